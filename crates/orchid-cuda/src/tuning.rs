//! Launch-shape knobs, for A/B measurements on the GPU without a rebuild. The defaults are the
//! shapes measured best (docs/perf-log.md); `ORCHID_TUNE_<NAME>=<n>` overrides one for a run.

use std::sync::OnceLock;

pub struct Tuning {
    /// Decode matvec blocks per SM assumed by the one-wave launch shapes (≤ 3 by registers).
    pub gemv_per_sm: usize,
    /// Warps per 16-row tile of `moe_up` (0: by K, `ops::moe_up_ksplit`).
    pub moe_up_ksplit: usize,
    /// K parts of the decode router matvec.
    pub router_kparts: usize,
    /// Splits of the decode attention inside the CUDA graph.
    pub attn_splits: usize,
    /// Key tiles per split at least in the graph's decode attention (short contexts: fewer splits).
    pub attn_min_tiles: usize,
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(format!("ORCHID_TUNE_{name}")).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub fn get() -> &'static Tuning {
    static T: OnceLock<Tuning> = OnceLock::new();
    T.get_or_init(|| Tuning {
        gemv_per_sm: env("GEMV_PER_SM", 3).clamp(1, 3),
        moe_up_ksplit: env("MOE_UP_KSPLIT", 0).min(8),
        router_kparts: env("ROUTER_KPARTS", 8).clamp(1, 16),
        attn_splits: env("ATTN_SPLITS", 64).clamp(1, crate::ops::attention::MAX_SPLITS),
        attn_min_tiles: env("ATTN_MIN_TILES", 8).min(4096),
    })
}
