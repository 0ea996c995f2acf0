//! The op-level backend's layer blocks (attention, Gated DeltaNet, MoE): buffers, launches over a
//! forward call's spans, variant choice.
//! No host synchronisation happens here: routing, token lists and tile tables stay on the GPU.

use orchid_model::backend::{AttentionInputs, DeltaNetInputs, MoeWeights};
use orchid_model::batch::BatchLayout;
use orchid_model::config::{AttentionDims, DeltaNetDims, MoeDims};
use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, copy_d2d};
use crate::ops::elementwise::{silu_mul, zero_words};
use crate::ops::gemm::{
    AltExpert, GemmX, Grouped, gemm, gemm_concat, gemm_pair_x, gemm_wg_round, gemm_wgmma, gemm_x, grouped_bn, matmul, matmul_x,
};
use crate::ops::gemv::{ROUTER_KPARTS, RouteEpi, gemv, use_gemv};
use crate::ops::moe_decode::{
    FusedRoute, MoeDecode, can_fuse_route, moe_down, moe_down_rows, moe_route_up, moe_route_up_rows, moe_up_rows,
};
use crate::ops::{attention as at, deltanet as dn, moe as mo};
use crate::state::{CaptureDst, CudaState, KV_BLOCK};
use crate::{CudaBackend, CudaTensor};

/// The `attn_prep` arguments a layer's batch shares: its projections from row 0, norms, RoPE
/// table, KV pools and shapes (the span's or row's own fields left at their defaults).
pub(crate) fn prep_base(
    inp: &AttentionInputs<'_, CudaBackend>,
    dims: &AttentionDims,
    inv_freq: u64,
    state: &CudaState,
    layer: usize,
    eps: f32,
) -> at::PrepArgs {
    let (hq, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let qstride = if dims.output_gate { 2 * d } else { d };
    at::PrepArgs {
        qg: inp.q_gate.ptr(),
        k: inp.k.ptr(),
        v: inp.v.ptr(),
        q_norm: inp.q_norm.buf.ptr,
        k_norm: inp.k_norm.buf.ptr,
        inv_freq,
        kpool: state.kpool_ptr(layer),
        vpool: state.vpool_ptr(layer),
        hq: hq as i32,
        hkv: hkv as i32,
        d: d as i32,
        r: dims.rotary_dim as i32,
        bs: KV_BLOCK as i32,
        ldq: (hq * qstride) as i32,
        qstride: qstride as i32,
        ldk: (hkv * d) as i32,
        eps,
        ..Default::default()
    }
}

pub fn attention(
    b: &CudaBackend,
    inp: AttentionInputs<'_, CudaBackend>,
    dims: &AttentionDims,
    eps: f32,
    layer: usize,
    batch: &BatchLayout,
    state: &mut CudaState,
) -> Result<CudaTensor> {
    let c = &b.ctx;
    let (hq, hkv, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    at::check_head_dim(d)?;
    let g = hq / hkv;
    let qstride = if dims.output_gate { 2 * d } else { d };
    let ldq = hq * qstride;
    let t_all = inp.q_gate.rows;
    if inp.q_gate.cols != ldq || inp.k.cols != hkv * d || inp.v.cols != hkv * d {
        return Err(Error::Op {
            op: "attention",
            msg: format!("q_gate {} / k {} / v {} columns", inp.q_gate.cols, inp.k.cols, inp.v.cols),
        });
    }
    let out = b.tensor(t_all, hq * d)?;
    let q_bf = DevBuf::alloc(b.gpu(), t_all * hq * d * 2)?;
    let inv_freq = b.inv_freq(dims.rope_theta, dims.rotary_dim)?;
    let scale_log2 = std::f32::consts::LOG2_E / (d as f32).sqrt();
    for span in &batch.spans {
        let have = state.slot(span.slot)?.attn_len[layer];
        if have != span.start {
            return Err(Error::Op { op: "attention", msg: format!("span starts at {} but the cache holds {have}", span.start) });
        }
        state.ensure_capacity(span.slot, span.start + span.len)?;
    }
    // Spans of several tokens: one launch of their q/k norms, RoPE and cache appends; those
    // without split-KV also one prefill launch, after the loop.
    // The batch's projections from row 0 (a batched attn_prep adds each span's row0).
    let base = prep_base(&inp, dims, inv_freq.ptr, state, layer, eps);
    let mut prep_spans: Vec<at::AttnSpan> = Vec::new();
    let mut plain: Vec<at::AttnSpan> = Vec::new();
    let mut plain_args = None;
    for (span, off) in batch.spans.iter().zip(batch.offsets()) {
        let p = at::PrepArgs {
            qg: inp.q_gate.row_ptr(off),
            k: inp.k.row_ptr(off),
            v: inp.v.row_ptr(off),
            q_out: q_bf.ptr + (off * hq * d * 2) as u64,
            table: state.table_ptr(span.slot),
            t: span.len as i32,
            start: span.start as i32,
            ..base
        };
        let mut a = at::AttnArgs {
            q: p.q_out,
            kpool: p.kpool,
            vpool: p.vpool,
            table: p.table,
            gate: if dims.output_gate { inp.q_gate.row_ptr(off) } else { 0 },
            out: out.row_ptr(off),
            t: span.len as i32,
            start: span.start as i32,
            hq: hq as i32,
            hkv: hkv as i32,
            g: g as i32,
            bs: KV_BLOCK as i32,
            ldg: ldq as i32,
            scale_log2,
            ..Default::default()
        };
        let entry = at::AttnSpan { q: a.q, gate: a.gate, out: a.out, table: a.table, t: a.t, start: a.start, row0: off as i32, pad0: 0 };
        if span.len > 1 {
            prep_spans.push(entry);
        }
        if span.len == 1 {
            // Its prep is folded into the decode kernel (which reads its own slot's cache only).
            let nsplit = at::decode_splits(span.start + 1, hkv, b.gpu().sms as usize);
            let nz = g.div_ceil(16);
            let part_o = DevBuf::alloc(b.gpu(), hkv * nz * nsplit * 16 * d * 4)?;
            let part_ml = DevBuf::alloc(b.gpu(), hkv * nz * nsplit * 16 * 2 * 4)?;
            a.nsplit = nsplit as i32;
            a.part_o = part_o.ptr;
            a.part_ml = part_ml.ptr;
            at::decode(c, &a, d, &p)?;
        } else {
            let nsplit = at::prefill_splits(span.len, g, hkv, span.start, b.gpu().sms as usize, c.tuning.attn_prefill_splits);
            if nsplit <= 1 {
                plain.push(entry);
                plain_args = Some(a);
            } else {
                prep_batch(b, &base, &mut prep_spans)?;
                // Few query tiles over a long context: split-KV (partials merged by a second kernel).
                let (no, nml) = at::prefill_parts(span.len, g, hkv, d, nsplit);
                let parts = (DevBuf::alloc(b.gpu(), no * 4)?, DevBuf::alloc(b.gpu(), nml * 4)?);
                (a.nsplit, a.part_o, a.part_ml) = (nsplit as i32, parts.0.ptr, parts.1.ptr);
                at::prefill(c, &a, d)?;
            }
        }
        state.slot_mut(span.slot)?.attn_len[layer] += span.len;
    }
    prep_batch(b, &base, &mut prep_spans)?;
    if let Some(a) = plain_args {
        let table = DevBuf::from_slice(b.gpu(), &plain)?;
        let t = plain.iter().map(|s| s.t).max().unwrap_or(0);
        at::prefill(c, &at::AttnArgs { spans: table.ptr, nspans: plain.len() as i32, t, ..a }, d)?;
    }
    Ok(out)
}

/// One `attn_prep` launch for the spans gathered so far, if any (taken from `spans`); `base` holds
/// the batch's shared arguments.
fn prep_batch(b: &CudaBackend, base: &at::PrepArgs, spans: &mut Vec<at::AttnSpan>) -> Result<()> {
    if spans.is_empty() {
        return Ok(());
    }
    let t = spans.iter().map(|s| s.t).max().unwrap_or(0);
    let table = DevBuf::from_slice(b.gpu(), spans)?;
    let n = spans.len() as i32;
    spans.clear();
    at::prep(&b.ctx, &at::PrepArgs { spans: table.ptr, nspans: n, t, ..*base })
}

pub fn deltanet(
    b: &CudaBackend,
    inp: DeltaNetInputs<'_, CudaBackend>,
    dims: &DeltaNetDims,
    eps: f32,
    layer: usize,
    batch: &BatchLayout,
    state: &mut CudaState,
) -> Result<CudaTensor> {
    let c = &b.ctx;
    let (hk, hv, dk, dv) = (dims.num_k_heads, dims.num_v_heads, dims.k_head_dim, dims.v_head_dim);
    let (cdim, kc) = (dims.conv_dim(), dims.conv_kernel);
    dn::check_dims(dk, dv, cdim, kc)?;
    let t_all = inp.qkv.rows;
    if inp.qkv.cols != cdim || inp.z.cols != hv * dv || inp.b.cols != hv || inp.a.cols != hv {
        return Err(Error::Op { op: "deltanet", msg: "input widths do not match the GDN dims".into() });
    }
    let out = b.tensor(t_all, hv * dv)?;
    let mut spans = Vec::new();
    for (span, off) in batch.spans.iter().zip(batch.offsets()) {
        state.slot(span.slot)?;
        if span.len > 1 {
            spans.push(Span { slot: span.slot, start: span.start, len: span.len, off });
            continue;
        }
        // One token: the fused decode kernel, straight into `out`.
        let a = dn::GdnDecodeArgs {
            qkv: inp.qkv.row_ptr(off),
            z: inp.z.row_ptr(off),
            b: inp.b.row_ptr(off),
            a: inp.a.row_ptr(off),
            conv_w: inp.conv.buf.ptr,
            conv_state: state.conv_ptr(span.slot, layer),
            a_log: inp.a_log.buf.ptr,
            dt_bias: inp.dt_bias.buf.ptr,
            norm_w: inp.norm.buf.ptr,
            state: state.rec_ptr(span.slot, layer),
            out: out.row_ptr(off),
            pos_ptr: 0,
            hk: hk as i32,
            hv: hv as i32,
            dk: dk as i32,
            dv: dv as i32,
            kc: kc as i32,
            c: cdim as i32,
            pos: span.start as i32,
            eps,
            ..Default::default()
        };
        dn::decode(c, &a)?;
    }
    if !spans.is_empty() {
        deltanet_spans(b, &inp, dims, eps, layer, &spans, &out, state)?;
    }
    Ok(out)
}

/// A span of more than one token in a GDN layer's forward call: its sequence's slot, first
/// position and length, and its first row in the call's tensors.
#[derive(Clone, Copy)]
struct Span {
    slot: usize,
    start: usize,
    len: usize,
    off: usize,
}

/// The chunked GDN layer over the spans of several tokens, each kernel launched once for all of
/// them where it can: the conv (a `GdnSpan` per span), the norms and gates and the gated norm
/// (per token: once per run of adjacent spans), the chunk prep and scan in groups of at most
/// CHUNK_SPAN_MAX tokens. A span with a capture inside it, or longer than that, runs its prep and
/// scan alone (`chunked_alone`). Every span's values are those of a call with that span alone.
#[allow(clippy::too_many_arguments)]
fn deltanet_spans(
    b: &CudaBackend,
    inp: &DeltaNetInputs<'_, CudaBackend>,
    dims: &DeltaNetDims,
    eps: f32,
    layer: usize,
    spans: &[Span],
    out: &CudaTensor,
    state: &mut CudaState,
) -> Result<()> {
    let c = &b.ctx;
    let (hk, hv, dk, dv) = (dims.num_k_heads, dims.num_v_heads, dims.k_head_dim, dims.v_head_dim);
    let (cdim, kc) = (dims.conv_dim(), dims.conv_kernel);
    let (t_all, conv_len) = (inp.qkv.rows, state.conv_len);
    let xc = b.tensor(t_all, cdim)?;
    let beta = DevBuf::alloc(b.gpu(), t_all * hv * 4)?;
    let gdec = DevBuf::alloc(b.gpu(), t_all * hv * 4)?;
    let core = b.tensor(t_all, hv * dv)?;
    // Snapshots asked for inside a span (`StatePool::capture_at`) get what a pass ending at their
    // position leaves: both conv buffers as before this span, the one such a pass writes holding
    // the inputs of the KC−1 positions before it (rows of this span), and the recurrent state
    // after the chunk ending there (the span's scan stops there).
    let mut descs = Vec::with_capacity(spans.len());
    let mut caps = Vec::with_capacity(spans.len());
    for s in spans {
        let conv_base = state.conv_ptr(s.slot, layer);
        let span_caps = state.captures_in(s.slot, layer, s.start, s.len)?;
        if let Some(cap) = span_caps.iter().find(|cap| !cap.offset.is_multiple_of(dn::CHUNK)) {
            return Err(Error::Op {
                op: "deltanet",
                msg: format!("a capture {} tokens into a span is not at a chunk boundary", cap.offset),
            });
        }
        let window = (kc - 1) * cdim * 4;
        for cap in &span_caps {
            copy_d2d(b.gpu(), cap.conv, conv_base, 2 * conv_len * 4)?;
            if window > 0 {
                let dst = cap.conv + (((s.start + cap.offset) & 1) * conv_len * 4) as u64;
                copy_d2d(b.gpu(), dst, inp.qkv.row_ptr(s.off + cap.offset + 1 - kc), window)?;
            }
        }
        caps.push(span_caps);
        descs.push(dn::GdnSpan {
            conv_in: conv_base + ((s.start & 1) * conv_len * 4) as u64,
            conv_out: conv_base + (((s.start + s.len) & 1) * conv_len * 4) as u64,
            state: state.rec_ptr(s.slot, layer),
            scratch: 0,
            row0: s.off as i32,
            t: s.len as i32,
            nchunks: dn::chunk_count(s.len) as i32,
            pad: 0,
        });
    }
    let table = DevBuf::from_slice(b.gpu(), &descs)?;
    let t_max = spans.iter().map(|s| s.len).max().unwrap_or(0);
    dn::conv(
        c,
        &dn::ConvArgs {
            x: inp.qkv.ptr(),
            w: inp.conv.buf.ptr,
            out: xc.ptr(),
            spans: table.ptr,
            t: t_max as i32,
            c: cdim as i32,
            kc: kc as i32,
            ldx: cdim as i32,
            nspans: spans.len() as i32,
            ..Default::default()
        },
    )?;
    // Runs of adjacent spans' rows, for the per-token kernels.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for s in spans {
        match runs.last_mut() {
            Some((r0, n)) if *r0 + *n == s.off => *n += s.len,
            _ => runs.push((s.off, s.len)),
        }
    }
    for &(r0, n) in &runs {
        dn::prep(
            c,
            &dn::GdnPrepArgs {
                x: xc.row_ptr(r0),
                b: inp.b.row_ptr(r0),
                a: inp.a.row_ptr(r0),
                a_log: inp.a_log.buf.ptr,
                dt_bias: inp.dt_bias.buf.ptr,
                beta: beta.ptr + (r0 * hv * 4) as u64,
                gdec: gdec.ptr + (r0 * hv * 4) as u64,
                t: n as i32,
                hk: hk as i32,
                hv: hv as i32,
                dk: dk as i32,
                ldb: hv as i32,
                lda: hv as i32,
                c: cdim as i32,
                pad: 0,
            },
        )?;
    }
    let args = dn::ChunkArgs {
        x: xc.ptr(),
        beta: beta.ptr,
        gdec: gdec.ptr,
        out: core.ptr(),
        hk: hk as i32,
        hv: hv as i32,
        dk: dk as i32,
        dv: dv as i32,
        c: cdim as i32,
        cw: dn::chunk_cols(dv) as i32,
        ..Default::default()
    };
    let (mut group, mut group_t): (Vec<dn::GdnSpan>, usize) = (Vec::new(), 0);
    for ((s, d), span_caps) in spans.iter().zip(&descs).zip(&caps) {
        if !span_caps.is_empty() || s.len > dn::CHUNK_SPAN_MAX {
            chunked_alone(b, &args, s, d.state, state.rec_len, span_caps)?;
            continue;
        }
        if group_t + s.len > dn::CHUNK_SPAN_MAX {
            chunked_group(b, &args, &std::mem::take(&mut group))?;
            group_t = 0;
        }
        group.push(*d);
        group_t += s.len;
    }
    if !group.is_empty() {
        chunked_group(b, &args, &group)?;
    }
    for (s, span_caps) in spans.iter().zip(&caps) {
        for cap in span_caps {
            state.captured(s.slot, layer, s.start + cap.offset)?;
        }
    }
    for &(r0, n) in &runs {
        dn::gated_norm(
            c,
            &dn::GNormArgs {
                core: core.row_ptr(r0),
                z: inp.z.row_ptr(r0),
                w: inp.norm.buf.ptr,
                out: out.row_ptr(r0),
                t: n as i32,
                hv: hv as i32,
                dv: dv as i32,
                ldz: (hv * dv) as i32,
                eps,
                pad0: 0,
            },
        )?;
    }
    Ok(())
}

/// The chunk prep and scan of several spans (none longer than CHUNK_SPAN_MAX, no captures) in one
/// launch each, every span with its own scratch.
fn chunked_group(b: &CudaBackend, args: &dn::ChunkArgs, group: &[dn::GdnSpan]) -> Result<()> {
    let (hv, dk, dv) = (args.hv as usize, args.dk as usize, args.dv as usize);
    let bytes: Vec<usize> = group.iter().map(|g| dn::chunk_scratch_bytes(hv, dk, dv, g.t as usize)).collect();
    let scratch = DevBuf::alloc(b.gpu(), bytes.iter().sum())?;
    let mut at = scratch.ptr;
    let mut descs = group.to_vec();
    for (d, n) in descs.iter_mut().zip(&bytes) {
        d.scratch = at;
        at += *n as u64;
    }
    let table = DevBuf::from_slice(b.gpu(), &descs)?;
    let a = dn::ChunkArgs {
        spans: table.ptr,
        t: descs.iter().map(|d| d.t).max().unwrap_or(0),
        nchunks: descs.iter().map(|d| d.nchunks).max().unwrap_or(0),
        nspans: descs.len() as i32,
        ..*args
    };
    dn::chunk_prep(&b.ctx, &a)?;
    dn::chunk_scan(&b.ctx, &a)
}

/// The chunk prep and scan of one span, in pieces of at most CHUNK_SPAN_MAX tokens (the state
/// passes through memory in between, so the scratch never exceeds that many tokens); the scan of
/// a piece also stops at each capture in it, for a copy of the state there.
fn chunked_alone(b: &CudaBackend, args: &dn::ChunkArgs, s: &Span, rec: u64, rec_len: usize, caps: &[CaptureDst]) -> Result<()> {
    let c = &b.ctx;
    let (hv, dk, dv, cdim) = (args.hv as usize, args.dk as usize, args.dv as usize, args.c as usize);
    let piece = s.len.min(dn::CHUNK_SPAN_MAX);
    let scratch = DevBuf::alloc(b.gpu(), dn::chunk_scratch_bytes(hv, dk, dv, piece))?;
    for p0 in (0..s.len).step_by(piece) {
        let n = piece.min(s.len - p0);
        let nchunks = dn::chunk_count(n) as i32;
        let row = (s.off + p0) as u64;
        let a = dn::ChunkArgs {
            x: args.x + row * (cdim * 4) as u64,
            beta: args.beta + row * (hv * 4) as u64,
            gdec: args.gdec + row * (hv * 4) as u64,
            state: rec,
            out: args.out + row * (hv * dv * 4) as u64,
            scratch: scratch.ptr,
            t: n as i32,
            nchunks,
            chunk0: 0,
            chunk1: nchunks,
            ..*args
        };
        dn::chunk_prep(c, &a)?;
        let mut done = 0;
        for cap in caps.iter().filter(|cap| cap.offset > p0 && cap.offset <= p0 + n) {
            let stop = ((cap.offset - p0) / dn::CHUNK) as i32;
            if stop > done {
                dn::chunk_scan(c, &dn::ChunkArgs { chunk0: done, chunk1: stop, ..a })?;
                done = stop;
            }
            copy_d2d(b.gpu(), cap.rec, rec, rec_len * 4)?;
        }
        if done < nchunks {
            dn::chunk_scan(c, &dn::ChunkArgs { chunk0: done, ..a })?;
        }
    }
    Ok(())
}

pub fn moe(b: &CudaBackend, x: &CudaTensor, w: &MoeWeights<CudaBackend>, dims: &MoeDims) -> Result<CudaTensor> {
    let out = b.tensor(x.rows, x.cols)?;
    moe_into(b, x, None, w, dims, out.ptr(), false, None)?;
    Ok(out)
}

/// `moe` of x written to `out` [t, H], or added onto it (`accumulate`: the residual). `xp`: x
/// already prepared for the GEMMs (`gemm_x` of the same rows), else prepared here. With `then`
/// (a norm weight and its eps) on the GEMM path, also returns the new `out` rows prepared for the
/// next block's GEMMs (`gemm_x_norm` of them with that norm, the same bits), from the combine.
#[allow(clippy::too_many_arguments)]
pub fn moe_into(
    b: &CudaBackend,
    x: &CudaTensor,
    xp: Option<GemmX>,
    w: &MoeWeights<CudaBackend>,
    dims: &MoeDims,
    out: u64,
    accumulate: bool,
    then: Option<(u64, f32)>,
) -> Result<Option<GemmX>> {
    let c = &b.ctx;
    let (t, h) = (x.rows, x.cols);
    let (e, k) = (dims.num_experts, dims.top_k);
    if e > mo::MOE_E_MAX || k > 32 || w.experts.num != e {
        return Err(Error::Op { op: "moe", msg: format!("{e} experts / top-{k} (the GPU router handles at most {} / 32)", mo::MOE_E_MAX) });
    }
    if t <= c.tuning.moe_rows_max
        && let Some(md) = moe_rows_experts(w, dims)
    {
        if !accumulate {
            zero_words(c, out, t * h)?;
        }
        return moe_rows(b, x, None, w, dims, &md, out).map(|()| None);
    }
    let gpu = b.gpu();
    // x rounded to bf16 with its group sums, once for every GEMM that reads it (router, experts'
    // gate/up, shared expert and its gate).
    let xp = match xp {
        Some(xp) => xp,
        None => gemm_x(c, x.ptr(), h, t, h)?,
    };
    // Router logits [t, e], then the shared-expert gate's logit in column e: one GEMM of both
    // weights where they share format and K.
    let ldl = e + w.shared_gate.is_some() as usize;
    let logits = b.tensor(t, ldl)?;
    let gemm_path = !use_gemv(c, t) && xp.k == w.router.cols && xp.kpad == w.router.kpad;
    match &w.shared_gate {
        Some(sg) if gemm_path && sg.fmt == w.router.fmt && sg.kpad == w.router.kpad && sg.cols == w.router.cols => {
            gemm_concat(c, &w.router, sg, &xp, t, logits.ptr(), ldl)?
        }
        sg => {
            matmul_x(c, &w.router, x.ptr(), h, &xp, t, logits.ptr(), ldl)?;
            if let Some(sg) = sg {
                matmul_x(c, sg, x.ptr(), h, &xp, t, logits.ptr() + (e * 4) as u64, ldl)?;
            }
        }
    }
    let wts = DevBuf::alloc(gpu, t * k * 4)?;
    let fmt = w.experts.gate.fmt;
    let bn = grouped_bn(fmt, t * k / e, gemm_wgmma(c, fmt, 64) && gemm_wg_round(c)).max(c.tuning.grouped_bn_min);
    // Batched decode: the lists in one block (fewer launches), the shared expert listed as
    // expert e of the grouped GEMMs where its weights have an expert's shape (no GEMMs of its
    // own); prompt chunks: over many blocks, the shared expert as dense GEMMs.
    let small = t * k <= mo::ROUTE_SMALL_MAX;
    let alt = match (&w.shared, &w.shared_gate) {
        (Some(m), Some(_)) if small && c.tuning.shared_grouped => {
            let ex = &w.experts;
            AltExpert::of(e, &ex.gate, &m.gate_proj, Some((&ex.up, &m.up_proj))).zip(AltExpert::of(e, &ex.down, &m.down_proj, None))
        }
        _ => None,
    };
    // List positions: the routed assignments, then the shared expert's tokens.
    let listed = t * k + if alt.is_some() { t } else { 0 };
    let max_tiles = listed.div_ceil(bn) + e + 1;
    let tiles = DevBuf::alloc(gpu, max_tiles * 16)?;
    let num_tiles = DevBuf::alloc(gpu, 4)?;
    let assign_tok = DevBuf::alloc(gpu, listed * 4)?;
    let slot_pos = DevBuf::alloc(gpu, t * k * 4)?;
    let route = if small { mo::route_small } else { mo::route_chain };
    let r = mo::Routing {
        logits: logits.ptr(),
        ldl,
        t,
        e,
        k,
        renorm: dims.norm_topk_prob,
        bn,
        wts: wts.ptr,
        tiles: tiles.ptr,
        num_tiles: num_tiles.ptr,
        assign_tok: assign_tok.ptr,
        slot_pos: slot_pos.ptr,
        shared: alt.is_some(),
    };
    route(c, &r)?;
    let grouped = |alt, early| Grouped { tiles: tiles.ptr, num_tiles: num_tiles.ptr, max_tiles, bn, alt, early };
    let hp = gemm_pair_x(c, &w.experts.gate, &w.experts.up, &xp, assign_tok.ptr, listed, Some(grouped(alt.map(|a| a.0), false)))?;
    let ybuf = DevBuf::alloc(gpu, listed * h * 4)?;
    // The routing wrote the tile table before the pair: the down GEMM may read it early.
    gemm(c, &w.experts.down, None, &hp, 0, listed, Some(grouped(alt.map(|a| a.1), true)), ybuf.ptr, h)?;
    // Shared expert (all tokens) and its sigmoid gate: rows t·k.. of the experts' outputs, or
    // GEMMs of its own.
    let mut shared_out = None;
    if let (Some(m), Some(_), None) = (&w.shared, &w.shared_gate, alt) {
        let is = m.gate_proj.rows;
        let sh = b.tensor(t, h)?;
        if t <= 8 {
            let (gt, up, sh_h) = (b.tensor(t, is)?, b.tensor(t, is)?, b.tensor(t, is)?);
            matmul(c, &m.gate_proj, x.ptr(), h, t, gt.ptr(), is)?;
            matmul(c, &m.up_proj, x.ptr(), h, t, up.ptr(), is)?;
            silu_mul(c, gt.ptr(), up.ptr(), sh_h.ptr(), t * is)?;
            matmul(c, &m.down_proj, sh_h.ptr(), is, t, sh.ptr(), h)?;
        } else {
            let shp = gemm_pair_x(c, &m.gate_proj, &m.up_proj, &xp, 0, t, None)?;
            gemm(c, &m.down_proj, None, &shp, 0, t, None, sh.ptr(), h)?;
        }
        shared_out = Some(sh);
    }
    let next = then.map(|_| GemmX::alloc(c, h, t, h)).transpose()?;
    let (norm, eps) = then.unwrap_or((0, 0.0));
    mo::combine(
        c,
        &mo::CombineArgs {
            y: ybuf.ptr,
            wts: wts.ptr,
            slot_pos: slot_pos.ptr,
            shared: match alt {
                Some(_) => ybuf.ptr + (t * k * h * 4) as u64,
                None => shared_out.as_ref().map_or(0, |s| s.ptr()),
            },
            shared_gate: logits.ptr() + (e * 4) as u64,
            out,
            t: t as i32,
            h: h as i32,
            topk: k as i32,
            ld_sg: ldl as i32,
            acc: accumulate as i32,
            norm,
            xb: next.as_ref().map_or(0, |p| p.xb()),
            xs: next.as_ref().map_or(0, |p| p.xs()),
            kpad: next.as_ref().map_or(0, |p| p.kpad as i32),
            eps,
            pad0: 0,
        },
    )?;
    Ok(next)
}

/// The MoE block of a few tokens through the per-token expert kernels of the decode path: router
/// (and shared gate) logits, top-k per token, every token's routed and shared experts' gate/up
/// in one launch, their down projections weighted and summed in another, added to `out` [t, H].
/// With `norm`, x is normalised on load (matvec path: at most 8 tokens). One token normalised on
/// load takes the router fused into the gate/up kernel where the layer allows (`moe_route_up`).
#[allow(clippy::too_many_arguments)]
pub fn moe_rows(
    b: &CudaBackend,
    x: &CudaTensor,
    norm: Option<(u64, f32)>,
    w: &MoeWeights<CudaBackend>,
    dims: &MoeDims,
    md: &MoeDecode,
    out: u64,
) -> Result<()> {
    let c = &b.ctx;
    let (t, h) = (x.rows, x.cols);
    let (e, k) = (dims.num_experts, dims.top_k);
    if norm.is_some() && t > 8 {
        return Err(Error::Op { op: "moe", msg: format!("a normalised-on-load MoE of {t} tokens (at most 8)") });
    }
    let ns = w.shared_gate.is_some() as usize;
    let ids = DevBuf::alloc(b.gpu(), t * k * 4)?;
    let wts = DevBuf::alloc(b.gpu(), t * (k + ns) * 4)?;
    let hbuf = DevBuf::alloc(b.gpu(), t * (k + ns) * md.hstride() * 4)?;
    if let Some(norm) = norm {
        // The router inside the experts' gate/up kernel (each token's top-k before its experts).
        let partial = DevBuf::alloc(b.gpu(), t * ROUTER_KPARTS * (e + 1) * 4)?;
        let route = FusedRoute {
            router: &w.router,
            shared_gate: w.shared_gate.as_ref(),
            e,
            renorm: dims.norm_topk_prob,
            partial: partial.ptr,
            barrier: c.route_barrier.ptr,
            wts: wts.ptr,
        };
        if can_fuse_route(c, md, &route, t) {
            if t == 1 {
                moe_route_up(c, md, x.ptr(), norm, ids.ptr, hbuf.ptr, &route)?;
                return moe_down(c, md, hbuf.ptr, wts.ptr, ids.ptr, out);
            }
            moe_route_up_rows(c, md, x.ptr(), norm, ids.ptr, hbuf.ptr, &route, t)?;
            return moe_down_rows(c, md, hbuf.ptr, wts.ptr, ids.ptr, out, t);
        }
    }
    let logits = b.tensor(t, e + ns)?;
    let fused = t <= 8 && w.shared_gate.as_ref().is_none_or(|sg| sg.fmt == w.router.fmt && sg.kpad == w.router.kpad);
    if fused {
        // Router (and shared gate) logits with every token's top-k in the last block. K parts
        // for one token only: the last block would sum the parts of t x E logits, which cost
        // more than the parts gain from 2 tokens on (measured at 2-8 tokens).
        let partial = if t == 1 { Some(DevBuf::alloc(b.gpu(), ROUTER_KPARTS * (e + ns) * 4)?) } else { None };
        let route = RouteEpi {
            counter: c.route_counter.ptr,
            ids: ids.ptr,
            wts: wts.ptr,
            e,
            topk: k,
            renorm: dims.norm_topk_prob,
            shared_col: w.shared_gate.as_ref().map(|_| e),
            partial: partial.as_ref().map_or(0, |p| p.ptr),
        };
        let mut segs = vec![(&w.router, 0)];
        segs.extend(w.shared_gate.as_ref().map(|sg| (sg, e)));
        gemv(c, &segs, x.ptr(), h, t, norm, logits.ptr(), e + ns, false, Some(route))?;
    } else {
        match &w.shared_gate {
            sg if t <= 8 => {
                gemv(c, &[(&w.router, 0)], x.ptr(), h, t, norm, logits.ptr(), e + ns, false, None)?;
                if let Some(sg) = sg {
                    gemv(c, &[(sg, e)], x.ptr(), h, t, norm, logits.ptr(), e + ns, false, None)?;
                }
            }
            sg => {
                matmul(c, &w.router, x.ptr(), h, t, logits.ptr(), e + ns)?;
                if let Some(sg) = sg {
                    matmul(c, sg, x.ptr(), h, t, logits.ptr() + (e * 4) as u64, e + ns)?;
                }
            }
        }
        mo::topk_rows(
            c,
            &mo::TopkArgs {
                logits: logits.ptr(),
                ids: ids.ptr,
                wts: wts.ptr,
                t: t as i32,
                e: e as i32,
                topk: k as i32,
                renorm: dims.norm_topk_prob as i32,
                ldl: (e + ns) as i32,
                shared: ns as i32,
                ..Default::default()
            },
        )?;
    }
    moe_up_rows(c, md, x.ptr(), norm.unwrap_or((0, 0.0)), ids.ptr, hbuf.ptr, t)?;
    moe_down_rows(c, md, hbuf.ptr, wts.ptr, ids.ptr, out, t)
}

/// The experts of `w` as the per-token kernels take them, if they can (one weight format).
pub fn moe_rows_experts<'a>(w: &'a MoeWeights<CudaBackend>, dims: &MoeDims) -> Option<MoeDecode<'a>> {
    if w.shared.is_some() != w.shared_gate.is_some() {
        return None;
    }
    let shared = w.shared.as_ref();
    let md = MoeDecode {
        gate: Some(&w.experts.gate),
        up: Some(&w.experts.up),
        down: Some(&w.experts.down),
        sh_gate: shared.map(|s| &s.gate_proj),
        sh_up: shared.map(|s| &s.up_proj),
        sh_down: shared.map(|s| &s.down_proj),
        topk: dims.top_k,
    };
    md.fmt().is_ok().then_some(md)
}
