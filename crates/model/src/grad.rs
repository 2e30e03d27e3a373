//! The training forward pass's fused operations, each with its own backward pass: RMS
//! norm, rotary embedding, SiLU-gated product, a frozen weight's matrix product, and the
//! attention of a whole batch of sequences (shared prefixes included).
//!
//! Composed from candle's elementwise operations, one layer's attention over a GRPO
//! group was a few hundred small tensors forward and as many backward, each allocated,
//! dispatched and freed; these run each as one pass over plain `f32` slices, and their
//! backward passes are the closed forms. The tests check values and gradients against
//! candle's compositions.

use std::sync::Arc;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail,
};
use rayon::prelude::*;

use crate::config::RopeLayout;
use crate::model::{dot_fixed as dot, with_f32};

/// The contiguous `f32` values of a custom operation's input.
fn values<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        bail!("{op} takes f32 inputs");
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("{op} takes contiguous inputs"),
    }
}

fn f32_contiguous(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::F32)?.contiguous()
}

/// `y += a · x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

// ---------------------------------------------------------------------------------------
// RMS norm

/// `x / √(mean(x²) + ε) · w` over the last dimension, differentiable in `x` and `w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let dtype = x.dtype();
    let y =
        f32_contiguous(x)?.apply_op2_arc(&f32_contiguous(w)?, Arc::new(Box::new(RmsNorm(eps))))?;
    y.to_dtype(dtype)
}

struct RmsNorm(f32);

impl RmsNorm {
    fn inverse_rms(&self, row: &[f32]) -> f32 {
        let sum: f32 = dot(row, row);
        1.0 / (sum / row.len() as f32 + self.0).sqrt()
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = values(xs, xl, self.name())?;
        let w = values(ws, wl, self.name())?;
        let d = w.len();
        if xl.dims().last() != Some(&d) {
            bail!("rms norm of rows {:?} with a weight of {d}", xl.dims());
        }
        let mut y = vec![0f32; x.len()];
        for (row, out) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            let r = self.inverse_rms(row);
            for ((o, v), w) in out.iter_mut().zip(row).zip(w) {
                *o = v * r * w;
            }
        }
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let want_w = w.track_op();
        let (dx, dw) = with_f32(x, |x| {
            with_f32(w, |w| {
                with_f32(grad, |dy| {
                    let mut dx = vec![0f32; x.len()];
                    let mut dw = vec![0f32; if want_w { d } else { 0 }];
                    let mut g = vec![0f32; d];
                    for ((row, dy), dx) in x
                        .chunks_exact(d)
                        .zip(dy.chunks_exact(d))
                        .zip(dx.chunks_exact_mut(d))
                    {
                        let r = self.inverse_rms(row);
                        for ((g, dy), w) in g.iter_mut().zip(dy).zip(w) {
                            *g = dy * w;
                        }
                        // ∂x = r·g − x·r³·(g·x)/d
                        let c = r * r * r * dot(&g, row) / d as f32;
                        for ((dx, g), v) in dx.iter_mut().zip(&g).zip(row) {
                            *dx = r * g - c * v;
                        }
                        if want_w {
                            for ((dw, dy), v) in dw.iter_mut().zip(dy).zip(row) {
                                *dw += dy * v * r;
                            }
                        }
                    }
                    (dx, dw)
                })
            })
        })???;
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        let dw = if want_w {
            Some(Tensor::from_vec(dw, w.shape(), w.device())?)
        } else {
            None
        };
        Ok((Some(dx), dw))
    }
}

// ---------------------------------------------------------------------------------------
// Rotary embedding

/// Rotates one head's pairs by the angles whose cosines and sines are `cos`, `sin`
/// (`−angle` when `inverse`).
pub(crate) fn rotate(
    head: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    layout: RopeLayout,
    inverse: bool,
) {
    let half = head.len() / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    match layout {
        RopeLayout::Interleaved => {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                let s = sign * sin[i];
                head[2 * i] = a * cos[i] - b * s;
                head[2 * i + 1] = a * s + b * cos[i];
            }
        }
        RopeLayout::Halves => {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                let s = sign * sin[i];
                head[i] = a * cos[i] - b * s;
                head[i + half] = a * s + b * cos[i];
            }
        }
    }
}

/// The rotary tables: per position, `head_dim / 2` cosines and sines.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `[positions, head_dim / 2]`.
    pub cos: Arc<[f32]>,
    /// `[positions, head_dim / 2]`.
    pub sin: Arc<[f32]>,
    /// Which elements of a head pair up.
    pub layout: RopeLayout,
}

/// Rotary embedding of `x`, `[rows, heads · head_dim]`, row `i` at position
/// `positions[i]`; differentiable in `x`.
pub fn rope(
    x: &Tensor,
    positions: &[usize],
    head_dim: usize,
    tables: &RopeTables,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let op = Rope {
        positions: positions.to_vec(),
        head_dim,
        tables: tables.clone(),
    };
    f32_contiguous(x)?
        .apply_op1_arc(Arc::new(Box::new(op)))?
        .to_dtype(dtype)
}

struct Rope {
    positions: Vec<usize>,
    head_dim: usize,
    tables: RopeTables,
}

impl Rope {
    fn apply(&self, x: &[f32], inverse: bool) -> Result<Vec<f32>> {
        let rows = self.positions.len();
        if rows == 0
            || !x.len().is_multiple_of(rows)
            || !(x.len() / rows).is_multiple_of(self.head_dim)
        {
            bail!(
                "rope of {} values for {rows} positions of heads of {}",
                x.len(),
                self.head_dim
            );
        }
        let width = x.len() / rows;
        let half = self.head_dim / 2;
        let mut y = x.to_vec();
        for (row, &pos) in y.chunks_exact_mut(width).zip(&self.positions) {
            if (pos + 1) * half > self.tables.cos.len() {
                bail!("rope position {pos} is past the tables");
            }
            let cos = &self.tables.cos[pos * half..(pos + 1) * half];
            let sin = &self.tables.sin[pos * half..(pos + 1) * half];
            for head in row.chunks_exact_mut(self.head_dim) {
                rotate(head, cos, sin, self.tables.layout, inverse);
            }
        }
        Ok(y)
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = self.apply(values(s, l, self.name())?, false)?;
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // A rotation's transpose is the rotation by the opposite angle.
        let dx = with_f32(grad, |g| self.apply(g, true))??;
        Ok(Some(Tensor::from_vec(dx, arg.shape(), arg.device())?))
    }
}

// ---------------------------------------------------------------------------------------
// SiLU-gated product

/// `silu(gate) · up`, differentiable in both.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let dtype = gate.dtype();
    f32_contiguous(gate)?
        .apply_op2_arc(&f32_contiguous(up)?, Arc::new(Box::new(SiluMul)))?
        .to_dtype(dtype)
}

struct SiluMul;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "fused-silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = values(gs, gl, self.name())?;
        let u = values(us, ul, self.name())?;
        if gl.shape() != ul.shape() {
            bail!("silu-mul of {:?} and {:?}", gl.dims(), ul.dims());
        }
        let y = g.iter().zip(u).map(|(&g, &u)| g * sigmoid(g) * u).collect();
        Ok((CpuStorage::F32(y), gl.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = with_f32(gate, |g| {
            with_f32(up, |u| {
                with_f32(grad, |dy| {
                    let mut dg = Vec::with_capacity(g.len());
                    let mut du = Vec::with_capacity(g.len());
                    for ((&g, &u), &dy) in g.iter().zip(u).zip(dy) {
                        let s = sigmoid(g);
                        dg.push(dy * u * s * (1.0 + g * (1.0 - s)));
                        du.push(dy * g * s);
                    }
                    (dg, du)
                })
            })
        })???;
        Ok((
            Some(Tensor::from_vec(dg, gate.shape(), gate.device())?),
            Some(Tensor::from_vec(du, up.shape(), up.device())?),
        ))
    }
}

// ---------------------------------------------------------------------------------------
// A frozen weight's product

/// `x Wᵀ` for `x` `[rows, in]` and a constant `W` `[out, in]` (both f32): the backward
/// pass is `∂x = ∂y W` only, never `W`'s gradient (a second product as large as the
/// first, and a weight-sized buffer, thrown away in LoRA training). The product goes
/// straight from the input's storage into the output's.
pub fn frozen_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op1_arc(Arc::new(Box::new(FrozenMatmul(w.contiguous()?))))
}

struct FrozenMatmul(Tensor);

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = values(s, l, self.name())?;
        let (out, inp) = self.0.dims2()?;
        let dims = l.dims();
        if dims.last() != Some(&inp) {
            bail!("frozen-matmul of {dims:?} by a weight [{out}, {inp}]");
        }
        let rows = x.len() / inp;
        let y = if rows > 0 {
            with_f32(&self.0, |w| times_transposed(x, w, (rows, inp, out)))?
        } else {
            Vec::new()
        };
        let mut shape = dims.to_vec();
        *shape.last_mut().expect("a dimension") = out;
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (out, inp) = self.0.dims2()?;
        let rows = grad.elem_count() / out;
        let mut dx = vec![0f32; rows * inp];
        if rows > 0 {
            with_f32(grad, |g| {
                with_f32(&self.0, |w| {
                    product(
                        &mut dx,
                        inp,
                        Side(g, out, 1),
                        Side(w, inp, 1),
                        (rows, inp, out),
                        None,
                        true,
                    )
                })
            })??;
        }
        Ok(Some(Tensor::from_vec(dx, arg.shape(), arg.device())?))
    }
}

// ---------------------------------------------------------------------------------------
// A frozen weight with a low-rank adapter

/// `x Wᵀ + scale · (x Aᵀ) Bᵀ` for `x` `[rows, in]`, a constant `W` `[out, in]`, and the
/// adapter's `A` `[rank, in]` and `B` `[out, rank]` (all f32): differentiable in `x`,
/// `A` and `B`. One output tensor where candle's composition kept five (the base
/// product, `x Aᵀ`, its product with `Bᵀ`, that scaled, the sum) for the backward
/// pass, each an elementwise pass over `[rows, out]` more; the rank-sized `x Aᵀ` is
/// computed again in the backward pass instead of kept.
pub fn adapted_matmul(
    x: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let op = AdaptedMatmul {
        w: w.contiguous()?,
        scale,
    };
    x.contiguous()?
        .apply_op3_arc(&a.contiguous()?, &b.contiguous()?, Arc::new(Box::new(op)))
}

struct AdaptedMatmul {
    w: Tensor,
    scale: f32,
}

impl AdaptedMatmul {
    /// `(rows, in, out, rank)`, checked against `x`'s, `A`'s and `B`'s element counts.
    fn sizes(&self, x: usize, a: usize, b: usize) -> Result<(usize, usize, usize, usize)> {
        let (out, inp) = self.w.dims2()?;
        let rank = a / inp.max(1);
        if inp == 0
            || out == 0
            || rank == 0
            || a != rank * inp
            || b != out * rank
            || !x.is_multiple_of(inp)
        {
            bail!(
                "adapted-matmul of {x} inputs by a weight [{out}, {inp}] with adapters of {a} and {b}"
            );
        }
        Ok((x / inp, inp, out, rank))
    }
}

/// `x Wᵀ`, `[rows, out]`, for `x` `[rows, inp]` and `W` `[out, inp]`: a frozen
/// weight's product, and the adapter's `x Aᵀ` (its input to `B`) in the forward pass and
/// again in the backward pass.
fn times_transposed(x: &[f32], w: &[f32], (rows, inp, out): (usize, usize, usize)) -> Vec<f32> {
    let mut y = vec![0f32; rows * out];
    product(
        &mut y,
        out,
        Side(x, inp, 1),
        Side(w, 1, inp),
        (rows, out, inp),
        None,
        true,
    );
    y
}

impl CustomOp3 for AdaptedMatmul {
    fn name(&self) -> &'static str {
        "adapted-matmul"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        a_s: &CpuStorage,
        al: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, a, b) = (
            values(xs, xl, self.name())?,
            values(a_s, al, self.name())?,
            values(bs, bl, self.name())?,
        );
        let (rows, inp, out, rank) = self.sizes(x.len(), a.len(), b.len())?;
        if xl.dims().last() != Some(&inp) {
            bail!(
                "adapted-matmul of {:?} by a weight [{out}, {inp}]",
                xl.dims()
            );
        }
        let mut y = Vec::new();
        if rows > 0 {
            y = with_f32(&self.w, |w| times_transposed(x, w, (rows, inp, out)))?;
            // u = x Aᵀ; y += scale · u Bᵀ
            let u = times_transposed(x, a, (rows, inp, rank));
            product(
                &mut y,
                out,
                Side(&u, rank, 1),
                Side(b, 1, rank),
                (rows, out, rank),
                Some(self.scale),
                true,
            );
        }
        let mut shape = xl.dims().to_vec();
        *shape.last_mut().expect("a dimension") = out;
        Ok((CpuStorage::F32(y), Shape::from(shape)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let s = self.scale;
        let (dx, da, db) = with_f32(x, |x| {
            with_f32(a, |a| {
                with_f32(b, |b| {
                    with_f32(grad, |dy| {
                        with_f32(&self.w, |w| -> Result<_> {
                            let (rows, inp, out, rank) = self.sizes(x.len(), a.len(), b.len())?;
                            let mut dx = vec![0f32; rows * inp];
                            let mut da = vec![0f32; rank * inp];
                            let mut db = vec![0f32; out * rank];
                            if rows == 0 {
                                return Ok((dx, da, db));
                            }
                            // ∂y B and x Aᵀ, both [rows, rank]
                            let mut dyb = vec![0f32; rows * rank];
                            product(
                                &mut dyb,
                                rank,
                                Side(dy, out, 1),
                                Side(b, rank, 1),
                                (rows, rank, out),
                                None,
                                true,
                            );
                            let u = times_transposed(x, a, (rows, inp, rank));
                            // ∂x = ∂y W + scale · (∂y B) A
                            product(
                                &mut dx,
                                inp,
                                Side(dy, out, 1),
                                Side(w, inp, 1),
                                (rows, inp, out),
                                None,
                                true,
                            );
                            product(
                                &mut dx,
                                inp,
                                Side(&dyb, rank, 1),
                                Side(a, inp, 1),
                                (rows, inp, rank),
                                Some(s),
                                true,
                            );
                            // ∂A = scale · (∂y B)ᵀ x; ∂B = scale · ∂yᵀ (x Aᵀ)
                            product(
                                &mut da,
                                inp,
                                Side(&dyb, 1, rank),
                                Side(x, inp, 1),
                                (rank, inp, rows),
                                Some(s),
                                true,
                            );
                            product(
                                &mut db,
                                rank,
                                Side(dy, 1, out),
                                Side(&u, rank, 1),
                                (out, rank, rows),
                                Some(s),
                                true,
                            );
                            Ok((dx, da, db))
                        })
                    })
                })
            })
        })??????;
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), x.device())?),
            Some(Tensor::from_vec(da, a.shape(), a.device())?),
            Some(Tensor::from_vec(db, b.shape(), b.device())?),
        ))
    }
}

// ---------------------------------------------------------------------------------------
// Attention

/// One sequence of a batched [`attention`]: its queries are rows
/// `q_start..q_start + n` of `q`; query `t` sees the key rows of `past` (in order),
/// then its own rows `own..=own + t`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionItem {
    /// First query row.
    pub q_start: usize,
    /// Queries (new tokens).
    pub n: usize,
    /// Earlier positions' key rows, as `(first row, rows)` ranges, in position order.
    pub past: Vec<(usize, usize)>,
    /// Key row of the first new token.
    pub own: usize,
}

impl AttentionItem {
    fn keys(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        self.past
            .iter()
            .flat_map(|&(start, len)| start..start + len)
            .chain(self.own..self.own + t + 1)
    }

    fn visible(&self, t: usize) -> usize {
        self.past.iter().map(|&(_, len)| len).sum::<usize>() + t + 1
    }
}

/// The shape of a batched [`attention`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Applied to every score.
    pub scale: f32,
}

/// Causal softmax attention of several sequences at once: `q` `[rows, heads · hd]`, `k`
/// and `v` `[key rows, kv_heads · hd]` (keys after their rotary embedding), what each
/// sequence sees given by `items`. Differentiable in all three; a key row shared by
/// several sequences (a group's prompt) gets the gradient of all of them.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    items: Vec<AttentionItem>,
    shape: AttentionShape,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let op = Attention { items, shape };
    f32_contiguous(q)?
        .apply_op3_arc(
            &f32_contiguous(k)?,
            &f32_contiguous(v)?,
            Arc::new(Box::new(op)),
        )?
        .to_dtype(dtype)
}

struct Attention {
    items: Vec<AttentionItem>,
    shape: AttentionShape,
}

impl Attention {
    fn check(&self, q: usize, k: usize, v: usize) -> Result<()> {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim,
            ..
        } = self.shape;
        if kv_heads == 0
            || heads % kv_heads != 0
            || k != v
            || !q.is_multiple_of(heads * head_dim)
            || !k.is_multiple_of(kv_heads * head_dim)
        {
            bail!(
                "attention of {q} query and {k}/{v} key/value values with {heads}/{kv_heads} heads of {head_dim}"
            );
        }
        let (q_rows, k_rows) = (q / (heads * head_dim), k / (kv_heads * head_dim));
        for item in &self.items {
            let past_end = item.past.iter().map(|&(s, l)| s + l).max().unwrap_or(0);
            if item.q_start + item.n > q_rows || item.own + item.n > k_rows || past_end > k_rows {
                bail!("an attention item {item:?} is outside {q_rows} query and {k_rows} key rows");
            }
        }
        Ok(())
    }

    /// The keys' (or values') rows an item sees, kv head `g` only: `[visible, hd]`,
    /// in position order.
    fn gather(&self, item: &AttentionItem, kv: &[f32], g: usize) -> Vec<f32> {
        let hd = self.shape.head_dim;
        let kv_dim = self.shape.kv_heads * hd;
        let mut out = Vec::with_capacity(item.visible(item.n - 1) * hd);
        for j in item.keys(item.n - 1) {
            out.extend_from_slice(&kv[j * kv_dim + g * hd..j * kv_dim + (g + 1) * hd]);
        }
        out
    }

    /// The softmax probabilities of query rows `rows` of head `h` of an item over the
    /// keys they may see: `[rows.len(), width]`, `width` the last row's visible keys,
    /// each row's invisible keys 0. `keys` is the item's [`Attention::gather`].
    fn probs(
        &self,
        item: &AttentionItem,
        rows: std::ops::Range<usize>,
        h: usize,
        q: &[f32],
        keys: &[f32],
    ) -> (Vec<f32>, usize) {
        let AttentionShape {
            heads,
            head_dim: hd,
            scale,
            ..
        } = self.shape;
        let q_dim = heads * hd;
        let past = item.visible(0) - 1;
        let width = past + rows.end;
        let mut p = vec![0f32; rows.len() * width];
        let q_at = (item.q_start + rows.start) * q_dim + h * hd;
        // S = Q Kᵀ
        product(
            &mut p,
            width,
            Side(&q[q_at..], q_dim, 1),
            Side(keys, 1, hd),
            (rows.len(), width, hd),
            None,
            false,
        );
        for (r, row) in p.chunks_exact_mut(width).enumerate() {
            let (seen, unseen) = row.split_at_mut(past + rows.start + r + 1);
            let max = seen
                .iter()
                .fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
            let mut total = 0f32;
            for s in seen.iter_mut() {
                *s = (*s * scale - max).exp();
                total += *s;
            }
            let inv = 1.0 / total;
            for s in seen.iter_mut() {
                *s *= inv;
            }
            unseen.fill(0.0);
        }
        (p, width)
    }

    /// One item's output for the heads of kv head `g`: `[n, heads / kv_heads · hd]`.
    fn forward_part(
        &self,
        item: &AttentionItem,
        g: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Vec<f32> {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: hd,
            ..
        } = self.shape;
        let groups = heads / kv_heads;
        let (keys, values) = (self.gather(item, k, g), self.gather(item, v, g));
        let width_out = groups * hd;
        let mut out = vec![0f32; item.n * width_out];
        for (i, h) in (g * groups..(g + 1) * groups).enumerate() {
            for start in (0..item.n).step_by(ROW_BLOCK) {
                let rows = start..(start + ROW_BLOCK).min(item.n);
                let (p, width) = self.probs(item, rows.clone(), h, q, &keys);
                // O = P V
                product(
                    &mut out[rows.start * width_out + i * hd..],
                    width_out,
                    Side(&p, width, 1),
                    Side(&values, hd, 1),
                    (rows.len(), hd, width),
                    None,
                    false,
                );
            }
        }
        out
    }

    /// One item's gradients for the heads of kv head `g`: `∂q` `[n, heads / kv_heads ·
    /// hd]`, and `∂k`, `∂v` of its visible key rows `[visible, hd]` (in
    /// [`AttentionItem::keys`] order).
    fn backward_part(
        &self,
        item: &AttentionItem,
        g: usize,
        (q, k, v): (&[f32], &[f32], &[f32]),
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: hd,
            scale,
        } = self.shape;
        let (q_dim, groups) = (heads * hd, heads / kv_heads);
        let (keys, values) = (self.gather(item, k, g), self.gather(item, v, g));
        let width_out = groups * hd;
        let mut dq = vec![0f32; item.n * width_out];
        let mut dk = vec![0f32; keys.len()];
        let mut dv = vec![0f32; values.len()];
        for (i, h) in (g * groups..(g + 1) * groups).enumerate() {
            for start in (0..item.n).step_by(ROW_BLOCK) {
                let rows = start..(start + ROW_BLOCK).min(item.n);
                let n = rows.len();
                let at = (item.q_start + rows.start) * q_dim + h * hd;
                let (p, width) = self.probs(item, rows.clone(), h, q, &keys);
                // ∂P = ∂O Vᵀ; ∂S = P ∘ (∂P − Σⱼ P ∂P) · scale
                let mut ds = vec![0f32; n * width];
                product(
                    &mut ds,
                    width,
                    Side(&dout[at..], q_dim, 1),
                    Side(&values, 1, hd),
                    (n, width, hd),
                    None,
                    false,
                );
                for (d, p) in ds.chunks_exact_mut(width).zip(p.chunks_exact(width)) {
                    let mean: f32 = d.iter().zip(p).map(|(d, p)| d * p).sum();
                    for (d, &p) in d.iter_mut().zip(p) {
                        *d = p * (*d - mean) * scale;
                    }
                }
                // ∂Q = ∂S K
                product(
                    &mut dq[rows.start * width_out + i * hd..],
                    width_out,
                    Side(&ds, width, 1),
                    Side(&keys, hd, 1),
                    (n, hd, width),
                    None,
                    false,
                );
                // ∂K += ∂Sᵀ Q; ∂V += Pᵀ ∂O
                product(
                    &mut dk,
                    hd,
                    Side(&ds, 1, width),
                    Side(&q[at..], q_dim, 1),
                    (width, hd, n),
                    Some(1.0),
                    false,
                );
                product(
                    &mut dv,
                    hd,
                    Side(&p, 1, width),
                    Side(&dout[at..], q_dim, 1),
                    (width, hd, n),
                    Some(1.0),
                    false,
                );
            }
        }
        (dq, dk, dv)
    }

    /// Every `(item, kv head)` pair: the attention's units of parallel work.
    fn parts(&self) -> Vec<(usize, usize)> {
        (0..self.items.len())
            .flat_map(|i| (0..self.shape.kv_heads).map(move |g| (i, g)))
            .collect()
    }

    /// Copies a part's `[n, heads / kv_heads · hd]` rows into `[rows, heads · hd]`.
    fn place(&self, dst: &mut [f32], item: &AttentionItem, g: usize, part: &[f32]) {
        let hd = self.shape.head_dim;
        let q_dim = self.shape.heads * hd;
        let width = part.len() / item.n;
        for (t, row) in part.chunks_exact(width).enumerate() {
            let at = (item.q_start + t) * q_dim + g * width;
            dst[at..at + width].copy_from_slice(row);
        }
    }
}

/// Query rows per block of the attention: a block's scores reach only as far as its
/// last row sees, so little of a long sequence's masked half is computed.
const ROW_BLOCK: usize = 64;

/// A matrix operand: values, row stride, column stride.
struct Side<'a>(&'a [f32], usize, usize);

/// `dst[i·dst_rs + j] = Σₗ lhs[i, l] · rhs[l, j]` for `(m, n, k)`, or with
/// `add = Some(s)`, `dst[…] += s · Σₗ …`; split over rayon's threads when `threads`, on
/// this thread otherwise (each of the attention's parts is one task).
#[expect(
    unsafe_code,
    reason = "gemm takes raw pointers; the bounds are checked"
)]
fn product(
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Side<'_>,
    rhs: Side<'_>,
    (m, n, k): (usize, usize, usize),
    add: Option<f32>,
    threads: bool,
) {
    let last = |rows: usize, rs: usize, cols: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(m > 0 && n > 0 && k > 0);
    assert!(last(m, dst_rs, n, 1) < dst.len() && n <= dst_rs);
    assert!(last(m, lhs.1, k, lhs.2) < lhs.0.len());
    assert!(last(k, rhs.1, n, rhs.2) < rhs.0.len());
    let threads = if threads {
        rayon::current_num_threads()
    } else {
        1
    };
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every element the strides address lies in its slice (checked above), and
    // the rows of `dst` (n ≤ its row stride) do not overlap.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            add.is_some(),
            lhs.0.as_ptr(),
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0.as_ptr(),
            rhs.2 as isize,
            rhs.1 as isize,
            1.0,
            add.unwrap_or(1.0),
            false,
            false,
            false,
            parallelism,
        );
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (
            values(qs, ql, self.name())?,
            values(ks, kl, self.name())?,
            values(vs, vl, self.name())?,
        );
        self.check(q.len(), k.len(), v.len())?;
        let parts = self.parts();
        let outs: Vec<Vec<f32>> = parts
            .par_iter()
            .map(|&(i, g)| self.forward_part(&self.items[i], g, q, k, v))
            .collect();
        let mut out = vec![0f32; q.len()];
        for (&(i, g), part) in parts.iter().zip(&outs) {
            self.place(&mut out, &self.items[i], g, part);
        }
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let hd = self.shape.head_dim;
        let kv_dim = self.shape.kv_heads * hd;
        let (dq, dk, dv) = with_f32(q, |q| {
            with_f32(k, |k| {
                with_f32(v, |v| {
                    with_f32(grad, |dout| {
                        // Per (item, kv head), then summed in that order: the same bits
                        // whatever the threads.
                        let parts = self.parts();
                        let grads: Vec<_> = parts
                            .par_iter()
                            .map(|&(i, g)| self.backward_part(&self.items[i], g, (q, k, v), dout))
                            .collect();
                        let mut dq = vec![0f32; q.len()];
                        let mut dk = vec![0f32; k.len()];
                        let mut dv = vec![0f32; v.len()];
                        for (&(i, g), (pq, pk, pv)) in parts.iter().zip(&grads) {
                            let item = &self.items[i];
                            self.place(&mut dq, item, g, pq);
                            let rows = item.keys(item.n - 1);
                            for ((j, pk), pv) in
                                rows.zip(pk.chunks_exact(hd)).zip(pv.chunks_exact(hd))
                            {
                                let at = j * kv_dim + g * hd;
                                axpy(&mut dk[at..at + hd], 1.0, pk);
                                axpy(&mut dv[at..at + hd], 1.0, pv);
                            }
                        }
                        (dq, dk, dv)
                    })
                })
            })
        })????;
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), q.device())?),
            Some(Tensor::from_vec(dk, k.shape(), k.device())?),
            Some(Tensor::from_vec(dv, v.shape(), v.device())?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device, Var};

    use super::*;

    fn random(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    /// Values and gradients of `fused` and `reference` (both of the given variables)
    /// under a random linear functional of the output, so every output element's
    /// gradient is checked.
    fn same_values_and_gradients(
        vars: &[Var],
        fused: impl Fn(&[Tensor]) -> Tensor,
        reference: impl Fn(&[Tensor]) -> Tensor,
    ) {
        let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let (y, r) = (fused(&xs), reference(&xs));
        close(&y, &r, 1e-5);
        let probe = random(y.dims(), 99);
        let gy = (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gr = (r * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for v in vars {
            close(
                gy.get(v).expect("fused gradient"),
                gr.get(v).expect("reference gradient"),
                1e-4,
            );
        }
    }

    #[test]
    fn rms_norm_matches_candles_composition() {
        let x = Var::from_tensor(&random(&[5, 24], 1)).unwrap();
        let w = Var::from_tensor(&random(&[24], 2)).unwrap();
        same_values_and_gradients(
            &[x, w],
            |t| rms_norm(&t[0], &t[1], 1e-5).unwrap(),
            |t| candle_nn::ops::rms_norm_slow(&t[0], &t[1], 1e-5).unwrap(),
        );
    }

    #[test]
    fn silu_mul_matches_candles_composition() {
        let g = Var::from_tensor(&(random(&[4, 30], 3) * 4.0).unwrap()).unwrap();
        let u = Var::from_tensor(&random(&[4, 30], 4)).unwrap();
        same_values_and_gradients(
            &[g, u],
            |t| silu_mul(&t[0], &t[1]).unwrap(),
            |t| (candle_nn::ops::silu(&t[0]).unwrap() * &t[1]).unwrap(),
        );
    }

    fn tables(layout: RopeLayout, positions: usize, hd: usize) -> (RopeTables, Tensor, Tensor) {
        let half = hd / 2;
        let freqs: Vec<f32> = (0..positions)
            .flat_map(|p| {
                (0..half).map(move |i| p as f32 / 10000f32.powf(2.0 * i as f32 / hd as f32))
            })
            .collect();
        let cos: Vec<f32> = freqs.iter().map(|f| f.cos()).collect();
        let sin: Vec<f32> = freqs.iter().map(|f| f.sin()).collect();
        let t = RopeTables {
            cos: cos.clone().into(),
            sin: sin.clone().into(),
            layout,
        };
        let c = Tensor::from_vec(cos, (positions, half), &Device::Cpu).unwrap();
        let s = Tensor::from_vec(sin, (positions, half), &Device::Cpu).unwrap();
        (t, c, s)
    }

    #[test]
    fn rope_matches_candles_for_both_layouts() {
        let (heads, hd, n, start) = (3, 8, 5, 4);
        for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
            let (t, cos, sin) = tables(layout, 16, hd);
            let x = Var::from_tensor(&random(&[n, heads * hd], 5)).unwrap();
            let positions: Vec<usize> = (start..start + n).collect();
            same_values_and_gradients(
                &[x],
                |v| rope(&v[0], &positions, hd, &t).unwrap(),
                |v| {
                    // candle: [1, heads, n, hd]
                    let x = v[0]
                        .reshape((n, heads, hd))
                        .unwrap()
                        .transpose(0, 1)
                        .unwrap()
                        .unsqueeze(0)
                        .unwrap()
                        .contiguous()
                        .unwrap();
                    let (c, s) = (
                        cos.narrow(0, start, n).unwrap(),
                        sin.narrow(0, start, n).unwrap(),
                    );
                    let y = match layout {
                        RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i_slow(&x, &c, &s),
                        RopeLayout::Halves => candle_nn::rotary_emb::rope_slow(&x, &c, &s),
                    }
                    .unwrap();
                    y.squeeze(0)
                        .unwrap()
                        .transpose(0, 1)
                        .unwrap()
                        .reshape((n, heads * hd))
                        .unwrap()
                },
            );
        }
    }

    #[test]
    fn frozen_matmul_matches_matmul_and_leaves_the_weight_alone() {
        let x = Var::from_tensor(&random(&[7, 33], 6)).unwrap();
        let w = random(&[19, 33], 7);
        same_values_and_gradients(
            &[x],
            |v| frozen_matmul(&v[0], &w).unwrap(),
            |v| v[0].matmul(&w.t().unwrap()).unwrap(),
        );
    }

    /// Attention written out with candle operations, one sequence at a time: keys
    /// `[past rows ; own rows]`, a causal mask on the own part.
    #[test]
    fn adapted_matmul_matches_candles_composition() {
        // 7 rows, in 24, out 20, rank 3; W frozen, gradients for x, A and B.
        let w = random(&[20, 24], 21);
        let x = Var::from_tensor(&random(&[7, 24], 22)).unwrap();
        let a = Var::from_tensor(&random(&[3, 24], 23)).unwrap();
        let b = Var::from_tensor(&random(&[20, 3], 24)).unwrap();
        same_values_and_gradients(
            &[x, a, b],
            |t| adapted_matmul(&t[0], &w, &t[1], &t[2], 0.7).unwrap(),
            |t| {
                let base = t[0].matmul(&w.t().unwrap()).unwrap();
                let low = t[0]
                    .matmul(&t[1].t().unwrap())
                    .unwrap()
                    .matmul(&t[2].t().unwrap())
                    .unwrap();
                (base + (low * 0.7).unwrap()).unwrap()
            },
        );
        let err = adapted_matmul(
            &random(&[2, 5], 1),
            &w,
            &random(&[3, 24], 2),
            &random(&[20, 3], 3),
            1.0,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("adapted-matmul"), "{err}");
    }

    fn reference_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        items: &[AttentionItem],
        s: AttentionShape,
    ) -> Tensor {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: hd,
            scale,
        } = s;
        let groups = heads / kv_heads;
        let mut outs = Vec::new();
        for item in items {
            let rows: Vec<u32> = item.keys(item.n - 1).map(|j| j as u32).collect();
            let index = Tensor::new(rows.as_slice(), &Device::Cpu).unwrap();
            let (kk, vv) = (
                k.index_select(&index, 0).unwrap(),
                v.index_select(&index, 0).unwrap(),
            );
            let len = rows.len();
            let past = len - item.n;
            let qq = q.narrow(0, item.q_start, item.n).unwrap();
            let mut heads_out = Vec::new();
            for h in 0..heads {
                let g = h / groups;
                let qh = qq.narrow(1, h * hd, hd).unwrap();
                let kh = kk.narrow(1, g * hd, hd).unwrap();
                let vh = vv.narrow(1, g * hd, hd).unwrap();
                let scores = (qh.matmul(&kh.t().unwrap()).unwrap() * f64::from(scale)).unwrap();
                let mask: Vec<f32> = (0..item.n)
                    .flat_map(|t| {
                        (0..len).map(move |j| if j > past + t { f32::NEG_INFINITY } else { 0.0 })
                    })
                    .collect();
                let mask = Tensor::from_vec(mask, (item.n, len), &Device::Cpu).unwrap();
                let p = candle_nn::ops::softmax(&(scores + mask).unwrap(), D::Minus1).unwrap();
                heads_out.push(p.matmul(&vh.contiguous().unwrap()).unwrap());
            }
            outs.push(Tensor::cat(&heads_out, 1).unwrap());
        }
        Tensor::cat(&outs, 0).unwrap()
    }

    #[test]
    fn batched_attention_with_a_shared_prefix_matches_candles_per_sequence() {
        // A 4-row prompt (key rows 0..4) shared by three continuations of 3, 1 and 2
        // tokens (key rows 4.., query rows 0..6), and a fourth sequence with no past
        // whose own keys sit past the others'; grouped-query (4 heads on 2).
        let shape = AttentionShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            scale: 0.35,
        };
        let items = vec![
            AttentionItem {
                q_start: 0,
                n: 3,
                past: vec![(0, 4)],
                own: 4,
            },
            AttentionItem {
                q_start: 3,
                n: 1,
                past: vec![(0, 4)],
                own: 7,
            },
            AttentionItem {
                q_start: 4,
                n: 2,
                past: vec![(0, 2), (2, 2)],
                own: 8,
            },
            AttentionItem {
                q_start: 6,
                n: 3,
                past: vec![],
                own: 10,
            },
        ];
        let q = Var::from_tensor(&random(&[9, 32], 8)).unwrap();
        let k = Var::from_tensor(&random(&[13, 16], 9)).unwrap();
        let v = Var::from_tensor(&random(&[13, 16], 10)).unwrap();
        same_values_and_gradients(
            &[q, k, v],
            |t| attention(&t[0], &t[1], &t[2], items.clone(), shape).unwrap(),
            |t| reference_attention(&t[0], &t[1], &t[2], &items, shape),
        );
    }

    /// Items longer than a block of query rows: a shared prompt, two continuations of
    /// more than two blocks and one of exactly one, grouped-query (6 heads on 2).
    #[test]
    fn long_items_match_candles_attention_across_row_blocks() {
        let shape = AttentionShape {
            heads: 6,
            kv_heads: 2,
            head_dim: 8,
            scale: 0.3,
        };
        let (prompt, a, b, c) = (5, 2 * ROW_BLOCK + 7, ROW_BLOCK, ROW_BLOCK + 1);
        let items = vec![
            AttentionItem {
                q_start: 0,
                n: a,
                past: vec![(0, prompt)],
                own: prompt,
            },
            AttentionItem {
                q_start: a,
                n: b,
                past: vec![(0, prompt)],
                own: prompt + a,
            },
            AttentionItem {
                q_start: a + b,
                n: c,
                past: vec![],
                own: prompt + a + b,
            },
        ];
        let rows = a + b + c;
        let q = Var::from_tensor(&random(&[rows, 48], 11)).unwrap();
        let k = Var::from_tensor(&random(&[prompt + rows, 16], 12)).unwrap();
        let v = Var::from_tensor(&random(&[prompt + rows, 16], 13)).unwrap();
        same_values_and_gradients(
            &[q, k, v],
            |t| attention(&t[0], &t[1], &t[2], items.clone(), shape).unwrap(),
            |t| reference_attention(&t[0], &t[1], &t[2], &items, shape),
        );
    }

    #[test]
    fn malformed_attention_items_are_refused() {
        let shape = AttentionShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 0.5,
        };
        let (q, k) = (random(&[2, 8], 1), random(&[2, 4], 2));
        let items = vec![AttentionItem {
            q_start: 0,
            n: 2,
            past: vec![(0, 3)],
            own: 0,
        }];
        let err = attention(&q, &k, &k, items, shape).unwrap_err().to_string();
        assert!(err.contains("outside"), "{err}");
    }
}
