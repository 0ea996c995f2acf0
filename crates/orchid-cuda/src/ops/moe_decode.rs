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
}

/// The router of a decode MoE layer, fused into `moe_up` by `moe_route_up` (kernels/moe_decode.cu
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
    if fmt != WFormat::Q4
        || r.router.fmt != WFormat::Bf16
        || r.router.kpad != g.kpad
        || !sg_ok
        || r.shared_gate.is_some() != m.sh_gate.is_some()
    {
        return false;
    }
    if !r.e.is_multiple_of(16) || r.e > 512 || m.topk > 32 || r.e != r.router.rows {
        return false;
    }
    let ks = moe_up_ksplit(units_of(fmt, g.kpad));
    let blocks = m.hstride().div_ceil(16).div_ceil(8 / ks) * (m.topk + shared as usize);
    let router_blocks = (r.e / 16 + shared as usize) * ROUTER_KPARTS;
    let smem = ring_bytes(fmt) + x_stage_bytes(fmt, g.kpad) + (g.kpad / 64) * 4 + 8 * 32 * 8 * 4 + 2560;
    router_blocks <= blocks && blocks <= gemv_resident(c, smem)
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
    if !can_fuse_route(c, m, r) {
        return Err(Error::Op { op: "moe_route_up", msg: "layer shape not supported by the fused router".into() });
    }
    moe_up_impl(c, m, x, norm, ids, h, Some(r), None)
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
    let ks = match c.tuning.moe_up_ksplit {
        0 => moe_up_ksplit(units_of(fmt, kpad)),
        k => k.next_power_of_two(),
    };
    let tiles = m.hstride().div_ceil(16);
    let nsrc = m.topk + a.has_shared as usize;
    let smem = ring_bytes(fmt) + x_stage_bytes(fmt, kpad) + (kpad / 64) * 4 + 8 * 32 * 8 * 4;
    let ks = match rows {
        Some(r) if c.tuning.moe_up_ksplit == 0 => rows_ksplit(ks, tiles, nsrc * r, gemv_resident(c, smem)),
        _ => ks,
    };
    a.ksplit = ks as i32;
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
    if rows.is_some() {
        name = if fmt == WFormat::Q4 { "moe_up_rows_q4" } else { "moe_up_rows_bf16" };
    }
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
    let nsrc = m.topk + a.has_shared as usize;
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
