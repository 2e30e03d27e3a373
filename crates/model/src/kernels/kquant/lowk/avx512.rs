//! Q2_K and Q3_K with AVX-512 VNNI (the layout and the definition are the parent module's).

use std::arch::x86_64::*;

use super::super::super::word_at;
use super::super::avx512::store;
use super::super::{PREFETCH, STREAM_PREFETCH, pair};
use super::{ActRow, K_SUMS, KPacked, QK_K};

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
/// faster.
///
/// # Safety
/// As `kquant`'s `avx512::group`: AVX-512 F/BW/VL/VNNI, AVX2 and FMA; `R` rows
/// holding `p.nb` super-blocks each; `gs` groups of `p`, none below `first`, and `out`
/// holding what `store` writes there (`16·R` values for one group).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(in super::super) unsafe fn q23k<const S: usize, const R: usize, const THREE: bool>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    let ahead = if S > 1 { STREAM_PREFETCH } else { PREFETCH };
    let mut accs = [[_mm512_setzero_ps(); R]; S];
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a: [*const i8; R] =
            std::array::from_fn(|r| unsafe { rows[r].qs.as_ptr().add(b * QK_K) });
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
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
                    let bit = _mm512_set1_epi8((1u8 << (4 * n + j)) as i8);
                    let mut sums = [[_mm512_setzero_si512(); R]; 2];
                    for t in 0..8 {
                        // SAFETY: step (n, t) is 64 of the block's 1024 quant bytes (Q3_K:
                        // step t 64 of its 512 high-bit bytes); the activation words lie
                        // within the row's super-block.
                        unsafe {
                            if R == 1 && j == 0 {
                                // The first of the four shifts to read step (n, t).
                                _mm_prefetch::<_MM_HINT_T0>(
                                    q.wrapping_add((n * 8 + t) * 64 + ahead).cast(),
                                );
                            }
                            let w = _mm512_loadu_si512(q.add((n * 8 + t) * 64).cast());
                            let w = if THREE { _mm512_srl_epi16(w, shift) } else { w };
                            let mut w = _mm512_and_si512(w, field);
                            if THREE {
                                let h = _mm512_loadu_si512(hp.add(t * 64).cast());
                                let set = _mm512_test_epi8_mask(h, bit);
                                w = _mm512_mask_add_epi8(w, set, w, four);
                            }
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
                        let s = &rows[r].sums[b * K_SUMS + 8 * n + 2 * j..];
                        let two = _mm512_set1_epi32(pair(i32::from(s[0]), i32::from(s[1])));
                        let by = if THREE { scales } else { mins };
                        msum[r] = _mm512_dpwssd_epi32(msum[r], by, two);
                    }
                }
            }
            // SAFETY: 16 f32 values each (Q3_K: no dmin, unused).
            let d = unsafe { _mm512_loadu_ps(blk.d.as_ptr()) };
            for r in 0..R {
                let da = _mm512_set1_ps(rows[r].d[b]);
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
