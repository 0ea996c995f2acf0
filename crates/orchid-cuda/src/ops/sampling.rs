//! Sampling launchers (greedy argmax over many blocks; the general sampler in one block).

use orchid_model::error::Result;

use super::Ctx;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: i32,
    pub seed: u64,
    pub valid: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct SampleArgs {
    pub logits: u64,
    pub params: u64,
    pub partial: u64,
    pub counter: u64,
    pub token_out: u64,
    pub pos: u64,
    pub step: u64,
    pub vocab: i32,
    pub nblocks: i32,
}

/// Blocks of the greedy argmax (the partial buffer holds this many float2).
pub const ARGMAX_BLOCKS: usize = 128;

impl SampleParams {
    pub fn greedy(valid: usize) -> SampleParams {
        SampleParams { valid: valid as i32, ..Default::default() }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

pub fn argmax(c: &Ctx, a: &SampleArgs) -> Result<()> {
    c.k("sample_argmax").launch(&c.gpu, (ARGMAX_BLOCKS as u32, 1, 1), 256, 0, a)
}

pub fn general(c: &Ctx, a: &SampleArgs) -> Result<()> {
    c.k("sample_general").launch(&c.gpu, (1, 1, 1), 1024, 0, a)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(std::mem::size_of::<super::SampleParams>(), 32);
        assert_eq!(std::mem::size_of::<super::SampleArgs>(), 64);
    }
}
