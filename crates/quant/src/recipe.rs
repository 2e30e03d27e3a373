//! Which type each tensor gets, and writing the quantized file.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{QuantError, Result};
use crate::gguf::{self, Gguf, TensorInfo, TensorSpec, Value};
use crate::imatrix::Imatrix;
use crate::types::GgmlType;

/// Whether llama-quantize would quantize this tensor at all: 2-D weights, not norms (the
/// rule of `tensor_allows_quantization` for the llama family).
pub fn is_quantizable(t: &TensorInfo) -> bool {
    t.dims.len() >= 2 && t.name.ends_with("weight") && !t.name.contains("_norm")
}

/// The type `want` becomes for a tensor with rows of `row_len` (llama.cpp's fallback for
/// shapes a 256-value type cannot hold: 576-wide rows make Q4_K into Q5_0, and so on).
pub fn effective_type(want: GgmlType, row_len: usize) -> GgmlType {
    if row_len.is_multiple_of(want.block_size()) {
        return want;
    }
    match want.fallback() {
        Some(f) if row_len.is_multiple_of(f.block_size()) => f,
        _ => GgmlType::F16,
    }
}

/// A type for every tensor of a file.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Tensor name → type, for every tensor in file order.
    pub types: Vec<(String, GgmlType)>,
}

impl Plan {
    /// Every quantizable tensor at `ty` (after fallback), the rest as they are — what
    /// `llama-quantize --pure` does.
    pub fn uniform(file: &Gguf, ty: GgmlType) -> Self {
        Self::with(file, |_| Some(ty))
    }

    /// Each quantizable tensor at `choose(tensor)` (after fallback; `None` keeps it).
    pub fn with(file: &Gguf, mut choose: impl FnMut(&TensorInfo) -> Option<GgmlType>) -> Self {
        Self {
            types: file
                .tensors
                .iter()
                .map(|t| {
                    let ty = if is_quantizable(t) {
                        choose(t).map_or(t.ty, |want| effective_type(want, t.row_len()))
                    } else {
                        t.ty
                    };
                    (t.name.clone(), ty)
                })
                .collect(),
        }
    }

    /// Tensor bytes of the file this plan makes.
    pub fn tensor_bytes(&self, file: &Gguf) -> u64 {
        file.tensors
            .iter()
            .zip(&self.types)
            .map(|(t, (_, ty))| ty.bytes_for(t.elements() as usize) as u64)
            .sum()
    }

    /// The most common quantized type (for `general.file_type`).
    pub fn main_type(&self, file: &Gguf) -> GgmlType {
        let mut by: BTreeMap<GgmlType, u64> = BTreeMap::new();
        for (t, (_, ty)) in file.tensors.iter().zip(&self.types) {
            if is_quantizable(t) {
                *by.entry(*ty).or_default() += t.elements();
            }
        }
        by.into_iter()
            .max_by_key(|(_, n)| *n)
            .map_or(GgmlType::F32, |(t, _)| t)
    }
}

/// What [`quantize_file`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Bytes of the file written.
    pub file_bytes: u64,
    /// Bytes of tensor data.
    pub tensor_bytes: u64,
    /// Bits per weight over all tensors.
    pub bpw: f64,
    /// Parameters per type.
    pub by_type: BTreeMap<String, u64>,
}

/// Writes `input` quantized by `plan` to `output` (atomically). Tensors whose type does
/// not change are copied byte for byte; the others are dequantized to f32 and quantized,
/// with `imatrix`'s importance for the weight when it has an entry. Every metadata key is
/// kept; `general.file_type` and `general.quantization_version` are set.
pub fn quantize_file(
    input: &mut Gguf,
    output: &Path,
    plan: &Plan,
    imatrix: Option<&Imatrix>,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Report> {
    if plan.types.len() != input.tensors.len() {
        return Err(QuantError::Invalid(
            "the plan does not cover the file's tensors".into(),
        ));
    }
    let mut metadata = input.metadata.clone();
    gguf::set(&mut metadata, "general.quantization_version", Value::U32(2));
    gguf::set(
        &mut metadata,
        "general.file_type",
        Value::U32(plan.main_type(input).file_type()),
    );
    if let Some(m) = imatrix {
        if let Some(d) = m.datasets.first() {
            gguf::set(
                &mut metadata,
                "quantize.imatrix.dataset",
                Value::String(d.clone()),
            );
        }
        gguf::set(
            &mut metadata,
            "quantize.imatrix.entries_count",
            Value::I32(m.entries.len() as i32),
        );
        gguf::set(
            &mut metadata,
            "quantize.imatrix.chunks_count",
            Value::I32(m.chunk_count as i32),
        );
    }
    let specs: Vec<TensorSpec> = input
        .tensors
        .iter()
        .zip(&plan.types)
        .map(|(t, (name, ty))| {
            debug_assert_eq!(&t.name, name);
            TensorSpec {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ty: *ty,
            }
        })
        .collect();
    for (t, s) in input.tensors.iter().zip(&specs) {
        if s.ty != t.ty && !(s.ty.is_quantizable() && t.ty.is_quantizable()) {
            return Err(QuantError::Unquantizable {
                name: t.name.clone(),
                reason: format!("cannot convert {} to {}", t.ty, s.ty),
            });
        }
    }
    let total = specs.len();
    let mut by_type: BTreeMap<String, u64> = BTreeMap::new();
    for (t, s) in input.tensors.iter().zip(&specs) {
        *by_type.entry(s.ty.name()).or_default() += t.elements();
    }
    let file_bytes = gguf::write(output, &metadata, &specs, |i| {
        let (name, ty) = (&specs[i].name, specs[i].ty);
        progress(i, total, name);
        let info = input.tensors[i].clone();
        if ty == info.ty {
            return input.read(i);
        }
        let data = input.read_f32(i)?;
        let importance = match imatrix {
            Some(m) if ty.uses_importance() => m.importance(name),
            _ => None,
        };
        if let Some(w) = &importance
            && w.len() != info.row_len()
        {
            return Err(QuantError::Unquantizable {
                name: name.clone(),
                reason: format!(
                    "the importance matrix has {} columns for rows of {}; was it made for another model?",
                    w.len(),
                    info.row_len()
                ),
            });
        }
        crate::quantize::quantize(ty, &data, info.row_len(), importance.as_deref()).map_err(
            |reason| QuantError::Unquantizable {
                name: name.clone(),
                reason,
            },
        )
    })?;
    progress(total, total, "");
    let tensor_bytes = plan.tensor_bytes(input);
    Ok(Report {
        file_bytes,
        tensor_bytes,
        bpw: tensor_bytes as f64 * 8.0 / input.parameters().max(1) as f64,
        by_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_follows_llama_quantize() {
        assert_eq!(effective_type(GgmlType::Q4_K, 576), GgmlType::Q5_0);
        assert_eq!(effective_type(GgmlType::Q2_K, 576), GgmlType::Q4_0);
        assert_eq!(effective_type(GgmlType::IQ4_XS, 576), GgmlType::IQ4_NL);
        assert_eq!(effective_type(GgmlType::Q6_K, 576), GgmlType::Q8_0);
        assert_eq!(effective_type(GgmlType::Q4_K, 1536), GgmlType::Q4_K);
        assert_eq!(effective_type(GgmlType::Q4_0, 48), GgmlType::F16);
    }
}
