//! Q2_K and Q3_K with AVX-512 VNNI (the layout and the definition are the parent module's).

use std::arch::x86_64::*;

use super::super::super::gfni;
use super::super::super::{Sides, word_at};
use super::super::avx512::store;
use super::super::{PREFETCH, prefetch_ahead, prefetch_line};
use super::{ActRow, K_SUMS, KPacked, QK_K, high_bit};

/// Per field `j` of half `n`: `vpdpbusd` of the sixteen rows' 2-bit (Q3_K: 3-bit
/// unsigned) weights with four broadcast activation bytes, steps 0–3 and 4–7 (the
/// two sub-blocks) in two sums, which fit in 16 bits (16·7·127 < 2¹⁵): one
/// `vpdpwssd` with the pair of scales then adds both.
///
/// Q2_K takes field `j` where it lies in the quant byte (bits `e..e + 2`, `e = 2j`),
/// as its value times `2^e` (no shift per step), and divides the two sums after,
/// exactly, since each is a multiple of `2^e`: 8% to 20% faster from L2 here. Q3_K
/// shifts each field down (`e = 0`) before adding its high bit; taking it in place
/// there (with the last field moved to bits 4–6, so that `7·2^e` fits a byte) was no
/// faster. [`q3k_gfni`] takes Q3_K's three bits in two instructions instead of four.
///
/// `GFNI` (only with `THREE`, and only from [`q3k_gfni`], into which this function is
/// inlined, so that GFNI's intrinsics are too) takes the three bits as that function
/// says.
///
/// # Safety
/// As `kquant`'s `avx512::group`: AVX-512 F/BW/VL/VNNI, AVX2 and FMA (and GFNI where
/// `GFNI`); `R` rows holding `p.nb` super-blocks each; `gs` groups of `p`, none below
/// `first`, and `out` holding what `store` writes there (`16·R` values for one group).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(in super::super) unsafe fn q23k<
    const S: usize,
    const R: usize,
    const THREE: bool,
    const GFNI: bool,
>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    let ahead = prefetch_ahead(S, R, PREFETCH);
    let mut accs = [[_mm512_setzero_ps(); R]; S];
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a = unsafe { sides.qs(b * QK_K) };
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
            if R == 1 {
                blk.prefetch_side(ahead / blk.quants.len());
            }
            let (q, small, hp) = (blk.quants.as_ptr(), blk.small.as_ptr(), blk.high.as_ptr());
            let mut isum = [_mm512_setzero_si512(); R];
            // Q2_K: Σ min·Σ a; Q3_K: Σ scale·Σ a.
            let mut msum = [_mm512_setzero_si512(); R];
            for n in 0..2 {
                for j in 0..4 {
                    let e = if THREE { 0 } else { 2 * j as i32 };
                    let shift = _mm_cvtsi32_si128(2 * j as i32 - e);
                    let field = _mm512_set1_epi8((3u8 << e) as i8);
                    let four = _mm512_set1_epi8((4u8 << e) as i8);
                    let bit = _mm512_set1_epi8((1u8 << high_bit(n, j)) as i8);
                    // GFNI: the select's mask (field j's bits from the quant byte, the
                    // rest from the high-bit byte) and the affine map moving bits 2j,
                    // 2j + 1 and high_bit(n, j) to bits 0, 1, 2 (output bit i is the
                    // parity of the input's bits set in the matrix's byte 7 − i).
                    let select = _mm512_set1_epi8((3u8 << (2 * j)) as i8);
                    let matrix = _mm512_set1_epi64(
                        ((1i64 << (2 * j)) << 56)
                            | ((1i64 << (2 * j + 1)) << 48)
                            | ((1i64 << high_bit(n, j)) << 40),
                    );
                    let mut sums = [[_mm512_setzero_si512(); R]; 2];
                    for t in 0..8 {
                        // SAFETY: step (n, t) is 64 of the block's 1024 quant bytes (Q3_K:
                        // step t 64 of its 512 high-bit bytes); the activation words lie
                        // within the row's super-block.
                        unsafe {
                            if R == 1 && j == 0 {
                                // The first of the four shifts to read step (n, t).
                                prefetch_line(q.wrapping_add((n * 8 + t) * 64), ahead);
                            }
                            let w = _mm512_loadu_si512(q.add((n * 8 + t) * 64).cast());
                            let w = if GFNI {
                                let h = _mm512_loadu_si512(hp.add(t * 64).cast());
                                // select ? w : h, bit by bit.
                                let both = _mm512_ternarylogic_epi32::<0xE4>(w, h, select);
                                _mm512_gf2p8affine_epi64_epi8::<0>(both, matrix)
                            } else {
                                let w = if THREE { _mm512_srl_epi16(w, shift) } else { w };
                                let mut w = _mm512_and_si512(w, field);
                                if THREE {
                                    let h = _mm512_loadu_si512(hp.add(t * 64).cast());
                                    let set = _mm512_test_epi8_mask(h, bit);
                                    w = _mm512_mask_add_epi8(w, set, w, four);
                                }
                                w
                            };
                            for r in 0..R {
                                let x = word_at(a[r].add(128 * n + 32 * j + 4 * t));
                                let s = &mut sums[t / 4][r];
                                *s = _mm512_dpbusd_epi32(*s, w, _mm512_set1_epi32(x));
                            }
                        }
                    }
                    // SAFETY: pair 4n + j, 32 bytes of the block's 256.
                    let pairs = unsafe {
                        _mm256_loadu_si256(small.add((4 * n + j) * 32).cast::<__m256i>())
                    };
                    let (scales, mins) = if THREE {
                        (_mm512_cvtepi8_epi16(pairs), _mm512_setzero_si512())
                    } else {
                        let x = _mm512_cvtepu8_epi16(pairs);
                        (
                            _mm512_and_si512(x, _mm512_set1_epi16(0x0F)),
                            _mm512_srli_epi16::<4>(x),
                        )
                    };
                    for r in 0..R {
                        // Exact: each sum is a multiple of 2^e.
                        let low = _mm512_sra_epi32(sums[0][r], _mm_cvtsi32_si128(e));
                        let high = _mm512_sll_epi32(sums[1][r], _mm_cvtsi32_si128(16 - e));
                        let both = _mm512_mask_blend_epi16(0xAAAA_AAAA, low, high);
                        isum[r] = _mm512_dpwssd_epi32(isum[r], both, scales);
                        // Sums 2(4n + j) and the next, side by side: a `vpdpwssd` pair.
                        // SAFETY: within the row's sums of super-block b.
                        let two = _mm512_set1_epi32(unsafe {
                            word_at(sides.sums(r, b * K_SUMS + 8 * n + 2 * j).cast())
                        });
                        let by = if THREE { scales } else { mins };
                        msum[r] = _mm512_dpwssd_epi32(msum[r], by, two);
                    }
                }
            }
            // SAFETY: 16 f32 values each (Q3_K: no dmin, unused).
            let d = unsafe { _mm512_loadu_ps(blk.d.as_ptr()) };
            for r in 0..R {
                // SAFETY: the rows hold super-block b.
                let da = _mm512_set1_ps(unsafe { sides.d(r, b) });
                if THREE {
                    // q6k_step, lane by lane, on Σ scale·(Σ u·a − 4·Σ a).
                    let total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32::<2>(msum[r]));
                    let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(total));
                    acc[r] = _mm512_add_ps(acc[r], i);
                } else {
                    // q4k_step, lane by lane.
                    // SAFETY: 16 f32 values.
                    let dmin = unsafe { _mm512_loadu_ps(blk.dmin.as_ptr()) };
                    let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
                    let m = _mm512_mul_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(msum[r]));
                    acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(i, m));
                }
            }
        }
    }
    // SAFETY: as `store` requires.
    unsafe { store(&accs, (gs, first), out) };
}

/// [`q23k`] for Q3_K: [`q3k_gfni`] where `gfni()` found GFNI, else the shifts.
///
/// # Safety
/// As [`q23k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(in super::super) unsafe fn q3k<const S: usize, const R: usize>(
    p: &KPacked,
    at: ([usize; S], usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    // SAFETY: as this function requires; GFNI where `gfni()` found it.
    unsafe {
        if gfni() {
            q3k_gfni::<S, R>(p, at, rows, out);
        } else {
            q23k::<S, R, true, false>(p, at, rows, out);
        }
    }
}

/// [`q23k`] for Q3_K with GFNI: per step, one bitwise select (`vpternlogd`) takes
/// field `j`'s two bits from the quant byte and its high bit from the high-bit byte
/// (which the repacking moved to a place the field does not take, `high_bit`), and
/// one `vgf2p8affineqb` moves the three to bits 0–2: two instructions where [`q23k`]
/// shifts, masks, tests the high bit and adds 4 under the mask. The same integers, so
/// the same bits. A Q3_K weight in L2, one row, one thread (`kernel_speed q3k 1024
/// 2048 1`, this Intel VM, two alternating pairs): 25.0–26.5 GB/s without, 32.5–32.6
/// with.
///
/// # Safety
/// As [`q23k`], and the CPU must support GFNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,gfni")]
pub(in super::super) unsafe fn q3k_gfni<const S: usize, const R: usize>(
    p: &KPacked,
    at: ([usize; S], usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    // SAFETY: as this function requires, GFNI included.
    unsafe { q23k::<S, R, true, true>(p, at, rows, out) }
}
