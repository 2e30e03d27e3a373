//! Q4_K and Q6_K weights repacked for SIMD, sixteen weight rows at a time.
//!
//! A file stores each weight row's super-blocks one after the other, so a kernel that
//! reads it as it is multiplies one row at a time and has to sum each row's products
//! across vector lanes and apply each sub-block's scale separately. Here sixteen rows
//! (a *group*) are interleaved instead, as ik_llama.cpp's run-time repacking does: for
//! every four consecutive values of a super-block, the group's sixteen rows' four weight
//! bytes lie side by side, one 32-bit lane per row. Four activation bytes broadcast to
//! every lane then give all sixteen rows' partial sums in one multiply-add, a sub-block
//! scale is one lane-wise multiplication, and the output of lane `l` is row `l`'s: no
//! sum across lanes is ever needed.
//!
//! The arithmetic per output is the one of the per-row scalar kernel, whatever the
//! instruction set: a super-block's sums are exact integers (their order does not
//! matter), then one float step per super-block ([`q4k_step`], [`q6k_step`]) in the
//! same order, lane by lane. So the scalar, AVX2 and AVX-512 kernels give the same bits,
//! and an output never depends on how many activation rows came with it.
//!
//! Layout per group and super-block (`gs = group·nb + b`; padding rows past the weight's
//! last are zeros):
//! - Q4_K: `quants[gs·2048..]` as `[chunk i: 4][step t: 8][lane: 16][4 bytes]`, the
//!   file's bytes `32i + 4t .. 32i + 4t + 4` of the lane's row: low nibbles are values
//!   `64i + 4t..` (sub-block `2i`), high nibbles values `64i + 32 + 4t..` (sub-block
//!   `2i + 1`). `small[gs·256..]`: the 8 scales as `[j][lane]`, then the 8 minimums as
//!   `[pair p: 4][lane][2]` (minimums `2p`, `2p + 1`). `d`, `dmin`: `[gs·16 + lane]`.
//! - Q5_K: Q4_K's, plus `high[gs·512..]` as `[chunk i][step t][lane]`, one byte of fifth
//!   bits each (bit `k` for the low nibble's value `k`, bit `4 + k` for the high one's).
//! - Q6_K (212 bytes per row and super-block, the file's 210 plus f32 `d`):
//!   `quants[gs·2048..]` as `[step s = 4·g8 + t: 32][lane][4 bytes]`, low nibbles the
//!   low 4 bits of values `16·g8 + 4t..` (group `g8`), high nibbles those of group
//!   `g8 + 8`; `high[gs·1024..]` as `[step][lane][2 bytes]`, the top two bits of the
//!   four low-nibble values (bits `2k..2k + 2` of the first byte) and of the four
//!   high-nibble values (the second). `small[gs·256..]`: the 16 signed scales as
//!   `[g][lane]`. `d`: `[gs·16 + lane]`. The weight is the unsigned 6 bits minus 32.

use half::f16;
use rayon::prelude::*;

use super::memory::Weights;
use super::{
    ActRow, K_SUMS, QK_K, ROW_TILE, per_group, q4k_step, q6k_step, unpack_q4k_scales, word_at,
};

mod lowk;

/// Weight rows per group: one 32-bit lane each in a 512-bit register.
pub(super) const LANES: usize = 16;
/// Bytes of quants per group and super-block.
const Q4K_QUANTS: usize = 128 * LANES;
const Q6K_QUANTS: usize = 128 * LANES;
/// Bytes of scales (and minimums) per group and super-block.
const SMALL: usize = 16 * LANES;
/// Bytes of Q5_K's fifth bits per group and super-block.
const HIGH: usize = 32 * LANES;
/// Bytes of Q6_K's top two bits per group and super-block.
const HIGH6: usize = 64 * LANES;
/// How far ahead of its loads, in bytes of packed quants, a SIMD kernel asks for the
/// cache line it will read (one prefetch per 64 bytes, at the line's first read): a
/// group's super-blocks, and the groups, follow each other, so decode streams the quants
/// front to back; the blocks-of-32 kernels' distance (`packed32.rs`). The high-bit arrays
/// (Q3_K, Q5_K, Q6_K: a half or a quarter of the quants' size) are not prefetched:
/// doing so measured no faster in decode and made Q6_K's 64-row prefill 1.4x slower.
/// Only the one-row kernels (decode) prefetch: in the four-row ones (prefill) it made
/// Q5_K's 64-row product 2.5x slower and gained nothing elsewhere; 2-3 rows unmeasured.
const PREFETCH: usize = 16 << 10;

/// Which K-quant a [`KPacked`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KType {
    /// 2-bit quants, 4-bit scales and minimums per 16 values (`lowk.rs`).
    Q2K,
    /// 2-bit quants plus a high bit, 6-bit signed scales per 16 values (`lowk.rs`).
    Q3K,
    Q4K,
    /// Q4_K's layout plus one high bit per value ([`KPacked`]'s `high`).
    Q5K,
    Q6K,
}

impl KType {
    /// Bytes of one super-block in a file.
    fn block_bytes(self) -> usize {
        match self {
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    fn quant_bytes(self) -> usize {
        match self {
            Self::Q2K | Self::Q3K => lowk::QUANTS,
            Self::Q4K | Self::Q5K => Q4K_QUANTS,
            Self::Q6K => Q6K_QUANTS,
        }
    }
}

/// A K-quant weight `[out, in]` repacked in groups of [`LANES`] rows (see the module
/// docs for the layout).
#[derive(Debug)]
pub(super) struct KPacked {
    pub(super) ty: KType,
    /// Super-blocks per row.
    pub(super) nb: usize,
    pub(super) groups: usize,
    quants: Weights,
    small: Weights,
    d: Weights<f32>,
    /// Q4_K and Q5_K.
    dmin: Weights<f32>,
    /// Q5_K only: the fifth bits, `[chunk i: 4][step t: 8][lane: 16]` one byte each:
    /// bit `k` for value `64i + 4t + k`, bit `4 + k` for value `64i + 32 + 4t + k`.
    high: Weights,
}

/// One group's buffers for one super-block.
struct Block<'a> {
    quants: &'a [u8],
    small: &'a [u8],
    d: &'a [f32],
    dmin: &'a [f32],
    high: &'a [u8],
}

/// One group's slots of every [`KPacked`] array, to fill.
struct GroupMut<'a> {
    quants: &'a mut [u8],
    small: &'a mut [u8],
    d: &'a mut [f32],
    dmin: &'a mut [f32],
    high: &'a mut [u8],
}

impl KPacked {
    /// Repacks the file's bytes of a `[out, in]` weight (`in` a multiple of 256).
    pub(super) fn pack(ty: KType, data: &[u8], out: usize, nb: usize) -> Self {
        let groups = out.div_ceil(LANES);
        let slots = groups * nb;
        let mut p = Self {
            ty,
            nb,
            groups,
            quants: Weights::zeroed(slots * ty.quant_bytes()),
            small: Weights::zeroed(slots * SMALL),
            d: Weights::zeroed(slots * LANES),
            dmin: Weights::zeroed(if matches!(ty, KType::Q3K | KType::Q6K) {
                0
            } else {
                slots * LANES
            }),
            high: match ty {
                KType::Q2K | KType::Q4K => Weights::default(),
                KType::Q3K | KType::Q5K => Weights::zeroed(slots * HIGH),
                KType::Q6K => Weights::zeroed(slots * HIGH6),
            },
        };
        let half_at =
            |block: &[u8], i: usize| f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
        let bb = ty.block_bytes();
        let parts = (
            per_group(&mut p.quants, groups),
            per_group(&mut p.small, groups),
            per_group(&mut p.d, groups),
            per_group(&mut p.dmin, groups),
            per_group(&mut p.high, groups),
        );
        parts
            .into_par_iter()
            .enumerate()
            .for_each(|(g, (quants, small, d, dmin, high))| {
                let grp = GroupMut {
                    quants,
                    small,
                    d,
                    dmin,
                    high,
                };
                for o in g * LANES..out.min((g + 1) * LANES) {
                    let lane = o % LANES;
                    for b in 0..nb {
                        let block = &data[(o * nb + b) * bb..(o * nb + b + 1) * bb];
                        let gs = b;
                        let q = &mut grp.quants[gs * ty.quant_bytes()..(gs + 1) * ty.quant_bytes()];
                        let small = &mut grp.small[gs * SMALL..(gs + 1) * SMALL];
                        match ty {
                            KType::Q2K | KType::Q3K => {
                                let high = match ty {
                                    KType::Q3K => &mut grp.high[gs * HIGH..(gs + 1) * HIGH],
                                    _ => &mut [],
                                };
                                let (d, dmin) = Self::pack_low(ty, block, lane, (q, small, high));
                                grp.d[gs * LANES + lane] = d;
                                if ty == KType::Q2K {
                                    grp.dmin[gs * LANES + lane] = dmin;
                                }
                            }
                            KType::Q4K | KType::Q5K => {
                                grp.d[gs * LANES + lane] = half_at(block, 0);
                                grp.dmin[gs * LANES + lane] = half_at(block, 2);
                                let packed: &[u8; 12] = block[4..16].try_into().expect("12 bytes");
                                let sub = unpack_q4k_scales(packed);
                                for j in 0..8 {
                                    small[j * LANES + lane] = sub[j];
                                }
                                for pair in 0..4 {
                                    for e in 0..2 {
                                        small[128 + (pair * LANES + lane) * 2 + e] =
                                            sub[8 + 2 * pair + e];
                                    }
                                }
                                // Q5_K: 32 bytes of fifth bits before the nibbles; value l of chunk
                                // i takes bit 2i (low nibbles) or 2i + 1 (high) of byte l.
                                let (qh, qs) = if ty == KType::Q5K {
                                    (&block[16..48], &block[48..176])
                                } else {
                                    (&block[..0], &block[16..144])
                                };
                                for i in 0..4 {
                                    for t in 0..8 {
                                        let at = ((i * 8 + t) * LANES + lane) * 4;
                                        q[at..at + 4].copy_from_slice(
                                            &qs[32 * i + 4 * t..32 * i + 4 * t + 4],
                                        );
                                        if ty == KType::Q5K {
                                            // Bit 2i (low nibbles) and 2i + 1 (high) of four
                                            // bytes, gathered into bits k and 4 + k: one
                                            // multiply moves bit 8k to bit 24 + k.
                                            let h = u32::from_le_bytes(
                                                qh[4 * t..4 * t + 4].try_into().expect("4"),
                                            );
                                            let gather = |bits: u32| {
                                                ((bits & 0x0101_0101).wrapping_mul(0x0102_0408)
                                                    >> 24)
                                                    as u8
                                            };
                                            grp.high[gs * HIGH + (i * 8 + t) * LANES + lane] =
                                                gather(h >> (2 * i))
                                                    | (gather(h >> (2 * i + 1)) << 4);
                                        }
                                    }
                                }
                            }
                            KType::Q6K => {
                                grp.d[gs * LANES + lane] = half_at(block, 208);
                                for g16 in 0..16 {
                                    small[g16 * LANES + lane] = block[192 + g16];
                                }
                                let low: &[u8; 128] = block[..128].try_into().expect("128");
                                let high: &[u8; 64] = block[128..192].try_into().expect("64");
                                let q: &mut [u8; Q6K_QUANTS] = q.try_into().expect("a slot");
                                let top: &mut [u8; HIGH6] = (&mut grp.high
                                    [gs * HIGH6..(gs + 1) * HIGH6])
                                    .try_into()
                                    .expect("a slot");
                                let word = |bytes: &[u8], at: usize| {
                                    u32::from_le_bytes([
                                        bytes[at],
                                        bytes[at + 1],
                                        bytes[at + 2],
                                        bytes[at + 3],
                                    ])
                                };
                                // Step s holds values 4s..4s+4 (low nibbles) and 128 + 4s..
                                // (high nibbles): in ggml's layout quarter s / 8 of each half,
                                // positions 4(s mod 8)..+4, four consecutive bytes of `low`
                                // and `high`, so each step is a few 32-bit operations.
                                for s in 0..32 {
                                    let (quarter, l) = (s / 8, 4 * (s % 8));
                                    let at = 32 * (quarter % 2) + l;
                                    let shift = 4 * (quarter / 2);
                                    let first = (word(low, at) >> shift) & 0x0F0F_0F0F;
                                    let second = (word(low, 64 + at) >> shift) & 0x0F0F_0F0F;
                                    let to = (s * LANES + lane) * 4;
                                    q[to..to + 4]
                                        .copy_from_slice(&(first | (second << 4)).to_le_bytes());
                                    for half in 0..2 {
                                        // The four values' top two bits, one per byte, packed
                                        // into bits 2k of one byte.
                                        let w = (word(high, 32 * half + l) >> (2 * quarter))
                                            & 0x0303_0303;
                                        let w = (w | (w >> 6)) & 0x000F_000F;
                                        top[(s * LANES + lane) * 2 + half] =
                                            ((w | (w >> 12)) & 0xFF) as u8;
                                    }
                                }
                            }
                        }
                    }
                }
            });
        p
    }

    #[inline(always)]
    fn block(&self, g: usize, b: usize) -> Block<'_> {
        let gs = g * self.nb + b;
        let qb = self.ty.quant_bytes();
        Block {
            quants: &self.quants[gs * qb..(gs + 1) * qb],
            small: &self.small[gs * SMALL..(gs + 1) * SMALL],
            d: &self.d[gs * LANES..(gs + 1) * LANES],
            dmin: if self.dmin.is_empty() {
                &[]
            } else {
                &self.dmin[gs * LANES..(gs + 1) * LANES]
            },
            high: match self.ty {
                KType::Q2K | KType::Q4K => &[],
                KType::Q3K | KType::Q5K => &self.high[gs * HIGH..(gs + 1) * HIGH],
                KType::Q6K => &self.high[gs * HIGH6..(gs + 1) * HIGH6],
            },
        }
    }

    /// Value `64i + 32·hi + 4t + k` of lane `lane` in a Q4_K / Q5_K block: the nibble,
    /// plus 16 for a set fifth bit (Q5_K).
    fn q45_value(blk: &Block<'_>, lane: usize, (i, t, k): (usize, usize, usize), hi: bool) -> u8 {
        let byte = blk.quants[((i * 8 + t) * LANES + lane) * 4 + k];
        let nibble = if hi { byte >> 4 } else { byte & 0x0F };
        if blk.high.is_empty() {
            return nibble;
        }
        let bit = (blk.high[(i * 8 + t) * LANES + lane] >> (k + 4 * usize::from(hi))) & 1;
        nibble | (bit << 4)
    }

    /// Value `16·g16 + 4t + k` of lane `lane` in a Q6_K block, unsigned 6 bits: the
    /// nibble (low for groups 0–7, high for 8–15 of step `(g16 mod 8, t)`) and the top
    /// two bits.
    fn q6_value(blk: &Block<'_>, lane: usize, (g16, t, k): (usize, usize, usize)) -> u8 {
        let (step, hi) = ((g16 % 8) * 4 + t, usize::from(g16 >= 8));
        let byte = blk.quants[(step * LANES + lane) * 4 + k];
        let nibble = (byte >> (4 * hi)) & 0x0F;
        let top = (blk.high[(step * LANES + lane) * 2 + hi] >> (2 * k)) & 3;
        nibble | (top << 4)
    }

    /// Row `o`'s super-block `b` as f32 (ggml's dequantization arithmetic), appended.
    pub(super) fn dequantize_block(&self, o: usize, b: usize, out: &mut Vec<f32>) {
        let (g, lane) = (o / LANES, o % LANES);
        let blk = self.block(g, b);
        let d = blk.d[lane];
        match self.ty {
            KType::Q2K | KType::Q3K => self.dequantize_low(o, b, out),
            KType::Q4K | KType::Q5K => {
                let dmin = blk.dmin[lane];
                let mut values = [0f32; QK_K];
                for j in 0..8 {
                    let (i, high) = (j / 2, j % 2 == 1);
                    let scale = d * f32::from(blk.small[j * LANES + lane]);
                    let min =
                        dmin * f32::from(blk.small[128 + ((j / 2) * LANES + lane) * 2 + j % 2]);
                    for t in 0..8 {
                        for k in 0..4 {
                            let q = Self::q45_value(&blk, lane, (i, t, k), high);
                            values[32 * j + 4 * t + k] = scale * f32::from(q) - min;
                        }
                    }
                }
                out.extend_from_slice(&values);
            }
            KType::Q6K => {
                let mut values = [0f32; QK_K];
                for g16 in 0..16 {
                    let scale = f32::from(blk.small[g16 * LANES + lane] as i8);
                    for t in 0..4 {
                        for k in 0..4 {
                            let q = Self::q6_value(&blk, lane, (g16, t, k));
                            values[16 * g16 + 4 * t + k] = d * scale * (i32::from(q) - 32) as f32;
                        }
                    }
                }
                out.extend_from_slice(&values);
            }
        }
    }

    /// Group `g`'s sixteen outputs for each of `rows` (at most four): `out[r·16 + lane]`
    /// is the product of weight row `16g + lane` with activation row `r`.
    pub(super) fn group(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        assert!(rows.len() <= ROW_TILE && out.len() >= rows.len() * LANES);
        for row in rows {
            assert!(
                row.qs.len() >= self.nb * QK_K
                    && row.d.len() >= self.nb
                    && row.sums.len() >= self.nb * K_SUMS
            );
        }
        #[cfg(target_arch = "x86_64")]
        match super::simd() {
            super::Simd::Avx512Vnni => {
                #[expect(unsafe_code, reason = "the CPU was checked for these features")]
                // SAFETY: simd() found AVX-512 F/BW/VL/VNNI, AVX2 and FMA; the buffers
                // were checked above and by `block`.
                unsafe {
                    avx512::group(self, g, rows, out)
                };
                return;
            }
            super::Simd::Avx2 => {
                #[expect(unsafe_code, reason = "the CPU was checked for AVX2 and FMA")]
                // SAFETY: simd() found AVX2 and FMA; buffers as above.
                unsafe {
                    avx2::group(self, g, rows, out)
                };
                return;
            }
            super::Simd::Scalar => {}
        }
        self.group_scalar(g, rows, out);
    }

    /// [`Self::group`] without SIMD: the reference every kernel equals bit for bit.
    pub(super) fn group_scalar(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        for (r, row) in rows.iter().enumerate() {
            for lane in 0..LANES {
                out[r * LANES + lane] = match self.ty {
                    KType::Q2K | KType::Q3K => self.dot_low(g, lane, row),
                    KType::Q4K | KType::Q5K => self.dot_q4k(g, lane, row),
                    KType::Q6K => self.dot_q6k(g, lane, row),
                };
            }
        }
    }

    fn dot_q4k(&self, g: usize, lane: usize, row: &ActRow) -> f32 {
        let mut acc = 0f32;
        for b in 0..self.nb {
            let blk = self.block(g, b);
            let a = &row.qs[b * QK_K..(b + 1) * QK_K];
            let sums = &row.sums[b * K_SUMS..(b + 1) * K_SUMS];
            let mut isum = 0i32;
            for i in 0..4 {
                let (mut lo, mut hi) = (0i32, 0i32);
                for t in 0..8 {
                    for k in 0..4 {
                        let ql = Self::q45_value(&blk, lane, (i, t, k), false);
                        let qh = Self::q45_value(&blk, lane, (i, t, k), true);
                        lo += i32::from(ql) * i32::from(a[64 * i + 4 * t + k]);
                        hi += i32::from(qh) * i32::from(a[64 * i + 32 + 4 * t + k]);
                    }
                }
                isum += i32::from(blk.small[2 * i * LANES + lane]) * lo
                    + i32::from(blk.small[(2 * i + 1) * LANES + lane]) * hi;
            }
            let mut msum = 0i32;
            for j in 0..8 {
                let min = blk.small[128 + ((j / 2) * LANES + lane) * 2 + j % 2];
                msum += i32::from(min) * (i32::from(sums[2 * j]) + i32::from(sums[2 * j + 1]));
            }
            acc = q4k_step(acc, blk.d[lane], blk.dmin[lane], row.d[b], isum, msum);
        }
        acc
    }

    fn dot_q6k(&self, g: usize, lane: usize, row: &ActRow) -> f32 {
        let mut acc = 0f32;
        for b in 0..self.nb {
            let blk = self.block(g, b);
            let a = &row.qs[b * QK_K..(b + 1) * QK_K];
            let sums = &row.sums[b * K_SUMS..(b + 1) * K_SUMS];
            let mut isum = 0i32;
            for g16 in 0..16 {
                let mut dot = 0i32;
                for t in 0..4 {
                    for k in 0..4 {
                        let q = Self::q6_value(&blk, lane, (g16, t, k));
                        dot += i32::from(q) * i32::from(a[16 * g16 + 4 * t + k]);
                    }
                }
                let scale = i32::from(blk.small[g16 * LANES + lane] as i8);
                isum += scale * (dot - 32 * i32::from(sums[g16]));
            }
            acc = q6k_step(acc, blk.d[lane], row.d[b], isum);
        }
        acc
    }
}

/// Two 16-value activation sums as the halves of one 32-bit word (for `madd_epi16`).
#[inline(always)]
fn pair(x: i32, y: i32) -> i32 {
    (x & 0xFFFF) | (y << 16)
}

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
mod avx512 {
    use std::arch::x86_64::*;

    #[cfg(doc)]
    use super::ROW_TILE;
    use super::lowk::avx512::q23k;
    use super::{ActRow, K_SUMS, KPacked, KType, LANES, PREFETCH, QK_K, pair, word_at};

    /// # Safety
    /// The CPU must support AVX-512 F, BW, VL and VNNI, AVX2 and FMA; `rows` (at most
    /// [`ROW_TILE`]) must hold `p.nb` super-blocks each and `out` `16·rows.len()`
    /// values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn group(p: &KPacked, g: usize, rows: &[ActRow], out: &mut [f32]) {
        // SAFETY: every arm calls with what this function requires.
        unsafe {
            match (p.ty, rows.len()) {
                (_, 0) => {}
                (KType::Q2K | KType::Q3K, _) => {
                    // Four rows at a time.
                    for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
                        low_k(p, g, rows, out);
                    }
                }
                (KType::Q4K, 1) => q4k::<1, false>(p, g, rows, out),
                (KType::Q4K, 2) => q4k::<2, false>(p, g, rows, out),
                (KType::Q4K, 3) => q4k::<3, false>(p, g, rows, out),
                (KType::Q4K, 4) => q4k::<4, false>(p, g, rows, out),
                (KType::Q4K, 5) => q4k::<5, false>(p, g, rows, out),
                (KType::Q4K, 6) => q4k::<6, false>(p, g, rows, out),
                (KType::Q4K, 7) => q4k::<7, false>(p, g, rows, out),
                (KType::Q4K, _) => q4k::<8, false>(p, g, rows, out),
                (KType::Q5K, 1) => q4k::<1, true>(p, g, rows, out),
                (KType::Q5K, 2) => q4k::<2, true>(p, g, rows, out),
                (KType::Q5K, 3) => q4k::<3, true>(p, g, rows, out),
                (KType::Q5K, 4) => q4k::<4, true>(p, g, rows, out),
                (KType::Q5K, 5) => q4k::<5, true>(p, g, rows, out),
                (KType::Q5K, 6) => q4k::<6, true>(p, g, rows, out),
                (KType::Q5K, 7) => q4k::<7, true>(p, g, rows, out),
                (KType::Q5K, _) => q4k::<8, true>(p, g, rows, out),
                (KType::Q6K, 1) => q6k::<1>(p, g, rows, out),
                (KType::Q6K, 2) => q6k::<2>(p, g, rows, out),
                (KType::Q6K, 3) => q6k::<3>(p, g, rows, out),
                (KType::Q6K, 4) => q6k::<4>(p, g, rows, out),
                (KType::Q6K, 5) => q6k::<5>(p, g, rows, out),
                (KType::Q6K, 6) => q6k::<6>(p, g, rows, out),
                (KType::Q6K, 7) => q6k::<7>(p, g, rows, out),
                (KType::Q6K, _) => q6k::<8>(p, g, rows, out),
            }
        }
    }

    /// [`group`] for Q2_K and Q3_K and at most four rows.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn low_k(p: &KPacked, g: usize, rows: &[ActRow], out: &mut [f32]) {
        // SAFETY: every arm calls with what this function requires.
        unsafe {
            match (p.ty, rows.len()) {
                (KType::Q2K, 1) => q23k::<1, false>(p, g, rows, out),
                (KType::Q2K, 2) => q23k::<2, false>(p, g, rows, out),
                (KType::Q2K, 3) => q23k::<3, false>(p, g, rows, out),
                (KType::Q2K, _) => q23k::<4, false>(p, g, rows, out),
                (KType::Q3K, 1) => q23k::<1, true>(p, g, rows, out),
                (KType::Q3K, 2) => q23k::<2, true>(p, g, rows, out),
                (KType::Q3K, 3) => q23k::<3, true>(p, g, rows, out),
                (KType::Q3K, _) => q23k::<4, true>(p, g, rows, out),
                _ => {}
            }
        }
    }

    /// Q4_K: per sub-block, `vpdpbusd` of the sixteen rows' nibbles with four broadcast
    /// activation bytes (no overflow: 32·15·128 < 2³¹), times the lane's scale. Each
    /// sub-block is unpacked once into eight registers, then every row takes its
    /// products from them, so the unpacking serves up to eight rows.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn q4k<const R: usize, const FIVE: bool>(
        p: &KPacked,
        g: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let low = _mm512_set1_epi8(0x0F);
        // Q5_K: byte k of a lane tests bit k (low nibbles) or 4 + k (high nibbles) of the
        // lane's fifth-bit byte, spread over the lane's four bytes.
        let bits = [
            _mm512_set1_epi32(0x0804_0201),
            _mm512_set1_epi32(0x8040_2010u32 as i32),
        ];
        let sixteen = _mm512_set1_epi8(16);
        // With one or two rows, two accumulators per row (even and odd steps), so that a
        // row's multiply-adds do not wait on each other.
        let chains = if R <= 2 { 2 } else { 1 };
        // Each row's quants, whose lengths `group` asserted.
        let qs: [*const i8; R] = std::array::from_fn(|r| rows[r].qs.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            let mut isum = [_mm512_setzero_si512(); R];
            for i in 0..4 {
                // Sub-block 2i + half: the low (half 0) or high nibbles of steps (i, t).
                for (half, &bits) in bits.iter().enumerate() {
                    let mut w = [_mm512_setzero_si512(); 8];
                    for (t, w) in w.iter_mut().enumerate() {
                        // SAFETY: 128·16 bytes per block: step (i, t) is 64 of them, and
                        // 16 of its 512 bytes of fifth bits.
                        unsafe {
                            if half == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    q.wrapping_add((i * 8 + t) * 64 + PREFETCH).cast(),
                                );
                            }
                            let x = _mm512_loadu_si512(q.add((i * 8 + t) * 64).cast());
                            let x = if half == 0 {
                                x
                            } else {
                                _mm512_srli_epi16::<4>(x)
                            };
                            *w = _mm512_and_si512(x, low);
                            if FIVE {
                                // Step (i, t)'s byte per lane times 0x01010101: the byte
                                // in all four of the lane's bytes.
                                let hb = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                    blk.high.as_ptr().add((i * 8 + t) * LANES).cast(),
                                ));
                                let hb = _mm512_mullo_epi32(hb, _mm512_set1_epi32(0x0101_0101));
                                let m = _mm512_test_epi8_mask(hb, bits);
                                *w = _mm512_mask_add_epi8(*w, m, *w, sixteen);
                            }
                        }
                    }
                    // SAFETY: scale 2i + half, 16 bytes within the 256.
                    let sc = unsafe {
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(
                            small.add((2 * i + half) * LANES).cast(),
                        ))
                    };
                    for r in 0..R {
                        let mut s = [_mm512_setzero_si512(); 2];
                        for (t, &w) in w.iter().enumerate() {
                            // SAFETY: the activation word lies within the row's
                            // super-block.
                            let x = unsafe {
                                word_at(qs[r].add(b * QK_K + 64 * i + 32 * half + 4 * t))
                            };
                            let c = t % chains;
                            s[c] = _mm512_dpbusd_epi32(s[c], w, _mm512_set1_epi32(x));
                        }
                        let sum = if chains == 2 {
                            _mm512_add_epi32(s[0], s[1])
                        } else {
                            s[0]
                        };
                        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sum, sc));
                    }
                }
            }
            let mut msum = [_mm512_setzero_si512(); R];
            for pr in 0..4 {
                // SAFETY: minimum pair pr, 32 bytes at 128 + 32·pr, within the 256.
                let m = unsafe {
                    _mm512_cvtepu8_epi16(_mm256_loadu_si256(small.add(128 + pr * 32).cast()))
                };
                for r in 0..R {
                    let s = &rows[r].sums[b * K_SUMS..];
                    let two = pair(
                        i32::from(s[4 * pr]) + i32::from(s[4 * pr + 1]),
                        i32::from(s[4 * pr + 2]) + i32::from(s[4 * pr + 3]),
                    );
                    msum[r] =
                        _mm512_add_epi32(msum[r], _mm512_madd_epi16(m, _mm512_set1_epi32(two)));
                }
            }
            // SAFETY: 16 f32 values each.
            let (d, dmin) = unsafe {
                (
                    _mm512_loadu_ps(blk.d.as_ptr()),
                    _mm512_loadu_ps(blk.dmin.as_ptr()),
                )
            };
            for r in 0..R {
                // q4k_step, lane by lane.
                let da = _mm512_set1_ps(rows[r].d[b]);
                let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
                let m = _mm512_mul_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(msum[r]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(i, m));
            }
        }
        for (r, &v) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16·R values.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * LANES), v) };
        }
    }

    /// `_mm512_shuffle_epi8` indices: `base`'s bytes offset by each lane's first byte
    /// within its 128-bit half (0, 4, 8, 12).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn lane_bytes(base: __m512i) -> __m512i {
        _mm512_add_epi8(
            base,
            _mm512_set_epi32(
                12 * 0x0101_0101,
                8 * 0x0101_0101,
                4 * 0x0101_0101,
                0,
                12 * 0x0101_0101,
                8 * 0x0101_0101,
                4 * 0x0101_0101,
                0,
                12 * 0x0101_0101,
                8 * 0x0101_0101,
                4 * 0x0101_0101,
                0,
                12 * 0x0101_0101,
                8 * 0x0101_0101,
                4 * 0x0101_0101,
                0,
            ),
        )
    }

    /// Nibbles plus 16 and 32 where byte k's top-bit byte has bit 2k and 2k + 1 set.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    #[inline]
    fn six_bits(nibbles: __m512i, top: __m512i) -> __m512i {
        let b0 = _mm512_test_epi8_mask(top, _mm512_set1_epi32(0x4010_0401));
        let b1 = _mm512_test_epi8_mask(top, _mm512_set1_epi32(0x8020_0802u32 as i32));
        let x = _mm512_mask_add_epi8(nibbles, b0, nibbles, _mm512_set1_epi8(16));
        _mm512_mask_add_epi8(x, b1, x, _mm512_set1_epi8(32))
    }

    /// Q6_K: per 16-value group, `vpdpbusd` of the unsigned 6-bit weights (no overflow),
    /// the −32 offset taken off with the group's activation sum (the sum starts there),
    /// times the lane's scale. Each pair of groups (four steps) is unpacked once into
    /// eight registers, then every row takes its products from them with activation
    /// words broadcast from memory, so the unpacking serves up to eight rows.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn q6k<const R: usize>(p: &KPacked, g: usize, rows: &[ActRow], out: &mut [f32]) {
        let low = _mm512_set1_epi8(0x0F);
        // The lane's top-bit byte for the low (high) nibbles in all four of its bytes.
        let spread_lo = _mm512_set1_epi32(0);
        let spread_hi = _mm512_set1_epi32(0x0101_0101);
        let (spread_lo, spread_hi) = (lane_bytes(spread_lo), lane_bytes(spread_hi));
        // Each row's arrays, whose lengths `group` asserted.
        let qs: [*const i8; R] = std::array::from_fn(|r| rows[r].qs.as_ptr());
        let sums: [*const i16; R] = std::array::from_fn(|r| rows[r].sums.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            let mut isum = [_mm512_setzero_si512(); R];
            let hp = blk.high.as_ptr();
            for g8 in 0..8 {
                // Groups g8 (low nibbles, w[t]) and g8 + 8 (high nibbles, w[4 + t]) of
                // steps (g8, t).
                let mut w = [_mm512_setzero_si512(); 8];
                for t in 0..4 {
                    let step = g8 * 4 + t;
                    // SAFETY: step's 64 of the block's 2048 nibble bytes and 32 of its
                    // 1024 top-bit bytes.
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(step * 64 + PREFETCH).cast());
                        let x = _mm512_loadu_si512(q.add(step * 64).cast());
                        let top =
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256(hp.add(step * 32).cast()));
                        w[t] = six_bits(
                            _mm512_and_si512(x, low),
                            _mm512_shuffle_epi8(top, spread_lo),
                        );
                        w[4 + t] = six_bits(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(x), low),
                            _mm512_shuffle_epi8(top, spread_hi),
                        );
                    }
                }
                // SAFETY: scales g8 and g8 + 8, 16 bytes each within the 256.
                let (sl, sh) = unsafe {
                    (
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(small.add(g8 * LANES).cast())),
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(small.add((g8 + 8) * LANES).cast())),
                    )
                };
                for r in 0..R {
                    // SAFETY: super-block b of the row's quants and sums; the activation
                    // words lie within it.
                    unsafe {
                        let a = qs[r].add(b * QK_K);
                        let s = sums[r].add(b * K_SUMS);
                        let mut lo = _mm512_set1_epi32(-32 * i32::from(*s.add(g8)));
                        let mut hi = _mm512_set1_epi32(-32 * i32::from(*s.add(g8 + 8)));
                        for t in 0..4 {
                            let xl = _mm512_set1_epi32(word_at(a.add(16 * g8 + 4 * t)));
                            let xh = _mm512_set1_epi32(word_at(a.add(16 * (g8 + 8) + 4 * t)));
                            lo = _mm512_dpbusd_epi32(lo, w[t], xl);
                            hi = _mm512_dpbusd_epi32(hi, w[4 + t], xh);
                        }
                        let x = _mm512_add_epi32(
                            _mm512_mullo_epi32(lo, sl),
                            _mm512_mullo_epi32(hi, sh),
                        );
                        isum[r] = _mm512_add_epi32(isum[r], x);
                    }
                }
            }
            // SAFETY: 16 f32 values.
            let d = unsafe { _mm512_loadu_ps(blk.d.as_ptr()) };
            for r in 0..R {
                // q6k_step, lane by lane.
                let da = _mm512_set1_ps(rows[r].d[b]);
                let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
                acc[r] = _mm512_add_ps(acc[r], i);
            }
        }
        for (r, &v) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16·R values.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * LANES), v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
mod avx2 {
    use std::arch::x86_64::*;

    #[cfg(doc)]
    use super::ROW_TILE;
    use super::lowk::avx2::q23k;
    use super::{ActRow, K_SUMS, KPacked, KType, LANES, PREFETCH, QK_K, pair, word_at};

    /// # Safety
    /// The CPU must support AVX2 and FMA; `rows` (at most [`ROW_TILE`]) must hold
    /// `p.nb` super-blocks each and `out` `16·rows.len()` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn group(p: &KPacked, g: usize, rows: &[ActRow], out: &mut [f32]) {
        for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
            // SAFETY: as this function requires.
            unsafe { group4(p, g, rows, out) };
        }
    }

    /// [`group`] for at most four rows.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group4(p: &KPacked, g: usize, rows: &[ActRow], out: &mut [f32]) {
        // Each half of the group (8 lanes) on its own: 16 registers are too few for
        // both halves of four rows' accumulators.
        for h in 0..2 {
            // SAFETY: every arm calls with what this function requires.
            unsafe {
                match (p.ty, rows.len()) {
                    (_, 0) => {}
                    (KType::Q2K, 1) => q23k::<1, false>(p, g, h, rows, out),
                    (KType::Q2K, 2) => q23k::<2, false>(p, g, h, rows, out),
                    (KType::Q2K, 3) => q23k::<3, false>(p, g, h, rows, out),
                    (KType::Q2K, _) => q23k::<4, false>(p, g, h, rows, out),
                    (KType::Q3K, 1) => q23k::<1, true>(p, g, h, rows, out),
                    (KType::Q3K, 2) => q23k::<2, true>(p, g, h, rows, out),
                    (KType::Q3K, 3) => q23k::<3, true>(p, g, h, rows, out),
                    (KType::Q3K, _) => q23k::<4, true>(p, g, h, rows, out),
                    (KType::Q4K, 1) => q4k::<1, false>(p, g, h, rows, out),
                    (KType::Q4K, 2) => q4k::<2, false>(p, g, h, rows, out),
                    (KType::Q4K, 3) => q4k::<3, false>(p, g, h, rows, out),
                    (KType::Q4K, _) => q4k::<4, false>(p, g, h, rows, out),
                    (KType::Q5K, 1) => q4k::<1, true>(p, g, h, rows, out),
                    (KType::Q5K, 2) => q4k::<2, true>(p, g, h, rows, out),
                    (KType::Q5K, 3) => q4k::<3, true>(p, g, h, rows, out),
                    (KType::Q5K, _) => q4k::<4, true>(p, g, h, rows, out),
                    (KType::Q6K, 1) => q6k::<1>(p, g, h, rows, out),
                    (KType::Q6K, 2) => q6k::<2>(p, g, h, rows, out),
                    (KType::Q6K, 3) => q6k::<3>(p, g, h, rows, out),
                    (KType::Q6K, _) => q6k::<4>(p, g, h, rows, out),
                }
            }
        }
    }

    /// The low 16 bits of each 32-bit lane in both halves (for `madd_epi16`).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn doubled(x: __m256i) -> __m256i {
        _mm256_or_si256(
            _mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)),
            _mm256_slli_epi32::<16>(x),
        )
    }

    /// Nibbles plus 16 and 32 where byte k's top-bit byte has bit 2k and 2k + 1 set.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn six_bits(nibbles: __m256i, top: __m256i) -> __m256i {
        let bit = |pattern: i32, add: i8| {
            let p = _mm256_set1_epi32(pattern);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(top, p), p);
            _mm256_and_si256(set, _mm256_set1_epi8(add))
        };
        let x = _mm256_add_epi8(nibbles, bit(0x4010_0401, 16));
        _mm256_add_epi8(x, bit(0x8020_0802u32 as i32, 32))
    }

    /// The block's fifth bits (Q5_K).
    #[inline(always)]
    fn p_high(blk: &super::Block<'_>) -> *const u8 {
        blk.high.as_ptr()
    }

    /// Q4_K, lanes `8h..8h + 8`: `vpmaddubsw` pair sums of nibbles and broadcast
    /// activation bytes, added in 16 bits over a sub-block's 8 steps (no overflow:
    /// 8·2·15·128 < 2¹⁵), then `vpmaddwd` with the lane's scale in both halves.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4k<const R: usize, const FIVE: bool>(
        p: &KPacked,
        g: usize,
        h: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let low = _mm256_set1_epi8(0x0F);
        // Q5_K's 5-bit values: pair sums up to 2·31·128, so at most 4 steps fit in 16 bits.
        let flush = if FIVE { 4 } else { 8 };
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
            let a: [*const i8; R] =
                std::array::from_fn(|r| unsafe { rows[r].qs.as_ptr().add(b * QK_K) });
            let mut isum = [_mm256_setzero_si256(); R];
            for j in 0..8 {
                // Sub-block j: chunk j / 2, the low nibbles for even j, the high for odd
                // (one nibble half at a time: 16 registers hold four rows' sums then).
                let (i, shift) = (j / 2, 4 * (j % 2) as i32);
                // SAFETY: scale j of lanes 8h..8h + 8, within the 256.
                let s = doubled(_mm256_cvtepu8_epi32(unsafe {
                    _mm_loadl_epi64(small.add(j * LANES + 8 * h).cast())
                }));
                // Q5_K: byte k of a lane tests the fifth bit of value k of this nibble half.
                let bits = _mm256_set1_epi32(0x0804_0201 << shift);
                let mut sum16 = [_mm256_setzero_si256(); R];
                for t in 0..8 {
                    // SAFETY: step (i, t) is 64 bytes of the block's 2048, half h 32 of
                    // them; the activation words lie within the row's super-block.
                    unsafe {
                        if R == 1 && j % 2 == 0 {
                            // The first of sub-blocks 2i and 2i + 1 to read step (i, t).
                            _mm_prefetch::<_MM_HINT_T0>(
                                q.wrapping_add((i * 8 + t) * 64 + PREFETCH).cast(),
                            );
                        }
                        let w = _mm256_loadu_si256(q.add((i * 8 + t) * 64 + 32 * h).cast());
                        let mut w =
                            _mm256_and_si256(_mm256_srl_epi16(w, _mm_cvtsi32_si128(shift)), low);
                        if FIVE {
                            // The lanes' fifth-bit bytes of step (i, t) (8 of the block's
                            // 512 from lane 8h), each in all four of its lane's bytes.
                            let hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                p_high(&blk).add((i * 8 + t) * LANES + 8 * h).cast(),
                            ));
                            let hb = _mm256_mullo_epi32(hb, _mm256_set1_epi32(0x0101_0101));
                            let set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bits), bits);
                            w = _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                        }
                        for r in 0..R {
                            let x = _mm256_set1_epi32(word_at(a[r].add(32 * j + 4 * t)));
                            sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(w, x));
                        }
                    }
                    if (t + 1) % flush == 0 {
                        for r in 0..R {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sum16[r], s));
                            sum16[r] = _mm256_setzero_si256();
                        }
                    }
                }
            }
            let mut msum = [_mm256_setzero_si256(); R];
            for pr in 0..4 {
                // SAFETY: minimum pair pr of lanes 8h..8h + 8: 16 bytes within the 256.
                let m = unsafe {
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(small.add(128 + pr * 32 + 16 * h).cast()))
                };
                for r in 0..R {
                    let s = &rows[r].sums[b * K_SUMS..];
                    let two = pair(
                        i32::from(s[4 * pr]) + i32::from(s[4 * pr + 1]),
                        i32::from(s[4 * pr + 2]) + i32::from(s[4 * pr + 3]),
                    );
                    msum[r] =
                        _mm256_add_epi32(msum[r], _mm256_madd_epi16(m, _mm256_set1_epi32(two)));
                }
            }
            // SAFETY: 8 f32 values each from lane 8h.
            let (d, dmin) = unsafe {
                (
                    _mm256_loadu_ps(blk.d.as_ptr().add(8 * h)),
                    _mm256_loadu_ps(blk.dmin.as_ptr().add(8 * h)),
                )
            };
            for r in 0..R {
                // q4k_step, lane by lane.
                let da = _mm256_set1_ps(rows[r].d[b]);
                let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[r]));
                let m = _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[r]));
                acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(i, m));
            }
        }
        for (r, &v) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16·R values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * LANES + 8 * h), v) };
        }
    }

    /// Q6_K, lanes `8h..8h + 8`: `vpmaddubsw` pair sums of the unsigned 6-bit weights,
    /// two steps added in 16 bits (no overflow: 2·2·63·128 < 2¹⁵), `vpmaddwd` with the
    /// lane's scale in both halves; the −32 offset from the group's activation sum.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q6k<const R: usize>(
        p: &KPacked,
        g: usize,
        h: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let low = _mm256_set1_epi8(0x0F);
        let spread_lo = _mm256_setr_epi8(
            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8,
            12, 12, 12, 12,
        );
        let spread_hi = _mm256_add_epi8(spread_lo, _mm256_set1_epi8(1));
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
            let a: [*const i8; R] =
                std::array::from_fn(|r| unsafe { rows[r].qs.as_ptr().add(b * QK_K) });
            let mut isum = [_mm256_setzero_si256(); R];
            let mut offset = [_mm256_setzero_si256(); R];
            let hp = blk.high.as_ptr();
            for g8 in 0..8 {
                // SAFETY: scales g8 and g8 + 8 of lanes 8h..8h + 8, within the 256.
                let (sl, sh) = unsafe {
                    (
                        doubled(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            small.add(g8 * LANES + 8 * h).cast(),
                        ))),
                        doubled(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            small.add((g8 + 8) * LANES + 8 * h).cast(),
                        ))),
                    )
                };
                for half in 0..2 {
                    // Two steps summed in 16 bits (no overflow: 2·2·63·128 < 2¹⁵).
                    let mut lo = [_mm256_setzero_si256(); R];
                    let mut hi = [_mm256_setzero_si256(); R];
                    for t in 2 * half..2 * half + 2 {
                        let step = g8 * 4 + t;
                        // SAFETY: step's 64 nibble bytes (half h: 32) and 32 top-bit bytes
                        // (half h: 16); the activation words lie within the row's block.
                        unsafe {
                            if R == 1 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    q.wrapping_add(step * 64 + PREFETCH).cast(),
                                );
                            }
                            let w = _mm256_loadu_si256(q.add(step * 64 + 32 * h).cast());
                            let top = _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                hp.add(step * 32 + 16 * h).cast(),
                            ));
                            let wl = six_bits(
                                _mm256_and_si256(w, low),
                                _mm256_shuffle_epi8(top, spread_lo),
                            );
                            let wh = six_bits(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(w), low),
                                _mm256_shuffle_epi8(top, spread_hi),
                            );
                            for r in 0..R {
                                let xl = _mm256_set1_epi32(word_at(a[r].add(16 * g8 + 4 * t)));
                                let xh =
                                    _mm256_set1_epi32(word_at(a[r].add(16 * (g8 + 8) + 4 * t)));
                                lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(wl, xl));
                                hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(wh, xh));
                            }
                        }
                    }
                    for r in 0..R {
                        let x = _mm256_add_epi32(
                            _mm256_madd_epi16(lo[r], sl),
                            _mm256_madd_epi16(hi[r], sh),
                        );
                        isum[r] = _mm256_add_epi32(isum[r], x);
                    }
                }
                for r in 0..R {
                    // scale·Σ q_a in 32 bits: the sum in the low half, 0 in the high.
                    let sums = &rows[r].sums[b * K_SUMS..];
                    let (ol, oh) = (
                        _mm256_set1_epi32(pair(i32::from(sums[g8]), 0)),
                        _mm256_set1_epi32(pair(i32::from(sums[g8 + 8]), 0)),
                    );
                    let x = _mm256_add_epi32(_mm256_madd_epi16(sl, ol), _mm256_madd_epi16(sh, oh));
                    offset[r] = _mm256_add_epi32(offset[r], x);
                }
            }
            // SAFETY: 8 f32 values from lane 8h.
            let d = unsafe { _mm256_loadu_ps(blk.d.as_ptr().add(8 * h)) };
            for r in 0..R {
                // q6k_step, lane by lane, on Σ scale·(Σ q·a − 32·Σ a).
                let total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(offset[r]));
                let da = _mm256_set1_ps(rows[r].d[b]);
                let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(total));
                acc[r] = _mm256_add_ps(acc[r], i);
            }
        }
        for (r, &v) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16·R values.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * LANES + 8 * h), v) };
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::super::{Simd, detected_simd, q6k_value, quantize_row_k};
    use super::*;

    /// Every K-quant type.
    const TYPES: [KType; 5] = [KType::Q2K, KType::Q3K, KType::Q4K, KType::Q5K, KType::Q6K];

    /// Weights quantized by candle, then the first super-block of rows 0, 1 and 2 set
    /// to extremes in the file's bytes: row 0 a pattern of extreme quant bytes and the
    /// largest and smallest scales (and minimums), row 1 every quant bit set and every
    /// scale at its largest (Q6_K: −128), row 2 every quant and scale byte zero (Q3_K:
    /// weights −4 and scales −32).
    fn extreme_weight(ty: KType, out: usize, nb: usize) -> Vec<u8> {
        let dtype = match ty {
            KType::Q2K => GgmlDType::Q2K,
            KType::Q3K => GgmlDType::Q3K,
            KType::Q4K => GgmlDType::Q4K,
            KType::Q5K => GgmlDType::Q5K,
            KType::Q6K => GgmlDType::Q6K,
        };
        let w = Tensor::randn(0f32, 1.0, (out, nb * QK_K), &Device::Cpu).unwrap();
        let mut data = QTensor::quantize(&w, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec();
        let bb = ty.block_bytes();
        let (quants, scales) = match ty {
            KType::Q2K => (16..80, 0..16),
            // High bits and low 2 bits.
            KType::Q3K => (0..96, 96..108),
            KType::Q4K => (16..144, 4..16),
            // Fifth bits and nibbles.
            KType::Q5K => (16..176, 4..16),
            KType::Q6K => (0..192, 192..208),
        };
        let row0 = &mut data[..bb];
        for (i, q) in row0[quants.clone()].iter_mut().enumerate() {
            *q = [0x00, 0xFF, 0x0F, 0xF0, 0x3C][i % 5];
        }
        for (i, s) in row0[scales.clone()].iter_mut().enumerate() {
            *s = match ty {
                KType::Q2K | KType::Q3K | KType::Q4K | KType::Q5K => {
                    [0xFF, 0x00, 0xFF, 0x01][i % 4]
                }
                KType::Q6K => [0x7F, 0x80, 0x7F, 0x01][i % 4],
            };
        }
        let row1 = &mut data[nb * bb..nb * bb + bb];
        row1[quants.clone()].fill(0xFF);
        row1[scales.clone()].fill(match ty {
            KType::Q6K => 0x80,
            _ => 0xFF,
        });
        let row2 = &mut data[2 * nb * bb..2 * nb * bb + bb];
        row2[quants].fill(0);
        row2[scales].fill(0);
        data
    }

    /// The AVX2 and AVX-512 group kernels give the scalar kernel's bits: both types,
    /// one to five super-blocks, one to four activation rows, a last group with padding
    /// rows, extreme weights (above) and activations (all +127, zeros, ±127).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_group_kernels_equal_the_scalar_one() {
        if detected_simd() < Simd::Avx2 {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let avx512 = detected_simd() >= Simd::Avx512Vnni;
        if !avx512 {
            eprintln!("AVX-512 kernels skipped: this CPU has no AVX-512 VNNI");
        }
        for ty in TYPES {
            for nb in [1, 2, 3, 5] {
                let out = 20;
                let packed = KPacked::pack(ty, &extreme_weight(ty, out, nb), out, nb);
                let k = nb * QK_K;
                let mut x: Vec<f32> = (0..k * ROW_TILE)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
                    .collect();
                x[..QK_K].fill(2.5);
                x[k..k + QK_K].fill(0.0);
                for (i, v) in x[2 * k..2 * k + QK_K].iter_mut().enumerate() {
                    *v = if i % 3 == 0 { -1.0 } else { 1.0 };
                }
                let rows: Vec<ActRow> = x.chunks_exact(k).map(quantize_row_k).collect();
                assert_eq!(rows[0].qs[..QK_K], [127; QK_K]);
                for g in 0..packed.groups {
                    for n in 1..=ROW_TILE {
                        let mut want = [0f32; ROW_TILE * LANES];
                        packed.group_scalar(g, &rows[..n], &mut want);
                        let mut got = [0f32; ROW_TILE * LANES];
                        #[expect(unsafe_code, reason = "the features were checked above")]
                        // SAFETY: detected_simd() found AVX2 and FMA; sizes as required.
                        unsafe {
                            avx2::group(&packed, g, &rows[..n], &mut got);
                        }
                        let at = format!("{ty:?}, {nb} super-blocks, group {g}, {n} rows");
                        assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "AVX2: {at}");
                        if avx512 {
                            let mut got = [0f32; ROW_TILE * LANES];
                            #[expect(unsafe_code, reason = "the features were checked above")]
                            // SAFETY: detected_simd() found AVX-512 VNNI, AVX2 and FMA.
                            unsafe {
                                avx512::group(&packed, g, &rows[..n], &mut got);
                            }
                            assert_eq!(
                                got.map(f32::to_bits),
                                want.map(f32::to_bits),
                                "AVX-512: {at}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The scalar group kernel is the per-row definition: exact integer sums per
    /// super-block (checked here in i64 from the file's bytes, against nothing packed),
    /// then the shared float step.
    #[test]
    fn scalar_group_kernel_is_the_definition() {
        for ty in TYPES {
            let (out, nb) = (18, 2);
            let data = extreme_weight(ty, out, nb);
            let packed = KPacked::pack(ty, &data, out, nb);
            let x: Vec<f32> = (0..nb * QK_K * 2)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 7.0)
                .collect();
            let rows: Vec<ActRow> = x.chunks_exact(nb * QK_K).map(quantize_row_k).collect();
            let bb = ty.block_bytes();
            let half = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
            for o in 0..out {
                for (r, row) in rows.iter().enumerate() {
                    let mut acc = 0f32;
                    for b in 0..nb {
                        let block = &data[(o * nb + b) * bb..(o * nb + b + 1) * bb];
                        let a = &row.qs[b * QK_K..(b + 1) * QK_K];
                        let sums = &row.sums[b * K_SUMS..(b + 1) * K_SUMS];
                        match ty {
                            KType::Q2K => {
                                // ggml's dequantize_row_q2_K: value 128n + 32j + l takes bits
                                // 2j, 2j + 1 of quant byte 32n + l; scale byte v / 16 holds
                                // the scale (low nibble) and the minimum (high).
                                let (mut isum, mut msum) = (0i64, 0i64);
                                for (v, &av) in a.iter().enumerate() {
                                    let (n, j, l) = (v / 128, v % 128 / 32, v % 32);
                                    let q = (block[16 + 32 * n + l] >> (2 * j)) & 3;
                                    let scale = block[v / 16] & 0x0F;
                                    isum += i64::from(scale) * i64::from(q) * i64::from(av);
                                }
                                for (s, &sum) in sums.iter().enumerate() {
                                    msum += i64::from(block[s] >> 4) * i64::from(sum);
                                }
                                let (i, m) =
                                    (i32::try_from(isum).unwrap(), i32::try_from(msum).unwrap());
                                acc =
                                    q4k_step(acc, half(block, 80), half(block, 82), row.d[b], i, m);
                            }
                            KType::Q3K => {
                                // ggml's dequantize_row_q3_K: the scales through its
                                // kmask words, value 128n + 32j + l from bits 2j, 2j + 1 of
                                // quant byte 32n + l, minus 4 where bit 4n + j of high-bit
                                // byte l is clear.
                                let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
                                let word = |i: usize| {
                                    u32::from_le_bytes(
                                        block[96 + 4 * i..100 + 4 * i].try_into().unwrap(),
                                    )
                                };
                                let mut aux = [word(0), word(1), word(2), 0];
                                let tmp = aux[2];
                                aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
                                aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
                                aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
                                aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
                                let scales: Vec<i64> = aux
                                    .iter()
                                    .flat_map(|w| w.to_le_bytes())
                                    .map(|s| i64::from(s as i8) - 32)
                                    .collect();
                                let mut isum = 0i64;
                                for (v, &av) in a.iter().enumerate() {
                                    let (n, j, l) = (v / 128, v % 128 / 32, v % 32);
                                    let q = i64::from((block[32 + 32 * n + l] >> (2 * j)) & 3);
                                    let set = (block[l] >> (4 * n + j)) & 1 == 1;
                                    let w = if set { q } else { q - 4 };
                                    isum += scales[v / 16] * w * i64::from(av);
                                }
                                acc = q6k_step(
                                    acc,
                                    half(block, 108),
                                    row.d[b],
                                    i32::try_from(isum).unwrap(),
                                );
                            }
                            KType::Q4K | KType::Q5K => {
                                let sub = unpack_q4k_scales(block[4..16].try_into().unwrap());
                                let (mut isum, mut msum) = (0i64, 0i64);
                                // ggml's dequantize_row_q5_K: value l of chunk c takes bit
                                // 2c (low nibble) or 2c + 1 (high) of fifth-bit byte l.
                                let five = ty == KType::Q5K;
                                let nibbles = if five { 48 } else { 16 };
                                for (v, &av) in a.iter().enumerate() {
                                    let (chunk, within) = (v / 64, v % 64);
                                    let byte = block[nibbles + 32 * chunk + within % 32];
                                    let mut q = if within < 32 { byte & 0x0F } else { byte >> 4 };
                                    if five {
                                        let bit = 2 * chunk + usize::from(within >= 32);
                                        q |= ((block[16 + within % 32] >> bit) & 1) << 4;
                                    }
                                    isum += i64::from(sub[v / 32]) * i64::from(q) * i64::from(av);
                                }
                                for j in 0..8 {
                                    msum += i64::from(sub[8 + j])
                                        * (i64::from(sums[2 * j]) + i64::from(sums[2 * j + 1]));
                                }
                                let (i, m) =
                                    (i32::try_from(isum).unwrap(), i32::try_from(msum).unwrap());
                                acc = q4k_step(acc, half(block, 0), half(block, 2), row.d[b], i, m);
                            }
                            KType::Q6K => {
                                let (low, high) = block[..192].split_at(128);
                                let mut isum = 0i64;
                                for (v, &av) in a.iter().enumerate() {
                                    let w = i64::from(q6k_value(low, high, v)) - 32;
                                    isum +=
                                        i64::from(block[192 + v / 16] as i8) * w * i64::from(av);
                                }
                                acc = q6k_step(
                                    acc,
                                    half(block, 208),
                                    row.d[b],
                                    i32::try_from(isum).unwrap(),
                                );
                            }
                        }
                    }
                    let mut got = [0f32; LANES];
                    packed.group_scalar(o / LANES, std::slice::from_ref(row), &mut got);
                    assert_eq!(
                        got[o % LANES].to_bits(),
                        acc.to_bits(),
                        "{ty:?}, weight row {o}, row {r}"
                    );
                }
            }
        }
    }
}
