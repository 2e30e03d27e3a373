//! Q4_K, Q5_K and Q6_K with AVX-512 VNNI, and the dispatch of every K-quant (the
//! layout and the definition are the parent module's).

use std::arch::x86_64::*;

use super::super::Sides;
#[cfg(doc)]
use super::ROW_TILE;
use super::lowk::avx512::{q3k, q23k};
use super::{
    ActRow, K_SUMS, KPacked, KType, LANES, PREFETCH, QK_K, pair, prefetch_ahead, prefetch_line,
    word_at,
};

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
            (KType::Q4K, 1) => q4k::<1, 1, false>(p, ([g], g), rows, out),
            (KType::Q4K, 2) => q4k::<1, 2, false>(p, ([g], g), rows, out),
            (KType::Q4K, 3) => q4k::<1, 3, false>(p, ([g], g), rows, out),
            (KType::Q4K, 4) => q4k::<1, 4, false>(p, ([g], g), rows, out),
            (KType::Q4K, 5) => q4k::<1, 5, false>(p, ([g], g), rows, out),
            (KType::Q4K, 6) => q4k::<1, 6, false>(p, ([g], g), rows, out),
            (KType::Q4K, 7) => q4k::<1, 7, false>(p, ([g], g), rows, out),
            (KType::Q4K, _) => q4k::<1, 8, false>(p, ([g], g), rows, out),
            (KType::Q5K, 1) => q4k::<1, 1, true>(p, ([g], g), rows, out),
            (KType::Q5K, 2) => q4k::<1, 2, true>(p, ([g], g), rows, out),
            (KType::Q5K, 3) => q4k::<1, 3, true>(p, ([g], g), rows, out),
            (KType::Q5K, 4) => q4k::<1, 4, true>(p, ([g], g), rows, out),
            (KType::Q5K, 5) => q4k::<1, 5, true>(p, ([g], g), rows, out),
            (KType::Q5K, 6) => q4k::<1, 6, true>(p, ([g], g), rows, out),
            (KType::Q5K, 7) => q4k::<1, 7, true>(p, ([g], g), rows, out),
            (KType::Q5K, _) => q4k::<1, 8, true>(p, ([g], g), rows, out),
            (KType::Q6K, 1) => q6k::<1, 1>(p, ([g], g), rows, out),
            (KType::Q6K, 2) => q6k::<1, 2>(p, ([g], g), rows, out),
            (KType::Q6K, 3) => q6k::<1, 3>(p, ([g], g), rows, out),
            (KType::Q6K, 4) => q6k::<1, 4>(p, ([g], g), rows, out),
            (KType::Q6K, 5) => q6k::<1, 5>(p, ([g], g), rows, out),
            (KType::Q6K, 6) => q6k::<1, 6>(p, ([g], g), rows, out),
            (KType::Q6K, 7) => q6k::<1, 7>(p, ([g], g), rows, out),
            (KType::Q6K, _) => q6k::<1, 8>(p, ([g], g), rows, out),
        }
    }
}

/// Decode: one activation row through the `S` groups `gs`, block by block in lockstep,
/// so that the core reads that many sequential streams of quants (`STREAMS`). Each
/// group's arithmetic is [`group`]'s with one row, in its order, so each output is the
/// same bits; group `gs[s]`'s sixteen outputs go to `out[(gs[s] − first)·16..]`.
///
/// # Safety
/// As [`group`] with the one row, for every group of `gs`; `out` must hold them.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn streams<const S: usize>(
    p: &KPacked,
    at: ([usize; S], usize),
    row: &[ActRow],
    out: &mut [f32],
) {
    // SAFETY: every arm calls with what this function requires.
    unsafe {
        match p.ty {
            KType::Q2K => q23k::<S, 1, false, false>(p, at, row, out),
            KType::Q3K => q3k::<S, 1>(p, at, row, out),
            KType::Q4K => q4k::<S, 1, false>(p, at, row, out),
            KType::Q5K => q4k::<S, 1, true>(p, at, row, out),
            KType::Q6K => q6k::<S, 1>(p, at, row, out),
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
            (KType::Q2K, 1) => q23k::<1, 1, false, false>(p, ([g], g), rows, out),
            (KType::Q2K, 2) => q23k::<1, 2, false, false>(p, ([g], g), rows, out),
            (KType::Q2K, 3) => q23k::<1, 3, false, false>(p, ([g], g), rows, out),
            (KType::Q2K, _) => q23k::<1, 4, false, false>(p, ([g], g), rows, out),
            (KType::Q3K, 1) => q3k::<1, 1>(p, ([g], g), rows, out),
            (KType::Q3K, 2) => q3k::<1, 2>(p, ([g], g), rows, out),
            (KType::Q3K, 3) => q3k::<1, 3>(p, ([g], g), rows, out),
            (KType::Q3K, _) => q3k::<1, 4>(p, ([g], g), rows, out),
            _ => {}
        }
    }
}

/// Q4_K: per sub-block, `vpdpbusd` of the sixteen rows' nibbles with four broadcast
/// activation bytes (no overflow: 32·15·128 < 2³¹), times the lane's scale. Each
/// sub-block is unpacked once into eight registers, then every row takes its
/// products from them, so the unpacking serves up to eight rows. Q5_K's fifth bits come
/// one load per sub-block, step t's shifted to bit 4 and or-ed on ([`bit_to_4`]); as a
/// byte mask per step and a masked add, the 64-row 2048² product took 1.17 ms against
/// 0.97 (Zen 5, one thread; Q4_K 0.93).
///
/// # Safety
/// As [`group`] for each group of `gs` (none below `first`); `out` must hold what
/// [`store`] writes there.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q4k<const S: usize, const R: usize, const FIVE: bool>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    let ahead = prefetch_ahead(S, R, PREFETCH);
    let low = _mm512_set1_epi8(0x0F);
    let sixteen = _mm512_set1_epi8(16);
    // Each row's arrays, whose lengths `group` asserted.
    let sides = Sides::<R>::of(rows);
    let mut accs = [[_mm512_setzero_ps(); R]; S];
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a = unsafe { sides.qs(b * QK_K) };
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
            blk.prefetch_side(ahead / blk.quants.len());
            let q = blk.quants.as_ptr();
            let small = blk.small.as_ptr();
            let mut isum = [_mm512_setzero_si512(); R];
            for i in 0..4 {
                // Sub-block 2i + half: the low (half 0) or high nibbles of steps (i, t).
                for half in 0..2 {
                    // Q5_K: the fifth bits of the chunk's eight steps in this nibble half,
                    // step t's in bit t of each byte.
                    let top = if FIVE {
                        // SAFETY: 64 of the block's 512 bytes of fifth bits.
                        unsafe {
                            _mm512_loadu_si512(blk.high.as_ptr().add((i * 2 + half) * 64).cast())
                        }
                    } else {
                        _mm512_setzero_si512()
                    };
                    let mut w = [_mm512_setzero_si512(); 8];
                    for (t, w) in w.iter_mut().enumerate() {
                        // SAFETY: 128·16 bytes per block: step (i, t) is 64 of them.
                        unsafe {
                            if half == 0 {
                                prefetch_line(q.wrapping_add((i * 8 + t) * 64), ahead);
                            }
                            let x = _mm512_loadu_si512(q.add((i * 8 + t) * 64).cast());
                            let x = if half == 0 {
                                x
                            } else {
                                _mm512_srli_epi16::<4>(x)
                            };
                            *w = _mm512_and_si512(x, low);
                            if FIVE {
                                // Or-ed onto the nibble: A | (B & C).
                                *w = _mm512_ternarylogic_epi32::<0xF8>(
                                    *w,
                                    bit_to_4(top, t),
                                    sixteen,
                                );
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
                        // Two sums per row (even and odd steps), so that a row's
                        // multiply-adds do not wait on each other: a chain of eight
                        // at four cycles each took as long as the eight rows' at two a
                        // cycle (Zen 5, 1B Q4_K_M prefill at one thread: 228-233 ->
                        // 239-241 tok/s against one chain for more than two rows).
                        let mut s = [_mm512_setzero_si512(); 2];
                        for (t, &w) in w.iter().enumerate() {
                            // SAFETY: the activation word lies within the row's
                            // super-block.
                            let x = unsafe { word_at(a[r].add(64 * i + 32 * half + 4 * t)) };
                            s[t % 2] = _mm512_dpbusd_epi32(s[t % 2], w, _mm512_set1_epi32(x));
                        }
                        let sum = _mm512_add_epi32(s[0], s[1]);
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
                for (r, msum) in msum.iter_mut().enumerate() {
                    // SAFETY: sums 4pr..4pr + 4 of the row's super-block b.
                    let s =
                        |i: usize| i32::from(unsafe { *sides.sums(r, b * K_SUMS + 4 * pr + i) });
                    let two = pair(s(0) + s(1), s(2) + s(3));
                    *msum = _mm512_add_epi32(*msum, _mm512_madd_epi16(m, _mm512_set1_epi32(two)));
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
                // SAFETY: the rows hold super-block b.
                let da = _mm512_set1_ps(unsafe { sides.d(r, b) });
                let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
                let m = _mm512_mul_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(msum[r]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(i, m));
            }
        }
    }
    // SAFETY: as `store` requires.
    unsafe { store(&accs, (gs, first), out) };
}

/// `top` shifted so that bit `t` of each byte lands at its bit 4 (the other bits are
/// left as they fall; a shift of 16-bit words by at most 4 moves no byte's bit `t` into
/// another byte's bit 4): fifth bits held as bit-planes (Q5_K here, Q5_0 and Q5_1 in
/// `packed32.rs`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(in crate::kernels) fn bit_to_4(top: __m512i, t: usize) -> __m512i {
    match t {
        0 => _mm512_slli_epi16::<4>(top),
        1 => _mm512_slli_epi16::<3>(top),
        2 => _mm512_slli_epi16::<2>(top),
        3 => _mm512_slli_epi16::<1>(top),
        4 => top,
        5 => _mm512_srli_epi16::<1>(top),
        6 => _mm512_srli_epi16::<2>(top),
        _ => _mm512_srli_epi16::<3>(top),
    }
}

/// Q6_K: per 16-value group, `vpdpbusd` of the unsigned 6-bit weights (no overflow),
/// the −32 offset taken off with the group's activation sum (the sum starts there),
/// times the lane's scale. Each pair of groups (four steps) is unpacked once into
/// eight registers, then every row takes its products from them with activation
/// words broadcast from memory, so the unpacking serves up to eight rows.
///
/// # Safety
/// As [`group`] for each group of `gs` (none below `first`); `out` must hold what
/// [`store`] writes there.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
unsafe fn q6k<const S: usize, const R: usize>(
    p: &KPacked,
    (gs, first): ([usize; S], usize),
    rows: &[ActRow],
    out: &mut [f32],
) {
    let ahead = prefetch_ahead(S, R, PREFETCH);
    let low = _mm512_set1_epi8(0x0F);
    let bits45 = _mm512_set1_epi8(0x30);
    // Each row's arrays, whose lengths `group` asserted.
    let sides = Sides::<R>::of(rows);
    let mut accs = [[_mm512_setzero_ps(); R]; S];
    for b in 0..p.nb {
        // SAFETY: `group`'s caller guarantees nb super-blocks of every row.
        let a = unsafe { sides.qs(b * QK_K) };
        for (&g, acc) in gs.iter().zip(&mut accs) {
            let blk = p.block(g, b);
            blk.prefetch_side(ahead / blk.quants.len());
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
                    // SAFETY: step's 64 of the block's 2048 nibble bytes and its pair's 64
                    // of its 1024 top-bit bytes.
                    unsafe {
                        prefetch_line(q.wrapping_add(step * 64), ahead);
                        let x = _mm512_loadu_si512(q.add(step * 64).cast());
                        let top = _mm512_loadu_si512(hp.add((step / 2) * 64).cast());
                        // The step's fields at bits 4-5 (bits shifted in from a neighbouring
                        // byte fall outside them), or-ed onto the nibbles: A | (B & C).
                        let (tl, th) = if step % 2 == 0 {
                            (_mm512_slli_epi16::<4>(top), _mm512_slli_epi16::<2>(top))
                        } else {
                            (top, _mm512_srli_epi16::<2>(top))
                        };
                        w[t] =
                            _mm512_ternarylogic_epi32::<0xF8>(_mm512_and_si512(x, low), tl, bits45);
                        w[4 + t] = _mm512_ternarylogic_epi32::<0xF8>(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(x), low),
                            th,
                            bits45,
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
                // Straight-line rows: as a loop, the compiler kept the rows' sums on
                // the stack (Zen 5, one thread: 64-row 2048² product 1.17 ms against
                // 1.04).
                each_row!(R, |r| {
                    // SAFETY: super-block b of the row's quants and sums; the activation
                    // words lie within it.
                    unsafe {
                        let (a, s) = (a[r], sides.sums(r, b * K_SUMS));
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
                });
            }
            // SAFETY: 16 f32 values.
            let d = unsafe { _mm512_loadu_ps(blk.d.as_ptr()) };
            for r in 0..R {
                // q6k_step, lane by lane.
                // SAFETY: the rows hold super-block b.
                let da = _mm512_set1_ps(unsafe { sides.d(r, b) });
                let i = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[r]));
                acc[r] = _mm512_add_ps(acc[r], i);
            }
        }
    }
    // SAFETY: as `store` requires.
    unsafe { store(&accs, (gs, first), out) };
}

/// Stores group `gs[s]`'s sixteen outputs for row `r` at `out[((gs[s] − first)·R +
/// r)·16..]`: with one group (`first` = it), row `r`'s at `out[16·r..]`.
///
/// # Safety
/// AVX-512 F; `out` must hold every one of them.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(super) unsafe fn store<const S: usize, const R: usize>(
    accs: &[[__m512; R]; S],
    (gs, first): ([usize; S], usize),
    out: &mut [f32],
) {
    for (&g, acc) in gs.iter().zip(accs) {
        for (r, &v) in acc.iter().enumerate() {
            let at = ((g - first) * R + r) * LANES;
            debug_assert!(at + LANES <= out.len());
            // SAFETY: `out` holds the group's values, as the caller guarantees.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(at), v) };
        }
    }
}
