//! Kernel sources (embedded with `include_str!`) compiled with NVRTC for the GPU found, to a
//! cubin (sm_90a on Hopper, so that Hopper-only instructions are available), cached on disk.
//!
//! Cache key: FNV-1a of (source, target, NVRTC version, options); folder: `CudaOptions::kernel_cache`.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys as nv;
use orchid_model::error::{Error, Result};

use crate::ops::{attention, deltanet, gemm, gemv, logprobs, moe, moe_decode, sampling};
use crate::options::CudaOptions;
use crate::weights::format_abi;

pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel file: `kernels/{name}.cu`, launched by `ops/{name}.rs`.
pub struct KernelFile {
    pub name: &'static str,
    /// The CUDA definitions of the argument structs and constants it uses (`crate::abi`).
    pub abi: &'static [fn() -> String],
    /// Headers it includes after common.cuh: (file name, source).
    pub headers: &'static [(&'static str, &'static str)],
    pub source: &'static str,
    /// Its `extern "C"` kernels.
    pub kernels: &'static [&'static str],
}

const MATVEC: (&str, &str) = ("matvec.cuh", include_str!("../kernels/matvec.cuh"));

/// Every kernel file, compiled in parallel at start (`ops::Ctx::new`).
pub const KERNEL_FILES: &[KernelFile] = &[
    KernelFile {
        name: "elementwise",
        abi: &[],
        headers: &[],
        source: include_str!("../kernels/elementwise.cu"),
        kernels: &["rms_norm", "add_rms_norm", "add_assign", "zero_words", "silu_mul", "gather_rows", "embed_q4", "embed_bf16"],
    },
    KernelFile {
        name: "gemv",
        abi: &[format_abi, gemv::matvec_abi, gemv::gemv_abi],
        headers: &[MATVEC],
        source: include_str!("../kernels/gemv.cu"),
        kernels: &["gemv_q4", "gemv_bf16", "gemv_q4_stream", "gemv_bf16_stream"],
    },
    KernelFile {
        name: "moe_decode",
        abi: &[format_abi, gemv::matvec_abi, moe_decode::moe_decode_abi],
        headers: &[MATVEC],
        source: include_str!("../kernels/moe_decode.cu"),
        kernels: &[
            "moe_up_q4",
            "moe_up_bf16",
            "moe_route_up_q4",
            "moe_down_q4",
            "moe_down_bf16",
            "moe_up_rows_q4",
            "moe_up_rows_bf16",
            "moe_route_up_rows_q4",
            "moe_down_rows_q4",
            "moe_down_rows_bf16",
        ],
    },
    KernelFile {
        name: "gemm",
        abi: &[format_abi, gemm::gemm_abi],
        headers: &[],
        source: include_str!("../kernels/gemm.cu"),
        kernels: &[
            "gemm_q4_n8",
            "gemm_q4_pair_n8",
            "gemm_q4_n8_ld",
            "gemm_q4_pair_n8_ld",
            "gemm_q4_n32_kc_ld",
            "gemm_q4_n32",
            "gemm_q4_pair_n32",
            "gemm_bf16_n32",
            "gemm_bf16_pair_n32",
            "gemm_q4_n64",
            "gemm_q4_n128",
            "gemm_q4_pair_n64",
            "gemm_q4_pair_n128",
            "gemm_bf16_n64",
            "gemm_bf16_n128",
            "gemm_bf16_pair_n64",
            "gemm_bf16_pair_n128",
            "gemm_q4_n32_kc",
            "gemm_q4_pair_n32_kc",
            "gemm_q4_n64_kc",
            "gemm_q4_pair_n64_kc",
            "gemm_bf16_n64_kc",
            "gemm_bf16_pair_n64_kc",
            "gemm_bf16_n128_kc",
            "gemm_bf16_pair_n128_kc",
            "gemm_q4_n64_wg",
            "gemm_q4_pair_n64_wg",
            "gemm_q4_n64_kc_wg",
            "gemm_q4_pair_n64_kc_wg",
            "gemm_q4_n64_wgr",
            "gemm_q4_pair_n64_wgr",
            "gemm_q4_n64_kc_wgr",
            "gemm_q4_pair_n64_kc_wgr",
            "gemm_xprep",
            "gemm_xprep_norm",
            "gemm_splitk_reduce",
            "gemm_splitk_reduce4",
        ],
    },
    KernelFile {
        name: "attention",
        abi: &[attention::attention_abi],
        headers: &[],
        source: include_str!("../kernels/attention.cu"),
        kernels: &[
            "attn_prep",
            "attn_combine",
            "attn_combine_rows",
            "attn_prefill_combine",
            "attn_prefill_d32",
            "attn_prefill_split_d32",
            "attn_decode_d32",
            "attn_decode_rows_d32",
            "attn_prefill_d64",
            "attn_prefill_split_d64",
            "attn_decode_d64",
            "attn_decode_rows_d64",
            "attn_prefill_d128",
            "attn_prefill_split_d128",
            "attn_decode_d128",
            "attn_decode_rows_d128",
            "attn_prefill_d256",
            "attn_prefill_split_d256",
            "attn_decode_d256",
            "attn_decode_rows_d256",
        ],
    },
    KernelFile {
        name: "deltanet",
        abi: &[deltanet::deltanet_abi],
        headers: &[],
        source: include_str!("../kernels/deltanet.cu"),
        kernels: &[
            "gdn_conv",
            "gdn_prep",
            "gdn_chunk_prep",
            "gdn_chunk_scan",
            "gdn_chunk_scan_tc",
            "gdn_chunk_scan_tc_wide",
            "gdn_gated_norm",
            "gdn_decode",
            "gdn_decode_rows",
            "gdn_decode_rows_stream",
        ],
    },
    KernelFile {
        name: "moe",
        abi: &[moe::moe_abi],
        headers: &[],
        source: include_str!("../kernels/moe.cu"),
        kernels: &["moe_topk", "moe_topk_rows", "moe_scan", "moe_lists", "moe_scatter", "moe_combine"],
    },
    KernelFile {
        name: "sampling",
        abi: &[sampling::sampling_abi],
        headers: &[],
        source: include_str!("../kernels/sampling.cu"),
        kernels: &["sample_argmax", "sample_general", "sample_argmax_rows", "sample_general_rows", "logit_adjust_rows"],
    },
    KernelFile {
        name: "logprobs",
        abi: &[sampling::sampling_abi, logprobs::logprobs_abi],
        headers: &[],
        source: include_str!("../kernels/logprobs.cu"),
        kernels: &["logprob_partials_rows", "logprob_finish_rows"],
    },
];

impl KernelFile {
    /// The text NVRTC compiles: common.cuh, the generated ABI (the structs and constants the
    /// file uses), the headers, the file; `#line` marks keep error positions
    /// in file terms.
    pub fn full_source(&self) -> String {
        let mut s =
            format!("#line 1 \"common.cuh\"\n{COMMON}\n// Generated from the Rust definitions (crate::abi).\n#line 1 \"abi.cuh\"\n");
        for abi in self.abi {
            s += &abi();
        }
        for (name, src) in self.headers {
            s += &format!("#line 1 \"{name}\"\n{src}\n");
        }
        s += &format!("#line 1 \"{}.cu\"\n{}", self.name, self.source);
        s
    }
}

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
    if r == nv::nvrtcResult::NVRTC_SUCCESS { Ok(()) } else { Err(Error::Backend(format!("nvrtc: {what}: {r:?}"))) }
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

/// NVRTC with the header folders and the cache folder of a [`CudaOptions`].
pub struct Compiler {
    includes: Vec<PathBuf>,
    cache: Option<PathBuf>,
}

impl Compiler {
    pub fn new(opts: &CudaOptions) -> Compiler {
        Compiler { includes: include_dirs(opts), cache: opts.kernel_cache.clone() }
    }

    /// Whether the CUDA headers (cuda_bf16.h) were found.
    pub fn has_headers(&self) -> bool {
        !self.includes.is_empty()
    }

    /// Compiles `file` to a cubin for `target`, or returns the cached cubin.
    pub fn compile(&self, file: &KernelFile, target: &str) -> Result<Vec<u8>> {
        let name = file.name;
        let mut opts =
            vec![format!("--gpu-architecture={target}"), "--std=c++17".to_string(), "-default-device".to_string(), "-lineinfo".to_string()];
        for i in &self.includes {
            opts.push(format!("--include-path={}", i.display()));
        }
        let full = file.full_source();
        let ver = nvrtc_version()?;
        let key = fnv1a(&[full.as_bytes(), target.as_bytes(), format!("{ver:?}").as_bytes(), opts[..4].join(" ").as_bytes()]);
        let path = self.cache.as_ref().map(|d| d.join(format!("{name}-{target}-{key:016x}.cubin")));
        if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()).filter(|b| !b.is_empty()) {
            return Ok(bytes);
        }
        let t0 = std::time::Instant::now();
        let cubin = compile_uncached(name, &full, &opts)?;
        tracing::debug!("compiled {name}.cu for {target} in {:.1}s", t0.elapsed().as_secs_f64());
        if let (Some(dir), Some(path)) = (&self.cache, &path)
            && std::fs::create_dir_all(dir).is_ok()
        {
            let tmp = dir.join(format!(".{name}-{key:016x}.{}.tmp", std::process::id()));
            if std::fs::write(&tmp, &cubin).is_ok() {
                let _ = std::fs::rename(&tmp, path);
            }
        }
        Ok(cubin)
    }
}

/// Include folders holding cuda_bf16.h (and cccl): the options' own, then each CUDA root's.
pub fn include_dirs(opts: &CudaOptions) -> Vec<PathBuf> {
    let mut out = opts.include_dirs.clone();
    for root in &opts.cuda_roots {
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

fn compile_uncached(name: &str, full: &str, opts: &[String]) -> Result<Vec<u8>> {
    let csrc = CString::new(full).map_err(|_| Error::Backend("kernel source holds a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.cu")).unwrap();
    let copts: Vec<CString> = opts.iter().map(|o| CString::new(o.as_str()).unwrap()).collect();
    let optp: Vec<*const std::ffi::c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: every pointer refers to a live CString; the program is destroyed on every path.
    unsafe {
        let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
        nvrtc_check(
            nv::nvrtcCreateProgram(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()),
            "nvrtcCreateProgram",
        )?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_is_listed_once_with_its_abi() {
        let mut names: Vec<&str> = KERNEL_FILES.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), KERNEL_FILES.len());
        for f in KERNEL_FILES {
            let src = f.full_source();
            // Each argument struct is defined once, by the generated ABI (no hand-written copy).
            for line in src.lines().filter(|l| l.starts_with("struct ") && l.ends_with("Args {")) {
                assert_eq!(src.matches(line).count(), 1, "{}: {line} defined twice", f.name);
            }
            assert!(src.contains(&format!("#line 1 \"{}.cu\"", f.name)));
        }
    }

    /// Every `__global__` entry point of a file is in its kernel list (a kernel left out compiles
    /// but is never loaded, and its first launch panics), and every listed name is defined.
    #[test]
    fn every_kernel_entry_point_is_listed() {
        for f in KERNEL_FILES {
            let src = f.source;
            // Entry points written out (those a macro body declares are checked by name below).
            let defined: Vec<String> = src
                .match_indices("__global__")
                .filter(|(i, _)| !src[..*i].trim_end_matches(|c| c != '\n').trim_end().ends_with('\\'))
                .filter_map(|(i, _)| entry_point_name(&src[i + "__global__".len()..]))
                .collect();
            for name in &defined {
                assert!(f.kernels.contains(&name.as_str()), "{}.cu defines {name}, which its kernel list lacks", f.name);
            }
            for name in f.kernels {
                // Written out, an argument of a kernel-defining macro, or a token-pasted `prefix##D`.
                let pasted = src.match_indices("##").any(|(i, _)| {
                    let prefix = &src[src[..i].rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |j| j + 1)..i];
                    !prefix.is_empty() && name.strip_prefix(prefix).is_some_and(|d| d.chars().all(|c| c.is_ascii_digit()))
                });
                let here = defined.iter().any(|d| d == name) || src.contains(&format!("({name},")) || pasted;
                assert!(here, "{}: {name} is listed but not defined", f.name);
            }
        }
    }

    /// The name in `void [__launch_bounds__(..)] name(` after a `__global__`.
    fn entry_point_name(rest: &str) -> Option<String> {
        let mut head = rest.split('{').next()?.to_string();
        if let Some(i) = head.find("__launch_bounds__(") {
            let close = i + head[i..].find(')')?;
            head.replace_range(i..=close, "");
        }
        Some(head.split('(').next()?.split_whitespace().last()?.to_string())
    }
}
