//! Gated DeltaNet launchers: conv, prep (norms, gates), chunked recurrence, gated norm, fused decode.

use orchid_model::error::{Error, Result};

use super::Ctx;

crate::kernel_abi! {
    pub fn deltanet_abi;
    const {
        /// Tokens per thread of `gdn_conv`.
        CONV_TOKENS => "CONV_TT": usize = 8;
        /// Tokens per chunk of the chunked prefill.
        CHUNK: usize = 64;
        /// Blocks per value head of the decode kernel (one thread-block cluster on sm_90+), each
        /// owning `dv / DECODE_SPLIT` state columns.
        DECODE_SPLIT => "GDN_NS": usize = 4;
        /// Threads per block of the decode kernel.
        DECODE_THREADS => "GDN_THREADS": usize = 256;
        /// State rows per thread of the decode kernel.
        DECODE_MAX_ROWS => "GDN_MAXR": usize = 16;
        /// Conv channels per thread of the decode kernel: a block convolves 2·dk + dv/DECODE_SPLIT channels.
        DECODE_CH_PER_THREAD => "GDN_NCPT": usize = 3;
    }
    #[derive(Clone, Copy, Default)]
    struct ConvArgs {
        x: u64,
        w: u64,
        state_in: u64,
        state_out: u64,
        out: u64,
        t: i32 => "T",
        c: i32 => "C",
        kc: i32 => "KC",
        ldx: i32,
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
        t: i32 => "T",
        hk: i32 => "Hk",
        hv: i32 => "Hv",
        dk: i32,
        dv: i32,
        c: i32 => "C",
        cw: i32,
        /// `chunk_count(t)`.
        nchunks: i32,
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
        /// `gdn_decode_rows`: the state slot of each row (i32; negative: padding, output zeros).
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

/// Dynamic shared memory of `gdn_chunk_prep`: K/W [64][dk+1], Q/V/U [64][max(dk,dv)+1],
/// Aᵀ [64][68], β and γ.
pub fn chunk_prep_smem(dk: usize, dv: usize) -> usize {
    (CHUNK * (dk + 1) + CHUNK * (dk.max(dv) + 1) + CHUNK * (CHUNK + 4) + 2 * CHUNK) * 4
}

/// Dynamic shared memory of `gdn_chunk_scan`: S [dk][cw+4], Vn and U [64][cw+4], W, Q, K
/// [64][dk+4], QK [64][68], γ and the decay factors.
pub fn chunk_scan_smem(dk: usize, cw: usize) -> usize {
    (dk * (cw + 4) + 2 * CHUNK * (cw + 4) + 3 * CHUNK * (dk + 4) + CHUNK * (CHUNK + 4) + 2 * CHUNK) * 4
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
    // Chunked prefill: 16-byte rows of q/k/W (cp.async, float4), both kernels' shared memory.
    let chunk_ok = dk.is_multiple_of(4) && chunk_prep_smem(dk, dv) <= 227 * 1024 && chunk_scan_smem(dk, chunk_cols(dv)) <= 227 * 1024;
    if !ok || !chunk_ok || conv_dim == 0 {
        return Err(Error::Op { op: "deltanet", msg: format!("GDN head dims dk {dk} / dv {dv} are not supported on CUDA") });
    }
    Ok(())
}

pub fn conv(c: &Ctx, a: &ConvArgs) -> Result<()> {
    let rows = (a.t.max(a.kc - 1).max(1) as usize).div_ceil(CONV_TOKENS);
    c.k("gdn_conv").launch(&c.gpu, ((a.c as usize).div_ceil(256) as u32, rows as u32, 1), 256, 0, a)
}

pub fn prep(c: &Ctx, a: &GdnPrepArgs) -> Result<()> {
    c.k("gdn_prep").launch(&c.gpu, (a.t as u32, 1, 1), 128, 0, a)
}

/// The chunked delta rule: `gdn_chunk_prep` (every chunk of every head in parallel, grid
/// (nchunks, Hv)) writes W, U, QK and γ to `a.scratch`; `gdn_chunk_scan` (grid (Hv, dv/cw))
/// walks the chunks in order on the state.
pub fn chunk(c: &Ctx, a: &ChunkArgs) -> Result<()> {
    let (dk, dv, cw) = (a.dk as usize, a.dv as usize, a.cw as usize);
    c.k("gdn_chunk_prep").launch(&c.gpu, (a.nchunks as u32, a.hv as u32, 1), 256, chunk_prep_smem(dk, dv) as u32, a)?;
    c.k("gdn_chunk_scan").launch(&c.gpu, (a.hv as u32, (dv / cw) as u32, 1), 256, chunk_scan_smem(dk, cw) as u32, a)
}

pub fn gated_norm(c: &Ctx, a: &GNormArgs) -> Result<()> {
    let tasks = a.t as usize * a.hv as usize;
    c.k("gdn_gated_norm").launch(&c.gpu, (tasks.div_ceil(4) as u32, 1, 1), 128, 0, a)
}

/// The fused decode step: `hv·DECODE_SPLIT` blocks (clusters of DECODE_SPLIT, one per value
/// head). Returns the number of kernels launched: 1 on sm_90+; 2 before (no clusters there, so
/// `gdn_decode` leaves the pre-norm output and `gdn_gated_norm` normalises it in place).
/// `decode` of one token of each of `rows` sequences (`a.rows_slot`, `a.pos_ptr`: one i32 per row).
pub fn decode_rows(c: &Ctx, a: &GdnDecodeArgs, rows: usize) -> Result<()> {
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
        assert_eq!(std::mem::size_of::<ConvArgs>(), 56);
        assert_eq!(std::mem::size_of::<GdnPrepArgs>(), 88);
        assert_eq!(std::mem::size_of::<ChunkArgs>(), 80);
        assert_eq!(std::mem::size_of::<GNormArgs>(), 56);
        assert_eq!(std::mem::size_of::<GdnDecodeArgs>(), 160);
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
    fn chunked_prefill_shapes() {
        // The 35B at 4,096 tokens: 64 chunks, 168 MB of scratch; prep 83,968 B (two blocks per
        // SM), scan 156,160 B.
        assert_eq!(chunk_count(4096), 64);
        assert_eq!(chunk_count(4097), 65);
        assert_eq!(chunk_count(2), 1);
        assert_eq!(CHUNK_SPAN_MAX % CHUNK, 0);
        assert_eq!(chunk_scratch_bytes(32, 128, 128, 4096), 32 * 64 * 64 * (128 + 128 + 65) * 4);
        assert_eq!(chunk_prep_smem(128, 128), 83_968);
        assert_eq!(chunk_scan_smem(128, 32), 156_160);
        // q/k/W rows are moved in 16-byte pieces.
        assert!(check_dims(30, 32, 184, 4).is_err());
        // dk = 192 with 32-column slices still fits the scan; the prep fits every dk, dv ≤ 256.
        assert!(chunk_scan_smem(192, chunk_cols(64)) <= 227 * 1024);
        assert!(chunk_prep_smem(256, 256) <= 227 * 1024);
    }
}
