//! Prefill GEMM launchers (kernels/gemm.cu): activations prepared once (`gemm_x`), dense and
//! grouped (MoE) GEMMs with the token-tile and split-K choices (pure functions, unit-tested), and
//! `matmul`, which picks the decode matvec for up to 8 tokens.

use orchid_model::error::{Error, Result};

use super::gemv::{gemv_rows, use_gemv};
use super::{Ctx, params};
use crate::driver::DevBuf;
use crate::weights::{GpuLinear, WFormat};

crate::kernel_abi! {
    pub fn gemm_abi;
    const {
        /// Runs of 128 columns per warp of `gemm_xprep`.
        XP_RUNS: usize = 4;
        /// Most K parts one cluster holds (the portable cluster size).
        SPLITK_CLUSTER_MAX: usize = 8;
        /// Most weights one `gemm_each` launch takes.
        GEMM_SEGS: usize = 4;
    }
    /// One weight of a `gemm_each` launch: its weight (and Q4 scale/bias words), output rows
    /// [t, rows] at `out` with row stride `ldo`, and its first block along grid.x.
    #[derive(Clone, Copy, Default)]
    struct GemmSeg {
        w: u64,
        sb: u64,
        out: u64,
        rows: i32,
        ldo: i32,
        rb0: i32,
        pad: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct GemmArgs {
        w: u64,
        sb: u64,
        w2: u64,
        sb2: u64,
        /// Prepared activations (`GemmX`): bf16 rows [*, kpad] and their group sums [*, kpad / 64].
        x: u64,
        xs: u64,
        x_rows: u64,
        out: u64,
        tiles: u64,
        num_tiles: u64,
        /// PAIR: 0, or the group sums of outputs prepared for the next GEMM (`out`: bf16 rows).
        xs_out: u64,
        m: i32 => "M",
        rows_e: i32,
        k: i32 => "K",
        kpad: i32,
        ldo: i32,
        t: i32 => "T",
        /// One pass (not PAIR): add the products onto `out` instead of storing them.
        acc: i32,
        /// Not PAIR: rows of `w`, whose rows `w2` continues (0: `w` alone; `gemm_concat`).
        m1: i32,
        /// Grouped: the expert (> 0; 0: none) whose weights are `alt_w` (PAIR: and `alt_w2`)
        /// instead of its place in `w` (`AltExpert`).
        alt_expert: i32,
        /// `gemm_each` (the _kc kernels): 2..=GEMM_SEGS weights in `seg`, each its own output
        /// (0: the weight in `w`).
        nseg: i32,
        alt_w: u64,
        alt_sb: u64,
        alt_w2: u64,
        alt_sb2: u64,
        seg: [GemmSeg; GEMM_SEGS],
        /// Grouped: the tile table was written two or more kernels back (`Grouped::early`).
        tiles_early: i32,
        pad: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct SplitkArgs {
        /// f32 partial sums [kparts][T][ldp] (PAIR: gate columns [0, ldp / 2), up from ldp / 2).
        part: u64,
        out: u64,
        /// PAIR: 0, or the group sums of outputs prepared for the next GEMM (`out`: bf16 rows).
        xs: u64,
        t: i32 => "T",
        m: i32 => "M",
        ldp: i32,
        ldo: i32,
        kparts: i32,
        pair: i32,
        /// Add onto out (out + Σ) instead of writing it.
        acc: i32,
        pad0: i32,
    }
}

/// Most K parts of a split-K GEMM (the range of `Tuning::gemm_kparts_max`).
pub const GEMM_KPARTS_MAX: usize = 16;
/// Fewest k-steps (of 128 columns) per K part of Q4 weights: a part still fills the cp.async
/// pipeline (S − 1 ≤ 5 k-steps in flight) and streams ≥ 36 KB of weights per block, against a
/// partial tile of at most 32 KB written and read back. A bf16 k-step alone streams 32 KB
/// (`split_min_ksteps`).
pub const SPLITK_MIN_KSTEPS: usize = 4;
/// Most tokens a split-K GEMM takes (batched decode); beyond, the token tiles fill the GPU and
/// the partials (8 bytes per token and weight row and part) would cost more than they save.
pub const SPLITK_MAX_TOKENS: usize = 128;

/// Whether a split-K GEMM of `kparts` K parts sums them in the GEMM itself: the tile's parts one
/// thread-block cluster, each leaving its partial tile in its shared memory for the cluster's
/// blocks to sum through distributed shared memory (the `_kc` kernels; compute capability 9.0+,
/// at most `SPLITK_CLUSTER_MAX` parts, `Tuning::splitk_cluster`). Otherwise partial sums go to a
/// scratch matrix that `gemm_splitk_reduce` sums. Both give the same bits (the parts in the order
/// 0, 1, ..., then the same epilogue).
pub fn splitk_in_cluster(c: &Ctx, kparts: usize) -> bool {
    c.tuning.splitk_cluster && c.gpu.cc.0 >= 9 && kparts <= SPLITK_CLUSTER_MAX
}

/// K parts of a dense GEMM of `row_blocks` blocks along the weight rows (128 rows, PAIR 64),
/// `ksteps` k-steps of 128 and `t` tokens on `sms` SMs, at most `max`: 1 (one pass over K) for
/// more than `SPLITK_MAX_TOKENS` tokens or when the row blocks alone give every SM one;
/// otherwise as many parts as give the row blocks about two blocks per SM (2 · sms / row_blocks),
/// each of at least `min_ksteps` k-steps (`split_min_ksteps`; the kernel deals ⌊ksteps / p⌋ or
/// ⌈ksteps / p⌉ to each). The token count only gates it, so that every batch of up to `SPLITK_MAX_TOKENS`
/// tokens sums each output in the same order, whatever the batch (the sums never depend on the
/// token tiles). A split GEMM takes `gemm_bn`'s tile (64 tokens; bf16 128 at 128), not the
/// narrower ones of `gemm_bn_dense`: one wave of up to two blocks per SM up to 64 tokens, two
/// waves beyond.
pub fn gemm_kparts(row_blocks: usize, ksteps: usize, min_ksteps: usize, t: usize, sms: usize, max: usize) -> usize {
    if t > SPLITK_MAX_TOKENS || row_blocks == 0 || row_blocks >= sms {
        return 1;
    }
    max.min(ksteps / min_ksteps.max(1)).min(2 * sms / row_blocks).max(1)
}

/// Fewest k-steps per K part of a split GEMM of weights in `fmt`: about 32 KB of weights per
/// 128-row block (Q4 `SPLITK_MIN_KSTEPS`, bf16 one: the router's 3 row blocks then split into 8
/// parts, not 4, at 16–64 tokens).
pub fn split_min_ksteps(fmt: WFormat) -> usize {
    match fmt {
        WFormat::Q4 => SPLITK_MIN_KSTEPS,
        WFormat::Bf16 => 1,
    }
}

/// `gemm_kparts` of a dense GEMM of `w` (PAIR: with an up weight of its shape) over `t` tokens
/// on this context's GPU with its tuning.
pub fn dense_kparts(c: &Ctx, w: &GpuLinear, pair: bool, t: usize) -> usize {
    kparts_of_rows(c, w.fmt, w.rows.div_ceil(if pair { 64 } else { 128 }), w.kpad, t)
}

/// `gemm_kparts` of a dense GEMM of `row_blocks` row blocks and padded K `kpad` on this GPU.
fn kparts_of_rows(c: &Ctx, fmt: WFormat, row_blocks: usize, kpad: usize, t: usize) -> usize {
    gemm_kparts(row_blocks, kpad / 128, split_min_ksteps(fmt), t, c.gpu.sms as usize, c.tuning.gemm_kparts_max)
}

/// Token-tile width of the experts' grouped GEMMs averaging `avg` tokens an expert: 8 for Q4
/// groups of fewer than 8 (batched decode: a smaller stage, three blocks per SM instead of two),
/// 32 for sparse groups of fewer than 32 (the tile's unused columns cost mma and staging work),
/// 64 beyond; `round64`: Q4's 64-token tile is the rounded warpgroup-MMA kernel (`gemm_wgmma`,
/// `gemm_wg_round`), which wins already from 16 tokens an expert (a 512-token prompt's experts;
/// measured on it only, perf log, "the experts' tile at 16–31 tokens each").
pub fn grouped_bn(fmt: WFormat, avg: usize, round64: bool) -> usize {
    let q4 = fmt == WFormat::Q4;
    match avg {
        _ if avg < 8 && q4 => 8,
        _ if avg < 16 || (avg < 32 && !(q4 && round64)) => 32,
        _ => 64,
    }
}

/// Token-tile width of a dense GEMM of `t` tokens: 32 for Q4 GEMMs of at most 32 tokens (the
/// 64-token tile's second column of warps would hold no tokens), 64 for Q4 (register budget) and
/// for short inputs, else 128.
pub fn gemm_bn(fmt: WFormat, t: usize) -> usize {
    match fmt {
        WFormat::Q4 if t <= 32 => 32,
        _ if fmt == WFormat::Q4 || t < 128 => 64,
        _ => 128,
    }
}

/// Token-tile width of a dense GEMM with `row_blocks` blocks along the weight rows: `gemm_bn`,
/// halved (down to 32) while the grid has fewer blocks than the GPU has SMs, so that small
/// GEMMs spread over more SMs (the sums and their order do not depend on the tile width; the
/// K parts are chosen apart, `gemm_kparts`). Q4 narrows only while the narrower grid still fits
/// one block per SM, a rule set when a Q4 block's main cost, dequantising its 128 weight rows in
/// registers, was the same for any width (since then the 32-token kernel dequantises each
/// fragment once, the 64-token one twice: to be re-measured); a bf16 block's work shrinks with
/// its width.
pub fn gemm_bn_dense(fmt: WFormat, t: usize, row_blocks: usize, sms: usize) -> usize {
    let blocks = |bn: usize| row_blocks * t.div_ceil(bn);
    let mut bn = gemm_bn(fmt, t);
    while bn > 32 && blocks(bn) < sms && (fmt == WFormat::Bf16 || blocks(bn / 2) <= sms) {
        bn /= 2;
    }
    bn
}

/// cp.async pipeline stages of each GEMM kernel (kernels/gemm.cu `GemmCfg::STAGES`): Q4 BN 32/64
/// and bf16 BN 64 stay within 113 KB (two blocks per SM), the others within 227 KB (one block).
pub fn gemm_stages(fmt: WFormat, bn: usize) -> usize {
    match (fmt, bn) {
        (WFormat::Q4, 8 | 32) => 6,
        (WFormat::Q4, 64) => 4,
        (WFormat::Q4, _) => 5,
        (WFormat::Bf16, 32) => 4,
        (WFormat::Bf16, 64) => 2,
        (WFormat::Bf16, _) => 3,
    }
}

/// Dynamic shared memory of a GEMM kernel: its stages (weights, token rows, group sums per
/// k-step), or the epilogue's C tile if larger (kernels/gemm.cu `GemmCfg::SMEM`). `wg` (the
/// `_wg` kernels): unpadded token rows, stages of whole KB and 1 KB to align the first.
pub fn gemm_smem(fmt: WFormat, bn: usize, wg: bool) -> usize {
    let a = match fmt {
        WFormat::Q4 => 128 * 64 + 128 * 8,
        WFormat::Bf16 => 128 * 136 * 2,
    };
    let main = if wg {
        gemm_stages(fmt, bn) * (a + bn * 256 + bn * 2 * 4).next_multiple_of(1024) + 1024
    } else {
        gemm_stages(fmt, bn) * (a + bn * 136 * 2 + bn * 2 * 4)
    };
    main.max(bn * (128 + 4) * 4)
}

/// Whether a GEMM of this format and token tile runs on the warpgroup-MMA kernels (`_wg`): Q4
/// 64-token tiles on compute capability 9.0 (sm_90a's wgmma), unless `Tuning::gemm_wgmma` is off.
/// In their exact form (`gemm_wg_round` off) each output is the same sum of the same mma and
/// scale steps in the same order as in the mma.sync kernels (kernels/gemm.cu, "warpgroup MMA").
pub fn gemm_wgmma(c: &Ctx, fmt: WFormat, bn: usize) -> bool {
    c.tuning.gemm_wgmma && c.gpu.cc == (9, 0) && fmt == WFormat::Q4 && bn == 64
}

/// Whether the `_wg` GEMMs run in their rounded form (`_wgr`, `Tuning::gemm_wg_round`): each
/// weight dequantised to bf16 and the whole K accumulated by the tensor cores (kernels/gemm.cu,
/// `q4_kstep_wgr`), so the outputs differ from the mma.sync kernels' by that rounding.
pub fn gemm_wg_round(c: &Ctx) -> bool {
    c.tuning.gemm_wg_round
}

/// Dynamic shared memory of an `_ld` kernel (weights loaded straight into registers) of token
/// tile `bn` whose blocks take `ksteps` k-steps: their token rows and group sums
/// (kernels/gemm.cu, "direct weight loads"), or the epilogue's C tile if larger.
pub fn gemm_ld_smem(bn: usize, ksteps: usize) -> usize {
    (ksteps * (bn * 136 * 2 + bn * 2 * 4)).max(bn * (128 + 4) * 4)
}

/// Most shared memory an `_ld` block of `bn` tokens may take: four blocks per SM for the 8-token
/// tile, two for the 32-token one, as the kernels' registers are bounded for.
pub fn gemm_ld_smem_max(bn: usize) -> usize {
    if bn == 8 { 55 * 1024 } else { 112 * 1024 }
}

/// The dynamic shared memory of the `_ld` kernel that runs a Q4 GEMM of token tile `bn` over
/// `ksteps` k-steps per block, if one does (unless `Tuning::gemm_direct` is off): grouped 8-token
/// tiles in one pass (the experts at batched decode), and dense 32-token tiles whose K parts
/// are summed in clusters (projections of 9–32 tokens), where the token rows fit. Each output is
/// the same sum of the same mma and scale steps in the same order as in the pipelined kernels.
pub fn gemm_ld(c: &Ctx, fmt: WFormat, bn: usize, grouped: bool, cluster: bool, ksteps: usize) -> Option<usize> {
    let shape = if grouped { bn == 8 && !cluster } else { bn == 32 && cluster };
    let smem = gemm_ld_smem(bn, ksteps);
    (c.tuning.gemm_direct && fmt == WFormat::Q4 && shape && smem <= gemm_ld_smem_max(bn)).then_some(smem)
}

/// Grouped tiles: (tile table, device count, upper bound of tiles, the table's tile width), and
/// an expert whose weights live apart.
pub struct Grouped {
    pub tiles: u64,
    pub num_tiles: u64,
    pub max_tiles: usize,
    pub bn: usize,
    pub alt: Option<AltExpert>,
    /// The tile table was written two or more kernels before this GEMM (the down GEMM after the
    /// gate/up pair): with programmatic dependent launch the _ld kernels then read it, and request
    /// their first weights, before waiting for the previous kernel.
    pub early: bool,
}

/// An expert of a grouped GEMM whose weights are not in the stacked experts' tensor (the shared
/// expert listed as expert E after the E routed ones): its index and its weight (and up weight).
#[derive(Clone, Copy, Debug)]
pub struct AltExpert {
    pub expert: usize,
    w: u64,
    sb: u64,
    w2: u64,
    sb2: u64,
}

impl AltExpert {
    /// Expert `expert` of the stacked `experts` (and `experts2`, the up weights of a pair) read
    /// from `w` (and `w2`) instead, when each has the shape and format of one stacked expert.
    pub fn of(expert: usize, experts: &GpuLinear, w: &GpuLinear, pair: Option<(&GpuLinear, &GpuLinear)>) -> Option<AltExpert> {
        let fits = |s: &GpuLinear, one: &GpuLinear| {
            one.count == 1
                && one.fmt == s.fmt
                && one.rows == s.rows
                && one.rows_pad == s.rows_pad
                && one.cols == s.cols
                && one.kpad == s.kpad
        };
        if expert == 0 || !fits(experts, w) || pair.is_some_and(|(s2, w2)| !fits(s2, w2)) {
            return None;
        }
        let (w2, sb2) = pair.map_or((0, 0), |(_, u)| (u.w_ptr(), u.sb_ptr()));
        Some(AltExpert { expert, w: w.w_ptr(), sb: w.sb_ptr(), w2, sb2 })
    }
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

    /// Room for `rows` prepared rows of `k` columns read from a row stride of `ldx` floats.
    pub fn alloc(c: &Ctx, ldx: usize, rows: usize, k: usize) -> Result<GemmX> {
        if !k.is_multiple_of(4) || !ldx.is_multiple_of(4) || ldx < k {
            return Err(Error::Op { op: "gemm", msg: format!("K {k} and the row stride {ldx} must be multiples of 4 (stride ≥ K)") });
        }
        let kpad = crate::weights::round_up(k.max(1), crate::weights::K_PAD);
        let buf = DevBuf::alloc(&c.gpu, rows * kpad * 2 + rows * (kpad / 64) * 4)?;
        Ok(GemmX { buf, rows, k, kpad })
    }
}

/// Prepares `rows` rows of x (f32, row stride `ldx`, `k` columns) for `gemm`.
pub fn gemm_x(c: &Ctx, x: u64, ldx: usize, rows: usize, k: usize) -> Result<GemmX> {
    let xp = GemmX::alloc(c, ldx, rows, k)?;
    let kpad = xp.kpad;
    // gemm_xprep: a warp per XP_RUNS runs of 128 columns, 8 warps per block.
    let warps = (rows * kpad / 128).div_ceil(XP_RUNS);
    if warps > 0 {
        let (xb, xs) = (xp.xb(), xp.xs());
        let (rows32, ldx32, k32, kpad32) = (rows as i32, ldx as i32, k as i32, kpad as i32);
        c.k("gemm_xprep").launch_raw(&c.gpu, (warps.div_ceil(8) as u32, 1, 1), 256, 0, params!(x, xb, xs, rows32, ldx32, k32, kpad32))?;
    }
    Ok(xp)
}

/// `gemm_x` of rms_norm(x) · `norm` (eps `eps`) in one pass: the same values as `rms_norm`
/// followed by `gemm_x`. The normalised f32 rows are also written to `y` [rows, k] unless it is 0.
#[allow(clippy::too_many_arguments)]
pub fn gemm_x_norm(c: &Ctx, x: u64, ldx: usize, rows: usize, k: usize, norm: u64, eps: f32, y: u64) -> Result<GemmX> {
    let xp = GemmX::alloc(c, ldx, rows, k)?;
    if rows > 0 {
        let (xb, xs) = (xp.xb(), xp.xs());
        let (ldx32, k32, kpad32) = (ldx as i32, k as i32, xp.kpad as i32);
        c.k("gemm_xprep_norm").launch_raw(&c.gpu, (rows as u32, 1, 1), 256, 0, params!(x, norm, xb, xs, y, ldx32, k32, kpad32, eps))?;
    }
    Ok(xp)
}

/// out[n, r] = Σ_k x[rows(n), k] W[r, k] (PAIR: silu(gate) ⊙ up) for many tokens; `x` prepared
/// by `gemm_x` (row n reads prepared row x_rows[n], or n when x_rows is 0). A dense GEMM is split
/// along K as `dense_kparts` says.
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
    let kparts = if grouped.is_none() { dense_kparts(c, w, w2.is_some(), t) } else { 1 };
    gemm_launch(c, w, w2, None, x, x_rows, t, grouped, out, ldo, 0, kparts, false)
}

/// `gemm` of two dense weights of the same format and K read as one, `w2`'s rows after `w`'s:
/// out[n, r] for r < w.rows from `w`, then w.rows + r' from `w2` (the router and the
/// shared-expert gate in one launch). Each output is the sum `gemm` gives for its weight alone
/// whenever both split K alike (`gemm_kparts` of the row blocks of both: for the router of 256
/// rows and the gate's one row, the same 8 parts as each alone on an H200).
pub fn gemm_concat(c: &Ctx, w: &GpuLinear, w2: &GpuLinear, x: &GemmX, t: usize, out: u64, ldo: usize) -> Result<()> {
    if w2.fmt != w.fmt || w2.kpad != w.kpad || w2.cols != w.cols || w.count != 1 || w2.count != 1 {
        return Err(Error::Op { op: "gemm concat", msg: "the two weights differ in format or K".into() });
    }
    let kparts = kparts_of_rows(c, w.fmt, (w.rows + w2.rows).div_ceil(128), w.kpad, t);
    gemm_launch(c, w, None, Some(w2), x, 0, t, None, out, ldo, 0, kparts, false)
}

/// The kernel a GEMM launch runs and its dynamic shared memory: format, gate/up pair, token
/// tile, split-K in clusters, grouped, two weights read as one (`gemm_concat`), and k-steps per
/// block. Warpgroup MMA where `gemm_wgmma` allows; direct weight loads where `gemm_ld` does,
/// but not for a dense pair or two weights read as one (no such kernels).
#[allow(clippy::too_many_arguments)]
fn gemm_pick(c: &Ctx, fmt: WFormat, pair: bool, bn: usize, cluster: bool, grouped: bool, concat: bool, ksteps: usize) -> (String, usize) {
    let wg = gemm_wgmma(c, fmt, bn);
    let ld = if grouped || (!pair && !concat) { gemm_ld(c, fmt, bn, grouped, cluster, ksteps) } else { None };
    let form = match (wg, gemm_wg_round(c)) {
        (false, _) => Wg::MmaSync,
        (true, false) => Wg::Exact,
        (true, true) => Wg::Rounded,
    };
    (gemm_kernel(fmt, pair, bn, cluster, form, ld.is_some()), ld.unwrap_or_else(|| gemm_smem(fmt, bn, wg)))
}

/// The tensor-core form of a GEMM kernel: mma.sync, warpgroup MMA with the exact scale step
/// (`_wg`) or with the weights rounded to bf16 (`_wgr`, `gemm_wg_round`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wg {
    MmaSync,
    Exact,
    Rounded,
}

/// The GEMM kernel of a format, gate/up pair or not, token tile, split-K form (`cluster`: the
/// _kc kernels, whose K parts are summed in the kernel's epilogue, which writes `out` as one pass
/// would), tensor-core form (`wg`, `Wg`: `gemm_wgmma`, `gemm_wg_round`) and weight path (`ld`:
/// straight into registers, `gemm_direct`).
fn gemm_kernel(fmt: WFormat, pair: bool, bn: usize, cluster: bool, wg: Wg, ld: bool) -> String {
    format!(
        "gemm_{}{}_n{bn}{}{}{}",
        if fmt == WFormat::Q4 { "q4" } else { "bf16" },
        if pair { "_pair" } else { "" },
        if cluster { "_kc" } else { "" },
        match wg {
            Wg::MmaSync => "",
            Wg::Exact => "_wg",
            Wg::Rounded => "_wgr",
        },
        if ld { "_ld" } else { "" }
    )
}

/// The K parts of `gemm_each` over `ws` at `t` tokens, None where it does not apply (fewer than
/// two or more than `GEMM_SEGS` weights, formats or K that differ, no split-K in clusters). With
/// `Tuning::gemm_each_wave` the parts are chosen for all the weights' row blocks together (so the
/// launch is one wave; each output then has the bits of `gemm_split` in that many parts), else
/// only where each weight alone would split K into the same parts (the bits of its own `gemm`).
pub fn each_kparts(c: &Ctx, ws: &[&GpuLinear], t: usize) -> Option<usize> {
    let w = ws.first()?;
    let alike = |v: &&GpuLinear| v.fmt == w.fmt && v.kpad == w.kpad && v.cols == w.cols && v.count == 1 && v.rows > 0;
    if !c.tuning.gemm_each || !(2..=GEMM_SEGS).contains(&ws.len()) || !ws.iter().all(alike) || t == 0 {
        return None;
    }
    let kparts = if c.tuning.gemm_each_wave {
        kparts_of_rows(c, w.fmt, ws.iter().map(|v| v.rows.div_ceil(128)).sum(), w.kpad, t)
    } else {
        let k = dense_kparts(c, w, false, t);
        if ws.iter().any(|v| dense_kparts(c, v, false, t) != k) {
            return None;
        }
        k
    };
    (kparts >= 2 && splitk_in_cluster(c, kparts)).then_some(kparts)
}

/// Dense `gemm`s of 2..=`GEMM_SEGS` weights of one format and K over the same prepared `x`,
/// each into its own output [t, rows_i] at `outs[i]`, as one launch: the _kc kernel over all
/// the weights' row blocks (a block row's weight and output from `GemmArgs::seg`), in
/// `each_kparts` K parts summed in clusters; the step saves the launches' fill and drain (the GDN
/// input projections: four GEMMs, two of 32 rows). Ok(false), launching nothing, where
/// `each_kparts` says None (the caller runs `gemm` for each).
pub fn gemm_each(c: &Ctx, ws: &[&GpuLinear], x: &GemmX, t: usize, outs: &[u64]) -> Result<bool> {
    let (Some(w), Some(kparts)) = (ws.first(), each_kparts(c, ws, t)) else { return Ok(false) };
    if outs.len() != ws.len() || x.k != w.cols || x.kpad != w.kpad || x.rows < t {
        return Ok(false);
    }
    let mut seg = [GemmSeg::default(); GEMM_SEGS];
    let mut rb = 0;
    for (i, (v, &out)) in ws.iter().zip(outs).enumerate() {
        seg[i] = GemmSeg { w: v.w_ptr(), sb: v.sb_ptr(), out, rows: v.rows as i32, ldo: v.rows as i32, rb0: rb as i32, pad: 0 };
        rb += v.rows.div_ceil(128);
    }
    let bn = gemm_bn(w.fmt, t);
    let a = GemmArgs {
        w: w.w_ptr(),
        sb: w.sb_ptr(),
        x: x.xb(),
        xs: x.xs(),
        out: outs[0],
        m: w.rows as i32,
        rows_e: w.rows_pad as i32,
        k: w.cols as i32,
        kpad: w.kpad as i32,
        ldo: w.rows as i32,
        t: t as i32,
        nseg: ws.len() as i32,
        seg,
        ..Default::default()
    };
    let (name, smem) = gemm_pick(c, w.fmt, false, bn, true, false, false, (w.kpad / 128).div_ceil(kparts));
    let grid = (rb as u32, t.div_ceil(bn) as u32, kparts as u32);
    c.k(&name).launch_cluster(&c.gpu, grid, (1, 1, kparts as u32), 256, smem as u32, &a)?;
    Ok(true)
}

/// The gate/up `gemm` pair (silu(gate) ⊙ up) written prepared for the GEMM that reads it (the
/// down projection): the bits `gemm` then `gemm_x` give, without the f32 rows and the extra pass.
/// Written by the GEMM (or its split-K reduction) where the rows are whole 128-row blocks; other
/// shapes take `gemm` and `gemm_x`.
pub fn gemm_pair_x(c: &Ctx, gate: &GpuLinear, up: &GpuLinear, x: &GemmX, x_rows: u64, t: usize, grouped: Option<Grouped>) -> Result<GemmX> {
    let m = gate.rows;
    if !m.is_multiple_of(128) {
        let h = DevBuf::alloc(&c.gpu, t * m * 4)?;
        gemm(c, gate, Some(up), x, x_rows, t, grouped, h.ptr, m)?;
        return gemm_x(c, h.ptr, m, t, m);
    }
    let xp = GemmX::alloc(c, m, t, m)?;
    let kparts = if grouped.is_none() { dense_kparts(c, gate, true, t) } else { 1 };
    gemm_launch(c, gate, Some(up), None, x, x_rows, t, grouped, xp.xb(), m, xp.xs(), kparts, false)?;
    Ok(xp)
}

/// A dense `gemm` in `kparts` K parts (1: one pass; more: split-K, at most one part per
/// k-step), whatever `gemm_kparts` says; `accumulate` adds the products onto `out` (in the
/// one pass's store, or in the split-K reduction; not for a pair). For `matmul_add` and the tests.
#[allow(clippy::too_many_arguments)]
pub fn gemm_split(
    c: &Ctx,
    w: &GpuLinear,
    w2: Option<&GpuLinear>,
    x: &GemmX,
    t: usize,
    out: u64,
    ldo: usize,
    kparts: usize,
    accumulate: bool,
) -> Result<()> {
    gemm_launch(c, w, w2, None, x, 0, t, None, out, ldo, 0, kparts, accumulate)
}

/// The GEMM launch (and its split-K reduction) behind `gemm`, `gemm_pair_x`, `gemm_split` and
/// `gemm_concat`: `w2` the up weight of a gate/up pair, `concat` a weight whose rows follow `w`'s.
#[allow(clippy::too_many_arguments)]
fn gemm_launch(
    c: &Ctx,
    w: &GpuLinear,
    w2: Option<&GpuLinear>,
    concat: Option<&GpuLinear>,
    x: &GemmX,
    x_rows: u64,
    t: usize,
    grouped: Option<Grouped>,
    out: u64,
    ldo: usize,
    xs_out: u64,
    kparts: usize,
    accumulate: bool,
) -> Result<()> {
    if xs_out != 0 && (w2.is_none() || !w.rows.is_multiple_of(128) || ldo != w.rows || accumulate || !out.is_multiple_of(16)) {
        return Err(Error::Op { op: "gemm", msg: "prepared outputs need a gate/up pair of whole 128-row blocks".into() });
    }
    if x.k != w.cols || x.kpad != w.kpad {
        return Err(Error::Op {
            op: "gemm",
            msg: format!("x prepared for K {} (padded {}), W has K {} (padded {})", x.k, x.kpad, w.cols, w.kpad),
        });
    }
    if x_rows == 0 && x.rows < t {
        return Err(Error::Op { op: "gemm", msg: format!("{t} tokens but {} prepared rows", x.rows) });
    }
    if let Some(u) = w2
        && (u.fmt != w.fmt || u.rows != w.rows || u.kpad != w.kpad || u.rows_pad != w.rows_pad)
    {
        return Err(Error::Op { op: "gemm pair", msg: "gate and up differ in format or shape".into() });
    }
    let pair = w2.is_some();
    let alt = grouped.as_ref().and_then(|g| g.alt);
    if alt.is_some_and(|x| pair != (x.w2 != 0)) {
        return Err(Error::Op { op: "gemm", msg: "the separate expert's weights do not match the pair".into() });
    }
    if concat.is_some() && (pair || grouped.is_some() || xs_out != 0) {
        return Err(Error::Op { op: "gemm concat", msg: "two weights in a row are dense and one pass of plain outputs".into() });
    }
    // Output rows: w's, then concat's.
    let m = w.rows + concat.map_or(0, |u| u.rows);
    let gx = m.div_ceil(if pair { 64 } else { 128 });
    // K parts (grid.z): at most one per k-step (grouped: one).
    let kparts = if grouped.is_some() { 1 } else { kparts.clamp(1, (w.kpad / 128).max(1)) };
    // Token tile: split-K fills the SMs itself (`gemm_kparts`), without the narrower tiles of
    // `gemm_bn_dense`, which would read and dequantise every weight tile once per token tile.
    let bn = match &grouped {
        Some(g) => g.bn,
        None if kparts > 1 => gemm_bn(w.fmt, t),
        None => gemm_bn_dense(w.fmt, t, gx, c.gpu.sms as usize),
    };
    if !(matches!(bn, 32 | 64 | 128) || (bn == 8 && w.fmt == WFormat::Q4 && grouped.is_some())) {
        return Err(Error::Op { op: "gemm", msg: format!("token tile {bn} (32, 64 or 128; 8 for grouped Q4)") });
    }
    if accumulate && pair {
        return Err(Error::Op { op: "gemm", msg: "a gate/up pair does not accumulate".into() });
    }
    if kparts > 1 && t > 65535 {
        return Err(Error::Op { op: "gemm", msg: format!("split-K over {t} tokens (at most 65535: the reduction's grid)") });
    }
    // Split-K: clusters of the K parts that sum in the kernel, or the parts' partial sums
    // [kparts][t][ldp] (PAIR: gate, then up), reduced below.
    let cluster = kparts > 1 && splitk_in_cluster(c, kparts);
    let ldp = m.next_multiple_of(4) * if pair { 2 } else { 1 };
    let scratch = if kparts > 1 && !cluster { Some(DevBuf::alloc(&c.gpu, kparts * t * ldp * 4)?) } else { None };
    let a = GemmArgs {
        w: w.w_ptr(),
        sb: w.sb_ptr(),
        w2: w2.or(concat).map_or(0, |u| u.w_ptr()),
        sb2: w2.or(concat).map_or(0, |u| u.sb_ptr()),
        x: x.xb(),
        xs: x.xs(),
        x_rows,
        out: scratch.as_ref().map_or(out, |b| b.ptr),
        tiles: grouped.as_ref().map_or(0, |g| g.tiles),
        num_tiles: grouped.as_ref().map_or(0, |g| g.num_tiles),
        xs_out: if scratch.is_some() { 0 } else { xs_out },
        m: m as i32,
        rows_e: w.rows_pad as i32,
        k: w.cols as i32,
        kpad: w.kpad as i32,
        ldo: if scratch.is_some() { ldp } else { ldo } as i32,
        t: t as i32,
        acc: (accumulate && scratch.is_none()) as i32,
        m1: concat.map_or(0, |_| w.rows as i32),
        alt_expert: alt.map_or(0, |x| x.expert as i32),
        nseg: 0,
        alt_w: alt.map_or(0, |x| x.w),
        alt_sb: alt.map_or(0, |x| x.sb),
        alt_w2: alt.map_or(0, |x| x.w2),
        alt_sb2: alt.map_or(0, |x| x.sb2),
        seg: Default::default(),
        tiles_early: grouped.as_ref().is_some_and(|g| g.early) as i32,
        pad: 0,
    };
    let (name, smem) = gemm_pick(c, w.fmt, pair, bn, cluster, grouped.is_some(), concat.is_some(), (w.kpad / 128).div_ceil(kparts));
    let smem = smem as u32;
    let gy = grouped.as_ref().map_or(t.div_ceil(bn), |g| g.max_tiles);
    let grid = (gx as u32, gy as u32, kparts as u32);
    if cluster {
        return c.k(&name).launch_cluster(&c.gpu, grid, (1, 1, kparts as u32), 256, smem, &a);
    }
    c.k(&name).launch(&c.gpu, grid, 256, smem, &a)?;
    let Some(part) = scratch else { return Ok(()) };
    let vec = m.is_multiple_of(4) && ldo.is_multiple_of(4) && out.is_multiple_of(16);
    let r = SplitkArgs {
        part: part.ptr,
        out,
        xs: xs_out,
        t: t as i32,
        m: m as i32,
        ldp: ldp as i32,
        ldo: ldo as i32,
        kparts: kparts as i32,
        pair: pair as i32,
        acc: accumulate as i32,
        pad0: 0,
    };
    let threads = if vec { m / 4 } else { m };
    let name = if vec { "gemm_splitk_reduce4" } else { "gemm_splitk_reduce" };
    c.k(name).launch(&c.gpu, (threads.div_ceil(256) as u32, t as u32, 1), 256, 0, &r)
}

/// x·Wᵀ for any number of tokens: matvec kernels for few tokens (`use_gemv`), GEMMs beyond.
pub fn matmul(c: &Ctx, w: &GpuLinear, x: u64, ldx: usize, t: usize, out: u64, ldo: usize) -> Result<()> {
    if use_gemv(c, t) {
        gemv_rows(c, &[(w, 0)], x, ldx, t, None, out, ldo, false)
    } else {
        let xp = gemm_x(c, x, ldx, t, w.cols)?;
        gemm(c, w, None, &xp, 0, t, None, out, ldo)
    }
}

/// out += x·Wᵀ (out: `t` rows of stride `ldo`) as a GEMM that adds onto out, in its store or in
/// its split-K reduction (`dense_kparts`): no product matrix, no separate add. For the tokens a
/// GEMM takes (not `use_gemv`).
pub fn matmul_add(c: &Ctx, w: &GpuLinear, x: u64, ldx: usize, t: usize, out: u64, ldo: usize) -> Result<()> {
    let kparts = dense_kparts(c, w, false, t);
    let xp = gemm_x(c, x, ldx, t, w.cols)?;
    gemm_split(c, w, None, &xp, t, out, ldo, kparts, true)
}

/// `matmul` of an input several weights share: the GEMM reads `xp`, x prepared once by `gemm_x`
/// (unless it was prepared for another K); the matvec reads x.
#[allow(clippy::too_many_arguments)]
pub fn matmul_x(c: &Ctx, w: &GpuLinear, x: u64, ldx: usize, xp: &GemmX, t: usize, out: u64, ldo: usize) -> Result<()> {
    if !use_gemv(c, t) && xp.k == w.cols && xp.kpad == w.kpad && xp.rows >= t {
        gemm(c, w, None, xp, 0, t, None, out, ldo)
    } else {
        matmul(c, w, x, ldx, t, out, ldo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arg_sizes() {
        assert_eq!(std::mem::size_of::<GemmArgs>(), 168 + GEMM_SEGS * 40);
        assert!(gemm_abi().contains("GemmSeg seg[4];"));
    }

    #[test]
    fn gemm_variants() {
        assert_eq!(gemm_bn(WFormat::Q4, 4096), 64);
        assert_eq!(gemm_bn(WFormat::Bf16, 4096), 128);
        assert_eq!(grouped_bn(WFormat::Bf16, 128, true), 64);
        assert_eq!(grouped_bn(WFormat::Q4, 8, true), 32);
        // A 512-token prompt's experts (16 tokens each on average) on the rounded 64-token tiles,
        // not where Q4's 64-token tile is another kernel.
        assert_eq!((grouped_bn(WFormat::Q4, 16, true), grouped_bn(WFormat::Bf16, 16, true)), (64, 32));
        assert_eq!((grouped_bn(WFormat::Q4, 16, false), grouped_bn(WFormat::Q4, 32, false)), (32, 64));
        assert_eq!((grouped_bn(WFormat::Q4, 2, true), grouped_bn(WFormat::Bf16, 2, true)), (8, 32));
        assert_eq!((gemm_bn(WFormat::Q4, 32), gemm_bn(WFormat::Q4, 33)), (32, 64));
        assert_eq!(gemm_bn(WFormat::Bf16, 16), 64);
        assert_eq!(gemm_kernel(WFormat::Q4, true, 32, true, Wg::MmaSync, false), "gemm_q4_pair_n32_kc");
        assert_eq!(gemm_kernel(WFormat::Bf16, false, 128, false, Wg::MmaSync, false), "gemm_bf16_n128");
        assert_eq!(gemm_kernel(WFormat::Q4, true, 64, true, Wg::Exact, false), "gemm_q4_pair_n64_kc_wg");
        assert_eq!(gemm_kernel(WFormat::Q4, false, 64, false, Wg::Rounded, false), "gemm_q4_n64_wgr");
        assert_eq!(gemm_kernel(WFormat::Q4, true, 8, false, Wg::MmaSync, true), "gemm_q4_pair_n8_ld");
        assert_eq!(gemm_kernel(WFormat::Q4, false, 32, true, Wg::MmaSync, true), "gemm_q4_n32_kc_ld");
        // The _ld kernels' token rows: the experts' K (2,048 and 512) fit four blocks per SM,
        // 4,096 does not (the pipelined kernel takes it); a dense 32-token K part of 4 k-steps
        // (the split projections' 512 columns) fits two.
        assert_eq!((gemm_ld_smem(8, 16), gemm_ld_smem(8, 4), gemm_ld_smem(8, 1)), (35840, 8960, 4224));
        assert!(gemm_ld_smem(8, 24) <= gemm_ld_smem_max(8) && gemm_ld_smem(8, 32) > gemm_ld_smem_max(8));
        assert_eq!(gemm_ld_smem(32, 4), 35840);
        assert!(gemm_ld_smem(32, 12) <= gemm_ld_smem_max(32) && gemm_ld_smem(32, 13) > gemm_ld_smem_max(32));
        assert!(4 * (gemm_ld_smem_max(8) + 1024) <= 228 * 1024 && 2 * (gemm_ld_smem_max(32) + 1024) <= 228 * 1024);
        // Shared memory per kernel: the same numbers as the static_asserts in kernels/gemm.cu.
        let smem = |f, bn| gemm_smem(f, bn, false);
        assert_eq!(gemm_smem(WFormat::Q4, 64, true), 107520); // 4 stages of 26 KB + 1 KB
        assert_eq!(smem(WFormat::Q4, 8), 68736); // 6 stages
        assert_eq!(smem(WFormat::Q4, 32), 109056); // 6 stages
        assert_eq!(smem(WFormat::Q4, 64), 108544); // 4 stages
        assert_eq!(smem(WFormat::Q4, 128), 225280); // 5 stages
        assert_eq!(smem(WFormat::Bf16, 32), 175104); // 4 stages
        assert_eq!(smem(WFormat::Bf16, 64), 105472); // 2 stages
        assert_eq!(smem(WFormat::Bf16, 128), 211968); // 3 stages
        for f in [WFormat::Q4, WFormat::Bf16] {
            for bn in [32, 64, 128] {
                assert!(gemm_smem(f, bn, false) <= 227 * 1024);
                assert!(gemm_stages(f, bn) >= 2);
            }
        }
        // Three blocks per SM for the 8-token tile, two where the others ask for it (228 KB,
        // 1 KB reserved per block).
        assert!(3 * (gemm_smem(WFormat::Q4, 8, false) + 1024) <= 228 * 1024);
        for (f, bn, wg) in [(WFormat::Q4, 32, false), (WFormat::Q4, 64, false), (WFormat::Q4, 64, true), (WFormat::Bf16, 64, false)] {
            assert!(2 * (gemm_smem(f, bn, wg) + 1024) <= 228 * 1024);
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

    #[test]
    fn split_k_parts() {
        let kp = |rows: usize, k: usize, t: usize| gemm_kparts(rows.div_ceil(128), k / 128, SPLITK_MIN_KSTEPS, t, 132, 8);
        // Batched decode on 132 SMs (at most 8 parts): a 12288 x 2048 weight (96 row blocks, 16
        // k-steps) in 2 parts (192 blocks at 16 or 64 tokens), 8192 x 2048 in 4, 2048 x 4096
        // (16 row blocks, 32 k-steps) in 8, 512 x 2048 in 4 (k-steps: 4 each), 2048 x 512 (4
        // k-steps) whole.
        assert_eq!(kp(12288, 2048, 64), 2);
        assert_eq!(kp(12288, 2048, 16), 2);
        assert_eq!(kp(8192, 2048, 64), 4);
        assert_eq!(kp(2048, 4096, 64), 8);
        assert_eq!(kp(512, 2048, 33), 4);
        assert_eq!(kp(2048, 512, 64), 1);
        assert_eq!(kp(1, 2048, 9), 4); // a one-row gate
        // bf16 (a k-step streams as much as four Q4 ones): the router and shared gate (257 rows,
        // 3 row blocks) in 8 parts.
        assert_eq!(gemm_kparts(3, 16, split_min_ksteps(WFormat::Bf16), 64, 132, 8), 8);
        // The same for every batch up to SPLITK_MAX_TOKENS tokens (the token count only gates it).
        for t in 1..=SPLITK_MAX_TOKENS {
            assert_eq!(kp(2048, 4096, t), 8);
        }
        // Prefill and larger batches: one pass.
        assert_eq!(kp(2048, 4096, SPLITK_MAX_TOKENS + 1), 1);
        assert_eq!(kp(256, 2048, 4096), 1);
        // Row blocks that give every SM one (the vocabulary projection): one pass.
        assert_eq!(kp(132 * 128, 4096, 64), 1);
        assert_eq!(kp(248320, 2048, 64), 1);
        // Just under: two blocks per SM at most.
        assert_eq!(kp(131 * 128, 4096, 64), 2);
        assert_eq!(gemm_kparts(67, 32, SPLITK_MIN_KSTEPS, 64, 132, 8), 3);
        // The knob: 1 is off, more caps the parts.
        assert_eq!(gemm_kparts(16, 32, SPLITK_MIN_KSTEPS, 64, 132, 1), 1);
        assert_eq!(gemm_kparts(16, 32, SPLITK_MIN_KSTEPS, 64, 132, 2), 2);
        assert_eq!(gemm_kparts(16, 64, SPLITK_MIN_KSTEPS, 64, 132, GEMM_KPARTS_MAX), 16);
        assert_eq!(gemm_kparts(1, 1000, SPLITK_MIN_KSTEPS, 64, 132, GEMM_KPARTS_MAX), GEMM_KPARTS_MAX);
        // Short K: at least SPLITK_MIN_KSTEPS k-steps per part.
        assert_eq!(gemm_kparts(16, 7, SPLITK_MIN_KSTEPS, 64, 132, 8), 1);
        assert_eq!(gemm_kparts(16, 8, SPLITK_MIN_KSTEPS, 64, 132, 8), 2);
        assert_eq!(gemm_kparts(16, 19, SPLITK_MIN_KSTEPS, 64, 132, 8), 4);
        assert_eq!(gemm_kparts(0, 19, SPLITK_MIN_KSTEPS, 64, 132, 8), 1);
        // Every choice: parts of at least SPLITK_MIN_KSTEPS k-steps, at most about two blocks
        // per SM from the row blocks, within the cap.
        for sms in [1, 16, 78, 132, 144] {
            for rb in 0..300 {
                for ks in 0..80 {
                    let p = gemm_kparts(rb, ks, SPLITK_MIN_KSTEPS, 64, sms, 8);
                    assert!((1..=8).contains(&p));
                    if p > 1 {
                        assert!(ks / p >= SPLITK_MIN_KSTEPS && rb < sms && rb * p <= 2 * sms, "{rb} {ks} {sms}: {p}");
                    }
                }
            }
        }
    }
}
