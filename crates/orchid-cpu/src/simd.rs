//! Small vector kernels, compiled a second time with AVX2+FMA and picked at run time.

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let chunks = n / 16;
    for c in 0..chunks {
        let (x, y) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for i in 0..16 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = 0f32;
    for i in chunks * 16..n {
        s = a[i].mul_add(b[i], s);
    }
    let mut t = [0f32; 8];
    for i in 0..8 {
        t[i] = acc[i] + acc[i + 8];
    }
    s + ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]))
}

#[inline(always)]
fn axpy_body(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body(alpha, x, y)
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// Σ a_i·b_i over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_body(a, b)
}

/// y += alpha·x.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { axpy_avx2(alpha, x, y) };
    }
    axpy_body(alpha, x, y)
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
