//! Per-tensor type allocation under a size budget, from measured sensitivity.
//!
//! 1. **Error table.** Every quantizable weight is quantized to every candidate type
//!    (after llama.cpp's fallback for its row length), and the importance-weighted squared
//!    error `E(t, T) = Σ_col imp_col · Σ_row Δw²` is recorded with the bytes: `E` is the
//!    expected squared error of that matmul's output over the calibration activations.
//! 2. **Sensitivity.** Weights are grouped by kind and layer band (first and last layers
//!    alone). For each group the runtime measures the mean KLD on calibration text when
//!    only that group is quantized to its smallest candidate, against a model whose
//!    weights are all the exact f32 values of the input (so compute-path noise is not
//!    measured). `s_g = KLD_g / Σ_{t∈g} E(t, probe)`: KLD per unit of output error.
//! 3. **Allocation.** Predicted cost `c(t, T) = s_g · E(t, T)`; each weight's candidates
//!    are reduced to their lower convex hull in (bytes, cost), and the steps down the
//!    hulls are taken greedily by marginal KLD per byte saved until the file fits.
//! 4. **Verification** is the caller's: quantize with the plan and measure
//!    (`kld::compare`); the prediction assumes costs add across weights.

use std::collections::BTreeMap;

use agentstack_model::model::Linear;
use agentstack_model::{LanguageModel, Model};
use candle_core::{Device, Tensor};
use serde::Serialize;

use crate::error::{QuantError, Result};
use crate::gguf::Gguf;
use crate::imatrix::Imatrix;
use crate::kld::{Accumulator, chunks, scored_log_probs};
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

/// Which weights take part: the blocks' matrices. The token embedding (tied to the output
/// here) stays as it is, as in llama.cpp's mixes for this model.
fn allocatable(file: &Gguf) -> Vec<usize> {
    (0..file.tensors.len())
        .filter(|&i| is_quantizable(&file.tensors[i]) && file.tensors[i].name.starts_with("blk."))
        .collect()
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
        let imp = imatrix.importance(&info.name).ok_or_else(|| {
            QuantError::Invalid(format!(
                "the importance matrix has no entry for {}; was it collected on this model?",
                info.name
            ))
        })?;
        let mut options: Vec<Candidate> = Vec::new();
        for &want in CANDIDATES {
            let ty = effective_type(want, cols);
            if options.iter().any(|o| o.ty == ty) {
                continue;
            }
            let q = crate::quantize::quantize(ty, &w, cols, Some(&imp)).map_err(|reason| {
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
                .map(|(j, (a, b))| f64::from(imp[j % cols]) * f64::from(a - b).powi(2))
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

/// Step 2: measures each group's sensitivity on `tokens` (chunks of `ctx`).
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
    let mut base = lm.model().clone();
    for w in table {
        let values = file.read_f32(w.index)?;
        let dims = file.tensors[w.index].dims.clone();
        *linear_of(&mut base, &w.name)
            .ok_or_else(|| QuantError::Invalid(format!("no layer for {}", w.name)))? =
            dense(values, &dims)?;
    }
    let chunks = chunks(tokens, ctx, None)?;
    let base_rows: Vec<Vec<Vec<f32>>> = chunks
        .iter()
        .map(|c| scored_log_probs(&base, c))
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
            *linear_of(&mut probe, &w.name).expect("checked above") = dense(back, &info.dims)?;
        }
        let mut acc = Accumulator::default();
        for (c, rows) in chunks.iter().zip(&base_rows) {
            let mine = scored_log_probs(&probe, c)?;
            for (j, (a, b)) in rows.iter().zip(&mine).enumerate() {
                acc.add(a, b, c[ctx / 2 + j + 1]);
            }
        }
        let kld = acc.stats().kld_mean;
        out.insert(
            name.to_owned(),
            (kld, if error > 0.0 { kld / error } else { 0.0 }),
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
        return Err(QuantError::Invalid(format!(
            "the smallest mix has {smallest} bytes of tensors ({:.1} MiB), more than the target {budget} ({:.1} MiB); \
             give a larger --target-size or --target-bpw",
            smallest as f64 / 1048576.0,
            budget as f64 / 1048576.0
        )));
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

    #[test]
    fn groups_separate_first_and_last_layers() {
        assert_eq!(group_of("blk.0.ffn_down.weight", 30), "ffn_down@0");
        assert_eq!(group_of("blk.29.attn_v.weight", 30), "attn_v@29");
        assert_eq!(group_of("blk.1.attn_v.weight", 30), "attn_v@1-7");
        assert_eq!(group_of("blk.28.attn_v.weight", 30), "attn_v@22-28");
        assert_eq!(group_of("token_embd.weight", 30), "token_embd");
    }
}
