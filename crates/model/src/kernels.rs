//! Quantized matrix multiplication kernels for the types candle only has scalar code for.
//!
//! [`FastLinear`] holds a Q4_1 weight (blocks of 32: `x = d·q + m`, 4-bit `q`) split into
//! separate arrays of nibbles, scales and minimums, and multiplies it with activations
//! quantized to Q8_1 exactly as ggml does (`quantize_row_q8_1`, `ggml_vec_dot_q4_1_q8_1`):
//! per block `d_w·d_a·Σ q_w·q_a + m_w·s_a`, where `s_a = d_a·Σ q_a`. Same arithmetic as
//! llama.cpp, so greedy tokens agree; AVX2 when the CPU has it, scalar otherwise. Rows of
//! the weight are split across rayon's threads.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{ModelError, Result};

const QK: usize = 32;
/// Activation rows handled together, so each unpacked weight block is used several times.
const ROW_TILE: usize = 4;

/// A Q4_1 weight `[out, in]` laid out for SIMD.
#[derive(Debug)]
pub struct FastLinear {
    out_features: usize,
    in_features: usize,
    /// `out · in/2` bytes: for each block, 16 bytes holding values j (low nibble) and
    /// j + 16 (high nibble).
    nibbles: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
}

/// Activations of one row quantized to Q8_1.
struct Q8Row {
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl FastLinear {
    /// Takes a Q4_1 tensor `[out, in]`.
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let (out_features, in_features) = q.shape().dims2()?;
        if q.dtype() != GgmlDType::Q4_1 || in_features % QK != 0 {
            return Err(ModelError::BadTensor {
                name: "Q4_1 weight".into(),
                reason: format!("type {:?} with row length {in_features}", q.dtype()),
            });
        }
        let data = q.data()?;
        let blocks = out_features * in_features / QK;
        if data.len() != blocks * 20 {
            return Err(ModelError::BadTensor {
                name: "Q4_1 weight".into(),
                reason: format!("{} bytes for {blocks} blocks", data.len()),
            });
        }
        let mut nibbles = Vec::with_capacity(blocks * 16);
        let mut scales = Vec::with_capacity(blocks);
        let mut mins = Vec::with_capacity(blocks);
        for block in data.chunks_exact(20) {
            scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
            mins.push(f16::from_le_bytes([block[2], block[3]]).to_f32());
            nibbles.extend_from_slice(&block[4..20]);
        }
        Ok(Self {
            out_features,
            in_features,
            nibbles,
            scales,
            mins,
        })
    }

    /// `[out, in]`.
    pub fn shape(&self) -> (usize, usize) {
        (self.out_features, self.in_features)
    }

    /// The weight as f32 `[out, in]`.
    pub fn dequantize(&self) -> Result<Tensor> {
        let mut values = Vec::with_capacity(self.out_features * self.in_features);
        for (b, block) in self.nibbles.chunks_exact(16).enumerate() {
            let (d, m) = (self.scales[b], self.mins[b]);
            let mut out = [0f32; QK];
            for (j, &byte) in block.iter().enumerate() {
                out[j] = d * f32::from(byte & 0x0F) + m;
                out[j + 16] = d * f32::from(byte >> 4) + m;
            }
            values.extend_from_slice(&out);
        }
        Ok(Tensor::from_vec(
            values,
            (self.out_features, self.in_features),
            &candle_core::Device::Cpu,
        )?)
    }

    /// `x Wᵀ` for `x` `[n, in]` (f32).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.apply_op1_no_bwd(&Op(self))?)
    }

    fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let k = self.in_features;
        let rows: Vec<Q8Row> = x.chunks_exact(k).map(quantize_q8_1).collect();
        let out = self.out_features;
        let mut y = vec![0f32; n * out];
        // Work split: chunks of weight rows; each computes all activation rows, writing
        // a [rows_in_chunk, n] tile that is scattered into y afterwards.
        let chunk = if n * out * k >= 1 << 18 { 16 } else { out };
        let tiles: Vec<(usize, Vec<f32>)> = (0..out)
            .step_by(chunk)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|start| {
                let end = (start + chunk).min(out);
                let mut tile = vec![0f32; (end - start) * n];
                for (o, t) in (start..end).zip(tile.chunks_exact_mut(n)) {
                    self.dot_row(o, &rows, t);
                }
                (start, tile)
            })
            .collect();
        for (start, tile) in tiles {
            for (i, t) in tile.chunks_exact(n).enumerate() {
                for (r, &v) in t.iter().enumerate() {
                    y[r * out + start + i] = v;
                }
            }
        }
        y
    }

    /// Dot products of weight row `o` with every activation row.
    fn dot_row(&self, o: usize, rows: &[Q8Row], out: &mut [f32]) {
        let nb = self.in_features / QK;
        let w = WeightRow {
            nibbles: &self.nibbles[o * nb * 16..(o + 1) * nb * 16],
            scales: &self.scales[o * nb..(o + 1) * nb],
            mins: &self.mins[o * nb..(o + 1) * nb],
        };
        for (tile, dst) in rows.chunks(ROW_TILE).zip(out.chunks_mut(ROW_TILE)) {
            dot_tile(&w, tile, dst);
        }
    }
}

struct WeightRow<'a> {
    nibbles: &'a [u8],
    scales: &'a [f32],
    mins: &'a [f32],
}

/// ggml's `quantize_row_q8_1` (AVX2 flavour: scale `127/amax`, round half to even; the
/// block scale and sum are stored as f16, so they are rounded through f16 here too).
fn quantize_q8_1(x: &[f32]) -> Q8Row {
    let nb = x.len() / QK;
    let mut qs = Vec::with_capacity(x.len());
    let mut d = Vec::with_capacity(nb);
    let mut s = Vec::with_capacity(nb);
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for &v in block {
            let q = (v * inv).round_ties_even() as i8;
            sum += i32::from(q);
            qs.push(q);
        }
        d.push(f16::from_f32(scale).to_f32());
        s.push(f16::from_f32(scale * sum as f32).to_f32());
    }
    Q8Row { qs, d, s }
}

fn dot_tile(w: &WeightRow<'_>, rows: &[Q8Row], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        #[expect(unsafe_code, reason = "the CPU was just checked for AVX2 and FMA")]
        // SAFETY: avx2 and fma are available (checked above).
        unsafe {
            avx2::dot_tile(w, rows, out)
        };
        return;
    }
    dot_tile_scalar(w, rows, out);
}

fn dot_tile_scalar(w: &WeightRow<'_>, rows: &[Q8Row], out: &mut [f32]) {
    for (row, dst) in rows.iter().zip(out.iter_mut()) {
        let mut sum = 0f32;
        for b in 0..w.scales.len() {
            let nib = &w.nibbles[b * 16..b * 16 + 16];
            let q = &row.qs[b * QK..b * QK + QK];
            let mut sumi = 0i32;
            for j in 0..16 {
                sumi += i32::from(nib[j] & 0x0F) * i32::from(q[j])
                    + i32::from(nib[j] >> 4) * i32::from(q[j + 16]);
            }
            sum += sumi as f32 * w.scales[b] * row.d[b] + w.mins[b] * row.s[b];
        }
        *dst = sum;
    }
}

#[cfg(target_arch = "x86_64")]
#[expect(unsafe_code, reason = "SIMD intrinsics; every load is bounds-checked by slicing first")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{QK, Q8Row, WeightRow};

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_tile(w: &WeightRow<'_>, rows: &[Q8Row], out: &mut [f32]) {
        let n = rows.len().min(out.len()).min(super::ROW_TILE);
        let mut acc = [_mm256_setzero_ps(); super::ROW_TILE];
        let mut mins = [0f32; super::ROW_TILE];
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for b in 0..w.scales.len() {
            let nib: &[u8; 16] = w.nibbles[b * 16..b * 16 + 16].try_into().expect("16 bytes");
            // SAFETY: `nib` is exactly 16 readable bytes.
            let packed = unsafe { _mm_loadu_si128(nib.as_ptr().cast()) };
            let shifted = _mm_srli_epi16::<4>(packed);
            let wq = _mm256_and_si256(_mm256_set_m128i(shifted, packed), low);
            let (dw, mw) = (w.scales[b], w.mins[b]);
            for r in 0..n {
                let row = &rows[r];
                let q: &[i8; QK] = row.qs[b * QK..b * QK + QK].try_into().expect("32 bytes");
                // SAFETY: `q` is exactly 32 readable bytes.
                let aq = unsafe { _mm256_loadu_si256(q.as_ptr().cast()) };
                let pairs = _mm256_maddubs_epi16(wq, aq);
                let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * row.d[b]), sums, acc[r]);
                mins[r] += mw * row.s[b];
            }
        }
        for r in 0..n {
            out[r] = hsum(acc[r]) + mins[r];
        }
    }
}

struct Op<'a>(&'a FastLinear);

impl CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "q4_1-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("q4_1-matmul expects f32 activations");
        };
        let dims = layout.shape().dims();
        let k = *dims.last().unwrap_or(&0);
        if k != self.0.in_features {
            candle_core::bail!(
                "q4_1-matmul: activations have width {k}, the weight expects {}",
                self.0.in_features
            );
        }
        let x = match layout.contiguous_offsets() {
            Some((start, end)) => &data[start..end],
            None => candle_core::bail!("q4_1-matmul expects contiguous activations"),
        };
        let n = x.len() / k.max(1);
        let y = self.0.matmul(x, n);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("at least one dim") = self.0.out_features;
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Module};
    use candle_core::quantized::QMatMul;

    use super::*;

    /// Tolerance against candle's own (scalar) Q4_1×Q8_1 product: the arithmetic is the
    /// same up to rounding of the activation scale (f16) and summation order.
    const MAX_REL_ERROR: f32 = 2e-3;

    #[test]
    fn matches_candle_q4_1_matmul() {
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (40, 128), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let fast = FastLinear::from_qtensor(&q).unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        for n in [1, 3, 4, 7] {
            let x = Tensor::randn(0f32, 1.0, (n, 128), &device).unwrap();
            let got: Vec<f32> = fast.forward(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let want: Vec<f32> = reference.forward(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= MAX_REL_ERROR * scale, "n={n}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn dequantize_matches_candle() {
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (8, 64), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let ours: Vec<f32> = FastLinear::from_qtensor(&q).unwrap().dequantize().unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let theirs: Vec<f32> = q.dequantize(&device).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn scalar_and_simd_agree() {
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (1, 256), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let fast = FastLinear::from_qtensor(&q).unwrap();
        let x: Vec<f32> = (0..256 * 3).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
        let rows: Vec<Q8Row> = x.chunks_exact(256).map(quantize_q8_1).collect();
        let w = WeightRow { nibbles: &fast.nibbles, scales: &fast.scales, mins: &fast.mins };
        let (mut a, mut b) = ([0f32; 3], [0f32; 3]);
        dot_tile(&w, &rows, &mut a);
        dot_tile_scalar(&w, &rows, &mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{x} vs {y}");
        }
    }
}
