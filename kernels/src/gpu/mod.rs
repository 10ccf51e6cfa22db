//! The device runtime of the `cuda` backend (feature `cuda`): finding the driver, compiling the
//! program of [`crate::cuda_program`] with NVRTC for the device at hand, and one [`Gpu`] that
//! owns the context, its stream, the loaded kernels and a cuBLAS handle.
//!
//! Every library is loaded at run time (cudarc's `dynamic-loading`), so a build with the
//! feature runs on machines without CUDA; [`probe`] is called before anything else because
//! cudarc panics, rather than erring, when a library it needs is missing.
//!
//! Kernels take plain device addresses ([`DevPtr`]): the backend owns its buffers as
//! `CudaSlice`s, works on a single stream, and offsets into them freely (a layer's slice of the
//! KV cache, a fused matrix's rows), which cudarc's views would make needlessly awkward.

mod launch;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use cudarc::nvrtc::{CompileOptions, Ptx};

pub use launch::{Arg, AttentionLaunch};

/// A device address (what a kernel's pointer parameter receives).
pub type DevPtr = u64;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no NVIDIA driver: libcuda.so could not be loaded (an NVIDIA GPU and its driver are needed)"
    )]
    NoDriver,
    #[error("the NVIDIA driver sees no GPU")]
    NoDevice,
    #[error(
        "NVRTC (libnvrtc.so.{0}) could not be loaded: install the CUDA toolkit, or `pip install nvidia-cuda-nvrtc` and add its lib folder to LD_LIBRARY_PATH"
    )]
    NoNvrtc(&'static str),
    #[error(
        "cuBLAS (libcublas.so.{0}) could not be loaded: install the CUDA toolkit, or `pip install nvidia-cublas` and add its lib folder to LD_LIBRARY_PATH"
    )]
    NoCublas(&'static str),
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("NVRTC could not compile kvgate's kernels for {arch}:\n{log}")]
    Compile { arch: String, log: String },
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("{0}")]
    Unsupported(String),
}

impl From<cudarc::driver::DriverError> for GpuError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        GpuError::Driver(e.to_string())
    }
}

impl From<cudarc::cublas::result::CublasError> for GpuError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        GpuError::Blas(format!("{e:?}"))
    }
}

/// The CUDA major version this build loads libraries for (`libnvrtc.so.N`, `libcublas.so.N`).
#[cfg(feature = "cuda12")]
pub const CUDA_MAJOR: &str = "12";
/// The CUDA major version this build loads libraries for (`libnvrtc.so.N`, `libcublas.so.N`).
#[cfg(not(feature = "cuda12"))]
pub const CUDA_MAJOR: &str = "13";

/// Whether a driver and at least one GPU are there, without any call that could panic.
pub fn probe() -> Result<usize, GpuError> {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    let n = CudaContext::device_count()?;
    if n < 1 {
        return Err(GpuError::NoDevice);
    }
    Ok(n as usize)
}

/// Whether NVRTC can be loaded (it needs no GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the whole program to PTX for `arch` (`"sm_90"`, …; `None`: NVRTC's default).
pub fn compile_program(arch: Option<&'static str>) -> Result<Ptx, GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc(CUDA_MAJOR));
    }
    let opts = CompileOptions {
        arch,
        // Exact division and square roots; no flush-to-zero: results stay close to the CPU's.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some("kvgate.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(crate::cuda_program::program(), opts).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => other.to_string(),
        };
        GpuError::Compile {
            arch: arch.unwrap_or("the default architecture").to_string(),
            log,
        }
    })
}

/// The `sm_XY` name of a compute capability (NVRTC takes a `&'static str`; the few names a
/// process ever needs are kept for its lifetime).
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let want = format!("sm_{major}{minor}");
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = names.iter().find(|n| **n == want) {
        return n;
    }
    let leaked: &'static str = Box::leak(want.into_boxed_str());
    names.push(leaked);
    leaked
}

/// One GPU: context, stream, kernels and cuBLAS.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: cudarc::cublas::CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    name: String,
    arch: &'static str,
    multiprocessors: usize,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens GPU `ordinal`: probes the driver, compiles and loads the kernels, opens cuBLAS.
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        let count = probe()?;
        if ordinal >= count {
            return Err(GpuError::Unsupported(format!(
                "GPU {ordinal} asked for, the driver sees {count}"
            )));
        }
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(GpuError::NoCublas(CUDA_MAJOR));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: the backend uses one stream for everything, so cudarc's cross-stream event
        // tracking has nothing to order.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_name(major, minor);
        let ptx = compile_program(Some(arch))?;
        let module = ctx.load_module(ptx)?;
        let mut funcs = HashMap::new();
        for name in crate::cuda_program::KERNELS
            .iter()
            .chain(std::iter::once(&crate::cuda_program::SAMPLE_TOP_P))
        {
            funcs.insert(*name, module.load_function(name)?);
        }
        let multiprocessors = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let stream = ctx.default_stream();
        let blas = cudarc::cublas::CudaBlas::new(stream.clone())?;
        let name = ctx.name()?;
        Ok(Gpu {
            ctx,
            stream,
            blas,
            funcs,
            name,
            arch,
            multiprocessors,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn arch(&self) -> &'static str {
        self.arch
    }

    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize), GpuError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Makes this GPU's context current on the calling thread. Calls that go through cudarc's
    /// safe API bind it themselves; cuBLAS and raw copies do not, and a backend is built on
    /// one thread and stepped on others.
    pub fn bind(&self) -> Result<(), GpuError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `n` zeroed values on the device.
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, GpuError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    /// A copy of `host` on the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, GpuError> {
        if host.is_empty() {
            // SAFETY: a one-element buffer that nothing reads.
            return Ok(unsafe { self.stream.alloc::<T>(1)? });
        }
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `host` into the start of `dst` (which must be long enough).
    pub fn write<T: DeviceRepr>(&self, host: &[T], dst: &mut CudaSlice<T>) -> Result<(), GpuError> {
        if host.is_empty() {
            return Ok(());
        }
        assert!(host.len() <= dst.len(), "device buffer too small");
        let mut view = dst.slice_mut(..host.len());
        self.stream.memcpy_htod(host, &mut view)?;
        Ok(())
    }

    /// The first `n` values of `src`, waiting for the stream.
    pub fn read<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>, GpuError> {
        let mut out = vec![T::default(); n];
        if n > 0 {
            self.stream.memcpy_dtoh(&src.slice(..n), &mut out)?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// `n` values starting at device address `at`, waiting for the stream.
    pub fn read_at<T: DeviceRepr + Default + Clone>(
        &self,
        at: DevPtr,
        n: usize,
    ) -> Result<Vec<T>, GpuError> {
        let mut out = vec![T::default(); n];
        if n > 0 {
            // SAFETY: the caller names `n` valid values at `at`; the copy completes before
            // `synchronize` returns and `out` lives until then.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(&mut out, at, self.stream.cu_stream())?;
            }
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Waits for everything queued so far.
    pub fn sync(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// Copies `bytes` bytes from `src` to `dst` on the device.
    pub fn copy(&self, src: DevPtr, dst: DevPtr, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: the caller names two device ranges of `bytes` bytes it owns.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }?;
        Ok(())
    }

    /// Seconds per call of `work`, measured with device events over `reps` calls after one
    /// unmeasured warm-up call.
    pub fn timed(
        &self,
        reps: usize,
        mut work: impl FnMut() -> Result<(), GpuError>,
    ) -> Result<f64, GpuError> {
        work()?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timing)?;
        let end = self.ctx.new_event(timing)?;
        start.record(&self.stream)?;
        for _ in 0..reps.max(1) {
            work()?;
        }
        end.record(&self.stream)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64 / 1e3 / reps.max(1) as f64)
    }

    /// The device address of a buffer.
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn func(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architecture_names_follow_the_compute_capability_and_are_kept_once() {
        assert_eq!(arch_name(9, 0), "sm_90");
        assert_eq!(arch_name(12, 1), "sm_121");
        assert!(std::ptr::eq(arch_name(8, 6), arch_name(8, 6)));
    }
}
