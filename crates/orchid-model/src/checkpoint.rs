//! A checkpoint directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, or (as a fallback) every `*.safetensors` file in the folder.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

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
            let text = std::fs::read_to_string(&index)
                .map_err(|e| Error::Io { path: index.clone(), msg: e.to_string() })?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| Error::Checkpoint { file: index.clone(), msg: format!("invalid JSON: {e}") })?;
            let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| Error::Checkpoint {
                file: index.clone(),
                msg: "no `weight_map` object".into(),
            })?;
            let names: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
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
            let st = SafetensorsFile::open(&f)?;
            for (name, t) in st.tensors {
                tensors.entry(name).or_insert(t);
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), tensors })
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
