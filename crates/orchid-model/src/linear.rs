//! Host-side weight matrices `W [rows = out, cols = in]` for `y = x · Wᵀ`, as they sit in the
//! checkpoint: dense (f32/f16/bf16) or MLX affine-quantized. Views share the mapped file.

use crate::dtype::{self, DType};
use crate::storage::Bytes;

#[derive(Clone, Debug)]
pub struct AffineWeight {
    /// u32 words, `rows × cols·bits/32`.
    pub packed: Bytes,
    /// `rows × cols/group` each, in `sb_dtype`.
    pub scales: Bytes,
    pub biases: Bytes,
    pub sb_dtype: DType,
    pub bits: u32,
    pub group: usize,
}

#[derive(Clone, Debug)]
pub enum WeightData {
    Dense { data: Bytes, dtype: DType },
    Affine(AffineWeight),
}

/// One weight matrix.
#[derive(Clone, Debug)]
pub struct LinearWeight {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl LinearWeight {
    pub fn dense(data: Bytes, dtype: DType, rows: usize, cols: usize) -> LinearWeight {
        assert_eq!(data.len(), rows * cols * dtype.size());
        LinearWeight { rows, cols, data: WeightData::Dense { data, dtype } }
    }

    pub fn dense_f32(v: &[f32], rows: usize, cols: usize) -> LinearWeight {
        Self::dense(Bytes::from_vec(dtype::from_f32(DType::F32, v)), DType::F32, rows, cols)
    }

    pub fn is_quantized(&self) -> bool {
        matches!(self.data, WeightData::Affine(_))
    }

    /// Bytes one row occupies in each buffer: (main, scales-or-0).
    fn row_bytes(&self) -> (usize, usize) {
        match &self.data {
            WeightData::Dense { dtype, .. } => (self.cols * dtype.size(), 0),
            WeightData::Affine(a) => (self.cols * a.bits as usize / 8, self.cols / a.group * a.sb_dtype.size()),
        }
    }

    /// Bytes this weight occupies.
    pub fn nbytes(&self) -> usize {
        let (m, s) = self.row_bytes();
        self.rows * (m + 2 * s)
    }

    /// Rows `r` of this matrix (no copy).
    pub fn rows_range(&self, r: std::ops::Range<usize>) -> LinearWeight {
        assert!(r.end <= self.rows);
        let (m, s) = self.row_bytes();
        let data = match &self.data {
            WeightData::Dense { data, dtype } => WeightData::Dense { data: data.slice(r.start * m..r.end * m), dtype: *dtype },
            WeightData::Affine(a) => WeightData::Affine(AffineWeight {
                packed: a.packed.slice(r.start * m..r.end * m),
                scales: a.scales.slice(r.start * s..r.end * s),
                biases: a.biases.slice(r.start * s..r.end * s),
                ..a.clone()
            }),
        };
        LinearWeight { rows: r.end - r.start, cols: self.cols, data }
    }

    /// A copy with rows reordered: row i of the result is row `perm[i]` of self.
    pub fn permute_rows(&self, perm: &[usize]) -> LinearWeight {
        let (m, s) = self.row_bytes();
        let gather = |b: &Bytes, w: usize| {
            let src = b.as_slice();
            let mut v = Vec::with_capacity(perm.len() * w);
            for &p in perm {
                v.extend_from_slice(&src[p * w..(p + 1) * w]);
            }
            Bytes::from_vec(v)
        };
        let data = match &self.data {
            WeightData::Dense { data, dtype } => WeightData::Dense { data: gather(data, m), dtype: *dtype },
            WeightData::Affine(a) => WeightData::Affine(AffineWeight {
                packed: gather(&a.packed, m),
                scales: gather(&a.scales, s),
                biases: gather(&a.biases, s),
                ..a.clone()
            }),
        };
        LinearWeight { rows: perm.len(), cols: self.cols, data }
    }

    /// Concatenates matrices with the same column count and storage format along rows.
    pub fn concat_rows(parts: &[&LinearWeight]) -> LinearWeight {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let cat = |f: &dyn Fn(&LinearWeight) -> Bytes| {
            let mut v = Vec::new();
            for p in parts {
                assert_eq!(p.cols, cols);
                v.extend_from_slice(f(p).as_slice());
            }
            Bytes::from_vec(v)
        };
        let data = match &parts[0].data {
            WeightData::Dense { dtype, .. } => WeightData::Dense {
                data: cat(&|p| match &p.data {
                    WeightData::Dense { data, dtype: d } if d == dtype => data.clone(),
                    _ => panic!("concat_rows: mixed formats"),
                }),
                dtype: *dtype,
            },
            WeightData::Affine(a0) => {
                let aff = |p: &LinearWeight| match &p.data {
                    WeightData::Affine(a) if a.bits == a0.bits && a.group == a0.group && a.sb_dtype == a0.sb_dtype => a.clone(),
                    _ => panic!("concat_rows: mixed formats"),
                };
                WeightData::Affine(AffineWeight {
                    packed: cat(&|p| aff(p).packed),
                    scales: cat(&|p| aff(p).scales),
                    biases: cat(&|p| aff(p).biases),
                    ..a0.clone()
                })
            }
        };
        LinearWeight { rows, cols, data }
    }

    /// Row `r` as f32 (dequantized if needed) into `out` (len = cols).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let (m, s) = self.row_bytes();
        match &self.data {
            WeightData::Dense { data, dtype } => {
                dtype::to_f32_into(*dtype, &data.as_slice()[r * m..(r + 1) * m], out);
            }
            WeightData::Affine(a) => {
                let ng = self.cols / a.group;
                let mut sc = vec![0f32; ng];
                let mut bi = vec![0f32; ng];
                dtype::to_f32_into(a.sb_dtype, &a.scales.as_slice()[r * s..(r + 1) * s], &mut sc);
                dtype::to_f32_into(a.sb_dtype, &a.biases.as_slice()[r * s..(r + 1) * s], &mut bi);
                let words: Vec<u32> =
                    a.packed.as_slice()[r * m..(r + 1) * m].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                crate::quant::dequant_row(&words, &sc, &bi, a.bits, a.group, out);
            }
        }
    }

    /// The whole matrix as f32 (tests and small tensors only).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
            self.row_f32(r, row);
        }
        out
    }
}
