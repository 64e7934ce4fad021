//! Criterion benches of both paths on the GPU backend (ep-kernels), dispatch and combine, at
//! DeepEP's standard setting (E=256, H=7168, K=8, FP8 dispatch, BF16 combine, random routing
//! without masked slots) over tokens per rank T = 1, 16, 128, 512, for:
//!
//! - `EP1`: one rank on one GPU; `EP2` and `EP8`: 2 and 8 virtual ranks on one GPU;
//! - `EP2x2GPU`: 2 ranks on two GPUs over NVLink, where two GPUs are present.
//!
//! Names: group `gpu/EP8/dispatch/T=128` holds functions `per-expert` and `batched`, and so on.
//! The time of one iteration is one call's time on the GPU, not the host's: CUDA events around
//! each launch on every device (the slowest device's figure), handed to criterion through
//! `iter_custom`; on one GPU the calls are replayed from a CUDA graph in chunks of up to 256
//! dispatch+combine pairs, as `ep-bench` does (`ep_benches::timing::time_path`). With
//! `EP_GPU_BENCH_TIMER=cupti`, the time is the kernels' own duration from CUPTI's activity
//! records instead (DeepEP's figure), under groups named `gpu-cupti/...`.
//!
//! A dispatch sample is a dispatch's time and a combine sample a combine's, but every timed
//! iteration runs one of each (combine needs the dispatch's handle; the next dispatch needs the
//! combine's acknowledgement). Throughput is one rank's bytes in DeepEP's accounting
//! (`ep_benches::accounting`), so criterion's GB/s is DeepEP's per-rank bandwidth.
//!
//! Before a setting is timed, both paths are checked bit for bit against the oracle. Where there
//! is no GPU (or too few, or too little memory), the setting prints `skipped: <why>` and the
//! bench exits 0; the CPU benches (`--bench paths`) are not affected.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use ep_benches::accounting;
use ep_benches::timing::{kernel_times, time_path};
use ep_kernels::{GpuGroup, GpuOptions, Path};
use ep_reference::oracle;
use ep_reference::workload::{Routing, Workload};
use ep_reference::{Config, Mode, Op};

const TOKENS: [usize; 4] = [1, 16, 128, 512];
const SEED: u64 = 0;
/// Most dispatch+combine pairs captured into one graph.
const CHUNK: u64 = 256;

/// (name, ranks, GPUs).
const SETUPS: [(&str, usize, usize); 4] = [
    ("EP1", 1, 1),
    ("EP2", 2, 1),
    ("EP8", 8, 1),
    ("EP2x2GPU", 2, 2),
];

const PATHS: [Path; 2] = [Path::PerExpert, Path::Batched];

/// The group's options: the defaults, over `gpus` GPUs.
fn options(gpus: usize) -> GpuOptions {
    GpuOptions {
        num_gpus: gpus,
        ..Default::default()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Timer {
    Events,
    Cupti,
}

impl Timer {
    fn from_env() -> Result<Timer, String> {
        match std::env::var("EP_GPU_BENCH_TIMER").as_deref() {
            Err(_) | Ok("") | Ok("events") => Ok(Timer::Events),
            Ok("cupti") => Ok(Timer::Cupti),
            Ok(v) => Err(format!(
                "EP_GPU_BENCH_TIMER={v:?}: expected \"events\" (the default) or \"cupti\""
            )),
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Timer::Events => "gpu",
            Timer::Cupti => "gpu-cupti",
        }
    }
}

/// Criterion's name filter as criterion reads it from the command line (`[FILTER]`, `--exact`,
/// `--ignored`; its own copy is private), so that a filtered run (e.g. `--baseline main
/// 'T=128/'`) builds only the settings it times: each setting costs inputs, the oracle and a GPU
/// group, seconds at T=512.
struct Filter {
    reject_all: bool,
    exact: Option<String>,
    regex: Option<regex::Regex>,
}

impl Filter {
    fn from_args() -> Filter {
        // Criterion's options that take a value (long and short forms).
        const VALUED: [&str; 19] = [
            "--color",
            "-c",
            "--save-baseline",
            "-s",
            "--baseline",
            "-b",
            "--baseline-lenient",
            "--format",
            "--profile-time",
            "--load-baseline",
            "--sample-size",
            "--warm-up-time",
            "--measurement-time",
            "--nresamples",
            "--noise-threshold",
            "--confidence-level",
            "--significance-level",
            "--plotting-backend",
            "--output-format",
        ];
        let args: Vec<String> = std::env::args().skip(1).collect();
        let mut pattern = None;
        let mut i = 0;
        while i < args.len() {
            let a = args[i].as_str();
            if a.starts_with('-') {
                if VALUED.contains(&a) {
                    i += 1; // its value
                }
            } else if pattern.is_none() {
                pattern = Some(a.to_string());
            }
            i += 1;
        }
        let has = |f: &str| args.iter().any(|a| a == f);
        let (exact, regex) = match pattern {
            None => (None, None),
            Some(p) if has("--exact") => (Some(p), None),
            // A pattern criterion cannot parse either: criterion reports it; build everything.
            Some(p) => (None, regex::Regex::new(&p).ok()),
        };
        Filter {
            reject_all: has("--ignored"),
            exact,
            regex,
        }
    }

    fn wants(&self, id: &str) -> bool {
        if self.reject_all {
            return false;
        }
        match (&self.exact, &self.regex) {
            (Some(e), _) => e == id,
            (None, Some(r)) => r.is_match(id),
            (None, None) => true,
        }
    }
}

/// GPU time of `iters` calls of `op` on `path` (each timed call runs a dispatch and a combine).
fn gpu_time(
    g: &mut GpuGroup,
    path: Path,
    op: Op,
    iters: u64,
    graph: bool,
    timer: Timer,
) -> Result<Duration, String> {
    let mut left = iters;
    let mut us = 0.0;
    while left > 0 {
        let n = left.min(CHUNK) as usize;
        let (d, c) = match timer {
            Timer::Events => time_path(g, path, n, 0, graph).map_err(|e| e.to_string())?,
            Timer::Cupti => {
                let k = kernel_times(g, path, n, graph)?;
                (k.dispatch_us, k.combine_us)
            }
        };
        us += match op {
            Op::Dispatch => d.iter().sum::<f64>(),
            Op::Combine => c.iter().sum::<f64>(),
        };
        left -= n as u64;
    }
    Ok(Duration::from_secs_f64(us * 1e-6))
}

/// Both paths' dispatch and combine, bit for bit against the oracle. Leaves every input uploaded
/// (the same for both paths), so either path can be timed afterwards.
fn verify(g: &mut GpuGroup, w: &Workload, ys: &[Vec<half::bf16>]) -> Result<(), String> {
    let cfg = *g.config();
    let want = oracle::dispatch(&cfg, &w.dispatch_inputs()).map_err(|e| format!("oracle: {e}"))?;
    let want_c =
        oracle::combine(&cfg, &w.combine_inputs(ys)).map_err(|e| format!("oracle: {e}"))?;
    for path in PATHS {
        let got = g
            .dispatch(path, &w.x, &w.topk_idx)
            .map_err(|e| format!("{} dispatch: {e}", path.name()))?;
        for (r, (a, b)) in got.iter().zip(&want).enumerate() {
            if let Some(d) = a.diff(b) {
                return Err(format!("{} dispatch, rank {r}: {d}", path.name()));
            }
        }
        let got_c = g
            .combine(path, ys, &w.topk_weights)
            .map_err(|e| format!("{} combine: {e}", path.name()))?;
        for (r, (a, b)) in got_c.iter().zip(&want_c).enumerate() {
            if a.iter()
                .map(|v| v.to_bits())
                .ne(b.iter().map(|v| v.to_bits()))
            {
                return Err(format!("{} combine differs on rank {r}", path.name()));
            }
        }
    }
    Ok(())
}

fn gpu(c: &mut Criterion) {
    let timer = match Timer::from_env() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("gpu benches: skipped: {e}");
            return;
        }
    };
    let devices = match ep_kernels::runtime::probe() {
        Ok(d) => d,
        Err(why) => {
            println!("gpu benches (EP1, EP2, EP8, EP2x2GPU; T = 1, 16, 128, 512): skipped: {why}");
            return;
        }
    };
    let n_gpus = ep_kernels::runtime::probe_devices(1).unwrap_or(0);
    println!(
        "gpu benches on {devices}; timer: {}",
        match timer {
            Timer::Events =>
                "CUDA events around each launch (EP_GPU_BENCH_TIMER=cupti for CUPTI kernel time)",
            Timer::Cupti => "CUPTI kernel records (each kernel's own GPU duration)",
        }
    );
    let filter = Filter::from_args();
    for (name, ranks, gpus) in SETUPS {
        let wanted = |t: usize| {
            ["dispatch", "combine"].iter().any(|op| {
                PATHS.iter().any(|p| {
                    filter.wants(&format!(
                        "{}/{name}/{op}/T={t}/{}",
                        timer.prefix(),
                        p.name()
                    ))
                })
            })
        };
        if !TOKENS.iter().any(|&t| wanted(t)) {
            continue;
        }
        if gpus > n_gpus {
            println!(
                "{}/{name}: skipped: {gpus} GPUs needed, {n_gpus} present",
                timer.prefix()
            );
            continue;
        }
        for t in TOKENS.into_iter().filter(|&t| wanted(t)) {
            let label = format!("{}/{name}/{{dispatch,combine}}/T={t}", timer.prefix());
            let cfg = match Config::new(ranks, 256, t, 7168, 8, Mode::FP8) {
                Ok(c) => c,
                Err(e) => {
                    println!("{label}: skipped: {e}");
                    continue;
                }
            };
            let w = Workload::uniform(&cfg, t, Routing::Random { masked: 0.0 }, SEED);
            let ys = w.expert_outputs(SEED);
            let mut g = match GpuGroup::new(&cfg, options(gpus)) {
                Ok(g) => g,
                Err(e) => {
                    println!("{label}: skipped: {e}");
                    continue;
                }
            };
            if let Err(e) = verify(&mut g, &w, &ys) {
                panic!("{label}: the GPU paths differ from the oracle: {e}");
            }
            let graph = gpus == 1;
            let sel = w.selections() as u64;
            for op in [Op::Dispatch, Op::Combine] {
                let (opname, bytes) = match op {
                    Op::Dispatch => ("dispatch", accounting::dispatch_logical_bytes(&cfg, sel)),
                    Op::Combine => ("combine", accounting::combine_logical_bytes(&cfg, sel)),
                };
                let mut grp =
                    c.benchmark_group(format!("{}/{name}/{opname}/T={t}", timer.prefix()));
                grp.sampling_mode(SamplingMode::Flat);
                grp.throughput(Throughput::BytesDecimal(bytes / ranks as u64));
                for path in PATHS {
                    grp.bench_function(path.name(), |b| {
                        b.iter_custom(|iters| {
                            gpu_time(&mut g, path, op, iters, graph, timer).unwrap_or_else(|e| {
                                panic!("{name} T={t} {} {opname}: {e}", path.name())
                            })
                        })
                    });
                }
                grp.finish();
            }
        }
    }
}

criterion_group! {
    name = benches;
    // 10 samples, 1 s of measurement per function: the GPU figures are steady, and the whole
    // sweep (up to 64 functions) stays within a few minutes.
    config = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300))
        .without_plots();
    targets = gpu
}
criterion_main!(benches);
