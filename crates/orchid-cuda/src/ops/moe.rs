//! MoE prefill launchers: top-k routing, counts/offsets/tile table, scatter, combine.

use orchid_model::error::Result;

use super::Ctx;

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct TopkArgs {
    pub logits: u64,
    pub ids: u64,
    pub wts: u64,
    pub counts: u64,
    pub t: i32,
    pub e: i32,
    pub topk: i32,
    pub renorm: i32,
    pub ldl: i32,
    pub pad0: i32,
    pub pad1: i32,
    pub pad2: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ScanArgs {
    pub counts: u64,
    pub offsets: u64,
    pub cursor: u64,
    pub tiles: u64,
    pub num_tiles: u64,
    pub e: i32,
    pub bn: i32,
    pub pad0: i32,
    pub pad1: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ScatterArgs {
    pub ids: u64,
    pub cursor: u64,
    pub assign_tok: u64,
    pub slot_pos: u64,
    pub t: i32,
    pub topk: i32,
    pub pad0: i32,
    pub pad1: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CombineArgs {
    pub y: u64,
    pub wts: u64,
    pub slot_pos: u64,
    pub shared: u64,
    pub shared_gate: u64,
    pub out: u64,
    pub t: i32,
    pub h: i32,
    pub topk: i32,
    pub ld_sg: i32,
}

pub fn topk(c: &Ctx, a: &TopkArgs) -> Result<()> {
    c.k("moe_topk").launch(&c.gpu, ((a.t as usize).div_ceil(4) as u32, 1, 1), 128, 0, a)
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
        assert_eq!(std::mem::size_of::<super::CombineArgs>(), 64);
    }
}
