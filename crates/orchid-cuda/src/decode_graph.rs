//! The decode fast path: one token of one sequence per step, every kernel of the step captured
//! once into a CUDA graph and replayed. Buffers are fixed; the position, the input token and the
//! step counter live on the device: the sampler writes the token into the next step's input and
//! advances the position, so a step needs no host data. The host only makes sure KV blocks exist
//! for the next position (an H2D update of the block table between steps) and reads the token.
//!
//! Per layer (see docs/cuda.md): GDN = qkv|z|b|a matvec (input norm fused on load) → fused GDN
//! decode → out_proj matvec (+ residual); attention = q|k|v matvec → split-K GQA decode with the
//! prep folded in (q/k norm, RoPE, cache append) → combine (+ gate) → o_proj (+ residual); MoE = router matvec
//! with top-k in its last block → all routed experts + shared expert gate/up (one kernel) →
//! down + weighted combine (+ residual). Then lm_head (final norm fused) and the sampler.

use std::sync::Arc;

use orchid_model::Model;
use orchid_model::error::{Error, Result};
use orchid_model::model::{Ffn, Mixer};

use crate::CudaBackend;
use crate::driver::{DevBuf, Graph};
use crate::ops::elementwise::embed;
use crate::ops::gemv::{ROUTER_KPARTS, RouteEpi, gemv};
use crate::ops::moe_decode::{FusedRoute, MoeDecode, can_fuse_route, moe_down, moe_route_up, moe_up};
use crate::ops::{Ctx, attention as at, deltanet as dn, sampling as sp};
use crate::state::{CudaState, KV_BLOCK};
use crate::weights::GpuLinear;

pub struct DecodeGraph {
    ctx: Arc<Ctx>,
    pub slot: usize,
    graph: Option<Graph>,
    x: DevBuf,
    proj: DevBuf,
    y: DevBuf,
    qbf: DevBuf,
    part_o: DevBuf,
    part_ml: DevBuf,
    router_logits: DevBuf,
    router_partial: DevBuf,
    route_ids: DevBuf,
    route_w: DevBuf,
    ones: DevBuf,
    counter: DevBuf,
    /// The fused router's grid barrier {arrived, departed} (kernels/moe_decode.cu route_phase).
    barrier: DevBuf,
    hbuf: DevBuf,
    logits: DevBuf,
    token: DevBuf,
    pos: DevBuf,
    step: DevBuf,
    params: DevBuf,
    partial: DevBuf,
    sample_counter: DevBuf,
    greedy: bool,
    vocab: usize,
    /// Host mirror of the device position (the next token's position).
    pub pos_host: usize,
    pub kernels_per_step: usize,
    /// Whether the step's kernels are chained by programmatic dependent launch (see `capture`).
    pub pdl: bool,
    /// Per-launch timing events when built with `profile` (see `profile_summary`).
    prof: Vec<(&'static str, crate::driver::Event)>,
}

fn gemv_groups(c: &Ctx, segs: &[(&GpuLinear, usize)], x: u64, norm: Option<(u64, f32)>, out: u64, ldo: usize, acc: bool) -> Result<usize> {
    // One launch per run of segments that share format and K.
    let ws: Vec<&GpuLinear> = segs.iter().map(|s| s.0).collect();
    let runs = crate::ops::gemv::gemv_groups(&ws);
    for run in &runs {
        gemv(c, &segs[run.clone()], x, 0, 1, norm, out, ldo, acc, None)?;
    }
    Ok(runs.len())
}

impl DecodeGraph {
    /// Builds the buffers for `slot` and captures one decode step.
    pub fn new(model: &Model<CudaBackend>, state: &mut CudaState, slot: usize, params: sp::SampleParams) -> Result<DecodeGraph> {
        Self::build(model, state, slot, params, false)
    }

    /// Like `new`, with a timing event after every kernel of the step (slightly slower).
    pub fn new_profiled(model: &Model<CudaBackend>, state: &mut CudaState, slot: usize, params: sp::SampleParams) -> Result<DecodeGraph> {
        Self::build(model, state, slot, params, true)
    }

    /// Time per kernel name over the last replayed step: (name, launches, ms), largest first.
    pub fn profile_summary(&self) -> Result<Vec<(&'static str, usize, f64)>> {
        crate::driver::profile_summary(&self.prof)
    }

    fn build(
        model: &Model<CudaBackend>,
        state: &mut CudaState,
        slot: usize,
        params: sp::SampleParams,
        profile: bool,
    ) -> Result<DecodeGraph> {
        let b = &model.backend;
        let ctx = b.ctx.clone();
        let gpu = ctx.gpu.clone();
        gpu.bind()?;
        state.slot(slot)?;
        let cfg = &model.config;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let a = &cfg.attention;
        let d = &cfg.deltanet;
        let m = &cfg.moe;
        let q_w = a.q_proj_rows() + 2 * a.kv_rows();
        let g_w = d.conv_dim() + d.value_dim() + 2 * d.num_v_heads;
        let proj_w = q_w.max(g_w).max(1);
        let y_w = (a.num_heads * a.head_dim).max(d.value_dim()).max(h);
        let nz = (a.num_heads / a.num_kv_heads).div_ceil(16);
        let hstride = m.intermediate.max(m.shared_intermediate).max(cfg.dense_intermediate).max(1);
        let nsrc = m.top_k + 1;
        let f32b = |n: usize| DevBuf::zeros(&gpu, n * 4);
        let greedy = params.temperature <= 0.0 || params.top_k == 1;
        let mut g = DecodeGraph {
            ctx: ctx.clone(),
            slot,
            graph: None,
            x: f32b(h)?,
            proj: f32b(proj_w)?,
            y: f32b(y_w)?,
            qbf: DevBuf::zeros(&gpu, a.num_heads * a.head_dim * 2)?,
            part_o: f32b(a.num_kv_heads * nz * ctx.tuning.attn_splits * 16 * a.head_dim)?,
            part_ml: f32b(a.num_kv_heads * nz * ctx.tuning.attn_splits * 16 * 2)?,
            router_logits: f32b(m.num_experts + 1)?,
            router_partial: f32b(ROUTER_KPARTS * (m.num_experts + 1))?,
            route_ids: f32b(m.top_k.max(1))?,
            route_w: f32b(m.top_k + 1)?,
            ones: DevBuf::from_slice(&gpu, &[1.0f32, 1.0])?,
            counter: f32b(1)?,
            barrier: f32b(2)?,
            hbuf: f32b(nsrc * hstride)?,
            logits: f32b(v)?,
            token: f32b(1)?,
            pos: f32b(1)?,
            step: f32b(1)?,
            params: DevBuf::from_slice(&gpu, &[params])?,
            partial: f32b(2 * sp::ARGMAX_BLOCKS)?,
            sample_counter: f32b(1)?,
            greedy,
            vocab: v,
            pos_host: 0,
            kernels_per_step: 0,
            pdl: false,
            prof: Vec::new(),
        };
        // Everything the capture needs must exist before it starts (no allocations inside).
        if cfg.num_attention_layers() > 0 {
            b.inv_freq(a.rope_theta, a.rotary_dim)?;
        }
        gpu.synchronize()?;
        // Programmatic dependent launch between the step's kernels (not with the per-kernel
        // timing events of a profiled graph); if the driver refuses it, capture without.
        let pdl = !profile && ctx.pdl;
        let (graph, launches, prof) = match g.capture(model, state, profile, pdl) {
            Ok(r) => r,
            Err(e) if pdl => {
                tracing::warn!("decode graph with programmatic dependent launch failed ({e}); capturing without it");
                g.pdl = false;
                g.capture(model, state, profile, false)?
            }
            Err(e) => return Err(e),
        };
        g.prof = prof;
        g.kernels_per_step = launches;
        tracing::debug!("decode graph: {launches} launches, {} nodes, pdl {}", graph.num_nodes(), g.pdl);
        g.graph = Some(graph);
        Ok(g)
    }

    #[allow(clippy::type_complexity)]
    fn capture(
        &mut self,
        model: &Model<CudaBackend>,
        state: &CudaState,
        profile: bool,
        pdl: bool,
    ) -> Result<(Graph, usize, Vec<(&'static str, crate::driver::Event)>)> {
        let gpu = self.ctx.gpu.clone();
        let mut launches = 0;
        let mut prof = Vec::new();
        self.pdl = pdl;
        let this = &*self;
        let graph = Graph::capture(&gpu, || {
            if profile {
                crate::driver::profile_begin_capture()?;
            }
            let r = this.enqueue(model, state);
            crate::driver::set_pdl(false);
            if profile {
                prof = crate::driver::profile_end();
            }
            launches = r?;
            Ok(())
        });
        crate::driver::set_pdl(false);
        Ok((graph?, launches, prof))
    }

    /// Enqueues one decode step on the stream; returns the number of launches. With `self.pdl`
    /// every launch after the first carries the programmatic-dependent-launch attribute.
    fn enqueue(&self, model: &Model<CudaBackend>, state: &CudaState) -> Result<usize> {
        let c = &*self.ctx;
        let cfg = &model.config;
        let eps = cfg.rms_norm_eps;
        let slot = self.slot;
        let mut n = 0;
        embed(c, &model.embed_tokens, self.token.ptr, self.x.ptr, 1)?;
        n += 1;
        crate::driver::set_pdl(self.pdl);
        for layer in &model.layers {
            let norm_in = Some((layer.input_layernorm.buf.ptr, eps));
            match &layer.mixer {
                Mixer::DeltaNet(dl) => {
                    let dd = &cfg.deltanet;
                    let (cdim, vd, hv) = (dd.conv_dim(), dd.value_dim(), dd.num_v_heads);
                    let segs = [(&dl.in_proj_qkv, 0), (&dl.in_proj_z, cdim), (&dl.in_proj_b, cdim + vd), (&dl.in_proj_a, cdim + vd + hv)];
                    n += gemv_groups(c, &segs, self.x.ptr, norm_in, self.proj.ptr, 0, false)?;
                    let p = self.proj.ptr;
                    n += dn::decode(
                        c,
                        &dn::GdnDecodeArgs {
                            qkv: p,
                            z: p + (cdim * 4) as u64,
                            b: p + ((cdim + vd) * 4) as u64,
                            a: p + ((cdim + vd + hv) * 4) as u64,
                            conv_w: dl.conv1d.buf.ptr,
                            conv_state: state.conv_ptr(slot, dl.state_index),
                            a_log: dl.a_log.buf.ptr,
                            dt_bias: dl.dt_bias.buf.ptr,
                            norm_w: dl.norm.buf.ptr,
                            state: state.rec_ptr(slot, dl.state_index),
                            out: self.y.ptr,
                            pos_ptr: self.pos.ptr,
                            hk: dd.num_k_heads as i32,
                            hv: hv as i32,
                            dk: dd.k_head_dim as i32,
                            dv: dd.v_head_dim as i32,
                            kc: dd.conv_kernel as i32,
                            c: cdim as i32,
                            pos: 0,
                            eps,
                            ..Default::default()
                        },
                    )?;
                    n += gemv_groups(c, &[(&dl.out_proj, 0)], self.y.ptr, None, self.x.ptr, 0, true)?;
                }
                Mixer::Attention(al) => {
                    let ad = &cfg.attention;
                    let (hq, hkv, dh) = (ad.num_heads, ad.num_kv_heads, ad.head_dim);
                    let qrows = ad.q_proj_rows();
                    let kv = ad.kv_rows();
                    let segs = [(&al.q_proj, 0), (&al.k_proj, qrows), (&al.v_proj, qrows + kv)];
                    n += gemv_groups(c, &segs, self.x.ptr, norm_in, self.proj.ptr, 0, false)?;
                    let inv = model.backend.inv_freq(ad.rope_theta, ad.rotary_dim)?;
                    let qstride = if ad.output_gate { 2 * dh } else { dh };
                    let pa = at::PrepArgs {
                        qg: self.proj.ptr,
                        k: self.proj.ptr + (qrows * 4) as u64,
                        v: self.proj.ptr + ((qrows + kv) * 4) as u64,
                        q_norm: al.q_norm.buf.ptr,
                        k_norm: al.k_norm.buf.ptr,
                        inv_freq: inv.ptr,
                        q_out: self.qbf.ptr,
                        kpool: state.kpool_ptr(al.cache_index),
                        vpool: state.vpool_ptr(al.cache_index),
                        table: state.table_ptr(slot),
                        pos_ptr: self.pos.ptr,
                        t: 1,
                        start: 0,
                        hq: hq as i32,
                        hkv: hkv as i32,
                        d: dh as i32,
                        r: ad.rotary_dim as i32,
                        bs: KV_BLOCK as i32,
                        ldq: (hq * qstride) as i32,
                        qstride: qstride as i32,
                        ldk: kv as i32,
                        eps,
                        ..Default::default()
                    };
                    let aa = at::AttnArgs {
                        q: self.qbf.ptr,
                        kpool: pa.kpool,
                        vpool: pa.vpool,
                        table: pa.table,
                        gate: if ad.output_gate { self.proj.ptr } else { 0 },
                        out: self.y.ptr,
                        part_o: self.part_o.ptr,
                        part_ml: self.part_ml.ptr,
                        pos_ptr: self.pos.ptr,
                        t: 1,
                        start: 0,
                        hq: hq as i32,
                        hkv: hkv as i32,
                        g: (hq / hkv) as i32,
                        bs: KV_BLOCK as i32,
                        ldg: (hq * qstride) as i32,
                        nsplit: c.tuning.attn_splits as i32,
                        min_tiles: c.tuning.attn_min_tiles as i32,
                        scale_log2: std::f32::consts::LOG2_E / (dh as f32).sqrt(),
                        ..Default::default()
                    };
                    at::decode(c, &aa, dh, &pa)?; // q/k norm, RoPE and the cache append folded in
                    n += 2;
                    n += gemv_groups(c, &[(&al.o_proj, 0)], self.y.ptr, None, self.x.ptr, 0, true)?;
                }
            }
            let norm_post = (layer.post_attention_layernorm.buf.ptr, eps);
            match &layer.ffn {
                Ffn::Moe(w) => {
                    let md = &cfg.moe;
                    let e = md.num_experts;
                    let shared = w.shared.as_ref().zip(w.shared_gate.as_ref());
                    let route = |shared_col| RouteEpi {
                        counter: self.counter.ptr,
                        ids: self.route_ids.ptr,
                        wts: self.route_w.ptr,
                        e,
                        topk: md.top_k,
                        renorm: md.norm_topk_prob,
                        shared_col,
                        partial: self.router_partial.ptr,
                    };
                    let md2 = MoeDecode {
                        gate: Some(&w.experts.gate),
                        up: Some(&w.experts.up),
                        down: Some(&w.experts.down),
                        sh_gate: shared.map(|(s, _)| &s.gate_proj),
                        sh_up: shared.map(|(s, _)| &s.up_proj),
                        sh_down: shared.map(|(s, _)| &s.down_proj),
                        topk: md.top_k,
                    };
                    // Router and gate/up in one kernel where the layer allows (one kernel and the
                    // router's last-block tail less per MoE layer); else router matvec + moe_up.
                    let fused = FusedRoute {
                        router: &w.router,
                        shared_gate: shared.map(|(_, sg)| sg),
                        e,
                        renorm: md.norm_topk_prob,
                        partial: self.router_partial.ptr,
                        barrier: self.barrier.ptr,
                        wts: self.route_w.ptr,
                    };
                    if can_fuse_route(c, &md2, &fused) {
                        moe_route_up(c, &md2, self.x.ptr, norm_post, self.route_ids.ptr, self.hbuf.ptr, &fused)?;
                        n += 1;
                    } else {
                        // The router matvec (normalised on load) into router_logits, E + 1 wide.
                        let router = |segs: &[(&GpuLinear, usize)], epi: Option<RouteEpi>| {
                            gemv(c, segs, self.x.ptr, 0, 1, Some(norm_post), self.router_logits.ptr, e + 1, false, epi)
                        };
                        match shared {
                            Some((_, sg)) if sg.fmt == w.router.fmt && sg.kpad == w.router.kpad => {
                                router(&[(&w.router, 0), (sg, e)], Some(route(Some(e))))?;
                                n += 1;
                            }
                            Some((_, sg)) => {
                                router(&[(sg, e)], None)?;
                                // The partials cover the router rows only; the shared-gate logit is already in place.
                                router(&[(&w.router, 0)], Some(RouteEpi { partial: 0, ..route(Some(e)) }))?;
                                n += 2;
                            }
                            None => {
                                router(&[(&w.router, 0)], Some(route(None)))?;
                                n += 1;
                            }
                        }
                        moe_up(c, &md2, self.x.ptr, norm_post, self.route_ids.ptr, self.hbuf.ptr)?;
                        n += 1;
                    }
                    moe_down(c, &md2, self.hbuf.ptr, self.route_w.ptr, self.route_ids.ptr, self.x.ptr)?;
                    n += 1;
                }
                Ffn::Dense(mlp) => {
                    let md2 = MoeDecode {
                        gate: None,
                        up: None,
                        down: None,
                        sh_gate: Some(&mlp.gate_proj),
                        sh_up: Some(&mlp.up_proj),
                        sh_down: Some(&mlp.down_proj),
                        topk: 0,
                    };
                    moe_up(c, &md2, self.x.ptr, norm_post, self.route_ids.ptr, self.hbuf.ptr)?;
                    moe_down(c, &md2, self.hbuf.ptr, self.ones.ptr, self.route_ids.ptr, self.x.ptr)?;
                    n += 2;
                }
            }
        }
        gemv(c, &[(&model.lm_head, 0)], self.x.ptr, 0, 1, Some((model.norm.buf.ptr, eps)), self.logits.ptr, 0, false, None)?;
        n += 1;
        self.sample_into(self.logits.ptr, true)?;
        Ok(n + 1)
    }

    /// Samples from `logits` into the input slot and advances the step counter; `advance_pos` also advances the device position (decode steps).
    fn sample_into(&self, logits: u64, advance_pos: bool) -> Result<()> {
        let a = sp::SampleArgs {
            logits,
            params: self.params.ptr,
            partial: self.partial.ptr,
            counter: self.sample_counter.ptr,
            token_out: self.token.ptr,
            pos: if advance_pos { self.pos.ptr } else { 0 },
            step: self.step.ptr,
            mask: 0,
            vocab: self.vocab as i32,
            nblocks: sp::ARGMAX_BLOCKS as i32,
        };
        if self.greedy { sp::argmax(&self.ctx, &a) } else { sp::general(&self.ctx, &a) }
    }

    /// Samples the first token from prefill logits (a [1, vocab] row on the device) into the
    /// input slot, sets the position to `pos` (the prompt length) and returns the token.
    pub fn start(&mut self, logits_row: u64, pos: usize) -> Result<u32> {
        self.ctx.gpu.bind()?;
        self.pos.upload(0, bytemuck::bytes_of(&(pos as i32)))?;
        self.step.upload(0, bytemuck::bytes_of(&0i32))?;
        self.sample_into(logits_row, false)?;
        self.pos_host = pos;
        self.read_token()
    }

    /// Sets the next input token and position directly (teacher forcing, tests).
    pub fn set_input(&mut self, token: u32, pos: usize) -> Result<()> {
        self.ctx.gpu.bind()?;
        self.pos.upload(0, bytemuck::bytes_of(&(pos as i32)))?;
        self.token.upload(0, bytemuck::bytes_of(&(token as i32)))?;
        self.pos_host = pos;
        Ok(())
    }

    /// Sets the device step counter, the counter of the seeded generator (the general sampler
    /// draws with (seed, step)), so that a caller can key the random stream to the token's index
    /// in its output.
    pub fn set_step(&mut self, step: usize) -> Result<()> {
        self.ctx.gpu.bind()?;
        self.step.upload(0, bytemuck::bytes_of(&(step.min(i32::MAX as usize) as i32)))
    }

    /// Whether the graph was captured with the greedy (argmax) sampler.
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    fn read_token(&self) -> Result<u32> {
        let mut t = [0i32];
        self.token.download(0, bytemuck::cast_slice_mut(&mut t))?;
        Ok(t[0] as u32)
    }

    /// Runs one step (the current input token at the current position) and returns the sampled
    /// token, which is also the next step's input.
    pub fn step(&mut self, state: &mut CudaState) -> Result<u32> {
        self.launch(state)?;
        self.read_token()
    }

    /// Enqueues one step without reading the token back.
    pub fn launch(&mut self, state: &mut CudaState) -> Result<()> {
        self.ctx.gpu.bind()?;
        state.ensure_capacity(self.slot, self.pos_host + 1)?;
        {
            let s = state.slot_mut(self.slot)?;
            if s.attn_len.iter().any(|&l| l != self.pos_host) {
                return Err(Error::Op {
                    op: "decode",
                    msg: format!("the cache holds {:?} tokens, the step is at position {}", s.attn_len, self.pos_host),
                });
            }
            s.attn_len.iter_mut().for_each(|l| *l += 1);
        }
        self.graph.as_ref().expect("captured").launch(&self.ctx.gpu)?;
        self.pos_host += 1;
        Ok(())
    }

    /// The logits of the last step (tests, teacher-forced comparison).
    pub fn logits(&self) -> Result<Vec<f32>> {
        let mut v = vec![0f32; self.vocab];
        self.logits.download(0, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    pub fn set_params(&mut self, p: sp::SampleParams) -> Result<()> {
        let greedy = p.temperature <= 0.0 || p.top_k == 1;
        if greedy != self.greedy {
            return Err(Error::Op { op: "decode", msg: "switching between greedy and sampled decoding needs a new graph".into() });
        }
        self.params.upload(0, bytemuck::bytes_of(&p))
    }
}
