//! Importance matrices: Σx² per input column of every weight matrix, collected by the
//! model runtime over calibration text, and llama.cpp's two file formats for them.
//!
//! llama.cpp's GGUF format (`llama-imatrix`'s default) stores, per weight, a tensor
//! `<name>.in_sum2` (Σx² per column) and `<name>.counts` (tokens seen), with
//! `general.type = "imatrix"`, `imatrix.datasets`, `imatrix.chunk_count` and
//! `imatrix.chunk_size`. The legacy `.dat` format stores per weight `(Σx²/tokens)·ncall`
//! and `ncall` (chunks), then the chunk count and the dataset name. Both read back to the
//! same importance vectors, the mean of x² per column, which is what `llama-quantize`
//! gives the quantizers.

use std::collections::BTreeMap;
use std::path::Path;

use agentstack_model::{Logits, Model, SeqInput};
use candle_core::{DType, Tensor};

use crate::error::{QuantError, Result};
use crate::gguf::{self, Gguf, TensorSpec, Value};
use crate::types::GgmlType;

/// Statistics of one weight's input.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Σx² per input column.
    pub sums: Vec<f32>,
    /// Input rows (tokens) summed.
    pub count: f64,
}

/// An importance matrix.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Imatrix {
    /// Per weight (GGUF tensor name).
    pub entries: BTreeMap<String, Entry>,
    /// Chunks of calibration text seen.
    pub chunk_count: u32,
    /// Tokens per chunk.
    pub chunk_size: u32,
    /// Where the calibration text came from.
    pub datasets: Vec<String>,
}

impl Imatrix {
    /// The importance of each input column of `weight` (mean x²), as llama-quantize
    /// passes it to the quantizers.
    pub fn importance(&self, weight: &str) -> Option<Vec<f32>> {
        let e = self.entries.get(weight)?;
        Some(if e.count > 0.0 {
            e.sums
                .iter()
                .map(|s| (f64::from(*s) / e.count) as f32)
                .collect()
        } else {
            vec![1.0; e.sums.len()]
        })
    }

    /// Collects the importance matrix of `model` over `tokens`, cut into chunks of
    /// `chunk_size` tokens (each run from an empty cache, as `llama-imatrix` does).
    /// With `process_output` the output projection is collected too, over every position
    /// (`llama-imatrix --process-output`); without, only the blocks' weights are.
    /// `progress(done, total)` is called after each chunk.
    pub fn collect(
        model: &Model,
        tokens: &[u32],
        chunk_size: usize,
        dataset: &str,
        process_output: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        if chunk_size < 2 {
            return Err(QuantError::Invalid(
                "the chunk size must be at least 2 tokens".into(),
            ));
        }
        let chunks = tokens.len() / chunk_size;
        if chunks == 0 {
            return Err(QuantError::Invalid(format!(
                "the calibration text has {} tokens, fewer than one chunk of {chunk_size}; \
                 give a longer text or a smaller chunk size",
                tokens.len()
            )));
        }
        let mut sums: BTreeMap<String, (Vec<f64>, f64)> = BTreeMap::new();
        for (i, chunk) in tokens.chunks_exact(chunk_size).enumerate() {
            let mut cache = model.new_cache();
            let mut observer = |names: &[String], x: &Tensor| -> agentstack_model::Result<()> {
                let x = x.to_dtype(DType::F32)?;
                let sq = x.sqr()?.sum(0)?.to_vec1::<f32>()?;
                let rows = x.dim(0)? as f64;
                for name in names {
                    if !process_output && !name.starts_with("blk.") {
                        continue;
                    }
                    let e = sums
                        .entry(name.clone())
                        .or_insert_with(|| (vec![0.0; sq.len()], 0.0));
                    for (a, v) in e.0.iter_mut().zip(&sq) {
                        *a += f64::from(*v);
                    }
                    e.1 += rows;
                }
                Ok(())
            };
            model.forward_observed(
                &mut [SeqInput {
                    cache: &mut cache,
                    tokens: chunk,
                    logits: if process_output {
                        Logits::All
                    } else {
                        Logits::Last
                    },
                }],
                Some(&mut observer),
            )?;
            progress(i + 1, chunks);
        }
        Ok(Self {
            entries: sums
                .into_iter()
                .map(|(k, (s, c))| {
                    (
                        k,
                        Entry {
                            sums: s.into_iter().map(|v| v as f32).collect(),
                            count: c,
                        },
                    )
                })
                .collect(),
            chunk_count: chunks as u32,
            chunk_size: chunk_size as u32,
            datasets: vec![dataset.to_owned()],
        })
    }

    /// Reads either format (GGUF first, then legacy `.dat`).
    pub fn load(path: &Path) -> Result<Self> {
        let bad = |reason: String| QuantError::BadImatrix {
            path: path.to_path_buf(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|source| QuantError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let m = if bytes.starts_with(b"GGUF") {
            Self::load_gguf(path)?
        } else {
            Self::parse_dat(&bytes).map_err(bad)?
        };
        m.check().map_err(bad)?;
        Ok(m)
    }

    /// Sums of squares are finite and not negative, and counts whole: a damaged file
    /// would otherwise weight a quantizer's search with NaN or infinity.
    fn check(&self) -> Result<(), String> {
        for (name, e) in &self.entries {
            // Counts are tokens (or llama.cpp's call counts): whole, so 0 or at least 1.
            if !(e.count.is_finite() && (e.count == 0.0 || e.count >= 1.0)) {
                return Err(format!(
                    "`{name}` has the count {}; counts are 0 or a number of tokens",
                    e.count
                ));
            }
            if let Some(v) = e.sums.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
                return Err(format!(
                    "`{name}` has the sum of squares {v}; sums of squares are finite and not negative"
                ));
            }
        }
        Ok(())
    }

    fn load_gguf(path: &Path) -> Result<Self> {
        let bad = |reason: String| QuantError::BadImatrix {
            path: path.to_path_buf(),
            reason,
        };
        let mut g = Gguf::open(path)?;
        if g.get("general.type").and_then(Value::as_str) != Some("imatrix") {
            return Err(bad(
                "a GGUF file without general.type = \"imatrix\" (is this a model, not an importance matrix?)"
                    .into(),
            ));
        }
        let u32_of = |k: &str| g.get(k).and_then(Value::as_u64).unwrap_or(0) as u32;
        let (chunk_count, chunk_size) =
            (u32_of("imatrix.chunk_count"), u32_of("imatrix.chunk_size"));
        let datasets = match g.get("imatrix.datasets") {
            Some(Value::Array(_, items)) => items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        };
        let mut entries = BTreeMap::new();
        for i in 0..g.tensors.len() {
            let name = g.tensors[i].name.clone();
            let Some(weight) = name.strip_suffix(".in_sum2") else {
                continue;
            };
            let counts_name = format!("{weight}.counts");
            let j = g
                .tensors
                .iter()
                .position(|t| t.name == counts_name)
                .ok_or_else(|| bad(format!("`{name}` has no `{counts_name}`")))?;
            let sums = g.read_f32(i)?;
            let counts = g.read_f32(j)?;
            if counts.len() != 1 {
                return Err(bad(format!(
                    "`{weight}` has {} matrices (mixture-of-experts importance is not supported)",
                    counts.len()
                )));
            }
            entries.insert(
                weight.to_owned(),
                Entry {
                    sums,
                    count: f64::from(counts[0]),
                },
            );
        }
        if entries.is_empty() {
            return Err(bad("no `*.in_sum2` tensors".into()));
        }
        Ok(Self {
            entries,
            chunk_count,
            chunk_size,
            datasets,
        })
    }

    fn parse_dat(b: &[u8]) -> Result<Self, String> {
        let mut at = 0usize;
        let i32_at = |at: &mut usize| -> Result<i32, String> {
            let v = b.get(*at..*at + 4).ok_or(
                "the file ends early (neither a GGUF nor a legacy .dat importance matrix?)",
            )?;
            *at += 4;
            Ok(i32::from_le_bytes(v.try_into().expect("4 bytes")))
        };
        let n = i32_at(&mut at)?;
        if !(1..=1 << 20).contains(&n) {
            return Err(format!(
                "{n} entries; this is not a legacy .dat importance matrix"
            ));
        }
        let mut entries = BTreeMap::new();
        for _ in 0..n {
            let len = i32_at(&mut at)?;
            if !(1..=4096).contains(&len) {
                return Err(format!("an entry name of {len} bytes"));
            }
            let name = b
                .get(at..at + len as usize)
                .ok_or("the file ends inside a name")?;
            let name = String::from_utf8(name.to_vec()).map_err(|_| "a name is not UTF-8")?;
            at += len as usize;
            let ncall = i32_at(&mut at)?;
            let nval = i32_at(&mut at)?;
            if nval < 1 {
                return Err(format!("`{name}` has {nval} values"));
            }
            let raw = b
                .get(at..at + 4 * nval as usize)
                .ok_or_else(|| format!("the file ends inside `{name}`"))?;
            at += 4 * nval as usize;
            let vals: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            // Stored as (Σx²/tokens)·ncall: keep the mean as sums over `ncall` "tokens".
            entries.insert(
                name,
                Entry {
                    sums: vals,
                    count: f64::from(ncall.max(0)),
                },
            );
        }
        let mut chunk_count = 0;
        let mut datasets = Vec::new();
        if at < b.len() {
            chunk_count = i32_at(&mut at)?.max(0) as u32;
            if at < b.len() {
                let len = i32_at(&mut at)?;
                if len > 0
                    && let Some(d) = b.get(at..at + len as usize)
                {
                    datasets.push(String::from_utf8_lossy(d).into_owned());
                }
            }
        }
        Ok(Self {
            entries,
            chunk_count,
            chunk_size: 0,
            datasets,
        })
    }

    /// Writes llama.cpp's GGUF imatrix format (atomically).
    pub fn save_gguf(&self, path: &Path) -> Result<()> {
        let metadata = vec![
            ("general.type".to_owned(), Value::String("imatrix".into())),
            (
                "imatrix.datasets".to_owned(),
                Value::Array(
                    8,
                    self.datasets
                        .iter()
                        .map(|d| Value::String(d.clone()))
                        .collect(),
                ),
            ),
            (
                "imatrix.chunk_count".to_owned(),
                Value::U32(self.chunk_count),
            ),
            ("imatrix.chunk_size".to_owned(), Value::U32(self.chunk_size)),
        ];
        let mut specs = Vec::new();
        let mut data = Vec::new();
        for (name, e) in &self.entries {
            specs.push(TensorSpec {
                name: format!("{name}.in_sum2"),
                dims: vec![e.sums.len() as u64, 1],
                ty: GgmlType::F32,
            });
            data.push(
                e.sums
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            );
            specs.push(TensorSpec {
                name: format!("{name}.counts"),
                dims: vec![1, 1],
                ty: GgmlType::F32,
            });
            data.push((e.count as f32).to_le_bytes().to_vec());
        }
        gguf::write(path, &metadata, &specs, |i| {
            Ok(std::mem::take(&mut data[i]))
        })?;
        Ok(())
    }

    /// Writes llama.cpp's legacy `.dat` format (atomically).
    pub fn save_dat(&self, path: &Path) -> Result<()> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.entries.len() as i32).to_le_bytes());
        let ncall = self.chunk_count.max(1) as i32;
        for (name, e) in &self.entries {
            out.extend_from_slice(&(name.len() as i32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&ncall.to_le_bytes());
            out.extend_from_slice(&(e.sums.len() as i32).to_le_bytes());
            let count = if e.count > 0.0 { e.count } else { 1.0 };
            for s in &e.sums {
                let v = (f64::from(*s) / count * f64::from(ncall)) as f32;
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.extend_from_slice(&(self.chunk_count as i32).to_le_bytes());
        let dataset = self.datasets.last().cloned().unwrap_or_default();
        out.extend_from_slice(&(dataset.len() as i32).to_le_bytes());
        out.extend_from_slice(dataset.as_bytes());
        gguf::write_atomic(path, &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Importance read back from the legacy format passes through f32 `(Σ/n)·ncall`.
    const DAT_RELATIVE_TOLERANCE: f32 = 1e-5;

    fn sample() -> Imatrix {
        let mut entries = BTreeMap::new();
        entries.insert(
            "blk.0.attn_q.weight".to_owned(),
            Entry {
                sums: (0..64).map(|i| i as f32 * 0.5 + 0.1).collect(),
                count: 512.0,
            },
        );
        entries.insert(
            "blk.0.ffn_down.weight".to_owned(),
            Entry {
                sums: (0..96).map(|i| 1.0 / (i as f32 + 1.0)).collect(),
                count: 512.0,
            },
        );
        Imatrix {
            entries,
            chunk_count: 2,
            chunk_size: 256,
            datasets: vec!["calibration.txt".into()],
        }
    }

    #[test]
    fn both_formats_round_trip_to_the_same_importance() {
        let dir = tempfile::tempdir().unwrap();
        let m = sample();
        let (g, d) = (dir.path().join("i.gguf"), dir.path().join("i.dat"));
        m.save_gguf(&g).unwrap();
        m.save_dat(&d).unwrap();
        let from_gguf = Imatrix::load(&g).unwrap();
        assert_eq!(from_gguf, m);
        let from_dat = Imatrix::load(&d).unwrap();
        assert_eq!(from_dat.chunk_count, 2);
        assert_eq!(from_dat.datasets, m.datasets);
        for name in m.entries.keys() {
            let (a, b) = (
                m.importance(name).unwrap(),
                from_dat.importance(name).unwrap(),
            );
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= DAT_RELATIVE_TOLERANCE * x.abs(),
                    "{name}: {x} vs {y}"
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]

        /// Damaged importance files of either format are refused or read; never a panic.
        #[test]
        fn damaged_files_never_panic_the_reader(
            gguf in proptest::bool::ANY,
            edits in proptest::collection::vec((0usize..2048, proptest::num::u8::ANY), 1..8),
            cut in proptest::option::of(0usize..2048),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("i");
            if gguf {
                sample().save_gguf(&path).unwrap();
            } else {
                sample().save_dat(&path).unwrap();
            }
            let bytes = crate::testing::damage(std::fs::read(&path).unwrap(), &edits, cut);
            std::fs::write(&path, &bytes).unwrap();
            if let Ok(m) = Imatrix::load(&path) {
                for name in m.entries.keys() {
                    let imp = m.importance(name).unwrap();
                    proptest::prop_assert!(imp.iter().all(|v| v.is_finite() && *v >= 0.0));
                }
            }
        }
    }

    #[test]
    fn garbage_and_models_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, b"hello").unwrap();
        let err = Imatrix::load(&p).unwrap_err().to_string();
        assert!(err.contains("not a valid importance matrix"), "{err}");
        let model = dir.path().join("m.gguf");
        gguf::write(
            &model,
            &[("general.type".into(), Value::String("model".into()))],
            &[],
            |_| Ok(vec![]),
        )
        .unwrap();
        let err = Imatrix::load(&model).unwrap_err().to_string();
        assert!(err.contains("is this a model"), "{err}");
    }
}
