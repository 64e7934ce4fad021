//! Multi-process dispatch/combine: one process per rank, torchrun style.
//!
//! `ep-gpu-mp --nprocs N [options]` starts N local ranks of itself (`ep_launch::spawn_local`) and
//! reports which rank failed; under an external launcher (torchrun: `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) it runs as one rank. Each rank opens GPU
//! `LOCAL_RANK % --gpus`, forms the group (CUDA IPC handles or the NCCL unique id through the TCP
//! rendezvous), checks every path against the oracle for `--rounds` random inputs (all ranks
//! generate the same inputs from the seed and compare their own rank's outputs bit for bit), then
//! times `--iters` back-to-back calls per path (host wall time per call, between two barriers).
//!
//! Options: --transport auto|nccl (auto: NVLink through CUDA IPC; nccl: NCCL everywhere),
//! --gpus G, --t 128 --h 7168 --k 8 --e 256 --mode fp8|bf16, --rounds 2, --iters 200,
//! --timeout-ms 10000, --die-rank R (rank R exits with code 3 in the middle of round 1, to
//! check that the others fail with a clear error within the timeout), --stall-rank R (rank R
//! stays alive but stops taking part: the others' bounded waits must name it).

use ep_kernels::testing::{random_inputs, random_y, Rng, Routing};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, Path, Transport};
use ep_launch::{Rendezvous, EXIT_PEER_FAILURE};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::{Config, Error, Mode, Op};
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
    fn num(&self, name: &str, d: usize) -> usize {
        let v = self.get(name, &d.to_string());
        v.parse()
            .unwrap_or_else(|_| panic!("{name}: not a number: {v}"))
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
    let mut child = Vec::new();
    let mut skip = false;
    for a in args.all.iter().skip(1) {
        if skip {
            skip = false;
            continue;
        }
        if a == "--nprocs" {
            skip = true;
            continue;
        }
        child.push(a.clone());
    }
    let exe = std::env::current_exe().expect("current_exe");
    let launch = match ep_launch::spawn_local(n, exe, &child, &[]) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ep-gpu-mp: launch failed: {e}");
            return ExitCode::from(1);
        }
    };
    let t0 = Instant::now();
    match launch.wait(Duration::from_secs(
        args.num("--launch-timeout-s", 240) as u64
    )) {
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

fn gpu_err(rank: usize, what: &str, e: GpuError) -> Fail {
    let by_peer = matches!(&e, GpuError::Contract(Error::Timeout { peer, .. }) if *peer != rank);
    (format!("rank {rank}: {what}: {e}"), by_peer)
}

fn rank_main(args: &Args) -> Result<(), Fail> {
    let timeout_ms = args.num("--timeout-ms", 10_000) as u64;
    let rdzv = Rendezvous::from_env(
        Duration::from_secs(60),
        Duration::from_millis(timeout_ms.max(30_000)),
    )
    .map_err(|e| (format!("rendezvous: {e}"), false))?;
    let (rank, world) = (rdzv.rank(), rdzv.world_size());
    let local_rank = ep_launch::ProcessConfig::from_env()
        .map(|p| p.local_rank)
        .unwrap_or(rank);
    let gpus = args.num("--gpus", 1).max(1);
    let ordinal = local_rank % gpus;
    let transport = match args.get("--transport", "auto").as_str() {
        "nccl" => Transport::Nccl,
        "auto" => Transport::Auto,
        t => return Err((format!("--transport {t}: auto or nccl"), false)),
    };
    let mode = match args.get("--mode", "fp8").as_str() {
        "bf16" => Mode::Bf16,
        _ => Mode::FP8,
    };
    let (t, h, k, e) = (
        args.num("--t", 128),
        args.num("--h", 7168),
        args.num("--k", 8),
        args.num("--e", 256),
    );
    let stall_rank = args
        .all
        .iter()
        .any(|a| a == "--stall-rank")
        .then(|| args.num("--stall-rank", 0));
    let die_rank = args
        .all
        .iter()
        .any(|a| a == "--die-rank")
        .then(|| args.num("--die-rank", 0));
    let cfg = Config::new(world, e, t, h, k, mode).map_err(|e| (format!("config: {e}"), false))?;
    let opts = GpuOptions {
        transport,
        timeout_ns: timeout_ms * 1_000_000,
        ..Default::default()
    };
    let tn = if transport == Transport::Nccl {
        "nccl"
    } else {
        "nvlink-ipc"
    };
    let mut g = GpuGroup::new_process(&cfg, opts, rank, ordinal, &mut |b| {
        rdzv.all_gather(b).map_err(|e| e.to_string())
    })
    .map_err(|e| gpu_err(rank, "group", e))?;
    println!(
        "rank {rank}/{world}: GPU {ordinal} ({}), {}, transport {tn}",
        g.describe_devices(),
        cfg.describe()
    );
    let paths: &[Path] = if transport == Transport::Nccl {
        &[Path::Batched]
    } else {
        &[Path::PerExpert, Path::Batched]
    };
    let mut rng = Rng::new(args.num("--seed", 7) as u64);
    let rounds = args.num("--rounds", 2);
    let mut checks = 0;
    for round in 0..rounds {
        let tokens: Vec<usize> = (0..world)
            .map(|s| if round == 1 && s == 1 { t / 2 } else { t })
            .collect();
        let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.05 }, &mut rng);
        let y = random_y(&cfg, &mut rng);
        let inputs: Vec<RankInput> = data
            .iter()
            .map(|d| RankInput {
                x: &d.x,
                topk_idx: &d.topk_idx,
            })
            .collect();
        let want = oracle::dispatch(&cfg, &inputs).map_err(|e| (format!("oracle: {e}"), false))?;
        let cin: Vec<CombineInput> = data
            .iter()
            .zip(&y)
            .map(|(d, y)| CombineInput {
                y,
                topk_idx: &d.topk_idx,
                topk_weights: &d.topk_weights,
            })
            .collect();
        let want_c = oracle::combine(&cfg, &cin).map_err(|e| (format!("oracle: {e}"), false))?;
        let me = &data[rank];
        for &path in paths {
            if die_rank == Some(rank) && round == 1 {
                eprintln!(
                    "rank {rank}: exiting on purpose (--die-rank) before the round-1 dispatch"
                );
                std::process::exit(3);
            }
            if stall_rank == Some(rank) && round == 1 {
                // Alive but silent (its buffers stay mapped): the peers' waits must time out.
                eprintln!(
                    "rank {rank}: stalling on purpose (--stall-rank) before the round-1 dispatch"
                );
                std::thread::sleep(Duration::from_millis(3 * timeout_ms));
                std::process::exit(3);
            }
            let t0 = Instant::now();
            let got = match g.dispatch_rank(path, &me.x, &me.topk_idx) {
                Ok(v) => v,
                Err(e) => {
                    let (m, p) = gpu_err(rank, &format!("{} dispatch", path.name()), e);
                    return Err((format!("{m} (after {} ms)", t0.elapsed().as_millis()), p));
                }
            };
            if let Some(d) = got.diff(&want[rank]) {
                return Err((
                    format!(
                        "rank {rank}: {} dispatch differs from the oracle: {d}",
                        path.name()
                    ),
                    false,
                ));
            }
            let out = g
                .combine_rank(path, &y[rank], &me.topk_weights)
                .map_err(|e| gpu_err(rank, &format!("{} combine", path.name()), e))?;
            if let Some(i) = (0..out.len()).find(|&i| out[i].to_bits() != want_c[rank][i].to_bits())
            {
                return Err((
                    format!(
                        "rank {rank}: {} combine differs from the oracle at element {i}",
                        path.name()
                    ),
                    false,
                ));
            }
            checks += 2;
        }
    }
    println!(
        "rank {rank}: {checks} checks bit-identical to the oracle ({rounds} rounds, paths {:?})",
        paths.iter().map(|p| p.name()).collect::<Vec<_>>()
    );
    let iters = args.num("--iters", 200);
    if iters == 0 {
        return Ok(());
    }
    let data = random_inputs(
        &cfg,
        &vec![t; world],
        Routing::Random { masked: 0.05 },
        &mut rng,
    );
    let y = random_y(&cfg, &mut rng);
    let me = &data[rank];
    for &path in paths {
        g.dispatch_rank(path, &me.x, &me.topk_idx)
            .map_err(|e| gpu_err(rank, "warm-up dispatch", e))?;
        g.upload_rank_combine(&y[rank], &me.topk_weights)
            .map_err(|e| gpu_err(rank, "upload", e))?;
        let mut us = [0.0f64; 2];
        for (i, op) in [Op::Dispatch, Op::Combine].into_iter().enumerate() {
            for _ in 0..5 {
                g.launch(op, path)
                    .map_err(|e| gpu_err(rank, "warm-up", e))?;
            }
            g.sync().map_err(|e| gpu_err(rank, "warm-up", e))?;
            rdzv.barrier("bench")
                .map_err(|e| (format!("rank {rank}: barrier: {e}"), true))?;
            let t0 = Instant::now();
            for _ in 0..iters {
                g.launch(op, path).map_err(|e| gpu_err(rank, "bench", e))?;
            }
            g.sync().map_err(|e| gpu_err(rank, "bench", e))?;
            us[i] = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
            rdzv.barrier("bench-end")
                .map_err(|e| (format!("rank {rank}: barrier: {e}"), true))?;
        }
        println!(
            "rank {rank}: BENCH transport={tn} path={} R={world} gpus={gpus} {}: dispatch {:.1} us/call, combine {:.1} us/call (host wall time, {iters} back-to-back calls)",
            path.name(),
            cfg.describe(),
            us[0],
            us[1]
        );
    }
    Ok(())
}
