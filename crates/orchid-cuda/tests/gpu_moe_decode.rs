//! Op-level parity of the batch-1 decode MoE kernels (kernels/moe_decode.cu, launched by
//! ops/moe_decode.rs): RMSNorm on load, routing (the fused `moe_route_up_q4`, or the router
//! matvec's top-k epilogue then `moe_up_*`), gate/up of every routed and the shared expert, and
//! `moe_down_*` (weighted down projections added to the residual), on one random token and on
//! several (the batched decode's `*_rows` kernels, the router fused in `moe_route_up_rows_q4`),
//! against the CPU twin: orchid-cpu's RMSNorm then its MoE block (or MLP), on the bf16-rounded normalised
//! input (what the kernels feed the tensor cores). Relative L2 in f64, tolerance 1e-2 as the
//! op-level MoE test in gpu_ops (the expert activations are rounded to bf16 before the down
//! projection). `#[ignore]`d: needs a GPU (scripts/gpu-test.sh runs it with `--ignored`).

mod common;

use common::*;
use orchid_cpu::{CpuBackend, CpuTensor};
use orchid_cuda::CudaBackend;
use orchid_cuda::driver::DevBuf;
use orchid_cuda::ops::gemv::{ROUTER_KPARTS, RouteEpi, gemv};
use orchid_cuda::ops::moe_decode::{
    FusedRoute, MoeDecode, can_fuse_route, moe_down, moe_down_rows, moe_route_up, moe_route_up_rows, moe_up, moe_up_rows,
};
use orchid_model::backend::{Backend, Mlp, MoeWeights};
use orchid_model::weights::HostMlp;

/// Every launch synchronised, so that a fault names its kernel.
fn gpu() -> CudaBackend {
    gpu_with(orchid_cuda::CudaOptions { sync_check: true, ..options() })
}

fn download(b: &DevBuf, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    b.download(0, bytemuck::cast_slice_mut(&mut v)).unwrap();
    v
}

/// `t` tokens through the decode MoE of a layer with `e` experts, top-`k`, hidden `h`, expert
/// width `i`, shared expert width `is` (0: none); `fused`: the router inside `moe_route_up_q4`
/// (one token) or `moe_route_up_rows_q4`.
#[allow(clippy::too_many_arguments)]
fn moe_case(g: &CudaBackend, rng: &mut Rng, t: usize, e: usize, k: usize, h: usize, i: usize, is: usize, fmt: Fmt, fused: bool) {
    let c = CpuBackend::new();
    let cfg = config(64, h, 1, (2, 1, 64), (1, 1, 32, 32), (e, k, i, is), 1);
    let (eps, md) = (cfg.rms_norm_eps, &cfg.moe);
    let bits = if fmt == Fmt::Mlx { 4 } else { 16 };
    let router = linear(rng, e, h, Fmt::Hf, 8);
    let experts: Vec<HostMlp> = (0..e).map(|_| mlp(rng, i, h, fmt, bits)).collect();
    let shared = (is > 0).then(|| mlp(rng, is, h, fmt, bits));
    let sgate = (is > 0).then(|| linear(rng, 1, h, Fmt::Hf, 8));
    let x = rng.vec(t * h, 1.0);
    let nw: Vec<f32> = (0..h).map(|_| 1.0 + 0.2 * rng.next()).collect();
    let resid = rng.vec(t * h, 1.0);

    // CPU twin: RMSNorm, bf16 rounding, the MoE block.
    let xn = c.rms_norm(&CpuTensor::from_vec(t, h, x.clone()), &c.upload_vector(&nw).unwrap(), eps).unwrap();
    let xn = CpuTensor::from_vec(t, h, round_bf16(&c.to_host(&xn).unwrap()));
    let cw = MoeWeights::<CpuBackend> {
        router: c.upload_linear(&router).unwrap(),
        experts: c.upload_experts(&experts).unwrap(),
        shared: shared.as_ref().map(|m| Mlp {
            gate_proj: c.upload_linear(&m.gate_proj).unwrap(),
            up_proj: c.upload_linear(&m.up_proj).unwrap(),
            down_proj: c.upload_linear(&m.down_proj).unwrap(),
        }),
        shared_gate: sgate.as_ref().map(|s| c.upload_linear(s).unwrap()),
    };
    let want = c.to_host(&c.moe(&xn, &cw, md).unwrap()).unwrap();

    // GPU: the decode kernels, the residual in `out`.
    g.gpu().bind().unwrap();
    let gpu = g.gpu();
    let (rg, ge) = (g.upload_linear(&router).unwrap(), g.upload_experts(&experts).unwrap());
    let gs = shared.as_ref().map(|m| [&m.gate_proj, &m.up_proj, &m.down_proj].map(|w| g.upload_linear(w).unwrap()));
    let gsg = sgate.as_ref().map(|s| g.upload_linear(s).unwrap());
    let nwg = g.upload_vector(&nw).unwrap();
    let xb = DevBuf::from_slice(gpu, &x).unwrap();
    let out = DevBuf::from_slice(gpu, &resid).unwrap();
    let hbuf = DevBuf::zeros(gpu, t * (k + 1) * i.max(is) * 4).unwrap();
    let ids = DevBuf::zeros(gpu, t * k * 4).unwrap();
    let wts = DevBuf::zeros(gpu, t * (k + 1) * 4).unwrap();
    let partial = DevBuf::zeros(gpu, t * ROUTER_KPARTS * (e + 1) * 4).unwrap();
    let barrier = DevBuf::zeros(gpu, 8 * t).unwrap();
    let counter = DevBuf::zeros(gpu, 4).unwrap();
    let logits = DevBuf::zeros(gpu, t * (e + 1) * 4).unwrap();
    let m = MoeDecode {
        gate: Some(&ge.gate),
        up: Some(&ge.up),
        down: Some(&ge.down),
        sh_gate: gs.as_ref().map(|s| &s[0]),
        sh_up: gs.as_ref().map(|s| &s[1]),
        sh_down: gs.as_ref().map(|s| &s[2]),
        topk: k,
    };
    let ctx = &*g.ctx;
    let norm = (nwg.buf.ptr, eps);
    let fr = FusedRoute {
        router: &rg,
        shared_gate: gsg.as_ref(),
        e,
        renorm: md.norm_topk_prob,
        partial: partial.ptr,
        barrier: barrier.ptr,
        wts: wts.ptr,
    };
    if fused {
        assert!(can_fuse_route(ctx, &m, &fr, t), "the fused router does not take this layer");
        if t == 1 {
            moe_route_up(ctx, &m, xb.ptr, norm, ids.ptr, hbuf.ptr, &fr).unwrap();
        } else {
            moe_route_up_rows(ctx, &m, xb.ptr, norm, ids.ptr, hbuf.ptr, &fr, t).unwrap();
        }
    } else {
        let route = RouteEpi {
            counter: counter.ptr,
            ids: ids.ptr,
            wts: wts.ptr,
            e,
            topk: k,
            renorm: md.norm_topk_prob,
            shared_col: gsg.as_ref().map(|_| e),
            partial: if t == 1 { partial.ptr } else { 0 },
        };
        let mut segs = vec![(&rg, 0)];
        if let Some(sg) = &gsg {
            segs.push((sg, e));
        }
        gemv(ctx, &segs, xb.ptr, h, t, Some(norm), logits.ptr, e + 1, false, Some(route)).unwrap();
        if t == 1 {
            moe_up(ctx, &m, xb.ptr, norm, ids.ptr, hbuf.ptr).unwrap();
        } else {
            moe_up_rows(ctx, &m, xb.ptr, norm, ids.ptr, hbuf.ptr, t).unwrap();
        }
    }
    if t == 1 {
        moe_down(ctx, &m, hbuf.ptr, wts.ptr, ids.ptr, out.ptr).unwrap();
    } else {
        moe_down_rows(ctx, &m, hbuf.ptr, wts.ptr, ids.ptr, out.ptr, t).unwrap();
    }
    let got: Vec<f32> = download(&out, t * h).iter().zip(&resid).map(|(o, r)| o - r).collect();
    let name = format!("decode moe T={t} E={e} top-{k} H={h} I={i} Is={is} {fmt:?}{}", if fused { " fused router" } else { "" });
    report(&name, rel_l2(&got, &want), 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_moe_kernels_match_the_cpu() {
    let g = gpu();
    let mut rng = Rng::new(11);
    // The 35B's shape (Q4 experts, bf16 router and shared gate): fused and unfused routing, one
    // token and the batched decode's 2-8 (the fused router's K parts shrink with the grid).
    for t in [1, 2, 3, 4, 8] {
        moe_case(&g, &mut rng, t, 256, 8, 2048, 512, 512, Fmt::Mlx, true);
        moe_case(&g, &mut rng, t, 256, 8, 2048, 512, 512, Fmt::Mlx, false);
    }
    // Small layers: too few expert blocks for the one-token fused router; no shared expert;
    // bf16 experts.
    moe_case(&g, &mut rng, 1, 16, 4, 128, 64, 128, Fmt::Mlx, false);
    moe_case(&g, &mut rng, 4, 16, 4, 128, 64, 128, Fmt::Mlx, true);
    moe_case(&g, &mut rng, 1, 64, 4, 256, 128, 0, Fmt::Mlx, false);
    moe_case(&g, &mut rng, 3, 64, 4, 256, 128, 0, Fmt::Mlx, true);
    moe_case(&g, &mut rng, 1, 12, 3, 256, 128, 64, Fmt::Hf, false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_dense_mlp_matches_the_cpu() {
    // A dense FFN runs as the "shared expert" alone (top-0), weighted by 1.
    let g = gpu();
    let c = CpuBackend::new();
    let mut rng = Rng::new(12);
    for (h, is, fmt) in [(256, 512, Fmt::Mlx), (128, 192, Fmt::Hf)] {
        let bits = if fmt == Fmt::Mlx { 4 } else { 16 };
        let w = mlp(&mut rng, is, h, fmt, bits);
        let x = rng.vec(h, 1.0);
        let nw: Vec<f32> = (0..h).map(|_| 1.0 + 0.2 * rng.next()).collect();
        let eps = 1e-6;
        let xn = c.rms_norm(&CpuTensor::from_vec(1, h, x.clone()), &c.upload_vector(&nw).unwrap(), eps).unwrap();
        let xn = CpuTensor::from_vec(1, h, round_bf16(&c.to_host(&xn).unwrap()));
        let [cg, cu, cd] = [&w.gate_proj, &w.up_proj, &w.down_proj].map(|l| c.upload_linear(l).unwrap());
        let hh = c.silu_mul(&c.matmul(&xn, &cg).unwrap(), &c.matmul(&xn, &cu).unwrap()).unwrap();
        let want = c.to_host(&c.matmul(&hh, &cd).unwrap()).unwrap();

        g.gpu().bind().unwrap();
        let gpu = g.gpu();
        let [gg, gu, gd] = [&w.gate_proj, &w.up_proj, &w.down_proj].map(|l| g.upload_linear(l).unwrap());
        let nwg = g.upload_vector(&nw).unwrap();
        let xb = DevBuf::from_slice(gpu, &x).unwrap();
        let out = DevBuf::zeros(gpu, h * 4).unwrap();
        let hbuf = DevBuf::zeros(gpu, is * 4).unwrap();
        let ids = DevBuf::zeros(gpu, 4).unwrap();
        let ones = DevBuf::from_slice(gpu, &[1.0f32, 1.0]).unwrap();
        let m = MoeDecode { gate: None, up: None, down: None, sh_gate: Some(&gg), sh_up: Some(&gu), sh_down: Some(&gd), topk: 0 };
        moe_up(&g.ctx, &m, xb.ptr, (nwg.buf.ptr, eps), ids.ptr, hbuf.ptr).unwrap();
        moe_down(&g.ctx, &m, hbuf.ptr, ones.ptr, ids.ptr, out.ptr).unwrap();
        report(&format!("decode dense MLP H={h} I={is} {fmt:?}"), rel_l2(&download(&out, h), &want), 1e-2);
    }
}
