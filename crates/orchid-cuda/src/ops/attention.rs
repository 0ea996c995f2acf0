//! Attention launchers: q/k norm + RoPE + cache append, flash prefill, split-K decode + combine.

use orchid_model::error::{Error, Result};

use super::Ctx;

crate::kernel_abi! {
    pub fn attention_abi;
    #[derive(Clone, Copy, Default)]
    struct PrepArgs {
        qg: u64,
        k: u64,
        v: u64,
        q_norm: u64,
        k_norm: u64,
        inv_freq: u64,
        q_out: u64,
        kpool: u64,
        vpool: u64,
        table: u64,
        pos_ptr: u64,
        t: i32 => "T",
        start: i32,
        hq: i32 => "Hq",
        hkv: i32 => "Hkv",
        /// ldq: row stride of qg (Hq*D*(1+gate))
        d: i32 => "D",
        r: i32 => "R",
        bs: i32 => "BS",
        ldq: i32,
        /// qstride: per-head stride inside a qg row (D or 2D)
        qstride: i32,
        ldk: i32,
        pad0: i32,
        pad1: i32,
        eps: f32,
        pad2: f32,
    }
    #[derive(Clone, Copy, Default)]
    struct AttnArgs {
        q: u64,
        kpool: u64,
        vpool: u64,
        table: u64,
        gate: u64,
        out: u64,
        part_o: u64,
        part_ml: u64,
        pos_ptr: u64,
        /// Decode of several sequences (`decode_rows`): the state slot of each row (i32; negative:
        /// padding), `pos_ptr` one position per row, `table` the first slot's block table.
        rows_slot: u64,
        t: i32 => "T",
        start: i32,
        hq: i32 => "Hq",
        hkv: i32 => "Hkv",
        g: i32 => "G",
        bs: i32 => "BS",
        ldg: i32,
        nsplit: i32,
        scale_log2: f32,
        /// Decode: key tiles per split at least (0 or 1: the keys spread over all splits).
        min_tiles: i32,
        /// `decode_rows`: block-table entries per slot.
        ld_table: i32,
        pad2: i32,
    }
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

/// `decode` of one token of each of `rows` sequences (see `AttnArgs::rows_slot`); `a.part_o` /
/// `a.part_ml` hold `rows` times one token's partials.
pub fn decode_rows(c: &Ctx, a: &AttnArgs, d: usize, prep: &PrepArgs, rows: usize) -> Result<()> {
    let nz = (a.g as usize).div_ceil(16);
    let grid = (a.hkv as u32, a.nsplit as u32, (rows * nz) as u32);
    c.k(&format!("attn_decode_rows_d{d}")).launch_raw(&c.gpu, grid, 128, decode_smem(d) as u32, super::params!(*a, *prep))?;
    let d32 = d as i32;
    c.k("attn_combine_rows").launch_raw(&c.gpu, (a.hq as u32, rows as u32, 1), 256, 0, super::params!(*a, d32))
}

/// Floats of one token's decode partials (output, then max and sum), `nsplit` splits.
pub fn decode_parts(hq: usize, hkv: usize, d: usize, nsplit: usize) -> (usize, usize) {
    let nz = (hq / hkv).div_ceil(16);
    (hkv * nz * nsplit * 16 * d, hkv * nz * nsplit * 16 * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_limits() {
        assert_eq!(std::mem::size_of::<PrepArgs>(), 144);
        assert_eq!(std::mem::size_of::<AttnArgs>(), 128);
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
