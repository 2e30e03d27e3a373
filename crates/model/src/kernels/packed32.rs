//! Weights in blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and what converts to them)
//! repacked sixteen rows at a time, as [`super::kquant`] does for the K-quants: for every
//! four consecutive values of a block, the group's sixteen rows' four weight bytes lie
//! side by side, one 32-bit lane per row, so four broadcast activation bytes give all
//! sixteen rows' partial sums in one multiply-add and lane `l` holds row `l`'s output.
//!
//! Three forms: *nibbles* (unsigned 4-bit `q`, or 5-bit with a fifth-bit byte per lane
//! and step; weight `d·(q − offset) (+ m)`: Q4_1 with offset 0 and `m`, Q4_0 with
//! offset 8, Q5_0 5-bit with offset 16, Q5_1 5-bit with `m`), *codebook* (4-bit indices
//! into IQ4_NL's signed bytes: IQ4_NL, IQ4_XS) and *bytes* (signed 8-bit `q`, weight
//! `d·q`: Q8_0; held as the unsigned `q + 128`, in the file's 34 bytes per block with
//! its f16 scale).
//!
//! Per output, whatever the instruction set: each block's `Σ (q_w − offset)·q_a` is an
//! exact integer (the offset taken off as `offset·Σ q_a`), then `acc = fma(d_w·d_a, Σ,
//! acc)` and, with a minimum, `acc = fma(m, s_a, acc)` (`s_a = d_a·Σ q_a`; `fma` rounds
//! once), and the output is `acc`: one chain of fused multiply-adds, the same in the
//! scalar, AVX2 and AVX-512 kernels, so all give the same bits for any number of
//! activation rows.
//!
//! Layout per group and block (`gb = group·nb + b`; padding rows are zeros):
//! - nibbles and codebook: `quants[gb·256..]` as `[step t: 4][lane: 16][4 bytes]`, the
//!   row's file bytes `4t..4t + 4`: low nibbles are values `4t..`, high nibbles values
//!   `16 + 4t..`; 5-bit: `high[gb·64..]` as `[step t][lane]`, bit `k` the fifth bit of
//!   value `4t + k`, bit `4 + k` that of value `16 + 4t + k`;
//! - bytes: `quants[gb·512..]` as `[step t: 8][lane][4 bytes]`, values `4t..4t + 4`,
//!   each `q + 128`;
//! - `d` (f16 for bytes), `m`: `[gb·16 + lane]` (`m` empty without minimums).
//!
//! The quants start on a 64-byte boundary, so no 512-bit load of a step straddles two
//! cache lines, and lie on huge pages where the OS gives them (`memory.rs`).

use half::f16;
use rayon::prelude::*;

use super::memory::Weights;
use super::{ActRow, QK, QuantKind, ROW_TILE, per_group, word_at};

/// Weight rows per group.
pub(super) const LANES: usize = 16;

/// How far ahead of its loads, in bytes of packed quants, a kernel asks for the cache
/// line it will read (one prefetch per 64 bytes). Decode streams the whole weight from
/// memory once; the hardware prefetcher alone left one core at about 20 GB/s, and
/// 16 KiB ahead (32 blocks of bytes) took a 64 MiB Q8_0 matrix-vector product from
/// ~3.4-4.2 ms to ~1.8-2.6 ms (`kernel_speed`, 8192×8192, 1 thread, a busy machine).
const PREFETCH: usize = 16 << 10;

/// The forms of quants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    /// 4-bit quants (with `five`, plus a fifth bit from `high`: Q5_0, Q5_1); the
    /// weight's integer is `q − offset`.
    Nibbles {
        offset: i32,
        five: bool,
    },
    /// 4-bit indices into IQ4_NL's codebook of signed bytes ([`CODEBOOK`]).
    Codebook,
    Bytes,
}

/// ggml's `kvalues_iq4nl`: the integers IQ4_NL and IQ4_XS indices stand for.
pub(super) const CODEBOOK: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl Form {
    /// Bytes of quants per row and block, as the per-row arrays hold them: with
    /// fifth bits, the 16 bytes of nibbles and then the 4 of fifth bits (ggml's `qh`,
    /// bit `j` for value `j`).
    /// The form of a blocks-of-32 type's kernel (Q8_0 for any other).
    pub(super) fn of(kind: QuantKind) -> Self {
        match kind {
            QuantKind::Q4_0 => Self::Nibbles {
                offset: 8,
                five: false,
            },
            QuantKind::Q4_1 => Self::Nibbles {
                offset: 0,
                five: false,
            },
            QuantKind::Q5_0 => Self::Nibbles {
                offset: 16,
                five: true,
            },
            QuantKind::Q5_1 => Self::Nibbles {
                offset: 0,
                five: true,
            },
            QuantKind::Iq4Nl | QuantKind::Iq4Xs => Self::Codebook,
            _ => Self::Bytes,
        }
    }

    pub(super) fn row_bytes(self) -> usize {
        match self {
            Self::Nibbles { five: true, .. } => QK / 2 + 4,
            Self::Nibbles { .. } | Self::Codebook => QK / 2,
            Self::Bytes => QK,
        }
    }

    /// Bytes of packed quants per row and block (fifth bits apart).
    fn packed_bytes(self) -> usize {
        match self {
            Self::Nibbles { .. } | Self::Codebook => QK / 2,
            Self::Bytes => QK,
        }
    }
}

/// A `[out, in]` weight in blocks of 32, repacked in groups of [`LANES`] rows.
#[derive(Debug)]
pub(super) struct Packed32 {
    pub(super) form: Form,
    /// Blocks per row.
    pub(super) nb: usize,
    pub(super) groups: usize,
    /// The packed quants, from a 64-byte boundary (see [`Weights`]).
    quants: Weights,
    /// Scales (not for bytes).
    d: Weights<f32>,
    /// Bytes' scales, as the file holds them (exactly: Q8_0's are f16).
    d16: Weights<f16>,
    m: Weights<f32>,
    /// Fifth bits: `[step t: 4][lane]` one byte each per group and block, bit `k` for
    /// value `4t + k`, bit `4 + k` for value `16 + 4t + k`.
    high: Weights,
}

struct Block<'a> {
    quants: &'a [u8],
    d: &'a [f32],
    d16: &'a [f16],
    m: &'a [f32],
    high: &'a [u8],
}

impl Block<'_> {
    /// Lane `lane`'s scale.
    fn scale(&self, lane: usize) -> f32 {
        if self.d16.is_empty() {
            self.d[lane]
        } else {
            self.d16[lane].to_f32()
        }
    }
}

/// One group's slots of [`Packed32`]'s arrays, to fill: quants, d, d16, m, high.
type Parts<'a> = (
    &'a mut [u8],
    &'a mut [f32],
    &'a mut [f16],
    &'a mut [f32],
    &'a mut [u8],
);

/// Slot `gb`'s `n` entries of a per-slot array, or nothing when the form has no such
/// array.
#[inline(always)]
fn slot<T>(v: &[T], gb: usize, n: usize) -> &[T] {
    if v.is_empty() {
        &[]
    } else {
        &v[gb * n..(gb + 1) * n]
    }
}

impl Packed32 {
    /// Repacks per-row arrays: `quants` (`form.row_bytes()` per block, row after row),
    /// `d` per block, `m` per block or empty.
    pub(super) fn pack(
        form: Form,
        quants: &[u8],
        d: &[f32],
        m: &[f32],
        out: usize,
        nb: usize,
    ) -> Self {
        let rb = form.row_bytes();
        Self::pack_with(form, !m.is_empty(), (out, nb), |i, src| {
            src.copy_from_slice(&quants[i * rb..(i + 1) * rb]);
            (d[i], m.get(i).copied().unwrap_or(0.0))
        })
    }

    /// Repacks blocks that `read(i, src)` gives one at a time, block `i = o·nb + b`
    /// (row `o`, block `b`): it fills `src` (`form.row_bytes()`) and returns the
    /// block's scale and minimum (ignored unless `has_min`). Reading the file's blocks
    /// this way leaves no per-row copy of the weight.
    pub(super) fn pack_with(
        form: Form,
        has_min: bool,
        (out, nb): (usize, usize),
        read: impl Fn(usize, &mut [u8]) -> (f32, f32) + Sync,
    ) -> Self {
        let groups = out.div_ceil(LANES);
        let slots = groups * nb;
        let qb = form.packed_bytes() * LANES;
        let five = matches!(form, Form::Nibbles { five: true, .. });
        let bytes = form == Form::Bytes;
        let mut held = Weights::zeroed(slots * qb);
        // Bytes are held as `q + 128`: zero padding rows stay weights 0.
        if bytes {
            held.fill(0x80);
        }
        let mut p = Self {
            form,
            nb,
            groups,
            quants: held,
            d: Weights::zeroed(if bytes { 0 } else { slots * LANES }),
            d16: Weights::zeroed(if bytes { slots * LANES } else { 0 }),
            m: Weights::zeroed(if has_min { slots * LANES } else { 0 }),
            high: Weights::zeroed(if five { slots * 4 * LANES } else { 0 }),
        };
        let rb = form.row_bytes();
        let parts = (
            per_group(&mut p.quants, groups),
            per_group(&mut p.d, groups),
            per_group(&mut p.d16, groups),
            per_group(&mut p.m, groups),
            per_group(&mut p.high, groups),
        );
        let pack_group = |g: usize, (q, ds, d16s, ms, high): Parts<'_>| {
            // Read once here: as captures they would be re-read after every store.
            let (bytes, five, has_min, rb, qb) = (bytes, five, has_min, rb, qb);
            for o in g * LANES..out.min((g + 1) * LANES) {
                let lane = o % LANES;
                let mut block = [0u8; QK];
                for b in 0..nb {
                    let gb = b;
                    let src = &mut block[..rb];
                    let (scale, min) = read(o * nb + b, src);
                    let src = &*src;
                    let dst = &mut q[gb * qb..(gb + 1) * qb];
                    // Bytes are held as q + 128: the sign bit of each byte flipped.
                    let flip = if bytes { 0x8080_8080 } else { 0 };
                    for t in 0..qb / LANES / 4 {
                        let at = (t * LANES + lane) * 4;
                        let w = u32::from_le_bytes(src[4 * t..4 * t + 4].try_into().expect("4"));
                        dst[at..at + 4].copy_from_slice(&(w ^ flip).to_le_bytes());
                    }
                    if five {
                        // Step t: values 4t..4t + 4 (low nibbles) and 16 + 4t.. (high), so
                        // the fifth bits 4t..4t + 4 and 16 + 4t.. of the block's word.
                        let qh = u32::from_le_bytes(src[16..20].try_into().expect("4 bytes"));
                        for t in 0..4 {
                            high[gb * 4 * LANES + t * LANES + lane] = (((qh >> (4 * t)) & 0xF)
                                | (((qh >> (16 + 4 * t)) & 0xF) << 4))
                                as u8;
                        }
                    }
                    if bytes {
                        let half = f16::from_f32(scale);
                        assert!(
                            half.to_f32().to_bits() == scale.to_bits(),
                            "a byte block's scale {scale} is not an f16"
                        );
                        d16s[gb * LANES + lane] = half;
                    } else {
                        ds[gb * LANES + lane] = scale;
                    }
                    if has_min {
                        ms[gb * LANES + lane] = min;
                    }
                }
            }
        };
        parts
            .into_par_iter()
            .enumerate()
            .for_each(|(g, part)| pack_group(g, part));
        p
    }

    pub(super) fn has_min(&self) -> bool {
        !self.m.is_empty()
    }

    #[inline(always)]
    fn block(&self, g: usize, b: usize) -> Block<'_> {
        let gb = g * self.nb + b;
        let qb = self.form.packed_bytes() * LANES;
        let q = gb * qb;
        Block {
            quants: &self.quants[q..q + qb],
            d: slot(&self.d, gb, LANES),
            d16: slot(&self.d16, gb, LANES),
            m: slot(&self.m, gb, LANES),
            high: slot(&self.high, gb, 4 * LANES),
        }
    }

    /// Row `o`'s quant of value `j` of block `b` as the kernels see it (nibble 0..15 or
    /// signed byte).
    fn quant(&self, blk: &Block<'_>, lane: usize, j: usize) -> i32 {
        match self.form {
            Form::Nibbles { offset, five } => {
                let (t, k) = ((j % 16) / 4, j % 4);
                let byte = blk.quants[(t * LANES + lane) * 4 + k];
                let mut q = if j < 16 { byte & 0x0F } else { byte >> 4 };
                if five {
                    let bit = (blk.high[t * LANES + lane] >> (k + 4 * usize::from(j >= 16))) & 1;
                    q |= bit << 4;
                }
                i32::from(q) - offset
            }
            Form::Codebook => {
                let (t, k) = ((j % 16) / 4, j % 4);
                let byte = blk.quants[(t * LANES + lane) * 4 + k];
                let index = if j < 16 { byte & 0x0F } else { byte >> 4 };
                i32::from(CODEBOOK[usize::from(index)])
            }
            Form::Bytes => {
                let (t, k) = (j / 4, j % 4);
                i32::from(blk.quants[(t * LANES + lane) * 4 + k]) - 128
            }
        }
    }

    /// Row `o`'s block `b` as f32: `d·q (+ m)`, appended.
    pub(super) fn dequantize_block(&self, o: usize, b: usize, out: &mut Vec<f32>) {
        let (g, lane) = (o / LANES, o % LANES);
        let blk = self.block(g, b);
        let d = blk.scale(lane);
        let m = if blk.m.is_empty() {
            None
        } else {
            Some(blk.m[lane])
        };
        out.extend((0..QK).map(|j| {
            let x = d * self.quant(&blk, lane, j) as f32;
            m.map_or(x, |m| x + m)
        }));
    }

    /// Group `g`'s sixteen outputs for each of `rows` (at most [`ROW_TILE`]):
    /// `out[r·16 + lane]`.
    pub(super) fn group(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        assert!(rows.len() <= ROW_TILE && out.len() >= rows.len() * LANES);
        for row in rows {
            assert!(
                row.qs.len() >= self.nb * QK
                    && row.d.len() >= self.nb
                    && row.isums.len() >= self.nb
                    && (!self.has_min() || row.s.len() >= self.nb)
            );
        }
        #[cfg(target_arch = "x86_64")]
        match super::simd() {
            super::Simd::Avx512Vnni => {
                #[expect(unsafe_code, reason = "the CPU was checked for these features")]
                // SAFETY: simd() found AVX-512 F/BW/VL/VNNI, AVX2 and FMA; buffers checked.
                unsafe {
                    avx512::group(self, g, rows, out)
                };
                return;
            }
            super::Simd::Avx2 => {
                #[expect(unsafe_code, reason = "the CPU was checked for AVX2, FMA and F16C")]
                // SAFETY: simd() found AVX2, FMA and F16C; buffers checked.
                unsafe {
                    avx2::group(self, g, rows, out)
                };
                return;
            }
            super::Simd::Scalar => {}
        }
        self.group_scalar(g, rows, out);
    }

    /// [`Self::group`] without SIMD: the definition every kernel equals bit for bit.
    pub(super) fn group_scalar(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        for (r, row) in rows.iter().enumerate() {
            for lane in 0..LANES {
                let mut acc = 0f32;
                for b in 0..self.nb {
                    let blk = self.block(g, b);
                    let a = &row.qs[b * QK..(b + 1) * QK];
                    let isum: i32 = (0..QK)
                        .map(|j| self.quant(&blk, lane, j) * i32::from(a[j]))
                        .sum();
                    acc = (blk.scale(lane) * row.d[b]).mul_add(isum as f32, acc);
                    if !blk.m.is_empty() {
                        acc = blk.m[lane].mul_add(row.s[b], acc);
                    }
                }
                out[r * LANES + lane] = acc;
            }
        }
    }
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
    use super::{ActRow, CODEBOOK, Form, LANES, PREFETCH, Packed32, QK, word_at};

    /// # Safety
    /// The CPU must support AVX-512 F, BW, VL and VNNI, AVX2 and FMA; `rows` (at most
    /// [`ROW_TILE`]) must hold `p.nb` blocks (quants, scales, integer sums, and sums `s`
    /// with a minimum) and `out` `16·rows.len()` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn group(p: &Packed32, g: usize, rows: &[ActRow], out: &mut [f32]) {
        // SAFETY: every arm calls with what this function requires.
        unsafe {
            match p.form {
                Form::Nibbles { five: false, .. } => with_rows::<NIBBLES>(p, g, rows, out),
                Form::Nibbles { five: true, .. } => with_rows::<FIVE>(p, g, rows, out),
                Form::Codebook => with_rows::<CODEBOOK_FORM>(p, g, rows, out),
                Form::Bytes => with_rows::<BYTES>(p, g, rows, out),
            }
        }
    }

    /// The forms as constants, so each gets its own kernel without a branch inside:
    /// with one shared body, the compiler hoisted the activation broadcasts common to
    /// the forms' branches and spilled them to the stack.
    const NIBBLES: u8 = 0;
    const FIVE: u8 = 1;
    const CODEBOOK_FORM: u8 = 2;
    const BYTES: u8 = 3;

    /// # Safety
    /// As [`group`]; `F` must be `p.form`'s constant.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn with_rows<const F: u8>(p: &Packed32, g: usize, rows: &[ActRow], out: &mut [f32]) {
        // SAFETY: every arm calls with what this function requires.
        unsafe {
            match rows.len() {
                0 => {}
                1 => rows_n::<1, F>(p, g, rows, out),
                2 => rows_n::<2, F>(p, g, rows, out),
                3 => rows_n::<3, F>(p, g, rows, out),
                4 => rows_n::<4, F>(p, g, rows, out),
                5 => rows_n::<5, F>(p, g, rows, out),
                6 => rows_n::<6, F>(p, g, rows, out),
                7 => rows_n::<7, F>(p, g, rows, out),
                _ => rows_n::<8, F>(p, g, rows, out),
            }
        }
    }

    /// `vpdpbusd` of the unsigned quants as held (nibbles, codebook values plus 128,
    /// bytes plus 128) with the signed activations; each row's integer sum starts at
    /// minus the offset times the block's activation sum, so it ends as the block's
    /// exact `Σ (q_w − offset)·q_a`.
    ///
    /// Each block is unpacked once into eight registers of unsigned bytes, then every
    /// row takes its products from them, its activation words broadcast straight from
    /// memory. (Interleaving the rows within each step instead made the compiler hoist
    /// all of a block's broadcasts and spill them to the stack.)
    ///
    /// # Safety
    /// As [`with_rows`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn rows_n<const R: usize, const F: u8>(
        p: &Packed32,
        g: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let low = _mm512_set1_epi8(0x0F);
        // The codebook plus 128 (unsigned bytes), in every 128-bit half.
        const SHIFTED: [i8; 16] = {
            let mut t = [0i8; 16];
            let mut i = 0;
            while i < 16 {
                t[i] = (CODEBOOK[i] as i16 + 128) as u8 as i8;
                i += 1;
            }
            t
        };
        let shifted = SHIFTED;
        // SAFETY: 16 readable bytes.
        let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(shifted.as_ptr().cast()) });
        let offset = match p.form {
            Form::Nibbles { offset, .. } => offset,
            Form::Codebook | Form::Bytes => 128,
        };
        // Each row's arrays, whose lengths `group` asserted.
        let qs: [*const i8; R] = std::array::from_fn(|r| rows[r].qs.as_ptr());
        let da: [*const f32; R] = std::array::from_fn(|r| rows[r].d.as_ptr());
        let sa: [*const f32; R] = std::array::from_fn(|r| rows[r].s.as_ptr());
        let isums: [*const i32; R] = std::array::from_fn(|r| rows[r].isums.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        let has_min = p.has_min();
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let q = blk.quants.as_ptr();
            // The block's weights as unsigned bytes: value `4t + k` of each lane in
            // byte k of its lane of `w[t]`.
            let mut w = [_mm512_setzero_si512(); 8];
            // SAFETY: the block's 256 (nibbles, codebook) or 512 (bytes) bytes of quants
            // and 64 of fifth bits.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(64 + PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(128 + PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(192 + PREFETCH).cast());
                if F == BYTES {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(256 + PREFETCH).cast());
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(320 + PREFETCH).cast());
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(384 + PREFETCH).cast());
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(448 + PREFETCH).cast());
                    for (t, w) in w.iter_mut().enumerate() {
                        *w = _mm512_loadu_si512(q.add(t * 64).cast());
                    }
                } else {
                    for t in 0..4 {
                        let x = _mm512_loadu_si512(q.add(t * 64).cast());
                        let mut wl = _mm512_and_si512(x, low);
                        let mut wh = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                        if F == CODEBOOK_FORM {
                            wl = _mm512_shuffle_epi8(table, wl);
                            wh = _mm512_shuffle_epi8(table, wh);
                        } else if F == FIVE {
                            // The lane's fifth-bit byte in all four of its bytes; byte k
                            // tests bit k (low nibbles) or 4 + k (high nibbles).
                            let hb = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                blk.high.as_ptr().add(t * LANES).cast(),
                            ));
                            let hb = _mm512_mullo_epi32(hb, _mm512_set1_epi32(0x0101_0101));
                            let ml = _mm512_test_epi8_mask(hb, _mm512_set1_epi32(0x0804_0201));
                            let mh =
                                _mm512_test_epi8_mask(hb, _mm512_set1_epi32(0x8040_2010u32 as i32));
                            wl = _mm512_mask_add_epi8(wl, ml, wl, _mm512_set1_epi8(16));
                            wh = _mm512_mask_add_epi8(wh, mh, wh, _mm512_set1_epi8(16));
                        }
                        w[t] = wl;
                        w[4 + t] = wh;
                    }
                }
            }
            // SAFETY: 16 scales each (`m` only with minimums).
            let d = unsafe {
                if F == BYTES {
                    _mm512_cvtph_ps(_mm256_loadu_si256(blk.d16.as_ptr().cast()))
                } else {
                    _mm512_loadu_ps(blk.d.as_ptr())
                }
            };
            for r in 0..R {
                // SAFETY: block b of each of the row's arrays (its value words lie in the
                // block's 32 bytes).
                unsafe {
                    let a = qs[r].add(b * QK);
                    let mut s0 = if offset == 0 {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_set1_epi32(-offset * *isums[r].add(b))
                    };
                    let mut s1 = _mm512_setzero_si512();
                    // Values 0..16 in the first chain, 16..32 in the second.
                    for t in 0..4 {
                        let lo = _mm512_set1_epi32(word_at(a.add(4 * t)));
                        let hi = _mm512_set1_epi32(word_at(a.add(16 + 4 * t)));
                        s0 = _mm512_dpbusd_epi32(s0, w[t], lo);
                        s1 = _mm512_dpbusd_epi32(s1, w[4 + t], hi);
                    }
                    let total = _mm512_add_epi32(s0, s1);
                    let dd = _mm512_mul_ps(d, _mm512_set1_ps(*da[r].add(b)));
                    acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(total), acc[r]);
                    if has_min {
                        let m = _mm512_loadu_ps(blk.m.as_ptr());
                        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(*sa[r].add(b)), acc[r]);
                    }
                }
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

    use super::{ActRow, CODEBOOK, Form, LANES, PREFETCH, Packed32, QK, word_at};

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; otherwise as `avx512::group`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group(p: &Packed32, g: usize, rows: &[ActRow], out: &mut [f32]) {
        // Four rows at a time: sixteen registers hold no more.
        for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
            for h in 0..2 {
                // SAFETY: every arm calls with what this function requires.
                unsafe {
                    match rows.len() {
                        0 => {}
                        1 => rows_n::<1>(p, g, h, rows, out),
                        2 => rows_n::<2>(p, g, h, rows, out),
                        3 => rows_n::<3>(p, g, h, rows, out),
                        _ => rows_n::<4>(p, g, h, rows, out),
                    }
                }
            }
        }
    }

    /// Lanes `8h..8h + 8`. Nibbles: `vpmaddubsw` pair sums added in 16 bits over the
    /// block (no overflow: 8·2·15·127 < 2¹⁵). Bytes: `|w|` times the activations with
    /// `w`'s sign (no pair overflows: 2·128·127 < 2¹⁵), widened every step.
    ///
    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_n<const R: usize>(
        p: &Packed32,
        g: usize,
        h: usize,
        rows: &[ActRow],
        out: &mut [f32],
    ) {
        let low = _mm256_set1_epi8(0x0F);
        let flip = _mm256_set1_epi8(i8::MIN);
        let ones = _mm256_set1_epi16(1);
        // SAFETY: 16 readable bytes.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(CODEBOOK.as_ptr().cast()) });
        let mut acc = [_mm256_setzero_ps(); R];
        let has_min = p.has_min();
        for b in 0..p.nb {
            let blk = p.block(g, b);
            let q = blk.quants.as_ptr();
            // SAFETY: `group`'s caller guarantees nb blocks of every row.
            let a: [*const i8; R] =
                std::array::from_fn(|r| unsafe { rows[r].qs.as_ptr().add(b * QK) });
            let mut isum = [_mm256_setzero_si256(); R];
            match p.form {
                Form::Nibbles { offset, five } => {
                    let mut sum16 = [_mm256_setzero_si256(); R];
                    for t in 0..4 {
                        // SAFETY: step t is 64 of the block's 256 bytes, half h 32 of
                        // them (and 8 of its 64 bytes of fifth bits); the activation words
                        // lie within the row's block.
                        unsafe {
                            if h == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    q.wrapping_add(t * 64 + PREFETCH).cast(),
                                );
                            }
                            let w = _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast());
                            let mut wl = _mm256_and_si256(w, low);
                            let mut wh = _mm256_and_si256(_mm256_srli_epi16::<4>(w), low);
                            if five {
                                let hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                    blk.high.as_ptr().add(t * LANES + 8 * h).cast(),
                                ));
                                let hb = _mm256_mullo_epi32(hb, _mm256_set1_epi32(0x0101_0101));
                                let bit = |pattern: i32| {
                                    let p = _mm256_set1_epi32(pattern);
                                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, p), p);
                                    _mm256_and_si256(set, _mm256_set1_epi8(16))
                                };
                                wl = _mm256_or_si256(wl, bit(0x0804_0201));
                                wh = _mm256_or_si256(wh, bit(0x8040_2010u32 as i32));
                            }
                            for r in 0..R {
                                let al = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                                let ah = _mm256_set1_epi32(word_at(a[r].add(16 + 4 * t)));
                                let x = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(wl, al),
                                    _mm256_maddubs_epi16(wh, ah),
                                );
                                sum16[r] = _mm256_add_epi16(sum16[r], x);
                            }
                        }
                        // Five bits: pair sums up to 2·2·31·127 per step, so two steps
                        // fit 16 bits (nibbles: all four).
                        if five && t % 2 == 1 {
                            for r in 0..R {
                                isum[r] =
                                    _mm256_add_epi32(isum[r], _mm256_madd_epi16(sum16[r], ones));
                                sum16[r] = _mm256_setzero_si256();
                            }
                        }
                    }
                    for r in 0..R {
                        let off = _mm256_set1_epi32(offset * rows[r].isums[b]);
                        let rest = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sum16[r], ones));
                        isum[r] = _mm256_sub_epi32(rest, off);
                    }
                }
                Form::Codebook => {
                    for t in 0..4 {
                        // SAFETY: step t is 64 of the block's 256 bytes, half h 32 of
                        // them; the activation words lie within the row's block.
                        unsafe {
                            if h == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    q.wrapping_add(t * 64 + PREFETCH).cast(),
                                );
                            }
                            let w = _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast());
                            let wl = _mm256_shuffle_epi8(table, _mm256_and_si256(w, low));
                            let wh = _mm256_shuffle_epi8(
                                table,
                                _mm256_and_si256(_mm256_srli_epi16::<4>(w), low),
                            );
                            let (absl, absh) = (_mm256_sign_epi8(wl, wl), _mm256_sign_epi8(wh, wh));
                            for r in 0..R {
                                let al = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                                let ah = _mm256_set1_epi32(word_at(a[r].add(16 + 4 * t)));
                                // No pair overflows: 2·127·127 < 2¹⁵.
                                let x = _mm256_add_epi32(
                                    _mm256_madd_epi16(
                                        _mm256_maddubs_epi16(absl, _mm256_sign_epi8(al, wl)),
                                        ones,
                                    ),
                                    _mm256_madd_epi16(
                                        _mm256_maddubs_epi16(absh, _mm256_sign_epi8(ah, wh)),
                                        ones,
                                    ),
                                );
                                isum[r] = _mm256_add_epi32(isum[r], x);
                            }
                        }
                    }
                }
                Form::Bytes => {
                    for t in 0..8 {
                        // SAFETY: step t is 64 of the block's 512 bytes, half h 32 of
                        // them; the activation word lies within the row's block.
                        unsafe {
                            if h == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    q.wrapping_add(t * 64 + PREFETCH).cast(),
                                );
                            }
                            // Held as `q + 128`: back to the signed `q`.
                            let w = _mm256_xor_si256(
                                _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast()),
                                flip,
                            );
                            let abs = _mm256_sign_epi8(w, w);
                            for r in 0..R {
                                let x = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                                let prod = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(x, w));
                                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(prod, ones));
                            }
                        }
                    }
                }
            }
            // SAFETY: 8 scales from lane 8h (`m` only with minimums).
            let d = unsafe {
                if blk.d16.is_empty() {
                    _mm256_loadu_ps(blk.d.as_ptr().add(8 * h))
                } else {
                    _mm256_cvtph_ps(_mm_loadu_si128(blk.d16.as_ptr().add(8 * h).cast()))
                }
            };
            for r in 0..R {
                let da = _mm256_set1_ps(rows[r].d[b]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[r]), acc[r]);
                if has_min {
                    // SAFETY: as above.
                    let m = unsafe { _mm256_loadu_ps(blk.m.as_ptr().add(8 * h)) };
                    acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(rows[r].s[b]), acc[r]);
                }
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
    use super::super::{Simd, Sums, detected_simd, quantize_row};
    use super::*;

    /// Every nibble variant (Q4_1, Q4_0, Q5_0, Q5_1) and the bytes (Q8_0).
    const NUMERIC_FORMS: [Form; 5] = [
        Form::Nibbles {
            offset: 0,
            five: false,
        },
        Form::Nibbles {
            offset: 8,
            five: false,
        },
        Form::Nibbles {
            offset: 16,
            five: true,
        },
        Form::Nibbles {
            offset: 0,
            five: true,
        },
        Form::Bytes,
    ];

    /// Per-row arrays of `out` rows × `nb` blocks with extremes in the first block of
    /// rows 0 and 1 (nibbles 0/15 mixed and all 15; bytes −128, 127, 0 and all −128),
    /// random elsewhere, and scales and minimums of both signs.
    fn rows_of(form: Form, out: usize, nb: usize, with_min: bool) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let rb = form.row_bytes();
        let mut quants: Vec<u8> = (0..out * nb * rb).map(|i| (i * 73 % 251) as u8).collect();
        for (i, q) in quants[..rb].iter_mut().enumerate() {
            *q = [0x00, 0xFF, 0x0F, 0xF0, 0x80, 0x7F][i % 6];
        }
        quants[nb * rb..nb * rb + rb].fill(match form {
            Form::Nibbles { .. } => 0xFF,
            // Index 0: −127.
            Form::Codebook => 0x00,
            Form::Bytes => 0x80,
        });
        let d: Vec<f32> = (0..out * nb)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) / 64.0)
            .collect();
        let m: Vec<f32> = if with_min {
            (0..out * nb)
                .map(|i| ((i * 11 % 13) as f32 - 6.0) / 32.0)
                .collect()
        } else {
            Vec::new()
        };
        (quants, d, m)
    }

    fn act_rows(k: usize, n: usize) -> Vec<ActRow> {
        let mut x: Vec<f32> = (0..k * n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        // Row 0 all +127 in its first block, row 1 zeros there, row 2 ±127.
        x[..QK].fill(2.5);
        if n > 1 {
            x[k..k + QK].fill(0.0);
        }
        if n > 2 {
            for (i, v) in x[2 * k..2 * k + QK].iter_mut().enumerate() {
                *v = if i % 3 == 0 { -1.0 } else { 1.0 };
            }
        }
        x.chunks_exact(k)
            .map(|r| quantize_row(r, Sums::F16))
            .collect()
    }

    /// The AVX2 and AVX-512 kernels give the scalar kernel's bits: every form, with and
    /// without minimums, 1, 2, 3 and 19 blocks, one to eight activation rows, a last
    /// group with padding rows, extreme quants and activations.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_group_kernels_equal_the_scalar_one() {
        if detected_simd() < Simd::Avx2 {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let avx512 = detected_simd() >= Simd::Avx512Vnni;
        for form in NUMERIC_FORMS.into_iter().chain([Form::Codebook]) {
            for with_min in [false, true] {
                for nb in [1, 2, 3, 19] {
                    let out = 20;
                    let (q, d, m) = rows_of(form, out, nb, with_min);
                    let packed = Packed32::pack(form, &q, &d, &m, out, nb);
                    let rows = act_rows(nb * QK, ROW_TILE);
                    assert_eq!(rows[0].qs[..QK], [127; QK]);
                    for g in 0..packed.groups {
                        for n in 1..=ROW_TILE {
                            let at = format!(
                                "{form:?}, minimum {with_min}, {nb} blocks, group {g}, {n} rows"
                            );
                            let mut want = [0f32; ROW_TILE * LANES];
                            packed.group_scalar(g, &rows[..n], &mut want);
                            let mut got = [0f32; ROW_TILE * LANES];
                            #[expect(unsafe_code, reason = "the features were checked above")]
                            // SAFETY: detected_simd() found AVX2, FMA and F16C; sizes as
                            // required.
                            unsafe {
                                avx2::group(&packed, g, &rows[..n], &mut got)
                            };
                            assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "AVX2: {at}");
                            if avx512 {
                                let mut got = [0f32; ROW_TILE * LANES];
                                #[expect(unsafe_code, reason = "the features were checked above")]
                                // SAFETY: detected_simd() found AVX-512 VNNI, AVX2 and FMA.
                                unsafe {
                                    avx512::group(&packed, g, &rows[..n], &mut got)
                                };
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
    }

    /// Every form's packed quants start on a cache line, so a step's 64-byte load never
    /// straddles two; bytes hold their scales as f16.
    #[test]
    fn packed_quants_start_on_a_cache_line() {
        for form in NUMERIC_FORMS.into_iter().chain([Form::Codebook]) {
            for (out, nb) in [(2, 1), (20, 3), (33, 19)] {
                let (q, d, _) = rows_of(form, out, nb, false);
                let packed = Packed32::pack(form, &q, &d, &[], out, nb);
                let first = packed.block(0, 0).quants.as_ptr();
                assert_eq!(first.align_offset(64), 0, "{form:?}, {out}x{nb}");
                assert_eq!(packed.d16.is_empty(), form != Form::Bytes, "{form:?}");
            }
        }
    }

    /// The scalar group kernel is the per-row definition of the module docs, computed
    /// here from the unpacked arrays.
    #[test]
    fn scalar_group_kernel_is_the_definition() {
        for form in NUMERIC_FORMS {
            for with_min in [false, true] {
                let (out, nb) = (18, 3);
                let (q, d, m) = rows_of(form, out, nb, with_min);
                let packed = Packed32::pack(form, &q, &d, &m, out, nb);
                let rows = act_rows(nb * QK, 2);
                let rb = form.row_bytes();
                for o in 0..out {
                    for row in &rows {
                        let mut acc = 0f32;
                        for b in 0..nb {
                            let bytes = &q[(o * nb + b) * rb..(o * nb + b + 1) * rb];
                            let value = |j: usize| -> i32 {
                                match form {
                                    Form::Nibbles { offset, five } => {
                                        let n = if j < 16 {
                                            bytes[j] & 0x0F
                                        } else {
                                            bytes[j - 16] >> 4
                                        };
                                        let qh = if five {
                                            u32::from_le_bytes(bytes[16..20].try_into().unwrap())
                                        } else {
                                            0
                                        };
                                        i32::from(n) + 16 * ((qh >> j) & 1) as i32 - offset
                                    }
                                    Form::Codebook if j < 16 => {
                                        i32::from(CODEBOOK[usize::from(bytes[j] & 0x0F)])
                                    }
                                    Form::Codebook => {
                                        i32::from(CODEBOOK[usize::from(bytes[j - 16] >> 4)])
                                    }
                                    Form::Bytes => i32::from(bytes[j] as i8),
                                }
                            };
                            let isum: i32 = (0..QK)
                                .map(|j| value(j) * i32::from(row.qs[b * QK + j]))
                                .sum();
                            acc = (d[o * nb + b] * row.d[b]).mul_add(isum as f32, acc);
                            if with_min {
                                acc = m[o * nb + b].mul_add(row.s[b], acc);
                            }
                        }
                        let mut got = [0f32; LANES];
                        packed.group_scalar(o / LANES, std::slice::from_ref(row), &mut got);
                        assert_eq!(got[o % LANES].to_bits(), acc.to_bits(), "{form:?}, row {o}");
                    }
                }
            }
        }
    }
}
