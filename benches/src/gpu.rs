//! The GPU backend of ep-bench: `ep_kernels::bench` runs both paths' CUDA kernels on the same
//! inputs, checks both bitwise against the oracle before timing, and times each call with CUDA
//! events. All ranks of a GPU run in one launch, so every rank of a call shares one latency
//! sample (the slowest GPU's); the per-rank lines differ only by each rank's own bytes.

use crate::accounting;
use crate::backend::{BenchError, BenchSpec};
use crate::report::{assemble, PathSamples, PointInfo, PointResult, RankSamples, Traffic};

/// `Ok(device)` when a CUDA GPU is usable, `Err(why not)` otherwise. Never panics.
pub fn probe() -> Result<String, String> {
    ep_kernels::bench::probe()
}

/// Runs one point on the GPU.
pub fn run(
    device: &str,
    spec: &BenchSpec,
    progress: &dyn Fn(&str),
) -> Result<PointResult, BenchError> {
    let cfg = spec.cfg;
    progress("generating inputs");
    let w = spec.workload();
    progress("running both paths on the GPU: verify against the oracle, then time");
    let report = ep_kernels::bench::run(
        &cfg,
        &w.x,
        &w.topk_idx,
        &w.topk_weights,
        spec.iters,
        spec.warmup,
        spec.gpus,
    )
    .map_err(|e| {
        if e.contains("differ") || e.contains("mismatch") {
            BenchError::Mismatch(e)
        } else {
            BenchError::Backend(e)
        }
    })?;
    let paths: Vec<PathSamples> = report
        .paths
        .into_iter()
        .map(|t| PathSamples {
            path: t.path,
            ranks: (0..cfg.num_ranks)
                .map(|rank| RankSamples {
                    rank,
                    dispatch_us: t.dispatch_us.clone(),
                    combine_us: t.combine_us.clone(),
                })
                .collect(),
            dispatch: Traffic {
                messages: t.dispatch_messages,
                signals: None,
                wire_bytes: t.dispatch_wire_bytes,
                logical_bytes: 0,
            },
            combine: Traffic {
                messages: t.combine_messages,
                signals: None,
                wire_bytes: t.combine_wire_bytes,
                logical_bytes: 0,
            },
            signals_total: t.signals,
        })
        .collect();
    let selections: Vec<u64> = w
        .topk_idx
        .iter()
        .map(|t| accounting::selections(t))
        .collect();
    let device = format!("{device} ({} GPU(s))", report.num_gpus);
    Ok(assemble(
        &PointInfo {
            backend: "gpu",
            device: &device,
            cfg: &cfg,
            tokens_per_rank: spec.tokens,
            masked: spec.masked,
            seed: spec.seed,
            iters: spec.iters,
            warmup: spec.warmup,
            selections: &selections,
            verified: "ep-kernels checked both paths bitwise against the oracle before timing",
            load_average: None,
        },
        paths,
    ))
}
