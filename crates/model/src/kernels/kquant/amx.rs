//! The Q4_K, Q5_K and Q6_K prefill with AMX: sixteen activation rows at a time, each
//! sub-block's (Q6_K: group of 16's) sixteen-by-sixteen integer sums from one
//! `tdpbssd`, times the lanes' scales into each super-block's exact integers, then the
//! float step of the parent module's definition ([`super::q4k_step`],
//! [`super::q6k_step`], lane by lane) with AVX-512.
//!
//! A group's super-blocks are first unpacked once into bytes `q` (0–15, or 0–31 with
//! Q5_K's fifth bit), sub-block by sub-block in the B tile's layout (value `4t + k` of
//! lane `l` at byte `64t + 4l + k`), so every sixteen-row tile reads them as they are.

use std::arch::asm;
use std::arch::x86_64::*;

use super::super::Sides;
use super::super::amx::{TILE_ROWS, TileConfig, tile_sums};
use super::avx512::bit_to_4;
use super::{ActRow, K_SUMS, KPacked, KType, LANES, QK_K, pair};

/// Bytes of one group's super-block unpacked: 256 values of 16 rows.
pub(super) const UNPACKED: usize = QK_K * LANES;
/// Bytes of one sub-block of 32 values unpacked.
const SUB: usize = 32 * LANES;

/// Group `g`'s super-blocks as bytes into `w` (`nb·4096` bytes): Q4_K's and Q5_K's
/// by sub-blocks of 32 values, Q6_K's by groups of 16 ([`unpack6`]).
///
/// # Safety
/// The CPU must support AVX-512 F and BW; `p` must be Q4_K, Q5_K or Q6_K and `w` hold
/// `p.nb·4096` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn unpack(p: &KPacked, g: usize, w: &mut [i8]) {
    if p.ty == KType::Q6K {
        // SAFETY: as this function requires.
        unsafe { unpack6(p, g, w) };
        return;
    }
    let low = _mm512_set1_epi8(0x0F);
    let sixteen = _mm512_set1_epi8(16);
    let five = p.ty == KType::Q5K;
    for b in 0..p.nb {
        let blk = p.block(g, b);
        let q = blk.quants.as_ptr();
        let dst = w[b * UNPACKED..(b + 1) * UNPACKED].as_mut_ptr();
        for i in 0..4 {
            // Q5_K: the fifth bits of chunk i's two nibble halves, for its eight steps.
            let top = [0, 1].map(|half| {
                if five {
                    // SAFETY: 64 of the block's 512 bytes of fifth bits.
                    unsafe { _mm512_loadu_si512(blk.high.as_ptr().add((i * 2 + half) * 64).cast()) }
                } else {
                    _mm512_setzero_si512()
                }
            });
            for t in 0..8 {
                // SAFETY: step (i, t)'s 64 bytes of the block's 2048, and 64 bytes of
                // each of sub-blocks 2i and 2i + 1 in `dst`.
                unsafe {
                    let x = _mm512_loadu_si512(q.add((i * 8 + t) * 64).cast());
                    let mut wl = _mm512_and_si512(x, low);
                    let mut wh = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                    if five {
                        // Or-ed onto the nibbles: A | (B & C).
                        let (tl, th) = (bit_to_4(top[0], t), bit_to_4(top[1], t));
                        wl = _mm512_ternarylogic_epi32::<0xF8>(wl, tl, sixteen);
                        wh = _mm512_ternarylogic_epi32::<0xF8>(wh, th, sixteen);
                    }
                    _mm512_storeu_si512(dst.add(2 * i * SUB + t * 64).cast(), wl);
                    _mm512_storeu_si512(dst.add((2 * i + 1) * SUB + t * 64).cast(), wh);
                }
            }
        }
    }
}

/// Q6_K's super-blocks as signed bytes `q − 32` into `w`, group of 16 values `gi` at
/// `256·gi` (four B-tile rows of 64 bytes).
///
/// # Safety
/// As [`unpack`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn unpack6(p: &KPacked, g: usize, w: &mut [i8]) {
    let low = _mm512_set1_epi8(0x0F);
    let bits45 = _mm512_set1_epi8(0x30);
    let offset = _mm512_set1_epi8(32);
    for b in 0..p.nb {
        let blk = p.block(g, b);
        let (q, hp) = (blk.quants.as_ptr(), blk.high.as_ptr());
        let dst = w[b * UNPACKED..(b + 1) * UNPACKED].as_mut_ptr();
        for step in 0..32 {
            let (g8, t) = (step / 4, step % 4);
            // SAFETY: the step's 64 of the block's 2048 nibble bytes and its pair's 64
            // of its 1024 top-bit bytes; row t of groups g8 and g8 + 8 in `dst`.
            unsafe {
                let x = _mm512_loadu_si512(q.add(step * 64).cast());
                let top = _mm512_loadu_si512(hp.add((step / 2) * 64).cast());
                // As the AVX-512 kernel: the step's top bits at bits 4-5, or-ed on.
                let (tl, th) = if step % 2 == 0 {
                    (_mm512_slli_epi16::<4>(top), _mm512_slli_epi16::<2>(top))
                } else {
                    (top, _mm512_srli_epi16::<2>(top))
                };
                let wl = _mm512_ternarylogic_epi32::<0xF8>(_mm512_and_si512(x, low), tl, bits45);
                let wh = _mm512_ternarylogic_epi32::<0xF8>(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(x), low),
                    th,
                    bits45,
                );
                let at = |gi: usize| dst.add(gi * 256 + t * 64).cast();
                _mm512_storeu_si512(at(g8), _mm512_sub_epi8(wl, offset));
                _mm512_storeu_si512(at(g8 + 8), _mm512_sub_epi8(wh, offset));
            }
        }
    }
}

/// Sixteen activation rows times K-quant group `g` unpacked in `w`: `out[r·16 +
/// lane]`. `SIX`: Q6_K, by groups of 16 values (16-byte activation rows, four B-tile
/// rows, signed scales, then [`super::q6k_step`]); else Q4_K/Q5_K, by sub-blocks of 32
/// (unsigned scales, the minimums, then [`super::q4k_step`]). `a` holds the rows' quants
/// one after another (`p.nb·256` bytes each). `ahead` (the next group's quants, or
/// nothing) is fetched into the L2 cache a super-block's share at a time.
///
/// # Safety
/// AMX must be [`available`](super::super::amx::available) and the CPU must support
/// AVX-512 F, BW, VL and VNNI, AVX2 and FMA; `p` must be Q6_K exactly when `SIX`; `w`
/// must hold the group unpacked ([`unpack`]), `a` `16·p.nb·256` bytes, `rows` 16 rows of
/// `p.nb` super-blocks (quants, scales and sums) and `out` 256 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn tile<const SIX: bool>(
    p: &KPacked,
    g: usize,
    (w, a): (&[i8], &[i8]),
    rows: &[ActRow],
    out: &mut [f32],
    ahead: &[u8],
) {
    #[repr(C, align(64))]
    struct Sums([[i32; TILE_ROWS * LANES]; 2]);
    // Parts (sub-blocks or groups) per super-block, values per part.
    let parts = if SIX { 16 } else { 8 };
    let width = QK_K / parts;
    // Tiles 0 and 3: the sums; 1 and 4: a part's activations (16 rows of `width`
    // bytes); 2 and 5: its weights (`width / 4` rows of four values of 16 lanes).
    let (aw, wr) = (width as u16, (width / 4) as u8);
    let config = TileConfig::new(&[(16, 64), (16, aw), (wr, 64), (16, 64), (16, aw), (wr, 64)]);
    let (nb, k) = (p.nb, p.nb * QK_K);
    let sides = Sides::<TILE_ROWS>::of(rows);
    let mut sums = Sums([[0; TILE_ROWS * LANES]; 2]);
    let c = sums.0.as_mut_ptr().cast::<i32>();
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    let per_block = ahead.len().div_ceil(64 * nb);
    // The parts in order, `s = parts·b + j`; part 0's product first.
    let total = nb * parts;
    // SAFETY: a valid configuration (AMX is available); part 0's operands.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &raw const config, options(nostack, readonly));
        tile_sums::<0>(a.as_ptr(), k, w.as_ptr(), c);
    }
    for b in 0..nb {
        for line in ahead.chunks(64).skip(b * per_block).take(per_block) {
            _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
        }
        let blk = p.block(g, b);
        let small = blk.small.as_ptr();
        let mut isum = [_mm512_setzero_si512(); TILE_ROWS];
        for j in 0..parts {
            let (s, next) = (parts * b + j, parts * b + j + 1);
            if next < total {
                // SAFETY: part `next`'s operands (activations at `width·next`, `16·width`
                // bytes of weights each), into the other sums buffer.
                unsafe {
                    let (a, w) = (
                        a.as_ptr().add(next * width),
                        w.as_ptr().add(next * width * LANES),
                    );
                    if s % 2 == 0 {
                        tile_sums::<1>(a, k, w, c.add(TILE_ROWS * LANES));
                    } else {
                        tile_sums::<0>(a, k, w, c);
                    }
                }
            }
            // SAFETY: scale j, 16 bytes within the 256.
            let sc = unsafe {
                let bytes = _mm_loadu_si128(small.add(j * LANES).cast());
                if SIX {
                    _mm512_cvtepi8_epi32(bytes)
                } else {
                    _mm512_cvtepu8_epi32(bytes)
                }
            };
            let sums = &sums.0[s % 2];
            for (r, isum) in isum.iter_mut().enumerate() {
                // SAFETY: 16 sums of row r.
                let v = unsafe { _mm512_load_si512(sums.as_ptr().add(r * LANES).cast()) };
                *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(v, sc));
            }
        }
        // SAFETY: 16 f32 values.
        let d = unsafe { _mm512_loadu_ps(blk.d.as_ptr()) };
        if SIX {
            for r in 0..TILE_ROWS {
                // q6k_step, lane by lane.
                // SAFETY: row r's scale of super-block b.
                let da = _mm512_set1_ps(unsafe { sides.d(r, b) });
                let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
                acc[r] = _mm512_add_ps(acc[r], i);
            }
            continue;
        }
        // SAFETY: 16 f32 values.
        let dmin = unsafe { _mm512_loadu_ps(blk.dmin.as_ptr()) };
        // SAFETY: the minimum pairs, 32 bytes at 128 + 32·pr within the 256.
        let mins: [__m512i; 4] = std::array::from_fn(|pr| unsafe {
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(small.add(128 + pr * 32).cast()))
        });
        for r in 0..TILE_ROWS {
            // SAFETY: row r's sums of super-block b.
            let s = |i: usize| i32::from(unsafe { *sides.sums(r, b * K_SUMS + i) });
            let mut msum = _mm512_setzero_si512();
            for (pr, &m) in mins.iter().enumerate() {
                let two = pair(s(4 * pr) + s(4 * pr + 1), s(4 * pr + 2) + s(4 * pr + 3));
                msum = _mm512_add_epi32(msum, _mm512_madd_epi16(m, _mm512_set1_epi32(two)));
            }
            // q4k_step, lane by lane.
            // SAFETY: row r's scale of super-block b.
            let da = _mm512_set1_ps(unsafe { sides.d(r, b) });
            let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
            let m = _mm512_mul_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(msum));
            acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(i, m));
        }
    }
    // SAFETY: the tiles are this thread's; releasing them ends their use.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    for (r, &v) in acc.iter().enumerate() {
        // SAFETY: `out` holds 256 values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * LANES), v) };
    }
}
