//! Quick timing of one quantized matmul, our kernels against candle's, for kernel work:
//! `cargo run --release -p agentstack-model --example kernel_speed -- [TYPES] [OUT] [IN] [ROWS]`
//! with `TYPES` a comma-separated list (`q4_0,q4k,q6k,iq4_xs`, default
//! `q4_1,q8_0,q4k,q6k`; `iq4_nl` and `iq4_xs` are random blocks, which candle does not
//! read) and `ROWS` a comma-separated list of activation row counts (default
//! `1,4,64`). Runs on the current thread pool (`RAYON_NUM_THREADS`);
//! `AGENTSTACK_KERNELS=avx2` caps our kernels' instruction set. Decode is one activation
//! row, prefill many. A weight that fits in L2 (`1024 2048`) times the kernels' arithmetic;
//! a larger one (`8192 8192`) the cache or memory they read from.
//! (The side-by-side benchmark against llama.cpp is `bench/inference`.)

use std::time::Instant;

use agentstack_model::gguf::{RawTensor, RawType};
use agentstack_model::kernels::{FastLinear, QuantKind};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::{RngCore, SeedableRng};

fn dtype(name: &str) -> Option<GgmlDType> {
    Some(match name {
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q5_1" => GgmlDType::Q5_1,
        "q8_0" => GgmlDType::Q8_0,
        "q2k" => GgmlDType::Q2K,
        "q3k" => GgmlDType::Q3K,
        "q4k" => GgmlDType::Q4K,
        "q5k" => GgmlDType::Q5K,
        "q6k" => GgmlDType::Q6K,
        _ => return None,
    })
}

/// A tensor of `out × inp` random IQ4 blocks (`iq4_nl`, `iq4_xs`), each scale `d` a
/// small f16 (speed does not depend on the values).
fn iq4(name: &str, out: usize, inp: usize) -> Option<RawTensor> {
    let ty = match name {
        "iq4_nl" => RawType::Iq4Nl,
        "iq4_xs" => RawType::Iq4Xs,
        _ => return None,
    };
    let (len, size) = (ty.block_size(), ty.type_size());
    let mut data = vec![0u8; out * inp / len * size];
    rand_chacha::ChaCha8Rng::seed_from_u64(7).fill_bytes(&mut data);
    for block in data.chunks_exact_mut(size) {
        block[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
    }
    Some(RawTensor {
        ty,
        dims: vec![out, inp],
        data,
    })
}

/// Median seconds of `f` over enough calls to take about 0.3 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-6);
    let n = ((0.3 / once) as usize).clamp(3, 2000);
    let mut samples: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[n / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let types = args
        .next()
        .unwrap_or_else(|| "q4_1,q8_0,q4k,q6k".to_owned());
    let out: usize = args.next().map_or(Ok(2048), |a| a.parse())?;
    let inp: usize = args.next().map_or(Ok(2048), |a| a.parse())?;
    let row_counts = args
        .next()
        .unwrap_or_else(|| "1,4,64".to_owned())
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<usize>, _>>()?;
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (out, inp), &dev)?;
    println!(
        "weight {out}x{inp}, {} threads",
        rayon::current_num_threads()
    );
    println!("| type | rows | ours µs | candle µs | ours / candle speed | weight GB/s (ours) |");
    println!("|---|--:|--:|--:|--:|--:|");
    for name in types.split(',') {
        // Ours, candle's where it reads the type, and the weight's bytes.
        let (fast, candle, bytes) = if let Some(raw) = iq4(name, out, inp) {
            (FastLinear::from_raw(&raw)?, None, raw.data.len() as f64)
        } else {
            let dt = dtype(name).ok_or_else(|| format!("unknown type {name}"))?;
            let q = QTensor::quantize(&w, dt)?;
            let bytes = q.storage_size_in_bytes() as f64;
            if QuantKind::of(dt).is_none() {
                println!("| {name} | – | no kernel | | | |");
                continue;
            }
            let fast = FastLinear::from_qtensor(&q)?;
            (fast, Some(QMatMul::from_qtensor(q)?), bytes)
        };
        for &rows in &row_counts {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?;
            let ours = time(|| {
                fast.forward(&x).expect("forward");
            });
            let (theirs, ratio) = match &candle {
                Some(candle) => {
                    let theirs = time(|| {
                        candle.forward(&x).expect("forward");
                    });
                    (
                        format!("{:.1}", theirs * 1e6),
                        format!("{:.2}×", theirs / ours),
                    )
                }
                None => ("–".to_owned(), String::new()),
            };
            println!(
                "| {name} | {rows} | {:.1} | {theirs} | {ratio} | {:.1} |",
                ours * 1e6,
                bytes / ours / 1e9
            );
        }
    }
    Ok(())
}
