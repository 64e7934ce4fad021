//! The GPU timing harness: what `ep-bench --backend gpu` and the
//! criterion GPU bench time, on a group of the GPU library (ep-kernels).
//!
//! - [`run()`]: the entry point: both paths checked bitwise against the oracle on the same
//!   inputs, then timed every way below, with the wire figures of [`crate::traffic`];
//! - [`events`]: the CUDA-event timing loop (graph replay on one GPU) and the empty kernel;
//! - [`kernel`]: kernel time from CUPTI's activity records ([`crate::cupti`]);
//! - [`hook`]: the receive-hook split, each half timed and profiled.

pub mod events;
pub mod hook;
pub mod kernel;
pub mod run;

pub use events::{time_empty, time_path};
pub use hook::{hook_split, HookError, HookSplit};
pub use kernel::{kernel_names, kernel_times, per_half_us, KernelTimes};
pub use run::{run, run_with, GpuReport, GpuTimings};
