//! Quantized matrix multiplication and attention kernels.
//!
//! [`FastLinear`] holds a weight repacked sixteen rows at a time, and multiplies it with
//! activations quantized the way ggml does (`quantize_row_q8_1` / `quantize_row_q8_0` /
//! Q8_K). Blocks of 32 (`packed32.rs`): Q4_1 (`x = d·q + m`, 4-bit `q`) and Q8_0 (`x =
//! d·q`, 8-bit `q`), per block `d_w·d_a·Σ q_w·q_a (+ m_w·s_a)`. AVX-512 VNNI or AVX2 when
//! the CPU has them, scalar otherwise, all with the same bits. Groups of rows are split
//! across threads: a forward pass's team (`team.rs`), or rayon's outside one.
//!
//! Q4_0, Q5_0 and Q5_1 run on the nibble form: Q4_0 with the offset 8 taken off through
//! the activations' block sums (ggml's exact integers), Q5_0 and Q5_1 with their fifth
//! bits beside the nibbles (Q5_0: offset 16, ggml's exact integers; Q5_1: its minimum,
//! with the activations' block sums in f32 rather than f16).
//!
//! IQ4_NL and IQ4_XS run on the codebook form (`iq4.rs`): their 4-bit
//! indices replaced by the codebook's signed bytes, one block per 32 values.
//!
//! The K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (super-blocks of 256 with integer
//! sub-block scales: what Q4_K_M and Q3_K_M files hold) are repacked sixteen rows at a
//! time (`kquant.rs`; Q2_K and Q3_K in `kquant/lowk.rs`) and take
//! activations quantized per 256 values with an f32 scale and the sum of every 16
//! quants, as ggml's Q8_K. Within a super-block every sum is then an integer, exact in
//! any order, and the float arithmetic is one step per super-block shared by the
//! scalar, AVX2 and AVX-512 kernels, so all give the same bits.
//!
//! Prefill on CPUs with AMX (`amx.rs`, where the process may use the tiles): the blocks
//! of 32, Q4_K, Q5_K and Q6_K take sixteen activation rows at a time through AMX tiles
//! (`packed32/amx.rs`, `kquant/amx.rs`), each group's weights unpacked once per product
//! into signed bytes. The tile sums are the same exact integers, and the float steps the
//! same, so the outputs keep their bits.
//!
//! Prefill with the AVX2 kernels (at least `ROW_TILE`, eight, rows): each group is first
//! unpacked once into bytes in the values' order (`kquant/avx2.rs`,
//! `packed32/avx2.rs`), then every activation row takes its products from them, four
//! rows per pass; the group kernels, which unpack each step again for every four rows
//! and each half of the lanes, keep the products of fewer rows. The sums are the same
//! exact integers and the float steps the same, so the outputs keep their bits.
//!
//! Every output element is computed by one thread in one fixed order, whatever the
//! number of rows in the batch: a sequence's logits do not depend on what it was
//! batched with, and scoring a whole sequence in one pass gives bit-identical
//! log-probabilities to generating it token by token. The [`attention`] kernel keeps
//! the same property for attention.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use half::f16;

use crate::error::{ModelError, Result};
use crate::gguf::{MappedTensor, TensorType};

/// Runs `$body` for each `$r` in `0..$n` (`$n` a constant of at most eight) as
/// straight-line code, each with its constant row, so that every row's accumulators
/// are registers. A `for` loop over the rows is unrolled or not as the compiler's
/// heuristics decide: a small change elsewhere in the kernel (a load in place of a
/// multiply) once left the 64-row Q8_0 product's accumulators on the stack, 1.67 →
/// 1.9 ms.
macro_rules! each_row {
    ($n:expr, |$r:ident| $body:block) => {{
        const { assert!($n <= 8) };
        each_row!(@ $n, $r, $body, 0 1 2 3 4 5 6 7)
    }};
    (@ $n:expr, $r:ident, $body:block, $($i:literal)*) => {{
        $(
            if $i < $n {
                let $r: usize = $i;
                $body
            }
        )*
    }};
}

mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
mod attend;
mod iq4;
mod kquant;
mod memory;
mod packed32;
mod pointwise;
pub(crate) mod team;

pub use attend::{Queries, attention, attention_batch};
pub(crate) use memory::{Arena, Weights as StoredArray, on_off_setting};
pub(crate) use pointwise::{add, rms_norm, silu_mul};
pub use team::stop_spinning;

use kquant::{KPacked, KType, LANES};
use packed32::{Form, Packed32, Scales};

const QK: usize = 32;
/// Values per K-quant super-block.
const QK_K: usize = 256;
/// Activation rows a group kernel takes at once. The AVX-512 kernels of the blocks of
/// 32 and of Q6_K unpack each block once for all of them (their registers hold eight
/// rows' sums); the others take them four at a time.
const ROW_TILE: usize = 8;
/// Activation sums per super-block: one per 16 values.
const K_SUMS: usize = QK_K / 16;

/// `v` cut into `groups` consecutive chunks of equal length (all empty when `v` is): a
/// packed weight's arrays per group of rows, each group's slots being contiguous, so
/// groups can be packed in parallel.
fn per_group<T>(v: &mut [T], groups: usize) -> Vec<&mut [T]> {
    let len = v.len().checked_div(groups).unwrap_or(0);
    if len == 0 {
        return (0..groups).map(|_| Default::default()).collect();
    }
    v.chunks_mut(len).collect()
}

/// Streams of quants a decode reads at once (`Packed32::decode`, `KPacked::decode`,
/// with the AVX-512 and the AVX2 kernels; Q6_K, which reads two arrays, takes two
/// groups at a time). One core of an Intel Xeon (2 cores, 480 MiB L3) read 12.4 GB/s
/// from one sequential stream, 14.1 from two, 15.4 from four and no more from eight or
/// sixteen. With AVX-512, 1B Q4_0 decode at one thread went from 18.5 to 21.5 tok/s
/// with four streams, 21.2 with eight; Q4_K_M from 19.1 to 20.6; Q6_K 15.7 to 16.2 with
/// two. With AVX2 (`AGENTSTACK_KERNELS=avx2`, same VM, one thread, two alternating
/// pairs): Q4_0 16.3–16.9 to 20.1–21.3, IQ4_XS 15.6–17.4 to 18.1–19.0, Q4_K_M
/// 14.2–14.3 to 16.2–16.5, Q6_K 13.0–13.2 to 13.9–14.0, Q2_K 19.6–20.6 to 20.4–21.5.
pub(super) const STREAMS: usize = 4;

/// How far ahead each of a decode's [`STREAMS`] streams prefetches (`PREFETCH` is one
/// stream's): 4 KiB took 1B Q4_0 and IQ4_XS decode from 21.5 to 22.1 tok/s at one
/// thread (2 KiB 21.4, 8 KiB 22.2, 16 KiB 21.5), from 37 to 39 at two.
const STREAM_PREFETCH: usize = 4 << 10;

/// How a decode (one activation row) reads a weight: the CPU's memory system decides
/// which is faster, by far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeRead {
    /// [`STREAMS`] groups at a time, block by block in lockstep, each stream
    /// prefetched [`STREAM_PREFETCH`] ahead in software: an Intel Xeon's core reads
    /// one stream at 12.4 GB/s and four at 15.4 (see [`STREAMS`]).
    Streams,
    /// One group after another, one sequential stream: an AMD EPYC (Zen 4, 2 cores)
    /// whose hardware prefetcher follows one stream at memory speed, and which four
    /// prefetched streams slow down. The K-quants then prefetch nothing in software
    /// (ahead by 1 or 4 KiB was slower), the blocks of 32 keep their one-stream
    /// distance (without it Q8_0 decoded at half speed, 7–8 tok/s against 15–17). One
    /// thread, 1B, alternating runs: Q4_K_M 15–19 → 34–40 tok/s (llama.cpp 31–33),
    /// Q6_K 13 → 24–30, Q2_K 24 → 36, Q3_K_M 18 → 26, Q4_0 21–25 → 24–28, Q8_0
    /// 13–14 → 15–17.
    Sequential,
    /// As [`DecodeRead::Sequential`], the K-quants prefetching [`SEQUENTIAL_PREFETCH`]
    /// ahead in software: an AMD EPYC of family 26 (Zen 5, 2 cores), whose hardware
    /// prefetcher alone left a one-row K-quant product at 21–26 GB/s (`kernel_speed`,
    /// 16384², one thread; 33–44 prefetched 4 or 8 KiB ahead, as the blocks of 32 read).
    /// 1B decode, one thread, alternating runs: Q4_K_M 36–38 → 44 tok/s, Q3_K_M 38 →
    /// 55–57, Q5_K_M 32–37 → 40–41, Q6_K 35–37 → 38–39; two threads: Q4_K_M 44–55 →
    /// 67–70, Q3_K_M 56–59 → 93–94.
    Prefetched,
}

/// How far ahead a K-quant one-row product read [`DecodeRead::Prefetched`] prefetches:
/// on the Zen 5 above 4 KiB and 8 KiB read alike (Q6_K a little faster at 4), 16 KiB
/// slower (Q6_K 23–31 GB/s against 34–36), none slowest.
const SEQUENTIAL_PREFETCH: usize = 4 << 10;

/// The [`DecodeRead`] of this process, chosen once: `AGENTSTACK_DECODE_READ`
/// (`streams`, `sequential` or `prefetched`), else by the CPU (AMD from Zen 5 on:
/// prefetched; older AMD: sequential; the rest: streams, as measured on the CPUs
/// above). An AMD family newer than measured gets Zen 5's.
fn decode_read() -> DecodeRead {
    static READ: std::sync::OnceLock<DecodeRead> = std::sync::OnceLock::new();
    *READ.get_or_init(|| {
        let name = agentstack_static::env_vars::AGENTSTACK_DECODE_READ;
        let value = std::env::var(name).ok();
        let default = match amd_family() {
            Some(family) if family >= ZEN5 => DecodeRead::Prefetched,
            Some(_) => DecodeRead::Sequential,
            None => DecodeRead::Streams,
        };
        match decode_read_setting(value.as_deref()) {
            Some(Some(read)) => read,
            Some(None) => default,
            None => {
                tracing::warn!(
                    value = value.as_deref().unwrap_or_default(),
                    "{name} is none of `streams`, `sequential`, `prefetched`: using {default:?}"
                );
                default
            }
        }
    })
}

/// `AGENTSTACK_DECODE_READ`'s meaning: `Some(None)` when unset or empty (the CPU's
/// default), `None` for a value that is none of the choices.
fn decode_read_setting(value: Option<&str>) -> Option<Option<DecodeRead>> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") => Some(None),
        Some("streams") => Some(Some(DecodeRead::Streams)),
        Some("sequential") => Some(Some(DecodeRead::Sequential)),
        Some("prefetched") => Some(Some(DecodeRead::Prefetched)),
        Some(_) => None,
    }
}

/// AMD's CPU family of Zen 5 (`0x1A`); Zen 3 and Zen 4 are `0x19`.
const ZEN5: u32 = 0x1A;

/// The CPU's family when its vendor is AMD (`cpuid` leaf 0: "AuthenticAMD"; leaf 1:
/// the base family plus, when that is `0xF`, the extended one), else `None`.
fn amd_family() -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    {
        let id = std::arch::x86_64::__cpuid(0);
        let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes);
        (vendor.concat() == *b"AuthenticAMD").then(|| {
            let eax = std::arch::x86_64::__cpuid(1).eax;
            let base = (eax >> 8) & 0xF;
            if base == 0xF {
                base + ((eax >> 20) & 0xFF)
            } else {
                base
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// How far ahead, in bytes, a K-quant kernel reading `streams` streams of quants for
/// `rows` activation rows prefetches them: [`STREAM_PREFETCH`] with several streams,
/// `one` (the packing's distance for one stream) with one, and for a one-row decode
/// read [`DecodeRead::Sequential`] 0 (no software prefetch), read
/// [`DecodeRead::Prefetched`] [`SEQUENTIAL_PREFETCH`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(streams: usize, rows: usize, one: usize) -> usize {
    if streams > 1 {
        STREAM_PREFETCH
    } else if rows == 1 {
        match decode_read() {
            DecodeRead::Sequential => 0,
            DecodeRead::Prefetched => SEQUENTIAL_PREFETCH,
            DecodeRead::Streams => one,
        }
    } else {
        one
    }
}

/// Prefetches into L1 the line `ahead` bytes after `at`, unless `ahead` is 0.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_line(at: *const u8, ahead: usize) {
    if ahead != 0 {
        #[expect(unsafe_code, reason = "a prefetch")]
        // SAFETY: a prefetch reads nothing and does not fault, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                at.wrapping_add(ahead).cast(),
            );
        }
    }
}

/// Calls `each` with the groups of `groups` `S` at a time, one from each of `S` equal
/// runs of the range (the `i`-th of every run together), and returns the groups left
/// over at its end; a range of fewer than `S` groups is all left over.
fn in_streams<const S: usize>(
    groups: std::ops::Range<usize>,
    mut each: impl FnMut([usize; S]),
) -> std::ops::Range<usize> {
    let run = groups.len() / S;
    for i in 0..run {
        each(std::array::from_fn(|s| groups.start + s * run + i));
    }
    groups.start + S * run..groups.end
}

/// Prefetches into L1 the part of each of `arrays` (its start in this block, its bytes
/// per block) that lies `ahead` blocks further on: the arrays of a packed weight other
/// than its quants, which a decode kernel prefetches step by step (`kquant`'s and
/// `packed32`'s `Block::prefetch_side`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_blocks_ahead(arrays: [(*const u8, usize); 4], ahead: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    if ahead == 0 {
        return;
    }
    for (at, per_block) in arrays {
        let next = at.wrapping_add(ahead * per_block);
        for line in (0..per_block).step_by(64) {
            #[expect(unsafe_code, reason = "a prefetch")]
            // SAFETY: a prefetch reads nothing and does not fault, whatever the address.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line).cast());
            }
        }
    }
}

/// A packing's decode of `groups` into `out` (16 per group): `streamed` computes what
/// it can with a streams kernel and returns the groups left over (all of them where it
/// cannot), `group` computes one group's sixteen outputs.
fn decode_with(
    groups: std::ops::Range<usize>,
    out: &mut [f32],
    streamed: impl FnOnce(&mut [f32]) -> std::ops::Range<usize>,
    mut group: impl FnMut(usize, &mut [f32]),
) {
    let start = groups.start;
    assert!(out.len() >= groups.len() * LANES);
    let rest = streamed(out);
    for g in rest {
        let at = (g - start) * LANES;
        group(g, &mut out[at..at + LANES]);
    }
}

/// The widest kernel family this CPU runs, detected once. `AGENTSTACK_KERNELS=avx2` or
/// `=scalar` caps it (to compare kernel families on one machine); AMX (`amx.rs`) comes
/// on top of AVX-512 VNNI for prefill, GFNI ([`gfni`]) for Q3_K, and `=avx512` turns
/// both off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(
    not(target_arch = "x86_64"),
    expect(dead_code, reason = "x86 kernel families")
)]
enum Simd {
    Scalar,
    Avx2,
    Avx512Vnni,
}

#[cfg_attr(
    not(target_arch = "x86_64"),
    expect(dead_code, reason = "x86 kernel families")
)]
fn simd() -> Simd {
    static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match std::env::var(agentstack_static::env_vars::AGENTSTACK_KERNELS).as_deref() {
            Ok("scalar") => Simd::Scalar,
            Ok("avx2") => Simd::Avx2,
            _ => Simd::Avx512Vnni,
        };
        detected_simd().min(cap)
    })
}

/// Whether `AGENTSTACK_KERNELS` caps the kernels (`avx512`, `avx2` or `scalar`): the
/// extensions beyond AVX-512 VNNI (AMX, GFNI) are then off.
#[cfg(target_arch = "x86_64")]
fn capped() -> bool {
    matches!(
        std::env::var(agentstack_static::env_vars::AGENTSTACK_KERNELS).as_deref(),
        Ok("avx512" | "avx2" | "scalar")
    )
}

/// Whether the AVX-512 kernels use GFNI (Q3_K's bits, `kquant/lowk`): the AVX-512
/// kernels are in use, uncapped, and the CPU has GFNI (Ice Lake and later, Zen 4;
/// Cascade Lake has VNNI without it). Detected once.
#[cfg(target_arch = "x86_64")]
fn gfni() -> bool {
    static GFNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GFNI.get_or_init(|| {
        simd() == Simd::Avx512Vnni && !capped() && std::arch::is_x86_feature_detected!("gfni")
    })
}

fn detected_simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        // F16C: Q8_0's f16 scales (every AVX2 CPU has it).
        if has!("avx2") && has!("fma") && has!("f16c") {
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                return Simd::Avx512Vnni;
            }
            return Simd::Avx2;
        }
    }
    Simd::Scalar
}

/// The weight types with a kernel here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// 4-bit with a scale per block of 32 (`x = d·(q − 8)`); runs on the Q4_1 kernel
    /// without minimum, the offset taken off with the activations' block sums.
    Q4_0,
    /// 4-bit with scale and minimum per block of 32; activations as Q8_1.
    Q4_1,
    /// 5-bit with a scale per block of 32 (`x = d·(q − 16)`); nibbles plus fifth bits,
    /// the offset taken off with the activations' block sums (ggml's Q5_0 × Q8_0
    /// integers).
    Q5_0,
    /// 5-bit with scale and minimum per block of 32 (`x = d·q + m`); nibbles plus fifth
    /// bits, activations as Q8_1 with exact sums.
    Q5_1,
    /// 8-bit with a scale per block of 32; activations as Q8_0.
    Q8_0,
    /// Q2_K: super-blocks of 256 (`d`, `dmin`), 16 sub-blocks of 16 with 4-bit scales
    /// and minimums, 2-bit quants; activations as Q8_K.
    Q2K,
    /// Q3_K: super-blocks of 256 (`d`), 16 sub-blocks of 16 with 6-bit scales (minus
    /// 32), 2-bit quants plus a high bit (`q − 4` where it is clear); activations as Q8_K.
    Q3K,
    /// Q4_K: super-blocks of 256 (`d`, `dmin`), 8 sub-blocks of 32 with 6-bit scales
    /// and minimums, 4-bit quants; activations as Q8_K.
    Q4K,
    /// Q5_K: Q4_K with a fifth bit per quant; activations as Q8_K.
    Q5K,
    /// Q6_K: super-blocks of 256 (`d`), 16 sub-blocks of 16 with 8-bit scales, 6-bit
    /// quants; activations as Q8_K.
    Q6K,
    /// IQ4_NL: 4-bit codebook indices with a scale per block of 32; the codebook form
    /// (ggml's IQ4_NL × Q8_0 integers).
    Iq4Nl,
    /// IQ4_XS: super-blocks of 256 with 6-bit sub-block scales over IQ4_NL's indices;
    /// the codebook form, one block per sub-block of 32, held as the file's f16 `d`
    /// and a byte `ls − 32` per block (ggml's IQ4_XS × Q8_K integers over each
    /// super-block).
    Iq4Xs,
}

/// How activations are quantized for a kind: weights whose kinds share it share one
/// quantized copy of the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActFormat {
    /// Blocks of 32, f16-rounded scale and sum (ggml's Q8_1).
    Q8_1,
    /// Blocks of 32, f16-rounded scale, the sum `d·Σq` in f32 (Q5_1: its minimum term
    /// then carries no f16 rounding of the activations' sums, unlike ggml's).
    Q8_1Exact,
    /// Blocks of 32, f16-rounded scale.
    Q8_0,
    /// Blocks of 256, f32 scale, sums of 16.
    Q8K,
    /// Q8_K's quants and scales held per block of 32 (the scale repeated, the block's
    /// sum), for IQ4_XS on the Q8_0 kernel: ggml's IQ4_XS × Q8_K integers (`iq4.rs`).
    Q8KIn32,
}

impl QuantKind {
    const ALL: [Self; 12] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Iq4Nl,
        Self::Iq4Xs,
    ];

    /// ggml's name of the type (`Q4_K`, `IQ4_XS`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Iq4Nl => "IQ4_NL",
            Self::Iq4Xs => "IQ4_XS",
        }
    }

    /// The kind [`Self::name`] names.
    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The file type of the kinds candle reads (all but IQ4_NL and IQ4_XS).
    fn ggml_dtype(self) -> Option<GgmlDType> {
        Self::ALL_GGML
            .into_iter()
            .find(|&(_, k)| k == self)
            .map(|(dtype, _)| dtype)
    }

    /// The K-quant layout of the K-quant kinds.
    fn ktype(self) -> Option<KType> {
        match self {
            Self::Q2K => Some(KType::Q2K),
            Self::Q3K => Some(KType::Q3K),
            Self::Q4K => Some(KType::Q4K),
            Self::Q5K => Some(KType::Q5K),
            Self::Q6K => Some(KType::Q6K),
            _ => None,
        }
    }

    /// The GGML types with a kernel, and theirs.
    const ALL_GGML: [(GgmlDType, Self); 10] = [
        (GgmlDType::Q4_0, Self::Q4_0),
        (GgmlDType::Q4_1, Self::Q4_1),
        (GgmlDType::Q5_0, Self::Q5_0),
        (GgmlDType::Q5_1, Self::Q5_1),
        (GgmlDType::Q8_0, Self::Q8_0),
        (GgmlDType::Q2K, Self::Q2K),
        (GgmlDType::Q3K, Self::Q3K),
        (GgmlDType::Q4K, Self::Q4K),
        (GgmlDType::Q5K, Self::Q5K),
        (GgmlDType::Q6K, Self::Q6K),
    ];

    /// The kernel for a GGML type, if there is one.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        Self::ALL_GGML
            .into_iter()
            .find(|&(d, _)| d == dtype)
            .map(|(_, k)| k)
    }

    /// Values per block as held (super-block for the K-quants; IQ4_XS is held in
    /// blocks of 32).
    fn block_len(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => QK,
            Self::Iq4Nl | Self::Iq4Xs => QK,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    fn act_format(self) -> ActFormat {
        match self {
            Self::Q4_1 => ActFormat::Q8_1,
            Self::Q5_1 => ActFormat::Q8_1Exact,
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 | Self::Iq4Nl => ActFormat::Q8_0,
            Self::Iq4Xs => ActFormat::Q8KIn32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K => ActFormat::Q8K,
        }
    }
}

/// A quantized weight `[out, in]` laid out for SIMD.
#[derive(Debug)]
pub struct FastLinear {
    kind: QuantKind,
    out_features: usize,
    in_features: usize,
    /// The weight repacked in groups of 16 rows.
    packed: Packing,
}

/// How a [`FastLinear`] holds its weight.
#[derive(Debug)]
enum Packing {
    /// The K-quants (`kquant.rs`).
    K(KPacked),
    /// Blocks of 32 (`packed32.rs`).
    B32(Packed32),
}

impl Packing {
    fn groups(&self) -> usize {
        match self {
            Self::K(p) => p.groups,
            Self::B32(p) => p.groups,
        }
    }

    fn group(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        match self {
            Self::K(p) => p.group(g, rows, out),
            Self::B32(p) => p.group(g, rows, out),
        }
    }

    /// Group `g`'s outputs for every row of `rows` into `out` (`[row][lane]`): the
    /// bits of [`Self::group`] on each tile of [`ROW_TILE`] rows, in the order that
    /// reads best (see [`packed32::Packed32::group_rows`]).
    fn group_rows(&self, g: usize, rows: &[ActRow], out: &mut [f32]) {
        match self {
            Self::K(p) => {
                for (tile, out) in rows.chunks(ROW_TILE).zip(out.chunks_mut(ROW_TILE * LANES)) {
                    p.group(g, tile, out);
                }
            }
            Self::B32(p) => p.group_rows(g, rows, out),
        }
    }

    /// Whether the AVX2 kernels run a product of `n` rows from each group unpacked once
    /// ([`Self::avx2_unpacked`]), for every packing alike: AVX2 is the kernel family in
    /// use (AVX-512 unpacks in registers, AMX in its own form) and there are at least
    /// [`ROW_TILE`] rows. The group kernels unpack each step again for every four rows
    /// and each half of the lanes; this unpacks a group once for all the rows.
    #[cfg(target_arch = "x86_64")]
    fn avx2_unpacks(n: usize) -> bool {
        simd() == Simd::Avx2 && n >= ROW_TILE
    }

    /// Group `g`'s outputs for every row of `rows` into `out` (`[row][lane]`), with
    /// AVX2 from the group unpacked into `w` (reused from group to group): the bits of
    /// [`Self::group`].
    #[cfg(target_arch = "x86_64")]
    fn avx2_unpacked(&self, g: usize, w: &mut Vec<u8>, rows: &[ActRow], out: &mut [f32]) {
        match self {
            Self::K(p) => {
                p.avx2_unpack(g, w);
                p.avx2_unpacked(g, w, rows, out);
            }
            Self::B32(p) => {
                p.avx2_unpack(g, w);
                p.avx2_unpacked(g, w, rows, out);
            }
        }
    }

    /// Groups `groups` for one activation row (decode): [`Self::group`]'s bits.
    fn decode(&self, groups: std::ops::Range<usize>, row: &ActRow, out: &mut [f32]) {
        self.decode_as(groups, row, out, decode_read());
    }

    /// [`Self::decode`] read as `read` says: the same bits either way.
    fn decode_as(
        &self,
        groups: std::ops::Range<usize>,
        row: &ActRow,
        out: &mut [f32],
        read: DecodeRead,
    ) {
        match self {
            Self::K(p) => p.decode(groups, row, out, read),
            Self::B32(p) => p.decode(groups, row, out, read),
        }
    }

    fn dequantize_block(&self, o: usize, b: usize, out: &mut Vec<f32>) {
        match self {
            Self::K(p) => p.dequantize_block(o, b, out),
            Self::B32(p) => p.dequantize_block(o, b, out),
        }
    }

    /// The values per activation row of an AMX product, if AMX takes this weight (the
    /// blocks of 32, Q4_K, Q5_K, Q6_K).
    #[cfg(target_arch = "x86_64")]
    fn amx_row_len(&self) -> Option<usize> {
        match self {
            Self::B32(p) => Some(p.nb * QK),
            Self::K(p) => p.has_amx().then_some(p.nb * QK_K),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn amx_unpack(&self, g: usize, w: &mut Vec<i8>) {
        match self {
            Self::K(p) => p.amx_unpack(g, w),
            Self::B32(p) => p.amx_unpack(g, w),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn amx_tile(
        &self,
        g: usize,
        wa: (&[i8], &[i8]),
        rows: &[ActRow],
        out: &mut [f32],
        ahead: bool,
    ) {
        match self {
            Self::K(p) => p.amx_tile(g, wa, rows, out, ahead),
            Self::B32(p) => p.amx_tile(g, wa, rows, out, ahead),
        }
    }
}

/// A weight's five arrays' bytes, each with its offset in an arena's file if it was
/// packed there ([`FastLinear::stored`]).
pub(crate) type StoredArrays<'a> = [(&'a [u8], Option<u64>); 5];

/// What the repack cache keeps of a [`FastLinear`] besides its arrays' bytes: enough
/// to rebuild it from them, and to check that each array holds what the kernels index.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StoredForm {
    /// [`QuantKind::name`].
    pub(crate) kind: String,
    pub(crate) out_features: usize,
    pub(crate) in_features: usize,
    /// Blocks of 32: whether the scales are held as f16 (the K-quants: false).
    pub(crate) half_scales: bool,
}

/// A digest of how this build repacks weights: the crate's version and the packed
/// arrays of a small weight of every kind, from fixed bytes. The repack cache keys its
/// files by it, so a build whose packing differs in any way never reads another's
/// arrays. Computed once (a few hundred microseconds).
pub(crate) fn layout_fingerprint() -> &'static str {
    use sha2::{Digest, Sha256};
    static DIGEST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DIGEST.get_or_init(|| {
        let mut h = Sha256::new();
        h.update(env!("CARGO_PKG_VERSION"));
        // A partial group of rows, two super-blocks per row.
        let (out, inp) = (LANES + 3, 2 * QK_K);
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        for kind in QuantKind::ALL {
            let (bytes, weight) = match kind.ggml_dtype() {
                Some(dtype) => {
                    let n = out * inp / dtype.block_size() * dtype.type_size();
                    let data = fingerprint_bytes(&mut x, n);
                    (n, FastLinear::from_ggml_bytes(dtype, (out, inp), &data))
                }
                None => {
                    let ty = if kind == QuantKind::Iq4Nl {
                        crate::gguf::RawType::Iq4Nl
                    } else {
                        crate::gguf::RawType::Iq4Xs
                    };
                    let n = out * inp / ty.block_size() * ty.type_size();
                    let data = fingerprint_bytes(&mut x, n);
                    (n, FastLinear::from_raw_bytes(ty, &[out, inp], &data))
                }
            };
            h.update(kind.name());
            h.update((bytes as u64).to_le_bytes());
            match weight {
                Ok(w) => {
                    let (form, arrays) = w.stored(0);
                    h.update(serde_json::to_vec(&form).unwrap_or_default());
                    for (a, _) in arrays {
                        h.update((a.len() as u64).to_le_bytes());
                        h.update(a);
                    }
                }
                Err(e) => h.update(e.to_string()),
            }
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// `n` bytes of a fixed xorshift sequence.
fn fingerprint_bytes(x: &mut u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            (*x >> 24) as u8
        })
        .collect()
}

/// The first `R` activation rows' arrays as pointers, taken once per kernel call. The
/// kernels read them block by block; indexing the rows' vectors there instead (a
/// pointer load and a bounds check per row and block) made the AVX2 64-row
/// blocks-of-32 product about 15% slower. Reading through them is the caller's promise
/// that the rows hold what is read (the kernels' callers check the rows' lengths).
#[derive(Clone, Copy)]
struct Sides<const R: usize> {
    qs: [*const i8; R],
    d: [*const f32; R],
    s: [*const f32; R],
    offset_sums: [*const i32; R],
    sums: [*const i16; R],
}

#[expect(unsafe_code, reason = "reads the SIMD kernels guarantee in bounds")]
impl<const R: usize> Sides<R> {
    /// The first `R` of `rows`.
    fn of(rows: &[ActRow]) -> Self {
        assert!(rows.len() >= R, "{R} rows");
        Self {
            qs: std::array::from_fn(|r| rows[r].qs.as_ptr()),
            d: std::array::from_fn(|r| rows[r].d.as_ptr()),
            s: std::array::from_fn(|r| rows[r].s.as_ptr()),
            offset_sums: std::array::from_fn(|r| rows[r].offset_sums.as_ptr()),
            sums: std::array::from_fn(|r| rows[r].sums.as_ptr()),
        }
    }

    /// Row `r`'s sums per 16 values (Q8_K) from sum `at`.
    ///
    /// # Safety
    /// Row `r` must hold sum `at`.
    #[inline(always)]
    unsafe fn sums(&self, r: usize, at: usize) -> *const i16 {
        // SAFETY: as the caller guarantees.
        unsafe { self.sums[r].add(at) }
    }

    /// Each row's quants from value `at`.
    ///
    /// # Safety
    /// Every row must hold value `at`.
    #[inline(always)]
    unsafe fn qs(&self, at: usize) -> [*const i8; R] {
        // SAFETY: as the caller guarantees.
        self.qs.map(|q| unsafe { q.add(at) })
    }

    /// Row `r`'s scale of block `b`.
    ///
    /// # Safety
    /// Row `r` must hold block `b`'s scale.
    #[inline(always)]
    unsafe fn d(&self, r: usize, b: usize) -> f32 {
        // SAFETY: as the caller guarantees.
        unsafe { *self.d[r].add(b) }
    }

    /// Row `r`'s `d·Σq` of block `b`.
    ///
    /// # Safety
    /// Row `r` must hold block `b`'s sum.
    #[inline(always)]
    unsafe fn s(&self, r: usize, b: usize) -> f32 {
        // SAFETY: as the caller guarantees.
        unsafe { *self.s[r].add(b) }
    }

    /// Row `r`'s `−128·Σq` of block `b` (blocks of 32; [`ActRow::offset_sums`]).
    ///
    /// # Safety
    /// Row `r` must hold block `b`'s integer sum.
    #[inline(always)]
    unsafe fn offset_sum(&self, r: usize, b: usize) -> i32 {
        // SAFETY: as the caller guarantees.
        unsafe { *self.offset_sums[r].add(b) }
    }

    /// Row `r`'s `Σq` of block `b` (blocks of 32), from its `−128·Σq`.
    ///
    /// # Safety
    /// Row `r` must hold block `b`'s integer sum.
    #[inline(always)]
    unsafe fn isum(&self, r: usize, b: usize) -> i32 {
        // SAFETY: as the caller guarantees.
        let held = unsafe { self.offset_sum(r, b) };
        // A multiple of 128 (−OFFSET_SUM): the shift divides it exactly.
        -(held >> 7)
    }
}

/// What [`ActRow::offset_sums`] holds per block times `Σq`: minus the 128 the
/// blocks-of-32 kernels add to bytes and codebook values to hold them unsigned.
const OFFSET_SUM: i32 = -128;

/// Activations of one row quantized to 8 bits per value (Q8_1, Q8_0 or Q8_K).
#[derive(Default)]
struct ActRow {
    qs: Vec<i8>,
    /// Scale per block (super-block for Q8_K).
    d: Vec<f32>,
    /// `d · Σq` per block (Q8_1 only).
    s: Vec<f32>,
    /// `Σq` per 16 values (Q8_K only).
    sums: Vec<i16>,
    /// `−128·Σq` per block (blocks of 32 only; [`OFFSET_SUM`]): where a block's integer
    /// sum starts for weights held plus 128 (bytes, codebook), read as it is, so an
    /// AVX-512 kernel broadcasts it from memory (computing it there per row and block,
    /// a multiply and a move to a vector register, made the 64-row IQ4_XS product ~8%
    /// slower); the nibbles' offsets 8 and 16 are it shifted right.
    offset_sums: Vec<i32>,
}

impl FastLinear {
    /// Takes a tensor `[out, in]` of a type with a [`QuantKind`].
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        Self::from_ggml_bytes(q.dtype(), q.shape().dims2()?, &q.data()?)
    }

    /// Takes a weight mapped from its file, of a type with a kernel here.
    pub fn from_mapped(t: &MappedTensor) -> Result<Self> {
        match t.ty() {
            TensorType::Raw(ty) => Self::from_raw_bytes(ty, t.dims(), t.bytes()),
            TensorType::Ggml(dtype) => {
                let &[out_features, in_features] = t.dims() else {
                    return Err(ModelError::BadTensor {
                        name: format!("{dtype:?} weight"),
                        reason: format!("shape {:?}, expected [out, in]", t.dims()),
                    });
                };
                Self::from_ggml_bytes(dtype, (out_features, in_features), t.bytes())
            }
        }
    }

    /// Takes the blocks `data` of a `[out, in]` tensor of candle's type `dtype`, as the
    /// file stores them.
    fn from_ggml_bytes(
        dtype: GgmlDType,
        (out_features, in_features): (usize, usize),
        data: &[u8],
    ) -> Result<Self> {
        let bad = |reason: String| ModelError::BadTensor {
            name: format!("{dtype:?} weight"),
            reason,
        };
        let kind = QuantKind::of(dtype).ok_or_else(|| bad("no kernel for this type".into()))?;
        let block_len = kind.block_len();
        if in_features % block_len != 0 {
            return Err(bad(format!(
                "row length {in_features} is not a multiple of {block_len}"
            )));
        }
        let blocks = out_features * in_features / block_len;
        let block_bytes = dtype.type_size();
        if data.len() != blocks * block_bytes {
            return Err(bad(format!("{} bytes for {blocks} blocks", data.len())));
        }
        if let Some(ty) = kind.ktype() {
            let nb = in_features / QK_K;
            return Ok(Self {
                kind,
                out_features,
                in_features,
                packed: Packing::K(KPacked::pack(ty, data, out_features, nb)),
            });
        }
        let half_at =
            |block: &[u8], i: usize| f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
        // Each file block straight into the kernel's form: its quants as the kernel of
        // `kind` reads them (see `from_blocks`), its scale and minimum.
        let read = |i: usize, src: &mut [u8]| {
            let block = &data[i * block_bytes..(i + 1) * block_bytes];
            match kind {
                QuantKind::Q4_1 => {
                    src.copy_from_slice(&block[4..20]);
                    (half_at(block, 0), half_at(block, 2))
                }
                QuantKind::Q8_0 => {
                    src.copy_from_slice(&block[2..34]);
                    (half_at(block, 0), 0.0)
                }
                QuantKind::Q4_0 => {
                    src.copy_from_slice(&block[2..18]);
                    (half_at(block, 0), 0.0)
                }
                // d, (Q5_1: m), 4 bytes of fifth bits, 16 of nibbles: value j takes the
                // low nibble of byte j and bit j, value j + 16 the high nibble and bit
                // j + 16. The kernel's order: nibbles, then the fifth bits.
                QuantKind::Q5_0 | QuantKind::Q5_1 => {
                    let five_1 = kind == QuantKind::Q5_1;
                    let at = if five_1 { 4 } else { 2 };
                    src[..16].copy_from_slice(&block[at + 4..at + 20]);
                    src[16..20].copy_from_slice(&block[at..at + 4]);
                    let min = if five_1 { half_at(block, 2) } else { 0.0 };
                    (half_at(block, 0), min)
                }
                QuantKind::Q2K
                | QuantKind::Q3K
                | QuantKind::Q4K
                | QuantKind::Q5K
                | QuantKind::Q6K => unreachable!("packed above"),
                QuantKind::Iq4Nl | QuantKind::Iq4Xs => unreachable!("no candle type"),
            }
        };
        let has_min = matches!(kind, QuantKind::Q4_1 | QuantKind::Q5_1);
        let nb = in_features / QK;
        Ok(Self {
            kind,
            out_features,
            in_features,
            packed: Packing::B32(Packed32::pack_with(
                Form::of(kind),
                // Every blocks-of-32 type's scale is an f16 in the file.
                (has_min, Scales::F16),
                (out_features, nb),
                read,
            )),
        })
    }

    /// A weight in blocks of 32 from per-row arrays, row after row: `quants` as the
    /// kernel of `kind` reads them (Q4_1 kernel: 16 bytes of nibbles per block, value `j`
    /// low and `j + 16` high; Q8_0 kernel: 32 signed bytes), `scales` per block, `mins`
    /// per block or empty. Conversions from other types end here.
    fn from_blocks(
        kind: QuantKind,
        (out_features, in_features): (usize, usize),
        quants: &[u8],
        scales: &[f32],
        mins: &[f32],
    ) -> Self {
        let nb = in_features / QK;
        Self {
            kind,
            out_features,
            in_features,
            packed: Packing::B32(Packed32::pack(
                Form::of(kind),
                quants,
                scales,
                mins,
                out_features,
                nb,
            )),
        }
    }

    /// Its form and its five arrays' bytes, for the repack cache, each with its offset
    /// in the file of arena `arena` if it was packed there (0: none).
    pub(crate) fn stored(&self, arena: u64) -> (StoredForm, StoredArrays<'_>) {
        let (half_scales, arrays) = match &self.packed {
            Packing::K(p) => (false, p.arrays(arena)),
            Packing::B32(p) => (p.half_scales(), p.arrays(arena)),
        };
        let form = StoredForm {
            kind: self.kind.name().to_owned(),
            out_features: self.out_features,
            in_features: self.in_features,
            half_scales,
        };
        (form, arrays)
    }

    /// The weight [`Self::stored`] described, from its arrays; None unless the form is
    /// one this build packs and every array holds exactly what the kernels index.
    pub(crate) fn from_stored(form: &StoredForm, arrays: [memory::Weights; 5]) -> Option<Self> {
        let kind = QuantKind::named(&form.kind)?;
        let (out, inp) = (form.out_features, form.in_features);
        let block_len = kind.block_len();
        // Bounded so that no array length overflows (a weight of 2^40 values is 1 TB).
        if inp == 0 || !inp.is_multiple_of(block_len) || out.checked_mul(inp)? > 1 << 40 {
            return None;
        }
        let packed = match kind.ktype() {
            Some(ty) => Packing::K(KPacked::from_arrays(ty, out, inp / QK_K, arrays)?),
            None => {
                let has_min = matches!(kind, QuantKind::Q4_1 | QuantKind::Q5_1);
                let scales = if kind == QuantKind::Iq4Xs {
                    Scales::Sub
                } else if form.half_scales {
                    Scales::F16
                } else {
                    Scales::F32
                };
                Packing::B32(Packed32::from_arrays(
                    Form::of(kind),
                    (has_min, scales),
                    (out, inp / QK),
                    arrays,
                )?)
            }
        };
        Some(Self {
            kind,
            out_features: out,
            in_features: inp,
            packed,
        })
    }

    /// The weight type.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// `[out, in]`.
    pub fn shape(&self) -> (usize, usize) {
        (self.out_features, self.in_features)
    }

    /// Rows `ids` of the weight as f32 (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Vec<f32> {
        let nb = self.in_features / self.kind.block_len();
        let mut out = Vec::with_capacity(ids.len() * self.in_features);
        for &id in ids {
            self.dequantize_row(id as usize, nb, &mut out);
        }
        out
    }

    /// Appends row `o` (of `nb` blocks) as f32, with the arithmetic of ggml's
    /// dequantization.
    fn dequantize_row(&self, o: usize, nb: usize, out: &mut Vec<f32>) {
        (0..nb).for_each(|b| self.packed.dequantize_block(o, b, out));
    }

    /// The weight as f32 `[out, in]`.
    pub fn dequantize(&self) -> Result<Tensor> {
        let nb = self.in_features / self.kind.block_len();
        let mut values = Vec::with_capacity(self.out_features * self.in_features);
        for o in 0..self.out_features {
            self.dequantize_row(o, nb, &mut values);
        }
        Ok(Tensor::from_vec(
            values,
            (self.out_features, self.in_features),
            &candle_core::Device::Cpu,
        )?)
    }

    /// `x Wᵀ` for `x` `[.., in]` (f32).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.apply_op1_no_bwd(&Op(self))?)
    }

    /// `x Wᵢᵀ` for several weights of the same type and width (q, k and v; gate and up):
    /// the activations are quantized once.
    pub fn forward_many(weights: &[&Self], x: &Tensor) -> Result<Vec<Tensor>> {
        let Some(first) = weights.first() else {
            return Ok(Vec::new());
        };
        if weights.iter().any(|w| {
            w.kind.act_format() != first.kind.act_format() || w.in_features != first.in_features
        }) {
            return weights.iter().map(|w| w.forward(x)).collect();
        }
        let dims = x.dims().to_vec();
        // The activations read in place (copied only when not contiguous f32s).
        let rows = crate::model::with_f32(x, |values| first.quantize(values))?;
        let n = rows.len();
        let outputs = if n == 1 && team::threads() > 1 {
            Self::decode_many(weights, &rows)
        } else {
            weights.iter().map(|w| w.matmul_rows(&rows, n)).collect()
        };
        weights
            .iter()
            .zip(outputs)
            .map(|(w, y)| {
                let mut out_dims = dims.clone();
                *out_dims.last_mut().expect("at least one dim") = w.out_features;
                Ok(Tensor::from_vec(y, out_dims, x.device())?)
            })
            .collect()
    }

    /// One activation row through several weights in one parallel region (a decode
    /// step's q, k and v, or gate and up): each weight's groups in the tasks
    /// [`Self::matmul_packed`] would give it, so each output is the same bits, with one
    /// wait for the team instead of one per weight.
    fn decode_many(weights: &[&Self], row: &[ActRow]) -> Vec<Vec<f32>> {
        debug_assert_eq!(row.len(), 1);
        let threads = team::threads();
        // Per weight: groups per task and the index of its first task.
        let mut plan = Vec::with_capacity(weights.len());
        let mut tasks = 0;
        for w in weights {
            let per_task = w.groups_per_task(1, threads);
            plan.push((per_task, tasks));
            tasks += w.packed.groups().div_ceil(per_task);
        }
        // One output per task: the tasks' groups differ in number, so a shared buffer
        // would not split into equal chunks.
        let mut outs = team::collect_chunks(tasks, 1, |task, slot: &mut [Vec<f32>]| {
            let w = plan.partition_point(|&(_, first)| first <= task) - 1;
            let (per_task, first) = plan[w];
            let p = &weights[w].packed;
            let from = (task - first) * per_task;
            let to = p.groups().min(from + per_task);
            let mut y = vec![0f32; (to - from) * LANES];
            p.decode(from..to, &row[0], &mut y);
            slot[0] = y;
        })
        .into_iter();
        weights
            .iter()
            .zip(&plan)
            .map(|(w, &(per_task, _))| {
                let mut y = Vec::with_capacity(w.packed.groups() * LANES);
                for _ in 0..w.packed.groups().div_ceil(per_task) {
                    y.extend(outs.next().unwrap_or_default());
                }
                y.truncate(w.out_features);
                y
            })
            .collect()
    }

    fn quantize(&self, x: &[f32]) -> Vec<ActRow> {
        let format = self.kind.act_format();
        let one = |r: &[f32]| match format {
            ActFormat::Q8_1 => quantize_row(r, Sums::F16),
            ActFormat::Q8_1Exact => quantize_row(r, Sums::Exact),
            ActFormat::Q8_0 => quantize_row(r, Sums::None),
            ActFormat::Q8K => quantize_row_k(r),
            ActFormat::Q8KIn32 => iq4::quantize_row_k_in_32(r),
        };
        let n = x.len() / self.in_features;
        let threads = team::threads();
        if n < 2 * threads || threads <= 1 {
            return x.chunks_exact(self.in_features).map(one).collect();
        }
        // A prefill's rows, split across the team (each row's bytes do not depend on
        // which thread quantized it).
        let mut rows: Vec<ActRow> = std::iter::repeat_with(ActRow::default).take(n).collect();
        let per_task = n.div_ceil(threads);
        team::for_each_chunk_mut(&mut rows, per_task, |t, chunk| {
            for (i, row) in chunk.iter_mut().enumerate() {
                let at = (t * per_task + i) * self.in_features;
                *row = one(&x[at..at + self.in_features]);
            }
        });
        rows
    }

    fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let rows = self.quantize(x);
        self.matmul_rows(&rows, n)
    }

    fn matmul_rows(&self, rows: &[ActRow], n: usize) -> Vec<f32> {
        self.matmul_packed(&self.packed, rows, n)
    }

    /// Groups of 16 output rows per task of a product with `n` activation rows on
    /// `threads` threads: one task per thread for one row (decode, as ggml splits a
    /// matrix-vector product), a few per thread for more (prefill), or all groups in one
    /// task with one thread or a small product.
    ///
    /// Decode reads each task's part of the weight as [`STREAMS`] streams, each begun
    /// afresh (its first [`STREAM_PREFETCH`] bytes not prefetched), and more, shorter
    /// tasks cost more than they balance. Two threads, this VM, alternating runs, against
    /// four tasks per thread: SmolLM2-135M Q4_1 223–237 → 262–284 tok/s; 1B Q2_K 52–53 →
    /// 54–56, Q3_K_M 42–43 → 44, Q6_K 31–32 → 32–33; Q4_0, Q4_K_M, Q8_0 and IQ4_XS 0–3%
    /// (two tasks per thread fell between; eight or sixteen were slower still).
    fn groups_per_task(&self, n: usize, threads: usize) -> usize {
        let groups = self.packed.groups();
        if threads <= 1 || n * self.out_features * self.in_features < 1 << 16 {
            groups
        } else if n == 1 {
            groups.div_ceil(threads)
        } else {
            groups.div_ceil(threads * 4)
        }
    }

    /// [`Self::matmul_rows`] for a weight packed in groups of 16 rows: each group's
    /// outputs for up to [`ROW_TILE`] activation rows at once, groups split across threads.
    fn matmul_packed(&self, p: &Packing, rows: &[ActRow], n: usize) -> Vec<f32> {
        let out = self.out_features;
        let groups = p.groups();
        let threads = team::threads();
        let per_task = self.groups_per_task(n, threads);
        // Every group's outputs as [group][row][lane], in one buffer the tasks write
        // in place: with one activation row (decode) it is the result itself.
        let stride = n * LANES;
        #[cfg(target_arch = "x86_64")]
        let amx = amx_operands(p, rows);
        let task = |t: usize, dst: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            if let Some(a) = &amx {
                amx_groups(p, a, rows, t * per_task, dst);
                return;
            }
            if let [row] = rows {
                let from = t * per_task;
                p.decode(from..from + dst.len() / LANES, row, dst);
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if Packing::avx2_unpacks(rows.len()) {
                let mut w = Vec::new();
                for (g, dst) in (t * per_task..).zip(dst.chunks_exact_mut(stride)) {
                    p.avx2_unpacked(g, &mut w, rows, dst);
                }
                return;
            }
            for (g, dst) in (t * per_task..).zip(dst.chunks_exact_mut(stride)) {
                p.group_rows(g, rows, dst);
            }
        };
        let mut tiles = team::collect_chunks(groups * stride, per_task * stride, task);
        if n == 1 {
            tiles.truncate(out);
            return tiles;
        }
        // The tiles as rows `[row][out]`, a few rows per task.
        let rows_per_task = if threads <= 1 || n * out < 1 << 16 {
            n
        } else {
            n.div_ceil(threads)
        };
        let copy = |t: usize, dst: &mut [f32]| {
            for (i, y_row) in dst.chunks_exact_mut(out).enumerate() {
                let r = t * rows_per_task + i;
                for (g, lanes) in tiles.chunks_exact(stride).enumerate() {
                    let o0 = g * LANES;
                    let width = LANES.min(out - o0);
                    y_row[o0..o0 + width].copy_from_slice(&lanes[r * LANES..r * LANES + width]);
                }
            }
        };
        team::collect_chunks(n * out, rows_per_task * out, copy)
    }
}

/// The activation rows' quants one after another (the first whole tiles' rows), when
/// AMX runs the product: with AMX available, a weight it takes (blocks of 32, Q4_K,
/// Q5_K, Q6_K) and at least one tile of rows.
#[cfg(target_arch = "x86_64")]
fn amx_operands(p: &Packing, rows: &[ActRow]) -> Option<Vec<i8>> {
    let k = p.amx_row_len()?;
    if rows.len() < amx::TILE_ROWS || !amx::available() {
        return None;
    }
    let full = rows.len() / amx::TILE_ROWS * amx::TILE_ROWS;
    let mut a = Vec::with_capacity(full * k);
    for row in &rows[..full] {
        a.extend_from_slice(&row.qs[..k]);
    }
    Some(a)
}

/// [`FastLinear::matmul_packed`]'s task with AMX: groups `g0..` into `dst` (`[group]
/// [row][lane]`), each group unpacked once, then its products sixteen rows at a time
/// (`a`: those rows' quants) and the rows left over with the group kernel.
#[cfg(target_arch = "x86_64")]
fn amx_groups(p: &Packing, a: &[i8], rows: &[ActRow], g0: usize, dst: &mut [f32]) {
    let tile = amx::TILE_ROWS;
    let full = rows.len() / tile * tile;
    let k = a.len() / full;
    let mut w = Vec::new();
    for (g, dst) in (g0..).zip(dst.chunks_exact_mut(rows.len() * LANES)) {
        p.amx_unpack(g, &mut w);
        let (tiles, rest) = dst.split_at_mut(full * LANES);
        for (i, ((chunk, d), a)) in rows[..full]
            .chunks_exact(tile)
            .zip(tiles.chunks_exact_mut(tile * LANES))
            .zip(a.chunks_exact(tile * k))
            .enumerate()
        {
            p.amx_tile(g, (&w, a), chunk, d, i == 0);
        }
        for (chunk, d) in rows[full..]
            .chunks(ROW_TILE)
            .zip(rest.chunks_mut(ROW_TILE * LANES))
        {
            p.group(g, chunk, d);
        }
    }
}

/// Q4_K's 12 bytes of 6-bit values unpacked: the 8 sub-block scales, then the 8
/// minimums. Sub-blocks 0–3 keep theirs in the low 6 bits of bytes 0–3 (scales) and
/// 4–7 (minimums); sub-blocks 4–7 take 4 low bits from a nibble of bytes 8–11 and 2
/// high bits from the top of bytes 0–3 (scales) or 4–7 (minimums).
fn unpack_q4k_scales(p: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for j in 0..4 {
        out[j] = p[j] & 63;
        out[8 + j] = p[j + 4] & 63;
        out[4 + j] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        out[12 + j] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    out
}

/// Value `i` (0..256) of a Q6_K super-block as unsigned 6 bits (the weight is this
/// minus 32). Each half of 128 values uses 64 bytes of `low` and 32 of `high`: value
/// `32q + l` of a half (quarter `q`) takes the low or high nibble of low byte
/// `l + 32·(q mod 2)` and bits `2q..2q + 2` of high byte `l`.
#[cfg(test)]
fn q6k_value(low: &[u8], high: &[u8], i: usize) -> u8 {
    let (half, quarter, l) = (i / 128, i % 128 / 32, i % 32);
    let byte = low[64 * half + 32 * (quarter % 2) + l];
    let nibble = if quarter < 2 { byte & 0x0F } else { byte >> 4 };
    nibble | (((high[32 * half + l] >> (2 * quarter)) & 3) << 4)
}

/// Whether (and how) [`quantize_row`] keeps each block's `d·Σq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sums {
    None,
    /// Rounded through f16, as ggml's Q8_1 stores it.
    F16,
    /// `d·Σq` in f32 with the f16-rounded `d` the products use.
    Exact,
}

/// ggml's `quantize_row_q8_1` / `quantize_row_q8_0`, AVX2 flavour: scale `127/amax`,
/// round half to even; the block scale (and sum) are stored as f16 by ggml, so they are
/// rounded through f16 here too.
fn quantize_row(x: &[f32], sums: Sums) -> ActRow {
    let nb = x.len() / QK;
    let mut qs = vec![0i8; nb * QK];
    let mut d = Vec::with_capacity(nb);
    let mut s = Vec::with_capacity(if sums == Sums::None { 0 } else { nb });
    let mut offset_sums = Vec::with_capacity(nb);
    for (block, q) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)) {
        let amax = act::amax(block);
        let scale = amax / 127.0;
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let sum = act::quantize(block, inv, q);
        offset_sums.push(OFFSET_SUM * sum);
        let rounded = f16::from_f32(scale).to_f32();
        d.push(rounded);
        match sums {
            Sums::None => {}
            Sums::F16 => s.push(f16::from_f32(scale * sum as f32).to_f32()),
            Sums::Exact => s.push(rounded * sum as f32),
        }
    }
    ActRow {
        qs,
        d,
        s,
        sums: Vec::new(),
        offset_sums,
    }
}

/// Activations for the K-quants, as ggml's Q8_K: per 256 values one scale `amax/127`
/// (round half to even), kept in f32 (it is never stored in a file, unlike Q8_0's), and
/// the sum of every 16 quants. One scale per super-block keeps a super-block's whole
/// product in integers, with two float multiplications per 256 values.
fn quantize_row_k(x: &[f32]) -> ActRow {
    let nb = x.len() / QK_K;
    let mut qs = vec![0i8; nb * QK_K];
    let mut d = Vec::with_capacity(nb);
    let mut sums = Vec::with_capacity(nb * K_SUMS);
    for (block, q) in x.chunks_exact(QK_K).zip(qs.chunks_exact_mut(QK_K)) {
        let amax = act::amax(block);
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for (group, q) in block.chunks_exact(16).zip(q.chunks_exact_mut(16)) {
            // At most 16·127 in magnitude.
            sums.push(act::quantize(group, inv, q) as i16);
        }
        d.push(amax / 127.0);
    }
    ActRow {
        qs,
        d,
        s: Vec::new(),
        sums,
        offset_sums: Vec::new(),
    }
}

/// Four activation bytes at `p` as one 32-bit word (for broadcasting to every lane of
/// a repacked kernel).
///
/// # Safety
/// `p..p + 4` must be readable.
#[inline(always)]
#[expect(
    unsafe_code,
    reason = "an unaligned read the SIMD kernels guarantee in bounds"
)]
unsafe fn word_at(p: *const i8) -> i32 {
    // SAFETY: as the caller guarantees.
    unsafe { p.cast::<i32>().read_unaligned() }
}

/// Round half to even for |x| ≤ 2²², as `_mm256_round_ps(_MM_ROUND_NEAREST)` does:
/// adding and subtracting 1.5·2²³ leaves the float unit's default rounding to do the
/// work (libm's `rintf` is a function call per value).
#[inline(always)]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// One super-block's step of a Q4_K product, shared by every kernel so that all give
/// the same bits: `isum = Σ_j scale_j·Σ q_w·q_a` and `msum = Σ_j min_j·Σ q_a` over the
/// sub-blocks are exact integers.
#[inline(always)]
fn q4k_step(acc: f32, d: f32, dmin: f32, da: f32, isum: i32, msum: i32) -> f32 {
    acc + ((d * da) * isum as f32 - (dmin * da) * msum as f32)
}

/// One super-block's step of a Q6_K product: `isum = Σ_g scale_g·Σ (q_w − 32)·q_a`,
/// an exact integer.
#[inline(always)]
fn q6k_step(acc: f32, d: f32, da: f32, isum: i32) -> f32 {
    acc + (d * da) * isum as f32
}

struct Op<'a>(&'a FastLinear);

impl CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "quantized-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("quantized-matmul expects f32 activations");
        };
        let dims = layout.shape().dims();
        let k = *dims.last().unwrap_or(&0);
        if k != self.0.in_features {
            candle_core::bail!(
                "quantized-matmul: activations have width {k}, the weight expects {}",
                self.0.in_features
            );
        }
        let x = match layout.contiguous_offsets() {
            Some((start, end)) => &data[start..end],
            None => candle_core::bail!("quantized-matmul expects contiguous activations"),
        };
        let n = x.len() / k.max(1);
        let y = self.0.matmul(x, n);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("at least one dim") = self.0.out_features;
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

    use super::*;

    /// Whether this CPU runs the `level` kernels a test compares; says the test is
    /// skipped where it does not.
    pub(super) fn cpu_has(level: Simd) -> bool {
        let has = detected_simd() >= level;
        if !has {
            eprintln!("skipped: this CPU has no {level:?} (kernels::Simd)");
        }
        has
    }

    /// A tensor's values, flattened.
    pub(super) fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Tolerance against candle's own (scalar) Q4_1×Q8_1 product: the arithmetic is the
    /// same up to rounding of the activation scale (f16) and summation order.
    const MAX_REL_ERROR: f32 = 2e-3;

    /// `len` values in [-2, 2) from a fixed xorshift sequence: the same every run, so a
    /// comparison whose rounding differences depend on the data cannot fail at random.
    fn fixed_values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.max(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// `AGENTSTACK_DECODE_READ` takes its three words in any case, leaves the choice
    /// to the CPU when unset or empty, and refuses anything else (the caller warns).
    #[test]
    fn decode_read_setting_reads_its_words() {
        use DecodeRead::{Prefetched, Sequential, Streams};
        assert_eq!(decode_read_setting(None), Some(None));
        assert_eq!(decode_read_setting(Some(" ")), Some(None));
        assert_eq!(decode_read_setting(Some("streams")), Some(Some(Streams)));
        assert_eq!(
            decode_read_setting(Some("Sequential")),
            Some(Some(Sequential))
        );
        assert_eq!(
            decode_read_setting(Some("PREFETCHED")),
            Some(Some(Prefetched))
        );
        assert_eq!(decode_read_setting(Some("stream")), None);
        assert_eq!(decode_read_setting(Some("1")), None);
    }

    #[test]
    fn matches_candle_q4_1_matmul() {
        let device = Device::Cpu;
        let w = Tensor::from_vec(fixed_values(40 * 128, 7), (40, 128), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let fast = FastLinear::from_qtensor(&q).unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        for n in [1, 3, 4, 7] {
            let x =
                Tensor::from_vec(fixed_values(n * 128, 11 + n as u64), (n, 128), &device).unwrap();
            let got: Vec<f32> = values(&fast.forward(&x).unwrap());
            let want: Vec<f32> = values(&reference.forward(&x).unwrap());
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= MAX_REL_ERROR * scale, "n={n}: {g} vs {w}");
            }
        }
    }

    /// Dequantization, whole or by rows (embedding lookups), gives candle's values: the
    /// same arithmetic in the same order.
    #[test]
    fn dequantize_matches_candle() {
        let device = Device::Cpu;
        for (dtype, width) in [
            (GgmlDType::Q4_0, 64),
            (GgmlDType::Q4_1, 64),
            (GgmlDType::Q5_0, 64),
            (GgmlDType::Q5_1, 64),
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q2K, 512),
            (GgmlDType::Q3K, 512),
            (GgmlDType::Q4K, 512),
            (GgmlDType::Q5K, 512),
            (GgmlDType::Q6K, 512),
        ] {
            let w = Tensor::randn(0f32, 1.0, (8, width), &device).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let fast = FastLinear::from_qtensor(&q).unwrap();
            let ours: Vec<f32> = values(&fast.dequantize().unwrap());
            let theirs: Vec<f32> = values(&q.dequantize(&device).unwrap());
            if dtype == GgmlDType::Q5_1 {
                // Held as `d·(q − 16) + (m + 16d)`: the minimum's sum is rounded once.
                for (a, b) in ours.iter().zip(&theirs) {
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                        "{dtype:?}: {a} vs {b}"
                    );
                }
                continue;
            }
            assert_eq!(ours, theirs, "{dtype:?}");
            let rows = fast.rows(&[5, 2]);
            assert_eq!(rows[..width], theirs[5 * width..6 * width], "{dtype:?}");
            assert_eq!(rows[width..], theirs[2 * width..3 * width], "{dtype:?}");
        }
    }

    /// The types of blocks of 32.
    const LEGACY_KINDS: [GgmlDType; 5] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
    ];

    /// Q4_0, Q5_0 and Q5_1 run on the Q4_1 and Q8_0 kernels after a conversion at load:
    /// each output equals the product of candle's dequantized weight with the
    /// activations after their 8-bit quantization, to float rounding (1e-5 of Σ|w·x'|).
    /// One to six rows, one and five blocks per row.
    #[test]
    fn converted_types_match_the_dequantized_product() {
        let device = Device::Cpu;
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            for (out, blocks) in [(5, 1), (9, 5)] {
                let k = blocks * QK;
                let w = Tensor::randn(0f32, 1.0, (out, k), &device).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let weights: Vec<f32> = values(&q.dequantize(&device).unwrap());
                let fast = FastLinear::from_qtensor(&q).unwrap();
                for n in [1, 4, 6] {
                    let x = Tensor::randn(0f32, 1.0, (n, k), &device).unwrap();
                    let xs: Vec<f32> = values(&x);
                    let got: Vec<f32> = values(&fast.forward(&x).unwrap());
                    for (r, xr) in xs.chunks_exact(k).enumerate() {
                        let act = quantize_row(xr, Sums::None);
                        for (o, wr) in weights.chunks_exact(k).enumerate() {
                            let (exact, size) =
                                wr.iter().enumerate().fold((0f64, 0f64), |(s, a), (i, &w)| {
                                    let p = f64::from(w)
                                        * f64::from(act.d[i / QK])
                                        * f64::from(act.qs[i]);
                                    (s + p, a + p.abs())
                                });
                            let g = f64::from(got[r * out + o]);
                            assert!(
                                (g - exact).abs() <= 1e-5 * size,
                                "{dtype:?}, {blocks} blocks, row {r}/{n}, output {o}: {g} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    const K_KINDS: [GgmlDType; 5] = [
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// Kernel against `x'·Wᵀ` summed in f64, `W` dequantized by candle and `x'` the
    /// activations after their 8-bit quantization: the same numbers summed in another
    /// order and rounded to f32, as a fraction of `Σ |w·x'|`.
    const K_KERNEL_TOLERANCE: f64 = 1e-5;

    /// K-quant weights quantized by candle: each output equals the product with
    /// candle's dequantized weight, to rounding once the activations are quantized, and
    /// within the quantization's bound (each activation off by at most half its
    /// super-block's step) of the product with the f32 activations. One to six rows,
    /// one and three super-blocks.
    #[test]
    fn k_quants_match_the_dequantized_product() {
        let device = Device::Cpu;
        for dtype in K_KINDS {
            for (out, superblocks) in [(5, 1), (9, 3)] {
                let k = superblocks * QK_K;
                let w = Tensor::randn(0f32, 1.0, (out, k), &device).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let weights: Vec<f32> = values(&q.dequantize(&device).unwrap());
                let fast = FastLinear::from_qtensor(&q).unwrap();
                for n in [1, 3, 4, 6] {
                    let x = Tensor::randn(0f32, 1.0, (n, k), &device).unwrap();
                    let xs: Vec<f32> = values(&x);
                    let got: Vec<f32> = values(&fast.forward(&x).unwrap());
                    for (r, xr) in xs.chunks_exact(k).enumerate() {
                        let act = quantize_row_k(xr);
                        let step = |i: usize| f64::from(act.d[i / QK_K]);
                        let xq: Vec<f64> = (0..k).map(|i| step(i) * f64::from(act.qs[i])).collect();
                        for (o, wr) in weights.chunks_exact(k).enumerate() {
                            let g = f64::from(got[r * out + o]);
                            let at = format!(
                                "{dtype:?}, {superblocks} super-blocks, row {r}/{n}, output {o}"
                            );
                            let wide = |x: &[f64]| -> (f64, f64) {
                                wr.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
                                    (s + f64::from(w) * x, a + (f64::from(w) * x).abs())
                                })
                            };
                            let (exact, size) = wide(&xq);
                            assert!(
                                (g - exact).abs() <= K_KERNEL_TOLERANCE * size,
                                "{at}: {g} vs {exact}"
                            );
                            let xf: Vec<f64> = xr.iter().map(|&v| f64::from(v)).collect();
                            let (plain, _) = wide(&xf);
                            let bound: f64 = wr
                                .iter()
                                .enumerate()
                                .map(|(i, &w)| f64::from(w).abs() * step(i) / 2.0)
                                .sum();
                            assert!(
                                (g - plain).abs() <= bound * 1.001 + K_KERNEL_TOLERANCE * size,
                                "{at}: {g} vs {plain} (bound {bound})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The 6-bit scale unpacking of Q4_K against its definition bit by bit, for every
    /// value of every byte position.
    #[test]
    fn q4k_scales_unpack_to_six_bits() {
        for byte in 0..=255u8 {
            for pos in 0..12 {
                let mut packed = [0u8; 12];
                packed[pos] = byte;
                let u = unpack_q4k_scales(&packed);
                // Bit b of 6-bit value v (scales 0..8, minimums 8..16).
                let bit = |v: usize, b: usize| (u[v] >> b) & 1;
                for bitpos in 0..8 {
                    let set = (byte >> bitpos) & 1;
                    // Where ggml's layout puts bit `bitpos` of byte `pos`.
                    let (v, b) = match (pos, bitpos) {
                        (0..=3, 0..=5) => (pos, bitpos),
                        (0..=3, _) => (4 + pos, bitpos - 2),
                        (4..=7, 0..=5) => (8 + pos - 4, bitpos),
                        (4..=7, _) => (12 + pos - 4, bitpos - 2),
                        (_, 0..=3) => (pos - 4, bitpos),
                        (_, _) => (pos + 4, bitpos - 4),
                    };
                    assert_eq!(bit(v, b), set, "byte {pos} bit {bitpos}");
                }
                let total: u32 = u.iter().map(|v| v.count_ones()).sum();
                assert_eq!(total, byte.count_ones(), "byte {pos}");
            }
        }
    }

    #[test]
    fn q8_0_matches_candle() {
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (24, 128), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let fast = FastLinear::from_qtensor(&q).unwrap();
        let reference = QMatMul::from_qtensor(q).unwrap();
        let x = Tensor::randn(0f32, 1.0, (5, 128), &device).unwrap();
        let got: Vec<f32> = values(&fast.forward(&x).unwrap());
        let want: Vec<f32> = values(&reference.forward(&x).unwrap());
        // Both quantize the activations to 8 bits, each its own way (candle may take
        // Q8_K for Q8_0 weights): the two differ by up to the activations' rounding, a
        // small fraction of Σ|w·x| (a fixed fraction of |y| alone fails when y is a
        // near-cancelling sum).
        let weights: Vec<f32> = values(&fast.dequantize().unwrap());
        let xs: Vec<f32> = values(&x);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (r, o) = (i / 24, i % 24);
            let size: f32 = (0..128)
                .map(|j| (weights[o * 128 + j] * xs[r * 128 + j]).abs())
                .sum();
            assert!((g - w).abs() <= 1e-2 * size, "{g} vs {w} (Σ|w·x| {size})");
        }
    }

    /// A rayon pool of `threads` threads.
    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// A product has the same bits on one thread as on three, where the groups are
    /// split across tasks that write their outputs in place: one row (decode, the
    /// buffer is the result) and five; a last group with padding lanes.
    #[test]
    fn outputs_do_not_depend_on_the_thread_count() {
        let device = Device::Cpu;
        let (one, three) = (pool(1), pool(3));
        for dtype in LEGACY_KINDS.into_iter().chain(K_KINDS) {
            // 200 outputs: 13 groups, the last with 8 lanes.
            let w = Tensor::randn(0f32, 1.0, (200, 512), &device).unwrap();
            let fast = FastLinear::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap();
            for n in [1, 5] {
                let x: Vec<f32> = values(&Tensor::randn(0f32, 1.0, (n, 512), &device).unwrap());
                let want = one.install(|| fast.matmul(&x, n));
                let got = three.install(|| fast.matmul(&x, n));
                assert_eq!(got.len(), n * 200);
                let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{dtype:?}, {n} rows");
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_the_batch() {
        let device = Device::Cpu;
        for dtype in LEGACY_KINDS.into_iter().chain(K_KINDS) {
            // 67 outputs: the four-at-a-time decode path plus a remainder.
            let w = Tensor::randn(0f32, 1.0, (67, 256), &device).unwrap();
            let fast = FastLinear::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap();
            // 37 rows: two sixteen-row tiles (AMX, where this CPU has it) and five more.
            let x = Tensor::randn(0f32, 1.0, (37, 256), &device).unwrap();
            let all: Vec<Vec<f32>> = fast.forward(&x).unwrap().to_vec2().unwrap();
            for (i, row) in all.iter().enumerate() {
                let one: Vec<Vec<f32>> = fast
                    .forward(&x.narrow(0, i, 1).unwrap())
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                assert_eq!(&one[0], row, "{dtype:?} row {i}");
            }
        }
    }

    /// A decode's groups read as several streams in lockstep (`Packing::decode`) give
    /// each group's own bits, for ranges whose length is a multiple of the streams or
    /// not, starting at the first group or not, and with a last group of padding lanes.
    #[test]
    fn decode_in_streams_gives_each_group_s_bits() {
        let device = Device::Cpu;
        for dtype in LEGACY_KINDS.into_iter().chain(K_KINDS) {
            // 200 outputs: 13 groups, the last with 8 lanes.
            let w = Tensor::randn(0f32, 1.0, (200, 512), &device).unwrap();
            let fast = FastLinear::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap();
            let x: Vec<f32> = values(&Tensor::randn(0f32, 1.0, (1, 512), &device).unwrap());
            let row = fast.quantize(&x);
            assert_decodes_as_groups(&fast.packed, &row[0], &format!("{dtype:?}"));
        }
    }

    /// Each SIMD family's streams kernel (`run(family, out)`, group `g`'s sixteen
    /// outputs at `out[(g − first)·16..]`) gives the scalar kernel's bits
    /// (`scalar(g, out)`) for each group of `gs`: AVX2 (the caller checked for it), and
    /// AVX-512 VNNI where the CPU has it.
    pub(super) fn assert_streams_give_scalar_bits(
        (groups, gs, first): (usize, &[usize], usize),
        mut scalar: impl FnMut(usize, &mut [f32]),
        mut run: impl FnMut(Simd, &mut [f32]),
        what: &str,
    ) {
        let mut want = vec![0f32; (groups - first) * LANES];
        for &g in gs {
            let at = (g - first) * LANES;
            scalar(g, &mut want[at..at + LANES]);
        }
        let bits = |y: &[f32], g: usize| {
            y[(g - first) * LANES..][..LANES]
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        for family in [Simd::Avx2, Simd::Avx512Vnni] {
            if detected_simd() < family {
                continue;
            }
            let mut got = vec![f32::NAN; want.len()];
            run(family, &mut got);
            for &g in gs {
                assert_eq!(
                    bits(&got, g),
                    bits(&want, g),
                    "{family:?}: {what}, groups {gs:?}"
                );
            }
        }
    }

    /// `Packing::decode` of several ranges of `p`'s groups, read in streams and not,
    /// equals `Packing::group` of each group, bit for bit.
    pub(super) fn assert_decodes_as_groups(p: &Packing, row: &ActRow, what: &str) {
        let groups = p.groups();
        assert!(groups >= 12, "{what}: too few groups to test streams");
        let ranges = [0..groups, 3..groups - 1, 1..9, 2..5, 0..1];
        for (range, read) in ranges.into_iter().flat_map(|r| {
            [
                (r.clone(), DecodeRead::Streams),
                (r.clone(), DecodeRead::Sequential),
                (r, DecodeRead::Prefetched),
            ]
        }) {
            let mut want = vec![0f32; range.len() * LANES];
            for (g, d) in range.clone().zip(want.chunks_exact_mut(LANES)) {
                p.group(g, std::slice::from_ref(row), d);
            }
            let mut got = vec![f32::NAN; range.len() * LANES];
            p.decode_as(range.clone(), row, &mut got, read);
            let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{what}, groups {range:?}, {read:?}"
            );
        }
    }

    /// Several weights of one input in one region (a decode step's q, k and v) give
    /// each weight's own product, bit for bit, on a team of 3 as on one thread; one
    /// weight small enough to be one task, K-quants of three types.
    #[test]
    fn weights_of_one_input_decode_together_as_alone() {
        let device = Device::Cpu;
        let (one, three) = (pool(1), pool(3));
        let weight = |out: usize, dtype, seed: u64| {
            let w = Tensor::from_vec(fixed_values(out * 512, seed), (out, 512), &device).unwrap();
            FastLinear::from_qtensor(&QTensor::quantize(&w, dtype).unwrap()).unwrap()
        };
        let ws = [
            weight(200, GgmlDType::Q4K, 1),
            weight(40, GgmlDType::Q6K, 2),
            weight(72, GgmlDType::Q5K, 3),
        ];
        let refs: Vec<&FastLinear> = ws.iter().collect();
        let x = Tensor::from_vec(fixed_values(512, 4), (1, 512), &device).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> { values(t).iter().map(|v| v.to_bits()).collect() };
        let want: Vec<Vec<u32>> =
            one.install(|| ws.iter().map(|w| bits(&w.forward(&x).unwrap())).collect());
        let got: Vec<Vec<u32>> = three.install(|| {
            team::with_team(|| {
                FastLinear::forward_many(&refs, &x)
                    .unwrap()
                    .iter()
                    .map(bits)
                    .collect()
            })
        });
        assert_eq!(got, want);
    }

    #[test]
    fn magic_rounding_is_round_half_to_even() {
        for i in -2540..=2540 {
            let x = i as f32 / 20.0;
            assert_eq!(round_ties_even(x), x.round_ties_even(), "{x}");
        }
        for x in [
            0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -127.0, 0.49999997, 1e-8,
        ] {
            assert_eq!(round_ties_even(x), x.round_ties_even(), "{x}");
        }
    }
}
