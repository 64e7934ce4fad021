//! `ep-bench --nprocs N`: one process per rank, torchrun style, on the GPU backend.
//!
//! Without `RANK`/`WORLD_SIZE` in the environment, `ep-bench --nprocs N` is the launcher: it
//! starts N copies of itself (`ep_launch::spawn_local`), prefixes their output with `[rank i]`,
//! and names the rank that failed. With them (set by that launcher, or by torchrun or any other
//! launcher), ep-bench runs as that one rank (`ep_kernels::mp::run_rank`): it forms the group
//! through CUDA IPC handles (or NCCL), checks every path bit for bit against the oracle, times
//! both, and prints its DeepEP-format lines.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ep_kernels::mp::{run_rank, MpOptions};
use ep_launch::EXIT_PEER_FAILURE;

/// The launcher side: starts `nprocs` copies of this program with `args` (this process's
/// arguments less `--nprocs`), waits for them up to `timeout`.
pub fn launch(nprocs: usize, args: Vec<String>, timeout: Duration) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ep-bench: cannot find its own executable to launch: {e}");
            return ExitCode::from(1);
        }
    };
    let t0 = Instant::now();
    let launch = match ep_launch::spawn_local(nprocs, exe, &args, &[]) {
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

/// `args` less `--nprocs N` / `--nprocs=N`.
pub fn child_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == "--nprocs" {
            skip = true;
        } else if !a.starts_with("--nprocs=") {
            out.push(a.clone());
        }
    }
    out
}

/// The rank side: runs this process's rank and prints its lines.
pub fn rank(o: &MpOptions) -> ExitCode {
    if let Err(why) = ep_kernels::bench::probe() {
        eprintln!("ep-bench: multi-process mode runs the GPU backend, and there is none: {why}");
        return ExitCode::from(1);
    }
    let rep = match run_rank(o) {
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
    }
    let d_bytes = (rep.selections * cfg.logical_dispatch_message_bytes()) as f64;
    let c_bytes = (rep.selections * cfg.logical_combine_message_bytes()) as f64;
    for t in &rep.timings {
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
        if let (0, Some((sizes, (dw, cw, dm, cm)))) = (rep.rank, t.wire) {
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
