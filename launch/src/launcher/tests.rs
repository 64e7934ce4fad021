//! The launcher's tests: real child processes (shell scripts), their exits, the output prefix,
//! the inherited listener.

use super::*;

fn quiet() -> LaunchOptions {
    LaunchOptions {
        grace: Duration::from_millis(300),
        term_grace: Duration::from_millis(500),
        echo: false,
        ..LaunchOptions::default()
    }
}

#[test]
fn children_get_torchrun_variables_and_output_is_kept_per_rank() {
    let script = "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE a=$MASTER_ADDR p=$MASTER_PORT x=$EXTRA by=$EP_LAUNCHER\"; echo err-$RANK >&2";
    let l = spawn_local_with(
        &quiet(),
        3,
        "/bin/sh",
        ["-c", script],
        &[("EXTRA".into(), "yes".into())],
    )
    .unwrap();
    let port = l.master_port();
    let report = l.wait(Duration::from_secs(20)).unwrap();
    assert_eq!(report.exits.len(), 3);
    for (rank, out) in report.output.iter().enumerate() {
        let want = format!("r={rank} w=3 l={rank} lw=3 a=127.0.0.1 p={port} x=yes by=ep-launch");
        assert!(out.contains(&want), "rank {rank}: {out:?}");
        assert!(out.contains(&format!("err-{rank}")), "rank {rank}: {out:?}");
        assert_eq!(report.exits[rank].how, ExitHow::Code(0));
    }
    assert_eq!(prefix_line(2, "hi"), "[rank 2] hi\n");
}

#[test]
fn per_rank_variables_reach_their_rank_only_and_override() {
    let script = "echo \"r=$RANK node=${EP_NODE_ID-unset} x=$EXTRA l=$LOCAL_RANK\"";
    let opts = LaunchOptions {
        rank_env: vec![
            vec![("EP_NODE_ID".into(), "0".into())],
            vec![
                ("EP_NODE_ID".into(), "1".into()),
                ("EXTRA".into(), "mine".into()),
                ("LOCAL_RANK".into(), "0".into()),
            ],
        ],
        ..quiet()
    };
    let l = spawn_local_with(
        &opts,
        3,
        "/bin/sh",
        ["-c", script],
        &[("EXTRA".into(), "all".into())],
    )
    .unwrap();
    let report = l.wait(Duration::from_secs(20)).unwrap();
    let want = [
        "r=0 node=0 x=all l=0",
        "r=1 node=1 x=mine l=0",
        "r=2 node=unset x=all l=2",
    ];
    for (rank, w) in want.iter().enumerate() {
        let w = w.to_string();
        assert!(
            report.output[rank].contains(&w),
            "rank {rank}: {:?}",
            report.output[rank]
        );
    }
    // More entries than ranks, or a bad name in an entry: refused before anything starts.
    for rank_env in [
        vec![vec![]; 3],
        vec![vec![], vec![("A=B".to_string(), "x".to_string())]],
    ] {
        let o = LaunchOptions {
            rank_env,
            ..quiet()
        };
        assert!(matches!(
            spawn_local_with(&o, 2, "/bin/sh", ["-c", "exit 0"], &[]),
            Err(LaunchError::InvalidRequest { .. })
        ));
    }
}

#[test]
fn nonzero_exit_names_rank_and_code_and_the_rest_are_terminated() {
    let t0 = Instant::now();
    let l = spawn_local_with(
        &quiet(),
        3,
        "/bin/sh",
        [
            "-c",
            "if [ \"$RANK\" = 1 ]; then echo dying >&2; exit 7; fi; exec sleep 60",
        ],
        &[],
    )
    .unwrap();
    let err = l.wait(Duration::from_secs(30)).unwrap_err();
    let elapsed = t0.elapsed();
    match &err {
        LaunchError::RankFailed {
            rank,
            how,
            exits,
            output,
        } => {
            assert_eq!(*rank, 1);
            assert_eq!(*how, ExitHow::Code(7));
            assert_eq!(output[1], vec!["dying".to_string()]);
            for r in [0, 2] {
                assert!(exits[r].terminated_by_launcher, "{:?}", exits[r]);
                assert_eq!(exits[r].how, ExitHow::Signal(SIGTERM));
            }
        }
        other => panic!("expected RankFailed, got {other:?}"),
    }
    assert!(
        err.to_string().starts_with("rank 1 exited with code 7"),
        "{err}"
    );
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn a_rank_failing_because_of_a_peer_is_not_blamed() {
    // Rank 0 exits first, but with EXIT_PEER_FAILURE ("someone else failed"); rank 1 is the
    // real failure, later.
    let l = spawn_local_with(
        &LaunchOptions {
            grace: Duration::from_secs(5),
            ..quiet()
        },
        2,
        "/bin/sh",
        [
            "-c",
            "if [ \"$RANK\" = 0 ]; then exit 86; fi; sleep 0.3; exit 7",
        ],
        &[],
    )
    .unwrap();
    match l.wait(Duration::from_secs(30)).unwrap_err() {
        LaunchError::RankFailed {
            rank, how, exits, ..
        } => {
            assert_eq!((rank, how), (1, ExitHow::Code(7)));
            assert!(exits[0].after < exits[1].after, "{exits:?}");
        }
        other => panic!("expected RankFailed, got {other:?}"),
    }
}

#[test]
fn sigterm_ignoring_children_are_killed_and_timeout_is_reported() {
    let t0 = Instant::now();
    let l = spawn_local_with(
        &quiet(),
        2,
        "/bin/sh",
        ["-c", "trap '' TERM; while :; do sleep 0.1; done"],
        &[],
    )
    .unwrap();
    let err = l.wait(Duration::from_millis(500)).unwrap_err();
    match &err {
        LaunchError::Timeout { running, exits, .. } => {
            assert_eq!(running, &vec![0, 1]);
            for e in exits {
                assert!(e.terminated_by_launcher);
                assert_eq!(e.how, ExitHow::Signal(SIGKILL), "{e}");
            }
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn the_port_stays_bound_from_launch_to_rank_0() {
    // Rank 0 inherits the launcher's bound socket (EP_RDZV_LISTEN_FD); the others do not.
    // While the children run, nobody else can bind the port: with a pick-and-release port,
    // this bind succeeded and any process could take the port before rank 0.
    let script = "if [ -n \"$EP_RDZV_LISTEN_FD\" ]; then \
                  echo fd=$(readlink /proc/$$/fd/$EP_RDZV_LISTEN_FD); else echo fd=none; fi; \
                  echo token=${#EP_JOB_TOKEN}; sleep 1";
    let l = spawn_local_with(&quiet(), 2, "/bin/sh", ["-c", script], &[]).unwrap();
    let port = l.master_port();
    let taken = TcpListener::bind(("127.0.0.1", port));
    assert!(
        matches!(&taken, Err(e) if e.kind() == std::io::ErrorKind::AddrInUse),
        "port {port} was free for anyone: {taken:?}"
    );
    let report = l.wait(Duration::from_secs(20)).unwrap();
    assert!(
        report.output[0]
            .iter()
            .any(|x| x.starts_with("fd=socket:[")),
        "{:?}",
        report.output[0]
    );
    assert!(
        report.output[1].contains(&"fd=none".to_string()),
        "{:?}",
        report.output[1]
    );
    // Every child got the job's 64-character token.
    for out in &report.output {
        assert!(out.contains(&"token=64".to_string()), "{out:?}");
    }
}

/// Absurd process counts (`spawn_local(usize::MAX, ..)` would allocate that many output
/// tails) are a typed error naming nprocs, before anything starts.
#[test]
fn absurd_process_counts_are_typed_errors() {
    for n in [1025, 1 << 20, usize::MAX] {
        match spawn_local_with(&quiet(), n, "/bin/true", [""; 0], &[]) {
            Err(LaunchError::InvalidRequest { detail }) => {
                assert!(
                    detail.contains(&format!("nprocs {n}")) && detail.contains("1024"),
                    "{detail}"
                );
            }
            other => panic!("nprocs {n}: expected InvalidRequest, got {other:?}"),
        }
    }
}

#[test]
fn bad_requests_are_typed() {
    assert!(matches!(
        spawn_local(0, "/bin/true", [""; 0], &[]),
        Err(LaunchError::InvalidRequest { .. })
    ));
    assert!(matches!(
        spawn_local(1, "/bin/true", [""; 0], &[("A=B".into(), "x".into())]),
        Err(LaunchError::InvalidRequest { .. })
    ));
    match spawn_local(2, "/nonexistent/program", [""; 0], &[]) {
        Err(LaunchError::Spawn {
            rank: 0, program, ..
        }) => {
            assert_eq!(program, "/nonexistent/program")
        }
        other => panic!("expected Spawn error, got {other:?}"),
    }
}
