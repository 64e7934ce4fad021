//! Multi-process dispatch/combine: one process per rank, torchrun style.
//!
//! The per-rank process binary that launchers and scripts start (its flags are stable: the
//! fault scripts use `--die-rank` / `--stall-rank`). For timing, `ep-bench --nprocs N` is the
//! user-facing entry point; it runs the same rank code (`ep_group::mp`).
//!
//! `ep-gpu-mp --nprocs N [options]` starts N local ranks of itself (`ep_launch::spawn_local`) and
//! reports which rank failed; under an external launcher (torchrun: `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) it runs as one rank. Each rank opens GPU
//! `LOCAL_RANK % --gpus`, forms the group (CUDA IPC handles or the NCCL unique id through the TCP
//! rendezvous), checks every path against the oracle for `--rounds` random inputs (all ranks
//! generate the same inputs from the seed and compare their own rank's outputs bit for bit), then
//! times `--iters` back-to-back calls per path (host wall time per call, between two barriers).
//!
//! Options: --transport auto|nccl|two-tier (auto: NVLink through CUDA IPC, one node; nccl: NCCL
//! everywhere; two-tier: CUDA IPC to the ranks of this node, NCCL to the others, the node from
//! `EP_NODE_ID`, else torchrun's `GROUP_RANK`, else the hostname), --gpus G, --nodes N (with
//! --nprocs: emulate N nodes on this machine, rank i on node i / (nprocs / N) through `EP_NODE_ID`
//! and `NCCL_HOSTID`; implies --transport two-tier unless --transport nccl is given), --t 128 --h 7168 --k 8 --e 256 --mode fp8|bf16, --rounds 2, --iters 200,
//! --timeout-ms 10000, --die-rank R (rank R exits with code 3 in the middle of round 1, to
//! check that the others fail with a clear error within the timeout), --stall-rank R (rank R
//! stays alive but stops taking part: the others' bounded waits must name it).

use ep_group::mp::{run_rank, MpOptions};
use ep_kernels::Transport;
use ep_launch::EXIT_PEER_FAILURE;
use ep_reference::Mode;
use std::process::ExitCode;
use std::time::{Duration, Instant};

struct Args {
    all: Vec<String>,
}

impl Args {
    fn get(&self, name: &str, d: &str) -> String {
        self.all
            .iter()
            .position(|a| a == name)
            .and_then(|i| self.all.get(i + 1).cloned())
            .unwrap_or_else(|| d.to_string())
    }
    /// The whole number after `name` (`d` without it). A bad one is a usage error: exit 2
    /// naming the flag (this runs before anything is started, so there is nothing to clean up).
    fn num(&self, name: &str, d: usize) -> usize {
        let v = self.get(name, &d.to_string());
        v.parse().unwrap_or_else(|_| {
            eprintln!("ep-gpu-mp: {name} {v:?}: expected a whole number, 0 or more");
            std::process::exit(2)
        })
    }
}

fn main() -> ExitCode {
    let args = Args {
        all: std::env::args().collect(),
    };
    let launched = ep_launch::is_launched_by_ep_launch() || ep_launch::is_launched_externally();
    if args.all.iter().any(|a| a == "--nprocs") && !launched {
        return parent(&args);
    }
    match rank_main(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err((msg, by_peer)) => {
            eprintln!("ep-gpu-mp: {msg}");
            if by_peer {
                ExitCode::from(EXIT_PEER_FAILURE as u8)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

fn parent(args: &Args) -> ExitCode {
    let n = args.num("--nprocs", 2);
    if !(1..=ep_launch::MAX_NPROCS).contains(&n) {
        eprintln!(
            "ep-gpu-mp: --nprocs {n}: give 1 to {} local processes",
            ep_launch::MAX_NPROCS
        );
        return ExitCode::from(2);
    }
    let nodes = args.num("--nodes", 1);
    // Read before any process starts (a bad value exits at once).
    let launch_timeout = Duration::from_secs(args.num("--launch-timeout-s", 240) as u64);
    let given_transport = args.all.iter().any(|a| a == "--transport");
    let mut child = Vec::new();
    let mut skip = false;
    for a in args.all.iter().skip(1) {
        if skip {
            skip = false;
            continue;
        }
        if a == "--nprocs" || a == "--nodes" {
            skip = true;
            continue;
        }
        child.push(a.clone());
    }
    let mut rank_env = Vec::new();
    if nodes != 1 {
        if args.get("--transport", "two-tier") == "auto" {
            eprintln!(
                "ep-gpu-mp: --nodes {nodes} emulates {nodes} nodes, and --transport auto reaches every peer through CUDA IPC (one node): use --transport two-tier or nccl"
            );
            return ExitCode::from(2);
        }
        if !given_transport {
            child.extend(["--transport".to_string(), "two-tier".to_string()]);
        }
        rank_env = match ep_group::topology::emulation_envs(n, nodes) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("ep-gpu-mp: --nodes: {e}");
                return ExitCode::from(2);
            }
        };
    }
    let exe = std::env::current_exe().expect("current_exe");
    let opts = ep_launch::LaunchOptions {
        rank_env,
        ..Default::default()
    };
    let launch = match ep_launch::spawn_local_with(&opts, n, exe, &child, &[]) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ep-gpu-mp: launch failed: {e}");
            return ExitCode::from(1);
        }
    };
    let t0 = Instant::now();
    match launch.wait(launch_timeout) {
        Ok(rep) => {
            println!(
                "ep-gpu-mp: all {n} ranks exited 0 ({:.1} s)",
                t0.elapsed().as_secs_f64()
            );
            drop(rep);
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!(
                "ep-gpu-mp: launch failed after {:.1} s: {e}",
                t0.elapsed().as_secs_f64()
            );
            ExitCode::from(1)
        }
    }
}

type Fail = (String, bool);

fn rank_main(args: &Args) -> Result<(), Fail> {
    let transport = match args.get("--transport", "auto").as_str() {
        "nccl" => Transport::Nccl,
        "auto" => Transport::Auto,
        "two-tier" => Transport::TwoTier,
        t => return Err((format!("--transport {t}: auto, nccl or two-tier"), false)),
    };
    if args.all.iter().any(|a| a == "--nodes") {
        return Err((
            "--nodes applies with --nprocs (it emulates nodes on this machine); under a launcher set EP_NODE_ID or GROUP_RANK per node".into(),
            false,
        ));
    }
    let flag = |name: &str| {
        args.all
            .iter()
            .any(|a| a == name)
            .then(|| args.num(name, 0))
    };
    let o = MpOptions {
        experts: args.num("--e", 256),
        tokens: args.num("--t", 128),
        hidden: args.num("--h", 7168),
        top_k: args.num("--k", 8),
        mode: match args.get("--mode", "fp8").as_str() {
            "bf16" => Mode::Bf16,
            _ => Mode::FP8,
        },
        transport,
        nccl_sizes: Default::default(),
        gpus: args.num("--gpus", 1),
        rounds: args.num("--rounds", 2),
        iters: args.num("--iters", 200),
        seed: args.num("--seed", 7) as u64,
        masked: 0.05,
        timeout: Duration::from_millis(args.num("--timeout-ms", 10_000) as u64),
        die_rank: flag("--die-rank"),
        stall_rank: flag("--stall-rank"),
    };
    let rep = run_rank(&o).map_err(|f| (f.message, f.caused_by_peer))?;
    let rank = rep.rank;
    println!(
        "rank {rank}/{}: {}, {}, transport {}",
        rep.world,
        rep.device,
        rep.config.describe(),
        rep.transport
    );
    println!(
        "rank {rank}: node {}, CUDA IPC to ranks {:?}, NCCL to ranks {:?}",
        rep.node, rep.ipc_peers, rep.nccl_peers
    );
    println!(
        "rank {rank}: {} checks bit-identical to the oracle ({} rounds)",
        rep.checks, o.rounds
    );
    for (path, why) in &rep.unsupported {
        println!(
            "rank {rank}: path={path} unsupported on this transport, not checked or timed: {why}"
        );
    }
    for t in &rep.timings {
        println!(
            "rank {rank}: BENCH transport={} path={} R={} gpus={} {}: dispatch {:.1} us/call, combine {:.1} us/call (host wall time, {} back-to-back calls)",
            rep.transport,
            t.path,
            rep.world,
            o.gpus,
            rep.config.describe(),
            t.dispatch_us,
            t.combine_us,
            o.iters
        );
    }
    Ok(())
}
