//! ==================== THE GPU BACKEND GOES HERE ====================
//!
//! Not built in yet: ep-bench does not depend on ep-kernels until its `bench` module lands.
//! To wire it (the lead's ~30-line change):
//! 1. add `ep-kernels.workspace = true` to benches/Cargo.toml;
//! 2. make [`probe`] return `ep_kernels::bench::probe()`;
//! 3. make [`run`] call `ep_kernels::bench::run(&spec.cfg, &w.x, &w.topk_idx,
//!    &w.topk_weights, spec.iters, spec.warmup, num_gpus)` on `let w = spec.workload();` (it
//!    verifies both paths against the oracle before timing) and turn each `GpuTimings` into a
//!    [`PathSamples`]:
//!    ```ignore
//!    PathSamples {
//!        path: t.path,
//!        // one RankSamples per rank if the timings are per rank (chunk dispatch_us by rank),
//!        // else one entry holding every sample
//!        ranks: vec![RankSamples { rank: 0, dispatch_us: t.dispatch_us, combine_us: t.combine_us }],
//!        dispatch: Traffic { messages: t.dispatch_messages, signals: None,
//!                            wire_bytes: t.dispatch_wire_bytes, logical_bytes: 0 },
//!        combine: Traffic { messages: t.combine_messages, signals: None,
//!                           wire_bytes: t.combine_wire_bytes, logical_bytes: 0 },
//!        signals_total: t.signals,
//!    }
//!    ```
//!    then `Ok(assemble(&PointInfo { backend: "gpu", device: &report.device, verified:
//!    "ep-kernels verified both paths against the oracle", load_average: None, .. }, paths))` exactly as
//!    `cpu::run` does.

use crate::backend::{BenchError, BenchSpec};
#[allow(unused_imports)]
use crate::report::{assemble, PathSamples, PointInfo, PointResult, RankSamples, Traffic};

/// Why there is no GPU backend.
pub const NOT_BUILT_IN: &str = "GPU backend not built in yet";

/// `Ok(device)` when a CUDA GPU is usable, `Err(why not)` otherwise. Never panics.
pub fn probe() -> Result<String, String> {
    Err(NOT_BUILT_IN.to_string())
}

/// Runs one point on the GPU.
pub fn run(
    _device: &str,
    _spec: &BenchSpec,
    _progress: &dyn Fn(&str),
) -> Result<PointResult, BenchError> {
    Err(BenchError::Backend(NOT_BUILT_IN.to_string()))
}
