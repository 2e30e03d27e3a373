//! The steps between a layer's matmuls at inference (residual adds, RMS norms, SiLU
//! gating), split across the open team.
//!
//! candle runs these one thread at a time (its pool is sized by `CANDLE_NUM_THREADS`)
//! or on rayon's workers, which wake up beside the team's spinning helpers: in a
//! two-thread prefill they left the helper idle for a fifth of the time. Each element
//! here is computed by candle's own formula, so the values are the same bits as
//! before; only who computes which chunk changes, and no element depends on that.
//! Operands of other types than f32 go to candle's operations.

use candle_core::Tensor;

use super::team;
use crate::error::{ModelError, Result};
use crate::model::with_f32;

/// Elements of an add below which a task is not worth handing out.
const ADD_CHUNK: usize = 1 << 15;

/// Elements of a SiLU gating (an `exp` each) below which a task is not worth handing
/// out: about ten microseconds of work.
const SILU_CHUNK: usize = 1 << 11;

/// Elements of RMS-normed rows below which a task is not worth handing out.
const NORM_CHUNK: usize = 1 << 13;

/// `x + y`, of one shape.
pub fn add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if !all_f32(&[x, y]) {
        return Ok((x + y)?);
    }
    binary(x, y, "residual add", ADD_CHUNK, |a, b| a + b)
}

/// `silu(g) · u` (`silu(v) = v / (1 + e^−v)`, candle's formula), of one shape.
pub fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if !all_f32(&[g, u]) {
        return Ok((candle_nn::ops::silu(g)? * u)?);
    }
    binary(g, u, "SiLU gating", SILU_CHUNK, |g, u| {
        g / (1.0 + (-g).exp()) * u
    })
}

/// RMS norm of each row of `x` (its last dimension) times `w`, as candle's fused
/// kernel computes it: `v / sqrt(Σv²/n + eps) · w`, the squares summed in order.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    if !all_f32(&[x, w]) {
        return Ok(candle_nn::ops::rms_norm(x, w, eps)?);
    }
    let dims = x.dims().to_vec();
    let d = dims.last().copied().unwrap_or(0);
    if w.dims() != [d] {
        return Err(shape_error("RMS norm", x, w));
    }
    let out = with_f32(x, |xs| {
        with_f32(w, |ws| {
            if d == 0 {
                return Vec::new();
            }
            let rows = NORM_CHUNK
                .div_ceil(d)
                .max(xs.len().div_ceil(d * 4 * team::threads()));
            team::collect_chunks(xs.len(), rows * d, |i, chunk| {
                let src = &xs[i * rows * d..][..chunk.len()];
                for (dst, src) in chunk.chunks_exact_mut(d).zip(src.chunks_exact(d)) {
                    let sum2: f32 = src.iter().map(|v| v * v).sum();
                    let m = (sum2 / d as f32 + eps).sqrt();
                    for ((o, s), a) in dst.iter_mut().zip(src).zip(ws) {
                        *o = *s / m * *a;
                    }
                }
            })
        })
    })??;
    Ok(Tensor::from_vec(out, dims, x.device())?)
}

/// `f(x, y)` element by element, in tasks of at least `min_chunk` elements.
fn binary(
    x: &Tensor,
    y: &Tensor,
    what: &str,
    min_chunk: usize,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<Tensor> {
    if x.dims() != y.dims() {
        return Err(shape_error(what, x, y));
    }
    let out = with_f32(x, |xs| {
        with_f32(y, |ys| {
            let chunk = min_chunk.max(xs.len().div_ceil(4 * team::threads()));
            team::collect_chunks(xs.len(), chunk, |i, dst| {
                let at = i * chunk;
                for ((o, &a), &b) in dst.iter_mut().zip(&xs[at..]).zip(&ys[at..]) {
                    *o = f(a, b);
                }
            })
        })
    })??;
    Ok(Tensor::from_vec(out, x.dims(), x.device())?)
}

/// Whether every operand holds f32s (the inference path's activations); others go to
/// candle, which keeps their type.
fn all_f32(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.dtype() == candle_core::DType::F32)
}

fn shape_error(what: &str, x: &Tensor, y: &Tensor) -> ModelError {
    ModelError::BadTensor {
        name: what.to_owned(),
        reason: format!("operands of shapes {:?} and {:?}", x.dims(), y.dims()),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    fn tensor(rows: usize, cols: usize, seed: usize) -> Tensor {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7919 + seed) % 1009) as f32 - 504.0) / 97.0)
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).expect("a tensor")
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// candle's values, bit for bit, at sizes below and above a task's chunk.
    #[test]
    fn they_are_candles_operations() {
        for (rows, cols) in [(1, 24), (3, 576), (64, 2048), (17, 8192)] {
            let (x, y) = (tensor(rows, cols, 1), tensor(rows, cols, 2));
            let w = tensor(1, cols, 3).flatten_all().expect("a vector");
            let want = (&x + &y).expect("candle's add");
            assert_eq!(bits(&add(&x, &y).expect("add")), bits(&want));
            let want = (candle_nn::ops::silu(&x).expect("silu") * &y).expect("a product");
            assert_eq!(bits(&silu_mul(&x, &y).expect("silu_mul")), bits(&want));
            let want = candle_nn::ops::rms_norm(&x, &w, 1e-5).expect("candle's rms norm");
            assert_eq!(
                bits(&rms_norm(&x, &w, 1e-5).expect("rms_norm")),
                bits(&want)
            );
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let (x, y) = (tensor(2, 8, 1), tensor(2, 9, 2));
        let err = add(&x, &y).expect_err("shapes differ").to_string();
        assert!(err.contains("[2, 8]") && err.contains("[2, 9]"), "{err}");
        assert!(rms_norm(&x, &tensor(1, 9, 3).flatten_all().expect("v"), 1e-5).is_err());
    }
}
