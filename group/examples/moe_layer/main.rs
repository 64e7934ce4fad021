//! A toy MoE layer on the GPU with the device API, end to end on one CUDA stream:
//!
//! router scores -> top-k (a kernel of this example) -> dispatch -> the experts (a kernel of this
//! example: dequantize the received rows, scale them by an expert factor) -> combine, with no
//! host synchronisation until the end; then everything is downloaded once and checked bit for
//! bit against `ep_reference::oracle`.
//!
//! ```text
//! cargo run --release --example moe_layer                 # 2 virtual ranks on GPU 0
//! cargo run --release --example moe_layer -- --ranks 4 --mode fp8-ue8m0
//! cargo run --release --example moe_layer -- --nprocs 2   # one process per rank (RankEp)
//! cargo run --release --example moe_layer -- --help       # every flag
//! ```
//!
//! - [`layer`]: the layer itself, what a user of the library writes;
//! - [`check`]: the comparison with the oracle (the example's claim: the layer's outputs are
//!   the contract's, bit for bit, on either path);
//! - [`inputs`]: every rank's tokens and router scores, from the seed;
//! - this file: the flags, and the two ways to run the layer (every rank in this process, or
//!   one rank per process, the processes started here or by a torchrun-style launcher).
//!
//! A flag out of range is refused with exit code 2, naming it. Without a usable GPU (or without
//! NVRTC) it prints `SKIPPED: moe_layer: <why>` and exits 0.

mod check;
mod error;
mod inputs;
mod layer;

use clap::builder::{PossibleValuesParser, RangedU64ValueParser, TypedValueParser};
use clap::Parser;
use ep_group::new_process;
use ep_kernels::cudarc::driver::CudaContext;
use ep_kernels::{GpuGroup, GpuOptions, Path};
use ep_reference::{Config, Mode};
use error::{cuda, LayerError};
use std::process::ExitCode;
use std::time::Duration;

/// A toy MoE layer on the GPU (top-k, dispatch, experts, combine on one stream), checked bit for
/// bit against the oracle.
#[derive(Debug, Clone, Parser)]
#[command(name = "moe_layer")]
struct Flags {
    /// Virtual ranks in this process, all on GPU 0.
    #[arg(long, value_name = "R", default_value_t = 2, value_parser = positive)]
    ranks: usize,
    /// Run N processes of one rank each, started here like `ep-bench --nprocs` (a torchrun-style
    /// launcher may start them too; --ranks is then not used).
    #[arg(long, value_name = "N", value_parser = positive)]
    nprocs: Option<usize>,
    /// Process mode: rank i uses GPU `LOCAL_RANK % G`.
    #[arg(long, value_name = "G", default_value_t = 1, value_parser = positive)]
    gpus: usize,
    /// Tokens per rank at most (T; each rank routes 1..=T of them).
    #[arg(long, value_name = "T", default_value_t = 64, value_parser = positive)]
    tokens: usize,
    /// Hidden size (H).
    #[arg(long, value_name = "H", default_value_t = 1024, value_parser = positive)]
    hidden: usize,
    /// Experts in all (E), at most 4096: the toy top-k kernel scans every expert per slot.
    #[arg(long, value_name = "E", default_value_t = 16,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=4096))]
    experts: usize,
    /// Experts per token (K).
    #[arg(long, value_name = "K", default_value_t = 4, value_parser = positive)]
    top_k: usize,
    /// Dispatch payload format.
    #[arg(long, default_value = "fp8", value_parser = modes())]
    mode: Mode,
    /// Which path the layer runs: one, or each in turn.
    #[arg(long, default_value = "both", value_parser = paths())]
    path: Paths,
    /// Seed of the tokens and router scores.
    #[arg(long, value_name = "S", default_value_t = 1)]
    seed: u64,
}

/// `--mode`'s values: the names ([`Mode::name`], parsed by `Mode`'s `FromStr`) of the modes
/// the layer offers.
fn modes() -> impl TypedValueParser<Value = Mode> {
    let names = [Mode::Bf16, Mode::FP8, Mode::FP8_UE8M0].map(Mode::name);
    PossibleValuesParser::new(names).map(|s| s.parse().expect("a possible value is a mode's name"))
}

/// `--path`: one path by its name ([`Path::name`]), or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Paths {
    One(Path),
    Both,
}

impl Paths {
    const BOTH: &'static str = "both";

    fn list(self) -> Vec<Path> {
        match self {
            Paths::One(p) => vec![p],
            Paths::Both => Path::ALL.to_vec(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Paths::One(p) => p.name(),
            Paths::Both => Paths::BOTH,
        }
    }
}

/// `--path`'s values: the paths' own names (parsed by `Path`'s `FromStr`), and `both`.
fn paths() -> impl TypedValueParser<Value = Paths> {
    let names = Path::ALL.iter().map(|p| p.name()).chain([Paths::BOTH]);
    PossibleValuesParser::new(names).map(|s| match s.as_str() {
        Paths::BOTH => Paths::Both,
        one => Paths::One(one.parse().expect("a possible value is a path's name")),
    })
}

/// A count of at least 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("a whole number of at least 1".into()),
    }
}

impl Flags {
    /// The layer's config for a group of `ranks` ranks, or why the library refuses it.
    fn config(&self, ranks: usize) -> Result<Config, LayerError> {
        Config::new(
            ranks,
            self.experts,
            self.tokens,
            self.hidden,
            self.top_k,
            self.mode,
        )
        .map_err(|e| LayerError::Flag {
            flag: if self.nprocs.is_some() {
                "--nprocs/--experts/--tokens/--hidden/--top-k"
            } else {
                "--ranks/--experts/--tokens/--hidden/--top-k"
            },
            value: format!(
                "R={ranks} E={} T={} H={} K={}",
                self.experts, self.tokens, self.hidden, self.top_k
            ),
            why: e.to_string(),
        })
    }

    /// The flags of one rank's process (all but --nprocs: each runs as one rank).
    fn child_args(&self) -> Vec<String> {
        [
            ("--gpus", self.gpus.to_string()),
            ("--tokens", self.tokens.to_string()),
            ("--hidden", self.hidden.to_string()),
            ("--experts", self.experts.to_string()),
            ("--top-k", self.top_k.to_string()),
            ("--mode", self.mode.name().to_string()),
            ("--path", self.path.name().to_string()),
            ("--seed", self.seed.to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect()
    }
}

/// Every rank in this process, on GPU 0: one stream, one `dispatch_device`/`combine_device`
/// call per layer covering all ranks.
fn virtual_ranks(f: &Flags) -> Result<(), LayerError> {
    let cfg = f.config(f.ranks)?;
    let host = inputs::host_inputs(&cfg, f.seed);
    let want = check::expected(&cfg, &host)?;
    let ctx = cuda("context", CudaContext::new(0))?;
    let s = cuda("stream", ctx.new_stream())?;
    let k = layer::kernels(&ctx)?;
    let mut g = GpuGroup::new(&cfg, GpuOptions::default())?;
    for path in f.path.list() {
        let mut bufs = host
            .iter()
            .map(|h| layer::rank_bufs(&g, &s, &cfg, h))
            .collect::<Result<Vec<_>, _>>()?;
        // The layer: everything is enqueued on `s`; the host waits once, here.
        layer::virtual_layer(&mut g, &s, &k, &cfg, path, &mut bufs)?;
        cuda("synchronize", s.synchronize())?;
        g.check()?;
        for (r, b) in bufs.iter().enumerate() {
            check::verify(&cfg, r, &want, b, &s)?;
        }
        let sel: usize = want.2.iter().map(|t| t.len()).sum();
        println!(
            "PASS: moe_layer {path} path, {} virtual ranks on one GPU, {} ({} tokens, {sel} selections): top-k -> dispatch -> experts -> combine on one stream, bit-identical to the oracle",
            cfg.num_ranks,
            cfg.describe(),
            host.iter().map(|h| h.n).sum::<usize>()
        );
    }
    Ok(())
}

/// This process is one rank of a launch (ep_launch or torchrun variables): the group forms
/// through the rendezvous, and the layer runs through [`ep_kernels::RankEp`].
fn one_rank(f: &Flags) -> Result<(), LayerError> {
    let rdzv = ep_launch::Rendezvous::from_env(Duration::from_secs(60), Duration::from_secs(60))
        .map_err(|e| LayerError::Launch(format!("rendezvous: {e}")))?;
    let (rank, world) = (rdzv.rank(), rdzv.world_size());
    let local = ep_launch::ProcessConfig::from_env()
        .map(|p| p.local_rank)
        .unwrap_or(rank);
    let ordinal = local % f.gpus;
    let cfg = f.config(world)?;
    let host = inputs::host_inputs(&cfg, f.seed);
    let want = check::expected(&cfg, &host)?;
    let ctx = cuda("context", CudaContext::new(ordinal))?;
    let s = cuda("stream", ctx.new_stream())?;
    let k = layer::kernels(&ctx)?;
    let mut g = new_process(&cfg, GpuOptions::default(), rank, ordinal, &mut |b| {
        rdzv.all_gather(b).map_err(|e| e.to_string())
    })?;
    for path in f.path.list() {
        let mut b = layer::rank_bufs(&g, &s, &cfg, &host[rank])?;
        let mut ep = g.rank_ep()?;
        layer::rank_layer(&mut ep, &s, &k, &cfg, path, rank, &mut b)?;
        cuda("synchronize", s.synchronize())?;
        ep.check()?;
        check::verify(&cfg, rank, &want, &b, &s)?;
        // Every rank done with this path before the next reuses the group's buffers, and
        // before any process exits and unmaps what its peers wrote into.
        rdzv.all_gather(&[])
            .map_err(|e| LayerError::Launch(format!("barrier: {e}")))?;
        println!(
            "PASS: moe_layer {path} path, rank {rank} of {world} processes (GPU {ordinal}), {} ({} tokens here): top-k -> dispatch -> experts -> combine on one stream via RankEp, bit-identical to the oracle",
            cfg.describe(),
            b.n
        );
    }
    Ok(())
}

/// Starts `n` processes of this program, one rank each, and waits for them.
fn launch(f: &Flags, n: usize) -> Result<(), LayerError> {
    let exe = std::env::current_exe().map_err(|e| LayerError::Launch(e.to_string()))?;
    let l = ep_launch::spawn_local(n, exe, f.child_args(), &[])
        .map_err(|e| LayerError::Launch(e.to_string()))?;
    l.wait(Duration::from_secs(240))
        .map_err(|e| LayerError::Launch(e.to_string()))?;
    println!(
        "PASS: moe_layer: all {n} processes (one rank each, {} GPU(s)) exited 0; {} paths",
        f.gpus,
        f.path.list().len()
    );
    Ok(())
}

fn main() -> ExitCode {
    // Bad flags: clap's error names the flag and exits 2 (`--help` prints every flag, exit 0).
    let f = Flags::parse();
    let launched = ep_launch::is_launched_by_ep_launch() || ep_launch::is_launched_externally();
    // The settings the library refuses, before looking for a GPU (under a launcher the group's
    // size is known only after the rendezvous).
    let ranks = match (launched, f.nprocs) {
        (true, _) => None,
        (false, Some(n)) => Some(n),
        (false, None) => Some(f.ranks),
    };
    if let Some(Err(e)) = ranks.map(|r| f.config(r)) {
        eprintln!("moe_layer: {e}");
        return ExitCode::from(2);
    }
    if !launched {
        if let Err(why) = ep_kernels::runtime::probe() {
            println!("SKIPPED: moe_layer: no usable GPU: {why}");
            return ExitCode::SUCCESS;
        }
        if !ep_kernels::compile::nvrtc_present() {
            println!("SKIPPED: moe_layer: libnvrtc cannot be opened");
            return ExitCode::SUCCESS;
        }
    }
    let r = match (launched, f.nprocs) {
        (true, _) => one_rank(&f),
        (false, Some(n)) => launch(&f, n),
        (false, None) => virtual_ranks(&f),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("FAIL: moe_layer: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(args: &[&str]) -> Result<Flags, clap::Error> {
        Flags::try_parse_from(std::iter::once("moe_layer").chain(args.iter().copied()))
    }

    #[test]
    fn a_child_runs_with_the_parents_settings() {
        let f = flags(&[
            "--nprocs",
            "2",
            "--mode",
            "fp8-ue8m0",
            "--path",
            "per-expert",
        ])
        .unwrap();
        let c = flags(
            &f.child_args()
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!(c.nprocs, None);
        assert_eq!(c.mode, Mode::FP8_UE8M0);
        assert_eq!(c.path.list(), vec![Path::PerExpert]);
        assert_eq!((c.tokens, c.hidden, c.experts, c.top_k), (64, 1024, 16, 4));
    }

    #[test]
    fn paths_by_their_names() {
        assert_eq!(flags(&[]).unwrap().path.list(), Path::ALL.to_vec());
        assert_eq!(
            flags(&["--path", "batched"]).unwrap().path,
            Paths::One(Path::Batched)
        );
        assert!(flags(&["--path", "per_expert"]).is_err());
        assert!(flags(&["--experts", "4097"]).is_err());
        assert!(flags(&["--ranks", "0"]).is_err());
    }
}
