//! The CPU backend: both paths as threads of this process, one thread per rank.
//!
//! Every call is collective: [`run_ranks`] starts one thread per rank, the threads meet at a
//! barrier, and each rank times its own call from the barrier to its return (as DeepEP times
//! each rank's kernel). Dispatch writes into one output per rank allocated once per group and
//! reused call after call ([`ep_reference::EpRank::dispatch_into`]), as DeepEP's callers reuse
//! their tensors.

use std::sync::Barrier;
use std::time::Instant;

use ep_reference::oracle;
use ep_reference::rank::run_ranks;
use ep_reference::workload::Workload;
use ep_reference::{
    bf16, CallStats, CombineFormat, Config, CpuOptions, DispatchOutput, Handle, Path,
};

use crate::accounting;
use crate::report::{assemble, PathSamples, PointInfo, PointResult, RankSamples, Traffic};
use crate::spec::{BenchError, BenchSpec};

/// Builds `path`'s group on the CPU backend: one endpoint per rank ([`ep_fast::path_group`]).
pub fn endpoints(path: Path, cfg: &Config, opts: CpuOptions) -> ep_reference::Result<Vec<Rank>> {
    ep_fast::path_group(path, cfg, opts)
}

/// One rank of either path.
pub type Rank = ep_fast::AnyRank;

/// One rank of a group with the dispatch output it reuses.
pub struct Slot {
    pub rank: Rank,
    pub out: DispatchOutput,
}

/// One path's group.
pub struct Group {
    pub path: Path,
    pub slots: Vec<Slot>,
}

impl Group {
    pub fn new(path: Path, cfg: &Config, opts: CpuOptions) -> ep_reference::Result<Group> {
        Ok(Group {
            path,
            slots: endpoints(path, cfg, opts)?
                .into_iter()
                .map(|rank| Slot {
                    rank,
                    out: DispatchOutput::zeroed(cfg),
                })
                .collect(),
        })
    }

    /// The dispatch outputs of the last call, in rank order.
    pub fn outputs(&self) -> Vec<&DispatchOutput> {
        self.slots.iter().map(|s| &s.out).collect()
    }
}

/// Inputs shared by both paths and what the oracle says they must produce.
pub struct Setup {
    pub workload: Workload,
    /// Every rank's expert outputs `y` (L x (R*T) x H) for combine.
    pub ys: Vec<Vec<bf16>>,
    pub oracle_dispatch: Vec<DispatchOutput>,
    pub oracle_combine: Vec<Vec<bf16>>,
    /// The combine's format; with LogFMT the expert outputs are scaled by 2^-4 (values in
    /// [-0.5, 0.5], as DeepEP's benchmark feeds small values) so that their groups pack.
    pub format: CombineFormat,
}

impl Setup {
    pub fn new(
        workload: Workload,
        seed: u64,
        format: CombineFormat,
    ) -> ep_reference::Result<Setup> {
        let cfg = workload.config;
        format.check(&cfg)?;
        let oracle_dispatch = oracle::dispatch(&cfg, &workload.dispatch_inputs())?;
        let mut ys = expert_outputs(&cfg, &oracle_dispatch, seed);
        if format == CombineFormat::LogFmt {
            for v in ys.iter_mut().flatten() {
                *v = bf16::from_f32(v.to_f32() * 0.0625);
            }
        }
        let oracle_combine = oracle::combine_with(&cfg, &workload.combine_inputs(&ys), format)?;
        Ok(Setup {
            workload,
            ys,
            oracle_dispatch,
            oracle_combine,
            format,
        })
    }

    pub fn config(&self) -> Config {
        self.workload.config
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Expert outputs for combine, values in [-8, 8], that differ per rank, expert, row and channel.
/// Only the meaningful rows (below `recv_count`, the only ones combine reads) are written; the
/// rest stay the allocator's untouched zero pages. At the standard setting that is ~3% of the
/// L x (R*T) x H buffer, so `y` costs ~100 MB instead of 3.7 GB, and T = 512 stays possible.
pub fn expert_outputs(cfg: &Config, dispatch: &[DispatchOutput], seed: u64) -> Vec<Vec<bf16>> {
    let (h, per) = (cfg.hidden, cfg.rows_per_expert());
    let len = cfg.num_local_experts() * per * h;
    dispatch
        .iter()
        .enumerate()
        .map(|(rank, out)| {
            let mut y = zeroed_bf16(len);
            for (l, &count) in out.recv_count.iter().enumerate() {
                for row in 0..count as usize {
                    let mut s = splitmix(seed ^ splitmix(((rank * per + row) * 65_536 + l) as u64));
                    let dst = &mut y[(l * per + row) * h..(l * per + row + 1) * h];
                    for v in dst.iter_mut() {
                        s = splitmix(s);
                        let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                        *v = bf16::from_f32(u * 16.0 - 8.0);
                    }
                }
            }
            y
        })
        .collect()
}

/// `len` zero bf16 values from the allocator's zeroed pages
/// (`ep_reference::numerics::bf16::zeroed`): unlike `vec![bf16::ZERO; len]`, which writes every
/// element, untouched pages cost no physical memory.
pub fn zeroed_bf16(len: usize) -> Vec<bf16> {
    ep_reference::numerics::bf16::zeroed(len)
}

/// Every rank's dispatch (untimed) into its reused output; the handles in rank order.
fn dispatch_all(g: &mut Group, w: &Workload) -> Result<Vec<Handle>, BenchError> {
    let path = g.path;
    run_ranks(&mut g.slots, |s| {
        let me = s.rank.rank();
        s.rank.dispatch_into(&w.x[me], &w.topk_idx[me], &mut s.out)
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .map_err(|err| BenchError::Path { path, err })
}

/// Every rank's combine (untimed), in rank order.
fn combine_all(
    g: &mut Group,
    w: &Workload,
    ys: &[Vec<bf16>],
    handles: &[Handle],
    format: CombineFormat,
) -> Result<Vec<Vec<bf16>>, BenchError> {
    let path = g.path;
    run_ranks(&mut g.slots, |s| {
        let me = s.rank.rank();
        let (idx, wt) = (&w.topk_idx[me], &w.topk_weights[me]);
        s.rank.combine_with(&ys[me], idx, wt, &handles[me], format)
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .map_err(|err| BenchError::Path { path, err })
}

/// Checks the dispatch outputs of `got` against `want`, rank by rank.
pub fn check_dispatch(
    what: &str,
    got: &[&DispatchOutput],
    want: &[&DispatchOutput],
) -> Result<(), BenchError> {
    if got.len() != want.len() {
        return Err(BenchError::Mismatch(format!(
            "{what}: {} dispatch outputs, expected {}",
            got.len(),
            want.len()
        )));
    }
    for (rank, (g, o)) in got.iter().zip(want).enumerate() {
        if let Some(d) = g.diff(o) {
            return Err(BenchError::Mismatch(format!(
                "{what}: dispatch on rank {rank}: {d}"
            )));
        }
    }
    Ok(())
}

/// Checks the combine outputs of `got` against `want`, rank by rank.
pub fn check_combine(
    what: &str,
    got: &[Vec<bf16>],
    want: &[Vec<bf16>],
    hidden: usize,
) -> Result<(), BenchError> {
    if got.len() != want.len() {
        return Err(BenchError::Mismatch(format!(
            "{what}: {} combine outputs, expected {}",
            got.len(),
            want.len()
        )));
    }
    for (rank, (g, o)) in got.iter().zip(want).enumerate() {
        if let Some(d) = ep_reference::output::combine_diff(g, o, hidden) {
            return Err(BenchError::Mismatch(format!(
                "{what}: combine on rank {rank}: {d}"
            )));
        }
    }
    Ok(())
}

/// Runs every group once, untimed, and checks that all of them produce bitwise the oracle's
/// dispatch and combine outputs on every rank, and the same as each other.
pub fn verify(setup: &Setup, groups: &mut [Group]) -> Result<String, BenchError> {
    let h = setup.config().hidden;
    let w = &setup.workload;
    let oracle: Vec<&DispatchOutput> = setup.oracle_dispatch.iter().collect();
    let mut combined: Vec<Vec<Vec<bf16>>> = Vec::new();
    for g in groups.iter_mut() {
        let name = g.path;
        let handles = dispatch_all(g, w)?;
        check_dispatch(&format!("{name} vs oracle"), &g.outputs(), &oracle)?;
        let comb = combine_all(g, w, &setup.ys, &handles, setup.format)?;
        check_combine(
            &format!("{name} vs oracle"),
            &comb,
            &setup.oracle_combine,
            h,
        )?;
        combined.push(comb);
    }
    // Each group keeps its dispatch outputs in its slots: compare the paths directly too.
    if let Some((g0, rest)) = groups.split_first() {
        for (g, comb) in rest.iter().zip(&combined[1..]) {
            let what = format!("{} vs {}", g.path, g0.path);
            check_dispatch(&what, &g.outputs(), &g0.outputs())?;
            check_combine(&what, comb, &combined[0], h)?;
        }
    }
    let names: Vec<&str> = groups.iter().map(|g| g.path.name()).collect();
    Ok(format!(
        "{} and the oracle: dispatch (recv_x, scales, counts, layout, src_info) and combine bitwise equal on all {} ranks",
        names.join(", "),
        setup.config().num_ranks
    ))
}

/// One rank's result of one timed call.
pub struct Timed<T> {
    pub us: f64,
    pub stats: CallStats,
    pub value: T,
}

/// One collective dispatch into the group's reused outputs, timed per rank; returns every
/// rank's handle.
pub fn timed_dispatch(g: &mut Group, w: &Workload) -> Result<Vec<Timed<Handle>>, BenchError> {
    let path = g.path;
    let barrier = Barrier::new(g.slots.len());
    run_ranks(&mut g.slots, |s| {
        let me = s.rank.rank();
        barrier.wait();
        let t0 = Instant::now();
        let res = s.rank.dispatch_into(&w.x[me], &w.topk_idx[me], &mut s.out);
        let us = t0.elapsed().as_secs_f64() * 1e6;
        Ok(Timed {
            us,
            stats: s.rank.last_stats(),
            value: res?,
        })
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .map_err(|err| BenchError::Path { path, err })
}

/// One collective combine with `handles`, the rows in `format`, timed per rank.
pub fn timed_combine(
    g: &mut Group,
    w: &Workload,
    ys: &[Vec<bf16>],
    handles: &[Handle],
    format: CombineFormat,
) -> Result<Vec<Timed<()>>, BenchError> {
    let path = g.path;
    let barrier = Barrier::new(g.slots.len());
    run_ranks(&mut g.slots, |s| {
        let me = s.rank.rank();
        barrier.wait();
        let t0 = Instant::now();
        let (idx, wt) = (&w.topk_idx[me], &w.topk_weights[me]);
        let res = s.rank.combine_with(&ys[me], idx, wt, &handles[me], format);
        let us = t0.elapsed().as_secs_f64() * 1e6;
        drop(res?);
        Ok(Timed {
            us,
            stats: s.rank.last_stats(),
            value: (),
        })
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .map_err(|err| BenchError::Path { path, err })
}

fn sum_stats<T>(v: &[Timed<T>]) -> CallStats {
    let mut s = CallStats::default();
    for t in v {
        s += t.stats;
    }
    s
}

fn traffic(s: CallStats) -> Traffic {
    Traffic {
        messages: s.messages,
        signals: Some(s.signals),
        wire_bytes: s.wire_bytes,
        logical_bytes: 0,
    }
}

/// A human description of this machine's CPU.
pub fn device() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cores} cores")
}

/// The first three fields of /proc/loadavg.
pub fn load_average() -> Option<String> {
    let t = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// Runs one point: inputs and oracle, both groups, verification, then `warmup + iters` rounds.
/// In every round each path does one dispatch and one combine (the paths alternate, so a
/// slow spell of a shared machine hits both alike).
pub fn run(spec: &BenchSpec, progress: &dyn Fn(&str)) -> Result<PointResult, BenchError> {
    let cfg = spec.cfg;
    let total = spec.rounds()?;
    let load_average = load_average();
    progress("generating inputs, expert outputs and the oracle's results");
    let setup = Setup::new(spec.workload(), spec.seed, spec.combine)?;
    progress("building both groups");
    let mut groups = Path::ALL
        .iter()
        .map(|&p| Group::new(p, &cfg, spec.cpu))
        .collect::<ep_reference::Result<Vec<_>>>()?;
    progress("checking both paths against the oracle and each other");
    let verified = verify(&setup, &mut groups)?;

    let w = &setup.workload;
    let r = cfg.num_ranks;
    let mut samples: Vec<PathSamples> = groups
        .iter()
        .map(|g| PathSamples {
            path: g.path,
            ranks: (0..r)
                .map(|rank| RankSamples {
                    rank,
                    ..Default::default()
                })
                .collect(),
            dispatch: Traffic::default(),
            combine: Traffic::default(),
            signals_total: 0,
        })
        .collect();
    for i in 0..total {
        let phase = if i < spec.warmup { "warm-up" } else { "timing" };
        progress(&format!("{phase} round {}/{total}", i + 1));
        for (g, s) in groups.iter_mut().zip(samples.iter_mut()) {
            let d = timed_dispatch(g, w)?;
            let handles: Vec<Handle> = d.iter().map(|t| t.value.clone()).collect();
            let c = timed_combine(g, w, &setup.ys, &handles, setup.format)?;
            if i < spec.warmup {
                continue;
            }
            for (rank, (dt, ct)) in d.iter().zip(&c).enumerate() {
                s.ranks[rank].dispatch_us.push(dt.us);
                s.ranks[rank].combine_us.push(ct.us);
            }
            let (ds, cs) = (sum_stats(&d), sum_stats(&c));
            s.dispatch = traffic(ds);
            s.combine = traffic(cs);
            s.signals_total = ds.signals + cs.signals;
        }
    }
    // The reused outputs of the last timed call must still be the oracle's.
    for g in &groups {
        check_dispatch(
            &format!("{} (last timed call) vs oracle", g.path),
            &g.outputs(),
            &setup.oracle_dispatch.iter().collect::<Vec<_>>(),
        )?;
    }
    drop(groups);
    let verified = format!("{verified}; the last timed dispatch's reused outputs checked again");
    let selections: Vec<u64> = w
        .topk_idx
        .iter()
        .map(|t| accounting::selections(t))
        .collect();
    let device = device();
    let mut point = assemble(
        &PointInfo {
            backend: "cpu",
            device: &device,
            cfg: &cfg,
            tokens_per_rank: spec.tokens,
            masked: spec.masked,
            seed: spec.seed,
            iters: spec.iters,
            warmup: spec.warmup,
            selections: &selections,
            verified: &verified,
            load_average,
        },
        samples,
    );
    point.config.combine = spec.combine.name();
    Ok(point)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::{Mode, RecvX};

    fn small(mode: Mode) -> BenchSpec {
        let hidden = if mode == Mode::FP8_UE8M0 { 512 } else { 256 };
        BenchSpec {
            cfg: Config::new(2, 8, 6, hidden, 3, mode).unwrap(),
            tokens: 5,
            masked: 0.1,
            seed: 7,
            iters: 3,
            warmup: 1,
            cpu: CpuOptions::default(),
            gpus: 1,
            graph: None,
            nccl: None,
            combine: CombineFormat::Bf16,
            scales_column_major: false,
        }
    }

    #[test]
    fn expert_outputs_fill_exactly_the_meaningful_rows() {
        let spec = small(Mode::FP8);
        let w = spec.workload();
        let outs = oracle::dispatch(&spec.cfg, &w.dispatch_inputs()).unwrap();
        let ys = expert_outputs(&spec.cfg, &outs, 1);
        let (h, per) = (spec.cfg.hidden, spec.cfg.rows_per_expert());
        for (rank, out) in outs.iter().enumerate() {
            for (l, &count) in out.recv_count.iter().enumerate() {
                for row in 0..per {
                    let r = &ys[rank][(l * per + row) * h..(l * per + row + 1) * h];
                    let nonzero = r.iter().filter(|v| v.to_f32() != 0.0).count();
                    if row < count as usize {
                        assert!(
                            nonzero > h / 2,
                            "rank {rank} expert {l} row {row} not filled"
                        );
                        assert!(r.iter().all(|v| (-8.0..=8.0).contains(&v.to_f32())));
                    } else {
                        assert_eq!(nonzero, 0);
                    }
                }
            }
        }
        // Deterministic in the seed, different across seeds.
        assert_eq!(ys, expert_outputs(&spec.cfg, &outs, 1));
        assert_ne!(ys, expert_outputs(&spec.cfg, &outs, 2));
    }

    #[test]
    fn zeroed_bf16_is_zero() {
        let v = zeroed_bf16(1000);
        assert_eq!(v.len(), 1000);
        assert!(v.iter().all(|x| x.to_bits() == 0));
    }

    #[test]
    fn a_flipped_byte_is_refused() {
        let spec = small(Mode::FP8);
        let setup = Setup::new(spec.workload(), 3, spec.combine).unwrap();
        let mut bad = setup.oracle_dispatch.clone();
        let want: Vec<&DispatchOutput> = setup.oracle_dispatch.iter().collect();
        assert!(check_dispatch("x", &bad.iter().collect::<Vec<_>>(), &want).is_ok());
        // Flip one bit of a meaningful row of rank 1.
        let l = bad[1].recv_count.iter().position(|&c| c > 0).unwrap();
        let i = l * spec.cfg.rows_per_expert() * spec.cfg.hidden + 5;
        match &mut bad[1].recv_x {
            RecvX::Fp8(v) => v[i] ^= 1,
            RecvX::Bf16(_) => unreachable!(),
        }
        let e = check_dispatch("x", &bad.iter().collect::<Vec<_>>(), &want).unwrap_err();
        assert!(
            matches!(e, BenchError::Mismatch(ref m) if m.contains("rank 1")),
            "{e}"
        );
        assert_eq!(e.exit_code(), 3);

        let mut badc = setup.oracle_combine.clone();
        assert!(check_combine("x", &badc, &setup.oracle_combine, 256).is_ok());
        badc[0][300] = bf16::from_bits(badc[0][300].to_bits() ^ 1);
        let e = check_combine("x", &badc, &setup.oracle_combine, 256).unwrap_err();
        assert!(e.to_string().contains("token 1 channel 44"), "{e}");
    }

    #[test]
    fn verify_refuses_a_path_that_disagrees_with_the_oracle() {
        let spec = small(Mode::Bf16);
        let mut setup = Setup::new(spec.workload(), 3, spec.combine).unwrap();
        // Pretend the oracle wanted other weights: combine outputs then differ.
        setup.oracle_combine[0][0] = bf16::from_f32(setup.oracle_combine[0][0].to_f32() + 1.0);
        let mut groups = vec![Group::new(Path::PerExpert, &spec.cfg, spec.cpu).unwrap()];
        let e = verify(&setup, &mut groups).unwrap_err();
        assert!(
            e.to_string()
                .contains("per-expert vs oracle: combine on rank 0"),
            "{e}"
        );
    }

    #[test]
    fn run_produces_a_point_with_both_paths() {
        for mode in [Mode::FP8, Mode::Bf16, Mode::FP8_UE8M0] {
            let spec = small(mode);
            let p = run(&spec, &|_| {}).unwrap();
            assert_eq!(p.paths.len(), 2);
            let w = spec.workload();
            let sel = w.selections() as u64;
            assert_eq!(p.selections, sel);
            for path in &p.paths {
                assert_eq!(path.ranks.len(), 2);
                assert_eq!(path.dispatch.samples, 2 * spec.iters);
                assert_eq!(
                    path.dispatch_traffic.logical_bytes,
                    sel * spec.cfg.logical_dispatch_message_bytes() as u64
                );
                assert!(path.dispatch_traffic.wire_bytes > 0);
            }
            // The per-expert path sends one message per selection in each direction.
            assert_eq!(p.paths[0].dispatch_traffic.messages, sel);
            assert_eq!(p.paths[0].combine_traffic.messages, sel);
            assert!(p.speedup.is_some());
        }
    }

    /// Warm-up + timed rounds that would wrap (iters 2^64-1, warmup 1: 0 rounds, a point of NaN
    /// latencies and 0 samples) are a typed error naming the count for a library caller,
    /// before anything is generated.
    #[test]
    fn absurd_iteration_counts_are_config_errors() {
        use ep_reference::Error;
        for (iters, warmup, what) in [
            (usize::MAX, 1, "iters"),
            (1, usize::MAX, "warmup"),
            (usize::MAX, usize::MAX, "iters"),
            (0, 1, "iters"),
        ] {
            let spec = BenchSpec {
                iters,
                warmup,
                ..small(Mode::FP8)
            };
            let e = run(&spec, &|_| {}).map(|_| ()).unwrap_err();
            let named = match &e {
                BenchError::Config(Error::LimitExceeded { what, .. }) => *what,
                BenchError::Config(Error::ZeroSize { what }) => *what,
                other => panic!("iters {iters} warmup {warmup}: {other}"),
            };
            assert_eq!(named, what, "iters {iters} warmup {warmup}: {e}");
            assert_eq!(e.exit_code(), 2);
        }
    }

    #[test]
    fn too_many_tokens_is_a_config_error() {
        let mut spec = small(Mode::FP8);
        spec.tokens = 7; // T = 6
        let e = run(&spec, &|_| {}).unwrap_err();
        assert!(matches!(e, BenchError::Config(_)), "{e}");
        assert_eq!(e.exit_code(), 2);
    }
}
