//! Thin launchers, one file per kernel file (`ops/X.rs` launches `kernels/X.cu`): the argument
//! structs (defined once, in `crate::abi`), shape checks, and the choice of kernel variant (pure
//! functions, unit-tested).

use std::collections::HashMap;
use std::sync::Arc;

use orchid_model::error::{Error, Result};

use crate::driver::{DevBuf, Gpu, Kernel};
use crate::options::{CudaOptions, Tuning};

pub mod attention;
pub mod deltanet;
pub mod elementwise;
pub mod gemm;
pub mod gemv;
pub mod logprobs;
pub mod moe;
pub mod moe_decode;
pub mod sampling;

/// The GPU, every loaded kernel and the launch-shape options.
pub struct Ctx {
    pub gpu: Arc<Gpu>,
    pub tuning: Tuning,
    /// Whether the decode graph chains its kernels with programmatic dependent launch.
    pub pdl: bool,
    /// The arrival counter of the router matvec's top-k epilogue outside the decode graph
    /// (`gemv::RouteEpi`): zero between launches (the last block resets it), so every router
    /// launch on the stream shares it.
    pub route_counter: DevBuf,
    /// The grid barriers of the router fused into a decode MoE (`moe_decode::moe_route_up`, two
    /// u32 counters per token, up to `moe_decode::ROUTE_ROWS_MAX` tokens, that the kernel
    /// resets), shared the same way.
    pub route_barrier: DevBuf,
    kernels: HashMap<&'static str, Kernel>,
}

impl Ctx {
    /// Compiles (or loads from the cache) every kernel file, in parallel.
    pub fn new(gpu: Arc<Gpu>, opts: &CudaOptions) -> Result<Ctx> {
        let target = crate::compile::target_for(gpu.cc);
        let compiler = crate::compile::Compiler::new(opts);
        let files = crate::compile::KERNEL_FILES;
        let cubins: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let hs: Vec<_> = files.iter().map(|f| s.spawn(|| compiler.compile(f, &target))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Backend("kernel compile thread panicked".into())))).collect()
        });
        gpu.bind()?;
        let mut kernels = HashMap::new();
        for (f, cubin) in files.iter().zip(cubins) {
            for k in crate::driver::load_module(&gpu, &cubin?, f.kernels)? {
                kernels.insert(k.name, k);
            }
        }
        // The GEMMs run up to two blocks of ~110 KB per SM: ask for the largest shared-memory
        // carveout (a hint; the driver may also pick it on its own, so a refusal is ignored).
        for (name, k) in kernels.iter() {
            if name.starts_with("gemm_") {
                use cudarc::driver::sys;
                // SAFETY: a live function handle of a loaded module; the value is a percentage.
                let _ = unsafe {
                    sys::cuFuncSetAttribute(k.f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                };
            }
        }
        let pdl = opts.pdl && gpu.cc.0 >= 9;
        let route_counter = DevBuf::zeros(&gpu, 4)?;
        let route_barrier = DevBuf::zeros(&gpu, 8 * moe_decode::ROUTE_ROWS_MAX)?;
        Ok(Ctx { gpu, tuning: opts.tuning.clamped(), pdl, route_counter, route_barrier, kernels })
    }

    /// The same GPU and kernels with other launch shapes (clamped).
    pub fn with_tuning(&self, tuning: &Tuning) -> Result<Ctx> {
        self.gpu.bind()?;
        Ok(Ctx {
            gpu: self.gpu.clone(),
            tuning: tuning.clamped(),
            pdl: self.pdl,
            route_counter: DevBuf::zeros(&self.gpu, 4)?,
            route_barrier: DevBuf::zeros(&self.gpu, 8 * moe_decode::ROUTE_ROWS_MAX)?,
            kernels: self.kernels.clone(),
        })
    }

    pub fn k(&self, name: &str) -> Kernel {
        *self.kernels.get(name).unwrap_or_else(|| panic!("kernel {name} is not loaded"))
    }
}

#[macro_export]
#[doc(hidden)]
macro_rules! params {
    ($($v:expr),*) => { &mut [$( &$v as *const _ as *mut std::ffi::c_void ),*] };
}
pub(crate) use params;
