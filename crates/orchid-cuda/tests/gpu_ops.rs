//! Per-kernel parity: every CUDA op against the CPU backend (the f32 reference) on random
//! inputs over awkward shapes (T in {1, 63, 64, 65, 127, 4097}, odd head counts). `#[ignore]`d
//! (a GPU is needed): scripts/gpu-test.sh runs them with `--ignored`, every launch synchronised
//! so that a fault names its kernel.
//!
//! Tolerances (relative L2, see docs/cuda.md):
//! - f32 kernels (norms, elementwise, embedding, GDN): 1e-5 .. 2e-3 (summation order; the GDN
//!   chunked solve amplifies rounding a little).
//! - matmuls against the CPU run on bf16-rounded inputs ("strict"): 1e-4 (only accumulation
//!   order differs: the 4-bit weights and bf16 operands are exact in both). These tests run the
//!   prompt GEMMs in their exact form (`exact_gpu`); the default rounded form (each 4-bit weight
//!   dequantised to bf16) is held to the CPU on the same rounded weights
//!   (`gemm_wg_round_matches_rounded_weights`) and to the MoE tolerance;
//!   against the CPU on f32 inputs ("loose"): 1e-2 (bf16 rounding of activations, ≤ 2^-9
//!   relative per element, ≈ 2e-3 RMS on a dot product).
//! - attention: 1.5e-2 (q, K and V in bf16 as in HF, probabilities rounded to bf16 for P·V).
//! - MoE: 1e-2 (expert activations rounded to bf16 before the down projection).

mod common;

use common::*;
use orchid_cpu::{CpuBackend, CpuTensor};
use orchid_cuda::ops::gemm::{self, GemmX};
use orchid_cuda::{CudaBackend, CudaTensor};
use orchid_model::backend::{AttentionInputs, Backend, DeltaNetInputs, MoeWeights, StateOptions, StatePool};
use orchid_model::batch::BatchLayout;
use orchid_model::weights::HostMlp;

const TS: [usize; 6] = [1, 63, 64, 65, 127, 4097];

/// The shared backend, synchronising after every launch.
fn gpu() -> CudaBackend {
    gpu_with(orchid_cuda::CudaOptions { sync_check: true, ..options() })
}

/// Tuning with the 64-token Q4 GEMMs in their exact form (`Tuning::gemm_wg_round` off): each
/// output the CPU's sum over the exact 4-bit weights, in the mma.sync kernels' bits.
fn exact() -> orchid_cuda::Tuning {
    orchid_cuda::Tuning { gemm_wg_round: false, ..Default::default() }
}

/// The shared backend with `exact()`.
fn exact_gpu() -> CudaBackend {
    gpu().with_tuning(&exact()).unwrap()
}

fn up(g: &CudaBackend, rows: usize, cols: usize, v: &[f32]) -> CudaTensor {
    g.from_host(rows, cols, v).unwrap()
}

fn host(g: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    g.to_host(t).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_elementwise_embed() {
    let g = gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(1);
    for &t in &TS {
        for &h in &[128usize, 200, 2048] {
            let x = rng.vec(t * h, 2.0);
            let y = rng.vec(t * h, 1.0);
            let w = rng.vec(h, 1.0);
            let (cx, cy) = (CpuTensor::from_vec(t, h, x.clone()), CpuTensor::from_vec(t, h, y.clone()));
            let (gx, gy) = (up(&g, t, h, &x), up(&g, t, h, &y));
            let (cw, gw) = (c.upload_vector(&w).unwrap(), g.upload_vector(&w).unwrap());
            let r = c.rms_norm(&cx, &cw, 1e-6).unwrap();
            report(&format!("rms_norm T={t} H={h}"), rel_l2(&host(&g, &g.rms_norm(&gx, &gw, 1e-6).unwrap()), &r.data), 1e-5);
            let (mut cx2, mut gx2) = (cx.clone(), up(&g, t, h, &x));
            let rn = c.add_rms_norm(&mut cx2, &cy, &cw, 1e-6).unwrap();
            let gn = g.add_rms_norm(&mut gx2, &gy, &gw, 1e-6).unwrap();
            report(&format!("add_rms_norm T={t} H={h}"), rel_l2(&host(&g, &gn), &rn.data).max(rel_l2(&host(&g, &gx2), &cx2.data)), 1e-5);
            let s = c.silu_mul(&cx, &cy).unwrap();
            report(&format!("silu_mul T={t} H={h}"), rel_l2(&host(&g, &g.silu_mul(&gx, &gy).unwrap()), &s.data), 1e-5);
            let rows: Vec<usize> = (0..t.min(7)).map(|i| (i * 37) % t).collect();
            let sr = c.select_rows(&cx, &rows).unwrap();
            report(&format!("select_rows T={t}"), rel_l2(&host(&g, &g.select_rows(&gx, &rows).unwrap()), &sr.data), 0.0);
        }
    }
    for (fmt, name) in [(Fmt::Mlx, "q4"), (Fmt::Hf, "bf16")] {
        let (v, h) = (1000, 256);
        let table = linear(&mut rng, v, h, fmt, 4);
        let ids: Vec<u32> = (0..65).map(|i| (i * 7919 % v) as u32).collect();
        let e = c.embed(&c.upload_linear(&table).unwrap(), &ids).unwrap();
        let ge = g.embed(&g.upload_linear(&table).unwrap(), &ids).unwrap();
        report(&format!("embed {name}"), rel_l2(&host(&g, &ge), &e.data), 1e-7);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_q4_and_bf16() {
    let g = exact_gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(2);
    // (256, 60001): more tiles than one wave holds, so the matvec streams (gemv_stream_body).
    let shapes = [(64usize, 33usize), (128, 512), (192, 130), (2048, 257), (4096, 2048), (512, 2048), (256, 60001)];
    for &(k, n) in &shapes {
        for (fmt, name) in [(Fmt::Mlx, "q4"), (Fmt::Hf, "bf16")] {
            let w = linear(&mut rng, n, k, fmt, 4);
            let (cw, gw) = (c.upload_linear(&w).unwrap(), g.upload_linear(&w).unwrap());
            for &t in &[1usize, 3, 8, 9, 63, 64, 65, 127, 4097] {
                if t * k * n > 1 << 31 {
                    continue;
                }
                let x = rng.vec(t * k, 1.0);
                let gy = host(&g, &g.matmul(&up(&g, t, k, &x), &gw).unwrap());
                let strict = c.matmul(&CpuTensor::from_vec(t, k, round_bf16(&x)), &cw).unwrap();
                report(&format!("matmul {name} strict T={t} K={k} N={n}"), rel_l2(&gy, &strict.data), 1e-4);
                let loose = c.matmul(&CpuTensor::from_vec(t, k, x), &cw).unwrap();
                report(&format!("matmul {name} loose T={t} K={k} N={n}"), rel_l2(&gy, &loose.data), 1e-2);
            }
        }
    }
}

/// Asserts bit-identical outputs (reported as a parity line of error 0 or infinity).
fn report_same(name: &str, a: &[f32], b: &[f32]) {
    let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    report(name, if same { 0.0 } else { f64::INFINITY }, 0.0);
}

/// The bytes of prepared GEMM inputs (bf16 rows and group sums), to the host.
fn prepared_bytes(xp: &GemmX) -> Vec<u8> {
    let mut v = vec![0u8; xp.buf.bytes];
    xp.buf.download(0, &mut v).unwrap();
    v
}

/// A dense GEMM of `t` prepared rows in `kparts` K parts (1: one pass), to the host.
fn gemm_parts(
    g: &CudaBackend,
    w: &orchid_cuda::GpuLinear,
    w2: Option<&orchid_cuda::GpuLinear>,
    xp: &GemmX,
    t: usize,
    kparts: usize,
) -> Vec<f32> {
    let out = g.tensor(t, w.rows).unwrap();
    gemm::gemm_split(&g.ctx, w, w2, xp, t, out.ptr(), w.rows, kparts, false).unwrap();
    host(g, &out)
}

/// A block's input projections in one launch (`gemm::gemm_each`, K parts as each weight alone
/// takes them): the GDN shapes scaled down (four Q4 weights of 1024, 512, 32 and 32 rows; three
/// bf16 ones), each output bit for bit what its own split-K GEMM gives, directly and through
/// `norm_matmuls`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_each_matches_gemm() {
    let g = gpu().with_tuning(&orchid_cuda::Tuning { gemm_each_wave: false, ..Default::default() }).unwrap();
    let apart = g.with_tuning(&orchid_cuda::Tuning { gemm_each: false, ..Default::default() }).unwrap();
    let pipe = g.with_tuning(&orchid_cuda::Tuning { gemm_direct: false, ..Default::default() }).unwrap();
    let c = CpuBackend::new();
    let mut rng = Rng::new(21);
    let k = 2048;
    for (fmt, name, rows) in [(Fmt::Mlx, "q4", &[1024usize, 512, 32, 32][..]), (Fmt::Hf, "bf16", &[512, 256, 32][..])] {
        let hw: Vec<_> = rows.iter().map(|&n| linear(&mut rng, n, k, fmt, 4)).collect();
        let gw: Vec<_> = hw.iter().map(|w| g.upload_linear(w).unwrap()).collect();
        let cw: Vec<_> = hw.iter().map(|w| c.upload_linear(w).unwrap()).collect();
        let refs: Vec<&orchid_cuda::GpuLinear> = gw.iter().collect();
        let nw = rng.vec(k, 1.0);
        let (gn, cn) = (g.upload_vector(&nw).unwrap(), c.upload_vector(&nw).unwrap());
        for &t in &[16usize, 33, 64] {
            let tag = format!("{name} T={t}");
            let x = rng.vec(t * k, 1.0);
            let gx = up(&g, t, k, &x);
            let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
            let outs: Vec<CudaTensor> = rows.iter().map(|&n| g.tensor(t, n).unwrap()).collect();
            let ptrs: Vec<u64> = outs.iter().map(|o| o.ptr()).collect();
            let one = gemm::gemm_each(&g.ctx, &refs, &xp, t, &ptrs).unwrap();
            report(&format!("gemm_each takes the weights in one launch {tag}"), if one { 0.0 } else { f64::INFINITY }, 0.0);
            for (i, w) in gw.iter().enumerate() {
                let o = g.tensor(t, w.rows).unwrap();
                gemm::gemm(&g.ctx, w, None, &xp, 0, t, None, o.ptr(), w.rows).unwrap();
                report_same(&format!("gemm_each = gemm, weight {i} {tag}"), &host(&g, &outs[i]), &host(&g, &o));
            }
            let crefs: Vec<_> = cw.iter().collect();
            let want = c.norm_matmuls(&CpuTensor::from_vec(t, k, x.clone()), &cn, 1e-6, &crefs).unwrap();
            let got = g.norm_matmuls(&gx, &gn, 1e-6, &refs).unwrap();
            let sep = apart.norm_matmuls(&gx, &gn, 1e-6, &refs).unwrap();
            let piped = pipe.norm_matmuls(&gx, &gn, 1e-6, &refs).unwrap();
            for i in 0..rows.len() {
                report_same(&format!("norm_matmuls one launch = a launch each, weight {i} {tag}"), &host(&g, &got[i]), &host(&g, &sep[i]));
                report_same(&format!("norm_matmuls direct loads = pipeline, weight {i} {tag}"), &host(&g, &got[i]), &host(&g, &piped[i]));
                report(&format!("norm_matmuls weight {i} {tag}"), rel_l2(&host(&g, &got[i]), &want[i].data), 1e-2);
            }
        }
    }
}

/// `gemm_each` with `Tuning::gemm_each_wave` on the GDN input projections' row counts (8,192 +
/// 4,096 + 32 + 32: 98 row blocks, so fewer K parts than each weight alone takes): each output
/// bit for bit what the GEMM in the launch's K parts gives, and near the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_each_wave_equals_split() {
    let g = gpu().with_tuning(&orchid_cuda::Tuning { gemm_each_wave: true, ..Default::default() }).unwrap();
    let c = CpuBackend::new();
    let mut rng = Rng::new(22);
    let (k, rows) = (2048, [8192usize, 4096, 32, 32]);
    let hw: Vec<_> = rows.iter().map(|&n| linear(&mut rng, n, k, Fmt::Mlx, 4)).collect();
    let gw: Vec<_> = hw.iter().map(|w| g.upload_linear(w).unwrap()).collect();
    let cw: Vec<_> = hw.iter().map(|w| c.upload_linear(w).unwrap()).collect();
    let refs: Vec<&orchid_cuda::GpuLinear> = gw.iter().collect();
    for &t in &[16usize, 64] {
        let x = rng.vec(t * k, 1.0);
        let gx = up(&g, t, k, &x);
        let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
        let kparts = gemm::each_kparts(&g.ctx, &refs, t);
        let alone = gemm::dense_kparts(&g.ctx, &gw[0], false, t);
        report(
            &format!("gemm_each_wave: fewer K parts ({kparts:?}) than alone ({alone}) T={t}"),
            if kparts.is_some_and(|p| p < alone) { 0.0 } else { f64::INFINITY },
            0.0,
        );
        let outs: Vec<CudaTensor> = rows.iter().map(|&n| g.tensor(t, n).unwrap()).collect();
        let ptrs: Vec<u64> = outs.iter().map(|o| o.ptr()).collect();
        let one = gemm::gemm_each(&g.ctx, &refs, &xp, t, &ptrs).unwrap();
        report(&format!("gemm_each_wave takes the weights in one launch T={t}"), if one { 0.0 } else { f64::INFINITY }, 0.0);
        let xc = CpuTensor::from_vec(t, k, x.clone());
        for (i, w) in gw.iter().enumerate() {
            let want = gemm_parts(&g, w, None, &xp, t, kparts.unwrap_or(1));
            report_same(&format!("gemm_each_wave = gemm in its K parts, weight {i} T={t}"), &host(&g, &outs[i]), &want);
            let cpu = c.matmul(&xc, &cw[i]).unwrap();
            report(&format!("gemm_each_wave weight {i} T={t}"), rel_l2(&want, &cpu.data), 1e-2);
        }
    }
}

/// Split-K dense GEMMs (batched decode: 16–64 tokens) in both formats: against the CPU (strict,
/// as `matmul_q4_and_bf16`), against the one-pass GEMM (only the summation order differs),
/// bit-identical from run to run and between the two ways of summing the parts (clusters, and
/// the reduction kernel; 12 parts: more than a cluster holds), through `matmul` (the rule's
/// parts) and `matmul_add` (the reduction adds onto the residual). N = 1001 takes the
/// one-output-per-thread reduction and a partial row block, N = 2048 and 520 the 4-output one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_split_k() {
    let g = exact_gpu();
    let red = g.with_tuning(&orchid_cuda::Tuning { splitk_cluster: false, ..exact() }).unwrap();
    let c = CpuBackend::new();
    let mut rng = Rng::new(12);
    let shapes = [(2048usize, 2048usize), (4096, 520), (2048, 1001), (1024, 64)];
    for &(k, n) in &shapes {
        for (fmt, name) in [(Fmt::Mlx, "q4"), (Fmt::Hf, "bf16")] {
            let w = linear(&mut rng, n, k, fmt, 4);
            let (cw, gw) = (c.upload_linear(&w).unwrap(), g.upload_linear(&w).unwrap());
            for &t in &[16usize, 33, 64] {
                let tag = format!("{name} T={t} K={k} N={n}");
                let x = rng.vec(t * k, 1.0);
                let gx = up(&g, t, k, &x);
                let strict = c.matmul(&CpuTensor::from_vec(t, k, round_bf16(&x)), &cw).unwrap().data;
                let kp = gemm::dense_kparts(&g.ctx, &gw, false, t);
                println!("split-K {tag}: {kp} parts by the rule");
                let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
                let one = gemm_parts(&g, &gw, None, &xp, t, 1);
                report(&format!("split-K one pass strict {tag}"), rel_l2(&one, &strict), 1e-4);
                for parts in [2, 3, kp.max(4), 12] {
                    let y = gemm_parts(&g, &gw, None, &xp, t, parts);
                    let again = gemm_parts(&g, &gw, None, &xp, t, parts);
                    report(&format!("split-K {parts} parts strict {tag}"), rel_l2(&y, &strict), 1e-4);
                    report(&format!("split-K {parts} parts vs one pass {tag}"), rel_l2(&y, &one), 1e-5);
                    report_same(&format!("split-K {parts} parts run to run {tag}"), &y, &again);
                    let yr = gemm_parts(&red, &gw, None, &xp, t, parts);
                    report_same(&format!("split-K {parts} parts cluster = reduction kernel {tag}"), &y, &yr);
                }
                // Through the backend: the rule's parts.
                let gy = host(&g, &g.matmul(&gx, &gw).unwrap());
                let gy2 = host(&g, &g.matmul(&gx, &gw).unwrap());
                report(&format!("split-K matmul strict {tag}"), rel_l2(&gy, &strict), 1e-4);
                report_same(&format!("split-K matmul run to run {tag}"), &gy, &gy2);
                // matmul_add: the residual plus the products (the reduction adds where the rule
                // splits, else the product then add_assign); and the accumulating reduction
                // with 3 parts explicitly.
                let r = rng.vec(t * n, 1.0);
                let want: Vec<f32> = r.iter().zip(&strict).map(|(a, b)| a + b).collect();
                let mut gr = up(&g, t, n, &r);
                g.matmul_add(&mut gr, &gx, &gw).unwrap();
                let got = host(&g, &gr);
                report(&format!("split-K matmul_add strict {tag}"), rel_l2(&got, &want), 1e-4);
                let mut gr2 = up(&g, t, n, &r);
                g.matmul_add(&mut gr2, &gx, &gw).unwrap();
                report_same(&format!("split-K matmul_add run to run {tag}"), &got, &host(&g, &gr2));
                for b in [&g, &red] {
                    let acc = up(&g, t, n, &r);
                    gemm::gemm_split(&b.ctx, &gw, None, &xp, t, acc.ptr(), n, 3, true).unwrap();
                    let y3 = gemm_parts(b, &gw, None, &xp, t, 3);
                    let sum3: Vec<f32> = r.iter().zip(&y3).map(|(a, b)| a + b).collect();
                    let how = if b.ctx.tuning.splitk_cluster { "cluster" } else { "reduction kernel" };
                    report_same(&format!("split-K accumulate = residual + product ({how}) {tag}"), &host(&g, &acc), &sum3);
                }
                // One pass that adds in its store.
                let acc1 = up(&g, t, n, &r);
                gemm::gemm_split(&g.ctx, &gw, None, &xp, t, acc1.ptr(), n, 1, true).unwrap();
                let y1 = gemm_parts(&g, &gw, None, &xp, t, 1);
                let sum1: Vec<f32> = r.iter().zip(&y1).map(|(a, b)| a + b).collect();
                report_same(&format!("one-pass accumulate = residual + product {tag}"), &host(&g, &acc1), &sum1);
            }
        }
    }
}

/// The GEMM path's normalising preparation (`gemm_x_norm`: a block's input projections) gives the
/// bits of `rms_norm` followed by `gemm_x`: the bf16 rows and their group sums, with K not a
/// multiple of 128 too (zero padding).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_x_norm_equals_norm_then_prep() {
    let g = gpu();
    let mut rng = Rng::new(21);
    for &(t, k) in &[(16usize, 2048usize), (33, 520), (64, 4096), (5, 132)] {
        let x = rng.vec(t * k, 3.0);
        let gx = up(&g, t, k, &x);
        let gw = g.upload_vector(&rng.vec(k, 1.0)).unwrap();
        let kept = up(&g, t, k, &vec![f32::NAN; t * k]);
        let fused = gemm::gemm_x_norm(&g.ctx, gx.ptr(), k, t, k, gw.buf.ptr, 1e-6, kept.ptr()).unwrap();
        let unkept = gemm::gemm_x_norm(&g.ctx, gx.ptr(), k, t, k, gw.buf.ptr, 1e-6, 0).unwrap();
        let xn = g.rms_norm(&gx, &gw, 1e-6).unwrap();
        let plain = gemm::gemm_x(&g.ctx, xn.ptr(), k, t, k).unwrap();
        let same = fused.buf.bytes == plain.buf.bytes
            && prepared_bytes(&fused) == prepared_bytes(&plain)
            && prepared_bytes(&unkept) == prepared_bytes(&plain);
        report(&format!("gemm_x_norm = rms_norm + gemm_x T={t} K={k}"), if same { 0.0 } else { f64::INFINITY }, 0.0);
        // The kept f32 rows are rms_norm's, bit for bit (the NaN fill shows any row left unwritten).
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let kept_same = bits(host(&g, &kept)) == bits(host(&g, &xn));
        report(&format!("gemm_x_norm kept rows = rms_norm T={t} K={k}"), if kept_same { 0.0 } else { f64::INFINITY }, 0.0);
    }
}

/// The gate/up pair (silu(gate) · up, the shared expert's GEMM) split along K: against the CPU
/// and the one-pass pair, bit-identical from run to run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_pair_split_k() {
    let g = exact_gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(13);
    for &(k, n) in &[(2048usize, 512usize), (2048, 1001)] {
        for (fmt, name) in [(Fmt::Mlx, "q4"), (Fmt::Hf, "bf16")] {
            let (wg, wu) = (linear(&mut rng, n, k, fmt, 4), linear(&mut rng, n, k, fmt, 4));
            let (cg, cu) = (c.upload_linear(&wg).unwrap(), c.upload_linear(&wu).unwrap());
            let (gg, gu) = (g.upload_linear(&wg).unwrap(), g.upload_linear(&wu).unwrap());
            for &t in &[16usize, 33, 64] {
                let tag = format!("{name} T={t} K={k} N={n}");
                let x = rng.vec(t * k, 1.0);
                let cx = CpuTensor::from_vec(t, k, round_bf16(&x));
                let strict = c.silu_mul(&c.matmul(&cx, &cg).unwrap(), &c.matmul(&cx, &cu).unwrap()).unwrap().data;
                let gx = up(&g, t, k, &x);
                let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
                let one = gemm_parts(&g, &gg, Some(&gu), &xp, t, 1);
                report(&format!("pair one pass strict {tag}"), rel_l2(&one, &strict), 1e-4);
                for parts in [2, 4] {
                    let y = gemm_parts(&g, &gg, Some(&gu), &xp, t, parts);
                    let again = gemm_parts(&g, &gg, Some(&gu), &xp, t, parts);
                    report(&format!("pair split-K {parts} parts strict {tag}"), rel_l2(&y, &strict), 1e-4);
                    report(&format!("pair split-K {parts} parts vs one pass {tag}"), rel_l2(&y, &one), 1e-5);
                    report_same(&format!("pair split-K {parts} parts run to run {tag}"), &y, &again);
                }
            }
        }
    }
}

/// Two weights read as one GEMM (`gemm_concat`: the router and the shared-expert gate): each
/// output column equals the GEMM of its own weight, bit for bit where both split K alike (the
/// router's shape), else within the split-K tolerance; Q4 too (its scale words follow the rows).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_concat_equals_two_gemms() {
    let g = gpu();
    let mut rng = Rng::new(29);
    for &(k, n1, n2, fmt, name) in &[(2048usize, 256usize, 1usize, Fmt::Hf, "bf16"), (1024, 200, 72, Fmt::Mlx, "q4")] {
        let bits = if fmt == Fmt::Mlx { 4 } else { 8 };
        let (w1, w2) = (linear(&mut rng, n1, k, fmt, bits), linear(&mut rng, n2, k, fmt, bits));
        let (g1, g2) = (g.upload_linear(&w1).unwrap(), g.upload_linear(&w2).unwrap());
        for &t in &[16usize, 64, 200] {
            let x = rng.vec(t * k, 1.0);
            let gx = up(&g, t, k, &x);
            let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
            let n = n1 + n2;
            let both = g.tensor(t, n).unwrap();
            gemm::gemm_concat(&g.ctx, &g1, &g2, &xp, t, both.ptr(), n).unwrap();
            let (o1, o2) = (g.tensor(t, n1).unwrap(), g.tensor(t, n2).unwrap());
            gemm::gemm(&g.ctx, &g1, None, &xp, 0, t, None, o1.ptr(), n1).unwrap();
            gemm::gemm(&g.ctx, &g2, None, &xp, 0, t, None, o2.ptr(), n2).unwrap();
            let (both, o1, o2) = (host(&g, &both), host(&g, &o1), host(&g, &o2));
            let want: Vec<f32> = (0..t).flat_map(|r| o1[r * n1..(r + 1) * n1].iter().chain(&o2[r * n2..(r + 1) * n2]).copied()).collect();
            let parts = |rows: usize| {
                let min_ksteps = gemm::split_min_ksteps(g1.fmt);
                gemm::gemm_kparts(rows.div_ceil(128), k / 128, min_ksteps, t, g.ctx.gpu.sms as usize, g.ctx.tuning.gemm_kparts_max)
            };
            let tag = format!("{name} T={t} K={k} rows {n1} + {n2}");
            if parts(n) == parts(n1) && parts(n) == parts(n2) {
                report_same(&format!("gemm_concat = two GEMMs {tag} ({} K parts)", parts(n)), &both, &want);
            } else {
                report(&format!("gemm_concat vs two GEMMs {tag}"), rel_l2(&both, &want), 1e-5);
            }
        }
    }
}

/// A grouped GEMM's separate expert (`AltExpert`: the shared expert listed after the routed
/// ones) gives the bits of a one-pass dense GEMM of its weights over the same tokens, for a
/// gate/up pair and a single weight, next to a tile of a stacked expert (which gives the bits of
/// that expert's dense GEMM).
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gemm_reads_a_separate_expert() {
    use orchid_cuda::driver::DevBuf;
    let g = gpu();
    let mut rng = Rng::new(31);
    let (e, h, i, t, routed, bn) = (4usize, 1024usize, 256usize, 40usize, 5usize, 32usize);
    let experts: Vec<HostMlp> = (0..e).map(|_| mlp(&mut rng, i, h, Fmt::Mlx, 4)).collect();
    let shared = mlp(&mut rng, i, h, Fmt::Mlx, 4);
    let ex = g.upload_experts(&experts).unwrap();
    let lin = |w| g.upload_linear(w).unwrap();
    let (sg, su, sd) = (lin(&shared.gate_proj), lin(&shared.up_proj), lin(&shared.down_proj));
    let (eg, eu, ed) = (lin(&experts[1].gate_proj), lin(&experts[1].up_proj), lin(&experts[1].down_proj));
    // List positions: expert 1 takes tokens 0..routed, the separate expert (index e) all t tokens.
    let listed = routed + t;
    let words = |v: &[u32]| DevBuf::from_slice(&g.ctx.gpu, v).unwrap();
    let x_rows: Vec<u32> = (0..routed as u32).chain(0..t as u32).collect();
    let mut table = vec![1, 0, routed as u32, 0];
    for j in 0..t.div_ceil(bn) {
        table.extend([e, routed + j * bn, bn.min(t - j * bn), 0].map(|v| v as u32));
    }
    let (rows, tiles, num) = (words(&x_rows), words(&table), words(&[(table.len() / 4) as u32]));
    let grouped = |alt| gemm::Grouped { tiles: tiles.ptr, num_tiles: num.ptr, max_tiles: table.len() / 4, bn, alt, early: true };
    let tail = |v: &[f32], n: usize| v[routed * n..].to_vec();
    let head = |v: &[f32], n: usize| v[..routed * n].to_vec();
    // Gate/up pair: silu(gate) ⊙ up rows.
    let x = rng.vec(t * h, 1.0);
    let gx = up(&g, t, h, &x);
    let xp = gemm::gemm_x(&g.ctx, gx.ptr(), h, t, h).unwrap();
    let alt = gemm::AltExpert::of(e, &ex.gate, &sg, Some((&ex.up, &su)));
    assert!(alt.is_some(), "the shared expert has an expert's shape");
    let got = g.tensor(listed, i).unwrap();
    gemm::gemm(&g.ctx, &ex.gate, Some(&ex.up), &xp, rows.ptr, listed, Some(grouped(alt)), got.ptr(), i).unwrap();
    let got = host(&g, &got);
    let (want, want1) = (g.tensor(t, i).unwrap(), g.tensor(t, i).unwrap());
    gemm::gemm_split(&g.ctx, &sg, Some(&su), &xp, t, want.ptr(), i, 1, false).unwrap();
    gemm::gemm_split(&g.ctx, &eg, Some(&eu), &xp, t, want1.ptr(), i, 1, false).unwrap();
    report_same("grouped pair: the separate expert = its dense GEMM", &tail(&got, i), &host(&g, &want));
    report_same("grouped pair: a stacked expert = its dense GEMM", &head(&got, i), &head(&host(&g, &want1), i));
    // A single weight (the down projection) over prepared rows read in list order.
    let y = rng.vec(listed * i, 1.0);
    let gy = up(&g, listed, i, &y);
    let yp = gemm::gemm_x(&g.ctx, gy.ptr(), i, listed, i).unwrap();
    let alt = gemm::AltExpert::of(e, &ex.down, &sd, None);
    let got = g.tensor(listed, h).unwrap();
    gemm::gemm(&g.ctx, &ex.down, None, &yp, 0, listed, Some(grouped(alt)), got.ptr(), h).unwrap();
    let got = host(&g, &got);
    let (yh, yt) =
        (gemm::gemm_x(&g.ctx, gy.ptr(), i, routed, i).unwrap(), gemm::gemm_x(&g.ctx, gy.ptr() + (routed * i * 4) as u64, i, t, i).unwrap());
    let (want, want1) = (g.tensor(t, h).unwrap(), g.tensor(routed, h).unwrap());
    gemm::gemm_split(&g.ctx, &sd, None, &yt, t, want.ptr(), h, 1, false).unwrap();
    gemm::gemm_split(&g.ctx, &ed, None, &yh, routed, want1.ptr(), h, 1, false).unwrap();
    report_same("grouped single: the separate expert = its dense GEMM", &tail(&got, h), &host(&g, &want));
    report_same("grouped single: a stacked expert = its dense GEMM", &head(&got, h), &host(&g, &want1));
    // Shapes that differ are refused.
    assert!(gemm::AltExpert::of(e, &ex.down, &sg, None).is_none());
    assert!(gemm::AltExpert::of(0, &ex.down, &sd, None).is_none());
}

/// The gate/up pair written prepared for the down projection (`gemm_pair_x`: in the one-pass
/// GEMM's epilogue, in the split-K reduction, or for other shapes, here N = 1000, through
/// `gemm_x`) gives the bytes of the pair's f32 rows prepared by `gemm_x`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_pair_x_equals_pair_then_prep() {
    let g = gpu();
    let red = g.with_tuning(&orchid_cuda::Tuning { splitk_cluster: false, ..Default::default() }).unwrap();
    let mut rng = Rng::new(23);
    for &(k, n) in &[(2048usize, 512usize), (1024, 256), (2048, 1000)] {
        for (fmt, name) in [(Fmt::Mlx, "q4"), (Fmt::Hf, "bf16")] {
            let (wg, wu) = (linear(&mut rng, n, k, fmt, 4), linear(&mut rng, n, k, fmt, 4));
            let (gg, gu) = (g.upload_linear(&wg).unwrap(), g.upload_linear(&wu).unwrap());
            for &t in &[16usize, 33, 64, 200] {
                let x = rng.vec(t * k, 1.0);
                let gx = up(&g, t, k, &x);
                let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
                let fused = gemm::gemm_pair_x(&g.ctx, &gg, &gu, &xp, 0, t, None).unwrap();
                let h = g.tensor(t, n).unwrap();
                gemm::gemm(&g.ctx, &gg, Some(&gu), &xp, 0, t, None, h.ptr(), n).unwrap();
                let plain = gemm::gemm_x(&g.ctx, h.ptr(), n, t, n).unwrap();
                let parts = gemm::dense_kparts(&g.ctx, &gg, true, t);
                let same = fused.buf.bytes == plain.buf.bytes && prepared_bytes(&fused) == prepared_bytes(&plain);
                let tag = format!("{name} T={t} K={k} N={n} ({parts} K parts)");
                report(&format!("gemm_pair_x = pair + gemm_x {tag}"), if same { 0.0 } else { f64::INFINITY }, 0.0);
                // The parts summed by the reduction kernel instead of in clusters: the same bytes.
                let reduced = gemm::gemm_pair_x(&red.ctx, &gg, &gu, &xp, 0, t, None).unwrap();
                let same = prepared_bytes(&reduced) == prepared_bytes(&fused);
                report(&format!("gemm_pair_x cluster = reduction kernel {tag}"), if same { 0.0 } else { f64::INFINITY }, 0.0);
                let hr = red.tensor(t, n).unwrap();
                gemm::gemm(&red.ctx, &gg, Some(&gu), &xp, 0, t, None, hr.ptr(), n).unwrap();
                report_same(&format!("gemm pair cluster = reduction kernel {tag}"), &host(&g, &h), &host(&red, &hr));
            }
        }
    }
}

/// The Q4 64-token tiles on warpgroup MMA (`gemm::gemm_wgmma`, the `_wg` kernels) against the
/// mma.sync kernels: one pass, split-K summed in clusters, and the gate/up pair written prepared,
/// at token counts whose last tile takes each wgmma width (16, 32 and 64 tokens). The same sums
/// in the same order: the same bits (the exact form, `Tuning::gemm_wg_round` off).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_wgmma_matches_mma_sync() {
    let g = exact_gpu();
    if !gemm::gemm_wgmma(&g.ctx, orchid_cuda::weights::WFormat::Q4, 64) {
        println!("no warpgroup MMA on this GPU: nothing to compare");
        return;
    }
    let mma = g.with_tuning(&orchid_cuda::Tuning { gemm_wgmma: false, ..exact() }).unwrap();
    let mut rng = Rng::new(37);
    for &(k, n) in &[(2048usize, 1024usize), (512, 2048), (1024, 640)] {
        let (wg, wu) = (linear(&mut rng, n, k, Fmt::Mlx, 4), linear(&mut rng, n, k, Fmt::Mlx, 4));
        let (gg, gu) = (g.upload_linear(&wg).unwrap(), g.upload_linear(&wu).unwrap());
        // One pass takes the 64-token tile from ~600 tokens on (gemm_bn_dense); the last tile of
        // 1100 / 1120 / 1130 tokens holds 12 / 32 / 42 (wgmma widths 16, 32, 64).
        for &t in &[33usize, 80, 90, 104, 1100, 1120, 1130] {
            let tag = format!("T={t} K={k} N={n}");
            let x = rng.vec(t * k, 1.0);
            let gx = up(&g, t, k, &x);
            let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
            for parts in [1, 4] {
                let a = gemm_parts(&g, &gg, None, &xp, t, parts);
                let b = gemm_parts(&mma, &gg, None, &xp, t, parts);
                // Where they differ first (token, row): a wrong operand layout shows its pattern.
                let bad: Vec<_> = (0..a.len()).filter(|&i| a[i].to_bits() != b[i].to_bits()).take(6).collect();
                for i in bad {
                    println!("  differs at token {} row {}: {} vs {}", i / n, i % n, a[i], b[i]);
                }
                report(&format!("wgmma vs mma.sync, {parts} K parts {tag}"), rel_l2(&a, &b), 1e-6);
                report_same(&format!("wgmma = mma.sync, {parts} K parts {tag}"), &a, &b);
            }
            let fused = gemm::gemm_pair_x(&g.ctx, &gg, &gu, &xp, 0, t, None).unwrap();
            let plain = gemm::gemm_pair_x(&mma.ctx, &gg, &gu, &xp, 0, t, None).unwrap();
            let same = prepared_bytes(&fused) == prepared_bytes(&plain);
            report(&format!("wgmma = mma.sync, gate/up pair prepared {tag}"), if same { 0.0 } else { f64::INFINITY }, 0.0);
        }
    }
}

/// The rounded `_wg` kernels (`Tuning::gemm_wg_round`, the `_wgr` kernels: each weight
/// dequantised to bf16 once, the whole K accumulated by the tensor cores) against the CPU on the
/// same bf16 weights (s · q + b rounded once) and bf16-rounded inputs ("strict": only the
/// accumulation order differs) and on the exact 4-bit weights ("loose"), one pass and split-K,
/// at token counts whose last tile takes each wgmma width. A GEMM that is bit for bit the exact
/// kernels' did not take a 64-token tile (only the strict check is skipped); the long ones must
/// take it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_wg_round_matches_rounded_weights() {
    let g = exact_gpu();
    if !gemm::gemm_wgmma(&g.ctx, orchid_cuda::weights::WFormat::Q4, 64) {
        println!("no warpgroup MMA on this GPU: nothing to compare");
        return;
    }
    let r = g.with_tuning(&orchid_cuda::Tuning { gemm_wg_round: true, ..Default::default() }).unwrap();
    let c = CpuBackend::new();
    let mut rng = Rng::new(43);
    for &(k, n) in &[(2048usize, 1024usize), (512, 2048), (1024, 640)] {
        let v = rng.vec(n * k, (3.0 / k as f32).sqrt());
        let hw = affine(n, k, &v, 4);
        let (gw, rw) = (g.upload_linear(&hw).unwrap(), r.upload_linear(&hw).unwrap());
        let (cexact, crounded) = (c.upload_linear(&hw).unwrap(), c.upload_linear(&dense_bf16(n, k, &round_bf16(&hw.to_f32()))).unwrap());
        // The gate/up pair's up weights (silu(gate) · up in the epilogue).
        let hu = affine(n, k, &rng.vec(n * k, (3.0 / k as f32).sqrt()), 4);
        let (ru, cu) = (r.upload_linear(&hu).unwrap(), c.upload_linear(&dense_bf16(n, k, &round_bf16(&hu.to_f32()))).unwrap());
        for &t in &[64usize, 90, 1100, 1120, 1130] {
            let tag = format!("T={t} K={k} N={n}");
            let x = rng.vec(t * k, 1.0);
            let gx = up(&g, t, k, &x);
            let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
            let xr = CpuTensor::from_vec(t, k, round_bf16(&x));
            let (strict, loose) = (c.matmul(&xr, &crounded).unwrap(), c.matmul(&xr, &cexact).unwrap());
            for parts in [1, 4] {
                let a = gemm_parts(&r, &rw, None, &xp, t, parts);
                let b = gemm_parts(&g, &gw, None, &xp, t, parts);
                let rounded = a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits());
                if rounded {
                    report(&format!("wg rounded vs CPU on bf16 weights, {parts} K parts {tag}"), rel_l2(&a, &strict.data), 1e-4);
                    let pair = gemm_parts(&r, &rw, Some(&ru), &xp, t, parts);
                    let want = c.silu_mul(&strict, &c.matmul(&xr, &cu).unwrap()).unwrap();
                    report(&format!("wg rounded pair vs CPU on bf16 weights, {parts} K parts {tag}"), rel_l2(&pair, &want.data), 1e-4);
                } else {
                    println!("  {parts} K parts {tag}: not on a 64-token tile");
                    assert!(t < 1000, "{tag}: a long GEMM took no rounded 64-token tile");
                }
                report(&format!("wg rounded vs exact weights, {parts} K parts {tag}"), rel_l2(&a, &loose.data), 1e-2);
            }
        }
    }
}

/// Dense split-K Q4 GEMMs of 9–32 tokens with the weights loaded straight into registers (the
/// `_ld` kernels, `gemm::gemm_ld`) against the cp.async pipeline: 2–8 K parts in clusters, K
/// 2,048 and 4,096, a partial row block (N = 1001), the accumulating form and a block's
/// projections in one launch. The same sums in the same order: the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_direct_matches_pipeline() {
    let g = gpu();
    let pipe = g.with_tuning(&orchid_cuda::Tuning { gemm_direct: false, ..Default::default() }).unwrap();
    let mut rng = Rng::new(41);
    for &(k, n) in &[(2048usize, 1024usize), (4096, 2048), (2048, 1001)] {
        let hw = linear(&mut rng, n, k, Fmt::Mlx, 4);
        let gw = g.upload_linear(&hw).unwrap();
        for &t in &[9usize, 16, 24, 32] {
            let tag = format!("T={t} K={k} N={n}");
            let x = rng.vec(t * k, 1.0);
            let gx = up(&g, t, k, &x);
            let xp = gemm::gemm_x(&g.ctx, gx.ptr(), k, t, k).unwrap();
            for parts in [2, 4, 8] {
                let a = gemm_parts(&g, &gw, None, &xp, t, parts);
                let b = gemm_parts(&pipe, &gw, None, &xp, t, parts);
                let bad: Vec<_> = (0..a.len()).filter(|&i| a[i].to_bits() != b[i].to_bits()).take(6).collect();
                for i in bad {
                    println!("  differs at token {} row {}: {} vs {}", i / n, i % n, a[i], b[i]);
                }
                report_same(&format!("direct loads = pipeline, {parts} K parts {tag}"), &a, &b);
            }
            // Accumulating onto a residual (the rule's K parts).
            let r = rng.vec(t * n, 1.0);
            let (ra, rb) = (up(&g, t, n, &r), up(&pipe, t, n, &r));
            gemm::gemm_split(&g.ctx, &gw, None, &xp, t, ra.ptr(), n, 4, true).unwrap();
            gemm::gemm_split(&pipe.ctx, &gw, None, &xp, t, rb.ptr(), n, 4, true).unwrap();
            report_same(&format!("direct loads = pipeline, accumulating {tag}"), &host(&g, &ra), &host(&pipe, &rb));
        }
    }
}

/// Random q/k/v, z, b and a of `t` tokens for a GDN layer, on the CPU and on the GPU.
fn gdn_step_inputs(g: &CudaBackend, rng: &mut Rng, t: usize, cdim: usize, vdim: usize, hv: usize) -> ([CpuTensor; 4], [CudaTensor; 4]) {
    let (qkv, z, b, a) = (rng.vec(t * cdim, 1.0), rng.vec(t * vdim, 2.0), rng.vec(t * hv, 2.0), rng.vec(t * hv, 2.0));
    let gt = [up(g, t, cdim, &qkv), up(g, t, vdim, &z), up(g, t, hv, &b), up(g, t, hv, &a)];
    let ct =
        [CpuTensor::from_vec(t, cdim, qkv), CpuTensor::from_vec(t, vdim, z), CpuTensor::from_vec(t, hv, b), CpuTensor::from_vec(t, hv, a)];
    (ct, gt)
}

/// A GDN layer's inputs from `gdn_step_inputs`' tensors and the layer's vectors (conv weight,
/// A_log, dt_bias, norm weight).
fn gdn_inputs<'a, B: Backend>(x: &'a [B::Tensor; 4], v: &'a [B::Vector]) -> DeltaNetInputs<'a, B> {
    DeltaNetInputs { qkv: &x[0], z: &x[1], b: &x[2], a: &x[3], conv: &v[0], a_log: &v[1], dt_bias: &v[2], norm: &v[3] }
}

/// One attention layer's state pools on both backends.
fn attn_states(hq: usize, hkv: usize, d: usize) -> (orchid_model::config::ModelConfig, StateOptions) {
    let cfg = config(64, 64, 1, (hq, hkv, d), (1, 1, 32, 32), (4, 2, 64, 0), 1);
    (cfg, StateOptions::new(2, 8192))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_prefill_and_decode() {
    let g = gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(3);
    let cases: [(usize, usize, usize, bool); 5] =
        [(16, 2, 256, true), (6, 1, 64, true), (8, 8, 32, true), (4, 2, 128, false), (3, 3, 64, true)];
    let schedules: [&[usize]; 5] = [&[1, 1, 1], &[63, 1, 1], &[64, 65], &[127, 1, 2], &[4097, 1]];
    for &(hq, hkv, d, gate) in &cases {
        let (mut cfg, opts) = attn_states(hq, hkv, d);
        cfg.attention.output_gate = gate;
        let dims = cfg.attention.clone();
        let qn = rng.vec(d, 0.2).iter().map(|x| 1.0 + x).collect::<Vec<_>>();
        let kn = rng.vec(d, 0.2).iter().map(|x| 1.0 + x).collect::<Vec<_>>();
        let (cqn, ckn) = (c.upload_vector(&qn).unwrap(), c.upload_vector(&kn).unwrap());
        let (gqn, gkn) = (g.upload_vector(&qn).unwrap(), g.upload_vector(&kn).unwrap());
        for sched in schedules {
            if sched[0] > 200 && hq * d > 512 {
                continue; // the f32 CPU reference of 4097² at 16 heads of 256 takes minutes
            }
            let mut cs = c.new_state(&cfg, opts).unwrap();
            let mut gs = g.new_state(&cfg, opts).unwrap();
            let (sc, sg) = (cs.alloc().unwrap(), gs.alloc().unwrap());
            let mut pos = 0;
            for &t in sched {
                let qw = dims.q_proj_rows();
                let (q, k, v) = (rng.vec(t * qw, 1.0), rng.vec(t * hkv * d, 1.0), rng.vec(t * hkv * d, 1.0));
                let (cq, ck, cv) = (
                    CpuTensor::from_vec(t, qw, q.clone()),
                    CpuTensor::from_vec(t, hkv * d, k.clone()),
                    CpuTensor::from_vec(t, hkv * d, v.clone()),
                );
                let (gq, gk, gv) = (up(&g, t, qw, &q), up(&g, t, hkv * d, &k), up(&g, t, hkv * d, &v));
                let ci = AttentionInputs::<CpuBackend> { q_gate: &cq, k: &ck, v: &cv, q_norm: &cqn, k_norm: &ckn };
                let gi = AttentionInputs::<CudaBackend> { q_gate: &gq, k: &gk, v: &gv, q_norm: &gqn, k_norm: &gkn };
                let b1 = BatchLayout::single(sc, pos, t);
                let b2 = BatchLayout::single(sg, pos, t);
                let co = c.attention(ci, &dims, 1e-6, 0, &b1, &mut cs).unwrap();
                let go = g.attention(gi, &dims, 1e-6, 0, &b2, &mut gs).unwrap();
                report(&format!("attention Hq={hq} Hkv={hkv} D={d} gate={gate} pos={pos} T={t}"), rel_l2(&host(&g, &go), &co.data), 1.5e-2);
                pos += t;
            }
        }
    }
}

/// Several sequences' spans in one attention call (their q/k norms, RoPE and cache appends in one
/// launch, the spans without split-KV in one prefill launch, a one-token span's decode) give each
/// sequence's outputs bit for bit as its span alone.
#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_spans_in_one_call_equal_alone() {
    use orchid_model::batch::SeqSpan;
    let g = gpu();
    let mut rng = Rng::new(24);
    // (first pass, span) per sequence.
    let seqs: [(usize, usize); 6] = [(0, 512), (37, 130), (64, 1), (5, 2), (1, 700), (12, 64)];
    for (hq, hkv, d, gate) in [(16, 2, 256, true), (6, 1, 64, false)] {
        let (mut cfg, _) = attn_states(hq, hkv, d);
        cfg.attention.output_gate = gate;
        let dims = cfg.attention.clone();
        let norms = [rng.vec(d, 0.2), rng.vec(d, 0.2)].map(|v| g.upload_vector(&v.iter().map(|x| 1.0 + x).collect::<Vec<_>>()).unwrap());
        let widths = [dims.q_proj_rows(), hkv * d, hkv * d];
        let inputs: Vec<[Vec<f32>; 3]> = seqs.iter().map(|&(p, t)| std::array::from_fn(|i| rng.vec((p + t) * widths[i], 1.0))).collect();
        // One attention call over spans (slot, sequence, from, to); the output rows.
        let fwd = |st: &mut orchid_cuda::CudaState, spans: &[Span]| -> Vec<f32> {
            let rows: usize = spans.iter().map(|s| s.3 - s.2).sum();
            let gt: [CudaTensor; 3] = std::array::from_fn(|i| {
                let v: Vec<f32> = spans.iter().flat_map(|s| inputs[s.1][i][s.2 * widths[i]..s.3 * widths[i]].to_vec()).collect();
                up(&g, rows, widths[i], &v)
            });
            let inp = AttentionInputs::<CudaBackend> { q_gate: &gt[0], k: &gt[1], v: &gt[2], q_norm: &norms[0], k_norm: &norms[1] };
            let batch = BatchLayout { spans: spans.iter().map(|s| SeqSpan { slot: s.0, start: s.2, len: s.3 - s.2 }).collect() };
            host(&g, &g.attention(inp, &dims, 1e-6, 0, &batch, st).unwrap())
        };
        let mut st = g.new_state(&cfg, StateOptions::new(2 * seqs.len(), 2048)).unwrap();
        let what = format!("attention spans in one call Hq={hq} Hkv={hkv} D={d}");
        spans_vs_alone(&mut st, &seqs, hq * d, &what, fwd, |_, _, _, _| {});
    }
}

/// Appends `t` tokens' keys (normalised, rotated) and values to a CPU state's cache the way the
/// CPU attention does, without computing their attention (the reference of a long cache).
fn cpu_append_kv(st: &mut orchid_cpu::CpuState, slot: usize, dims: &orchid_model::config::AttentionDims, kn: &[f32], k: &[f32], v: &[f32]) {
    use orchid_cpu::attention::{apply_rope, rope_cos_sin};
    let (hkv, d) = (dims.num_kv_heads, dims.head_dim);
    let cache = &mut st.slot(slot).kv[0];
    let t = k.len() / (hkv * d);
    let mut tmp = vec![0f32; d];
    for p in 0..t {
        let (cos, sin) = rope_cos_sin(dims, cache.len + p);
        for j in 0..hkv {
            orchid_cpu::elementwise::rms_norm_into(&k[(p * hkv + j) * d..(p * hkv + j + 1) * d], kn, 1e-6, &mut tmp);
            apply_rope(&mut tmp[..dims.rotary_dim], &cos, &sin);
            cache.k.extend_from_slice(&tmp);
        }
        cache.v.extend_from_slice(&v[p * hkv * d..(p + 1) * hkv * d]);
    }
    cache.len += t;
}

/// Split-KV prefill (few query tiles over a long cache): against the CPU, against the plain
/// kernel (`attn_prefill_splits` = 1, same inputs in another slot) and against itself (bitwise).
/// Cases: (Hq, Hkv, D, gate, cached prefix, spans); a prefix goes into the CPU cache directly
/// (its f32 attention would take minutes); spans from position 0 are checked in full (there the
/// first query tiles have fewer key tiles than splits: empty splits, rows with no key in a split).
#[test]
#[ignore = "needs a CUDA GPU"]
#[allow(clippy::type_complexity)]
fn attention_prefill_split_kv() {
    let g = gpu();
    let plain = g.with_tuning(&orchid_cuda::Tuning { attn_prefill_splits: 1, ..Default::default() }).unwrap();
    let c = CpuBackend::new();
    let mut rng = Rng::new(8);
    let sms = g.gpu().sms as usize;
    let max = g.ctx.tuning.attn_prefill_splits;
    let cases: [(usize, usize, usize, bool, usize, &[usize]); 6] = [
        (16, 2, 256, true, 3000, &[2, 37, 100]),
        (8, 2, 256, true, 9000, &[37, 100]),
        (6, 2, 128, true, 5000, &[2, 37, 100]),
        (4, 1, 128, false, 7000, &[100]),
        (2, 2, 256, true, 0, &[2100, 2, 37]),
        (2, 2, 128, true, 0, &[2100, 100]),
    ];
    for &(hq, hkv, d, gate, prefix, spans) in &cases {
        let (mut cfg, _) = attn_states(hq, hkv, d);
        cfg.attention.output_gate = gate;
        let dims = cfg.attention.clone();
        let total = prefix + spans.iter().sum::<usize>();
        let opts = StateOptions::new(3, total.next_multiple_of(64));
        let qn = rng.vec(d, 0.2).iter().map(|x| 1.0 + x).collect::<Vec<_>>();
        let kn = rng.vec(d, 0.2).iter().map(|x| 1.0 + x).collect::<Vec<_>>();
        let (cqn, ckn) = (c.upload_vector(&qn).unwrap(), c.upload_vector(&kn).unwrap());
        let (gqn, gkn) = (g.upload_vector(&qn).unwrap(), g.upload_vector(&kn).unwrap());
        let mut cs = c.new_state(&cfg, opts).unwrap();
        let mut gs = g.new_state(&cfg, opts).unwrap();
        let sc = cs.alloc().unwrap();
        // Slots: split-KV, plain kernel, split-KV again.
        let slots = [gs.alloc().unwrap(), gs.alloc().unwrap(), gs.alloc().unwrap()];
        let qw = dims.q_proj_rows();
        let mut pos = 0;
        for (i, &t) in std::iter::once(&prefix).chain(spans).enumerate() {
            if t == 0 {
                continue;
            }
            let (q, k, v) = (rng.vec(t * qw, 1.0), rng.vec(t * hkv * d, 1.0), rng.vec(t * hkv * d, 1.0));
            let (gq, gk, gv) = (up(&g, t, qw, &q), up(&g, t, hkv * d, &k), up(&g, t, hkv * d, &v));
            let gi = || AttentionInputs::<CudaBackend> { q_gate: &gq, k: &gk, v: &gv, q_norm: &gqn, k_norm: &gkn };
            let mut outs = Vec::new();
            for (j, &slot) in slots.iter().enumerate() {
                let be = if j == 1 { &plain } else { &g };
                outs.push(host(&g, &be.attention(gi(), &dims, 1e-6, 0, &BatchLayout::single(slot, pos, t), &mut gs).unwrap()));
            }
            let nsplit = orchid_cuda::ops::attention::prefill_splits(t, hq / hkv, hkv, pos, sms, max);
            let name = format!("attention split-KV Hq={hq} Hkv={hkv} D={d} gate={gate} pos={pos} T={t} nsplit={nsplit}");
            let same = outs[0].iter().zip(&outs[2]).all(|(a, b)| a.to_bits() == b.to_bits());
            println!("PARITY {} {name}: bitwise reproducible", if same { "PASS" } else { "FAIL" });
            assert!(same, "{name}: two runs differ");
            if i == 0 {
                // The cached prefix: the CPU only stores its keys and values.
                cpu_append_kv(&mut cs, sc, &dims, &kn, &k, &v);
                report(&format!("{name} vs plain kernel"), rel_l2(&outs[0], &outs[1]), 5e-3);
            } else {
                assert!(nsplit > 1, "{name}: the case does not take the split-KV path on {sms} SMs");
                let (cq, ck, cv) = (CpuTensor::from_vec(t, qw, q), CpuTensor::from_vec(t, hkv * d, k), CpuTensor::from_vec(t, hkv * d, v));
                let ci = AttentionInputs::<CpuBackend> { q_gate: &cq, k: &ck, v: &cv, q_norm: &cqn, k_norm: &ckn };
                let co = c.attention(ci, &dims, 1e-6, 0, &BatchLayout::single(sc, pos, t), &mut cs).unwrap();
                report(&format!("{name} (plain kernel: rel_err {:.3e})", rel_l2(&outs[1], &co.data)), rel_l2(&outs[0], &co.data), 1.5e-2);
                // bf16 probabilities scaled by each split's own maximum instead of the running one:
                // ~2e-3 apart, as far as either is from the f32 reference.
                report(&format!("{name} vs plain kernel"), rel_l2(&outs[0], &outs[1]), 5e-3);
            }
            pos += t;
        }
    }
}

struct GdnCase {
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_chunked_and_decode() {
    let g = gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(4);
    let cases = [
        GdnCase { hk: 16, hv: 32, dk: 128, dv: 128 },
        GdnCase { hk: 3, hv: 6, dk: 32, dv: 48 },
        GdnCase { hk: 2, hv: 4, dk: 64, dv: 32 },
        GdnCase { hk: 1, hv: 1, dk: 32, dv: 32 },
    ];
    let schedules: [&[usize]; 5] = [&[1, 1, 1], &[63, 1, 1], &[64, 65], &[127, 2, 1], &[4097, 1]];
    for cs_ in &cases {
        let cfg = config(64, 64, 1, (2, 1, 64), (cs_.hk, cs_.hv, cs_.dk, cs_.dv), (4, 2, 64, 0), 1000);
        let dims = cfg.deltanet.clone();
        let (cdim, kc, hv, dv) = (dims.conv_dim(), dims.conv_kernel, dims.num_v_heads, dims.v_head_dim);
        let conv = rng.vec(cdim * kc, 0.5);
        let a_log: Vec<f32> = (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect();
        let dt = rng.vec(hv, 0.5);
        let nw: Vec<f32> = rng.vec(dv, 0.2).iter().map(|x| 1.0 + x).collect();
        let cv = [
            c.upload_vector(&conv).unwrap(),
            c.upload_vector(&a_log).unwrap(),
            c.upload_vector(&dt).unwrap(),
            c.upload_vector(&nw).unwrap(),
        ];
        let gv = [
            g.upload_vector(&conv).unwrap(),
            g.upload_vector(&a_log).unwrap(),
            g.upload_vector(&dt).unwrap(),
            g.upload_vector(&nw).unwrap(),
        ];
        for sched in schedules {
            let opts = StateOptions::new(1, 8192);
            let mut cst = c.new_state(&cfg, opts).unwrap();
            let mut gst = g.new_state(&cfg, opts).unwrap();
            let (sc, sg) = (cst.alloc().unwrap(), gst.alloc().unwrap());
            let mut pos = 0;
            for &t in sched {
                let (ct, gt) = gdn_step_inputs(&g, &mut rng, t, cdim, hv * dv, hv);
                let ci = gdn_inputs::<CpuBackend>(&ct, &cv);
                let gi = gdn_inputs::<CudaBackend>(&gt, &gv);
                let co = c.deltanet(ci, &dims, 1e-6, 0, &BatchLayout::single(sc, pos, t), &mut cst).unwrap();
                let go = g.deltanet(gi, &dims, 1e-6, 0, &BatchLayout::single(sg, pos, t), &mut gst).unwrap();
                report(
                    &format!("deltanet Hk={} Hv={} dk={} dv={} pos={pos} T={t}", cs_.hk, cs_.hv, cs_.dk, cs_.dv),
                    rel_l2(&host(&g, &go), &co.data),
                    2e-3,
                );
                pos += t;
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_chunked_prefill_equals_token_by_token() {
    let g = gpu();
    let mut rng = Rng::new(5);
    let cfg = config(64, 64, 1, (2, 1, 64), (16, 32, 128, 128), (4, 2, 64, 0), 1000);
    let dims = cfg.deltanet.clone();
    let (cdim, kc, hv, dv) = (dims.conv_dim(), dims.conv_kernel, dims.num_v_heads, dims.v_head_dim);
    let vecs = [rng.vec(cdim * kc, 0.5), (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(), rng.vec(hv, 0.5), vec![1.0; dv]];
    let gv: Vec<_> = vecs.iter().map(|v| g.upload_vector(v).unwrap()).collect();
    let t = 130;
    let (qkv, z, b, a) = (rng.vec(t * cdim, 1.0), rng.vec(t * hv * dv, 2.0), rng.vec(t * hv, 2.0), rng.vec(t * hv, 2.0));
    let opts = StateOptions::new(2, 512);
    let mut st = g.new_state(&cfg, opts).unwrap();
    let (s0, s1) = (st.alloc().unwrap(), st.alloc().unwrap());
    let run = |st: &mut orchid_cuda::CudaState, slot: usize, lo: usize, hi: usize| {
        let n = hi - lo;
        let gt = [
            up(&g, n, cdim, &qkv[lo * cdim..hi * cdim]),
            up(&g, n, hv * dv, &z[lo * hv * dv..hi * hv * dv]),
            up(&g, n, hv, &b[lo * hv..hi * hv]),
            up(&g, n, hv, &a[lo * hv..hi * hv]),
        ];
        host(&g, &g.deltanet(gdn_inputs(&gt, &gv), &dims, 1e-6, 0, &BatchLayout::single(slot, lo, n), st).unwrap())
    };
    let full = run(&mut st, s0, 0, t);
    let mut steps = Vec::new();
    for i in 0..t {
        steps.extend(run(&mut st, s1, i, i + 1));
    }
    report("deltanet chunked(130) == 130 decode steps", rel_l2(&full, &steps), 2e-3);
    // And the states agree: one more token from each.
    let n0 = run(&mut st, s0, 0, 1);
    let n1 = run(&mut st, s1, 0, 1);
    report("deltanet state after chunked == after decode", rel_l2(&n0, &n1), 2e-3);
}

/// The chunk scan on tensor cores (3xTF32, `gdn_chunk_scan_tc`) against the f32 FMA scan: outputs
/// of a 130-token and a 4,097-token span (two prep + scan pieces, a partial last chunk) and the
/// state after them (one more token each), for the 35B's GDN shape and a small one. 3xTF32 keeps
/// about f32 precision: relative L2 within 1e-5 (a single TF32 product would be ~1e-3).
#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_scan_tensor_cores_match_fma() {
    let g = gpu();
    let fma = g.with_tuning(&orchid_cuda::Tuning { gdn_scan_tc: false, ..Default::default() }).unwrap();
    let mut rng = Rng::new(6);
    for (hk, hv, dk, dv) in [(16, 32, 128, 128), (2, 4, 64, 32)] {
        let cfg = config(64, 64, 1, (2, 1, 64), (hk, hv, dk, dv), (4, 2, 64, 0), 1000);
        let dims = cfg.deltanet.clone();
        let (cdim, kc) = (dims.conv_dim(), dims.conv_kernel);
        let vecs =
            [rng.vec(cdim * kc, 0.5), (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(), rng.vec(hv, 0.5), vec![1.0; dv]];
        let gv: Vec<_> = vecs.iter().map(|v| g.upload_vector(v).unwrap()).collect();
        for t in [130, 4097] {
            let n1 = t + 1;
            let (qkv, z, b, a) = (rng.vec(n1 * cdim, 1.0), rng.vec(n1 * hv * dv, 2.0), rng.vec(n1 * hv, 2.0), rng.vec(n1 * hv, 2.0));
            // Tokens 0..t as one span, then token t (its output reads the state the span left).
            let run = |be: &CudaBackend| {
                let mut st = be.new_state(&cfg, StateOptions::new(1, 8192)).unwrap();
                let slot = st.alloc().unwrap();
                [(0, t), (t, n1)].map(|(lo, hi)| {
                    let r = |v: &[f32], w: usize| up(be, hi - lo, w, &v[lo * w..hi * w]);
                    let gt = [r(&qkv, cdim), r(&z, hv * dv), r(&b, hv), r(&a, hv)];
                    let o = be.deltanet(gdn_inputs(&gt, &gv), &dims, 1e-6, 0, &BatchLayout::single(slot, lo, hi - lo), &mut st);
                    host(be, &o.unwrap())
                })
            };
            let (tc, f) = (run(&g), run(&fma));
            let name = format!("deltanet scan tensor cores == FMA Hv={hv} dk={dk} dv={dv} T={t}");
            report(&name, rel_l2(&tc[0], &f[0]), 1e-5);
            report(&format!("{name}, the state after"), rel_l2(&tc[1], &f[1]), 1e-5);
        }
    }
}

/// Layer 0 of a slot's GDN state as bits: both conv buffers, then the recurrent state.
fn slot_bits(g: &CudaBackend, st: &orchid_cuda::CudaState, slot: usize) -> Vec<u32> {
    use orchid_cuda::driver::{DevBuf, copy_d2d};
    let (conv, rec) = (2 * st.conv_len * 4, st.rec_len * 4);
    let buf = DevBuf::alloc(g.gpu(), conv + rec).unwrap();
    copy_d2d(g.gpu(), buf.ptr, st.conv_ptr(slot, 0), conv).unwrap();
    copy_d2d(g.gpu(), buf.ptr + conv as u64, st.rec_ptr(slot, 0), rec).unwrap();
    let mut v = vec![0u32; (conv + rec) / 4];
    buf.download(0, bytemuck::cast_slice_mut(&mut v)).unwrap();
    v
}

fn to_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Positions where two bit patterns differ, a length difference counting as that many.
fn differing(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

/// A snapshot captured inside a prefill span (`StatePool::capture_at`): the scan of the span runs
/// in launches that stop at each capture's chunk (a copy of the state between them), then goes on.
/// Checked bit for bit, for the 35B's GDN shape and a small one: (1) outputs and final conv and
/// recurrent states equal those of the same span without captures (the scan split at inner chunks
/// == the unsplit scan); (2) the outputs equal those of passes split at the captures (every GDN
/// kernel of a span computes each row or chunk on its own, the chunks counted from the span's
/// start); (3) each captured snapshot, restored, equals the one `save` takes after a pass ending
/// at its position: the recurrent state after the same chunks (f32 in memory between launches,
/// the same arithmetic per chunk), both conv buffers as the split pass leaves them (the one it
/// writes holds the inputs of the last KC−1 positions, copied). The small shape runs a span past
/// CHUNK_SPAN_MAX (two prep + scan pieces) with a capture at the pieces' boundary and one inside
/// the second piece; the 35B shape's capturing pass has another sequence's span before it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_capture_inside_a_span() {
    use orchid_model::batch::SeqSpan;
    let g = gpu();
    let mut rng = Rng::new(11);
    // (shape, prompt length, first pass, captures, another span in the capturing pass)
    let cases = [
        (GdnCase { hk: 16, hv: 32, dk: 128, dv: 128 }, 300, 64, vec![128, 192, 256], true),
        (GdnCase { hk: 3, hv: 6, dk: 32, dv: 48 }, 4288, 0, vec![128, 4096, 4160], false),
    ];
    for (cs_, t, first, points, mate) in cases {
        let cfg = config(64, 64, 1, (2, 1, 64), (cs_.hk, cs_.hv, cs_.dk, cs_.dv), (4, 2, 64, 0), 1000);
        let dims = cfg.deltanet.clone();
        let (cdim, kc, hv, dv) = (dims.conv_dim(), dims.conv_kernel, dims.num_v_heads, dims.v_head_dim);
        let vecs = [rng.vec(cdim * kc, 0.5), (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(), rng.vec(hv, 0.5), {
            rng.vec(dv, 0.2).iter().map(|x| 1.0 + x).collect()
        }];
        let gv: Vec<_> = vecs.iter().map(|v| g.upload_vector(v).unwrap()).collect();
        // Per-token inputs of the prompt and of the other sequence: qkv, z, b, a.
        let mut inputs = |n: usize| [rng.vec(n * cdim, 1.0), rng.vec(n * hv * dv, 2.0), rng.vec(n * hv, 2.0), rng.vec(n * hv, 2.0)];
        let (xs, other) = (inputs(t), inputs(100));
        let widths = [cdim, hv * dv, hv, hv];
        // One forward call of the layer over spans (slot, start, end, inputs); the output rows.
        let fwd = |st: &mut orchid_cuda::CudaState, spans: &[(usize, usize, usize, &[Vec<f32>; 4])]| -> Vec<f32> {
            let gt: [CudaTensor; 4] = std::array::from_fn(|i| {
                let rows: usize = spans.iter().map(|s| s.2 - s.1).sum();
                let v: Vec<f32> = spans.iter().flat_map(|s| s.3[i][s.1 * widths[i]..s.2 * widths[i]].to_vec()).collect();
                up(&g, rows, widths[i], &v)
            });
            let batch = BatchLayout { spans: spans.iter().map(|s| SeqSpan { slot: s.0, start: s.1, len: s.2 - s.1 }).collect() };
            host(&g, &g.deltanet(gdn_inputs(&gt, &gv), &dims, 1e-6, 0, &batch, st).unwrap())
        };
        let name = format!("deltanet capture Hv={hv} dk={} dv={dv} T={t} at {points:?}", cs_.dk);
        let mut st = g.new_state(&cfg, StateOptions::new(6, 8192)).unwrap();
        let slots: Vec<usize> = (0..6).map(|_| st.alloc().unwrap()).collect();
        let (o, a, b, c, d, e) = (slots[0], slots[1], slots[2], slots[3], slots[4], slots[5]);
        // a: one pass over [first, t) capturing at `points`; b: the same without captures.
        let mut tail = [Vec::new(), Vec::new()];
        for (k, slot) in [a, b].into_iter().enumerate() {
            if first > 0 {
                fwd(&mut st, &[(slot, 0, first, &xs)]);
            }
            if slot == a {
                for &p in points.iter().rev() {
                    st.capture_at(slot, p).unwrap();
                }
            }
            let out = if mate && slot == a {
                let both = fwd(&mut st, &[(o, 0, 100, &other), (slot, first, t, &xs)]);
                both[100 * hv * dv..].to_vec()
            } else {
                fwd(&mut st, &[(slot, first, t, &xs)])
            };
            tail[k] = to_bits(&out);
        }
        let caps = st.take_captures(a).unwrap();
        assert_eq!(caps.iter().map(|c| c.0).collect::<Vec<_>>(), points, "{name}: captured positions");
        report(&format!("{name}: outputs vs no capture, differing"), differing(&tail[0], &tail[1]) as f64, 0.0);
        report(
            &format!("{name}: final state vs no capture, differing"),
            differing(&slot_bits(&g, &st, a), &slot_bits(&g, &st, b)) as f64,
            0.0,
        );
        // c: passes split at the captures, a snapshot saved after each.
        let mut split = Vec::new();
        let mut saved = Vec::new();
        if first > 0 {
            fwd(&mut st, &[(c, 0, first, &xs)]);
        }
        let mut lo = first;
        for &hi in points.iter().chain([&t]) {
            split.extend(fwd(&mut st, &[(c, lo, hi, &xs)]));
            if hi < t {
                saved.push(st.save(c, hi).unwrap());
            }
            lo = hi;
        }
        report(&format!("{name}: outputs vs split passes, differing"), differing(&to_bits(&split), &tail[1]) as f64, 0.0);
        for ((at, cap), snap) in caps.into_iter().zip(saved) {
            st.restore(d, &cap).unwrap();
            st.restore(e, &snap).unwrap();
            let n = differing(&slot_bits(&g, &st, d), &slot_bits(&g, &st, e));
            report(&format!("{name}: snapshot at {at} vs saved after a pass ending there, differing"), n as f64, 0.0);
            for (s, snap) in [(d, cap), (e, snap)] {
                st.release(snap);
                st.free(s);
                assert_eq!(st.alloc(), Some(s));
            }
        }
    }
}

/// A span (slot, sequence, from, to) of one forward call in the spans-vs-alone tests.
type Span = (usize, usize, usize, usize);

/// Each of `seqs` ((first pass, span) per sequence) on two fresh slots of `st`: its first pass
/// alone on both, then its span in one call `fwd` with the others' (first slots) and alone
/// (second slots). Reports each sequence's outputs (rows of `width` floats) against its span
/// alone, bitwise, then runs `more(name, state, its slot together, its slot alone)`.
fn spans_vs_alone(
    st: &mut orchid_cuda::CudaState,
    seqs: &[(usize, usize)],
    width: usize,
    what: &str,
    fwd: impl Fn(&mut orchid_cuda::CudaState, &[Span]) -> Vec<f32>,
    more: impl Fn(&str, &orchid_cuda::CudaState, usize, usize),
) {
    let n = seqs.len();
    let slots: Vec<usize> = (0..2 * n).map(|_| st.alloc().unwrap()).collect();
    let (together, alone) = slots.split_at(n);
    for (i, &(p, _)) in seqs.iter().enumerate() {
        if p > 0 {
            fwd(st, &[(together[i], i, 0, p)]);
            fwd(st, &[(alone[i], i, 0, p)]);
        }
    }
    let spans: Vec<Span> = seqs.iter().enumerate().map(|(i, &(p, t))| (together[i], i, p, p + t)).collect();
    let out = fwd(st, &spans);
    let mut row = 0;
    for (i, &(p, t)) in seqs.iter().enumerate() {
        let solo = fwd(st, &[(alone[i], i, p, p + t)]);
        let mine = &out[row * width..(row + t) * width];
        row += t;
        let name = format!("{what}: sequence {i} ({p} + {t})");
        assert!(mine.iter().all(|x| x.is_finite()), "{name}: non-finite output");
        report(&format!("{name}: outputs vs alone, differing"), differing(&to_bits(mine), &to_bits(&solo)) as f64, 0.0);
        more(&name, st, together[i], alone[i]);
    }
}

/// Several sequences' spans in one forward call of a GDN layer (the conv in one launch, the chunk
/// prep and scan in groups of at most CHUNK_SPAN_MAX tokens, the per-token kernels per run of
/// adjacent spans) against each span in a call of its own: outputs, recurrent and conv states
/// bit-identical. Spans of 2 to 4,100 tokens from even and odd positions after a first pass, a
/// one-token span between them (the decode kernel, splitting the runs), groups that overflow
/// CHUNK_SPAN_MAX, and a span longer than it (prep and scan alone, in pieces).
#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_spans_in_one_call_equal_alone() {
    use orchid_model::batch::SeqSpan;
    let g = gpu();
    let mut rng = Rng::new(21);
    let shapes = [GdnCase { hk: 16, hv: 32, dk: 128, dv: 128 }, GdnCase { hk: 3, hv: 6, dk: 32, dv: 48 }];
    // (first pass, span) per sequence.
    let seqs: [(usize, usize); 8] = [(0, 512), (37, 130), (64, 1), (5, 2), (0, 3000), (1, 700), (0, 4100), (12, 64)];
    for cs_ in shapes {
        let cfg = config(64, 64, 1, (2, 1, 64), (cs_.hk, cs_.hv, cs_.dk, cs_.dv), (4, 2, 64, 0), 1000);
        let dims = cfg.deltanet.clone();
        let (cdim, kc, hv, dv) = (dims.conv_dim(), dims.conv_kernel, dims.num_v_heads, dims.v_head_dim);
        let vecs = [rng.vec(cdim * kc, 0.5), (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(), rng.vec(hv, 0.5), {
            rng.vec(dv, 0.2).iter().map(|x| 1.0 + x).collect()
        }];
        let gv: Vec<_> = vecs.iter().map(|v| g.upload_vector(v).unwrap()).collect();
        let widths = [cdim, hv * dv, hv, hv];
        let inputs: Vec<[Vec<f32>; 4]> =
            seqs.iter().map(|&(p, t)| std::array::from_fn(|i| rng.vec((p + t) * widths[i], [1.0, 2.0, 2.0, 2.0][i]))).collect();
        // One forward call over spans (slot, sequence, from, to); the output rows.
        let fwd = |st: &mut orchid_cuda::CudaState, spans: &[Span]| -> Vec<f32> {
            let gt: [CudaTensor; 4] = std::array::from_fn(|i| {
                let rows: usize = spans.iter().map(|s| s.3 - s.2).sum();
                let v: Vec<f32> = spans.iter().flat_map(|s| inputs[s.1][i][s.2 * widths[i]..s.3 * widths[i]].to_vec()).collect();
                up(&g, rows, widths[i], &v)
            });
            let batch = BatchLayout { spans: spans.iter().map(|s| SeqSpan { slot: s.0, start: s.2, len: s.3 - s.2 }).collect() };
            host(&g, &g.deltanet(gdn_inputs(&gt, &gv), &dims, 1e-6, 0, &batch, st).unwrap())
        };
        let mut st = g.new_state(&cfg, StateOptions::new(2 * seqs.len(), 16384)).unwrap();
        let what = format!("deltanet spans in one call Hv={hv} dk={} dv={dv}", cs_.dk);
        spans_vs_alone(&mut st, &seqs, hv * dv, &what, fwd, |name, st, a, b| {
            report(
                &format!("{name}: conv and recurrent state vs alone, differing"),
                differing(&slot_bits(&g, st, a), &slot_bits(&g, st, b)) as f64,
                0.0,
            );
        });
    }
}

/// The two batched decode kernels (`RowsKernel::Blocks`, `Stream`) on the same random states and
/// inputs: 1, 3, 16 and 64 rows with slots out of order, padding rows (slot −1) and positions of
/// both parities, in a state layout of two layers per slot. On sm_90+ the outputs, the recurrent
/// states and the conv states must be bit-identical (the same arithmetic per element); before
/// sm_90 the block-per-row kernel normalises in a separate kernel (another summation order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_decode_rows_stream_equals_blocks() {
    use orchid_cuda::driver::DevBuf;
    use orchid_cuda::ops::deltanet::{self as dn, RowsKernel};
    let g = gpu();
    let gp = g.gpu();
    gp.bind().unwrap();
    let mut rng = Rng::new(9);
    let download = |b: &DevBuf| {
        let mut v = vec![0f32; b.bytes / 4];
        b.download(0, bytemuck::cast_slice_mut(&mut v)).unwrap();
        v
    };
    for cs in [GdnCase { hk: 16, hv: 32, dk: 128, dv: 128 }, GdnCase { hk: 3, hv: 6, dk: 32, dv: 48 }] {
        let (hk, hv, dk, dv, kc) = (cs.hk, cs.hv, cs.dk, cs.dv, 4);
        let cdim = 2 * hk * dk + hv * dv;
        let (conv_len, rec_len) = ((kc - 1) * cdim, hv * dk * dv);
        let w = [rng.vec(cdim * kc, 0.5), (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(), rng.vec(hv, 0.5), {
            rng.vec(dv, 0.2).iter().map(|x| 1.0 + x).collect()
        }];
        let wb: Vec<DevBuf> = w.iter().map(|v| DevBuf::from_slice(gp, v).unwrap()).collect();
        for rows in [1usize, 3, 16, 64] {
            let nslots = rows + 3;
            let mut slots: Vec<i32> = (0..nslots as i32).collect();
            for i in (1..nslots).rev() {
                slots.swap(i, rng.below(i + 1));
            }
            slots.truncate(rows);
            if rows > 1 {
                for i in (1..rows).step_by(4) {
                    slots[i] = -1;
                }
                slots[rows - 1] = -1;
            }
            let pos: Vec<i32> = (0..rows).map(|_| rng.below(1000) as i32).collect();
            let meta = DevBuf::from_slice(gp, &[slots.clone(), pos].concat()).unwrap();
            // Each slot holds two layers' states; the launch is for the second layer.
            let (conv_stride, rec_stride) = (2 * 2 * conv_len, 2 * rec_len);
            let conv0 = rng.vec(nslots * conv_stride, 1.0);
            let rec0 = rng.vec(nslots * rec_stride, 0.3);
            let (ldq, ldz, ldba, ldo) = (cdim + 3, hv * dv + 5, hv + 1, hv * dv + 4);
            let inp: Vec<DevBuf> =
                [rng.vec(rows * ldq, 1.0), rng.vec(rows * ldz, 2.0), rng.vec(rows * ldba, 2.0), rng.vec(rows * ldba, 2.0)]
                    .iter()
                    .map(|v| DevBuf::from_slice(gp, v).unwrap())
                    .collect();
            let run = |k: RowsKernel| {
                let conv = DevBuf::from_slice(gp, &conv0).unwrap();
                let rec = DevBuf::from_slice(gp, &rec0).unwrap();
                let out = DevBuf::from_slice(gp, &vec![f32::NAN; rows * ldo]).unwrap();
                let a = dn::GdnDecodeArgs {
                    qkv: inp[0].ptr,
                    z: inp[1].ptr,
                    b: inp[2].ptr,
                    a: inp[3].ptr,
                    conv_w: wb[0].ptr,
                    conv_state: conv.ptr + (2 * conv_len * 4) as u64,
                    a_log: wb[1].ptr,
                    dt_bias: wb[2].ptr,
                    norm_w: wb[3].ptr,
                    state: rec.ptr + (rec_len * 4) as u64,
                    out: out.ptr,
                    pos_ptr: meta.ptr + (rows * 4) as u64,
                    rows_slot: meta.ptr,
                    hk: hk as i32,
                    hv: hv as i32,
                    dk: dk as i32,
                    dv: dv as i32,
                    kc: kc as i32,
                    c: cdim as i32,
                    eps: 1e-6,
                    ld_qkv: ldq as i32,
                    ld_z: ldz as i32,
                    ld_ba: ldba as i32,
                    ld_out: ldo as i32,
                    conv_stride: conv_stride as i32,
                    rec_stride: rec_stride as i32,
                    ..Default::default()
                };
                dn::decode_rows_with(&g.ctx, &a, rows, k).unwrap();
                [download(&out), download(&conv), download(&rec)]
            };
            let old = run(RowsKernel::Blocks);
            let new = run(RowsKernel::Stream);
            let name = format!("deltanet decode rows: stream vs blocks Hv={hv} dk={dk} dv={dv} R={rows}");
            for (r, &slot) in slots.iter().enumerate() {
                let row = &new[0][r * ldo..r * ldo + hv * dv];
                assert!(slot >= 0 || row.iter().all(|&v| v == 0.0), "{name}: padding row {r} is not zero");
                assert!(row.iter().all(|v| v.is_finite()), "{name}: row {r} not written");
            }
            if gp.cc.0 >= 9 {
                let differing: usize =
                    old.iter().zip(&new).map(|(u, v)| u.iter().zip(v).filter(|(p, q)| p.to_bits() != q.to_bits()).count()).sum();
                report(&format!("{name}: values not bit-identical {differing}"), differing as f64, 0.0);
            } else {
                let cols = |o: &[f32]| (0..rows).flat_map(|r| o[r * ldo..r * ldo + hv * dv].to_vec()).collect::<Vec<f32>>();
                let err = rel_l2(&cols(&new[0]), &cols(&old[0])).max(rel_l2(&new[1], &old[1])).max(rel_l2(&new[2], &old[2]));
                report(&name, err, 1e-5);
            }
        }
    }
}

/// Batched decode through the backend (several one-token spans: one decode-rows launch, the
/// kernel the tuning picks) against the CPU: sequences prefilled to different lengths, then
/// decoded together with their slots out of order, then a subset of them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn deltanet_decode_rows_vs_cpu() {
    use orchid_model::batch::SeqSpan;
    let g = gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(10);
    for cs_ in [GdnCase { hk: 16, hv: 32, dk: 128, dv: 128 }, GdnCase { hk: 3, hv: 6, dk: 32, dv: 48 }] {
        let cfg = config(64, 64, 1, (2, 1, 64), (cs_.hk, cs_.hv, cs_.dk, cs_.dv), (4, 2, 64, 0), 1000);
        let dims = cfg.deltanet.clone();
        let (cdim, kc, hv, dv) = (dims.conv_dim(), dims.conv_kernel, dims.num_v_heads, dims.v_head_dim);
        let vecs = [rng.vec(cdim * kc, 0.5), (0..hv).map(|_| (1.0 + 7.5 * (rng.next() + 1.0)).ln()).collect(), rng.vec(hv, 0.5), {
            rng.vec(dv, 0.2).iter().map(|x| 1.0 + x).collect()
        }];
        let cv: Vec<_> = vecs.iter().map(|v| c.upload_vector(v).unwrap()).collect();
        let gv: Vec<_> = vecs.iter().map(|v| g.upload_vector(v).unwrap()).collect();
        let lens = [3usize, 70, 1, 9, 130];
        let opts = StateOptions::new(lens.len(), 512);
        let mut cst = c.new_state(&cfg, opts).unwrap();
        let mut gst = g.new_state(&cfg, opts).unwrap();
        // One forward call over spans (cpu slot, gpu slot, start, len) on both backends.
        let mut step =
            |spans: &[(usize, usize, usize, usize)], what: &str, cst: &mut orchid_cpu::CpuState, gst: &mut orchid_cuda::CudaState| {
                let t: usize = spans.iter().map(|s| s.3).sum();
                let (ct, gt) = gdn_step_inputs(&g, &mut rng, t, cdim, hv * dv, hv);
                let ci = gdn_inputs::<CpuBackend>(&ct, &cv);
                let gi = gdn_inputs::<CudaBackend>(&gt, &gv);
                let cb = BatchLayout { spans: spans.iter().map(|s| SeqSpan { slot: s.0, start: s.2, len: s.3 }).collect() };
                let gb = BatchLayout { spans: spans.iter().map(|s| SeqSpan { slot: s.1, start: s.2, len: s.3 }).collect() };
                let co = c.deltanet(ci, &dims, 1e-6, 0, &cb, cst).unwrap();
                let go = g.deltanet(gi, &dims, 1e-6, 0, &gb, gst).unwrap();
                report(
                    &format!("deltanet decode rows Hk={} Hv={hv} dk={} dv={dv}: {what}", cs_.hk, cs_.dk),
                    rel_l2(&host(&g, &go), &co.data),
                    2e-3,
                );
            };
        let mut seqs = Vec::new();
        for &len in &lens {
            let (sc, sg) = (cst.alloc().unwrap(), gst.alloc().unwrap());
            step(&[(sc, sg, 0, len)], &format!("prefill {len}"), &mut cst, &mut gst);
            seqs.push((sc, sg, len));
        }
        for k in 0..3 {
            let spans: Vec<_> = [3, 0, 4, 1, 2].iter().map(|&i| (seqs[i].0, seqs[i].1, seqs[i].2 + k, 1)).collect();
            step(&spans, &format!("5 rows, step {k}"), &mut cst, &mut gst);
        }
        let spans: Vec<_> = [4, 2].iter().map(|&i| (seqs[i].0, seqs[i].1, seqs[i].2 + 3, 1)).collect();
        step(&spans, "2 rows", &mut cst, &mut gst);
    }
}

/// The first `n` 4-byte words of a device buffer.
fn dev_words(b: &orchid_cuda::driver::DevBuf, n: usize) -> Vec<u32> {
    let mut v = vec![0u8; n * 4];
    b.download(0, &mut v).unwrap();
    v.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// What a routing wrote: the weights, the tile table (its used part), the tile count, and the
/// lists (`assign_tok`, `slot_pos`), as words.
type RoutedWords = (Vec<u32>, Vec<u32>, usize, Vec<u32>, Vec<u32>);

/// Runs `route` (`route_small` or `route_chain`) of the logits [t, e] at `logits` (top-k,
/// renormalised, tiles of `bn` tokens, the shared expert listed where `shared`) into fresh buffers.
#[allow(clippy::too_many_arguments)]
fn routed(
    g: &CudaBackend,
    route: fn(&orchid_cuda::ops::Ctx, &orchid_cuda::ops::moe::Routing) -> orchid_model::error::Result<()>,
    logits: u64,
    t: usize,
    e: usize,
    k: usize,
    bn: usize,
    shared: bool,
) -> RoutedWords {
    let listed = t * k + if shared { t } else { 0 };
    let max_tiles = listed.div_ceil(bn) + e + 1;
    let alloc = |words: usize| orchid_cuda::driver::DevBuf::zeros(&g.ctx.gpu, words * 4).unwrap();
    let (wts, tiles, num, at, sp) = (alloc(t * k), alloc(max_tiles * 4), alloc(1), alloc(listed), alloc(t * k));
    let r = orchid_cuda::ops::moe::Routing {
        logits,
        ldl: e,
        t,
        e,
        k,
        renorm: true,
        bn,
        wts: wts.ptr,
        tiles: tiles.ptr,
        num_tiles: num.ptr,
        assign_tok: at.ptr,
        slot_pos: sp.ptr,
        shared,
    };
    route(&g.ctx, &r).unwrap();
    let n = dev_words(&num, 1)[0] as usize;
    (dev_words(&wts, t * k), dev_words(&tiles, 4 * n.min(max_tiles)), n, dev_words(&at, listed), dev_words(&sp, t * k))
}

/// The two-launch routing of batched decode (`route_small`: top-k, then the lists in one block)
/// gives the bits of the prefill chain (top-k with counts, scan, scatter): routing weights, tile
/// table and lists, with ties in the logits and up to the full 1024 assignments. With the shared
/// expert listed, the same plus its tiles (expert E, every token) and list entries at the end.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_route_small_equals_chain() {
    use orchid_cuda::ops::moe as mo;
    let g = gpu();
    let mut rng = Rng::new(22);
    for &(e, k) in &[(256usize, 8usize), (512, 10), (16, 4)] {
        for &t in &[1usize, 9, 16, 33, 64, 102, 128, 256] {
            if t * k > mo::ROUTE_SMALL_MAX {
                continue;
            }
            // Coarse logits (multiples of 1/8): many ties, broken towards the lower id.
            let logits: Vec<f32> = rng.vec(t * e, 2.0).iter().map(|v| (v * 8.0).round() / 8.0).collect();
            let gl = up(&g, t, e, &logits);
            let bn = 32;
            let run = |small: bool, shared: bool| {
                routed(&g, if small { mo::route_small } else { mo::route_chain }, gl.ptr(), t, e, k, bn, shared)
            };
            let (a, b) = (run(true, false), run(false, false));
            let same = a == b && a.2 > 0;
            report(&format!("route_small = route_chain E={e} k={k} T={t}"), if same { 0.0 } else { f64::INFINITY }, 0.0);
            let s = run(true, true);
            let mut tiles = a.1.clone();
            let nt = t.div_ceil(bn);
            for i in 0..nt {
                tiles.extend([e, t * k + i * bn, bn.min(t - i * bn), 0].map(|v| v as u32));
            }
            let mut at = a.3.clone();
            at.extend(0..t as u32);
            let same = (s.0 == a.0, s.2 == a.2 + nt, s.4 == a.4) == (true, true, true) && s.1 == tiles && s.3 == at;
            report(&format!("route_small with the shared expert E={e} k={k} T={t}"), if same { 0.0 } else { f64::INFINITY }, 0.0);
        }
    }
}

/// The prefill routing chain over many scatter chunks (`SCATTER_CHUNK_TOKENS` tokens each, a block
/// per chunk) against the lists computed here: each token's top-k ids (the largest logits, ties
/// to the lower id), every expert's entries in ascending (token, slot) order at its offset, the
/// tile table in expert order, each (token, slot) pointing at its own entry.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_route_chain_lists_across_chunks() {
    use orchid_cuda::ops::moe as mo;
    let g = gpu();
    let mut rng = Rng::new(23);
    for &(e, k) in &[(256usize, 8usize), (512, 10)] {
        for &t in &[129usize, 255, 512, 1000, 4097, 8192] {
            // Each row a random order of e distinct logits 4/e apart (no near-ties).
            let logits: Vec<f32> = (0..t)
                .flat_map(|_| {
                    let mut row: Vec<f32> = (0..e).map(|i| i as f32 * 4.0 / e as f32 - 2.0).collect();
                    for i in (1..e).rev() {
                        row.swap(i, rng.below(i + 1));
                    }
                    row
                })
                .collect();
            let gl = up(&g, t, e, &logits);
            let bn = 64;
            let (_, tiles, n, at, sp) = routed(&g, mo::route_chain, gl.ptr(), t, e, k, bn, false);
            // Expected: ids per (token, slot), then the lists and tiles they imply.
            let ids: Vec<usize> = (0..t)
                .flat_map(|tk| {
                    let row = &logits[tk * e..(tk + 1) * e];
                    let mut order: Vec<usize> = (0..e).collect();
                    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                    order.into_iter().take(k)
                })
                .collect();
            let mut count = vec![0usize; e];
            ids.iter().for_each(|&x| count[x] += 1);
            let mut next: Vec<usize> = count.iter().scan(0, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect();
            let mut want_tiles = vec![];
            for (x, &c) in count.iter().enumerate() {
                for i in 0..c.div_ceil(bn) {
                    want_tiles.extend([x, next[x] + i * bn, bn.min(c - i * bn), 0].map(|v| v as u32));
                }
            }
            let (mut want_at, mut want_sp) = (vec![0u32; t * k], vec![0u32; t * k]);
            for (i, &x) in ids.iter().enumerate() {
                want_at[next[x]] = (i / k) as u32;
                want_sp[i] = next[x] as u32;
                next[x] += 1;
            }
            let same = n * 4 == want_tiles.len() && tiles == want_tiles && at == want_at && sp == want_sp;
            report(
                &format!("route_chain lists over {} chunks E={e} k={k} T={t}", t.div_ceil(mo::SCATTER_CHUNK_TOKENS)),
                if same { 0.0 } else { f64::INFINITY },
                0.0,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
#[allow(clippy::type_complexity)]
fn moe_routing_and_experts() {
    // The kernels' algebra on the exact form; the default rounded form against the CPU.
    let (g, rounded) = (exact_gpu(), gpu());
    // The shared expert through GEMMs of its own instead of listed in the grouped ones.
    let own = g.with_tuning(&orchid_cuda::Tuning { shared_grouped: false, ..exact() }).unwrap();
    // The experts' GEMMs without the 8-token tile (32 tokens at least).
    let wide = g.with_tuning(&orchid_cuda::Tuning { grouped_bn_min: 32, ..exact() }).unwrap();
    // The 64-token tiles on mma.sync instead of warpgroup MMA.
    let mma = g.with_tuning(&orchid_cuda::Tuning { gemm_wgmma: false, ..exact() }).unwrap();
    // The 8-token tiles' weights through the cp.async pipeline instead of straight into registers.
    let pipe = g.with_tuning(&orchid_cuda::Tuning { gemm_direct: false, ..exact() }).unwrap();
    // Every MoE block on the GEMM path preparing the next block's input in its combine.
    let fused = g.with_tuning(&orchid_cuda::Tuning { combine_norm_min: 0, ..exact() }).unwrap();
    let c = CpuBackend::new();
    let mut rng = Rng::new(6);
    // (E, k, H, I, Is, T list)
    let cases: [(usize, usize, usize, usize, usize, &[usize]); 3] = [
        (256, 8, 2048, 512, 512, &[1, 5, 63, 64, 65, 127]),
        (16, 4, 128, 64, 128, &[1, 8, 9, 63, 64, 65, 127, 513, 4097]),
        (12, 3, 256, 128, 0, &[1, 65]),
    ];
    for &(e, k, h, i, is, ts) in &cases {
        let cfg = config(64, h, 1, (2, 1, 64), (1, 1, 32, 32), (e, k, i, is), 1);
        let router = linear(&mut rng, e, h, Fmt::Hf, 8);
        let experts: Vec<HostMlp> = (0..e).map(|_| mlp(&mut rng, i, h, Fmt::Mlx, 4)).collect();
        let shared = (is > 0).then(|| mlp(&mut rng, is, h, Fmt::Mlx, 4));
        let sgate = (is > 0).then(|| linear(&mut rng, 1, h, Fmt::Hf, 8));
        let cw = MoeWeights::<CpuBackend> {
            router: c.upload_linear(&router).unwrap(),
            experts: c.upload_experts(&experts).unwrap(),
            shared: shared.as_ref().map(|m| orchid_model::backend::Mlp {
                gate_proj: c.upload_linear(&m.gate_proj).unwrap(),
                up_proj: c.upload_linear(&m.up_proj).unwrap(),
                down_proj: c.upload_linear(&m.down_proj).unwrap(),
            }),
            shared_gate: sgate.as_ref().map(|s| c.upload_linear(s).unwrap()),
        };
        let gw = MoeWeights::<CudaBackend> {
            router: g.upload_linear(&router).unwrap(),
            experts: g.upload_experts(&experts).unwrap(),
            shared: shared.as_ref().map(|m| orchid_model::backend::Mlp {
                gate_proj: g.upload_linear(&m.gate_proj).unwrap(),
                up_proj: g.upload_linear(&m.up_proj).unwrap(),
                down_proj: g.upload_linear(&m.down_proj).unwrap(),
            }),
            shared_gate: sgate.as_ref().map(|s| g.upload_linear(s).unwrap()),
        };
        for &t in ts {
            let x = rng.vec(t * h, 1.0);
            let co = c.moe(&CpuTensor::from_vec(t, h, round_bf16(&x)), &cw, &cfg.moe).unwrap();
            let go = host(&g, &g.moe(&up(&g, t, h, &x), &gw, &cfg.moe).unwrap());
            report(&format!("moe E={e} k={k} H={h} I={i} Is={is} T={t}"), rel_l2(&go, &co.data), 1e-2);
            let ro = host(&rounded, &rounded.moe(&up(&rounded, t, h, &x), &gw, &cfg.moe).unwrap());
            report(&format!("moe rounded prompt GEMMs E={e} k={k} H={h} I={i} Is={is} T={t}"), rel_l2(&ro, &co.data), 1e-2);
            // Only the shared expert's sums differ (one pass against split-K parts), and the
            // bf16 rounding of its activations where that moves them across a rounding step.
            let oo = host(&own, &own.moe(&up(&own, t, h, &x), &gw, &cfg.moe).unwrap());
            report(&format!("moe shared expert grouped vs own GEMMs E={e} k={k} Is={is} T={t}"), rel_l2(&go, &oo), 1e-4);
            // The token tile never changes a sum: the 8-token tile gives the 32-token one's bits.
            let wo = host(&wide, &wide.moe(&up(&wide, t, h, &x), &gw, &cfg.moe).unwrap());
            report_same(&format!("moe 8-token tiles = 32-token tiles E={e} k={k} T={t}"), &go, &wo);
            // Nor the tensor-core instruction (64-token tiles: warpgroup MMA on Hopper).
            let mo = host(&mma, &mma.moe(&up(&mma, t, h, &x), &gw, &cfg.moe).unwrap());
            report_same(&format!("moe wgmma = mma.sync E={e} k={k} T={t}"), &go, &mo);
            // Nor the weights' path into registers (8-token tiles: direct loads).
            let po = host(&pipe, &pipe.moe(&up(&pipe, t, h, &x), &gw, &cfg.moe).unwrap());
            report_same(&format!("moe direct weight loads = cp.async pipeline E={e} k={k} T={t}"), &go, &po);
            // The whole block (norm, experts, residual add) leaving the next block's input prepared
            // by its combine: the same residual rows and the same next projections as the next
            // block's own norm and preparation.
            let (nw, nn) = (g.upload_vector(&rng.vec(h, 1.0)).unwrap(), g.upload_vector(&rng.vec(h, 1.0)).unwrap());
            let proj = g.upload_linear(&linear(&mut rng, 96, h, Fmt::Mlx, 4)).unwrap();
            let block = |b: &CudaBackend, next: Option<&orchid_cuda::GpuVec>| {
                let mut xt = up(b, t, h, &x);
                b.moe_block(&mut xt, &nw, 1e-6, &gw, &cfg.moe, next).unwrap();
                let [p] = <[CudaTensor; 1]>::try_from(b.norm_matmuls(&xt, &nn, 1e-6, &[&proj]).unwrap()).ok().unwrap();
                (host(b, &xt), host(b, &p))
            };
            let ((xa, pa), (xb, pb)) = (block(&fused, Some(&nn)), block(&g, None));
            report_same(&format!("moe_block's prepared next input: residual E={e} k={k} T={t}"), &xa, &xb);
            report_same(&format!("moe_block's prepared next input: next projections E={e} k={k} T={t}"), &pa, &pb);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sampling_greedy_and_filters() {
    let g = gpu();
    let mut rng = Rng::new(7);
    // Greedy over a full vocabulary, with the maximum duplicated: the lower id wins.
    let v = 248320;
    let mut l = rng.vec(v, 4.0);
    l[123_456] = 9.0;
    l[200_001] = 9.0;
    let gl = up(&g, 1, v, &l);
    let tok = orchid_cuda::sample(&g, &gl, orchid_cuda::SampleParams::greedy(v), 0).unwrap();
    println!("PARITY {} sampling greedy: token {tok} (want 123456)", if tok == 123_456 { "PASS" } else { "FAIL" });
    assert_eq!(tok, 123_456);
    // `valid` masks the tail.
    let tok = orchid_cuda::sample(&g, &gl, orchid_cuda::SampleParams::greedy(100_000), 0).unwrap();
    let want = orchid_engine_argmax(&l[..100_000]);
    assert_eq!(tok as usize, want);
    // Filters: empirical frequencies against the exact filtered distribution.
    let n = 64;
    let logits = rng.vec(n, 2.0);
    let gl = up(&g, 1, n, &logits);
    for (temp, top_k, top_p, min_p) in
        [(1.0f32, 0usize, 1.0f32, 0.0f32), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 10, 0.8, 0.05)]
    {
        let p = orchid_cuda::SampleParams {
            temperature: temp,
            top_k: top_k as i32,
            top_p,
            min_p,
            seed: 42,
            valid: n as i32,
            ..Default::default()
        };
        let want = filtered(&logits, temp, top_k, top_p, min_p);
        let draws = 4000;
        let mut freq = vec![0f64; n];
        for s in 0..draws {
            freq[orchid_cuda::sample(&g, &gl, p, s).unwrap() as usize] += 1.0 / draws as f64;
        }
        let outside: f64 = freq.iter().zip(&want).filter(|(_, w)| **w == 0.0).map(|(f, _)| f).sum();
        let dev = freq.iter().zip(&want).map(|(f, w)| (f - w).abs()).fold(0.0, f64::max);
        let ok = outside == 0.0 && dev < 0.035;
        println!(
            "PARITY {} sampling T={temp} k={top_k} p={top_p} min_p={min_p}: max |freq - p| {dev:.3}, mass outside {outside}",
            if ok { "PASS" } else { "FAIL" }
        );
        assert!(ok);
        // Reproducible: same seed and step, same token.
        assert_eq!(orchid_cuda::sample(&g, &gl, p, 7).unwrap(), orchid_cuda::sample(&g, &gl, p, 7).unwrap());
    }
}

fn orchid_engine_argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// The CPU engine's sampling distribution (temperature, top-k, top-p, min-p), exactly.
fn filtered(l: &[f32], temp: f32, top_k: usize, top_p: f32, min_p: f32) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    if top_k > 0 {
        idx.truncate(top_k);
    }
    let m = l[idx[0]] as f64;
    let mut p: Vec<f64> = idx.iter().map(|&i| ((l[i] as f64 - m) / temp as f64).exp()).collect();
    let s: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= s);
    let mut keep = p.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (i, q) in p.iter().enumerate() {
            acc += q;
            if acc >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    if min_p > 0.0 {
        let floor = p[0] * min_p as f64;
        keep = keep.min(p.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    let mass: f64 = p[..keep].iter().sum();
    let mut out = vec![0.0; l.len()];
    for j in 0..keep {
        out[idx[j]] = p[j] / mass;
    }
    out
}
