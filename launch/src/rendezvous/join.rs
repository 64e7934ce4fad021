//! A rank's side of the door: dialling rank 0 and the handshake on a fresh connection (rank
//! 0's challenge, this rank's hello with its proof, rank 0's admission with its proof). Rank 0's
//! side is [`super::admission`].

use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::auth::{self, Claim, Role, MAC_LEN, NONCE_LEN};
use crate::rendezvous::collective::{grace, Rendezvous};
use crate::rendezvous::config::RendezvousConfig;
use crate::rendezvous::error::{abort_error, RendezvousError, Result};
use crate::rendezvous::frame::{
    encode, Facing, FrameLimits, Kind, Op, ADMIT_LEN, CHALLENGE_LEN, FLAG_TOKEN, HELLO_LEN,
    POLL_SLEEP,
};
use crate::rendezvous::link::{Fault, Link, SendFault};
use crate::rendezvous::seal::Seal;
use crate::time::{after, deadline as deadline_at};

/// How a handshake attempt with rank 0 failed.
pub(crate) enum Handshake {
    /// Before rank 0 answered the hello: connect again (until the deadline).
    Retry(String),
    /// Rank 0 refused this rank, or failed to prove itself: give up.
    Fatal(RendezvousError),
}

/// Opens a TCP connection to rank 0 (any of its addresses), bounded by `deadline`.
pub(crate) fn dial(cfg: &RendezvousConfig, deadline: Instant) -> std::result::Result<Link, String> {
    let addrs = cfg.resolve()?;
    let mut err = String::new();
    for a in addrs {
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&a, budget) {
            Ok(s) => {
                let limits = FrameLimits {
                    facing: Facing::RootUnproven,
                    world: cfg.world_size,
                    max_blob: cfg.limits.max_blob,
                };
                return Link::new(0, s, limits).map_err(|e| e.to_string());
            }
            Err(e) => err = format!("{a}: {e}"),
        }
    }
    Err(err)
}

/// The handshake on a fresh connection to rank 0: its challenge, this rank's hello with its
/// proof, rank 0's admission with its proof. Returns the connection's session key
/// ([`auth::session_key`]); `Retry` when the connection fails before rank 0 has answered the
/// hello (rank 0 not up yet, or it dropped this connection to make room).
pub(crate) fn handshake(
    cfg: &RendezvousConfig,
    link: &mut Link,
    deadline: Instant,
) -> std::result::Result<[u8; MAC_LEN], Handshake> {
    let rank = cfg.rank;
    let unauth = |peer: usize, detail: String| {
        Handshake::Fatal(RendezvousError::Unauthenticated { rank, peer, detail })
    };
    let challenge_by = deadline.min(after(cfg.limits.handshake_timeout));
    let ch = link
        .next_frame(challenge_by)
        .map_err(|c| Handshake::Retry(format!("no challenge from rank 0: {c}")))?;
    match ch.kind {
        Kind::Challenge if ch.payload.len() == CHALLENGE_LEN => {}
        Kind::Abort => return Err(Handshake::Fatal(unproven_report(cfg, &ch.payload))),
        other => {
            return Err(Handshake::Retry(format!(
                "expected a challenge from rank 0, got {other:?}"
            )))
        }
    }
    let wants_token = ch.payload[0] & FLAG_TOKEN != 0;
    let mut server_nonce = [0u8; NONCE_LEN];
    server_nonce.copy_from_slice(&ch.payload[1..]);
    match (&cfg.token, wants_token) {
        (Some(_), false) => {
            return Err(unauth(
                0,
                "rank 0 runs without a job token but this rank has one: set the same \
                 EP_JOB_TOKEN on every rank"
                    .into(),
            ))
        }
        (None, true) => {
            return Err(unauth(
                rank,
                "rank 0 requires a job token and this rank has none: set the same \
                 EP_JOB_TOKEN on every rank"
                    .into(),
            ))
        }
        _ => {}
    }
    let client_nonce: [u8; NONCE_LEN] = auth::random().map_err(|e| {
        Handshake::Fatal(RendezvousError::InvalidConfig {
            rank,
            detail: e.to_string(),
        })
    })?;
    let claim = Claim {
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        rank: rank as u32,
        world: cfg.world_size as u32,
        job_id: &cfg.job_id,
    };
    let proof = cfg
        .token
        .as_ref()
        .map_or([0u8; MAC_LEN], |t| auth::prove(t, Role::Hello, &claim));
    let mut payload = Vec::with_capacity(HELLO_LEN);
    payload.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
    payload.extend_from_slice(&client_nonce);
    payload.extend_from_slice(&proof);
    let hello = encode(Kind::Hello, Op::Connect, 0, rank, &payload);
    link.send(&hello, challenge_by).map_err(|f| {
        Handshake::Retry(match f {
            SendFault::Lost(c) => c,
            SendFault::Timeout => "sending the hello timed out".into(),
        })
    })?;
    // Rank 0 answers a hello at once (admits or refuses); wait up to the connect deadline
    // so a slow answer is never mistaken for a drop.
    let ad = link
        .next_frame(deadline)
        .map_err(|c| Handshake::Retry(format!("rank 0 did not answer the hello: {c}")))?;
    match ad.kind {
        Kind::Admit if ad.payload.len() == ADMIT_LEN => {
            if let Some(t) = &cfg.token {
                if !auth::check(t, Role::Admit, &claim, &ad.payload) {
                    return Err(unauth(
                        0,
                        format!(
                            "the process at {} did not prove it holds the job token: it is \
                             not this job's rank 0 (or rank 0 has another EP_JOB_TOKEN or \
                             EP_JOB_ID); nothing was sent to it",
                            cfg.addr_string()
                        ),
                    ));
                }
            }
            Ok(auth::session_key(cfg.token.as_ref(), &claim))
        }
        // Refused (or the job failed) before rank 0 proved itself.
        Kind::Abort => Err(Handshake::Fatal(unproven_report(cfg, &ad.payload))),
        other => Err(Handshake::Fatal(RendezvousError::Protocol {
            rank,
            peer: 0,
            op: Op::Connect,
            seq: 0,
            detail: format!("expected an admission, got {other:?}"),
        })),
    }
}

/// What a failure report (`Abort`) from the endpoint this rank dialled means before that
/// endpoint has proved it holds the job token: nothing it says is believed. With a token, the
/// rank it names is not blamed (a stranger on the port could name any rank, and a launcher
/// would then blame that innocent rank); this rank fails naming itself, with the report's text
/// kept and marked unverified. That is also right when the report is true: rank 0 refuses a
/// rank before admitting it only for the rank's own fault (a wrong token, a world size or rank
/// that cannot be right, a second process with its rank), and a rank with a wrong token cannot
/// verify the real rank 0's proof either. Without a token nothing can be proved, and the
/// report is taken as it is (such a job trusts everyone who can reach the port).
fn unproven_report(cfg: &RendezvousConfig, payload: &[u8]) -> RendezvousError {
    let rank = cfg.rank;
    if cfg.token.is_none() {
        return abort_error(rank, 0, Op::Connect, 0, payload);
    }
    let text = payload
        .get(5..)
        .map_or_else(|| "a malformed report".into(), String::from_utf8_lossy);
    RendezvousError::Aborted {
        rank,
        peer: rank,
        reporter: 0,
        op: Op::Connect,
        seq: 0,
        detail: format!(
            "the process at {} turned this rank away, and has not proved it holds the job \
             token, so its report is not believed and blames no other rank: {text}",
            cfg.addr_string()
        ),
    }
}

impl Rendezvous {
    pub(crate) fn connect_to_root(cfg: &RendezvousConfig) -> Result<Self> {
        let rank = cfg.rank;
        let start = Instant::now();
        let deadline = deadline_at(start, cfg.connect_timeout);
        let connect_err = |cause: String| RendezvousError::Connect {
            rank,
            peer: 0,
            addr: cfg.addr_string(),
            timeout: cfg.connect_timeout,
            cause,
        };
        let mut last_error = String::from("no attempt made");
        let mut link = loop {
            if Instant::now() >= deadline {
                return Err(connect_err(last_error));
            }
            // Rank 0 may not be listening yet: the next try in a while. If it is up but closed
            // this connection (its queue was full, under a flood), at once: each try is a
            // chance at the next free place.
            let mut pause = Duration::from_millis(20);
            match dial(cfg, deadline) {
                Ok(mut link) => match handshake(cfg, &mut link, deadline) {
                    Ok(key) => {
                        // Rank 0 proved itself: from now on it may send collective results,
                        // each frame (both ways) tagged under the connection's key.
                        link.limits.facing = Facing::Root;
                        link.seal = Some(Seal::new(key, false));
                        break link;
                    }
                    Err(Handshake::Retry(cause)) => {
                        last_error = cause;
                        pause = Duration::from_millis(1);
                    }
                    Err(Handshake::Fatal(err)) => return Err(err),
                },
                Err(e) => last_error = e,
            }
            std::thread::sleep(pause);
        };

        // Wait to be welcomed: rank 0 answers once every rank is in, so allow it the whole
        // connect timeout plus a grace for the last rank's connection to arrive.
        let welcome_deadline = deadline_at(deadline, grace(cfg.connect_timeout));
        loop {
            let progress = link.pump();
            if let Some(frame) = link.inbox.pop_front() {
                return match frame.kind {
                    Kind::Welcome if frame.op == Op::Connect => {
                        Ok(Self::from_links(cfg, vec![link]))
                    }
                    Kind::Abort => Err(abort_error(rank, 0, Op::Connect, 0, &frame.payload)),
                    other => Err(RendezvousError::Protocol {
                        rank,
                        peer: 0,
                        op: Op::Connect,
                        seq: 0,
                        detail: format!("expected a welcome, got {other:?}"),
                    }),
                };
            }
            match &link.fault {
                Some(Fault::Bad(detail)) => {
                    return Err(RendezvousError::Protocol {
                        rank,
                        peer: 0,
                        op: Op::Connect,
                        seq: 0,
                        detail: detail.clone(),
                    })
                }
                Some(Fault::Forged(detail)) => {
                    return Err(RendezvousError::Unauthenticated {
                        rank,
                        peer: 0,
                        detail: detail.clone(),
                    })
                }
                Some(Fault::Lost(cause)) => {
                    return Err(RendezvousError::PeerLost {
                        rank,
                        peer: 0,
                        op: Op::Connect,
                        seq: 0,
                        cause: cause.clone(),
                    })
                }
                Some(Fault::Clean) => {
                    return Err(RendezvousError::PeerLost {
                        rank,
                        peer: 0,
                        op: Op::Connect,
                        seq: 0,
                        cause: "rank 0 left before welcoming this rank".into(),
                    })
                }
                None => {}
            }
            if Instant::now() >= welcome_deadline {
                return Err(RendezvousError::Timeout {
                    rank,
                    peer: 0,
                    op: Op::Connect,
                    seq: 0,
                    timeout: welcome_deadline.saturating_duration_since(start),
                });
            }
            if !progress {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }
}
