//! `ep-bench`: per-expert versus per-destination batched dispatch/combine, side by side, on the
//! same inputs and the same machine. Checks that both paths produce bitwise the oracle's outputs
//! before timing anything. See `ep-bench --help` and BENCHMARKS.md.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use ep_benches::backend::{self, Backend, BackendChoice, BenchError, BenchSpec};
use ep_benches::report::{self, PointResult};
use ep_reference::{Config, CpuOptions, Mode};
use serde::Serialize;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    /// The GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TransportArg {
    Auto,
    Nccl,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DispatchArg {
    Fp8,
    Bf16,
}

/// Per-expert vs per-destination batched MoE dispatch/combine (DeepEP low-latency mode), side
/// by side on the same inputs. The defaults are DESIGN.md's standard decode setting: 8 ranks,
/// E=256, T=128 tokens per rank, H=7168, K=8, FP8 dispatch, BF16 combine, random routing with 5%
/// masked slots.
#[derive(Debug, Parser)]
#[command(name = "ep-bench", version)]
struct Cli {
    /// Where to run: auto picks the GPU backend when it is usable, the CPU backend otherwise.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// R: ranks in the group.
    #[arg(long, default_value_t = 8)]
    ranks: usize,
    /// E: experts in all (a multiple of --ranks).
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Tokens on every rank.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// T (num_max_dispatch_tokens_per_rank); defaults to --tokens.
    #[arg(long, conflicts_with = "sweep_tokens")]
    max_tokens: Option<usize>,
    /// H: hidden size.
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// K: experts per token (1..=16).
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Dispatch payload format (combine is always BF16).
    #[arg(long, value_enum, default_value_t = DispatchArg::Fp8)]
    dispatch: DispatchArg,
    /// FP8: round scales up to powers of two.
    #[arg(long)]
    round_scale: bool,
    /// FP8: pack scales as UE8M0 exponent bytes (requires --round-scale).
    #[arg(long)]
    ue8m0: bool,
    /// Timed iterations [default: 20 on the CPU backend, 200 on the GPU backend].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    iters: Option<u64>,
    /// Untimed warm-up iterations [default: 3 on the CPU backend, 20 on the GPU backend].
    #[arg(long)]
    warmup: Option<usize>,
    /// Seed of the inputs (tokens, routing, weights, expert outputs).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fraction of top-k slots that are -1 (masked).
    #[arg(long, default_value_t = 0.05, value_parser = parse_fraction)]
    masked: f64,
    /// CPU backend: staging workers per rank (batched path); 0 = one per core the ranks leave
    /// free (at least 1, at most 4).
    #[arg(long, default_value_t = 0)]
    workers: u64,
    /// Multi-process mode (GPU backend): start N processes, one rank each, torchrun style (CUDA
    /// IPC between them, or NCCL with --transport nccl). Under an external launcher (RANK and
    /// WORLD_SIZE set) ep-bench runs as that one rank by itself. R is then the number of
    /// processes, and --ranks is not used.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    nprocs: u64,
    /// Multi-process mode: how ranks reach each other (auto: NVLink through CUDA IPC; nccl: NCCL
    /// send/recv everywhere, batched path only).
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    transport: TransportArg,
    /// GPU backend: GPUs to spread the ranks over (1: all ranks as virtual ranks on one GPU).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    gpus: u64,
    /// CPU backend: bound on every wait of one call, in seconds.
    #[arg(long, default_value_t = 30.0, value_parser = parse_positive)]
    timeout_secs: f64,
    /// Run one point per value of T (tokens per rank = T), e.g. 1,16,128,512.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    sweep_tokens: Vec<usize>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a fraction in [0, 1]"))
    }
}

fn parse_positive(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{v} is not a positive number of seconds"))
    }
}

impl Cli {
    fn mode(&self) -> Result<Mode, String> {
        match self.dispatch {
            DispatchArg::Bf16 if self.round_scale || self.ue8m0 => {
                Err("--round-scale and --ue8m0 apply to --dispatch fp8 only".to_string())
            }
            DispatchArg::Bf16 => Ok(Mode::Bf16),
            DispatchArg::Fp8 => Ok(Mode::Fp8 {
                round_scale: self.round_scale,
                ue8m0: self.ue8m0,
            }),
        }
    }

    /// (tokens per rank, T) of every point.
    fn points(&self) -> Vec<(usize, usize)> {
        if self.sweep_tokens.is_empty() {
            vec![(self.tokens, self.max_tokens.unwrap_or(self.tokens))]
        } else {
            self.sweep_tokens.iter().map(|&t| (t, t)).collect()
        }
    }
}

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
    ep_benches::multiproc::rank(&ep_kernels::mp::MpOptions {
        experts: cli.experts,
        tokens: cli.tokens,
        hidden: cli.hidden,
        top_k: cli.top_k,
        mode,
        transport: match cli.transport {
            TransportArg::Auto => ep_kernels::Transport::Auto,
            TransportArg::Nccl => ep_kernels::Transport::Nccl,
        },
        gpus: cli.gpus as usize,
        rounds: 1,
        iters: cli.iters.map_or(200, |i| i as usize),
        seed: cli.seed,
        masked: cli.masked,
        timeout: Duration::from_secs_f64(cli.timeout_secs),
        die_rank: None,
        stall_rank: None,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mode = match cli.mode() {
        Ok(m) => m,
        Err(e) => return fail(e, 2),
    };
    if ep_launch::is_launched_externally() {
        return multiproc(&cli, mode);
    }
    if cli.nprocs > 1 {
        let args: Vec<String> = std::env::args().skip(1).collect();
        return ep_benches::multiproc::launch(
            cli.nprocs as usize,
            ep_benches::multiproc::child_args(&args),
            Duration::from_secs_f64(cli.timeout_secs * 4.0 + 120.0),
        );
    }
    // Every config is checked before anything runs.
    let mut specs = Vec::new();
    for (tokens, t) in cli.points() {
        let cfg = match Config::new(cli.ranks, cli.experts, t, cli.hidden, cli.top_k, mode) {
            Ok(c) => c,
            Err(e) => return fail(e, 2),
        };
        if tokens > t {
            return fail(
                ep_reference::Error::TooManyTokens {
                    rank: 0,
                    tokens,
                    max: t,
                },
                2,
            );
        }
        specs.push(BenchSpec {
            cfg,
            tokens,
            masked: cli.masked,
            seed: cli.seed,
            iters: 0,
            warmup: 0,
            cpu: CpuOptions {
                timeout: Duration::from_secs_f64(cli.timeout_secs),
                staging_workers: cli.workers as usize,
                memory_limit: None,
            },
            gpus: cli.gpus as usize,
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
                    print_point(&p);
                }
                results.push(Ok(p));
            }
            Err(e @ BenchError::Mismatch(_)) => return fail(&e, e.exit_code()),
            Err(e) => {
                if n == 1 {
                    return fail(&e, e.exit_code());
                }
                eprintln!("ep-bench: {label} not run: {e}");
                exit = exit.max(e.exit_code());
                results.push(Err(e.to_string()));
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

fn print_point(p: &PointResult) {
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
    print!("{}", report::deepep_lines(p));
    print!("{}", report::table(p));
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_are_the_standard_decode_setting() {
        let c = Cli::try_parse_from(["ep-bench"]).unwrap();
        assert_eq!(
            (c.ranks, c.experts, c.tokens, c.hidden, c.top_k),
            (8, 256, 128, 7168, 8)
        );
        assert_eq!(c.mode().unwrap(), Mode::FP8);
        assert_eq!(c.points(), vec![(128, 128)]);
        assert_eq!(c.masked, 0.05);
    }

    #[test]
    fn sweep_and_modes_parse() {
        let c = Cli::try_parse_from(["ep-bench", "--sweep-tokens", "1,16,128,512"]).unwrap();
        assert_eq!(c.points(), vec![(1, 1), (16, 16), (128, 128), (512, 512)]);
        let c = Cli::try_parse_from(["ep-bench", "--round-scale", "--ue8m0"]).unwrap();
        assert_eq!(c.mode().unwrap(), Mode::FP8_UE8M0);
        let c = Cli::try_parse_from(["ep-bench", "--dispatch", "bf16", "--ue8m0"]).unwrap();
        assert!(c.mode().is_err());
        assert!(Cli::try_parse_from(["ep-bench", "--masked", "1.5"]).is_err());
        assert!(Cli::try_parse_from(["ep-bench", "--iters", "0"]).is_err());
        assert!(Cli::try_parse_from(["ep-bench", "--dispatch", "fp4"]).is_err());
        let c = Cli::try_parse_from(["ep-bench", "--tokens", "3", "--max-tokens", "8"]).unwrap();
        assert_eq!(c.points(), vec![(3, 8)]);
    }
}
