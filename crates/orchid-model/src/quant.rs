//! MLX affine quantization (docs/model.md §7.6): groups of `group` consecutive input elements
//! share a scale and a bias; `w = scale * q + bias` with unsigned `q` of `bits` bits packed
//! into little-endian u32 words, lowest bits first. Scales may be negative.

/// Bit widths this engine runs (each packs evenly into u32 words).
pub const SUPPORTED_BITS: [u32; 3] = [2, 4, 8];

/// Dequantizes one row: `packed` holds `out.len() * bits / 32` words, `scales`/`biases` one
/// value per group.
pub fn dequant_row(packed: &[u32], scales: &[f32], biases: &[f32], bits: u32, group: usize, out: &mut [f32]) {
    let per_word = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    for (g, chunk) in out.chunks_mut(group).enumerate() {
        let (s, b) = (scales[g], biases[g]);
        let words = &packed[g * group / per_word..(g + 1) * group / per_word];
        for (w, vals) in words.iter().zip(chunk.chunks_mut(per_word)) {
            for (i, v) in vals.iter_mut().enumerate() {
                *v = s * ((w >> (bits as usize * i)) & mask) as f32 + b;
            }
        }
    }
}

/// Quantizes one row exactly as MLX's `quantize` does (f32 arithmetic, round half to even):
/// returns (packed words, scales, biases) with scales/biases in f32 (the caller rounds them to
/// the storage dtype).
pub fn quantize_row(w: &[f32], bits: u32, group: usize) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    assert!(w.len().is_multiple_of(group) && group.is_multiple_of(32 / bits as usize));
    let n_bins = ((1u32 << bits) - 1) as f32;
    let per_word = (32 / bits) as usize;
    let mut packed = Vec::with_capacity(w.len() / per_word);
    let mut scales = Vec::with_capacity(w.len() / group);
    let mut biases = Vec::with_capacity(w.len() / group);
    for g in w.chunks(group) {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for &x in g {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        let neg_edge = lo.abs() > hi.abs();
        let mut scale = ((hi - lo) / n_bins).max(1e-7);
        if !neg_edge {
            scale = -scale;
        }
        let edge = if neg_edge { lo } else { hi };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for vals in g.chunks(per_word) {
            let mut word = 0u32;
            for (i, &x) in vals.iter().enumerate() {
                let q = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32;
                word |= q << (bits as usize * i);
            }
            packed.push(word);
        }
        scales.push(scale);
        biases.push(bias);
    }
    (packed, scales, biases)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_bit_order() {
        // docs/model.md §7.6: bytes a9 49 9b a6 decode to 9,10,9,4,11,9,6,10.
        let w = u32::from_le_bytes([0xa9, 0x49, 0x9b, 0xa6]);
        let mut out = vec![0f32; 8];
        dequant_row(&[w], &[1.0], &[0.0], 4, 8, &mut out);
        assert_eq!(out, vec![9., 10., 9., 4., 11., 9., 6., 10.]);
    }

    #[test]
    fn quantize_roundtrip_error_is_small() {
        let w: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 70.0).collect();
        // (2-bit groups can clamp at the far edge: MLX anchors one edge exactly.)
        for bits in [4, 8] {
            let (p, s, b) = quantize_row(&w, bits, 64);
            let mut out = vec![0f32; w.len()];
            dequant_row(&p, &s, &b, bits, 64, &mut out);
            // Anchoring one edge exactly can clamp the other by up to one step.
            let step = 2.0 * 0.72 / ((1u32 << bits) - 1) as f32;
            for (x, y) in w.iter().zip(&out) {
                assert!((x - y).abs() <= step, "bits {bits}: {x} vs {y}");
            }
        }
    }
}
