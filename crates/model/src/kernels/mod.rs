//! Quantized matrix multiplication and attention kernels.
//!
//! [`FastLinear`] holds a Q4_1 weight (blocks of 32: `x = d·q + m`, 4-bit `q`) or a Q8_0
//! weight (`x = d·q`, 8-bit `q`) split into separate arrays of quants, scales and
//! minimums, and multiplies it with activations quantized the way ggml does
//! (`quantize_row_q8_1` / `quantize_row_q8_0`, then `ggml_vec_dot_q4_1_q8_1` /
//! `ggml_vec_dot_q8_0_q8_0`): per block `d_w·d_a·Σ q_w·q_a (+ m_w·s_a)`. AVX2 when the CPU
//! has it, scalar otherwise. Rows of the weight are split across rayon's threads.
//!
//! Q4_0, Q5_0 and Q5_1 are converted at load to run on those two kernels: Q4_0 as Q4_1
//! with minimum `−8d`; Q5_0 as Q8_0 with `q − 16` in a signed byte (ggml's exact
//! integers); Q5_1 as Q8_0 plus a minimum `m + 16d`. The two with a large minimum term
//! take the activations' block sums in f32 rather than f16.
//!
//! The K-quants Q4_K and Q6_K (super-blocks of 256 with integer sub-block scales: what
//! Q4_K_M files hold) are repacked sixteen rows at a time ([`kquant`]) and take
//! activations quantized per 256 values with an f32 scale and the sum of every 16
//! quants, as ggml's Q8_K. Within a super-block every sum is then an integer, exact in
//! any order, and the float arithmetic is one step per super-block shared by the
//! scalar, AVX2 and AVX-512 kernels, so all give the same bits.
//!
//! Every output element is computed by one thread in one fixed order, whatever the
//! number of rows in the batch: a sequence's logits do not depend on what it was
//! batched with, and scoring a whole sequence in one pass gives bit-identical
//! log-probabilities to generating it token by token. The [`attention`] kernel keeps
//! the same property for attention.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::error::{ModelError, Result};

mod kquant;

use kquant::{KPacked, KType, LANES};

const QK: usize = 32;
/// Values per K-quant super-block.
const QK_K: usize = 256;
/// Activation sums per super-block: one per 16 values.
const K_SUMS: usize = QK_K / 16;
/// Activation rows handled together, so each unpacked weight block is used several times.
const ROW_TILE: usize = 4;

/// The widest kernel family this CPU runs, detected once. `AGENTSTACK_KERNELS=avx2` or
/// `=scalar` caps it (to compare kernel families on one machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(
    not(target_arch = "x86_64"),
    expect(dead_code, reason = "x86 kernel families")
)]
enum Simd {
    Scalar,
    Avx2,
    Avx512Vnni,
}

#[cfg_attr(
    not(target_arch = "x86_64"),
    expect(dead_code, reason = "x86 kernel families")
)]
fn simd() -> Simd {
    static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match std::env::var("AGENTSTACK_KERNELS").as_deref() {
            Ok("scalar") => Simd::Scalar,
            Ok("avx2") => Simd::Avx2,
            _ => Simd::Avx512Vnni,
        };
        detected_simd().min(cap)
    })
}

fn detected_simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                return Simd::Avx512Vnni;
            }
            return Simd::Avx2;
        }
    }
    Simd::Scalar
}

/// The weight types with a kernel here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// 4-bit with a scale per block of 32 (`x = d·(q − 8)`); runs on the Q4_1 kernel
    /// with minimum `−8d`, activations as Q8_1 with exact sums.
    Q4_0,
    /// 4-bit with scale and minimum per block of 32; activations as Q8_1.
    Q4_1,
    /// 5-bit with a scale per block of 32 (`x = d·(q − 16)`); runs on the Q8_0 kernel
    /// with `q − 16` as a signed byte (the same integers as ggml's Q5_0 × Q8_0).
    Q5_0,
    /// 5-bit with scale and minimum per block of 32 (`x = d·q + m`); runs on the Q8_0
    /// kernel with `q − 16` as a signed byte and minimum `m + 16d`, activations as
    /// Q8_1 with exact sums.
    Q5_1,
    /// 8-bit with a scale per block of 32; activations as Q8_0.
    Q8_0,
    /// Q4_K: super-blocks of 256 (`d`, `dmin`), 8 sub-blocks of 32 with 6-bit scales
    /// and minimums, 4-bit quants; activations as Q8_K.
    Q4K,
    /// Q6_K: super-blocks of 256 (`d`), 16 sub-blocks of 16 with 8-bit scales, 6-bit
    /// quants; activations as Q8_K.
    Q6K,
}

/// How activations are quantized for a kind: weights whose kinds share it share one
/// quantized copy of the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActFormat {
    /// Blocks of 32, f16-rounded scale and sum (ggml's Q8_1).
    Q8_1,
    /// Blocks of 32, f16-rounded scale, the sum `d·Σq` in f32 (for weights whose
    /// minimum term is large: Q4_0 and Q5_1 as offset kernels).
    Q8_1Exact,
    /// Blocks of 32, f16-rounded scale.
    Q8_0,
    /// Blocks of 256, f32 scale, sums of 16.
    Q8K,
}

impl QuantKind {
    /// The kernel for a GGML type, if there is one.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q5_0 => Some(Self::Q5_0),
            GgmlDType::Q5_1 => Some(Self::Q5_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Values per block (super-block for the K-quants).
    fn block_len(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => QK,
            Self::Q4K | Self::Q6K => QK_K,
        }
    }

    /// The kind whose kernel runs this one (the weight is converted at load).
    fn kernel(self) -> Self {
        match self {
            Self::Q4_0 => Self::Q4_1,
            Self::Q5_0 | Self::Q5_1 => Self::Q8_0,
            other => other,
        }
    }

    /// Bytes of quants per block, as the kernel holds them.
    fn quant_bytes(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 => 16,
            Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K => 128,
            // 128 bytes of low 4 bits, then 64 of high 2 bits (the file's order).
            Self::Q6K => 192,
        }
    }

    fn act_format(self) -> ActFormat {
        match self {
            Self::Q4_1 => ActFormat::Q8_1,
            Self::Q4_0 | Self::Q5_1 => ActFormat::Q8_1Exact,
            Self::Q5_0 | Self::Q8_0 => ActFormat::Q8_0,
            Self::Q4K | Self::Q6K => ActFormat::Q8K,
        }
    }
}

/// A quantized weight `[out, in]` laid out for SIMD.
#[derive(Debug)]
pub struct FastLinear {
    kind: QuantKind,
    out_features: usize,
    in_features: usize,
    /// Q4_1: 16 bytes per block, values j (low nibble) and j + 16 (high nibble).
    /// Q8_0: 32 signed bytes per block. (Empty for the K-quants.)
    quants: Vec<u8>,
    /// `d` per block.
    scales: Vec<f32>,
    /// Q4_1: `m` per block.
    mins: Vec<f32>,
    /// Q4_K and Q6_K: the weight repacked in groups of 16 rows ([`kquant`]).
    packed: Option<KPacked>,
}

/// Activations of one row quantized to 8 bits per value (Q8_1, Q8_0 or Q8_K).
struct ActRow {
    qs: Vec<i8>,
    /// Scale per block (super-block for Q8_K).
    d: Vec<f32>,
    /// `d · Σq` per block (Q8_1 only).
    s: Vec<f32>,
    /// `Σq` per 16 values (Q8_K only).
    sums: Vec<i16>,
}

impl FastLinear {
    /// Takes a Q4_1, Q8_0, Q4_K or Q6_K tensor `[out, in]`.
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let (out_features, in_features) = q.shape().dims2()?;
        let bad = |reason: String| ModelError::BadTensor {
            name: format!("{:?} weight", q.dtype()),
            reason,
        };
        let kind = QuantKind::of(q.dtype()).ok_or_else(|| bad("no kernel for this type".into()))?;
        let block_len = kind.block_len();
        if in_features % block_len != 0 {
            return Err(bad(format!(
                "row length {in_features} is not a multiple of {block_len}"
            )));
        }
        let data = q.data()?;
        let blocks = out_features * in_features / block_len;
        let block_bytes = q.dtype().type_size();
        if data.len() != blocks * block_bytes {
            return Err(bad(format!("{} bytes for {blocks} blocks", data.len())));
        }
        if let Some(ty) = match kind {
            QuantKind::Q4K => Some(KType::Q4K),
            QuantKind::Q6K => Some(KType::Q6K),
            _ => None,
        } {
            let nb = in_features / QK_K;
            return Ok(Self {
                kind,
                out_features,
                in_features,
                quants: Vec::new(),
                scales: Vec::new(),
                mins: Vec::new(),
                packed: Some(KPacked::pack(ty, &data, out_features, nb)),
            });
        }
        let qb = kind.quant_bytes();
        let mut quants = Vec::with_capacity(blocks * qb);
        let mut scales = Vec::with_capacity(blocks);
        let mut mins = Vec::new();
        let half_at =
            |block: &[u8], i: usize| f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
        for block in data.chunks_exact(block_bytes) {
            match kind {
                QuantKind::Q4_1 => {
                    scales.push(half_at(block, 0));
                    mins.push(half_at(block, 2));
                    quants.extend_from_slice(&block[4..20]);
                }
                QuantKind::Q8_0 => {
                    scales.push(half_at(block, 0));
                    quants.extend_from_slice(&block[2..34]);
                }
                QuantKind::Q4_0 => {
                    let d = half_at(block, 0);
                    scales.push(d);
                    mins.push(-8.0 * d);
                    quants.extend_from_slice(&block[2..18]);
                }
                // d, (Q5_1: m), 4 bytes of fifth bits, 16 of nibbles: value j takes the
                // low nibble of byte j and bit j, value j + 16 the high nibble and bit
                // j + 16.
                QuantKind::Q5_0 | QuantKind::Q5_1 => {
                    let d = half_at(block, 0);
                    let at = if kind == QuantKind::Q5_1 { 4 } else { 2 };
                    let high = u32::from_le_bytes(block[at..at + 4].try_into().expect("4 bytes"));
                    let nibbles = &block[at + 4..at + 20];
                    let value = |j: usize| {
                        let nibble = if j < 16 {
                            nibbles[j] & 0x0F
                        } else {
                            nibbles[j - 16] >> 4
                        };
                        (nibble | (((high >> j) & 1) as u8) << 4) as i8 - 16
                    };
                    quants.extend((0..QK).map(|j| value(j) as u8));
                    scales.push(d);
                    if kind == QuantKind::Q5_1 {
                        mins.push(half_at(block, 2) + 16.0 * d);
                    }
                }
                QuantKind::Q4K | QuantKind::Q6K => unreachable!("packed above"),
            }
        }
        Ok(Self {
            kind,
            out_features,
            in_features,
            quants,
            scales,
            mins,
            packed: None,
        })
    }

    /// The weight type.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// `[out, in]`.
    pub fn shape(&self) -> (usize, usize) {
        (self.out_features, self.in_features)
    }

    /// Rows `ids` of the weight as f32 (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Vec<f32> {
        let nb = self.in_features / self.kind.block_len();
        let mut out = Vec::with_capacity(ids.len() * self.in_features);
        for &id in ids {
            self.dequantize_row(id as usize, nb, &mut out);
        }
        out
    }

    /// Appends row `o` (of `nb` blocks) as f32.
    fn dequantize_row(&self, o: usize, nb: usize, out: &mut Vec<f32>) {
        match &self.packed {
            Some(p) => (0..nb).for_each(|b| p.dequantize_block(o, b, out)),
            None => (o * nb..(o + 1) * nb).for_each(|b| self.dequantize_block(b, out)),
        }
    }

    /// Appends block `b` as f32, with the arithmetic of ggml's dequantization.
    fn dequantize_block(&self, b: usize, out: &mut Vec<f32>) {
        let qb = self.kind.quant_bytes();
        let q = &self.quants[b * qb..(b + 1) * qb];
        let d = self.scales[b];
        match self.kind.kernel() {
            QuantKind::Q4_1 => {
                let m = self.mins[b];
                let mut block = [0f32; QK];
                for (j, &byte) in q.iter().enumerate() {
                    block[j] = d * f32::from(byte & 0x0F) + m;
                    block[j + 16] = d * f32::from(byte >> 4) + m;
                }
                out.extend_from_slice(&block);
            }
            QuantKind::Q8_0 if self.mins.is_empty() => {
                out.extend(q.iter().map(|&byte| d * f32::from(byte as i8)));
            }
            QuantKind::Q8_0 => {
                let m = self.mins[b];
                out.extend(q.iter().map(|&byte| d * f32::from(byte as i8) + m));
            }
            _ => unreachable!("K-quants are packed by group"),
        }
    }

    /// The weight as f32 `[out, in]`.
    pub fn dequantize(&self) -> Result<Tensor> {
        let nb = self.in_features / self.kind.block_len();
        let mut values = Vec::with_capacity(self.out_features * self.in_features);
        for o in 0..self.out_features {
            self.dequantize_row(o, nb, &mut values);
        }
        Ok(Tensor::from_vec(
            values,
            (self.out_features, self.in_features),
            &candle_core::Device::Cpu,
        )?)
    }

    /// `x Wᵀ` for `x` `[.., in]` (f32).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.apply_op1_no_bwd(&Op(self))?)
    }

    /// `x Wᵢᵀ` for several weights of the same type and width (q, k and v; gate and up):
    /// the activations are quantized once.
    pub fn forward_many(weights: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let Some(first) = weights.first() else {
            return Ok(Vec::new());
        };
        if weights.iter().any(|w| {
            w.kind.act_format() != first.kind.act_format() || w.in_features != first.in_features
        }) {
            return weights.iter().map(|w| w.forward(x)).collect();
        }
        let x = x.contiguous()?;
        let dims = x.dims().to_vec();
        let values = x.flatten_all()?.to_vec1::<f32>()?;
        let rows = first.quantize(&values);
        let n = rows.len();
        weights
            .iter()
            .map(|w| {
                let mut out_dims = dims.clone();
                *out_dims.last_mut().expect("at least one dim") = w.out_features;
                let y = w.matmul_rows(&rows, n);
                Ok(Tensor::from_vec(y, out_dims, x.device())?)
            })
            .collect()
    }

    fn quantize(&self, x: &[f32]) -> Vec<ActRow> {
        let format = self.kind.act_format();
        x.chunks_exact(self.in_features)
            .map(|r| match format {
                ActFormat::Q8_1 => quantize_row(r, Sums::F16),
                ActFormat::Q8_1Exact => quantize_row(r, Sums::Exact),
                ActFormat::Q8_0 => quantize_row(r, Sums::None),
                ActFormat::Q8K => quantize_row_k(r),
            })
            .collect()
    }

    fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let rows = self.quantize(x);
        self.matmul_rows(&rows, n)
    }

    fn matmul_rows(&self, rows: &[ActRow], n: usize) -> Vec<f32> {
        if let Some(p) = &self.packed {
            return self.matmul_packed(p, rows, n);
        }
        let k = self.in_features;
        let out = self.out_features;
        let mut y = vec![0f32; n * out];
        // Work split: ranges of weight rows, a few per thread (one range when there is
        // one thread: splitting work nobody else can take only costs). Which thread
        // computes an element never changes how it is computed.
        let threads = rayon::current_num_threads();
        let chunk = if threads <= 1 || n * out * k < 1 << 16 {
            out
        } else {
            out.div_ceil(threads * 4).next_multiple_of(4)
        };
        if n == 1 {
            // Decoding: y is [1, out], so each range of weight rows owns a slice of it.
            y.par_chunks_mut(chunk).enumerate().for_each(|(c, dst)| {
                self.rows_into(c * chunk, &rows[0], dst);
            });
            return y;
        }
        let tiles: Vec<(usize, Vec<f32>)> = (0..out)
            .step_by(chunk)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|start| {
                let end = (start + chunk).min(out);
                let mut tile = vec![0f32; (end - start) * n];
                for (o, t) in (start..end).zip(tile.chunks_exact_mut(n)) {
                    self.dot_row(o, rows, t);
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

    /// [`Self::matmul_rows`] for a weight packed in groups of 16 rows: each group's
    /// outputs for up to four activation rows at once, groups split across threads.
    fn matmul_packed(&self, p: &KPacked, rows: &[ActRow], n: usize) -> Vec<f32> {
        let out = self.out_features;
        let threads = rayon::current_num_threads();
        // Groups per task: a few tasks per thread, or one task with one thread.
        let per_task = if threads <= 1 || n * out * self.in_features < 1 << 16 {
            p.groups
        } else {
            p.groups.div_ceil(threads * 4)
        };
        // Task results: for each group, [row][lane] for every activation row.
        let tiles: Vec<Vec<f32>> = (0..p.groups)
            .step_by(per_task)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|first| {
                let last = (first + per_task).min(p.groups);
                let mut tile = vec![0f32; (last - first) * n * LANES];
                for (g, dst) in (first..last).zip(tile.chunks_exact_mut(n * LANES)) {
                    for (chunk, d) in rows.chunks(ROW_TILE).zip(dst.chunks_mut(ROW_TILE * LANES)) {
                        p.group(g, chunk, d);
                    }
                }
                tile
            })
            .collect();
        let mut y = vec![0f32; n * out];
        let mut g = 0;
        for tile in &tiles {
            for group in tile.chunks_exact(n * LANES) {
                let o0 = g * LANES;
                let width = LANES.min(out - o0);
                for (r, lanes) in group.chunks_exact(LANES).enumerate() {
                    y[r * out + o0..r * out + o0 + width].copy_from_slice(&lanes[..width]);
                }
                g += 1;
            }
        }
        y
    }

    /// Weight rows `start..start + dst.len()` against one activation row, four at a time.
    fn rows_into(&self, start: usize, row: &ActRow, dst: &mut [f32]) {
        let mut quads = dst.chunks_exact_mut(4);
        let mut o = start;
        for quad in &mut quads {
            let quad: &mut [f32; 4] = quad.try_into().expect("four outputs");
            self.dot_weights4(o, row, quad);
            o += 4;
        }
        for d in quads.into_remainder() {
            self.dot_row(o, std::slice::from_ref(row), std::slice::from_mut(d));
            o += 1;
        }
    }

    fn weight_row(&self, o: usize) -> WeightRow<'_> {
        let nb = self.in_features / self.kind.block_len();
        let qb = self.kind.quant_bytes();
        WeightRow {
            quants: &self.quants[o * nb * qb..(o + 1) * nb * qb],
            scales: &self.scales[o * nb..(o + 1) * nb],
            mins: row_part(&self.mins, o, nb),
        }
    }

    /// Dot products of weight row `o` with every activation row.
    fn dot_row(&self, o: usize, rows: &[ActRow], out: &mut [f32]) {
        let w = self.weight_row(o);
        for (tile, dst) in rows.chunks(ROW_TILE).zip(out.chunks_mut(ROW_TILE)) {
            dot_tile(self.kind.kernel(), &w, tile, dst);
        }
    }

    /// Dot products of weight rows `o..o + 4` with one activation row: the same
    /// arithmetic per output as [`Self::dot_row`], with the activation loads shared.
    fn dot_weights4(&self, o: usize, row: &ActRow, out: &mut [f32; 4]) {
        let ws = [
            self.weight_row(o),
            self.weight_row(o + 1),
            self.weight_row(o + 2),
            self.weight_row(o + 3),
        ];
        #[cfg(target_arch = "x86_64")]
        match simd() {
            Simd::Avx512Vnni => {
                #[expect(unsafe_code, reason = "the CPU was checked for these features")]
                // SAFETY: simd() found AVX-512 F/BW/VL/VNNI, AVX2 and FMA.
                unsafe {
                    avx512::weights4(self.kind.kernel(), &ws, row, out)
                };
                return;
            }
            Simd::Avx2 => {
                #[expect(unsafe_code, reason = "the CPU was checked for AVX2 and FMA")]
                // SAFETY: simd() found AVX2 and FMA.
                unsafe {
                    avx2::weights4(self.kind.kernel(), &ws, row, out)
                };
                return;
            }
            Simd::Scalar => {}
        }
        for (w, dst) in ws.iter().zip(out.iter_mut()) {
            dot_tile_scalar(
                self.kind.kernel(),
                w,
                std::slice::from_ref(row),
                std::slice::from_mut(dst),
            );
        }
    }
}

struct WeightRow<'a> {
    quants: &'a [u8],
    scales: &'a [f32],
    mins: &'a [f32],
}

/// Row `o`'s `per_row` values of a per-block array, or nothing for an array the kind
/// does not use.
fn row_part<T>(values: &[T], o: usize, per_row: usize) -> &[T] {
    if values.is_empty() {
        &[]
    } else {
        &values[o * per_row..(o + 1) * per_row]
    }
}

/// Q4_K's 12 bytes of 6-bit values unpacked: the 8 sub-block scales, then the 8
/// minimums. Sub-blocks 0–3 keep theirs in the low 6 bits of bytes 0–3 (scales) and
/// 4–7 (minimums); sub-blocks 4–7 take 4 low bits from a nibble of bytes 8–11 and 2
/// high bits from the top of bytes 0–3 (scales) or 4–7 (minimums).
fn unpack_q4k_scales(p: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for j in 0..4 {
        out[j] = p[j] & 63;
        out[8 + j] = p[j + 4] & 63;
        out[4 + j] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        out[12 + j] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    out
}

/// Value `i` (0..256) of a Q6_K super-block as unsigned 6 bits (the weight is this
/// minus 32). Each half of 128 values uses 64 bytes of `low` and 32 of `high`: value
/// `32q + l` of a half (quarter `q`) takes the low or high nibble of low byte
/// `l + 32·(q mod 2)` and bits `2q..2q + 2` of high byte `l`.
#[inline]
fn q6k_value(low: &[u8], high: &[u8], i: usize) -> u8 {
    let (half, quarter, l) = (i / 128, i % 128 / 32, i % 32);
    let byte = low[64 * half + 32 * (quarter % 2) + l];
    let nibble = if quarter < 2 { byte & 0x0F } else { byte >> 4 };
    nibble | (((high[32 * half + l] >> (2 * quarter)) & 3) << 4)
}

/// Whether (and how) [`quantize_row`] keeps each block's `d·Σq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sums {
    None,
    /// Rounded through f16, as ggml's Q8_1 stores it.
    F16,
    /// `d·Σq` in f32 with the f16-rounded `d` the products use.
    Exact,
}

/// ggml's `quantize_row_q8_1` / `quantize_row_q8_0`, AVX2 flavour: scale `127/amax`,
/// round half to even; the block scale (and sum) are stored as f16 by ggml, so they are
/// rounded through f16 here too.
fn quantize_row(x: &[f32], sums: Sums) -> ActRow {
    let nb = x.len() / QK;
    let mut qs = Vec::with_capacity(x.len());
    let mut d = Vec::with_capacity(nb);
    let mut s = Vec::with_capacity(if sums == Sums::None { 0 } else { nb });
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for &v in block {
            let q = round_ties_even(v * inv) as i8;
            sum += i32::from(q);
            qs.push(q);
        }
        let rounded = f16::from_f32(scale).to_f32();
        d.push(rounded);
        match sums {
            Sums::None => {}
            Sums::F16 => s.push(f16::from_f32(scale * sum as f32).to_f32()),
            Sums::Exact => s.push(rounded * sum as f32),
        }
    }
    ActRow {
        qs,
        d,
        s,
        sums: Vec::new(),
    }
}

/// Activations for the K-quants, as ggml's Q8_K: per 256 values one scale `amax/127`
/// (round half to even), kept in f32 (it is never stored in a file, unlike Q8_0's), and
/// the sum of every 16 quants. One scale per super-block keeps a super-block's whole
/// product in integers, with two float multiplications per 256 values.
fn quantize_row_k(x: &[f32]) -> ActRow {
    let nb = x.len() / QK_K;
    let mut qs = Vec::with_capacity(x.len());
    let mut d = Vec::with_capacity(nb);
    let mut sums = Vec::with_capacity(nb * K_SUMS);
    for block in x.chunks_exact(QK_K) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for group in block.chunks_exact(16) {
            let mut sum = 0i16;
            for &v in group {
                let q = round_ties_even(v * inv) as i8;
                sum += i16::from(q);
                qs.push(q);
            }
            sums.push(sum);
        }
        d.push(amax / 127.0);
    }
    ActRow {
        qs,
        d,
        s: Vec::new(),
        sums,
    }
}

/// Round half to even for |x| ≤ 2²², as `_mm256_round_ps(_MM_ROUND_NEAREST)` does:
/// adding and subtracting 1.5·2²³ leaves the float unit's default rounding to do the
/// work (libm's `rintf` is a function call per value).
#[inline(always)]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

fn dot_tile(kind: QuantKind, w: &WeightRow<'_>, rows: &[ActRow], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match simd() {
        Simd::Avx512Vnni => {
            #[expect(unsafe_code, reason = "the CPU was checked for these features")]
            // SAFETY: simd() found AVX-512 F/BW/VL/VNNI, AVX2 and FMA.
            unsafe {
                avx512::dot_tile(kind, w, rows, out)
            };
            return;
        }
        Simd::Avx2 => {
            #[expect(unsafe_code, reason = "the CPU was checked for AVX2 and FMA")]
            // SAFETY: simd() found AVX2 and FMA.
            unsafe {
                avx2::dot_tile(kind, w, rows, out)
            };
            return;
        }
        Simd::Scalar => {}
    }
    dot_tile_scalar(kind, w, rows, out);
}

/// `Σ_b m_w[b]·s_a[b]` in eight lanes (lane `b mod 8`), combined in a fixed tree: the
/// minimum term of Q4_1 products, the same for every row count.
#[inline]
fn mins_dot(mins: &[f32], sums: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let n = mins.len().min(sums.len());
    let (mins, sums) = (&mins[..n], &sums[..n]);
    let (cm, cs) = (mins.chunks_exact(8), sums.chunks_exact(8));
    let (rm, rs) = (cm.remainder(), cs.remainder());
    for (m, s) in cm.zip(cs) {
        for l in 0..8 {
            lanes[l] += m[l] * s[l];
        }
    }
    for (l, (m, s)) in rm.iter().zip(rs).enumerate() {
        lanes[l] += m * s;
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
}

fn dot_tile_scalar(kind: QuantKind, w: &WeightRow<'_>, rows: &[ActRow], out: &mut [f32]) {
    for (row, dst) in rows.iter().zip(out.iter_mut()) {
        *dst = match kind {
            QuantKind::Q4_1 | QuantKind::Q8_0 => dot_blocks_scalar(kind, w, row),
            _ => unreachable!("K-quants are packed by group; other kinds run a kernel kind"),
        };
    }
}

/// One super-block's step of a Q4_K product, shared by every kernel so that all give
/// the same bits: `isum = Σ_j scale_j·Σ q_w·q_a` and `msum = Σ_j min_j·Σ q_a` over the
/// sub-blocks are exact integers.
#[inline(always)]
fn q4k_step(acc: f32, d: f32, dmin: f32, da: f32, isum: i32, msum: i32) -> f32 {
    acc + ((d * da) * isum as f32 - (dmin * da) * msum as f32)
}

/// One super-block's step of a Q6_K product: `isum = Σ_g scale_g·Σ (q_w − 32)·q_a`,
/// an exact integer.
#[inline(always)]
fn q6k_step(acc: f32, d: f32, da: f32, isum: i32) -> f32 {
    acc + (d * da) * isum as f32
}

/// A Q4_1 or Q8_0 weight row against one activation row.
fn dot_blocks_scalar(kind: QuantKind, w: &WeightRow<'_>, row: &ActRow) -> f32 {
    // Two accumulators (even and odd blocks), as the SIMD kernels.
    let mut acc = [0f32; 2];
    for b in 0..w.scales.len() {
        let q = &row.qs[b * QK..b * QK + QK];
        let mut sumi = 0i32;
        match kind {
            QuantKind::Q4_1 => {
                let nib = &w.quants[b * 16..b * 16 + 16];
                for j in 0..16 {
                    sumi += i32::from(nib[j] & 0x0F) * i32::from(q[j])
                        + i32::from(nib[j] >> 4) * i32::from(q[j + 16]);
                }
            }
            QuantKind::Q8_0 => {
                let wq = &w.quants[b * 32..b * 32 + 32];
                for j in 0..32 {
                    sumi += i32::from(wq[j] as i8) * i32::from(q[j]);
                }
            }
            _ => unreachable!("K-quants have their own kernels"),
        }
        acc[b % 2] += sumi as f32 * (w.scales[b] * row.d[b]);
    }
    let mut sum = acc[0] + acc[1];
    if !w.mins.is_empty() {
        sum += mins_dot(w.mins, &row.s);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ActRow, QK, QuantKind, ROW_TILE, WeightRow};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn hsum(v: __m256) -> f32 {
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
    pub(super) unsafe fn dot_tile(
        kind: QuantKind,
        w: &WeightRow<'_>,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let n = rows.len().min(out.len()).min(ROW_TILE);
        // SAFETY (all arms): AVX2 and FMA are available, as this function requires.
        unsafe {
            match (kind, n) {
                (QuantKind::Q4_1, 1) => rows_q4_1::<1>(w, rows, out),
                (QuantKind::Q4_1, 2) => rows_q4_1::<2>(w, rows, out),
                (QuantKind::Q4_1, 3) => rows_q4_1::<3>(w, rows, out),
                (QuantKind::Q4_1, _) => rows_q4_1::<4>(w, rows, out),
                (QuantKind::Q8_0, 1) => rows_q8_0::<1>(w, rows, out),
                (QuantKind::Q8_0, 2) => rows_q8_0::<2>(w, rows, out),
                (QuantKind::Q8_0, 3) => rows_q8_0::<3>(w, rows, out),
                (QuantKind::Q8_0, _) => rows_q8_0::<4>(w, rows, out),
                _ => unreachable!("K-quants are packed by group; other kinds run a kernel kind"),
            }
        }
        if !w.mins.is_empty() {
            for r in 0..n {
                out[r] += mins_dot(w.mins, &rows[r].s);
            }
        }
    }

    /// `Σ q_w·q_a` of one block as 8 f32 lanes: `wq` unsigned (Q4_1 nibbles), `aq` signed.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn block_us(wq: __m256i, aq: __m256i) -> __m256 {
        let pairs = _mm256_maddubs_epi16(wq, aq);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// Q4_1 × Q8_1 for `R` activation rows: per row, even blocks go to one accumulator
    /// and odd blocks to another (two FMA chains in flight); the arithmetic of a row
    /// does not depend on `R`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_q4_1<const R: usize>(w: &WeightRow<'_>, rows: &[ActRow], out: &mut [f32]) {
        let nb = w.scales.len();
        assert!(w.quants.len() >= nb * 16 && rows.len() >= R && out.len() >= R);
        for row in &rows[..R] {
            assert!(row.qs.len() >= nb * QK && row.d.len() >= nb);
        }
        let low = _mm256_set1_epi8(0x0F);
        let mut even = [_mm256_setzero_ps(); R];
        let mut odd = [_mm256_setzero_ps(); R];
        let wq_ptr = w.quants.as_ptr();
        let ws = w.scales.as_ptr();
        let a_ptr: [*const i8; R] = std::array::from_fn(|r| rows[r].qs.as_ptr());
        let d_ptr: [*const f32; R] = std::array::from_fn(|r| rows[r].d.as_ptr());
        // SAFETY: every offset below is for a block b < nb, which the asserts cover.
        let unpack = |b: usize| unsafe {
            let packed = _mm_loadu_si128(wq_ptr.add(b * 16).cast());
            let shifted = _mm_srli_epi16::<4>(packed);
            _mm256_and_si256(_mm256_set_m128i(shifted, packed), low)
        };
        let mut b = 0;
        while b + 1 < nb {
            let (w0, w1) = (unpack(b), unpack(b + 1));
            // SAFETY: b + 1 < nb.
            let (s0, s1) = unsafe { (*ws.add(b), *ws.add(b + 1)) };
            for r in 0..R {
                // SAFETY: b + 1 < nb.
                unsafe {
                    let a0 = _mm256_loadu_si256(a_ptr[r].add(b * QK).cast());
                    let a1 = _mm256_loadu_si256(a_ptr[r].add((b + 1) * QK).cast());
                    let (d0, d1) = (*d_ptr[r].add(b), *d_ptr[r].add(b + 1));
                    even[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), block_us(w0, a0), even[r]);
                    odd[r] = _mm256_fmadd_ps(_mm256_set1_ps(s1 * d1), block_us(w1, a1), odd[r]);
                }
            }
            b += 2;
        }
        if b < nb {
            let w0 = unpack(b);
            // SAFETY: b < nb.
            let s0 = unsafe { *ws.add(b) };
            for r in 0..R {
                // SAFETY: b < nb.
                unsafe {
                    let a0 = _mm256_loadu_si256(a_ptr[r].add(b * QK).cast());
                    let d0 = *d_ptr[r].add(b);
                    even[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), block_us(w0, a0), even[r]);
                }
            }
        }
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(even[r], odd[r]));
        }
    }

    /// Four weight rows against one activation row, each output computed exactly as
    /// [`rows_q4_1`] / [`rows_q8_0`] compute it (even and odd block accumulators).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weights4(
        kind: QuantKind,
        ws: &[WeightRow<'_>; 4],
        row: &ActRow,
        out: &mut [f32; 4],
    ) {
        // SAFETY: the CPU supports AVX2 and FMA, as this function requires.
        unsafe {
            match kind {
                QuantKind::Q4_1 => weights4_kind::<true>(ws, row, out),
                QuantKind::Q8_0 => weights4_kind::<false>(ws, row, out),
                _ => unreachable!("K-quants are packed by group; other kinds run a kernel kind"),
            }
        }
        if !ws[0].mins.is_empty() {
            for k in 0..4 {
                out[k] += mins_dot(ws[k].mins, &row.s);
            }
        }
    }

    /// [`weights4`] for Q4_1 (`Q4 = true`) or Q8_0.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weights4_kind<const Q4: bool>(
        ws: &[WeightRow<'_>; 4],
        row: &ActRow,
        out: &mut [f32; 4],
    ) {
        let nb = ws[0].scales.len();
        let qb = if Q4 { 16 } else { 32 };
        for w in ws {
            assert!(w.scales.len() == nb && w.quants.len() >= nb * qb);
        }
        assert!(row.qs.len() >= nb * QK && row.d.len() >= nb);
        let low = _mm256_set1_epi8(0x0F);
        let mut even = [_mm256_setzero_ps(); 4];
        let mut odd = [_mm256_setzero_ps(); 4];
        let a = row.qs.as_ptr();
        let d = row.d.as_ptr();
        let wp: [*const u8; 4] = std::array::from_fn(|k| ws[k].quants.as_ptr());
        let sp: [*const f32; 4] = std::array::from_fn(|k| ws[k].scales.as_ptr());
        // The product of weight row `k`'s block `b` with activation block `aq`, as 8 lanes.
        // SAFETY (closure body): b < nb, covered by the asserts.
        let product = |k: usize, b: usize, aq: __m256i| unsafe {
            if Q4 {
                let packed = _mm_loadu_si128(wp[k].add(b * 16).cast());
                let shifted = _mm_srli_epi16::<4>(packed);
                block_us(_mm256_and_si256(_mm256_set_m128i(shifted, packed), low), aq)
            } else {
                let wq = _mm256_loadu_si256(wp[k].add(b * 32).cast());
                block_us(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq))
            }
        };
        let mut b = 0;
        while b + 1 < nb {
            // SAFETY: b + 1 < nb.
            unsafe {
                let (a0, a1) = (
                    _mm256_loadu_si256(a.add(b * QK).cast()),
                    _mm256_loadu_si256(a.add((b + 1) * QK).cast()),
                );
                let (d0, d1) = (*d.add(b), *d.add(b + 1));
                for k in 0..4 {
                    let (s0, s1) = (*sp[k].add(b), *sp[k].add(b + 1));
                    even[k] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), product(k, b, a0), even[k]);
                    odd[k] =
                        _mm256_fmadd_ps(_mm256_set1_ps(s1 * d1), product(k, b + 1, a1), odd[k]);
                }
            }
            b += 2;
        }
        if b < nb {
            // SAFETY: b < nb.
            unsafe {
                let (a0, d0) = (_mm256_loadu_si256(a.add(b * QK).cast()), *d.add(b));
                for k in 0..4 {
                    let s0 = *sp[k].add(b);
                    even[k] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), product(k, b, a0), even[k]);
                }
            }
        }
        for k in 0..4 {
            out[k] = hsum(_mm256_add_ps(even[k], odd[k]));
        }
    }

    /// The minimum term `Σ_b m[b]·s[b]` exactly as the scalar [`mins_dot`] computes it
    /// (eight lanes, multiply then add, the same final tree), eight blocks per step.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn mins_dot(m: &[f32], s: &[f32]) -> f32 {
        let n = m.len().min(s.len());
        let full = n / 8 * 8;
        let mut lanes = _mm256_setzero_ps();
        for c in (0..full).step_by(8) {
            let mv: &[f32; 8] = m[c..c + 8].try_into().expect("8 values");
            let sv: &[f32; 8] = s[c..c + 8].try_into().expect("8 values");
            // SAFETY: both references cover exactly 8 readable f32 values.
            let (mv, sv) = unsafe { (_mm256_loadu_ps(mv.as_ptr()), _mm256_loadu_ps(sv.as_ptr())) };
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(mv, sv));
        }
        let mut l = [0f32; 8];
        // SAFETY: `l` has room for 8 f32 values.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), lanes) };
        for (i, (x, y)) in m[full..n].iter().zip(&s[full..n]).enumerate() {
            l[i] += x * y;
        }
        ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
    }

    /// Q8_0 × Q8_0 for `R` activation rows, arranged as [`rows_q4_1`].
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_q8_0<const R: usize>(w: &WeightRow<'_>, rows: &[ActRow], out: &mut [f32]) {
        let nb = w.scales.len();
        assert!(w.quants.len() >= nb * 32 && rows.len() >= R && out.len() >= R);
        for row in &rows[..R] {
            assert!(row.qs.len() >= nb * QK && row.d.len() >= nb);
        }
        let mut even = [_mm256_setzero_ps(); R];
        let mut odd = [_mm256_setzero_ps(); R];
        let wq_ptr = w.quants.as_ptr();
        let ws = w.scales.as_ptr();
        let a_ptr: [*const i8; R] = std::array::from_fn(|r| rows[r].qs.as_ptr());
        let d_ptr: [*const f32; R] = std::array::from_fn(|r| rows[r].d.as_ptr());
        // |w| unsigned times sign(w)·a signed, as ggml's mul_sum_i8_pairs.
        // SAFETY: every offset below is for a block b < nb, which the asserts cover.
        let load = |b: usize| unsafe { _mm256_loadu_si256(wq_ptr.add(b * 32).cast()) };
        let mut b = 0;
        while b + 1 < nb {
            let (w0, w1) = (load(b), load(b + 1));
            let (abs0, abs1) = (_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(w1, w1));
            // SAFETY: b + 1 < nb.
            let (s0, s1) = unsafe { (*ws.add(b), *ws.add(b + 1)) };
            for r in 0..R {
                // SAFETY: b + 1 < nb.
                unsafe {
                    let a0 = _mm256_loadu_si256(a_ptr[r].add(b * QK).cast());
                    let a1 = _mm256_loadu_si256(a_ptr[r].add((b + 1) * QK).cast());
                    let (d0, d1) = (*d_ptr[r].add(b), *d_ptr[r].add(b + 1));
                    let p0 = block_us(abs0, _mm256_sign_epi8(a0, w0));
                    let p1 = block_us(abs1, _mm256_sign_epi8(a1, w1));
                    even[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), p0, even[r]);
                    odd[r] = _mm256_fmadd_ps(_mm256_set1_ps(s1 * d1), p1, odd[r]);
                }
            }
            b += 2;
        }
        if b < nb {
            let w0 = load(b);
            let abs0 = _mm256_sign_epi8(w0, w0);
            // SAFETY: b < nb.
            let s0 = unsafe { *ws.add(b) };
            for r in 0..R {
                // SAFETY: b < nb.
                unsafe {
                    let a0 = _mm256_loadu_si256(a_ptr[r].add(b * QK).cast());
                    let d0 = *d_ptr[r].add(b);
                    let p0 = block_us(abs0, _mm256_sign_epi8(a0, w0));
                    even[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), p0, even[r]);
                }
            }
        }
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(even[r], odd[r]));
        }
    }
}

/// The AVX-512 VNNI kernels: the AVX2 ones with two blocks per 512-bit register (even
/// block in the low half, odd block in the high half: the AVX2 kernels' two
/// accumulators side by side) and `vpdpbusd` for the byte products. No byte product sum
/// saturates in either, so every output is bit-identical to the AVX2 kernels' (tested).
/// The K-quant kernels hold two sub-blocks (or quarters) per register; their sums are
/// exact integers and their float step is the shared one, so they too give the AVX2
/// and scalar kernels' bits (tested).
#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::hsum;
    use super::{ActRow, QK, QuantKind, ROW_TILE, WeightRow};

    /// Two blocks' `Σ q_w·q_a` as 16 f32 lanes (the low 8 for the first block), each
    /// lane the sum of the same four byte products as the AVX2 kernels' lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn blocks2(wq: __m512i, aq: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, aq))
    }

    /// One block's `Σ q_w·q_a` as 8 f32 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn block1(wq: __m256i, aq: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, aq))
    }

    /// `[x0; 8] ++ [x1; 8]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn scale2(x0: f32, x1: f32) -> __m512 {
        _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(x0), _mm512_set1_ps(x1))
    }

    /// The upper 8 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn high(v: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    }

    /// Weight blocks `b` and `b + 1` as unsigned bytes in activation order, and (Q8_0)
    /// the mask of negative weights: Q4_1 nibbles unpacked to `[lows b, highs b, lows
    /// b+1, highs b+1]`; Q8_0 as `|w|`, the activations to be negated where `w < 0`
    /// (ggml's `mul_sum_i8_pairs`).
    ///
    /// # Safety
    /// `quants` must hold blocks `b` and `b + 1`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    unsafe fn weights2<const Q4: bool>(quants: *const u8, b: usize) -> (__m512i, __mmask64) {
        // SAFETY: the caller guarantees blocks b and b + 1 are readable.
        unsafe {
            if Q4 {
                let packed = _mm256_loadu_si256(quants.add(b * 16).cast());
                let shifted = _mm256_srli_epi16::<4>(packed);
                // [p_b, p_b+1, s_b, s_b+1] → [p_b, s_b, p_b+1, s_b+1]
                let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(packed), shifted);
                let ordered = _mm512_shuffle_i64x2::<0b11_01_10_00>(both, both);
                (_mm512_and_si512(ordered, _mm512_set1_epi8(0x0F)), 0)
            } else {
                let w = _mm512_loadu_si512(quants.add(b * 32).cast());
                (_mm512_abs_epi8(w), _mm512_movepi8_mask(w))
            }
        }
    }

    /// [`weights2`] for block `b` alone.
    ///
    /// # Safety
    /// `quants` must hold block `b`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    unsafe fn weights1<const Q4: bool>(quants: *const u8, b: usize) -> (__m256i, __mmask32) {
        // SAFETY: the caller guarantees block b is readable.
        unsafe {
            if Q4 {
                let packed = _mm_loadu_si128(quants.add(b * 16).cast());
                let shifted = _mm_srli_epi16::<4>(packed);
                let both = _mm256_set_m128i(shifted, packed);
                (_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), 0)
            } else {
                let w = _mm256_loadu_si256(quants.add(b * 32).cast());
                (_mm256_abs_epi8(w), _mm256_movepi8_mask(w))
            }
        }
    }

    /// The minimum term `Σ_b m[b]·s[b]` with the arithmetic of the scalar `mins_dot`
    /// (lane `b mod 8`, multiply then add, the same final tree), inlined into the
    /// kernels: the last partial group of eight is a masked load whose other lanes add
    /// `0·0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn mins(m: &[f32], s: &[f32]) -> f32 {
        let n = m.len().min(s.len());
        let mut lanes = _mm256_setzero_ps();
        let mut c = 0;
        while c + 8 <= n {
            // SAFETY: c + 8 <= n, within both slices.
            let (mv, sv) = unsafe {
                (
                    _mm256_loadu_ps(m.as_ptr().add(c)),
                    _mm256_loadu_ps(s.as_ptr().add(c)),
                )
            };
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(mv, sv));
            c += 8;
        }
        if c < n {
            let mask: __mmask8 = (1u8 << (n - c)) - 1;
            // SAFETY: the mask reads only lanes c..n, within both slices.
            let (mv, sv) = unsafe {
                (
                    _mm256_maskz_loadu_ps(mask, m.as_ptr().add(c)),
                    _mm256_maskz_loadu_ps(mask, s.as_ptr().add(c)),
                )
            };
            lanes = _mm256_mask_add_ps(lanes, mask, lanes, _mm256_mul_ps(mv, sv));
        }
        // ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7))
        let a = _mm_add_ps(
            _mm256_castps256_ps128(lanes),
            _mm256_extractf128_ps::<1>(lanes),
        );
        let t = _mm_add_ps(a, _mm_shuffle_ps::<0b10_11_00_01>(a, a));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_movehl_ps(t, t)))
    }

    /// # Safety
    /// The CPU must support AVX-512 F, BW, VL and VNNI, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn dot_tile(
        kind: QuantKind,
        w: &WeightRow<'_>,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let n = rows.len().min(out.len()).min(ROW_TILE);
        // SAFETY (all arms): the CPU has the features this function requires.
        unsafe {
            match (kind, n) {
                (QuantKind::Q4_1, 1) => rows_kind::<true, 1>(w, rows, out),
                (QuantKind::Q4_1, 2) => rows_kind::<true, 2>(w, rows, out),
                (QuantKind::Q4_1, 3) => rows_kind::<true, 3>(w, rows, out),
                (QuantKind::Q4_1, _) => rows_kind::<true, 4>(w, rows, out),
                (QuantKind::Q8_0, 1) => rows_kind::<false, 1>(w, rows, out),
                (QuantKind::Q8_0, 2) => rows_kind::<false, 2>(w, rows, out),
                (QuantKind::Q8_0, 3) => rows_kind::<false, 3>(w, rows, out),
                (QuantKind::Q8_0, _) => rows_kind::<false, 4>(w, rows, out),
                _ => unreachable!("K-quants are packed by group; other kinds run a kernel kind"),
            }
        }
        if !w.mins.is_empty() {
            for r in 0..n {
                out[r] += mins(w.mins, &rows[r].s);
            }
        }
    }

    /// One weight row against `R` activation rows, Q4_1 (`Q4`) or Q8_0: the arithmetic
    /// of `avx2::rows_q4_1` / `avx2::rows_q8_0`.
    ///
    /// # Safety
    /// As [`dot_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn rows_kind<const Q4: bool, const R: usize>(
        w: &WeightRow<'_>,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let nb = w.scales.len();
        let qb = if Q4 { 16 } else { 32 };
        assert!(w.quants.len() >= nb * qb && rows.len() >= R && out.len() >= R);
        for row in &rows[..R] {
            assert!(row.qs.len() >= nb * QK && row.d.len() >= nb);
        }
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); R];
        let wq = w.quants.as_ptr();
        let ws = w.scales.as_ptr();
        let a_ptr: [*const i8; R] = std::array::from_fn(|r| rows[r].qs.as_ptr());
        let d_ptr: [*const f32; R] = std::array::from_fn(|r| rows[r].d.as_ptr());
        let mut b = 0;
        while b + 1 < nb {
            // SAFETY: b + 1 < nb, and the asserts cover nb blocks of every buffer.
            unsafe {
                let (wv, neg) = weights2::<Q4>(wq, b);
                let (s0, s1) = (*ws.add(b), *ws.add(b + 1));
                for r in 0..R {
                    let a = _mm512_loadu_si512(a_ptr[r].add(b * QK).cast());
                    let a = if Q4 {
                        a
                    } else {
                        _mm512_mask_sub_epi8(a, neg, zero, a)
                    };
                    let (d0, d1) = (*d_ptr[r].add(b), *d_ptr[r].add(b + 1));
                    acc[r] = _mm512_fmadd_ps(scale2(s0 * d0, s1 * d1), blocks2(wv, a), acc[r]);
                }
            }
            b += 2;
        }
        let mut even: [__m256; R] = std::array::from_fn(|r| _mm512_castps512_ps256(acc[r]));
        if b < nb {
            // SAFETY: b < nb.
            unsafe {
                let (wv, neg) = weights1::<Q4>(wq, b);
                let s0 = *ws.add(b);
                for r in 0..R {
                    let a = _mm256_loadu_si256(a_ptr[r].add(b * QK).cast());
                    let a = if Q4 {
                        a
                    } else {
                        _mm256_mask_sub_epi8(a, neg, _mm256_setzero_si256(), a)
                    };
                    let d0 = *d_ptr[r].add(b);
                    even[r] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), block1(wv, a), even[r]);
                }
            }
        }
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(even[r], high(acc[r])));
        }
    }

    /// Four weight rows against one activation row: the arithmetic of
    /// `avx2::weights4`.
    ///
    /// # Safety
    /// As [`dot_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn weights4(
        kind: QuantKind,
        ws: &[WeightRow<'_>; 4],
        row: &ActRow,
        out: &mut [f32; 4],
    ) {
        // SAFETY: the CPU has the features this function requires.
        unsafe {
            match kind {
                QuantKind::Q4_1 => weights4_kind::<true>(ws, row, out),
                QuantKind::Q8_0 => weights4_kind::<false>(ws, row, out),
                _ => unreachable!("K-quants are packed by group; other kinds run a kernel kind"),
            }
        }
        if !ws[0].mins.is_empty() {
            for k in 0..4 {
                out[k] += mins(ws[k].mins, &row.s);
            }
        }
    }

    /// [`weights4`] for Q4_1 (`Q4 = true`) or Q8_0.
    ///
    /// # Safety
    /// As [`dot_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn weights4_kind<const Q4: bool>(
        ws: &[WeightRow<'_>; 4],
        row: &ActRow,
        out: &mut [f32; 4],
    ) {
        let nb = ws[0].scales.len();
        let qb = if Q4 { 16 } else { 32 };
        for w in ws {
            assert!(w.scales.len() == nb && w.quants.len() >= nb * qb);
        }
        assert!(row.qs.len() >= nb * QK && row.d.len() >= nb);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); 4];
        let a = row.qs.as_ptr();
        let d = row.d.as_ptr();
        let wp: [*const u8; 4] = std::array::from_fn(|k| ws[k].quants.as_ptr());
        let sp: [*const f32; 4] = std::array::from_fn(|k| ws[k].scales.as_ptr());
        let mut b = 0;
        while b + 1 < nb {
            // SAFETY: b + 1 < nb, and the asserts cover nb blocks of every buffer.
            unsafe {
                let av = _mm512_loadu_si512(a.add(b * QK).cast());
                let (d0, d1) = (*d.add(b), *d.add(b + 1));
                for k in 0..4 {
                    let (wv, neg) = weights2::<Q4>(wp[k], b);
                    let ak = if Q4 {
                        av
                    } else {
                        _mm512_mask_sub_epi8(av, neg, zero, av)
                    };
                    let (s0, s1) = (*sp[k].add(b), *sp[k].add(b + 1));
                    acc[k] = _mm512_fmadd_ps(scale2(s0 * d0, s1 * d1), blocks2(wv, ak), acc[k]);
                }
            }
            b += 2;
        }
        let mut even: [__m256; 4] = std::array::from_fn(|k| _mm512_castps512_ps256(acc[k]));
        if b < nb {
            // SAFETY: b < nb.
            unsafe {
                let av = _mm256_loadu_si256(a.add(b * QK).cast());
                let d0 = *d.add(b);
                for k in 0..4 {
                    let (wv, neg) = weights1::<Q4>(wp[k], b);
                    let ak = if Q4 {
                        av
                    } else {
                        _mm256_mask_sub_epi8(av, neg, _mm256_setzero_si256(), av)
                    };
                    let s0 = *sp[k].add(b);
                    even[k] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * d0), block1(wv, ak), even[k]);
                }
            }
        }
        for k in 0..4 {
            out[k] = hsum(_mm256_add_ps(even[k], high(acc[k])));
        }
    }
}

struct Op<'a>(&'a FastLinear);

impl CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "quantized-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("quantized-matmul expects f32 activations");
        };
        let dims = layout.shape().dims();
        let k = *dims.last().unwrap_or(&0);
        if k != self.0.in_features {
            candle_core::bail!(
                "quantized-matmul: activations have width {k}, the weight expects {}",
                self.0.in_features
            );
        }
        let x = match layout.contiguous_offsets() {
            Some((start, end)) => &data[start..end],
            None => candle_core::bail!("quantized-matmul expects contiguous activations"),
        };
        let n = x.len() / k.max(1);
        let y = self.0.matmul(x, n);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("at least one dim") = self.0.out_features;
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}

/// Causal attention of `n` new queries against a sequence's keys and values.
///
/// `q` is `[n, heads·hd]` (rotary already applied), `k` and `v` are `[s, kv_heads·hd]`
/// with the new positions last (`s ≥ n`): query `t` sees keys `0..=s−n+t`. Returns
/// `[n, heads·hd]`. Each output row is computed in one fixed order whatever `n` is, so a
/// position attends identically in a prefill, a decode step or a batch.
#[expect(clippy::too_many_arguments, reason = "the shape of one attention call")]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    let q_dim = heads * hd;
    let kv_dim = kv_heads * hd;
    let s = k.len() / kv_dim.max(1);
    let start = s - n;
    let groups = heads / kv_heads;
    let mut out = vec![0f32; n * q_dim];
    let task = |(t, h): (usize, usize), dst: &mut [f32]| {
        let qrow = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
        let g = h / groups;
        let visible = start + t + 1;
        let mut scores = Vec::with_capacity(visible);
        let mut max = f32::NEG_INFINITY;
        for j in 0..visible {
            let krow = &k[j * kv_dim + g * hd..j * kv_dim + (g + 1) * hd];
            let score = dot(qrow, krow) * scale;
            max = max.max(score);
            scores.push(score);
        }
        let mut total = 0f32;
        for score in &mut scores {
            *score = (*score - max).exp();
            total += *score;
        }
        let inv = 1.0 / total;
        dst.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let vrow = &v[j * kv_dim + g * hd..j * kv_dim + (g + 1) * hd];
            let p = p * inv;
            for (o, &x) in dst.iter_mut().zip(vrow) {
                *o += p * x;
            }
        }
    };
    if n * heads * s >= 1 << 14 {
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each(|(i, dst)| task((i / heads, i % heads), dst));
    } else {
        for (i, dst) in out.chunks_mut(hd).enumerate() {
            task((i / heads, i % heads), dst);
        }
    }
    out
}

/// A dot product with eight independent lanes (vectorizable, same order every time).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

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
            let got: Vec<f32> = fast
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let want: Vec<f32> = reference
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= MAX_REL_ERROR * scale, "n={n}: {g} vs {w}");
            }
        }
    }

    /// Dequantization, whole or by rows (embedding lookups), gives candle's values: the
    /// same arithmetic in the same order.
    #[test]
    fn dequantize_matches_candle() {
        let device = Device::Cpu;
        for (dtype, width) in [
            (GgmlDType::Q4_0, 64),
            (GgmlDType::Q4_1, 64),
            (GgmlDType::Q5_0, 64),
            (GgmlDType::Q5_1, 64),
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q4K, 512),
            (GgmlDType::Q6K, 512),
        ] {
            let w = Tensor::randn(0f32, 1.0, (8, width), &device).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let fast = FastLinear::from_qtensor(&q).unwrap();
            let ours: Vec<f32> = fast
                .dequantize()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let theirs: Vec<f32> = q
                .dequantize(&device)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            if dtype == GgmlDType::Q5_1 {
                // Held as `d·(q − 16) + (m + 16d)`: the minimum's sum is rounded once.
                for (a, b) in ours.iter().zip(&theirs) {
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                        "{dtype:?}: {a} vs {b}"
                    );
                }
                continue;
            }
            assert_eq!(ours, theirs, "{dtype:?}");
            let rows = fast.rows(&[5, 2]);
            assert_eq!(rows[..width], theirs[5 * width..6 * width], "{dtype:?}");
            assert_eq!(rows[width..], theirs[2 * width..3 * width], "{dtype:?}");
        }
    }

    /// The types of blocks of 32.
    const LEGACY_KINDS: [GgmlDType; 5] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
    ];

    /// Q4_0, Q5_0 and Q5_1 run on the Q4_1 and Q8_0 kernels after a conversion at load:
    /// each output equals the product of candle's dequantized weight with the
    /// activations after their 8-bit quantization, to float rounding (1e-5 of Σ|w·x'|).
    /// One to six rows, one and five blocks per row.
    #[test]
    fn converted_types_match_the_dequantized_product() {
        let device = Device::Cpu;
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            for (out, blocks) in [(5, 1), (9, 5)] {
                let k = blocks * QK;
                let w = Tensor::randn(0f32, 1.0, (out, k), &device).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let weights: Vec<f32> = q
                    .dequantize(&device)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let fast = FastLinear::from_qtensor(&q).unwrap();
                for n in [1, 4, 6] {
                    let x = Tensor::randn(0f32, 1.0, (n, k), &device).unwrap();
                    let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                    let got: Vec<f32> = fast
                        .forward(&x)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    for (r, xr) in xs.chunks_exact(k).enumerate() {
                        let act = quantize_row(xr, Sums::None);
                        for (o, wr) in weights.chunks_exact(k).enumerate() {
                            let (exact, size) =
                                wr.iter().enumerate().fold((0f64, 0f64), |(s, a), (i, &w)| {
                                    let p = f64::from(w)
                                        * f64::from(act.d[i / QK])
                                        * f64::from(act.qs[i]);
                                    (s + p, a + p.abs())
                                });
                            let g = f64::from(got[r * out + o]);
                            assert!(
                                (g - exact).abs() <= 1e-5 * size,
                                "{dtype:?}, {blocks} blocks, row {r}/{n}, output {o}: {g} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    const K_KINDS: [GgmlDType; 2] = [GgmlDType::Q4K, GgmlDType::Q6K];

    /// Kernel against `x'·Wᵀ` summed in f64, `W` dequantized by candle and `x'` the
    /// activations after their 8-bit quantization: the same numbers summed in another
    /// order and rounded to f32, as a fraction of `Σ |w·x'|`.
    const K_KERNEL_TOLERANCE: f64 = 1e-5;

    /// Q4_K and Q6_K weights quantized by candle: each output equals the product with
    /// candle's dequantized weight, to rounding once the activations are quantized, and
    /// within the quantization's bound (each activation off by at most half its
    /// super-block's step) of the product with the f32 activations. One to six rows,
    /// one and three super-blocks.
    #[test]
    fn k_quants_match_the_dequantized_product() {
        let device = Device::Cpu;
        for dtype in K_KINDS {
            for (out, superblocks) in [(5, 1), (9, 3)] {
                let k = superblocks * QK_K;
                let w = Tensor::randn(0f32, 1.0, (out, k), &device).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let weights: Vec<f32> = q
                    .dequantize(&device)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let fast = FastLinear::from_qtensor(&q).unwrap();
                for n in [1, 3, 4, 6] {
                    let x = Tensor::randn(0f32, 1.0, (n, k), &device).unwrap();
                    let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                    let got: Vec<f32> = fast
                        .forward(&x)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    for (r, xr) in xs.chunks_exact(k).enumerate() {
                        let act = quantize_row_k(xr);
                        let step = |i: usize| f64::from(act.d[i / QK_K]);
                        let xq: Vec<f64> = (0..k).map(|i| step(i) * f64::from(act.qs[i])).collect();
                        for (o, wr) in weights.chunks_exact(k).enumerate() {
                            let g = f64::from(got[r * out + o]);
                            let at = format!(
                                "{dtype:?}, {superblocks} super-blocks, row {r}/{n}, output {o}"
                            );
                            let wide = |x: &[f64]| -> (f64, f64) {
                                wr.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
                                    (s + f64::from(w) * x, a + (f64::from(w) * x).abs())
                                })
                            };
                            let (exact, size) = wide(&xq);
                            assert!(
                                (g - exact).abs() <= K_KERNEL_TOLERANCE * size,
                                "{at}: {g} vs {exact}"
                            );
                            let xf: Vec<f64> = xr.iter().map(|&v| f64::from(v)).collect();
                            let (plain, _) = wide(&xf);
                            let bound: f64 = wr
                                .iter()
                                .enumerate()
                                .map(|(i, &w)| f64::from(w).abs() * step(i) / 2.0)
                                .sum();
                            assert!(
                                (g - plain).abs() <= bound * 1.001 + K_KERNEL_TOLERANCE * size,
                                "{at}: {g} vs {plain} (bound {bound})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The 6-bit scale unpacking of Q4_K against its definition bit by bit, for every
    /// value of every byte position.
    #[test]
    fn q4k_scales_unpack_to_six_bits() {
        for byte in 0..=255u8 {
            for pos in 0..12 {
                let mut packed = [0u8; 12];
                packed[pos] = byte;
                let u = unpack_q4k_scales(&packed);
                // Bit b of 6-bit value v (scales 0..8, minimums 8..16).
                let bit = |v: usize, b: usize| (u[v] >> b) & 1;
                for bitpos in 0..8 {
                    let set = (byte >> bitpos) & 1;
                    // Where ggml's layout puts bit `bitpos` of byte `pos`.
                    let (v, b) = match (pos, bitpos) {
                        (0..=3, 0..=5) => (pos, bitpos),
                        (0..=3, _) => (4 + pos, bitpos - 2),
                        (4..=7, 0..=5) => (8 + pos - 4, bitpos),
                        (4..=7, _) => (12 + pos - 4, bitpos - 2),
                        (_, 0..=3) => (pos - 4, bitpos),
                        (_, _) => (pos + 4, bitpos - 4),
                    };
                    assert_eq!(bit(v, b), set, "byte {pos} bit {bitpos}");
                }
                let total: u32 = u.iter().map(|v| v.count_ones()).sum();
                assert_eq!(total, byte.count_ones(), "byte {pos}");
            }
        }
    }

    #[test]
    fn scalar_and_simd_agree() {
        let device = Device::Cpu;
        for dtype in LEGACY_KINDS {
            let w = Tensor::randn(0f32, 1.0, (1, 256), &device).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let fast = FastLinear::from_qtensor(&q).unwrap();
            let x: Vec<f32> = (0..256 * 3)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
                .collect();
            let rows: Vec<ActRow> = x
                .chunks_exact(256)
                .map(|r| fast.quantize(r).remove(0))
                .collect();
            let w = WeightRow {
                quants: &fast.quants,
                scales: &fast.scales,
                mins: &fast.mins,
            };
            let (mut a, mut b) = ([0f32; 3], [0f32; 3]);
            dot_tile(fast.kind.kernel(), &w, &rows, &mut a);
            dot_tile_scalar(fast.kind.kernel(), &w, &rows, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                    "{dtype:?}: {x} vs {y}"
                );
            }
        }
    }

    #[test]
    fn q8_0_matches_candle() {
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (24, 128), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let fast = FastLinear::from_qtensor(&q).unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        let x = Tensor::randn(0f32, 1.0, (5, 128), &device).unwrap();
        let got: Vec<f32> = fast
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = reference
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Both quantize the activations to 8 bits, each its own way (candle may take
        // Q8_K for Q8_0 weights): the two differ by up to the activations' rounding, a
        // small fraction of Σ|w·x| (a fixed fraction of |y| alone fails when y is a
        // near-cancelling sum).
        let weights: Vec<f32> = fast
            .dequantize()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (r, o) = (i / 24, i % 24);
            let size: f32 = (0..128)
                .map(|j| (weights[o * 128 + j] * xs[r * 128 + j]).abs())
                .sum();
            assert!((g - w).abs() <= 1e-2 * size, "{g} vs {w} (Σ|w·x| {size})");
        }
    }

    #[test]
    fn rows_do_not_depend_on_the_batch() {
        let device = Device::Cpu;
        for dtype in LEGACY_KINDS.into_iter().chain(K_KINDS) {
            // 67 outputs: the four-at-a-time decode path plus a remainder.
            let w = Tensor::randn(0f32, 1.0, (67, 256), &device).unwrap();
            let fast = FastLinear::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap();
            let x = Tensor::randn(0f32, 1.0, (9, 256), &device).unwrap();
            let all: Vec<Vec<f32>> = fast.forward(&x).unwrap().to_vec2().unwrap();
            for (i, row) in all.iter().enumerate() {
                let one: Vec<Vec<f32>> = fast
                    .forward(&x.narrow(0, i, 1).unwrap())
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                assert_eq!(&one[0], row, "{dtype:?} row {i}");
            }
        }
    }

    /// The AVX-512 VNNI kernels give the AVX2 kernels' bits: Q4_1 and Q8_0, odd and even
    /// block counts, one to four activation rows, and the four-weight decoding path.
    /// Byte values cover the extremes (nibbles 0 and 15, weights ±127 and −128,
    /// activations ±127).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_kernels_equal_the_avx2_ones() {
        if detected_simd() < Simd::Avx512Vnni {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        let device = Device::Cpu;
        for dtype in LEGACY_KINDS {
            for blocks in [1, 2, 3, 18, 19, 48] {
                let k = blocks * QK;
                let w = Tensor::randn(0f32, 1.0, (4, k), &device).unwrap();
                let mut fast =
                    FastLinear::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap();
                // Extreme bytes in the first block of each row.
                for (i, q) in fast.quants.iter_mut().enumerate().take(8) {
                    *q = [0x00, 0xFF, 0x0F, 0xF0, 0x80, 0x7F, 0x81, 0x01][i];
                }
                let x: Vec<f32> = (0..k * 4)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
                    .collect();
                let mut rows: Vec<ActRow> = x
                    .chunks_exact(k)
                    .map(|r| fast.quantize(r).remove(0))
                    .collect();
                rows[0].qs[..4].copy_from_slice(&[127, -127, 0, 127]);
                let weight = |o: usize| fast.weight_row(o);
                for n in 1..=4 {
                    let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
                    #[expect(unsafe_code, reason = "the features were checked above")]
                    // SAFETY: detected_simd() found AVX-512 VNNI, AVX2 and FMA.
                    unsafe {
                        avx512::dot_tile(fast.kind.kernel(), &weight(0), &rows[..n], &mut a[..n]);
                        avx2::dot_tile(fast.kind.kernel(), &weight(0), &rows[..n], &mut b[..n]);
                    }
                    assert_eq!(
                        a.map(f32::to_bits),
                        b.map(f32::to_bits),
                        "{dtype:?}, {blocks} blocks, {n} rows"
                    );
                }
                let ws = [weight(0), weight(1), weight(2), weight(3)];
                let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
                #[expect(unsafe_code, reason = "the features were checked above")]
                // SAFETY: detected_simd() found AVX-512 VNNI, AVX2 and FMA.
                unsafe {
                    avx512::weights4(fast.kind.kernel(), &ws, &rows[0], &mut a);
                    avx2::weights4(fast.kind.kernel(), &ws, &rows[0], &mut b);
                }
                assert_eq!(
                    a.map(f32::to_bits),
                    b.map(f32::to_bits),
                    "{dtype:?}, {blocks} blocks, four weights"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_minimum_term_equals_the_scalar_one() {
        if !std::is_x86_feature_detected!("avx2") || !std::is_x86_feature_detected!("fma") {
            return;
        }
        for n in [1, 7, 8, 18, 23, 48] {
            let m: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.013)
                .collect();
            let s: Vec<f32> = (0..n)
                .map(|i| ((i * 11 % 13) as f32 - 6.0) * 0.77)
                .collect();
            #[expect(unsafe_code, reason = "AVX2 and FMA were checked above")]
            // SAFETY: checked above.
            let simd = unsafe { avx2::mins_dot(&m, &s) };
            assert_eq!(simd.to_bits(), mins_dot(&m, &s).to_bits(), "n = {n}");
        }
    }

    #[test]
    fn magic_rounding_is_round_half_to_even() {
        for i in -2540..=2540 {
            let x = i as f32 / 20.0;
            assert_eq!(round_ties_even(x), x.round_ties_even(), "{x}");
        }
        for x in [
            0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -127.0, 0.49999997, 1e-8,
        ] {
            assert_eq!(round_ties_even(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn attention_is_causal_and_shape_independent() {
        let (heads, kv_heads, hd, s) = (4, 2, 16, 7);
        let f = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0) - 0.5;
        let q: Vec<f32> = (0..s * heads * hd).map(f).collect();
        let k: Vec<f32> = (0..s * kv_heads * hd).map(|i| f(i + 17)).collect();
        let v: Vec<f32> = (0..s * kv_heads * hd).map(|i| f(i + 31)).collect();
        let full = attention(&q, &k, &v, s, heads, kv_heads, hd, 0.25);
        for t in 0..s {
            let kv = (t + 1) * kv_heads * hd;
            let one = attention(
                &q[t * heads * hd..(t + 1) * heads * hd],
                &k[..kv],
                &v[..kv],
                1,
                heads,
                kv_heads,
                hd,
                0.25,
            );
            assert_eq!(
                one,
                full[t * heads * hd..(t + 1) * heads * hd],
                "position {t}"
            );
        }
        // The first position sees only itself: its output is its own value row.
        assert_eq!(&full[..hd], &v[..hd]);
    }
}
