//! The GPU timing run `ep-bench` calls: both paths checked bitwise against the oracle on the
//! same inputs, then timed with CUDA events, under CUPTI, and through the receive-hook split.

use crate::timing::events::time_path;
use crate::timing::hook::{hook_split, HookError, HookSplit};
use crate::timing::kernel::{kernel_times, KernelTimes};
use crate::traffic::{accounting, logfmt_combine_bytes, nccl_accounting};
use ep_kernels::runtime::{Buffers, GpuGroup, GpuOptions, NcclSizes, Path, Transport};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::workload::received_counts;
use ep_reference::{CombineFormat, Config, DispatchOutput, Op};
use half::bf16;

/// One path's timings. `dispatch_us`/`combine_us` are CUDA-event figures (stream time from the
/// event before a launch to the event after it); `kernel` is the kernel's own GPU time from
/// CUPTI's activity records, the figure DeepEP's test prints.
#[derive(Debug, Clone)]
pub struct GpuTimings {
    pub path: Path,
    /// Over NCCL: the sizing mode this path ran; None over NVLink.
    pub nccl_sizes: Option<NcclSizes>,
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

/// Runs both paths on the same inputs (one Vec per rank), each on a group of its own that
/// holds that path's receive area only ([`HostSide`] computes the oracle's outputs once for
/// both), checks both bitwise against the oracle first (Err if not equal; the received rows of
/// each rank), then times each path with CUDA events: `warmup` calls, then `iters`
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
        CombineFormat::Bf16,
    )
}

/// [`run`] with the groups' options (transport, NCCL sizing; `buffers` is set per path) and
/// the choice of graph replay
/// (`graph`, one GPU only) or one launch per call. Over NCCL the calls are
/// launched one by one (exact sizes read headers on the host mid-call: nothing to capture), the
/// per-expert path runs exact sizes whatever `opts.nccl_sizes` says (capacity would send L*T
/// entries per peer; the group refuses it), and the wire figures come from
/// [`nccl_accounting`] (no device signals). Combine moves its rows in `format`: with LogFMT the
/// expert outputs are scaled by 2^-4 ([`HostSide::new_with`]) so that their groups pack, and
/// its wire figures are [`logfmt_combine_bytes`]'s.
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
    format: CombineFormat,
) -> Result<GpuReport, String> {
    let num_gpus = opts.num_gpus;
    let nccl = opts.transport == Transport::Nccl;
    let inner = || -> Result<GpuReport, String> {
        let host = HostSide::new_with(cfg, x, topk_idx, topk_weights, format)?;
        let mut device = String::new();
        let mut gpus = 0;
        let mut paths = Vec::new();
        for path in Path::ALL {
            // One group per path, holding that path's receive area only, dropped before the
            // next path's is built: at R = 128 on one GPU 116.7 GiB, against 131.2 GiB for
            // one group of both paths (`crate::memory::gpu_device_bytes`, `ep-scale bench`).
            let path_opts = GpuOptions {
                buffers: Buffers {
                    path: Some(path),
                    own_tensors: true,
                },
                ..opts
            };
            let mut g = GpuGroup::new(cfg, path_opts).map_err(|e| e.to_string())?;
            g.set_combine_format(format).map_err(|e| e.to_string())?;
            device = g.describe_devices();
            gpus = g.num_gpus();
            let sizes = match path {
                Path::PerExpert => NcclSizes::Exact,
                Path::Batched => opts.nccl_sizes,
            };
            g.set_nccl_sizes(sizes);
            check_dispatch(&mut g, path, x, topk_idx, &host.want)?;
            let y = &host.y;
            let want_c = &host.want_c;
            let got_c = g
                .combine(path, y, topk_weights)
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
            drop(got_c);
            let graph = graph && num_gpus == 1 && !nccl;
            let (dt, ct) =
                time_path(&mut g, path, iters, warmup, graph).map_err(|e| e.to_string())?;
            let kernel = kernel_times(&mut g, path, iters, graph);
            // The split combines the group's own y, which the combine above uploaded.
            let hook = match hook_split(
                &mut g,
                path,
                x,
                topk_idx,
                topk_weights,
                want_c,
                iters,
                warmup,
            ) {
                Ok(h) => Ok(h),
                Err(HookError::Mismatch(m)) => return Err(m),
                Err(HookError::Gpu(e)) => Err(e.to_string()),
            };
            let (dw, mut cw, dm, mut cm, mut sig) = if g.uses_nccl() {
                let (dw, cw, dm, cm) = nccl_accounting(cfg, topk_idx, path, sizes)?;
                (dw, cw, dm, cm, 0)
            } else {
                accounting(cfg, topk_idx, path, num_gpus)
            };
            if format == CombineFormat::LogFmt {
                // Every row is put encoded (none read in place): its encoded size; the batched
                // path then puts a batch to, and signals, every source.
                cw = logfmt_combine_bytes(cfg, &received_counts(cfg, topk_idx), y);
                if path == Path::Batched {
                    let pairs = (cfg.num_ranks * cfg.num_ranks) as u64;
                    (cm, sig) = (pairs, 2 * pairs);
                }
            }
            paths.push(GpuTimings {
                path,
                nccl_sizes: g.uses_nccl().then_some(sizes),
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
            num_gpus: gpus,
            paths,
        })
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(inner))
        .unwrap_or_else(|_| Err("GPU benchmark panicked".into()))
}

/// What the host holds for a GPU run: the oracle's outputs and the expert outputs, each sized
/// by what the routing sends, not by the L x R*T capacity (E x T rows per rank, 470 MB of y at
/// E = 256, T = 128, H = 7168, whatever R): the capacity-shaped buffers sit on zeroed pages
/// (`DispatchOutput::zeroed`, `ep_reference::numerics::bf16::zeroed`) of which only the
/// received rows are ever written.
pub struct HostSide {
    /// Every rank's dispatch output as the oracle computes it.
    pub want: Vec<DispatchOutput>,
    /// Every rank's expert outputs, drawn for the received rows only
    /// (`testing::random_y_received`; any y in the dispatch layout is a valid combine input).
    pub y: Vec<Vec<bf16>>,
    /// Every rank's combine output as the oracle computes it from `y`.
    pub want_c: Vec<Vec<bf16>>,
}

impl HostSide {
    /// Computed once per run, before any group is built (a bf16 combine).
    pub fn new(
        cfg: &Config,
        x: &[Vec<bf16>],
        topk_idx: &[Vec<i64>],
        topk_weights: &[Vec<f32>],
    ) -> Result<HostSide, String> {
        HostSide::new_with(cfg, x, topk_idx, topk_weights, CombineFormat::Bf16)
    }

    /// [`HostSide::new`] for a combine in `format`: with LogFMT the expert outputs are scaled
    /// by 2^-4 (values in [-0.5, 0.5], as the CPU backend feeds them) so that their groups
    /// pack, and `want_c` is `oracle::combine_with` of the format.
    pub fn new_with(
        cfg: &Config,
        x: &[Vec<bf16>],
        topk_idx: &[Vec<i64>],
        topk_weights: &[Vec<f32>],
        format: CombineFormat,
    ) -> Result<HostSide, String> {
        let inputs: Vec<RankInput> = (0..cfg.num_ranks)
            .map(|r| RankInput {
                x: &x[r],
                topk_idx: &topk_idx[r],
            })
            .collect();
        // The oracle's dispatch on a thread of its own beside y and the oracle's combine, which
        // need the counts only (at R = 64 on a development machine: 3.7 s against 4.0 + 3.4 s).
        let counts = received_counts(cfg, topk_idx);
        let (want, y_want_c) = std::thread::scope(|s| {
            let want = s.spawn(|| oracle::dispatch(cfg, &inputs).map_err(|e| e.to_string()));
            let mut y = ep_kernels::testing::random_y_received(
                cfg,
                &counts,
                &mut ep_kernels::testing::Rng::new(7),
            );
            if format == CombineFormat::LogFmt {
                // The received rows only: the others stay untouched zero pages.
                let (h, per) = (cfg.hidden, cfg.rows_per_expert());
                for (y, c) in y.iter_mut().zip(&counts) {
                    for (l, &n) in c.iter().enumerate() {
                        let rows = usize::try_from(n).unwrap_or(0).min(per);
                        for v in &mut y[l * per * h..(l * per + rows) * h] {
                            *v = bf16::from_f32(v.to_f32() * 0.0625);
                        }
                    }
                }
            }
            let cin: Vec<CombineInput> = (0..cfg.num_ranks)
                .map(|r| CombineInput {
                    y: &y[r],
                    topk_idx: &topk_idx[r],
                    topk_weights: &topk_weights[r],
                })
                .collect();
            let want_c = oracle::combine_with(cfg, &cin, format).map_err(|e| e.to_string());
            let want = want
                .join()
                .unwrap_or_else(|_| Err("the oracle's dispatch panicked".into()));
            (want, want_c.map(|c| (y, c)))
        });
        let (y, want_c) = y_want_c?;
        Ok(HostSide {
            want: want?,
            y,
            want_c,
        })
    }
}

/// One dispatch of every rank on `path` through the host harness, each rank's output read back
/// (its received rows: `GpuGroup::read_dispatch_output`) and compared with the oracle's before
/// the next is read, so that one rank's copy is held at a time.
fn check_dispatch(
    g: &mut GpuGroup,
    path: Path,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    want: &[DispatchOutput],
) -> Result<(), String> {
    let gpu = |e: ep_kernels::GpuError| e.to_string();
    g.upload_dispatch_inputs(x, topk_idx).map_err(gpu)?;
    g.launch(Op::Dispatch, path).map_err(gpu)?;
    g.sync().map_err(gpu)?;
    for (r, b) in want.iter().enumerate() {
        let a = g.read_dispatch_output(r).map_err(gpu)?;
        if let Some(d) = a.diff(b) {
            return Err(format!(
                "{} dispatch differs from the oracle on rank {r}: {d}",
                path.name()
            ));
        }
    }
    Ok(())
}
