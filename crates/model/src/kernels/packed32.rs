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
//! activation rows. IQ4_XS ([`Scales::Sub`]), as ggml's `ggml_vec_dot_iq4_xs_q8_K`:
//! over each super-block of eight blocks the integer `Σ (ls − 32)·Σ q_w·q_a` (at most
//! 8·32·32·127·127 < 2³¹ in magnitude), then one `acc = fma(d·d_a, Σ, acc)` per
//! super-block (`d_a` Q8_K's one scale per 256 values).
//!
//! Layout per group and block (`gb = group·nb + b`; padding rows are zeros):
//! - nibbles and codebook: `quants[gb·256..]` as `[step t: 4][lane: 16][4 bytes]`, the
//!   row's file bytes `4t..4t + 4`: low nibbles are values `4t..`, high nibbles values
//!   `16 + 4t..`; 5-bit: `high[gb·64..]` as `[lane: 16][4 bytes]`, bit `t + 4h` of
//!   byte k the fifth bit of value `16h + 4t + k` of the lane's row (the value in byte
//!   `4·lane + k` of step t's quants, its low nibble for `h = 0`): one load serves the
//!   block, and a shift and a mask put step t's bits at bit 4 of its quant bytes (as
//!   Q5_K's, `kquant.rs`);
//! - bytes: `quants[gb·512..]` as `[step t: 8][lane][4 bytes]`, values `4t..4t + 4`,
//!   each `q + 128`;
//! - `d` or `d16`, `m` (f16): `[gb·16 + lane]` (`m` empty without minimums). Scales are held
//!   as f16 (`d16`) when every one is an f16, as the file stores them for every type but
//!   IQ4_XS: Q4_0 then streams 4.5 bits per weight, as in the file, instead of 5.
//!   IQ4_XS's per-32 scale `d·(ls − 32)` is no f16; it is held as [`Scales::Sub`]: `d16`
//!   per super-block `[(gb / 8)·16 + lane]` and the signed `ls − 32` in `high[gb·16 +
//!   lane]`.
//!
//! The quants start on a 64-byte boundary, so no 512-bit load of a step straddles two
//! cache lines, and lie on huge pages where the OS gives them (`memory.rs`).

use half::f16;
use rayon::prelude::*;

use super::memory::Weights;
use super::{
    ActRow, DecodeRead, QK, QuantKind, ROW_TILE, STREAM_PREFETCH, STREAMS, decode_with, in_streams,
    per_group, prefetch_line, word_at,
};

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

    /// What the kernels take off each quant as held (nibbles: the type's offset;
    /// codebook values and bytes are held plus 128).
    pub(super) fn offset(self) -> i32 {
        match self {
            Self::Nibbles { offset, .. } => offset,
            Self::Codebook | Self::Bytes => 128,
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

/// How a weight's per-block scales are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scales {
    /// An f32 per block (`d`).
    F32,
    /// An f16 per block (`d16`), as the file holds them.
    F16,
    /// IQ4_XS's: an f16 `d` per eight blocks (a super-block; `d16`, `[(gb / 8)·16 +
    /// lane]`) and a signed byte `ls − 32` per block (`high`, `[gb·16 + lane]`), 4.31
    /// bits per value. The kernels multiply each block's integer sum by `ls − 32` and
    /// take `d` once per super-block (see the module docs); the block's dequantized
    /// scale is `d·(ls − 32)`, exact in f32.
    Sub,
}

/// A `[out, in]` weight in blocks of 32, repacked in groups of [`LANES`] rows.
#[derive(Debug)]
pub(super) struct Packed32 {
    pub(super) form: Form,
    pub(super) scales: Scales,
    /// Blocks per row.
    pub(super) nb: usize,
    pub(super) groups: usize,
    /// The packed quants, from a 64-byte boundary (see [`Weights`]).
    quants: Weights,
    /// Scales ([`Scales::F32`]; empty otherwise).
    d: Weights<f32>,
    /// Scales ([`Scales::F16`], always for bytes) or super-block scales
    /// ([`Scales::Sub`]), as the file holds them.
    d16: Weights<f16>,
    /// Minimums (Q4_1, Q5_1), f16s as the file holds them.
    m: Weights<f16>,
    /// Fifth bits: `[lane: 16][4 bytes]` per group and block, bit `t + 4h` of byte k
    /// for value `16h + 4t + k` of the lane's row. With [`Scales::Sub`]: each block's
    /// signed scale byte per lane.
    high: Weights,
}

/// [`Packed32`]'s arrays resolved to slices ([`Packed32::view`]), with what it takes
/// to find a block in them without a branch. The AVX-512 kernel took the slices afresh
/// for every block, 28% of its samples in a 64-row 2048² IQ4_XS product (Zen 5, one
/// thread: 1.12 → 1.03 ms with a view taken once per call).
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    quants: &'a [u8],
    d: &'a [f32],
    d16: &'a [f16],
    m: &'a [f16],
    high: &'a [u8],
    nb: usize,
    /// Bytes of quants per group and block.
    qb: usize,
    /// Values per block of `d`, `d16`, `m` and `high` (0 for an array the form lacks).
    per: [usize; 4],
    /// How many blocks share a `d16` entry, as a shift (IQ4_XS's super-blocks: 3).
    d16_shift: u32,
    sub: bool,
}

impl<'a> View<'a> {
    /// Group `g`'s blocks, its range of each array checked once here.
    #[inline(always)]
    pub(super) fn group(&self, g: usize) -> GroupView<'a> {
        let [pd, pd16, pm, ph] = self.per;
        let nb = self.nb;
        // `nb` is a multiple of 8 with super-blocks, so the group's super-block scales
        // are whole entries of `d16`.
        let (s0, s1) = ((g * nb) >> self.d16_shift, ((g + 1) * nb) >> self.d16_shift);
        let range = |n: usize| g * nb * n..(g + 1) * nb * n;
        GroupView(View {
            quants: &self.quants[range(self.qb)],
            d: &self.d[range(pd)],
            d16: &self.d16[s0 * pd16..s1 * pd16],
            m: &self.m[range(pm)],
            high: &self.high[range(ph)],
            ..*self
        })
    }

    /// Block `b` of group `g`.
    #[inline(always)]
    pub(super) fn block(&self, g: usize, b: usize) -> Block<'a> {
        let gb = g * self.nb + b;
        let [pd, pd16, pm, ph] = self.per;
        let slot = |gb: usize, n: usize| gb * n..(gb + 1) * n;
        Block {
            quants: &self.quants[slot(gb, self.qb)],
            d: &self.d[slot(gb, pd)],
            d16: &self.d16[slot(gb >> self.d16_shift, pd16)],
            m: &self.m[slot(gb, pm)],
            high: &self.high[slot(gb, ph)],
            sub: self.sub,
        }
    }
}

/// One group's part of [`Packed32`]'s arrays ([`View::group`]), as a view of one
/// group: its blocks found without a bounds check each, which the SIMD kernels' block
/// loops gave up to 8% of a 64-row product to (Zen 5, 2048² IQ4_XS 0.97–1.02 →
/// 0.90–0.96 ms).
#[derive(Clone, Copy)]
pub(super) struct GroupView<'a>(View<'a>);

impl<'a> GroupView<'a> {
    /// Block `b` of the group.
    ///
    /// # Safety
    /// `b` must be below the weight's blocks per row (`nb`).
    #[expect(unsafe_code, reason = "a block of the group's checked ranges")]
    #[inline(always)]
    pub(super) unsafe fn block(&self, b: usize) -> Block<'a> {
        let v = &self.0;
        let [pd, pd16, pm, ph] = v.per;
        let slot = |i: usize, n: usize| i * n..(i + 1) * n;
        debug_assert!(b < v.nb);
        // SAFETY: each array holds `nb` blocks of `per` values from the group's start
        // (`d16` one entry per `1 << d16_shift` blocks, from a super-block's start),
        // as `View::group` sliced them, and `b < nb`.
        unsafe {
            Block {
                quants: v.quants.get_unchecked(slot(b, v.qb)),
                d: v.d.get_unchecked(slot(b, pd)),
                d16: v.d16.get_unchecked(slot(b >> v.d16_shift, pd16)),
                m: v.m.get_unchecked(slot(b, pm)),
                high: v.high.get_unchecked(slot(b, ph)),
                sub: v.sub,
            }
        }
    }
}

pub(super) struct Block<'a> {
    quants: &'a [u8],
    d: &'a [f32],
    /// The block's scales, or ([`Scales::Sub`]) its super-block's.
    d16: &'a [f16],
    m: &'a [f16],
    /// Fifth bits, or ([`Scales::Sub`]) the block's signed scale bytes.
    high: &'a [u8],
    sub: bool,
}

impl Block<'_> {
    /// Prefetches into L1 this block's part of the arrays other than the quants
    /// (scales, minimums, fifth bits or sub-block scales) `ahead` blocks after it (the
    /// group's later blocks, then the next group's), one cache line each: a decode
    /// kernel prefetches the quants; these are 6% (Q8_0) to 30% (Q5_1) of a block's
    /// bytes, each a stream of its own (see `kquant`'s `Block::prefetch_side`).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch_side(&self, ahead: usize) {
        // A super-block's scales serve its eight blocks.
        let d16 = size_of_val(self.d16) / if self.sub { 8 } else { 1 };
        super::prefetch_blocks_ahead(
            [
                (self.d.as_ptr().cast(), size_of_val(self.d)),
                (self.d16.as_ptr().cast(), d16),
                (self.m.as_ptr().cast(), size_of_val(self.m)),
                (self.high.as_ptr(), self.high.len()),
            ],
            ahead,
        );
    }

    /// Lane `lane`'s scale.
    fn scale(&self, lane: usize) -> f32 {
        if !self.d.is_empty() {
            self.d[lane]
        } else if self.sub {
            self.d16[lane].to_f32() * f32::from(self.high[lane] as i8)
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
    &'a mut [f16],
    &'a mut [u8],
);

impl Packed32 {
    /// How many values each array holds (quants, d, d16, m, high) for a weight of `out`
    /// rows and `nb` blocks per row (with [`Scales::Sub`], a multiple of 8), with
    /// minimums or not, its scales held as `scales` says.
    fn lens(form: Form, (has_min, scales): (bool, Scales), out: usize, nb: usize) -> [usize; 5] {
        let slots = out.div_ceil(LANES) * nb;
        let five = matches!(form, Form::Nibbles { five: true, .. });
        [
            slots * form.packed_bytes() * LANES,
            if scales == Scales::F32 {
                slots * LANES
            } else {
                0
            },
            match scales {
                Scales::F32 => 0,
                Scales::F16 => slots * LANES,
                Scales::Sub => slots / 8 * LANES,
            },
            if has_min { slots * LANES } else { 0 },
            if five {
                slots * 4 * LANES
            } else if scales == Scales::Sub {
                slots * LANES
            } else {
                0
            },
        ]
    }

    /// Whether its scales are held as f16 (per block or per super-block): no f32 array.
    pub(super) fn half_scales(&self) -> bool {
        self.d.is_empty()
    }

    /// Its arrays' bytes, in [`Self::lens`]'s order (what the repack cache stores),
    /// each with its offset in the file of arena `arena` if it was packed there.
    pub(super) fn arrays(&self, arena: u64) -> super::StoredArrays<'_> {
        [
            (self.quants.as_bytes(), self.quants.offset_in(arena)),
            (self.d.as_bytes(), self.d.offset_in(arena)),
            (self.d16.as_bytes(), self.d16.offset_in(arena)),
            (self.m.as_bytes(), self.m.offset_in(arena)),
            (self.high.as_bytes(), self.high.offset_in(arena)),
        ]
    }

    /// A weight from arrays [`Self::arrays`] gave, if each holds as many values as
    /// [`Self::lens`] says (the kernels index them without further checks). Bytes
    /// always hold f16 scales; super-block scales come only with the codebook form,
    /// whole super-blocks and no minimums.
    pub(super) fn from_arrays(
        form: Form,
        (has_min, scales): (bool, Scales),
        (out, nb): (usize, usize),
        [quants, d, d16, m, high]: [Weights; 5],
    ) -> Option<Self> {
        if form == Form::Bytes && scales == Scales::F32 {
            return None;
        }
        if scales == Scales::Sub && (form != Form::Codebook || has_min || nb % 8 != 0) {
            return None;
        }
        let p = Self {
            form,
            scales,
            nb,
            groups: out.div_ceil(LANES),
            quants,
            d: d.cast()?,
            d16: d16.cast()?,
            m: m.cast()?,
            high,
        };
        let held = [
            p.quants.len(),
            p.d.len(),
            p.d16.len(),
            p.m.len(),
            p.high.len(),
        ];
        (held == Self::lens(form, (has_min, scales), out, nb)).then_some(p)
    }

    /// Repacks per-row arrays: `quants` (`form.row_bytes()` per block, row after row),
    /// `d` per block, `m` per block or empty. The scales are held as f16 when every one
    /// is exactly an f16.
    pub(super) fn pack(
        form: Form,
        quants: &[u8],
        d: &[f32],
        m: &[f32],
        out: usize,
        nb: usize,
    ) -> Self {
        let rb = form.row_bytes();
        let half = d
            .iter()
            .all(|&x| f16::from_f32(x).to_f32().to_bits() == x.to_bits());
        let scales = if half { Scales::F16 } else { Scales::F32 };
        Self::pack_with(form, (!m.is_empty(), scales), (out, nb), |i, src| {
            src.copy_from_slice(&quants[i * rb..(i + 1) * rb]);
            (d[i], m.get(i).copied().unwrap_or(0.0))
        })
    }

    /// Repacks blocks that `read(i, src)` gives one at a time, block `i = o·nb + b`
    /// (row `o`, block `b`): it fills `src` (`form.row_bytes()`) and returns the
    /// block's scale and minimum (ignored unless `has_min`); with [`Scales::Sub`],
    /// its super-block's `d` and its `ls − 32` instead. With [`Scales::F16`] (always
    /// for bytes) every scale must be an f16, and is held as one; so must every `d`
    /// with [`Scales::Sub`]. Reading the file's blocks this way leaves no per-row copy
    /// of the weight.
    pub(super) fn pack_with(
        form: Form,
        (has_min, scales): (bool, Scales),
        (out, nb): (usize, usize),
        read: impl Fn(usize, &mut [u8]) -> (f32, f32) + Sync,
    ) -> Self {
        let groups = out.div_ceil(LANES);
        let qb = form.packed_bytes() * LANES;
        let five = matches!(form, Form::Nibbles { five: true, .. });
        let bytes = form == Form::Bytes;
        let scales = if bytes { Scales::F16 } else { scales };
        assert!(scales != Scales::Sub || (form == Form::Codebook && !has_min && nb % 8 == 0));
        let [quants, d, d16, m, high] = Self::lens(form, (has_min, scales), out, nb);
        let mut held = Weights::zeroed(quants);
        // Bytes are held as `q + 128`: zero padding rows stay weights 0.
        if bytes {
            held.fill(0x80);
        }
        let mut p = Self {
            form,
            scales,
            nb,
            groups,
            quants: held,
            d: Weights::zeroed(d),
            d16: Weights::zeroed(d16),
            m: Weights::zeroed(m),
            high: Weights::zeroed(high),
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
            let (bytes, five, has_min, scales, rb, qb) = (bytes, five, has_min, scales, rb, qb);
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
                        for k in 0..4 {
                            // Value 16h + 4t + k's bit to bit t + 4h of the lane's byte k.
                            let at = gb * 4 * LANES + 4 * lane + k;
                            for (t, h) in (0..4).flat_map(|t| [(t, 0), (t, 1)]) {
                                let bit = (qh >> (16 * h + 4 * t + k)) & 1;
                                high[at] |= (bit as u8) << (t + 4 * h);
                            }
                        }
                    }
                    match scales {
                        Scales::F32 => ds[gb * LANES + lane] = scale,
                        Scales::F16 | Scales::Sub => {
                            let held = f16::from_f32(scale);
                            assert!(
                                held.to_f32().to_bits() == scale.to_bits(),
                                "a block's scale {scale} is not an f16"
                            );
                            if scales == Scales::F16 {
                                d16s[gb * LANES + lane] = held;
                            } else {
                                // `scale` is the super-block's d, `min` the block's
                                // ls − 32 (|ls − 32| ≤ 32).
                                d16s[gb / 8 * LANES + lane] = held;
                                high[gb * LANES + lane] = (min as i8) as u8;
                            }
                        }
                    }
                    if has_min {
                        let held = f16::from_f32(min);
                        assert!(
                            held.to_f32().to_bits() == min.to_bits(),
                            "a block's minimum {min} is not an f16"
                        );
                        ms[gb * LANES + lane] = held;
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

    /// Its arrays as plain slices, for a kernel to take before its block loop: each
    /// array's slice costs a match on where its bytes live and a checked cast, so a
    /// kernel that took them afresh for every block spent more on that than on its
    /// arithmetic's other steps ([`View`]).
    #[inline(always)]
    pub(super) fn view(&self) -> View<'_> {
        let sub = self.scales == Scales::Sub;
        // An array the form lacks is empty and takes no values per block.
        let per = |len: usize, n: usize| if len == 0 { 0 } else { n };
        View {
            quants: &self.quants,
            d: &self.d,
            d16: &self.d16,
            m: &self.m,
            high: &self.high,
            nb: self.nb,
            qb: self.form.packed_bytes() * LANES,
            per: [
                per(self.d.len(), LANES),
                per(self.d16.len(), LANES),
                per(self.m.len(), LANES),
                per(self.high.len(), if sub { LANES } else { 4 * LANES }),
            ],
            d16_shift: if sub { 3 } else { 0 },
            sub,
        }
    }

    /// Block `b` of group `g` (outside the kernels' loops: they take [`Self::view`]
    /// first).
    fn block(&self, g: usize, b: usize) -> Block<'_> {
        self.view().block(g, b)
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
                    let bit = (blk.high[4 * lane + k] >> (t + 4 * usize::from(j >= 16))) & 1;
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
            Some(blk.m[lane].to_f32())
        };
        out.extend((0..QK).map(|j| {
            let x = d * self.quant(&blk, lane, j) as f32;
            m.map_or(x, |m| x + m)
        }));
    }

    /// Panics unless `row` holds what the SIMD kernels read of it: `nb` blocks of
    /// quants, scales, integer sums and (with minimums) sums.
    fn check_row(&self, row: &ActRow) {
        assert!(
            row.qs.len() >= self.nb * QK
                && row.d.len() >= self.nb
                && row.offset_sums.len() >= self.nb
                && (!self.has_min() || row.s.len() >= self.nb)
        );
    }

    /// Group `g`'s sixteen outputs for each of `rows` (at most [`ROW_TILE`]):
    /// `out[r·16 + lane]`.
    pub(super) fn group(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        self.group_ahead(g, rows, out, PREFETCH);
    }

    /// [`Self::group`], its AVX-512 kernel prefetching `ahead` bytes ahead (none at 0)
    /// with more than one row (one always prefetches).
    fn group_ahead(&self, g: usize, rows: &[ActRow], out: &mut [f32], ahead: usize) {
        assert!(rows.len() <= ROW_TILE && out.len() >= rows.len() * LANES);
        for row in rows {
            self.check_row(row);
        }
        #[cfg(target_arch = "x86_64")]
        match super::simd() {
            super::Simd::Avx512Vnni => {
                #[expect(unsafe_code, reason = "the CPU was checked for these features")]
                // SAFETY: simd() found AVX-512 F/BW/VL/VNNI, AVX2 and FMA; buffers checked.
                unsafe {
                    avx512::group(self, g, rows, out, ahead)
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

    /// Group `g`'s sixteen outputs for every row of `rows` (any number) into `out`
    /// (`[row][lane]`): [`Self::group`] for each tile of [`ROW_TILE`] rows, its bits.
    /// With AVX-512 only the first tile prefetches (the next group's quants, as
    /// decode does); the later tiles find the group's quants in cache. A prefetch in
    /// every tile cost more than it gave (64-row 2048² IQ4_XS from cache 1.03 → 0.90
    /// ms without), none at all left the first tile waiting on memory (1B prefill no
    /// faster); the first tile only, 1B prefill, one thread, Zen 5, alternating
    /// runs: IQ4_XS 201–206 → 207–225 tok/s, Q4_0 201–207 → 207–221, Q8_0 the same.
    pub(super) fn group_rows(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        assert!(out.len() >= rows.len() * LANES);
        for (i, (tile, out)) in rows
            .chunks(ROW_TILE)
            .zip(out.chunks_mut(ROW_TILE * LANES))
            .enumerate()
        {
            self.group_ahead(g, tile, out, if i == 0 { PREFETCH } else { 0 });
        }
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
                let avx512 = super::simd() == super::Simd::Avx512Vnni;
                return in_streams(groups.clone(), |gs| {
                    #[expect(unsafe_code, reason = "the CPU was checked for these features")]
                    // SAFETY: simd() found AVX-512 F/BW/VL/VNNI, AVX2 and FMA (or AVX2,
                    // FMA and F16C); the row was checked, and `out` by `decode_with`.
                    unsafe {
                        if avx512 {
                            avx512::streams::<STREAMS>(self, gs, groups.start, row, out);
                        } else {
                            avx2::streams::<STREAMS>(self, gs, groups.start, row, out);
                        }
                    };
                });
            }
            groups.clone()
        };
        decode_with(groups.clone(), out, streamed, |g, d| self.group(g, rows, d));
    }

    /// Group `g`'s blocks unpacked for [`Self::amx_tile`] (`nb·512` bytes), into `w`.
    /// Only with AMX ([`super::amx::available`]).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn amx_unpack(&self, g: usize, w: &mut Vec<i8>) {
        assert!(super::amx::available() && g < self.groups);
        w.resize(self.nb * amx::UNPACKED, 0);
        #[expect(
            unsafe_code,
            reason = "AVX-512 over buffers whose lengths are set first"
        )]
        // SAFETY: AMX is only available with the AVX-512 kernels; `w` was sized.
        unsafe {
            amx::unpack(self, g, w);
        }
    }

    /// [`Self::group`] for sixteen rows with AMX: `w` is group `g` from
    /// [`Self::amx_unpack`], `a` the rows' quants one after another (`nb·32` each).
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
        let k = self.nb * QK;
        assert!(
            super::amx::available()
                && g < self.groups
                && w.len() == self.nb * amx::UNPACKED
                && rows.len() == super::amx::TILE_ROWS
                && a.len() >= super::amx::TILE_ROWS * k
                && out.len() >= super::amx::TILE_ROWS * LANES
        );
        for row in rows {
            assert!(row.d.len() >= self.nb && (!self.has_min() || row.s.len() >= self.nb));
        }
        let ahead = if ahead && g + 1 < self.groups {
            let bytes = self.nb * self.form.packed_bytes() * LANES;
            &self.quants[(g + 1) * bytes..(g + 2) * bytes]
        } else {
            &[]
        };
        #[expect(
            unsafe_code,
            reason = "AMX and AVX-512 over buffers whose lengths are asserted first"
        )]
        // SAFETY: AMX is available (and with it AVX-512); buffers checked.
        unsafe {
            amx::tile(self, g, (w, a), rows, out, ahead);
        }
    }

    /// Group `g`'s blocks unpacked for [`Self::avx2_unpacked`] into `w`, on a CPU with
    /// AVX2.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn avx2_unpack(&self, g: usize, w: &mut Vec<u8>) {
        assert!(super::detected_simd() >= super::Simd::Avx2 && g < self.groups);
        w.resize(self.nb * avx2::unpacked_bytes(self), 0);
        #[expect(unsafe_code, reason = "AVX2 over buffers whose lengths are set first")]
        // SAFETY: the CPU has AVX2, FMA and F16C (`detected_simd`); `w` was sized.
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
                && w.len() == self.nb * avx2::unpacked_bytes(self)
                && out.len() >= rows.len() * LANES
        );
        for row in rows {
            self.check_row(row);
        }
        #[expect(
            unsafe_code,
            reason = "AVX2 over buffers whose lengths are asserted first"
        )]
        // SAFETY: the CPU has AVX2, FMA and F16C; `w`, the rows and `out` checked.
        unsafe {
            avx2::unpacked(self, g, w, rows, out);
        }
    }

    /// [`Self::group`] without SIMD: the definition every kernel equals bit for bit.
    pub(super) fn group_scalar(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        let view = self.view();
        for (r, row) in rows.iter().enumerate() {
            for lane in 0..LANES {
                let mut acc = 0f32;
                // IQ4_XS: the super-block's Σ (ls − 32)·Σ q_w·q_a so far.
                let mut sub_sum = 0i32;
                for b in 0..self.nb {
                    let blk = view.block(g, b);
                    let a = &row.qs[b * QK..(b + 1) * QK];
                    let isum: i32 = (0..QK)
                        .map(|j| self.quant(&blk, lane, j) * i32::from(a[j]))
                        .sum();
                    if blk.sub {
                        sub_sum += i32::from(blk.high[lane] as i8) * isum;
                        if b % 8 == 7 {
                            // The activations' scale is the super-block's (Q8_K).
                            let d = blk.d16[lane].to_f32() * row.d[b];
                            acc = d.mul_add(sub_sum as f32, acc);
                            sub_sum = 0;
                        }
                        continue;
                    }
                    acc = (blk.scale(lane) * row.d[b]).mul_add(isum as f32, acc);
                    if !blk.m.is_empty() {
                        acc = blk.m[lane].to_f32().mul_add(row.s[b], acc);
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
mod avx512;

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "SIMD intrinsics over buffers whose lengths are asserted first"
)]
mod avx2;

#[cfg(target_arch = "x86_64")]
#[expect(
    unsafe_code,
    reason = "AMX and SIMD over buffers whose lengths are asserted first"
)]
mod amx;

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_streams_give_scalar_bits, cpu_has};
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

    /// Every form packed from `out` rows of [`rows_of`]'s values: f16 scales and (all
    /// but the bytes) f32 ones, which are held as f32, with and without minimums, each
    /// of `nbs` blocks per row; with each its block count and a description of the case
    /// for assertion messages.
    #[cfg(target_arch = "x86_64")]
    fn packings(out: usize, nbs: &[usize]) -> Vec<(Packed32, usize, String)> {
        let mut cases = Vec::new();
        for (form, f32_scales) in NUMERIC_FORMS
            .into_iter()
            .chain([Form::Codebook])
            .flat_map(|f| [(f, false), (f, f != Form::Bytes)])
        {
            for with_min in [false, true] {
                for &nb in nbs {
                    let (q, mut d, m) = rows_of(form, out, nb, with_min);
                    if f32_scales {
                        // Not f16s (as IQ4_XS's): held as f32.
                        d.iter_mut().for_each(|d| *d *= 1.0 + 1e-6);
                    }
                    let packed = Packed32::pack(form, &q, &d, &m, out, nb);
                    assert_eq!(packed.d16.is_empty(), f32_scales, "{form:?}");
                    let case = format!(
                        "{form:?}, f32 scales {f32_scales}, minimum {with_min}, {nb} blocks"
                    );
                    cases.push((packed, nb, case));
                }
            }
        }
        // IQ4_XS's super-block scales: eight times as many blocks, scale bytes
        // −32 and 31 first, row 1's first two blocks all −127 (with activation row 0's
        // +127, a super-block sum past 2²⁴, which f32 rounds).
        for &nb in nbs {
            let nb = 8 * nb;
            let (mut q, d, _) = rows_of(Form::Codebook, out, nb, false);
            q[nb * QK / 2..(nb + 2) * QK / 2].fill(0);
            let ls = |i: usize| match i % nb {
                0 | 1 => -32,
                2 => 31,
                _ => (i * 29 % 64) as i32 - 32,
            };
            let packed =
                Packed32::pack_with(Form::Codebook, (false, Scales::Sub), (out, nb), |i, src| {
                    src.copy_from_slice(&q[i * QK / 2..(i + 1) * QK / 2]);
                    (d[i / 8 * 8], ls(i) as f32)
                });
            cases.push((packed, nb, format!("IQ4_XS scales, {nb} blocks")));
        }
        cases
    }

    /// The AVX2 and AVX-512 kernels give the scalar kernel's bits: every form, with and
    /// without minimums, 1, 2, 3 and 19 blocks, one to eight activation rows, a last
    /// group with padding rows, extreme quants and activations.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_group_kernels_equal_the_scalar_one() {
        if !cpu_has(Simd::Avx2) {
            return;
        }
        let avx512 = detected_simd() >= Simd::Avx512Vnni;
        for (packed, nb, case) in packings(20, &[1, 2, 3, 19]) {
            let rows = act_rows(nb * QK, ROW_TILE);
            assert_eq!(rows[0].qs[..QK], [127; QK]);
            for g in 0..packed.groups {
                for n in 1..=ROW_TILE {
                    let at = format!("{case}, group {g}, {n} rows");
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
                    // Prefetching or not (a prefill's later tiles) reads the same.
                    for ahead in [PREFETCH, 0].into_iter().filter(|_| avx512) {
                        let mut got = [0f32; ROW_TILE * LANES];
                        #[expect(unsafe_code, reason = "the features were checked above")]
                        // SAFETY: detected_simd() found AVX-512 VNNI, AVX2 and FMA.
                        unsafe {
                            avx512::group(&packed, g, &rows[..n], &mut got, ahead)
                        };
                        assert_eq!(
                            got.map(f32::to_bits),
                            want.map(f32::to_bits),
                            "AVX-512, {ahead} ahead: {at}"
                        );
                    }
                }
            }
        }
    }

    /// The AVX2 prefill from a group unpacked once gives the scalar kernel's bits: every
    /// form, f16 and f32 scales, with and without minimums, one to nineteen blocks, one
    /// to thirteen activation rows, a last group with padding rows, extreme values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_unpacked_prefill_equals_the_scalar_kernel() {
        if !cpu_has(Simd::Avx2) {
            return;
        }
        for (packed, nb, case) in packings(20, &[1, 3, 19]) {
            let rows = act_rows(nb * QK, 13);
            let mut w = Vec::new();
            for g in 0..packed.groups {
                packed.avx2_unpack(g, &mut w);
                for n in [1, 3, 4, 5, 8, 9, 13] {
                    let mut want = vec![0f32; n * LANES];
                    packed.group_scalar(g, &rows[..n], &mut want);
                    let mut got = vec![0f32; n * LANES];
                    packed.avx2_unpacked(g, &w, &rows[..n], &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{case}, group {g}, {n} rows");
                }
            }
        }
    }

    /// The AVX2 and AVX-512 streams kernels (decode) give the scalar kernel's bits for
    /// each of their groups: four groups and two, from runs of a range that starts past
    /// group 0 and ends with a group with padding rows; every form, with and without
    /// minimums, one and three blocks, each extreme activation row.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_streams_kernels_equal_the_scalar_one() {
        fn check<const S: usize>(packed: &Packed32, gs: [usize; S], row: &ActRow, what: &str) {
            let first = 1;
            assert_streams_give_scalar_bits(
                (packed.groups, &gs, first),
                |g, out| packed.group_scalar(g, std::slice::from_ref(row), out),
                |family, out| {
                    #[expect(unsafe_code, reason = "the families were checked")]
                    // SAFETY: the CPU runs `family` (checked by the caller and the
                    // helper); `out` holds every group from `first`.
                    unsafe {
                        if family == Simd::Avx2 {
                            avx2::streams::<S>(packed, gs, first, row, out);
                        } else {
                            avx512::streams::<S>(packed, gs, first, row, out);
                        }
                    }
                },
                what,
            );
        }
        if !cpu_has(Simd::Avx2) {
            return;
        }
        // 88 outputs: 6 groups, the last with 8 padding lanes.
        for (packed, nb, case) in packings(88, &[1, 3]) {
            for (r, row) in act_rows(nb * QK, 3).iter().enumerate() {
                let at = format!("{case}, row {r}");
                check::<4>(&packed, [1, 2, 4, 5], row, &at);
                check::<2>(&packed, [2, 5], row, &at);
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
        for (packed, nb, case) in packings(20, &[1, 3, 19]) {
            let rows = act_rows(nb * QK, tile);
            let a: Vec<i8> = rows.iter().flat_map(|r| r.qs[..nb * QK].to_vec()).collect();
            let mut w = Vec::new();
            for g in 0..packed.groups {
                let mut want = vec![0f32; tile * LANES];
                for (rows, want) in rows.chunks(ROW_TILE).zip(want.chunks_mut(ROW_TILE * LANES)) {
                    packed.group_scalar(g, rows, want);
                }
                packed.amx_unpack(g, &mut w);
                let mut got = vec![0f32; tile * LANES];
                packed.amx_tile(g, (&w, &a), &rows, &mut got, g % 2 == 0);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{case}, group {g}");
            }
        }
    }

    /// Every form's packed quants start on a cache line, so a step's 64-byte load never
    /// straddles two; scales that are f16s are held as f16.
    #[test]
    fn packed_quants_start_on_a_cache_line() {
        for form in NUMERIC_FORMS.into_iter().chain([Form::Codebook]) {
            for (out, nb) in [(2, 1), (20, 3), (33, 19)] {
                let (q, d, _) = rows_of(form, out, nb, false);
                let packed = Packed32::pack(form, &q, &d, &[], out, nb);
                let first = packed.block(0, 0).quants.as_ptr();
                assert_eq!(first.align_offset(64), 0, "{form:?}, {out}x{nb}");
                assert!(!packed.d16.is_empty() && packed.d.is_empty(), "{form:?}");
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
