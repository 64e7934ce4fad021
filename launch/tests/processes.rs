//! Real processes: the demo binary run by `spawn_local` (loopback only). Every wait is bounded.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
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
    without_launcher_env(DEMO)
}

fn without_launcher_env(program: &str) -> Command {
    let mut c = Command::new(program);
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
        "EP_JOB_TOKEN",
        "EP_RDZV_OPEN",
        "EP_JOB_ID",
        "EP_RDZV_LISTEN_FD",
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
fn an_absurd_nprocs_is_refused_naming_the_flag() {
    // `--nprocs 18446744073709551615` panicked inside spawn_local (exit 101).
    for n in ["18446744073709551615", "1025", "0", "-1", "abc"] {
        let (code, out, err) = run_bounded(
            demo_without_launcher_env().args(["--nprocs", n]),
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(1), "--nprocs {n}: {out}{err}");
        assert!(
            err.contains("--nprocs") && err.contains(n) && !err.contains("panicked"),
            "--nprocs {n}: {err}"
        );
    }
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

#[test]
fn a_multi_host_job_without_a_token_refuses_to_start() {
    // Rank 0 of a job whose MASTER_ADDR is not loopback (a documentation address: only a local
    // bind is ever attempted, no packet is sent). Without EP_JOB_TOKEN it refuses to start,
    // saying what to set; with a token, or EP_RDZV_OPEN=1, it gets past that check and fails
    // only at the bind (the address is not this host's).
    let base = |extra: &[(&str, &str)]| {
        let mut c = demo_without_launcher_env();
        c.env("RANK", "0")
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "192.0.2.1")
            .env("MASTER_PORT", "29500")
            .args(["--timeout-s", "5"]);
        for (k, v) in extra {
            c.env(k, v);
        }
        run_bounded(&mut c, Duration::from_secs(30))
    };
    let (code, _, err) = base(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("needs a shared secret: set EP_JOB_TOKEN") && err.contains("EP_RDZV_OPEN=1"),
        "{err}"
    );
    for extra in [
        &[("EP_RDZV_OPEN", "1")][..],
        &[("EP_JOB_TOKEN", "a-token-of-enough-length")][..],
    ] {
        let (code, _, err) = base(extra);
        assert_eq!(code, Some(2), "{extra:?}: {err}");
        assert!(!err.contains("EP_JOB_TOKEN"), "{extra:?}: {err}");
        assert!(
            err.contains("cannot listen on 192.0.2.1:29500"),
            "{extra:?}: {err}"
        );
    }
    // A token too short to be a secret is an environment error, and is not echoed.
    let (code, _, err) = base(&[("EP_JOB_TOKEN", "hunter2")]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("EP_JOB_TOKEN") && !err.contains("hunter2"),
        "{err}"
    );
}

/// Runs 3 demo ranks where rank 2 starts `delay_s` late (and rank 0 under `rank0_prefix`, a
/// shell prefix such as a `ulimit`), while `stranger(port)` runs against the rendezvous port.
/// Returns the launch result and what the stranger returned.
fn with_stranger<T: Send + 'static>(
    delay_s: &str,
    rank0_prefix: &str,
    stranger: impl FnOnce(u16) -> T + Send + 'static,
) -> (Result<ep_launch::LaunchReport, LaunchError>, T) {
    let script = format!(
        "if [ \"$RANK\" = 2 ]; then sleep {delay_s}; fi; \
         if [ \"$RANK\" = 0 ]; then {rank0_prefix} :; fi; \
         exec \"$0\" --rounds 2 --timeout-s 30"
    );
    let launch = spawn_local_with(
        &LaunchOptions {
            echo: false,
            ..opts()
        },
        3,
        "/bin/sh",
        ["-c", script.as_str(), DEMO],
        &[],
    )
    .unwrap();
    let port = launch.master_port();
    let s = std::thread::spawn(move || stranger(port));
    let r = launch.wait(Duration::from_secs(90));
    (r, s.join().unwrap())
}

#[test]
fn strangers_claiming_ranks_do_not_fail_a_launched_job() {
    // While rank 2 is late, a stranger keeps claiming rank 2 (and rank 1): with hellos that
    // carry no proof, and with hellos of the old protocol, which let the first claim win.
    let (r, attempts) = with_stranger("0.5", "", |port| {
        let t0 = Instant::now();
        let mut attempts = 0;
        while attempts < 200 && t0.elapsed() < Duration::from_millis(450) {
            attempts += 1;
            let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let rank = 1 + (attempts % 2) as u32;
            let (version, payload) = if attempts % 3 == 0 {
                (1u16, 3u32.to_le_bytes().to_vec())
            } else {
                let mut p = 3u32.to_le_bytes().to_vec();
                p.extend_from_slice(&[9u8; 64]);
                (2u16, p)
            };
            let mut f = b"EPRZ".to_vec();
            f.extend_from_slice(&version.to_le_bytes());
            f.extend_from_slice(&[1, 0]); // hello, connect
            f.extend_from_slice(&0u64.to_le_bytes());
            f.extend_from_slice(&rank.to_le_bytes());
            f.extend_from_slice(&(payload.len() as u64).to_le_bytes());
            f.extend_from_slice(&payload);
            let _ = s.write_all(&f);
            std::thread::sleep(Duration::from_millis(2));
        }
        attempts
    });
    assert!(
        attempts > 10,
        "the stranger got only {attempts} attempts in"
    );
    let report = r.unwrap_or_else(|e| panic!("the job failed: {e}"));
    for (rank, out) in report.output.iter().enumerate() {
        assert!(
            out.contains(&format!("rank {rank}: ok")),
            "rank {rank}: {out:?}"
        );
    }
}

#[test]
fn rank_0_out_of_descriptors_sheds_idle_connections_and_the_job_forms() {
    // Rank 0 may hold 40 descriptors; 90 idle connections arrive while rank 2 is late. accept
    // fails with EMFILE once the descriptors are gone: rank 0 must drop idle connections and
    // back off (not spin, not ignore it forever), so rank 2 still gets in.
    const FLOOD: usize = 90;
    let (r, closed) = with_stranger("1.5", "ulimit -n 40 &&", |port| {
        let mut conns = Vec::new();
        for _ in 0..FLOOD {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => {
                    s.set_nonblocking(true).unwrap();
                    conns.push(s);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        // Count those rank 0 closed before rank 2 arrives (the cap of 64 alone would close
        // at most FLOOD - 64 = 26 of them).
        std::thread::sleep(Duration::from_millis(1000));
        let mut closed = 0;
        let mut buf = [0u8; 512];
        for s in &mut conns {
            loop {
                match s.read(&mut buf) {
                    Ok(0) => {
                        closed += 1;
                        break;
                    }
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed += 1;
                        break;
                    }
                }
            }
        }
        closed
    });
    let report = r.unwrap_or_else(|e| panic!("the job failed: {e}"));
    assert_eq!(report.exits.len(), 3);
    assert!(
        closed > FLOOD - 64,
        "rank 0 closed only {closed} of {FLOOD}"
    );
}

/// A sustained connect flood on `port`: `threads` threads each keep up to `per_thread` silent
/// connections open, opening a new one as soon as rank 0 closes one, until the port refuses
/// connections (rank 0 formed its group and closed its listener) or `limit` passes. Returns the
/// connections opened.
fn sustained_flood(port: u16, threads: usize, per_thread: usize, limit: Duration) -> usize {
    let t0 = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            std::thread::spawn(move || {
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                let mut held: Vec<TcpStream> = Vec::new();
                let mut opened = 0;
                let mut buf = [0u8; 256];
                while t0.elapsed() < limit {
                    // Drop those rank 0 closed.
                    held.retain_mut(|s| match s.read(&mut buf) {
                        Ok(0) => false,
                        Ok(_) => true,
                        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                    });
                    if held.len() >= per_thread {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    match TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
                        Ok(s) => {
                            s.set_nonblocking(true).unwrap();
                            held.push(s);
                            opened += 1;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
                        Err(_) => {}
                    }
                }
                opened
            })
        })
        .collect();
    workers.into_iter().map(|w| w.join().unwrap()).sum()
}

/// "rank R/W connected in 1.2s" (the demo's line) as a duration.
fn connected_in(output: &[String], rank: usize) -> Duration {
    let line = output
        .iter()
        .find(|l| l.starts_with(&format!("rank {rank}/")) && l.contains("connected in"))
        .unwrap_or_else(|| panic!("rank {rank}: no connected line in {output:?}"));
    let t = line.split("connected in ").nth(1).unwrap();
    let t = t.split(' ').next().unwrap();
    let (num, unit) = t.split_at(t.find(|c: char| c.is_alphabetic()).unwrap());
    let v: f64 = num.parse().unwrap();
    Duration::from_secs_f64(match unit {
        "s" => v,
        "ms" => v / 1e3,
        "µs" | "us" => v / 1e6,
        "ns" => v / 1e9,
        u => panic!("unit {u} in {line}"),
    })
}

#[test]
fn real_ranks_join_promptly_while_rank_0_near_its_descriptor_limit_is_flooded() {
    // Rank 0 with 24-64 descriptors under a sustained connect flood: a real rank's join must
    // take about as long as without the flood (not up to 15 s, nor never, with the innocent rank
    // blamed). Rank 2 starts 0.3 s into the flood.
    for nofile in [24, 40, 64] {
        let prefix = format!("ulimit -n {nofile} &&");
        let (r, opened) = with_stranger("0.3", &prefix, |port| {
            sustained_flood(port, 4, 64, Duration::from_secs(20))
        });
        let report = r.unwrap_or_else(|e| panic!("nofile {nofile}: the job failed: {e}"));
        for rank in [1, 2] {
            let took = connected_in(&report.output[rank], rank);
            println!(
                "nofile {nofile}: rank {rank} joined in {took:?} ({opened} flood connections)"
            );
            assert!(
                took < Duration::from_secs(3),
                "nofile {nofile}: rank {rank} took {took:?} to join ({opened} flood connections)"
            );
        }
        assert!(
            opened > 50,
            "nofile {nofile}: the flood opened only {opened}"
        );
    }
}

#[test]
fn a_rank_0_with_one_descriptor_left_still_forms_the_job() {
    // Rank 0 uses up its descriptors but one (under a limit of 64): the listener it inherits
    // from the launcher is duplicated into that one and the inherited number closed, so exactly
    // one is free for rank 1's connection, and every other accept fails with EMFILE (Linux
    // reports it whether or not a connection waits). Rank 1, in the middle of its handshake,
    // must not be dropped for that.
    let launch = spawn_local_with(
        &LaunchOptions {
            echo: false,
            ..opts()
        },
        2,
        "/bin/sh",
        [
            "-c",
            "if [ \"$RANK\" = 0 ]; then ulimit -n 64; fi; \
             exec \"$0\" --exhaust-fds 0 --timeout-s 20",
            DEMO,
        ],
        &[],
    )
    .unwrap();
    let report = launch
        .wait(Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        report.output[0].iter().any(|l| l.contains("holding")),
        "{:?}",
        report.output[0]
    );
    assert!(
        report.output[1].contains(&"rank 1: ok".to_string()),
        "{:?}",
        report.output[1]
    );
}

#[test]
fn rank_0_that_cannot_accept_at_all_fails_naming_the_cause() {
    // Rank 0 alone, no descriptor left once it has bound its port, nothing in the handshake to
    // drop: after 5 s of EMFILE it gives up with an error naming the cause, instead of retrying
    // until its connect timeout (60 s) or forever.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Through sh, for the ulimit.
    let mut c = without_launcher_env("/bin/sh");
    c.env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .args([
            "-c",
            "ulimit -n 64; exec \"$0\" --exhaust-fds 0 --timeout-s 60",
            DEMO,
        ]);
    let t0 = Instant::now();
    let (code, out, err) = run_bounded(&mut c, Duration::from_secs(40));
    let took = t0.elapsed();
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(out.contains("holding"), "{out}");
    assert!(
        err.contains(&format!("cannot accept connections on 127.0.0.1:{port}"))
            && err.contains("os error 24"),
        "{err}"
    );
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(30),
        "took {took:?}"
    );
}
