//! `ep-bench`: per-expert versus per-destination batched dispatch/combine, side by side, on the
//! same inputs and the same machine. Checks that both paths produce bitwise the oracle's outputs
//! before timing anything. See `ep-bench --help` and BENCHMARKS.md.

mod checks;
mod cli;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use crate::checks::{
    check_memory, multiproc_config, refuse_in_multiproc, refuse_in_single, refuse_logfmt_over_nccl,
    refuse_nccl_sizes, refuse_on_backend, refuse_scales_layout,
};
use crate::cli::{BackendArg, Cli, Given, TimingArg, MAX_TIMEOUT_SECS};
use clap::{CommandFactory, FromArgMatches};
use ep_benches::backend::{self, Backend, BackendChoice};
use ep_benches::flags::{self};
use ep_benches::report::{self, PointResult};
use ep_benches::spec::{BenchError, BenchSpec};
use ep_kernels::Transport;
use ep_reference::{Config, CpuOptions, Mode};
use serde::Serialize;

#[derive(Serialize)]
struct JsonPoint<'a> {
    tokens_per_rank: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a PointResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize)]
struct JsonDoc<'a> {
    tool: &'static str,
    command: Vec<String>,
    backend: &'static str,
    device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    points: Vec<JsonPoint<'a>>,
}

/// Status lines on stderr: rewritten in place on a terminal, one per line otherwise.
struct Progress {
    tty: bool,
}

impl Progress {
    fn show(&self, msg: &str) {
        if self.tty {
            eprint!("\r{msg:<100.100}");
        } else {
            eprintln!("{msg}");
        }
    }

    fn done(&self) {
        if self.tty {
            eprint!("\r{:<100}\r", "");
        }
    }
}

fn fail(msg: impl std::fmt::Display, code: i32) -> ExitCode {
    eprintln!("ep-bench: error: {msg}");
    ExitCode::from(code as u8)
}

/// One rank of a multi-process run (see `ep_benches::multiproc`).
fn multiproc(cli: &Cli, mode: Mode) -> ExitCode {
    ep_benches::multiproc::rank(&ep_group::mp::MpOptions {
        experts: cli.experts,
        tokens: cli.tokens,
        hidden: cli.hidden,
        top_k: cli.top_k,
        mode,
        transport: cli.transport,
        nccl_sizes: cli.nccl_sizes.unwrap_or_default(),
        gpus: cli.gpus as usize,
        rounds: cli.rounds as usize,
        iters: cli.iters.map_or(200, |i| i as usize),
        seed: cli.seed,
        masked: cli.masked,
        timeout: cli.timeout(),
        die_rank: cli.die_rank.map(|r| r as usize),
        stall_rank: cli.stall_rank.map(|r| r as usize),
    })
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let given = Given(&matches);
    let mode = match cli.mode() {
        Ok(m) => m,
        Err(e) => return fail(e, 2),
    };
    if let Err(e) = refuse_nccl_sizes(&cli, &given) {
        return fail(e, 2);
    }
    if let Err(e) = refuse_logfmt_over_nccl(&cli, &given) {
        return fail(e, 2);
    }
    if let Err(e) = refuse_scales_layout(mode, &given) {
        return fail(e, 2);
    }
    let launched = ep_launch::is_launched_externally();
    if launched || cli.nprocs > 1 {
        if let Err(e) = refuse_in_multiproc(&cli, &given, launched) {
            return fail(e, 2);
        }
    }
    if launched {
        let world = std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|w| w.parse().ok());
        if let Some(Err(e)) = world.map(|w| multiproc_config(&cli, mode, w, "WORLD_SIZE")) {
            return fail(e, 2);
        }
        return multiproc(&cli, mode);
    }
    if cli.nprocs > 1 {
        let n = cli.nprocs as usize;
        if let Err(e) = multiproc_config(&cli, mode, n, "--nprocs") {
            return fail(e, 2);
        }
        let auto_given = given.has("transport") && cli.transport == Transport::Auto;
        if let Err(e) = ep_benches::multiproc::check_nodes(n, cli.nodes as usize, auto_given) {
            return fail(e, 2);
        }
        // Say it before starting N processes that would each find no GPU.
        if let Err(why) = ep_benches::gpu::probe() {
            return fail(
                format!(
                    "--nprocs {n} starts one GPU process per rank, and there is no usable GPU here ({why}); without --nprocs ep-bench runs every rank in one process (on the CPU backend here)"
                ),
                1,
            );
        }
        let args: Vec<String> = std::env::args().skip(1).collect();
        let launch_secs = cli.timeout_secs.min(MAX_TIMEOUT_SECS) * 4.0 + 120.0;
        return ep_benches::multiproc::launch_nodes(
            n,
            cli.nodes as usize,
            ep_benches::multiproc::child_args(&args),
            Duration::from_secs_f64(launch_secs),
        );
    }
    if let Err(e) = refuse_in_single(&given, cli.json) {
        return fail(e, 2);
    }
    if cli.timing == TimingArg::Graph && cli.transport == Transport::Nccl {
        return fail(
            "--timing graph does not apply with --transport nccl (exact sizes read the headers on the host mid-call): drop --timing graph",
            2,
        );
    }
    if cli.timing == TimingArg::Graph && cli.gpus > 1 {
        return fail(
            format!(
                "--timing graph replays one GPU's CUDA graph, and --gpus {} spreads the ranks over several: drop --timing graph, or use --gpus 1",
                cli.gpus
            ),
            2,
        );
    }
    // Every config is checked before anything runs.
    let mut specs = Vec::new();
    for (tokens, t) in cli.points() {
        let raw = Config {
            num_ranks: cli.ranks,
            num_experts: cli.experts,
            max_tokens_per_rank: t,
            hidden: cli.hidden,
            top_k: cli.top_k,
            mode,
        };
        let cfg = match Config::new(cli.ranks, cli.experts, t, cli.hidden, cli.top_k, mode) {
            Ok(c) => c,
            Err(e) => return fail(flags::explain(&e, &raw, &cli.flags(false)), 2),
        };
        if tokens > t {
            let e = ep_reference::Error::TooManyTokens {
                rank: 0,
                tokens,
                max: t,
            };
            return fail(flags::explain(&e, &raw, &cli.flags(false)), 2);
        }
        specs.push(BenchSpec {
            cfg,
            tokens,
            masked: cli.masked,
            seed: cli.seed,
            iters: 0,
            warmup: 0,
            cpu: CpuOptions {
                timeout: cli.timeout(),
                staging_workers: cli.workers,
                memory_limit: None,
                enable_shrink: false,
            },
            gpus: cli.gpus as usize,
            combine: if cli.logfmt {
                ep_reference::CombineFormat::LogFmt
            } else {
                ep_reference::CombineFormat::Bf16
            },
            graph: match cli.timing {
                TimingArg::Auto => None,
                TimingArg::Graph => Some(true),
                TimingArg::Stream => Some(false),
            },
            nccl: (cli.transport == Transport::Nccl).then(|| cli.nccl_sizes.unwrap_or_default()),
            scales_column_major: cli.scales_column_major,
        });
    }
    let choice = match cli.backend {
        BackendArg::Auto => BackendChoice::Auto,
        BackendArg::Cpu => BackendChoice::Cpu,
        BackendArg::Gpu => BackendChoice::Gpu,
    };
    let (backend, note) = match backend::choose(choice) {
        Ok(b) => b,
        Err(e) => return fail(&e, e.exit_code()),
    };
    if let Some(n) = &note {
        eprintln!("ep-bench: {n}");
    }
    if let Err(e) = refuse_on_backend(&given, &backend) {
        return fail(e, 2);
    }
    if let Err(e) = check_memory(&cli, &specs, &backend) {
        return fail(e, 2);
    }
    let (def_iters, def_warmup) = backend.default_iters();
    let iters = cli.iters.map_or(def_iters, |i| i as usize);
    let warmup = cli.warmup.unwrap_or(def_warmup);
    for s in &mut specs {
        s.iters = iters;
        s.warmup = warmup;
    }
    let device = match &backend {
        Backend::Cpu => ep_benches::cpu::device(),
        Backend::Gpu(d) => d.clone(),
    };

    let progress = Progress {
        tty: std::io::stderr().is_terminal(),
    };
    let n = specs.len();
    let mut results: Vec<Result<PointResult, String>> = Vec::new();
    let mut exit = 0;
    for (i, spec) in specs.iter().enumerate() {
        let label = if n > 1 {
            format!("[point {}/{n} T={}]", i + 1, spec.cfg.max_tokens_per_rank)
        } else {
            format!("[T={}]", spec.cfg.max_tokens_per_rank)
        };
        let res = backend::run_point(&backend, spec, &|m| progress.show(&format!("{label} {m}")));
        progress.done();
        match res {
            Ok(p) => {
                if !cli.json {
                    print_point(&p, cli.per_rank);
                }
                if cli.profile {
                    progress.show(&format!("{label} phase profile"));
                    let prof = ep_benches::gpu::phase_profile(spec, cli.profile_blocks);
                    progress.done();
                    match prof {
                        Ok(lines) => println!("{lines}"),
                        Err(e) => {
                            eprintln!("ep-bench: {label} profile not run: {e}");
                            exit = exit.max(e.exit_code());
                        }
                    }
                }
                results.push(Ok(p));
            }
            Err(e @ BenchError::Mismatch(_)) => return fail(&e, e.exit_code()),
            Err(e) => {
                let code = e.exit_code();
                let msg = match &e {
                    BenchError::Config(c) => flags::explain(c, &spec.cfg, &cli.flags(false)),
                    other => other.to_string(),
                };
                if n == 1 {
                    return fail(msg, code);
                }
                eprintln!("ep-bench: {label} not run: {msg}");
                exit = exit.max(code);
                results.push(Err(msg));
            }
        }
    }
    let tokens: Vec<usize> = specs.iter().map(|s| s.tokens).collect();
    if cli.json {
        let doc = JsonDoc {
            tool: "ep-bench",
            command: std::env::args().collect(),
            backend: backend.name(),
            device,
            note,
            points: tokens
                .iter()
                .zip(&results)
                .map(|(&t, r)| JsonPoint {
                    tokens_per_rank: t,
                    result: r.as_ref().ok(),
                    error: r.as_ref().err().cloned(),
                })
                .collect(),
        };
        match serde_json::to_string_pretty(&doc) {
            Ok(s) => println!("{s}"),
            Err(e) => return fail(e, 1),
        }
    } else if n > 1 {
        println!("== sweep over tokens per rank (medians over every rank's calls) ==");
        print!("{}", report::sweep_table(&results, &tokens));
    }
    ExitCode::from(exit as u8)
}

fn print_point(p: &PointResult, per_rank: bool) {
    let c = &p.config;
    println!(
        "== ep-bench: {} backend ({}) | R={} E={} T={} H={} K={} | dispatch {}, combine {} | {} tokens/rank, random routing, {:.0}% masked slots, seed {} | {} selections | {} timed + {} warm-up calls per path ==",
        p.backend, p.device, c.num_ranks, c.num_experts, c.max_tokens_per_rank, c.hidden, c.top_k,
        c.dispatch, c.combine, p.tokens_per_rank, p.masked * 100.0, p.seed, p.selections,
        p.iters, p.warmup
    );
    if let Some(l) = &p.load_average {
        println!("host load average at start (1/5/15 min): {l}");
    }
    println!("verified before timing: {}", p.verified);
    if per_rank {
        print!("{}", report::deepep_lines(p));
    } else {
        println!("(every rank's line in DeepEP's format: --per-rank)");
        // Per path, not per rank: the CUPTI kernel time and the receive-hook split (GPU).
        print!("{}", report::kernel_time_lines(p));
        print!("{}", report::hook_split_lines(p));
    }
    // The summary last, ending with the speed-up: what a user looks for.
    print!("{}", report::table(p));
    println!();
}
