//! The GPU backend of ep-bench: `crate::timing` runs both paths' CUDA kernels on the same
//! inputs, checks both bitwise against the oracle before timing, and times each call with CUDA
//! events. All ranks of a GPU run in one launch, so every rank of a call shares one latency
//! sample (the slowest GPU's); the per-rank lines differ only by each rank's own bytes.
//! Beside the event figures, each path's kernel time from CUPTI (DeepEP's figure: each kernel's
//! own GPU duration), or why it is missing ([`crate::report::KernelTime`]), and the receive-hook
//! split ([`crate::report::HookSplit`]).

use crate::accounting;
use crate::report::{
    assemble, HookSplit, KernelTime, PathSamples, PointInfo, PointResult, RankSamples, Traffic,
};
use crate::spec::{BenchError, BenchSpec};
use crate::stats::Summary;
use ep_reference::Path;

/// `Ok(device)` when a CUDA GPU is usable, `Err(why not)` otherwise. Never panics.
pub fn probe() -> Result<String, String> {
    ep_kernels::runtime::probe()
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
    // As run_with decides: a graph on one GPU only, never over NCCL (exact sizes sync the host).
    let graph = spec.graph.unwrap_or(spec.gpus == 1) && spec.gpus == 1 && spec.nccl.is_none();
    let opts = ep_kernels::GpuOptions {
        num_gpus: spec.gpus,
        transport: if spec.nccl.is_some() {
            ep_kernels::Transport::Nccl
        } else {
            ep_kernels::Transport::Auto
        },
        nccl_sizes: spec.nccl.unwrap_or_default(),
        scales_column_major: spec.scales_column_major,
        ..Default::default()
    };
    let report = crate::timing::run_with(
        &cfg,
        &w.x,
        &w.topk_idx,
        &w.topk_weights,
        spec.iters,
        spec.warmup,
        opts,
        graph,
        spec.combine,
    )
    .map_err(|e| {
        if e.contains("differ") || e.contains("mismatch") {
            BenchError::Mismatch(e)
        } else {
            BenchError::Backend(e)
        }
    })?;
    let nccl_note = |path: Path| {
        report
            .paths
            .iter()
            .find(|t| t.path == path)
            .and_then(|t| t.nccl_sizes)
            .map_or("-", |s| s.name())
    };
    let device = match spec.nccl {
        None => format!("{device} ({} GPU(s))", report.num_gpus),
        Some(_) => format!(
            "{device} ({} GPU(s)), NCCL transport for every peer: per-expert {} sizes, batched {} sizes; messages = NCCL sends, bytes = what they carry (headers, capacity padding included), no device signals",
            report.num_gpus,
            nccl_note(Path::PerExpert),
            nccl_note(Path::Batched)
        ),
    };
    let kernel_times: Vec<KernelTime> = report
        .paths
        .iter()
        .map(|t| kernel_time(&t.kernel))
        .collect();
    let hook_splits: Vec<HookSplit> = report.paths.iter().map(|t| hook_split(&t.hook)).collect();
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
    let mut point = assemble(
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
            verified: if graph {
                "ep-kernels checked both paths bitwise against the oracle before timing; timed calls replayed from a CUDA graph"
            } else {
                "ep-kernels checked both paths bitwise against the oracle before timing; timed calls launched one by one (stream)"
            },
            load_average: None,
        },
        paths,
    );
    point.config.combine = spec.combine.name();
    for ((p, k), h) in point.paths.iter_mut().zip(kernel_times).zip(hook_splits) {
        p.kernel_time = Some(k);
        p.hook_split = Some(h);
    }
    Ok(point)
}

/// The report's form of one path's CUPTI kernel time.
fn kernel_time(k: &Result<crate::timing::KernelTimes, String>) -> KernelTime {
    let summarize = |v: &[f64]| Summary::of(v).ok_or("no profiled calls");
    match k {
        Ok(k) => match (summarize(&k.dispatch_us), summarize(&k.combine_us)) {
            (Ok(dispatch), Ok(combine)) => KernelTime::Measured {
                dispatch,
                combine,
                launches_per_call: k.launches_per_call,
            },
            (Err(e), _) | (_, Err(e)) => KernelTime::Unavailable { reason: e.into() },
        },
        Err(e) => KernelTime::Unavailable { reason: e.clone() },
    }
}

/// The report's form of one path's receive-hook split.
fn hook_split(h: &Result<crate::timing::HookSplit, String>) -> HookSplit {
    let four = |v: [&[f64]; 4]| -> Result<[Summary; 4], String> {
        let s = |x: &[f64]| Summary::of(x).ok_or_else(|| "no timed calls".to_string());
        Ok([s(v[0])?, s(v[1])?, s(v[2])?, s(v[3])?])
    };
    match h {
        Err(reason) => HookSplit::Unavailable {
            reason: reason.clone(),
        },
        Ok(h) => match four([
            &h.dispatch_send_us,
            &h.dispatch_recv_us,
            &h.combine_send_us,
            &h.combine_recv_us,
        ]) {
            Err(reason) => HookSplit::Unavailable { reason },
            Ok(events) => HookSplit::Measured {
                events,
                kernel: h
                    .kernel
                    .as_ref()
                    .map_err(|e| e.clone())
                    .and_then(|k| four([&k[0], &k[1], &k[2], &k[3]])),
            },
        },
    }
}

/// `ep-bench --profile`: the in-kernel phase profile of one call of each kernel. Every block stamps `%globaltimer` at the start of each phase; a
/// line per (path, op) gives, per phase i, the median/max over device 0's blocks of
/// (stamp_i - earliest block start), in us, from the third of three profiled calls (the first
/// two warm up). First line: the per-launch time of an empty kernel with the same grid, stream
/// launches (the fixed overhead). A debugging figure: the stamps perturb the kernels slightly.
/// With `blocks`, every block's stamps of each batched kernel follow its line (`block b:` and
/// the reached phases, us since the earliest block start).
pub fn phase_profile(spec: &BenchSpec, blocks: bool) -> Result<String, BenchError> {
    use ep_kernels::{GpuGroup, GpuOptions, Path};
    use ep_reference::Op;
    use std::fmt::Write as _;
    let be = |e: ep_kernels::GpuError| BenchError::Backend(format!("profile: {e}"));
    let cfg = spec.cfg;
    let w = spec.workload();
    // Drawn for the received rows only (the upload takes no other row); for LogFMT scaled by
    // 2^-4 into [-0.5, 0.5], as the timed runs do, so that the groups pack.
    let mut y = w.expert_outputs_received(spec.seed, &w.received_counts());
    if spec.combine == ep_reference::CombineFormat::LogFmt {
        for v in y.iter_mut().flatten() {
            *v = half::bf16::from_f32(v.to_f32() * 0.0625);
        }
    }
    let mut g = GpuGroup::new(
        &cfg,
        GpuOptions {
            num_gpus: spec.gpus,
            scales_column_major: spec.scales_column_major,
            ..Default::default()
        },
    )
    .map_err(be)?;
    // The combine in the point's format (`--logfmt`: the LogFMT encoder's and decoder's stamps).
    g.set_combine_format(spec.combine).map_err(be)?;
    let mut s = String::new();
    let empty = crate::timing::time_empty(&mut g, 200).map_err(be)?;
    let med = |v: &[f64]| Summary::of(v).map_or(f64::NAN, |m| m.median_us);
    let _ = writeln!(
        s,
        "profile R={}: empty kernel ({} blocks x 512 on device 0), stream launches: median {:.2} us",
        cfg.num_ranks,
        g.blocks_per_rank() * (cfg.num_ranks / g.num_gpus().max(1)),
        med(&empty)
    );
    // The same empty kernel under CUPTI: the GPU duration of a launch of this grid that does
    // nothing, the floor under every kernel figure (launch, block start and exit).
    match crate::cupti::KernelTimer::start() {
        Ok(timer) => {
            let run = (0..200)
                .try_for_each(|_| g.launch_empty())
                .and_then(|_| g.sync());
            let recs = timer.finish();
            let durs: Vec<f64> = recs
                .map(|r| {
                    r.iter()
                        .filter(|k| k.name.starts_with("ep_empty"))
                        .map(|k| k.duration_us())
                        .collect()
                })
                .unwrap_or_default();
            run.map_err(be)?;
            let _ = writeln!(
                s,
                "profile R={}: empty kernel, CUPTI kernel time: median {:.2} us ({} records)",
                cfg.num_ranks,
                med(&durs),
                durs.len()
            );
        }
        Err(e) => {
            let _ = writeln!(s, "profile: empty kernel's CUPTI time not measured: {e}");
        }
    }
    g.upload_dispatch_inputs(&w.x, &w.topk_idx).map_err(be)?;
    g.upload_combine_inputs(&y, &w.topk_weights).map_err(be)?;
    for path in Path::ALL {
        for op in [Op::Dispatch, Op::Combine] {
            let mut stamps = Vec::new();
            let mut halves = [Vec::new(), Vec::new()];
            for _ in 0..3 {
                if op == Op::Combine {
                    g.launch(Op::Dispatch, path).map_err(be)?;
                }
                stamps = g.profile(op, path).map_err(be)?;
            }
            for _ in 0..3 {
                if op == Op::Combine {
                    g.launch(Op::Dispatch, path).map_err(be)?;
                }
                halves = g.profile_halves(op, path).map_err(be)?;
            }
            for (what, st) in [("", &stamps), (" send", &halves[0]), (" recv", &halves[1])] {
                let _ = writeln!(
                    s,
                    "{}  (phase start, us since the first block started: median/max over blocks)",
                    phase_line(&format!("profile {:<10} {:?}{what}:", path.name(), op), st)
                );
                if blocks && path == Path::Batched {
                    s.push_str(&block_lines(st));
                }
            }
        }
    }
    g.sync().map_err(be)?;
    Ok(s)
}

/// The earliest block start (p0) of a profiled launch, the zero of its stamps.
fn first_start(stamps: &[[u64; ep_kernels::runtime::PROF_SLOTS]]) -> u64 {
    stamps
        .iter()
        .map(|s| s[0])
        .filter(|&v| v > 0)
        .min()
        .unwrap_or(0)
}

/// `--profile-blocks`: a line per block, its reached phases' stamps less the earliest block
/// start, in us.
fn block_lines(stamps: &[[u64; ep_kernels::runtime::PROF_SLOTS]]) -> String {
    use std::fmt::Write as _;
    let t0 = first_start(stamps);
    let mut out = String::new();
    for (b, st) in stamps.iter().enumerate() {
        let _ = write!(out, "  block {b}:");
        for (ph, &v) in st.iter().enumerate().filter(|(_, &v)| v > 0) {
            let _ = write!(out, " p{ph} {:.2}", v.saturating_sub(t0) as f64 / 1e3);
        }
        out.push('\n');
    }
    out
}

/// One line of the phase profile: per phase reached, the median/max over blocks of its stamp
/// less the earliest block start, in us.
fn phase_line(head: &str, stamps: &[[u64; ep_kernels::runtime::PROF_SLOTS]]) -> String {
    use std::fmt::Write as _;
    let t0 = first_start(stamps);
    let mut line = head.to_string();
    for ph in 0..ep_kernels::runtime::PROF_SLOTS {
        let v: Vec<f64> = stamps
            .iter()
            .filter(|s| s[ph] > 0)
            .map(|s| s[ph].saturating_sub(t0) as f64 / 1e3)
            .collect();
        if let Some(m) = Summary::of(&v) {
            let _ = write!(line, " p{ph} {:.1}/{:.1}", m.median_us, m.max_us);
        }
    }
    line
}
