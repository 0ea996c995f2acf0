//! Weights on the GPU. Two formats (see kernels/common.cuh):
//! - `Q4`: MLX affine 4-bit with group 64, nibbles repacked so that each lane of an mma quad
//!   loads its A fragments with one 16-byte load per two groups; scale and bias of each
//!   (row, group) packed as bf16 pairs in one u32, both stored tile-major (the 16 rows of a
//!   tile keep each 128-k unit in one contiguous kilobyte). Bytes per weight: 0.5 + 4/64 (as MLX).
//! - `Bf16`: dense bf16 (dense checkpoints; affine weights of other bit widths or groups are
//!   dequantised to bf16 at upload).
//!
//! Rows are padded to a multiple of 128 and columns (K) to a multiple of 128, with zeros.

use std::sync::Arc;

use half::{bf16, f16};
use orchid_model::dtype::DType;
use orchid_model::error::{Error, Result};
use orchid_model::linear::{AffineWeight, LinearWeight, WeightData};
use rayon::prelude::*;

use crate::driver::{DevBuf, Gpu};

crate::kernel_abi! {
    pub fn format_abi;
    const {
        /// `WFormat::Q4` in the kernels' template arguments.
        FMT_Q4: i32 = 0;
        /// `WFormat::Bf16`.
        FMT_BF16: i32 = 1;
    }
}

pub const ROW_PAD: usize = 128;
pub const K_PAD: usize = 128;

pub fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WFormat {
    Q4,
    Bf16,
}

/// One weight matrix W [rows, cols] on the GPU (or E of them stacked, `rows_e` rows apart).
pub struct GpuLinear {
    pub fmt: WFormat,
    /// Logical rows of one matrix and its columns.
    pub rows: usize,
    pub cols: usize,
    /// Padded rows of one matrix (the stride between stacked experts) and padded columns.
    pub rows_pad: usize,
    pub kpad: usize,
    /// Number of stacked matrices.
    pub count: usize,
    pub w: DevBuf,
    pub sb: Option<DevBuf>,
}

impl GpuLinear {
    pub fn w_ptr(&self) -> u64 {
        self.w.ptr
    }
    pub fn sb_ptr(&self) -> u64 {
        self.sb.as_ref().map_or(0, |b| b.ptr)
    }
    pub fn nbytes(&self) -> usize {
        self.w.bytes + self.sb.as_ref().map_or(0, |b| b.bytes)
    }
    /// Bytes read for one pass over `rows` logical rows (for bandwidth figures).
    pub fn bytes_per_row(&self) -> f64 {
        match self.fmt {
            WFormat::Q4 => self.cols as f64 * (0.5 + 4.0 / 64.0),
            WFormat::Bf16 => self.cols as f64 * 2.0,
        }
    }
}

/// A device f32 vector (norm weights, A_log, ...).
pub struct GpuVec {
    pub buf: DevBuf,
    pub len: usize,
}

fn is_q4(w: &LinearWeight) -> bool {
    matches!(&w.data, WeightData::Affine(a) if a.bits == 4 && a.group == 64)
}

/// For each (word w < 16, nibble n < 8) of a repacked 128-k unit: the source k within the unit.
fn unit_permutation() -> [[u8; 8]; 16] {
    let mut perm = [[0u8; 8]; 16];
    for t in 0..4 {
        for j in 0..2 {
            for w in 0..2 {
                for p in 0..4 {
                    for h in 0..2 {
                        let s = 2 * w + (p >> 1);
                        let hi8 = p & 1;
                        let k_local = 16 * s + 8 * hi8 + 2 * t + h;
                        let word = t * 4 + 2 * j + w;
                        let nib = if h == 1 { p + 4 } else { p };
                        perm[word][nib] = (j * 64 + k_local) as u8;
                    }
                }
            }
        }
    }
    perm
}

fn sb_to_bf16_bits(dtype: DType, bytes: &[u8], i: usize) -> u16 {
    match dtype {
        DType::BF16 => u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]),
        DType::F16 => bf16::from_f32(f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()).to_bits(),
        _ => bf16::from_f32(f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())).to_bits(),
    }
}

/// Repacks one Q4 matrix into `out_w` (rows_pad · kpad / 8 words) and `out_sb` (rows_pad ·
/// kpad / 64 words) in tile-major order (common.cuh "Q4 memory order"): for each 16-row tile
/// and 128-k unit u, the 16 rows' 16 words of u (row r of the tile at word 16 r), then the next
/// unit; scale/bias likewise, 32 words per (tile, unit) (row r at 2 r, its two groups).
fn repack_q4(w: &LinearWeight, a: &AffineWeight, kpad: usize, out_w: &mut [u32], out_sb: &mut [u32]) {
    let perm = unit_permutation();
    let cols = w.cols;
    let wpr_in = cols / 8;
    let units = kpad / 128;
    let g_in = cols / 64;
    let packed: &[u32] = a.packed.typed::<u32>();
    let (sc, bi) = (a.scales.as_slice(), a.biases.as_slice());
    let tiles = w.rows.div_ceil(16);
    let tile_w = 16 * kpad / 8;
    let tile_s = 16 * kpad / 64;
    out_w[..tiles * tile_w].par_chunks_mut(tile_w).zip(out_sb[..tiles * tile_s].par_chunks_mut(tile_s)).enumerate().for_each(
        |(tile, (ow, os))| {
            for rin in 0..16 {
                let r = tile * 16 + rin;
                if r >= w.rows {
                    break; // padding rows stay zero
                }
                let src = &packed[r * wpr_in..(r + 1) * wpr_in];
                let nib = |k: usize| -> u32 { if k < cols { (src[k / 8] >> (4 * (k % 8))) & 15 } else { 0 } };
                for u in 0..units {
                    for (wi, pw) in perm.iter().enumerate() {
                        let mut v = 0u32;
                        for (n, &kl) in pw.iter().enumerate() {
                            v |= nib(u * 128 + kl as usize) << (4 * n);
                        }
                        ow[u * 256 + rin * 16 + wi] = v;
                    }
                    for j in 0..2 {
                        let g = 2 * u + j;
                        os[u * 32 + rin * 2 + j] = if g < g_in {
                            let s = sb_to_bf16_bits(a.sb_dtype, sc, r * g_in + g) as u32;
                            let b = sb_to_bf16_bits(a.sb_dtype, bi, r * g_in + g) as u32;
                            s | (b << 16)
                        } else {
                            0
                        };
                    }
                }
            }
        },
    );
}

/// Converts rows to bf16 into `out` [rows_pad][kpad].
fn to_bf16_rows(w: &LinearWeight, kpad: usize, out: &mut [u16]) {
    let cols = w.cols;
    out[..w.rows * kpad].par_chunks_mut(kpad).enumerate().for_each(|(r, o)| match &w.data {
        WeightData::Dense { data, dtype: DType::BF16 } => {
            o[..cols].copy_from_slice(&data.typed::<u16>()[r * cols..(r + 1) * cols]);
        }
        _ => {
            let mut row = vec![0f32; cols];
            w.row_f32(r, &mut row);
            for (d, s) in o.iter_mut().zip(&row) {
                *d = bf16::from_f32(*s).to_bits();
            }
        }
    });
}

/// Uploads `mats` (all of the same shape) stacked, in the Q4 format when every one qualifies.
pub fn upload_stacked(gpu: &Arc<Gpu>, mats: &[&LinearWeight]) -> Result<GpuLinear> {
    let first = mats.first().ok_or_else(|| Error::Backend("upload of zero matrices".into()))?;
    let (rows, cols) = (first.rows, first.cols);
    if mats.iter().any(|m| m.rows != rows || m.cols != cols) {
        return Err(Error::Backend("stacked matrices differ in shape".into()));
    }
    let rows_pad = round_up(rows.max(1), ROW_PAD);
    let kpad = round_up(cols.max(1), K_PAD);
    let n = mats.len();
    if mats.iter().all(|m| is_q4(m)) {
        let wpr = kpad / 8;
        let gpr = kpad / 64;
        let mut hw = vec![0u32; n * rows_pad * wpr];
        let mut hs = vec![0u32; n * rows_pad * gpr];
        for (e, m) in mats.iter().enumerate() {
            let WeightData::Affine(a) = &m.data else { unreachable!() };
            let ow = &mut hw[e * rows_pad * wpr..(e + 1) * rows_pad * wpr];
            let os = &mut hs[e * rows_pad * gpr..(e + 1) * rows_pad * gpr];
            repack_q4(m, a, kpad, ow, os);
        }
        Ok(GpuLinear {
            fmt: WFormat::Q4,
            rows,
            cols,
            rows_pad,
            kpad,
            count: n,
            w: DevBuf::from_slice(gpu, &hw)?,
            sb: Some(DevBuf::from_slice(gpu, &hs)?),
        })
    } else {
        let mut hb = vec![0u16; n * rows_pad * kpad];
        for (e, m) in mats.iter().enumerate() {
            to_bf16_rows(m, kpad, &mut hb[e * rows_pad * kpad..(e + 1) * rows_pad * kpad]);
        }
        Ok(GpuLinear { fmt: WFormat::Bf16, rows, cols, rows_pad, kpad, count: n, w: DevBuf::from_slice(gpu, &hb)?, sb: None })
    }
}

pub fn upload_linear(gpu: &Arc<Gpu>, w: &LinearWeight) -> Result<GpuLinear> {
    upload_stacked(gpu, &[w])
}

pub fn upload_vec(gpu: &Arc<Gpu>, v: &[f32]) -> Result<GpuVec> {
    Ok(GpuVec { buf: DevBuf::from_slice(gpu, if v.is_empty() { &[0f32] } else { v })?, len: v.len() })
}

/// The routed experts of one MoE layer: gate, up [E × I] and down [E × H], stacked.
pub struct GpuExperts {
    pub gate: GpuLinear,
    pub up: GpuLinear,
    pub down: GpuLinear,
    pub num: usize,
}

pub fn upload_experts(gpu: &Arc<Gpu>, experts: &[orchid_model::weights::HostMlp]) -> Result<GpuExperts> {
    let g: Vec<&LinearWeight> = experts.iter().map(|m| &m.gate_proj).collect();
    let u: Vec<&LinearWeight> = experts.iter().map(|m| &m.up_proj).collect();
    let d: Vec<&LinearWeight> = experts.iter().map(|m| &m.down_proj).collect();
    let (gate, up, down) = (upload_stacked(gpu, &g)?, upload_stacked(gpu, &u)?, upload_stacked(gpu, &d)?);
    if gate.fmt != up.fmt || gate.fmt != down.fmt {
        // Mixed formats would need per-matrix kernels; fall back to bf16 for all three.
        let (gate, up, down) = (force_bf16(gpu, &g)?, force_bf16(gpu, &u)?, force_bf16(gpu, &d)?);
        return Ok(GpuExperts { gate, up, down, num: experts.len() });
    }
    Ok(GpuExperts { gate, up, down, num: experts.len() })
}

fn force_bf16(gpu: &Arc<Gpu>, mats: &[&LinearWeight]) -> Result<GpuLinear> {
    let (rows, cols) = (mats[0].rows, mats[0].cols);
    let rows_pad = round_up(rows, ROW_PAD);
    let kpad = round_up(cols, K_PAD);
    let mut hb = vec![0u16; mats.len() * rows_pad * kpad];
    for (e, m) in mats.iter().enumerate() {
        to_bf16_rows(m, kpad, &mut hb[e * rows_pad * kpad..(e + 1) * rows_pad * kpad]);
    }
    Ok(GpuLinear { fmt: WFormat::Bf16, rows, cols, rows_pad, kpad, count: mats.len(), w: DevBuf::from_slice(gpu, &hb)?, sb: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element (r, k) from the repacked buffers, as `q4_element` (kernels/elementwise.cu) reads it.
    fn repacked_element(ow: &[u32], os: &[u32], kpad: usize, r: usize, k: usize) -> f32 {
        let (unit, j, kl) = (k >> 7, (k >> 6) & 1, k & 63);
        let (s, rem) = (kl >> 4, kl & 15);
        let (hi8, t, h) = (rem >> 3, (rem & 7) >> 1, rem & 1);
        let word = t * 4 + 2 * j + (s >> 1);
        let p = 2 * (s & 1) + hi8;
        let tu = (r >> 4) * (kpad / 128) + unit;
        let wv = ow[tu * 256 + (r & 15) * 16 + word];
        let q = (wv >> (4 * if h == 1 { p + 4 } else { p })) & 15;
        let sb = os[tu * 32 + (r & 15) * 2 + j];
        let (sc, bi) = (f32::from_bits((sb & 0xffff) << 16), f32::from_bits(sb & 0xffff_0000));
        sc * q as f32 + bi
    }

    #[test]
    fn repack_is_tile_major_and_exact() {
        // 37 rows (a partial tile), 320 columns (a partial unit): every element round-trips.
        let (rows, cols) = (37usize, 320usize);
        let mut packed = Vec::new();
        let (mut sc, mut bi) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let row: Vec<f32> = (0..cols).map(|k| ((r * 131 + k * 17) % 97) as f32 / 13.0 - 3.5).collect();
            let (p, s, b) = orchid_model::quant::quantize_row(&row, 4, 64);
            packed.extend(p.iter().flat_map(|w| w.to_le_bytes()));
            sc.extend(s.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()));
            bi.extend(b.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()));
        }
        let a = AffineWeight {
            packed: orchid_model::storage::Bytes::from_vec(packed),
            scales: orchid_model::storage::Bytes::from_vec(sc),
            biases: orchid_model::storage::Bytes::from_vec(bi),
            sb_dtype: DType::BF16,
            bits: 4,
            group: 64,
        };
        let w = LinearWeight { rows, cols, data: WeightData::Affine(a.clone()) };
        let (rows_pad, kpad) = (round_up(rows, ROW_PAD), round_up(cols, K_PAD));
        let mut ow = vec![0u32; rows_pad * kpad / 8];
        let mut os = vec![0u32; rows_pad * kpad / 64];
        repack_q4(&w, &a, kpad, &mut ow, &mut os);
        let mut want = vec![0f32; cols];
        for r in 0..rows {
            w.row_f32(r, &mut want);
            for (k, &v) in want.iter().enumerate() {
                let got = repacked_element(&ow, &os, kpad, r, k);
                assert!((got - v).abs() <= 1e-6 * v.abs().max(1.0), "({r}, {k}): {got} vs {v}");
            }
            for k in cols..kpad {
                assert_eq!(repacked_element(&ow, &os, kpad, r, k), 0.0, "padding ({r}, {k})");
            }
        }
    }

    #[test]
    fn permutation_is_a_bijection_per_unit() {
        let p = unit_permutation();
        let mut seen = [false; 128];
        for w in p.iter() {
            for &k in w.iter() {
                assert!(!seen[k as usize], "k {k} twice");
                seen[k as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        // Lane t = 0, group 0, word 0, slot 0 holds k = 0 (low nibble) and k = 1 (nibble 4).
        assert_eq!(p[0][0], 0);
        assert_eq!(p[0][4], 1);
        // slot 1 (the "+8" half of step 0): k = 8, 9.
        assert_eq!(p[0][1], 8);
        assert_eq!(p[0][5], 9);
        // lane t = 1 starts at k = 2; its group-1 words start at k = 64 + 2.
        assert_eq!(p[4][0], 2);
        assert_eq!(p[6][0], 66);
    }
}
