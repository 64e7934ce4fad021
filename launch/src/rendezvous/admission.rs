//! Rank 0's door: accepting connections, challenging them, and admitting only those that prove
//! they are ranks of this job, without letting strangers disturb the job or exhaust rank 0.
//!
//! - Every accepted connection is challenged at once (a fresh nonce) and must answer with a
//!   hello within [`Limits::handshake_timeout`](super::Limits::handshake_timeout); its buffer is
//!   bounded to one hello (`FrameLimits` of `Facing::Unidentified`).
//! - At most [`Limits::max_pending`](super::Limits::max_pending) connections wait in the
//!   handshake, and never more than rank 0 has descriptors for. When full, a new connection
//!   pushes out the oldest one if that one has had [`ANSWER_WINDOW`] to answer (a real rank
//!   answers within a round trip); otherwise the new one is closed at once. Either way the
//!   queue of connections waiting in the kernel drains as fast as they come, so a flood cannot
//!   keep a real rank waiting behind it: each try of a real rank is either taken (and answered
//!   within the window) or closed at once, and the rank reconnects.
//! - A hello that fails (garbage, a wrong or missing proof, a world size, rank or rank number
//!   that cannot be right) is refused: that connection gets a short report and is closed; the
//!   job goes on. Only a connection that proved it holds the job token and still disagrees is
//!   one of the job's own processes gone wrong: that fails the job.
//! - Out of descriptors: rank 0 keeps one in reserve (a duplicate of the listener). When
//!   `accept` fails for lack of descriptors (EMFILE, ENFILE), it frees the reserve and accepts
//!   again: nothing waiting means nothing to do (Linux reports EMFILE whether or not a
//!   connection waits, so a real rank in the middle of its handshake is not shed for it); a
//!   connection waiting is handled as at a full queue above, and the reserve is taken back.
//!   Without a reserve (or for lack of memory: ENOBUFS, ENOMEM), it sheds the oldest
//!   unidentified connection if it has been silent for [`SHED_AGE`], and backs off (1 ms
//!   doubling to 100 ms) instead of spinning; if no connection is in the handshake at all and
//!   it lasts [`ACCEPT_GIVE_UP`], it is an error naming the cause.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::auth::{self, Claim, Role, MAC_LEN, NONCE_LEN};
use crate::rendezvous::collective::Rendezvous;
use crate::rendezvous::config::RendezvousConfig;
use crate::rendezvous::error::{abort_payload, AbortKind, RendezvousError, Result};
use crate::rendezvous::frame::{
    encode, Facing, Frame, FrameLimits, Kind, Op, ADMIT_LEN, FLAG_TOKEN, HELLO_LEN, POLL_SLEEP,
};
use crate::rendezvous::link::{Fault, Link, SendFault};
use crate::rendezvous::seal::Seal;
use crate::time::{after, deadline};

/// Accepts taken per call, so one call stays short under a flood.
const ACCEPT_BATCH: usize = 16;
const MIN_BACKOFF: Duration = Duration::from_millis(1);
const MAX_BACKOFF: Duration = Duration::from_millis(100);
/// How long `accept` may keep failing for lack of resources, with nothing left to shed, before
/// rank 0 gives up.
pub(crate) const ACCEPT_GIVE_UP: Duration = Duration::from_secs(5);
/// How long a connection must have been in the handshake before it is shed for lack of
/// descriptors (a real rank answers its challenge within a round trip). At most a quarter of
/// the handshake timeout.
pub(crate) const SHED_AGE: Duration = Duration::from_millis(250);
/// How long a new connection has to answer its challenge before a newer one may push it out of
/// a full queue: a round trip and a scheduling delay, with room to spare. At most a quarter of
/// the handshake timeout.
pub(crate) const ANSWER_WINDOW: Duration = Duration::from_millis(20);

/// A connection in the handshake.
struct Pending {
    link: Link,
    nonce: [u8; NONCE_LEN],
    since: Instant,
    until: Instant,
}

/// What to do with a hello.
enum Verdict {
    Admit {
        rank: usize,
        client_nonce: [u8; NONCE_LEN],
    },
    /// Not one of ours (or not provably): close it, with this reason, and go on.
    Refuse { rank: Option<usize>, detail: String },
    /// One of ours, proven, and wrong: the job fails.
    Fatal(RendezvousError),
}

pub(crate) struct Door<'a> {
    cfg: &'a RendezvousConfig,
    addr: String,
    pending: VecDeque<Pending>,
    /// While `accept` fails for lack of resources: since when, and when to try again.
    starved_since: Option<Instant>,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// The descriptor held in reserve (a duplicate of the listener): freed to accept a
    /// connection when there is no other, taken back afterwards.
    spare: Option<TcpListener>,
    /// Counters, for tests and diagnostics.
    pub(crate) refused: usize,
    pub(crate) shed: usize,
}

/// Whether an `accept` error means this process or the system is out of descriptors (EMFILE
/// 24, ENFILE 23).
fn is_out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(24 | 23))
}

/// Whether an `accept` error means this process or the system is out of descriptors or memory.
fn is_exhaustion(e: &std::io::Error) -> bool {
    // EMFILE 24, ENFILE 23, ENOBUFS 105, ENOMEM 12 (Linux numbering; the kinds cover the rest).
    matches!(e.raw_os_error(), Some(24 | 23 | 105 | 12)) || e.kind() == ErrorKind::OutOfMemory
}

impl<'a> Door<'a> {
    pub(crate) fn new(cfg: &'a RendezvousConfig, addr: String) -> Self {
        Door {
            cfg,
            addr,
            pending: VecDeque::new(),
            starved_since: None,
            retry_at: None,
            backoff: MIN_BACKOFF,
            spare: None,
            refused: 0,
            shed: 0,
        }
    }

    /// Accepts waiting connections and challenges each. Returns whether anything happened;
    /// `Err` only when `accept` has failed for lack of resources for [`ACCEPT_GIVE_UP`] with
    /// nothing left to shed.
    pub(crate) fn accept(&mut self, listener: &TcpListener, now: Instant) -> Result<bool> {
        if self.retry_at.is_some_and(|t| now < t) {
            return Ok(false);
        }
        self.retry_at = None;
        if self.spare.is_none() {
            // Taken (back) whenever a descriptor is free, before any connection takes it.
            self.spare = listener.try_clone().ok();
        }
        let mut progress = false;
        for _ in 0..ACCEPT_BATCH {
            let e = match listener.accept() {
                Ok((stream, _)) => {
                    progress = true;
                    self.arrived(stream, now, false);
                    continue;
                }
                Err(e) => e,
            };
            // Out of descriptors: free the reserve and look again (is a connection waiting at
            // all?), then take the reserve back.
            let e = if is_out_of_descriptors(&e) && self.spare.take().is_some() {
                let again = listener.accept();
                let e = match again {
                    Ok((stream, _)) => {
                        progress = true;
                        self.arrived(stream, now, true);
                        None
                    }
                    Err(e) => Some(e),
                };
                self.spare = listener.try_clone().ok();
                match e {
                    None => continue,
                    Some(e) if e.kind() == ErrorKind::WouldBlock => {
                        // Out of descriptors with nothing waiting: look again shortly.
                        self.retry_at = Some(deadline(now, self.backoff));
                        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                        break;
                    }
                    Some(e) => e,
                }
            } else {
                e
            };
            match e.kind() {
                ErrorKind::WouldBlock => break,
                ErrorKind::Interrupted => {}
                _ if is_exhaustion(&e) => {
                    self.starved(&e, now)?;
                    break;
                }
                // The connection died between arrival and accept (ECONNABORTED, ...): only
                // that one is affected; take the next.
                _ => {}
            }
        }
        Ok(progress)
    }

    /// A connection taken from the listener (`via_reserve`: with the descriptor freed from the
    /// reserve, so one waiting connection must go for it to stay, unless none waits).
    fn arrived(&mut self, stream: TcpStream, now: Instant, via_reserve: bool) {
        self.starved_since = None;
        self.backoff = MIN_BACKOFF;
        let full = if via_reserve {
            !self.pending.is_empty()
        } else {
            self.pending.len() >= self.cfg.limits.max_pending
        };
        if full {
            self.make_room(stream, now);
        } else {
            self.challenge(stream, now);
        }
    }

    /// `accept` failed for lack of resources (`e`) with no reserve to free: sheds the oldest
    /// waiting connection if it has been silent for [`SHED_AGE`] and backs off; `Err` once it
    /// has lasted [`ACCEPT_GIVE_UP`] with nothing left to shed.
    fn starved(&mut self, e: &std::io::Error, now: Instant) -> Result<()> {
        let since = *self.starved_since.get_or_insert(now);
        let shed_age = SHED_AGE.min(self.cfg.limits.handshake_timeout / 4);
        let oldest_silent = self
            .pending
            .front()
            .is_some_and(|p| now.saturating_duration_since(p.since) >= shed_age);
        if oldest_silent {
            // A descriptor freed: the next attempt can take the next connection.
            self.pending.pop_front();
            self.shed += 1;
        } else if self.pending.is_empty() && now.saturating_duration_since(since) >= ACCEPT_GIVE_UP
        {
            return Err(RendezvousError::Accept {
                rank: 0,
                addr: self.addr.clone(),
                cause: format!(
                    "{e} for {:?} with no connection left to drop (raise the open-file limit, \
                     `ulimit -n`)",
                    now.saturating_duration_since(since)
                ),
            });
        }
        self.retry_at = Some(deadline(now, self.backoff));
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        Ok(())
    }

    /// A new connection at a full queue: it pushes out the oldest waiting one if that one has
    /// had [`ANSWER_WINDOW`] to answer, and is closed at once otherwise.
    fn make_room(&mut self, stream: TcpStream, now: Instant) {
        let window = ANSWER_WINDOW.min(self.cfg.limits.handshake_timeout / 4);
        let oldest_had_its_chance = self
            .pending
            .front()
            .is_some_and(|p| now.saturating_duration_since(p.since) >= window);
        if oldest_had_its_chance {
            self.pending.pop_front();
            self.shed += 1;
            self.challenge(stream, now);
        } else {
            // Closed before it is challenged: a real rank reconnects.
            drop(stream);
            self.shed += 1;
        }
    }

    /// Challenges a new connection; one that cannot take the challenge at once is dropped.
    fn challenge(&mut self, stream: TcpStream, now: Instant) {
        let Ok(nonce) = auth::random::<NONCE_LEN>() else {
            return;
        };
        let limits = FrameLimits {
            facing: Facing::Unidentified,
            world: self.cfg.world_size,
            max_blob: self.cfg.limits.max_blob,
        };
        let Ok(mut link) = Link::new(usize::MAX, stream, limits) else {
            return;
        };
        let flags = if self.cfg.token.is_some() {
            FLAG_TOKEN
        } else {
            0
        };
        let mut payload = vec![flags];
        payload.extend_from_slice(&nonce);
        // A fresh socket's send buffer takes these few bytes at once: no waiting (deadline now).
        if link
            .send(&encode(Kind::Challenge, Op::Connect, 0, 0, &payload), now)
            .is_ok()
        {
            self.pending.push_back(Pending {
                link,
                nonce,
                since: now,
                until: deadline(now, self.cfg.limits.handshake_timeout),
            });
        }
    }

    /// Reads every connection in the handshake once: admits into `slots` those that proved who
    /// they are, drops strangers and those past their deadline. Returns (progress, ranks
    /// admitted); `Err` when a proven rank of this job is in conflict (the job fails).
    pub(crate) fn admit(
        &mut self,
        now: Instant,
        slots: &mut [Option<Link>],
    ) -> Result<(bool, usize)> {
        let mut progress = false;
        let mut admitted = 0;
        let mut i = 0;
        while i < self.pending.len() {
            progress |= self.pending[i].link.pump();
            let p = &mut self.pending[i];
            let Some(hello) = p.link.inbox.pop_front() else {
                if p.link.fault.is_some() || now >= p.until {
                    // Garbage, a close, or silence past the deadline: not a rank of ours.
                    self.pending.remove(i);
                    progress = true;
                } else {
                    i += 1;
                }
                continue;
            };
            let Some(mut p) = self.pending.remove(i) else {
                break;
            };
            progress = true;
            match self.judge(&hello, &p.nonce, slots) {
                Verdict::Admit { rank, client_nonce } => {
                    let proof = self.cfg.token.as_ref().map_or([0u8; MAC_LEN], |t| {
                        auth::prove(t, Role::Admit, &self.claim(&p.nonce, &client_nonce, rank))
                    });
                    let bytes = encode(Kind::Admit, Op::Connect, 0, 0, &proof[..ADMIT_LEN]);
                    // A rank that cannot take its admission at once reconnects.
                    if p.link.send(&bytes, now).is_ok() {
                        // Every later frame on this connection is tagged under its key.
                        let claim = self.claim(&p.nonce, &client_nonce, rank);
                        let key = auth::session_key(self.cfg.token.as_ref(), &claim);
                        p.link.seal = Some(Seal::new(key, true));
                        p.link.peer = rank;
                        p.link.limits = FrameLimits {
                            facing: Facing::Member,
                            ..p.link.limits
                        };
                        slots[rank] = Some(p.link);
                        admitted += 1;
                    }
                }
                Verdict::Refuse { rank, detail } => {
                    self.refused += 1;
                    let msg = format!("rank 0 refused this connection: {detail}");
                    let mut payload = vec![AbortKind::Other as u8];
                    let culprit = rank.map_or(u32::MAX, |r| r.min(u32::MAX as usize) as u32);
                    payload.extend_from_slice(&culprit.to_le_bytes());
                    payload.extend_from_slice(msg.as_bytes());
                    // Best effort, no waiting: a real rank learns why; a stranger is closed.
                    let _ = p
                        .link
                        .send(&encode(Kind::Abort, Op::Connect, 0, 0, &payload), now);
                }
                Verdict::Fatal(err) => {
                    let bytes = encode(Kind::Abort, Op::Connect, 0, 0, &abort_payload(&err));
                    let _ = p.link.send(&bytes, now);
                    return Err(err);
                }
            }
        }
        Ok((progress, admitted))
    }

    fn claim<'c>(
        &'c self,
        server_nonce: &'c [u8; NONCE_LEN],
        client_nonce: &'c [u8; NONCE_LEN],
        rank: usize,
    ) -> Claim<'c> {
        Claim {
            server_nonce,
            client_nonce,
            rank: rank as u32,
            world: self.cfg.world_size as u32,
            job_id: &self.cfg.job_id,
        }
    }

    fn judge(&self, hello: &Frame, nonce: &[u8; NONCE_LEN], slots: &[Option<Link>]) -> Verdict {
        let world = self.cfg.world_size;
        if hello.kind != Kind::Hello || hello.op != Op::Connect || hello.payload.len() != HELLO_LEN
        {
            return Verdict::Refuse {
                rank: None,
                detail: "malformed hello".into(),
            };
        }
        let claimed = hello.src;
        let claimed_world = u32::from_le_bytes([
            hello.payload[0],
            hello.payload[1],
            hello.payload[2],
            hello.payload[3],
        ]);
        let mut client_nonce = [0u8; NONCE_LEN];
        client_nonce.copy_from_slice(&hello.payload[4..4 + NONCE_LEN]);
        let proof = &hello.payload[4 + NONCE_LEN..];
        // With a token, the proof comes first: nothing an unproven peer claims is believed, so
        // nothing it claims can fail the job or be blamed on a real rank.
        let proven = match &self.cfg.token {
            Some(t) => {
                let claim = Claim {
                    server_nonce: nonce,
                    client_nonce: &client_nonce,
                    rank: claimed as u32,
                    world: claimed_world,
                    job_id: &self.cfg.job_id,
                };
                if !auth::check(t, Role::Hello, &claim, proof) {
                    return Verdict::Refuse {
                        rank: Some(claimed),
                        detail: format!(
                            "the claim to be rank {claimed} carries no valid proof of the job \
                             token (EP_JOB_TOKEN and EP_JOB_ID must be the same on every rank)"
                        ),
                    };
                }
                true
            }
            None => false,
        };
        let problem = if claimed_world as usize != world {
            Some(format!(
                "rank {claimed} was started with world size {claimed_world}, rank 0 with {world}"
            ))
        } else if claimed == 0 || claimed >= world {
            Some(format!("a peer claims rank {claimed}, outside 1..{world}"))
        } else if slots[claimed].is_some() {
            Some(format!("two processes claim rank {claimed}"))
        } else {
            None
        };
        match problem {
            None => Verdict::Admit {
                rank: claimed,
                client_nonce,
            },
            Some(detail) if proven => Verdict::Fatal(RendezvousError::Protocol {
                rank: 0,
                peer: claimed.min(u32::MAX as usize),
                op: Op::Connect,
                seq: 0,
                detail,
            }),
            Some(detail) => Verdict::Refuse {
                rank: Some(claimed),
                detail,
            },
        }
    }
}

impl Rendezvous {
    pub(crate) fn accept_all(cfg: &RendezvousConfig, listener: TcpListener) -> Result<Self> {
        let rank = 0;
        let world = cfg.world_size;
        let deadline = after(cfg.connect_timeout);
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| cfg.addr_string());
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::Bind {
                rank,
                addr: addr.clone(),
                cause: e.to_string(),
            })?;

        let mut slots: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        // Connections accepted but not yet identified: capped, deadlined, hello-sized buffers.
        let mut door = Door::new(cfg, addr);
        let mut connected = 1;
        let fail = |slots: &mut Vec<Option<Link>>, err: RendezvousError| {
            let payload = abort_payload(&err);
            let bytes = encode(Kind::Abort, Op::Connect, 0, 0, &payload);
            let d = after(Duration::from_millis(100));
            for link in slots.iter_mut().flatten() {
                let _ = link.send(&bytes, d);
            }
            err
        };

        while connected < world {
            let now = Instant::now();
            let mut progress = match door.accept(&listener, now) {
                Ok(p) => p,
                Err(err) => return Err(fail(&mut slots, err)),
            };
            match door.admit(now, &mut slots) {
                Ok((p, n)) => {
                    progress |= p;
                    connected += n;
                }
                Err(err) => return Err(fail(&mut slots, err)),
            }
            // Ranks already in must stay alive while we wait for the rest.
            for link in slots.iter_mut().flatten() {
                progress |= link.pump();
                if let Some(Fault::Forged(detail)) = &link.fault {
                    let err = RendezvousError::Unauthenticated {
                        rank,
                        peer: link.peer,
                        detail: detail.clone(),
                    };
                    return Err(fail(&mut slots, err));
                }
                if let Some(Fault::Lost(cause)) | Some(Fault::Bad(cause)) = &link.fault {
                    let err = RendezvousError::PeerLost {
                        rank,
                        peer: link.peer,
                        op: Op::Connect,
                        seq: 0,
                        cause: cause.clone(),
                    };
                    return Err(fail(&mut slots, err));
                }
                if link.fault == Some(Fault::Clean) || !link.inbox.is_empty() {
                    let err = RendezvousError::PeerLost {
                        rank,
                        peer: link.peer,
                        op: Op::Connect,
                        seq: 0,
                        cause: "left (or aborted) before the group was formed".into(),
                    };
                    return Err(fail(&mut slots, err));
                }
            }
            if connected == world {
                break;
            }
            if Instant::now() >= deadline {
                let missing = (1..world).find(|&r| slots[r].is_none()).unwrap_or(1);
                let err = RendezvousError::Timeout {
                    rank,
                    peer: missing,
                    op: Op::Connect,
                    seq: 0,
                    timeout: cfg.connect_timeout,
                };
                return Err(fail(&mut slots, err));
            }
            if !progress {
                std::thread::sleep(POLL_SLEEP);
            }
        }
        // Strangers still in the handshake are dropped here; the listener closes on return.
        drop(door);

        let mut links: Vec<Link> = slots.into_iter().flatten().collect();
        let welcome = encode(
            Kind::Welcome,
            Op::Connect,
            0,
            0,
            &(world as u32).to_le_bytes(), // world <= u32::MAX (RendezvousConfig::validate)
        );
        let send_deadline = after(cfg.op_timeout.min(Duration::from_secs(10)));
        for i in 0..links.len() {
            if let Err(f) = links[i].send(&welcome, send_deadline) {
                let peer = links[i].peer;
                let err = match f {
                    SendFault::Lost(cause) => RendezvousError::PeerLost {
                        rank,
                        peer,
                        op: Op::Connect,
                        seq: 0,
                        cause,
                    },
                    SendFault::Timeout => RendezvousError::Timeout {
                        rank,
                        peer,
                        op: Op::Connect,
                        seq: 0,
                        timeout: cfg.op_timeout,
                    },
                };
                let mut slots: Vec<Option<Link>> = links.into_iter().map(Some).collect();
                return Err(fail(&mut slots, err));
            }
        }
        Ok(Self::from_links(cfg, links))
    }
}
