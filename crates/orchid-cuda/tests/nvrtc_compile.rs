//! Compiles every kernel family with NVRTC for sm_90a (Hopper). Needs no GPU: it runs wherever
//! libnvrtc and the CUDA headers can be found (LD_LIBRARY_PATH, ORCHID_CUDA_INCLUDE or
//! /usr/local/cuda), and prints "skipped" elsewhere.

#[test]
fn nvrtc_compiles_every_kernel_for_sm90a() {
    // SAFETY: probing only opens the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("skipped: libnvrtc not found");
        return;
    }
    if orchid_cuda::compile::include_dirs().is_empty() {
        println!("skipped: CUDA headers (cuda_bf16.h) not found; set ORCHID_CUDA_INCLUDE");
        return;
    }
    let dir = std::env::temp_dir().join(format!("orchid-nvrtc-test-{}", std::process::id()));
    // SAFETY: tests in this file run in one thread; the variable only redirects the cache.
    unsafe { std::env::set_var("ORCHID_KERNEL_CACHE", &dir) };
    let (maj, min) = orchid_cuda::compile::nvrtc_version().unwrap();
    println!("NVRTC {maj}.{min}");
    for (name, src) in orchid_cuda::compile::SOURCES {
        let t = std::time::Instant::now();
        let cubin = orchid_cuda::compile::compile(name, src, "sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.len() > 1000, "{name}: empty cubin");
        assert_eq!(&cubin[..4], b"\x7fELF", "{name}: not an ELF cubin");
        println!("{name}.cu: {} bytes in {:.1}s", cubin.len(), t.elapsed().as_secs_f64());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
