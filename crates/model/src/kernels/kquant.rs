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
//! - Q5_K: Q4_K's, plus `high[gs·512..]` as `[chunk i: 4][nibble half h: 2][lane:
//!   16][4 bytes]`, bit `t` of byte k the fifth bit of the value in byte k of the
//!   lane's word of step `(i, t)` (its low nibble for `h = 0`, its high one for `h =
//!   1`): one load serves the chunk's eight steps of a nibble half, and a shift by
//!   `4 − t` and a mask put step t's bits at bit 4 of its quant bytes, as Q6_K's.
//! - Q6_K (212 bytes per row and super-block, the file's 210 plus f32 `d`):
//!   `quants[gs·2048..]` as `[step s = 4·g8 + t: 32][lane][4 bytes]`, low nibbles the
//!   low 4 bits of values `16·g8 + 4t..` (group `g8`), high nibbles those of group
//!   `g8 + 8`; `high[gs·1024..]` as `[step pair u: 16][lane][4 bytes]`, byte k beside
//!   quant byte k of steps `2u` and `2u + 1`: the top two bits of its low-nibble and
//!   high-nibble values of step `2u + e` in bits `4e..4e + 2` and `4e + 2..4e + 4`, so
//!   that a shift and a mask put them at bits 4–5 of the quant bytes.
//!   `small[gs·256..]`: the 16 signed scales as `[g][lane]`. `d`: `[gs·16 + lane]`.
//!   The weight is the unsigned 6 bits minus 32.

use half::f16;
use rayon::prelude::*;

use super::memory::Weights;
use super::{
    ActRow, DecodeRead, K_SUMS, QK_K, ROW_TILE, STREAMS, decode_with, in_streams, per_group,
    prefetch_ahead, prefetch_line, q4k_step, q6k_step, unpack_q4k_scales, word_at,
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
    /// Q5_K only: the fifth bits, `[chunk i: 4][step t: 8][half h: 2]` a 64-bit mask
    /// each: bit `4·lane + k` for value `64i + 32h + 4t + k` of the lane's row.
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

impl Block<'_> {
    /// Prefetches into L1 the arrays other than the quants (scales, `d`, `dmin`, high
    /// bits) of the super-block `ahead` blocks after this one in the same arrays (the
    /// group's later blocks, then the next group's). A decode kernel prefetches the
    /// quants step by step; these arrays are 16% (Q4_K) to 45% (Q3_K) of a block's
    /// bytes, each a stream of its own, and a core reading four groups at once has
    /// more streams than its hardware prefetcher follows well. With Q3_K's GFNI
    /// kernel, 1B decode (repack cache off, two alternating pairs): Q3_K_M +7% on one
    /// thread and +8% on two, Q2_K +6%; Q4_K_M and Q6_K unchanged. Weights mapped
    /// from a repack-cache entry decoded 2–17% slower than fresh ones without it, as
    /// fast with it (bench/RESULTS, 2026-12-05 17:20).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch_side(&self, ahead: usize) {
        super::prefetch_blocks_ahead(
            [
                (self.small.as_ptr(), self.small.len()),
                (self.d.as_ptr().cast(), size_of_val(self.d)),
                (self.dmin.as_ptr().cast(), size_of_val(self.dmin)),
                (self.high.as_ptr(), self.high.len()),
            ],
            ahead,
        );
    }
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
    /// How many values each array holds (quants, small, d, dmin, high) for a weight of
    /// `out` rows and `nb` super-blocks per row.
    fn lens(ty: KType, out: usize, nb: usize) -> [usize; 5] {
        let slots = out.div_ceil(LANES) * nb;
        [
            slots * ty.quant_bytes(),
            slots * SMALL,
            slots * LANES,
            match ty {
                KType::Q3K | KType::Q6K => 0,
                KType::Q2K | KType::Q4K | KType::Q5K => slots * LANES,
            },
            match ty {
                KType::Q2K | KType::Q4K => 0,
                KType::Q3K | KType::Q5K => slots * HIGH,
                KType::Q6K => slots * HIGH6,
            },
        ]
    }

    /// Its arrays' bytes, in [`Self::lens`]'s order (what the repack cache stores),
    /// each with its offset in the file of arena `arena` if it was packed there.
    pub(super) fn arrays(&self, arena: u64) -> super::StoredArrays<'_> {
        [
            (self.quants.as_bytes(), self.quants.offset_in(arena)),
            (self.small.as_bytes(), self.small.offset_in(arena)),
            (self.d.as_bytes(), self.d.offset_in(arena)),
            (self.dmin.as_bytes(), self.dmin.offset_in(arena)),
            (self.high.as_bytes(), self.high.offset_in(arena)),
        ]
    }

    /// A weight from arrays [`Self::arrays`] gave, if each holds as many values as
    /// [`Self::lens`] says (the kernels index them without further checks).
    pub(super) fn from_arrays(
        ty: KType,
        out: usize,
        nb: usize,
        [quants, small, d, dmin, high]: [Weights; 5],
    ) -> Option<Self> {
        let p = Self {
            ty,
            nb,
            groups: out.div_ceil(LANES),
            quants,
            small,
            d: d.cast()?,
            dmin: dmin.cast()?,
            high,
        };
        let held = [
            p.quants.len(),
            p.small.len(),
            p.d.len(),
            p.dmin.len(),
            p.high.len(),
        ];
        (held == Self::lens(ty, out, nb)).then_some(p)
    }

    /// Repacks the file's bytes of a `[out, in]` weight (`in` a multiple of 256).
    pub(super) fn pack(ty: KType, data: &[u8], out: usize, nb: usize) -> Self {
        let groups = out.div_ceil(LANES);
        let [quants, small, d, dmin, high] = Self::lens(ty, out, nb);
        let mut p = Self {
            ty,
            nb,
            groups,
            quants: Weights::zeroed(quants),
            small: Weights::zeroed(small),
            d: Weights::zeroed(d),
            dmin: Weights::zeroed(dmin),
            high: Weights::zeroed(high),
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
                                            // Bit 2i (low nibbles) or 2i + 1 (high) of
                                            // byte 4t + k, to bit t of byte k of the
                                            // lane's word of chunk i's nibble half.
                                            for h in 0..2 {
                                                let at =
                                                    gs * HIGH + ((i * 2 + h) * LANES + lane) * 4;
                                                for k in 0..4 {
                                                    let bit = (qh[4 * t + k] >> (2 * i + h)) & 1;
                                                    grp.high[at + k] |= bit << t;
                                                }
                                            }
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
                                        // The four values' top two bits, one per byte (byte
                                        // k for value k), into their field of the step
                                        // pair's bytes.
                                        let w = (word(high, 32 * half + l) >> (2 * quarter))
                                            & 0x0303_0303;
                                        let field = 4 * (s % 2) + 2 * half;
                                        let at = ((s / 2) * LANES + lane) * 4;
                                        for (k, byte) in top[at..at + 4].iter_mut().enumerate() {
                                            *byte |= (((w >> (8 * k)) & 3) as u8) << field;
                                        }
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
        let at = ((i * 2 + usize::from(hi)) * LANES + lane) * 4 + k;
        let bit = (blk.high[at] >> t) & 1;
        nibble | (bit << 4)
    }

    /// Value `16·g16 + 4t + k` of lane `lane` in a Q6_K block, unsigned 6 bits: the
    /// nibble (low for groups 0–7, high for 8–15 of step `(g16 mod 8, t)`) and the top
    /// two bits.
    fn q6_value(blk: &Block<'_>, lane: usize, (g16, t, k): (usize, usize, usize)) -> u8 {
        let (step, hi) = ((g16 % 8) * 4 + t, usize::from(g16 >= 8));
        let byte = blk.quants[(step * LANES + lane) * 4 + k];
        let nibble = (byte >> (4 * hi)) & 0x0F;
        let field = 4 * (step % 2) + 2 * hi;
        let top = (blk.high[((step / 2) * LANES + lane) * 4 + k] >> field) & 3;
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

    /// Panics unless `row` holds what the SIMD kernels read of it: `nb` super-blocks of
    /// quants, scales and sums.
    fn check_row(&self, row: &ActRow) {
        assert!(
            row.qs.len() >= self.nb * QK_K
                && row.d.len() >= self.nb
                && row.sums.len() >= self.nb * K_SUMS
        );
    }

    /// Group `g`'s sixteen outputs for each of `rows` (at most four): `out[r·16 + lane]`
    /// is the product of weight row `16g + lane` with activation row `r`.
    pub(super) fn group(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        assert!(rows.len() <= ROW_TILE && out.len() >= rows.len() * LANES);
        for row in rows {
            self.check_row(row);
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

    /// Groups `groups`' sixteen outputs each for one activation row (decode), into
    /// `out` (`16·groups.len()`): [`Self::group`]'s bits. With AVX-512 or AVX2 the
    /// groups go [`STREAMS`] at a time, one from each of as many equal runs of the
    /// range, block by block in lockstep, so that the core reads that many sequential
    /// streams of quants, where `read` says so; else one group after another.
    pub(super) fn decode(
        &self,
        groups: std::ops::Range<usize>,
        row: &ActRow,
        out: &mut [f32],
        read: DecodeRead,
    ) {
        assert!(groups.end <= self.groups);
        let rows = std::slice::from_ref(row);
        let streamed = |out: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            if super::simd() >= super::Simd::Avx2
                && read == DecodeRead::Streams
                && groups.len() >= STREAMS
            {
                self.check_row(row);
                // Q6_K reads two arrays (quants and top bits): two groups at a time.
                return if self.ty == KType::Q6K {
                    self.streams::<2>(groups.clone(), rows, out)
                } else {
                    self.streams::<STREAMS>(groups.clone(), rows, out)
                };
            }
            groups.clone()
        };
        decode_with(groups.clone(), out, streamed, |g, d| self.group(g, rows, d));
    }

    /// [`Self::decode`]'s groups `S` at a time with AVX-512 or AVX2 (`in_streams`);
    /// returns the groups left over. The caller has checked the CPU, `row` and `out`.
    #[cfg(target_arch = "x86_64")]
    fn streams<const S: usize>(
        &self,
        groups: std::ops::Range<usize>,
        row: &[ActRow],
        out: &mut [f32],
    ) -> std::ops::Range<usize> {
        let avx512 = super::simd() == super::Simd::Avx512Vnni;
        debug_assert!(avx512 || super::simd() == super::Simd::Avx2);
        in_streams::<S>(groups.clone(), |gs| {
            #[expect(unsafe_code, reason = "the CPU was checked for these features")]
            // SAFETY: `decode` found AVX-512 F/BW/VL/VNNI, AVX2 and FMA (or AVX2 and
            // FMA) and checked the row, `decode_with` `out`; the blocks are checked by
            // `block`.
            unsafe {
                if avx512 {
                    avx512::streams::<S>(self, (gs, groups.start), row, out);
                } else {
                    avx2::streams::<S>(self, (gs, groups.start), row, out);
                }
            };
        })
    }

    /// Whether [`Self::amx_tile`] takes this type (Q4_K, Q5_K, Q6_K).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn has_amx(&self) -> bool {
        matches!(self.ty, KType::Q4K | KType::Q5K | KType::Q6K)
    }

    /// Group `g`'s super-blocks unpacked for [`Self::amx_tile`] (`nb·4096` bytes), into
    /// `w`. Only with AMX ([`super::amx::available`]) and [`Self::has_amx`].
    #[cfg(target_arch = "x86_64")]
    pub(super) fn amx_unpack(&self, g: usize, w: &mut Vec<i8>) {
        assert!(super::amx::available() && self.has_amx() && g < self.groups);
        w.resize(self.nb * amx::UNPACKED, 0);
        #[expect(
            unsafe_code,
            reason = "AVX-512 over buffers whose lengths are set first"
        )]
        // SAFETY: AMX is only available with the AVX-512 kernels; Q4_K, Q5_K or Q6_K;
        // `w` was sized.
        unsafe {
            amx::unpack(self, g, w);
        }
    }

    /// [`Self::group`] for sixteen rows with AMX (Q4_K, Q5_K, Q6_K): `w` is group `g`
    /// from [`Self::amx_unpack`], `a` the rows' quants one after another (`nb·256`
    /// each).
    /// With `ahead`, the next group's quants are fetched meanwhile (give it for one
    /// tile per group).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn amx_tile(
        &self,
        g: usize,
        (w, a): (&[i8], &[i8]),
        rows: &[ActRow],
        out: &mut [f32],
        ahead: bool,
    ) {
        assert!(
            super::amx::available()
                && self.has_amx()
                && g < self.groups
                && w.len() == self.nb * amx::UNPACKED
                && rows.len() == super::amx::TILE_ROWS
                && a.len() >= super::amx::TILE_ROWS * self.nb * QK_K
                && out.len() >= super::amx::TILE_ROWS * LANES
        );
        for row in rows {
            assert!(row.d.len() >= self.nb && row.sums.len() >= self.nb * K_SUMS);
        }
        let bytes = self.nb * self.ty.quant_bytes();
        let ahead = if ahead && g + 1 < self.groups {
            &self.quants[(g + 1) * bytes..(g + 2) * bytes]
        } else {
            &[]
        };
        #[expect(
            unsafe_code,
            reason = "AMX and AVX-512 over buffers whose lengths are asserted first"
        )]
        // SAFETY: AMX is available (and with it AVX-512); Q4_K, Q5_K or Q6_K; buffers
        // checked.
        unsafe {
            if self.ty == KType::Q6K {
                amx::tile::<true>(self, g, (w, a), rows, out, ahead);
            } else {
                amx::tile::<false>(self, g, (w, a), rows, out, ahead);
            }
        }
    }

    /// Group `g`'s super-blocks unpacked for [`Self::avx2_unpacked`] (`nb·4096` bytes)
    /// into `w`, on a CPU with AVX2.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn avx2_unpack(&self, g: usize, w: &mut Vec<u8>) {
        assert!(super::detected_simd() >= super::Simd::Avx2 && g < self.groups);
        w.resize(self.nb * avx2::UNPACKED, 0);
        #[expect(unsafe_code, reason = "AVX2 over buffers whose lengths are set first")]
        // SAFETY: the CPU has AVX2 and FMA; `w` was sized.
        unsafe {
            avx2::unpack(self, g, w);
        }
    }

    /// [`Self::group`]'s outputs for any number of `rows` from group `g` unpacked in
    /// `w` ([`Self::avx2_unpack`]), with AVX2: the same bits.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn avx2_unpacked(&self, g: usize, w: &[u8], rows: &[ActRow], out: &mut [f32]) {
        assert!(
            super::detected_simd() >= super::Simd::Avx2
                && g < self.groups
                && w.len() == self.nb * avx2::UNPACKED
                && out.len() >= rows.len() * LANES
        );
        for row in rows {
            self.check_row(row);
        }
        #[expect(
            unsafe_code,
            reason = "AVX2 over buffers whose lengths are asserted first"
        )]
        // SAFETY: the CPU has AVX2 and FMA; `w`, the rows and `out` checked.
        unsafe {
            avx2::unpacked(self, g, w, rows, out);
        }
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
pub(super) mod avx512;

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "AMX and SIMD over buffers whose lengths are asserted first"
)]
mod amx;

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
pub(super) mod avx2;

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::super::tests::{assert_streams_give_scalar_bits, cpu_has};
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

    /// `n` activation rows of `nb` super-blocks, quantized: row 0 all +127 in its first
    /// super-block, row 1 zeros there, row 2 ±127, the rest varied.
    fn extreme_rows(nb: usize, n: usize) -> Vec<ActRow> {
        let k = nb * QK_K;
        let mut x: Vec<f32> = (0..k * n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        x[..QK_K].fill(2.5);
        x[k..k + QK_K].fill(0.0);
        for (i, v) in x[2 * k..2 * k + QK_K].iter_mut().enumerate() {
            *v = if i % 3 == 0 { -1.0 } else { 1.0 };
        }
        x.chunks_exact(k).map(quantize_row_k).collect()
    }

    /// The AVX2 and AVX-512 group kernels give the scalar kernel's bits: both types,
    /// one to five super-blocks, one to four activation rows, a last group with padding
    /// rows, extreme weights (above) and activations (all +127, zeros, ±127).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_group_kernels_equal_the_scalar_one() {
        if !cpu_has(Simd::Avx2) {
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
                let rows = extreme_rows(nb, ROW_TILE);
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

    /// The AVX2 prefill from a group unpacked once gives the scalar kernel's bits: every
    /// K-quant, one to five super-blocks, one to thirteen activation rows (four at
    /// a time and the rest), a last group with padding rows, extreme weights and
    /// activations.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_unpacked_prefill_equals_the_scalar_kernel() {
        if !cpu_has(Simd::Avx2) {
            return;
        }
        for ty in TYPES {
            for nb in [1, 2, 3, 5] {
                let out = 20;
                let packed = KPacked::pack(ty, &extreme_weight(ty, out, nb), out, nb);
                let rows = extreme_rows(nb, 13);
                let mut w = Vec::new();
                for g in 0..packed.groups {
                    packed.avx2_unpack(g, &mut w);
                    for n in [1, 2, 3, 4, 5, 7, 8, 9, 13] {
                        let mut want = vec![0f32; n * LANES];
                        packed.group_scalar(g, &rows[..n], &mut want);
                        let mut got = vec![0f32; n * LANES];
                        packed.avx2_unpacked(g, &w, &rows[..n], &mut got);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{ty:?}, {nb} super-blocks, group {g}, {n} rows"
                        );
                    }
                }
            }
        }
    }

    /// The AVX2 and AVX-512 streams kernels (decode) give the scalar kernel's bits for
    /// each of their groups: four groups and two, from runs of a range that starts past
    /// group 0 and ends with a group with padding rows; every type, one and three
    /// super-blocks, extreme weights and each extreme activation row.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_streams_kernels_equal_the_scalar_one() {
        fn check<const S: usize>(
            packed: &KPacked,
            at: ([usize; S], usize),
            row: &[ActRow],
            what: &str,
        ) {
            assert_streams_give_scalar_bits(
                (packed.groups, &at.0, at.1),
                |g, out| packed.group_scalar(g, row, out),
                |family, out| {
                    #[expect(unsafe_code, reason = "the families were checked")]
                    // SAFETY: the CPU runs `family` (checked by the caller and the
                    // helper); `out` holds every group from `first`.
                    unsafe {
                        if family == Simd::Avx2 {
                            avx2::streams::<S>(packed, at, row, out);
                        } else {
                            avx512::streams::<S>(packed, at, row, out);
                        }
                    }
                },
                what,
            );
        }
        if !cpu_has(Simd::Avx2) {
            return;
        }
        for ty in TYPES {
            for nb in [1, 3] {
                // 88 outputs: 6 groups, the last with 8 padding lanes.
                let packed = KPacked::pack(ty, &extreme_weight(ty, 88, nb), 88, nb);
                let rows = extreme_rows(nb, 3);
                for r in 0..rows.len() {
                    let at = format!("{ty:?}, {nb} super-blocks, row {r}");
                    check::<4>(&packed, ([1, 2, 4, 5], 1), &rows[r..=r], &at);
                    check::<2>(&packed, ([2, 5], 1), &rows[r..=r], &at);
                }
            }
        }
    }

    /// Q3_K's AVX-512 kernel with GFNI and without (a CPU with GFNI runs the first,
    /// so the group and streams tests above only reach the second on one without)
    /// gives the scalar kernel's bits: one and three super-blocks, one and four
    /// activation rows, each group (the last with padding rows), and four groups in
    /// lockstep, extreme weights and activations.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q3k_kernels_with_and_without_gfni_equal_the_scalar_one() {
        /// `lowk::avx512::q23k` (or `q3k_gfni`) of `rows` (`R` of them) through `gs`.
        fn run<const S: usize, const R: usize>(
            p: &KPacked,
            at: ([usize; S], usize),
            rows: &[ActRow],
            gfni: bool,
        ) -> Vec<u32> {
            let mut out = vec![f32::NAN; (p.groups - at.1) * LANES * R];
            #[expect(unsafe_code, reason = "the features were checked by the caller")]
            // SAFETY: the caller found AVX-512 VNNI, AVX2 and FMA (and GFNI where
            // `gfni`); `R` rows of `p.nb` super-blocks, `out` holds every group from
            // `first`.
            unsafe {
                if gfni {
                    lowk::avx512::q3k_gfni::<S, R>(p, at, rows, &mut out);
                } else {
                    lowk::avx512::q23k::<S, R, true, false>(p, at, rows, &mut out);
                }
            }
            out.iter().map(|v| v.to_bits()).collect()
        }
        if !cpu_has(Simd::Avx512Vnni) {
            return;
        }
        let mut with = vec![false];
        if std::arch::is_x86_feature_detected!("gfni") {
            with.push(true);
        } else {
            eprintln!("the GFNI kernel skipped: this CPU has no GFNI");
        }
        for nb in [1, 3] {
            let packed = KPacked::pack(KType::Q3K, &extreme_weight(KType::Q3K, 88, nb), 88, nb);
            let rows = extreme_rows(nb, 4);
            let scalar = |g: usize, rows: &[ActRow]| {
                let mut want = vec![0f32; LANES * rows.len()];
                packed.group_scalar(g, rows, &mut want);
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            for &gfni in &with {
                let at = format!("{nb} super-blocks, GFNI {gfni}");
                for g in 0..packed.groups {
                    let got = run::<1, 4>(&packed, ([g], g), &rows, gfni);
                    assert_eq!(
                        got[..4 * LANES],
                        scalar(g, &rows),
                        "{at}, group {g}, 4 rows"
                    );
                    for r in 0..rows.len() {
                        let got = run::<1, 1>(&packed, ([g], g), &rows[r..=r], gfni);
                        let want = scalar(g, &rows[r..=r]);
                        assert_eq!(got[..LANES], want, "{at}, group {g}, row {r}");
                    }
                }
                for r in 0..rows.len() {
                    let got = run::<4, 1>(&packed, ([1, 2, 4, 5], 1), &rows[r..=r], gfni);
                    for g in [1, 2, 4, 5] {
                        let want = scalar(g, &rows[r..=r]);
                        let at = format!("{at}, four streams, group {g}, row {r}");
                        assert_eq!(got[(g - 1) * LANES..g * LANES], want, "{at}");
                    }
                }
            }
        }
    }

    /// The AMX tiles (sixteen rows) give the scalar kernel's bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_tiles_equal_the_scalar_kernel() {
        if !super::super::amx::available() {
            eprintln!("skipped: this process cannot use AMX");
            return;
        }
        let tile = super::super::amx::TILE_ROWS;
        for ty in [KType::Q4K, KType::Q5K, KType::Q6K] {
            for nb in [1, 3] {
                let out = 20;
                let packed = KPacked::pack(ty, &extreme_weight(ty, out, nb), out, nb);
                let k = nb * QK_K;
                let rows = extreme_rows(nb, tile);
                let a: Vec<i8> = rows.iter().flat_map(|r| r.qs[..k].to_vec()).collect();
                let mut w = Vec::new();
                for g in 0..packed.groups {
                    let mut want = vec![0f32; tile * LANES];
                    for (rows, want) in rows.chunks(ROW_TILE).zip(want.chunks_mut(ROW_TILE * LANES))
                    {
                        packed.group_scalar(g, rows, want);
                    }
                    packed.amx_unpack(g, &mut w);
                    let mut got = vec![0f32; tile * LANES];
                    packed.amx_tile(g, (&w, &a), &rows, &mut got, g % 2 == 0);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{ty:?}, {nb} super-blocks, group {g}"
                    );
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
