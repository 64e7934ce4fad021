//! Kernel time from CUPTI's activity records ([`crate::cupti`]): the figure DeepEP's test
//! prints, beside the event figures.

use crate::timing::events::time_path;
use ep_kernels::runtime::{GpuGroup, Path};

/// The kernels a path launches: (dispatch, combine), by module symbol (the name CUPTI's
/// records carry, after [`canonical`]).
pub fn kernel_names(path: Path) -> (&'static str, &'static str) {
    let f = family(path);
    (f.kernels[0].symbol, f.kernels[1].symbol)
}

fn family(path: Path) -> ep_kernels::compile::Family {
    match path {
        Path::PerExpert => ep_kernels::compile::PER_EXPERT,
        Path::Batched => ep_kernels::compile::BATCHED,
    }
}

/// CUPTI's records with each of our kernels named by its module symbol ([`kernel_names`]),
/// whether the record carries the mangled symbol or the demangled signature
/// (`ep_batched::dispatch(KParams, IoTable)`), so that [`kernel_names`] finds them either way.
/// Both halves of a call are launches of the operation's one kernel (the hook's split and NCCL's
/// pack + unpack: two launches per call, in order), as DeepEP's are.
pub fn canonical(mut recs: Vec<crate::cupti::KernelRecord>) -> Vec<crate::cupti::KernelRecord> {
    for r in &mut recs {
        for p in [Path::PerExpert, Path::Batched] {
            let ks = family(p).kernels;
            for (i, k) in ks.iter().enumerate() {
                let demangled = r
                    .name
                    .strip_prefix(k.name)
                    .is_some_and(|t| t.starts_with('('));
                if demangled || r.name == k.symbol {
                    r.name = ks[i].symbol.to_string();
                }
            }
        }
    }
    recs
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
    let recs = canonical(recs.map_err(|e| e.to_string())?);
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

#[cfg(test)]
mod tests {
    use super::*;
    use ep_kernels::runtime::probe;
    use ep_kernels::runtime::GpuOptions;
    use ep_reference::{Config, Mode};

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

    /// A record carrying the demangled signature and one carrying the symbol both name the
    /// kernel by its symbol; another kernel whose name merely starts alike is left alone.
    #[test]
    fn canonical_names_our_kernels_by_symbol() {
        let recs = canonical(vec![
            rec("ep_batched::dispatch(KParams, IoTable)", 0, 0, 1),
            rec("_ZN10ep_batched7combineE7KParams7IoTable", 0, 0, 1),
            rec("ep_batched::dispatch_other(int)", 0, 0, 1),
            rec("ep_per_expert::combine(KParams, IoTable)", 0, 0, 1),
        ]);
        let (bd, bc) = kernel_names(Path::Batched);
        let (_, pc) = kernel_names(Path::PerExpert);
        let names: Vec<&str> = recs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, [bd, bc, "ep_batched::dispatch_other(int)", pc]);
        assert_eq!(bd, "_ZN10ep_batched8dispatchE7KParams7IoTable");
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
        let mut rng = ep_kernels::testing::Rng::new(5);
        let data = ep_kernels::testing::random_inputs(
            &cfg,
            &[8, 5],
            ep_kernels::testing::Routing::Random { masked: 0.1 },
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
