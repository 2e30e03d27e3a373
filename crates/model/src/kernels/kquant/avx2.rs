//! Q4_K, Q5_K and Q6_K with AVX2, and the dispatch of every K-quant (the layout and
//! the definition are the parent module's).

use std::arch::x86_64::*;

use super::super::Sides;
#[cfg(doc)]
use super::ROW_TILE;
use super::lowk::avx2::{pair_scales, q23k};
use super::{
    ActRow, K_SUMS, KPacked, KType, LANES, PREFETCH, QK_K, pair, prefetch_ahead, prefetch_line,
    word_at,
};

/// # Safety
/// The CPU must support AVX2 and FMA; `rows` (at most [`ROW_TILE`]) must hold
/// `p.nb` super-blocks each and `out` `16·rows.len()` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group(p: &KPacked, g: usize, rows: &[ActRow], out: &mut [f32]) {
    // One row (decode): both halves of the group in one pass, each step's 64 bytes
    // read at once (as the blocks of 32 do).
    if rows.len() == 1 {
        // SAFETY: as this function requires.
        unsafe {
            match p.ty {
                KType::Q4K => return q4k::<1, 1, false, 2>(p, ([g], g), 0, rows, out),
                KType::Q5K => return q4k::<1, 1, true, 2>(p, ([g], g), 0, rows, out),
                KType::Q6K => return q6k::<1, 1, 2>(p, ([g], g), 0, rows, out),
                KType::Q2K => return q23k::<1, 1, false, 2>(p, ([g], g), 0, rows, out),
                KType::Q3K => return q23k::<1, 1, true, 2>(p, ([g], g), 0, rows, out),
            }
        }
    }
    for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
        // SAFETY: as this function requires.
        unsafe { group4(p, g, rows, out) };
    }
}

/// Decode: one activation row through the `S` groups `gs`, block by block in lockstep,
/// so that the core reads that many sequential streams of quants (`STREAMS`). Each
/// group's arithmetic is [`group`]'s with one row (both halves in one pass), in its
/// order, so each output is the same bits; group `gs[s]`'s sixteen outputs go to
/// `out[(gs[s] − first)·16..]`.
///
/// # Safety
/// As [`group`] with the one row, for every group of `gs`; `out` must hold them.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn streams<const S: usize>(
    p: &KPacked,
    at: ([usize; S], usize),
    row: &[ActRow],
    out: &mut [f32],
) {
    // SAFETY: every arm calls with what this function requires.
    unsafe {
        match p.ty {
            KType::Q4K => q4k::<S, 1, false, 2>(p, at, 0, row, out),
            KType::Q5K => q4k::<S, 1, true, 2>(p, at, 0, row, out),
            KType::Q6K => q6k::<S, 1, 2>(p, at, 0, row, out),
            KType::Q2K => q23k::<S, 1, false, 2>(p, at, 0, row, out),
            KType::Q3K => q23k::<S, 1, true, 2>(p, at, 0, row, out),
        }
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
                (KType::Q2K, 1) => q23k::<1, 1, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q2K, 2) => q23k::<1, 2, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q2K, 3) => q23k::<1, 3, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q2K, _) => q23k::<1, 4, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q3K, 1) => q23k::<1, 1, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q3K, 2) => q23k::<1, 2, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q3K, 3) => q23k::<1, 3, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q3K, _) => q23k::<1, 4, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q4K, 1) => q4k::<1, 1, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q4K, 2) => q4k::<1, 2, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q4K, 3) => q4k::<1, 3, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q4K, _) => q4k::<1, 4, false, 1>(p, ([g], g), h, rows, out),
                (KType::Q5K, 1) => q4k::<1, 1, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q5K, 2) => q4k::<1, 2, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q5K, 3) => q4k::<1, 3, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q5K, _) => q4k::<1, 4, true, 1>(p, ([g], g), h, rows, out),
                (KType::Q6K, 1) => q6k::<1, 1, 1>(p, ([g], g), h, rows, out),
                (KType::Q6K, 2) => q6k::<1, 2, 1>(p, ([g], g), h, rows, out),
                (KType::Q6K, 3) => q6k::<1, 3, 1>(p, ([g], g), h, rows, out),
                (KType::Q6K, _) => q6k::<1, 4, 1>(p, ([g], g), h, rows, out),
            }
        }
    }
}

/// Stores the accumulators of the `S` groups `gs` (`R` rows, `H` halves of eight lanes
/// from half `h0`): row `r` of group `g` at `out[(g − first + r)·16 + 8·(h0 + hh)..]`.
///
/// # Safety
/// AVX; `out` must hold every one of them.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(in crate::kernels) unsafe fn store<const S: usize, const R: usize, const H: usize>(
    accs: &[[[__m256; H]; R]; S],
    (gs, first): ([usize; S], usize),
    h0: usize,
    out: &mut [f32],
) {
    for (&g, acc) in gs.iter().zip(accs) {
        for (r, acc) in acc.iter().enumerate() {
            for (hh, &v) in acc.iter().enumerate() {
                // SAFETY: as the caller guarantees.
                unsafe {
                    _mm256_storeu_ps(
                        out.as_mut_ptr()
                            .add((g - first + r) * LANES + 8 * (h0 + hh)),
                        v,
                    )
                };
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

/// 16 in each byte of the result whose bit `t` is set in `top`, else 0: fifth bits held
/// as bit-planes (Q5_K, Q5_0, Q5_1: `kquant.rs`, `packed32.rs`). A shift of 16-bit words
/// by at most 4 moves no byte's bit `t` into another byte's bit 4.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(in crate::kernels) fn fifth_bits(top: __m256i, t: usize) -> __m256i {
    let at4 = match t {
        0 => _mm256_slli_epi16::<4>(top),
        1 => _mm256_slli_epi16::<3>(top),
        2 => _mm256_slli_epi16::<2>(top),
        3 => _mm256_slli_epi16::<1>(top),
        4 => top,
        5 => _mm256_srli_epi16::<1>(top),
        6 => _mm256_srli_epi16::<2>(top),
        _ => _mm256_srli_epi16::<3>(top),
    };
    _mm256_and_si256(at4, _mm256_set1_epi8(16))
}

/// Q4_K, lanes `8h..8h + 8·H` (`H` halves of eight lanes from half `h`): `vpmaddubsw`
/// pair sums of nibbles and broadcast activation bytes, added in 16 bits over a
/// sub-block's 8 steps (no overflow: 8·2·15·128 < 2¹⁵), then `vpmaddwd` with the lane's
/// scale in both halves.
///
/// The `S` groups `gs` go block by block (one row when `S > 1`: `streams`); row `r`
/// of group `g` goes to `out[(g − first + r)·16..]`.
///
/// # Safety
/// As [`group`].
#[target_feature(enable = "avx2,fma")]
unsafe fn q4k<const S: usize, const R: usize, const FIVE: bool, const H: usize>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    h0: usize,
    rows: &[ActRow],
    out: &mut [f32],
) {
    debug_assert!(S == 1 || R == 1);
    let low = _mm256_set1_epi8(0x0F);
    // Q5_K's 5-bit values: pair sums up to 2·31·128, so at most 4 steps fit in 16 bits.
    let flush = if FIVE { 4 } else { 8 };
    let mut accs = [[[_mm256_setzero_ps(); H]; R]; S];
    let ahead = prefetch_ahead(S, R, PREFETCH);
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a = unsafe { sides.qs(b * QK_K) };
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
            if R == 1 {
                blk.prefetch_side(ahead / blk.quants.len());
            }
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            let mut isum = [[_mm256_setzero_si256(); H]; R];
            for j in 0..8 {
                // Sub-block j: chunk j / 2, the low nibbles for even j, the high for odd
                // (one nibble half at a time: 16 registers hold four rows' sums then).
                let (i, shift) = (j / 2, 4 * (j % 2) as i32);
                let s: [__m256i; H] = std::array::from_fn(|hh| {
                    // SAFETY: scale j of lanes 8h..8h + 8, within the 256.
                    doubled(_mm256_cvtepu8_epi32(unsafe {
                        _mm_loadl_epi64(small.add(j * LANES + 8 * (h0 + hh)).cast())
                    }))
                });
                // Q5_K: the fifth bits of chunk i's nibble half j % 2, lanes 8h.., for
                // its eight steps.
                let top: [__m256i; H] = std::array::from_fn(|hh| {
                    if FIVE {
                        // SAFETY: 32 of the block's 512 bytes of fifth bits.
                        unsafe {
                            _mm256_loadu_si256(
                                blk.high
                                    .as_ptr()
                                    .add((2 * i + j % 2) * 64 + 32 * (h0 + hh))
                                    .cast(),
                            )
                        }
                    } else {
                        _mm256_setzero_si256()
                    }
                });
                let mut sum16 = [[_mm256_setzero_si256(); H]; R];
                for t in 0..8 {
                    for hh in 0..H {
                        let h = h0 + hh;
                        // SAFETY: step (i, t) is 64 bytes of the block's 2048, half h 32 of
                        // them; the activation words lie within the row's super-block.
                        unsafe {
                            if R == 1 && j % 2 == 0 && hh == 0 {
                                // The first of sub-blocks 2i and 2i + 1 to read step (i, t).
                                prefetch_line(q.wrapping_add((i * 8 + t) * 64), ahead);
                            }
                            let w = _mm256_loadu_si256(q.add((i * 8 + t) * 64 + 32 * h).cast());
                            let mut w = _mm256_and_si256(
                                _mm256_srl_epi16(w, _mm_cvtsi32_si128(shift)),
                                low,
                            );
                            if FIVE {
                                w = _mm256_or_si256(w, fifth_bits(top[hh], t));
                            }
                            for r in 0..R {
                                let x = _mm256_set1_epi32(word_at(a[r].add(32 * j + 4 * t)));
                                sum16[r][hh] =
                                    _mm256_add_epi16(sum16[r][hh], _mm256_maddubs_epi16(w, x));
                            }
                        }
                    }
                    if (t + 1) % flush == 0 {
                        for r in 0..R {
                            for hh in 0..H {
                                isum[r][hh] = _mm256_add_epi32(
                                    isum[r][hh],
                                    _mm256_madd_epi16(sum16[r][hh], s[hh]),
                                );
                                sum16[r][hh] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
            }
            for hh in 0..H {
                let isum: [__m256i; R] = std::array::from_fn(|r| isum[r][hh]);
                let mut half: [__m256; R] = std::array::from_fn(|r| acc[r][hh]);
                // SAFETY: the rows hold super-block b.
                unsafe { q4k_end(&blk, &sides, b, h0 + hh, isum, &mut half) };
                for (acc, v) in acc.iter_mut().zip(half) {
                    acc[hh] = v;
                }
            }
        }
    }
    // SAFETY: `out` holds 16·R values per group from `first`.
    unsafe { store(&accs, (gs, first), h0, out) };
}

/// Q6_K, lanes `8h..8h + 8·H` (`H` halves of eight lanes from half `h`): `vpmaddubsw`
/// pair sums of the unsigned 6-bit weights, two steps added in 16 bits (no overflow:
/// 2·2·63·128 < 2¹⁵), `vpmaddwd` with the lane's scale in both halves; the −32 offset
/// from the group's activation sum.
///
/// The `S` groups `gs` go block by block (one row when `S > 1`: `streams`); row `r`
/// of group `g` goes to `out[(g − first + r)·16..]`.
///
/// # Safety
/// As [`group`].
#[target_feature(enable = "avx2,fma")]
unsafe fn q6k<const S: usize, const R: usize, const H: usize>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    h0: usize,
    rows: &[ActRow],
    out: &mut [f32],
) {
    debug_assert!(S == 1 || R == 1);
    let low = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    let mut accs = [[[_mm256_setzero_ps(); H]; R]; S];
    let ahead = prefetch_ahead(S, R, PREFETCH);
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a = unsafe { sides.qs(b * QK_K) };
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
            if R == 1 {
                blk.prefetch_side(ahead / blk.quants.len());
            }
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            let mut isum = [[_mm256_setzero_si256(); H]; R];
            let mut offset = [[_mm256_setzero_si256(); H]; R];
            let hp = blk.high.as_ptr();
            for g8 in 0..8 {
                let scales: [(__m256i, __m256i); H] = std::array::from_fn(|hh| {
                    let h = h0 + hh;
                    // SAFETY: scales g8 and g8 + 8 of lanes 8h..8h + 8, within the 256.
                    unsafe {
                        (
                            doubled(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                small.add(g8 * LANES + 8 * h).cast(),
                            ))),
                            doubled(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                small.add((g8 + 8) * LANES + 8 * h).cast(),
                            ))),
                        )
                    }
                });
                for half in 0..2 {
                    // Two steps summed in 16 bits (no overflow: 2·2·63·128 < 2¹⁵).
                    let mut lo = [[_mm256_setzero_si256(); H]; R];
                    let mut hi = [[_mm256_setzero_si256(); H]; R];
                    for t in 2 * half..2 * half + 2 {
                        let step = g8 * 4 + t;
                        for hh in 0..H {
                            let h = h0 + hh;
                            // SAFETY: step's 64 nibble bytes (half h: 32) and its pair's 64
                            // top-bit bytes (half h: 32); the activation words lie within the
                            // row's block.
                            unsafe {
                                if R == 1 && hh == 0 {
                                    prefetch_line(q.wrapping_add(step * 64), ahead);
                                }
                                let w = _mm256_loadu_si256(q.add(step * 64 + 32 * h).cast());
                                let top =
                                    _mm256_loadu_si256(hp.add((step / 2) * 64 + 32 * h).cast());
                                // The step's fields at bits 4-5 (bits shifted in from a
                                // neighbouring byte fall outside them).
                                let (tl, th) = if step % 2 == 0 {
                                    (_mm256_slli_epi16::<4>(top), _mm256_slli_epi16::<2>(top))
                                } else {
                                    (top, _mm256_srli_epi16::<2>(top))
                                };
                                let wl = _mm256_or_si256(
                                    _mm256_and_si256(w, low),
                                    _mm256_and_si256(tl, bits45),
                                );
                                let wh = _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(w), low),
                                    _mm256_and_si256(th, bits45),
                                );
                                for r in 0..R {
                                    let xl = _mm256_set1_epi32(word_at(a[r].add(16 * g8 + 4 * t)));
                                    let xh =
                                        _mm256_set1_epi32(word_at(a[r].add(16 * (g8 + 8) + 4 * t)));
                                    lo[r][hh] =
                                        _mm256_add_epi16(lo[r][hh], _mm256_maddubs_epi16(wl, xl));
                                    hi[r][hh] =
                                        _mm256_add_epi16(hi[r][hh], _mm256_maddubs_epi16(wh, xh));
                                }
                            }
                        }
                    }
                    for r in 0..R {
                        for hh in 0..H {
                            let (sl, sh) = scales[hh];
                            let x = _mm256_add_epi32(
                                _mm256_madd_epi16(lo[r][hh], sl),
                                _mm256_madd_epi16(hi[r][hh], sh),
                            );
                            isum[r][hh] = _mm256_add_epi32(isum[r][hh], x);
                        }
                    }
                }
                for (r, offset) in offset.iter_mut().enumerate() {
                    // scale·Σ q_a in 32 bits: the sum in the low half, 0 in the high.
                    // SAFETY: the rows' sums of super-block b.
                    let (sl, sh) = unsafe {
                        let sums = sides.sums(r, b * K_SUMS);
                        (*sums.add(g8), *sums.add(g8 + 8))
                    };
                    let (ol, oh) = (
                        _mm256_set1_epi32(pair(i32::from(sl), 0)),
                        _mm256_set1_epi32(pair(i32::from(sh), 0)),
                    );
                    for hh in 0..H {
                        let (sl, sh) = scales[hh];
                        let x =
                            _mm256_add_epi32(_mm256_madd_epi16(sl, ol), _mm256_madd_epi16(sh, oh));
                        offset[hh] = _mm256_add_epi32(offset[hh], x);
                    }
                }
            }
            for hh in 0..H {
                let isum: [__m256i; R] = std::array::from_fn(|r| isum[r][hh]);
                let offset: [__m256i; R] = std::array::from_fn(|r| offset[r][hh]);
                let mut half: [__m256; R] = std::array::from_fn(|r| acc[r][hh]);
                // SAFETY: the rows hold super-block b.
                unsafe { q6k_end(&blk, &sides, b, h0 + hh, (isum, offset), &mut half) };
                for (acc, v) in acc.iter_mut().zip(half) {
                    acc[hh] = v;
                }
            }
        }
    }
    // SAFETY: `out` holds 16·R values per group from `first`.
    unsafe { store(&accs, (gs, first), h0, out) };
}

/// The end of super-block `b` of a Q4_K or Q5_K product, lanes `8h..8h + 8`: each
/// row's sum of minimums times activation sums, then [`super::q4k_step`] lane by lane
/// on `isum` into `acc`. Always inlined (into AVX2 kernels), so no target feature of
/// its own: as a call it cost the 64-row product a tenth of its time.
///
/// # Safety
/// The CPU must support AVX2 and FMA; the rows must hold super-block `b`'s scale and
/// sums.
#[inline(always)]
unsafe fn q4k_end<const R: usize>(
    blk: &super::Block<'_>,
    rows: &Sides<R>,
    b: usize,
    h: usize,
    isum: [__m256i; R],
    acc: &mut [__m256; R],
) {
    let small = blk.small.as_ptr();
    // SAFETY: AVX2 as the caller guarantees; minimum pair pr of lanes 8h..8h + 8 is 16
    // bytes within the 256, the rows' sums of super-block b within theirs, `d` and
    // `dmin` 8 f32 values each from lane 8h.
    unsafe {
        let mut msum = [_mm256_setzero_si256(); R];
        for pr in 0..4 {
            // Minimums 2pr and 2pr + 1 per lane, each in both halves of its 32 bits,
            // times the sums of 16 of their sub-blocks (two 16-bit sums side by side
            // in memory are a `vpmaddwd` pair).
            let m = _mm256_cvtepu8_epi16(_mm_loadu_si128(small.add(128 + pr * 32 + 16 * h).cast()));
            let (m0, m1) = (doubled(m), doubled(_mm256_srli_epi32::<16>(m)));
            for (r, msum) in msum.iter_mut().enumerate() {
                let s = rows.sums(r, b * K_SUMS + 4 * pr).cast::<i8>();
                let s0 = _mm256_set1_epi32(word_at(s));
                let s1 = _mm256_set1_epi32(word_at(s.add(4)));
                let x = _mm256_add_epi32(_mm256_madd_epi16(m0, s0), _mm256_madd_epi16(m1, s1));
                *msum = _mm256_add_epi32(*msum, x);
            }
        }
        let d = _mm256_loadu_ps(blk.d.as_ptr().add(8 * h));
        let dmin = _mm256_loadu_ps(blk.dmin.as_ptr().add(8 * h));
        for r in 0..R {
            // q4k_step, lane by lane.
            let da = _mm256_set1_ps(rows.d(r, b));
            let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[r]));
            let m = _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[r]));
            acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(i, m));
        }
    }
}

/// The end of super-block `b` of a Q6_K product, lanes `8h..8h + 8`:
/// [`super::q6k_step`] lane by lane on `isum − 32·offset` (`offset` = Σ scale·Σ q_a)
/// into `acc`. Always inlined, as [`q4k_end`].
///
/// # Safety
/// The CPU must support AVX2 and FMA; the rows must hold super-block `b`'s scale.
#[inline(always)]
unsafe fn q6k_end<const R: usize>(
    blk: &super::Block<'_>,
    rows: &Sides<R>,
    b: usize,
    h: usize,
    (isum, offset): ([__m256i; R], [__m256i; R]),
    acc: &mut [__m256; R],
) {
    // SAFETY: AVX2 as the caller guarantees; `d` holds 8 f32 values from lane 8h.
    unsafe {
        let d = _mm256_loadu_ps(blk.d.as_ptr().add(8 * h));
        for r in 0..R {
            // q6k_step, lane by lane, on Σ scale·(Σ q·a − 32·Σ a).
            let total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(offset[r]));
            let da = _mm256_set1_ps(rows.d(r, b));
            let i = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(total));
            acc[r] = _mm256_add_ps(acc[r], i);
        }
    }
}

/// Bytes of one group's super-block unpacked by [`unpack`]: 256 values of 16 rows.
pub(super) const UNPACKED: usize = QK_K * LANES;

/// Group `g`'s super-blocks as unsigned bytes into `w` (`p.nb·4096` bytes), value
/// `4s + k` of a super-block (step `s`) of lane `l` at byte `4096b + 64s + 4l + k`: Q2_K
/// 0–3, Q3_K 0–7 (the high bit on; the weight is that minus 4), Q4_K 0–15, Q5_K 0–31
/// (the fifth bit on), Q6_K 0–63 (the top two bits on; the weight is that minus 32).
/// Each step's eight-lane halves are then one load each for [`unpacked`].
///
/// # Safety
/// The CPU must support AVX2 and FMA; `w` must hold `p.nb·4096` bytes.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn unpack(p: &KPacked, g: usize, w: &mut [u8]) {
    let low = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    for b in 0..p.nb {
        let blk = p.block(g, b);
        let (q, hp) = (blk.quants.as_ptr(), blk.high.as_ptr());
        let dst = w[b * UNPACKED..(b + 1) * UNPACKED].as_mut_ptr();
        for h in 0..2 {
            match p.ty {
                KType::Q4K | KType::Q5K => {
                    for i in 0..4 {
                        // Q5_K: the fifth bits of chunk i's two nibble halves, lanes
                        // 8h.., for its eight steps.
                        let top = [0, 1].map(|half| {
                            if p.ty == KType::Q5K {
                                // SAFETY: 32 of the block's 512 bytes of fifth bits.
                                unsafe {
                                    _mm256_loadu_si256(hp.add((2 * i + half) * 64 + 32 * h).cast())
                                }
                            } else {
                                _mm256_setzero_si256()
                            }
                        });
                        for t in 0..8 {
                            // SAFETY: step (i, t)'s 64 bytes of the block's 2048 (half h:
                            // 32), and steps t of sub-blocks 2i and 2i + 1 in `dst`.
                            unsafe {
                                let x = _mm256_loadu_si256(q.add((i * 8 + t) * 64 + 32 * h).cast());
                                let mut wl = _mm256_and_si256(x, low);
                                let mut wh = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low);
                                if p.ty == KType::Q5K {
                                    wl = _mm256_or_si256(wl, fifth_bits(top[0], t));
                                    wh = _mm256_or_si256(wh, fifth_bits(top[1], t));
                                }
                                let at = |j: usize| dst.add(j * 512 + t * 64 + 32 * h).cast();
                                _mm256_storeu_si256(at(2 * i), wl);
                                _mm256_storeu_si256(at(2 * i + 1), wh);
                            }
                        }
                    }
                }
                KType::Q6K => {
                    for step in 0..32 {
                        let (g8, t) = (step / 4, step % 4);
                        // SAFETY: the step's 64 of the block's 2048 nibble bytes and its
                        // pair's 64 of the 1024 top-bit bytes (half h: 32 each); step t
                        // of groups g8 and g8 + 8 in `dst`.
                        unsafe {
                            let x = _mm256_loadu_si256(q.add(step * 64 + 32 * h).cast());
                            let top = _mm256_loadu_si256(hp.add((step / 2) * 64 + 32 * h).cast());
                            // As `q6k`: the step's top bits at bits 4-5, or-ed on.
                            let (tl, th) = if step % 2 == 0 {
                                (_mm256_slli_epi16::<4>(top), _mm256_slli_epi16::<2>(top))
                            } else {
                                (top, _mm256_srli_epi16::<2>(top))
                            };
                            let wl = _mm256_or_si256(
                                _mm256_and_si256(x, low),
                                _mm256_and_si256(tl, bits45),
                            );
                            let wh = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(x), low),
                                _mm256_and_si256(th, bits45),
                            );
                            let at = |gi: usize| dst.add(gi * 256 + t * 64 + 32 * h).cast();
                            _mm256_storeu_si256(at(g8), wl);
                            _mm256_storeu_si256(at(g8 + 8), wh);
                        }
                    }
                }
                KType::Q2K | KType::Q3K => {
                    for n in 0..2 {
                        for t in 0..8 {
                            // SAFETY: step (n, t)'s 64 of the block's 1024 quant bytes and
                            // (Q3_K) step t's 64 of its 512 high-bit bytes, half h: 32 each;
                            // steps 32n + 8j + t of `dst`.
                            unsafe {
                                let x = _mm256_loadu_si256(q.add((n * 8 + t) * 64 + 32 * h).cast());
                                let hw = if p.ty == KType::Q3K {
                                    _mm256_loadu_si256(hp.add(t * 64 + 32 * h).cast())
                                } else {
                                    _mm256_setzero_si256()
                                };
                                for j in 0..4 {
                                    let mut u = _mm256_and_si256(
                                        _mm256_srl_epi16(x, _mm_cvtsi32_si128(2 * j as i32)),
                                        _mm256_set1_epi8(3),
                                    );
                                    if p.ty == KType::Q3K {
                                        // Field j's high bit (at `high_bit(n, j)`) to bit 2.
                                        let hb = super::lowk::high_bit(n, j) as i32;
                                        let moved = if hb >= 2 {
                                            _mm256_srl_epi16(hw, _mm_cvtsi32_si128(hb - 2))
                                        } else {
                                            _mm256_sll_epi16(hw, _mm_cvtsi32_si128(2 - hb))
                                        };
                                        u = _mm256_or_si256(
                                            u,
                                            _mm256_and_si256(moved, _mm256_set1_epi8(4)),
                                        );
                                    }
                                    let step = 32 * n + 8 * j + t;
                                    _mm256_storeu_si256(dst.add(step * 64 + 32 * h).cast(), u);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Prefill from group `g` unpacked in `w` ([`unpack`]): every row of `rows`, four at a
/// time, `out[r·16 + lane]`. Each step of eight lanes is one load that serves the four
/// rows, so the unpacking, done once per group for all rows, leaves the loop; the sums
/// are [`group`]'s exact integers and the float steps its, so the bits are its.
///
/// # Safety
/// As [`unpack`]; `w` must hold group `g` unpacked, `rows` `p.nb` super-blocks each
/// and `out` `16·rows.len()` values.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn unpacked(p: &KPacked, g: usize, w: &[u8], rows: &[ActRow], out: &mut [f32]) {
    for (rows, out) in rows.chunks(4).zip(out.chunks_mut(4 * LANES)) {
        for h in 0..2 {
            // SAFETY: every arm calls with what this function requires.
            unsafe {
                match (p.ty, rows.len()) {
                    (KType::Q4K, 1) => unpacked45::<1, 4>(p, (g, h), w, rows, out),
                    (KType::Q4K, 2) => unpacked45::<2, 4>(p, (g, h), w, rows, out),
                    (KType::Q4K, 3) => unpacked45::<3, 4>(p, (g, h), w, rows, out),
                    (KType::Q4K, _) => unpacked45::<4, 4>(p, (g, h), w, rows, out),
                    // 5-bit values: four steps' pair sums fit in 16 bits (4·2·31·128).
                    (KType::Q5K, 1) => unpacked45::<1, 4>(p, (g, h), w, rows, out),
                    (KType::Q5K, 2) => unpacked45::<2, 4>(p, (g, h), w, rows, out),
                    (KType::Q5K, 3) => unpacked45::<3, 4>(p, (g, h), w, rows, out),
                    (KType::Q5K, _) => unpacked45::<4, 4>(p, (g, h), w, rows, out),
                    (KType::Q6K, 1) => unpacked16::<1, SIX>(p, (g, h), w, rows, out),
                    (KType::Q6K, 2) => unpacked16::<2, SIX>(p, (g, h), w, rows, out),
                    (KType::Q6K, 3) => unpacked16::<3, SIX>(p, (g, h), w, rows, out),
                    (KType::Q6K, _) => unpacked16::<4, SIX>(p, (g, h), w, rows, out),
                    (KType::Q3K, 1) => unpacked16::<1, THREE>(p, (g, h), w, rows, out),
                    (KType::Q3K, 2) => unpacked16::<2, THREE>(p, (g, h), w, rows, out),
                    (KType::Q3K, 3) => unpacked16::<3, THREE>(p, (g, h), w, rows, out),
                    (KType::Q3K, _) => unpacked16::<4, THREE>(p, (g, h), w, rows, out),
                    (KType::Q2K, 1) => unpacked16::<1, TWO>(p, (g, h), w, rows, out),
                    (KType::Q2K, 2) => unpacked16::<2, TWO>(p, (g, h), w, rows, out),
                    (KType::Q2K, 3) => unpacked16::<3, TWO>(p, (g, h), w, rows, out),
                    (KType::Q2K, _) => unpacked16::<4, TWO>(p, (g, h), w, rows, out),
                }
            }
        }
    }
}

/// [`unpacked`] for Q4_K or Q5_K, `R` rows, lanes `8h..8h + 8`: per sub-block (8
/// steps), `vpmaddubsw` pair sums added in 16 bits over `FLUSH` steps, then `vpmaddwd`
/// with the lane's scale.
///
/// # Safety
/// As [`unpacked`], with `R` rows.
#[target_feature(enable = "avx2,fma")]
unsafe fn unpacked45<const R: usize, const FLUSH: usize>(
    p: &KPacked,
    (g, h): (usize, usize),
    w: &[u8],
    rows: &[ActRow],
    out: &mut [f32],
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        let blk = p.block(g, b);
        let small = blk.small.as_ptr();
        // SAFETY: super-block b of each row and of the unpacked group, half h.
        let (a, wb) = unsafe { (sides.qs(b * QK_K), w.as_ptr().add(b * UNPACKED + 32 * h)) };
        let mut isum = [_mm256_setzero_si256(); R];
        for j in 0..8 {
            // SAFETY: scale j of lanes 8h..8h + 8, within the 256.
            let s = doubled(_mm256_cvtepu8_epi32(unsafe {
                _mm_loadl_epi64(small.add(j * LANES + 8 * h).cast())
            }));
            for t0 in (0..8).step_by(FLUSH) {
                // SAFETY: steps 8j + t0.. of the 4096 bytes, half h; the activation words
                // within the rows' super-block.
                unsafe {
                    let at = std::array::from_fn(|r| a[r].add(32 * j + 4 * t0));
                    unsigned_steps::<R, FLUSH>(wb.add(j * 512 + t0 * 64), at, s, &mut isum);
                }
            }
        }
        // SAFETY: the rows hold super-block b.
        unsafe { q4k_end(&blk, &sides, b, h, isum, &mut acc) };
    }
    // SAFETY: `out` holds 16·R values.
    unsafe { store(&[acc.map(|v| [v])], ([g], g), h, out) };
}

/// [`unpacked16`]'s types: Q6_K, Q3_K, Q2_K.
const SIX: usize = 6;
const THREE: usize = 3;
const TWO: usize = 2;

/// [`unpacked`] for the types with a scale per 16 values (4 steps), `R` rows, lanes
/// `8h..8h + 8`: `vpmaddubsw` pair sums of the unsigned weights added in 16 bits (Q6_K
/// over two steps: 2·2·63·128 < 2¹⁵; Q3_K and Q2_K over four), then `vpmaddwd` with
/// the lane's scale. After the products, each row's activation sums of 16 times the
/// scales (Q6_K, Q3_K: the offsets 32 and 4) or the minimums (Q2_K), a pair of
/// sub-blocks per `vpmaddwd`; then the float step of the type (`TY`: [`SIX`],
/// [`THREE`] or [`TWO`]).
///
/// # Safety
/// As [`unpacked`], with `R` rows and `p` of type `TY`.
#[target_feature(enable = "avx2,fma")]
unsafe fn unpacked16<const R: usize, const TY: usize>(
    p: &KPacked,
    (g, h): (usize, usize),
    w: &[u8],
    rows: &[ActRow],
    out: &mut [f32],
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let sides = Sides::<R>::of(rows);
    for b in 0..p.nb {
        let blk = p.block(g, b);
        let small = blk.small.as_ptr();
        // SAFETY: super-block b of each row and of the unpacked group, half h.
        let (a, wb) = unsafe { (sides.qs(b * QK_K), w.as_ptr().add(b * UNPACKED + 32 * h)) };
        // Sub-blocks 2p and 2p + 1's scales (Q2_K: and minimums), 16-bit pairs per lane.
        // SAFETY: pair pr of lanes 8h..8h + 8 of the block's 256 bytes of `small`.
        let pairs = |pr: usize| unsafe {
            if TY == SIX {
                let lo = _mm_loadl_epi64(small.add(2 * pr * LANES + 8 * h).cast());
                let hi = _mm_loadl_epi64(small.add((2 * pr + 1) * LANES + 8 * h).cast());
                (
                    _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi)),
                    _mm256_setzero_si256(),
                )
            } else if TY == THREE {
                pair_scales::<true>(small, pr, h)
            } else {
                pair_scales::<false>(small, pr, h)
            }
        };
        let mut isum = [_mm256_setzero_si256(); R];
        for pr in 0..8 {
            let (scales, _) = pairs(pr);
            for (e, s) in [doubled(scales), doubled(_mm256_srli_epi32::<16>(scales))]
                .into_iter()
                .enumerate()
            {
                let gi = 2 * pr + e;
                // SAFETY: steps 4gi.. of the 4096 bytes, half h; the activation words
                // within the rows' super-block.
                unsafe {
                    let w = wb.add(gi * 256);
                    let at: [*const i8; R] = std::array::from_fn(|r| a[r].add(16 * gi));
                    if TY == SIX {
                        // Two steps at a time: 2·2·63·128 < 2¹⁵.
                        unsigned_steps::<R, 2>(w, at, s, &mut isum);
                        unsigned_steps::<R, 2>(w.add(128), at.map(|a| a.add(8)), s, &mut isum);
                    } else {
                        unsigned_steps::<R, 4>(w, at, s, &mut isum);
                    }
                }
            }
        }
        // Σ scale·Σ q_a (Q6_K, Q3_K) or Σ min·Σ q_a (Q2_K), per lane.
        let mut msum = [_mm256_setzero_si256(); R];
        for pr in 0..8 {
            let (scales, mins) = pairs(pr);
            let by = if TY == TWO { mins } else { scales };
            for (r, msum) in msum.iter_mut().enumerate() {
                // Sums 2pr and 2pr + 1, side by side in memory: a `vpmaddwd` pair.
                // SAFETY: within the row's sums of super-block b.
                let two = _mm256_set1_epi32(unsafe {
                    word_at(sides.sums(r, b * K_SUMS + 2 * pr).cast())
                });
                *msum = _mm256_add_epi32(*msum, _mm256_madd_epi16(by, two));
            }
        }
        // SAFETY: 8 f32 values from lane 8h.
        let d = unsafe { _mm256_loadu_ps(blk.d.as_ptr().add(8 * h)) };
        for r in 0..R {
            // SAFETY: the rows hold super-block b.
            let da = _mm256_set1_ps(unsafe { sides.d(r, b) });
            let i = if TY == TWO {
                _mm256_cvtepi32_ps(isum[r])
            } else {
                // Σ scale·(Σ u·a − offset·Σ a), the offset 32 (Q6_K) or 4 (Q3_K).
                let off = if TY == SIX {
                    _mm256_slli_epi32::<5>(msum[r])
                } else {
                    _mm256_slli_epi32::<2>(msum[r])
                };
                _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off))
            };
            // q6k_step (Q6_K, Q3_K) or q4k_step (Q2_K), lane by lane.
            let i = _mm256_mul_ps(_mm256_mul_ps(d, da), i);
            acc[r] = if TY == TWO {
                // SAFETY: 8 f32 values from lane 8h.
                let dmin = unsafe { _mm256_loadu_ps(blk.dmin.as_ptr().add(8 * h)) };
                let m = _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(msum[r]));
                _mm256_add_ps(acc[r], _mm256_sub_ps(i, m))
            } else {
                _mm256_add_ps(acc[r], i)
            };
        }
    }
    // SAFETY: `out` holds 16·R values.
    unsafe { store(&[acc.map(|v| [v])], ([g], g), h, out) };
}

/// `N` steps of unsigned weights at `w` (one eight-lane half each, 64 bytes apart)
/// times `R` rows' activation words at `a` (4 bytes apart): `vpmaddubsw` pair sums
/// added in 16 bits (the caller keeps `N` within their bound), then `vpmaddwd` with
/// `s` (a lane's scale in both halves, or ones) into `isum`. The inner loop of every
/// AVX2 prefill from unpacked weights but the signed ones. Always inlined (into AVX2
/// kernels), so no target feature of its own.
///
/// # Safety
/// The CPU must support AVX2; `N` steps must be readable at `w` and `4·N` bytes at
/// each of `a`.
#[inline(always)]
pub(in crate::kernels) unsafe fn unsigned_steps<const R: usize, const N: usize>(
    w: *const u8,
    a: [*const i8; R],
    s: __m256i,
    isum: &mut [__m256i; R],
) {
    // SAFETY: AVX2 and the buffers as the caller guarantees.
    unsafe {
        let mut sum16 = [_mm256_setzero_si256(); R];
        for t in 0..N {
            let wv = _mm256_loadu_si256(w.add(t * 64).cast());
            for r in 0..R {
                let x = _mm256_set1_epi32(word_at(a[r].add(4 * t)));
                sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(wv, x));
            }
        }
        for r in 0..R {
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(sum16[r], s));
        }
    }
}
