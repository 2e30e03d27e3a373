//! The blocks-of-32 kernels with AVX-512 VNNI (the layout and the definition they
//! compute are the parent module's).

use std::arch::x86_64::*;

use super::super::Sides;
use super::super::kquant::avx512::bit_to_4;
#[cfg(doc)]
use super::ROW_TILE;
use super::{
    ActRow, Block, CODEBOOK, Form, LANES, PREFETCH, Packed32, QK, STREAM_PREFETCH, Scales,
    prefetch_line, word_at,
};

/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI, AVX2 and FMA; `rows` (at most
/// [`ROW_TILE`]) must hold `p.nb` blocks (quants, scales, integer sums, and sums `s`
/// with a minimum) and `out` `16·rows.len()` values. Several rows prefetch `ahead`
/// bytes of quants ahead (none at 0); one row always prefetches [`PREFETCH`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn group(p: &Packed32, g: usize, rows: &[ActRow], out: &mut [f32], ahead: usize) {
    let at = (g, ahead);
    // SAFETY: every arm calls with what this function requires.
    unsafe {
        match p.form {
            Form::Nibbles { five: false, .. } => with_rows::<NIBBLES>(p, at, rows, out),
            Form::Nibbles { five: true, .. } => with_rows::<FIVE>(p, at, rows, out),
            Form::Codebook if p.scales == Scales::Sub => {
                with_rows::<CODEBOOK_SUB>(p, at, rows, out)
            }
            Form::Codebook => with_rows::<CODEBOOK_FORM>(p, at, rows, out),
            Form::Bytes => with_rows::<BYTES>(p, at, rows, out),
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
/// The codebook with [`Scales::Sub`] (IQ4_XS): each block's scale from its
/// super-block's `d` and its signed byte.
const CODEBOOK_SUB: u8 = 4;

/// # Safety
/// As [`group`]; `F` must be `p.form`'s constant.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn with_rows<const F: u8>(
    p: &Packed32,
    at: (usize, usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    // SAFETY: every arm calls with what this function requires.
    unsafe {
        match rows.len() {
            0 => {}
            1 => rows_n::<1, F>(p, at, rows, out),
            2 => rows_n::<2, F>(p, at, rows, out),
            3 => rows_n::<3, F>(p, at, rows, out),
            4 => rows_n::<4, F>(p, at, rows, out),
            5 => rows_n::<5, F>(p, at, rows, out),
            6 => rows_n::<6, F>(p, at, rows, out),
            7 => rows_n::<7, F>(p, at, rows, out),
            _ => rows_n::<8, F>(p, at, rows, out),
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
    (g, ahead): (usize, usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    let low = _mm512_set1_epi8(0x0F);
    let table = _mm512_broadcast_i32x4(codebook_shifted());
    let offset = p.form.offset();
    // Each row's arrays, whose lengths `group` asserted.
    let sides = Sides::<R>::of(rows);
    let mut acc = [_mm512_setzero_ps(); R];
    // One row (decode) always reads ahead: a constant, so its kernel has no branch.
    let ahead = if R == 1 { PREFETCH } else { ahead };
    // IQ4_XS: each row's Σ (ls − 32)·Σ q_w·q_a over the super-block so far.
    let mut sub_sum = [_mm512_setzero_si512(); R];
    let has_min = p.has_min();
    let view = p.view();
    let group = view.group(g);
    for b in 0..p.nb {
        // Decode (one row, from memory) keeps the checked block: the unchecked loop
        // read memory 5–10% slower at its prefetch distance (Zen 5, Q4_0 16384²:
        // 3.5–3.7 → 3.8–4.3 ms; 8 KiB ahead instead of 16 gave it back).
        let blk = if R == 1 {
            view.block(g, b)
        } else {
            // SAFETY: b < nb.
            unsafe { group.block(b) }
        };
        // SAFETY: the block's quants and fifth bits.
        let w = unsafe { unpack::<F>(&blk, (low, table), ahead) };
        // SAFETY: block b of each row.
        let a = unsafe { sides.qs(b * QK) };
        if F == CODEBOOK_SUB {
            // SAFETY: the block's scale bytes, its super-block's scales; block b of
            // each row's arrays.
            unsafe {
                let ls = sub_scales(&blk);
                each_row!(R, |r| {
                    let start = start_at::<F>(sides.offset_sum(r, b), offset);
                    let total = block_sum(&w, a[r], start);
                    sub_sum[r] = _mm512_add_epi32(sub_sum[r], _mm512_mullo_epi32(total, ls));
                });
                if b % 8 == 7 {
                    let (d, _) = block_scales(&blk, false);
                    each_row!(R, |r| {
                        let dd = _mm512_mul_ps(d, _mm512_set1_ps(sides.d(r, b)));
                        acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sub_sum[r]), acc[r]);
                        sub_sum[r] = _mm512_setzero_si512();
                    });
                }
            }
            continue;
        }
        // SAFETY: the block's scales and minimums.
        let (d, m) = unsafe { block_scales(&blk, has_min) };
        each_row!(R, |r| {
            // SAFETY: block b of each of the row's arrays (its value words lie in the
            // block's 32 bytes).
            unsafe {
                let start = start_at::<F>(sides.offset_sum(r, b), offset);
                let total = block_sum(&w, a[r], start);
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(sides.d(r, b)));
                acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(total), acc[r]);
                if has_min {
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sides.s(r, b)), acc[r]);
                }
            }
        });
    }
    for (r, &v) in acc.iter().enumerate() {
        // SAFETY: `out` holds 16·R values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * LANES), v) };
    }
}

/// One row's integer sum of a block unpacked in `w` ([`unpack`]) with its 32
/// activations at `a`, from `start`: values 0..16 in one chain, 16..32 in another,
/// each activation word broadcast straight from memory.
///
/// # Safety
/// The CPU must support AVX-512 F and VNNI; `a` must point to 32 readable bytes.
#[inline(always)]
unsafe fn block_sum(w: &[__m512i; 8], a: *const i8, start: __m512i) -> __m512i {
    // SAFETY: as the caller guarantees.
    unsafe {
        let word = |at: usize| _mm512_set1_epi32(word_at(a.add(at)));
        let mut s0 = start;
        let mut s1 = _mm512_setzero_si512();
        for t in 0..4 {
            s0 = _mm512_dpbusd_epi32(s0, w[t], word(4 * t));
            s1 = _mm512_dpbusd_epi32(s1, w[4 + t], word(16 + 4 * t));
        }
        _mm512_add_epi32(s0, s1)
    }
}

/// Decode: one activation row through the `S` groups `gs`, block by block in lockstep,
/// so that the core reads `S` sequential streams of quants at once (one stream left a
/// core at about 12 GB/s here, four reach 15). Each group's arithmetic is
/// [`rows_n`]'s with one row, in its order, so each output is the same bits; group
/// `gs[s]`'s sixteen outputs go to `out[(gs[s] − first)·16..]`.
///
/// # Safety
/// As [`group`] with the one row, for every group of `gs`; `out` must hold them.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn streams<const S: usize>(
    p: &Packed32,
    gs: [usize; S],
    first: usize,
    row: &ActRow,
    out: &mut [f32],
) {
    // SAFETY: every arm calls with what this function requires.
    unsafe {
        match p.form {
            Form::Nibbles { five: false, .. } => streams_f::<S, NIBBLES>(p, gs, first, row, out),
            Form::Nibbles { five: true, .. } => streams_f::<S, FIVE>(p, gs, first, row, out),
            Form::Codebook if p.scales == Scales::Sub => {
                streams_f::<S, CODEBOOK_SUB>(p, gs, first, row, out)
            }
            Form::Codebook => streams_f::<S, CODEBOOK_FORM>(p, gs, first, row, out),
            Form::Bytes => streams_f::<S, BYTES>(p, gs, first, row, out),
        }
    }
}

/// [`streams`] for the form `F`.
///
/// # Safety
/// As [`streams`]; `F` must be `p.form`'s constant.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn streams_f<const S: usize, const F: u8>(
    p: &Packed32,
    gs: [usize; S],
    first: usize,
    row: &ActRow,
    out: &mut [f32],
) {
    let low = _mm512_set1_epi8(0x0F);
    let table = _mm512_broadcast_i32x4(codebook_shifted());
    let offset = p.form.offset();
    let has_min = p.has_min();
    let mut acc = [_mm512_setzero_ps(); S];
    // IQ4_XS: as in `rows_n`.
    let mut sub_sum = [_mm512_setzero_si512(); S];
    let view = p.view();
    for b in 0..p.nb {
        // SAFETY: block b of the row's arrays (its value words lie in its 32 bytes).
        let (lo, hi, start, da, sa) = unsafe {
            let a = row.qs.as_ptr().add(b * QK);
            let lo: [__m512i; 4] =
                std::array::from_fn(|t| _mm512_set1_epi32(word_at(a.add(4 * t))));
            let hi: [__m512i; 4] =
                std::array::from_fn(|t| _mm512_set1_epi32(word_at(a.add(16 + 4 * t))));
            let start = start_at::<F>(*row.offset_sums.get_unchecked(b), offset);
            let sa = if has_min {
                _mm512_set1_ps(*row.s.get_unchecked(b))
            } else {
                _mm512_setzero_ps()
            };
            (lo, hi, start, _mm512_set1_ps(*row.d.get_unchecked(b)), sa)
        };
        for s in 0..S {
            let blk = view.block(gs[s], b);
            // SAFETY: the block's quants and fifth bits, as in `rows_n`.
            let w = unsafe { unpack::<F>(&blk, (low, table), STREAM_PREFETCH) };
            let mut s0 = start;
            let mut s1 = _mm512_setzero_si512();
            for t in 0..4 {
                s0 = _mm512_dpbusd_epi32(s0, w[t], lo[t]);
                s1 = _mm512_dpbusd_epi32(s1, w[4 + t], hi[t]);
            }
            let total = _mm512_add_epi32(s0, s1);
            if F == CODEBOOK_SUB {
                // SAFETY: the block's scale bytes, its super-block's scales.
                unsafe {
                    let ls = sub_scales(&blk);
                    sub_sum[s] = _mm512_add_epi32(sub_sum[s], _mm512_mullo_epi32(total, ls));
                    if b % 8 == 7 {
                        let (d, _) = block_scales(&blk, false);
                        let dd = _mm512_mul_ps(d, da);
                        acc[s] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(sub_sum[s]), acc[s]);
                        sub_sum[s] = _mm512_setzero_si512();
                    }
                }
                continue;
            }
            // SAFETY: the block's scales and minimums.
            let (d, m) = unsafe { block_scales(&blk, has_min) };
            let dd = _mm512_mul_ps(d, da);
            acc[s] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(total), acc[s]);
            if has_min {
                acc[s] = _mm512_fmadd_ps(m, sa, acc[s]);
            }
        }
    }
    for (s, &v) in acc.iter().enumerate() {
        // SAFETY: `out` holds group gs[s]'s sixteen values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((gs[s] - first) * LANES), v) };
    }
}

/// Where a block's integer sum starts: `−offset·Σq_a`, from the row's `−128·Σq_a`
/// (`offset_sum`, broadcast from memory as it is for bytes and codebook, whose offset
/// is 128; shifted right for nibbles, whose offsets are 0 or 8, and for five bits,
/// 0 or 16), so that the sum ends as the block's exact `Σ (q_w − offset)·q_a`. The
/// form `F` decides at compile time: a choice at run time among three (and a shift
/// count held in a register) kept the row loop from being unrolled, its accumulators
/// on the stack (64-row Q8_0 1.67 → 1.9 ms).
///
/// # Safety
/// The CPU must support AVX-512 F.
#[inline(always)]
unsafe fn start_at<const F: u8>(offset_sum: i32, offset: i32) -> __m512i {
    // SAFETY: AVX-512 F as the caller guarantees.
    unsafe {
        if F == BYTES || F == CODEBOOK_FORM || F == CODEBOOK_SUB {
            _mm512_set1_epi32(offset_sum)
        } else if offset == 0 {
            _mm512_setzero_si512()
        } else if F == NIBBLES {
            _mm512_srai_epi32::<4>(_mm512_set1_epi32(offset_sum))
        } else {
            _mm512_srai_epi32::<3>(_mm512_set1_epi32(offset_sum))
        }
    }
}

/// IQ4_NL's codebook plus 128 (unsigned bytes), for `vpshufb` in every 128-bit lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn codebook_shifted() -> __m128i {
    const SHIFTED: [i8; 16] = {
        let mut t = [0i8; 16];
        let mut i = 0;
        while i < 16 {
            t[i] = (CODEBOOK[i] as i16 + 128) as u8 as i8;
            i += 1;
        }
        t
    };
    // SAFETY: 16 readable bytes.
    unsafe { _mm_loadu_si128(SHIFTED.as_ptr().cast()) }
}

/// A block's weights as unsigned bytes, value `4t + k` of each lane in byte k of its
/// lane of `w[t]` (values 16.. in `w[4 + t]` for nibbles and codebook), prefetching
/// `ahead` bytes of quants ahead (none at 0), and the other arrays as many blocks
/// ahead. The latter, 1B decode (`__measure`, one switch flipped, two alternating pairs, tok/s):
/// Q4_0 20.7–20.9 → 21.1–21.8 on one thread, 36.2–36.6 → 37.6–38.2 on two; Q8_0 and
/// IQ4_XS within noise (and Q4_0 too in a later A/B of the whole change).
///
/// Always inlined, so that the weights stay in registers: as a function of its own
/// (which `#[inline]` left it, called once per block) it returned them through the
/// stack, and the caller's accumulators went to the stack across each call. Decode,
/// one thread, alternating runs: 1B Q8_0 16.3–17.7 → 20.2–21.1 tok/s, SmolLM2 Q8_0
/// 105–117 → 118–134.
///
/// # Safety
/// As [`group`], for the block (the CPU's features too); `F` must be the weight's
/// form's constant.
#[inline(always)]
unsafe fn unpack<const F: u8>(
    blk: &Block<'_>,
    (low, table): (__m512i, __m512i),
    ahead: usize,
) -> [__m512i; 8] {
    let q = blk.quants.as_ptr();
    // SAFETY: the block's 256 (nibbles, codebook) or 512 (bytes) bytes of quants and 64
    // of fifth bits; the CPU's features as the caller guarantees.
    unsafe {
        let mut w = [_mm512_setzero_si512(); 8];
        blk.prefetch_side(ahead / blk.quants.len());
        let lines = if F == BYTES { 8 } else { 4 };
        for line in 0..lines {
            prefetch_line(q.wrapping_add(64 * line), ahead);
        }
        if F == BYTES {
            for (t, w) in w.iter_mut().enumerate() {
                *w = _mm512_loadu_si512(q.add(t * 64).cast());
            }
        } else {
            // The block's fifth bits, step t's in bits t and t + 4 of each byte.
            let top = if F == FIVE {
                _mm512_loadu_si512(blk.high.as_ptr().cast())
            } else {
                _mm512_setzero_si512()
            };
            for t in 0..4 {
                let x = _mm512_loadu_si512(q.add(t * 64).cast());
                let mut wl = _mm512_and_si512(x, low);
                let mut wh = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low);
                if F == CODEBOOK_FORM || F == CODEBOOK_SUB {
                    wl = _mm512_shuffle_epi8(table, wl);
                    wh = _mm512_shuffle_epi8(table, wh);
                } else if F == FIVE {
                    // Or-ed onto the nibbles: A | (B & C).
                    let sixteen = _mm512_set1_epi8(16);
                    wl = _mm512_ternarylogic_epi32::<0xF8>(wl, bit_to_4(top, t), sixteen);
                    wh = _mm512_ternarylogic_epi32::<0xF8>(wh, bit_to_4(top, t + 4), sixteen);
                }
                w[t] = wl;
                w[4 + t] = wh;
            }
        }
        w
    }
}

/// A block's sixteen scales (with [`Scales::Sub`], its super-block's `d`, held as f16
/// like the file's) and, with `has_min`, its minimums (zeros without).
///
/// # Safety
/// As [`group`], for the block's arrays.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn block_scales(blk: &Block<'_>, has_min: bool) -> (__m512, __m512) {
    // SAFETY: 16 scales, f16 or f32 (or 16 f16 super-block scales), and 16 f16 minimums
    // when the weight has them.
    unsafe {
        let d = if !blk.d16.is_empty() {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.d16.as_ptr().cast()))
        } else {
            _mm512_loadu_ps(blk.d.as_ptr())
        };
        let m = if has_min {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.m.as_ptr().cast()))
        } else {
            _mm512_setzero_ps()
        };
        (d, m)
    }
}

/// A [`Scales::Sub`] block's sixteen signed scale bytes `ls − 32`, widened.
///
/// # Safety
/// As [`group`], for the block's arrays; the weight's scales must be [`Scales::Sub`].
#[inline(always)]
pub(super) unsafe fn sub_scales(blk: &Block<'_>) -> __m512i {
    // SAFETY: the block's 16 scale bytes; AVX-512 F as the caller guarantees.
    unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.high.as_ptr().cast())) }
}
