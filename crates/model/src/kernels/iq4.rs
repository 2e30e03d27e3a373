//! IQ4_NL and IQ4_XS weights on the blocks-of-32 kernels' codebook form.
//!
//! Both types store 4-bit indices into one non-uniform codebook of 16 signed integers,
//! each of which fits a signed byte. The kernels keep the indices (4 bits per value, as
//! in the file) and look the integers up in registers (`vpshufb`), so each block's
//! product is the very integer ggml's IQ4 dot products compute: an IQ4_NL block keeps
//! its scale `d`, and each 32-value sub-block of an IQ4_XS super-block becomes a block
//! with scale
//! `d·(ls − 32)` (an f16 times a 6-bit integer: exact in f32, and the very float
//! ggml's `dequantize_row_iq4_xs` computes). Dequantized values are therefore ggml's.
//!
//! Activations are quantized as ggml quantizes them for each type: Q8_0 (an f16 scale
//! per 32) for IQ4_NL, Q8_K (one f32 scale per 256) for IQ4_XS, held per block of 32
//! with the scale repeated ([`quantize_row_k_in_32`]). Every block's `Σ q_w·q_a` is then
//! the integer ggml's `ggml_vec_dot_iq4_nl_q8_0` / `ggml_vec_dot_iq4_xs_q8_K` sums. For
//! IQ4_XS the kernels go on as ggml does: `Σ (ls − 32)·Σ q_w·q_a` over the super-block in
//! integers, then one float step per 256 values (`d·d_a` times it). The float step per
//! block this replaced (the block's scale `d·(ls − 32)` times `d_a`, the sum converted,
//! a fused multiply-add) took the 64-row 2048² product 1.83–1.90 ms, the integer sums
//! 1.74 (AVX-512, one Zen 4 thread; 1.60–1.63 once the activation sums were read
//! from memory, see `ActRow::offset_sums`). Only the order of the float steps differs
//! from ggml's (`fma` against a multiply and an add). Q8_K is coarser than Q8_0, but
//! it is what llama.cpp computes: on SmolLM2-135M IQ4_XS, 525 next-token
//! log-probabilities (`tests/llamacpp`, `prompt_logprobs_match_llama_cpp`) differ from
//! llama.cpp's by 0.137 nats on average with Q8_K for IQ4_XS and 0.149 with Q8_0
//! (llama.cpp differs from itself, flash attention off and an f32 cache, by 0.125).
//! With the integer super-block sums: 0.143 on average, at most 1.73 (0.136 and 1.07
//! with a float step per block) — the noise of 8-bit activations, not of the change:
//! the two definitions' outputs differ by ~1e-7 of their size (an IQ4_XS `ffn_down`,
//! 50 rows), yet SmolLM2's log-probabilities of a 51-token text by 0.06 nats on
//! average, as a change that small flips roundings of the next layer's quantized
//! activations.
//!
//! IQ4_NL is held in 4.5 bits per value, as in the file (an f16 scale per 32). IQ4_XS
//! in 4.31: the super-block's f16 `d` and a signed byte `ls − 32` per block
//! ([`Scales::Sub`]; the file's 4.25; an f32 `d·(ls − 32)` per block, 5 bits per value,
//! decoded the 1B model 20% slower).

use half::f16;

use super::packed32::{Form, Packed32, Scales};
use super::{ActRow, FastLinear, OFFSET_SUM, Packing, QK, QK_K, QuantKind, quantize_row_k};
use crate::error::{ModelError, Result};
use crate::gguf::{RawTensor, RawType};

/// Appends a block's 16 bytes of indices (value j the low nibble of byte j, value
/// j + 16 its high nibble: the kernels' nibble layout).
fn push_values(nibbles: &[u8], quants: &mut Vec<u8>) {
    quants.extend_from_slice(nibbles);
}

/// ggml's Q8_K activations (one f32 scale per 256 values) in the form the blocks-of-32
/// kernels read: each block of 32 with its super-block's scale and its own sum.
pub(super) fn quantize_row_k_in_32(x: &[f32]) -> ActRow {
    let k = quantize_row_k(x);
    ActRow {
        d: k.d.iter().flat_map(|&d| [d; QK_K / QK]).collect(),
        offset_sums: k
            .qs
            .chunks_exact(QK)
            .map(|b| OFFSET_SUM * b.iter().map(|&q| i32::from(q)).sum::<i32>())
            .collect(),
        qs: k.qs,
        s: Vec::new(),
        sums: Vec::new(),
    }
}

impl FastLinear {
    /// Takes an IQ4_NL or IQ4_XS tensor `[.., in]` (every dimension but the last is a
    /// row), converted to the Q8_0 kernel's blocks.
    pub fn from_raw(t: &RawTensor) -> Result<Self> {
        Self::from_raw_bytes(t.ty, &t.dims, &t.data)
    }

    /// Takes the blocks `data` of an IQ4_NL or IQ4_XS tensor of shape `dims`, as the
    /// file stores them.
    pub(crate) fn from_raw_bytes(ty: RawType, dims: &[usize], data: &[u8]) -> Result<Self> {
        let bad = |reason: String| ModelError::BadTensor {
            name: format!("{ty:?} weight"),
            reason,
        };
        let (&in_features, rows) = dims
            .split_last()
            .ok_or_else(|| bad("no dimensions".into()))?;
        let out_features: usize = rows.iter().product();
        let (block_len, block_bytes) = (ty.block_size(), ty.type_size());
        if in_features % block_len != 0 {
            return Err(bad(format!(
                "row length {in_features} is not a multiple of {block_len}"
            )));
        }
        let blocks = out_features * in_features / block_len;
        if data.len() != blocks * block_bytes {
            return Err(bad(format!("{} bytes for {blocks} blocks", data.len())));
        }
        let half_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
        if ty == RawType::Iq4Xs {
            // d, scales_h (u16), scales_l[4], 8 × 16 bytes of indices: kernel block i
            // is sub-block i mod 8 of file block i / 8, with scale d·(ls − 32) held as
            // d and ls − 32.
            let read = |i: usize, src: &mut [u8]| {
                let block = &data[(i / 8) * block_bytes..(i / 8 + 1) * block_bytes];
                let ib = i % 8;
                let scales_h = u16::from_le_bytes([block[2], block[3]]);
                let low = (block[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
                let high = ((scales_h >> (2 * ib)) & 3) as u8;
                // The kernels' nibble layout is the file's (see `push_values`).
                src.copy_from_slice(&block[8 + 16 * ib..24 + 16 * ib]);
                (
                    half_at(block, 0),
                    f32::from(i16::from(low | high << 4) - 32),
                )
            };
            return Ok(Self {
                kind: QuantKind::Iq4Xs,
                out_features,
                in_features,
                packed: Packing::B32(Packed32::pack_with(
                    Form::Codebook,
                    (false, Scales::Sub),
                    (out_features, in_features / QK),
                    read,
                )),
            });
        }
        let kernel_blocks = out_features * in_features / QK;
        let mut quants = Vec::with_capacity(kernel_blocks * QK / 2);
        let mut scales = Vec::with_capacity(kernel_blocks);
        for block in data.chunks_exact(block_bytes) {
            match ty {
                // d, 16 bytes of indices.
                RawType::Iq4Nl => {
                    scales.push(half_at(block, 0));
                    push_values(&block[2..18], &mut quants);
                }
                RawType::Iq4Xs => unreachable!("read block by block above"),
            }
        }
        Ok(Self::from_blocks(
            QuantKind::Iq4Nl,
            (out_features, in_features),
            &quants,
            &scales,
            &[],
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Tensor;

    use super::super::tests::values;
    use super::super::{Packing, Sums, quantize_row};
    use super::*;
    use crate::gguf::tests::{ggml_dequantize, sample};

    /// Kernel against `x'·Wᵀ` summed in f64 (`W` dequantized as ggml does, `x'` the
    /// activations after their 8-bit quantization): the same numbers summed in another
    /// order and rounded to f32, as a fraction of `Σ |w·x'|`.
    const PRODUCT_TOLERANCE: f64 = 1e-5;

    const TYPES: [RawType; 2] = [RawType::Iq4Nl, RawType::Iq4Xs];

    /// The weight, whole or by rows (embedding lookups), holds ggml's dequantized
    /// values bit for bit.
    #[test]
    fn dequantized_values_are_ggml_s() {
        for ty in TYPES {
            let (out, inp) = (5, 512);
            let raw = sample(ty, out, inp, 3);
            let want = ggml_dequantize(&raw);
            assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v < 0.0));
            let fast = FastLinear::from_raw(&raw).unwrap();
            assert_eq!(fast.shape(), (out, inp));
            let got: Vec<f32> = values(&fast.dequantize().unwrap());
            assert_eq!(got, want, "{ty:?}");
            let rows = fast.rows(&[4, 1]);
            assert_eq!(rows[..inp], want[4 * inp..5 * inp], "{ty:?}");
            assert_eq!(rows[inp..], want[inp..2 * inp], "{ty:?}");
        }
    }

    /// Each output equals the product of ggml's dequantized weight with the activations
    /// after the 8-bit quantization ggml gives them (Q8_0 for IQ4_NL, Q8_K for IQ4_XS),
    /// to float rounding. One to six activation rows; 5 and 20 weight rows (a group of
    /// 16 with padding, and a second group); one and three super-blocks per row.
    #[test]
    fn product_is_the_dequantized_weight_times_the_quantized_activations() {
        let device = candle_core::Device::Cpu;
        for ty in TYPES {
            for (out, superblocks) in [(5, 1), (20, 3)] {
                let k = superblocks * 256;
                let raw = sample(ty, out, k, out);
                let weights = ggml_dequantize(&raw);
                let fast = FastLinear::from_raw(&raw).unwrap();
                for n in [1, 4, 6] {
                    let x = Tensor::randn(0f32, 1.0, (n, k), &device).unwrap();
                    let xs: Vec<f32> = values(&x);
                    let got: Vec<f32> = values(&fast.forward(&x).unwrap());
                    for (r, xr) in xs.chunks_exact(k).enumerate() {
                        // ggml's activation blocks for each type.
                        let (act, block) = match ty {
                            RawType::Iq4Nl => (quantize_row(xr, Sums::None), QK),
                            RawType::Iq4Xs => (quantize_row_k(xr), QK_K),
                        };
                        for (o, wr) in weights.chunks_exact(k).enumerate() {
                            let (exact, size) =
                                wr.iter().enumerate().fold((0f64, 0f64), |(s, a), (i, &w)| {
                                    let p = f64::from(w)
                                        * f64::from(act.d[i / block])
                                        * f64::from(act.qs[i]);
                                    (s + p, a + p.abs())
                                });
                            let g = f64::from(got[r * out + o]);
                            assert!(
                                (g - exact).abs() <= PRODUCT_TOLERANCE * size,
                                "{ty:?}, {superblocks} super-blocks, row {r}/{n}, output {o}: {g} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A decode's groups read as several streams in lockstep give each group's bits.
    #[test]
    fn decode_in_streams_gives_each_group_s_bits() {
        for ty in TYPES {
            let (out, k) = (200, 512);
            let fast = FastLinear::from_raw(&sample(ty, out, k, 7)).unwrap();
            let xs: Vec<f32> = (0..k)
                .map(|i| ((i * 41 % 89) as f32 - 44.0) / 9.0)
                .collect();
            let rows = fast.quantize(&xs);
            super::super::tests::assert_decodes_as_groups(
                &fast.packed,
                &rows[0],
                &format!("{ty:?}"),
            );
        }
    }

    /// The kernel this CPU runs (AVX-512, AVX2 or scalar) gives the scalar kernel's bits
    /// on the converted weights: codebook values down to −127 and scales of both signs.
    #[test]
    fn simd_and_scalar_agree() {
        for ty in TYPES {
            let (out, k) = (20, 512);
            let fast = FastLinear::from_raw(&sample(ty, out, k, 5)).unwrap();
            let Packing::B32(p) = &fast.packed else {
                panic!("{ty:?} is not in blocks of 32");
            };
            let xs: Vec<f32> = (0..8 * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
                .collect();
            // The activations as this type's weights take them.
            let rows = fast.quantize(&xs);
            for g in 0..p.groups {
                for n in 1..=8 {
                    let mut want = [0f32; 128];
                    p.group_scalar(g, &rows[..n], &mut want);
                    let mut got = [0f32; 128];
                    p.group(g, &rows[..n], &mut got);
                    assert_eq!(
                        got.map(f32::to_bits),
                        want.map(f32::to_bits),
                        "{ty:?}, group {g}, {n} rows"
                    );
                }
            }
            // With AVX2, from each group unpacked once (IQ4_XS's scales per 32).
            #[cfg(target_arch = "x86_64")]
            if super::super::detected_simd() >= super::super::Simd::Avx2 {
                let mut w = Vec::new();
                for g in 0..p.groups {
                    p.avx2_unpack(g, &mut w);
                    let mut want = [0f32; 128];
                    p.group_scalar(g, &rows, &mut want);
                    let mut got = [0f32; 128];
                    p.avx2_unpacked(g, &w, &rows, &mut got);
                    assert_eq!(
                        got.map(f32::to_bits),
                        want.map(f32::to_bits),
                        "{ty:?}, group {g}, AVX2 unpacked"
                    );
                }
            }
            // A prefill of 37 rows: two sixteen-row tiles (AMX where this CPU has it)
            // and five more.
            let xs: Vec<f32> = (0..37 * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 11.0)
                .collect();
            let rows = fast.quantize(&xs);
            let got = fast.matmul_rows(&rows, 37);
            for (r, row) in rows.iter().enumerate() {
                for g in 0..p.groups {
                    let mut want = [0f32; 16];
                    p.group_scalar(g, std::slice::from_ref(row), &mut want);
                    let width = 16.min(out - 16 * g);
                    let got = &got[r * out + 16 * g..r * out + 16 * g + width];
                    assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        want[..width]
                            .iter()
                            .map(|x| x.to_bits())
                            .collect::<Vec<_>>(),
                        "{ty:?}, 37 rows, row {r}, group {g}"
                    );
                }
            }
        }
    }
}
