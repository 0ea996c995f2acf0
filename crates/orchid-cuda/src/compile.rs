//! Kernel sources (embedded with `include_str!`) compiled with NVRTC for the GPU found, to a
//! cubin (sm_90a on Hopper, so that Hopper-only instructions are available), cached on disk.
//!
//! Cache key: FNV-1a of (source, target, NVRTC version, options). Folder: $ORCHID_KERNEL_CACHE,
//! else $XDG_CACHE_HOME/orchid/kernels, else ~/.cache/orchid/kernels, else a temp folder.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys as nv;
use orchid_model::error::{Error, Result};

pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// The kernel families: (file stem, source).
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("../kernels/elementwise.cu")),
    ("gemv", include_str!("../kernels/gemv.cu")),
    ("gemm", include_str!("../kernels/gemm.cu")),
    ("attention", include_str!("../kernels/attention.cu")),
    ("deltanet", include_str!("../kernels/deltanet.cu")),
    ("moe", include_str!("../kernels/moe.cu")),
    ("sampling", include_str!("../kernels/sampling.cu")),
];

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

fn nvrtc_check(r: nv::nvrtcResult, what: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Backend(format!("nvrtc: {what}: {r:?}")))
    }
}

pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: out-pointers valid; the library was probed before.
    nvrtc_check(unsafe { nv::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
    Ok((a, b))
}

/// Target name for a compute capability: sm_90a on Hopper (arch-specific features), else sm_XY.
pub fn target_for(cc: (i32, i32)) -> String {
    if cc == (9, 0) { "sm_90a".to_string() } else { format!("sm_{}{}", cc.0, cc.1) }
}

/// Include folders holding cuda_bf16.h (and cccl).
pub fn include_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var("ORCHID_CUDA_INCLUDE") {
        out.extend(std::env::split_paths(&p));
    }
    for root in crate::driver::cuda_roots() {
        let inc = root.join("include");
        if inc.join("cuda_bf16.h").is_file() {
            out.push(inc.clone());
            if inc.join("cccl").is_dir() {
                out.push(inc.join("cccl"));
            }
        }
    }
    out
}

fn cache_dir() -> PathBuf {
    if let Ok(p) = std::env::var("ORCHID_KERNEL_CACHE") {
        return PathBuf::from(p);
    }
    if let Ok(p) = std::env::var("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("orchid/kernels");
    }
    if let Ok(p) = std::env::var("HOME") {
        return PathBuf::from(p).join(".cache/orchid/kernels");
    }
    std::env::temp_dir().join("orchid-kernels")
}

/// Compiles `src` (with the common header prepended) to a cubin for `target`, or returns the
/// cached cubin.
pub fn compile(name: &str, src: &str, target: &str) -> Result<Vec<u8>> {
    let incs = include_dirs();
    let mut opts = vec![format!("--gpu-architecture={target}"), "--std=c++17".to_string(), "-default-device".to_string(), "-lineinfo".to_string()];
    for i in &incs {
        opts.push(format!("--include-path={}", i.display()));
    }
    let full = format!("{COMMON}\n#line 1 \"{name}.cu\"\n{src}");
    let ver = nvrtc_version()?;
    let key = fnv1a(&[full.as_bytes(), target.as_bytes(), format!("{ver:?}").as_bytes(), opts[..4].join(" ").as_bytes()]);
    let dir = cache_dir();
    let path = dir.join(format!("{name}-{target}-{key:016x}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok(bytes);
        }
    }
    let t0 = std::time::Instant::now();
    let cubin = compile_uncached(name, &full, &opts)?;
    tracing::debug!("compiled {name}.cu for {target} in {:.1}s", t0.elapsed().as_secs_f64());
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = dir.join(format!(".{name}-{key:016x}.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}

fn compile_uncached(name: &str, full: &str, opts: &[String]) -> Result<Vec<u8>> {
    let csrc = CString::new(full).map_err(|_| Error::Backend("kernel source holds a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.cu")).unwrap();
    let copts: Vec<CString> = opts.iter().map(|o| CString::new(o.as_str()).unwrap()).collect();
    let optp: Vec<*const std::ffi::c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: every pointer refers to a live CString; the program is destroyed on every path.
    unsafe {
        let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
        nvrtc_check(nv::nvrtcCreateProgram(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()), "nvrtcCreateProgram")?;
        let r = nv::nvrtcCompileProgram(prog, optp.len() as i32, optp.as_ptr());
        let mut log_size = 0usize;
        nv::nvrtcGetProgramLogSize(prog, &mut log_size);
        let mut log = vec![0 as std::ffi::c_char; log_size.max(1)];
        nv::nvrtcGetProgramLog(prog, log.as_mut_ptr());
        let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            nv::nvrtcDestroyProgram(&mut prog);
            return Err(Error::Backend(format!("nvrtc: compiling {name}.cu failed ({r:?}):\n{log}")));
        }
        let mut size = 0usize;
        let r = nv::nvrtcGetCUBINSize(prog, &mut size);
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            nv::nvrtcDestroyProgram(&mut prog);
            return Err(Error::Backend(format!("nvrtc: nvrtcGetCUBINSize for {name}.cu: {r:?}")));
        }
        let mut cubin = vec![0u8; size];
        let r = nv::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char);
        nv::nvrtcDestroyProgram(&mut prog);
        nvrtc_check(r, "nvrtcGetCUBIN")?;
        Ok(cubin)
    }
}
