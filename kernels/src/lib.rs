//! # ep-kernels
//!
//! The CUDA backend of ep-dispatch: both paths of DESIGN.md (per-expert and per-destination
//! batched dispatch/combine) as CUDA kernels, compiled at run time with NVRTC (`compile`), run
//! by a small runtime over one or more GPUs with peer access (`runtime`), and timed by the
//! benchmark entry point (`bench`). Every output is bit-identical to `ep_reference::oracle`.
//!
//! Where there is no CUDA driver (or no NVRTC), nothing touches the GPU: [`runtime::probe_devices`]
//! and [`bench::probe`] say why, and the tests print `SKIPPED: <reason>`.

pub mod bench;
pub mod compile;
pub mod runtime;
pub mod testing;

pub use runtime::{GpuGroup, GpuOptions, Path};

/// Errors of the GPU backend.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// Bad input, a config the device cannot hold, or a timed-out wait: the contract's errors.
    #[error(transparent)]
    Contract(#[from] ep_reference::Error),
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// NVRTC failed to compile a kernel.
    #[error("NVRTC: {0}")]
    Compile(String),
    /// No usable GPU (no driver, no NVRTC, too few devices).
    #[error("no usable GPU: {0}")]
    NoDevice(String),
    /// A config outside what the GPU kernels support (e.g. more than 32 ranks).
    #[error("unsupported on the GPU: {0}")]
    Unsupported(String),
    /// Combine was called on another path than the last dispatch.
    #[error(
        "combine on the {combine} path needs a dispatch on that path (last dispatch: {dispatch})"
    )]
    PathMismatch {
        combine: &'static str,
        dispatch: &'static str,
    },
}
