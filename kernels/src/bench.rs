//! The benchmark entry point `ep-bench` calls (see the benches crate).

use crate::runtime::{probe_devices, GpuGroup, GpuOptions, Path};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::{Config, Op};
use half::bf16;

/// Ok(device description) if a usable CUDA GPU is present, Err(reason) otherwise. Never panics.
pub fn probe() -> Result<String, String> {
    std::panic::catch_unwind(|| -> Result<String, String> {
        let n = probe_devices(1)?;
        let ctx = cudarc::driver::CudaContext::new(0).map_err(|e| format!("context: {e:?}"))?;
        let name = ctx.name().map_err(|e| format!("name: {e:?}"))?;
        let (a, b) = ctx.compute_capability().map_err(|e| format!("cc: {e:?}"))?;
        Ok(format!("{name} (sm_{a}{b}) x {n}"))
    })
    .unwrap_or_else(|_| Err("the CUDA probe panicked".into()))
}

/// One path's timings.
#[derive(Debug, Clone)]
pub struct GpuTimings {
    /// "per-expert" or "batched".
    pub path: &'static str,
    /// One sample per timed call, microseconds.
    pub dispatch_us: Vec<f64>,
    pub combine_us: Vec<f64>,
    /// Bytes written into other ranks' (and the own rank's) receive buffers, all ranks, per call.
    pub dispatch_wire_bytes: u64,
    pub combine_wire_bytes: u64,
    pub dispatch_messages: u64,
    pub combine_messages: u64,
    /// Signals stored per dispatch + combine call pair, all ranks.
    pub signals: u64,
}

#[derive(Debug, Clone)]
pub struct GpuReport {
    pub device: String,
    pub num_gpus: usize,
    pub paths: Vec<GpuTimings>,
}

/// Wire accounting of one dispatch + combine on `path` with the default options (combine reads
/// rows of owners on the same GPU in place): (dispatch bytes, combine bytes, dispatch messages,
/// combine messages, signals), all ranks, per call pair. Dispatch bytes are the bytes stored into
/// the receive buffers (the own rank's included); combine bytes are the rows actually put (per-
/// expert: every row; batched: rows whose owner sits on another GPU than their source).
pub fn accounting(
    cfg: &Config,
    topk_idx: &[Vec<i64>],
    path: Path,
    num_gpus: usize,
) -> (u64, u64, u64, u64, u64) {
    let (r, l, k, e) = (
        cfg.num_ranks,
        cfg.num_local_experts(),
        cfg.top_k,
        cfg.num_experts,
    );
    let per_gpu = r / num_gpus.max(1);
    let selections: u64 = topk_idx
        .iter()
        .map(|t| t.iter().filter(|&&v| v >= 0).count() as u64)
        .sum();
    let mut dedup = 0u64;
    let mut cross = 0u64;
    for (s, t) in topk_idx.iter().enumerate() {
        for row in t.chunks_exact(k) {
            let mut mask = 0u64;
            for &v in row.iter().filter(|&&v| v >= 0) {
                let d = v as usize / l;
                mask |= 1 << d;
                cross += (d / per_gpu != s / per_gpu) as u64;
            }
            dedup += mask.count_ones() as u64;
        }
    }
    let row = 2 * cfg.hidden as u64;
    let all_local = num_gpus <= 1;
    match path {
        Path::Batched => (
            dedup * crate::runtime::entry_bytes(cfg) as u64,
            cross * row,
            (r * r) as u64,
            if all_local {
                0
            } else {
                (r * r - r * per_gpu) as u64
            },
            if all_local {
                (r * r) as u64
            } else {
                2 * (r * r) as u64
            },
        ),
        Path::PerExpert => (
            selections * crate::runtime::pe_entry_bytes(cfg) as u64,
            selections * row,
            selections,
            selections,
            2 * (e * r) as u64,
        ),
    }
}

/// Runs both paths on the same inputs (one Vec per rank), checks both bitwise against the oracle
/// first (Err if not equal), then times each path with CUDA events: `warmup` calls, then `iters`
/// timed calls, each sample one dispatch or one combine launch (events around the launch on
/// every device; the sample is the slowest device's). On one GPU the timed calls are replayed
/// from a CUDA graph (event nodes inside the graph); on several, launched one by one.
pub fn run(
    cfg: &Config,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
    iters: usize,
    warmup: usize,
    num_gpus: usize,
) -> Result<GpuReport, String> {
    run_timed(
        cfg,
        x,
        topk_idx,
        topk_weights,
        iters,
        warmup,
        num_gpus,
        num_gpus == 1,
    )
}

/// [`run`], choosing graph replay (`graph`, one GPU only) or one launch per call.
#[allow(clippy::too_many_arguments)]
pub fn run_timed(
    cfg: &Config,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
    iters: usize,
    warmup: usize,
    num_gpus: usize,
    graph: bool,
) -> Result<GpuReport, String> {
    let inner = || -> Result<GpuReport, String> {
        let inputs: Vec<RankInput> = (0..cfg.num_ranks)
            .map(|r| RankInput {
                x: &x[r],
                topk_idx: &topk_idx[r],
            })
            .collect();
        let want = oracle::dispatch(cfg, &inputs).map_err(|e| e.to_string())?;
        // Expert outputs: y derived from the received rows would need a dequantization; any y
        // in the dispatch layout is a valid combine input, so use a fixed random one.
        let y = crate::testing::random_y(cfg, &mut crate::testing::Rng::new(7));
        let cin: Vec<CombineInput> = (0..cfg.num_ranks)
            .map(|r| CombineInput {
                y: &y[r],
                topk_idx: &topk_idx[r],
                topk_weights: &topk_weights[r],
            })
            .collect();
        let want_c = oracle::combine(cfg, &cin).map_err(|e| e.to_string())?;
        let opts = GpuOptions {
            num_gpus,
            ..Default::default()
        };
        let mut g = GpuGroup::new(cfg, opts).map_err(|e| e.to_string())?;
        let device = g.describe_devices();
        let mut paths = Vec::new();
        for path in [Path::PerExpert, Path::Batched] {
            let got = g.dispatch(path, x, topk_idx).map_err(|e| e.to_string())?;
            for (r, (a, b)) in got.iter().zip(&want).enumerate() {
                if let Some(d) = a.diff(b) {
                    return Err(format!(
                        "{} dispatch differs from the oracle on rank {r}: {d}",
                        path.name()
                    ));
                }
            }
            let got_c = g
                .combine(path, &y, topk_weights)
                .map_err(|e| e.to_string())?;
            for r in 0..cfg.num_ranks {
                if got_c[r]
                    .iter()
                    .map(|v| v.to_bits())
                    .ne(want_c[r].iter().map(|v| v.to_bits()))
                {
                    return Err(format!(
                        "{} combine differs from the oracle on rank {r}",
                        path.name()
                    ));
                }
            }
            let (dt, ct) = time_path(&mut g, path, iters, warmup, graph && num_gpus == 1)
                .map_err(|e| e.to_string())?;
            let (dw, cw, dm, cm, sig) = accounting(cfg, topk_idx, path, num_gpus);
            paths.push(GpuTimings {
                path: path.name(),
                dispatch_us: dt,
                combine_us: ct,
                dispatch_wire_bytes: dw,
                combine_wire_bytes: cw,
                dispatch_messages: dm,
                combine_messages: cm,
                signals: sig,
            });
        }
        Ok(GpuReport {
            device,
            num_gpus: g.num_gpus(),
            paths,
        })
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(inner))
        .unwrap_or_else(|_| Err("GPU benchmark panicked".into()))
}

/// Per-launch time of the empty kernel (same grid), stream launches: the fixed overhead.
pub fn time_empty(g: &mut GpuGroup, iters: usize) -> Result<Vec<f64>, crate::GpuError> {
    use cudarc::driver::{result, sys};
    let err = |w: &str, e: result::DriverError| crate::GpuError::Cuda(format!("{w}: {e:?}"));
    let streams = g.streams();
    let (ctx, s) = &streams[0];
    ctx.bind_to_thread().map_err(|e| err("bind", e))?;
    let mut evs = Vec::new();
    for _ in 0..=iters {
        evs.push(
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| err("event", e))?,
        );
    }
    for _ in 0..10 {
        g.launch_empty()?;
    }
    for (i, &e) in evs.iter().enumerate() {
        // SAFETY: event and stream of the bound context.
        unsafe { result::event::record(e, *s) }.map_err(|e| err("record", e))?;
        if i < iters {
            g.launch_empty()?;
        }
    }
    g.sync()?;
    let mut out = Vec::new();
    ctx.bind_to_thread().map_err(|e| err("bind", e))?;
    for w in evs.windows(2) {
        // SAFETY: both events completed on this context.
        out.push(
            unsafe { result::event::elapsed(w[0], w[1]) }.map_err(|e| err("elapsed", e))? as f64
                * 1e3,
        );
    }
    for e in evs {
        // SAFETY: complete and unused from here on.
        let _ = unsafe { result::event::destroy(e) };
    }
    Ok(out)
}

/// Times `iters` dispatch+combine pairs (after `warmup`), one event pair around each launch on
/// every device. Returns per-call microseconds (max over devices).
pub fn time_path(
    g: &mut GpuGroup,
    path: Path,
    iters: usize,
    warmup: usize,
    graph: bool,
) -> Result<(Vec<f64>, Vec<f64>), crate::GpuError> {
    use cudarc::driver::{result, sys};
    let err = |w: &str, e: result::DriverError| crate::GpuError::Cuda(format!("{w}: {e:?}"));
    // Dispatch must precede combine on the same path (the handle lives on the device).
    for _ in 0..warmup {
        g.launch(Op::Dispatch, path)?;
        g.launch(Op::Combine, path)?;
    }
    g.sync()?;
    let streams = g.streams();
    // Three events per iteration per device: before dispatch, between, after combine.
    let mut evs: Vec<Vec<sys::CUevent>> = Vec::new();
    for (ctx, _) in &streams {
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        let mut v = Vec::with_capacity(3 * iters);
        for _ in 0..3 * iters {
            v.push(
                result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                    .map_err(|e| err("event", e))?,
            );
        }
        evs.push(v);
    }
    let graph = graph && streams.len() == 1;
    let record = |i: usize, evs: &Vec<Vec<sys::CUevent>>| -> Result<(), crate::GpuError> {
        for (d, (ctx, s)) in streams.iter().enumerate() {
            ctx.bind_to_thread().map_err(|e| err("bind", e))?;
            let flags = if graph {
                sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
            } else {
                0
            };
            // SAFETY: the event and stream belong to this (bound) context. Inside a capture the
            // EXTERNAL flag makes it a real event-record node of the graph.
            let rc = unsafe { sys::cuEventRecordWithFlags(evs[d][i], *s, flags) };
            rc.result().map_err(|e| err("record", e))?;
        }
        Ok(())
    };
    if graph {
        let (ctx, s) = &streams[0];
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream belongs to the bound context and is idle (synchronised above).
        unsafe { result::stream::begin_capture(*s, mode) }.map_err(|e| err("begin capture", e))?;
    }
    for it in 0..iters {
        record(3 * it, &evs)?;
        g.launch(Op::Dispatch, path)?;
        record(3 * it + 1, &evs)?;
        g.launch(Op::Combine, path)?;
        record(3 * it + 2, &evs)?;
    }
    if graph {
        let (_, s) = &streams[0];
        // SAFETY: ends the capture begun above on the same stream; the graph and its executable
        // are destroyed after their one replay has finished.
        unsafe {
            let gr = result::stream::end_capture(*s).map_err(|e| err("end capture", e))?;
            let exec = result::graph::instantiate(gr, sys::CUgraphInstantiate_flags(0))
                .map_err(|e| err("instantiate", e))?;
            result::graph::launch(exec, *s).map_err(|e| err("graph launch", e))?;
            result::stream::synchronize(*s).map_err(|e| err("graph sync", e))?;
            let _ = result::graph::exec_destroy(exec);
            let _ = result::graph::destroy(gr);
        }
    }
    g.sync()?;
    let mut disp = vec![0f64; iters];
    let mut comb = vec![0f64; iters];
    for (d, (ctx, _)) in streams.iter().enumerate() {
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        for it in 0..iters {
            // SAFETY: all three events were recorded on this context and have completed.
            let (a, b) = unsafe {
                (
                    result::event::elapsed(evs[d][3 * it], evs[d][3 * it + 1])
                        .map_err(|e| err("elapsed", e))?,
                    result::event::elapsed(evs[d][3 * it + 1], evs[d][3 * it + 2])
                        .map_err(|e| err("elapsed", e))?,
                )
            };
            disp[it] = disp[it].max(a as f64 * 1e3);
            comb[it] = comb[it].max(b as f64 * 1e3);
        }
        for &e in &evs[d] {
            // SAFETY: the event is complete and not used again.
            let _ = unsafe { result::event::destroy(e) };
        }
    }
    Ok((disp, comb))
}
