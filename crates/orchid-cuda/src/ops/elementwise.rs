//! Elementwise launchers (kernels/elementwise.cu): RMSNorm (with the residual add), add, SiLU·up,
//! zero fill, row gather and the embedding lookup.

use orchid_model::error::Result;

use super::{Ctx, params};
use crate::weights::{GpuLinear, WFormat};

pub fn rms_norm(c: &Ctx, x: u64, w: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<()> {
    let (n32, eps) = (n as i32, eps);
    c.k("rms_norm").launch_raw(&c.gpu, (rows as u32, 1, 1), 256, 0, params!(x, w, y, n32, eps))
}

#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(c: &Ctx, x: u64, r: u64, w: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<()> {
    let n32 = n as i32;
    c.k("add_rms_norm").launch_raw(&c.gpu, (rows as u32, 1, 1), 256, 0, params!(x, r, w, y, n32, eps))
}

fn grid1d(n: usize) -> u32 {
    (n.div_ceil(256)).clamp(1, 65535 * 8) as u32
}

pub fn add_assign(c: &Ctx, x: u64, y: u64, n: usize) -> Result<()> {
    let n64 = n as i64;
    c.k("add_assign").launch_raw(&c.gpu, (grid1d(n), 1, 1), 256, 0, params!(x, y, n64))
}

/// Zeroes `words` 32-bit words at `x`.
pub fn zero_words(c: &Ctx, x: u64, words: usize) -> Result<()> {
    let n64 = words as i64;
    c.k("zero_words").launch_raw(&c.gpu, (grid1d(words), 1, 1), 256, 0, params!(x, n64))
}

pub fn silu_mul(c: &Ctx, g: u64, u: u64, out: u64, n: usize) -> Result<()> {
    let n64 = n as i64;
    c.k("silu_mul").launch_raw(&c.gpu, (grid1d(n), 1, 1), 256, 0, params!(g, u, out, n64))
}

pub fn gather_rows(c: &Ctx, x: u64, rows: u64, out: u64, nrows: usize, n: usize) -> Result<()> {
    let n32 = n as i32;
    c.k("gather_rows").launch_raw(&c.gpu, (nrows as u32, 1, 1), 256, 0, params!(x, rows, out, n32))
}

pub fn embed(c: &Ctx, table: &GpuLinear, ids: u64, out: u64, t: usize) -> Result<()> {
    let (n, kpad) = (table.cols as i32, table.kpad as i32);
    let w = table.w_ptr();
    match table.fmt {
        WFormat::Q4 => {
            let sb = table.sb_ptr();
            c.k("embed_q4").launch_raw(&c.gpu, (t as u32, 1, 1), 256, 0, params!(w, sb, ids, out, n, kpad))
        }
        WFormat::Bf16 => c.k("embed_bf16").launch_raw(&c.gpu, (t as u32, 1, 1), 256, 0, params!(w, ids, out, n, kpad)),
    }
}
