//! Per-tensor type allocation under a size budget, from measured sensitivity.
//!
//! 1. **Error table.** Every quantizable weight (the token embedding and output too) is
//!    quantized to every candidate type (after llama.cpp's fallback for its row length),
//!    and the importance-weighted squared error `E(t, T) = Σ_col imp_col · Σ_row Δw²` is
//!    recorded with the bytes: `E` is the expected squared error of that matmul's output
//!    over the calibration activations (unweighted where the importance matrix has no
//!    entry: the output's is collected only on request, as by llama-imatrix).
//! 2. **Sensitivity.** Weights are grouped by kind and layer band (first and last layers
//!    alone). For each group the runtime measures the mean KLD over every position of the
//!    calibration text when only that group is quantized to its smallest candidate,
//!    against a model whose weights are all the exact f32 values of the input (so
//!    compute-path noise is not measured). `s_g = KLD_g / Σ_{t∈g} E(t, probe)`: KLD per
//!    unit of output error. A tied embedding is measured as lookup table and output both.
//! 3. **Allocation.** Predicted cost `c(t, T) = s_g · E(t, T)`; each weight's candidates
//!    are reduced to their lower convex hull in (bytes, cost), the steps down the hulls
//!    are taken greedily by marginal KLD per byte saved until the file fits, and the bytes
//!    the last step freed beyond the need are spent again on the best steps back up.
//! 4. **Verification** is the caller's: quantize with the plan and measure
//!    (`kld::compare`); the prediction assumes costs add across weights.

use std::collections::BTreeMap;

use agentstack_model::model::{Embedding, Linear};
use agentstack_model::{LanguageModel, Logits, Model, SeqInput};
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::error::{QuantError, Result};
use crate::gguf::Gguf;
use crate::imatrix::Imatrix;
use crate::kld::kld;
use crate::recipe::{Plan, effective_type, is_quantizable};
use crate::types::GgmlType;

/// The types allocation chooses among (each falls back per row length as llama.cpp's).
pub const CANDIDATES: &[GgmlType] = &[
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_XS,
    GgmlType::Q4_0,
    GgmlType::IQ4_NL,
    GgmlType::Q4_K,
    GgmlType::Q5_0,
    GgmlType::Q5_K,
    GgmlType::Q5_1,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

/// One candidate type of one weight.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// The type (after fallback).
    pub ty: GgmlType,
    /// Bytes of the weight at this type.
    pub bytes: u64,
    /// Importance-weighted squared error.
    pub error: f64,
}

/// The candidates of one weight.
#[derive(Debug, Clone, Serialize)]
pub struct WeightOptions {
    /// Tensor index in the file.
    pub index: usize,
    /// Name.
    pub name: String,
    /// Sensitivity group.
    pub group: String,
    /// Candidates, distinct types.
    pub options: Vec<Candidate>,
}

/// The sensitivity group of a weight: its kind and layer band.
pub fn group_of(name: &str, layers: usize) -> String {
    let mut parts = name.split('.');
    match (
        parts.next(),
        parts.next().and_then(|l| l.parse::<usize>().ok()),
        parts.next(),
    ) {
        (Some("blk"), Some(layer), Some(kind)) => {
            let band = if layer == 0 {
                "0".to_owned()
            } else if layer + 1 == layers {
                format!("{layer}")
            } else {
                let start = 1 + (layer - 1) / 7 * 7;
                format!("{start}-{}", (start + 6).min(layers - 2))
            };
            format!("{kind}@{band}")
        }
        _ => name.trim_end_matches(".weight").to_owned(),
    }
}

/// Measures every weight's sensitivity alone instead of per kind and layer band: one
/// probe per weight (211 on SmolLM2 instead of 43), for mixes that follow each layer's
/// own sensitivity.
pub fn per_tensor(table: &mut [WeightOptions]) {
    for w in table {
        w.group = w.name.trim_end_matches(".weight").to_owned();
    }
}

/// Which weights take part: every matrix, the token embedding and output projection too
/// (on a model with tied embeddings one table is both, and is measured as both).
fn allocatable(file: &Gguf) -> Vec<usize> {
    (0..file.tensors.len())
        .filter(|&i| is_quantizable(&file.tensors[i]))
        .collect()
}

/// The embedding and output weights: llama-imatrix leaves them out unless asked
/// (`--process-output`), so their error is unweighted when the matrix has no entry.
fn optional_importance(name: &str) -> bool {
    !name.starts_with("blk.")
}

/// Step 1: the error table (every allocatable weight at every candidate type).
pub fn error_table(
    file: &mut Gguf,
    imatrix: &Imatrix,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<WeightOptions>> {
    let layers = file
        .tensors
        .iter()
        .filter_map(|t| {
            t.name
                .strip_prefix("blk.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |l| l + 1);
    let indices = allocatable(file);
    let mut out = Vec::with_capacity(indices.len());
    for (k, &i) in indices.iter().enumerate() {
        let info = file.tensors[i].clone();
        let w = file.read_f32(i)?;
        let cols = info.row_len();
        let imp = imatrix.importance(&info.name);
        if imp.is_none() && !optional_importance(&info.name) {
            return Err(QuantError::Invalid(format!(
                "the importance matrix has no entry for {}; was it collected on this model?",
                info.name
            )));
        }
        let mut options: Vec<Candidate> = Vec::new();
        for &want in CANDIDATES {
            let ty = effective_type(want, cols);
            if options.iter().any(|o| o.ty == ty) {
                continue;
            }
            let q = crate::quantize::quantize(ty, &w, cols, imp.as_deref()).map_err(|reason| {
                QuantError::Unquantizable {
                    name: info.name.clone(),
                    reason,
                }
            })?;
            let back = crate::quantize::dequantize(ty, &q, w.len()).map_err(|reason| {
                QuantError::Unquantizable {
                    name: info.name.clone(),
                    reason,
                }
            })?;
            let error: f64 = w
                .iter()
                .zip(&back)
                .enumerate()
                .map(|(j, (a, b))| {
                    let weight = imp.as_ref().map_or(1.0, |imp| f64::from(imp[j % cols]));
                    weight * f64::from(a - b).powi(2)
                })
                .sum();
            options.push(Candidate {
                ty,
                bytes: q.len() as u64,
                error,
            });
        }
        options.sort_by_key(|o| o.bytes);
        out.push(WeightOptions {
            index: i,
            group: group_of(&info.name, layers),
            name: info.name,
            options,
        });
        progress(k + 1, indices.len());
    }
    Ok(out)
}

/// Step 2's result: KLD per unit error per group, and what was measured.
#[derive(Debug, Clone, Serialize)]
pub struct Sensitivity {
    /// Group → (probe mean KLD, KLD per unit error).
    pub groups: BTreeMap<String, (f64, f64)>,
}

fn linear_of<'a>(model: &'a mut Model, name: &str) -> Option<&'a mut Linear> {
    let mut parts = name.split('.');
    let (Some("blk"), Some(layer), Some(kind)) = (parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    let block = model.blocks_mut().get_mut(layer.parse::<usize>().ok()?)?;
    Some(match kind {
        "attn_q" => &mut block.q,
        "attn_k" => &mut block.k,
        "attn_v" => &mut block.v,
        "attn_output" => &mut block.o,
        "ffn_gate" => &mut block.gate,
        "ffn_up" => &mut block.up,
        "ffn_down" => &mut block.down,
        _ => return None,
    })
}

fn dense(values: Vec<f32>, dims: &[u64]) -> Result<Linear> {
    let (cols, rows) = (dims[0] as usize, dims[1] as usize);
    Ok(Linear::Dense {
        weight: Tensor::from_vec(values, (rows, cols), &Device::Cpu)?,
        bias: None,
    })
}

/// Puts `values` (laid out as the file's `dims`) in place of weight `name` in `model`. A
/// tied token embedding is replaced as the lookup table and as the output projection.
fn replace_weight(
    model: &mut Model,
    name: &str,
    values: Vec<f32>,
    dims: &[u64],
    tied: bool,
) -> Result<()> {
    match name {
        "token_embd.weight" => {
            let (cols, rows) = (dims[0] as usize, dims[1] as usize);
            let table = Tensor::from_vec(values, (rows, cols), &Device::Cpu)?;
            if tied {
                *model.output_mut() = Linear::Dense {
                    weight: table.clone(),
                    bias: None,
                };
            }
            *model.embedding_mut() = Embedding::Dense(table);
        }
        "output.weight" => *model.output_mut() = dense(values, dims)?,
        _ => {
            *linear_of(model, name)
                .ok_or_else(|| QuantError::Invalid(format!("no layer for {name}")))? =
                dense(values, dims)?
        }
    }
    Ok(())
}

/// The calibration tokens as windows of at most `ctx` tokens, near-equal in length, that
/// together cover all of them.
fn windows(tokens: &[u32], ctx: usize) -> Result<Vec<&[u32]>> {
    if ctx < 4 * WARMUP || tokens.len() < 4 * WARMUP {
        return Err(QuantError::Invalid(format!(
            "sensitivity needs a calibration text of at least {} tokens and windows of at least \
             as many (got {} tokens, windows of {ctx}); give a longer text or a larger context",
            4 * WARMUP,
            tokens.len()
        )));
    }
    let len = tokens.len().div_ceil(tokens.len().div_ceil(ctx));
    Ok(tokens
        .chunks(len)
        .filter(|w| w.len() > 2 * WARMUP)
        .collect())
}

/// Leading positions of a window left unscored: their short context makes them unlike
/// the rest of the text.
const WARMUP: usize = 8;

/// Next-token log-probabilities at every scored position of `window`.
fn distributions(model: &Model, window: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut cache = model.new_cache();
    let logits = model.forward(&mut [SeqInput {
        cache: &mut cache,
        tokens: &window[..window.len() - 1],
        logits: Logits::All,
    }])?;
    let rows: Vec<Vec<f32>> = logits[0].to_vec2()?;
    Ok(rows
        .iter()
        .skip(WARMUP)
        .map(|r| agentstack_model::sampling::log_softmax(r))
        .collect())
}

/// Step 2: measures each group's sensitivity on `tokens` (every position past the first
/// few of each window of at most `ctx` tokens).
pub fn measure_sensitivity(
    file: &mut Gguf,
    lm: &LanguageModel,
    table: &[WeightOptions],
    imatrix: &Imatrix,
    tokens: &[u32],
    ctx: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Sensitivity> {
    // The reference: every allocatable weight as exact f32 values of the input.
    let tied = lm.model().tied_output();
    let mut base = lm.model().clone();
    for w in table {
        let values = file.read_f32(w.index)?;
        let dims = file.tensors[w.index].dims.clone();
        replace_weight(&mut base, &w.name, values, &dims, tied)?;
    }
    let windows = windows(tokens, ctx)?;
    let base_rows: Vec<Vec<Vec<f32>>> = windows
        .iter()
        .map(|w| distributions(&base, w))
        .collect::<Result<_>>()?;
    let mut groups: BTreeMap<&str, Vec<&WeightOptions>> = BTreeMap::new();
    for w in table {
        groups.entry(w.group.as_str()).or_default().push(w);
    }
    let mut out = BTreeMap::new();
    let total = groups.len();
    for (g, (name, members)) in groups.into_iter().enumerate() {
        let mut probe = base.clone();
        let mut error = 0.0;
        for w in &members {
            let lowest = &w.options[0];
            error += lowest.error;
            let info = file.tensors[w.index].clone();
            let values = file.read_f32(w.index)?;
            let imp = imatrix.importance(&w.name);
            let q = crate::quantize::quantize(lowest.ty, &values, info.row_len(), imp.as_deref())
                .map_err(|reason| QuantError::Unquantizable {
                name: w.name.clone(),
                reason,
            })?;
            let back =
                crate::quantize::dequantize(lowest.ty, &q, values.len()).map_err(|reason| {
                    QuantError::Unquantizable {
                        name: w.name.clone(),
                        reason,
                    }
                })?;
            replace_weight(&mut probe, &w.name, back, &info.dims, tied)?;
        }
        let (mut sum, mut n) = (0.0, 0usize);
        for (w, rows) in windows.iter().zip(&base_rows) {
            let mine = distributions(&probe, w)?;
            for (a, b) in rows.iter().zip(&mine) {
                sum += kld(a, b);
                n += 1;
            }
        }
        let mean = sum / n as f64;
        out.insert(
            name.to_owned(),
            (mean, if error > 0.0 { mean / error } else { 0.0 }),
        );
        progress(g + 1, total);
    }
    Ok(Sensitivity { groups: out })
}

/// A chosen mix and what it is predicted to cost.
#[derive(Debug, Clone, Serialize)]
pub struct Allocation {
    /// Weight name → type.
    pub choice: BTreeMap<String, GgmlType>,
    /// Tensor bytes of the whole file with this mix.
    pub tensor_bytes: u64,
    /// Predicted mean KLD against the input (sum of per-weight costs).
    pub predicted_kld: f64,
}

/// Tensor bytes of `file` with every allocatable weight at its smallest candidate type.
pub fn smallest_mix(file: &Gguf) -> u64 {
    file.tensors
        .iter()
        .map(|t| {
            if !is_quantizable(t) {
                return t.bytes();
            }
            CANDIDATES
                .iter()
                .map(|&want| {
                    effective_type(want, t.row_len()).bytes_for(t.elements() as usize) as u64
                })
                .min()
                .unwrap_or_else(|| t.bytes())
        })
        .sum()
}

/// Refuses a budget (tensor bytes) below [`smallest_mix`], before anything is measured.
pub fn check_budget(file: &Gguf, budget: u64) -> Result<()> {
    let smallest = smallest_mix(file);
    if budget < smallest {
        return Err(too_small(smallest, budget));
    }
    Ok(())
}

fn too_small(smallest: u64, budget: u64) -> QuantError {
    QuantError::Invalid(format!(
        "the smallest mix has {smallest} bytes of tensors ({:.1} MiB), more than the target {budget} ({:.1} MiB); \
         give a larger --target-size or --target-bpw",
        smallest as f64 / 1048576.0,
        budget as f64 / 1048576.0
    ))
}

/// Step 3: the mix of least predicted KLD whose tensor bytes fit `budget`, with every
/// other tensor of `file` counted at its current size.
pub fn allocate(
    file: &Gguf,
    table: &[WeightOptions],
    sens: &Sensitivity,
    budget: u64,
) -> Result<Allocation> {
    let fixed: u64 = {
        let chosen: std::collections::HashSet<usize> = table.iter().map(|w| w.index).collect();
        file.tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| !chosen.contains(i))
            .map(|(_, t)| t.bytes())
            .sum()
    };
    // Lower convex hull of (bytes, cost) per weight, from the largest option down.
    let hulls: Vec<Vec<(u64, f64, GgmlType)>> = table
        .iter()
        .map(|w| {
            let s = sens.groups.get(&w.group).map_or(0.0, |g| g.1);
            let mut pts: Vec<(u64, f64, GgmlType)> = w
                .options
                .iter()
                .map(|o| (o.bytes, s * o.error, o.ty))
                .collect();
            pts.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
            // Drop dominated points (more bytes, no less cost).
            let mut frontier: Vec<(u64, f64, GgmlType)> = Vec::new();
            for p in pts.into_iter().rev() {
                if frontier.last().is_none_or(|l| p.1 > l.1 && p.0 < l.0) {
                    frontier.push(p);
                }
            }
            // frontier: bytes descending, cost ascending… make it convex.
            let mut hull: Vec<(u64, f64, GgmlType)> = Vec::new();
            for p in frontier {
                while hull.len() >= 2 {
                    let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
                    let slope_ab = (b.1 - a.1) / (a.0 - b.0) as f64;
                    let slope_bp = (p.1 - b.1) / (b.0 - p.0) as f64;
                    if slope_bp <= slope_ab {
                        hull.pop();
                    } else {
                        break;
                    }
                }
                hull.push(p);
            }
            hull
        })
        .collect();
    let mut at = vec![0usize; hulls.len()];
    let mut bytes = fixed + hulls.iter().map(|h| h[0].0).sum::<u64>();
    let smallest = fixed
        + hulls
            .iter()
            .map(|h| h.last().expect("one option").0)
            .sum::<u64>();
    if budget < smallest {
        return Err(too_small(smallest, budget));
    }
    while bytes > budget {
        let mut best: Option<(f64, usize)> = None;
        for (k, h) in hulls.iter().enumerate() {
            if let Some(next) = h.get(at[k] + 1) {
                let cur = h[at[k]];
                let ratio = (next.1 - cur.1) / (cur.0 - next.0) as f64;
                if best.is_none_or(|(r, _)| ratio < r) {
                    best = Some((ratio, k));
                }
            }
        }
        let (_, k) = best.expect("budget is above the smallest mix");
        bytes -= hulls[k][at[k]].0 - hulls[k][at[k] + 1].0;
        at[k] += 1;
    }
    // The last step down may have freed far more than needed (a large weight changing
    // type): spend what is left on the steps back up that buy the most per byte and fit.
    loop {
        let mut best: Option<(f64, usize)> = None;
        for (k, h) in hulls.iter().enumerate() {
            if at[k] == 0 {
                continue;
            }
            let (cur, up) = (h[at[k]], h[at[k] - 1]);
            if bytes + (up.0 - cur.0) > budget {
                continue;
            }
            let gain = (cur.1 - up.1) / (up.0 - cur.0) as f64;
            if best.is_none_or(|(g, _)| gain > g) {
                best = Some((gain, k));
            }
        }
        let Some((_, k)) = best else { break };
        bytes += hulls[k][at[k] - 1].0 - hulls[k][at[k]].0;
        at[k] -= 1;
    }
    Ok(Allocation {
        choice: table
            .iter()
            .zip(&hulls)
            .zip(&at)
            .map(|((w, h), &a)| (w.name.clone(), h[a].2))
            .collect(),
        tensor_bytes: bytes,
        predicted_kld: hulls.iter().zip(&at).map(|(h, &a)| h[a].1).sum(),
    })
}

impl Allocation {
    /// The plan for `file`: chosen types for the allocated weights, the rest unchanged.
    pub fn plan(&self, file: &Gguf) -> Plan {
        Plan::with(file, |t| self.choice.get(&t.name).copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weights `a` (large) and `b` (small), each with three made-up options.
    fn toy() -> (tempfile::TempDir, Gguf, Vec<WeightOptions>, Sensitivity) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let specs: Vec<crate::gguf::TensorSpec> =
            [("blk.0.a.weight", 4096), ("blk.0.b.weight", 512)]
                .into_iter()
                .map(|(name, cols)| crate::gguf::TensorSpec {
                    name: name.into(),
                    dims: vec![cols, 1],
                    ty: GgmlType::F32,
                })
                .collect();
        crate::gguf::write(&path, &[], &specs, |i| {
            Ok(vec![0; specs[i].dims[0] as usize * 4])
        })
        .unwrap();
        let file = Gguf::open(&path).unwrap();
        let option = |ty, bytes, error| Candidate { ty, bytes, error };
        let table = vec![
            WeightOptions {
                index: 0,
                name: "blk.0.a.weight".into(),
                group: "a".into(),
                options: vec![
                    option(GgmlType::Q4_0, 2304, 8.0),
                    option(GgmlType::Q5_0, 2816, 2.0),
                    option(GgmlType::Q8_0, 4352, 0.1),
                ],
            },
            WeightOptions {
                index: 1,
                name: "blk.0.b.weight".into(),
                group: "b".into(),
                options: vec![
                    option(GgmlType::Q4_0, 288, 4.0),
                    option(GgmlType::Q5_0, 352, 1.0),
                    option(GgmlType::Q8_0, 544, 0.05),
                ],
            },
        ];
        let sens = Sensitivity {
            groups: [("a".to_owned(), (0.0, 1.0)), ("b".to_owned(), (0.0, 1.0))].into(),
        };
        (dir, file, table, sens)
    }

    #[test]
    fn allocation_fits_the_budget_and_spends_what_is_left() {
        let (_dir, file, table, sens) = toy();
        // Everything at Q8_0 fits.
        let all = allocate(&file, &table, &sens, 4352 + 544).unwrap();
        assert_eq!(all.choice["blk.0.a.weight"], GgmlType::Q8_0);
        assert_eq!(all.tensor_bytes, 4352 + 544);
        // The cheapest step down per unit of cost is `a` to Q5_0 (1.9 per 1536 bytes);
        // after it, 1536 − 100 bytes are left over, enough to keep `b` at Q8_0.
        let some = allocate(&file, &table, &sens, 4352 + 544 - 100).unwrap();
        assert_eq!(some.choice["blk.0.a.weight"], GgmlType::Q5_0);
        assert_eq!(some.choice["blk.0.b.weight"], GgmlType::Q8_0);
        assert!(
            (some.predicted_kld - 2.05).abs() < 1e-9,
            "{}",
            some.predicted_kld
        );
        // Just above the smallest mix: both at Q4_0, then the left-over bytes buy `b` back.
        let least = allocate(&file, &table, &sens, 2304 + 352).unwrap();
        assert_eq!(least.choice["blk.0.a.weight"], GgmlType::Q4_0);
        assert_eq!(least.choice["blk.0.b.weight"], GgmlType::Q5_0);
        assert!(least.tensor_bytes <= 2304 + 352);
        // Below it: a clear refusal.
        let err = allocate(&file, &table, &sens, 2000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("smallest mix"), "{err}");
        // Before measuring anything: the smallest types' real sizes (Q2_K's 84 bytes per
        // 256 values here).
        assert_eq!(smallest_mix(&file), (16 + 2) * 84);
        assert!(check_budget(&file, (16 + 2) * 84).is_ok());
        let err = check_budget(&file, 1000).unwrap_err().to_string();
        assert!(err.contains("larger --target-size"), "{err}");
    }

    #[test]
    fn groups_separate_first_and_last_layers() {
        assert_eq!(group_of("blk.0.ffn_down.weight", 30), "ffn_down@0");
        assert_eq!(group_of("blk.29.attn_v.weight", 30), "attn_v@29");
        assert_eq!(group_of("blk.1.attn_v.weight", 30), "attn_v@1-7");
        assert_eq!(group_of("blk.28.attn_v.weight", 30), "attn_v@22-28");
        assert_eq!(group_of("token_embd.weight", 30), "token_embd");
    }
}
