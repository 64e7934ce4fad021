//! The formed group ([`Rendezvous`]): forming it (rank 0 admits, the others join:
//! [`crate::rendezvous::admission`], [`crate::rendezvous::join`]) and its collectives
//! (`all_gather`, `broadcast`, `barrier`), every wait bounded, every failure relayed.

use std::net::{Shutdown, TcpListener};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::rendezvous::config::RendezvousConfig;
use crate::rendezvous::error::{abort_error, abort_payload, RendezvousError, Result};
use crate::rendezvous::frame::{
    decode_blobs, encode, encode_blobs, Kind, Op, MAX_PAYLOAD, POLL_SLEEP,
};
use crate::rendezvous::link::{Fault, Link, SendFault};
use crate::time::{after, deadline as deadline_at};

pub(crate) struct Inner {
    /// Sequence number of the last call started (0: connecting).
    pub(crate) seq: u64,
    /// Rank 0: links to ranks 1..world_size, in rank order. Others: the one link to rank 0.
    pub(crate) links: Vec<Link>,
    /// The first failure; the group refuses further calls once set.
    pub(crate) broken: Option<RendezvousError>,
}

/// A connected group of `world_size` processes (or threads). `Sync`: the collectives take
/// `&self` and are serialized by an internal lock; every rank must call the same collectives in
/// the same order.
pub struct Rendezvous {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) op_timeout: Duration,
    pub(crate) max_blob: usize,
    pub(crate) inner: Mutex<Inner>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("op_timeout", &self.op_timeout)
            .finish_non_exhaustive()
    }
}

impl Rendezvous {
    /// Forms the group: rank 0 binds `master_addr:master_port` and waits for every other rank;
    /// the others connect to it, retrying until `connect_timeout`. Returns once all
    /// `world_size` ranks are connected (this call is also a barrier).
    pub fn connect(cfg: &RendezvousConfig) -> Result<Self> {
        cfg.validate()?;
        #[cfg(unix)]
        if let (0, Some(fd)) = (cfg.rank, cfg.inherited_listener) {
            match crate::inherit::take(fd, cfg.master_port) {
                Ok(Some(listener)) => return Self::accept_all(cfg, listener),
                // Taken by an earlier rendezvous of this process: bind as usual.
                Ok(None) => {}
                Err(cause) => {
                    return Err(RendezvousError::Bind {
                        rank: 0,
                        addr: cfg.addr_string(),
                        cause,
                    })
                }
            }
        }
        if cfg.rank == 0 {
            let addrs = cfg.resolve().map_err(|cause| RendezvousError::Bind {
                rank: 0,
                addr: cfg.addr_string(),
                cause,
            })?;
            let listener = TcpListener::bind(&addrs[..]).map_err(|e| RendezvousError::Bind {
                rank: 0,
                addr: cfg.addr_string(),
                cause: e.to_string(),
            })?;
            Self::accept_all(cfg, listener)
        } else {
            Self::connect_to_root(cfg)
        }
    }

    /// Rank 0 with a listener the caller already bound (so a test or launcher can pick a free
    /// port with `bind("127.0.0.1:0")` without a race). `cfg.rank` must be 0.
    pub fn with_listener(cfg: &RendezvousConfig, listener: TcpListener) -> Result<Self> {
        cfg.validate()?;
        if cfg.rank != 0 {
            return Err(RendezvousError::InvalidConfig {
                rank: cfg.rank,
                detail: "only rank 0 listens".into(),
            });
        }
        Self::accept_all(cfg, listener)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Sets the bound of every later collective call: e.g. a generous one while a group forms
    /// (kernels compile, NCCL connects), then the job's own wait bound once it runs, so that a
    /// peer lost at a barrier is reported within that bound rather than the set-up's. Zero is
    /// refused ([`RendezvousError::InvalidConfig`]).
    pub fn set_op_timeout(&mut self, timeout: Duration) -> Result<()> {
        if timeout.is_zero() {
            return Err(RendezvousError::InvalidConfig {
                rank: self.rank,
                detail: "op_timeout must be nonzero".into(),
            });
        }
        self.op_timeout = timeout;
        Ok(())
    }

    /// The bound of every collective call.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// The sequence number the next collective call will carry.
    pub fn next_seq(&self) -> u64 {
        self.lock().seq + 1
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave Inner half-updated in a way that matters:
        // the worst case is a group that fails its next call, which it reports.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn from_links(cfg: &RendezvousConfig, links: Vec<Link>) -> Self {
        Rendezvous {
            rank: cfg.rank,
            world_size: cfg.world_size,
            op_timeout: cfg.op_timeout,
            max_blob: cfg.limits.max_blob,
            inner: Mutex::new(Inner {
                seq: 0,
                links,
                broken: None,
            }),
        }
    }

    /// Every rank contributes `blob`; every rank gets all `world_size` blobs, in rank order.
    /// Blobs may differ in length (empty is fine).
    pub fn all_gather(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather_op(Op::AllGather, blob)
    }

    /// Rank 0's `blob` on every rank. The other ranks' `blob` arguments are ignored (pass `&[]`).
    pub fn broadcast(&self, blob: &[u8]) -> Result<Vec<u8>> {
        let mut inner = self.lock();
        let seq = self.begin(&mut inner, Op::Broadcast)?;
        let r = if self.rank == 0 && blob.len() > self.max_blob {
            Err(self.too_large(Op::Broadcast, seq, blob.len()))
        } else if self.rank == 0 {
            // Look at the links first, so a peer known to be dead fails this call.
            self.poll_faults(&mut inner, Op::Broadcast, seq)
                .and_then(|()| {
                    let bytes = encode(Kind::Data, Op::Broadcast, seq, 0, blob);
                    self.send_all(&mut inner, &bytes, Op::Broadcast, seq)?;
                    Ok(blob.to_vec())
                })
        } else {
            self.collect(&mut inner, Op::Broadcast, seq)
                .map(|mut v| v.pop().unwrap_or_default())
        };
        self.finish(&mut inner, Op::Broadcast, seq, r)
    }

    /// Waits until every rank reaches the barrier with the same `tag`. A rank at a barrier with
    /// another tag, or in another collective, fails every rank with an error naming it.
    pub fn barrier(&self, tag: &str) -> Result<()> {
        let tags = self.gather_op(Op::Barrier, tag.as_bytes())?;
        for (peer, t) in tags.iter().enumerate() {
            if t.as_slice() != tag.as_bytes() {
                let err = RendezvousError::BarrierMismatch {
                    rank: self.rank,
                    peer,
                    seq: self.lock().seq,
                    tag: tag.to_string(),
                    peer_tag: String::from_utf8_lossy(t).into_owned(),
                };
                self.lock().broken = Some(err.clone());
                return Err(err);
            }
        }
        Ok(())
    }

    /// Looks at the connections without waiting: fails if a peer died or a failure was reported,
    /// succeeds otherwise (also when a peer left cleanly). Meant for a watchdog thread that polls
    /// while the data plane (GPU kernels) runs, to abort instead of waiting for a dead peer. A
    /// failure rank 0 sees is relayed to the other ranks, whose next `check_peers` sees it.
    pub fn check_peers(&self) -> Result<()> {
        let mut inner = self.lock();
        let seq = inner.seq;
        if let Some(first) = &inner.broken {
            return Err(RendezvousError::Broken {
                rank: self.rank,
                op: Op::CheckPeers,
                seq,
                first: Box::new(first.clone()),
            });
        }
        let r = self.poll_faults(&mut inner, Op::CheckPeers, seq);
        self.finish(&mut inner, Op::CheckPeers, seq, r)
    }

    /// Closes the connections abruptly, without the goodbye a clean drop sends: the peers see
    /// what they would see if this process crashed. For failure tests (feature `testing`).
    #[cfg(feature = "testing")]
    pub fn abandon(self) {
        // Dropping the streams closes them; Drop then finds no link to say goodbye on.
        self.lock().links.clear();
    }

    // -- internals ------------------------------------------------------------------------

    pub(crate) fn too_large(&self, op: Op, seq: u64, len: usize) -> RendezvousError {
        RendezvousError::BlobTooLarge {
            rank: self.rank,
            op,
            seq,
            len,
            limit: self.max_blob,
        }
    }

    pub(crate) fn begin(&self, inner: &mut Inner, op: Op) -> Result<u64> {
        inner.seq += 1;
        let seq = inner.seq;
        if let Some(first) = &inner.broken {
            return Err(RendezvousError::Broken {
                rank: self.rank,
                op,
                seq,
                first: Box::new(first.clone()),
            });
        }
        Ok(seq)
    }

    /// Records a failure, reports it to the peers that can still hear it (rank 0: everyone,
    /// others: rank 0, which relays), and returns it.
    pub(crate) fn finish<T>(&self, inner: &mut Inner, op: Op, seq: u64, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(err) => {
                if inner.broken.is_none() {
                    inner.broken = Some(err.clone());
                    let bytes = encode(Kind::Abort, op, seq, self.rank, &abort_payload(&err));
                    let d = after(Duration::from_millis(200));
                    for link in inner.links.iter_mut() {
                        // A peer that sent garbage is still there and is told too; one whose
                        // connection is gone is not.
                        let gone = matches!(link.fault, Some(Fault::Lost(_) | Fault::Clean));
                        if !gone && Some(link.peer) != err.peer_if_lost() {
                            let _ = link.send(&bytes, d);
                        }
                    }
                }
                Err(err)
            }
        }
    }

    pub(crate) fn gather_op(&self, op: Op, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut inner = self.lock();
        let seq = self.begin(&mut inner, op)?;
        let r = if blob.len() > self.max_blob {
            Err(self.too_large(op, seq, blob.len()))
        } else if self.rank == 0 {
            self.collect(&mut inner, op, seq).and_then(|rest| {
                let mut all = Vec::with_capacity(self.world_size);
                all.push(blob.to_vec());
                all.extend(rest);
                let payload = encode_blobs(&all);
                if payload.len() as u64 > MAX_PAYLOAD {
                    return Err(RendezvousError::Protocol {
                        rank: 0,
                        peer: 0,
                        op,
                        seq,
                        detail: format!(
                            "gathered {} bytes, above the frame limit {MAX_PAYLOAD}",
                            payload.len()
                        ),
                    });
                }
                let bytes = encode(Kind::Data, op, seq, 0, &payload);
                self.send_all(&mut inner, &bytes, op, seq)?;
                Ok(all)
            })
        } else {
            let bytes = encode(Kind::Data, op, seq, self.rank, blob);
            let deadline = after(self.op_timeout);
            self.send_to(&mut inner, 0, &bytes, op, seq, deadline)
                .and_then(|()| self.collect(&mut inner, op, seq))
                .and_then(|mut v| {
                    let payload = v.pop().unwrap_or_default();
                    let all = decode_blobs(&payload).map_err(|detail| RendezvousError::Protocol {
                        rank: self.rank,
                        peer: 0,
                        op,
                        seq,
                        detail,
                    })?;
                    if all.len() != self.world_size || all[self.rank] != blob {
                        return Err(RendezvousError::Protocol {
                            rank: self.rank,
                            peer: 0,
                            op,
                            seq,
                            detail: format!(
                                "rank 0 returned {} blobs for world size {}, or not this rank's own blob",
                                all.len(),
                                self.world_size
                            ),
                        });
                    }
                    Ok(all)
                })
        };
        self.finish(&mut inner, op, seq, r)
    }

    pub(crate) fn send_to(
        &self,
        inner: &mut Inner,
        idx: usize,
        bytes: &[u8],
        op: Op,
        seq: u64,
        deadline: Instant,
    ) -> Result<()> {
        let link = &mut inner.links[idx];
        let peer = link.peer;
        if let Some(err) = self.link_error(link, op, seq) {
            return Err(err);
        }
        link.send(bytes, deadline).map_err(|f| match f {
            SendFault::Lost(cause) => RendezvousError::PeerLost {
                rank: self.rank,
                peer,
                op,
                seq,
                cause,
            },
            SendFault::Timeout => RendezvousError::Timeout {
                rank: self.rank,
                peer,
                op,
                seq,
                timeout: self.op_timeout,
            },
        })
    }

    pub(crate) fn send_all(&self, inner: &mut Inner, bytes: &[u8], op: Op, seq: u64) -> Result<()> {
        let deadline = after(self.op_timeout);
        for i in 0..inner.links.len() {
            self.send_to(inner, i, bytes, op, seq, deadline)?;
        }
        Ok(())
    }

    /// The error a link's state means right now, if any: a reported abort, a goodbye, a
    /// closed/reset connection or garbage bytes. A data frame waiting in the inbox is not an
    /// error here.
    pub(crate) fn link_error(&self, link: &Link, op: Op, seq: u64) -> Option<RendezvousError> {
        if let Some(f) = link.inbox.iter().find(|f| f.kind == Kind::Abort) {
            return Some(abort_error(self.rank, link.peer, op, seq, &f.payload));
        }
        if link.inbox.iter().any(|f| f.kind == Kind::Bye) {
            return Some(RendezvousError::PeerLost {
                rank: self.rank,
                peer: link.peer,
                op,
                seq,
                cause: "the peer left the group (dropped its rendezvous)".into(),
            });
        }
        match &link.fault {
            None => None,
            Some(Fault::Clean) => Some(RendezvousError::PeerLost {
                rank: self.rank,
                peer: link.peer,
                op,
                seq,
                cause: "the peer left the group (dropped its rendezvous)".into(),
            }),
            Some(Fault::Lost(cause)) => Some(RendezvousError::PeerLost {
                rank: self.rank,
                peer: link.peer,
                op,
                seq,
                cause: cause.clone(),
            }),
            Some(Fault::Bad(detail)) => Some(RendezvousError::Protocol {
                rank: self.rank,
                peer: link.peer,
                op,
                seq,
                detail: detail.clone(),
            }),
            Some(Fault::Forged(detail)) => Some(RendezvousError::Unauthenticated {
                rank: self.rank,
                peer: link.peer,
                detail: format!("{op} #{seq}: {detail}"),
            }),
        }
    }

    /// Reads every link once and reports a dead or aborting peer (a clean goodbye is not an error
    /// here: a finished peer may leave).
    pub(crate) fn poll_faults(&self, inner: &mut Inner, op: Op, seq: u64) -> Result<()> {
        for link in inner.links.iter_mut() {
            link.pump();
        }
        for link in inner.links.iter() {
            let left_cleanly = link.fault == Some(Fault::Clean)
                || (link.fault.is_none() && link.inbox.iter().any(|f| f.kind == Kind::Bye));
            if op == Op::CheckPeers
                && left_cleanly
                && !link.inbox.iter().any(|f| f.kind == Kind::Abort)
            {
                continue;
            }
            if let Some(err) = self.link_error(link, op, seq) {
                return Err(err);
            }
        }
        Ok(())
    }

    /// Waits for one `Data` frame of (`op`, `seq`) on every link, in link order, watching all
    /// links for death meanwhile. Rank 0 waits `op_timeout`; the others wait a little longer,
    /// so that a failure rank 0 relays (naming the actual culprit) reaches them first.
    pub(crate) fn collect(&self, inner: &mut Inner, op: Op, seq: u64) -> Result<Vec<Vec<u8>>> {
        let start = Instant::now();
        let timeout = if self.rank == 0 {
            self.op_timeout
        } else {
            self.op_timeout.saturating_add(grace(self.op_timeout))
        };
        let deadline = deadline_at(start, timeout);
        let n = inner.links.len();
        let mut got: Vec<Option<Vec<u8>>> = (0..n).map(|_| None).collect();
        loop {
            let mut progress = false;
            for (i, link) in inner.links.iter_mut().enumerate() {
                progress |= link.pump();
                if got[i].is_none() {
                    if let Some(front) = link.inbox.front() {
                        if front.kind == Kind::Data {
                            let f = link.inbox.pop_front().unwrap_or_else(|| unreachable!());
                            if f.op != op || f.seq != seq || f.src != link.peer {
                                return Err(RendezvousError::Protocol {
                                    rank: self.rank,
                                    peer: link.peer,
                                    op,
                                    seq,
                                    detail: format!(
                                        "rank {} sent {} #{} (from rank {}) while this rank is in {op} #{seq}",
                                        link.peer, f.op, f.seq, f.src
                                    ),
                                });
                            }
                            got[i] = Some(f.payload);
                            progress = true;
                        } else if !matches!(front.kind, Kind::Abort | Kind::Bye) {
                            return Err(RendezvousError::Protocol {
                                rank: self.rank,
                                peer: link.peer,
                                op,
                                seq,
                                detail: format!("unexpected {:?} frame", front.kind),
                            });
                        }
                    }
                }
            }
            // Everything this call needs has arrived: it succeeded, whatever follows on the
            // links (a peer that finished and left, a failure of a later call) is for the next
            // call to see.
            if got.iter().all(Option::is_some) {
                return Ok(got.into_iter().map(Option::unwrap_or_default).collect());
            }
            // Otherwise death or abort on any link fails the call, even on links that already
            // answered: the call cannot complete without every peer.
            for link in inner.links.iter() {
                if let Some(err) = self.link_error(link, op, seq) {
                    return Err(err);
                }
            }
            if Instant::now() >= deadline {
                let missing = got.iter().position(Option::is_none).unwrap_or(0);
                return Err(RendezvousError::Timeout {
                    rank: self.rank,
                    peer: inner.links[missing].peer,
                    op,
                    seq,
                    timeout,
                });
            }
            if !progress {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }
}

/// How much longer than rank 0 the other ranks wait, so rank 0's relayed report arrives first.
pub(crate) fn grace(timeout: Duration) -> Duration {
    (timeout / 8).min(Duration::from_secs(2))
}

impl Drop for Rendezvous {
    /// Says goodbye to every peer (so they can tell a clean exit from a crash) and closes.
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        let bye = encode(Kind::Bye, Op::Connect, inner.seq, self.rank, &[]);
        let d = after(Duration::from_millis(100));
        for link in inner.links.iter_mut() {
            // Drain unread bytes first: closing with unread data sends a reset, which could
            // reach the peer before the goodbye.
            link.pump();
            if link.fault.is_none() {
                let _ = link.send(&bye, d);
            }
            let _ = link.stream.shutdown(Shutdown::Write);
        }
    }
}
