//! The batch graphs' logit adjustment table: each row's penalties and logit bias as a sparse
//! per-token list (`orchid_model::LogitAdjust`), which the sampling graph applies to the row's
//! logits before its sampler (`logit_adjust_rows` in `kernels/sampling.cu`).
//!
//! One device buffer per batch graph, allocated at capture (the graph reads it through fixed
//! pointers): i32 offsets [bucket + 1] (row r's entries are entries[offsets[r] .. offsets[r + 1]]),
//! padded to 16 bytes, then room for [`ROW_CAP`] entries per row, then as many f32 where the
//! kernel may keep each entry's logit before its adjustment (`saved`: the sampling graph of a step
//! with log-probabilities needs the raw logit of its sampled token). The host packs the step's lists
//! back to back (CSR) and copies header and entries in one upload; a step in which no row has a
//! list uploads nothing (one copy of an all-zero header when the previous step had lists), and a
//! row with an empty list costs its offset only.

use std::sync::Arc;

use orchid_model::LogitAdjust;
use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, Gpu};
use crate::ops::sampling::AdjustEntry;

/// The most entries one row's list may hold (distinct tokens the row's penalties or bias touch:
/// with a repetition penalty, every distinct token of the prompt and the output). The engine
/// decodes a sequence with a longer list on the op-level path. 64 KiB of device memory per row.
pub const ROW_CAP: usize = 4096;

/// Bytes of the offsets header for `bucket` rows (a multiple of 16, so the entries are aligned).
pub fn header_bytes(bucket: usize) -> usize {
    ((bucket + 1) * 4).next_multiple_of(16)
}

/// Packs the lists of a step's `lists.len()` rows for a table of `bucket` rows: the header (rows
/// past the step's have empty lists) and the entries, as the bytes of the table's start; None
/// when no row has an entry. Errors: more rows than `bucket`, a list longer than [`ROW_CAP`],
/// tokens not in increasing order (the kernel's threads must not write one logit twice).
pub fn pack(lists: &[Vec<LogitAdjust>], bucket: usize) -> Result<Option<Vec<u8>>> {
    let err = |msg: String| Err(Error::Op { op: "logit adjust", msg });
    if lists.len() > bucket {
        return err(format!("{} rows for a table of {bucket}", lists.len()));
    }
    if lists.iter().all(Vec::is_empty) {
        return Ok(None);
    }
    let mut offsets = Vec::with_capacity(bucket + 1);
    let mut entries: Vec<AdjustEntry> = Vec::with_capacity(lists.iter().map(Vec::len).sum());
    offsets.push(0i32);
    for (r, l) in lists.iter().enumerate() {
        if l.len() > ROW_CAP {
            return err(format!("row {r}: {} logit adjustments, at most {ROW_CAP}", l.len()));
        }
        if l.windows(2).any(|w| w[0].token >= w[1].token) || l.iter().any(|a| a.token > i32::MAX as u32) {
            return err(format!("row {r}: the logit adjustments' tokens are not increasing"));
        }
        entries.extend(l.iter().map(|a| AdjustEntry {
            token: a.token as i32,
            bias: a.bias,
            repetition: a.repetition,
            subtract: a.subtract,
        }));
        offsets.push(entries.len() as i32);
    }
    offsets.resize(bucket + 1, entries.len() as i32);
    let mut bytes = vec![0u8; header_bytes(bucket)];
    bytes[..offsets.len() * 4].copy_from_slice(bytemuck::cast_slice(&offsets));
    bytes.extend_from_slice(bytemuck::cast_slice(&entries));
    Ok(Some(bytes))
}

/// A batch graph's table (see the module docs).
pub struct AdjustTable {
    buf: DevBuf,
    bucket: usize,
    /// Whether the device header may hold a non-empty list (the last upload had entries).
    dirty: bool,
}

impl AdjustTable {
    /// A table of `bucket` rows, every list empty.
    pub fn new(gpu: &Arc<Gpu>, bucket: usize) -> Result<AdjustTable> {
        let buf = DevBuf::zeros(gpu, header_bytes(bucket) + bucket * ROW_CAP * (std::mem::size_of::<AdjustEntry>() + 4))?;
        Ok(AdjustTable { buf, bucket, dirty: false })
    }

    /// The device offsets (the table's start).
    pub fn offsets(&self) -> u64 {
        self.buf.ptr
    }

    /// The device entries.
    pub fn entries(&self) -> u64 {
        self.buf.ptr + header_bytes(self.bucket) as u64
    }

    /// The device room for the entries' logits before their adjustment (f32 per entry, in entry
    /// order).
    pub fn saved(&self) -> u64 {
        self.entries() + (self.bucket * ROW_CAP * std::mem::size_of::<AdjustEntry>()) as u64
    }

    /// Copies the step's lists (one per row, or none at all when `lists` is empty) into the table,
    /// on the graphs' stream; see [`pack`] for the errors (the table is left as it was).
    pub fn upload(&mut self, lists: &[Vec<LogitAdjust>]) -> Result<()> {
        match pack(lists, self.bucket)? {
            Some(bytes) => {
                self.dirty = true;
                self.buf.upload(0, &bytes)?;
            }
            None if self.dirty => {
                self.buf.upload(0, &vec![0u8; header_bytes(self.bucket)])?;
                self.dirty = false;
            }
            None => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchid_model::apply_logit_adjust;

    /// The kernel's reading of a packed table, on the CPU: row r's entries through the offsets,
    /// each applied with the device's operations (one rounding each), tokens ≥ `valid` skipped.
    fn kernel_on_cpu(bytes: &[u8], bucket: usize, logits: &mut [f32], vocab: usize, valid: &[usize]) {
        let h = header_bytes(bucket);
        let off: &[i32] = bytemuck::cast_slice(&bytes[..(bucket + 1) * 4]);
        let entries: Vec<AdjustEntry> = bytes[h..].chunks(16).map(bytemuck::pod_read_unaligned).collect();
        for r in 0..bucket {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            for e in &entries[off[r] as usize..off[r + 1] as usize] {
                if e.token >= 0 && (e.token as usize) < valid[r].min(vocab) {
                    let x = row[e.token as usize] + e.bias;
                    let x = if x > 0.0 { x / e.repetition } else { x * e.repetition };
                    row[e.token as usize] = x - e.subtract;
                }
            }
        }
    }

    /// Randomized: packed tables read as the kernel reads them give each row what the reference
    /// (`apply_logit_adjust`) gives, rows without a list untouched; bad lists are errors.
    #[test]
    fn packed_tables_match_the_reference() {
        let mut rng = orchid_engine::sampling::Rng::new(0x9E37_79B9_7F4A_7C15);
        let mut next = move |n: usize| (rng.next_u64() % n as u64) as usize;
        let (vocab, bucket) = (500usize, 8usize);
        for case in 0..200 {
            let rows = 1 + next(bucket);
            let valid: Vec<usize> = (0..bucket).map(|_| 400 + next(150)).collect();
            let lists: Vec<Vec<LogitAdjust>> = (0..rows)
                .map(|_| {
                    if next(3) == 0 {
                        return Vec::new();
                    }
                    let mut ids: Vec<u32> = (0..next(60)).map(|_| next(vocab + 30) as u32).collect();
                    ids.sort_unstable();
                    ids.dedup();
                    ids.into_iter()
                        .map(|token| LogitAdjust {
                            token,
                            bias: if next(2) == 0 { -0.0 } else { next(200) as f32 / 8.0 - 12.5 },
                            repetition: if next(2) == 0 { 1.0 } else { 0.5 + next(100) as f32 / 64.0 },
                            subtract: if next(2) == 0 { 0.0 } else { next(100) as f32 / 32.0 - 1.5 },
                        })
                        .collect()
                })
                .collect();
            let logits: Vec<f32> = (0..bucket * vocab).map(|_| next(4000) as f32 / 100.0 - 20.0).collect();
            let mut want = logits.clone();
            for (r, l) in lists.iter().enumerate() {
                apply_logit_adjust(&mut want[r * vocab..(r + 1) * vocab], valid[r], l);
            }
            let mut got = logits.clone();
            match pack(&lists, bucket).unwrap() {
                Some(bytes) => {
                    assert!(bytes.len() <= header_bytes(bucket) + bucket * ROW_CAP * 16);
                    kernel_on_cpu(&bytes, bucket, &mut got, vocab, &valid);
                }
                None => assert!(lists.iter().all(Vec::is_empty), "case {case}"),
            }
            let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "case {case}");
            assert_eq!(bits(&got[rows * vocab..]), bits(&logits[rows * vocab..]), "padding rows changed");
        }
        let a = |token| LogitAdjust::neutral(token);
        assert!(pack(&[vec![a(3), a(3)]], 2).is_err());
        assert!(pack(&[vec![a(4), a(3)]], 2).is_err());
        assert!(pack(&[vec![], vec![], vec![a(1)]], 2).is_err());
        assert!(pack(&[(0..=ROW_CAP as u32).map(a).collect()], 1).is_err());
        assert!(pack(&[(0..ROW_CAP as u32).map(a).collect()], 1).unwrap().is_some());
        assert_eq!(pack(&[vec![], vec![]], 2).unwrap(), None);
        assert_eq!(pack(&[], 2).unwrap(), None);
    }
}
