//! Huge timeouts saturate (wait "forever") instead of panicking on
//! `Instant + Duration` or `Duration * n` overflow. Loopback only; every wait is bounded by the
//! test itself.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ep_launch::{spawn_local_with, LaunchOptions, Rendezvous, RendezvousConfig};

const DEMO: &str = env!("CARGO_BIN_EXE_ep-rdzv-demo");

fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("test body did not finish within {limit:?}"),
    }
}

#[test]
fn a_group_with_maximal_timeouts_works() {
    bounded(Duration::from_secs(60), || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let cfg = move |rank| RendezvousConfig::local(rank, 3, port, Duration::MAX);
        let peers: Vec<_> = (1..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let rd = Rendezvous::connect(&cfg(r))?;
                    rd.barrier("b")?;
                    rd.all_gather(&[r as u8])
                })
            })
            .collect();
        let r0 = Rendezvous::with_listener(&cfg(0), l).unwrap();
        r0.barrier("b").unwrap();
        let all = r0.all_gather(&[0]).unwrap();
        assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        r0.check_peers().unwrap();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), all);
        }
        drop(r0);
    });
}

#[test]
fn the_launcher_waits_with_a_maximal_timeout_and_grace() {
    bounded(Duration::from_secs(60), || {
        let opts = LaunchOptions {
            grace: Duration::MAX,
            term_grace: Duration::MAX,
            echo: false,
            ..LaunchOptions::default()
        };
        let l = spawn_local_with(&opts, 2, "/bin/sh", ["-c", "exit 0"], &[]).unwrap();
        let report = l.wait(Duration::MAX).unwrap();
        assert_eq!(report.exits.len(), 2);
    });
}

#[test]
fn the_demo_accepts_the_largest_timeout_flag() {
    let mut child = Command::new(DEMO)
        .args(["--nprocs", "2", "--timeout-s", "18446744073709551615"])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the demo did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "stdout {so}\nstderr {se}");
    assert!(so.contains("all 2 ranks succeeded"), "{so}");
    assert!(!se.contains("panicked"), "{se}");
}
