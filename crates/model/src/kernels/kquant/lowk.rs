//! Q2_K and Q3_K in [`KPacked`]'s groups of sixteen rows: the design of the other
//! K-quants (one 32-bit lane per row, four broadcast activation bytes, exact integer
//! sums per super-block, then one float step shared by every kernel), for 2-bit quants.
//!
//! A file's quant byte `l` of half `n` holds four values 32 apart (bits `2j..2j + 2`:
//! value `128n + 32j + l`), so four consecutive bytes, shifted by `2j` and masked, are
//! the weights of four consecutive values: the repacked quants are the file's bytes,
//! four per lane and step, and each is read four times (once per shift).
//!
//! Layout per group and super-block (`gs = group·nb + b`):
//! - Both: `quants[gs·1024..]` as `[half n: 2][step t: 8][lane: 16][4 bytes]`, the
//!   file's quant bytes `32n + 4t .. 32n + 4t + 4`: bits `2j..2j + 2` of byte `k` are
//!   value `128n + 32j + 4t + k`, of sub-block `8n + 2j + t/4` (16 values each).
//!   `small[gs·256..]` as `[pair p: 8][lane][2]`: sub-blocks `2p` and `2p + 1` (the two
//!   of shift `j = p mod 4` in half `p / 4`) side by side, one 16-bit pair per lane.
//! - Q2_K (88 bytes per row and super-block, the file's 84 with f32 `d` and `dmin`):
//!   `small` holds the file's scale bytes (scale in the low nibble, minimum in the
//!   high one); `d`, `dmin`: `[gs·16 + lane]`. `x = d·scale·q − dmin·min`.
//! - Q3_K (116 bytes, the file's 110 with the 6-bit scales unpacked and f32 `d`):
//!   `high[gs·512..]` as `[step t: 8][lane][4 bytes]`, the file's high-bit bytes `4t ..
//!   4t + 4`: bit `4n + j` of byte `k` is value `128n + 32j + 4t + k`'s. `small` holds
//!   the scales minus 32 as signed bytes; `d`: `[gs·16 + lane]`. The kernels read the
//!   unsigned 3 bits `u = q + 4·h` and take ggml's weight `u − 4` (`q − 4` where the
//!   high bit is clear) through the activations' sums of 16.

use half::f16;

use super::super::{ActRow, K_SUMS, QK_K, q4k_step, q6k_step};
use super::{Block, KPacked, KType, LANES};

/// Bytes of quants per group and super-block.
pub(super) const QUANTS: usize = 64 * LANES;

/// Q3_K's 12 bytes of 6-bit scales unpacked, minus 32: scales 0–7 take 4 low bits from
/// a nibble of bytes 0–7 (low nibbles first), scales 8–15 the high nibbles, and each
/// its 2 high bits from bytes 8–11 (bits `2·(s / 4)` of byte `8 + s mod 4`).
fn unpack_q3k_scales(p: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for s in 0..16 {
        let low = p[s % 8] >> (4 * (s / 8)) & 0x0F;
        let high = (p[8 + s % 4] >> (2 * (s / 4))) & 3;
        out[s] = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Sub-block `s`'s place in `small`: pair `s / 2`, lane, then `s mod 2`.
#[inline(always)]
fn small_at(s: usize, lane: usize) -> usize {
    ((s / 2) * LANES + lane) * 2 + s % 2
}

impl KPacked {
    /// One Q2_K or Q3_K super-block of the file into a group's buffers at `lane`;
    /// returns `d` and (Q2_K) `dmin`.
    pub(super) fn pack_low(
        ty: KType,
        block: &[u8],
        lane: usize,
        (quants, small, high): (&mut [u8], &mut [u8], &mut [u8]),
    ) -> (f32, f32) {
        let half_at = |i: usize| f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
        // Q2_K: 16 scale bytes, 64 quant bytes, d, dmin. Q3_K: 32 high-bit bytes, 64
        // quant bytes, 12 scale bytes, d.
        let qs = if ty == KType::Q2K {
            &block[16..80]
        } else {
            &block[32..96]
        };
        for n in 0..2 {
            for t in 0..8 {
                let at = ((n * 8 + t) * LANES + lane) * 4;
                quants[at..at + 4].copy_from_slice(&qs[32 * n + 4 * t..32 * n + 4 * t + 4]);
            }
        }
        if ty == KType::Q2K {
            for (s, &byte) in block[..16].iter().enumerate() {
                small[small_at(s, lane)] = byte;
            }
            return (half_at(80), half_at(82));
        }
        for (s, scale) in unpack_q3k_scales(&block[96..108]).into_iter().enumerate() {
            small[small_at(s, lane)] = scale as u8;
        }
        for t in 0..8 {
            let at = (t * LANES + lane) * 4;
            high[at..at + 4].copy_from_slice(&block[4 * t..4 * t + 4]);
        }
        (half_at(108), 0.0)
    }

    /// Value `128n + 32j + 4t + k` of lane `lane`: Q2_K's 2 bits, or Q3_K's unsigned 3
    /// (the weight is this minus 4).
    #[inline(always)]
    fn low_value(blk: &Block<'_>, lane: usize, (n, j, t, k): (usize, usize, usize, usize)) -> u8 {
        let q = (blk.quants[((n * 8 + t) * LANES + lane) * 4 + k] >> (2 * j)) & 3;
        if blk.high.is_empty() {
            return q;
        }
        let h = (blk.high[(t * LANES + lane) * 4 + k] >> (4 * n + j)) & 1;
        q | (h << 2)
    }

    /// Row `o`'s super-block `b` as f32, appended: ggml's `dequantize_row_q2_K` /
    /// `dequantize_row_q3_K` arithmetic.
    pub(super) fn dequantize_low(&self, o: usize, b: usize, out: &mut Vec<f32>) {
        let (g, lane) = (o / LANES, o % LANES);
        let blk = self.block(g, b);
        let d = blk.d[lane];
        let mut values = [0f32; QK_K];
        for n in 0..2 {
            for j in 0..4 {
                for t in 0..8 {
                    let s = 8 * n + 2 * j + t / 4;
                    let byte = blk.small[small_at(s, lane)];
                    for k in 0..4 {
                        let q = Self::low_value(&blk, lane, (n, j, t, k));
                        values[128 * n + 32 * j + 4 * t + k] = match self.ty {
                            KType::Q2K => {
                                let (dl, ml) = (
                                    d * f32::from(byte & 0x0F),
                                    blk.dmin[lane] * f32::from(byte >> 4),
                                );
                                dl * f32::from(q) - ml
                            }
                            _ => d * f32::from(byte as i8) * f32::from(q as i8 - 4),
                        };
                    }
                }
            }
        }
        out.extend_from_slice(&values);
    }

    /// Row `16g + lane` times `row`, the reference every kernel equals bit for bit:
    /// per super-block the exact integer sums, then [`q4k_step`] (Q2_K: `Σ scale·Σ q·a`
    /// and `Σ min·Σ a`) or [`q6k_step`] (Q3_K: `Σ scale·(Σ u·a − 4·Σ a)`).
    pub(super) fn dot_low(&self, g: usize, lane: usize, row: &ActRow) -> f32 {
        let mut acc = 0f32;
        for b in 0..self.nb {
            let blk = self.block(g, b);
            let a = &row.qs[b * QK_K..(b + 1) * QK_K];
            let sums = &row.sums[b * K_SUMS..(b + 1) * K_SUMS];
            let (mut isum, mut msum) = (0i32, 0i32);
            for (s, &sum) in sums.iter().enumerate() {
                let (n, j, half) = (s / 8, s % 8 / 2, s % 2);
                let mut dot = 0i32;
                for t in 4 * half..4 * half + 4 {
                    for k in 0..4 {
                        let q = Self::low_value(&blk, lane, (n, j, t, k));
                        dot += i32::from(q) * i32::from(a[128 * n + 32 * j + 4 * t + k]);
                    }
                }
                let byte = blk.small[small_at(s, lane)];
                if self.ty == KType::Q2K {
                    isum += i32::from(byte & 0x0F) * dot;
                    msum += i32::from(byte >> 4) * i32::from(sum);
                } else {
                    isum += i32::from(byte as i8) * (dot - 4 * i32::from(sum));
                }
            }
            acc = if self.ty == KType::Q2K {
                q4k_step(acc, blk.d[lane], blk.dmin[lane], row.d[b], isum, msum)
            } else {
                q6k_step(acc, blk.d[lane], row.d[b], isum)
            };
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    use super::super::super::word_at;
    use super::super::{PREFETCH, pair};
    use super::{ActRow, K_SUMS, KPacked, QK_K};

    /// Per shift `j` of half `n`: `vpdpbusd` of the sixteen rows' 2-bit (Q3_K: 3-bit
    /// unsigned) weights with four broadcast activation bytes, steps 0–3 and 4–7 (the
    /// two sub-blocks) in two sums, which fit in 16 bits (16·7·127 < 2¹⁵): one
    /// `vpdpwssd` with the pair of scales then adds both.
    ///
    /// # Safety
    /// As `kquant`'s `avx512::group`: AVX-512 F/BW/VL/VNNI, AVX2 and FMA; `R` rows
    /// holding `p.nb` super-blocks each, `out` `16·R` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(in super::super) unsafe fn q23k<const R: usize, const THREE: bool>(
        p: &KPacked,
        g: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let two_bits = _mm512_set1_epi8(3);
        let four = _mm512_set1_epi8(4);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let (q, small, hp) = (blk.quants.as_ptr(), blk.small.as_ptr(), blk.high.as_ptr());
            // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
            let a: [*const i8; R] =
                std::array::from_fn(|r| unsafe { rows[r].qs.as_ptr().add(b * QK_K) });
            let mut isum = [_mm512_setzero_si512(); R];
            // Q2_K: Σ min·Σ a; Q3_K: Σ scale·Σ a.
            let mut msum = [_mm512_setzero_si512(); R];
            for n in 0..2 {
                for j in 0..4 {
                    let shift = _mm_cvtsi32_si128(2 * j as i32);
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
                                    q.wrapping_add((n * 8 + t) * 64 + PREFETCH).cast(),
                                );
                            }
                            let w = _mm512_loadu_si512(q.add((n * 8 + t) * 64).cast());
                            let mut w = _mm512_and_si512(_mm512_srl_epi16(w, shift), two_bits);
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
                        let both = _mm512_mask_blend_epi16(
                            0xAAAA_AAAA,
                            sums[0][r],
                            _mm512_slli_epi32::<16>(sums[1][r]),
                        );
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
        for (r, &v) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16·R values.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * 16), v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::super::word_at;
    use super::super::avx2::doubled;
    use super::super::{PREFETCH, pair};
    use super::{ActRow, K_SUMS, KPacked, QK_K};

    /// Scale pair `pr` of lanes `8h..8h + 8` as 16-bit pairs (one per lane), and Q2_K's
    /// minimums likewise.
    ///
    /// # Safety
    /// AVX2; `small` points to a block's 256 bytes of scales, `pr < 8`, `h < 2`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn pair_scales<const THREE: bool>(
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
    /// Lanes `8h..8h + 8` of group `g`.
    ///
    /// # Safety
    /// As `kquant`'s `avx2::group`: AVX2 and FMA; `R` rows holding `p.nb` super-blocks
    /// each, `out` `16·R` values.
    #[target_feature(enable = "avx2,fma")]
    pub(in super::super) unsafe fn q23k<const R: usize, const THREE: bool>(
        p: &KPacked,
        g: usize,
        h: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let two_bits = _mm256_set1_epi8(3);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let (q, small, hp) = (blk.quants.as_ptr(), blk.small.as_ptr(), blk.high.as_ptr());
            // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
            let a: [*const i8; R] =
                std::array::from_fn(|r| unsafe { rows[r].qs.as_ptr().add(b * QK_K) });
            let mut isum = [_mm256_setzero_si256(); R];
            for n in 0..2 {
                for j in 0..4 {
                    let shift = _mm_cvtsi32_si128(2 * j as i32);
                    // Bit 4n + j of each high-bit byte moved to bit 2 (shifts of 16-bit
                    // words: the mask keeps each byte's own bit).
                    let hb = 4 * n + j;
                    // SAFETY: the block's scales; pair 4n + j < 8.
                    let (scales, _) = unsafe { pair_scales::<THREE>(small, 4 * n + j, h) };
                    let s_of = [doubled(scales), doubled(_mm256_srli_epi32::<16>(scales))];
                    for (half, scale) in s_of.iter().enumerate() {
                        let mut sum16 = [_mm256_setzero_si256(); R];
                        for t in 4 * half..4 * half + 4 {
                            // SAFETY: step (n, t) is 64 of the block's 1024 quant bytes,
                            // half h 32 of them (Q3_K: step t's 64 high-bit bytes); the
                            // activation words lie within the row's super-block.
                            unsafe {
                                if R == 1 && j == 0 {
                                    // The first of the four shifts to read step (n, t).
                                    _mm_prefetch::<_MM_HINT_T0>(
                                        q.wrapping_add((n * 8 + t) * 64 + PREFETCH).cast(),
                                    );
                                }
                                let w = _mm256_loadu_si256(q.add((n * 8 + t) * 64 + 32 * h).cast());
                                let mut w = _mm256_and_si256(_mm256_srl_epi16(w, shift), two_bits);
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
                                    sum16[r] = _mm256_add_epi16(
                                        sum16[r],
                                        _mm256_maddubs_epi16(w, _mm256_set1_epi32(word)),
                                    );
                                }
                            }
                        }
                        for r in 0..R {
                            isum[r] =
                                _mm256_add_epi32(isum[r], _mm256_madd_epi16(sum16[r], *scale));
                        }
                    }
                }
            }
            // Q2_K: Σ min·Σ a; Q3_K: Σ scale·Σ a (after the products: fewer live registers).
            let mut msum = [_mm256_setzero_si256(); R];
            for pr in 0..8 {
                // SAFETY: the block's scales; pr < 8.
                let (scales, mins) = unsafe { pair_scales::<THREE>(small, pr, h) };
                let by = if THREE { scales } else { mins };
                for r in 0..R {
                    let s = &rows[r].sums[b * K_SUMS + 2 * pr..];
                    let two = _mm256_set1_epi32(pair(i32::from(s[0]), i32::from(s[1])));
                    msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(by, two));
                }
            }
            // SAFETY: 8 f32 values from lane 8h.
            let d = unsafe { _mm256_loadu_ps(blk.d.as_ptr().add(8 * h)) };
            for r in 0..R {
                let da = _mm256_set1_ps(rows[r].d[b]);
                if THREE {
                    // q6k_step, lane by lane, on Σ scale·(Σ u·a − 4·Σ a).
                    let total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<2>(msum[r]));
                    let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(total));
                    acc[r] = _mm256_add_ps(acc[r], i);
                } else {
                    // q4k_step, lane by lane.
                    // SAFETY: 8 f32 values from lane 8h.
                    let dmin = unsafe { _mm256_loadu_ps(blk.dmin.as_ptr().add(8 * h)) };
                    let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[r]));
                    let m = _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[r]));
                    acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(i, m));
                }
            }
        }
        for (r, &v) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16·R values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * 16 + 8 * h), v) };
        }
    }
}
