//! Thin launchers: one `#[repr(C)]` struct per CUDA argument struct (same field order, so the
//! layouts agree), shape checks, and the choice of kernel variant (pure functions, unit-tested).

use std::collections::HashMap;
use std::sync::Arc;

use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, Gpu, Kernel};
use crate::weights::{GpuLinear, WFormat};

/// Every kernel name, per source file.
pub const KERNEL_NAMES: &[(&str, &[&str])] = &[
    ("elementwise", &["rms_norm", "add_rms_norm", "add_assign", "silu_mul", "gather_rows", "embed_q4", "embed_bf16"]),
    ("gemv", &["gemv_q4", "gemv_bf16", "gemv_q4_stream", "gemv_bf16_stream", "moe_up_q4", "moe_up_bf16", "moe_route_up_q4", "moe_down_q4", "moe_down_bf16"]),
    (
        "gemm",
        &[
            "gemm_q4_n32", "gemm_q4_pair_n32", "gemm_bf16_n32", "gemm_bf16_pair_n32", "gemm_q4_n64", "gemm_q4_n128", "gemm_q4_pair_n64", "gemm_q4_pair_n128", "gemm_bf16_n64", "gemm_bf16_n128",
            "gemm_bf16_pair_n64", "gemm_bf16_pair_n128", "gemm_xprep",
        ],
    ),
    (
        "attention",
        &[
            "attn_prep", "attn_combine", "attn_prefill_d32", "attn_decode_d32", "attn_prefill_d64", "attn_decode_d64",
            "attn_prefill_d128", "attn_decode_d128", "attn_prefill_d256", "attn_decode_d256",
        ],
    ),
    ("deltanet", &["gdn_conv", "gdn_prep", "gdn_chunk_prep", "gdn_chunk_scan", "gdn_gated_norm", "gdn_decode"]),
    ("moe", &["moe_topk", "moe_scan", "moe_scatter", "moe_combine"]),
    ("sampling", &["sample_argmax", "sample_general"]),
];

/// The GPU plus every loaded kernel.
pub struct Ctx {
    pub gpu: Arc<Gpu>,
    kernels: HashMap<&'static str, Kernel>,
}

impl Ctx {
    /// Compiles (or loads from the cache) every kernel family, in parallel.
    pub fn new(gpu: Arc<Gpu>) -> Result<Ctx> {
        let target = crate::compile::target_for(gpu.cc);
        let cubins: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = crate::compile::SOURCES
                .iter()
                .map(|(name, src)| {
                    let t = target.clone();
                    s.spawn(move || crate::compile::compile(name, src, &t))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Backend("kernel compile thread panicked".into())))).collect()
        });
        gpu.bind()?;
        let mut kernels = HashMap::new();
        for ((name, _), cubin) in crate::compile::SOURCES.iter().zip(cubins) {
            let cubin = cubin?;
            let names = KERNEL_NAMES.iter().find(|(n, _)| n == name).map(|(_, k)| *k).unwrap_or(&[]);
            for k in crate::driver::load_module(&gpu, &cubin, names)? {
                kernels.insert(k.name, k);
            }
        }
        // The GEMMs run up to two blocks of ~110 KB per SM: ask for the largest shared-memory
        // carveout (a hint; the driver may also pick it on its own, so a refusal is ignored).
        for (name, k) in kernels.iter() {
            if name.starts_with("gemm_") {
                use cudarc::driver::sys;
                // SAFETY: a live function handle of a loaded module; the value is a percentage.
                let _ = unsafe { sys::cuFuncSetAttribute(k.f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100) };
            }
        }
        Ok(Ctx { gpu, kernels })
    }

    pub fn k(&self, name: &str) -> Kernel {
        *self.kernels.get(name).unwrap_or_else(|| panic!("kernel {name} is not loaded"))
    }

}

pub mod attention;
pub mod deltanet;
pub mod moe;
pub mod sampling;

#[macro_export]
#[doc(hidden)]
macro_rules! params {
    ($($v:expr),*) => { &mut [$( &$v as *const _ as *mut std::ffi::c_void ),*] };
}
pub(crate) use params;

// ------------------------------------------------------------------------------------------------
// Elementwise

pub fn rms_norm(c: &Ctx, x: u64, w: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<()> {
    let (n32, eps) = (n as i32, eps);
    c.k("rms_norm").launch_raw(&c.gpu, (rows as u32, 1, 1), 256, 0, params!(x, w, y, n32, eps))
}

pub fn add_rms_norm(c: &Ctx, x: u64, r: u64, w: u64, y: u64, rows: usize, n: usize, eps: f32) -> Result<()> {
    let n32 = n as i32;
    c.k("add_rms_norm").launch_raw(&c.gpu, (rows as u32, 1, 1), 256, 0, params!(x, r, w, y, n32, eps))
}

fn grid1d(n: usize) -> u32 {
    (n.div_ceil(256)).clamp(1, 65535 * 8) as u32
}

pub fn add_assign(c: &Ctx, x: u64, y: u64, n: usize) -> Result<()> {
    let n64 = n as i64;
    c.k("add_assign").launch_raw(&c.gpu, (grid1d(n), 1, 1), 256, 0, params!(x, y, n64))
}

pub fn silu_mul(c: &Ctx, g: u64, u: u64, out: u64, n: usize) -> Result<()> {
    let n64 = n as i64;
    c.k("silu_mul").launch_raw(&c.gpu, (grid1d(n), 1, 1), 256, 0, params!(g, u, out, n64))
}

pub fn gather_rows(c: &Ctx, x: u64, rows: u64, out: u64, nrows: usize, n: usize) -> Result<()> {
    let n32 = n as i32;
    c.k("gather_rows").launch_raw(&c.gpu, (nrows as u32, 1, 1), 256, 0, params!(x, rows, out, n32))
}

pub fn embed(c: &Ctx, table: &GpuLinear, ids: u64, out: u64, t: usize) -> Result<()> {
    let (n, kpad) = (table.cols as i32, table.kpad as i32);
    let w = table.w_ptr();
    match table.fmt {
        WFormat::Q4 => {
            let sb = table.sb_ptr();
            c.k("embed_q4").launch_raw(&c.gpu, (t as u32, 1, 1), 256, 0, params!(w, sb, ids, out, n, kpad))
        }
        WFormat::Bf16 => c.k("embed_bf16").launch_raw(&c.gpu, (t as u32, 1, 1), 256, 0, params!(w, ids, out, n, kpad)),
    }
}

// ------------------------------------------------------------------------------------------------
// Decode matvecs

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GemvSeg {
    pub w: u64,
    pub sb: u64,
    pub rows: i32,
    pub tiles: i32,
    pub out_col: i32,
    pub pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GemvArgs {
    pub seg: [GemvSeg; 4],
    pub x: u64,
    pub norm_w: u64,
    pub out: u64,
    pub route_counter: u64,
    pub route_ids: u64,
    pub route_w: u64,
    pub partial: u64,
    pub nseg: i32,
    pub k: i32,
    pub kpad: i32,
    pub ldx: i32,
    pub t: i32,
    pub ldo: i32,
    pub accumulate: i32,
    pub ksplit: i32,
    pub eps: f32,
    pub e: i32,
    pub topk: i32,
    pub renorm: i32,
    pub shared_col: i32,
    pub kparts: i32,
    pub pad1: i32,
    pub pad2: i32,
}

/// Warps per 16-row tile along K: about four 128-k (Q4) or 32-k (bf16) units per warp.
pub fn gemv_ksplit(nunits: usize) -> usize {
    let mut ks = 1;
    while ks < 8 && nunits >= ks * 2 * 4 {
        ks *= 2;
    }
    if nunits >= 8 && ks < 2 {
        ks = 2;
    }
    ks
}

/// Warps per tile for a matvec of `tiles` 16-row tiles: the most that still fit every block in
/// one wave (`resident(ks)`: blocks resident at once with that shape), so no block waits for a
/// second wave and x is staged once per block, at most 8 units per warp. None if no shape fits
/// one wave (then the matvec streams: `gemv_stream_body`).
pub fn gemv_launch_ksplit(nunits: usize, tiles: usize, resident: impl Fn(usize) -> usize) -> Option<usize> {
    [8usize, 4, 2, 1].into_iter().find(|&ks| nunits / ks >= 1 && nunits.div_ceil(ks) <= 8 && tiles.div_ceil(8 / ks) <= resident(ks))
}

/// Blocks of the decode matvec kernels per SM by registers (≤ 80 each: `__launch_bounds__(256, 3)`).
pub const GEMV_BLOCKS_PER_SM: usize = 3;

/// Resident blocks of a decode kernel using `smem` bytes of dynamic shared memory: at most
/// GEMV_BLOCKS_PER_SM per SM, fewer where shared memory runs out (1 KB reserved per block).
pub fn gemv_resident(gpu: &crate::driver::Gpu, smem: usize) -> usize {
    let per_sm = (gpu.max_smem_optin as usize + 1024) / (smem + 1024);
    gpu.sms as usize * per_sm.clamp(1, GEMV_BLOCKS_PER_SM.min(crate::tuning::get().gemv_per_sm))
}

/// Warps per 16-row tile of the decode `moe_up` kernel: two units of gate and two of up per warp
/// (four ring slots: all requested at once), so K = 2048 (Q4) takes 8 warps per tile.
pub fn moe_up_ksplit(nunits: usize) -> usize {
    nunits.div_ceil(2).next_power_of_two().clamp(1, 8)
}

/// Unit slots per warp of the decode kernels' shared-memory weight ring (kernels/gemv.cu RING).
pub const RING_SLOTS: usize = 4;

/// Shared memory of the 8 warps' rings: a slot holds one unit of a 16-row tile for 32 lanes.
pub fn ring_bytes(fmt: WFormat) -> usize {
    8 * RING_SLOTS * if fmt == WFormat::Q4 { 32 * 48 } else { 32 * 32 }
}

/// Shared-memory bytes of one staged activation row (kernels/gemv.cu x_words): Q4 kernels keep
/// x in the mma fragment order, 4 x 20 words per 128-k unit; BF16 kernels as a padded row.
pub fn x_stage_bytes(fmt: WFormat, kpad: usize) -> usize {
    match fmt {
        WFormat::Q4 => kpad / 128 * 4 * 20 * 4,
        WFormat::Bf16 => (kpad + 8) * 2,
    }
}

/// Dynamic shared memory of a decode matvec (gemv_q4 / gemv_bf16).
pub fn gemv_smem(fmt: WFormat, kpad: usize, t: usize) -> usize {
    ring_bytes(fmt) + t * x_stage_bytes(fmt, kpad) + t * (kpad / 64) * 4 + 8 * 32 * 4 * 4
}

pub fn units_of(fmt: WFormat, kpad: usize) -> usize {
    match fmt {
        WFormat::Q4 => kpad / 128,
        WFormat::Bf16 => kpad / 32,
    }
}

/// Optional router epilogue: the last block computes the top-k of the first `e` outputs.
pub struct RouteEpi {
    pub counter: u64,
    pub ids: u64,
    pub wts: u64,
    pub e: usize,
    pub topk: usize,
    pub renorm: bool,
    pub shared_col: Option<usize>,
    /// Scratch for K-split partial sums: f32 [ROUTER_KPARTS][ldo].
    pub partial: u64,
}

/// K parts of the decode router matvec (more blocks than its 17 row tiles alone).
pub const ROUTER_KPARTS: usize = 8;

/// y[t, out_col_i + r] (=|+=) Σ_k x[t, k] W_i[r, k] for T ≤ 8 tokens; segments share x and the format.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    c: &Ctx,
    segs: &[(&GpuLinear, usize)],
    x: u64,
    ldx: usize,
    t: usize,
    norm: Option<(u64, f32)>,
    out: u64,
    ldo: usize,
    accumulate: bool,
    route: Option<RouteEpi>,
) -> Result<()> {
    if t == 0 || t > 8 || segs.is_empty() || segs.len() > 4 {
        return Err(Error::Op { op: "gemv", msg: format!("{t} tokens, {} segments", segs.len()) });
    }
    let (fmt, kpad, k) = (segs[0].0.fmt, segs[0].0.kpad, segs[0].0.cols);
    if segs.iter().any(|(w, _)| w.fmt != fmt || w.kpad != kpad || w.cols != k) {
        return Err(Error::Op { op: "gemv", msg: "segments differ in format or K".into() });
    }
    let mut a = GemvArgs::default();
    let mut total_tiles = 0;
    for (i, (w, col)) in segs.iter().enumerate() {
        let tiles = w.rows.div_ceil(16) as i32;
        a.seg[i] = GemvSeg { w: w.w_ptr(), sb: w.sb_ptr(), rows: w.rows as i32, tiles, out_col: *col as i32, pad: 0 };
        total_tiles += tiles as usize;
    }
    a.nseg = segs.len() as i32;
    a.x = x;
    a.k = k as i32;
    a.kpad = kpad as i32;
    a.ldx = ldx as i32;
    a.t = t as i32;
    a.out = out;
    a.ldo = ldo as i32;
    a.accumulate = accumulate as i32;
    if let Some((w, eps)) = norm {
        a.norm_w = w;
        a.eps = eps;
    }
    a.shared_col = -1;
    if let Some(r) = route {
        if r.e > 512 || r.topk > 32 {
            return Err(Error::Op { op: "router", msg: format!("{} experts / top-{} (at most 512 / 32 on the GPU)", r.e, r.topk) });
        }
        a.route_counter = r.counter;
        a.partial = r.partial;
        a.route_ids = r.ids;
        a.route_w = r.wts;
        a.e = r.e as i32;
        a.topk = r.topk as i32;
        a.renorm = r.renorm as i32;
        a.shared_col = r.shared_col.map_or(-1, |c| c as i32);
    }
    let units = units_of(fmt, kpad);
    let mut kparts = 1;
    if a.route_counter != 0 && a.partial != 0 {
        kparts = crate::tuning::get().router_kparts.min(ROUTER_KPARTS).min(units / 2).max(1);
    }
    let smem = gemv_smem(fmt, kpad, t);
    let resident = |_ks: usize| gemv_resident(&c.gpu, smem);
    let name = if fmt == WFormat::Q4 { "gemv_q4" } else { "gemv_bf16" };
    if kparts == 1 && a.route_counter == 0 && segs.len() == 1 && gemv_launch_ksplit(units, total_tiles, resident).is_none() {
        // Too large for one wave (the lm_head): resident blocks whose warps stream whole tiles.
        a.ksplit = 1;
        a.kparts = 1;
        let blocks = resident(1).min(total_tiles.div_ceil(8));
        return c.k(&format!("{name}_stream")).launch(&c.gpu, (blocks as u32, 1, 1), 256, smem as u32, &a);
    }
    let ks = if kparts > 1 { 8 } else { gemv_launch_ksplit(units, total_tiles, resident).unwrap_or_else(|| gemv_ksplit(units)) };
    a.ksplit = ks as i32;
    a.kparts = kparts as i32;
    let blocks = total_tiles.div_ceil(8 / ks);
    c.k(name).launch(&c.gpu, (blocks as u32, kparts as u32, 1), 256, smem as u32, &a)
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct MoeUpArgs {
    pub gate_w: u64,
    pub gate_sb: u64,
    pub up_w: u64,
    pub up_sb: u64,
    pub sh_gate_w: u64,
    pub sh_gate_sb: u64,
    pub sh_up_w: u64,
    pub sh_up_sb: u64,
    pub x: u64,
    pub norm_w: u64,
    pub ids: u64,
    pub h: u64,
    pub k: i32,
    pub kpad: i32,
    pub i: i32,
    pub rows_e: i32,
    pub is: i32,
    pub topk: i32,
    pub hstride: i32,
    pub ksplit: i32,
    pub eps: f32,
    pub has_shared: i32,
    pub pad0: i32,
    pub pad1: i32,
    pub router_w: u64,
    pub sgate_w: u64,
    pub partial: u64,
    pub barrier: u64,
    pub route_w: u64,
    pub e: i32,
    pub renorm: i32,
    pub kparts: i32,
    pub router_blocks: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct MoeDownArgs {
    pub down_w: u64,
    pub down_sb: u64,
    pub sh_down_w: u64,
    pub sh_down_sb: u64,
    pub h: u64,
    pub route_w: u64,
    pub ids: u64,
    pub out: u64,
    pub hdim: i32,
    pub rows_e: i32,
    pub kpad_r: i32,
    pub kpad_s: i32,
    pub i: i32,
    pub is: i32,
    pub topk: i32,
    pub has_shared: i32,
    pub hstride: i32,
    pub ksplit: i32,
    pub pad0: i32,
    pub pad1: i32,
}

/// Experts of one decode MoE: routed (stacked) and an optional shared (or dense) MLP.
pub struct MoeDecode<'a> {
    pub gate: Option<&'a GpuLinear>,
    pub up: Option<&'a GpuLinear>,
    pub down: Option<&'a GpuLinear>,
    pub sh_gate: Option<&'a GpuLinear>,
    pub sh_up: Option<&'a GpuLinear>,
    pub sh_down: Option<&'a GpuLinear>,
    pub topk: usize,
}

impl MoeDecode<'_> {
    fn fmt(&self) -> Result<WFormat> {
        let all: Vec<&GpuLinear> =
            [self.gate, self.up, self.down, self.sh_gate, self.sh_up, self.sh_down].into_iter().flatten().collect();
        let f = all.first().map(|w| w.fmt).ok_or_else(|| Error::Op { op: "moe", msg: "no experts".into() })?;
        if all.iter().any(|w| w.fmt != f) {
            return Err(Error::Op { op: "moe decode", msg: "routed and shared experts are stored in different formats".into() });
        }
        Ok(f)
    }
    pub fn hstride(&self) -> usize {
        self.gate.map_or(0, |g| g.rows).max(self.sh_gate.map_or(0, |g| g.rows))
    }
}

/// The router of a decode MoE layer, fused into `moe_up` by `moe_route_up` (kernels/gemv.cu
/// route_phase): bf16 router [e rows] and shared-expert gate row, `partial` f32 [kparts][e + 1],
/// `barrier` two zeroed u32 counters (reset by the kernel itself), `ids` / `wts` the routing for
/// moe_down.
pub struct FusedRoute<'a> {
    pub router: &'a GpuLinear,
    pub shared_gate: Option<&'a GpuLinear>,
    pub e: usize,
    pub renorm: bool,
    pub partial: u64,
    pub barrier: u64,
    pub wts: u64,
}

/// Whether `moe_route_up` can take this layer: Q4 experts, bf16 router (and shared gate) with the
/// experts' K, E a multiple of 16 (≤ 512), top-k ≤ 32, and every block of the grid resident at
/// once (its grid barrier needs that).
pub fn can_fuse_route(c: &Ctx, m: &MoeDecode, r: &FusedRoute) -> bool {
    let Ok(fmt) = m.fmt() else { return false };
    let (Some(g), Some(_)) = (m.gate, m.up) else { return false };
    let sg_ok = r.shared_gate.is_none_or(|s| s.fmt == WFormat::Bf16 && s.kpad == g.kpad && s.cols == g.cols);
    let shared = r.shared_gate.is_some() && m.sh_gate.is_some();
    if fmt != WFormat::Q4 || r.router.fmt != WFormat::Bf16 || r.router.kpad != g.kpad || !sg_ok || r.shared_gate.is_some() != m.sh_gate.is_some() {
        return false;
    }
    if r.e % 16 != 0 || r.e > 512 || m.topk > 32 || r.e != r.router.rows {
        return false;
    }
    let ks = moe_up_ksplit(units_of(fmt, g.kpad));
    let blocks = m.hstride().div_ceil(16).div_ceil(8 / ks) * (m.topk + shared as usize);
    let router_blocks = (r.e / 16 + shared as usize) * ROUTER_KPARTS;
    let smem = ring_bytes(fmt) + x_stage_bytes(fmt, g.kpad) + (g.kpad / 64) * 4 + 8 * 32 * 8 * 4 + 2560;
    router_blocks <= blocks && blocks <= gemv_resident(&c.gpu, smem)
}

/// h[src] = silu(gate_src · xn) ⊙ (up_src · xn), xn = rms_norm(x) (one token).
pub fn moe_up(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64) -> Result<()> {
    moe_up_impl(c, m, x, norm, ids, h, None)
}

/// Router and `moe_up` in one kernel (see `FusedRoute`); `ids` receives the routing for moe_down.
pub fn moe_route_up(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64, r: &FusedRoute) -> Result<()> {
    if !can_fuse_route(c, m, r) {
        return Err(Error::Op { op: "moe_route_up", msg: "layer shape not supported by the fused router".into() });
    }
    moe_up_impl(c, m, x, norm, ids, h, Some(r))
}

fn moe_up_impl(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64, route: Option<&FusedRoute>) -> Result<()> {
    let fmt = m.fmt()?;
    let any = m.gate.or(m.sh_gate).unwrap();
    let (k, kpad) = (any.cols, any.kpad);
    let mut a = MoeUpArgs { x, norm_w: norm.0, eps: norm.1, ids, h, k: k as i32, kpad: kpad as i32, topk: m.topk as i32, ..Default::default() };
    if let (Some(g), Some(u)) = (m.gate, m.up) {
        a.gate_w = g.w_ptr();
        a.gate_sb = g.sb_ptr();
        a.up_w = u.w_ptr();
        a.up_sb = u.sb_ptr();
        a.i = g.rows as i32;
        a.rows_e = g.rows_pad as i32;
    }
    if let (Some(g), Some(u)) = (m.sh_gate, m.sh_up) {
        a.sh_gate_w = g.w_ptr();
        a.sh_gate_sb = g.sb_ptr();
        a.sh_up_w = u.w_ptr();
        a.sh_up_sb = u.sb_ptr();
        a.is = g.rows as i32;
        a.has_shared = 1;
    }
    a.hstride = m.hstride() as i32;
    let ks = match crate::tuning::get().moe_up_ksplit {
        0 => moe_up_ksplit(units_of(fmt, kpad)),
        k => k.next_power_of_two(),
    };
    a.ksplit = ks as i32;
    let tiles = m.hstride().div_ceil(16);
    let nsrc = m.topk + a.has_shared as usize;
    let smem = ring_bytes(fmt) + x_stage_bytes(fmt, kpad) + (kpad / 64) * 4 + 8 * 32 * 8 * 4;
    let mut name = if fmt == WFormat::Q4 { "moe_up_q4" } else { "moe_up_bf16" };
    if let Some(r) = route {
        a.router_w = r.router.w_ptr();
        a.sgate_w = r.shared_gate.map_or(0, |s| s.w_ptr());
        a.partial = r.partial;
        a.barrier = r.barrier;
        a.route_w = r.wts;
        a.e = r.e as i32;
        a.renorm = r.renorm as i32;
        a.kparts = ROUTER_KPARTS as i32;
        a.router_blocks = ((r.e / 16 + a.has_shared as usize) * ROUTER_KPARTS) as i32;
        name = "moe_route_up_q4";
    }
    c.k(name).launch(&c.gpu, (tiles.div_ceil(8 / ks) as u32, nsrc as u32, 1), 256, smem as u32, &a)
}

/// out += Σ_src w[src] · down_src · h[src]  (w: routing weights, then the shared gate).
pub fn moe_down(c: &Ctx, m: &MoeDecode, h: u64, route_w: u64, ids: u64, out: u64) -> Result<()> {
    let fmt = m.fmt()?;
    let any = m.down.or(m.sh_down).unwrap();
    let hdim = any.rows;
    let mut a = MoeDownArgs { h, route_w, ids, out, hdim: hdim as i32, topk: m.topk as i32, hstride: m.hstride() as i32, ..Default::default() };
    if let Some(d) = m.down {
        a.down_w = d.w_ptr();
        a.down_sb = d.sb_ptr();
        a.rows_e = d.rows_pad as i32;
        a.kpad_r = d.kpad as i32;
        a.i = d.cols as i32;
    }
    if let Some(d) = m.sh_down {
        a.sh_down_w = d.w_ptr();
        a.sh_down_sb = d.sb_ptr();
        a.kpad_s = d.kpad as i32;
        a.is = d.cols as i32;
        a.has_shared = 1;
    }
    a.ksplit = 8;
    let nsrc = m.topk + a.has_shared as usize;
    let kmax = (a.kpad_r.max(a.kpad_s)) as usize;
    let smem = ring_bytes(fmt) + nsrc * x_stage_bytes(fmt, kmax) + nsrc * (kmax / 64) * 4 + 8 * 32 * 4 * 4;
    let name = if fmt == WFormat::Q4 { "moe_down_q4" } else { "moe_down_bf16" };
    c.k(name).launch(&c.gpu, (hdim.div_ceil(16) as u32, 1, 1), 256, smem as u32, &a)
}

// ------------------------------------------------------------------------------------------------
// Prefill GEMMs

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GemmArgs {
    pub w: u64,
    pub sb: u64,
    pub w2: u64,
    pub sb2: u64,
    /// Prepared activations (`GemmX`): bf16 rows [*, kpad] and their group sums [*, kpad / 64].
    pub x: u64,
    pub xs: u64,
    pub x_rows: u64,
    pub out: u64,
    pub tiles: u64,
    pub num_tiles: u64,
    pub m: i32,
    pub rows_e: i32,
    pub k: i32,
    pub kpad: i32,
    pub ldo: i32,
    pub t: i32,
    pub pad0: i32,
    pub pad1: i32,
}

/// Token-tile width: 32 for sparse groups (fewer than 32 tokens per expert on average: the
/// tile's unused columns cost mma and staging work), 64 for Q4 (register budget) and for short
/// or grouped inputs, else 128.
pub fn gemm_bn(fmt: WFormat, t: usize, grouped: Option<usize>) -> usize {
    match grouped {
        Some(avg) if avg < 32 => 32,
        Some(_) => 64,
        None if fmt == WFormat::Q4 || t < 128 => 64,
        None => 128,
    }
}

/// Token-tile width of a dense GEMM with `row_blocks` blocks along the weight rows: `gemm_bn`,
/// halved (down to 32) while the grid has fewer blocks than the GPU has SMs, so that small
/// GEMMs spread over more SMs (no split-K: the sums and their order do not depend on the tile
/// width). Q4 narrows only while the narrower grid still fits one block per SM, a rule set when
/// a Q4 block's main cost, dequantising its 128 weight rows in registers, was the same for any
/// width (since then the 32-token kernel dequantises each fragment once, the 64/128-token ones
/// by 4 token warps: to be re-measured); a bf16 block's work shrinks with its width.
pub fn gemm_bn_dense(fmt: WFormat, t: usize, row_blocks: usize, sms: usize) -> usize {
    let blocks = |bn: usize| row_blocks * t.div_ceil(bn);
    let mut bn = gemm_bn(fmt, t, None);
    while bn > 32 && blocks(bn) < sms && (fmt == WFormat::Bf16 || blocks(bn / 2) <= sms) {
        bn /= 2;
    }
    bn
}

/// cp.async pipeline stages of each GEMM kernel (kernels/gemm.cu `GemmCfg::STAGES`): Q4 BN 32/64
/// and bf16 BN 64 stay within 113 KB (two blocks per SM), the others within 227 KB (one block).
pub fn gemm_stages(fmt: WFormat, bn: usize) -> usize {
    match (fmt, bn) {
        (WFormat::Q4, 32) => 6,
        (WFormat::Q4, 64) => 4,
        (WFormat::Q4, _) => 5,
        (WFormat::Bf16, 32) => 4,
        (WFormat::Bf16, 64) => 2,
        (WFormat::Bf16, _) => 3,
    }
}

/// Dynamic shared memory of a GEMM kernel: its stages (weights, token rows, group sums per
/// k-step), or the epilogue's C tile if larger (kernels/gemm.cu `GemmCfg::SMEM`).
pub fn gemm_smem(fmt: WFormat, bn: usize) -> usize {
    let a = match fmt {
        WFormat::Q4 => 128 * 64 + 128 * 8,
        WFormat::Bf16 => 128 * 136 * 2,
    };
    let stage = a + bn * 136 * 2 + bn * 2 * 4;
    (gemm_stages(fmt, bn) * stage).max(bn * (128 + 4) * 4)
}

/// Grouped tiles: (tile table, device count, upper bound of tiles, the table's tile width).
pub struct Grouped {
    pub tiles: u64,
    pub num_tiles: u64,
    pub max_tiles: usize,
    pub bn: usize,
}

/// Activations prepared once for the GEMMs (`gemm_xprep`): `rows` rows of x rounded to bf16
/// [rows, kpad] (zero beyond K), then the sum of each 64-group of the rounded values
/// [rows, kpad / 64] f32, in one device buffer (freed, stream-ordered, when dropped).
pub struct GemmX {
    pub buf: DevBuf,
    pub rows: usize,
    pub k: usize,
    pub kpad: usize,
}

impl GemmX {
    pub fn xb(&self) -> u64 {
        self.buf.ptr
    }
    pub fn xs(&self) -> u64 {
        self.buf.ptr + (self.rows * self.kpad * 2) as u64
    }
}

/// Prepares `rows` rows of x (f32, row stride `ldx`, `k` columns) for `gemm`.
pub fn gemm_x(c: &Ctx, x: u64, ldx: usize, rows: usize, k: usize) -> Result<GemmX> {
    if !k.is_multiple_of(4) || !ldx.is_multiple_of(4) || ldx < k {
        return Err(Error::Op { op: "gemm", msg: format!("K {k} and the row stride {ldx} must be multiples of 4 (stride ≥ K)") });
    }
    let kpad = crate::weights::round_up(k.max(1), crate::weights::K_PAD);
    let buf = DevBuf::alloc(&c.gpu, rows * kpad * 2 + rows * (kpad / 64) * 4)?;
    let xp = GemmX { buf, rows, k, kpad };
    // gemm_xprep: a warp per XP_RUNS (4) runs of 128 columns, 8 warps per block.
    let warps = (rows * kpad / 128).div_ceil(4);
    if warps > 0 {
        let (xb, xs) = (xp.xb(), xp.xs());
        let (rows32, ldx32, k32, kpad32) = (rows as i32, ldx as i32, k as i32, kpad as i32);
        c.k("gemm_xprep").launch_raw(&c.gpu, (warps.div_ceil(8) as u32, 1, 1), 256, 0, params!(x, xb, xs, rows32, ldx32, k32, kpad32))?;
    }
    Ok(xp)
}

/// out[n, r] = Σ_k x[rows(n), k] W[r, k] (PAIR: silu(gate) ⊙ up) for many tokens; `x` prepared
/// by `gemm_x` (row n reads prepared row x_rows[n], or n when x_rows is 0).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    c: &Ctx,
    w: &GpuLinear,
    w2: Option<&GpuLinear>,
    x: &GemmX,
    x_rows: u64,
    t: usize,
    grouped: Option<Grouped>,
    out: u64,
    ldo: usize,
) -> Result<()> {
    if x.k != w.cols || x.kpad != w.kpad {
        return Err(Error::Op { op: "gemm", msg: format!("x prepared for K {} (padded {}), W has K {} (padded {})", x.k, x.kpad, w.cols, w.kpad) });
    }
    if x_rows == 0 && x.rows < t {
        return Err(Error::Op { op: "gemm", msg: format!("{t} tokens but {} prepared rows", x.rows) });
    }
    if let Some(u) = w2 {
        if u.fmt != w.fmt || u.rows != w.rows || u.kpad != w.kpad || u.rows_pad != w.rows_pad {
            return Err(Error::Op { op: "gemm pair", msg: "gate and up differ in format or shape".into() });
        }
    }
    let pair = w2.is_some();
    let gx = w.rows.div_ceil(if pair { 64 } else { 128 });
    let bn = grouped.as_ref().map_or_else(|| gemm_bn_dense(w.fmt, t, gx, c.gpu.sms as usize), |g| g.bn);
    if !matches!(bn, 32 | 64 | 128) {
        return Err(Error::Op { op: "gemm", msg: format!("token tile {bn} (32, 64 or 128)") });
    }
    let a = GemmArgs {
        w: w.w_ptr(),
        sb: w.sb_ptr(),
        w2: w2.map_or(0, |u| u.w_ptr()),
        sb2: w2.map_or(0, |u| u.sb_ptr()),
        x: x.xb(),
        xs: x.xs(),
        x_rows,
        out,
        tiles: grouped.as_ref().map_or(0, |g| g.tiles),
        num_tiles: grouped.as_ref().map_or(0, |g| g.num_tiles),
        m: w.rows as i32,
        rows_e: w.rows_pad as i32,
        k: w.cols as i32,
        kpad: w.kpad as i32,
        ldo: ldo as i32,
        t: t as i32,
        pad0: 0,
        pad1: 0,
    };
    let name = format!("gemm_{}{}_n{bn}", if w.fmt == WFormat::Q4 { "q4" } else { "bf16" }, if pair { "_pair" } else { "" });
    let gy = grouped.as_ref().map_or(t.div_ceil(bn), |g| g.max_tiles);
    c.k(&name).launch(&c.gpu, (gx as u32, gy as u32, 1), 256, gemm_smem(w.fmt, bn) as u32, &a)
}

/// x·Wᵀ for any number of tokens: matvec kernels up to 8 tokens, GEMMs beyond.
pub fn matmul(c: &Ctx, w: &GpuLinear, x: u64, ldx: usize, t: usize, out: u64, ldo: usize) -> Result<()> {
    if t <= 8 {
        gemv(c, &[(w, 0)], x, ldx, t, None, out, ldo, false, None)
    } else {
        let xp = gemm_x(c, x, ldx, t, w.cols)?;
        gemm(c, w, None, &xp, 0, t, None, out, ldo)
    }
}

/// `matmul` of an input several weights share: the GEMM (t > 8) reads `xp`, x prepared once by
/// `gemm_x` (unless it was prepared for another K); the matvec reads x.
#[allow(clippy::too_many_arguments)]
pub fn matmul_x(c: &Ctx, w: &GpuLinear, x: u64, ldx: usize, xp: &GemmX, t: usize, out: u64, ldo: usize) -> Result<()> {
    if t > 8 && xp.k == w.cols && xp.kpad == w.kpad && xp.rows >= t {
        gemm(c, w, None, xp, 0, t, None, out, ldo)
    } else {
        matmul(c, w, x, ldx, t, out, ldo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksplit_choice() {
        assert_eq!(gemv_ksplit(16), 2 * 2); // K=2048 Q4: four units per warp
        assert_eq!(gemv_ksplit(32), 8);
        assert_eq!(gemv_ksplit(4), 1);
        assert_eq!(gemv_ksplit(1), 1);
        assert_eq!(gemv_ksplit(64), 8);
        assert!(gemv_ksplit(8) >= 2);
    }

    #[test]
    fn arg_struct_sizes_match_cuda() {
        assert_eq!(std::mem::size_of::<GemvArgs>(), 248);
        assert_eq!(std::mem::size_of::<MoeUpArgs>(), 200);
        assert_eq!(std::mem::size_of::<MoeDownArgs>(), 112);
        assert_eq!(std::mem::size_of::<GemmArgs>(), 112);
    }

    #[test]
    fn moe_up_split() {
        assert_eq!(moe_up_ksplit(16), 8); // K = 2048 Q4: two units of gate and two of up per warp
        assert_eq!(moe_up_ksplit(4), 2);
        assert_eq!(moe_up_ksplit(1), 1);
        assert_eq!(moe_up_ksplit(64), 8); // bf16 K = 2048: 64 units, four batches
    }

    #[test]
    fn one_wave_matvecs() {
        // qkv|z|b|a of the 35B (772 tiles, K = 2048) at 3 blocks/SM: 4 warps per tile, 386 blocks;
        // at 2 blocks/SM: 2 warps per tile, 193 blocks.
        assert_eq!(gemv_launch_ksplit(16, 772, |_| 396), Some(4));
        assert_eq!(gemv_launch_ksplit(16, 772, |_| 264), Some(2));
        // out_proj (128 tiles, K = 4096): 8 warps per tile, 128 blocks.
        assert_eq!(gemv_launch_ksplit(32, 128, |_| 264), Some(8));
        // lm_head does not fit one wave: it streams.
        assert_eq!(gemv_launch_ksplit(16, 15520, |_| 396), None);
        // Rings: 4 slots of 1.5 KB (Q4) per warp, 48 KB per block; x of K = 2048 in fragment order.
        assert_eq!(ring_bytes(WFormat::Q4), 48 * 1024);
        assert_eq!(gemv_smem(WFormat::Q4, 2048, 1), 48 * 1024 + 5120 + 128 + 4096);
    }

    #[test]
    fn gemm_variants() {
        assert_eq!(gemm_bn(WFormat::Q4, 4096, None), 64);
        assert_eq!(gemm_bn(WFormat::Bf16, 4096, None), 128);
        assert_eq!(gemm_bn(WFormat::Bf16, 4096, Some(128)), 64);
        assert_eq!(gemm_bn(WFormat::Q4, 4096, Some(8)), 32);
        // Shared memory per kernel: the same numbers as the static_asserts in kernels/gemm.cu.
        let smem = |f, bn| gemm_smem(f, bn);
        assert_eq!(smem(WFormat::Q4, 32), 109056); // 6 stages
        assert_eq!(smem(WFormat::Q4, 64), 108544); // 4 stages
        assert_eq!(smem(WFormat::Q4, 128), 225280); // 5 stages
        assert_eq!(smem(WFormat::Bf16, 32), 175104); // 4 stages
        assert_eq!(smem(WFormat::Bf16, 64), 105472); // 2 stages
        assert_eq!(smem(WFormat::Bf16, 128), 211968); // 3 stages
        for f in [WFormat::Q4, WFormat::Bf16] {
            for bn in [32, 64, 128] {
                assert!(gemm_smem(f, bn) <= 227 * 1024);
                assert!(gemm_stages(f, bn) >= 2);
            }
        }
        // Two blocks per SM (228 KB, 1 KB reserved per block) where the kernels ask for it.
        for (f, bn) in [(WFormat::Q4, 32), (WFormat::Q4, 64), (WFormat::Bf16, 64)] {
            assert!(2 * (gemm_smem(f, bn) + 1024) <= 228 * 1024);
        }
        // Dense tiles on 132 SMs (T = 256): Q4 with 16 row blocks (4 x 64-token tiles = 64
        // blocks) narrows to 32 tokens; 64 row blocks (256 blocks) keep 64.
        assert_eq!(gemm_bn_dense(WFormat::Q4, 256, 16, 132), 32);
        assert_eq!(gemm_bn_dense(WFormat::Q4, 256, 64, 132), 64);
        // 32 row blocks: 128 blocks of 64 tokens already fill one block per SM; 256 of 32 would
        // put two on each SM (the rule in gemm_bn_dense).
        assert_eq!(gemm_bn_dense(WFormat::Q4, 256, 32, 132), 64);
        assert_eq!(gemm_bn_dense(WFormat::Q4, 256, 1, 132), 32);
        assert_eq!(gemm_bn_dense(WFormat::Q4, 4096, 16, 132), 64);
        // The router (256 experts = 2 row blocks, bf16): 128 -> 32.
        assert_eq!(gemm_bn_dense(WFormat::Bf16, 256, 2, 132), 32);
        assert_eq!(gemm_bn_dense(WFormat::Bf16, 4096, 64, 132), 128);
        assert_eq!(gemm_bn_dense(WFormat::Bf16, 100, 128, 132), 64);
    }
}
