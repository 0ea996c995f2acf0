//! The safetensors format: an 8-byte little-endian header length, a JSON header
//! `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the data.
//! Reading memory-maps the file and validates every entry; a corrupt file is an error naming
//! the file and the tensor, never a crash. Writing streams tensors to disk.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::storage::Bytes;

/// Largest header we accept (real checkpoints have < 10 MB of header).
const MAX_HEADER: u64 = 256 << 20;

/// One tensor of a file: dtype, shape and its bytes (a view into the mapping).
#[derive(Clone, Debug)]
pub struct TensorView {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
    pub file: Arc<PathBuf>,
}

impl TensorView {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// An error about this tensor, naming its file.
    pub fn err(&self, msg: impl Into<String>) -> Error {
        Error::tensor(&self.file, &self.name, msg)
    }

    /// All values as f32 (float dtypes only).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        if !self.dtype.is_float() {
            return Err(self.err(format!("expected a float tensor, found {:?}", self.dtype)));
        }
        let mut out = vec![0f32; self.numel()];
        crate::dtype::to_f32_into(self.dtype, self.bytes.as_slice(), &mut out);
        Ok(out)
    }

    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            return Err(self.err(format!("expected shape {shape:?}, found {:?}", self.shape)));
        }
        Ok(())
    }

    pub fn expect_float(&self) -> Result<()> {
        if !matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(self.err(format!("expected F32, F16 or BF16, found {:?}", self.dtype)));
        }
        Ok(())
    }
}

/// A memory-mapped safetensors file.
pub struct SafetensorsFile {
    pub path: Arc<PathBuf>,
    pub tensors: BTreeMap<String, TensorView>,
    pub metadata: Map<String, Value>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), msg: e.to_string() };
        // A named pipe or a device would block (or never end) when read: check the type first.
        if !std::fs::metadata(path).map_err(io)?.is_file() {
            return Err(Error::Checkpoint { file: path.to_path_buf(), msg: "not a regular file".into() });
        }
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(Error::Checkpoint { file: path.to_path_buf(), msg: "empty file".into() });
        }
        // SAFETY: the mapping is read-only; checkpoints are not modified while orchid runs
        // (the same assumption every mmap-based loader makes).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Arc::new(mmap))
    }

    /// Parses a whole file held in memory (used by tests and small files).
    pub fn parse(path: &Path, data: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Result<SafetensorsFile> {
        let bad = |msg: String| Error::Checkpoint { file: path.to_path_buf(), msg };
        let all: &[u8] = (*data).as_ref();
        if all.len() < 8 {
            return Err(bad(format!("truncated: {} bytes, not a safetensors file", all.len())));
        }
        let n = u64::from_le_bytes(all[..8].try_into().unwrap());
        if n > MAX_HEADER || 8 + n > all.len() as u64 {
            // The length field is not echoed: for a file that is not safetensors it is just the
            // file's first bytes.
            return Err(bad(format!(
                "invalid or truncated header: the header length field does not fit the file ({} bytes); not a safetensors file?",
                all.len()
            )));
        }
        let header_end = 8 + n as usize;
        let header: Value = serde_json::from_slice(&all[8..header_end])
            .map_err(|e| bad(format!("header is not valid JSON (line {}, column {})", e.line(), e.column())))?;
        let Value::Object(entries) = header else {
            return Err(bad("header is not a JSON object".into()));
        };
        let data_len = all.len() - header_end;
        let path_arc = Arc::new(path.to_path_buf());
        let mut tensors = BTreeMap::new();
        let mut metadata = Map::new();
        for (name, entry) in entries {
            if name == "__metadata__" {
                if let Value::Object(m) = entry {
                    metadata = m;
                }
                continue;
            }
            let terr = |msg: String| Error::tensor(path, &name, msg);
            let dtype_s = entry.get("dtype").and_then(Value::as_str).ok_or_else(|| terr("no dtype".into()))?;
            let dtype = DType::from_safetensors(dtype_s).ok_or_else(|| terr(format!("unknown dtype `{dtype_s}`")))?;
            let shape = entry
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| terr("no shape".into()))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| terr("shape is not a list of sizes".into()))?;
            let offs = entry
                .get("data_offsets")
                .and_then(Value::as_array)
                .filter(|a| a.len() == 2)
                .and_then(|a| Some((a[0].as_u64()? as usize, a[1].as_u64()? as usize)))
                .ok_or_else(|| terr("bad data_offsets".into()))?;
            let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let want = numel.and_then(|n| n.checked_mul(dtype.size())).ok_or_else(|| terr("shape overflows".into()))?;
            if offs.0 > offs.1 || offs.1 - offs.0 != want {
                return Err(terr(format!("data_offsets {:?} do not match shape {shape:?} of {dtype:?} ({want} bytes)", offs)));
            }
            if offs.1 > data_len {
                return Err(terr(format!("truncated file: tensor data ends at byte {} but the file holds {data_len} data bytes", offs.1)));
            }
            let bytes = Bytes::from_shared(data.clone(), header_end + offs.0..header_end + offs.1);
            tensors.insert(name.clone(), TensorView { name, dtype, shape, bytes, file: path_arc.clone() });
        }
        Ok(SafetensorsFile { path: path_arc, tensors, metadata })
    }
}

/// A tensor to write: name, dtype, shape and its little-endian bytes.
pub struct OutTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OutTensor {
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, v: &[f32]) -> OutTensor {
        OutTensor { name: name.into(), dtype: DType::F32, shape, data: crate::dtype::from_f32(DType::F32, v) }
    }
}

/// Writes a safetensors file (tensors sorted by name; header padded to 8 bytes).
pub fn write(path: &Path, tensors: &[OutTensor], metadata: &Map<String, Value>) -> Result<()> {
    let io = |e: std::io::Error| Error::Io { path: path.to_path_buf(), msg: e.to_string() };
    let mut order: Vec<&OutTensor> = tensors.iter().collect();
    order.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), Value::Object(metadata.clone()));
    }
    let mut off = 0usize;
    for t in &order {
        let want = t.shape.iter().product::<usize>() * t.dtype.size();
        assert_eq!(want, t.data.len(), "tensor {} has {} bytes, shape says {want}", t.name, t.data.len());
        let mut e = Map::new();
        e.insert("dtype".into(), Value::from(t.dtype.safetensors_name()));
        e.insert("shape".into(), Value::from(t.shape.clone()));
        e.insert("data_offsets".into(), Value::from(vec![off, off + t.data.len()]));
        header.insert(t.name.clone(), Value::Object(e));
        off += t.data.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).expect("header serializes");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::with_capacity(1 << 22, std::fs::File::create(path).map_err(io)?);
    f.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    f.write_all(&h).map_err(io)?;
    for t in &order {
        f.write_all(&t.data).map_err(io)?;
    }
    f.flush().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let dir = std::env::temp_dir().join(format!("orchid-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.safetensors");
        write(&p, &[OutTensor::f32("x", vec![2, 3], &[1., 2., 3., 4., 5., 6.])], &Map::new()).unwrap();
        let f = SafetensorsFile::open(&p).unwrap();
        assert_eq!(f.tensors["x"].to_f32().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
        let bytes = std::fs::read(&p).unwrap();
        let short = dir.join("short.safetensors");
        std::fs::write(&short, &bytes[..bytes.len() - 4]).unwrap();
        let e = SafetensorsFile::open(&short).err().unwrap().to_string();
        assert!(e.contains("short.safetensors") && e.contains("`x`") && e.contains("truncated"), "{e}");
        std::fs::write(&short, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
        assert!(SafetensorsFile::open(&short).err().unwrap().to_string().contains("header"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
