//! Strangers at the rendezvous port. A raw TCP client (std::net::TcpStream)
//! plays the stranger against a real rendezvous on 127.0.0.1; in every case the job's real ranks
//! still complete their all_gather and nobody real is blamed. Loops are bounded in count and
//! time; every test finishes by itself.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ep_launch::auth::JobToken;
use ep_launch::rendezvous::Limits;
use ep_launch::{Op, Rendezvous, RendezvousConfig, RendezvousError};

const WORLD: usize = 3;
/// The rendezvous protocol version (3: frames after the handshake carry a tag).
const VERSION: u16 = 3;
const HEADER: usize = 28;
const HELLO_LEN: usize = 4 + 32 + 32;
// Frame kinds on the wire.
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const DATA: u8 = 3;
const ABORT: u8 = 4;
const CHALLENGE: u8 = 6;
const ADMIT: u8 = 7;

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

fn token() -> JobToken {
    JobToken::new(*b"the-real-job-token-0123456789").unwrap()
}

fn cfg(rank: usize, port: u16) -> RendezvousConfig {
    RendezvousConfig::local(rank, WORLD, port, Duration::from_secs(20)).with_token(token())
}

/// One real rank: forms the group (rank 0 on `listener`), all-gathers its rank, and checks it
/// got every rank's.
fn real_rank(
    rank: usize,
    c: RendezvousConfig,
    listener: Option<TcpListener>,
) -> JoinHandle<Result<(), RendezvousError>> {
    std::thread::spawn(move || {
        let r = match listener {
            Some(l) => Rendezvous::with_listener(&c, l)?,
            None => Rendezvous::connect(&c)?,
        };
        let all = r.all_gather(&[rank as u8; 3])?;
        let want: Vec<Vec<u8>> = (0..WORLD).map(|p| vec![p as u8; 3]).collect();
        assert_eq!(all, want, "rank {rank}");
        r.barrier("done")?;
        Ok(())
    })
}

/// Rank 0 listening on a fresh port (the stranger can reach it at once).
fn start_rank0(
    c: impl FnOnce(u16) -> RendezvousConfig,
) -> (u16, JoinHandle<Result<(), RendezvousError>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (port, real_rank(0, c(port), Some(l)))
}

/// Every real rank must succeed: nobody real is blamed for what the strangers did.
fn all_succeed(ranks: Vec<JoinHandle<Result<(), RendezvousError>>>) {
    for (rank, h) in ranks.into_iter().enumerate() {
        if let Err(e) = h.join().expect("rank thread panicked") {
            panic!("real rank {rank} failed: {e}");
        }
    }
}

fn frame(version: u16, kind: u8, src: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = b"EPRZ".to_vec();
    v.extend_from_slice(&version.to_le_bytes());
    v.push(kind);
    v.push(0); // op: connect
    v.extend_from_slice(&0u64.to_le_bytes());
    v.extend_from_slice(&src.to_le_bytes());
    v.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// A hello for `rank` of a `world`-rank job with a made-up proof (a stranger has no token).
fn forged_hello(rank: u32, world: u32) -> Vec<u8> {
    let mut p = world.to_le_bytes().to_vec();
    p.extend_from_slice(&[0x5a; 32]); // client nonce
    p.extend_from_slice(&[0xa5; 32]); // "proof"
    assert_eq!(p.len(), HELLO_LEN);
    frame(VERSION, HELLO, rank, &p)
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Reads one frame: (kind, payload).
fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h)?;
    assert_eq!(&h[..4], b"EPRZ");
    let len = u64::from_le_bytes(h[20..28].try_into().unwrap());
    assert!(len <= 1 << 20, "a {len}-byte frame to a stranger");
    let mut p = vec![0u8; len as usize];
    s.read_exact(&mut p)?;
    Ok((h[6], p))
}

/// Reads rank 0's challenge: (token required, nonce).
fn challenge(s: &mut TcpStream) -> (bool, Vec<u8>) {
    let (kind, p) = read_frame(s).expect("a challenge");
    assert_eq!(kind, CHALLENGE);
    assert_eq!(p.len(), 33);
    (p[0] & 1 != 0, p[1..].to_vec())
}

/// Reads until rank 0 closes the connection (EOF or reset), at most `within`; returns the frame
/// kinds received meanwhile, or None if it stayed open.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let t0 = Instant::now();
    let mut kinds = Vec::new();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if t0.elapsed() > within {
                    return None;
                }
            }
            Err(_) => break, // reset: closed too
        }
    }
    // The frame kinds in what came before the close.
    let mut at = 0;
    while buf.len() >= at + HEADER {
        kinds.push(buf[at + 6]);
        let len = u64::from_le_bytes(buf[at + 20..at + 28].try_into().unwrap()) as usize;
        at += HEADER + len;
    }
    Some(kinds)
}

/// Refused: told why (an abort report) and closed, never welcomed, admitted or sent data.
fn assert_refused(s: &mut TcpStream, what: &str) {
    let kinds = closed_within(s, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("{what}: rank 0 kept the connection open"));
    for k in [WELCOME, ADMIT, DATA] {
        assert!(!kinds.contains(&k), "{what}: got frame kind {k}: {kinds:?}");
    }
}

#[test]
fn a_stranger_without_the_secret_cannot_take_a_rank() {
    bounded(Duration::from_secs(60), || {
        let (port, r0) = start_rank0(|p| cfg(0, p));
        // First in line, before any real rank: claims rank 1 with a made-up proof.
        let mut s = connect(port);
        let (wants_token, nonce) = challenge(&mut s);
        assert!(wants_token);
        assert_eq!(nonce.len(), 32);
        s.write_all(&forged_hello(1, WORLD as u32)).unwrap();
        let (kind, report) = read_frame(&mut s).unwrap();
        assert_eq!(kind, ABORT);
        let report = String::from_utf8_lossy(&report[5..]).into_owned();
        assert!(
            report.contains("refused") && report.contains("proof"),
            "{report}"
        );
        assert_refused(&mut s, "forged hello");
        // A stranger that does not wait for the challenge (speaking the old protocol, which
        // let the first hello for rank 2 take rank 2).
        let mut old = connect(port);
        let mut p = (WORLD as u32).to_le_bytes().to_vec();
        p.truncate(4);
        old.write_all(&frame(1, HELLO, 2, &p)).unwrap();
        assert_refused(&mut old, "version-1 hello");
        all_succeed(vec![
            r0,
            real_rank(1, cfg(1, port), None),
            real_rank(2, cfg(2, port), None),
        ]);
    });
}

#[test]
fn garbage_and_oversized_frames_are_dropped() {
    bounded(Duration::from_secs(60), || {
        let (port, r0) = start_rank0(|p| cfg(0, p));
        let mut http = connect(port);
        http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut noise = connect(port);
        let junk: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        noise.write_all(&junk).unwrap();
        // A well-formed header announcing a 1 GiB hello, then a stream of bytes: rank 0 must
        // close on the header, not buffer the stream.
        let mut huge = connect(port);
        let mut h = frame(VERSION, HELLO, 1, &[]);
        h[20..28].copy_from_slice(&(1u64 << 30).to_le_bytes());
        huge.write_all(&h).unwrap();
        let mut sent = 0usize;
        huge.set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        while sent < 8 << 20 {
            match huge.write(&[7u8; 64 << 10]) {
                Ok(n) => sent += n,
                Err(_) => break, // reset by rank 0, or a full window: either way, stop
            }
        }
        // A data frame before any hello.
        let mut early = connect(port);
        early.write_all(&frame(VERSION, DATA, 1, b"x")).unwrap();
        for (s, what) in [
            (&mut http, "http"),
            (&mut noise, "noise"),
            (&mut huge, "oversized hello"),
            (&mut early, "data first"),
        ] {
            assert_refused(s, what);
        }
        all_succeed(vec![
            r0,
            real_rank(1, cfg(1, port), None),
            real_rank(2, cfg(2, port), None),
        ]);
    });
}

#[test]
fn a_silent_client_is_dropped_at_the_handshake_deadline_and_blocks_nobody() {
    bounded(Duration::from_secs(60), || {
        let limits = Limits {
            handshake_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let (port, r0) = start_rank0(|p| RendezvousConfig {
            limits,
            ..cfg(0, p)
        });
        let t0 = Instant::now();
        let mut silent = connect(port);
        let _ = challenge(&mut silent);
        assert_refused(&mut silent, "silent client");
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(250),
            "dropped too early: {took:?}"
        );
        // Another silent one, while the real ranks join: they do not wait for it.
        let _quiet = connect(port);
        let t1 = Instant::now();
        all_succeed(vec![
            r0,
            real_rank(1, cfg(1, port), None),
            real_rank(2, cfg(2, port), None),
        ]);
        assert!(t1.elapsed() < Duration::from_secs(10), "{:?}", t1.elapsed());
    });
}

#[test]
fn a_flood_of_connections_is_capped_and_the_job_still_forms() {
    bounded(Duration::from_secs(90), || {
        const FLOOD: usize = 120;
        const CAP: usize = 8;
        let limits = Limits {
            max_pending: CAP,
            // Long: what closes the flood here is the cap, not the deadline.
            handshake_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let (port, r0) = start_rank0(|p| RendezvousConfig {
            limits,
            ..cfg(0, p)
        });
        let r1 = real_rank(1, cfg(1, port), None);
        let mut flood: Vec<TcpStream> = (0..FLOOD).map(|_| connect(port)).collect();
        for s in &flood {
            s.set_nonblocking(true).unwrap();
        }
        // Rank 0 holds at most CAP of them: the rest are closed, long before their deadline.
        let t0 = Instant::now();
        let mut closed = [false; FLOOD];
        let mut chunk = [0u8; 256];
        while closed.iter().filter(|&&c| c).count() < FLOOD - CAP {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "only {} of {FLOOD} closed",
                closed.iter().filter(|&&c| c).count()
            );
            for (i, s) in flood.iter_mut().enumerate() {
                if !closed[i] {
                    match s.read(&mut chunk) {
                        Ok(0) => closed[i] = true,
                        Ok(_) => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => closed[i] = true,
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The real rank 2 still gets in (rank 1 came before the flood and is in already).
        all_succeed(vec![r0, r1, real_rank(2, cfg(2, port), None)]);
        for s in &flood {
            let _ = s.shutdown(Shutdown::Both);
        }
    });
}

#[test]
fn duplicate_out_of_range_and_wrong_world_claims_of_strangers_are_refused() {
    bounded(Duration::from_secs(60), || {
        let (port, r0) = start_rank0(|p| cfg(0, p));
        let r1 = real_rank(1, cfg(1, port), None);
        // Let rank 1 be admitted, so the first claim below is a duplicate.
        std::thread::sleep(Duration::from_millis(300));
        for (rank, world, what) in [
            (1u32, WORLD as u32, "duplicate rank 1"),
            (7, WORLD as u32, "rank 7 of 3"),
            (0, WORLD as u32, "rank 0"),
            (u32::MAX, WORLD as u32, "rank 2^32-1"),
            (2, 5, "rank 2 of a 5-rank job"),
        ] {
            let mut s = connect(port);
            let _ = challenge(&mut s);
            s.write_all(&forged_hello(rank, world)).unwrap();
            assert_refused(&mut s, what);
        }
        all_succeed(vec![r0, r1, real_rank(2, cfg(2, port), None)]);
    });
}

#[test]
fn an_authenticated_duplicate_fails_the_job_naming_the_rank() {
    bounded(Duration::from_secs(60), || {
        // Both processes hold the token: one of the job's own launches went wrong. That is a
        // real error, named.
        let (port, r0) = start_rank0(|p| cfg(0, p));
        let a = real_rank(1, cfg(1, port), None);
        std::thread::sleep(Duration::from_millis(300));
        let b = real_rank(1, cfg(1, port), None);
        let e0 = r0.join().unwrap().unwrap_err();
        assert!(
            matches!(&e0, RendezvousError::Protocol { rank: 0, peer: 1, op: Op::Connect, detail, .. } if detail.contains("two processes claim rank 1")),
            "{e0}"
        );
        for h in [a, b] {
            let e = h.join().unwrap().unwrap_err();
            assert_eq!(e.peer(), Some(1), "{e}");
        }
    });
}

#[test]
fn a_rank_with_the_wrong_token_is_refused_at_once_and_blames_itself() {
    bounded(Duration::from_secs(60), || {
        let (port, r0) = start_rank0(|p| RendezvousConfig {
            connect_timeout: Duration::from_secs(2),
            ..cfg(0, p)
        });
        let t0 = Instant::now();
        let wrong = RendezvousConfig::local(1, WORLD, port, Duration::from_secs(20))
            .with_token(JobToken::new(*b"another-job-token-000000").unwrap());
        let e = Rendezvous::connect(&wrong).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert!(
            matches!(
                e,
                RendezvousError::Aborted {
                    rank: 1,
                    peer: 1,
                    reporter: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!e.is_caused_by_peer(), "{e}");
        assert!(e.to_string().contains("EP_JOB_TOKEN"), "{e}");
        // And without any token, this rank fails at once, saying so.
        let none = RendezvousConfig::local(1, WORLD, port, Duration::from_secs(20));
        let e = Rendezvous::connect(&none).unwrap_err();
        assert!(
            matches!(
                e,
                RendezvousError::Unauthenticated {
                    rank: 1,
                    peer: 1,
                    ..
                }
            ),
            "{e}"
        );
        // Rank 0 saw nobody real: it times out waiting for rank 1.
        let e0 = r0.join().unwrap().unwrap_err();
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
    });
}

/// A stranger that listens on the port instead of rank 0: it challenges, reads the hello and
/// admits with `admit` (it cannot compute the proof). Returns every byte it got after the hello.
fn impostor(flags: u8, admit: Vec<u8>) -> (u16, JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut p = vec![flags];
        p.extend_from_slice(&[1u8; 32]);
        s.write_all(&frame(VERSION, CHALLENGE, 0, &p)).unwrap();
        let mut after = Vec::new();
        if flags & 1 == 0 {
            // A rank with a token refuses an open rank 0 before saying hello.
            let _ = s.read_to_end(&mut after);
            return after;
        }
        let (kind, hello) = read_frame(&mut s).unwrap();
        assert_eq!((kind, hello.len()), (HELLO, HELLO_LEN));
        s.write_all(&frame(VERSION, ADMIT, 0, &admit)).unwrap();
        s.write_all(&frame(VERSION, WELCOME, 0, &(WORLD as u32).to_le_bytes()))
            .unwrap();
        let _ = s.read_to_end(&mut after);
        after
    });
    (port, h)
}

#[test]
fn a_rank_does_not_trust_a_stranger_listening_on_the_port() {
    bounded(Duration::from_secs(60), || {
        for (flags, what) in [(1u8, "claims a token"), (0u8, "runs open")] {
            let (port, fake) = impostor(flags, vec![0u8; 32]);
            let e = Rendezvous::connect(&cfg(1, port)).unwrap_err();
            assert!(
                matches!(
                    e,
                    RendezvousError::Unauthenticated {
                        rank: 1,
                        peer: 0,
                        ..
                    }
                ),
                "impostor that {what}: {e}"
            );
            // The rank sent nothing after its hello (no data, no IPC handles).
            let after = fake.join().unwrap();
            assert!(after.is_empty(), "impostor that {what} got {after:?}");
        }
    });
}

/// A stranger on the port that sends a failure report (an `Abort` naming rank 2 as the culprit)
/// instead of the challenge (`at_once`), or after reading the hello instead of an admission.
fn impostor_reporting_rank_2(at_once: bool) -> (u16, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if !at_once {
            let mut p = vec![1u8];
            p.extend_from_slice(&[1u8; 32]);
            s.write_all(&frame(VERSION, CHALLENGE, 0, &p)).unwrap();
            let (kind, _) = read_frame(&mut s).unwrap();
            assert_eq!(kind, HELLO);
        }
        // Kind "lost", culprit rank 2, a plausible message.
        let mut report = vec![1u8];
        report.extend_from_slice(&2u32.to_le_bytes());
        report.extend_from_slice(b"connection reset by peer");
        let _ = s.write_all(&frame(VERSION, ABORT, 0, &report));
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    (port, h)
}

#[test]
fn a_report_from_an_unproven_rank_0_blames_nobody_else() {
    // An Abort from the endpoint a rank dialled, before that endpoint has proved it holds the
    // job token, must not make the rank blame the rank the report names (exit 86 would make
    // the launcher blame an innocent rank 2). Nothing an unproven peer says is believed: the
    // rank fails, naming nobody but itself.
    bounded(Duration::from_secs(60), || {
        for at_once in [true, false] {
            let (port, fake) = impostor_reporting_rank_2(at_once);
            let c = RendezvousConfig {
                connect_timeout: Duration::from_secs(3),
                ..cfg(1, port)
            };
            let e = Rendezvous::connect(&c).unwrap_err();
            assert!(
                !e.is_caused_by_peer() && e.peer() != Some(2),
                "at once {at_once}: {e}"
            );
            assert!(
                e.to_string().contains("not proved"),
                "at once {at_once}: {e}"
            );
            fake.join().unwrap();
        }
    });
}

#[test]
fn a_rank_reads_an_admission_welcome_and_broadcast_sent_at_once() {
    // A rank 0 that holds the token (here: the test, computing the proofs and tags as the
    // protocol defines them) may send the admission, the welcome and a first broadcast back to
    // back; the rank must check the proof and then take the rest under the limits of a proven
    // rank 0, each frame checked against its tag.
    use hmac::{Hmac, Mac};
    let secret = b"the-real-job-token-0123456789";
    // HMAC-SHA256(token, label | server nonce | client nonce | rank 1 | world 2 | empty job id).
    let proof = |label: &[u8], server_nonce: &[u8], client_nonce: &[u8]| {
        let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(secret).unwrap();
        m.update(label);
        m.update(server_nonce);
        m.update(client_nonce);
        m.update(&1u32.to_le_bytes());
        m.update(&2u32.to_le_bytes());
        m.update(&0u64.to_le_bytes());
        m.finalize().into_bytes().to_vec()
    };
    // Frame `n` from rank 0 on a sealed connection: the length counts the tag, which is
    // HMAC-SHA256(key, direction 0 | n | header | payload).
    let sealed = |key: &[u8], n: u64, mut f: Vec<u8>| {
        let len = u64::from_le_bytes(f[20..28].try_into().unwrap()) + 32;
        f[20..28].copy_from_slice(&len.to_le_bytes());
        let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(key).unwrap();
        m.update(&[0]);
        m.update(&n.to_le_bytes());
        m.update(&f);
        f.extend_from_slice(&m.finalize().into_bytes());
        f
    };
    bounded(Duration::from_secs(60), move || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let blob: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let sent = blob.clone();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let server_nonce = [3u8; 32];
            let mut p = vec![1u8];
            p.extend_from_slice(&server_nonce);
            s.write_all(&frame(VERSION, CHALLENGE, 0, &p)).unwrap();
            let (kind, hello) = read_frame(&mut s).unwrap();
            assert_eq!(kind, HELLO);
            let client_nonce = &hello[4..36];
            let admit = proof(
                b"ep-launch rendezvous v3 admit\0",
                &server_nonce,
                client_nonce,
            );
            let key = proof(
                b"ep-launch rendezvous v3 session\0",
                &server_nonce,
                client_nonce,
            );
            let mut all = frame(VERSION, ADMIT, 0, &admit);
            let welcome = frame(VERSION, WELCOME, 0, &2u32.to_le_bytes());
            all.extend_from_slice(&sealed(&key, 0, welcome));
            let mut data = frame(VERSION, DATA, 0, &sent);
            data[7] = 2; // op: broadcast
            data[8..16].copy_from_slice(&1u64.to_le_bytes()); // seq 1
            all.extend_from_slice(&sealed(&key, 1, data));
            s.write_all(&all).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let c = RendezvousConfig::local(1, 2, port, Duration::from_secs(10)).with_token(token());
        let r = Rendezvous::connect(&c).unwrap();
        assert_eq!(r.broadcast(&[]).unwrap(), blob);
        drop(r);
        server.join().unwrap();
    });
}

/// What a relay between rank 1 and rank 0 does to the first `Data` frame it forwards one way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tamper {
    /// Flip a bit of the payload going to the rank (rank 0's broadcast: the NCCL unique id).
    FlipToRank,
    /// Flip a bit of the payload going to rank 0 (the rank's all_gather contribution).
    FlipToRoot,
    /// Forward the frame going to the rank twice.
    ReplayToRank,
}

/// Copies whole frames from `from` to `to` (the framing is the header's length: it covers
/// whatever follows the header), doing `alter` to the first `Data` frame.
fn forward_frames(mut from: TcpStream, mut to: TcpStream, alter: Option<Tamper>) {
    let mut done = false;
    loop {
        let mut h = [0u8; HEADER];
        if from.read_exact(&mut h).is_err() {
            let _ = to.shutdown(Shutdown::Write);
            return;
        }
        let len = u64::from_le_bytes(h[20..28].try_into().unwrap()) as usize;
        let mut p = vec![0u8; len];
        if from.read_exact(&mut p).is_err() {
            let _ = to.shutdown(Shutdown::Write);
            return;
        }
        let mut copies = 1;
        if h[6] == DATA && !done {
            done = true;
            match alter {
                Some(Tamper::FlipToRank | Tamper::FlipToRoot) => p[0] ^= 1,
                Some(Tamper::ReplayToRank) => copies = 2,
                None => {}
            }
        }
        for _ in 0..copies {
            if to.write_all(&h).and_then(|()| to.write_all(&p)).is_err() {
                return;
            }
        }
    }
}

/// A relay in the middle: listens on a port of its own for one rank, connects it to rank 0 at
/// `root_port`, and forwards both ways, tampering as told.
fn relay(root_port: u16, tamper: Tamper) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let Ok((rank, _)) = l.accept() else { return };
        let root = TcpStream::connect(("127.0.0.1", root_port)).unwrap();
        let (down, up) = match tamper {
            Tamper::FlipToRoot => (None, Some(tamper)),
            _ => (Some(tamper), None),
        };
        let (r2, root2) = (rank.try_clone().unwrap(), root.try_clone().unwrap());
        let a = std::thread::spawn(move || forward_frames(root2, r2, down));
        forward_frames(rank, root, up);
        let _ = a.join();
    });
    port
}

#[test]
fn a_relay_that_alters_or_replays_a_later_frame_is_caught_naming_the_peer() {
    // A relay in the middle must not be able to alter what the frames after the HMAC exchange
    // carry (the NCCL unique id, CUDA IPC handles): every such frame carries a tag under a key
    // derived from the exchange, and an altered, replayed or reordered frame is refused with an
    // authentication error naming the peer it came from.
    bounded(Duration::from_secs(60), || {
        let id = b"nccl-unique-id: 0123456789abcdef".to_vec();
        for tamper in [Tamper::FlipToRank, Tamper::FlipToRoot, Tamper::ReplayToRank] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = l.local_addr().unwrap().port();
            let via = relay(port, tamper);
            let sent = id.clone();
            let run = move |rank: usize, c: RendezvousConfig, l: Option<TcpListener>| {
                let id = sent.clone();
                std::thread::spawn(move || {
                    let r = match l {
                        Some(l) => Rendezvous::with_listener(&c, l)?,
                        None => Rendezvous::connect(&c)?,
                    };
                    let mine = if rank == 0 { id.as_slice() } else { &[] };
                    let mut got = vec![r.broadcast(mine)];
                    if tamper == Tamper::ReplayToRank {
                        got.push(r.broadcast(mine));
                    }
                    if tamper == Tamper::FlipToRoot {
                        got = vec![r.all_gather(&[rank as u8; 8]).map(|v| v.concat())];
                    }
                    got.into_iter().collect::<Result<Vec<_>, _>>()
                })
            };
            let ranks = [
                run(0, cfg(0, port), Some(l)),
                run(1, cfg(1, via), None),
                run(2, cfg(2, port), None),
            ];
            let res: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            let (victim, peer) = match tamper {
                Tamper::FlipToRoot => (0, 1),
                _ => (1, 0),
            };
            match &res[victim] {
                Err(
                    e @ RendezvousError::Unauthenticated {
                        rank,
                        peer: p,
                        detail,
                    },
                ) if *rank == victim && *p == peer => {
                    assert!(detail.contains("integrity"), "{tamper:?}: {e}");
                }
                other => panic!("{tamper:?}: rank {victim} got {other:?}"),
            }
            // Nobody took altered bytes for real ones: what any rank returned is genuine.
            for (rank, r) in res.iter().enumerate() {
                if let Ok(got) = r {
                    for blob in got {
                        let genuine = match tamper {
                            Tamper::FlipToRoot => (0..WORLD as u8).flat_map(|b| [b; 8]).collect(),
                            _ => id.clone(),
                        };
                        assert_eq!(blob, &genuine, "{tamper:?}: rank {rank}");
                    }
                }
            }
        }
    });
}
