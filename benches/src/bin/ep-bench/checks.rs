//! ep-bench's checks before anything runs: the flags that do not apply to the run, the
//! configs in the command line's words, the memory a point needs.

use crate::cli::{BackendArg, Cli, Given};
use ep_benches::backend::Backend;
use ep_benches::flags::{self, Flags};
use ep_benches::memory::{self, MemInfo};
use ep_benches::spec::BenchSpec;
use ep_kernels::Transport;
use ep_reference::{Config, Mode};

/// The config of multi-process mode, R = `world` (set by `ranks_flag`), checked before any
/// process starts.
pub(crate) fn multiproc_config(
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

/// Flags that multi-process mode (one rank per process, GPU backend) does not use.
pub(crate) fn refuse_in_multiproc(
    cli: &Cli,
    given: &Given<'_>,
    launched: bool,
) -> Result<(), String> {
    if let Some(f) = given.first(&[
        "ranks",
        "max_tokens",
        "sweep_tokens",
        "warmup",
        "workers",
        "json",
        "per_rank",
        "profile",
        "profile_blocks",
        "timing",
        "logfmt",
        "scales_column_major",
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

/// `--logfmt` needs every peer over CUDA IPC / NVLink: the NCCL transport carries bf16 rows only.
pub(crate) fn refuse_logfmt_over_nccl(cli: &Cli, given: &Given<'_>) -> Result<(), String> {
    if given.has("logfmt") && matches!(cli.transport, Transport::Nccl | Transport::TwoTier) {
        return Err(format!(
            "--logfmt with --transport {}: the NCCL transport carries bf16 rows only (LogFMT runs over NVLink): drop one of them",
            cli.transport.name()
        ));
    }
    Ok(())
}

/// `--scales-column-major` lays out the FP8 scales: a BF16 dispatch has none.
pub(crate) fn refuse_scales_layout(mode: Mode, given: &Given<'_>) -> Result<(), String> {
    if given.has("scales_column_major") && mode == Mode::Bf16 {
        return Err(
            "--scales-column-major with --dispatch bf16: a BF16 dispatch has no scales to lay out: drop --scales-column-major, or use --dispatch fp8"
                .into(),
        );
    }
    Ok(())
}

/// `--nccl-sizes` needs the NCCL transport.
pub(crate) fn refuse_nccl_sizes(cli: &Cli, given: &Given<'_>) -> Result<(), String> {
    if given.has("nccl_sizes") && !matches!(cli.transport, Transport::Nccl | Transport::TwoTier) {
        return Err(
            "--nccl-sizes applies where NCCL carries traffic only: add --transport nccl (or two-tier with --nodes), or drop --nccl-sizes"
                .into(),
        );
    }
    Ok(())
}

/// Flags that a single-process run does not use.
pub(crate) fn refuse_in_single(given: &Given<'_>, json: bool) -> Result<(), String> {
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
    if let Some(f) = given.first(&["profile", "profile_blocks"]).filter(|_| json) {
        return Err(format!(
            "{f} prints text lines, which --json cannot carry: drop one of them"
        ));
    }
    if given.has("profile_blocks") && !given.has("profile") {
        return Err("--profile-blocks adds to --profile's lines: add --profile".into());
    }
    Ok(())
}

/// Flags that `backend` does not use.
pub(crate) fn refuse_on_backend(given: &Given<'_>, backend: &Backend) -> Result<(), String> {
    match backend {
        Backend::Cpu => {
            if let Some(f) = given.first(&[
                "gpus",
                "profile",
                "profile_blocks",
                "timing",
                "transport",
                "nccl_sizes",
                "scales_column_major",
            ]) {
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
pub(crate) fn check_memory(
    cli: &Cli,
    specs: &[BenchSpec],
    backend: &Backend,
) -> Result<(), String> {
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
