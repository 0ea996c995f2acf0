//! The op-level attention and GDN blocks for a batch in which every span is one token (decode of
//! several sequences): one launch per layer covers every row, each row reading its state slot and
//! position from device arrays.
//!
//! Two ways in. Eagerly, from `Model::forward` over such a batch: the slots and positions are
//! uploaded once per call and the host bookkeeping (cache lengths, KV blocks) is done here, span
//! by span, as on the per-span path. Captured, while a [`DeviceBatch`] is set on the backend
//! (`batch_graph`): the token ids, slots and positions are device buffers the graph reads at
//! every replay, the host layout is only a shape, and the replaying code does the bookkeeping.

use orchid_model::backend::{AttentionInputs, DeltaNetInputs};
use orchid_model::batch::BatchLayout;
use orchid_model::config::{AttentionDims, DeltaNetDims};
use orchid_model::error::{Error, Result};

use crate::driver::DevBuf;
use crate::ops::{attention as at, deltanet as dn};
use crate::state::{CudaState, KV_BLOCK};
use crate::{CudaBackend, CudaTensor};

/// The device inputs of a captured batched decode step: `rows` i32 token ids, state slots
/// (negative: a padding row) and positions.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBatch {
    pub ids: u64,
    pub slots: u64,
    pub pos: u64,
    pub rows: usize,
    /// A step of one row pinned to this state slot: the kernels get the slot's state and block
    /// table addresses as arguments instead of reading the slot from `slots` (one dependent load
    /// fewer before their state requests).
    pub pinned: Option<usize>,
}

/// Where the rows' states are found: the device array of slots (0 for slot 0 of every row) and
/// the slot whose addresses the kernels are given.
fn rows_slots(b: &CudaBackend, slots: u64) -> (u64, usize) {
    match b.device_batch().and_then(|db| db.pinned) {
        Some(slot) => (0, slot),
        None => (slots, 0),
    }
}

/// Whether `batch` goes through this module: every span one token (a lone token too, so that an
/// op-level decode step runs the kernels of the captured one and gives the same logits).
pub fn applies(batch: &BatchLayout) -> bool {
    batch.spans.iter().all(|s| s.len == 1)
}

/// Device slots and positions of the rows: the captured step's buffers, or the layout's, uploaded
/// once for all the layers of a forward call (kept in the state until the layout changes).
fn rows_meta(b: &CudaBackend, batch: &BatchLayout, state: &mut CudaState) -> Result<(u64, u64)> {
    let n = batch.spans.len();
    if let Some(db) = b.device_batch() {
        if db.rows != n {
            return Err(Error::Op { op: "decode rows", msg: format!("{n} spans in a captured step of {} rows", db.rows) });
        }
        return Ok((db.slots, db.pos));
    }
    let key: Vec<(usize, usize)> = batch.spans.iter().map(|s| (s.slot, s.start)).collect();
    if state.rows_meta.as_ref().is_none_or(|(k, _)| *k != key) {
        let v: Vec<i32> = key.iter().map(|&(slot, _)| slot as i32).chain(key.iter().map(|&(_, start)| start as i32)).collect();
        state.rows_meta = Some((key, DevBuf::from_slice(b.gpu(), &v)?));
    }
    let buf = &state.rows_meta.as_ref().expect("set above").1;
    Ok((buf.ptr, buf.ptr + (n * 4) as u64))
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
    let qstride = if dims.output_gate { 2 * d } else { d };
    let ldq = hq * qstride;
    let rows = batch.spans.len();
    let eager = b.device_batch().is_none();
    if eager {
        for span in &batch.spans {
            let have = state.slot(span.slot)?.attn_len[layer];
            if have != span.start {
                return Err(Error::Op { op: "attention", msg: format!("span starts at {} but the cache holds {have}", span.start) });
            }
            state.ensure_capacity(span.slot, span.start + 1)?;
        }
    }
    let (slots, pos) = rows_meta(b, batch, state)?;
    let (slots, base) = rows_slots(b, slots);
    let inv_freq = b.inv_freq(dims.rope_theta, dims.rotary_dim)?;
    // Splits enough for about two blocks per SM over all rows (the positions are device data).
    let nsplit = (2 * b.gpu().sms as usize).div_ceil(hkv * rows).clamp(1, c.tuning.attn_splits.clamp(1, at::MAX_SPLITS));
    let (po, pml) = at::decode_parts(hq, hkv, d, nsplit);
    let part_o = DevBuf::alloc(b.gpu(), rows * po * 4)?;
    let part_ml = DevBuf::alloc(b.gpu(), rows * pml * 4)?;
    let out = b.tensor(rows, hq * d)?;
    let p = at::PrepArgs {
        table: state.table_ptr(base),
        pos_ptr: pos,
        t: 1,
        ..crate::layers::prep_base(&inp, dims, inv_freq.ptr, state, layer, eps)
    };
    let a = at::AttnArgs {
        kpool: p.kpool,
        vpool: p.vpool,
        table: p.table,
        gate: if dims.output_gate { inp.q_gate.ptr() } else { 0 },
        out: out.ptr(),
        part_o: part_o.ptr,
        part_ml: part_ml.ptr,
        pos_ptr: pos,
        rows_slot: slots,
        t: 1,
        hq: hq as i32,
        hkv: hkv as i32,
        g: (hq / hkv) as i32,
        bs: KV_BLOCK as i32,
        ldg: ldq as i32,
        nsplit: nsplit as i32,
        min_tiles: c.tuning.attn_min_tiles as i32,
        ld_table: state.max_blocks_per_seq as i32,
        scale_log2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
        ..Default::default()
    };
    at::decode_rows(c, &a, d, &p, rows)?;
    if eager {
        for span in &batch.spans {
            state.slot_mut(span.slot)?.attn_len[layer] += 1;
        }
    }
    Ok(out)
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
    let (hk, hv, dk, dv) = (dims.num_k_heads, dims.num_v_heads, dims.k_head_dim, dims.v_head_dim);
    let rows = batch.spans.len();
    if b.device_batch().is_none() {
        for span in &batch.spans {
            state.slot(span.slot)?;
        }
    }
    let (slots, pos) = rows_meta(b, batch, state)?;
    let (slots, base) = rows_slots(b, slots);
    let out = b.tensor(rows, hv * dv)?;
    let stride = |floats: usize| {
        i32::try_from(floats).map_err(|_| Error::Op { op: "deltanet", msg: "state slots too large for the batched decode".into() })
    };
    let a = dn::GdnDecodeArgs {
        qkv: inp.qkv.ptr(),
        z: inp.z.ptr(),
        b: inp.b.ptr(),
        a: inp.a.ptr(),
        conv_w: inp.conv.buf.ptr,
        conv_state: state.conv_ptr(base, layer),
        a_log: inp.a_log.buf.ptr,
        dt_bias: inp.dt_bias.buf.ptr,
        norm_w: inp.norm.buf.ptr,
        state: state.rec_ptr(base, layer),
        out: out.ptr(),
        pos_ptr: pos,
        rows_slot: slots,
        hk: hk as i32,
        hv: hv as i32,
        dk: dk as i32,
        dv: dv as i32,
        kc: dims.conv_kernel as i32,
        c: dims.conv_dim() as i32,
        pos: 0,
        eps,
        ld_qkv: inp.qkv.cols as i32,
        ld_z: inp.z.cols as i32,
        ld_ba: inp.b.cols as i32,
        ld_out: (hv * dv) as i32,
        conv_stride: stride(state.conv_slot_stride())?,
        rec_stride: stride(state.rec_slot_stride())?,
        rows: rows as i32,
        pad0: 0,
    };
    if inp.a.cols != inp.b.cols {
        return Err(Error::Op { op: "deltanet", msg: "b and a widths differ".into() });
    }
    dn::decode_rows(&b.ctx, &a, rows)?;
    Ok(out)
}
