//! The CUDA-event timing loop: events around every launch on every device, the calls replayed
//! from a CUDA graph on one GPU, and the empty kernel's launch overhead. Every error path ends a
//! capture and destroys the graph, its executable and the events.

use ep_kernels::runtime::{GpuGroup, Path};
use ep_kernels::GpuError;
use ep_reference::Op;

/// Per-launch time of the empty kernel (same grid), stream launches: the fixed overhead.
pub fn time_empty(g: &mut GpuGroup, iters: usize) -> Result<Vec<f64>, GpuError> {
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
) -> Result<(Vec<f64>, Vec<f64>), GpuError> {
    time_loop(g, iters, warmup, graph, &mut |g, op| g.launch(op, path))
}

type Launch<'a> = dyn FnMut(&mut GpuGroup, Op) -> Result<(), GpuError> + 'a;

pub(crate) fn cuda_err(what: &str, e: cudarc::driver::result::DriverError) -> GpuError {
    GpuError::Cuda(format!("{what}: {e:?}"))
}

/// Timing events of every device, destroyed on drop (also when timing fails half-way).
pub(crate) struct Events {
    pub(crate) per_dev: Vec<(
        std::sync::Arc<cudarc::driver::CudaContext>,
        Vec<cudarc::driver::sys::CUevent>,
    )>,
}

impl Events {
    pub(crate) fn new(
        streams: &[(
            std::sync::Arc<cudarc::driver::CudaContext>,
            cudarc::driver::sys::CUstream,
        )],
        n: usize,
    ) -> Result<Events, GpuError> {
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
/// longer capturing.
struct Capture {
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    stream: cudarc::driver::sys::CUstream,
    open: bool,
}

impl Capture {
    fn begin(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<Capture, GpuError> {
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
    fn end(mut self) -> Result<Graph, GpuError> {
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
    fn replay_once(&mut self, stream: cudarc::driver::sys::CUstream) -> Result<(), GpuError> {
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
) -> Result<(Vec<f64>, Vec<f64>), GpuError> {
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
        .ok_or_else(|| GpuError::Unsupported(format!("{iters} timed calls")))?;
    let evs = Events::new(&streams, n_ev)?;
    let graph = graph && streams.len() == 1;
    let record = |i: usize| -> Result<(), GpuError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use ep_kernels::runtime::probe;
    use ep_kernels::runtime::GpuOptions;
    use ep_reference::{Config, Mode};

    /// A launch that fails half-way through a captured timing run must leave no capture behind:
    /// the stream is not capturing afterwards and the group times again.
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
        let mut rng = ep_kernels::testing::Rng::new(3);
        let data = ep_kernels::testing::random_inputs(
            &cfg,
            &[8, 8],
            ep_kernels::testing::Routing::Random { masked: 0.1 },
            &mut rng,
        );
        let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
        let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
        g.dispatch(Path::Batched, &x, &idx).unwrap();
        let mut n = 0;
        let r = time_loop(&mut g, 4, 0, true, &mut |g, op| {
            n += 1;
            if n == 3 {
                return Err(GpuError::Cuda("injected failure".into()));
            }
            g.launch(op, Path::Batched)
        });
        assert!(
            matches!(&r, Err(GpuError::Cuda(m)) if m == "injected failure"),
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
}
