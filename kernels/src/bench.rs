//! The benchmark entry point `ep-bench` calls (see the benches crate).

use crate::runtime::{probe_devices, GpuGroup, GpuOptions, NcclSizes, Path, Transport};
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

/// One path's timings. `dispatch_us`/`combine_us` are CUDA-event figures (stream time from the
/// event before a launch to the event after it); `kernel` is the kernel's own GPU time from
/// CUPTI's activity records, the figure DeepEP's test prints.
#[derive(Debug, Clone)]
pub struct GpuTimings {
    /// "per-expert" or "batched".
    pub path: &'static str,
    /// Over NCCL: the sizing mode this path ran ("exact" / "capacity"); None over NVLink.
    pub nccl_sizes: Option<&'static str>,
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
    /// The CUPTI kernel time of the same calls (a separate profiled run of `iters` pairs; see
    /// [`KernelTimes`]), beside the event figures above; `Err(why)` where CUPTI is missing or
    /// its records did not add up (the event figures stand alone then).
    pub kernel: Result<KernelTimes, String>,
    /// The receive-hook split ([`hook_split`]), or why it could not be timed.
    pub hook: Result<HookSplit, String>,
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

/// One NCCL call's wire figures, all ranks: (dispatch bytes, combine bytes, dispatch
/// messages, combine messages).
pub type NcclWire = (u64, u64, u64, u64);

/// Wire accounting of the NCCL transport, every peer (self included) through NCCL: (dispatch
/// bytes, combine bytes, dispatch messages, combine messages), all ranks, per call. A message
/// is one `ncclSend` (zero-byte sends are not issued); bytes are what the sends carry: the
/// (2 + L) x 4-byte header of every pair, and the payload as sized by `sizes` (capacity padding
/// included). Batched: one payload message per pair (exact: tokens x entry bytes; capacity:
/// T entries), combine one per pair (exact: selections x 2H; capacity: T x min(K, L) rows).
/// Per-expert (exact only): one message per (pair, local expert) with rows, both ways.
/// Checked arithmetic: an overflow is an error naming the figure.
pub fn nccl_accounting(
    cfg: &Config,
    topk_idx: &[Vec<i64>],
    path: Path,
    sizes: NcclSizes,
) -> Result<NcclWire, String> {
    let (r, l, k, t) = (
        cfg.num_ranks,
        cfg.num_local_experts(),
        cfg.top_k,
        cfg.max_tokens_per_rank as u64,
    );
    let of = |what: &str| format!("the NCCL {what} overflow u64");
    let mul = |a: u64, b: u64, what: &str| a.checked_mul(b).ok_or_else(|| of(what));
    let add = |a: u64, b: u64, what: &str| a.checked_add(b).ok_or_else(|| of(what));
    let hb = ((2 + l) * 4) as u64;
    let eb = crate::runtime::entry_bytes(cfg) as u64;
    let peb = crate::runtime::pe_entry_bytes(cfg) as u64;
    let rowb = 2 * cfg.hidden as u64;
    let cap_rows = mul(t, k.min(l) as u64, "capacity rows")?;
    let (mut dw, mut cw, mut dm, mut cm) = (0u64, 0u64, 0u64, 0u64);
    for rows in topk_idx {
        // rows[d * L + l]: selections of (this source, d, l); tokens[d], sels[d].
        let mut per = vec![0u64; r * l];
        let mut tokens = vec![0u64; r];
        for tok in rows.chunks_exact(k) {
            let mut mask = vec![false; r];
            for &v in tok.iter().filter(|&&v| v >= 0) {
                let e = v as usize;
                if e >= r * l {
                    return Err(format!("expert {e} outside 0..{}", r * l));
                }
                per[e] += 1;
                mask[e / l] = true;
            }
            for (d, m) in mask.into_iter().enumerate() {
                tokens[d] += m as u64;
            }
        }
        for d in 0..r {
            let sel: u64 = per[d * l..(d + 1) * l].iter().sum();
            let with_rows = per[d * l..(d + 1) * l].iter().filter(|&&n| n > 0).count() as u64;
            let (db, dmsg, cb, cmsg) = match (path, sizes) {
                (Path::Batched, NcclSizes::Exact) => (
                    mul(tokens[d], eb, "dispatch bytes")?,
                    (tokens[d] > 0) as u64,
                    mul(sel, rowb, "combine bytes")?,
                    (sel > 0) as u64,
                ),
                (Path::Batched, NcclSizes::Capacity) => (
                    mul(t, eb, "dispatch bytes")?,
                    1,
                    mul(cap_rows, rowb, "combine bytes")?,
                    1,
                ),
                (Path::PerExpert, NcclSizes::Exact) => (
                    mul(sel, peb, "dispatch bytes")?,
                    with_rows,
                    mul(sel, rowb, "combine bytes")?,
                    with_rows,
                ),
                (Path::PerExpert, NcclSizes::Capacity) => {
                    return Err("the per-expert path over NCCL runs exact sizes only".into())
                }
            };
            dw = add(dw, add(hb, db, "dispatch bytes")?, "dispatch bytes")?;
            dm = add(dm, 1 + dmsg, "dispatch messages")?;
            cw = add(cw, cb, "combine bytes")?;
            cm = add(cm, cmsg, "combine messages")?;
        }
    }
    Ok((dw, cw, dm, cm))
}

/// Runs both paths on the same inputs (one Vec per rank), checks both bitwise against the oracle
/// first (Err if not equal), then times each path with CUDA events: `warmup` calls, then `iters`
/// timed calls, each sample one dispatch or one combine launch (events around the launch on
/// every device; the sample is the slowest device's). On one GPU the timed calls are replayed
/// from a CUDA graph (event nodes inside the graph); on several, launched one by one. Then
/// `iters` more calls run under a CUPTI kernel timer for [`GpuTimings::kernel`], and the
/// receive-hook split is timed and profiled the same way ([`hook_split`]).
pub fn run(
    cfg: &Config,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
    iters: usize,
    warmup: usize,
    num_gpus: usize,
) -> Result<GpuReport, String> {
    let opts = GpuOptions {
        num_gpus,
        ..Default::default()
    };
    run_with(
        cfg,
        x,
        topk_idx,
        topk_weights,
        iters,
        warmup,
        opts,
        num_gpus == 1,
    )
}

/// [`run`] with the group's options (transport, NCCL sizing) and the choice of graph replay
/// (`graph`, one GPU only) or one launch per call. Over NCCL the calls are
/// launched one by one (exact sizes read headers on the host mid-call: nothing to capture), the
/// per-expert path runs exact sizes whatever `opts.nccl_sizes` says (capacity would send L*T
/// entries per peer; the group refuses it), and the wire figures come from
/// [`nccl_accounting`] (no device signals).
#[allow(clippy::too_many_arguments)]
pub fn run_with(
    cfg: &Config,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
    iters: usize,
    warmup: usize,
    opts: GpuOptions,
    graph: bool,
) -> Result<GpuReport, String> {
    let num_gpus = opts.num_gpus;
    let nccl = opts.transport == Transport::Nccl;
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
        let mut g = GpuGroup::new(cfg, opts).map_err(|e| e.to_string())?;
        let device = g.describe_devices();
        let mut paths = Vec::new();
        for path in [Path::PerExpert, Path::Batched] {
            let sizes = match path {
                Path::PerExpert => NcclSizes::Exact,
                Path::Batched => opts.nccl_sizes,
            };
            g.set_nccl_sizes(sizes);
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
            let graph = graph && num_gpus == 1 && !nccl;
            let (dt, ct) =
                time_path(&mut g, path, iters, warmup, graph).map_err(|e| e.to_string())?;
            let kernel = kernel_times(&mut g, path, iters, graph);
            let hook = match hook_split(
                &mut g,
                path,
                x,
                topk_idx,
                topk_weights,
                &y,
                &want_c,
                iters,
                warmup,
            ) {
                Ok(h) => Ok(h),
                Err(HookError::Mismatch(m)) => return Err(m),
                Err(HookError::Gpu(e)) => Err(e.to_string()),
            };
            let (dw, cw, dm, cm, sig) = if g.uses_nccl() {
                let (dw, cw, dm, cm) = nccl_accounting(cfg, topk_idx, path, sizes)?;
                (dw, cw, dm, cm, 0)
            } else {
                accounting(cfg, topk_idx, path, num_gpus)
            };
            paths.push(GpuTimings {
                path: path.name(),
                nccl_sizes: g.uses_nccl().then(|| sizes.name()),
                dispatch_us: dt,
                combine_us: ct,
                dispatch_wire_bytes: dw,
                combine_wire_bytes: cw,
                dispatch_messages: dm,
                combine_messages: cm,
                signals: sig,
                kernel,
                hook,
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
pub fn time_empty(g: &mut GpuGroup, iters: usize) -> Result<Vec<f64>, crate::error::GpuError> {
    use cudarc::driver::result;
    let streams = g.streams();
    let (ctx, s) = &streams[0];
    // Destroyed on every path out of here.
    let evs = Events::new(&streams[..1], iters + 1)?;
    for _ in 0..10 {
        g.launch_empty()?;
    }
    for (i, &e) in evs.per_dev[0].1.iter().enumerate() {
        ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: event and stream of the bound context.
        unsafe { result::event::record(e, *s) }.map_err(|e| cuda_err("record", e))?;
        if i < iters {
            g.launch_empty()?;
        }
    }
    g.sync()?;
    let mut out = Vec::new();
    ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
    for w in evs.per_dev[0].1.windows(2) {
        // SAFETY: both events completed on this context.
        out.push(
            unsafe { result::event::elapsed(w[0], w[1]) }.map_err(|e| cuda_err("elapsed", e))?
                as f64
                * 1e3,
        );
    }
    Ok(out)
}

/// Times `iters` dispatch+combine pairs (after `warmup`), one event pair around each launch on
/// every device. Returns per-call microseconds (max over devices).
///
/// On every error path the capture (graph mode) is ended and the graph, its executable and the
/// events are destroyed: the group's stream is left usable.
pub fn time_path(
    g: &mut GpuGroup,
    path: Path,
    iters: usize,
    warmup: usize,
    graph: bool,
) -> Result<(Vec<f64>, Vec<f64>), crate::error::GpuError> {
    time_loop(g, iters, warmup, graph, &mut |g, op| g.launch(op, path))
}

type Launch<'a> = dyn FnMut(&mut GpuGroup, Op) -> Result<(), crate::error::GpuError> + 'a;

fn cuda_err(what: &str, e: cudarc::driver::result::DriverError) -> crate::error::GpuError {
    crate::error::GpuError::Cuda(format!("{what}: {e:?}"))
}

/// Timing events of every device, destroyed on drop (also when timing fails half-way).
struct Events {
    per_dev: Vec<(
        std::sync::Arc<cudarc::driver::CudaContext>,
        Vec<cudarc::driver::sys::CUevent>,
    )>,
}

impl Events {
    fn new(
        streams: &[(
            std::sync::Arc<cudarc::driver::CudaContext>,
            cudarc::driver::sys::CUstream,
        )],
        n: usize,
    ) -> Result<Events, crate::error::GpuError> {
        use cudarc::driver::{result, sys};
        let mut ev = Events {
            per_dev: Vec::new(),
        };
        for (ctx, _) in streams {
            ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
            ev.per_dev.push((ctx.clone(), Vec::with_capacity(n)));
            let v = &mut ev.per_dev.last_mut().expect("just pushed").1;
            for _ in 0..n {
                v.push(
                    result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                        .map_err(|e| cuda_err("event", e))?,
                );
            }
        }
        Ok(ev)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        for (ctx, v) in &self.per_dev {
            let _ = ctx.bind_to_thread();
            for &e in v {
                // SAFETY: created on this (bound) context and not used after this; an event
                // still pending is released by the driver once it completes.
                let _ = unsafe { cudarc::driver::result::event::destroy(e) };
            }
        }
    }
}

/// A stream capture in progress. Dropped without [`Capture::end`] (an error between begin and
/// end), it ends the capture and destroys whatever graph it produced, so the stream is no
/// longer capturing (issue 10 item 8).
struct Capture {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    stream: cudarc::driver::sys::CUstream,
    open: bool,
}

impl Capture {
    fn begin(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<Capture, crate::error::GpuError> {
        use cudarc::driver::{result, sys};
        ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream belongs to the bound context and is idle (synchronised by the caller).
        unsafe { result::stream::begin_capture(stream, mode) }
            .map_err(|e| cuda_err("begin capture", e))?;
        Ok(Capture {
            ctx: ctx.clone(),
            stream,
            open: true,
        })
    }

    /// Ends the capture: the captured graph, destroyed when the returned guard drops.
    fn end(mut self) -> Result<Graph, crate::error::GpuError> {
        self.open = false;
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: ends the capture begun in `begin` on the same stream and context.
        let g = unsafe { cudarc::driver::result::stream::end_capture(self.stream) }
            .map_err(|e| cuda_err("end capture", e))?;
        Ok(Graph {
            graph: g,
            exec: None,
        })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.open {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: the capture begun in `begin` is still open on this stream; ending it is
            // always allowed (an invalidated capture ends with an error and no graph).
            if let Ok(g) = unsafe { cudarc::driver::result::stream::end_capture(self.stream) } {
                if !g.is_null() {
                    // SAFETY: the graph was just produced by the capture and never launched.
                    let _ = unsafe { cudarc::driver::result::graph::destroy(g) };
                }
            }
        }
    }
}

/// A captured graph and its executable, destroyed on drop (after the caller synchronised).
struct Graph {
    graph: cudarc::driver::sys::CUgraph,
    exec: Option<cudarc::driver::sys::CUgraphExec>,
}

impl Graph {
    /// Instantiates the graph and runs it once on `stream`, waiting for it.
    fn replay_once(
        &mut self,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), crate::error::GpuError> {
        use cudarc::driver::{result, sys};
        // SAFETY: `graph` is a complete captured graph of the bound context.
        let exec =
            unsafe { result::graph::instantiate(self.graph, sys::CUgraphInstantiate_flags(0)) }
                .map_err(|e| cuda_err("instantiate", e))?;
        self.exec = Some(exec);
        // SAFETY: the executable and stream belong to the bound context; the wait makes the
        // replay complete before the guard can destroy anything.
        unsafe {
            result::graph::launch(exec, stream).map_err(|e| cuda_err("graph launch", e))?;
            result::stream::synchronize(stream).map_err(|e| cuda_err("graph sync", e))?;
        }
        Ok(())
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both were created by this guard's owner on the current context; a replay that
        // was launched has been waited for (replay_once synchronises; on its error paths the
        // driver defers the release of an executable still in use).
        unsafe {
            if let Some(e) = self.exec {
                let _ = cudarc::driver::result::graph::exec_destroy(e);
            }
            if !self.graph.is_null() {
                let _ = cudarc::driver::result::graph::destroy(self.graph);
            }
        }
    }
}

/// [`time_path`] with the launch as a parameter (the tests inject a failing one).
fn time_loop(
    g: &mut GpuGroup,
    iters: usize,
    warmup: usize,
    graph: bool,
    launch: &mut Launch<'_>,
) -> Result<(Vec<f64>, Vec<f64>), crate::error::GpuError> {
    use cudarc::driver::{result, sys};
    // Dispatch must precede combine on the same path (the handle lives on the device).
    for _ in 0..warmup {
        launch(g, Op::Dispatch)?;
        launch(g, Op::Combine)?;
    }
    g.sync()?;
    let streams = g.streams();
    // Three events per iteration per device: before dispatch, between, after combine.
    let n_ev = iters
        .checked_mul(3)
        .ok_or_else(|| crate::error::GpuError::Unsupported(format!("{iters} timed calls")))?;
    let evs = Events::new(&streams, n_ev)?;
    let graph = graph && streams.len() == 1;
    let record = |i: usize| -> Result<(), crate::error::GpuError> {
        for (d, (ctx, s)) in streams.iter().enumerate() {
            ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
            let flags = if graph {
                sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
            } else {
                0
            };
            // SAFETY: the event and stream belong to this (bound) context. Inside a capture the
            // EXTERNAL flag makes it a real event-record node of the graph.
            let rc = unsafe { sys::cuEventRecordWithFlags(evs.per_dev[d].1[i], *s, flags) };
            rc.result().map_err(|e| cuda_err("record", e))?;
        }
        Ok(())
    };
    let capture = if graph {
        Some(Capture::begin(&streams[0].0, streams[0].1)?)
    } else {
        None
    };
    // An error from here to `end` drops `capture`, which ends the capture.
    for it in 0..iters {
        record(3 * it)?;
        launch(g, Op::Dispatch)?;
        record(3 * it + 1)?;
        launch(g, Op::Combine)?;
        record(3 * it + 2)?;
    }
    if let Some(c) = capture {
        let mut gr = c.end()?;
        gr.replay_once(streams[0].1)?;
    }
    g.sync()?;
    let mut disp = vec![0f64; iters];
    let mut comb = vec![0f64; iters];
    for (ctx, ev) in &evs.per_dev {
        ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        for it in 0..iters {
            // SAFETY: all three events were recorded on this context and have completed.
            let (a, b) = unsafe {
                (
                    result::event::elapsed(ev[3 * it], ev[3 * it + 1])
                        .map_err(|e| cuda_err("elapsed", e))?,
                    result::event::elapsed(ev[3 * it + 1], ev[3 * it + 2])
                        .map_err(|e| cuda_err("elapsed", e))?,
                )
            };
            disp[it] = disp[it].max(a as f64 * 1e3);
            comb[it] = comb[it].max(b as f64 * 1e3);
        }
    }
    Ok((disp, comb))
}

/// The kernels a path launches: (dispatch, combine).
pub fn kernel_names(path: Path) -> (&'static str, &'static str) {
    let f = match path {
        Path::PerExpert => crate::compile::PER_EXPERT,
        Path::Batched => crate::compile::BATCHED,
    };
    (f.kernels[0], f.kernels[1])
}

/// A path's kernel time from CUPTI's activity records ([`crate::cupti`]): the GPU duration of
/// the path's own kernels, per call (slowest device), as DeepEP's test reports it through the
/// profiler. Launch gaps and anything between the launches are not in it; the event figures
/// include them.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTimes {
    pub dispatch_us: Vec<f64>,
    pub combine_us: Vec<f64>,
    /// Launches of each kernel per call and device: 1, or 2 where the NCCL transport splits a
    /// call into a pack and an unpack launch (their sum is the call's figure; NCCL's own
    /// kernels are not in it).
    pub launches_per_call: usize,
}

/// Profiles `iters` more dispatch+combine pairs on `path` under a CUPTI kernel timer (a run of
/// its own, apart from the event-timed one, as DeepEP's `bench_kineto` is apart from `bench`).
/// `Err(why)` where CUPTI is unavailable or its records do not add up to the calls made.
pub fn kernel_times(
    g: &mut GpuGroup,
    path: Path,
    iters: usize,
    graph: bool,
) -> Result<KernelTimes, String> {
    if iters == 0 {
        return Err("no timed calls (--iters 0)".into());
    }
    let devices: Vec<u32> = g
        .streams()
        .iter()
        .map(|(c, _)| c.ordinal() as u32)
        .collect();
    let timer = crate::cupti::KernelTimer::start().map_err(|e| e.to_string())?;
    let run = time_path(g, path, iters, 0, graph);
    // Finish the timer whatever the run did: CUPTI's state is per process.
    let recs = timer.finish();
    run.map_err(|e| format!("profiled run: {e}"))?;
    let recs = recs.map_err(|e| e.to_string())?;
    let (dn, cn) = kernel_names(path);
    let first = devices.first().copied().unwrap_or(0);
    let n = recs
        .iter()
        .filter(|r| r.name == dn && r.device == first)
        .count();
    let launches = (n / iters).max(1);
    let per = |name| {
        crate::cupti::per_call_us(&recs, name, &devices, iters, launches).map_err(|e| e.to_string())
    };
    Ok(KernelTimes {
        dispatch_us: per(dn)?,
        combine_us: per(cn)?,
        launches_per_call: launches,
    })
}

// ------------------------------------------------------------------ the receive-hook split

/// One path's receive-hook split (DeepEP's `return_recv_hook`): each of dispatch and combine
/// issued as its send half and its receive half through the device API
/// ([`GpuGroup::dispatch_send`] ... [`GpuGroup::combine_recv`]), on streams of the caller's
/// own, one launch per half (no graph). Event figures: stream time between CUDA events around
/// each half, per call (slowest device), in microseconds.
#[derive(Debug, Clone)]
pub struct HookSplit {
    pub dispatch_send_us: Vec<f64>,
    pub dispatch_recv_us: Vec<f64>,
    pub combine_send_us: Vec<f64>,
    pub combine_recv_us: Vec<f64>,
    /// CUPTI kernel time of each half (a separate profiled run of as many calls): dispatch
    /// send, dispatch recv, combine send, combine recv; `Err(why)` where CUPTI is missing.
    pub kernel: Result<[Vec<f64>; 4], String>,
}

/// Why a hook-split run stopped: its combine output differs from the oracle (the run fails),
/// or a CUDA/API error (the split is reported missing, with this reason).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HookError {
    #[error("{0}")]
    Mismatch(String),
    #[error(transparent)]
    Gpu(#[from] crate::error::GpuError),
}

/// The CUPTI records of kernel `name` launched twice per call (send, then receive), split into
/// per-call halves (slowest device each).
pub fn per_half_us(
    records: &[crate::cupti::KernelRecord],
    name: &str,
    devices: &[u32],
    calls: usize,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    // Check every device's records before allocating anything sized by `calls`.
    let mut per_dev = Vec::with_capacity(devices.len());
    for &d in devices {
        let mut mine: Vec<_> = records
            .iter()
            .filter(|r| r.name == name && r.device == d)
            .collect();
        if Some(mine.len()) != calls.checked_mul(2) {
            return Err(format!(
                "{name}: {} record(s) on device {d}, expected {calls} call(s) x 2 halves",
                mine.len()
            ));
        }
        mine.sort_by_key(|r| r.start_ns);
        per_dev.push(mine);
    }
    let mut send = vec![0f64; calls];
    let mut recv = vec![0f64; calls];
    for mine in per_dev {
        for (i, c) in mine.chunks_exact(2).enumerate() {
            send[i] = send[i].max(c[0].duration_us());
            recv[i] = recv[i].max(c[1].duration_us());
        }
    }
    Ok((send, recv))
}

/// A u16 buffer seen as bf16.
fn bf16_view(b: &cudarc::driver::CudaSlice<u16>) -> cudarc::driver::CudaView<'_, bf16> {
    // SAFETY: u16 and bf16 have the same size and alignment; every bit pattern is a bf16.
    unsafe { b.transmute::<bf16>(b.len()) }.expect("same length")
}

/// u16 buffers seen as mutable bf16 views.
fn bf16_views(
    bufs: &mut [cudarc::driver::CudaSlice<u16>],
) -> Vec<cudarc::driver::CudaViewMut<'_, bf16>> {
    bufs.iter_mut()
        .map(|b| {
            let n = b.len();
            // SAFETY: as in `bf16_view`, for a mutable view.
            unsafe { b.transmute_mut::<bf16>(n) }.expect("same length")
        })
        .collect()
}

/// Times the receive-hook split of `path`: uploads every rank's inputs to buffers of its own
/// (on one new stream per GPU of the group), runs `warmup` split pairs and checks the last
/// combine bit for bit against `want_combine` (the oracle's), then times `iters` pairs with
/// events around each half, then profiles `iters` more under CUPTI. Synchronises before it
/// returns (also on errors: the buffers it frees are idle).
#[allow(clippy::too_many_arguments)]
pub fn hook_split(
    g: &mut GpuGroup,
    path: Path,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
    y: &[Vec<bf16>],
    want_combine: &[Vec<bf16>],
    iters: usize,
    warmup: usize,
) -> Result<HookSplit, HookError> {
    use crate::runtime::{CombineIn, DispatchIn, Tokens};
    use cudarc::driver::{result, CudaContext, CudaSlice};
    let cfg = *g.config();
    let (r, k) = (cfg.num_ranks, cfg.top_k);
    let gerr =
        |what: &str, e: cudarc::driver::DriverError| -> HookError { cuda_err(what, e).into() };
    // One stream per GPU of the group, on a context object of our own with cudarc's
    // cross-stream event tracking off (all work here is on that one stream per GPU).
    let mut streams = Vec::new();
    for (c, _) in g.streams() {
        let ctx = CudaContext::new(c.ordinal()).map_err(|e| gerr("context", e))?;
        // SAFETY: nothing of this context object is in use yet; every buffer below is used on
        // its GPU's one stream only, so the implicit events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let s = ctx.new_stream().map_err(|e| gerr("stream", e))?;
        streams.push((ctx, s));
    }
    let per = r / streams.len();
    let st = |q: usize| &streams[q / per].1;
    let bits = |v: &[bf16]| -> Vec<u16> { v.iter().map(|b| b.to_bits()).collect() };
    struct Bufs {
        x: CudaSlice<u16>,
        t: CudaSlice<i64>,
        w: CudaSlice<f32>,
        y: CudaSlice<u16>,
    }
    let mut bufs = Vec::with_capacity(r);
    let mut outbufs: Vec<CudaSlice<u16>> = Vec::with_capacity(r);
    for q in 0..r {
        let s = st(q);
        let up = |e| gerr("upload", e);
        // Zero-length inputs (a rank without tokens) still need a valid allocation.
        let pad = |v: Vec<u16>| if v.is_empty() { vec![0u16] } else { v };
        let t = if topk_idx[q].is_empty() {
            vec![-1i64]
        } else {
            topk_idx[q].clone()
        };
        let w = if topk_weights[q].is_empty() {
            vec![0f32]
        } else {
            topk_weights[q].clone()
        };
        bufs.push(Bufs {
            x: s.clone_htod(&pad(bits(&x[q]))).map_err(up)?,
            t: s.clone_htod(&t).map_err(up)?,
            w: s.clone_htod(&w).map_err(up)?,
            y: s.clone_htod(&bits(&y[q])).map_err(up)?,
        });
        outbufs.push(s.alloc_zeros(x[q].len().max(1)).map_err(up)?);
    }
    let xs: Vec<_> = bufs.iter().map(|b| bf16_view(&b.x)).collect();
    let ts: Vec<_> = bufs.iter().map(|b| b.t.slice(..)).collect();
    let ws: Vec<_> = bufs.iter().map(|b| b.w.slice(..)).collect();
    let ys: Vec<_> = bufs.iter().map(|b| bf16_view(&b.y)).collect();
    let dins: Vec<DispatchIn> = (0..r)
        .map(|q| DispatchIn {
            x: &xs[q],
            topk_idx: &ts[q],
            n_tokens: Tokens::Host(topk_idx[q].len() / k),
        })
        .collect();
    let cins: Vec<CombineIn> = (0..r)
        .map(|q| CombineIn {
            y: &ys[q],
            topk_idx: &ts[q],
            topk_weights: &ws[q],
        })
        .collect();
    let sref: Vec<&cudarc::driver::CudaStream> = streams.iter().map(|(_, s)| s.as_ref()).collect();
    let raw: Vec<_> = streams
        .iter()
        .map(|(c, s)| (c.clone(), s.cu_stream()))
        .collect();
    let sync_all = || -> Result<(), HookError> {
        for (_, s) in &streams {
            s.synchronize().map_err(|e| gerr("synchronize", e))?;
        }
        Ok(())
    };
    // One split pair; `mark(i)` records event i of the pair (0..5) when timing.
    let pair = |g: &mut GpuGroup,
                ov: &mut [cudarc::driver::CudaViewMut<'_, bf16>],
                mark: &mut dyn FnMut(usize) -> Result<(), crate::error::GpuError>|
     -> Result<(), crate::error::GpuError> {
        mark(0)?;
        let hk = g.dispatch_send(path, &sref, &dins, None)?;
        mark(1)?;
        let handle = g.dispatch_recv(hk, &sref)?;
        mark(2)?;
        let ch = g.combine_send(&sref, &handle, &cins, ov)?;
        mark(3)?;
        g.combine_recv(ch, &sref)?;
        mark(4)
    };
    let run = (|| -> Result<HookSplit, HookError> {
        let mut ov = bf16_views(&mut outbufs);
        for _ in 0..warmup.max(1) {
            pair(g, &mut ov, &mut |_| Ok(()))?;
        }
        sync_all()?;
        g.check()?;
        drop(ov);
        for (q, o) in outbufs.iter().enumerate() {
            let got = st(q).clone_dtoh(o).map_err(|e| gerr("download", e))?;
            let n = want_combine[q].len();
            if got[..n]
                .iter()
                .zip(&want_combine[q])
                .any(|(a, b)| *a != b.to_bits())
            {
                return Err(HookError::Mismatch(format!(
                    "{} combine through the receive hook differs from the oracle on rank {q}",
                    path.name()
                )));
            }
        }
        let mut ov = bf16_views(&mut outbufs);
        let n_ev = iters
            .checked_mul(5)
            .ok_or_else(|| crate::error::GpuError::Unsupported(format!("{iters} timed calls")))?;
        let evs = Events::new(&raw, n_ev)?;
        for it in 0..iters {
            pair(g, &mut ov, &mut |i| {
                for (d, (ctx, s)) in raw.iter().enumerate() {
                    ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
                    // SAFETY: event and stream of this (bound) context.
                    unsafe { result::event::record(evs.per_dev[d].1[5 * it + i], *s) }
                        .map_err(|e| cuda_err("record", e))?;
                }
                Ok(())
            })?;
        }
        sync_all()?;
        g.check()?;
        let mut halves = [
            vec![0f64; iters],
            vec![0f64; iters],
            vec![0f64; iters],
            vec![0f64; iters],
        ];
        for (ctx, ev) in &evs.per_dev {
            ctx.bind_to_thread().map_err(|e| gerr("bind", e))?;
            for it in 0..iters {
                for (i, half) in halves.iter_mut().enumerate() {
                    // SAFETY: both events were recorded on this context and have completed.
                    let ms = unsafe { result::event::elapsed(ev[5 * it + i], ev[5 * it + i + 1]) }
                        .map_err(|e| gerr("elapsed", e))?;
                    half[it] = half[it].max(ms as f64 * 1e3);
                }
            }
        }
        drop(evs);
        let kernel = if iters == 0 {
            Err("no timed calls (--iters 0)".to_string())
        } else {
            match crate::cupti::KernelTimer::start() {
                Err(e) => Err(e.to_string()),
                Ok(timer) => {
                    let mut ran = Ok(());
                    for _ in 0..iters {
                        ran = pair(g, &mut ov, &mut |_| Ok(()));
                        if ran.is_err() {
                            break;
                        }
                    }
                    let synced = sync_all();
                    // Finish the timer whatever the run did: CUPTI's state is per process.
                    let recs = timer.finish();
                    ran?;
                    synced?;
                    g.check()?;
                    let devices: Vec<u32> = raw.iter().map(|(c, _)| c.ordinal() as u32).collect();
                    let (dn, cn) = kernel_names(path);
                    recs.map_err(|e| e.to_string()).and_then(|recs| {
                        let (ds, dr) = per_half_us(&recs, dn, &devices, iters)?;
                        let (cs, cr) = per_half_us(&recs, cn, &devices, iters)?;
                        Ok([ds, dr, cs, cr])
                    })
                }
            }
        };
        let [ds, dr, cs, cr] = halves;
        Ok(HookSplit {
            dispatch_send_us: ds,
            dispatch_recv_us: dr,
            combine_send_us: cs,
            combine_recv_us: cr,
            kernel,
        })
    })();
    // Whatever happened, nothing of ours may still run when the buffers are freed.
    let _ = sync_all();
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    fn rec(name: &str, device: u32, start_ns: u64, dur_ns: u64) -> crate::cupti::KernelRecord {
        crate::cupti::KernelRecord {
            name: name.into(),
            start_ns,
            end_ns: start_ns + dur_ns,
            device,
            context: 1,
            stream: 1,
            correlation: 0,
        }
    }

    /// The NCCL figures by hand for a small case: R = 2, E = 4 (L = 2), T = 2, K = 2, H = 128,
    /// bf16. Rank 0: token 0 -> experts 0, 2; token 1 -> 1, -1. Rank 1: token 0 -> 3, 2.
    #[test]
    fn nccl_accounting_counts_every_send_and_byte() {
        let cfg = Config::new(2, 4, 2, 128, 2, Mode::Bf16).unwrap();
        let topk = vec![vec![0, 2, 1, -1], vec![3, 2]];
        let hb = 4 * 4; // (2 + L) i32
        let eb = crate::runtime::entry_bytes(&cfg) as u64; // 80 + 256
        let peb = crate::runtime::pe_entry_bytes(&cfg) as u64; // 16 + 256
        let rowb = 256u64;
        assert_eq!((eb, peb), (336, 272));
        // Pairs (0,0): 2 tokens, sel 2 (experts 0, 1); (0,1): 1 token, sel 1 (expert 2);
        // (1,0): nothing; (1,1): 1 token, sel 2 (experts 2, 3). Four headers.
        let b = nccl_accounting(&cfg, &topk, Path::Batched, NcclSizes::Exact).unwrap();
        assert_eq!(b, (4 * hb + 4 * eb, 5 * rowb, 4 + 3, 3));
        let c = nccl_accounting(&cfg, &topk, Path::Batched, NcclSizes::Capacity).unwrap();
        // Capacity: T = 2 entries and T * min(K, L) = 4 rows on every pair.
        assert_eq!(c, (4 * hb + 4 * 2 * eb, 4 * 4 * rowb, 4 * 2, 4));
        let p = nccl_accounting(&cfg, &topk, Path::PerExpert, NcclSizes::Exact).unwrap();
        // Messages per (pair, expert with rows): (0,0) 2, (0,1) 1, (1,1) 2.
        assert_eq!(p, (4 * hb + 5 * peb, 5 * rowb, 4 + 5, 5));
        assert!(nccl_accounting(&cfg, &topk, Path::PerExpert, NcclSizes::Capacity).is_err());
        assert!(nccl_accounting(&cfg, &[vec![9, -1]], Path::Batched, NcclSizes::Exact).is_err());
    }

    /// Two launches per call: the earlier one is the send half, the later the receive half,
    /// whatever order the records arrive in; the slowest device counts; a missing record is
    /// an error naming the kernel and device.
    #[test]
    fn per_half_splits_records_in_start_order() {
        let recs = vec![
            rec("k", 0, 3000, 40), // call 1 recv
            rec("k", 0, 0, 10),    // call 0 send
            rec("k", 0, 2000, 30), // call 1 send
            rec("k", 0, 1000, 20), // call 0 recv
            rec("other", 0, 500, 999),
            rec("k", 1, 0, 15),
            rec("k", 1, 1000, 5),
            rec("k", 1, 2000, 1),
            rec("k", 1, 3000, 50),
        ];
        let (send, recv) = per_half_us(&recs, "k", &[0, 1], 2).unwrap();
        let us = |v: &[f64]| {
            v.iter()
                .map(|x| (x * 1e3).round() as u64)
                .collect::<Vec<_>>()
        };
        assert_eq!(us(&send), [15, 30]);
        assert_eq!(us(&recv), [20, 50]);
        let e = per_half_us(&recs[..8], "k", &[0, 1], 2).unwrap_err();
        assert!(e.contains("k: 3 record(s) on device 1"), "{e}");
        assert!(per_half_us(&recs, "k", &[0], usize::MAX).is_err());
    }

    /// A launch that fails half-way through a captured timing run must leave no capture behind
    /// (issue 10 item 8): the stream is not capturing afterwards and the group times again.
    /// Needs a GPU, so it is ignored by default (CI has none) and run on the GPU machine with
    /// `--ignored`; there, without a GPU, it fails rather than pass.
    #[test]
    #[ignore = "needs a GPU: run with --ignored on the GPU machine"]
    fn failed_capture_leaves_no_capture_behind() {
        use cudarc::driver::sys;
        if let Err(why) = probe() {
            panic!("needs a GPU: {why}");
        }
        let cfg = Config::new(2, 16, 8, 256, 4, Mode::Bf16).unwrap();
        let mut g = GpuGroup::new(&cfg, GpuOptions::default()).unwrap();
        let mut rng = crate::testing::Rng::new(3);
        let data = crate::testing::random_inputs(
            &cfg,
            &[8, 8],
            crate::testing::Routing::Random { masked: 0.1 },
            &mut rng,
        );
        let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
        let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
        g.dispatch(Path::Batched, &x, &idx).unwrap();
        let mut n = 0;
        let r = time_loop(&mut g, 4, 0, true, &mut |g, op| {
            n += 1;
            if n == 3 {
                return Err(crate::error::GpuError::Cuda("injected failure".into()));
            }
            g.launch(op, Path::Batched)
        });
        assert!(
            matches!(&r, Err(crate::error::GpuError::Cuda(m)) if m == "injected failure"),
            "{r:?}"
        );
        for (ctx, s) in g.streams() {
            ctx.bind_to_thread().unwrap();
            let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
            // SAFETY: the stream belongs to the bound context; `st` is a valid out-pointer.
            unsafe { sys::cuStreamIsCapturing(s, &mut st) }
                .result()
                .unwrap();
            assert_eq!(
                st,
                sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
                "the stream is still capturing after the failed run"
            );
        }
        let (d, c) = time_path(&mut g, Path::Batched, 3, 1, true).unwrap();
        assert_eq!((d.len(), c.len()), (3, 3));
        assert!(d.iter().chain(&c).all(|&us| us > 0.0), "{d:?} {c:?}");
    }

    /// CUPTI kernel time of a small group: one record per call and kernel, durations below the
    /// event figures' sum (events also hold launch gaps). On the GPU machine only.
    #[test]
    #[ignore = "needs a GPU and libcupti: run with --ignored on the GPU machine"]
    fn cupti_kernel_times_match_the_calls() {
        if let Err(why) = probe() {
            panic!("needs a GPU: {why}");
        }
        let cfg = Config::new(2, 16, 8, 256, 4, Mode::FP8).unwrap();
        let mut g = GpuGroup::new(&cfg, GpuOptions::default()).unwrap();
        let mut rng = crate::testing::Rng::new(5);
        let data = crate::testing::random_inputs(
            &cfg,
            &[8, 5],
            crate::testing::Routing::Random { masked: 0.1 },
            &mut rng,
        );
        let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
        let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
        for path in [Path::PerExpert, Path::Batched] {
            g.dispatch(path, &x, &idx).unwrap();
            for graph in [false, true] {
                let (de, ce) = time_path(&mut g, path, 20, 2, graph).unwrap();
                let k = kernel_times(&mut g, path, 20, graph).unwrap();
                assert_eq!(k.launches_per_call, 1);
                assert_eq!((k.dispatch_us.len(), k.combine_us.len()), (20, 20));
                assert!(k.dispatch_us.iter().chain(&k.combine_us).all(|&u| u > 0.0));
                let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
                println!(
                    "{} graph={graph}: dispatch events {:.2} us, CUPTI kernel {:.2} us; \
                     combine events {:.2} us, CUPTI kernel {:.2} us",
                    path.name(),
                    mean(&de),
                    mean(&k.dispatch_us),
                    mean(&ce),
                    mean(&k.combine_us)
                );
            }
        }
    }
}
