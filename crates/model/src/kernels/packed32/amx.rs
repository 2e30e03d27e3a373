//! The blocks-of-32 prefill with AMX: sixteen activation rows at a time, each block's
//! sixteen-by-sixteen integer sums from one `tdpbssd`, then the float steps of the
//! parent module's definition with AVX-512, row by row.
//!
//! A group's blocks are first unpacked once into signed bytes `q − offset` (the B
//! tile's layout is the packed one: value `4t + k` of lane `l` at byte `64t + 4l + k`),
//! so the products of every sixteen-row tile of the prefill read them as they are.

use std::arch::asm;
use std::arch::x86_64::*;

use super::super::Sides;
use super::super::amx::{TILE_ROWS, TileConfig, tile_sums};
use super::super::kquant::avx512::bit_to_4;
use super::avx512::{block_scales, sub_scales};
use super::{ActRow, CODEBOOK, Form, LANES, Packed32, QK};

/// Bytes of one group's block unpacked: 32 values of 16 rows.
pub(super) const UNPACKED: usize = QK * LANES;

/// Group `g`'s blocks as signed bytes `q − offset` into `w` (`nb·512` bytes).
///
/// # Safety
/// The CPU must support AVX-512 F and BW; `w` must hold `p.nb·512` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn unpack(p: &Packed32, g: usize, w: &mut [i8]) {
    let low = _mm512_set1_epi8(0x0F);
    // SAFETY: 16 readable bytes.
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(CODEBOOK.as_ptr().cast()) });
    let (offset, five) = match p.form {
        Form::Nibbles { offset, five } => (offset, five),
        Form::Codebook | Form::Bytes => (0, false),
    };
    let offset = _mm512_set1_epi8(offset as i8);
    let sixteen = _mm512_set1_epi8(16);
    let group = p.view().group(g);
    for b in 0..p.nb {
        // SAFETY: b < nb.
        let blk = unsafe { group.block(b) };
        let q = blk.quants.as_ptr();
        let dst = w[b * UNPACKED..(b + 1) * UNPACKED].as_mut_ptr();
        // SAFETY: the block's 256 (nibbles, codebook) or 512 (bytes) bytes of quants,
        // its 64 bytes of fifth bits, and 512 bytes of `dst`.
        unsafe {
            if p.form == Form::Bytes {
                // Held as q + 128.
                let flip = _mm512_set1_epi8(-128);
                for t in 0..8 {
                    let x = _mm512_loadu_si512(q.add(t * 64).cast());
                    _mm512_storeu_si512(dst.add(t * 64).cast(), _mm512_xor_si512(x, flip));
                }
                continue;
            }
            // The block's fifth bits, step t's in bits t and t + 4 of each byte.
            let top = if five {
                _mm512_loadu_si512(blk.high.as_ptr().cast())
            } else {
                _mm512_setzero_si512()
            };
            for t in 0..4 {
                let x = _mm512_loadu_si512(q.add(t * 64).cast());
                let mut wl = _mm512_and_si512(x, low);
                let mut wh = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                if p.form == Form::Codebook {
                    wl = _mm512_shuffle_epi8(table, wl);
                    wh = _mm512_shuffle_epi8(table, wh);
                } else {
                    if five {
                        // Or-ed onto the nibbles: A | (B & C).
                        wl = _mm512_ternarylogic_epi32::<0xF8>(wl, bit_to_4(top, t), sixteen);
                        wh = _mm512_ternarylogic_epi32::<0xF8>(wh, bit_to_4(top, t + 4), sixteen);
                    }
                    wl = _mm512_sub_epi8(wl, offset);
                    wh = _mm512_sub_epi8(wh, offset);
                }
                _mm512_storeu_si512(dst.add(t * 64).cast(), wl);
                _mm512_storeu_si512(dst.add((4 + t) * 64).cast(), wh);
            }
        }
    }
}

/// Sixteen activation rows times group `g` unpacked in `w`: `out[r·16 + lane]`. `a`
/// holds the rows' quants one after another (`p.nb·32` bytes each).
///
/// # Safety
/// AMX must be [`available`](super::super::amx::available) and the CPU must support
/// AVX-512 F, BW, VL and VNNI, AVX2 and FMA; `w` must hold the group unpacked
/// ([`unpack`]), `a` `16·p.nb·32` bytes, `rows` 16 rows of `p.nb` blocks and `out`
/// 256 values. `ahead` (the next group's quants, or nothing) is fetched into the L2
/// cache a block's share at a time, so that its unpacking does not wait on memory.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn tile(
    p: &Packed32,
    g: usize,
    (w, a): (&[i8], &[i8]),
    rows: &[ActRow],
    out: &mut [f32],
    ahead: &[u8],
) {
    #[repr(C, align(64))]
    struct Sums([[i32; TILE_ROWS * LANES]; 2]);
    // Tiles 0 and 3: the sums (16 rows of 16 i32); 1 and 4: the activations (16 rows
    // of a block's 32 bytes); 2 and 5: the weights (8 rows of four values of 16 lanes).
    let config = TileConfig::new(&[(16, 64), (16, 32), (8, 64), (16, 64), (16, 32), (8, 64)]);
    let (nb, k) = (p.nb, p.nb * QK);
    let has_min = p.has_min();
    let sides = Sides::<TILE_ROWS>::of(rows);
    let mut sums = Sums([[0; TILE_ROWS * LANES]; 2]);
    let c = sums.0.as_mut_ptr().cast::<i32>();
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    let mut sub_sums = [_mm512_setzero_si512(); TILE_ROWS];
    let per_block = ahead.len().div_ceil(64 * nb);
    let group = p.view().group(g);
    // SAFETY: a valid configuration (AMX is available); block 0's operands.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &raw const config, options(nostack, readonly));
        tile_sums::<0>(a.as_ptr(), k, w.as_ptr(), c);
    }
    for b in 0..nb {
        let (even, next) = (b % 2 == 0, b + 1);
        if next < nb {
            // SAFETY: block b + 1's operands, into the other sums buffer.
            unsafe {
                let (a, w) = (a.as_ptr().add(next * QK), w.as_ptr().add(next * UNPACKED));
                if even {
                    tile_sums::<1>(a, k, w, c.add(TILE_ROWS * LANES));
                } else {
                    tile_sums::<0>(a, k, w, c);
                }
            }
        }
        for line in ahead.chunks(64).skip(b * per_block).take(per_block) {
            _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
        }
        // SAFETY: b < nb.
        let blk = unsafe { group.block(b) };
        let sums = &sums.0[b % 2];
        if blk.sub {
            // IQ4_XS (the parent module's definition, as `avx512::rows_n`): each row's
            // Σ (ls − 32)·Σ q_w·q_a over the super-block, one float step at its end.
            // SAFETY: the block's scale bytes and its super-block's scales; 16 sums of
            // each row; block b of the rows' scales.
            unsafe {
                let ls = sub_scales(&blk);
                for (r, sub_sum) in sub_sums.iter_mut().enumerate() {
                    let total = _mm512_load_si512(sums.as_ptr().add(r * LANES).cast());
                    *sub_sum = _mm512_add_epi32(*sub_sum, _mm512_mullo_epi32(total, ls));
                }
                if b % 8 == 7 {
                    let (d, _) = block_scales(&blk, false);
                    for (r, (acc, sub_sum)) in acc.iter_mut().zip(&mut sub_sums).enumerate() {
                        let dd = _mm512_mul_ps(d, _mm512_set1_ps(sides.d(r, b)));
                        *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(*sub_sum), *acc);
                        *sub_sum = _mm512_setzero_si512();
                    }
                }
            }
            continue;
        }
        // SAFETY: the block's scales (and minimums).
        let (d, m) = unsafe { block_scales(&blk, has_min) };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: 16 sums of row r; block b of the row's scales (and sums).
            unsafe {
                let total = _mm512_load_si512(sums.as_ptr().add(r * LANES).cast());
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(sides.d(r, b)));
                *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(total), *acc);
                if has_min {
                    *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(sides.s(r, b)), *acc);
                }
            }
        }
    }
    // SAFETY: the tiles are this thread's; releasing them ends their use.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    for (r, &v) in acc.iter().enumerate() {
        // SAFETY: `out` holds 256 values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * LANES), v) };
    }
}
