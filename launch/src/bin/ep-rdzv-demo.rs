//! Rendezvous demo: every rank all-gathers "hostname pid" and prints what it got.
//!
//! ```text
//! ep-rdzv-demo --nprocs 4                 # spawns 4 local ranks itself (ep-launch)
//! torchrun --nproc-per-node 4 --no-python ep-rdzv-demo   # or any torchrun-style launcher
//! ```
//!
//! Options (for the failure tests): `--die-after-barrier R` (rank R exits with code 3 right after
//! the first barrier, without closing its rendezvous: a crash as the others see it),
//! `--abort-after-barrier R` (rank R calls `abort()`: killed by SIGABRT), `--rounds K`
//! (all_gathers after the barrier, default 2), `--exhaust-fds R` (rank R uses up its file
//! descriptors but one before the rendezvous, so its `accept` fails with EMFILE), `--pause-ms P` (sleep after each round, so a test can
//! kill a rank mid-run), `--timeout-s S` (connect and per-call timeout,
//! default 60).
//!
//! Exit codes: 0 success, 1 bad usage or environment, 2 rendezvous error (or, when self-launched,
//! a rank failed), 3 the deliberate death, `EXIT_PEER_FAILURE` (86) a rendezvous error caused by
//! another rank.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use ep_launch::{is_launched_externally, ProcessConfig, Rendezvous};

struct Args {
    nprocs: Option<usize>,
    die_after_barrier: Option<usize>,
    abort_after_barrier: Option<usize>,
    exhaust_fds: Option<usize>,
    rounds: usize,
    pause: Duration,
    timeout: Duration,
}

fn parse_args() -> Result<(Args, Vec<String>), String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let mut a = Args {
        nprocs: None,
        die_after_barrier: None,
        abort_after_barrier: None,
        exhaust_fds: None,
        rounds: 2,
        pause: Duration::ZERO,
        timeout: Duration::from_secs(60),
    };
    let mut passthrough = Vec::new();
    let mut it = raw.into_iter();
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or_else(|| format!("{name} needs a value"))?;
            v.parse::<u64>()
                .map_err(|e| format!("{name} {v:?}: expected a non-negative integer ({e})"))
        };
        match flag.as_str() {
            "--nprocs" => {
                let n = value("--nprocs")?;
                match usize::try_from(n) {
                    Ok(n @ 1..=ep_launch::MAX_NPROCS) => a.nprocs = Some(n),
                    _ => {
                        return Err(format!(
                            "--nprocs {n}: give 1 to {} local processes",
                            ep_launch::MAX_NPROCS
                        ))
                    }
                }
            }
            "--die-after-barrier" => a.die_after_barrier = Some(value(&flag)? as usize),
            "--abort-after-barrier" => a.abort_after_barrier = Some(value(&flag)? as usize),
            "--exhaust-fds" => a.exhaust_fds = Some(value(&flag)? as usize),
            "--rounds" => a.rounds = value(&flag)? as usize,
            "--pause-ms" => a.pause = Duration::from_millis(value(&flag)?),
            "--timeout-s" => a.timeout = Duration::from_secs(value(&flag)?.max(1)),
            "-h" | "--help" => {
                return Err(
                    "usage: ep-rdzv-demo [--nprocs N] [--rounds K] [--timeout-s S] \
                            [--die-after-barrier R] [--abort-after-barrier R]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    // The children's arguments: everything but --nprocs, rebuilt from the parsed values.
    if let Some(r) = a.die_after_barrier {
        passthrough.extend(["--die-after-barrier".to_string(), r.to_string()]);
    }
    if let Some(r) = a.exhaust_fds {
        passthrough.extend(["--exhaust-fds".to_string(), r.to_string()]);
    }
    if let Some(r) = a.abort_after_barrier {
        passthrough.extend(["--abort-after-barrier".to_string(), r.to_string()]);
    }
    passthrough.extend(["--rounds".to_string(), a.rounds.to_string()]);
    passthrough.extend(["--timeout-s".to_string(), a.timeout.as_secs().to_string()]);
    passthrough.extend(["--pause-ms".to_string(), a.pause.as_millis().to_string()]);
    Ok((a, passthrough))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
}

fn main() -> ExitCode {
    let (args, child_args) = match parse_args() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("ep-rdzv-demo: {e}");
            return ExitCode::from(1);
        }
    };

    if !is_launched_externally() {
        let n = args.nprocs.unwrap_or(1);
        let exe = match std::env::current_exe() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("ep-rdzv-demo: cannot find own executable: {e}");
                return ExitCode::from(1);
            }
        };
        let launch = match ep_launch::spawn_local(n, &exe, &child_args, &[]) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("ep-rdzv-demo: {e}");
                return ExitCode::from(1);
            }
        };
        // Bounded: connecting plus the calls, with room to spare.
        let calls = u32::try_from(args.rounds.saturating_add(4)).unwrap_or(u32::MAX);
        let bound = args
            .timeout
            .saturating_mul(calls)
            .saturating_add(Duration::from_secs(30));
        return match launch.wait(bound) {
            Ok(_) => {
                println!("ep-rdzv-demo: all {n} ranks succeeded");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ep-rdzv-demo: {e}");
                ExitCode::from(2)
            }
        };
    }

    let pc = match ProcessConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ep-rdzv-demo: {e}");
            return ExitCode::from(1);
        }
    };
    let rank = pc.rank;
    match run(&pc, &args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {rank}: error: {e}");
            if e.is_caused_by_peer() {
                // Another rank failed first: let the launcher blame it, not us.
                ExitCode::from(ep_launch::EXIT_PEER_FAILURE as u8)
            } else {
                ExitCode::from(2)
            }
        }
    }
}

/// Opens `/dev/null` until the descriptor limit is reached, then frees one (for the listener
/// rank 0 takes over). The files stay open until the process exits. Bounded by the limit itself
/// and by a cap of 1 << 20.
fn exhaust_fds() -> usize {
    let mut held = Vec::new();
    while held.len() < 1 << 20 {
        match std::fs::File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(_) => break,
        }
    }
    held.pop();
    let n = held.len();
    std::mem::forget(held);
    n
}

fn run(pc: &ProcessConfig, args: &Args) -> Result<(), ep_launch::RendezvousError> {
    if args.exhaust_fds == Some(pc.rank) {
        println!(
            "rank {}: holding {} descriptors, as told",
            pc.rank,
            exhaust_fds()
        );
    }
    let t0 = Instant::now();
    let rdzv = Rendezvous::connect(&pc.rendezvous_config(args.timeout, args.timeout))?;
    let rank = rdzv.rank();
    println!(
        "rank {rank}/{} connected in {:.1?} (local rank {})",
        rdzv.world_size(),
        t0.elapsed(),
        pc.local_rank
    );
    rdzv.barrier("start")?;
    if args.die_after_barrier == Some(rank) {
        println!("rank {rank}: dying after the first barrier, as told");
        // No destructors: the rendezvous never says goodbye, as in a crash.
        std::process::exit(3);
    }
    if args.abort_after_barrier == Some(rank) {
        println!("rank {rank}: aborting after the first barrier, as told");
        std::process::abort();
    }
    let me = format!("{} {}", hostname(), std::process::id());
    for round in 0..args.rounds {
        let t = Instant::now();
        let all = rdzv.all_gather(me.as_bytes())?;
        let el = t.elapsed();
        for (peer, blob) in all.iter().enumerate() {
            println!(
                "rank {rank} round {round}: rank {peer} is {}",
                String::from_utf8_lossy(blob)
            );
        }
        println!("rank {rank} round {round}: all_gather took {el:.1?}");
        std::thread::sleep(args.pause);
    }
    let token = rdzv.broadcast(format!("token-from-{}", std::process::id()).as_bytes())?;
    println!("rank {rank}: broadcast {}", String::from_utf8_lossy(&token));
    rdzv.barrier("end")?;
    println!("rank {rank}: ok");
    Ok(())
}
