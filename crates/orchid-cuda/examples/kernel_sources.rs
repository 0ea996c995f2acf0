//! Writes the exact text NVRTC compiles for each kernel file (common.cuh, the generated ABI,
//! headers, the file) to `DIR/<name>.cu`, for offline tools (`scripts/kernel-resources.sh`).
//!
//!   cargo run --release -p orchid-cuda --example kernel_sources -- DIR

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: kernel_sources DIR"));
    std::fs::create_dir_all(&dir).expect("create DIR");
    for f in orchid_cuda::compile::KERNEL_FILES {
        let p = dir.join(format!("{}.cu", f.name));
        std::fs::write(&p, f.full_source()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        println!("{}", p.display());
    }
}
