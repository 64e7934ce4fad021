//! GPU differential fuzz: N random configs, virtual ranks on one GPU (and on
//! two when two are present), every mode, several routings, both paths, each output compared bit
//! for bit with `ep_reference::oracle`.
//!
//! A custom runner (`harness = false`), as in `gpu/main.rs`: without a CUDA GPU and NVRTC the GPU
//! test prints `SKIPPED: <test>: <reason>` and counts as skipped, never as passed. One CPU test
//! always runs: the case generator's configs are valid and cover what the fuzz promises.
//!
//! Each config: R in 1..=8 (even R over two GPUs), L in 1..=6 (E = R*L), T in 1..=48, K in
//! 1..=min(16, E); one config in eight (not with `EP_GPU_FUZZ_SMALL`) is a wide one:
//! R in 33..=256 (half of them 33, 64, 128 or 256), L in 1..=2, T in 1..=8, H small; one of the four modes, H any size in bf16, a multiple of 128 (fp8) or 512
//! (ue8m0), `zero_copy_local` on or off, and now and then a small forced `blocks_per_rank`. It
//! runs `EP_GPU_FUZZ_ROUNDS` inputs on one group (buffer reuse across calls), each with its own
//! routing (uniform, masked at 10-100 %, all to one expert, all to one rank, one expert on every
//! rank) and token counts (empty ranks, full ranks, anything between), both paths in a random
//! order: dispatch against `DispatchOutput::diff`, combine against `output::combine_diff`.
//! About a third of the configs whose H is a multiple of 128 combine in LogFMT-10 (expert
//! outputs scaled so that most groups pack, `testing::logfmt_packable`), against
//! `oracle::combine_with`.
//! Inputs come from the project's one generator, `ep_reference::workload` (on main it has no
//! special values such as NaN, inf, -0 or subnormals; the fuzz uses what it offers).
//!
//! Environment:
//! - `EP_GPU_FUZZ_CASES` configs (default 1000); `EP_GPU_FUZZ_ROUNDS` inputs per config (2);
//! - `EP_GPU_FUZZ_SEED` master seed (default: from the clock; always printed);
//! - `EP_GPU_FUZZ_REPLAY=<case seed>` runs the one case a failure printed;
//! - `EP_GPU_FUZZ_MAX_SECS` time budget (default 170): past it the run stops, says how many
//!   configs ran, and exits 2 (incomplete; never reported as passed);
//! - `EP_GPU_FUZZ_SMALL=1` small shapes only (T <= 8, H <= 512, R <= 4), for the sanitizer;
//! - `EP_GPU_TIMEOUT_MS` the kernels' wait bound (default: `GpuOptions::default()`, 2 s);
//!   raise it under compute-sanitizer;
//! - `EP_GPU_BLOCKS_PER_RANK` forces blocks per rank on every group (sanitizer: fewer blocks).

use ep_test_runner as runner;
use runner::env_num;

use ep_kernels::runtime::probe_devices;
use ep_kernels::testing::{logfmt_packable, Rng};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, Path};
use ep_reference::output::combine_diff;
use ep_reference::workload::{Routing, Values, Workload};
use ep_reference::{oracle, CombineFormat, Config, Mode};
use std::collections::BTreeMap;
use std::time::Instant;

const MODES: [Mode; 4] = [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0];

/// Failures printed in full; later ones are counted only.
const PRINTED_FAILURES: usize = 20;
/// The run stops after this many failures (the first ones say what is wrong).
const MAX_FAILURES: usize = 100;

fn main() {
    let settings = match Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpu_fuzz: {e}");
            std::process::exit(2);
        }
    };
    let mut runner = runner::Runner::new("gpu_fuzz tests");
    runner.run(
        "fuzz_cases_are_valid_and_cover_every_mode_routing_and_shape",
        Ok(()),
        || match generator_self_test(&settings) {
            Ok(()) => runner::Verdict::Ok(String::new()),
            Err(e) => runner::Verdict::Failed(e.to_string()),
        },
    );
    let gpus = probe_devices(1);
    runner.run(
        "gpu_fuzz_random_configs_both_paths_bitwise_equal_oracle",
        gpus.clone().map(drop),
        || match run_fuzz(&settings, gpus.unwrap_or(0) >= 2) {
            Outcome::Complete => runner::Verdict::Ok(String::new()),
            Outcome::Cut => runner::Verdict::Incomplete,
            Outcome::Failed => runner::Verdict::Failed("see the failing configs above".into()),
        },
    );
    runner.finish()
}

// ---------------------------------------------------------------- settings

struct Settings {
    cases: usize,
    rounds: usize,
    seed: u64,
    replay: Option<u64>,
    max_secs: f64,
    small: bool,
    timeout_ns: u64,
    blocks_per_rank: Option<usize>,
}

impl Settings {
    fn from_env() -> Result<Settings, String> {
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let s = Settings {
            cases: env_num("EP_GPU_FUZZ_CASES")?.unwrap_or(1000),
            rounds: env_num("EP_GPU_FUZZ_ROUNDS")?.unwrap_or(2),
            seed: env_num("EP_GPU_FUZZ_SEED")?.unwrap_or(clock % 1_000_000_007),
            replay: env_num("EP_GPU_FUZZ_REPLAY")?,
            max_secs: env_num("EP_GPU_FUZZ_MAX_SECS")?.unwrap_or(170.0),
            small: env_num::<u32>("EP_GPU_FUZZ_SMALL")?.unwrap_or(0) != 0,
            timeout_ns: match env_num::<u64>("EP_GPU_TIMEOUT_MS")? {
                Some(ms) => ms.saturating_mul(1_000_000),
                None => GpuOptions::default().timeout_ns,
            },
            blocks_per_rank: env_num("EP_GPU_BLOCKS_PER_RANK")?,
        };
        if s.rounds == 0 {
            return Err("EP_GPU_FUZZ_ROUNDS=0: at least 1 input per config".into());
        }
        if s.blocks_per_rank == Some(0) {
            return Err("EP_GPU_BLOCKS_PER_RANK=0: at least 1".into());
        }
        if s.max_secs.is_nan() || s.max_secs <= 0.0 {
            return Err(format!("EP_GPU_FUZZ_MAX_SECS={}: must be > 0", s.max_secs));
        }
        Ok(s)
    }
}

// ---------------------------------------------------------------- cases

/// How tokens choose experts in one round (names for the report).
#[derive(Debug, Clone, Copy)]
struct RoutingPlan {
    name: &'static str,
    routing: Routing,
}

/// One input on a config.
#[derive(Debug, Clone)]
struct Round {
    plan: RoutingPlan,
    tokens: Vec<usize>,
    seed: u64,
    /// Per-expert path first (else batched first).
    per_expert_first: bool,
}

/// One config and its rounds, all drawn from `seed`.
#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    cfg: Config,
    gpus: usize,
    zero_copy_local: bool,
    blocks_per_rank: Option<usize>,
    /// The combine's format (set on the group for this case's rounds).
    format: CombineFormat,
    rounds: Vec<Round>,
}

impl Case {
    /// Cases with the same key share a group (run next to each other).
    fn key(&self) -> (usize, usize, usize, usize, usize, usize, usize, bool, usize) {
        let c = &self.cfg;
        let mode = MODES.iter().position(|m| *m == c.mode).unwrap_or(9);
        (
            self.gpus,
            c.num_ranks,
            c.num_experts,
            c.max_tokens_per_rank,
            c.hidden,
            c.top_k,
            mode,
            self.zero_copy_local,
            self.blocks_per_rank.unwrap_or(0),
        )
    }

    fn describe(&self) -> String {
        format!(
            "{} on {} GPU(s), combine {}, zero_copy_local={}, blocks_per_rank={}",
            self.cfg.describe(),
            self.gpus,
            self.format.name(),
            self.zero_copy_local,
            self.blocks_per_rank
                .map_or("default".to_string(), |b| b.to_string())
        )
    }
}

/// The seed of case `i` of a run with master seed `master` (splitmix64 of both).
fn case_seed(master: u64, i: usize) -> u64 {
    let mut z = master ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len())]
}

/// Draws a config and its rounds from `seed` alone (a printed seed replays it).
fn draw_case(seed: u64, two_gpus: bool, small: bool, rounds: usize) -> Case {
    let mut rng = Rng::new(seed);
    let gpus = if two_gpus && rng.below(3) == 0 { 2 } else { 1 };
    // Past 32 ranks (the wide build of the kernels): small T and H, so that 256 virtual ranks
    // fit one GPU and the oracle's host work stays small.
    let wide = !small && rng.below(8) == 0;
    let max_r = if small { 4 } else { 8 };
    let r = if wide {
        let r = if rng.below(2) == 0 {
            pick(&mut rng, &[33, 64, 128, 256])
        } else {
            33 + rng.below(224)
        };
        if gpus == 2 {
            r + r % 2
        } else {
            r
        }
    } else if gpus == 2 {
        2 * (1 + rng.below(max_r / 2))
    } else {
        1 + rng.below(max_r)
    };
    let l = 1 + rng.below(if wide { 2 } else { 6 });
    let e = r * l;
    let k = 1 + rng.below(16.min(e));
    let t = 1 + rng.below(if small || wide { 8 } else { 48 });
    let mode = MODES[rng.below(4)];
    // Rows per rank that combine's y holds: keep the host work per case small.
    let big_ok = !small && !wide && r * l * r * t <= 512;
    let h = match mode {
        Mode::Bf16 if wide => 1 + rng.below(512),
        Mode::Fp8 { ue8m0: false, .. } if wide => 128 * (1 + rng.below(4)),
        Mode::Fp8 { ue8m0: true, .. } if wide => 512,
        Mode::Bf16 => match rng.below(10) {
            0..=4 => 1 + rng.below(256),
            5..=8 => 257 + rng.below(if small { 256 } else { 1792 }),
            _ if big_ok => pick(&mut rng, &[4096, 7168]),
            _ => 2 + 2 * rng.below(64),
        },
        Mode::Fp8 { ue8m0: false, .. } => match rng.below(10) {
            0..=8 => 128 * (1 + rng.below(if small { 4 } else { 16 })),
            _ if big_ok => 7168,
            _ => 128,
        },
        Mode::Fp8 { ue8m0: true, .. } => match rng.below(10) {
            0..=8 => 512 * (1 + rng.below(if small { 1 } else { 4 })),
            _ if big_ok => 7168,
            _ => 512,
        },
    };
    let cfg = Config::new(r, e, t, h, k, mode)
        .unwrap_or_else(|err| panic!("case seed {seed}: drew an invalid config: {err}"));
    let zero_copy_local = rng.below(2) == 0;
    let blocks_per_rank = if !wide && rng.below(4) == 0 {
        Some(1 + rng.below(4))
    } else {
        None
    };
    let rounds = (0..rounds)
        .map(|_| {
            let plan = match rng.below(8) {
                0 | 1 => RoutingPlan {
                    name: "uniform",
                    routing: Routing::Random { masked: 0.0 },
                },
                2 | 3 => RoutingPlan {
                    name: "masked",
                    routing: Routing::Random {
                        masked: pick(&mut rng, &[0.1, 0.3, 0.6, 1.0]),
                    },
                },
                4 => RoutingPlan {
                    name: "skew-one-expert",
                    routing: Routing::OneExpert,
                },
                5 | 6 => RoutingPlan {
                    name: "skew-one-rank",
                    routing: Routing::OneRank { rank: rng.below(r) },
                },
                _ => RoutingPlan {
                    name: "every-rank",
                    routing: Routing::EveryRank,
                },
            };
            let tokens = (0..r)
                .map(|_| match rng.below(4) {
                    0 => 0,
                    1 => t,
                    _ => rng.below(t + 1),
                })
                .collect();
            Round {
                plan,
                tokens,
                seed: rng.next_u64(),
                per_expert_first: rng.below(2) == 0,
            }
        })
        .collect();
    // From a generator of its own: every other choice of a seed is what it was without it.
    let format = if h % 128 == 0 && Rng::new(seed ^ 0x6C6F_6766_6D74_0001).below(3) == 0 {
        CombineFormat::LogFmt
    } else {
        CombineFormat::Bf16
    };
    Case {
        seed,
        cfg,
        gpus,
        zero_copy_local,
        blocks_per_rank,
        format,
        rounds,
    }
}

fn draw_cases(s: &Settings, two_gpus: bool) -> Vec<Case> {
    match s.replay {
        Some(seed) => vec![draw_case(seed, two_gpus, s.small, s.rounds)],
        None => (0..s.cases)
            .map(|i| draw_case(case_seed(s.seed, i), two_gpus, s.small, s.rounds))
            .collect(),
    }
}

/// The generator's promises, checked without a GPU: every config valid, every mode, routing,
/// rank count 1..=8, both `zero_copy_local` settings, empty and full ranks, 2-GPU cases with
/// even R only, and (for the workload) inputs that pass the oracle's checks.
fn generator_self_test(s: &Settings) -> Result<(), String> {
    let n = s.cases.max(200);
    let settings = Settings {
        cases: n,
        replay: None,
        small: false,
        ..*s
    };
    let cases = draw_cases(&settings, true);
    let mut modes = [0usize; 4];
    let mut routings: BTreeMap<&str, usize> = BTreeMap::new();
    let mut ranks = [0usize; 9];
    let (mut wide, mut wide_256) = (0, 0);
    let (mut empty, mut full, mut zc, mut two, mut logfmt) = (0, 0, 0, 0, 0);
    for c in &cases {
        c.cfg
            .validate()
            .map_err(|e| format!("case {}: {e}", c.seed))?;
        let cfg = &c.cfg;
        if cfg.top_k > 16.min(cfg.num_experts) || cfg.max_tokens_per_rank > 48 {
            return Err(format!("case {}: out of range: {}", c.seed, c.describe()));
        }
        if c.gpus == 2 && cfg.num_ranks % 2 != 0 {
            return Err(format!("case {}: odd R on 2 GPUs", c.seed));
        }
        let l = cfg.num_local_experts();
        if !(1..=6).contains(&l) {
            return Err(format!("case {}: L = {l}", c.seed));
        }
        modes[MODES.iter().position(|m| *m == cfg.mode).unwrap()] += 1;
        if cfg.num_ranks > 8 {
            // A wide case: 33..=256 ranks, small shapes.
            if cfg.num_ranks < 33
                || cfg.num_ranks > ep_kernels::runtime::MAX_RANKS
                || cfg.max_tokens_per_rank > 8
                || l > 2
                || cfg.hidden > 512
            {
                return Err(format!(
                    "case {}: wide case out of range: {}",
                    c.seed,
                    c.describe()
                ));
            }
            wide += 1;
            wide_256 += (cfg.num_ranks == 256) as usize;
        } else {
            ranks[cfg.num_ranks] += 1;
        }
        zc += c.zero_copy_local as usize;
        if c.format == CombineFormat::LogFmt {
            c.format
                .check(cfg)
                .map_err(|e| format!("case {}: {e}", c.seed))?;
            logfmt += 1;
        }
        two += (c.gpus == 2) as usize;
        for r in &c.rounds {
            *routings.entry(r.plan.name).or_default() += 1;
            empty += r.tokens.iter().filter(|&&n| n == 0).count();
            full += r
                .tokens
                .iter()
                .filter(|&&n| n == cfg.max_tokens_per_rank)
                .count();
        }
    }
    // A few workloads through the oracle's input checks (cheap: the first 20 cases).
    for c in cases.iter().take(20) {
        for r in &c.rounds {
            let w = Workload::generate(&c.cfg, &r.tokens, r.plan.routing, r.seed);
            oracle::dispatch(&c.cfg, &w.dispatch_inputs())
                .map_err(|e| format!("case {}: workload refused: {e}", c.seed))?;
        }
    }
    println!(
        "  {n} cases: modes {modes:?}, R 1..8 {:?}, R 33..256 {wide} ({wide_256} at 256), routings {routings:?}, empty ranks {empty}, full ranks {full}, zero_copy_local {zc}, on 2 GPUs {two}, LogFMT {logfmt}",
        &ranks[1..]
    );
    if modes.contains(&0) || ranks[1..].contains(&0) || routings.len() < 5 {
        return Err("a mode, rank count or routing is never drawn".into());
    }
    if wide == 0 || wide_256 == 0 {
        return Err("no case past 32 ranks, or none at 256".into());
    }
    if logfmt == 0 || logfmt == n {
        return Err("no LogFMT case, or no bf16 one".into());
    }
    if empty == 0 || full == 0 || zc == 0 || zc == n || two == 0 {
        return Err(
            "empty/full ranks, both zero_copy_local settings or 2-GPU cases missing".into(),
        );
    }
    // Replay: the same seed gives the same case.
    let a = draw_case(cases[7].seed, true, false, s.rounds);
    if a.key() != cases[7].key() || a.rounds[0].tokens != cases[7].rounds[0].tokens {
        return Err("a case seed does not replay the same case".into());
    }
    Ok(())
}

// ---------------------------------------------------------------- the GPU run

enum Outcome {
    Complete,
    Cut,
    Failed,
}

/// Passed comparisons per (mode, path): [dispatch, combine].
type Tally = BTreeMap<(&'static str, &'static str), [usize; 2]>;

struct Stats {
    configs: usize,
    rounds: usize,
    tally: Tally,
    routings: BTreeMap<&'static str, usize>,
    ranks: BTreeMap<(usize, usize), usize>,
    /// Configs that passed with special values in x and y.
    special: usize,
    /// Configs that passed with a LogFMT combine.
    logfmt: usize,
    refused: usize,
    failures: usize,
    group_secs: f64,
}

fn run_fuzz(s: &Settings, two_gpus: bool) -> Outcome {
    let t0 = Instant::now();
    let mut cases = draw_cases(s, two_gpus);
    // Cases with the same config shape next to each other (they share a group), otherwise in the
    // drawn order: a run cut by its time budget still covers every R, mode and size.
    let mut first = std::collections::HashMap::new();
    for (i, c) in cases.iter().enumerate() {
        first.entry(c.key()).or_insert(i);
    }
    cases.sort_by_key(|c| first[&c.key()]);
    match s.replay {
        Some(seed) => println!("replaying case seed {seed}"),
        None => println!(
            "gpu_fuzz: {} configs x {} rounds, seed {} (EP_GPU_FUZZ_SEED), {} GPU(s) used, wait bound {} ms, budget {} s",
            cases.len(),
            s.rounds,
            s.seed,
            if two_gpus { 2 } else { 1 },
            s.timeout_ns / 1_000_000,
            s.max_secs
        ),
    }
    // Keep each device's primary context alive between groups: without a holder, dropping the
    // last group releases it and the next group pays a full context creation.
    let mut keepers = keep_contexts(two_gpus, s.timeout_ns);
    let mut st = Stats {
        configs: 0,
        rounds: 0,
        tally: BTreeMap::new(),
        routings: BTreeMap::new(),
        ranks: BTreeMap::new(),
        special: 0,
        logfmt: 0,
        refused: 0,
        failures: 0,
        group_secs: 0.0,
    };
    let mut group: Option<(GpuGroup, _)> = None;
    let mut cut = false;
    for (i, case) in cases.iter().enumerate() {
        if st.failures >= MAX_FAILURES {
            println!(
                "STOPPED after {MAX_FAILURES} failures ({i} of {} configs tried)",
                cases.len()
            );
            break;
        }
        if t0.elapsed().as_secs_f64() > s.max_secs {
            cut = true;
            println!(
                "TIME BUDGET: {} s reached after {i} of {} configs; the rest did not run",
                s.max_secs,
                cases.len()
            );
            break;
        }
        if group.as_ref().map(|(_, k)| *k) != Some(case.key()) {
            group = None;
            let tg = Instant::now();
            let made = GpuGroup::new(
                &case.cfg,
                GpuOptions {
                    num_gpus: case.gpus,
                    timeout_ns: s.timeout_ns,
                    blocks_per_rank: s.blocks_per_rank.or(case.blocks_per_rank),
                    zero_copy_local: case.zero_copy_local,
                    // DeepEP's column-major recv_scales in half the cases (read back into the
                    // oracle's row order); tied to zero_copy_local, which the group key covers.
                    scales_column_major: case.zero_copy_local,
                    ..Default::default()
                },
            );
            st.group_secs += tg.elapsed().as_secs_f64();
            match made {
                Ok(g) => group = Some((g, case.key())),
                Err(GpuError::Unsupported(why)) => {
                    println!("refused (typed): {}: {why}", case.describe());
                    st.refused += 1;
                    continue;
                }
                Err(e) => {
                    fail(&mut st, case, None, &format!("group: {e}"));
                    continue;
                }
            }
        }
        let (g, _) = group.as_mut().expect("a group for this case");
        let ok =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_case(g, case, &mut st)));
        match ok {
            Ok(Ok(())) => {}
            Ok(Err((round, msg))) => {
                fail(&mut st, case, Some(round), &msg);
                group = None; // a failed group refuses later calls; start afresh
            }
            Err(_) => {
                fail(&mut st, case, None, "panicked");
                group = None;
            }
        }
        if group.is_none() {
            // After a failure, let the primary contexts go and take them again: a sticky CUDA
            // error (a faulting kernel) would otherwise fail every later config too.
            keepers.clear();
            keepers = keep_contexts(two_gpus, s.timeout_ns);
        }
        st.configs += 1;
        if (i + 1) % 100 == 0 {
            println!(
                "  {} configs, {} failures, {:.1} s",
                i + 1,
                st.failures,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    drop(group);
    drop(keepers);
    report(&st, t0.elapsed().as_secs_f64(), cases.len());
    if st.failures > 0 {
        Outcome::Failed
    } else if cut {
        Outcome::Cut
    } else {
        Outcome::Complete
    }
}

/// One small group per device set, alive for the whole run (see `run_fuzz`).
fn keep_contexts(two_gpus: bool, timeout_ns: u64) -> Vec<GpuGroup> {
    let mut keep = Vec::new();
    let cfg = Config::new(1, 1, 1, 128, 1, Mode::Bf16).expect("a valid holder config");
    let opts = GpuOptions {
        timeout_ns,
        blocks_per_rank: Some(1),
        ..Default::default()
    };
    if let Ok(g) = GpuGroup::new(&cfg, opts) {
        keep.push(g);
    }
    if two_gpus {
        let cfg = Config::new(2, 2, 1, 128, 1, Mode::Bf16).expect("a valid holder config");
        if let Ok(g) = GpuGroup::new(
            &cfg,
            GpuOptions {
                num_gpus: 2,
                ..opts
            },
        ) {
            keep.push(g);
        }
    }
    keep
}

fn fail(st: &mut Stats, case: &Case, round: Option<usize>, msg: &str) {
    st.failures += 1;
    if st.failures <= PRINTED_FAILURES {
        let round = round.map_or(String::new(), |r| {
            format!(
                " round {r} ({}, tokens {:?})",
                case.rounds[r].plan.name, case.rounds[r].tokens
            )
        });
        println!(
            "FAIL: {}{round}: {msg}\n  replay: EP_GPU_FUZZ_REPLAY={} EP_GPU_FUZZ_ROUNDS={}{} (on a machine with as many GPUs)",
            case.describe(),
            case.seed,
            case.rounds.len(),
            replay_env()
        );
    }
}

/// The settings besides the seed that a replay needs (those that change the case or its group).
fn replay_env() -> String {
    [
        "EP_GPU_FUZZ_SMALL",
        "EP_GPU_BLOCKS_PER_RANK",
        "EP_GPU_TIMEOUT_MS",
    ]
    .iter()
    .filter_map(|v| std::env::var(v).ok().map(|x| format!(" {v}={x}")))
    .collect()
}

/// Special values (±inf, NaN of both signs, ±0, subnormals, values beyond e4m3's 448) in x and
/// in the expert outputs of every odd-seeded case, as the CPU differential run draws them (a
/// function of the case seed, so a replay draws the same).
fn case_values(seed: u64) -> Values {
    if seed % 2 == 1 {
        Values::Special { share: 0.05 }
    } else {
        Values::Normal
    }
}

/// Every round of a case on `g`; `Err((round, what))` on the first difference or error.
fn run_case(g: &mut GpuGroup, case: &Case, st: &mut Stats) -> Result<(), (usize, String)> {
    let cfg = case.cfg;
    let mode = cfg.mode.name();
    // Expert outputs y, one set per config (the costliest input to draw): each round's routing
    // reads other rows of it.
    let values = case_values(case.seed);
    let mut ys = Workload::uniform(&cfg, 0, Routing::EveryRank, case.seed)
        .expert_outputs_with(case.seed, values);
    if case.format == CombineFormat::LogFmt {
        logfmt_packable(&mut ys, cfg.hidden);
    }
    g.set_combine_format(case.format)
        .map_err(|e| (0, format!("combine format: {e}")))?;
    for (ri, round) in case.rounds.iter().enumerate() {
        let err = |m: String| (ri, m);
        let w =
            Workload::generate_with(&cfg, &round.tokens, round.plan.routing, values, round.seed);
        let want = oracle::dispatch(&cfg, &w.dispatch_inputs())
            .map_err(|e| err(format!("oracle dispatch: {e}")))?;
        let want_c = oracle::combine_with(&cfg, &w.combine_inputs(&ys), case.format)
            .map_err(|e| err(format!("oracle combine: {e}")))?;
        let paths = if round.per_expert_first {
            [Path::PerExpert, Path::Batched]
        } else {
            [Path::Batched, Path::PerExpert]
        };
        for path in paths {
            let got = g
                .dispatch(path, &w.x, &w.topk_idx)
                .map_err(|e| err(format!("{} dispatch: {e}", path.name())))?;
            for (r, (a, b)) in got.iter().zip(&want).enumerate() {
                if let Some(d) = a.diff(b) {
                    return Err(err(format!(
                        "{} dispatch, rank {r} differs from the oracle: {d}",
                        path.name()
                    )));
                }
            }
            st.tally.entry((mode, path.name())).or_default()[0] += 1;
            let got_c = g
                .combine(path, &ys, &w.topk_weights)
                .map_err(|e| err(format!("{} combine: {e}", path.name())))?;
            for (r, (a, b)) in got_c.iter().zip(&want_c).enumerate() {
                if let Some(d) = combine_diff(a, b, cfg.hidden) {
                    return Err(err(format!(
                        "{} combine, rank {r} differs from the oracle: {d}",
                        path.name()
                    )));
                }
            }
            st.tally.entry((mode, path.name())).or_default()[1] += 1;
        }
        st.rounds += 1;
        *st.routings.entry(round.plan.name).or_default() += 1;
    }
    *st.ranks.entry((case.gpus, cfg.num_ranks)).or_default() += 1;
    if values != Values::Normal {
        st.special += 1;
    }
    st.logfmt += (case.format == CombineFormat::LogFmt) as usize;
    Ok(())
}

fn report(st: &Stats, secs: f64, drawn: usize) {
    println!(
        "gpu_fuzz: {} of {drawn} configs ran ({} inputs), {} refused with Unsupported, {} failed; {secs:.1} s ({:.1} s creating groups)",
        st.configs, st.rounds, st.refused, st.failures, st.group_secs
    );
    println!(
        "  bitwise-equal comparisons per mode and path (dispatch / combine, all ranks of a call):"
    );
    for ((mode, path), [d, c]) in &st.tally {
        println!("    {mode:<16} {path:<11} {d:>6} / {c:>6}");
    }
    let ranks: Vec<String> = st
        .ranks
        .iter()
        .map(|((g, r), n)| format!("R={r}/{g}GPU:{n}"))
        .collect();
    println!("  configs passed per R and GPUs: {}", ranks.join(" "));
    println!("  inputs passed per routing: {:?}", st.routings);
    println!(
        "  configs passed with special values (inf, NaN, -0, subnormals, > 448) in x and y: {}",
        st.special
    );
    println!("  configs passed with a LogFMT combine: {}", st.logfmt);
}
