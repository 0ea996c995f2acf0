//! Prefill GEMM launchers (kernels/gemm.cu): activations prepared once (`gemm_x`), dense and
//! grouped (MoE) GEMMs with the token-tile choice (pure functions, unit-tested), and `matmul`,
//! which picks the decode matvec for up to 8 tokens.

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
        m: i32 => "M",
        rows_e: i32,
        k: i32 => "K",
        kpad: i32,
        ldo: i32,
        t: i32 => "T",
        pad0: i32,
        pad1: i32,
    }
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
    // gemm_xprep: a warp per XP_RUNS runs of 128 columns, 8 warps per block.
    let warps = (rows * kpad / 128).div_ceil(XP_RUNS);
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

/// x·Wᵀ for any number of tokens: matvec kernels for few tokens (`use_gemv`), GEMMs beyond.
pub fn matmul(c: &Ctx, w: &GpuLinear, x: u64, ldx: usize, t: usize, out: u64, ldo: usize) -> Result<()> {
    if use_gemv(c, t) {
        gemv_rows(c, &[(w, 0)], x, ldx, t, None, out, ldo, false)
    } else {
        let xp = gemm_x(c, x, ldx, t, w.cols)?;
        gemm(c, w, None, &xp, 0, t, None, out, ldo)
    }
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
        assert_eq!(std::mem::size_of::<GemmArgs>(), 112);
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
