//! # ep-verify
//!
//! The checks every change is gated on: the batched path equals the per-expert path equals the
//! oracle, bit for bit, on every output (tests in `tests/`), and loom models of the signaling
//! protocol run on the shipped code (`tests/loom_*.rs`, built with `--cfg ep_loom`).
//!
//! This library holds the harness the tests share: run a path on a workload and compare it, and
//! [`gpu_protocol`], the CUDA kernels' synchronisation as a model that loom checks.

pub mod differential;
pub mod gpu_protocol;

use ep_reference::oracle;
use ep_reference::output::combine_diff;
use ep_reference::path::run_ranks;
use ep_reference::workload::Workload;
use ep_reference::{bf16, DispatchOutput, EpRank, Handle, Result};

/// Every rank's dispatch, run collectively.
pub fn dispatch_all<R: EpRank>(
    ranks: &mut [R],
    w: &Workload,
) -> Vec<Result<(DispatchOutput, Handle)>> {
    run_ranks(ranks, |rk| {
        let r = rk.rank();
        rk.dispatch(&w.x[r], &w.topk_idx[r])
    })
}

/// Every rank's combine of `ys` with the handles of a dispatch, run collectively.
pub fn combine_all<R: EpRank>(
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
    handles: &[Handle],
) -> Vec<Result<Vec<bf16>>> {
    run_ranks(ranks, |rk| {
        let r = rk.rank();
        rk.combine(&ys[r], &w.topk_idx[r], &w.topk_weights[r], &handles[r])
    })
}

/// Dispatch then combine on `ranks`, compared with the oracle; `Err` describes the first
/// difference (or the error a rank returned).
pub fn check_against_oracle<R: EpRank>(
    name: &str,
    ranks: &mut [R],
    w: &Workload,
    seed: u64,
) -> std::result::Result<(), String> {
    check_against_oracle_with(name, ranks, w, &w.expert_outputs(seed))
}

/// As [`check_against_oracle`], with the expert outputs `ys` given (one per rank).
pub fn check_against_oracle_with<R: EpRank>(
    name: &str,
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
) -> std::result::Result<(), String> {
    let cfg = &w.config;
    let want = oracle::dispatch(cfg, &w.dispatch_inputs()).map_err(|e| format!("oracle: {e}"))?;
    let got = dispatch_all(ranks, w);
    let mut handles = Vec::new();
    for (r, (g, wo)) in got.into_iter().zip(&want).enumerate() {
        let (out, h) = g.map_err(|e| format!("{name} dispatch rank {r}: {e}"))?;
        if let Some(d) = wo.diff(&out) {
            return Err(format!(
                "{name} dispatch rank {r} differs from the oracle: {d}"
            ));
        }
        handles.push(h);
    }
    let want = oracle::combine(cfg, &w.combine_inputs(ys)).map_err(|e| format!("oracle: {e}"))?;
    let got = combine_all(ranks, w, ys, &handles);
    for (r, (g, wo)) in got.into_iter().zip(&want).enumerate() {
        let out = g.map_err(|e| format!("{name} combine rank {r}: {e}"))?;
        if let Some(d) = combine_diff(wo, &out, cfg.hidden) {
            return Err(format!(
                "{name} combine rank {r} differs from the oracle at {d}"
            ));
        }
    }
    Ok(())
}
