//! Decode matvec launchers (kernels/gemv.cu): y = x·Wᵀ for up to 8 tokens on tensor cores, with
//! the preceding RMSNorm fused on load, up to four weights in one launch, and the router's top-k
//! epilogue; the launch-shape choice (pure functions, unit-tested).

use orchid_model::error::{Error, Result};

use super::Ctx;
use crate::weights::{GpuLinear, WFormat};

crate::kernel_abi! {
    pub fn matvec_abi;
    const {
        /// Unit slots per warp of the decode kernels' shared-memory weight ring (matvec.cuh UnitRing).
        RING_SLOTS => "RING": usize = 4;
        /// Words per (unit, lane quad member) of x staged in mma fragment order (matvec.cuh XLayout),
        /// 16 used: the four members of a warp hit disjoint banks.
        XF_STRIDE: usize = 20;
    }
}

crate::kernel_abi! {
    pub fn gemv_abi;
    #[derive(Clone, Copy, Default)]
    struct GemvSeg {
        w: u64,
        sb: u64,
        /// The segment's output column 0: y[t, r] at out + t·ldo + r.
        out: u64,
        rows: i32,
        tiles: i32,
        /// The segment's first column in the router's logits (K-part partial sums).
        out_col: i32,
        ldo: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct GemvArgs {
        seg: [GemvSeg; 4],
        x: u64,
        norm_w: u64,
        out: u64,
        route_counter: u64,
        route_ids: u64,
        route_w: u64,
        partial: u64,
        nseg: i32,
        k: i32 => "K",
        kpad: i32,
        ldx: i32,
        t: i32 => "T",
        ldo: i32,
        accumulate: i32,
        ksplit: i32,
        eps: f32,
        e: i32 => "E",
        topk: i32,
        renorm: i32,
        shared_col: i32,
        kparts: i32,
        pad1: i32,
        pad2: i32,
    }
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
pub fn gemv_resident(c: &Ctx, smem: usize) -> usize {
    let gpu = &c.gpu;
    let per_sm = (gpu.max_smem_optin as usize + 1024) / (smem + 1024);
    gpu.sms as usize * per_sm.clamp(1, GEMV_BLOCKS_PER_SM.min(c.tuning.gemv_per_sm))
}

/// Shared memory of the 8 warps' rings: a slot holds one unit of a 16-row tile for 32 lanes.
pub fn ring_bytes(fmt: WFormat) -> usize {
    8 * RING_SLOTS * if fmt == WFormat::Q4 { 32 * 48 } else { 32 * 32 }
}

/// Shared-memory bytes of one staged activation row (kernels/matvec.cuh x_words): Q4 kernels keep
/// x in the mma fragment order, 4 x 20 words per 128-k unit; BF16 kernels as a padded row.
pub fn x_stage_bytes(fmt: WFormat, kpad: usize) -> usize {
    match fmt {
        WFormat::Q4 => kpad / 128 * 4 * XF_STRIDE * 4,
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
    /// Scratch for K-split partial sums: f32 [ROUTER_KPARTS][T][ldo] (0: no K parts).
    pub partial: u64,
}

/// K parts of the decode router matvec (more blocks than its 17 row tiles alone).
pub const ROUTER_KPARTS: usize = 8;

/// Most tokens one `gemv` takes.
pub const MAX_TOKENS: usize = 8;

/// Whether `t` tokens take the matvecs (`gemv_rows`) rather than the GEMM.
pub fn use_gemv(c: &Ctx, t: usize) -> bool {
    t <= MAX_TOKENS.max(c.tuning.gemv_rows_max)
}

/// `gemv` of any number of tokens, `MAX_TOKENS` per launch (each launch reads the weights).
#[allow(clippy::too_many_arguments)]
pub fn gemv_rows(
    c: &Ctx,
    segs: &[(&GpuLinear, usize)],
    x: u64,
    ldx: usize,
    t: usize,
    norm: Option<(u64, f32)>,
    out: u64,
    ldo: usize,
    accumulate: bool,
) -> Result<()> {
    for r0 in (0..t).step_by(MAX_TOKENS) {
        let n = MAX_TOKENS.min(t - r0);
        gemv(c, segs, x + (r0 * ldx * 4) as u64, ldx, n, norm, out + (r0 * ldo * 4) as u64, ldo, accumulate, None)?;
    }
    Ok(())
}

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
    let outs: Vec<Seg> = segs.iter().map(|&(w, col)| Seg { w, out: out + (col * 4) as u64, ldo, col }).collect();
    launch(c, &outs, x, ldx, t, norm, (out, ldo), accumulate, route)
}

/// `gemv` of up to four weights into outputs of their own: y_i [t, rows_i] at `outs[i]`.
pub fn gemv_each(c: &Ctx, segs: &[(&GpuLinear, u64)], x: u64, ldx: usize, t: usize, norm: Option<(u64, f32)>) -> Result<()> {
    let outs: Vec<Seg> = segs.iter().map(|&(w, out)| Seg { w, out, ldo: w.rows, col: 0 }).collect();
    launch(c, &outs, x, ldx, t, norm, (0, 0), false, None)
}

/// Runs of `ws` (indices) that one `gemv_each` launch takes: up to four neighbours sharing
/// format and K.
pub fn gemv_groups(ws: &[&GpuLinear]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < ws.len() {
        let mut j = i + 1;
        while j < ws.len() && j - i < 4 && ws[j].fmt == ws[i].fmt && ws[j].kpad == ws[i].kpad && ws[j].cols == ws[i].cols {
            j += 1;
        }
        runs.push(i..j);
        i = j;
    }
    runs
}

/// One segment of a launch: the weight, its output (column 0, row stride) and, for the router's
/// K parts, its first column in the shared output.
struct Seg<'a> {
    w: &'a GpuLinear,
    out: u64,
    ldo: usize,
    col: usize,
}

#[allow(clippy::too_many_arguments)]
fn launch(
    c: &Ctx,
    segs: &[Seg],
    x: u64,
    ldx: usize,
    t: usize,
    norm: Option<(u64, f32)>,
    (out, ldo): (u64, usize),
    accumulate: bool,
    route: Option<RouteEpi>,
) -> Result<()> {
    if t == 0 || t > MAX_TOKENS || segs.is_empty() || segs.len() > 4 {
        return Err(Error::Op { op: "gemv", msg: format!("{t} tokens, {} segments", segs.len()) });
    }
    let (fmt, kpad, k) = (segs[0].w.fmt, segs[0].w.kpad, segs[0].w.cols);
    if segs.iter().any(|s| s.w.fmt != fmt || s.w.kpad != kpad || s.w.cols != k) {
        return Err(Error::Op { op: "gemv", msg: "segments differ in format or K".into() });
    }
    let mut a = GemvArgs::default();
    let mut total_tiles = 0;
    for (i, s) in segs.iter().enumerate() {
        let w = s.w;
        let tiles = w.rows.div_ceil(16) as i32;
        a.seg[i] =
            GemvSeg { w: w.w_ptr(), sb: w.sb_ptr(), out: s.out, rows: w.rows as i32, tiles, out_col: s.col as i32, ldo: s.ldo as i32 };
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
        kparts = c.tuning.router_kparts.min(ROUTER_KPARTS).min(units / 2).max(1);
    }
    let smem = gemv_smem(fmt, kpad, t);
    let resident = |_ks: usize| gemv_resident(c, smem);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arg_sizes() {
        assert_eq!(std::mem::size_of::<GemvArgs>(), 280);
        assert!(gemv_abi().contains("struct GemvArgs {\n    GemvSeg seg[4];\n"));
    }

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
}
