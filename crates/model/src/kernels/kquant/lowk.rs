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
//!   4t + 4` with their bits moved: the file's bit `4n + j` of byte `k` (value `128n +
//!   32j + 4t + k`'s) is bit [`high_bit`]`(n, j)` here, a position that field `j`'s two
//!   bits do not take in the quant byte, so that one bitwise select takes both into one
//!   byte (AVX-512 with GFNI). `small` holds the scales minus 32 as signed bytes; `d`:
//!   `[gs·16 + lane]`. The kernels read the unsigned 3 bits `u = q + 4·h` and take
//!   ggml's weight `u − 4` (`q − 4` where the high bit is clear) through the
//!   activations' sums of 16.

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

/// Where the high bit of field `j` of half `n` lies in a repacked Q3_K high-bit byte:
/// in the place of field `j + 2 (mod 4)`'s bits in the quant byte (its low bit for half
/// 0, its high bit for half 1), never at bits `2j, 2j + 1`, where field `j` lies.
#[inline(always)]
pub(super) const fn high_bit(n: usize, j: usize) -> usize {
    2 * ((j + 2) % 4) + n
}

/// A file's Q3_K high-bit byte with bit `4n + j` moved to [`high_bit`]`(n, j)`.
fn move_high_bits(byte: u8) -> u8 {
    let mut out = 0;
    for n in 0..2 {
        for j in 0..4 {
            out |= ((byte >> (4 * n + j)) & 1) << high_bit(n, j);
        }
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
            for (dst, &byte) in high[at..at + 4].iter_mut().zip(&block[4 * t..4 * t + 4]) {
                *dst = move_high_bits(byte);
            }
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
        let h = (blk.high[(t * LANES + lane) * 4 + k] >> high_bit(n, j)) & 1;
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
pub(super) mod avx512;

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
pub(super) mod avx2;
