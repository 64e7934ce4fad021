//! GPU soak: `EP_SOAK_CALLS` calls of each path (default 10^5; one call is a
//! dispatch and the combine after it) on a few fixed configs, on groups that live for the whole
//! run (the same buffers, epochs counting up). Each round draws one random input (token counts
//! 0..=T per rank, empty and full ranks, masked slots, skew to one expert or one rank) and runs it
//! on both paths, alternating which goes first: every call of a path sees a new routing, and the
//! expected outputs are computed once per round.
//!
//! Every call is checked for conservation: on every rank, `recv_count` and `layout_range` are
//! what the routing implies, each selection arrives exactly once, at the row the contract gives
//! it (token order within its (expert, source) range), with its `src_info` and its payload bytes
//! (the token's own encoding, `ep_reference::payload::Encoder`); and every token's combine is bit
//! for bit the oracle's (`oracle::combine`, `output::combine_diff`). Every `EP_SOAK_FULL_EVERY`-th
//! call (default 1000) is also compared in full with `oracle::dispatch` (`DispatchOutput::diff`).
//!
//! A custom runner (`harness = false`), as in `gpu/main.rs`: without a CUDA GPU and NVRTC the soak
//! prints `SKIPPED: <test>: <reason>` and counts as skipped, never as passed. One CPU test always
//! runs: the conservation check catches every mutant of a correct output (a row swapped, lost,
//! duplicated or corrupted, a count or range off by one).
//!
//! Environment: `EP_SOAK_CALLS` (calls per path, default 100000), `EP_SOAK_QUICK=1` or the
//! argument `--quick` (2000 calls per path), `EP_SOAK_FULL_EVERY` (1000), `EP_SOAK_SEED` (default
//! from the clock; printed), `EP_SOAK_MAX_SECS` (time budget, default 170 s; each config gets the
//! time left divided by the configs left: past its share a config stops, the run says how many
//! calls ran and exits 2, incomplete, never passed), `EP_SOAK_REPLAY=<config>:<call seed>:<path>` (one call that a
//! failure printed, on a fresh group), `EP_GPU_TIMEOUT_MS` (the kernels' wait bound).

use ep_test_runner as runner;
use runner::env_num;

use ep_kernels::runtime::probe_devices;
use ep_kernels::testing::Rng;
use ep_kernels::{GpuError, GpuGroup, GpuOptions, Path};
use ep_reference::output::combine_diff;
use ep_reference::payload::Encoder;
use ep_reference::workload::{Routing, Workload};
use ep_reference::{oracle, Config, DispatchOutput, Mode, RecvScales, RecvX};
use std::time::Instant;

const PRINTED_FAILURES: usize = 20;
/// A config stops after this many failures in the run.
const MAX_FAILURES: usize = 200;
/// The paths in the order of the counters (`counts[i]` is `PATHS[i]`'s).
const PATHS: [Path; 2] = Path::ALL;

fn main() {
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpu_soak: {e}");
            std::process::exit(2);
        }
    };
    let mut runner = runner::Runner::new("gpu_soak tests");
    runner.run(
        "soak_conservation_check_catches_every_mutant",
        Ok(()),
        || match conservation_self_test() {
            Ok(n) => runner::Verdict::Ok(format!("{n} mutants caught")),
            Err(e) => runner::Verdict::Failed(e.to_string()),
        },
    );
    let gpus = probe_devices(1);
    runner.run(
        "gpu_soak_calls_conserve_every_selection_and_match_the_oracle",
        gpus.clone().map(drop),
        || {
            let outcome = match settings.replay {
                Some(r) => replay(&settings, r),
                None => soak(&settings, gpus.unwrap_or(0) >= 2),
            };
            match outcome {
                Outcome::Complete => runner::Verdict::Ok(String::new()),
                Outcome::Cut => runner::Verdict::Incomplete,
                Outcome::Failed => runner::Verdict::Failed("see the failing calls above".into()),
            }
        },
    );
    runner.finish()
}

// ---------------------------------------------------------------- settings

#[derive(Debug, Clone, Copy)]
struct Replay {
    config: usize,
    seed: u64,
    path: Path,
}

struct Settings {
    calls: usize,
    full_every: usize,
    seed: u64,
    max_secs: f64,
    timeout_ns: u64,
    replay: Option<Replay>,
}

fn parse_replay(v: &str) -> Result<Replay, String> {
    let names = PATHS.map(Path::name).join("|");
    let bad = || format!("EP_SOAK_REPLAY={v:?}: expected <config>:<call seed>:<{names}>");
    let parts: Vec<&str> = v.trim().split(':').collect();
    let [c, s, p] = parts[..] else {
        return Err(bad());
    };
    Ok(Replay {
        config: c.parse().map_err(|_| bad())?,
        seed: s.parse().map_err(|_| bad())?,
        path: p.parse::<Path>().map_err(|_| bad())?,
    })
}

impl Settings {
    fn from_env() -> Result<Settings, String> {
        let quick = std::env::args().any(|a| a == "--quick")
            || env_num::<u32>("EP_SOAK_QUICK")?.unwrap_or(0) != 0;
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let s = Settings {
            calls: env_num("EP_SOAK_CALLS")?.unwrap_or(if quick { 2000 } else { 100_000 }),
            full_every: env_num("EP_SOAK_FULL_EVERY")?.unwrap_or(1000),
            seed: env_num("EP_SOAK_SEED")?.unwrap_or(clock % 1_000_000_007),
            max_secs: env_num("EP_SOAK_MAX_SECS")?.unwrap_or(170.0),
            timeout_ns: match env_num::<u64>("EP_GPU_TIMEOUT_MS")? {
                Some(ms) => ms.saturating_mul(1_000_000),
                None => GpuOptions::default().timeout_ns,
            },
            replay: match std::env::var("EP_SOAK_REPLAY") {
                Ok(v) => Some(parse_replay(&v)?),
                Err(_) => None,
            },
        };
        if s.full_every == 0 {
            return Err("EP_SOAK_FULL_EVERY=0: at least 1".into());
        }
        if s.max_secs.is_nan() || s.max_secs <= 0.0 {
            return Err(format!("EP_SOAK_MAX_SECS={}: must be > 0", s.max_secs));
        }
        Ok(s)
    }
}

// ---------------------------------------------------------------- configs and calls

/// One fixed config of the soak.
struct SoakConfig {
    cfg: Config,
    gpus: usize,
    zero_copy_local: bool,
}

/// The soak's configs: every mode, R from 2 to 4 on one GPU, small H and K so that a call (the
/// device round trips and the host's checks, the oracle's combine included) costs a few hundred
/// microseconds; with two GPUs one more across them (system-scope signals).
fn configs(two_gpus: bool) -> Vec<SoakConfig> {
    let c = |r, e, t, h, k, mode, gpus, zero_copy_local| SoakConfig {
        cfg: Config::new(r, e, t, h, k, mode).expect("a valid soak config"),
        gpus,
        zero_copy_local,
    };
    let mut v = vec![
        c(2, 8, 16, 128, 4, Mode::FP8, 1, true),
        c(4, 8, 6, 512, 3, Mode::FP8_UE8M0, 1, true),
        c(2, 6, 24, 64, 5, Mode::Bf16, 1, false),
        c(3, 9, 12, 128, 2, Mode::FP8_ROUND, 1, true),
    ];
    if two_gpus {
        v.push(c(2, 8, 16, 128, 4, Mode::FP8, 2, true));
    }
    v
}

fn describe(sc: &SoakConfig) -> String {
    format!(
        "{} on {} GPU(s), zero_copy_local={}",
        sc.cfg.describe(),
        sc.gpus,
        sc.zero_copy_local
    )
}

fn group(sc: &SoakConfig, timeout_ns: u64) -> Result<GpuGroup, GpuError> {
    GpuGroup::new(
        &sc.cfg,
        GpuOptions {
            num_gpus: sc.gpus,
            timeout_ns,
            zero_copy_local: sc.zero_copy_local,
            ..Default::default()
        },
    )
}

/// One call's inputs, drawn from its seed: token counts (empty and full ranks included) and a
/// routing (uniform, masked, all to one expert, all to one rank, one expert on every rank).
fn call_inputs(cfg: &Config, seed: u64) -> (Workload, &'static str) {
    let mut rng = Rng::new(seed);
    let t = cfg.max_tokens_per_rank;
    let tokens: Vec<usize> = (0..cfg.num_ranks)
        .map(|_| match rng.below(8) {
            0 => 0,
            1 => t,
            _ => rng.below(t + 1),
        })
        .collect();
    let (name, routing) = match rng.below(10) {
        0..=2 => ("uniform", Routing::Random { masked: 0.0 }),
        3..=5 => (
            "masked",
            Routing::Random {
                masked: [0.05, 0.2, 0.5, 0.9][rng.below(4)],
            },
        ),
        6 => ("skew-one-expert", Routing::OneExpert),
        7 | 8 => (
            "skew-one-rank",
            Routing::OneRank {
                rank: rng.below(cfg.num_ranks),
            },
        ),
        _ => ("every-rank", Routing::EveryRank),
    };
    (
        Workload::generate(cfg, &tokens, routing, rng.next_u64()),
        name,
    )
}

fn call_seed(master: u64, config: usize, call: u64) -> u64 {
    let mut z = master ^ ((config as u64) << 56) ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Every token's payload as the wire carries it: `[source][token]`.
fn encode_all(cfg: &Config, w: &Workload) -> Vec<Vec<Vec<u8>>> {
    let mut enc = Encoder::new(cfg);
    let h = cfg.hidden;
    w.x.iter()
        .map(|x| {
            x.chunks_exact(h)
                .map(|row| {
                    let mut p = vec![0u8; cfg.payload_bytes()];
                    enc.encode(row, &mut p);
                    p
                })
                .collect()
        })
        .collect()
}

/// Row `idx` of `out` (local expert l, row j: idx = l * rows_per_expert + j) in payload bytes.
fn row_payload(cfg: &Config, out: &DispatchOutput, idx: usize) -> Vec<u8> {
    let h = cfg.hidden;
    let mut v = Vec::with_capacity(cfg.payload_bytes());
    match &out.recv_x {
        RecvX::Bf16(x) => {
            for b in &x[idx * h..(idx + 1) * h] {
                v.extend(b.to_bits().to_le_bytes());
            }
        }
        RecvX::Fp8(x) => v.extend(&x[idx * h..(idx + 1) * h]),
    }
    let spr = cfg.scales_per_row();
    match &out.recv_scales {
        None => {}
        Some(RecvScales::F32(s)) => {
            for f in &s[idx * spr..(idx + 1) * spr] {
                v.extend(f.to_bits().to_le_bytes());
            }
        }
        Some(RecvScales::Ue8m0(s)) => {
            for w in &s[idx * spr..(idx + 1) * spr] {
                v.extend(w.to_le_bytes());
            }
        }
    }
    v
}

/// Conservation of one dispatch: on every rank d, for every local expert l and source s, the
/// range (begin, count) is (selections of expert d*L+l by sources before s, by s), `recv_count`
/// is the sum, and the rows of the range hold s's selecting tokens in token order, each once,
/// with its `src_info` and its payload bytes.
fn check_conservation(
    cfg: &Config,
    w: &Workload,
    payloads: &[Vec<Vec<u8>>],
    outs: &[DispatchOutput],
) -> Result<(), String> {
    let (r_n, l_n, k) = (cfg.num_ranks, cfg.num_local_experts(), cfg.top_k);
    let per = cfg.rows_per_expert();
    if outs.len() != r_n {
        return Err(format!("{} outputs for {r_n} ranks", outs.len()));
    }
    // selecting[e][s]: the tokens of s that selected expert e, in token order.
    let mut selecting = vec![vec![Vec::new(); r_n]; cfg.num_experts];
    for (s, idx) in w.topk_idx.iter().enumerate() {
        for (t, row) in idx.chunks_exact(k).enumerate() {
            for &e in row.iter().filter(|&&e| e >= 0) {
                selecting[e as usize][s].push(t);
            }
        }
    }
    for (d, out) in outs.iter().enumerate() {
        if out.recv_count.len() != l_n || out.layout_range.len() != l_n * r_n {
            return Err(format!(
                "rank {d}: recv_count/layout_range have the wrong length"
            ));
        }
        for l in 0..l_n {
            let e = d * l_n + l;
            let mut begin = 0usize;
            for (s, toks) in selecting[e].iter().enumerate() {
                let want = (begin as i32, toks.len() as i32);
                let got = out.layout_range[l * r_n + s];
                if got != want {
                    return Err(format!(
                        "rank {d}: layout_range[expert {l}][source {s}] = {got:?}, the routing gives {want:?}"
                    ));
                }
                if begin + toks.len() > per {
                    return Err(format!("rank {d}: expert {l} holds more than {per} rows"));
                }
                for (j, &t) in toks.iter().enumerate() {
                    let idx = l * per + begin + j;
                    if out.src_info[idx] != t as i32 {
                        return Err(format!(
                            "rank {d}: expert {l} row {} has src_info {}, want token {t} of source {s}",
                            begin + j,
                            out.src_info[idx]
                        ));
                    }
                    if row_payload(cfg, out, idx) != payloads[s][t] {
                        return Err(format!(
                            "rank {d}: expert {l} row {} (token {t} of source {s}): payload bytes differ from the token's encoding",
                            begin + j
                        ));
                    }
                }
                begin += toks.len();
            }
            if out.recv_count[l] != begin as i32 {
                return Err(format!(
                    "rank {d}: recv_count[{l}] = {}, the routing gives {begin}",
                    out.recv_count[l]
                ));
            }
        }
    }
    Ok(())
}

/// What one input must give, computed once and checked against both paths: every token's
/// payload, the oracle's combine, and (on sampled calls) the oracle's full dispatch.
struct Expected {
    payloads: Vec<Vec<Vec<u8>>>,
    combine: Vec<Vec<half::bf16>>,
    dispatch: Option<Vec<DispatchOutput>>,
}

fn expected(
    cfg: &Config,
    w: &Workload,
    ys: &[Vec<half::bf16>],
    full: bool,
) -> Result<Expected, String> {
    Ok(Expected {
        payloads: encode_all(cfg, w),
        combine: oracle::combine(cfg, &w.combine_inputs(ys)).map_err(|e| format!("oracle: {e}"))?,
        dispatch: if full {
            Some(oracle::dispatch(cfg, &w.dispatch_inputs()).map_err(|e| format!("oracle: {e}"))?)
        } else {
            None
        },
    })
}

/// One call of `path`: dispatch (conservation; on sampled calls the full oracle too), then
/// combine (bitwise the oracle's for every token). `Err` describes the first problem and says
/// whether the group refuses further calls (an error rather than a wrong output).
fn one_call(
    g: &mut GpuGroup,
    path: Path,
    w: &Workload,
    ys: &[Vec<half::bf16>],
    want: &Expected,
) -> Result<(), (String, bool)> {
    let cfg = *g.config();
    let got = g
        .dispatch(path, &w.x, &w.topk_idx)
        .map_err(|e| (format!("dispatch: {e}"), true))?;
    check_conservation(&cfg, w, &want.payloads, &got)
        .map_err(|e| (format!("dispatch: {e}"), false))?;
    if let Some(want_d) = &want.dispatch {
        for (r, (a, b)) in got.iter().zip(want_d).enumerate() {
            if let Some(d) = a.diff(b) {
                return Err((format!("dispatch, rank {r}: full oracle diff: {d}"), false));
            }
        }
    }
    let got_c = g
        .combine(path, ys, &w.topk_weights)
        .map_err(|e| (format!("combine: {e}"), true))?;
    for (r, (a, b)) in got_c.iter().zip(&want.combine).enumerate() {
        if let Some(d) = combine_diff(a, b, cfg.hidden) {
            return Err((format!("combine, rank {r}: {d}"), false));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- the soak

enum Outcome {
    Complete,
    Cut,
    Failed,
}

#[derive(Default)]
struct PathCount {
    calls: u64,
    full: u64,
    failures: u64,
}

fn soak(s: &Settings, two_gpus: bool) -> Outcome {
    let scs = configs(two_gpus);
    let per_config = s.calls.div_ceil(scs.len()) as u64;
    println!(
        "gpu_soak: {} calls per path over {} configs ({per_config} each), seed {} (EP_SOAK_SEED), full oracle every {} calls, wait bound {} ms, budget {} s (shared by the configs left)",
        s.calls,
        scs.len(),
        s.seed,
        s.full_every,
        s.timeout_ns / 1_000_000,
        s.max_secs
    );
    let t_all = Instant::now();
    let mut totals = [PathCount::default(), PathCount::default()];
    let mut printed = 0;
    let mut cut = false;
    let mut routings = std::collections::BTreeMap::<&str, u64>::new();
    for (ci, sc) in scs.iter().enumerate() {
        let t0 = Instant::now();
        // The budget left, shared by the configs left (a quick config leaves time to the next).
        let share = (s.max_secs - t_all.elapsed().as_secs_f64()) / (scs.len() - ci) as f64;
        let mut g = match group(sc, s.timeout_ns) {
            Ok(g) => g,
            Err(e) => {
                println!("FAIL: config {ci} {}: group: {e}", describe(sc));
                totals[0].failures += 1;
                continue;
            }
        };
        let ys = Workload::uniform(&sc.cfg, 0, Routing::EveryRank, s.seed).expert_outputs(s.seed);
        let mut counts = [PathCount::default(), PathCount::default()];
        let mut rebuilt = 0;
        let mut call = 0u64;
        while call < per_config {
            if printed >= MAX_FAILURES {
                println!("STOPPED: {MAX_FAILURES} failures (the first ones say what is wrong)");
                break;
            }
            if t0.elapsed().as_secs_f64() > share {
                cut = true;
                println!(
                    "TIME BUDGET: config {ci} stopped after {call} of {per_config} calls per path ({share:.0} s)"
                );
                break;
            }
            // One input per round, run on both paths (alternating which goes first): every call
            // of a path sees a new random routing, and the expected outputs are computed once.
            let seed = call_seed(s.seed, ci, call);
            let (w, routing) = call_inputs(&sc.cfg, seed);
            *routings.entry(routing).or_default() += 1;
            let full = call.is_multiple_of(s.full_every as u64);
            let want = match expected(&sc.cfg, &w, &ys, full) {
                Ok(x) => x,
                Err(e) => {
                    println!("FAIL: config {ci}, call {call}: {e}");
                    return Outcome::Failed;
                }
            };
            for pi in 0..2 {
                let pi = if call.is_multiple_of(2) { pi } else { 1 - pi };
                let path = PATHS[pi];
                let res = one_call(&mut g, path, &w, &ys, &want);
                counts[pi].calls += 1;
                counts[pi].full += full as u64;
                if let Err((msg, broken)) = res {
                    counts[pi].failures += 1;
                    printed += 1;
                    if printed <= PRINTED_FAILURES {
                        println!(
                            "FAIL: config {ci} ({}), call {call}, {} ({routing}, tokens {:?}): {msg}\n  replay: EP_SOAK_SEED={} EP_SOAK_REPLAY={ci}:{seed}:{}",
                            describe(sc),
                            path.name(),
                            (0..sc.cfg.num_ranks).map(|r| w.num_tokens(r)).collect::<Vec<_>>(),
                            s.seed,
                            path.name()
                        );
                    }
                    if broken {
                        drop(g);
                        rebuilt += 1;
                        g = match group(sc, s.timeout_ns) {
                            Ok(g) => g,
                            Err(e) => {
                                println!("FAIL: config {ci}: cannot rebuild the group: {e}");
                                return Outcome::Failed;
                            }
                        };
                    }
                }
            }
            call += 1;
        }
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "config {ci}: {}: {} {} calls ({} full, {} failed), {} {} calls ({} full, {} failed), {secs:.1} s, {:.0} us per call; device call counters {:?}{}",
            describe(sc),
            PATHS[0],
            counts[0].calls,
            counts[0].full,
            counts[0].failures,
            PATHS[1],
            counts[1].calls,
            counts[1].full,
            counts[1].failures,
            secs * 1e6 / (counts[0].calls + counts[1].calls).max(1) as f64,
            g.calls(),
            if rebuilt > 0 {
                format!(" (group rebuilt {rebuilt} times after errors)")
            } else {
                String::new()
            }
        );
        for (t, c) in totals.iter_mut().zip(&counts) {
            t.calls += c.calls;
            t.full += c.full;
            t.failures += c.failures;
        }
    }
    let failures = totals[0].failures + totals[1].failures;
    println!(
        "gpu_soak: {} {} calls, {} {} calls (each a dispatch and a combine, conservation and combine checked on every call), {} + {} fully against the oracle, {failures} failures, {:.1} s",
        PATHS[0],
        totals[0].calls,
        PATHS[1],
        totals[1].calls,
        totals[0].full,
        totals[1].full,
        t_all.elapsed().as_secs_f64()
    );
    println!("  calls per routing: {routings:?}");
    if failures > 0 {
        Outcome::Failed
    } else if cut {
        Outcome::Cut
    } else {
        Outcome::Complete
    }
}

fn replay(s: &Settings, r: Replay) -> Outcome {
    let scs = configs(true);
    let Some(sc) = scs.get(r.config) else {
        println!("EP_SOAK_REPLAY: no config {}", r.config);
        return Outcome::Failed;
    };
    println!(
        "replaying config {} ({}), call seed {}, {}",
        r.config,
        describe(sc),
        r.seed,
        r.path.name()
    );
    let mut g = match group(sc, s.timeout_ns) {
        Ok(g) => g,
        Err(e) => {
            println!("FAIL: group: {e}");
            return Outcome::Failed;
        }
    };
    let ys = Workload::uniform(&sc.cfg, 0, Routing::EveryRank, s.seed).expert_outputs(s.seed);
    let (w, routing) = call_inputs(&sc.cfg, r.seed);
    let want = match expected(&sc.cfg, &w, &ys, true) {
        Ok(x) => x,
        Err(e) => {
            println!("FAIL: replay: {e}");
            return Outcome::Failed;
        }
    };
    match one_call(&mut g, r.path, &w, &ys, &want) {
        Ok(()) => {
            println!("replay ({routing}): conservation, full oracle and combine all hold");
            Outcome::Complete
        }
        Err((msg, _)) => {
            println!("FAIL: replay ({routing}): {msg}");
            Outcome::Failed
        }
    }
}

// ---------------------------------------------------------------- the check's own test

/// The conservation check on the oracle's (correct) outputs passes, and each mutant of them
/// fails: returns how many mutants were caught.
fn conservation_self_test() -> Result<usize, String> {
    let mut caught = 0;
    for mode in [Mode::Bf16, Mode::FP8, Mode::FP8_UE8M0] {
        let h = if mode == Mode::FP8_UE8M0 { 512 } else { 128 };
        let cfg = Config::new(2, 4, 8, h, 2, mode).map_err(|e| e.to_string())?;
        let w = Workload::uniform(&cfg, 8, Routing::Random { masked: 0.1 }, 42);
        let outs = oracle::dispatch(&cfg, &w.dispatch_inputs()).map_err(|e| e.to_string())?;
        let payloads = encode_all(&cfg, &w);
        check_conservation(&cfg, &w, &payloads, &outs)
            .map_err(|e| format!("{}: the oracle's own output fails: {e}", mode.name()))?;
        // A (rank, expert, source) range with at least two rows, for swaps and duplicates.
        let per = cfg.rows_per_expert();
        let (d, l, s) = (0..2)
            .flat_map(|d| (0..2).flat_map(move |l| (0..2).map(move |s| (d, l, s))))
            .find(|&(d, l, s)| outs[d].range(l, s).1 >= 2)
            .ok_or("no range with two rows in the sample")?;
        let (b, c) = outs[d].range(l, s);
        let i = l * per + b;
        type Mutant = (&'static str, Box<dyn Fn(&mut DispatchOutput)>);
        let mutants: Vec<Mutant> = vec![
            (
                "two rows' src_info swapped",
                Box::new(move |o| o.src_info.swap(i, i + 1)),
            ),
            (
                "a row duplicated over its neighbour",
                Box::new(move |o| {
                    o.src_info[i + 1] = o.src_info[i];
                    copy_row(o, i, i + 1)
                }),
            ),
            (
                "the last row of a range lost (counts lowered)",
                Box::new(move |o| {
                    let rn = o.config.num_ranks;
                    o.layout_range[l * rn + s].1 -= 1;
                    for s2 in s + 1..rn {
                        o.layout_range[l * rn + s2].0 -= 1;
                    }
                    o.recv_count[l] -= 1;
                }),
            ),
            (
                "recv_count one too high",
                Box::new(move |o| o.recv_count[l] += 1),
            ),
            (
                "a range's begin shifted",
                Box::new(move |o| {
                    let rn = o.config.num_ranks;
                    o.layout_range[l * rn + s].0 += 1
                }),
            ),
            (
                "one payload byte flipped",
                Box::new(move |o| match &mut o.recv_x {
                    RecvX::Bf16(x) => x[i * h] = half::bf16::from_bits(x[i * h].to_bits() ^ 1),
                    RecvX::Fp8(x) => x[i * h + h - 1] ^= 0x10,
                }),
            ),
            (
                "a row's src_info naming another token",
                Box::new(move |o| {
                    o.src_info[i + c - 1] = o.src_info[i + c - 1].wrapping_add(1);
                }),
            ),
        ];
        let mut mutants = mutants;
        if mode.is_fp8() {
            mutants.push((
                "one scale changed",
                Box::new(move |o| match &mut o.recv_scales {
                    Some(RecvScales::F32(v)) => v[i * (h / 128)] *= 2.0,
                    Some(RecvScales::Ue8m0(v)) => v[i * (h / 512)] ^= 1,
                    None => {}
                }),
            ));
        }
        for (what, m) in &mutants {
            let mut bad = outs.clone();
            m(&mut bad[d]);
            if check_conservation(&cfg, &w, &payloads, &bad).is_ok() {
                return Err(format!("{}: mutant not caught: {what}", mode.name()));
            }
            caught += 1;
        }
        // Combine: one bit of one token differs from the oracle's.
        let ys = w.expert_outputs(7);
        let want = oracle::combine(&cfg, &w.combine_inputs(&ys)).map_err(|e| e.to_string())?;
        let mut bad = want[1].clone();
        bad[0] = half::bf16::from_bits(bad[0].to_bits() ^ 0x8000);
        if combine_diff(&bad, &want[1], h).is_none()
            || combine_diff(&want[1], &want[1], h).is_some()
        {
            return Err("combine_diff misses a flipped sign bit or flags equal outputs".into());
        }
        caught += 1;
    }
    Ok(caught)
}

fn copy_row(o: &mut DispatchOutput, from: usize, to: usize) {
    let cfg = o.config;
    let h = cfg.hidden;
    match &mut o.recv_x {
        RecvX::Bf16(x) => x.copy_within(from * h..(from + 1) * h, to * h),
        RecvX::Fp8(x) => x.copy_within(from * h..(from + 1) * h, to * h),
    }
    let spr = cfg.scales_per_row();
    match &mut o.recv_scales {
        None => {}
        Some(RecvScales::F32(v)) => v.copy_within(from * spr..(from + 1) * spr, to * spr),
        Some(RecvScales::Ue8m0(v)) => v.copy_within(from * spr..(from + 1) * spr, to * spr),
    }
}
