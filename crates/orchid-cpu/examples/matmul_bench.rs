use orchid_cpu::matmul::matmul;
use orchid_cpu::tensor::CpuTensor;
use orchid_model::linear::LinearWeight;
fn main() {
    let (t, k, n) = (512usize, 384usize, 1536usize);
    let x = CpuTensor::from_vec(t, k, (0..t * k).map(|i| (i % 97) as f32 / 97.0).collect());
    let wv: Vec<f32> = (0..n * k).map(|i| (i % 89) as f32 / 89.0 - 0.5).collect();
    let w = LinearWeight::dense_f32(&wv, n, k);
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let _ = matmul(&x, &w);
            let t0 = std::time::Instant::now();
            let iters = 20;
            for _ in 0..iters {
                std::hint::black_box(matmul(&x, &w));
            }
            let s = t0.elapsed().as_secs_f64() / iters as f64;
            println!("threads {threads}: {:.2} ms, {:.1} GFLOP/s", s * 1e3, 2.0 * (t * k * n) as f64 / s / 1e9);
        });
    }
}
