//! The rendezvous among ranks that are threads of this process (loopback only). Every test runs
//! under a watchdog, so a hang fails the test instead of blocking the run.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ep_launch::auth::JobToken;
use ep_launch::{Op, Rendezvous, RendezvousConfig, RendezvousError};

/// Runs `f` on a thread and fails if it takes longer than `limit`.
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

/// A listener for rank 0 on a free loopback port, and the port.
fn listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let port = l.local_addr().unwrap().port();
    (l, port)
}

fn cfg(rank: usize, world: usize, port: u16, timeout: Duration) -> RendezvousConfig {
    RendezvousConfig::local(rank, world, port, timeout)
}

/// Forms a group of `world` threads, each building its own `Rendezvous` (rank 0 on the listener,
/// the others connecting to its port), and runs `body(rank, rdzv)` on each. Results in rank
/// order.
fn run_group<T, F>(world: usize, timeout: Duration, body: F) -> Vec<Result<T, RendezvousError>>
where
    T: Send + 'static,
    F: Fn(usize, Rendezvous) -> Result<T, RendezvousError> + Send + Sync + 'static,
{
    let (l, port) = listener();
    let body = Arc::new(body);
    let mut l = Some(l);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let body = Arc::clone(&body);
            let lis = if rank == 0 { l.take() } else { None };
            std::thread::spawn(move || {
                let c = cfg(rank, world, port, timeout);
                let r = match lis {
                    Some(lis) => Rendezvous::with_listener(&c, lis),
                    None => Rendezvous::connect(&c),
                };
                r.and_then(|rdzv| body(rank, rdzv))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

fn blob_of(rank: usize, round: usize) -> Vec<u8> {
    // Different lengths per rank (rank 0's is empty in round 0), contents depend on both.
    (0..rank * 37 + round)
        .map(|i| (i + rank * 7 + round) as u8)
        .collect()
}

#[test]
fn collectives_among_1_2_4_threads() {
    bounded(Duration::from_secs(60), || {
        for world in [1usize, 2, 4] {
            let results = run_group(world, Duration::from_secs(20), move |rank, rdzv| {
                assert_eq!((rdzv.rank(), rdzv.world_size()), (rank, world));
                assert_eq!(rdzv.next_seq(), 1);
                rdzv.barrier("start")?;
                for round in 0..20 {
                    let all = rdzv.all_gather(&blob_of(rank, round))?;
                    let want: Vec<Vec<u8>> = (0..world).map(|r| blob_of(r, round)).collect();
                    assert_eq!(all, want, "rank {rank} round {round}");
                    let b = rdzv.broadcast(
                        if rank == 0 {
                            format!("root-{round}").into_bytes()
                        } else {
                            b"ignored".to_vec()
                        }
                        .as_slice(),
                    )?;
                    assert_eq!(b, format!("root-{round}").into_bytes());
                }
                rdzv.barrier("end")?;
                Ok(rdzv.next_seq())
            });
            for (rank, r) in results.into_iter().enumerate() {
                // 1 barrier + 20 * (all_gather + broadcast) + 1 barrier = 42 calls.
                assert_eq!(
                    r.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}")),
                    43
                );
            }
        }
    });
}

#[test]
fn large_blobs_cross_in_both_directions() {
    bounded(Duration::from_secs(60), || {
        let results = run_group(4, Duration::from_secs(30), |rank, rdzv| {
            let mine = vec![rank as u8 + 1; 3 << 20];
            let all = rdzv.all_gather(&mine)?;
            let ok = all.len() == 4
                && all
                    .iter()
                    .enumerate()
                    .all(|(r, b)| b.len() == 3 << 20 && b.iter().all(|&x| x == r as u8 + 1));
            let big = rdzv.broadcast(&vec![0xAB; if rank == 0 { 5 << 20 } else { 0 }])?;
            Ok(ok && big.len() == 5 << 20 && big.iter().all(|&x| x == 0xAB))
        });
        for (rank, r) in results.into_iter().enumerate() {
            assert!(r.unwrap(), "rank {rank} got wrong data");
        }
    });
}

/// Forms a group of 4; every rank passes the first barrier; then `victim` does `leave` (drop,
/// abandon, ...) while the others call all_gather. Returns each survivor's error and how long it
/// took to arrive.
fn survivors_after(
    victim: usize,
    timeout: Duration,
    leave: fn(Rendezvous),
) -> Vec<(usize, RendezvousError, Duration)> {
    let results = run_group(4, timeout, move |rank, rdzv| {
        rdzv.barrier("start")?;
        if rank == victim {
            leave(rdzv);
            return Ok(None);
        }
        let t = Instant::now();
        match rdzv.all_gather(b"x") {
            Ok(_) => panic!("rank {rank}: all_gather succeeded without rank {victim}"),
            Err(e) => {
                let took = t.elapsed();
                // The group is broken from now on: the next call fails at once, naming the
                // same culprit.
                let again = rdzv.barrier("after").unwrap_err();
                assert!(
                    matches!(again, RendezvousError::Broken { .. }),
                    "rank {rank}: {again}"
                );
                assert_eq!(again.peer(), e.peer());
                Ok(Some((rank, e, took)))
            }
        }
    });
    results
        .into_iter()
        .filter_map(|r| r.expect("no rank may fail before the victim leaves"))
        .collect()
}

fn assert_peer_lost(victim: usize, got: &[(usize, RendezvousError, Duration)]) {
    assert_eq!(got.len(), 3);
    for (rank, err, took) in got {
        match err {
            RendezvousError::PeerLost {
                rank: r,
                peer,
                op,
                seq,
                ..
            } => {
                assert_eq!(
                    (*r, *peer, *op, *seq),
                    (*rank, victim, Op::AllGather, 2),
                    "{err}"
                );
            }
            other => panic!("rank {rank}: expected PeerLost of rank {victim}, got {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!(
                "rank {rank}: peer rank {victim} lost during all_gather #2"
            )),
            "{msg}"
        );
        // The timeout is 30 s: the loss must be seen long before it.
        assert!(*took < Duration::from_secs(3), "rank {rank} took {took:?}");
    }
}

#[test]
fn a_rank_that_crashes_is_reported_as_peer_lost_promptly() {
    bounded(Duration::from_secs(60), || {
        for victim in [2, 0] {
            let got = survivors_after(victim, Duration::from_secs(30), Rendezvous::abandon);
            assert_peer_lost(victim, &got);
        }
    });
}

#[test]
fn a_rank_that_drops_its_rendezvous_is_reported_as_peer_lost_promptly() {
    bounded(Duration::from_secs(60), || {
        for victim in [3, 0] {
            let got = survivors_after(victim, Duration::from_secs(30), drop);
            assert_peer_lost(victim, &got);
            for (_, err, _) in &got {
                assert!(err.to_string().contains("left the group"), "{err}");
            }
        }
    });
}

#[test]
fn a_hung_rank_times_out_and_everyone_names_it() {
    bounded(Duration::from_secs(60), || {
        let (failed_tx, failed_rx) = mpsc::channel::<()>();
        let failed_rx = std::sync::Mutex::new(failed_rx);
        let timeout = Duration::from_millis(800);
        let t0 = Instant::now();
        let results = run_group(4, timeout, move |rank, rdzv| {
            rdzv.barrier("start")?;
            if rank == 1 {
                // Alive (connections open) but never calls: hold on until the three others
                // have failed (bounded).
                let rx = failed_rx.lock().unwrap();
                for _ in 0..3 {
                    let _ = rx.recv_timeout(Duration::from_secs(20));
                }
                return Ok(None);
            }
            let e = rdzv.all_gather(b"x").unwrap_err();
            let _ = failed_tx.send(());
            Ok(Some(e))
        });
        let elapsed = t0.elapsed();
        let errs: Vec<_> = results.into_iter().filter_map(|r| r.unwrap()).collect();
        assert_eq!(errs.len(), 3);
        for err in &errs {
            assert_eq!(err.peer(), Some(1), "{err}");
        }
        assert!(
            matches!(
                errs[0],
                RendezvousError::Timeout {
                    rank: 0,
                    peer: 1,
                    op: Op::AllGather,
                    seq: 2,
                    ..
                }
            ),
            "{}",
            errs[0]
        );
        for err in &errs[1..] {
            assert!(
                matches!(
                    err,
                    RendezvousError::Aborted {
                        peer: 1,
                        reporter: 0,
                        op: Op::AllGather,
                        seq: 2,
                        ..
                    }
                ),
                "{err}"
            );
            assert!(err.to_string().contains("timed out"), "{err}");
        }
        assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
    });
}

#[test]
fn ranks_in_different_collectives_are_detected() {
    bounded(Duration::from_secs(60), || {
        let results = run_group(3, Duration::from_secs(20), |rank, rdzv| {
            let t = Instant::now();
            let e = if rank == 2 {
                rdzv.barrier("x").map(|_| ()).unwrap_err()
            } else {
                rdzv.all_gather(b"y").map(|_| ()).unwrap_err()
            };
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "rank {rank}: {:?}",
                t.elapsed()
            );
            Ok(e)
        });
        let errs: Vec<RendezvousError> = results.into_iter().map(Result::unwrap).collect();
        match &errs[0] {
            RendezvousError::Protocol {
                rank: 0,
                peer: 2,
                op: Op::AllGather,
                seq: 1,
                detail,
            } => {
                assert!(detail.contains("barrier #1"), "{detail}")
            }
            other => panic!("rank 0: {other}"),
        }
        for e in &errs[1..] {
            assert_eq!(e.peer(), Some(2), "{e}");
        }
    });
}

#[test]
fn barrier_tags_must_match() {
    bounded(Duration::from_secs(60), || {
        let results = run_group(2, Duration::from_secs(20), |rank, rdzv| {
            Ok(rdzv
                .barrier(if rank == 0 { "epoch-1" } else { "epoch-2" })
                .unwrap_err())
        });
        let errs: Vec<RendezvousError> = results.into_iter().map(Result::unwrap).collect();
        assert_eq!(
            errs[0],
            RendezvousError::BarrierMismatch {
                rank: 0,
                peer: 1,
                seq: 1,
                tag: "epoch-1".into(),
                peer_tag: "epoch-2".into()
            }
        );
        assert_eq!(errs[1].peer(), Some(0));
    });
}

#[test]
fn connect_timeouts_name_the_missing_rank() {
    bounded(Duration::from_secs(60), || {
        // World of 3, rank 2 never comes.
        let (l, port) = listener();
        let timeout = Duration::from_millis(700);
        let t0 = Instant::now();
        let r1 = std::thread::spawn(move || Rendezvous::connect(&cfg(1, 3, port, timeout)));
        let e0 = Rendezvous::with_listener(&cfg(0, 3, port, timeout), l).unwrap_err();
        let e1 = r1.join().unwrap().unwrap_err();
        assert_eq!(
            e0,
            RendezvousError::Timeout {
                rank: 0,
                peer: 2,
                op: Op::Connect,
                seq: 0,
                timeout
            }
        );
        assert_eq!(e1.peer(), Some(2), "{e1}");
        assert!(t0.elapsed() < Duration::from_secs(5));

        // Nobody listening: a connect error naming rank 0 and the address, at the deadline.
        let (l, port) = listener();
        drop(l);
        let t0 = Instant::now();
        let e = Rendezvous::connect(&cfg(1, 2, port, timeout)).unwrap_err();
        assert!(
            matches!(&e, RendezvousError::Connect { rank: 1, peer: 0, addr, .. } if *addr == format!("127.0.0.1:{port}")),
            "{e}"
        );
        let took = t0.elapsed();
        assert!(took >= timeout && took < Duration::from_secs(5), "{took:?}");
    });
}

#[test]
fn world_size_disagreement_is_refused() {
    bounded(Duration::from_secs(60), || {
        // Both hold the job token: the disagreement is proven to come from the job's own rank 1,
        // so it fails the job, promptly, on both sides.
        let token = JobToken::new(*b"world-size-test-token").unwrap();
        let (l, port) = listener();
        let t = Duration::from_secs(10);
        let t0 = Instant::now();
        let tk = token.clone();
        let r1 =
            std::thread::spawn(move || Rendezvous::connect(&cfg(1, 3, port, t).with_token(tk)));
        let e0 = Rendezvous::with_listener(&cfg(0, 2, port, t).with_token(token), l).unwrap_err();
        let e1 = r1.join().unwrap().unwrap_err();
        assert!(
            matches!(&e0, RendezvousError::Protocol { rank: 0, peer: 1, op: Op::Connect, detail, .. } if detail.contains("world size 3")),
            "{e0}"
        );
        assert!(
            matches!(e1, RendezvousError::Aborted { rank: 1, .. }),
            "{e1}"
        );
        assert!(e1.to_string().contains("world size 3"), "{e1}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());

        // Without a token nothing proves the claim comes from the job: rank 0 refuses that
        // connection (which learns why at once) and keeps waiting for a real rank 1.
        let (l, port) = listener();
        let t = Duration::from_millis(1500);
        let r1 = std::thread::spawn(move || {
            let t0 = Instant::now();
            (Rendezvous::connect(&cfg(1, 3, port, t)), t0.elapsed())
        });
        let e0 = Rendezvous::with_listener(&cfg(0, 2, port, t), l).unwrap_err();
        let (e1, took1) = r1.join().unwrap();
        let e1 = e1.unwrap_err();
        assert!(
            matches!(
                e0,
                RendezvousError::Timeout {
                    rank: 0,
                    peer: 1,
                    op: Op::Connect,
                    ..
                }
            ),
            "{e0}"
        );
        assert!(
            matches!(
                e1,
                RendezvousError::Aborted {
                    rank: 1,
                    peer: 1,
                    ..
                }
            ),
            "{e1}"
        );
        assert!(e1.to_string().contains("world size 3"), "{e1}");
        assert!(took1 < Duration::from_secs(1), "{took1:?}");
    });
}

#[test]
fn stray_connections_are_ignored() {
    bounded(Duration::from_secs(60), || {
        let (l, port) = listener();
        let t = Duration::from_secs(10);
        // A stranger connects first and speaks HTTP; another connects and says nothing.
        let mut stray = TcpStream::connect(("127.0.0.1", port)).unwrap();
        std::io::Write::write_all(&mut stray, b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let r1 = std::thread::spawn(move || {
            let r = Rendezvous::connect(&cfg(1, 2, port, t))?;
            r.all_gather(b"one")
        });
        let r0 = Rendezvous::with_listener(&cfg(0, 2, port, t), l).unwrap();
        let all = r0.all_gather(b"zero").unwrap();
        assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
        assert_eq!(r1.join().unwrap().unwrap(), all);
    });
}

#[test]
fn check_peers_sees_a_death_and_rank_0_relays_it() {
    bounded(Duration::from_secs(60), || {
        let (l, port) = listener();
        let t = Duration::from_secs(20);
        let r1 = std::thread::spawn(move || Rendezvous::connect(&cfg(1, 3, port, t)));
        let r2 = std::thread::spawn(move || Rendezvous::connect(&cfg(2, 3, port, t)));
        let r0 = Rendezvous::with_listener(&cfg(0, 3, port, t), l).unwrap();
        let r1 = r1.join().unwrap().unwrap();
        let r2 = r2.join().unwrap().unwrap();
        r0.check_peers().unwrap();
        r1.check_peers().unwrap();

        r2.abandon();
        let poll_until_err = |r: &Rendezvous| {
            let t0 = Instant::now();
            loop {
                if let Err(e) = r.check_peers() {
                    return (e, t0.elapsed());
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "rank {}: no error",
                    r.rank()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        let (e0, took0) = poll_until_err(&r0);
        assert!(
            matches!(
                e0,
                RendezvousError::PeerLost {
                    rank: 0,
                    peer: 2,
                    op: Op::CheckPeers,
                    ..
                }
            ),
            "{e0}"
        );
        let (e1, took1) = poll_until_err(&r1);
        assert!(
            matches!(&e1, RendezvousError::PeerLost { rank: 1, peer: 2, cause, .. } if cause.contains("reported by rank 0")),
            "{e1}"
        );
        assert!(took0 < Duration::from_secs(2) && took1 < Duration::from_secs(2));
    });
}

#[test]
fn a_clean_exit_is_not_a_failure_for_check_peers() {
    bounded(Duration::from_secs(60), || {
        let results = run_group(2, Duration::from_secs(20), |rank, rdzv| {
            rdzv.barrier("done")?;
            if rank == 1 {
                return Ok(());
            }
            // Give rank 1 time to drop (and say goodbye), then look.
            std::thread::sleep(Duration::from_millis(200));
            rdzv.check_peers()?;
            // But a collective needs it: that fails, naming it.
            let e = rdzv.all_gather(b"z").unwrap_err();
            assert!(
                matches!(
                    e,
                    RendezvousError::PeerLost {
                        rank: 0,
                        peer: 1,
                        ..
                    }
                ),
                "{e}"
            );
            Ok(())
        });
        for r in results {
            r.unwrap();
        }
    });
}

#[test]
fn blobs_above_the_limit_fail_naming_the_sender() {
    bounded(Duration::from_secs(60), || {
        let (l, port) = listener();
        let t = Duration::from_secs(10);
        let small = ep_launch::rendezvous::Limits {
            max_blob: 1000,
            ..Default::default()
        };
        let c = move |rank| RendezvousConfig {
            limits: small,
            ..cfg(rank, 2, port, t)
        };
        // Rank 1 tries a blob above its own limit: refused before anything is sent, and the
        // group learns who failed.
        let r1 = std::thread::spawn(move || {
            let r = Rendezvous::connect(&c(1))?;
            Ok::<_, RendezvousError>(r.all_gather(&[1u8; 1001]).unwrap_err())
        });
        let r0 = Rendezvous::with_listener(&c(0), l).unwrap();
        let e0 = r0.all_gather(b"zero").unwrap_err();
        let e1 = r1.join().unwrap().unwrap();
        assert!(
            matches!(
                e1,
                RendezvousError::BlobTooLarge {
                    rank: 1,
                    op: Op::AllGather,
                    seq: 1,
                    len: 1001,
                    limit: 1000
                }
            ),
            "{e1}"
        );
        assert_eq!(e0.peer(), Some(1), "{e0}");

        // A rank whose limit is larger than rank 0's: rank 0 refuses the frame on its header
        // (it never buffers the blob) and names the sender.
        let (l, port) = listener();
        let r1 = std::thread::spawn(move || {
            let r = Rendezvous::connect(&cfg(1, 2, port, t))?;
            r.all_gather(&[1u8; 5000])
        });
        let r0 = Rendezvous::with_listener(
            &RendezvousConfig {
                limits: small,
                ..cfg(0, 2, port, t)
            },
            l,
        )
        .unwrap();
        let e0 = r0.all_gather(b"zero").unwrap_err();
        assert!(
            matches!(&e0, RendezvousError::Protocol { rank: 0, peer: 1, detail, .. } if detail.contains("exceeds the limit 1000")),
            "{e0}"
        );
        assert_eq!(r1.join().unwrap().unwrap_err().peer(), Some(1));
    });
}

#[test]
fn a_bracketed_ipv6_master_addr_resolves_and_the_group_forms() {
    // `MASTER_ADDR=[::1]` passes the loopback check and resolves, on rank 0 (bind) and on the
    // others (connect): no "cannot resolve [::1]:port".
    bounded(Duration::from_secs(60), || {
        let port = match TcpListener::bind("[::1]:0") {
            Ok(l) => l.local_addr().unwrap().port(),
            Err(e) => {
                println!("SKIPPED: no IPv6 loopback here ({e})");
                return;
            }
        };
        let t = Duration::from_secs(20);
        let v6 = |rank| RendezvousConfig {
            master_addr: "[::1]".into(),
            ..cfg(rank, 2, port, t)
        };
        let c1 = v6(1);
        let r1 = std::thread::spawn(move || {
            let r = Rendezvous::connect(&c1)?;
            r.all_gather(b"one")
        });
        let c0 = v6(0);
        assert!(c0.is_loopback());
        let r0 = Rendezvous::connect(&c0).unwrap_or_else(|e| panic!("rank 0: {e}"));
        let want = vec![b"zero".to_vec(), b"one".to_vec()];
        assert_eq!(r0.all_gather(b"zero").unwrap(), want);
        assert_eq!(
            r1.join().unwrap().unwrap_or_else(|e| panic!("rank 1: {e}")),
            want
        );
        // Brackets around anything but an IPv6 literal are refused up front, naming the address.
        for bad in ["[127.0.0.1]", "[localhost]", "[::1", "::1]", "[]"] {
            let c = RendezvousConfig {
                master_addr: bad.into(),
                ..cfg(1, 2, port, t)
            };
            let e = Rendezvous::connect(&c).unwrap_err();
            assert!(
                matches!(&e, RendezvousError::InvalidConfig { rank: 1, detail } if detail.contains(bad)),
                "{bad}: {e}"
            );
        }
    });
}
