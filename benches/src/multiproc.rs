//! `ep-bench --nprocs N`: one process per rank, torchrun style, on the GPU backend.
//!
//! Without `RANK`/`WORLD_SIZE` in the environment, `ep-bench --nprocs N` is the launcher: it
//! starts N copies of itself (`ep_launch::spawn_local`), prefixes their output with `[rank i]`,
//! and names the rank that failed. With them (set by that launcher, or by torchrun or any other
//! launcher), ep-bench runs as that one rank (`ep_group::mp::run_rank_with`): it forms the
//! group through CUDA IPC handles (or NCCL), checks every path bit for bit against the oracle,
//! times both here ([`time_calls`]), and prints its DeepEP-format lines.
//!
//! `--nodes N` (with `--nprocs`) emulates N nodes on this machine: rank i is on node
//! `i / (nprocs / N)` (`EP_NODE_ID`, and `NCCL_HOSTID` per node so that NCCL takes the nodes for
//! separate hosts and talks between them over its network transport), GPU `i % --gpus`, and the
//! ranks run the two-tier transport (CUDA IPC inside a node, NCCL across) unless `--transport
//! nccl` is given. A path the transport refuses is reported as unsupported, not failed.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ep_group::mp::{run_rank_with, sizes_for, MpFailure, MpOptions, RankRun};
use ep_kernels::runtime::{NcclSizes, Path, Transport};
use ep_launch::EXIT_PEER_FAILURE;
use ep_reference::Op;

/// `--nodes` of a launch, checked before any process starts: it must divide `--nprocs`, and more
/// than one node needs a transport that crosses nodes (`transport_auto_given`: the user asked for
/// `--transport auto` explicitly).
pub fn check_nodes(nprocs: usize, nodes: usize, transport_auto_given: bool) -> Result<(), String> {
    ep_group::topology::emulated_node(0, nprocs, nodes)
        .map_err(|e| format!("--nodes {nodes} does not fit --nprocs {nprocs}: {e}"))?;
    if nodes > 1 && transport_auto_given {
        return Err(format!(
            "--nodes {nodes} emulates {nodes} nodes, and --transport auto reaches every peer through CUDA IPC, which needs one node: use --transport two-tier (the default with --nodes) or --transport nccl"
        ));
    }
    Ok(())
}

/// The launcher side: starts `nprocs` copies of this program with `args` (this process's
/// arguments less `--nprocs`), waits for them up to `timeout`.
pub fn launch(nprocs: usize, args: Vec<String>, timeout: Duration) -> ExitCode {
    launch_nodes(nprocs, 1, args, timeout)
}

/// [`launch`] on `nodes` emulated nodes (see the module docs; `args` without `--nodes`, as
/// [`child_args`] leaves them). `nodes` must have passed [`check_nodes`].
pub fn launch_nodes(
    nprocs: usize,
    nodes: usize,
    mut args: Vec<String>,
    timeout: Duration,
) -> ExitCode {
    let mut rank_env = Vec::new();
    if nodes > 1 {
        rank_env = match ep_group::topology::emulation_envs(nprocs, nodes) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("ep-bench: --nodes {nodes}: {e}");
                return ExitCode::from(2);
            }
        };
        if !args
            .iter()
            .any(|a| a == "--transport" || a.starts_with("--transport="))
        {
            args.extend([
                "--transport".to_string(),
                Transport::TwoTier.name().to_string(),
            ]);
        }
    }
    let opts = ep_launch::LaunchOptions {
        rank_env,
        ..Default::default()
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ep-bench: cannot find its own executable to launch: {e}");
            return ExitCode::from(1);
        }
    };
    let t0 = Instant::now();
    let launch = match ep_launch::spawn_local_with(&opts, nprocs, exe, &args, &[]) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ep-bench: launching {nprocs} processes failed: {e}");
            return ExitCode::from(1);
        }
    };
    match launch.wait(timeout) {
        Ok(_) => {
            println!(
                "ep-bench: all {nprocs} ranks succeeded ({:.1} s)",
                t0.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "ep-bench: failed after {:.1} s: {e}",
                t0.elapsed().as_secs_f64()
            );
            ExitCode::from(1)
        }
    }
}

/// `args` less `--nprocs N` / `--nprocs=N` and `--nodes N` / `--nodes=N` (the launcher's: a
/// rank takes its node from its environment).
pub fn child_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == "--nprocs" || a == "--nodes" {
            skip = true;
        } else if !a.starts_with("--nprocs=") && !a.starts_with("--nodes=") {
            out.push(a.clone());
        }
    }
    out
}

/// One path's timing on this rank.
#[derive(Debug, Clone)]
pub struct MpTiming {
    pub path: Path,
    pub dispatch_us: f64,
    pub combine_us: f64,
    /// NCCL transport: the path and the sizing it ran (its wire figures follow from them and
    /// the report's `timed_topk_idx`: [`crate::traffic::nccl_accounting`]).
    pub nccl: Option<(Path, NcclSizes)>,
}

/// Times `o.iters` back-to-back calls per path and operation on this rank (host wall time per
/// call, between two barriers, after 5 warm-up calls), on the inputs `run` holds: what a rank of
/// `ep-bench --nprocs` does between its checks and its final barrier. Nothing with `o.iters` 0.
pub fn time_calls(run: &mut RankRun<'_>, o: &MpOptions) -> Result<Vec<MpTiming>, MpFailure> {
    let rank = run.rank;
    let fail = |message: String, caused_by_peer: bool| MpFailure {
        message,
        caused_by_peer,
    };
    let me = &run.inputs[rank];
    let mut timings = Vec::new();
    if o.iters > 0 {
        for &path in run.paths {
            run.group.set_nccl_sizes(sizes_for(o, path));
            run.group
                .dispatch_rank(path, &me.x, &me.topk_idx)
                .map_err(|e| run.gpu_failure("warm-up dispatch", e))?;
            run.group
                .upload_rank_combine(&run.y[rank], &me.topk_weights)
                .map_err(|e| run.gpu_failure("upload", e))?;
            let mut us = [0.0f64; 2];
            for (i, op) in [Op::Dispatch, Op::Combine].into_iter().enumerate() {
                for _ in 0..5 {
                    run.group
                        .launch(op, path)
                        .map_err(|e| run.gpu_failure("warm-up", e))?;
                }
                run.group
                    .sync()
                    .map_err(|e| run.gpu_failure("warm-up", e))?;
                run.rdzv
                    .barrier("bench")
                    .map_err(|e| fail(format!("rank {rank}: barrier: {e}"), true))?;
                run.step(&format!("timing {} {op:?}", path.name()));
                let t0 = Instant::now();
                for _ in 0..o.iters {
                    run.group
                        .launch(op, path)
                        .map_err(|e| run.gpu_failure("bench", e))?;
                }
                run.group.sync().map_err(|e| run.gpu_failure("bench", e))?;
                us[i] = t0.elapsed().as_secs_f64() * 1e6 / o.iters as f64;
                run.rdzv
                    .barrier("bench-end")
                    .map_err(|e| fail(format!("rank {rank}: barrier: {e}"), true))?;
            }
            timings.push(MpTiming {
                path,
                dispatch_us: us[0],
                combine_us: us[1],
                nccl: (o.transport == Transport::Nccl).then(|| (path, sizes_for(o, path))),
            });
        }
    }
    Ok(timings)
}

/// The rank side: runs this process's rank (`ep_group::mp`), times its calls
/// ([`time_calls`]) and prints its lines.
pub fn rank(o: &MpOptions) -> ExitCode {
    if let Err(why) = ep_kernels::runtime::probe() {
        eprintln!("ep-bench: multi-process mode runs the GPU backend, and there is none: {why}");
        return ExitCode::from(1);
    }
    let (rep, timings) = match run_rank_with(o, |run| time_calls(run, o)) {
        Ok(r) => r,
        Err(f) => {
            eprintln!("ep-bench: {f}");
            let code = if f.caused_by_peer {
                EXIT_PEER_FAILURE
            } else {
                1
            };
            return ExitCode::from(code as u8);
        }
    };
    let cfg = rep.config;
    if rep.rank == 0 {
        println!(
            "== ep-bench: gpu backend, {} processes | {} | transport {} | {} checks per rank bit-identical to the oracle | host wall time per call over {} back-to-back calls ==",
            rep.world,
            cfg.describe(),
            rep.transport,
            rep.checks,
            o.iters
        );
        for (path, why) in &rep.unsupported {
            println!(
                "{path}: unsupported on transport {}, not checked or timed: {why}",
                o.transport
            );
        }
    }
    if !rep.nccl_peers.is_empty() && !rep.ipc_peers.is_empty() {
        println!(
            "[rank {}] node {}: CUDA IPC to ranks {:?}, NCCL to ranks {:?}",
            rep.rank, rep.node, rep.ipc_peers, rep.nccl_peers
        );
    }
    let d_bytes = (rep.selections * cfg.logical_dispatch_message_bytes()) as f64;
    let c_bytes = (rep.selections * cfg.logical_combine_message_bytes()) as f64;
    for t in &timings {
        println!(
            "{} [rank {}] Dispatch bandwidth: {:.2} GB/s, avg_t={:.2} us | Combine bandwidth: {:.2} GB/s, avg_t={:.2} us   ({})",
            t.path,
            rep.rank,
            d_bytes / t.dispatch_us / 1e3,
            t.dispatch_us,
            c_bytes / t.combine_us / 1e3,
            t.combine_us,
            rep.device
        );
        // Over NCCL, the wire figures of one call, all ranks.
        let wire = t.nccl.and_then(|(path, sizes)| {
            crate::traffic::nccl_accounting(&cfg, &rep.timed_topk_idx, path, sizes)
                .map(|w| (sizes.name(), w))
                .ok()
        });
        if let (0, Some((sizes, (dw, cw, dm, cm)))) = (rep.rank, wire) {
            println!(
                "{} over NCCL ({sizes} sizes), one call, all ranks: dispatch {dm} NCCL sends, {dw} wire bytes | combine {cm} NCCL sends, {cw} wire bytes",
                t.path
            );
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::child_args;

    #[test]
    fn nodes_is_removed_and_checked() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            child_args(&v(&[
                "--nodes",
                "2",
                "--nprocs=4",
                "--gpus",
                "2",
                "--nodes=2"
            ])),
            v(&["--gpus", "2"])
        );
        assert!(super::check_nodes(4, 2, false).is_ok());
        assert!(super::check_nodes(4, 1, true).is_ok());
        let e = super::check_nodes(4, 3, false).unwrap_err();
        assert!(e.contains("--nodes 3 does not fit --nprocs 4"), "{e}");
        let e = super::check_nodes(2, 4, false).unwrap_err();
        assert!(e.contains("--nodes 4"), "{e}");
        let e = super::check_nodes(4, 2, true).unwrap_err();
        assert!(e.contains("--transport auto"), "{e}");
    }

    #[test]
    fn nprocs_is_removed_in_both_spellings() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            child_args(&v(&["--nprocs", "2", "--iters", "5"])),
            v(&["--iters", "5"])
        );
        assert_eq!(
            child_args(&v(&["--tokens", "8", "--nprocs=4"])),
            v(&["--tokens", "8"])
        );
    }
}
