//! Gated DeltaNet launchers: conv, prep (norms, gates), chunked recurrence, gated norm, fused decode.

use orchid_model::error::{Error, Result};

use super::Ctx;

crate::kernel_abi! {
    pub fn deltanet_abi;
    const {
        /// Tokens per thread of `gdn_conv`.
        CONV_TOKENS => "CONV_TT": usize = 8;
        /// Tokens per chunk of the chunked prefill.
        CHUNK: usize = orchid_model::backend::GDN_CHUNK;
        /// Blocks per value head of the decode kernel (one thread-block cluster on sm_90+), each
        /// owning `dv / DECODE_SPLIT` state columns.
        DECODE_SPLIT => "GDN_NS": usize = 4;
        /// Threads per block of the decode kernel.
        DECODE_THREADS => "GDN_THREADS": usize = 256;
        /// State rows per thread of the decode kernel.
        DECODE_MAX_ROWS => "GDN_MAXR": usize = 16;
        /// Conv channels per thread of the decode kernel: a block convolves 2·dk + dv/DECODE_SPLIT channels.
        DECODE_CH_PER_THREAD => "GDN_NCPT": usize = 3;
        /// State slices per block of the streamed batched decode (`gdn_decode_rows_stream`) in a
        /// ring of shared buffers: all but one are in flight while a slice is computed.
        STREAM_BUFS => "GDN_NBUF": usize = 4;
        /// Most rows one block of the streamed batched decode takes.
        STREAM_MAX_ROWS => "GDN_SROWS": usize = 64;
    }
    #[derive(Clone, Copy, Default)]
    struct ConvArgs {
        x: u64,
        w: u64,
        state_in: u64,
        state_out: u64,
        out: u64,
        /// 0, or `nspans` `GdnSpan`s: a batched launch, one span per grid z (x, out and the
        /// states are then the span's, `t` the longest span).
        spans: u64,
        t: i32 => "T",
        c: i32 => "C",
        kc: i32 => "KC",
        ldx: i32,
        nspans: i32,
        pad: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct GdnPrepArgs {
        x: u64,
        b: u64,
        a: u64,
        a_log: u64,
        dt_bias: u64,
        beta: u64,
        gdec: u64,
        t: i32 => "T",
        hk: i32 => "Hk",
        hv: i32 => "Hv",
        dk: i32,
        ldb: i32,
        lda: i32,
        c: i32 => "C",
        pad: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct ChunkArgs {
        x: u64,
        beta: u64,
        gdec: u64,
        state: u64,
        out: u64,
        /// `chunk_scratch_bytes` (written by gdn_chunk_prep, read by gdn_chunk_scan).
        scratch: u64,
        /// 0, or `nspans` `GdnSpan`s: a batched launch, one span per grid z (x, beta, gdec, out,
        /// the state, the scratch and the chunks are then the span's; `t` and `nchunks` the
        /// longest span's).
        spans: u64,
        t: i32 => "T",
        hk: i32 => "Hk",
        hv: i32 => "Hv",
        dk: i32,
        dv: i32,
        c: i32 => "C",
        cw: i32,
        /// `chunk_count(t)`.
        nchunks: i32,
        /// The chunks [chunk0, chunk1) `gdn_chunk_scan` walks (`gdn_chunk_prep` takes all).
        chunk0: i32,
        chunk1: i32,
        nspans: i32,
        pad: i32,
    }
    /// One sequence's span in a batched conv / chunked launch: its first row in the step's
    /// tensors, its length and chunks, its conv buffers (read, written), recurrent state and scratch.
    #[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
    struct GdnSpan {
        conv_in: u64,
        conv_out: u64,
        state: u64,
        scratch: u64,
        row0: i32,
        t: i32 => "T",
        nchunks: i32,
        pad: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct GNormArgs {
        core: u64,
        z: u64,
        w: u64,
        out: u64,
        t: i32 => "T",
        hv: i32 => "Hv",
        dv: i32,
        ldz: i32,
        eps: f32,
        pad0: i32,
    }
    #[derive(Clone, Copy, Default)]
    struct GdnDecodeArgs {
        qkv: u64,
        z: u64,
        b: u64,
        a: u64,
        conv_w: u64,
        conv_state: u64,
        a_log: u64,
        dt_bias: u64,
        norm_w: u64,
        state: u64,
        out: u64,
        pos_ptr: u64,
        /// `gdn_decode_rows`: the state slot of each row (i32; negative: padding, output zeros);
        /// 0: slot 0 for every row (a graph pinned to one sequence: the states are its own).
        rows_slot: u64,
        hk: i32 => "Hk",
        hv: i32 => "Hv",
        dk: i32,
        dv: i32,
        kc: i32 => "KC",
        c: i32 => "C",
        pos: i32,
        eps: f32,
        /// `gdn_decode_rows`: row strides (floats) of qkv, z, b and a, out.
        ld_qkv: i32,
        ld_z: i32,
        ld_ba: i32,
        ld_out: i32,
        /// `gdn_decode_rows`: floats from one slot's conv / recurrent state to the next one's.
        conv_stride: i32,
        rec_stride: i32,
        /// `gdn_decode_rows_stream`: the number of rows (its grid's y is the blocks per head).
        rows: i32,
        pad0: i32,
    }
}

/// Dynamic shared memory of `gdn_decode`: the old conv window (KC−1 taps) and the conv weights
/// (KC taps) of the block's 2·dk + dv/DECODE_SPLIT channels, then the state rows of every
/// thread (used only for dims other than the compiled-in fast path), f32.
pub fn decode_smem(dk: usize, dv: usize, kc: usize) -> usize {
    ((2 * kc - 1) * (2 * dk + dv / DECODE_SPLIT) + DECODE_MAX_ROWS * DECODE_THREADS) * 4
}

/// Columns of the state per chunked-prefill block.
pub fn chunk_cols(dv: usize) -> usize {
    if dv.is_multiple_of(32) { 32 } else { 16 }
}

/// The longest span one `chunk` call takes (a multiple of CHUNK; layers.rs runs longer spans in
/// pieces), which bounds the scratch.
pub const CHUNK_SPAN_MAX: usize = 4096;

/// Chunks of a span of `t` tokens.
pub fn chunk_count(t: usize) -> usize {
    t.div_ceil(CHUNK)
}

/// Scratch of the chunked prefill: per value head and chunk W [64][dk], U [64][dv], QK [64][64]
/// and γ [64], f32 (Hv = 32, dk = dv = 128, 4,096 tokens: 168 MB).
pub fn chunk_scratch_bytes(hv: usize, dk: usize, dv: usize, t: usize) -> usize {
    hv * chunk_count(t) * CHUNK * (dk + dv + CHUNK + 1) * 4
}

/// Dynamic shared memory of `gdn_chunk_prep`: K/W [64][dk+4], Q/V/U [64][max(dk,dv)+4],
/// Aᵀ [64][68], β and γ.
pub fn chunk_prep_smem(dk: usize, dv: usize) -> usize {
    (CHUNK * (dk + 4) + CHUNK * (dk.max(dv) + 4) + CHUNK * (CHUNK + 4) + 2 * CHUNK) * 4
}

/// Dynamic shared memory of `gdn_chunk_scan`: S [dk][cw+4], Vn and U [64][cw+4], W, Q, K
/// [64][dk+4], QK [64][68], γ and the decay factors.
pub fn chunk_scan_smem(dk: usize, cw: usize) -> usize {
    (dk * (cw + 4) + 2 * CHUNK * (cw + 4) + 3 * CHUNK * (dk + 4) + CHUNK * (CHUNK + 4) + 2 * CHUNK) * 4
}

/// Most dynamic shared memory one block of the chunked-prefill kernels may take (sm_90).
const BLOCK_SMEM_MAX: usize = 227 * 1024;

/// Dynamic shared memory of `gdn_chunk_scan_tc` (`cw` = 32 state columns a block, or 64 for
/// `gdn_chunk_scan_tc_wide`): S, Vn and U [..][cw + 8], W and Q [64][dk+4], K [64][dk+8], QK
/// [64][68], γ and the decay factors.
pub fn chunk_scan_tc_smem(dk: usize, cw: usize) -> usize {
    (dk * (cw + 8) + 2 * CHUNK * (cw + 8) + 2 * CHUNK * (dk + 4) + CHUNK * (dk + 8) + CHUNK * (CHUNK + 4) + 2 * CHUNK) * 4
}

/// Whether the chunk scan of these dims runs on tensor cores (`gdn_chunk_scan_tc`, unless
/// `Tuning::gdn_scan_tc` is off): dk a power of two from 16 on, 32 state columns per block (dv
/// a multiple of 32), and its shared memory within the 227 KB of a block.
pub fn scan_on_tensor_cores(c: &Ctx, dk: usize, cw: usize) -> bool {
    c.tuning.gdn_scan_tc && dk >= 16 && dk.is_power_of_two() && cw == 32 && chunk_scan_tc_smem(dk, 32) <= BLOCK_SMEM_MAX
}

/// Whether a tensor-core scan of `blocks` 32-column blocks runs as `gdn_chunk_scan_tc_wide`
/// (64 columns and 512 threads a block: each chunk's W, Q, K and QK read once per 64 columns, half
/// the blocks; the same bits): where the 32-column grid would take more than one wave of `sms`
/// (one block per SM), dv allows it and `Tuning::gdn_scan_wide` is on. A grid within one wave
/// keeps its blocks' count: every block walks the chunks one after another.
pub fn scan_wide(c: &Ctx, dk: usize, dv: usize, blocks: usize) -> bool {
    c.tuning.gdn_scan_wide && dv.is_multiple_of(64) && blocks > c.gpu.sms as usize && chunk_scan_tc_smem(dk, 64) <= BLOCK_SMEM_MAX
}

pub fn check_dims(dk: usize, dv: usize, conv_dim: usize, kc: usize) -> Result<()> {
    // Decode: a block holds all dk rows of cw = dv/DECODE_SPLIT columns, rg = 256/cw row groups.
    let cw = dv / DECODE_SPLIT;
    let rg = DECODE_THREADS / cw.max(1);
    let ok = dv.is_multiple_of(16)
        && (1..=256).contains(&dk)
        && (16..=256).contains(&dv)
        && rg >= 1
        && dk.div_ceil(rg) <= DECODE_MAX_ROWS
        && 2 * dk + cw <= DECODE_CH_PER_THREAD * DECODE_THREADS
        && (1..=64).contains(&kc)
        && decode_smem(dk, dv, kc) <= 96 * 1024;
    // Chunked prefill: 16-byte rows of q/k/W (cp.async, float4), the prep's k-steps of 8, both
    // kernels' shared memory.
    let chunk_ok =
        dk.is_multiple_of(8) && chunk_prep_smem(dk, dv) <= BLOCK_SMEM_MAX && chunk_scan_smem(dk, chunk_cols(dv)) <= BLOCK_SMEM_MAX;
    if !ok || !chunk_ok || conv_dim == 0 {
        return Err(Error::Op { op: "deltanet", msg: format!("GDN head dims dk {dk} / dv {dv} are not supported on CUDA") });
    }
    Ok(())
}

pub fn conv(c: &Ctx, a: &ConvArgs) -> Result<()> {
    let rows = (a.t.max(a.kc - 1).max(1) as usize).div_ceil(CONV_TOKENS);
    c.k("gdn_conv").launch(&c.gpu, ((a.c as usize).div_ceil(256) as u32, rows as u32, a.nspans.max(1) as u32), 256, 0, a)
}

pub fn prep(c: &Ctx, a: &GdnPrepArgs) -> Result<()> {
    c.k("gdn_prep").launch(&c.gpu, (a.t as u32, 1, 1), 128, 0, a)
}

/// The state-independent half of the chunked delta rule: `gdn_chunk_prep` (every chunk of every
/// head in parallel, grid (nchunks, Hv, spans)) writes W, U, QK and γ to `a.scratch`.
pub fn chunk_prep(c: &Ctx, a: &ChunkArgs) -> Result<()> {
    c.k("gdn_chunk_prep").launch(
        &c.gpu,
        (a.nchunks as u32, a.hv as u32, a.nspans.max(1) as u32),
        256,
        chunk_prep_smem(a.dk as usize, a.dv as usize) as u32,
        a,
    )
}

/// The sequential half: `gdn_chunk_scan` (grid (Hv, dv/cw, spans)) walks chunks [chunk0, chunk1) in
/// order on the state. Consecutive ranges in separate launches compute bit for bit what one
/// launch over all of them does, the state in memory between them being the state after the
/// first range.
///
/// Where the dims allow it (`scan_on_tensor_cores`) the products run on tensor cores
/// (`gdn_chunk_scan_tc`, 3xTF32: about f32 precision, not the same bits).
pub fn chunk_scan(c: &Ctx, a: &ChunkArgs) -> Result<()> {
    let (dk, dv, cw) = (a.dk as usize, a.dv as usize, a.cw as usize);
    let grid = (a.hv as u32, (dv / cw) as u32, a.nspans.max(1) as u32);
    if scan_on_tensor_cores(c, dk, cw) {
        // 8 warps per 32 columns a block (the kernels' template width).
        let (name, tw) = if scan_wide(c, dk, dv, (grid.0 * grid.1 * grid.2) as usize) {
            ("gdn_chunk_scan_tc_wide", 64)
        } else {
            ("gdn_chunk_scan_tc", 32)
        };
        let grid = (grid.0, (dv / tw) as u32, grid.2);
        return c.k(name).launch(&c.gpu, grid, 8 * tw as u32, chunk_scan_tc_smem(dk, tw) as u32, a);
    }
    c.k("gdn_chunk_scan").launch(&c.gpu, grid, 256, chunk_scan_smem(dk, cw) as u32, a)
}

pub fn gated_norm(c: &Ctx, a: &GNormArgs) -> Result<()> {
    let tasks = a.t as usize * a.hv as usize;
    c.k("gdn_gated_norm").launch(&c.gpu, (tasks.div_ceil(4) as u32, 1, 1), 128, 0, a)
}

/// The kernel of a batched decode step (`decode_rows`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsKernel {
    /// `gdn_decode_rows`: `decode` with a row index, a block per (value head, column slice, row).
    Blocks,
    /// `gdn_decode_rows_stream`: a block per value head and share of the rows, walking (row, column
    /// slice) units with the next slices' state streamed into a ring of shared buffers (one wave:
    /// `stream_grid`). The same arithmetic per element as `Blocks` on sm_90+.
    Stream,
}

/// Dynamic shared memory of `gdn_decode_rows_stream`: STREAM_BUFS state slices [dk][dv/DECODE_SPLIT],
/// two row buffers (old conv window, x, z, b, a), the conv weights, a row's conv output, its
/// pre-norm output and its normalised q and k, f32.
pub fn stream_smem(dk: usize, dv: usize, kc: usize) -> usize {
    let nch = 2 * dk + dv;
    (STREAM_BUFS * dk * (dv / DECODE_SPLIT) + 2 * (kc * nch + dv + 2) + kc * nch + nch + dv + 2 * dk) * 4
}

/// Static shared memory of `gdn_decode_rows_stream`: partial sums, sums of squares, the rows'
/// slots and positions.
pub const STREAM_STATIC_SMEM: usize = (2 * DECODE_THREADS + 2 * DECODE_SPLIT + 2 * STREAM_MAX_ROWS) * 4;

/// The kernel for a batched decode step of `rows` rows: `Stream` from `knob` rows on
/// (`Tuning::gdn_rows_kernel`; 0: never) if its shared memory fits in `smem_max` bytes.
pub fn rows_kernel(knob: usize, rows: usize, dk: usize, dv: usize, kc: usize, smem_max: usize) -> RowsKernel {
    if knob > 0 && rows >= knob && stream_smem(dk, dv, kc) + STREAM_STATIC_SMEM <= smem_max {
        RowsKernel::Stream
    } else {
        RowsKernel::Blocks
    }
}

/// Blocks per value head of `gdn_decode_rows_stream` (its grid's y): the rows per block are as
/// few as one wave allows (`per_sm` blocks on each of `sms` SMs), at most STREAM_MAX_ROWS, then
/// as few blocks as take them (16 rows on a wave of 12 blocks per head: 8 blocks of 2 rows, not
/// 4 of 2 and 8 of 1).
pub fn stream_grid(rows: usize, hv: usize, sms: usize, per_sm: usize) -> usize {
    let wave = (sms * per_sm / hv.max(1)).max(1);
    let per_block = rows.div_ceil(wave).clamp(1, STREAM_MAX_ROWS);
    rows.div_ceil(per_block).max(1)
}

/// `decode` of one token of each of `rows` sequences (`a.rows_slot`, `a.pos_ptr`: one i32 per
/// row), on the kernel `rows_kernel` picks.
pub fn decode_rows(c: &Ctx, a: &GdnDecodeArgs, rows: usize) -> Result<()> {
    let smem_max = c.gpu.max_smem_optin.max(0) as usize;
    let k = rows_kernel(c.tuning.gdn_rows_kernel, rows, a.dk as usize, a.dv as usize, a.kc as usize, smem_max);
    decode_rows_with(c, a, rows, k)
}

/// `decode_rows` on the given kernel.
pub fn decode_rows_with(c: &Ctx, a: &GdnDecodeArgs, rows: usize, kernel: RowsKernel) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    if kernel == RowsKernel::Stream {
        let smem = stream_smem(a.dk as usize, a.dv as usize, a.kc as usize);
        if smem + STREAM_STATIC_SMEM > c.gpu.max_smem_optin.max(0) as usize {
            return Err(Error::Op { op: "deltanet", msg: format!("the streamed batched decode needs {smem} bytes of shared memory") });
        }
        let k = c.k("gdn_decode_rows_stream");
        let per_sm = k.max_active_blocks(DECODE_THREADS as u32, smem as u32)?.max(1);
        let g = stream_grid(rows, a.hv as usize, c.gpu.sms.max(1) as usize, per_sm);
        let args = GdnDecodeArgs { rows: rows as i32, ..*a };
        return k.launch(&c.gpu, (a.hv as u32, g as u32, 1), DECODE_THREADS as u32, smem as u32, &args);
    }
    let smem = decode_smem(a.dk as usize, a.dv as usize, a.kc as usize) as u32;
    let grid = (a.hv as usize * DECODE_SPLIT) as u32;
    c.k("gdn_decode_rows").launch(&c.gpu, (grid, rows as u32, 1), DECODE_THREADS as u32, smem, a)?;
    if c.gpu.cc.0 < 9 {
        gated_norm(
            c,
            &GNormArgs {
                core: a.out,
                z: a.z,
                w: a.norm_w,
                out: a.out,
                t: rows as i32,
                hv: a.hv,
                dv: a.dv,
                ldz: a.ld_z,
                eps: a.eps,
                pad0: 0,
            },
        )?;
    }
    Ok(())
}

/// The fused decode step: `hv·DECODE_SPLIT` blocks (clusters of DECODE_SPLIT, one per value
/// head). Returns the number of kernels launched: 1 on sm_90+; 2 before (no clusters there, so
/// `gdn_decode` leaves the pre-norm output and `gdn_gated_norm` normalises it in place).
pub fn decode(c: &Ctx, a: &GdnDecodeArgs) -> Result<usize> {
    let smem = decode_smem(a.dk as usize, a.dv as usize, a.kc as usize) as u32;
    let grid = (a.hv as usize * DECODE_SPLIT) as u32;
    c.k("gdn_decode").launch(&c.gpu, (grid, 1, 1), DECODE_THREADS as u32, smem, a)?;
    if c.gpu.cc.0 >= 9 {
        return Ok(1);
    }
    let n = GNormArgs { core: a.out, z: a.z, w: a.norm_w, out: a.out, t: 1, hv: a.hv, dv: a.dv, ldz: a.hv * a.dv, eps: a.eps, pad0: 0 };
    gated_norm(c, &n)?;
    Ok(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_dims() {
        assert_eq!(std::mem::size_of::<ConvArgs>(), 72);
        assert_eq!(std::mem::size_of::<GdnPrepArgs>(), 88);
        assert_eq!(std::mem::size_of::<ChunkArgs>(), 104);
        assert_eq!(std::mem::size_of::<GdnSpan>(), 48);
        assert_eq!(std::mem::size_of::<GNormArgs>(), 56);
        assert_eq!(std::mem::size_of::<GdnDecodeArgs>(), 168);
        check_dims(128, 128, 8192, 4).unwrap();
        check_dims(32, 48, 288, 4).unwrap();
        check_dims(64, 32, 256, 4).unwrap();
        check_dims(32, 32, 96, 4).unwrap();
        check_dims(64, 256, 1280, 4).unwrap();
        check_dims(192, 64, 1024, 4).unwrap();
        check_dims(128, 128, 8192, 1).unwrap();
        assert!(check_dims(128, 40, 300, 4).is_err());
        assert!(check_dims(128, 256, 1536, 4).is_err()); // 128 rows over 4 row groups
        assert!(check_dims(128, 0, 256, 4).is_err());
        // The decode launch shape: 128 blocks of 256 threads for the 35B's 32 value heads.
        assert_eq!(32 * DECODE_SPLIT, 128);
        assert_eq!(decode_smem(128, 128, 4), (7 * 288 + 16 * 256) * 4);
    }

    #[test]
    fn batched_decode_kernel_and_grid() {
        // The 35B: four 16 KB state slices in flight, 90,672 B of shared memory in all: two
        // blocks per SM (228 KB), so 8 blocks per value head fill one wave on 132 SMs.
        assert_eq!(stream_smem(128, 128, 4), (4 * 128 * 32 + 2 * (4 * 384 + 130) + 4 * 384 + 384 + 128 + 256) * 4);
        assert_eq!(stream_smem(128, 128, 4) + STREAM_STATIC_SMEM, 90_672);
        assert_eq!(stream_grid(64, 32, 132, 2), 8);
        assert_eq!(stream_grid(16, 32, 132, 2), 8);
        assert_eq!(stream_grid(3, 32, 132, 2), 3);
        assert_eq!(stream_grid(1, 32, 132, 2), 1);
        assert_eq!(stream_grid(32, 32, 132, 2), 8);
        assert_eq!(stream_grid(12, 32, 132, 2), 6); // 2 rows per block
        assert_eq!(stream_grid(16, 32, 132, 3), 8); // a wave of 12: 2 rows per block
        assert_eq!(stream_grid(64, 32, 132, 3), 11); // 6 rows per block
        assert_eq!(stream_grid(1000, 32, 132, 2), 16); // at most STREAM_MAX_ROWS rows per block
        assert!(1000usize.div_ceil(stream_grid(1000, 32, 132, 2)) <= STREAM_MAX_ROWS);
        assert_eq!(stream_grid(8, 300, 132, 1), 1);
        assert_eq!(stream_grid(0, 32, 132, 2), 1);
        let optin = 227 * 1024;
        assert_eq!(rows_kernel(1, 1, 128, 128, 4, optin), RowsKernel::Stream);
        assert_eq!(rows_kernel(16, 8, 128, 128, 4, optin), RowsKernel::Blocks);
        assert_eq!(rows_kernel(16, 16, 128, 128, 4, optin), RowsKernel::Stream);
        assert_eq!(rows_kernel(0, 64, 128, 128, 4, optin), RowsKernel::Blocks);
        assert_eq!(rows_kernel(1, 64, 128, 128, 48, optin), RowsKernel::Blocks); // too long a conv window
        // Every shape check_dims accepts fits the stream's slices (at most 16 KB each) and rows.
        for (dk, dv) in [(128, 128), (32, 48), (64, 32), (32, 32), (64, 256), (192, 64)] {
            assert!(dk * (dv / DECODE_SPLIT) <= 4096);
            assert_eq!(rows_kernel(1, 4, dk, dv, 4, optin), RowsKernel::Stream, "dk {dk} dv {dv}");
        }
    }

    #[test]
    fn chunked_prefill_shapes() {
        // The 35B at 4,096 tokens: 64 chunks, 168 MB of scratch; prep 85,504 B (two blocks per
        // SM), scan 156,160 B.
        assert_eq!(chunk_count(4096), 64);
        assert_eq!(chunk_count(4097), 65);
        assert_eq!(chunk_count(2), 1);
        assert_eq!(CHUNK_SPAN_MAX % CHUNK, 0);
        assert_eq!(chunk_scratch_bytes(32, 128, 128, 4096), 32 * 64 * 64 * (128 + 128 + 65) * 4);
        assert_eq!(chunk_prep_smem(128, 128), 85_504);
        assert_eq!(chunk_scan_smem(128, 32), 156_160);
        assert_eq!(chunk_scan_tc_smem(128, 32), 161_280);
        assert_eq!(chunk_scan_tc_smem(128, 64), 194_048);
        // q/k/W rows are moved in 16-byte pieces, the prep's products in k-steps of 8.
        assert!(check_dims(30, 32, 184, 4).is_err());
        assert!(check_dims(36, 32, 184, 4).is_err());
        // dk = 192 with 32-column slices still fits the scan; the prep fits every dk, dv ≤ 256.
        assert!(chunk_scan_smem(192, chunk_cols(64)) <= BLOCK_SMEM_MAX);
        assert!(chunk_prep_smem(256, 256) <= BLOCK_SMEM_MAX);
    }
}
