//! Attention launchers: q/k norm + RoPE + cache append, flash prefill, split-K decode + combine.

use orchid_model::error::{Error, Result};

use super::Ctx;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct PrepArgs {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub inv_freq: u64,
    pub q_out: u64,
    pub kpool: u64,
    pub vpool: u64,
    pub table: u64,
    pub pos_ptr: u64,
    pub t: i32,
    pub start: i32,
    pub hq: i32,
    pub hkv: i32,
    pub d: i32,
    pub r: i32,
    pub bs: i32,
    pub ldq: i32,
    pub qstride: i32,
    pub ldk: i32,
    pub pad0: i32,
    pub pad1: i32,
    pub eps: f32,
    pub pad2: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct AttnArgs {
    pub q: u64,
    pub kpool: u64,
    pub vpool: u64,
    pub table: u64,
    pub gate: u64,
    pub out: u64,
    pub part_o: u64,
    pub part_ml: u64,
    pub pos_ptr: u64,
    pub t: i32,
    pub start: i32,
    pub hq: i32,
    pub hkv: i32,
    pub g: i32,
    pub bs: i32,
    pub ldg: i32,
    pub nsplit: i32,
    pub scale_log2: f32,
    /// Decode: key tiles per split at least (0 or 1: the keys spread over all splits).
    pub min_tiles: i32,
    pub pad1: i32,
    pub pad2: i32,
}

pub const SUPPORTED_HEAD_DIMS: [usize; 4] = [32, 64, 128, 256];

/// Most splits of a decode attention (the combine kernel merges one split per thread).
pub const MAX_SPLITS: usize = 64;

/// Key-tile lengths (prefill, decode) per head dim; the KV block size must be a multiple.
pub fn tiles_for(d: usize) -> (usize, usize) {
    match d {
        256 => (32, 16),
        128 => (64, 16),
        _ => (64, 32),
    }
}

pub fn prefill_smem(d: usize) -> usize {
    let (tk, _) = tiles_for(d);
    (64 * (d + 8) + 4 * tk * (d + 8)) * 2
}

pub fn decode_smem(d: usize) -> usize {
    let (_, tk) = tiles_for(d);
    let kv = 4 * 2 * 2 * tk * (d + 8) * 2; // 4 warps, 2 buffers, K and V
    let merge = (128 + 4 * 16 * d) * 4; // m, l of the 4 warps, then each warp's rescaled O
    16 * (d + 8) * 2 + kv.max(merge)
}

/// Decode splits for a context of `n` keys: enough blocks to fill the GPU, at least 256 keys each.
pub fn decode_splits(n: usize, hkv: usize, sms: usize) -> usize {
    let want = (2 * sms).div_ceil(hkv.max(1));
    want.min(n.div_ceil(256)).clamp(1, MAX_SPLITS)
}

pub fn check_head_dim(d: usize) -> Result<()> {
    if SUPPORTED_HEAD_DIMS.contains(&d) {
        Ok(())
    } else {
        Err(Error::Op { op: "attention", msg: format!("head_dim {d} is not supported on CUDA (32, 64, 128 or 256)") })
    }
}

pub fn prep(c: &Ctx, a: &PrepArgs) -> Result<()> {
    let heads = (a.hq + a.hkv) as usize;
    c.k("attn_prep").launch(&c.gpu, (a.t as u32, heads.div_ceil(4) as u32, 1), 128, 0, a)
}

pub fn prefill(c: &Ctx, a: &AttnArgs, d: usize) -> Result<()> {
    let rows = (a.t * a.g) as usize;
    let name = format!("attn_prefill_d{d}");
    c.k(&name).launch(&c.gpu, (rows.div_ceil(64) as u32, a.hkv as u32, 1), 128, prefill_smem(d) as u32, a)
}

/// Split-K decode of one token, then the combine. The decode kernel also does attn_prep's work
/// for the token (`prep`: q norm + RoPE into shared memory, the new key and value into the
/// cache), so callers launch no separate prep (`prep.t` must be 1).
pub fn decode(c: &Ctx, a: &AttnArgs, d: usize, prep: &PrepArgs) -> Result<()> {
    if prep.t != 1 {
        return Err(Error::Op { op: "attention decode", msg: format!("one token per decode, not {}", prep.t) });
    }
    let nz = (a.g as usize).div_ceil(16);
    let grid = (a.hkv as u32, a.nsplit as u32, nz as u32);
    c.k(&format!("attn_decode_d{d}")).launch_raw(&c.gpu, grid, 128, decode_smem(d) as u32, super::params!(*a, *prep))?;
    let d32 = d as i32;
    c.k("attn_combine").launch_raw(&c.gpu, (a.hq as u32, 1, 1), 256, 0, super::params!(*a, d32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_limits() {
        assert_eq!(std::mem::size_of::<PrepArgs>(), 144);
        assert_eq!(std::mem::size_of::<AttnArgs>(), 120);
        for d in SUPPORTED_HEAD_DIMS {
            assert!(prefill_smem(d) <= 227 * 1024 && decode_smem(d) <= 227 * 1024, "d {d}");
            let (p, q) = tiles_for(d);
            assert_eq!(crate::state::KV_BLOCK % p, 0);
            assert_eq!(crate::state::KV_BLOCK % q, 0);
        }
        assert_eq!(decode_splits(10, 2, 132), 1);
        assert_eq!(decode_splits(131072, 2, 132), 64);
    }
}
