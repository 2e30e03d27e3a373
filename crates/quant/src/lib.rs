//! Quantization with honest quality measurement.
//!
//! `agentstack-quant` turns a GGUF model into a smaller GGUF model and says how much worse
//! it got, in the statistics llama.cpp reports:
//!
//! - [`gguf`]: a GGUF v3 reader and writer under llama.cpp's stricter rules (contiguous,
//!   aligned offsets in tensor order; `general.alignment`), keeping every metadata key;
//! - [`quantize`]: quantizers and dequantizers for Q8_0, Q5_0/1, Q4_0/1, Q2_K–Q6_K,
//!   IQ4_NL and IQ4_XS, ported from ggml so llama.cpp accepts the bytes, with optional
//!   importance weighting;
//! - [`imatrix`]: importance matrices collected by the model runtime, in llama.cpp's
//!   GGUF and legacy `.dat` formats;
//! - [`recipe`]: a type per tensor (with llama-quantize's fallbacks) and writing the file;
//! - [`kld`]: KLD and perplexity against a base, as `llama-perplexity --kl-divergence`;
//! - [`allocate`]: per-weight types under a size budget from measured sensitivity;
//! - [`plot`]: the size-vs-KLD chart;
//! - [`types`]: the GGML type table.
//!
//! ```no_run
//! use agentstack_quant::{quantize, types::GgmlType};
//!
//! let weights = vec![0.25f32; 512];
//! let bytes = quantize::quantize(GgmlType::Q4_K, &weights, 256, None).unwrap();
//! let back = quantize::dequantize(GgmlType::Q4_K, &bytes, 512).unwrap();
//! assert!((back[0] - 0.25).abs() < 0.01);
//! ```

pub mod allocate;
mod error;
pub mod gguf;
pub mod imatrix;
pub mod kld;
pub mod plot;
pub mod quantize;
pub mod recipe;
pub mod types;

pub use crate::error::{QuantError, Result};

/// candle's name for a type, where candle has one.
pub fn candle_dtype(ty: types::GgmlType) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as D;
    use types::GgmlType as G;
    Some(match ty {
        G::F32 => D::F32,
        G::F16 => D::F16,
        G::BF16 => D::BF16,
        G::Q4_0 => D::Q4_0,
        G::Q4_1 => D::Q4_1,
        G::Q5_0 => D::Q5_0,
        G::Q5_1 => D::Q5_1,
        G::Q8_0 => D::Q8_0,
        G::Q2_K => D::Q2K,
        G::Q3_K => D::Q3K,
        G::Q4_K => D::Q4K,
        G::Q5_K => D::Q5K,
        G::Q6_K => D::Q6K,
        _ => return None,
    })
}

/// Helpers of this crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    /// `bytes` with bytes overwritten (`(position mod length, value)`) and then cut to
    /// `cut`, as a damaged download or a half-written file would be.
    pub(crate) fn damage(mut bytes: Vec<u8>, edits: &[(usize, u8)], cut: Option<usize>) -> Vec<u8> {
        for &(at, b) in edits {
            let at = at % bytes.len();
            bytes[at] = b;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.min(bytes.len()));
        }
        bytes
    }
}
