//! The settings orchid takes from the environment, read once here and passed to the libraries
//! (which read no environment variables):
//!
//! - `ORCHID_PDL=0`: capture the CUDA decode graph without programmatic dependent launch.
//! - `ORCHID_SYNC_CHECK=1`: synchronise after every CUDA launch, so that a fault names its kernel.
//! - `ORCHID_KERNEL_CACHE`: the compiled-kernel cache (default `$XDG_CACHE_HOME/orchid/kernels`,
//!   else `~/.cache/orchid/kernels`).
//! - `ORCHID_CUDA_HOME`, `CUDA_HOME`, `CUDA_PATH`: CUDA toolkit folders (NVRTC, headers), tried
//!   before `/usr/local/cuda`; `ORCHID_CUDA_INCLUDE`: header folders (a path list).
//! - `ORCHID_TUNE_<KNOB>=<n>`: launch shapes for A/B runs (`orchid_cuda::Tuning`: GEMV_PER_SM,
//!   MOE_UP_KSPLIT, MOE_DOWN_KSPLIT, ROUTER_KPARTS, ATTN_SPLITS, ATTN_MIN_TILES,
//!   ATTN_PREFILL_SPLITS (1: no split-KV prefill), MOE_ROWS_MAX, GEMV_ROWS_MAX, GDN_ROWS,
//!   GEMM_KPARTS_MAX (1: no split-K GEMMs), ROUTE_ROWS (0: batched decode without the router
//!   fused into the experts' kernel), SHARED_GROUPED (0: the shared expert's own GEMMs in
//!   batched decode), SPLITK_CLUSTER (0: split-K GEMMs summed by a reduction kernel), GROUPED_BN_MIN (32: no 8-token
//!   tiles for the experts' grouped GEMMs), GEMM_EACH (0: a GEMM launch per input projection),
//!   GEMM_EACH_WAVE (0: that launch only where each weight alone splits K alike), GEMM_WGMMA, GEMM_DIRECT,
//!   GDN_SCAN_TC (0: the GDN chunk scan on f32 FMAs), GDN_SCAN_WIDE (0: its tensor-core form 32
//!   columns a block, however many blocks), COMBINE_NORM_MIN (rows from which the MoE
//!   combine prepares the next block's input)).
//! - `ORCHID_DECODE_GRAPH=0` (or false/off/no): the engine decodes without the CUDA decode graph.
//! - `ORCHID_FAULT=load` or `step` (a testing aid): the engine thread panics while loading or at
//!   its first step.

use std::path::PathBuf;
use std::sync::OnceLock;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn off(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off" | "no")
}

fn tune(name: &str, default: usize) -> usize {
    var(&format!("ORCHID_TUNE_{name}")).and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// The CUDA backend's options.
pub fn cuda_options() -> &'static orchid_cuda::CudaOptions {
    static OPTS: OnceLock<orchid_cuda::CudaOptions> = OnceLock::new();
    OPTS.get_or_init(|| {
        let d = orchid_cuda::CudaOptions::default();
        let kernel_cache = var("ORCHID_KERNEL_CACHE")
            .map(PathBuf::from)
            .or_else(|| var("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("orchid/kernels")))
            .or_else(|| var("HOME").map(|p| PathBuf::from(p).join(".cache/orchid/kernels")))
            .unwrap_or_else(|| std::env::temp_dir().join("orchid-kernels"));
        let mut cuda_roots: Vec<PathBuf> =
            ["ORCHID_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"].iter().filter_map(|v| var(v)).map(PathBuf::from).collect();
        cuda_roots.extend(d.cuda_roots.iter().cloned());
        let t = &d.tuning;
        orchid_cuda::CudaOptions {
            pdl: var("ORCHID_PDL").is_none_or(|v| !off(&v)),
            sync_check: var("ORCHID_SYNC_CHECK").is_some_and(|v| !off(&v)),
            kernel_cache: Some(kernel_cache),
            cuda_roots,
            include_dirs: var("ORCHID_CUDA_INCLUDE").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default(),
            tuning: orchid_cuda::Tuning {
                gemv_per_sm: tune("GEMV_PER_SM", t.gemv_per_sm),
                moe_up_ksplit: tune("MOE_UP_KSPLIT", t.moe_up_ksplit),
                moe_down_ksplit: tune("MOE_DOWN_KSPLIT", t.moe_down_ksplit),
                router_kparts: tune("ROUTER_KPARTS", t.router_kparts),
                attn_splits: tune("ATTN_SPLITS", t.attn_splits),
                attn_min_tiles: tune("ATTN_MIN_TILES", t.attn_min_tiles),
                attn_prefill_splits: tune("ATTN_PREFILL_SPLITS", t.attn_prefill_splits),
                moe_rows_max: tune("MOE_ROWS_MAX", t.moe_rows_max),
                gemv_rows_max: tune("GEMV_ROWS_MAX", t.gemv_rows_max),
                gdn_rows_kernel: tune("GDN_ROWS", t.gdn_rows_kernel),
                gemm_kparts_max: tune("GEMM_KPARTS_MAX", t.gemm_kparts_max),
                route_rows: tune("ROUTE_ROWS", t.route_rows as usize) != 0,
                shared_grouped: tune("SHARED_GROUPED", t.shared_grouped as usize) != 0,
                splitk_cluster: tune("SPLITK_CLUSTER", t.splitk_cluster as usize) != 0,
                grouped_bn_min: tune("GROUPED_BN_MIN", t.grouped_bn_min),
                gemm_each: tune("GEMM_EACH", t.gemm_each as usize) != 0,
                gemm_each_wave: tune("GEMM_EACH_WAVE", t.gemm_each_wave as usize) != 0,
                gemm_wgmma: tune("GEMM_WGMMA", t.gemm_wgmma as usize) != 0,
                gemm_wg_round: tune("GEMM_WG_ROUND", t.gemm_wg_round as usize) != 0,
                gemm_direct: tune("GEMM_DIRECT", t.gemm_direct as usize) != 0,
                gdn_scan_tc: tune("GDN_SCAN_TC", t.gdn_scan_tc as usize) != 0,
                gdn_scan_wide: tune("GDN_SCAN_WIDE", t.gdn_scan_wide as usize) != 0,
                combine_norm_min: tune("COMBINE_NORM_MIN", t.combine_norm_min),
            },
        }
    })
}

/// Whether the engine may decode a lone sequence through the backend's fast decoder.
pub fn decode_graph() -> bool {
    var("ORCHID_DECODE_GRAPH").is_none_or(|v| !off(&v))
}

/// `ORCHID_FAULT`: the engine thread's injected panic, for tests.
pub fn fault() -> Option<orchid_engine::engine::Fault> {
    match var("ORCHID_FAULT")?.as_str() {
        "load" => Some(orchid_engine::engine::Fault::Load),
        "step" => Some(orchid_engine::engine::Fault::Step),
        _ => None,
    }
}
