//! Small vector kernels. Written so the compiler vectorises them (8-lane chunks, FMA); the
//! workspace builds for x86-64-v3 (AVX2 + FMA), see `.cargo/config.toml`.

/// Σ a_i·b_i over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (ac, at) = a[..n].as_chunks::<8>();
    let (bc, bt) = b[..n].as_chunks::<8>();
    let mut acc = [0f32; 8];
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in at.iter().zip(bt) {
        s = x.mul_add(*y, s);
    }
    s
}

/// y += alpha·x.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dot_matches_f64() {
        let a: Vec<f32> = (0..1003).map(|i| ((i * 7919) % 997) as f32 / 997.0 - 0.5).collect();
        let b: Vec<f32> = (0..1003).map(|i| ((i * 104729) % 991) as f32 / 991.0 - 0.5).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((super::dot(&a, &b) as f64 - want).abs() < 1e-4);
    }
}
