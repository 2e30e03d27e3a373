//! Causal attention of new queries against a sequence's cached keys and values, for
//! inference (training's differentiable attention is `grad`'s).
//!
//! Each query and head is computed alone: its scores (query · key, eight keys at a
//! time), their softmax, and the probability-weighted sum of the value rows. A task
//! of the parallel region is one query's heads that share a key-value head, of any
//! sequence of the batch ([`attention_batch`]). Every output
//! element is computed in one fixed order whatever the number of queries, threads or
//! the SIMD family, so a position attends to the same bits in a prefill, a decode step
//! or a batch:
//! - a score sums eight lanes over the head's dimensions (lane `l` takes the products
//!   of dimensions `l mod 8`; a product is rounded, then added), the lanes then in the
//!   tree `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, and any dimensions past
//!   the last eight one by one;
//! - an output element adds the value rows' products in key order.
//!
//! The AVX2 build runs eight keys' lanes in eight registers and sums their trees with
//! two rounds of horizontal adds (`vhaddps` pairs adjacent lanes, as the tree does), and
//! keeps up to 64 output elements in registers across all keys; the baseline does the
//! same arithmetic one number at a time.

use super::team;
#[cfg(target_arch = "x86_64")]
use super::{Simd, simd};

/// Causal attention of `n` new queries against a sequence's keys and values.
///
/// `q` is `[n, heads·hd]` (rotary already applied), `k` and `v` are `[s, kv_heads·hd]`
/// with the new positions last (`s ≥ n`): query `t` sees keys `0..=s−n+t`. Returns
/// `[n, heads·hd]`, each row the same bits whatever `n` is (see the module's
/// documentation).
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
    attention_batch(&[Queries { q, k, v, n }], heads, kv_heads, hd, scale)
}

/// One sequence's part of [`attention_batch`]: its `n` new queries `q`
/// (`[n, heads·hd]`) and its keys and values `k`, `v` (`[s, kv_heads·hd]`, the new
/// positions last).
#[derive(Debug, Clone, Copy)]
pub struct Queries<'a> {
    /// The new queries, rotary applied.
    pub q: &'a [f32],
    /// Every key of the sequence, the new ones last.
    pub k: &'a [f32],
    /// Every value of the sequence, the new ones last.
    pub v: &'a [f32],
    /// How many queries are new.
    pub n: usize,
}

/// [`attention`] of several sequences in one parallel region: the outputs of each in
/// turn, `[Σ n, heads·hd]`, each row the same bits as alone. A task is one query's
/// heads that share a key-value head, so the keys and values it reads for the first
/// of them are in cache for the others; a batch of decoding sequences is one region per
/// layer rather than one per sequence.
pub fn attention_batch(
    items: &[Queries<'_>],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    let wide = simd() >= Simd::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    all(&shapes(items, heads, kv_heads, hd, scale), wide)
}

/// Each sequence's [`Attend`] with the layer's shape.
fn shapes<'a>(
    items: &[Queries<'a>],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    scale: f32,
) -> Vec<Attend<'a>> {
    items
        .iter()
        .map(|it| Attend {
            q: it.q,
            k: it.k,
            v: it.v,
            n: it.n,
            heads,
            kv_heads,
            hd,
            scale,
        })
        .collect()
}

/// Multiply-adds of one call's scores and sums at which its heads are split across the
/// team: a parallel region costs a few microseconds, a decode step's attention of a
/// small model's layer a few dozen at a few hundred positions.
const PARALLEL_WORK: usize = 1 << 15;

/// Every query and head of every shape (all of one model's layer: the same heads and
/// head size), each computed by [`Attend::one`]; `wide` runs its AVX2 build.
fn all(shapes: &[Attend<'_>], wide: bool) -> Vec<f32> {
    let Some(first) = shapes.first() else {
        return Vec::new();
    };
    let (heads, kv_heads, hd) = (first.heads, first.kv_heads, first.hd);
    // The query heads that share a key-value head are next to each other.
    let group = heads / kv_heads.max(1);
    // Each query row of each shape, as (shape, row), and the work of them all.
    let mut rows = Vec::new();
    let mut work = 0;
    for (i, shape) in shapes.iter().enumerate() {
        let s = shape.k.len() / (kv_heads * hd).max(1);
        rows.extend((0..shape.n).map(|t| (i, t)));
        work += shape.n * heads * s * hd;
    }
    // A unit of work is one query's heads that share a key-value head when there are
    // enough of them to keep the team busy, else one head.
    let unit_heads =
        if heads.is_multiple_of(kv_heads.max(1)) && rows.len() * kv_heads >= 4 * team::threads() {
            group
        } else {
            1
        };
    let per_row = heads / unit_heads;
    let units = rows.len() * per_row;
    // Units per task: one each when the call is worth splitting, all of them in one
    // task otherwise.
    let per = if work >= PARALLEL_WORK {
        1
    } else {
        units.max(1)
    };
    team::collect_chunks(
        rows.len() * heads * hd,
        per * unit_heads * hd,
        |task, dst| {
            for (u, dst) in dst.chunks_mut(unit_heads * hd).enumerate() {
                let unit = task * per + u;
                let (i, t) = rows[unit / per_row];
                let first = unit % per_row * unit_heads;
                for (j, dst) in dst.chunks_mut(hd).enumerate() {
                    shapes[i].one_any(wide, t, first + j, dst);
                }
            }
        },
    )
}

/// One attention call's inputs and shape.
pub(super) struct Attend<'a> {
    pub(super) q: &'a [f32],
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    pub(super) n: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) hd: usize,
    pub(super) scale: f32,
}

impl Attend<'_> {
    /// Every query and head, each computed by [`Self::one`]; `wide` runs its AVX2 build.
    #[cfg(test)]
    pub(super) fn all(&self, wide: bool) -> Vec<f32> {
        all(std::slice::from_ref(self), wide)
    }

    /// Query `t`, head `h` into `dst`, with the AVX2 kernels when `wide`.
    #[inline]
    fn one_any(&self, wide: bool, t: usize, h: usize, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if wide {
            #[expect(unsafe_code, reason = "the CPU was checked for AVX2 and FMA")]
            // SAFETY: `wide` only when simd() found AVX2 and FMA.
            unsafe {
                self.one_avx2(t, h, dst)
            };
            return;
        }
        let _ = wide;
        self.one::<false>(t, h, dst);
    }

    /// [`Self::one`] with AVX2 kernels for its scores and sums.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[expect(unsafe_code, reason = "a target-feature function")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn one_avx2(&self, t: usize, h: usize, dst: &mut [f32]) {
        self.one::<true>(t, h, dst);
    }

    /// Query `t`, head `h` into `dst`; `WIDE` (only from [`Self::one_avx2`]) uses the
    /// AVX2 kernels, the same bits.
    #[inline(always)]
    fn one<const WIDE: bool>(&self, t: usize, h: usize, dst: &mut [f32]) {
        let (hd, q_dim, kv_dim) = (self.hd, self.heads * self.hd, self.kv_heads * self.hd);
        let s = self.k.len() / kv_dim.max(1);
        let start = s - self.n;
        let g = h / (self.heads / self.kv_heads);
        let qrow = &self.q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
        let visible = start + t + 1;
        let krow = |j: usize| &self.k[j * kv_dim + g * hd..j * kv_dim + (g + 1) * hd];
        let mut scores = vec![0f32; visible];
        let mut done = 0;
        if hd.is_multiple_of(8) {
            for (c, out) in scores.chunks_exact_mut(8).enumerate() {
                let keys: [&[f32]; 8] = std::array::from_fn(|i| krow(8 * c + i));
                let dots = dot8::<WIDE>(qrow, keys);
                for (o, d) in out.iter_mut().zip(dots) {
                    *o = d * self.scale;
                }
            }
            done = visible / 8 * 8;
        }
        for (j, o) in scores.iter_mut().enumerate().skip(done) {
            *o = dot(qrow, krow(j)) * self.scale;
        }
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut total = 0f32;
        for score in &mut scores {
            *score = (*score - max).exp();
            total += *score;
        }
        let inv = 1.0 / total;
        for p in &mut scores {
            *p *= inv;
        }
        let vals = &self.v[g * hd..];
        #[cfg(target_arch = "x86_64")]
        if WIDE && hd.is_multiple_of(8) {
            #[expect(unsafe_code, reason = "AVX2 intrinsics")]
            // SAFETY: WIDE only runs inside `one_avx2` (AVX2 checked); row `j` of the
            // values starts at `j·kv_dim` of `vals` and the last visible one ends within
            // it (`visible ≤ s`, `g·hd + hd ≤ kv_dim`).
            unsafe {
                avx2::weighted_sum(&scores, vals, kv_dim, dst)
            };
            return;
        }
        dst.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            for (o, &x) in dst.iter_mut().zip(&vals[j * kv_dim..j * kv_dim + hd]) {
                *o += p * x;
            }
        }
    }
}

/// [`dot`] of `a` with each of eight vectors of its length (a multiple of 8).
#[inline(always)]
fn dot8<const WIDE: bool>(a: &[f32], b: [&[f32]; 8]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if WIDE {
        #[expect(unsafe_code, reason = "AVX2 intrinsics")]
        // SAFETY: WIDE only inside `one_avx2` (AVX2 checked); `dot8` checks the lengths.
        return unsafe { avx2::dot8(a, b) };
    }
    b.map(|b| dot(a, b))
}

/// A dot product: eight lanes, summed in the module's tree, then the rest of the
/// dimensions in order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[expect(unsafe_code, reason = "AVX2 intrinsics")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::dot`] of `a` with eight vectors at once, bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot8(a: &[f32], b: [&[f32]; 8]) -> [f32; 8] {
        let n = a.len();
        assert!(n.is_multiple_of(8) && b.iter().all(|b| b.len() == n));
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..n).step_by(8) {
            // SAFETY: `c + 8 ≤ n`, the length of every vector.
            unsafe {
                let x = _mm256_loadu_ps(a.as_ptr().add(c));
                for (acc, b) in acc.iter_mut().zip(&b) {
                    let y = _mm256_loadu_ps(b.as_ptr().add(c));
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
                }
            }
        }
        // hadd(u, v) = [u0+u1, u2+u3, v0+v1, v2+v3 | u4+u5, u6+u7, v4+v5, v6+v7].
        let h01 = _mm256_hadd_ps(acc[0], acc[1]);
        let h23 = _mm256_hadd_ps(acc[2], acc[3]);
        let h45 = _mm256_hadd_ps(acc[4], acc[5]);
        let h67 = _mm256_hadd_ps(acc[6], acc[7]);
        // Vector i's (l0+l1)+(l2+l3) in element i of the low half (keys 0-3) and its
        // (l4+l5)+(l6+l7) in element i of the high half.
        let q0 = _mm256_hadd_ps(h01, h23);
        let q1 = _mm256_hadd_ps(h45, h67);
        let low = _mm256_permute2f128_ps::<0x20>(q0, q1);
        let high = _mm256_permute2f128_ps::<0x31>(q0, q1);
        let mut out = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(low, high)) };
        out
    }

    /// `dst = Σ_j p_j · vals[j·stride..][..dst.len()]` in key order, each product
    /// rounded and then added (the baseline's arithmetic), up to 64 elements held in
    /// registers across all keys.
    ///
    /// # Safety
    /// The CPU must support AVX2; `dst.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum(p: &[f32], vals: &[f32], stride: usize, dst: &mut [f32]) {
        let hd = dst.len();
        assert!(hd.is_multiple_of(8));
        if let Some(last) = p.len().checked_sub(1) {
            assert!(last * stride + hd <= vals.len());
        }
        for (c, out) in dst.chunks_mut(64).enumerate() {
            let base = 64 * c;
            // SAFETY: AVX2 is enabled here; the last row holds `base + 8R ≤ hd` elements
            // (checked above), so every row does.
            unsafe {
                match out.len() / 8 {
                    8 => sum_into::<8>(p, vals, stride, base, out),
                    7 => sum_into::<7>(p, vals, stride, base, out),
                    6 => sum_into::<6>(p, vals, stride, base, out),
                    5 => sum_into::<5>(p, vals, stride, base, out),
                    4 => sum_into::<4>(p, vals, stride, base, out),
                    3 => sum_into::<3>(p, vals, stride, base, out),
                    2 => sum_into::<2>(p, vals, stride, base, out),
                    _ => sum_into::<1>(p, vals, stride, base, out),
                }
            }
        }
    }

    /// `R·8` elements of [`weighted_sum`] from `base`, in `R` registers.
    ///
    /// # Safety
    /// The CPU must support AVX2; row `j`'s elements `base..base + 8R` (at
    /// `j·stride + base`) lie within `vals` for every `j < p.len()`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn sum_into<const R: usize>(
        p: &[f32],
        vals: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
    ) {
        assert_eq!(out.len(), 8 * R);
        let mut acc = [_mm256_setzero_ps(); R];
        for (j, &pj) in p.iter().enumerate() {
            let pj = _mm256_set1_ps(pj);
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: within row j's elements, as the caller promised.
                let x = unsafe { _mm256_loadu_ps(vals.as_ptr().add(j * stride + base + 8 * r)) };
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(pj, x));
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // SAFETY: `out` holds 8R floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * r), *acc) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::cpu_has;
    use super::super::{Simd, detected_simd};
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed) % 1009) as f32 - 504.0) / 97.0)
            .collect()
    }

    #[test]
    fn the_avx2_build_gives_the_baselines_bits() {
        if !cpu_has(Simd::Avx2) {
            return;
        }
        for (n, s, heads, kv_heads, hd) in [
            (1, 37, 9, 3, 64),
            (7, 7, 4, 4, 20),
            (5, 300, 8, 2, 64),
            (3, 70, 4, 2, 128),
            (2, 19, 2, 1, 72),
            (1, 8, 2, 2, 8),
        ] {
            let q = values(n * heads * hd, 1);
            let k = values(s * kv_heads * hd, 2);
            let v = values(s * kv_heads * hd, 3);
            let shape = Attend {
                q: &q,
                k: &k,
                v: &v,
                n,
                heads,
                kv_heads,
                hd,
                scale: 0.125,
            };
            let (base, wide) = (shape.all(false), shape.all(true));
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&wide),
                bits(&base),
                "n {n}, s {s}, heads {heads}/{kv_heads}, hd {hd}"
            );
        }
    }

    /// Several sequences in one call (decoding ones and a prompt, grouped heads and
    /// not) give each the same bits as alone, on both builds.
    #[test]
    fn a_batch_gives_each_sequence_its_bits_alone() {
        let (heads, kv_heads, hd) = (9, 3, 64);
        let sizes = [(1, 37), (1, 120), (6, 6), (1, 9), (3, 300), (1, 1)];
        /// One sequence's queries, keys, values and new positions.
        type Sequence = (Vec<f32>, Vec<f32>, Vec<f32>, usize);
        let data: Vec<Sequence> = sizes
            .iter()
            .enumerate()
            .map(|(i, &(n, s))| {
                (
                    values(n * heads * hd, 10 + i),
                    values(s * kv_heads * hd, 20 + i),
                    values(s * kv_heads * hd, 30 + i),
                    n,
                )
            })
            .collect();
        let items: Vec<Queries<'_>> = data
            .iter()
            .map(|(q, k, v, n)| Queries { q, k, v, n: *n })
            .collect();
        let simds: &[bool] = if detected_simd() >= Simd::Avx2 {
            &[false, true]
        } else {
            &[false]
        };
        for &wide in simds {
            for count in [1, 2, sizes.len()] {
                let shaped = shapes(&items[..count], heads, kv_heads, hd, 0.125);
                let together = all(&shaped, wide);
                let mut at = 0;
                for (i, shape) in shaped.iter().enumerate() {
                    let alone = shape.all(wide);
                    assert_eq!(
                        together[at..at + alone.len()]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                        alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "sequence {i} of {count}, wide {wide}"
                    );
                    at += alone.len();
                }
                assert_eq!(at, together.len());
            }
        }
        assert!(attention_batch(&[], heads, kv_heads, hd, 0.125).is_empty());
    }

    /// Softmax-weighted values, as the definition computes them in f64.
    #[test]
    fn it_is_softmax_attention() {
        let (n, s, heads, kv_heads, hd) = (3, 45, 4, 2, 64);
        let q = values(n * heads * hd, 5);
        let k = values(s * kv_heads * hd, 6);
        let v = values(s * kv_heads * hd, 7);
        let scale = 0.05;
        let got = attention(&q, &k, &v, n, heads, kv_heads, hd, scale);
        let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
        for t in 0..n {
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                let visible = s - n + t + 1;
                let logits: Vec<f64> = (0..visible)
                    .map(|j| {
                        (0..hd)
                            .map(|d| {
                                f64::from(q[t * q_dim + h * hd + d])
                                    * f64::from(k[j * kv_dim + g * hd + d])
                            })
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..hd {
                    let want: f64 = (0..visible)
                        .map(|j| weights[j] / total * f64::from(v[j * kv_dim + g * hd + d]))
                        .sum();
                    let at = t * q_dim + h * hd + d;
                    assert!(
                        (f64::from(got[at]) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "query {t}, head {h}, element {d}: {} vs {want}",
                        got[at]
                    );
                }
            }
        }
    }

    #[test]
    fn it_is_causal_and_shape_independent() {
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
