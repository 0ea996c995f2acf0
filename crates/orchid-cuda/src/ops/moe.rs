//! MoE prefill launchers: top-k routing, counts/offsets/tile table, scatter, combine.

use orchid_model::error::Result;

use super::Ctx;
use super::elementwise::zero_words;
use crate::driver::DevBuf;

crate::kernel_abi! {
    pub fn moe_abi;
    const {
        /// Most experts the routing kernels take (`warp_topk`: 16 logits per lane).
        MOE_E_MAX: usize = 512;
        /// Tokens per chunk of `moe_scatter` (a multiple of its 8 warps).
        SCATTER_CHUNK_TOKENS: usize = 128;
    }
    #[derive(Clone, Copy, Default)]
    struct TopkArgs {
        logits: u64,
        ids: u64,
        wts: u64,
        counts: u64,
        /// With `counts`: each scatter chunk's counts [chunks, E] (0: none).
        chunk_counts: u64,
        t: i32 => "T",
        e: i32 => "E",
        topk: i32,
        renorm: i32,
        ldl: i32,
        /// `topk_rows`: 1 when column E holds the shared expert's gate logit.
        shared: i32,
        chunk_tokens: i32,
        pad0: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct ScanArgs {
        counts: u64,
        offsets: u64,
        cursor: u64,
        tiles: u64,
        num_tiles: u64,
        e: i32 => "E",
        bn: i32,
        pad0: i32,
        pad1: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct ScatterArgs {
        ids: u64,
        cursor: u64,
        assign_tok: u64,
        slot_pos: u64,
        chunk_counts: u64,
        t: i32 => "T",
        topk: i32,
        e: i32 => "E",
        chunk_tokens: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct ListsArgs {
        ids: u64,
        tiles: u64,
        num_tiles: u64,
        assign_tok: u64,
        slot_pos: u64,
        t: i32 => "T",
        e: i32 => "E",
        topk: i32,
        bn: i32,
        /// 1: the shared expert is listed as expert E (`Routing::shared`).
        shared: i32,
        pad0: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct CombineArgs {
        y: u64,
        wts: u64,
        slot_pos: u64,
        shared: u64,
        shared_gate: u64,
        out: u64,
        /// Not 0: the norm weight of the next block, whose GEMM input (`xb`, `xs`: a `GemmX` of
        /// `kpad` columns) is prepared from the new rows too.
        norm: u64,
        xb: u64,
        xs: u64,
        t: i32 => "T",
        h: i32 => "H",
        topk: i32,
        ld_sg: i32,
        /// Add the sum onto `out` (the residual) instead of storing it.
        acc: i32,
        kpad: i32,
        eps: f32,
        pad0: i32,
    }
}

pub fn topk(c: &Ctx, a: &TopkArgs) -> Result<()> {
    c.k("moe_topk").launch(&c.gpu, ((a.t as usize).div_ceil(4) as u32, 1, 1), 128, 0, a)
}

/// Top-k per token for the per-token expert kernels (`moe_decode::moe_up_rows`): ids [T, topk],
/// weights [T, topk + shared] (the shared expert's sigmoid gate last).
pub fn topk_rows(c: &Ctx, a: &TopkArgs) -> Result<()> {
    c.k("moe_topk_rows").launch(&c.gpu, ((a.t as usize).div_ceil(4) as u32, 1, 1), 128, 0, a)
}

pub fn scan(c: &Ctx, a: &ScanArgs) -> Result<()> {
    c.k("moe_scan").launch(&c.gpu, (1, 1, 1), 1024, 0, a)
}

/// Stable scatter into the per-expert lists: one block per chunk of `a.chunk_tokens` tokens.
pub fn scatter(c: &Ctx, a: &ScatterArgs) -> Result<()> {
    c.k("moe_scatter").launch(&c.gpu, ((a.t as usize).div_ceil(a.chunk_tokens as usize) as u32, 1, 1), 256, 0, a)
}

/// One MoE layer's routing: `t` tokens' logits over `e` experts [t, e] (row stride `ldl` ≥ e) in; out, each token's
/// top-`k` weights [t, k] (renormalised where `renorm`), the grouped GEMMs' tile table (tiles of
/// `bn` tokens) and its count, and the expert-ordered lists (`assign_tok`: the token of each
/// list position; `slot_pos`: the list position of each (token, slot)). With `shared`
/// (`route_small` only), the shared expert is listed too, as expert `e` with every token: list
/// positions t·k + i (token i), its tiles after the routed experts' (room for t + bn more
/// positions' worth of tiles and t more list entries).
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub logits: u64,
    pub ldl: usize,
    pub t: usize,
    pub e: usize,
    pub k: usize,
    pub renorm: bool,
    pub bn: usize,
    pub wts: u64,
    pub tiles: u64,
    pub num_tiles: u64,
    pub assign_tok: u64,
    pub slot_pos: u64,
    pub shared: bool,
}

impl Routing {
    /// The top-k launch of this routing, with `ids` out and, where not 0, the experts' `counts`
    /// and each scatter chunk's `chunk_counts` counted.
    fn topk_args(&self, ids: u64, counts: u64, chunk_counts: u64) -> TopkArgs {
        TopkArgs {
            logits: self.logits,
            ids,
            wts: self.wts,
            counts,
            chunk_counts,
            t: self.t as i32,
            e: self.e as i32,
            topk: self.k as i32,
            renorm: self.renorm as i32,
            ldl: self.ldl as i32,
            chunk_tokens: SCATTER_CHUNK_TOKENS as i32,
            ..Default::default()
        }
    }
}

/// The routing of any number of tokens (prompt chunks) in four launches: top-k with the experts'
/// counts (in all and per chunk of `SCATTER_CHUNK_TOKENS` tokens), their scan into offsets and the
/// tile table, the stable scatter into the lists (a block per chunk).
pub fn route_chain(c: &Ctx, r: &Routing) -> Result<()> {
    if r.shared || r.e > MOE_E_MAX {
        return Err(orchid_model::error::Error::Op {
            op: "moe route_chain",
            msg: format!(
                "{} experts, shared listed: {} (at most {MOE_E_MAX}; the shared expert is listed by route_small only)",
                r.e, r.shared
            ),
        });
    }
    let ids = DevBuf::alloc(&c.gpu, r.t * r.k * 4)?;
    // The experts' counts, then each chunk's: zeroed in one launch.
    let chunks = r.t.div_ceil(SCATTER_CHUNK_TOKENS);
    let counts = DevBuf::alloc(&c.gpu, (1 + chunks) * r.e * 4)?;
    let chunk_counts = counts.ptr + (r.e * 4) as u64;
    zero_words(c, counts.ptr, (1 + chunks) * r.e)?;
    topk(c, &r.topk_args(ids.ptr, counts.ptr, chunk_counts))?;
    let offsets = DevBuf::alloc(&c.gpu, r.e * 4)?;
    let cursor = DevBuf::alloc(&c.gpu, r.e * 4)?;
    let (t, e, topk, chunk_tokens) = (r.t as i32, r.e as i32, r.k as i32, SCATTER_CHUNK_TOKENS as i32);
    let (tiles, num_tiles, bn) = (r.tiles, r.num_tiles, r.bn as i32);
    scan(c, &ScanArgs { counts: counts.ptr, offsets: offsets.ptr, cursor: cursor.ptr, tiles, num_tiles, e, bn, ..Default::default() })?;
    let (assign_tok, slot_pos) = (r.assign_tok, r.slot_pos);
    scatter(c, &ScatterArgs { ids: ids.ptr, cursor: cursor.ptr, assign_tok, slot_pos, chunk_counts, t, topk, e, chunk_tokens })
}

/// Most assignments (tokens x top-k) `route_small` takes: one per thread of its block.
pub const ROUTE_SMALL_MAX: usize = 1024;

/// `route_chain` of at most `ROUTE_SMALL_MAX` assignments (batched decode) in two launches, bit
/// for bit: the top-k over many blocks, then the counts, scans, tile table and lists in one block.
pub fn route_small(c: &Ctx, r: &Routing) -> Result<()> {
    if r.t * r.k > ROUTE_SMALL_MAX || r.e > MOE_E_MAX {
        return Err(orchid_model::error::Error::Op {
            op: "moe route_small",
            msg: format!("{} tokens x top-{} over {} experts (at most {ROUTE_SMALL_MAX} assignments, {MOE_E_MAX} experts)", r.t, r.k, r.e),
        });
    }
    let ids = DevBuf::alloc(&c.gpu, r.t * r.k * 4)?;
    topk(c, &r.topk_args(ids.ptr, 0, 0))?;
    let a = ListsArgs {
        ids: ids.ptr,
        tiles: r.tiles,
        num_tiles: r.num_tiles,
        assign_tok: r.assign_tok,
        slot_pos: r.slot_pos,
        t: r.t as i32,
        e: r.e as i32,
        topk: r.k as i32,
        bn: r.bn as i32,
        shared: r.shared as i32,
        pad0: 0,
    };
    c.k("moe_lists").launch(&c.gpu, (1, 1, 1), 1024, 0, &a)
}

/// Most tokens whose `combine` with a norm takes blocks of 1024 threads.
const COMBINE_WIDE_ROWS: usize = 128;

/// The experts' weighted sum per token (a block of 256 per 256 outputs of a token). With `a.norm`
/// a block per token, which also prepares the next block's input: 1024 threads for a decode
/// batch (few blocks: more loads in flight each), 256 for a prompt (more blocks per SM).
pub fn combine(c: &Ctx, a: &CombineArgs) -> Result<()> {
    let (blocks, threads) = match a.norm {
        0 => ((a.h as u32).div_ceil(256), 256),
        _ if a.t as usize <= COMBINE_WIDE_ROWS => (1, 1024),
        _ => (1, 256),
    };
    c.k("moe_combine").launch(&c.gpu, (a.t as u32, blocks, 1), threads, 0, a)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(std::mem::size_of::<super::TopkArgs>(), 72);
        assert_eq!(std::mem::size_of::<super::ScanArgs>(), 56);
        assert_eq!(std::mem::size_of::<super::ScatterArgs>(), 56);
        assert_eq!(std::mem::size_of::<super::CombineArgs>(), 104);
        assert_eq!(std::mem::size_of::<super::ListsArgs>(), 64);
    }
}
