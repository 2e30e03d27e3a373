//! The blocks-of-32 kernels with AVX2 (the layout and the definition they compute are
//! the parent module's).

use std::arch::x86_64::*;

use super::super::Sides;
use super::super::kquant::avx2::{fifth_bits, store, unsigned_steps};
use super::{
    ActRow, Block, CODEBOOK, Form, LANES, PREFETCH, Packed32, QK, STREAM_PREFETCH, Scales,
    prefetch_line, word_at,
};

/// # Safety
/// The CPU must support AVX2, FMA and F16C; otherwise as `avx512::group`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group(p: &Packed32, g: usize, rows: &[ActRow], out: &mut [f32]) {
    if rows.len() == 1 {
        // One row (decode): both halves of the group in one pass, so each step's 64
        // bytes are read at once and the block's bookkeeping serves both (two passes
        // took 1B Q4_0 decode to 18-19 tok/s at one thread, one pass 27-28).
        // SAFETY: as this function requires.
        unsafe { rows_n::<1, 2, 1>(p, ([g], g), 0, rows, out) };
        return;
    }
    // Four rows at a time, one half of the group per pass: sixteen registers hold no
    // more.
    for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
        for h in 0..2 {
            // SAFETY: every arm calls with what this function requires.
            unsafe {
                match rows.len() {
                    0 => {}
                    1 => rows_n::<1, 1, 1>(p, ([g], g), h, rows, out),
                    2 => rows_n::<2, 1, 1>(p, ([g], g), h, rows, out),
                    3 => rows_n::<3, 1, 1>(p, ([g], g), h, rows, out),
                    _ => rows_n::<4, 1, 1>(p, ([g], g), h, rows, out),
                }
            }
        }
    }
}

/// Lanes `8h..8h + 8·H` (`H` halves of eight lanes from half `h`). Nibbles:
/// `vpmaddubsw` pair sums added in 16 bits over the block (no overflow: 8·2·15·127 <
/// 2¹⁵). Bytes: `|w|` times the activations with
/// `w`'s sign (no pair overflows: 2·128·127 < 2¹⁵), widened every step. The `S` groups
/// `gs` go block by block (one row when `S > 1`, see [`streams`]); row `r` of group `g`
/// goes to `out[(g − first + r)·16..]`.
///
/// # Safety
/// As [`group`], for every group of `gs`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_n<const R: usize, const H: usize, const S: usize>(
    p: &Packed32,
    (gs, first): ([usize; S], usize),
    h0: usize,
    rows: &[ActRow],
    out: &mut [f32],
) {
    // SAFETY: as this function requires.
    unsafe {
        if p.scales == Scales::Sub {
            rows_sub::<R, H, S, true>(p, (gs, first), h0, rows, out);
        } else {
            rows_sub::<R, H, S, false>(p, (gs, first), h0, rows, out);
        }
    }
}

/// [`rows_n`] with `SUB` for [`Scales::Sub`] (IQ4_XS) or not, a constant: the sums of
/// IQ4_XS live across the blocks of a super-block, and as a choice at run time the
/// other forms' one-row decode grew slower with them (Q5_0 4–8%).
///
/// # Safety
/// As [`rows_n`]; `SUB` must say whether `p`'s scales are [`Scales::Sub`].
#[target_feature(enable = "avx2,fma,f16c")]
#[expect(
    clippy::needless_range_loop,
    reason = "a half's index places its bytes and picks its accumulators alike"
)]
unsafe fn rows_sub<const R: usize, const H: usize, const S: usize, const SUB: bool>(
    p: &Packed32,
    (gs, first): ([usize; S], usize),
    h0: usize,
    rows: &[ActRow],
    out: &mut [f32],
) {
    debug_assert!(S == 1 || R == 1);
    let low = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(i8::MIN);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: 16 readable bytes.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(CODEBOOK.as_ptr().cast()) });
    let mut accs = [[[_mm256_setzero_ps(); H]; R]; S];
    // IQ4_XS's integer sums, which go on over each super-block.
    let mut sub_sums = [[[_mm256_setzero_si256(); H]; R]; S];
    let ahead = if S > 1 { STREAM_PREFETCH } else { PREFETCH };
    let sides = Sides::<R>::of(rows);
    let view = p.view();
    let groups = gs.map(|g| view.group(g));
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb blocks of every row.
        let a = unsafe { sides.qs(b * QK) };
        for ((s, acc), sub_sum) in (0..S).zip(&mut accs).zip(&mut sub_sums) {
            // Decode (one row) keeps the checked block, as `avx512::rows_n` does.
            let blk = if R == 1 {
                view.block(gs[s], b)
            } else {
                // SAFETY: b < nb.
                unsafe { groups[s].block(b) }
            };
            let q = blk.quants.as_ptr();
            let mut block_sum = [[_mm256_setzero_si256(); H]; R];
            let isum = if SUB {
                if b % 8 == 0 {
                    *sub_sum = [[_mm256_setzero_si256(); H]; R];
                }
                sub_sum
            } else {
                &mut block_sum
            };
            match p.form {
                Form::Nibbles { offset, five } => {
                    let mut sum16 = [[_mm256_setzero_si256(); H]; R];
                    // SAFETY: with five bits, the block's 64 bytes of them.
                    let top: [__m256i; H] =
                        std::array::from_fn(|hh| unsafe { fifth_plane(&blk, h0 + hh, five) });
                    for t in 0..4 {
                        for hh in 0..H {
                            let h = h0 + hh;
                            // SAFETY: step t is 64 of the block's 256 bytes, half h 32 of
                            // them; the activation words lie within the row's block.
                            unsafe {
                                let (wl, wh) =
                                    nibble_halves(half_step(q, t, h, ahead), top[hh], t, five);
                                for r in 0..R {
                                    let al = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                                    let ah = _mm256_set1_epi32(word_at(a[r].add(16 + 4 * t)));
                                    let x = _mm256_add_epi16(
                                        _mm256_maddubs_epi16(wl, al),
                                        _mm256_maddubs_epi16(wh, ah),
                                    );
                                    sum16[r][hh] = _mm256_add_epi16(sum16[r][hh], x);
                                }
                            }
                        }
                        // Five bits: pair sums up to 2·2·31·127 per step, so two steps
                        // fit 16 bits (nibbles: all four).
                        if five && t % 2 == 1 {
                            for (isum, sum16) in isum.iter_mut().zip(&mut sum16) {
                                for (isum, sum16) in isum.iter_mut().zip(sum16) {
                                    *isum =
                                        _mm256_add_epi32(*isum, _mm256_madd_epi16(*sum16, ones));
                                    *sum16 = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                    for r in 0..R {
                        // SAFETY: the rows hold block b.
                        let off = _mm256_set1_epi32(offset * unsafe { sides.isum(r, b) });
                        for (isum, sum16) in isum[r].iter_mut().zip(&sum16[r]) {
                            let rest = _mm256_add_epi32(*isum, _mm256_madd_epi16(*sum16, ones));
                            *isum = _mm256_sub_epi32(rest, off);
                        }
                    }
                }
                Form::Codebook => {
                    // IQ4_XS: each pair sum times its lane's `ls − 32` (exact: 32·2·127·127
                    // < 2³¹), so the block's sums come out scaled.
                    let pairs: [__m256i; H] = std::array::from_fn(|hh| {
                        if SUB {
                            // SAFETY: the block's scale bytes.
                            unsafe { sub_pairs(&blk, h0 + hh) }
                        } else {
                            ones
                        }
                    });
                    for t in 0..4 {
                        for hh in 0..H {
                            let h = h0 + hh;
                            // SAFETY: step t is 64 of the block's 256 bytes, half h 32 of
                            // them; the activation words lie within the row's block.
                            unsafe {
                                let w = half_step(q, t, h, ahead);
                                let wl = _mm256_shuffle_epi8(table, _mm256_and_si256(w, low));
                                let wh = _mm256_shuffle_epi8(
                                    table,
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(w), low),
                                );
                                let (absl, absh) =
                                    (_mm256_sign_epi8(wl, wl), _mm256_sign_epi8(wh, wh));
                                for r in 0..R {
                                    let al = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                                    let ah = _mm256_set1_epi32(word_at(a[r].add(16 + 4 * t)));
                                    // No pair overflows: 2·127·127 < 2¹⁵.
                                    let x = _mm256_add_epi32(
                                        _mm256_madd_epi16(
                                            _mm256_maddubs_epi16(absl, _mm256_sign_epi8(al, wl)),
                                            pairs[hh],
                                        ),
                                        _mm256_madd_epi16(
                                            _mm256_maddubs_epi16(absh, _mm256_sign_epi8(ah, wh)),
                                            pairs[hh],
                                        ),
                                    );
                                    isum[r][hh] = _mm256_add_epi32(isum[r][hh], x);
                                }
                            }
                        }
                    }
                }
                Form::Bytes => {
                    for t in 0..8 {
                        for hh in 0..H {
                            let h = h0 + hh;
                            // SAFETY: step t is 64 of the block's 512 bytes, half h 32 of
                            // them; the activation word lies within the row's block.
                            unsafe {
                                // Held as `q + 128`: back to the signed `q`.
                                let w = _mm256_xor_si256(half_step(q, t, h, ahead), flip);
                                let abs = _mm256_sign_epi8(w, w);
                                for r in 0..R {
                                    let x = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                                    let prod = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(x, w));
                                    isum[r][hh] = _mm256_add_epi32(
                                        isum[r][hh],
                                        _mm256_madd_epi16(prod, ones),
                                    );
                                }
                            }
                        }
                    }
                }
            }
            if SUB && b % 8 != 7 {
                continue;
            }
            for hh in 0..H {
                let isum: [__m256i; R] = std::array::from_fn(|r| isum[r][hh]);
                let mut half: [__m256; R] = std::array::from_fn(|r| acc[r][hh]);
                // SAFETY: the rows hold block b.
                unsafe { end(&blk, &sides, b, h0 + hh, isum, &mut half) };
                for (acc, v) in acc.iter_mut().zip(half) {
                    acc[hh] = v;
                }
            }
        }
    }
    // SAFETY: `out` holds 16·R values per group from `first`.
    unsafe { store(&accs, (gs, first), h0, out) };
}

/// Lanes `8h..`'s fifth bits of a block ([`nibble_halves`]' `top`): 32 of its 64
/// bytes, step t's in bits t and t + 4 of each byte; zeros without `five`. Always
/// inlined (into AVX2 kernels), so no target feature of its own.
///
/// # Safety
/// The CPU must support AVX2; with `five`, the block's 64 bytes of fifth bits must be
/// readable.
#[inline(always)]
unsafe fn fifth_plane(blk: &Block<'_>, h: usize, five: bool) -> __m256i {
    if five {
        // SAFETY: AVX2 and the fifth bits as the caller guarantees.
        unsafe { _mm256_loadu_si256(blk.high.as_ptr().add(32 * h).cast()) }
    } else {
        // SAFETY: AVX2 as the caller guarantees.
        unsafe { _mm256_setzero_si256() }
    }
}

/// The unsigned values of step `t`'s 32 quant bytes `x` (one half of its lanes): the
/// low nibbles and the high ones, each with 16 added where its fifth bit is set
/// (`five`: bits t and t + 4 of those lanes' [`fifth_plane`], `top`). Always inlined
/// (into AVX2 kernels), so no target feature of its own.
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn nibble_halves(x: __m256i, top: __m256i, t: usize, five: bool) -> (__m256i, __m256i) {
    // SAFETY: AVX2 as the caller guarantees.
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let mut wl = _mm256_and_si256(x, low);
        let mut wh = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low);
        if five {
            wl = _mm256_or_si256(wl, fifth_bits(top, t));
            wh = _mm256_or_si256(wh, fifth_bits(top, t + 4));
        }
        (wl, wh)
    }
}

/// Half `h` (32 bytes) of step `t` (64 bytes) of a block's quants at `q`; the first half
/// asks for the cache line `ahead` bytes ahead ([`PREFETCH`] for one stream,
/// [`STREAM_PREFETCH`] for each of several).
///
/// # Safety
/// The CPU must support AVX2; the step's 64 bytes must be readable.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_step(q: *const u8, t: usize, h: usize, ahead: usize) -> __m256i {
    if h == 0 {
        prefetch_line(q.wrapping_add(t * 64), ahead);
    }
    // SAFETY: the caller's.
    unsafe { _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast()) }
}

/// Decode: one activation row through the `S` groups `gs`, block by block in lockstep,
/// so that the core reads that many sequential streams of quants (`STREAMS`). Each
/// group's arithmetic is [`group`]'s with one row (both halves in one pass), in its
/// order, so each output is the same bits; group `gs[s]`'s sixteen outputs go to
/// `out[(gs[s] − first)·16..]`.
///
/// # Safety
/// As [`group`] with the one row, for every group of `gs`; `out` must hold them.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn streams<const S: usize>(
    p: &Packed32,
    gs: [usize; S],
    first: usize,
    row: &ActRow,
    out: &mut [f32],
) {
    // SAFETY: as this function requires.
    unsafe { rows_n::<1, 2, S>(p, (gs, first), 0, std::slice::from_ref(row), out) };
}

/// The end of block `b` for lanes `8h..8h + 8`: `acc = fma(d_w·d_a, isum, acc)` and,
/// with minimums, `acc = fma(m, s_a, acc)`, lane by lane. Always inlined (into AVX2
/// kernels), so no target feature of its own.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the rows must hold block `b`'s scale and
/// (with minimums) sum.
#[inline(always)]
unsafe fn end<const R: usize>(
    blk: &Block<'_>,
    rows: &Sides<R>,
    b: usize,
    h: usize,
    isum: [__m256i; R],
    acc: &mut [__m256; R],
) {
    // SAFETY: AVX2, FMA and F16C as the caller guarantees; 8 scales from lane 8h (`m`
    // only with minimums).
    unsafe {
        let m = if blk.m.is_empty() {
            None
        } else {
            Some(_mm256_cvtph_ps(_mm_loadu_si128(
                blk.m.as_ptr().add(8 * h).cast(),
            )))
        };
        fma_step(scales_of(blk, h), m, rows, b, isum, acc);
    }
}

/// `acc = fma(d_w·d_a, isum, acc)` and, with minimums `m`, `acc = fma(m, s_a, acc)`,
/// lane by lane, for block `b` of each row. Always inlined, as [`end`].
///
/// # Safety
/// The CPU must support AVX2 and FMA; the rows must hold block `b`'s scale and (with
/// `m`) sum.
#[inline(always)]
unsafe fn fma_step<const R: usize>(
    d: __m256,
    m: Option<__m256>,
    rows: &Sides<R>,
    b: usize,
    isum: [__m256i; R],
    acc: &mut [__m256; R],
) {
    // SAFETY: AVX2 and FMA, and the rows' block b, as the caller guarantees.
    unsafe {
        for r in 0..R {
            let da = _mm256_set1_ps(rows.d(r, b));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            if let Some(m) = m {
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(rows.s(r, b)), acc[r]);
            }
        }
    }
}

/// IQ4_XS's ([`Scales::Sub`]) scale bytes `ls − 32` of lanes `8h..8h + 8` as 16-bit
/// pairs `(ls − 32, ls − 32)`, one per 32-bit lane: the `vpmaddwd` operand that adds a
/// lane's pair sums times its scale. Always inlined, as [`end`].
///
/// # Safety
/// The CPU must support AVX2; the block's scales must be [`Scales::Sub`].
#[inline(always)]
unsafe fn sub_pairs(blk: &Block<'_>, h: usize) -> __m256i {
    // SAFETY: AVX2 as the caller guarantees; 8 scale bytes from lane 8h.
    unsafe {
        let ls = _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.high.as_ptr().add(8 * h).cast()));
        _mm256_or_si256(
            _mm256_slli_epi32::<16>(ls),
            _mm256_and_si256(ls, _mm256_set1_epi32(0xFFFF)),
        )
    }
}

/// Block `blk`'s scales of lanes `8h..8h + 8` as f32: `d`, the f16 `d` widened, or
/// IQ4_XS's super-block `d`. Always inlined, as [`end`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline(always)]
unsafe fn scales_of(blk: &Block<'_>, h: usize) -> __m256 {
    // SAFETY: AVX2 and F16C as the caller guarantees; 8 scales from lane 8h.
    unsafe {
        if blk.d16.is_empty() {
            _mm256_loadu_ps(blk.d.as_ptr().add(8 * h))
        } else {
            _mm256_cvtph_ps(_mm_loadu_si128(blk.d16.as_ptr().add(8 * h).cast()))
        }
    }
}

/// Where a group's block unpacked by [`unpack`] holds its lanes' scales as f32 (and,
/// 64 bytes on, its minimums, or IQ4_XS's [`sub_pairs`]): after the 32 values of 16
/// rows.
const SCALES_AT: usize = QK * LANES;

/// Bytes of one group's block unpacked by [`unpack`]: values, scales, minimums or
/// scale pairs.
pub(super) fn unpacked_bytes(p: &Packed32) -> usize {
    SCALES_AT
        + if p.has_min() || p.scales == Scales::Sub {
            128
        } else {
            64
        }
}

/// Group `g`'s blocks as bytes into `w` (`p.nb·`[`unpacked_bytes`]), value `4t + k`
/// of a block (step `t`) of lane `l` at byte `64t + 4l + k` of the block's part:
/// nibbles as unsigned 0–15 (0–31 with a fifth bit), codebook indices and bytes as the
/// signed weights; then (at [`SCALES_AT`]) the lanes' scales
/// as f32 (`d`, the f16 `d` widened, or IQ4_XS's super-block `d`, as the group kernels
/// compute them) and minimums (IQ4_XS: its [`sub_pairs`]). Each step's eight-lane
/// halves are then one load each for [`unpacked`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `p.nb·unpacked_bytes(p)`
/// bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack(p: &Packed32, g: usize, w: &mut [u8]) {
    let low = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(i8::MIN);
    // SAFETY: 16 readable bytes.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(CODEBOOK.as_ptr().cast()) });
    let per = unpacked_bytes(p);
    let group = p.view().group(g);
    for b in 0..p.nb {
        // SAFETY: b < nb.
        let blk = unsafe { group.block(b) };
        let q = blk.quants.as_ptr();
        let dst = w[b * per..(b + 1) * per].as_mut_ptr();
        for h in 0..2 {
            // SAFETY: each step's half (32 bytes) of the block's quants and (five bits)
            // its 64 bytes of fifth bits; steps t and t + 4 (bytes: t) of the block in
            // `dst`; 8 scales (minimums) from lane 8h, to 32 bytes at SCALES_AT (+ 64) +
            // 32h.
            unsafe {
                let scales = dst.add(SCALES_AT + 32 * h).cast::<f32>();
                _mm256_storeu_ps(scales, scales_of(&blk, h));
                if p.has_min() {
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(blk.m.as_ptr().add(8 * h).cast()));
                    _mm256_storeu_ps(scales.add(16), m);
                } else if blk.sub {
                    _mm256_storeu_si256(scales.add(16).cast(), sub_pairs(&blk, h));
                }
                let at = |t: usize| dst.add(t * 64 + 32 * h);
                match p.form {
                    Form::Nibbles { five, .. } => {
                        let top = fifth_plane(&blk, h, five);
                        for t in 0..4 {
                            let x = _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast());
                            let (wl, wh) = nibble_halves(x, top, t, five);
                            _mm256_storeu_si256(at(t).cast(), wl);
                            _mm256_storeu_si256(at(t + 4).cast(), wh);
                        }
                    }
                    Form::Codebook => {
                        for t in 0..4 {
                            let x = _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast());
                            let wl = _mm256_shuffle_epi8(table, _mm256_and_si256(x, low));
                            let wh = _mm256_shuffle_epi8(
                                table,
                                _mm256_and_si256(_mm256_srli_epi16::<4>(x), low),
                            );
                            _mm256_storeu_si256(at(t).cast(), wl);
                            _mm256_storeu_si256(at(t + 4).cast(), wh);
                        }
                    }
                    Form::Bytes => {
                        for t in 0..8 {
                            // Held as `q + 128`: back to the signed `q`.
                            let v = _mm256_xor_si256(
                                _mm256_loadu_si256(q.add(t * 64 + 32 * h).cast()),
                                flip,
                            );
                            _mm256_storeu_si256(at(t).cast(), v);
                        }
                    }
                }
            }
        }
    }
}

/// Prefill from group `g` unpacked in `w` ([`unpack`]): every row of `rows`, four at a
/// time, `out[r·16 + lane]`. Each step of eight lanes is one load that serves the four
/// rows, so the unpacking, done once per group for all
/// rows, leaves the loop; the sums are [`group`]'s exact integers and the float steps
/// its, so the bits are its.
///
/// # Safety
/// As [`unpack`]; `w` must hold group `g` unpacked, `rows` `p.nb` blocks each (with
/// their scales, integer sums and, with minimums, sums) and `out` `16·rows.len()`
/// values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpacked(p: &Packed32, g: usize, w: &[u8], rows: &[ActRow], out: &mut [f32]) {
    for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
        for h in 0..2 {
            // SAFETY: every arm calls with what this function requires.
            unsafe {
                match (p.form, p.has_min(), rows.len()) {
                    // Nibbles: pair sums added in 16 bits over the block (8·2·15·127 <
                    // 2¹⁵), with a fifth bit over half of it (4·2·31·127 < 2¹⁵).
                    (Form::Nibbles { five: false, .. }, false, n) => match n {
                        1 => nibbles::<1, 8, false>(p, (g, h), w, rows, out),
                        2 => nibbles::<2, 8, false>(p, (g, h), w, rows, out),
                        3 => nibbles::<3, 8, false>(p, (g, h), w, rows, out),
                        _ => nibbles::<4, 8, false>(p, (g, h), w, rows, out),
                    },
                    (Form::Nibbles { five: false, .. }, true, n) => match n {
                        1 => nibbles::<1, 8, true>(p, (g, h), w, rows, out),
                        2 => nibbles::<2, 8, true>(p, (g, h), w, rows, out),
                        3 => nibbles::<3, 8, true>(p, (g, h), w, rows, out),
                        _ => nibbles::<4, 8, true>(p, (g, h), w, rows, out),
                    },
                    (Form::Nibbles { five: true, .. }, false, n) => match n {
                        1 => nibbles::<1, 4, false>(p, (g, h), w, rows, out),
                        2 => nibbles::<2, 4, false>(p, (g, h), w, rows, out),
                        3 => nibbles::<3, 4, false>(p, (g, h), w, rows, out),
                        _ => nibbles::<4, 4, false>(p, (g, h), w, rows, out),
                    },
                    (Form::Nibbles { five: true, .. }, true, n) => match n {
                        1 => nibbles::<1, 4, true>(p, (g, h), w, rows, out),
                        2 => nibbles::<2, 4, true>(p, (g, h), w, rows, out),
                        3 => nibbles::<3, 4, true>(p, (g, h), w, rows, out),
                        _ => nibbles::<4, 4, true>(p, (g, h), w, rows, out),
                    },
                    (Form::Codebook, false, n) if p.scales == Scales::Sub => match n {
                        1 => signed::<1, false, true>(p, (g, h), w, rows, out),
                        2 => signed::<2, false, true>(p, (g, h), w, rows, out),
                        3 => signed::<3, false, true>(p, (g, h), w, rows, out),
                        _ => signed::<4, false, true>(p, (g, h), w, rows, out),
                    },
                    (Form::Codebook | Form::Bytes, false, n) => match n {
                        1 => signed::<1, false, false>(p, (g, h), w, rows, out),
                        2 => signed::<2, false, false>(p, (g, h), w, rows, out),
                        3 => signed::<3, false, false>(p, (g, h), w, rows, out),
                        _ => signed::<4, false, false>(p, (g, h), w, rows, out),
                    },
                    (Form::Codebook | Form::Bytes, true, n) => match n {
                        1 => signed::<1, true, false>(p, (g, h), w, rows, out),
                        2 => signed::<2, true, false>(p, (g, h), w, rows, out),
                        3 => signed::<3, true, false>(p, (g, h), w, rows, out),
                        _ => signed::<4, true, false>(p, (g, h), w, rows, out),
                    },
                }
            }
        }
    }
}

/// The end of block `b` from its unpacked scales at `scales` (lanes `8h..`; minimums
/// 64 bytes on, with `MIN`): [`end`]'s arithmetic.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `scales` must point to the 8 scales (and 8
/// minimums 16 values on); the rows must hold block `b`'s scale and (with `MIN`) sum.
#[inline(always)]
unsafe fn unpacked_end<const R: usize, const MIN: bool>(
    scales: *const f32,
    rows: &Sides<R>,
    b: usize,
    isum: [__m256i; R],
    acc: &mut [__m256; R],
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let m = if MIN {
            Some(_mm256_loadu_ps(scales.add(16)))
        } else {
            None
        };
        fma_step(_mm256_loadu_ps(scales), m, rows, b, isum, acc);
    }
}

/// [`unpacked`] for nibbles, `R` rows, lanes `8h..8h + 8`: `vpmaddubsw` pair sums
/// added in 16 bits over `FLUSH` steps, widened, less `offset·Σ q_a`.
///
/// # Safety
/// As [`unpacked`], with `R` rows and `p` in the nibble form.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles<const R: usize, const FLUSH: usize, const MIN: bool>(
    p: &Packed32,
    (g, h): (usize, usize),
    w: &[u8],
    rows: &[ActRow],
    out: &mut [f32],
) {
    let Form::Nibbles { offset, .. } = p.form else {
        unreachable!("the nibble form")
    };
    // Four bits: offset 0 or 8; five (flushed every four steps): 0 or 16.
    debug_assert!(offset == 0 || offset == if FLUSH == 8 { 8 } else { 16 });
    let ones = _mm256_set1_epi16(1);
    let per = unpacked_bytes(p);
    let mut acc = [_mm256_setzero_ps(); R];
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        // SAFETY: block b of each row and of the unpacked group, half h.
        let (a, wb) = unsafe { (sides.qs(b * QK), w.as_ptr().add(b * per + 32 * h)) };
        let mut isum = [_mm256_setzero_si256(); R];
        for t0 in (0..8).step_by(FLUSH) {
            // SAFETY: steps t0.. of the block's 512 bytes, half h; the activation words
            // within the rows' block.
            unsafe {
                let at = a.map(|a| a.add(4 * t0));
                unsigned_steps::<R, FLUSH>(wb.add(t0 * 64), at, ones, &mut isum);
            }
        }
        if offset != 0 {
            for (r, isum) in isum.iter_mut().enumerate() {
                // −offset·Σq_a: the row's −128·Σq_a broadcast from memory, shifted
                // right (offsets 8 and, with five bits, 16). (Σq_a times the offset on
                // a general register, moved to a vector one, took the 64-row Q4_0
                // product 8% longer.)
                // SAFETY: the rows hold block b.
                let held = _mm256_set1_epi32(unsafe { sides.offset_sum(r, b) });
                let off = if FLUSH == 8 {
                    _mm256_srai_epi32::<4>(held)
                } else {
                    _mm256_srai_epi32::<3>(held)
                };
                *isum = _mm256_add_epi32(*isum, off);
            }
        }
        // SAFETY: the block's unpacked scales of half h (and minimums); the rows hold
        // block b.
        unsafe { unpacked_end::<R, MIN>(wb.add(SCALES_AT).cast(), &sides, b, isum, &mut acc) };
    }
    // SAFETY: `out` holds 16·R values.
    unsafe { store(&[acc.map(|v| [v])], ([g], g), h, out) };
}

/// [`unpacked`] for signed weights (codebook, bytes), `R` rows, lanes `8h..8h + 8`:
/// `|w|` times the activations with `w`'s sign (no pair overflows: 2·128·127 < 2¹⁵),
/// widened every step. (`|w|` is taken per step for the four rows: holding it unpacked
/// as well made the 64-row Q8_0 product no faster, 2.4–2.8 ms against 2.4–2.5.
/// Neither did 16-bit weights and activations with `vpmaddwd`, two multiply-adds and
/// two adds per 32 products and row (64-row IQ4_XS 2.43 ms against 2.37–2.60): both
/// are four vector operations per 32 products, and those bound the product.) With
/// `SUB` (IQ4_XS), the widening multiplies by the lane's `ls − 32` ([`sub_pairs`]) and
/// the sums go on over the super-block, one float step at its end.
///
/// # Safety
/// As [`unpacked`], with `R` rows and `p` in the codebook or bytes form (`SUB`: with
/// [`Scales::Sub`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn signed<const R: usize, const MIN: bool, const SUB: bool>(
    p: &Packed32,
    (g, h): (usize, usize),
    w: &[u8],
    rows: &[ActRow],
    out: &mut [f32],
) {
    let ones = _mm256_set1_epi16(1);
    let per = unpacked_bytes(p);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut isum = [_mm256_setzero_si256(); R];
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        // SAFETY: block b of each row and of the unpacked group, half h.
        let (a, wb) = unsafe { (sides.qs(b * QK), w.as_ptr().add(b * per + 32 * h)) };
        let widen = if SUB {
            // SAFETY: the block's scale pairs of half h.
            unsafe { _mm256_loadu_si256(wb.add(SCALES_AT + 64).cast()) }
        } else {
            ones
        };
        for t in 0..8 {
            // SAFETY: step t's half within the block's 512 bytes; the activation words
            // within the rows' block.
            unsafe {
                let wv = _mm256_loadu_si256(wb.add(t * 64).cast());
                let abs = _mm256_sign_epi8(wv, wv);
                for r in 0..R {
                    let x = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                    let prod = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(x, wv));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(prod, widen));
                }
            }
        }
        if SUB && b % 8 != 7 {
            continue;
        }
        // SAFETY: the block's unpacked scales of half h (and minimums); the rows hold
        // block b.
        unsafe { unpacked_end::<R, MIN>(wb.add(SCALES_AT).cast(), &sides, b, isum, &mut acc) };
        isum = [_mm256_setzero_si256(); R];
    }
    // SAFETY: `out` holds 16·R values.
    unsafe { store(&[acc.map(|v| [v])], ([g], g), h, out) };
}
