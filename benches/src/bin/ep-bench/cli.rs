//! ep-bench's command line: the flags, their parsers and bounds, and which were given.

use std::time::Duration;

use std::str::FromStr;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::parser::ValueSource;
use clap::{ArgMatches, Parser, ValueEnum};
use ep_benches::flags::Flags;
use ep_benches::spec::{MAX_ITERS, MAX_WARMUP};
use ep_kernels::{NcclSizes, Transport};
use ep_reference::Mode;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum BackendArg {
    /// The GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

/// The value parser of a flag that takes one of the library's choice enums (`--transport`,
/// `--nccl-sizes`): clap offers the enum's own names (its `ALL` and `name()`) and the enum's
/// `FromStr` turns the one given into the value, so a flag spells every value as the library,
/// its Python API and the reports do. ep-bench's own choices (`--backend`, `--timing`,
/// `--dispatch`) are `ValueEnum`s of this file.
fn named<T>(all: &'static [T], name: fn(T) -> &'static str) -> impl TypedValueParser<Value = T>
where
    T: Copy + FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Display,
{
    PossibleValuesParser::new(all.iter().map(move |&v| name(v))).map(|s| {
        s.parse::<T>()
            .unwrap_or_else(|e| unreachable!("a possible value parses: {e}"))
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum TimingArg {
    /// A CUDA graph on one GPU, one launch per call on several.
    Auto,
    /// Replay the timed calls from a CUDA graph (one GPU only).
    Graph,
    /// Launch every timed call on the stream.
    Stream,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum DispatchArg {
    Fp8,
    Bf16,
}

/// Timeouts above this many seconds (about 11.6 days) are taken as this, so every deadline
/// derived from one stays representable.
pub(crate) const MAX_TIMEOUT_SECS: f64 = 1e6;
/// The shortest timeout accepted (1 ms): below it a bound is no bound (1e-300 became 0 ns, and
/// every first wait then "timed out", blaming an innocent rank).
pub(crate) const MIN_TIMEOUT_SECS: f64 = 1e-3;

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
pub(crate) struct Cli {
    /// Where to run: auto picks the GPU backend when it is usable, the CPU backend otherwise.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub(crate) backend: BackendArg,
    /// R: ranks in the group (at most 1024).
    #[arg(long, default_value_t = 8, value_parser = parse_count)]
    pub(crate) ranks: usize,
    /// E: experts in all (a multiple of --ranks, at most 65536).
    #[arg(long, default_value_t = 256, value_parser = parse_count)]
    pub(crate) experts: usize,
    /// Tokens on every rank.
    #[arg(long, default_value_t = 128, value_parser = parse_count)]
    pub(crate) tokens: usize,
    /// T (num_max_dispatch_tokens_per_rank, at most 65536); defaults to --tokens.
    #[arg(long, conflicts_with = "sweep_tokens", value_parser = parse_count)]
    pub(crate) max_tokens: Option<usize>,
    /// H: hidden size (at most 65536; a multiple of 128 with --dispatch fp8, of 512 with
    /// --ue8m0; any with --dispatch bf16).
    #[arg(long, default_value_t = 7168, value_parser = parse_count)]
    pub(crate) hidden: usize,
    /// K: experts per token (1..=16).
    #[arg(long, default_value_t = 8, value_parser = parse_count)]
    pub(crate) top_k: usize,
    /// Dispatch payload format (combine is BF16, or LogFMT-10 with --logfmt).
    #[arg(long, value_enum, default_value_t = DispatchArg::Fp8)]
    pub(crate) dispatch: DispatchArg,
    /// Combine in LogFMT-10 (DeepEP's `use_logfmt`; needs --hidden a multiple of 128): the
    /// expert outputs are scaled into [-0.5, 0.5] so that their groups pack, and the combine's
    /// wire bytes are the encoded rows'. Single process; not with --transport nccl (NCCL
    /// carries bf16 rows only).
    #[arg(long)]
    pub(crate) logfmt: bool,
    /// FP8: round scales up to powers of two.
    #[arg(long)]
    pub(crate) round_scale: bool,
    /// GPU backend, FP8, one process: recv_scales in DeepEP's column-major layout (word strides
    /// R*T*G, 1, R*T), as the Python Buffer and DeepGEMM take them; the default is row-major.
    #[arg(long)]
    pub(crate) scales_column_major: bool,
    /// FP8: pack scales as UE8M0 exponent bytes (requires --round-scale).
    #[arg(long)]
    pub(crate) ue8m0: bool,
    /// Timed iterations, 1..=100000 [default: 20 on the CPU backend, 200 on the GPU backend].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS as u64))]
    pub(crate) iters: Option<u64>,
    /// Untimed warm-up iterations, at most 100000 [default: 3 on the CPU backend, 20 on the GPU
    /// backend].
    #[arg(long, value_parser = parse_warmup)]
    pub(crate) warmup: Option<usize>,
    /// Seed of the inputs (tokens, routing, weights, expert outputs).
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Fraction of top-k slots that are -1 (masked).
    #[arg(long, default_value_t = 0.05, value_parser = parse_fraction)]
    pub(crate) masked: f64,
    /// CPU backend: staging workers per rank (batched path); 0 = one per core the ranks leave
    /// free (at least 1, at most 4). At most 256 (ep_reference::options::MAX_STAGING_WORKERS).
    #[arg(long, default_value_t = 0, value_parser = parse_workers)]
    pub(crate) workers: usize,
    /// Multi-process mode (GPU backend): start N processes, one rank each, torchrun style (CUDA
    /// IPC between them, or NCCL with --transport nccl). Under an external launcher (RANK and
    /// WORLD_SIZE set) ep-bench runs as that one rank by itself. R is then the number of
    /// processes, and --ranks is not used.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub(crate) nprocs: u64,
    /// GPU backend: how ranks reach each other (auto: NVLink, through CUDA IPC between
    /// processes; nccl: NCCL send/recv for every peer, both paths; one rank per GPU, so in one
    /// process --gpus must equal --ranks; two-tier: CUDA IPC to the ranks of this node, NCCL to
    /// the others, node from EP_NODE_ID, GROUP_RANK or the hostname).
    #[arg(
        long,
        value_parser = named(&Transport::ALL, Transport::name),
        default_value_t = Transport::Auto
    )]
    pub(crate) transport: Transport,
    /// Multi-process mode: emulate this many nodes on this machine (rank i on node i / (N /
    /// nodes), GPU i % --gpus; EP_NODE_ID and NCCL_HOSTID set per rank), with the two-tier
    /// transport (CUDA IPC inside a node, NCCL across) unless --transport nccl.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub(crate) nodes: u64,
    /// With --transport nccl: how the batched path sizes its NCCL messages (exact: a header
    /// round trip through the host, then exact sizes; capacity: header + T entries / T*min(K,L)
    /// rows in one group, no host round trip). The per-expert path always runs exact sizes.
    /// [default: the library's, ep_kernels::NcclSizes::default()]
    #[arg(long, value_parser = named(&NcclSizes::ALL, NcclSizes::name))]
    pub(crate) nccl_sizes: Option<NcclSizes>,
    /// GPU backend: GPUs to spread the ranks over (1: all ranks as virtual ranks on one GPU).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(crate) gpus: u64,
    /// CPU backend and multi-process mode: bound on every wait of one call, in seconds: at
    /// least 0.001 (1 ms), finite; values above 1e6, about 11.6 days, are taken as 1e6.
    #[arg(long, default_value_t = 30.0, value_parser = parse_timeout, allow_hyphen_values = true)]
    pub(crate) timeout_secs: f64,
    /// Run one point per value of T (tokens per rank = T), e.g. 1,16,128,512.
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = parse_count)]
    pub(crate) sweep_tokens: Vec<usize>,
    /// Also print every rank's line in DeepEP's format (`per-expert [rank 0] Dispatch
    /// bandwidth: ... | Combine bandwidth: ...`), before the summary.
    #[arg(long)]
    pub(crate) per_rank: bool,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// GPU backend: after each point, the in-kernel phase profile (`%globaltimer` stamps per
    /// block and phase, one call of each kernel) and the empty kernel's launch time: where
    /// inside a call the time goes. A debugging figure, not a latency.
    #[arg(long)]
    pub(crate) profile: bool,
    /// With --profile: also every block's stamps of each batched kernel (a line per block), to
    /// see which blocks finish last.
    #[arg(long)]
    pub(crate) profile_blocks: bool,
    /// GPU backend: how the timed calls are issued (graph: replayed from one CUDA graph, one
    /// GPU only; stream: launched one by one, what an eager caller sees).
    #[arg(long, value_enum, default_value_t = TimingArg::Auto)]
    pub(crate) timing: TimingArg,
    /// Multi-process mode: rounds of random inputs every path is checked on, bit for bit against
    /// the oracle, before the timed calls (the second round gives rank 1 half the tokens).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub(crate) rounds: u64,
    /// Multi-process mode, fault test hook (scripts/gpu/faults.sh): rank R exits (code 3) before
    /// round 2's first dispatch; the others must fail with an error naming it.
    #[arg(long, hide = true, value_parser = clap::value_parser!(u64).range(0..=1023))]
    pub(crate) die_rank: Option<u64>,
    /// Multi-process mode, fault test hook: rank R stays alive but silent (three timeouts)
    /// before round 2's first dispatch; the others' bounded waits must name it.
    #[arg(long, hide = true, value_parser = clap::value_parser!(u64).range(0..=1023))]
    pub(crate) stall_rank: Option<u64>,
}

pub(crate) fn parse_fraction(s: &str) -> Result<f64, String> {
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
pub(crate) fn parse_timeout(s: &str) -> Result<f64, String> {
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
pub(crate) fn parse_count(s: &str) -> Result<usize, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("{s} is negative; give a whole number, 0 or more"));
    }
    s.parse()
        .map_err(|_| format!("{s:?} is not a whole number (0 or more)"))
}

/// A count of at most `max` (`what` says what is counted, for the message). A number of digits
/// too large for a `usize` is simply above `max`.
pub(crate) fn parse_at_most(s: &str, max: usize, what: &str) -> Result<usize, String> {
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
pub(crate) fn parse_workers(s: &str) -> Result<usize, String> {
    parse_at_most(
        s,
        ep_reference::options::MAX_STAGING_WORKERS,
        "staging workers per rank (0 picks one per free core)",
    )
}

/// Warm-up iterations: at most `MAX_WARMUP`.
pub(crate) fn parse_warmup(s: &str) -> Result<usize, String> {
    parse_at_most(s, MAX_WARMUP, "warm-up iterations")
}

impl Cli {
    /// The bound on every wait (clamped to `MAX_TIMEOUT_SECS` by the parser).
    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_secs.min(MAX_TIMEOUT_SECS))
    }

    /// The flags that set R and T.
    pub(crate) fn flags(&self, multiproc: bool) -> Flags {
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

    pub(crate) fn mode(&self) -> Result<Mode, String> {
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
    pub(crate) fn points(&self) -> Vec<(usize, usize)> {
        if self.sweep_tokens.is_empty() {
            vec![(self.tokens, self.max_tokens.unwrap_or(self.tokens))]
        } else {
            self.sweep_tokens.iter().map(|&t| (t, t)).collect()
        }
    }
}

/// The flags given on the command line (not defaulted).
pub(crate) struct Given<'a>(pub(crate) &'a ArgMatches);

impl Given<'_> {
    pub(crate) fn has(&self, id: &str) -> bool {
        self.0.value_source(id) == Some(ValueSource::CommandLine)
    }

    /// The first of `ids` given, as its flag.
    pub(crate) fn first(&self, ids: &[&'static str]) -> Option<String> {
        ids.iter()
            .find(|id| self.has(id))
            .map(|id| format!("--{}", id.replace('_', "-")))
    }
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
