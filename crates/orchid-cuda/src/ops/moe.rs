//! MoE prefill launchers: top-k routing, counts/offsets/tile table, scatter, combine.

use orchid_model::error::Result;

use super::Ctx;

crate::kernel_abi! {
    pub fn moe_abi;
    #[derive(Clone, Copy, Default)]
    struct TopkArgs {
        logits: u64,
        ids: u64,
        wts: u64,
        counts: u64,
        t: i32 => "T",
        e: i32 => "E",
        topk: i32,
        renorm: i32,
        ldl: i32,
        /// `topk_rows`: 1 when column E holds the shared expert's gate logit.
        shared: i32,
        pad1: i32,
        pad2: i32,
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
        t: i32 => "T",
        topk: i32,
        pad0: i32,
        pad1: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct CombineArgs {
        y: u64,
        wts: u64,
        slot_pos: u64,
        shared: u64,
        shared_gate: u64,
        out: u64,
        t: i32 => "T",
        h: i32 => "H",
        topk: i32,
        ld_sg: i32,
        /// Add the sum onto `out` (the residual) instead of storing it.
        acc: i32,
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

/// Stable scatter into the per-expert lists: one block per expert (`e` experts).
pub fn scatter(c: &Ctx, a: &ScatterArgs, e: usize) -> Result<()> {
    c.k("moe_scatter").launch(&c.gpu, (e as u32, 1, 1), 256, 0, a)
}

pub fn combine(c: &Ctx, a: &CombineArgs) -> Result<()> {
    c.k("moe_combine").launch(&c.gpu, (a.t as u32, 1, 1), 256, 0, a)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(std::mem::size_of::<super::TopkArgs>(), 64);
        assert_eq!(std::mem::size_of::<super::ScanArgs>(), 56);
        assert_eq!(std::mem::size_of::<super::ScatterArgs>(), 48);
        assert_eq!(std::mem::size_of::<super::CombineArgs>(), 72);
    }
}
