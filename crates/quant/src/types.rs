//! The GGML tensor types: ids, block sizes and byte sizes, and which of them this crate
//! can produce.

use std::fmt;
use std::str::FromStr;

/// A GGML tensor type, by its id in GGUF files (`ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

/// `(id, name, values per block, bytes per block)` for every type of llama.cpp 0c1e570
/// whose layout is fixed (ids 4 and 5 were removed from ggml and are never valid).
const TABLE: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
];

/// The types this crate quantizes to (and dequantizes from), smallest first by bits per
/// weight.
pub const QUANTIZABLE: &[GgmlType] = &[
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_XS,
    GgmlType::Q4_0,
    GgmlType::IQ4_NL,
    GgmlType::Q4_K,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_K,
    GgmlType::Q5_1,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

#[expect(missing_docs, reason = "the names are ggml's")]
impl GgmlType {
    pub const F32: Self = Self(0);
    pub const F16: Self = Self(1);
    pub const Q4_0: Self = Self(2);
    pub const Q4_1: Self = Self(3);
    pub const Q5_0: Self = Self(6);
    pub const Q5_1: Self = Self(7);
    pub const Q8_0: Self = Self(8);
    pub const Q2_K: Self = Self(10);
    pub const Q3_K: Self = Self(11);
    pub const Q4_K: Self = Self(12);
    pub const Q5_K: Self = Self(13);
    pub const Q6_K: Self = Self(14);
    pub const IQ4_NL: Self = Self(20);
    pub const IQ4_XS: Self = Self(23);
    pub const BF16: Self = Self(30);
}

impl GgmlType {
    fn entry(self) -> Option<&'static (u32, &'static str, usize, usize)> {
        TABLE.iter().find(|e| e.0 == self.0)
    }

    /// Whether the id is a type with a known layout.
    pub fn is_known(self) -> bool {
        self.entry().is_some()
    }

    /// ggml's name (`Q4_K`), or `type<id>` for an unknown id.
    pub fn name(self) -> String {
        self.entry()
            .map(|e| e.1.to_owned())
            .unwrap_or_else(|| format!("type{}", self.0))
    }

    /// Values per block (0 for an unknown type).
    pub fn block_size(self) -> usize {
        self.entry().map_or(0, |e| e.2)
    }

    /// Bytes per block (0 for an unknown type).
    pub fn type_size(self) -> usize {
        self.entry().map_or(0, |e| e.3)
    }

    /// Bits per weight.
    pub fn bpw(self) -> f64 {
        match self.entry() {
            Some(e) => e.3 as f64 * 8.0 / e.2 as f64,
            None => 0.0,
        }
    }

    /// Bytes of `n` values (`n` a multiple of the block size).
    pub fn bytes_for(self, n: usize) -> usize {
        match self.block_size() {
            0 => 0,
            b => n / b * self.type_size(),
        }
    }

    /// Whether this crate can quantize to (and dequantize from) this type.
    pub fn is_quantizable(self) -> bool {
        QUANTIZABLE.contains(&self)
    }

    /// Whether the importance matrix changes how this type is quantized (as in ggml:
    /// every type here except Q8_0 and the float types).
    pub fn uses_importance(self) -> bool {
        self.is_quantizable() && !matches!(self, Self::Q8_0 | Self::F16 | Self::BF16 | Self::F32)
    }

    /// Whether candle 0.11 can read this type (so agentstack-model can load it directly).
    pub fn candle_reads(self) -> bool {
        matches!(self.0, 0..=3 | 6..=15 | 30)
    }

    /// The type llama.cpp falls back to when a row length is not a multiple of this
    /// type's block size (`llama-quantize`'s rule for 256-value types), if any.
    pub fn fallback(self) -> Option<Self> {
        match self {
            Self::Q2_K | Self::Q3_K => Some(Self::Q4_0),
            Self::Q4_K => Some(Self::Q5_0),
            Self::Q5_K => Some(Self::Q5_1),
            Self::Q6_K => Some(Self::Q8_0),
            Self::IQ4_XS => Some(Self::IQ4_NL),
            _ => None,
        }
    }

    /// The `general.file_type` (`llama_ftype`) of a file whose main type is this one.
    pub fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 7,
            Self::Q5_0 => 8,
            Self::Q5_1 => 9,
            Self::Q2_K => 10,
            Self::Q3_K => 12, // Q3_K_M
            Self::Q4_K => 15, // Q4_K_M
            Self::Q5_K => 17, // Q5_K_M
            Self::Q6_K => 18,
            Self::IQ4_NL => 25,
            Self::IQ4_XS => 30,
            Self::BF16 => 32,
            _ => 1024, // LLAMA_FTYPE_GUESSED
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl serde::Serialize for GgmlType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl FromStr for GgmlType {
    type Err = String;

    /// Parses a type name as llama.cpp spells it, in any case (`q4_k`, `IQ4_XS`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let upper = s.to_ascii_uppercase();
        TABLE
            .iter()
            .find(|e| e.1 == upper)
            .map(|e| Self(e.0))
            .filter(|t| t.is_quantizable())
            .ok_or_else(|| {
                let names: Vec<String> = QUANTIZABLE.iter().map(|t| t.name()).collect();
                format!(
                    "unknown or unsupported type `{s}`; choose one of: {}",
                    names.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_reference_table() {
        assert_eq!(GgmlType::Q2_K.bpw(), 2.625);
        assert_eq!(GgmlType::Q3_K.bpw(), 3.4375);
        assert_eq!(GgmlType::Q6_K.bpw(), 6.5625);
        assert_eq!(GgmlType::IQ4_XS.bpw(), 4.25);
        assert_eq!(GgmlType::Q8_0.bytes_for(64), 68);
    }

    #[test]
    fn names_parse_in_any_case_and_unknown_ones_say_what_exists() {
        assert_eq!("q4_k".parse::<GgmlType>(), Ok(GgmlType::Q4_K));
        assert_eq!("IQ4_NL".parse::<GgmlType>(), Ok(GgmlType::IQ4_NL));
        let err = "q3_k_xl".parse::<GgmlType>().unwrap_err();
        assert!(err.contains("Q4_K") && err.contains("q3_k_xl"), "{err}");
        // Known but not producible here.
        assert!("IQ2_XXS".parse::<GgmlType>().is_err());
    }
}
