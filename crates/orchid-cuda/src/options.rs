//! What the CUDA backend is told by its user: the binary builds a [`CudaOptions`] once (from its
//! flags and the environment) and passes it to [`crate::CudaBackend::new`]; tests construct one.
//! The library itself reads no environment variables.

use std::path::PathBuf;

#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Chain the decode graph's kernels with programmatic dependent launch (compute capability
    /// 9.0 or newer; if the driver refuses it, the capture falls back without it by itself).
    pub pdl: bool,
    /// Synchronise after every launch outside a graph capture, so that a fault names its kernel
    /// (debugging; slow).
    pub sync_check: bool,
    /// Folder of the compiled-kernel cache (None: compile at every start).
    pub kernel_cache: Option<PathBuf>,
    /// CUDA toolkit folders, tried in order for NVRTC (`lib64/libnvrtc.so*`, when it is not on
    /// the loader's path) and its headers (`include`, `include/cccl`).
    pub cuda_roots: Vec<PathBuf>,
    /// Header folders for NVRTC (`cuda_bf16.h`, cccl) tried before those of `cuda_roots`.
    pub include_dirs: Vec<PathBuf>,
    /// Launch shapes.
    pub tuning: Tuning,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            pdl: true,
            sync_check: false,
            kernel_cache: None,
            cuda_roots: vec![PathBuf::from("/usr/local/cuda")],
            include_dirs: Vec::new(),
            tuning: Tuning::default(),
        }
    }
}

/// Launch-shape knobs (for A/B measurements without a rebuild); the defaults are the shapes
/// measured best (docs/perf-log.md). Out-of-range values are clamped by [`Tuning::clamped`].
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// Decode matvec blocks per SM assumed by the one-wave launch shapes (1..=3: registers).
    pub gemv_per_sm: usize,
    /// Warps per 16-row tile of `moe_up` (0: by K, `ops::moe_decode::moe_up_ksplit`, and for several
    /// tokens by the grid, `rows_ksplit`; at most 8).
    pub moe_up_ksplit: usize,
    /// Warps per 16-row tile of `moe_down_rows` (0: by the grid, `ops::moe_decode::rows_ksplit`;
    /// at most 8); the one-token `moe_down` always takes 8.
    pub moe_down_ksplit: usize,
    /// K parts of the one-token decode router matvec (1..=`ops::gemv::ROUTER_KPARTS`; several
    /// tokens take one).
    pub router_kparts: usize,
    /// Splits of the decode attention inside the CUDA graph (1..=`ops::attention::MAX_SPLITS`).
    pub attn_splits: usize,
    /// Key tiles per split at least in the graph's decode attention (short contexts: fewer splits).
    pub attn_min_tiles: usize,
    /// Most key splits of a prefill attention (split-KV, for spans of few query tiles over a long
    /// context, `ops::attention::prefill_splits`; 1: never split; at most `MAX_SPLITS`).
    pub attn_prefill_splits: usize,
    /// Most tokens an op-level MoE block runs through the per-token expert kernels (each token
    /// reads its own experts); larger batches take the grouped GEMM (each expert read once).
    pub moe_rows_max: usize,
    /// Most tokens a dense projection runs as matvecs (up to 8 tokens per launch, the weights
    /// read once per launch); larger batches take the GEMM.
    pub gemv_rows_max: usize,
    /// Batched GDN decode (`ops::deltanet::rows_kernel`): batches of at least this many rows take
    /// the streamed kernel (`gdn_decode_rows_stream`), smaller ones the block-per-row one
    /// (`gdn_decode_rows`); 0: never the streamed one.
    pub gdn_rows_kernel: usize,
    /// Most K parts of a dense GEMM split along K (`ops::gemm::gemm_kparts`; 1: no split-K;
    /// at most `ops::gemm::GEMM_KPARTS_MAX`).
    pub gemm_kparts_max: usize,
    /// Batched decode of 2..=8 rows: the router fused into the experts' gate/up kernel
    /// (`ops::moe_decode::moe_route_up_rows`) where the layer allows; false: the router matvec.
    pub route_rows: bool,
    /// Batched decode on the GEMM path (up to `ops::moe::ROUTE_SMALL_MAX` assignments): the
    /// shared expert as one more expert of the grouped GEMMs where its weights have an expert's
    /// shape (`ops::gemm::AltExpert`); false: GEMMs of its own.
    pub shared_grouped: bool,
    /// Split-K GEMMs sum their K parts inside the GEMM, as thread-block clusters
    /// (`ops::gemm::splitk_in_cluster`, where the GPU has them); false: a reduction kernel.
    pub splitk_cluster: bool,
    /// Narrowest token tile of the experts' grouped GEMMs (8, 32 or 64; `ops::gemm::grouped_bn`
    /// picks 8 for Q4 experts averaging fewer than 8 tokens).
    pub grouped_bn_min: usize,
    /// A block's input projections that share format and K in one split-K GEMM launch
    /// (`ops::gemm::gemm_each`, where each splits K alike); false: a launch per weight.
    pub gemm_each: bool,
    /// `gemm_each` chooses its K parts for all its weights' row blocks together (one wave of
    /// blocks; each output then differs in its last bits from its own launch's); false: only where
    /// every weight alone splits K alike, into those parts.
    pub gemm_each_wave: bool,
    /// The Q4 GEMMs of 64-token tiles on Hopper's warpgroup MMA (`ops::gemm::gemm_wgmma`, the
    /// `_wg` kernels, compute capability 9.0); false: the mma.sync kernels.
    pub gemm_wgmma: bool,
    /// The `_wg` GEMMs dequantise each 4-bit weight to bf16 (one rounding, as MLX's quantized
    /// matmul does) and let the tensor cores accumulate all of K (`ops::gemm::gemm_wg_round`, the
    /// `_wgr` kernels; ~1e-3 relative from the exact sums, 12 % faster at 4K prompts); false: the
    /// exact per-group scale step (the mma.sync kernels' bits).
    pub gemm_wg_round: bool,
    /// Q4 GEMMs with each warp's weights loaded straight into registers (`ops::gemm::gemm_ld`,
    /// the `_ld` kernels: the experts' 8-token tiles, dense 32-token tiles split in clusters);
    /// false: the cp.async pipeline.
    pub gemm_direct: bool,
    /// The GDN chunk scan's products on tensor cores (`ops::deltanet::scan_on_tensor_cores`,
    /// 3xTF32) where its dims allow; false: f32 FMAs.
    pub gdn_scan_tc: bool,
    /// Tensor-core chunk scans whose 32-column grid would take more than one wave run 64 columns
    /// a block (`ops::deltanet::scan_wide`, the same bits); false: always 32.
    pub gdn_scan_wide: bool,
    /// MoE blocks of at least this many rows on the GEMM path prepare the next block's GEMM input
    /// in their combine (`moe_combine` with a norm: a block per token); smaller ones leave it to
    /// the next block's `gemm_xprep_norm`.
    pub combine_norm_min: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            gemv_per_sm: 3,
            moe_up_ksplit: 0,
            moe_down_ksplit: 0,
            router_kparts: 8,
            attn_splits: 64,
            attn_min_tiles: 8,
            attn_prefill_splits: 64,
            moe_rows_max: 8,
            gemv_rows_max: 8,
            gdn_rows_kernel: 16,
            gemm_kparts_max: 8,
            route_rows: true,
            shared_grouped: true,
            splitk_cluster: true,
            grouped_bn_min: 8,
            gemm_each: true,
            gemm_each_wave: true,
            gemm_wgmma: true,
            gemm_wg_round: true,
            gemm_direct: true,
            gdn_scan_tc: true,
            gdn_scan_wide: true,
            combine_norm_min: 9,
        }
    }
}

impl Tuning {
    /// Every knob within the range its kernels support.
    pub fn clamped(&self) -> Tuning {
        Tuning {
            gemv_per_sm: self.gemv_per_sm.clamp(1, crate::ops::gemv::GEMV_BLOCKS_PER_SM),
            moe_up_ksplit: self.moe_up_ksplit.min(8),
            moe_down_ksplit: self.moe_down_ksplit.min(8),
            router_kparts: self.router_kparts.clamp(1, crate::ops::gemv::ROUTER_KPARTS),
            attn_splits: self.attn_splits.clamp(1, crate::ops::attention::MAX_SPLITS),
            attn_min_tiles: self.attn_min_tiles.min(4096),
            attn_prefill_splits: self.attn_prefill_splits.clamp(1, crate::ops::attention::MAX_SPLITS),
            moe_rows_max: self.moe_rows_max.min(4096),
            gemv_rows_max: self.gemv_rows_max.min(4096),
            gdn_rows_kernel: self.gdn_rows_kernel.min(4096),
            gemm_kparts_max: self.gemm_kparts_max.clamp(1, crate::ops::gemm::GEMM_KPARTS_MAX),
            route_rows: self.route_rows,
            shared_grouped: self.shared_grouped,
            splitk_cluster: self.splitk_cluster,
            grouped_bn_min: match self.grouped_bn_min {
                0..=8 => 8,
                9..=32 => 32,
                _ => 64,
            },
            gemm_each: self.gemm_each,
            gemm_each_wave: self.gemm_each_wave,
            gemm_wgmma: self.gemm_wgmma,
            gemm_wg_round: self.gemm_wg_round,
            gemm_direct: self.gemm_direct,
            gdn_scan_tc: self.gdn_scan_tc,
            gdn_scan_wide: self.gdn_scan_wide,
            combine_norm_min: self.combine_norm_min,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_within_range() {
        let t = Tuning::default();
        assert_eq!(t.clamped(), t);
        let wild = Tuning {
            gemv_per_sm: 9,
            moe_up_ksplit: 99,
            moe_down_ksplit: 99,
            router_kparts: 0,
            attn_splits: 1 << 20,
            attn_min_tiles: 1 << 20,
            attn_prefill_splits: 1 << 20,
            moe_rows_max: 0,
            gemv_rows_max: 0,
            gdn_rows_kernel: 1 << 20,
            gemm_kparts_max: 0,
            route_rows: true,
            shared_grouped: false,
            splitk_cluster: false,
            grouped_bn_min: 100,
            gemm_each: false,
            gemm_each_wave: false,
            gemm_wgmma: false,
            gemm_wg_round: true,
            gemm_direct: false,
            gdn_scan_tc: false,
            gdn_scan_wide: false,
            combine_norm_min: 0,
        };
        let c = wild.clamped();
        assert_eq!((c.gemv_per_sm, c.moe_up_ksplit, c.router_kparts, c.attn_min_tiles), (3, 8, 1, 4096));
        assert_eq!((c.gdn_rows_kernel, c.moe_down_ksplit), (4096, 8));
        assert_eq!(c.attn_splits, crate::ops::attention::MAX_SPLITS);
        assert_eq!((c.gemm_kparts_max, c.grouped_bn_min), (1, 64));
        let many = Tuning { gemm_kparts_max: 1000, ..Tuning::default() }.clamped();
        assert_eq!(many.gemm_kparts_max, crate::ops::gemm::GEMM_KPARTS_MAX);
        assert_eq!(c.attn_prefill_splits, crate::ops::attention::MAX_SPLITS);
        assert_eq!(Tuning { attn_prefill_splits: 0, ..t }.clamped().attn_prefill_splits, 1);
    }
}
