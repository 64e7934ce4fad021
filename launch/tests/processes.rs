//! Real processes: the demo binary run by `spawn_local` (loopback only). Every wait is bounded.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ep_launch::{spawn_local_with, ExitHow, LaunchError, LaunchOptions, EXIT_PEER_FAILURE};

const DEMO: &str = env!("CARGO_BIN_EXE_ep-rdzv-demo");

fn opts() -> LaunchOptions {
    LaunchOptions {
        // Survivors fail on their own within milliseconds; a long grace shows that they did
        // (terminated_by_launcher stays false).
        grace: Duration::from_secs(20),
        term_grace: Duration::from_secs(2),
        echo: true,
        ..LaunchOptions::default()
    }
}

#[test]
fn demo_all_gathers_hostname_and_pid_among_1_2_4_processes() {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    for n in [1usize, 2, 4] {
        let launch = spawn_local_with(
            &opts(),
            n,
            DEMO,
            ["--rounds", "3", "--timeout-s", "30"],
            &[],
        )
        .unwrap();
        let pids = launch.pids().to_vec();
        let report = launch
            .wait(Duration::from_secs(90))
            .unwrap_or_else(|e| panic!("{n} ranks: {e}"));
        for rank in 0..n {
            let out = &report.output[rank];
            assert_eq!(report.exits[rank].how, ExitHow::Code(0));
            assert!(
                out.contains(&format!("rank {rank}: ok")),
                "rank {rank}: {out:?}"
            );
            for round in 0..3 {
                for (peer, pid) in pids.iter().enumerate() {
                    // Every rank saw every rank's real pid (the launcher's view of it).
                    let want = format!("rank {rank} round {round}: rank {peer} is {host} {pid}");
                    assert!(out.contains(&want), "rank {rank} lacks {want:?}: {out:?}");
                }
            }
            let token = format!("rank {rank}: broadcast token-from-{}", pids[0]);
            assert!(out.contains(&token), "rank {rank}: {out:?}");
        }
    }
}

/// Runs 4 ranks where `victim` dies after the first barrier by `flag`; returns the launcher's
/// error after checking that every survivor failed by itself, promptly, with PeerLost naming
/// the victim.
fn death_of(victim: usize, n: usize, flag: &str) -> LaunchError {
    let t0 = Instant::now();
    let v = victim.to_string();
    let launch = spawn_local_with(
        &opts(),
        n,
        DEMO,
        [flag, v.as_str(), "--timeout-s", "60"],
        &[],
    )
    .unwrap();
    let err = launch.wait(Duration::from_secs(120)).unwrap_err();
    let LaunchError::RankFailed {
        rank,
        exits,
        output,
        ..
    } = &err
    else {
        panic!("expected RankFailed, got {err}");
    };
    assert_eq!(*rank, victim, "{err}");
    let died_at = exits[victim].after;
    for e in exits.iter().filter(|e| e.rank != victim) {
        // Failed by itself (because of a peer), not killed by the launcher, with an error
        // naming itself and the victim.
        assert_eq!(e.how, ExitHow::Code(EXIT_PEER_FAILURE), "{e}");
        assert!(!e.terminated_by_launcher, "{e}");
        let want = format!(
            "rank {r}: error: rank {r}: peer rank {victim} lost during all_gather #2",
            r = e.rank
        );
        assert!(
            output[e.rank].iter().any(|l| l.starts_with(&want)),
            "rank {}: wanted {want:?} in {:?}",
            e.rank,
            output[e.rank]
        );
        // The timeout is 60 s; the loss is seen at once.
        let lag = e.after.saturating_sub(died_at);
        assert!(
            lag < Duration::from_secs(5),
            "rank {} failed {lag:?} after the death",
            e.rank
        );
    }
    // The whole run ended long before the rendezvous timeout or the launcher's grace.
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t0.elapsed()
    );
    err
}

fn victim_lines(err: &LaunchError) -> Vec<String> {
    match err {
        LaunchError::RankFailed { rank, output, .. } => output[*rank].clone(),
        _ => Vec::new(),
    }
}

#[test]
fn a_process_that_exits_after_the_first_barrier_fails_the_others_with_peer_lost() {
    let err = death_of(2, 4, "--die-after-barrier");
    assert!(
        matches!(
            err,
            LaunchError::RankFailed {
                how: ExitHow::Code(3),
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().starts_with("rank 2 exited with code 3"),
        "{err}"
    );
    let tail = victim_lines(&err);
    assert!(
        tail.iter()
            .any(|l| l.contains("dying after the first barrier")),
        "{tail:?}"
    );
}

#[test]
fn rank_0_dying_fails_the_others_with_peer_lost() {
    let err = death_of(0, 3, "--die-after-barrier");
    assert!(
        matches!(
            err,
            LaunchError::RankFailed {
                rank: 0,
                how: ExitHow::Code(3),
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_process_killed_by_a_signal_is_reported_with_the_signal() {
    let err = death_of(1, 2, "--abort-after-barrier");
    assert!(
        matches!(
            err,
            LaunchError::RankFailed {
                rank: 1,
                how: ExitHow::Signal(6),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("signal 6 (SIGABRT)"), "{err}");
}

#[test]
fn a_rank_killed_from_outside_mid_run_fails_the_other_promptly() {
    // What an operator (or the checker) does: kill -9 one rank of a running job.
    let t0 = Instant::now();
    let launch = spawn_local_with(
        &opts(),
        2,
        DEMO,
        ["--rounds", "100000", "--pause-ms", "5", "--timeout-s", "60"],
        &[],
    )
    .unwrap();
    let victim = launch.pids()[1];
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        Command::new("kill")
            .args(["-KILL", &victim.to_string()])
            .status()
            .map(|s| s.success())
    });
    let err = launch.wait(Duration::from_secs(120)).unwrap_err();
    assert!(
        killer.join().unwrap().unwrap(),
        "kill -KILL {victim} failed"
    );
    let LaunchError::RankFailed {
        rank,
        how,
        exits,
        output,
    } = &err
    else {
        panic!("expected RankFailed, got {err}");
    };
    assert_eq!((*rank, *how), (1, ExitHow::Signal(9)), "{err}");
    assert!(
        err.to_string()
            .starts_with("rank 1 was killed by signal 9 (SIGKILL)"),
        "{err}"
    );
    assert_eq!(exits[0].how, ExitHow::Code(EXIT_PEER_FAILURE), "{err}");
    assert!(!exits[0].terminated_by_launcher);
    assert!(
        output[0]
            .iter()
            .any(|l| l.starts_with("rank 0: error: rank 0: peer rank 1 lost during")),
        "{:?}",
        output[0]
    );
    let lag = exits[0].after.saturating_sub(exits[1].after);
    assert!(
        lag < Duration::from_secs(5),
        "rank 0 failed {lag:?} after the kill"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
}

/// Runs a command with a hard bound; returns (exit code, stdout, stderr).
fn run_bounded(cmd: &mut Command, limit: Duration) -> (Option<i32>, String, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("command did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn demo_without_launcher_env() -> Command {
    let mut c = Command::new(DEMO);
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "EP_LAUNCHER",
        "EP_RDZV_PORT",
        "TORCHELASTIC_RUN_ID",
    ] {
        c.env_remove(v);
    }
    c
}

#[test]
fn the_demo_launches_itself_with_nprocs_and_prefixes_lines() {
    let (code, out, _) = run_bounded(
        demo_without_launcher_env().args(["--nprocs", "3", "--timeout-s", "30"]),
        Duration::from_secs(90),
    );
    assert_eq!(code, Some(0), "{out}");
    for rank in 0..3 {
        assert!(
            out.contains(&format!("[rank {rank}] rank {rank}: ok\n")),
            "{out}"
        );
    }
    assert!(out.contains("all 3 ranks succeeded"), "{out}");

    // And when one rank dies, the self-launching demo exits non-zero naming it.
    let (code, _, err) = run_bounded(
        demo_without_launcher_env().args(["--nprocs", "2", "--die-after-barrier", "1"]),
        Duration::from_secs(90),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("rank 1 exited with code 3"), "{err}");
    assert!(
        err.contains("[rank 0] rank 0: error: rank 0: peer rank 1 lost during all_gather #2"),
        "{err}"
    );
}

#[test]
fn bad_environment_is_a_typed_error_naming_the_variable() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("RANK", "5"), ("WORLD_SIZE", "2")],
            "RANK=5 is out of range: must be below WORLD_SIZE=2",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")],
            "MASTER_PORT=\"99999\" is invalid",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "two")],
            "WORLD_SIZE=\"two\" is invalid",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "1")],
            "LOCAL_RANK is not set",
        ),
    ];
    for (vars, want) in cases {
        let mut c = demo_without_launcher_env();
        c.env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "29500");
        for (k, v) in *vars {
            c.env(k, v);
        }
        if *want == "LOCAL_RANK is not set" {
            c.env_remove("LOCAL_RANK");
        }
        let (code, _, err) = run_bounded(&mut c, Duration::from_secs(30));
        assert_eq!(code, Some(1), "{vars:?}: {err}");
        assert!(err.contains(want), "{vars:?}: wanted {want:?} in {err:?}");
    }
}
