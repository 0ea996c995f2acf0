//! Batch-1 MoE launchers of the decode graph (kernels/moe_decode.cu): every routed expert's and
//! the shared expert's gate/up in one kernel (optionally with the router fused in), then all
//! down projections weighted and added to the residual in one kernel.

use orchid_model::error::{Error, Result};

use super::Ctx;
use super::gemv::{ROUTER_KPARTS, gemv_resident, ring_bytes, units_of, x_stage_bytes};
use crate::weights::{GpuLinear, WFormat};

/// Warps per 16-row tile of the decode `moe_up` kernel: two units of gate and two of up per warp
/// (four ring slots: all requested at once), so K = 2048 (Q4) takes 8 warps per tile.
pub fn moe_up_ksplit(nunits: usize) -> usize {
    nunits.div_ceil(2).next_power_of_two().clamp(1, 8)
}

/// Warps per 16-row tile of the several-token kernels (`moe_up_rows`, `moe_down_rows`): `ks`
/// halved while the grid (`tiles` per source, `8 / ks` tiles per block, `others` = sources x
/// tokens) is more than one wave of `resident` blocks. A block stages its token's activations
/// once for all its tiles, so fewer, longer blocks stage less and keep the weight rings full
/// (measured: 4 tokens best at 288 blocks of two warps per tile, 8 tokens at one).
pub fn rows_ksplit(ks: usize, tiles: usize, others: usize, resident: usize) -> usize {
    let blocks = |ks: usize| tiles.div_ceil(8 / ks) * others;
    let mut ks = ks.clamp(1, 8);
    while ks > 1 && blocks(ks) > resident {
        ks /= 2;
    }
    ks
}

crate::kernel_abi! {
    pub fn moe_decode_abi;
    #[derive(Clone, Copy, Default)]
    struct MoeUpArgs {
        /// stacked routed experts, expert stride rows_e rows
        gate_w: u64,
        gate_sb: u64,
        up_w: u64,
        up_sb: u64,
        sh_gate_w: u64,
        sh_gate_sb: u64,
        sh_up_w: u64,
        sh_up_sb: u64,
        /// h: [nsrc, hstride] f32
        x: u64,
        norm_w: u64,
        ids: u64,
        h: u64,
        k: i32 => "K",
        kpad: i32,
        i: i32 => "I",
        rows_e: i32,
        is: i32 => "Is",
        topk: i32,
        hstride: i32,
        ksplit: i32,
        eps: f32,
        has_shared: i32,
        pad0: i32,
        pad1: i32,
        /// Fused router (moe_route_up_*): bf16 router rows [E] and shared-gate row (col E), K parts,
        /// partial sums [kparts][E + 1], barrier counters {arrived, departed}, routing weights out.
        router_w: u64,
        sgate_w: u64,
        partial: u64,
        barrier: u64,
        route_w: u64,
        e: i32 => "E",
        renorm: i32,
        kparts: i32,
        router_blocks: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct MoeDownArgs {
        down_w: u64,
        down_sb: u64,
        sh_down_w: u64,
        sh_down_sb: u64,
        /// out [H] f32, accumulated
        h: u64,
        route_w: u64,
        ids: u64,
        out: u64,
        hdim: i32 => "H",
        rows_e: i32,
        kpad_r: i32,
        kpad_s: i32,
        i: i32 => "I",
        is: i32 => "Is",
        topk: i32,
        has_shared: i32,
        hstride: i32,
        ksplit: i32,
        pad0: i32,
        pad1: i32,
    }
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
    pub fn fmt(&self) -> Result<WFormat> {
        let all: Vec<&GpuLinear> = [self.gate, self.up, self.down, self.sh_gate, self.sh_up, self.sh_down].into_iter().flatten().collect();
        let f = all.first().map(|w| w.fmt).ok_or_else(|| Error::Op { op: "moe", msg: "no experts".into() })?;
        if all.iter().any(|w| w.fmt != f) {
            return Err(Error::Op { op: "moe decode", msg: "routed and shared experts are stored in different formats".into() });
        }
        Ok(f)
    }
    pub fn hstride(&self) -> usize {
        self.gate.map_or(0, |g| g.rows).max(self.sh_gate.map_or(0, |g| g.rows))
    }
    /// Whether a shared (or dense) MLP runs beside the routed experts (source `topk`).
    pub fn has_shared(&self) -> bool {
        self.sh_gate.is_some() && self.sh_up.is_some()
    }
    /// Sources of the gate/up kernels: the routed experts, then the shared MLP.
    pub fn nsrc(&self) -> usize {
        self.topk + self.has_shared() as usize
    }
}

/// The router of a decode MoE layer, fused into `moe_up` by `moe_route_up` (kernels/moe_decode.cu
/// route_phase): bf16 router [e rows] and shared-expert gate row, `partial` f32 [rows][kparts][e +
/// 1] (`ROUTER_KPARTS` parts are always room enough), `barrier` two zeroed u32 counters per token
/// (reset by the kernel itself), `ids` / `wts` the routing for moe_down.
pub struct FusedRoute<'a> {
    pub router: &'a GpuLinear,
    pub shared_gate: Option<&'a GpuLinear>,
    pub e: usize,
    pub renorm: bool,
    pub partial: u64,
    pub barrier: u64,
    pub wts: u64,
}

/// Most tokens of one fused-router launch (`moe_route_up_rows`): the batched decode's per-token
/// expert kernels take at most this many.
pub const ROUTE_ROWS_MAX: usize = 8;

/// Static shared memory of the fused router's top-k (route_phase), on top of `moe_up`'s.
const ROUTE_SMEM: usize = 2560;

/// K parts of the router fused into `moe_up`, whose router blocks are the first `router_tiles` x
/// parts of a token's `blocks`: one token takes `ROUTER_KPARTS` (None if its blocks are fewer);
/// several tokens, whose grid `rows_ksplit` keeps to one wave, as many as their blocks hold.
pub fn route_kparts(router_tiles: usize, blocks: usize, rows: usize) -> Option<usize> {
    let kp = (blocks / router_tiles.max(1)).min(ROUTER_KPARTS);
    (kp == ROUTER_KPARTS || (rows > 1 && kp >= 1)).then_some(kp)
}

/// Warps per 16-row tile and dynamic shared memory of a `moe_up` launch over `rows` tokens
/// (None: the one-token kernels), `route`: with the router fused in.
fn up_shape(c: &Ctx, m: &MoeDecode, fmt: WFormat, kpad: usize, rows: Option<usize>, route: bool) -> (usize, usize) {
    let ks = match c.tuning.moe_up_ksplit {
        0 => moe_up_ksplit(units_of(fmt, kpad)),
        k => k.next_power_of_two(),
    };
    let smem = ring_bytes(fmt) + x_stage_bytes(fmt, kpad) + (kpad / 64) * 4 + 8 * 32 * 8 * 4;
    let resident = gemv_resident(c, smem + if route { ROUTE_SMEM } else { 0 });
    let ks = match rows {
        Some(r) if c.tuning.moe_up_ksplit == 0 => rows_ksplit(ks, m.hstride().div_ceil(16), m.nsrc() * r, resident),
        _ => ks,
    };
    (ks, smem)
}

/// Whether `moe_route_up` (one token) or `moe_route_up_rows` (`rows` tokens, at most
/// `ROUTE_ROWS_MAX`, unless `Tuning::route_rows` is off) can take this layer: Q4 experts, bf16
/// router (and shared gate) with the experts' K, E a multiple of 16 (≤ 512), top-k ≤ 32, room
/// for the router's K parts among a token's blocks (`route_kparts`), and every block of the grid
/// resident at once (its per-token barriers need that).
pub fn can_fuse_route(c: &Ctx, m: &MoeDecode, r: &FusedRoute, rows: usize) -> bool {
    route_launch(c, m, r, rows).is_some()
}

/// The launch shape of a fused router: warps per tile, K parts, router blocks per token.
struct RouteShape {
    ksplit: usize,
    kparts: usize,
    router_blocks: usize,
}

/// The fused router's launch shape, if it can take the layer (`can_fuse_route`).
fn route_launch(c: &Ctx, m: &MoeDecode, r: &FusedRoute, rows: usize) -> Option<RouteShape> {
    let fmt = m.fmt().ok()?;
    let (Some(g), Some(_)) = (m.gate, m.up) else { return None };
    let sg_ok = r.shared_gate.is_none_or(|s| s.fmt == WFormat::Bf16 && s.kpad == g.kpad && s.cols == g.cols);
    if fmt != WFormat::Q4
        || r.router.fmt != WFormat::Bf16
        || r.router.kpad != g.kpad
        || !sg_ok
        || r.shared_gate.is_some() != m.has_shared()
        || !(1..=ROUTE_ROWS_MAX).contains(&rows)
        || (rows > 1 && !c.tuning.route_rows)
    {
        return None;
    }
    if !r.e.is_multiple_of(16) || r.e > 512 || m.topk > 32 || r.e != r.router.rows {
        return None;
    }
    let (ks, smem) = up_shape(c, m, fmt, g.kpad, (rows > 1).then_some(rows), true);
    let blocks = m.hstride().div_ceil(16).div_ceil(8 / ks) * m.nsrc();
    let router_tiles = r.e / 16 + m.has_shared() as usize;
    let kparts = route_kparts(router_tiles, blocks, rows)?;
    (blocks * rows <= gemv_resident(c, smem + ROUTE_SMEM)).then_some(RouteShape {
        ksplit: ks,
        kparts,
        router_blocks: router_tiles * kparts,
    })
}

/// h[src] = silu(gate_src · xn) ⊙ (up_src · xn), xn = rms_norm(x) (one token).
pub fn moe_up(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64) -> Result<()> {
    moe_up_impl(c, m, x, norm, ids, h, None, None)
}

/// `moe_up` of `rows` tokens (x [rows, K], normalised on load unless `norm.0` is 0; ids [rows,
/// topk]; h per token `nsrc · hstride` floats).
pub fn moe_up_rows(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64, rows: usize) -> Result<()> {
    moe_up_impl(c, m, x, norm, ids, h, None, Some(rows))
}

/// Router and `moe_up` in one kernel (see `FusedRoute`); `ids` receives the routing for moe_down.
pub fn moe_route_up(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64, r: &FusedRoute) -> Result<()> {
    moe_up_impl(c, m, x, norm, ids, h, Some(r), None)
}

/// `moe_route_up` of `rows` tokens (as `moe_up_rows`; ids [rows, topk], the routing weights
/// [rows, nsrc]): each token routed as the one-token kernel routes it, with the K parts its
/// blocks hold (`route_kparts`).
#[allow(clippy::too_many_arguments)]
pub fn moe_route_up_rows(c: &Ctx, m: &MoeDecode, x: u64, norm: (u64, f32), ids: u64, h: u64, r: &FusedRoute, rows: usize) -> Result<()> {
    moe_up_impl(c, m, x, norm, ids, h, Some(r), Some(rows))
}

#[allow(clippy::too_many_arguments)]
fn moe_up_impl(
    c: &Ctx,
    m: &MoeDecode,
    x: u64,
    norm: (u64, f32),
    ids: u64,
    h: u64,
    route: Option<&FusedRoute>,
    rows: Option<usize>,
) -> Result<()> {
    let fmt = m.fmt()?;
    let any = m.gate.or(m.sh_gate).unwrap();
    let (k, kpad) = (any.cols, any.kpad);
    let mut a =
        MoeUpArgs { x, norm_w: norm.0, eps: norm.1, ids, h, k: k as i32, kpad: kpad as i32, topk: m.topk as i32, ..Default::default() };
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
    let tiles = m.hstride().div_ceil(16);
    let nsrc = m.nsrc();
    let (mut ks, smem) = up_shape(c, m, fmt, kpad, rows, false);
    let mut name = match (fmt, rows) {
        (WFormat::Q4, None) => "moe_up_q4",
        (WFormat::Bf16, None) => "moe_up_bf16",
        (WFormat::Q4, Some(_)) => "moe_up_rows_q4",
        (WFormat::Bf16, Some(_)) => "moe_up_rows_bf16",
    };
    if let Some(r) = route {
        let Some(shape) = route_launch(c, m, r, rows.unwrap_or(1)) else {
            return Err(Error::Op { op: "moe_route_up", msg: "layer shape not supported by the fused router".into() });
        };
        ks = shape.ksplit;
        a.router_w = r.router.w_ptr();
        a.sgate_w = r.shared_gate.map_or(0, |s| s.w_ptr());
        a.partial = r.partial;
        a.barrier = r.barrier;
        a.route_w = r.wts;
        a.e = r.e as i32;
        a.renorm = r.renorm as i32;
        a.kparts = shape.kparts as i32;
        a.router_blocks = shape.router_blocks as i32;
        name = if rows.is_some() { "moe_route_up_rows_q4" } else { "moe_route_up_q4" };
    }
    a.ksplit = ks as i32;
    c.k(name).launch(&c.gpu, (tiles.div_ceil(8 / ks) as u32, nsrc as u32, rows.unwrap_or(1) as u32), 256, smem as u32, &a)
}

/// out += Σ_src w[src] · down_src · h[src]  (w: routing weights, then the shared gate).
pub fn moe_down(c: &Ctx, m: &MoeDecode, h: u64, route_w: u64, ids: u64, out: u64) -> Result<()> {
    moe_down_impl(c, m, h, route_w, ids, out, None)
}

/// `moe_down` of `rows` tokens (route_w [rows, nsrc], out [rows, H] accumulated).
pub fn moe_down_rows(c: &Ctx, m: &MoeDecode, h: u64, route_w: u64, ids: u64, out: u64, rows: usize) -> Result<()> {
    moe_down_impl(c, m, h, route_w, ids, out, Some(rows))
}

fn moe_down_impl(c: &Ctx, m: &MoeDecode, h: u64, route_w: u64, ids: u64, out: u64, rows: Option<usize>) -> Result<()> {
    let fmt = m.fmt()?;
    let any = m.down.or(m.sh_down).unwrap();
    let hdim = any.rows;
    let mut a =
        MoeDownArgs { h, route_w, ids, out, hdim: hdim as i32, topk: m.topk as i32, hstride: m.hstride() as i32, ..Default::default() };
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
    let nsrc = m.nsrc();
    let kmax = (a.kpad_r.max(a.kpad_s)) as usize;
    let smem = ring_bytes(fmt) + nsrc * x_stage_bytes(fmt, kmax) + nsrc * (kmax / 64) * 4 + 8 * 32 * 4 * 4;
    let tiles = hdim.div_ceil(16);
    let ks = match (rows, c.tuning.moe_down_ksplit) {
        (Some(_), k) if k > 0 => k.next_power_of_two().min(8),
        (Some(r), _) => rows_ksplit(8, tiles, r, gemv_resident(c, smem)),
        (None, _) => 8,
    };
    a.ksplit = ks as i32;
    let name = match (fmt, rows.is_some()) {
        (WFormat::Q4, false) => "moe_down_q4",
        (WFormat::Bf16, false) => "moe_down_bf16",
        (WFormat::Q4, true) => "moe_down_rows_q4",
        (WFormat::Bf16, true) => "moe_down_rows_bf16",
    };
    c.k(name).launch(&c.gpu, (tiles.div_ceil(8 / ks) as u32, rows.unwrap_or(1) as u32, 1), 256, smem as u32, &a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arg_sizes() {
        assert_eq!(std::mem::size_of::<MoeUpArgs>(), 200);
        assert_eq!(std::mem::size_of::<MoeDownArgs>(), 112);
    }

    #[test]
    fn moe_up_split() {
        assert_eq!(moe_up_ksplit(16), 8); // K = 2048 Q4: two units of gate and two of up per warp
        assert_eq!(moe_up_ksplit(4), 2);
        assert_eq!(moe_up_ksplit(1), 1);
        assert_eq!(moe_up_ksplit(64), 8); // bf16 K = 2048: 64 units, four batches
    }

    #[test]
    fn fused_router_parts() {
        // Qwen3.6-35B-A3B: 17 router tiles (256 experts, the shared gate); a token's blocks at 1 /
        // 2 / 4 / 8 tokens (rows_split below): 288, 144, 72, 36.
        let kp = |blocks: usize, rows: usize| route_kparts(17, blocks, rows);
        assert_eq!((kp(288, 1), kp(144, 2), kp(72, 4), kp(36, 8)), (Some(8), Some(8), Some(4), Some(2)));
        // One token needs every part; several take what fits, at least one.
        assert_eq!((route_kparts(2, 5, 1), route_kparts(2, 5, 4)), (None, Some(2)));
        assert_eq!((route_kparts(4, 4, 3), route_kparts(5, 4, 3)), (Some(1), None));
    }

    #[test]
    fn rows_split() {
        // Qwen3.6-35B-A3B's moe_up on 132 SMs x 3 blocks: 32 tiles, 9 sources.
        let up = |rows: usize| rows_ksplit(8, 32, 9 * rows, 396);
        assert_eq!((up(1), up(2), up(4), up(8), up(64)), (8, 4, 2, 1, 1));
        // moe_down: 128 tiles of the 2048 outputs, one token per grid row.
        let down = |rows: usize| rows_ksplit(8, 128, rows, 264);
        assert_eq!((down(1), down(2), down(4), down(8)), (8, 8, 4, 2));
        // Never above 8 or below 1, and the grid within a wave wherever one warp per tile allows.
        for ks in [0, 1, 2, 4, 8, 16] {
            for tiles in [1, 7, 32, 128] {
                for others in [1, 9, 72] {
                    let k = rows_ksplit(ks, tiles, others, 396);
                    assert!((1..=8).contains(&k) && (k == 1 || tiles.div_ceil(8 / k) * others <= 396));
                }
            }
        }
    }
}
