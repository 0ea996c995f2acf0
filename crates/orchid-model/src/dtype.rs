//! Element types that appear in checkpoints, and conversions to f32.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    U32,
    I16,
    U16,
    I8,
    U8,
    Bool,
}

impl DType {
    pub fn from_safetensors(s: &str) -> Option<DType> {
        Some(match s {
            "F64" => DType::F64,
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "U32" => DType::U32,
            "I16" => DType::I16,
            "U16" => DType::U16,
            "I8" => DType::I8,
            "U8" => DType::U8,
            "BOOL" => DType::Bool,
            _ => return None,
        })
    }

    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Float types that weights and activations may be stored in.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }
}

/// Converts little-endian float bytes of `dtype` into `out` (len = bytes / size).
pub fn to_f32_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F64 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes(c.try_into().unwrap()) as f32;
            }
        }
        other => panic!("to_f32_into: {other:?} is not a float type"),
    }
}

/// Converts f32 values to little-endian bytes of `dtype` (F32, F16 or BF16; round to nearest even).
pub fn from_f32(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    match dtype {
        DType::F32 => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        DType::BF16 => v.iter().for_each(|x| out.extend_from_slice(&bf16::from_f32(*x).to_bits().to_le_bytes())),
        DType::F16 => v.iter().for_each(|x| out.extend_from_slice(&f16::from_f32(*x).to_bits().to_le_bytes())),
        other => panic!("from_f32: {other:?} is not a supported float type"),
    }
    out
}
