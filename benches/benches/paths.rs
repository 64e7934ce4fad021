//! Criterion benches of both paths on the CPU backend, dispatch and combine, at the standard
//! decode setting (R=8, E=256, H=7168, K=8, FP8 dispatch, BF16 combine, random routing with 5%
//! masked slots) over tokens per rank T = 1, 16, 128, 512.
//!
//! Names pair up: group `dispatch/T=128` holds functions `per-expert` and `batched`, and so on.
//! Each iteration is one collective call of all 8 ranks (one thread each, released together by a
//! barrier); its time is the mean over ranks of each rank's own latency, the figure ep-bench
//! prints as `avg_t` (criterion's throughput is one rank's logical bytes, docs/contract.md's accounting,
//! in decimal units, so its MB/s is ep-bench's GB/s x 1000). Before timing a T, both paths are checked bitwise
//! against the oracle and each other. Dispatch writes into one output per rank allocated once
//! (`dispatch_into`); combine reuses one dispatch's handle for every call.
//!
//! A T whose groups do not fit this machine's memory is skipped with the typed error's message.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use ep_benches::accounting;
use ep_benches::cpu::{timed_combine, timed_dispatch, verify, Group, Setup, Timed};
use ep_reference::workload::{Routing, Workload};
use ep_reference::{Config, CpuOptions, Handle, Mode, Path};

const TOKENS: [usize; 4] = [1, 16, 128, 512];
const RANKS: usize = 8;
const SEED: u64 = 0;

fn mean_rank_time<T>(v: &[Timed<T>]) -> Duration {
    Duration::from_secs_f64(v.iter().map(|t| t.us).sum::<f64>() / v.len() as f64 * 1e-6)
}

fn paths(c: &mut Criterion) {
    for t in TOKENS {
        let cfg = Config::new(RANKS, 256, t, 7168, 8, Mode::FP8).expect("standard config");
        let w = Workload::uniform(&cfg, t, Routing::Random { masked: 0.05 }, SEED);
        let sel = w
            .topk_idx
            .iter()
            .map(|i| accounting::selections(i))
            .sum::<u64>();
        let setup = Setup::new(w, SEED, ep_reference::CombineFormat::Bf16).expect("inputs");
        let opts = CpuOptions::default();
        let mut groups = match Path::ALL
            .iter()
            .map(|&k| Group::new(k, &cfg, opts))
            .collect::<ep_reference::Result<Vec<_>>>()
        {
            Ok(g) => g,
            Err(e) => {
                eprintln!("dispatch/T={t}, combine/T={t}: skipped: {e}");
                continue;
            }
        };
        if let Err(e) = verify(&setup, &mut groups) {
            panic!("T={t}: {e}");
        }
        let w = &setup.workload;

        let mut g = c.benchmark_group(format!("dispatch/T={t}"));
        g.sampling_mode(SamplingMode::Flat);
        g.throughput(Throughput::BytesDecimal(
            accounting::dispatch_logical_bytes(&cfg, sel) / RANKS as u64,
        ));
        for grp in groups.iter_mut() {
            g.bench_function(grp.path.name(), |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| mean_rank_time(&timed_dispatch(grp, w).expect("dispatch")))
                        .sum()
                })
            });
        }
        g.finish();

        let mut g = c.benchmark_group(format!("combine/T={t}"));
        g.sampling_mode(SamplingMode::Flat);
        g.throughput(Throughput::BytesDecimal(
            accounting::combine_logical_bytes(&cfg, sel) / RANKS as u64,
        ));
        for grp in groups.iter_mut() {
            let handles: Vec<Handle> = timed_dispatch(grp, w)
                .expect("dispatch")
                .into_iter()
                .map(|t| t.value)
                .collect();
            g.bench_function(grp.path.name(), |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            mean_rank_time(
                                &timed_combine(grp, w, &setup.ys, &handles, setup.format)
                                    .expect("combine"),
                            )
                        })
                        .sum()
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    // Sane on 2 cores: 10 samples, ~3 s of measurement per function (criterion stretches it
    // when one call is slower than that allows), no plots.
    config = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .without_plots();
    targets = paths
}
criterion_main!(benches);
