//! `ep-bench`: per-expert versus per-destination batched dispatch/combine, side by side, on the
//! same inputs and the same machine. Checks that both paths produce bitwise the oracle's outputs
//! before timing anything. See `ep-bench --help` and BENCHMARKS.md.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, ValueEnum};
use ep_benches::backend::{self, Backend, BackendChoice, BenchError, BenchSpec, MAX_ITERS};
use ep_benches::flags::{self, Flags};
use ep_benches::memory::{self, MemInfo};
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
    /// CUDA IPC to the ranks of this node, NCCL to the others (node: EP_NODE_ID, GROUP_RANK or
    /// the hostname).
    TwoTier,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum NcclSizesArg {
    /// Exchange the batch headers, read them on the host, send exactly the rows there are.
    Exact,
    /// Headers and a fixed capacity in one NCCL group: no host round trip (batched path).
    Capacity,
}

impl NcclSizesArg {
    fn sizes(self) -> ep_kernels::NcclSizes {
        match self {
            NcclSizesArg::Exact => ep_kernels::NcclSizes::Exact,
            NcclSizesArg::Capacity => ep_kernels::NcclSizes::Capacity,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TimingArg {
    /// A CUDA graph on one GPU, one launch per call on several.
    Auto,
    /// Replay the timed calls from a CUDA graph (one GPU only).
    Graph,
    /// Launch every timed call on the stream.
    Stream,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DispatchArg {
    Fp8,
    Bf16,
}

/// Timeouts above this many seconds (about 11.6 days) are taken as this, so every deadline
/// derived from one stays representable.
const MAX_TIMEOUT_SECS: f64 = 1e6;
/// The shortest timeout accepted (1 ms): below it a bound is no bound (1e-300 became 0 ns, and
/// every first wait then "timed out", blaming an innocent rank).
const MIN_TIMEOUT_SECS: f64 = 1e-3;

/// Per-expert vs per-destination batched MoE dispatch/combine (DeepEP low-latency mode), side
/// by side on the same inputs. The defaults are docs/contract.md's standard decode setting: 8 ranks,
/// E=256, T=128 tokens per rank, H=7168, K=8, FP8 dispatch, BF16 combine, random routing with 5%
/// masked slots.
///
/// Prints, per point: the setting, how both paths were verified against the oracle, one row per
/// path (median and p99 latencies, messages, signals, bytes) and, last, the speed-up of the
/// batched path over the per-expert one. `--per-rank` adds every rank's line in DeepEP's format.
///
/// Before generating anything ep-bench checks every config and the memory the run needs. A flag
/// that does not apply to the run (e.g. `--nccl-sizes` without `--transport nccl`, `--gpus` on the CPU
/// backend) is refused, never ignored.
///
/// Exit codes: 0 done; 1 a path or the backend failed (e.g. no usable GPU for `--backend gpu`
/// or `--nprocs`); 2 bad flags, a config out of range, or not enough memory; 3 outputs not
/// bitwise equal to the oracle's (nothing timed).
#[derive(Debug, Parser)]
#[command(name = "ep-bench", version, allow_negative_numbers = true)]
struct Cli {
    /// Where to run: auto picks the GPU backend when it is usable, the CPU backend otherwise.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// R: ranks in the group (at most 1024).
    #[arg(long, default_value_t = 8, value_parser = parse_count)]
    ranks: usize,
    /// E: experts in all (a multiple of --ranks, at most 65536).
    #[arg(long, default_value_t = 256, value_parser = parse_count)]
    experts: usize,
    /// Tokens on every rank.
    #[arg(long, default_value_t = 128, value_parser = parse_count)]
    tokens: usize,
    /// T (num_max_dispatch_tokens_per_rank, at most 65536); defaults to --tokens.
    #[arg(long, conflicts_with = "sweep_tokens", value_parser = parse_count)]
    max_tokens: Option<usize>,
    /// H: hidden size (at most 65536; a multiple of 128 with --dispatch fp8, of 512 with
    /// --ue8m0; any with --dispatch bf16).
    #[arg(long, default_value_t = 7168, value_parser = parse_count)]
    hidden: usize,
    /// K: experts per token (1..=16).
    #[arg(long, default_value_t = 8, value_parser = parse_count)]
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
    /// Timed iterations, 1..=100000 [default: 20 on the CPU backend, 200 on the GPU backend].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS as u64))]
    iters: Option<u64>,
    /// Untimed warm-up iterations, at most 100000 [default: 3 on the CPU backend, 20 on the GPU
    /// backend].
    #[arg(long, value_parser = parse_warmup)]
    warmup: Option<usize>,
    /// Seed of the inputs (tokens, routing, weights, expert outputs).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fraction of top-k slots that are -1 (masked).
    #[arg(long, default_value_t = 0.05, value_parser = parse_fraction)]
    masked: f64,
    /// CPU backend: staging workers per rank (batched path); 0 = one per core the ranks leave
    /// free (at least 1, at most 4). At most 256 (ep_reference::path::MAX_STAGING_WORKERS).
    #[arg(long, default_value_t = 0, value_parser = parse_workers)]
    workers: usize,
    /// Multi-process mode (GPU backend): start N processes, one rank each, torchrun style (CUDA
    /// IPC between them, or NCCL with --transport nccl). Under an external launcher (RANK and
    /// WORLD_SIZE set) ep-bench runs as that one rank by itself. R is then the number of
    /// processes, and --ranks is not used.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    nprocs: u64,
    /// GPU backend: how ranks reach each other (auto: NVLink, through CUDA IPC between
    /// processes; nccl: NCCL send/recv for every peer, both paths; one rank per GPU, so in one
    /// process --gpus must equal --ranks).
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    transport: TransportArg,
    /// Multi-process mode: emulate this many nodes on this machine (rank i on node i / (N /
    /// nodes), GPU i % --gpus; EP_NODE_ID and NCCL_HOSTID set per rank), with the two-tier
    /// transport (CUDA IPC inside a node, NCCL across) unless --transport nccl.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    nodes: u64,
    /// With --transport nccl: how the batched path sizes its NCCL messages (exact: a header
    /// round trip through the host, then exact sizes; capacity: header + T entries / T*min(K,L)
    /// rows in one group, no host round trip). The per-expert path always runs exact sizes.
    /// [default: the library's, ep_kernels::NcclSizes::default()]
    #[arg(long, value_enum)]
    nccl_sizes: Option<NcclSizesArg>,
    /// GPU backend: GPUs to spread the ranks over (1: all ranks as virtual ranks on one GPU).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    gpus: u64,
    /// CPU backend and multi-process mode: bound on every wait of one call, in seconds: at
    /// least 0.001 (1 ms), finite; values above 1e6, about 11.6 days, are taken as 1e6.
    #[arg(long, default_value_t = 30.0, value_parser = parse_timeout, allow_hyphen_values = true)]
    timeout_secs: f64,
    /// Run one point per value of T (tokens per rank = T), e.g. 1,16,128,512.
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = parse_count)]
    sweep_tokens: Vec<usize>,
    /// Also print every rank's line in DeepEP's format (`per-expert [rank 0] Dispatch
    /// bandwidth: ... | Combine bandwidth: ...`), before the summary.
    #[arg(long)]
    per_rank: bool,
    /// Print one JSON document instead of text.
    #[arg(long)]
    json: bool,
    /// GPU backend: after each point, the in-kernel phase profile (`%globaltimer` stamps per
    /// block and phase, one call of each kernel) and the empty kernel's launch time: where
    /// inside a call the time goes. A debugging figure, not a latency.
    #[arg(long)]
    profile: bool,
    /// GPU backend: how the timed calls are issued (graph: replayed from one CUDA graph, one
    /// GPU only; stream: launched one by one, what an eager caller sees).
    #[arg(long, value_enum, default_value_t = TimingArg::Auto)]
    timing: TimingArg,
    /// Multi-process mode: rounds of random inputs every path is checked on, bit for bit against
    /// the oracle, before the timed calls (the second round gives rank 1 half the tokens).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    rounds: u64,
    /// Multi-process mode, fault test hook (scripts/gpu/faults.sh): rank R exits (code 3) before
    /// round 2's first dispatch; the others must fail with an error naming it.
    #[arg(long, hide = true, value_parser = clap::value_parser!(u64).range(0..=1023))]
    die_rank: Option<u64>,
    /// Multi-process mode, fault test hook: rank R stays alive but silent (three timeouts)
    /// before round 2's first dispatch; the others' bounded waits must name it.
    #[arg(long, hide = true, value_parser = clap::value_parser!(u64).range(0..=1023))]
    stall_rank: Option<u64>,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number; give a fraction in [0, 1], e.g. 0.05"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is not a fraction in [0, 1] (the share of top-k slots that are -1, e.g. 0.05)"
        ))
    }
}

/// A bound on a wait, in seconds: finite, at least `MIN_TIMEOUT_SECS`; above
/// `MAX_TIMEOUT_SECS` it is taken as that.
fn parse_timeout(s: &str) -> Result<f64, String> {
    let range = format!("give {MIN_TIMEOUT_SECS} (1 ms) or more, e.g. 30");
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds: {range}"))?;
    if !v.is_finite() {
        Err(format!("{s} is not a finite number of seconds: {range}"))
    } else if v <= 0.0 {
        Err(format!("{s} is not a positive number of seconds: {range}"))
    } else if v < MIN_TIMEOUT_SECS {
        Err(format!(
            "{s} seconds is below the shortest bound on a wait: {range}"
        ))
    } else {
        Ok(v.min(MAX_TIMEOUT_SECS))
    }
}

/// A count: a whole number, 0 or more (the config checks then say which values are in range).
fn parse_count(s: &str) -> Result<usize, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("{s} is negative; give a whole number, 0 or more"));
    }
    s.parse()
        .map_err(|_| format!("{s:?} is not a whole number (0 or more)"))
}

/// A count of at most `max` (`what` says what is counted, for the message). A number of digits
/// too large for a `usize` is simply above `max`.
fn parse_at_most(s: &str, max: usize, what: &str) -> Result<usize, String> {
    let too_many = || format!("{s} {what}: at most {max}");
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return match s.parse::<usize>() {
            Ok(n) if n <= max => Ok(n),
            _ => Err(too_many()),
        };
    }
    let n = parse_count(s)?;
    if n > max {
        return Err(too_many());
    }
    Ok(n)
}

/// Staging workers per rank: at most `MAX_STAGING_WORKERS` (a thread each, per rank and call).
fn parse_workers(s: &str) -> Result<usize, String> {
    parse_at_most(
        s,
        ep_reference::path::MAX_STAGING_WORKERS,
        "staging workers per rank (0 picks one per free core)",
    )
}

/// Warm-up iterations: at most `MAX_WARMUP`.
fn parse_warmup(s: &str) -> Result<usize, String> {
    parse_at_most(s, ep_benches::backend::MAX_WARMUP, "warm-up iterations")
}

impl Cli {
    /// The bound on every wait (clamped to `MAX_TIMEOUT_SECS` by the parser).
    fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_secs.min(MAX_TIMEOUT_SECS))
    }

    /// The flags that set R and T.
    fn flags(&self, multiproc: bool) -> Flags {
        Flags {
            ranks: if multiproc { "--nprocs" } else { "--ranks" },
            tokens: if !self.sweep_tokens.is_empty() {
                "--sweep-tokens"
            } else if self.max_tokens.is_some() {
                "--max-tokens"
            } else {
                "--tokens"
            },
        }
    }

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
    ep_benches::multiproc::rank(&ep_group::mp::MpOptions {
        experts: cli.experts,
        tokens: cli.tokens,
        hidden: cli.hidden,
        top_k: cli.top_k,
        mode,
        transport: match cli.transport {
            TransportArg::Auto => ep_kernels::Transport::Auto,
            TransportArg::Nccl => ep_kernels::Transport::Nccl,
            TransportArg::TwoTier => ep_kernels::Transport::TwoTier,
        },
        nccl_sizes: cli.nccl_sizes.map(|s| s.sizes()).unwrap_or_default(),
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

/// The config of multi-process mode, R = `world` (set by `ranks_flag`), checked before any
/// process starts.
fn multiproc_config(
    cli: &Cli,
    mode: Mode,
    world: usize,
    ranks_flag: &'static str,
) -> Result<Config, String> {
    Config::new(world, cli.experts, cli.tokens, cli.hidden, cli.top_k, mode).map_err(|e| {
        let c = Config {
            num_ranks: world,
            num_experts: cli.experts,
            max_tokens_per_rank: cli.tokens,
            hidden: cli.hidden,
            top_k: cli.top_k,
            mode,
        };
        let f = Flags {
            ranks: ranks_flag,
            ..cli.flags(true)
        };
        flags::explain(&e, &c, &f)
    })
}

/// The flags given on the command line (not defaulted).
struct Given<'a>(&'a ArgMatches);

impl Given<'_> {
    fn has(&self, id: &str) -> bool {
        self.0.value_source(id) == Some(ValueSource::CommandLine)
    }

    /// The first of `ids` given, as its flag.
    fn first(&self, ids: &[&'static str]) -> Option<String> {
        ids.iter()
            .find(|id| self.has(id))
            .map(|id| format!("--{}", id.replace('_', "-")))
    }
}

/// Flags that multi-process mode (one rank per process, GPU backend) does not use.
fn refuse_in_multiproc(cli: &Cli, given: &Given<'_>, launched: bool) -> Result<(), String> {
    if let Some(f) = given.first(&[
        "ranks",
        "max_tokens",
        "sweep_tokens",
        "warmup",
        "workers",
        "json",
        "per_rank",
        "profile",
        "timing",
    ]) {
        let why = if f == "--ranks" {
            "R is the number of processes"
        } else {
            "it applies to single-process runs only"
        };
        return Err(format!(
            "{f} does not apply in multi-process mode ({why}); drop it, or drop --nprocs"
        ));
    }
    if given.has("backend") && matches!(cli.backend, BackendArg::Cpu) {
        return Err(
            "--backend cpu does not apply in multi-process mode, which runs the GPU backend; drop --nprocs for the CPU backend"
                .into(),
        );
    }
    if launched && given.has("nodes") {
        return Err(
            "--nodes does not apply under an external launcher: set EP_NODE_ID (or torchrun's GROUP_RANK) per node and --transport two-tier"
                .into(),
        );
    }
    if launched && given.has("nprocs") {
        return Err(
            "--nprocs does not apply under an external launcher (RANK and WORLD_SIZE are set): the launcher started the processes"
                .into(),
        );
    }
    Ok(())
}

/// `--nccl-sizes` needs the NCCL transport.
fn refuse_nccl_sizes(cli: &Cli, given: &Given<'_>) -> Result<(), String> {
    if given.has("nccl_sizes")
        && !matches!(cli.transport, TransportArg::Nccl | TransportArg::TwoTier)
    {
        return Err(
            "--nccl-sizes applies where NCCL carries traffic only: add --transport nccl (or two-tier with --nodes), or drop --nccl-sizes"
                .into(),
        );
    }
    Ok(())
}

/// Flags that a single-process run does not use.
fn refuse_in_single(given: &Given<'_>, json: bool) -> Result<(), String> {
    if let Some(f) = given.first(&["rounds", "die_rank", "stall_rank"]) {
        return Err(format!(
            "{f} applies with --nprocs N (or under a launcher): it checks and tests the processes of a multi-process run; drop {f}, or add --nprocs"
        ));
    }
    if given.has("nodes") {
        return Err(
            "--nodes applies with --nprocs N (N > 1): it emulates nodes for the processes ep-bench starts, and this run is one process: drop --nodes, or add --nprocs"
                .into(),
        );
    }
    if let Some(f) = given.first(&["per_rank"]).filter(|_| json) {
        return Err(format!(
            "{f} applies to the text output; --json always has every rank's figures"
        ));
    }
    if let Some(f) = given.first(&["profile"]).filter(|_| json) {
        return Err(format!(
            "{f} prints text lines, which --json cannot carry: drop one of them"
        ));
    }
    Ok(())
}

/// Flags that `backend` does not use.
fn refuse_on_backend(given: &Given<'_>, backend: &Backend) -> Result<(), String> {
    match backend {
        Backend::Cpu => {
            if let Some(f) = given.first(&["gpus", "profile", "timing", "transport", "nccl_sizes"])
            {
                return Err(format!(
                    "{f} applies to the GPU backend, and this run uses the CPU backend: drop {f}"
                ));
            }
        }
        Backend::Gpu(_) => {
            if let Some(f) = given.first(&["workers", "timeout_secs"]) {
                return Err(format!(
                    "{f} applies to the CPU backend (and {}), and this run uses the GPU backend in one process: drop {f}, or add --backend cpu",
                    if f == "--timeout-secs" { "to multi-process mode" } else { "not to the GPU kernels" }
                ));
            }
        }
    }
    Ok(())
}

/// Refuses a point that would not fit in this machine's memory, before anything is generated.
fn check_memory(cli: &Cli, specs: &[BenchSpec], backend: &Backend) -> Result<(), String> {
    let Some(mem) = MemInfo::read() else {
        return Ok(());
    };
    for s in specs {
        let est = memory::estimate(&s.cfg, s.tokens, backend);
        if let Err(short) = memory::check(&est, &mem) {
            let f = cli.flags(false);
            let c = &s.cfg;
            let point = if cli.sweep_tokens.is_empty() {
                String::new()
            } else {
                format!(" (point T={})", c.max_tokens_per_rank)
            };
            let total = match short {
                memory::Shortfall::Buffer { .. } => format!(
                    "; in all it needs about {}, and {} is available",
                    memory::gb(est.touched),
                    memory::gb(mem.available)
                ),
                _ => String::new(),
            };
            let biggest = est
                .parts
                .iter()
                .max_by_key(|p| p.1)
                .map(|p| format!(" (the largest part: {}, {})", p.0, memory::gb(p.1)))
                .unwrap_or_default();
            return Err(format!(
                "this run{point} {short}{total}{biggest}. Lower {} (now {}), --hidden ({}), --experts ({}), --top-k ({}) or --ranks ({}){}",
                f.tokens,
                c.max_tokens_per_rank,
                c.hidden,
                c.num_experts,
                c.top_k,
                c.num_ranks,
                if c.mode == Mode::Bf16 { ", or use --dispatch fp8" } else { "" }
            ));
        }
    }
    Ok(())
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
        let auto_given = given.has("transport") && cli.transport == TransportArg::Auto;
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
    if cli.timing == TimingArg::Graph && cli.transport == TransportArg::Nccl {
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
            graph: match cli.timing {
                TimingArg::Auto => None,
                TimingArg::Graph => Some(true),
                TimingArg::Stream => Some(false),
            },
            nccl: (cli.transport == TransportArg::Nccl)
                .then(|| cli.nccl_sizes.map(|s| s.sizes()).unwrap_or_default()),
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
                    let prof = ep_benches::gpu::phase_profile(spec);
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
