//! y = x·Wᵀ straight from the checkpoint's storage (f32/bf16/f16 or MLX affine). Each weight
//! row is decoded once per call into f32 and used for every token, so a prefill chunk reads
//! the weights once; rows are spread over threads.

use half::{bf16, f16};
use orchid_model::dtype::DType;
use orchid_model::linear::{LinearWeight, WeightData};
use rayon::prelude::*;

use crate::simd::dot;
use crate::tensor::CpuTensor;

/// Decodes row `r` of `w` into `out` (len = cols) without allocating.
pub fn decode_row(w: &LinearWeight, r: usize, out: &mut [f32]) {
    let cols = w.cols;
    match &w.data {
        WeightData::Dense { data, dtype } => match dtype {
            DType::F32 => out.copy_from_slice(&data.typed::<f32>()[r * cols..(r + 1) * cols]),
            DType::BF16 => {
                let src = &data.typed::<u16>()[r * cols..(r + 1) * cols];
                out.iter_mut().zip(src).for_each(|(o, &b)| *o = bf16::from_bits(b).to_f32());
            }
            DType::F16 => {
                let src = &data.typed::<u16>()[r * cols..(r + 1) * cols];
                out.iter_mut().zip(src).for_each(|(o, &b)| *o = f16::from_bits(b).to_f32());
            }
            other => unreachable!("dense weights of {other:?} are rejected at load"),
        },
        WeightData::Affine(a) => {
            let bits = a.bits as usize;
            let words_per_row = cols * bits / 32;
            let groups = cols / a.group;
            let packed = &a.packed.typed::<u32>()[r * words_per_row..(r + 1) * words_per_row];
            let sb = |bytes: &[u8], g: usize| -> f32 {
                let i = (r * groups + g) * a.sb_dtype.size();
                match a.sb_dtype {
                    DType::BF16 => bf16::from_bits(u16::from_le_bytes([bytes[i], bytes[i + 1]])).to_f32(),
                    DType::F16 => f16::from_bits(u16::from_le_bytes([bytes[i], bytes[i + 1]])).to_f32(),
                    _ => f32::from_le_bytes(bytes[i..i + 4].try_into().unwrap()),
                }
            };
            let (sc, bi) = (a.scales.as_slice(), a.biases.as_slice());
            let words_per_group = a.group * bits / 32;
            for g in 0..groups {
                let ws = &packed[g * words_per_group..(g + 1) * words_per_group];
                let o = &mut out[g * a.group..(g + 1) * a.group];
                let (s, b) = (sb(sc, g), sb(bi, g));
                match bits {
                    4 => unpack::<4, 8>(ws, s, b, o),
                    8 => unpack::<8, 4>(ws, s, b, o),
                    _ => unpack::<2, 16>(ws, s, b, o),
                }
            }
        }
    }
}

/// o = s·q + b for the `PER = 32 / BITS` codes of each word (lowest bits first).
#[inline(always)]
fn unpack<const BITS: u32, const PER: usize>(words: &[u32], s: f32, b: f32, o: &mut [f32]) {
    let mask = (1u32 << BITS) - 1;
    for (w, oc) in words.iter().zip(o.as_chunks_mut::<PER>().0) {
        for (i, v) in oc.iter_mut().enumerate() {
            *v = s.mul_add(((w >> (BITS * i as u32)) & mask) as f32, b);
        }
    }
}

/// Weight rows handled by one task: enough work (≥ 64K multiply-adds) that scheduling is
/// cheap next to it, and at most a few tasks per thread to balance the load.
fn rows_per_task(n: usize, k: usize, t: usize) -> usize {
    let min_rows = (1usize << 16).div_ceil((k * t).max(1));
    let balanced = n.div_ceil(4 * rayon::current_num_threads());
    min_rows.max(balanced).max(R).next_multiple_of(R)
}
/// Register tile of the micro-kernel: R weight rows × C tokens, 8 lanes each.
const R: usize = 4;
const C: usize = 2;

/// out[r][c] = w[r]·x[c] for an R×C tile (k = common length); AVX2 keeps the 8 accumulators,
/// 4 weight vectors and 2 token vectors in registers, so each load feeds 2–4 FMAs.
#[inline(always)]
fn tile(w: [&[f32]; R], x: [&[f32]; C]) -> [[f32; C]; R] {
    let k = x[0].len();
    let xc: [&[[f32; 8]]; C] = std::array::from_fn(|c| x[c].as_chunks::<8>().0);
    let wc: [&[[f32; 8]]; R] = std::array::from_fn(|r| w[r][..k].as_chunks::<8>().0);
    let n = xc[0].len();
    let mut acc = [[[0f32; 8]; C]; R];
    for i in 0..n {
        let xv: [[f32; 8]; C] = std::array::from_fn(|c| xc[c][i]);
        for r in 0..R {
            let wv = wc[r][i];
            for c in 0..C {
                for l in 0..8 {
                    acc[r][c][l] = wv[l].mul_add(xv[c][l], acc[r][c][l]);
                }
            }
        }
    }
    let full = n * 8;
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let a = &acc[r][c];
            let mut s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            for j in full..k {
                s = w[r][j].mul_add(x[c][j], s);
            }
            out[r][c] = s;
        }
    }
    out
}

/// Rows `r0..r0+n` of the output, transposed ([n, t]), from decoded weight rows `bufs`.
fn rows_times_tokens(bufs: &[Vec<f32>], x: &CpuTensor, o: &mut [f32]) {
    let (t, k) = (x.rows, x.cols);
    let n = bufs.len();
    let mut r = 0;
    while r < n {
        if r + R <= n {
            let w: [&[f32]; R] = std::array::from_fn(|i| bufs[r + i].as_slice());
            let mut ti = 0;
            while ti + C <= t {
                let xs: [&[f32]; C] = std::array::from_fn(|c| &x.data[(ti + c) * k..(ti + c + 1) * k]);
                let v = tile(w, xs);
                for i in 0..R {
                    for c in 0..C {
                        o[(r + i) * t + ti + c] = v[i][c];
                    }
                }
                ti += C;
            }
            for tt in ti..t {
                for i in 0..R {
                    o[(r + i) * t + tt] = dot(&x.data[tt * k..(tt + 1) * k], w[i]);
                }
            }
            r += R;
        } else {
            for tt in 0..t {
                o[r * t + tt] = dot(&x.data[tt * k..(tt + 1) * k], &bufs[r]);
            }
            r += 1;
        }
    }
}

/// [T, in] · [out, in]ᵀ -> [T, out].
pub fn matmul(x: &CpuTensor, w: &LinearWeight) -> CpuTensor {
    assert_eq!(x.cols, w.cols, "matmul: x has {} columns, the weight {}", x.cols, w.cols);
    let (t, k, n) = (x.rows, x.cols, w.rows);
    // out_t is [n, t]: each task owns whole weight rows, decoded once for all tokens.
    let mut out_t = vec![0f32; n * t];
    let per_task = rows_per_task(n, k, t);
    out_t.par_chunks_mut(per_task * t).enumerate().for_each(|(ci, chunk)| {
        let rows = chunk.len() / t;
        let bufs: Vec<Vec<f32>> = (0..rows)
            .map(|ri| {
                let mut b = vec![0f32; k];
                decode_row(w, ci * per_task + ri, &mut b);
                b
            })
            .collect();
        rows_times_tokens(&bufs, x, chunk);
    });
    if t == 1 {
        return CpuTensor::from_vec(1, n, out_t);
    }
    let mut out = vec![0f32; t * n];
    for r in 0..n {
        for ti in 0..t {
            out[ti * n + r] = out_t[r * t + ti];
        }
    }
    CpuTensor::from_vec(t, n, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchid_model::linear::AffineWeight;
    use orchid_model::storage::Bytes;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    fn reference(x: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0f64; t * n];
        for i in 0..t {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
            }
        }
        out
    }

    fn rel_err(a: &[f32], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    #[test]
    fn dense_and_affine_match_reference() {
        for &(t, k, n) in &[(1, 64, 3), (5, 128, 17), (65, 256, 9)] {
            let x = rand(t * k, 1);
            let wv = rand(n * k, 2);
            let w = LinearWeight::dense_f32(&wv, n, k);
            let y = matmul(&CpuTensor::from_vec(t, k, x.clone()), &w);
            assert!(rel_err(&y.data, &reference(&x, &wv, t, k, n)) < 1e-6);
            for bits in [4u32, 8] {
                let mut packed = Vec::new();
                let mut sc = Vec::new();
                let mut bi = Vec::new();
                for r in 0..n {
                    let (p, s, b) = orchid_model::quant::quantize_row(&wv[r * k..(r + 1) * k], bits, 32);
                    packed.extend(p.iter().flat_map(|w| w.to_le_bytes()));
                    sc.extend(s);
                    bi.extend(b);
                }
                let aw = LinearWeight {
                    rows: n,
                    cols: k,
                    data: WeightData::Affine(AffineWeight {
                        packed: Bytes::from_vec(packed).aligned::<u32>(),
                        scales: Bytes::from_vec(orchid_model::dtype::from_f32(DType::F32, &sc)),
                        biases: Bytes::from_vec(orchid_model::dtype::from_f32(DType::F32, &bi)),
                        sb_dtype: DType::F32,
                        bits,
                        group: 32,
                    }),
                };
                let deq = aw.to_f32();
                let y = matmul(&CpuTensor::from_vec(t, k, x.clone()), &aw);
                assert!(rel_err(&y.data, &reference(&x, &deq, t, k, n)) < 1e-6);
            }
        }
    }
}
