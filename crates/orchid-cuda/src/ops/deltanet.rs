//! Gated DeltaNet launchers: conv, prep (norms, gates), chunked recurrence, gated norm, fused decode.

use orchid_model::error::{Error, Result};

use super::Ctx;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ConvArgs {
    pub x: u64,
    pub w: u64,
    pub state_in: u64,
    pub state_out: u64,
    pub out: u64,
    pub t: i32,
    pub c: i32,
    pub kc: i32,
    pub ldx: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GdnPrepArgs {
    pub x: u64,
    pub b: u64,
    pub a: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub beta: u64,
    pub gdec: u64,
    pub t: i32,
    pub hk: i32,
    pub hv: i32,
    pub dk: i32,
    pub ldb: i32,
    pub lda: i32,
    pub c: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ChunkArgs {
    pub x: u64,
    pub beta: u64,
    pub gdec: u64,
    pub state: u64,
    pub out: u64,
    pub t: i32,
    pub hk: i32,
    pub hv: i32,
    pub dk: i32,
    pub dv: i32,
    pub c: i32,
    pub cw: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GNormArgs {
    pub core: u64,
    pub z: u64,
    pub w: u64,
    pub out: u64,
    pub t: i32,
    pub hv: i32,
    pub dv: i32,
    pub ldz: i32,
    pub eps: f32,
    pub pad0: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GdnDecodeArgs {
    pub qkv: u64,
    pub z: u64,
    pub b: u64,
    pub a: u64,
    pub conv_w: u64,
    pub conv_state: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub norm_w: u64,
    pub state: u64,
    pub out: u64,
    pub pos_ptr: u64,
    pub hk: i32,
    pub hv: i32,
    pub dk: i32,
    pub dv: i32,
    pub kc: i32,
    pub c: i32,
    pub pos: i32,
    pub pad: i32,
    pub eps: f32,
    pub pad1: f32,
}

pub const DECODE_THREADS: usize = 512;
pub const DECODE_MAX_ROWS: usize = 32;

/// Columns of the state per chunked-prefill block.
pub fn chunk_cols(dv: usize) -> usize {
    if dv % 32 == 0 { 32 } else { 16 }
}

pub fn chunk_smem(dk: usize, cw: usize) -> usize {
    let ks = dk + 1;
    let vs = cw + 1;
    (3 * 64 * ks + 2 * 64 * 65 + 2 * 64 * vs + dk * vs + 3 * 64) * 4
}

pub fn check_dims(dk: usize, dv: usize, conv_dim: usize, kc: usize) -> Result<()> {
    let rg = DECODE_THREADS / dv.max(1);
    let ok = dv % 16 == 0 && dk <= 256 && dv <= 256 && 2 * dk + dv <= 768 && rg >= 1 && dk.div_ceil(rg) <= DECODE_MAX_ROWS && kc >= 1;
    if !ok || conv_dim == 0 || chunk_smem(dk, chunk_cols(dv)) > 227 * 1024 {
        return Err(Error::Op { op: "deltanet", msg: format!("GDN head dims dk {dk} / dv {dv} are not supported on CUDA") });
    }
    Ok(())
}

pub fn conv(c: &Ctx, a: &ConvArgs) -> Result<()> {
    let rows = a.t.max(a.kc - 1).max(1);
    c.k("gdn_conv").launch(&c.gpu, ((a.c as usize).div_ceil(256) as u32, rows as u32, 1), 256, 0, a)
}

pub fn prep(c: &Ctx, a: &GdnPrepArgs) -> Result<()> {
    c.k("gdn_prep").launch(&c.gpu, (a.t as u32, 1, 1), 128, 0, a)
}

pub fn chunk(c: &Ctx, a: &ChunkArgs) -> Result<()> {
    let smem = chunk_smem(a.dk as usize, a.cw as usize);
    c.k("gdn_chunk").launch(&c.gpu, (a.hv as u32, (a.dv / a.cw) as u32, 1), 256, smem as u32, a)
}

pub fn gated_norm(c: &Ctx, a: &GNormArgs) -> Result<()> {
    let tasks = a.t as usize * a.hv as usize;
    c.k("gdn_gated_norm").launch(&c.gpu, (tasks.div_ceil(4) as u32, 1, 1), 128, 0, a)
}

pub fn decode(c: &Ctx, a: &GdnDecodeArgs) -> Result<()> {
    c.k("gdn_decode").launch(&c.gpu, (a.hv as u32, 1, 1), DECODE_THREADS as u32, 0, a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_dims() {
        assert_eq!(std::mem::size_of::<ConvArgs>(), 56);
        assert_eq!(std::mem::size_of::<GdnPrepArgs>(), 88);
        assert_eq!(std::mem::size_of::<ChunkArgs>(), 72);
        assert_eq!(std::mem::size_of::<GNormArgs>(), 56);
        assert_eq!(std::mem::size_of::<GdnDecodeArgs>(), 136);
        check_dims(128, 128, 8192, 4).unwrap();
        check_dims(32, 48, 288, 4).unwrap();
        check_dims(64, 32, 256, 4).unwrap();
        assert!(check_dims(128, 40, 300, 4).is_err());
    }
}
