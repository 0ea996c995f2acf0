//! Attention launchers: q/k norm + RoPE + cache append, flash prefill (split-KV + combine for few
//! query tiles over a long context), split-K decode + combine.

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
        /// Prefill: 0, or `nspans` `AttnSpan`s, one span per grid z (qg, k and v from the span's
        /// `row0` on; q_out, table, t and start the span's; `t` the longest span).
        nspans: i32,
        pad1: i32,
        eps: f32,
        pad2: f32,
        spans: u64,
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
        /// padding), `pos_ptr` one position per row, `table` the first slot's block table; 0:
        /// slot 0 for every row (a graph pinned to one sequence: `table` is its block table).
        rows_slot: u64,
        /// Prefill (`prefill_spans`): 0, or `nspans` `AttnSpan`s, one span per grid z (q, gate,
        /// out, table, t and start are then the span's; `t` the longest span).
        spans: u64,
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
        nspans: i32,
    }
    /// One sequence's span in a batched prefill launch: its query rows (bf16, [t][Hq][D]), gate
    /// rows, output rows, block table, length, first position, and (`attn_prep`) its first row
    /// in the batch's projections.
    #[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
    struct AttnSpan {
        q: u64,
        gate: u64,
        out: u64,
        table: u64,
        t: i32 => "T",
        start: i32,
        row0: i32,
        pad0: i32,
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

/// Least keys per split of a split-KV prefill.
pub const PREFILL_SPLIT_KEYS: usize = 1024;

/// Key splits of the prefill attention of `t` queries at positions `start..start + t` (G query
/// heads per KV head): more than one only when its blocks (query tiles × Hkv) fill less than
/// the `sms` SMs, then about two blocks per SM, at least `PREFILL_SPLIT_KEYS` keys each, at most
/// `max` (and `MAX_SPLITS`). With one split the prefill runs the plain kernel.
pub fn prefill_splits(t: usize, g: usize, hkv: usize, start: usize, sms: usize, max: usize) -> usize {
    let blocks = (t * g).div_ceil(64) * hkv;
    // Only a span short of one block per SM: two blocks of the plain kernel fit on an SM, so
    // such a span leaves SMs idle and the rest half occupied.
    if blocks == 0 || blocks >= sms {
        return 1;
    }
    (2 * sms / blocks).min((start + t) / PREFILL_SPLIT_KEYS).min(max).clamp(1, MAX_SPLITS)
}

/// Floats of a split-KV prefill's partials (output, then max and sum): `nsplit` per query row.
pub fn prefill_parts(t: usize, g: usize, hkv: usize, d: usize, nsplit: usize) -> (usize, usize) {
    let rows = t * g * hkv * nsplit;
    (rows * d, rows * 2)
}

pub fn check_head_dim(d: usize) -> Result<()> {
    if SUPPORTED_HEAD_DIMS.contains(&d) {
        Ok(())
    } else {
        Err(Error::Op { op: "attention", msg: format!("head_dim {d} is not supported on CUDA (32, 64, 128 or 256)") })
    }
}

/// q/k norm, RoPE, q to bf16 and K/V into the cache: of `a.t` tokens, or of each of `a.nspans`
/// spans (`a.t` the longest).
pub fn prep(c: &Ctx, a: &PrepArgs) -> Result<()> {
    let heads = (a.hq + a.hkv) as usize;
    c.k("attn_prep").launch(&c.gpu, (a.t as u32, heads.div_ceil(4) as u32, a.nspans.max(1) as u32), 128, 0, a)
}

/// Flash prefill of a span. With `a.nsplit` > 1 (`prefill_splits`), split-KV: each block takes
/// one share of its key tiles and writes partials to `a.part_o` / `a.part_ml` (`prefill_parts`),
/// which `attn_prefill_combine` merges in split order, normalises and gates.
pub fn prefill(c: &Ctx, a: &AttnArgs, d: usize) -> Result<()> {
    let rows = (a.t * a.g) as usize;
    if a.nsplit <= 1 {
        let name = format!("attn_prefill_d{d}");
        let grid = (rows.div_ceil(64) as u32, a.hkv as u32, a.nspans.max(1) as u32);
        return c.k(&name).launch(&c.gpu, grid, 128, prefill_smem(d) as u32, a);
    }
    if a.spans != 0 {
        return Err(Error::Op { op: "attention prefill", msg: "split-KV takes one span".into() });
    }
    if a.nsplit as usize > MAX_SPLITS || a.part_o == 0 || a.part_ml == 0 {
        return Err(Error::Op { op: "attention prefill", msg: format!("{} splits (at most {MAX_SPLITS}, with partials)", a.nsplit) });
    }
    let grid = (rows.div_ceil(64) as u32, a.hkv as u32, a.nsplit as u32);
    c.k(&format!("attn_prefill_split_d{d}")).launch(&c.gpu, grid, 128, prefill_smem(d) as u32, a)?;
    let d32 = d as i32;
    c.k("attn_prefill_combine").launch_raw(&c.gpu, (rows as u32, a.hkv as u32, 1), 256, 0, super::params!(*a, d32))
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
        assert_eq!(std::mem::size_of::<PrepArgs>(), 152);
        assert_eq!(std::mem::size_of::<AttnArgs>(), 136);
        assert_eq!(std::mem::size_of::<AttnSpan>(), 48);
        for d in SUPPORTED_HEAD_DIMS {
            assert!(prefill_smem(d) <= 227 * 1024 && decode_smem(d) <= 227 * 1024, "d {d}");
            let (p, q) = tiles_for(d);
            assert_eq!(crate::state::KV_BLOCK % p, 0);
            assert_eq!(crate::state::KV_BLOCK % q, 0);
        }
        assert_eq!(decode_splits(10, 2, 132), 1);
        assert_eq!(decode_splits(131072, 2, 132), 64);
    }

    #[test]
    fn prefill_split_rule() {
        // Qwen3.6-35B-A3B (16 query heads, 2 KV heads) on 132 SMs.
        let (g, hkv, sms) = (8, 2, 132);
        // The next turn of a 32K conversation: 100 queries = 13 tiles x 2 = 26 blocks -> 10
        // splits (260 blocks, one wave of two per SM), ~3,200 keys each.
        assert_eq!(prefill_splits(100, g, hkv, 32_000, sms, 64), 10);
        assert_eq!(prefill_splits(100, g, hkv, 32_000, sms, 4), 4);
        assert_eq!(prefill_splits(100, g, hkv, 32_000, sms, 1), 1);
        // Two queries: limited by MAX_SPLITS, then by the keys (1,024 per split at least).
        assert_eq!(prefill_splits(2, g, hkv, 131_072, sms, 64), MAX_SPLITS);
        assert_eq!(prefill_splits(2, g, hkv, 9_000, sms, 64), 8);
        // A short context: too few keys to split.
        assert_eq!(prefill_splits(100, g, hkv, 1_900, sms, 64), 1);
        assert_eq!(prefill_splits(37, g, hkv, 2_011, sms, 64), 2);
        // Prompts from the start, or spans whose blocks fill the SMs: the plain kernel.
        assert_eq!(prefill_splits(4096, g, hkv, 0, sms, 64), 1);
        assert_eq!(prefill_splits(600, g, hkv, 0, sms, 64), 1);
        assert_eq!(prefill_splits(528, g, hkv, 31_744, sms, 64), 1);
        // A 512-token chunk at 32K: 128 blocks on 132 SMs, one per SM: two splits fill both.
        assert_eq!(prefill_splits(512, g, hkv, 31_744, sms, 64), 2);
        // A chat turn of 330 tokens over 10K: 84 blocks -> 3 splits.
        assert_eq!(prefill_splits(330, g, hkv, 10_000, sms, 64), 3);
        assert_eq!(prefill_splits(256, g, hkv, 31_744, sms, 64), 4);
        assert_eq!(prefill_splits(0, g, hkv, 32_000, sms, 64), 1);
        assert_eq!(prefill_parts(100, 8, 2, 256, 10), (100 * 8 * 2 * 10 * 256, 100 * 8 * 2 * 10 * 2));
        // The partials stay small: below two blocks per SM of 64 rows at the most.
        for t in 2..600 {
            let n = prefill_splits(t, g, hkv, 1 << 20, sms, 64);
            assert!((t * g).div_ceil(64) * hkv * n <= 2 * sms, "t {t}: {n} splits");
        }
    }
}
