//! Writing checkpoints: tensors go into safetensors shards of bounded size, then
//! `model.safetensors.index.json` (when there is more than one shard) and `config.json`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::safetensors::{OutTensor, write};

pub struct CheckpointWriter {
    dir: PathBuf,
    max_shard_bytes: usize,
    pending: Vec<OutTensor>,
    pending_bytes: usize,
    /// (temporary file, tensor names) per written shard.
    shards: Vec<(PathBuf, Vec<String>)>,
    total_bytes: usize,
}

impl CheckpointWriter {
    pub fn new(dir: &Path, max_shard_bytes: usize) -> Result<CheckpointWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.to_path_buf(), msg: e.to_string() })?;
        Ok(CheckpointWriter {
            dir: dir.to_path_buf(),
            max_shard_bytes,
            pending: Vec::new(),
            pending_bytes: 0,
            shards: Vec::new(),
            total_bytes: 0,
        })
    }

    pub fn add(&mut self, t: OutTensor) -> Result<()> {
        if self.pending_bytes > 0 && self.pending_bytes + t.data.len() > self.max_shard_bytes {
            self.flush()?;
        }
        self.pending_bytes += t.data.len();
        self.total_bytes += t.data.len();
        self.pending.push(t);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self.dir.join(format!(".shard-{}.tmp", self.shards.len()));
        let mut meta = Map::new();
        meta.insert("format".into(), Value::from("pt"));
        write(&path, &self.pending, &meta)?;
        let names = self.pending.drain(..).map(|t| t.name).collect();
        self.shards.push((path, names));
        self.pending_bytes = 0;
        Ok(())
    }

    /// Writes the last shard, names the shards and writes the index; returns bytes written.
    pub fn finish(mut self) -> Result<usize> {
        self.flush()?;
        let io = |p: &Path, e: std::io::Error| Error::Io { path: p.to_path_buf(), msg: e.to_string() };
        let n = self.shards.len();
        let mut weight_map = Map::new();
        for (i, (tmp, names)) in self.shards.iter().enumerate() {
            let file = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
            let dst = self.dir.join(&file);
            std::fs::rename(tmp, &dst).map_err(|e| io(&dst, e))?;
            for name in names {
                weight_map.insert(name.clone(), Value::from(file.clone()));
            }
        }
        if n > 1 {
            let index = json!({ "metadata": { "total_size": self.total_bytes }, "weight_map": weight_map });
            let p = self.dir.join("model.safetensors.index.json");
            std::fs::write(&p, serde_json::to_string_pretty(&index).unwrap()).map_err(|e| io(&p, e))?;
        }
        Ok(self.total_bytes)
    }
}

/// Writes `config.json` (pretty, key order kept).
pub fn write_config(dir: &Path, config: &Value) -> Result<()> {
    let p = dir.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(config).unwrap() + "\n").map_err(|e| Error::Io { path: p, msg: e.to_string() })
}

/// The `quantization` block mlx-lm writes: defaults plus 8-bit overrides for the router and
/// the shared-expert gate of every MoE layer.
pub fn mlx_quantization_block(prefix: &str, layers: usize, bits: u32, group: usize, moe_layers: &[bool]) -> Value {
    let mut q = Map::new();
    q.insert("group_size".into(), Value::from(group));
    q.insert("bits".into(), Value::from(bits));
    q.insert("mode".into(), Value::from("affine"));
    for (l, &moe) in moe_layers.iter().enumerate().take(layers) {
        if moe {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                q.insert(format!("{prefix}layers.{l}.{m}"), json!({ "group_size": 64, "bits": 8 }));
            }
        }
    }
    Value::Object(q)
}
