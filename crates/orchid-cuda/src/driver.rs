//! The thin layer over the CUDA driver API (through cudarc's `sys` bindings, loaded at run time):
//! probing, one context and stream, device memory with a byte count and peak, module loading,
//! kernel launches with a by-value argument struct, events and graph capture.
//!
//! Every call checks its return code; a missing library or device is an error, never a panic.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys;
use orchid_model::error::{Error, Result};

use crate::options::CudaOptions;

pub type DevPtr = sys::CUdeviceptr;

pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName only writes a pointer to a static string.
    let n = unsafe {
        sys::cuGetErrorName(r, &mut name);
        if name.is_null() { format!("{r:?}") } else { std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned() }
    };
    Err(Error::Backend(format!("cuda: {what}: {n}")))
}

/// Makes NVRTC loadable when it lives in the toolkit folder rather than the loader's path: the
/// library is opened once by its full path, so that cudarc's later open by name finds it.
fn preload_nvrtc(roots: &[std::path::PathBuf]) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: probing only opens the library.
        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return;
        }
        for root in roots {
            for lib in ["lib64/libnvrtc.so.13", "lib64/libnvrtc.so.12", "lib64/libnvrtc.so", "lib/libnvrtc.so.13"] {
                let p = root.join(lib);
                if p.is_file() {
                    let c = std::ffi::CString::new(p.to_string_lossy().as_bytes()).unwrap();
                    // SAFETY: dlopen of a shared library by path; the handle is leaked on purpose
                    // so the library stays loaded for the process.
                    let h = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
                    if !h.is_null() {
                        return;
                    }
                }
            }
        }
    });
}

const RTLD_NOW: i32 = 2;
const RTLD_GLOBAL: i32 = 0x100;
unsafe extern "C" {
    fn dlopen(filename: *const std::ffi::c_char, flag: i32) -> *mut c_void;
}

/// Why CUDA cannot be used here, or Ok when a usable GPU is present (NVRTC is also looked for
/// under `opts.cuda_roots`).
pub fn probe(opts: &CudaOptions) -> std::result::Result<(), String> {
    // SAFETY: opening the driver library is side-effect free.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found: no NVIDIA driver on this machine".into());
    }
    // SAFETY: the library is present (checked above).
    unsafe {
        if sys::cuInit(0) != sys::CUresult::CUDA_SUCCESS {
            return Err("cuInit failed: the NVIDIA driver is installed but no usable GPU was found".into());
        }
        let mut n = 0;
        if sys::cuDeviceGetCount(&mut n) != sys::CUresult::CUDA_SUCCESS || n == 0 {
            return Err("no CUDA device found".into());
        }
    }
    preload_nvrtc(&opts.cuda_roots);
    // SAFETY: probing only opens the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so) was not found: set LD_LIBRARY_PATH to the CUDA toolkit's lib64 (e.g. /usr/local/cuda/lib64)".into()
        );
    }
    Ok(())
}

/// True when `probe` succeeds (used by `--device auto`).
pub fn available(opts: &CudaOptions) -> bool {
    probe(opts).is_ok()
}

/// Device memory accounting: bytes currently allocated through this crate, and the peak.
#[derive(Default)]
pub struct MemStats {
    pub current: AtomicUsize,
    pub peak: AtomicUsize,
}

/// The GPU: context, stream and memory pool. Shared (Arc) by buffers, which free themselves.
pub struct Gpu {
    pub ctx: sys::CUcontext,
    pub dev: sys::CUdevice,
    pub stream: sys::CUstream,
    pub name: String,
    pub cc: (i32, i32),
    pub sms: i32,
    pub total_mem: usize,
    pub max_smem_optin: i32,
    pub mem: MemStats,
    /// Synchronise after every launch outside a capture (`CudaOptions::sync_check`).
    pub sync_check: bool,
}

// SAFETY: CUDA driver handles may be used from any thread once the context is made current on
// it (`Gpu::bind` does that at every entry point); the driver API itself is thread-safe.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    pub fn new(ordinal: i32, opts: &CudaOptions) -> Result<Arc<Gpu>> {
        probe(opts).map_err(Error::Backend)?;
        // SAFETY: the driver is loaded and initialised (probe); every out-pointer is valid.
        unsafe {
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut stream = std::ptr::null_mut();
            check(sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "cuStreamCreate")?;
            let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
                let mut v = 0;
                check(sys::cuDeviceGetAttribute(&mut v, a, dev), "cuDeviceGetAttribute")?;
                Ok(v)
            };
            use sys::CUdevice_attribute::*;
            let cc = (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
            let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let max_smem_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            let mut name = [0 as std::ffi::c_char; 256];
            check(sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev), "cuDeviceGetName")?;
            let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut total_mem = 0usize;
            check(sys::cuDeviceTotalMem_v2(&mut total_mem, dev), "cuDeviceTotalMem")?;
            // Keep freed stream-ordered memory in the pool instead of returning it to the OS.
            let mut pool = std::ptr::null_mut();
            check(sys::cuDeviceGetDefaultMemPool(&mut pool, dev), "cuDeviceGetDefaultMemPool")?;
            let mut thr: u64 = u64::MAX;
            check(
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut thr as *mut u64 as *mut c_void,
                ),
                "cuMemPoolSetAttribute",
            )?;
            if cc.0 < 8 {
                return Err(Error::Backend(format!(
                    "{name} has compute capability {}.{}; orchid needs 8.0 or newer (bf16 tensor cores)",
                    cc.0, cc.1
                )));
            }
            Ok(Arc::new(Gpu {
                ctx,
                dev,
                stream,
                name,
                cc,
                sms,
                total_mem,
                max_smem_optin,
                mem: MemStats::default(),
                sync_check: opts.sync_check,
            }))
        }
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: ctx is a live primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: stream is live.
        check(unsafe { sys::cuStreamSynchronize(self.stream) }, "cuStreamSynchronize")
    }

    /// (free, total) device memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: out-pointers are valid.
        check(unsafe { sys::cuMemGetInfo_v2(&mut f, &mut t) }, "cuMemGetInfo")?;
        Ok((f, t))
    }

    pub fn reset_peak(&self) {
        self.mem.peak.store(self.mem.current.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    pub fn peak_bytes(&self) -> usize {
        self.mem.peak.load(Ordering::Relaxed)
    }

    pub fn current_bytes(&self) -> usize {
        self.mem.current.load(Ordering::Relaxed)
    }
}

/// A device allocation (stream-ordered), freed on drop; or, while an [`Arena`] is active on this
/// thread, a piece of the arena (not freed).
pub struct DevBuf {
    pub ptr: DevPtr,
    pub bytes: usize,
    gpu: Arc<Gpu>,
    owned: bool,
}

/// Where this thread's allocations go while a graph is captured (`Arena::measure` / `carve`): a
/// capture with stream-ordered allocations gets memory nodes between its kernels, which keeps
/// them from being chained by programmatic dependent launch; carving every temporary of the
/// captured step out of one preallocated buffer instead gives a graph of kernels only. The
/// arena never reuses memory: its size is the sum of the step's allocations, measured first.
pub enum Arena {
    /// Allocate as usual and add up the (aligned) bytes.
    Measure(usize),
    /// Hand out consecutive pieces of [base, base + size).
    Carve { base: DevPtr, size: usize, used: usize },
}

const ARENA_ALIGN: usize = 256;

impl Arena {
    /// Runs `f` with this thread's allocations going to `arena`; returns what `f` returned and
    /// the arena as it ended (the bytes measured or used).
    pub fn with<R>(arena: Arena, f: impl FnOnce() -> R) -> (R, Arena) {
        ARENA.with(|a| *a.borrow_mut() = Some(arena));
        let r = f();
        let a = ARENA.with(|a| a.borrow_mut().take()).expect("the arena is set");
        (r, a)
    }

    pub fn bytes(&self) -> usize {
        match self {
            Arena::Measure(n) => *n,
            Arena::Carve { used, .. } => *used,
        }
    }
}

impl DevBuf {
    pub fn alloc(gpu: &Arc<Gpu>, bytes: usize) -> Result<DevBuf> {
        let bytes = bytes.max(16);
        let carved = ARENA.with(|a| match a.borrow_mut().as_mut() {
            Some(Arena::Carve { base, size, used }) => {
                let off = used.next_multiple_of(ARENA_ALIGN);
                if off + bytes > *size {
                    return Some(Err(Error::Backend(format!("cuda: graph arena of {size} bytes exhausted"))));
                }
                *used = off + bytes;
                Some(Ok(*base + off as u64))
            }
            Some(Arena::Measure(n)) => {
                *n = n.next_multiple_of(ARENA_ALIGN) + bytes;
                None
            }
            None => None,
        });
        if let Some(ptr) = carved {
            return Ok(DevBuf { ptr: ptr?, bytes, gpu: gpu.clone(), owned: false });
        }
        let mut ptr = 0;
        // SAFETY: valid out-pointer, live stream.
        let r = unsafe { sys::cuMemAllocAsync(&mut ptr, bytes, gpu.stream) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let (free, total) = gpu.mem_info().unwrap_or((0, 0));
            return Err(Error::Backend(format!(
                "cuda: out of device memory allocating {:.1} MiB ({:.1} of {:.1} GiB free)",
                bytes as f64 / 1048576.0,
                free as f64 / 1073741824.0,
                total as f64 / 1073741824.0
            )));
        }
        check(r, "cuMemAllocAsync")?;
        let cur = gpu.mem.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        gpu.mem.peak.fetch_max(cur, Ordering::Relaxed);
        Ok(DevBuf { ptr, bytes, gpu: gpu.clone(), owned: true })
    }

    pub fn zeros(gpu: &Arc<Gpu>, bytes: usize) -> Result<DevBuf> {
        let b = DevBuf::alloc(gpu, bytes)?;
        b.memset0()?;
        Ok(b)
    }

    pub fn from_slice<T: bytemuck::Pod>(gpu: &Arc<Gpu>, v: &[T]) -> Result<DevBuf> {
        let bytes: &[u8] = bytemuck::cast_slice(v);
        let b = DevBuf::alloc(gpu, bytes.len())?;
        b.upload(0, bytes)?;
        Ok(b)
    }

    /// Copies host bytes to offset `off`. Pageable memory: the driver stages the data before
    /// returning, so `data` may be dropped right after.
    pub fn upload(&self, off: usize, data: &[u8]) -> Result<()> {
        assert!(off + data.len() <= self.bytes, "upload out of range");
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked; source valid for the call.
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(self.ptr + off as u64, data.as_ptr() as *const c_void, data.len(), self.gpu.stream) },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Copies `out.len()` bytes from offset `off` to the host and waits.
    pub fn download(&self, off: usize, out: &mut [u8]) -> Result<()> {
        assert!(off + out.len() <= self.bytes, "download out of range");
        // SAFETY: range checked; the stream is synchronised before `out` is used.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, self.ptr + off as u64, out.len(), self.gpu.stream),
                "cuMemcpyDtoHAsync",
            )?;
        }
        self.gpu.synchronize()
    }

    pub fn memset0(&self) -> Result<()> {
        // SAFETY: whole allocation.
        check(unsafe { sys::cuMemsetD8Async(self.ptr, 0, self.bytes, self.gpu.stream) }, "cuMemsetD8Async")
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: ptr came from cuMemAllocAsync on this stream; later work on the stream is
        // ordered after every earlier use.
        unsafe {
            sys::cuCtxSetCurrent(self.gpu.ctx);
            sys::cuMemFreeAsync(self.ptr, self.gpu.stream);
        }
        self.gpu.mem.current.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Device-to-device copy on the stream.
pub fn copy_d2d(gpu: &Gpu, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
    // SAFETY: callers pass live ranges.
    check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, gpu.stream) }, "cuMemcpyDtoDAsync")
}

thread_local! {
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PDL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PROFILE: std::cell::RefCell<Option<Vec<(&'static str, Event)>>> = const { std::cell::RefCell::new(None) };
    static ARENA: std::cell::RefCell<Option<Arena>> = const { std::cell::RefCell::new(None) };
}

/// Starts recording an event after every launch of this thread (inside a graph capture too,
/// as external event-record nodes), for per-kernel timing.
pub fn profile_begin(gpu: &Gpu) -> Result<()> {
    let first = Event::new()?;
    first.record(gpu)?;
    PROFILE.with(|p| *p.borrow_mut() = Some(vec![("start", first)]));
    Ok(())
}

/// Starts recording inside a graph capture (the start marker is an external record node).
pub fn profile_begin_capture() -> Result<()> {
    PROFILE.with(|p| *p.borrow_mut() = Some(Vec::new()));
    Ok(())
}

/// Stops recording; returns (kernel, event) pairs, the first being the start marker.
pub fn profile_end() -> Vec<(&'static str, Event)> {
    PROFILE.with(|p| p.borrow_mut().take()).unwrap_or_default()
}

/// Sums the time between consecutive events per kernel name: (name, launches, total ms), largest first.
pub fn profile_summary(events: &[(&'static str, Event)]) -> Result<Vec<(&'static str, usize, f64)>> {
    let mut acc: Vec<(&'static str, usize, f64)> = Vec::new();
    for w in events.windows(2) {
        if w[0].1.ev.is_null() {
            continue;
        }
        let ms = w[0].1.elapsed_ms(&w[1].1)? as f64;
        match acc.iter_mut().find(|a| a.0 == w[1].0) {
            Some(a) => {
                a.1 += 1;
                a.2 += ms;
            }
            None => acc.push((w[1].0, 1, ms)),
        }
    }
    acc.sort_by(|a, b| b.2.total_cmp(&a.2));
    Ok(acc)
}

/// While on (this thread), launches carry the programmatic-stream-serialization attribute
/// (programmatic dependent launch, Hopper+): the kernel may start while the previous one on the
/// stream still runs, and must call `pdl_wait()` (kernels/common.cuh) before it reads anything
/// that kernel or an earlier one wrote. The decode graph turns it on for its kernels.
pub fn set_pdl(on: bool) {
    PDL.with(|p| p.set(on));
}

/// A loaded kernel.
#[derive(Clone, Copy)]
pub struct Kernel {
    pub f: sys::CUfunction,
    pub name: &'static str,
}

// SAFETY: function handles are immutable once loaded.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// How many blocks of `block` threads with `smem` bytes of dynamic shared memory one SM holds.
    pub fn max_active_blocks(&self, block: u32, smem: u32) -> Result<usize> {
        let mut n = 0;
        // SAFETY: a live function handle; valid out-pointer.
        check(unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.f, block as i32, smem as usize) }, self.name)?;
        Ok(n.max(0) as usize)
    }

    /// Launches with one by-value argument struct `A` (laid out `#[repr(C)]` like the CUDA
    /// struct of the same name).
    pub fn launch<A>(&self, gpu: &Gpu, grid: (u32, u32, u32), block: u32, smem: u32, args: &A) -> Result<()> {
        // kernelParams[0] points at the struct itself; the driver copies size_of::<A>() bytes.
        self.launch_raw(gpu, grid, block, smem, &mut [args as *const A as *mut c_void])
    }

    /// Launches with a list of pointers to the arguments.
    pub fn launch_raw(&self, gpu: &Gpu, grid: (u32, u32, u32), block: u32, smem: u32, params: &mut [*mut c_void]) -> Result<()> {
        self.launch_ex(gpu, grid, None, block, smem, params)
    }

    /// `launch` as thread-block clusters of `cluster` blocks (compute capability 9.0+; the grid a
    /// multiple of it in each dimension).
    pub fn launch_cluster<A>(
        &self,
        gpu: &Gpu,
        grid: (u32, u32, u32),
        cluster: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &A,
    ) -> Result<()> {
        self.launch_ex(gpu, grid, Some(cluster), block, smem, &mut [args as *const A as *mut c_void])
    }

    fn launch_ex(
        &self,
        gpu: &Gpu,
        grid: (u32, u32, u32),
        cluster: Option<(u32, u32, u32)>,
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let pdl = PDL.with(|p| p.get());
        let r = if pdl || cluster.is_some() {
            // SAFETY: the attributes and config live across the call; as below for the rest.
            unsafe {
                let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
                let mut n = 0;
                if pdl {
                    attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                    attrs[n].value.programmaticStreamSerializationAllowed = 1;
                    n += 1;
                }
                if let Some((x, y, z)) = cluster {
                    attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                    attrs[n].value.clusterDim.x = x;
                    attrs[n].value.clusterDim.y = y;
                    attrs[n].value.clusterDim.z = z;
                    n += 1;
                }
                let cfg = sys::CUlaunchConfig {
                    gridDimX: grid.0,
                    gridDimY: grid.1,
                    gridDimZ: grid.2,
                    blockDimX: block,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: smem,
                    hStream: gpu.stream,
                    attrs: attrs.as_mut_ptr(),
                    numAttrs: n as u32,
                };
                sys::cuLaunchKernelEx(&cfg, self.f, params.as_mut_ptr(), std::ptr::null_mut())
            }
        } else {
            // SAFETY: the function handle is live; params point at values that outlive the call
            // (the driver copies them at launch).
            unsafe {
                sys::cuLaunchKernel(
                    self.f,
                    grid.0,
                    grid.1,
                    grid.2,
                    block,
                    1,
                    1,
                    smem,
                    gpu.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
        };
        check(r, self.name)?;
        let prof = PROFILE.with(|p| p.borrow().is_some());
        if prof {
            let ev = Event::new()?;
            if CAPTURING.with(|c| c.get()) {
                // SAFETY: live event and capturing stream; an external record becomes a graph node.
                check(
                    unsafe {
                        sys::cuEventRecordWithFlags(ev.ev, gpu.stream, sys::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL as u32)
                    },
                    "cuEventRecordWithFlags",
                )?;
            } else {
                ev.record(gpu)?;
            }
            PROFILE.with(|p| {
                let mut p = p.borrow_mut();
                let v = p.as_mut().unwrap();
                if v.is_empty() {
                    // First launch inside a capture: its time is measured from the step's start,
                    // which the sampler of the previous step marks; use a zero-length entry.
                    v.push(("start", Event { ev: std::ptr::null_mut() }));
                }
                v.push((self.name, ev));
            });
        }
        if gpu.sync_check && !CAPTURING.with(|c| c.get()) {
            // Debug mode (`CudaOptions::sync_check`): wait for every kernel so a fault names it.
            // SAFETY: live stream.
            check(unsafe { sys::cuStreamSynchronize(gpu.stream) }, self.name)?;
        }
        Ok(())
    }
}

/// Loads a cubin and resolves the named kernels; allows each the device's full opt-in shared memory.
pub fn load_module(gpu: &Gpu, image: &[u8], names: &[&'static str]) -> Result<Vec<Kernel>> {
    let mut module = std::ptr::null_mut();
    // SAFETY: image is a complete cubin; the module is kept for the process (never unloaded).
    unsafe {
        check(sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void), "cuModuleLoadData")?;
        names
            .iter()
            .map(|&n| {
                let c = std::ffi::CString::new(n).unwrap();
                let mut f = std::ptr::null_mut();
                check(sys::cuModuleGetFunction(&mut f, module, c.as_ptr()), n)?;
                // Dynamic + static shared memory may not exceed the opt-in limit.
                let mut stat = 0;
                check(sys::cuFuncGetAttribute(&mut stat, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f), n)?;
                check(
                    sys::cuFuncSetAttribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        gpu.max_smem_optin - stat,
                    ),
                    n,
                )?;
                Ok(Kernel { f, name: n })
            })
            .collect()
    }
}

/// A CUDA event for timing.
pub struct Event {
    ev: sys::CUevent,
}

// SAFETY: event handles may be used from any thread of the context.
unsafe impl Send for Event {}

impl Event {
    pub fn new() -> Result<Event> {
        let mut ev = std::ptr::null_mut();
        // SAFETY: out-pointer valid.
        check(unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) }, "cuEventCreate")?;
        Ok(Event { ev })
    }
    pub fn record(&self, gpu: &Gpu) -> Result<()> {
        // SAFETY: live event and stream.
        check(unsafe { sys::cuEventRecord(self.ev, gpu.stream) }, "cuEventRecord")
    }
    /// Milliseconds from `self` to `end` (waits for `end`).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: both events recorded on the stream.
        unsafe {
            check(sys::cuEventSynchronize(end.ev), "cuEventSynchronize")?;
            check(sys::cuEventElapsedTime_v2(&mut ms, self.ev, end.ev), "cuEventElapsedTime")?;
        }
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ev.is_null() {
            return;
        }
        // SAFETY: live event.
        unsafe {
            sys::cuEventDestroy_v2(self.ev);
        }
    }
}

/// An instantiated CUDA graph, replayed on the GPU's stream.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: the graph is only launched from the thread that owns the decode runner (&mut self).
unsafe impl Send for Graph {}

impl Graph {
    /// Captures everything `f` enqueues on the stream into a graph.
    pub fn capture(gpu: &Gpu, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        // SAFETY: live stream; capture is ended on every path.
        unsafe {
            check(
                sys::cuStreamBeginCapture_v2(gpu.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture",
            )?;
            CAPTURING.with(|c| c.set(true));
            let r = f();
            CAPTURING.with(|c| c.set(false));
            let mut graph = std::ptr::null_mut();
            let e = sys::cuStreamEndCapture(gpu.stream, &mut graph);
            r?;
            check(e, "cuStreamEndCapture")?;
            let mut exec = std::ptr::null_mut();
            check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate")?;
            Ok(Graph { graph, exec })
        }
    }

    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        // SAFETY: live exec and stream.
        check(unsafe { sys::cuGraphLaunch(self.exec, gpu.stream) }, "cuGraphLaunch")
    }

    /// Number of kernel nodes (for logs).
    pub fn num_nodes(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: live graph; a null node array asks for the count only.
        unsafe {
            sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n);
        }
        n
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: live handles, destroyed once.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

/// Copies `out.len()` bytes from device address `ptr` (memory the caller knows to be that large,
/// e.g. a graph's arena) to the host and waits.
pub fn download_raw(gpu: &Gpu, ptr: u64, out: &mut [u8]) -> Result<()> {
    // SAFETY: the caller vouches for the device range; the stream is synchronised before `out`
    // is used.
    unsafe { check(sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, ptr, out.len(), gpu.stream), "cuMemcpyDtoHAsync")? };
    gpu.synchronize()
}
