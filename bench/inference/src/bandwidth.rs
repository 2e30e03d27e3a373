//! The memory-bandwidth ceiling of decode.
//!
//! Decoding one token reads every weight matrix once, so a decode can go no faster than
//! (bytes of weights read per token) / (memory bandwidth). The bandwidth is measured
//! here as `memcpy`'s: a 256 MiB buffer copied into another, split evenly between T
//! threads, counted as memory traffic, read plus written, as STREAM counts its "copy"
//! (2 × 256 MiB per copy: at these sizes glibc's `memcpy` writes with non-temporal
//! stores, so nothing else moves). Counting only the bytes copied would put the ceiling
//! at half of what a read-only stream reaches: llama.cpp decodes 1B Q8_0 at ~1.6× that.
//! The best of several copies is the ceiling, so a figure near 100% of it is as fast
//! as this machine moves memory.
//!
//! A copy is not what decode does, though, and its figure depends on how the C library
//! copies: on an Intel Xeon with a 480 MiB L3 here, two threads copying 256 MiB counted
//! 26 GB/s of traffic and copying 1 GiB 41 GB/s (glibc writes with non-temporal stores
//! only above a threshold set from the cache size), while one thread counted 23 GB/s,
//! more than the 15.4 GB/s any read-only stream reached on one core. So the benchmark
//! also measures what decode needs, reading ([`measure_read`]: a buffer of twice the
//! last-level cache, each thread reading it as four prefetched streams and as one, the
//! faster counted), and reports decode against both ceilings.

use std::time::Instant;

use agentstack_quant::gguf::Gguf;
use agentstack_quant::recipe::is_quantizable;
use anyhow::{Context, Result};
use rayon::prelude::*;
use serde::Serialize;

/// Bytes copied per measurement: above most CPUs' caches, though not every one (the
/// Intel Xeon of 2026-12-05 reports a 480 MiB L3); the read ceiling's buffer is sized
/// from the cache ([`read_buffer_bytes`]).
pub const BUFFER_BYTES: usize = 256 << 20;
/// Timed copies per thread count (after one untimed copy).
const COPIES: usize = 7;

/// `memcpy` bandwidth at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct Bandwidth {
    /// Threads copying at once.
    pub threads: usize,
    /// Bytes copied per copy (the traffic is twice that).
    pub bytes: usize,
    /// The best copy, bytes of traffic (read + written) per second: the ceiling's
    /// bandwidth.
    pub best_bytes_per_second: f64,
    /// The median copy, bytes of traffic per second.
    pub median_bytes_per_second: f64,
    /// Each copy, bytes of traffic per second.
    pub samples: Vec<f64>,
}

/// Measures `memcpy` of [`BUFFER_BYTES`] at `threads` threads (a pool of its own).
pub fn measure(threads: usize) -> Result<Bandwidth> {
    // Touched before timing (non-zero, so no page stays a shared zero page).
    let src = vec![1u8; BUFFER_BYTES];
    let mut dst = vec![2u8; BUFFER_BYTES];
    let chunk = BUFFER_BYTES.div_ceil(threads);
    let samples = timed(threads, 2 * BUFFER_BYTES, || {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&dst);
    })?;
    Ok(Bandwidth::of(threads, BUFFER_BYTES, samples))
}

/// Bytes per second of [`COPIES`] timed runs of `run` on a pool of `threads` threads
/// of its own, after one untimed run; each run counts `counted` bytes.
fn timed(threads: usize, counted: usize, mut run: impl FnMut() + Send) -> Result<Vec<f64>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting the measuring threads")?;
    let mut samples = Vec::with_capacity(COPIES);
    for pass in 0..=COPIES {
        let start = Instant::now();
        pool.install(&mut run);
        let seconds = start.elapsed().as_secs_f64();
        if pass > 0 {
            samples.push(counted as f64 / seconds.max(f64::MIN_POSITIVE));
        }
    }
    Ok(samples)
}

impl Bandwidth {
    fn of(threads: usize, bytes: usize, samples: Vec<f64>) -> Self {
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        Self {
            threads,
            bytes,
            best_bytes_per_second: sorted.last().copied().unwrap_or(0.0),
            median_bytes_per_second: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            samples,
        }
    }
}

/// Sequential streams each thread reads at once in [`measure_read`]'s first plan: one
/// core of an Intel Xeon here read 12.4 GB/s from one stream, 15.4 from four and no
/// more from eight, as decode's kernels read four (`kernels::STREAMS`).
pub const READ_STREAMS: usize = 4;

/// Bytes read per measurement of [`measure_read`]: twice the last-level cache this
/// machine reports (`/sys`), and at least 1 GiB, so that the reads come from memory.
pub fn read_buffer_bytes() -> usize {
    (2 * last_level_cache_bytes().unwrap_or(0)).max(1 << 30)
}

/// The largest CPU cache `/sys` lists for cpu0 (Linux), in bytes.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|entry| {
        let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (digits, unit) = size.split_at(
            size.find(|c: char| !c.is_ascii_digit())
                .unwrap_or(size.len()),
        );
        let n: usize = digits.parse().ok()?;
        Some(match unit {
            "K" => n << 10,
            "M" => n << 20,
            "G" => n << 30,
            _ => n,
        })
    })
    .max()
}

/// Measures read-only bandwidth at `threads` threads (a pool of its own): a buffer of
/// [`read_buffer_bytes`] split evenly between them, each thread's part summed in each of
/// the two ways decode reads its weights (`AGENTSTACK_DECODE_READ`): as
/// [`READ_STREAMS`] streams in lockstep, each prefetched in software, and as one stream
/// with no software prefetch. The faster plan's samples are returned, so the ceiling is
/// this machine's, whichever way its core reads best (an Intel Xeon here: the streams,
/// 15.4 GB/s against 12.4; an AMD EPYC: the one stream). `bytes` and the rates count
/// bytes read.
pub fn measure_read(threads: usize) -> Result<Bandwidth> {
    let bytes = read_buffer_bytes();
    // Touched before timing (non-zero, so no page stays a shared zero page).
    let words = vec![1u64; bytes / 8];
    let chunk = words.len().div_ceil(threads);
    let plan = |read: fn(&[u64]) -> u64| {
        timed(threads, bytes, || {
            let sum: u64 = words
                .par_chunks(chunk)
                .map(read)
                .reduce(|| 0, u64::wrapping_add);
            std::hint::black_box(sum);
        })
    };
    let streams = Bandwidth::of(
        threads,
        bytes,
        plan(read_streams::<READ_STREAMS, READ_AHEAD>)?,
    );
    let one = Bandwidth::of(threads, bytes, plan(read_streams::<1, 0>)?);
    Ok(
        if one.best_bytes_per_second > streams.best_bytes_per_second {
            one
        } else {
            streams
        },
    )
}

/// Words of each stream read per step of [`read_streams`]: 256 bytes, four cache lines.
const STEP_WORDS: usize = 32;

/// How far ahead of its loads each stream asks for a cache line, as decode's kernels do
/// with several streams (`kernels::STREAM_PREFETCH`).
const READ_AHEAD: usize = 4 << 10;

/// The wrapping sum of `part`, read as `S` equal runs in lockstep, 256 bytes of each at
/// a time (the words past the last whole step are left out), each run prefetched
/// `AHEAD` bytes ahead (0: not at all): with AVX2's 32-byte loads where the CPU has them
/// (a loop the compiler vectorized for the baseline's 16-byte ones read one core at 11
/// GB/s where AVX-512 loads in C read 15).
fn read_streams<const S: usize, const AHEAD: usize>(part: &[u64]) -> u64 {
    let run = part.len() / S / STEP_WORDS * STEP_WORDS;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        #[expect(unsafe_code, reason = "AVX2 loads, the CPU checked")]
        // SAFETY: the CPU has AVX2; the loads lie within `part` (`S` runs of `run`
        // words).
        return unsafe { read_streams_avx2::<S, AHEAD>(part, run) };
    }
    let mut acc = [0u64; STEP_WORDS];
    for i in (0..run).step_by(STEP_WORDS) {
        for s in 0..S {
            let words = &part[s * run + i..s * run + i + STEP_WORDS];
            for (a, w) in acc.iter_mut().zip(words) {
                *a = a.wrapping_add(*w);
            }
        }
    }
    acc.iter().fold(0, |a, &w| a.wrapping_add(w))
}

/// [`read_streams`] with AVX2.
///
/// # Safety
/// The CPU must have AVX2; `part` must hold `S · run` words, `run` a multiple of
/// [`STEP_WORDS`].
#[cfg(target_arch = "x86_64")]
#[expect(unsafe_code, reason = "AVX2 loads")]
#[target_feature(enable = "avx2")]
unsafe fn read_streams_avx2<const S: usize, const AHEAD: usize>(part: &[u64], run: usize) -> u64 {
    use std::arch::x86_64::*;
    assert!(part.len() >= S * run && run.is_multiple_of(STEP_WORDS));
    let base = part.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    for i in (0..run).step_by(STEP_WORDS) {
        for s in 0..S {
            // SAFETY: words s·run + i .. + STEP_WORDS lie within `part`; a prefetch
            // past its end reads nothing.
            unsafe {
                let p = base.add(s * run + i);
                if AHEAD > 0 {
                    for line in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add((AHEAD + 64 * line) / 8).cast());
                    }
                }
                for k in 0..STEP_WORDS / 4 {
                    let v = _mm256_loadu_si256(p.add(4 * k).cast());
                    acc[k % 4] = _mm256_add_epi64(acc[k % 4], v);
                }
            }
        }
    }
    let mut words = [0u64; 16];
    for (k, v) in acc.iter().enumerate() {
        // SAFETY: 4 words of `words` each.
        unsafe { _mm256_storeu_si256(words.as_mut_ptr().add(4 * k).cast(), *v) };
    }
    words.iter().fold(0, |a, &w| a.wrapping_add(w))
}

/// Bytes of weights one decoded token reads: every 2-D weight matrix, the output
/// projection included; with tied embeddings (no `output.weight`) the token embedding
/// is read whole once, as the output head (its row lookup for the input is
/// negligible). Norms and other 1-D tensors are left out.
pub fn weight_bytes_per_token(file: &Gguf) -> u64 {
    let tied = file.tensor("output.weight").is_none();
    file.tensors
        .iter()
        .filter(|t| is_quantizable(t))
        .filter(|t| tied || t.name != "token_embd.weight")
        .map(|t| t.bytes())
        .sum()
}

/// The bandwidth T threads have: the best measured at any count up to T (T threads can
/// do what one does; on a shared machine a second copying thread can measure lower
/// than one alone, which would put the ceiling below what a decode reaches).
pub fn at_most(bandwidths: &[Bandwidth], threads: usize) -> f64 {
    bandwidths
        .iter()
        .filter(|b| b.threads <= threads)
        .map(|b| b.best_bytes_per_second)
        .fold(f64::NAN, f64::max)
}

/// The decode ceiling, tok/s.
pub fn ceiling(bytes_per_second: f64, bytes_per_token: u64) -> f64 {
    if bytes_per_token == 0 {
        f64::NAN
    } else {
        bytes_per_second / bytes_per_token as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_measure_a_positive_bandwidth() {
        let b = measure(1).unwrap();
        assert_eq!(b.samples.len(), COPIES);
        assert!(b.best_bytes_per_second >= b.median_bytes_per_second);
        assert!(b.median_bytes_per_second > 0.0);
    }

    #[test]
    fn reads_sum_every_stream() {
        let part: Vec<u64> = (1..=256).collect();
        // Four runs of 64 words, all read; or one of 256.
        assert_eq!(read_streams::<4, READ_AHEAD>(&part), 256 * 257 / 2);
        assert_eq!(read_streams::<1, 0>(&part), 256 * 257 / 2);
        // 300 words: four runs of 64, the last 44 words left out; one run of 288.
        let part: Vec<u64> = (1..=300).collect();
        assert_eq!(read_streams::<4, READ_AHEAD>(&part), 256 * 257 / 2);
        assert_eq!(read_streams::<1, 0>(&part), 288 * 289 / 2);
        assert!(read_buffer_bytes() >= 1 << 30);
    }

    #[test]
    fn ceiling_is_bandwidth_over_bytes() {
        assert_eq!(ceiling(10e9, 1_000_000_000), 10.0);
        assert!(ceiling(10e9, 0).is_nan());
    }

    #[test]
    fn more_threads_never_have_less_bandwidth() {
        let at = |threads, best| Bandwidth {
            threads,
            bytes: 1,
            best_bytes_per_second: best,
            median_bytes_per_second: best,
            samples: vec![best],
        };
        let measured = [at(1, 30.0), at(2, 26.0), at(4, 50.0)];
        assert_eq!(at_most(&measured, 1), 30.0);
        assert_eq!(at_most(&measured, 2), 30.0);
        assert_eq!(at_most(&measured, 4), 50.0);
        assert!(at_most(&measured[1..], 1).is_nan());
    }
}
