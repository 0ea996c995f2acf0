//! A checkpoint directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, or (as a fallback) every `*.safetensors` file in the folder.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use rayon::prelude::*;

use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::safetensors::{SafetensorsFile, TensorView};

pub struct Checkpoint {
    pub dir: PathBuf,
    tensors: BTreeMap<String, TensorView>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = read_regular_file(&index)?;
            let v: Value =
                serde_json::from_str(&text).map_err(|e| Error::Checkpoint { file: index.clone(), msg: format!("invalid JSON: {e}") })?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::Checkpoint { file: index.clone(), msg: "no `weight_map` object".into() })?;
            let names: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
            // Only files inside the folder: a plain relative name, no `..`, no absolute path.
            for n in &names {
                let inside = !n.is_empty() && Path::new(n).components().all(|c| matches!(c, Component::Normal(_)));
                if !inside {
                    return Err(Error::Checkpoint {
                        file: index.clone(),
                        msg: format!("`weight_map` names `{n}`, which is not a file inside the model folder"),
                    });
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::Io { path: dir.to_path_buf(), msg: e.to_string() })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(Error::Checkpoint { file: dir.to_path_buf(), msg: "no .safetensors files found".into() });
        }
        let mut tensors = BTreeMap::new();
        for f in files {
            if !f.exists() {
                return Err(Error::Checkpoint { file: f, msg: "listed in the index but missing".into() });
            }
            if !f.is_file() {
                return Err(Error::Checkpoint { file: f, msg: "not a regular file".into() });
            }
            let st = SafetensorsFile::open(&f)?;
            for (name, t) in st.tensors {
                tensors.entry(name).or_insert(t);
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), tensors })
    }

    /// Refuses a checkpoint with a NaN or infinite value in any float tensor (naming the
    /// tensor). One pass over the data, split into blocks scanned in parallel; only the
    /// exponent bits are looked at.
    pub fn check_finite(&self) -> Result<()> {
        const BLOCK: usize = 1 << 20;
        let mut jobs = Vec::new();
        for t in self.tensors.values() {
            let size = match t.dtype {
                DType::F32 | DType::F16 | DType::BF16 => t.dtype.size(),
                _ => continue,
            };
            let n = t.bytes.len();
            let step = BLOCK / size * size;
            jobs.extend((0..n).step_by(step).map(|s| (t, s..(s + step).min(n))));
        }
        let bad = jobs.par_iter().find_map_any(|(t, r)| {
            let b = &t.bytes.as_slice()[r.clone()];
            let at = match t.dtype {
                DType::F32 => b.chunks_exact(4).position(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000 == 0x7f80_0000),
                DType::F16 => b.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00),
                _ => b.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80),
            };
            at.map(|i| (*t, (r.start / t.dtype.size()) + i))
        });
        match bad {
            Some((t, i)) => Err(t.err(format!("holds a non-finite value (NaN or infinity) at element {i}"))),
            None => Ok(()),
        }
    }

    pub fn get(&self, name: &str) -> Option<&TensorView> {
        self.tensors.get(name)
    }

    /// The tensor or an error naming the checkpoint folder and the tensor.
    pub fn require(&self, name: &str) -> Result<&TensorView> {
        self.tensors.get(name).ok_or_else(|| Error::tensor(&self.dir, name, "missing from the checkpoint"))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.bytes.len()).sum()
    }
}

/// Reads a small text file (config, index) that must be a regular file: a named pipe or a
/// device in its place is refused instead of blocking the load.
pub fn read_regular_file(path: &Path) -> Result<String> {
    let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), msg: e.to_string() };
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(Error::Checkpoint { file: path.to_path_buf(), msg: "not a regular file".into() });
    }
    std::fs::read_to_string(path).map_err(io)
}
