//! Q2_K and Q3_K with AVX2 (the layout and the definition are the parent module's).

use std::arch::x86_64::*;

use super::super::super::{Sides, word_at};
use super::super::avx2::{doubled, store};
use super::super::{PREFETCH, prefetch_ahead, prefetch_line};
use super::{ActRow, K_SUMS, KPacked, QK_K, high_bit};

/// Scale pair `pr` of lanes `8h..8h + 8` as 16-bit pairs (one per lane), and Q2_K's
/// minimums likewise.
///
/// # Safety
/// AVX2; `small` points to a block's 256 bytes of scales, `pr < 8`, `h < 2`.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(in super::super) unsafe fn pair_scales<const THREE: bool>(
    small: *const u8,
    pr: usize,
    h: usize,
) -> (__m256i, __m256i) {
    // SAFETY: pair pr of lanes 8h..8h + 8 is 16 of the block's 256 bytes of `small`.
    let bytes = unsafe { _mm_loadu_si128(small.add(pr * 32 + 16 * h).cast()) };
    if THREE {
        return (_mm256_cvtepi8_epi16(bytes), _mm256_setzero_si256());
    }
    let x = _mm256_cvtepu8_epi16(bytes);
    (
        _mm256_and_si256(x, _mm256_set1_epi16(0x0F)),
        _mm256_srli_epi16::<4>(x),
    )
}

/// `vpmaddubsw` pair sums of the 2-bit (Q3_K: 3-bit unsigned) weights and broadcast
/// activation bytes, added in 16 bits over a sub-block's 4 steps (no overflow:
/// 4·2·7·127 < 2¹⁵), then `vpmaddwd` with the lane's scale in both halves.
///
/// Lanes `8h..8h + 8·H` of group `g` (`H` halves of eight lanes from half `h`): one
/// row (decode) takes both halves in one pass, so each step's 64 bytes are read at
/// once; more rows take one half each (16 registers are too few for both).
///
/// The `S` groups `gs` go block by block (one row when `S > 1`: `streams`); row `r`
/// of group `g` goes to `out[(g − first + r)·16..]`.
///
/// # Safety
/// As `kquant`'s `avx2::group`: AVX2 and FMA; `R` rows holding `p.nb` super-blocks
/// each, `out` `16·R` values; `h + H ≤ 2`.
#[target_feature(enable = "avx2,fma")]
#[expect(
    clippy::needless_range_loop,
    reason = "a half's index places its bytes and picks its accumulators alike"
)]
pub(in super::super) unsafe fn q23k<
    const S: usize,
    const R: usize,
    const THREE: bool,
    const H: usize,
>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    h0: usize,
    rows: &[ActRow],
    out: &mut [f32],
) {
    debug_assert!(S == 1 || R == 1);
    let two_bits = _mm256_set1_epi8(3);
    let mut accs = [[[_mm256_setzero_ps(); H]; R]; S];
    let ahead = prefetch_ahead(S, R, PREFETCH);
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a = unsafe { sides.qs(b * QK_K) };
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
            let (q, small, hp) = (blk.quants.as_ptr(), blk.small.as_ptr(), blk.high.as_ptr());
            let mut isum = [[_mm256_setzero_si256(); H]; R];
            for n in 0..2 {
                for j in 0..4 {
                    let shift = _mm_cvtsi32_si128(2 * j as i32);
                    // Field j's high bit of each high-bit byte moved to bit 2 (shifts
                    // of 16-bit words: the mask keeps each byte's own bit).
                    let hb = high_bit(n, j);
                    let s_of: [[__m256i; 2]; H] = std::array::from_fn(|hh| {
                        // SAFETY: the block's scales; pair 4n + j < 8, half h0 + hh < 2.
                        let (scales, _) =
                            unsafe { pair_scales::<THREE>(small, 4 * n + j, h0 + hh) };
                        [doubled(scales), doubled(_mm256_srli_epi32::<16>(scales))]
                    });
                    for half in 0..2 {
                        let mut sum16 = [[_mm256_setzero_si256(); H]; R];
                        for t in 4 * half..4 * half + 4 {
                            for hh in 0..H {
                                let h = h0 + hh;
                                // SAFETY: step (n, t) is 64 of the block's 1024 quant bytes,
                                // half h 32 of them (Q3_K: step t's 64 high-bit bytes); the
                                // activation words lie within the row's super-block.
                                unsafe {
                                    if R == 1 && j == 0 && hh == 0 {
                                        // The first of the four shifts to read step (n, t).
                                        prefetch_line(q.wrapping_add((n * 8 + t) * 64), ahead);
                                    }
                                    let w =
                                        _mm256_loadu_si256(q.add((n * 8 + t) * 64 + 32 * h).cast());
                                    let mut w =
                                        _mm256_and_si256(_mm256_srl_epi16(w, shift), two_bits);
                                    if THREE {
                                        let hw = _mm256_loadu_si256(hp.add(t * 64 + 32 * h).cast());
                                        let moved = if hb >= 2 {
                                            _mm256_srl_epi16(hw, _mm_cvtsi32_si128(hb as i32 - 2))
                                        } else {
                                            _mm256_sll_epi16(hw, _mm_cvtsi32_si128(2 - hb as i32))
                                        };
                                        w = _mm256_or_si256(
                                            w,
                                            _mm256_and_si256(moved, _mm256_set1_epi8(4)),
                                        );
                                    }
                                    for r in 0..R {
                                        let word = word_at(a[r].add(128 * n + 32 * j + 4 * t));
                                        sum16[r][hh] = _mm256_add_epi16(
                                            sum16[r][hh],
                                            _mm256_maddubs_epi16(w, _mm256_set1_epi32(word)),
                                        );
                                    }
                                }
                            }
                        }
                        for r in 0..R {
                            for hh in 0..H {
                                isum[r][hh] = _mm256_add_epi32(
                                    isum[r][hh],
                                    _mm256_madd_epi16(sum16[r][hh], s_of[hh][half]),
                                );
                            }
                        }
                    }
                }
            }
            for hh in 0..H {
                let h = h0 + hh;
                // Q2_K: Σ min·Σ a; Q3_K: Σ scale·Σ a (after the products: fewer live
                // registers).
                let mut msum = [_mm256_setzero_si256(); R];
                for pr in 0..8 {
                    // SAFETY: the block's scales; pr < 8.
                    let (scales, mins) = unsafe { pair_scales::<THREE>(small, pr, h) };
                    let by = if THREE { scales } else { mins };
                    for r in 0..R {
                        // Sums 2pr and 2pr + 1, side by side: a `vpmaddwd` pair.
                        // SAFETY: within the row's sums of super-block b.
                        let two = _mm256_set1_epi32(unsafe {
                            word_at(sides.sums(r, b * K_SUMS + 2 * pr).cast())
                        });
                        msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(by, two));
                    }
                }
                // SAFETY: 8 f32 values from lane 8h.
                let d = unsafe { _mm256_loadu_ps(blk.d.as_ptr().add(8 * h)) };
                for r in 0..R {
                    // SAFETY: the rows hold super-block b.
                    let da = _mm256_set1_ps(unsafe { sides.d(r, b) });
                    if THREE {
                        // q6k_step, lane by lane, on Σ scale·(Σ u·a − 4·Σ a).
                        let total = _mm256_sub_epi32(isum[r][hh], _mm256_slli_epi32::<2>(msum[r]));
                        let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(total));
                        acc[r][hh] = _mm256_add_ps(acc[r][hh], i);
                    } else {
                        // q4k_step, lane by lane.
                        // SAFETY: 8 f32 values from lane 8h.
                        let dmin = unsafe { _mm256_loadu_ps(blk.dmin.as_ptr().add(8 * h)) };
                        let i =
                            _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[r][hh]));
                        let m = _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[r]));
                        acc[r][hh] = _mm256_add_ps(acc[r][hh], _mm256_sub_ps(i, m));
                    }
                }
            }
        }
    }
    // SAFETY: `out` holds 16·R values per group from `first`.
    unsafe { store(&accs, (gs, first), h0, out) };
}
