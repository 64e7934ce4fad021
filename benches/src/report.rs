//! What one benchmark point produced, whichever backend ran it, and how it is printed.
//!
//! A backend hands [`assemble`] raw samples ([`PathSamples`]: every rank's latency of every
//! timed call, and what one call put on the wire); everything derived (summaries, DeepEP-style
//! bandwidths, speed-ups) is computed here, the same way for the CPU and the GPU backends.

use std::fmt::Write as _;

use ep_reference::{Config, Path};
use serde::{Serialize, Serializer};

use crate::accounting;
use crate::stats::Summary;

/// What one operation (dispatch or combine) of one path put on the wire in one call, summed
/// over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Traffic {
    /// Puts (messages).
    pub messages: u64,
    /// Signals posted; `None` where the backend counts signals only for both operations.
    pub signals: Option<u64>,
    /// Bytes actually written into peers' buffers.
    pub wire_bytes: u64,
    /// Bytes as docs/contract.md's bandwidth accounting counts them (selections x message bytes).
    pub logical_bytes: u64,
}

/// One rank's raw latencies, one per timed call, in microseconds.
#[derive(Debug, Clone, Default)]
pub struct RankSamples {
    pub rank: usize,
    pub dispatch_us: Vec<f64>,
    pub combine_us: Vec<f64>,
}

/// One path's raw results, as a backend measured them.
#[derive(Debug, Clone)]
pub struct PathSamples {
    pub path: Path,
    pub ranks: Vec<RankSamples>,
    /// Messages, signals and wire bytes of one dispatch call, summed over ranks
    /// (`logical_bytes` is filled in by [`assemble`]).
    pub dispatch: Traffic,
    pub combine: Traffic,
    /// Signals of one dispatch plus one combine, summed over ranks.
    pub signals_total: u64,
}

/// One rank's figures, DeepEP style.
#[derive(Debug, Clone, Serialize)]
pub struct RankResult {
    pub rank: usize,
    pub selections: u64,
    pub dispatch_logical_bytes: u64,
    pub combine_logical_bytes: u64,
    pub dispatch: Summary,
    pub combine: Summary,
    /// Logical bytes / mean latency.
    pub dispatch_gb_s: f64,
    pub combine_gb_s: f64,
}

/// One path's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PathResult {
    /// In the JSON document by its name ([`Path::name`]).
    #[serde(serialize_with = "path_name")]
    pub path: Path,
    /// Over every (rank, call) sample.
    pub dispatch: Summary,
    pub combine: Summary,
    pub dispatch_traffic: Traffic,
    pub combine_traffic: Traffic,
    pub signals_per_call: u64,
    pub ranks: Vec<RankResult>,
    /// GPU backend: the kernel time from CUPTI (see [`KernelTime`]); `None` where the backend
    /// has no kernel timer (the CPU backend, process mode).
    pub kernel_time: Option<KernelTime>,
    /// GPU backend: the receive-hook split (see [`HookSplit`]); `None` elsewhere.
    pub hook_split: Option<HookSplit>,
}

fn path_name<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(path.name())
}

/// The receive-hook split (DeepEP's `return_recv_hook`, pplx's `do_send`/`do_recv`): dispatch
/// and combine each issued as a send half and a receive half through the device API, one
/// launch per half. Events: stream time between CUDA events around each half; CUPTI: each
/// half's kernel duration in a profiled run of its own.
// One per path and run: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Serialize)]
pub enum HookSplit {
    Measured {
        /// Dispatch send, dispatch recv, combine send, combine recv (CUDA events).
        events: [Summary; 4],
        /// The same halves from CUPTI, or why not.
        kernel: Result<[Summary; 4], String>,
    },
    /// Why the split was not timed.
    Unavailable { reason: String },
}

/// The GPU kernels' own durations from CUPTI's activity records (DeepEP's figure: its test reads
/// them through the profiler), measured in a profiled run of their own. The latencies beside
/// them (`avg_t`, the table) are CUDA-event figures: stream time around each launch.
#[derive(Debug, Clone, Serialize)]
pub enum KernelTime {
    Measured {
        dispatch: Summary,
        combine: Summary,
        /// Launches per call and device summed into one figure (2 with the NCCL transport).
        launches_per_call: usize,
    },
    /// Why there is no CUPTI figure (e.g. libcupti not found); the event figures stand.
    Unavailable { reason: String },
}

/// Per-expert time / batched time, from the medians over every (rank, call) sample.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Speedup {
    pub dispatch: f64,
    pub combine: f64,
    /// (dispatch + combine) medians.
    pub total: f64,
}

/// The config as it appears in the JSON document.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigInfo {
    pub num_ranks: usize,
    pub num_experts: usize,
    pub max_tokens_per_rank: usize,
    pub hidden: usize,
    pub top_k: usize,
    pub dispatch: &'static str,
    pub combine: &'static str,
}

impl From<&Config> for ConfigInfo {
    fn from(c: &Config) -> ConfigInfo {
        ConfigInfo {
            num_ranks: c.num_ranks,
            num_experts: c.num_experts,
            max_tokens_per_rank: c.max_tokens_per_rank,
            hidden: c.hidden,
            top_k: c.top_k,
            dispatch: c.mode.name(),
            combine: "bf16",
        }
    }
}

/// Everything one benchmark point produced.
#[derive(Debug, Clone, Serialize)]
pub struct PointResult {
    pub backend: String,
    pub device: String,
    pub config: ConfigInfo,
    pub tokens_per_rank: usize,
    pub masked: f64,
    pub seed: u64,
    pub iters: usize,
    pub warmup: usize,
    /// Selections over all ranks.
    pub selections: u64,
    /// How the outputs were checked before timing.
    pub verified: String,
    /// The host's load average (1, 5, 15 min) when the point started, where known: the CPU
    /// backend shares the cores with whatever else runs.
    pub load_average: Option<String>,
    pub paths: Vec<PathResult>,
    /// Present when both paths ran.
    pub speedup: Option<Speedup>,
}

/// What [`assemble`] needs besides the samples.
pub struct PointInfo<'a> {
    pub backend: &'a str,
    pub device: &'a str,
    pub cfg: &'a Config,
    pub tokens_per_rank: usize,
    pub masked: f64,
    pub seed: u64,
    pub iters: usize,
    pub warmup: usize,
    /// Selections of every rank.
    pub selections: &'a [u64],
    pub verified: &'a str,
    pub load_average: Option<String>,
}

fn summary(samples: &[f64]) -> Summary {
    Summary::of(samples).unwrap_or(Summary {
        samples: 0,
        mean_us: f64::NAN,
        median_us: f64::NAN,
        p99_us: f64::NAN,
        min_us: f64::NAN,
        max_us: f64::NAN,
    })
}

/// Derives every figure of a point from the backends' raw samples.
pub fn assemble(info: &PointInfo<'_>, paths: Vec<PathSamples>) -> PointResult {
    let cfg = info.cfg;
    let results: Vec<PathResult> = paths
        .into_iter()
        .map(|p| {
            let ranks: Vec<RankResult> = p
                .ranks
                .iter()
                .map(|rs| {
                    let sel = info.selections.get(rs.rank).copied().unwrap_or(0);
                    let (d, c) = (summary(&rs.dispatch_us), summary(&rs.combine_us));
                    let (db, cb) = (
                        accounting::dispatch_logical_bytes(cfg, sel),
                        accounting::combine_logical_bytes(cfg, sel),
                    );
                    RankResult {
                        rank: rs.rank,
                        selections: sel,
                        dispatch_logical_bytes: db,
                        combine_logical_bytes: cb,
                        dispatch_gb_s: accounting::gb_per_s(db, d.mean_us),
                        combine_gb_s: accounting::gb_per_s(cb, c.mean_us),
                        dispatch: d,
                        combine: c,
                    }
                })
                .collect();
            let all_d: Vec<f64> = p.ranks.iter().flat_map(|r| r.dispatch_us.clone()).collect();
            let all_c: Vec<f64> = p.ranks.iter().flat_map(|r| r.combine_us.clone()).collect();
            let total_sel: u64 = info.selections.iter().sum();
            PathResult {
                path: p.path,
                dispatch: summary(&all_d),
                combine: summary(&all_c),
                dispatch_traffic: Traffic {
                    logical_bytes: accounting::dispatch_logical_bytes(cfg, total_sel),
                    ..p.dispatch
                },
                combine_traffic: Traffic {
                    logical_bytes: accounting::combine_logical_bytes(cfg, total_sel),
                    ..p.combine
                },
                signals_per_call: p.signals_total,
                ranks,
                kernel_time: None,
                hook_split: None,
            }
        })
        .collect();
    let speedup = match (
        results.iter().find(|p| p.path == Path::PerExpert),
        results.iter().find(|p| p.path == Path::Batched),
    ) {
        (Some(pe), Some(b)) => Some(Speedup {
            dispatch: pe.dispatch.median_us / b.dispatch.median_us,
            combine: pe.combine.median_us / b.combine.median_us,
            total: (pe.dispatch.median_us + pe.combine.median_us)
                / (b.dispatch.median_us + b.combine.median_us),
        }),
        _ => None,
    };
    PointResult {
        backend: info.backend.to_string(),
        device: info.device.to_string(),
        config: ConfigInfo::from(cfg),
        tokens_per_rank: info.tokens_per_rank,
        masked: info.masked,
        seed: info.seed,
        iters: info.iters,
        warmup: info.warmup,
        selections: info.selections.iter().sum(),
        verified: info.verified.to_string(),
        load_average: info.load_average.clone(),
        paths: results,
        speedup,
    }
}

fn mb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e6)
}

fn signals(t: &Traffic) -> String {
    t.signals.map_or("-".to_string(), |s| s.to_string())
}

/// The DeepEP-format lines, per path and rank:
/// `per-expert [rank 0] Dispatch bandwidth: X GB/s, avg_t=Y us | Combine bandwidth: X GB/s, avg_t=Y us`,
/// then, on the GPU, each path's CUPTI kernel time ([`kernel_time_lines`]).
pub fn deepep_lines(p: &PointResult) -> String {
    let mut s = String::new();
    if p.paths.iter().any(|x| x.kernel_time.is_some()) {
        let _ = writeln!(s, "(avg_t: CUDA events around each launch)");
    }
    for path in &p.paths {
        for r in &path.ranks {
            let _ = writeln!(
                s,
                "{} [rank {}] Dispatch bandwidth: {:.2} GB/s, avg_t={:.2} us | Combine bandwidth: {:.2} GB/s, avg_t={:.2} us",
                path.path, r.rank, r.dispatch_gb_s, r.dispatch.mean_us, r.combine_gb_s, r.combine.mean_us
            );
        }
    }
    s.push_str(&kernel_time_lines(p));
    s.push_str(&hook_split_lines(p));
    s
}

/// The receive-hook split per path in DeepEP's format, means over the calls, labelled:
/// `batched Dispatch send/recv time: a + b us | Combine send/recv time: c + d us   (receive hook: CUDA events around each half)`
/// and the same from CUPTI where it works. Empty where no path has a split (the CPU backend).
pub fn hook_split_lines(p: &PointResult) -> String {
    let mut s = String::new();
    let line = |s: &mut String, path: &str, h: &[Summary; 4], what: &str| {
        let _ = writeln!(
            s,
            "{path} Dispatch send/recv time: {:.2} + {:.2} us | Combine send/recv time: {:.2} + {:.2} us   (receive hook: {what})",
            h[0].mean_us, h[1].mean_us, h[2].mean_us, h[3].mean_us
        );
    };
    for path in &p.paths {
        match &path.hook_split {
            None => {}
            Some(HookSplit::Measured { events, kernel }) => {
                line(
                    &mut s,
                    path.path.name(),
                    events,
                    "CUDA events around each half, one launch per half",
                );
                match kernel {
                    Ok(k) => line(
                        &mut s,
                        path.path.name(),
                        k,
                        "CUPTI kernel time of each half",
                    ),
                    Err(why) => {
                        let _ = writeln!(
                            s,
                            "{} receive hook, CUPTI kernel time of each half: not measured: {why}",
                            path.path
                        );
                    }
                }
            }
            Some(HookSplit::Unavailable { reason }) => {
                let _ = writeln!(
                    s,
                    "{} receive hook split: not measured: {reason}",
                    path.path
                );
            }
        }
    }
    s
}

/// One line per path with a kernel timer, the CUPTI kernel time beside the event time:
/// `batched kernel time (CUPTI): Dispatch X us | Combine Y us   [events: Dispatch A us | Combine B us]`,
/// means over the calls. Empty for the CPU backend.
pub fn kernel_time_lines(p: &PointResult) -> String {
    let mut s = String::new();
    for path in &p.paths {
        let events = format!(
            "[CUDA events: Dispatch {:.2} us | Combine {:.2} us]",
            path.dispatch.mean_us, path.combine.mean_us
        );
        match &path.kernel_time {
            None => {}
            Some(KernelTime::Measured {
                dispatch,
                combine,
                launches_per_call,
            }) => {
                let split = if *launches_per_call > 1 {
                    format!(" ({launches_per_call} launches per call summed)")
                } else {
                    String::new()
                };
                let _ = writeln!(
                    s,
                    "{} kernel time (CUPTI, each kernel's own GPU duration, DeepEP's figure): Dispatch {:.2} us | Combine {:.2} us{split}   {events}",
                    path.path, dispatch.mean_us, combine.mean_us
                );
            }
            Some(KernelTime::Unavailable { reason }) => {
                let _ = writeln!(
                    s,
                    "{} kernel time (CUPTI): not measured: {reason}   {events}",
                    path.path
                );
            }
        }
    }
    s
}

/// The summary table of one point.
pub fn table(p: &PointResult) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<11} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9} {:>13} {:>13} {:>17} {:>17}",
        "path",
        "disp med us",
        "disp p99 us",
        "comb med us",
        "comb p99 us",
        "speed-up",
        "signals",
        "msgs d/c",
        "signals d/c",
        "logical MB d/c",
        "wire MB d/c",
    );
    for path in &p.paths {
        let speedup = match (&p.speedup, path.path) {
            (Some(sp), Path::Batched) => format!("{:.2}x", sp.total),
            (Some(_), Path::PerExpert) => "1.00x".to_string(),
            (None, _) => "-".to_string(),
        };
        let (d, c) = (&path.dispatch_traffic, &path.combine_traffic);
        let _ = writeln!(
            s,
            "{:<11} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>9} {:>9} {:>13} {:>13} {:>17} {:>17}",
            path.path,
            path.dispatch.median_us,
            path.dispatch.p99_us,
            path.combine.median_us,
            path.combine.p99_us,
            speedup,
            path.signals_per_call,
            format!("{}/{}", d.messages, c.messages),
            format!("{}/{}", signals(d), signals(c)),
            format!("{}/{}", mb(d.logical_bytes), mb(c.logical_bytes)),
            format!("{}/{}", mb(d.wire_bytes), mb(c.wire_bytes)),
        );
    }
    let _ = writeln!(
        s,
        "(latencies: median and p99 over every rank's own latency of every timed call; messages, signals and bytes: one call, summed over ranks)"
    );
    s.push_str(&speedup_line(p));
    s
}

/// The one line a user looks for, printed last: the batched path's speed-up over the
/// per-expert path (empty where only one path ran).
pub fn speedup_line(p: &PointResult) -> String {
    match &p.speedup {
        Some(sp) => format!(
            "speed-up (per-expert median / batched median): dispatch {:.2}x, combine {:.2}x, dispatch+combine {:.2}x\n",
            sp.dispatch, sp.combine, sp.total
        ),
        None => String::new(),
    }
}

/// One line per point of a sweep.
pub fn sweep_table(points: &[Result<PointResult, String>], tokens: &[usize]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>6} {:>16} {:>16} {:>16} {:>16} {:>10} {:>10} {:>10}",
        "T",
        "p-e disp med us",
        "bat disp med us",
        "p-e comb med us",
        "bat comb med us",
        "disp x",
        "comb x",
        "total x"
    );
    for (t, pt) in tokens.iter().zip(points) {
        match pt {
            Ok(p) => {
                let med = |path: Path, disp: bool| {
                    p.paths
                        .iter()
                        .find(|x| x.path == path)
                        .map(|x| {
                            if disp {
                                x.dispatch.median_us
                            } else {
                                x.combine.median_us
                            }
                        })
                        .unwrap_or(f64::NAN)
                };
                let sp = p.speedup;
                let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}x"));
                let _ = writeln!(
                    s,
                    "{:>6} {:>16.1} {:>16.1} {:>16.1} {:>16.1} {:>10} {:>10} {:>10}",
                    t,
                    med(Path::PerExpert, true),
                    med(Path::Batched, true),
                    med(Path::PerExpert, false),
                    med(Path::Batched, false),
                    f(sp.map(|s| s.dispatch)),
                    f(sp.map(|s| s.combine)),
                    f(sp.map(|s| s.total)),
                );
            }
            Err(e) => {
                let _ = writeln!(s, "{t:>6} not run: {e}");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    fn samples(path: Path, d: f64, c: f64) -> PathSamples {
        PathSamples {
            path,
            ranks: (0..2)
                .map(|rank| RankSamples {
                    rank,
                    dispatch_us: vec![d; 3],
                    combine_us: vec![c; 3],
                })
                .collect(),
            dispatch: Traffic {
                messages: 7,
                signals: Some(2),
                wire_bytes: 100,
                logical_bytes: 0,
            },
            combine: Traffic::default(),
            signals_total: 4,
        }
    }

    #[test]
    fn assemble_counts_bytes_and_speedup() {
        let cfg = Config::new(2, 4, 8, 128, 2, Mode::FP8).unwrap();
        let sel = [3u64, 5];
        let info = PointInfo {
            backend: "cpu",
            device: "test",
            cfg: &cfg,
            tokens_per_rank: 4,
            masked: 0.0,
            seed: 1,
            iters: 3,
            warmup: 0,
            selections: &sel,
            verified: "yes",
            load_average: None,
        };
        let p = assemble(
            &info,
            vec![
                samples(Path::PerExpert, 30.0, 60.0),
                samples(Path::Batched, 10.0, 30.0),
            ],
        );
        let msg = 128 + 4 + 16;
        assert_eq!(p.selections, 8);
        assert_eq!(p.paths[0].dispatch_traffic.logical_bytes, 8 * msg);
        assert_eq!(p.paths[0].combine_traffic.logical_bytes, 8 * 256);
        assert_eq!(p.paths[0].dispatch_traffic.wire_bytes, 100);
        let r1 = &p.paths[1].ranks[1];
        assert_eq!(r1.dispatch_logical_bytes, 5 * msg);
        // 5 * 148 bytes in 10 us.
        assert!((r1.dispatch_gb_s - 740.0 / 10e-6 / 1e9).abs() < 1e-9);
        let sp = p.speedup.unwrap();
        assert_eq!(sp.dispatch, 3.0);
        assert_eq!(sp.combine, 2.0);
        assert_eq!(sp.total, 90.0 / 40.0);
        // CPU: no kernel timer, no kernel-time line and no event label.
        assert_eq!(kernel_time_lines(&p), "");
        assert_eq!(hook_split_lines(&p), "");
        assert!(!deepep_lines(&p).contains("CUPTI"));
        let lines = deepep_lines(&p);
        let t = table(&p);
        assert!(
            t.trim_end().lines().last().unwrap().starts_with(
                "speed-up (per-expert median / batched median): dispatch 3.00x, combine 2.00x"
            ),
            "{t}"
        );
        assert!(lines.contains(
            "batched [rank 1] Dispatch bandwidth: 0.07 GB/s, avg_t=10.00 us | Combine bandwidth: 0.04 GB/s, avg_t=30.00 us"
        ), "{lines}");
    }

    /// A GPU point of two paths (per-expert 30/60 us, batched 10/30 us by events), R = 2.
    fn gpu_point() -> PointResult {
        let cfg = Config::new(2, 4, 8, 128, 2, Mode::FP8).unwrap();
        let sel = [3u64, 5];
        let info = PointInfo {
            backend: "gpu",
            device: "test",
            cfg: &cfg,
            tokens_per_rank: 4,
            masked: 0.0,
            seed: 1,
            iters: 3,
            warmup: 0,
            selections: &sel,
            verified: "yes",
            load_average: None,
        };
        assemble(
            &info,
            vec![
                samples(Path::PerExpert, 30.0, 60.0),
                samples(Path::Batched, 10.0, 30.0),
            ],
        )
    }

    #[test]
    fn kernel_time_prints_beside_the_event_time() {
        let mut p = gpu_point();
        p.paths[0].kernel_time = Some(KernelTime::Unavailable {
            reason: "libcupti not found".into(),
        });
        p.paths[1].kernel_time = Some(KernelTime::Measured {
            dispatch: Summary::of(&[7.0, 9.0]).unwrap(),
            combine: Summary::of(&[20.0]).unwrap(),
            launches_per_call: 1,
        });
        let lines = deepep_lines(&p);
        assert!(
            lines.starts_with("(avg_t: CUDA events around each launch)"),
            "{lines}"
        );
        assert!(lines.contains(
            "per-expert kernel time (CUPTI): not measured: libcupti not found   [CUDA events: Dispatch 30.00 us | Combine 60.00 us]"
        ), "{lines}");
        assert!(lines.contains(
            "batched kernel time (CUPTI, each kernel's own GPU duration, DeepEP's figure): Dispatch 8.00 us | Combine 20.00 us   [CUDA events: Dispatch 10.00 us | Combine 30.00 us]"
        ), "{lines}");
    }

    #[test]
    fn hook_split_prints_in_deepep_format_with_its_source() {
        let mut p = gpu_point();
        let sm = |v: f64| Summary::of(&[v, v + 2.0]).unwrap();
        p.paths[0].hook_split = Some(HookSplit::Unavailable {
            reason: "no device".into(),
        });
        p.paths[1].hook_split = Some(HookSplit::Measured {
            events: [sm(1.0), sm(2.0), sm(3.0), sm(4.0)],
            kernel: Err("libcupti not found".into()),
        });
        let lines = deepep_lines(&p);
        assert!(
            lines.contains("per-expert receive hook split: not measured: no device"),
            "{lines}"
        );
        assert!(lines.contains(
            "batched Dispatch send/recv time: 2.00 + 3.00 us | Combine send/recv time: 4.00 + 5.00 us   (receive hook: CUDA events around each half, one launch per half)"
        ), "{lines}");
        assert!(lines.contains(
            "batched receive hook, CUPTI kernel time of each half: not measured: libcupti not found"
        ), "{lines}");
        p.paths[1].hook_split = Some(HookSplit::Measured {
            events: [sm(1.0), sm(2.0), sm(3.0), sm(4.0)],
            kernel: Ok([sm(0.0), sm(1.0), sm(2.0), sm(3.0)]),
        });
        assert!(hook_split_lines(&p).contains(
            "batched Dispatch send/recv time: 1.00 + 2.00 us | Combine send/recv time: 3.00 + 4.00 us   (receive hook: CUPTI kernel time of each half)"
        ));
    }
}
