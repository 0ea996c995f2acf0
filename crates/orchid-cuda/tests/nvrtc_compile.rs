//! Compiles every kernel file with NVRTC for sm_90a (Hopper). Needs no GPU, but NVRTC and the
//! CUDA headers: `#[ignore]`d, run by scripts/gpu-build.sh (with the NVRTC of the pip wheels,
//! see docs/cuda.md) and scripts/gpu-test.sh with `--ignored`. The headers: ORCHID_CUDA_INCLUDE
//! (a path list) or /usr/local/cuda/include. With ORCHID_NVRTC_OUT=DIR the cubins are kept there
//! (for `cuobjdump --dump-resource-usage`: registers, spills and shared memory per kernel).

#[test]
#[ignore = "needs NVRTC and the CUDA headers"]
fn nvrtc_compiles_every_kernel_for_sm90a() {
    // SAFETY: probing only opens the library.
    assert!(unsafe { cudarc::nvrtc::sys::is_culib_present() }, "libnvrtc not found (LD_LIBRARY_PATH)");
    let keep = std::env::var_os("ORCHID_NVRTC_OUT").map(std::path::PathBuf::from);
    let dir = keep.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("orchid-nvrtc-test-{}", std::process::id())));
    let include_dirs = std::env::var_os("ORCHID_CUDA_INCLUDE").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    let opts = orchid_cuda::CudaOptions { kernel_cache: Some(dir.clone()), include_dirs, ..Default::default() };
    let compiler = orchid_cuda::compile::Compiler::new(&opts);
    assert!(compiler.has_headers(), "CUDA headers (cuda_bf16.h) not found: set ORCHID_CUDA_INCLUDE");
    let (maj, min) = orchid_cuda::compile::nvrtc_version().unwrap();
    println!("NVRTC {maj}.{min}");
    for f in orchid_cuda::compile::KERNEL_FILES {
        let t = std::time::Instant::now();
        let cubin = compiler.compile(f, "sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.len() > 1000, "{}: empty cubin", f.name);
        assert_eq!(&cubin[..4], b"\x7fELF", "{}: not an ELF cubin", f.name);
        println!("{}.cu: {} bytes in {:.1}s", f.name, cubin.len(), t.elapsed().as_secs_f64());
    }
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
