//! The two loops of activation quantization, with SIMD: a block's largest magnitude,
//! and its values times `127/amax` rounded half to even into bytes with their sum.
//! Every path gives the scalar one's bits: `max` and the rounding are exact, and the
//! products are single IEEE multiplications either way. (For NaN activations the
//! maximum may differ by path; the output is meaningless then anyway.)

use super::{Simd, round_ties_even, simd};

/// The largest `|v|` of `x` (0 for an empty slice).
pub(super) fn amax(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(16) && simd() >= Simd::Avx2 {
        #[expect(unsafe_code, reason = "the CPU was checked for AVX2")]
        // SAFETY: simd() found AVX2; the length is a multiple of 16.
        return unsafe { x86::amax(x) };
    }
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// `out[i] = round_ties_even(x[i]·inv)` as a byte (the caller's `inv` keeps every
/// product within ±127.5), and the sum of `out`.
pub(super) fn quantize(x: &[f32], inv: f32, out: &mut [i8]) -> i32 {
    assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(16) && simd() >= Simd::Avx2 {
        #[expect(unsafe_code, reason = "the CPU was checked for AVX2")]
        // SAFETY: simd() found AVX2 (and AVX-512 F/BW/VL for that path); equal lengths,
        // a multiple of 16.
        return unsafe {
            if simd() >= Simd::Avx512Vnni {
                x86::quantize_avx512(x, inv, out)
            } else {
                x86::quantize_avx2(x, inv, out)
            }
        };
    }
    let mut sum = 0i32;
    for (q, &v) in out.iter_mut().zip(x) {
        *q = round_ties_even(v * inv) as i8;
        sum += i32::from(*q);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over slices whose lengths are checked by the callers"
)]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2; `x.len()` a multiple of 16.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn amax(x: &[f32]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let (mut m0, mut m1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in x.chunks_exact(16) {
            // SAFETY: 16 readable values.
            let (a, b) = unsafe {
                (
                    _mm256_loadu_ps(c.as_ptr()),
                    _mm256_loadu_ps(c.as_ptr().add(8)),
                )
            };
            m0 = _mm256_max_ps(m0, _mm256_andnot_ps(sign, a));
            m1 = _mm256_max_ps(m1, _mm256_andnot_ps(sign, b));
        }
        let mut lanes = [0f32; 8];
        // SAFETY: 8 writable values.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_max_ps(m0, m1)) };
        lanes.iter().fold(0f32, |m, &v| m.max(v))
    }

    /// # Safety
    /// AVX-512 F, BW and VL; equal lengths, a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn quantize_avx512(x: &[f32], inv: f32, out: &mut [i8]) -> i32 {
        let scale = _mm512_set1_ps(inv);
        let mut sum = _mm512_setzero_si512();
        for (c, o) in x.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 readable values and 16 writable bytes.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), scale);
                let q = _mm512_cvtps_epi32(_mm512_roundscale_ps::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(v));
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128(o.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(q));
            }
        }
        _mm512_reduce_add_epi32(sum)
    }

    /// # Safety
    /// AVX2; equal lengths, a multiple of 16.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_avx2(x: &[f32], inv: f32, out: &mut [i8]) -> i32 {
        let scale = _mm256_set1_ps(inv);
        let mut sum = _mm256_setzero_si256();
        for (c, o) in x.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 readable values and 16 writable bytes.
            unsafe {
                let round = |v: __m256| {
                    _mm256_cvtps_epi32(_mm256_round_ps::<
                        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                    >(_mm256_mul_ps(v, scale)))
                };
                let a = round(_mm256_loadu_ps(c.as_ptr()));
                let b = round(_mm256_loadu_ps(c.as_ptr().add(8)));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
                // Two saturating packs interleave 128-bit halves: a0 b0 a1 b1 as 16-bit,
                // then bytes [a0 b0 a1 b1 | same]; the permute puts a before b.
                let words = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
                let bytes = _mm256_packs_epi16(words, words);
                let bytes = _mm256_permute4x64_epi64::<0b00_00_10_00>(bytes);
                _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(bytes));
            }
        }
        let mut lanes = [0i32; 8];
        // SAFETY: 8 writable values.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), sum) };
        lanes.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path this CPU has gives the scalar definition's bytes and sums, ties and
    /// the ±127 ends included.
    #[test]
    fn simd_quantization_equals_the_scalar_one() {
        let mut x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        // Exact ties when scaled by 1 (0.5, 1.5, -2.5, 126.5) and the ends.
        x[..6].copy_from_slice(&[0.5, 1.5, -2.5, 127.0, -127.0, 126.5]);
        let top = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(amax(&x), top);
        assert_eq!(amax(&[0.0; 32]), 0.0);
        for inv in [1.0, 127.0 / top, 0.0] {
            let want: Vec<i8> = x.iter().map(|&v| round_ties_even(v * inv) as i8).collect();
            let want_sum: i32 = want.iter().map(|&q| i32::from(q)).sum();
            let mut got = vec![0i8; x.len()];
            assert_eq!(quantize(&x, inv, &mut got), want_sum, "inv {inv}");
            assert_eq!(got, want, "inv {inv}");
            #[cfg(target_arch = "x86_64")]
            {
                use super::super::detected_simd;
                if detected_simd() >= Simd::Avx2 {
                    #[expect(unsafe_code, reason = "the CPU was checked for AVX2")]
                    // SAFETY: AVX2 detected; equal lengths, a multiple of 16.
                    let sum = unsafe { x86::quantize_avx2(&x, inv, &mut got) };
                    assert_eq!((sum, &got), (want_sum, &want), "AVX2, inv {inv}");
                }
            }
        }
    }
}
