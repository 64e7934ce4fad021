//! A small TCP rendezvous for the control plane of a multi-process job.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects to it (retrying until a
//! deadline, since rank 0 may start last). The group is a star around rank 0 and its connections
//! stay open for its whole life, so later collectives reuse them and a peer's death is seen on
//! them.
//!
//! Collectives move opaque byte blobs (the NCCL unique id, CUDA IPC handles of communication
//! buffers, host names, ...): [`Rendezvous::all_gather`], [`Rendezvous::broadcast`] and
//! [`Rendezvous::barrier`]. Every rank must call the same collectives in the same order; each call
//! has a sequence number (1, 2, ...) that travels in every frame, with the operation, so a peer in
//! another call is detected and reported instead of silently mixing data.
//!
//! # Wire format
//!
//! Every frame is a 28-byte little-endian header followed by `len` bytes:
//! `magic "EPRZ" | version u16 | kind u8 | op u8 | seq u64 | src rank u32 | len u64`.
//! Kinds: `Challenge` (0 -> new connection: flags u8, nonce), `Hello` (rank -> 0: world size,
//! nonce, proof), `Admit` (0 -> rank: rank 0's proof), `Welcome` (0 -> rank, once all ranks are
//! in), `Data`, `Abort` (a failure report: kind u8, culprit rank u32, message), `Bye` (clean
//! close). Each kind (and, for `Data`, each operation and direction) has its own payload limit,
//! checked on the header before any payload is buffered.
//!
//! The handshake frames (`Challenge`, `Hello`, `Admit`, and a refusal's `Abort`) are the
//! payload alone. Every frame after them, both ways, is sealed ([`seal`], protocol version 3):
//! `len` counts the payload and a 32-byte tag after it, `HMAC-SHA256(session key, direction |
//! frame number | header | payload)`, the key derived from the handshake
//! ([`crate::auth::session_key`]). A frame that fails its tag (altered, injected, replayed,
//! reordered) fails the connection with [`RendezvousError::Unauthenticated`] naming the peer.
//!
//! # Who may join
//!
//! With a job token ([`RendezvousConfig::token`], `EP_JOB_TOKEN`) every connection proves it
//! holds the token before it is given a rank, and rank 0 proves it back before the rank sends
//! anything (see [`crate::auth`]). Connections that fail (a stranger, garbage bytes, a wrong
//! proof, a silent client past the handshake deadline, a rank number out of range or taken, a
//! wrong world size) are dropped without disturbing the job; only a connection that *proved* it
//! holds the token and then disagrees (world size, rank taken) fails the job, since it is one of
//! the job's own processes. Unidentified connections are capped ([`Limits::max_pending`], and
//! by rank 0's descriptors; when full, the oldest is dropped for a new one once it has had a
//! round trip's time to answer, else the new one is closed at once) and each is bounded to a
//! hello-sized buffer. Without a token
//! (one host only, unless [`RendezvousConfig::open`]) anyone who can reach the port can take a
//! free rank.
//!
//! # Failure
//!
//! Every wait is bounded (`connect_timeout` while connecting, `op_timeout` per collective) and
//! every error names this rank, the peer, the operation and the sequence number. A peer whose
//! connection closes or resets is reported as [`RendezvousError::PeerLost`] as soon as it is seen
//! (the sockets are polled every fraction of a millisecond while waiting), not at the timeout.
//! When rank 0 sees a failure it relays it (an `Abort` frame naming the culprit) to every other
//! rank, so they fail promptly with an error naming the rank that died, not merely rank 0. After
//! a failure the group is broken: further calls fail at once with [`RendezvousError::Broken`].
//! A rank believes such a report only once rank 0 has proved it holds the job token: one that
//! comes before (from whatever answered at rank 0's address) blames nobody but the rank itself.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::{self, JobToken, MAC_LEN, NONCE_LEN};
use crate::time::{after, deadline as deadline_at};

pub(crate) mod address;
mod admission;
mod join;
mod seal;

use seal::{Seal, TAG_LEN};

use address::Host;

const MAGIC: [u8; 4] = *b"EPRZ";
/// Bumped whenever the wire format changes; a peer with another version is refused.
/// Version 3: every frame after the handshake carries a tag ([`seal`]).
pub const PROTOCOL_VERSION: u16 = 3;
const HEADER_LEN: usize = 28;
/// The largest payload one frame may carry (an all-gather result included). Far above what the
/// control plane needs (an NCCL unique id is 128 bytes, a CUDA IPC handle 64), low enough that a
/// garbage length from a stray peer cannot make us allocate the machine away.
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// How long the poll loops sleep when no socket made progress.
const POLL_SLEEP: Duration = Duration::from_micros(200);
/// Payload sizes of the handshake frames.
const CHALLENGE_LEN: usize = 1 + NONCE_LEN;
const HELLO_LEN: usize = 4 + NONCE_LEN + MAC_LEN;
const ADMIT_LEN: usize = MAC_LEN;
const WELCOME_LEN: usize = 4;
/// The largest failure report (its message is truncated to fit).
const MAX_ABORT: usize = 64 * 1024;
/// Challenge flag: rank 0 requires a proof of the job token.
const FLAG_TOKEN: u8 = 1;

/// The collective (or phase) an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Connect,
    AllGather,
    Broadcast,
    Barrier,
    CheckPeers,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Op::Connect => 0,
            Op::AllGather => 1,
            Op::Broadcast => 2,
            Op::Barrier => 3,
            Op::CheckPeers => 4,
        }
    }
    fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            0 => Op::Connect,
            1 => Op::AllGather,
            2 => Op::Broadcast,
            3 => Op::Barrier,
            4 => Op::CheckPeers,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Connect => "connect",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::CheckPeers => "check_peers",
        })
    }
}

/// A rendezvous failure. Every variant names this rank (`rank`); those about a peer name it
/// (`peer`), the operation (`op`) and the call's sequence number (`seq`, 0 while connecting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank {rank}: invalid rendezvous configuration: {detail}")]
    InvalidConfig { rank: usize, detail: String },
    #[error("rank {rank}: cannot listen on {addr}: {cause}")]
    Bind {
        rank: usize,
        addr: String,
        cause: String,
    },
    #[error("rank {rank}: could not connect to rank {peer} at {addr} within {timeout:?}: {cause}")]
    Connect {
        rank: usize,
        peer: usize,
        addr: String,
        timeout: Duration,
        cause: String,
    },
    #[error("rank {rank}: {op} #{seq} timed out after {timeout:?} waiting for rank {peer}")]
    Timeout {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        timeout: Duration,
    },
    #[error("rank {rank}: peer rank {peer} lost during {op} #{seq}: {cause}")]
    PeerLost {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        cause: String,
    },
    #[error("rank {rank}: protocol error with rank {peer} in {op} #{seq}: {detail}")]
    Protocol {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        detail: String,
    },
    #[error(
        "rank {rank}: barrier #{seq} with tag {tag:?}, but rank {peer} is at barrier {peer_tag:?}"
    )]
    BarrierMismatch {
        rank: usize,
        peer: usize,
        seq: u64,
        tag: String,
        peer_tag: String,
    },
    #[error("rank {rank}: {op} #{seq} aborted: rank {reporter} reported a failure of rank {peer}: {detail}")]
    Aborted {
        rank: usize,
        peer: usize,
        reporter: usize,
        op: Op,
        seq: u64,
        detail: String,
    },
    #[error("rank {rank}: {op} #{seq} refused: the group already failed ({first})")]
    Broken {
        rank: usize,
        op: Op,
        seq: u64,
        first: Box<RendezvousError>,
    },
    #[error("rank {rank}: the rendezvous at {addr} is reachable from other hosts, so the job needs a shared secret: set EP_JOB_TOKEN to the same value on every rank (e.g. `openssl rand -hex 32`), or set EP_RDZV_OPEN=1 to let anyone who can reach that port join the job")]
    NoJobToken { rank: usize, addr: String },
    #[error("rank {rank}: authentication with rank {peer} failed: {detail}")]
    Unauthenticated {
        rank: usize,
        peer: usize,
        detail: String,
    },
    #[error("rank {rank}: cannot accept connections on {addr}: {cause}")]
    Accept {
        rank: usize,
        addr: String,
        cause: String,
    },
    #[error("rank {rank}: {op} #{seq}: a blob of {len} bytes exceeds the limit of {limit} bytes (Limits::max_blob)")]
    BlobTooLarge {
        rank: usize,
        op: Op,
        seq: u64,
        len: usize,
        limit: usize,
    },
}

impl RendezvousError {
    /// The rank that got this error.
    pub fn rank(&self) -> usize {
        match self {
            RendezvousError::InvalidConfig { rank, .. }
            | RendezvousError::Bind { rank, .. }
            | RendezvousError::Connect { rank, .. }
            | RendezvousError::Timeout { rank, .. }
            | RendezvousError::PeerLost { rank, .. }
            | RendezvousError::Protocol { rank, .. }
            | RendezvousError::BarrierMismatch { rank, .. }
            | RendezvousError::Aborted { rank, .. }
            | RendezvousError::Broken { rank, .. }
            | RendezvousError::NoJobToken { rank, .. }
            | RendezvousError::Unauthenticated { rank, .. }
            | RendezvousError::Accept { rank, .. }
            | RendezvousError::BlobTooLarge { rank, .. } => *rank,
        }
    }

    /// Whether another rank is to blame (it died, hung, or misbehaved): a process exiting on
    /// such an error should use [`EXIT_PEER_FAILURE`](crate::launcher::EXIT_PEER_FAILURE), so a
    /// launcher reports the culprit rather than the first survivor to notice.
    pub fn is_caused_by_peer(&self) -> bool {
        self.peer().is_some_and(|p| p != self.rank())
    }

    /// The rank this error is about (the one that died, timed out or misbehaved), if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            RendezvousError::InvalidConfig { .. }
            | RendezvousError::Bind { .. }
            | RendezvousError::NoJobToken { .. }
            | RendezvousError::Accept { .. }
            | RendezvousError::BlobTooLarge { .. } => None,
            RendezvousError::Unauthenticated { peer, .. } => Some(*peer),
            RendezvousError::Connect { peer, .. }
            | RendezvousError::Timeout { peer, .. }
            | RendezvousError::PeerLost { peer, .. }
            | RendezvousError::Protocol { peer, .. }
            | RendezvousError::BarrierMismatch { peer, .. }
            | RendezvousError::Aborted { peer, .. } => Some(*peer),
            RendezvousError::Broken { first, .. } => first.peer(),
        }
    }
}

pub type Result<T> = std::result::Result<T, RendezvousError>;

/// Where rank 0 is, who this process is, and the time bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Bound on forming the group: rank 0 waits this long for all ranks, the others this long
    /// to reach rank 0 and be welcomed.
    pub connect_timeout: Duration,
    /// Bound on each collective call.
    pub op_timeout: Duration,
    /// The job's shared secret: every rank must hold the same one. `None` runs unauthenticated,
    /// which [`Rendezvous::connect`] allows only on a loopback `master_addr` or with `open`.
    pub token: Option<JobToken>,
    /// Allow a job without a token across hosts (`EP_RDZV_OPEN=1`): anyone who can reach the
    /// port can then join as a free rank.
    pub open: bool,
    /// The job's identity, bound into every proof (`EP_JOB_ID`, else torchrun's
    /// `TORCHELASTIC_RUN_ID`, else empty): two jobs that share a token still cannot mix.
    pub job_id: String,
    /// Bounds against hostile or broken peers.
    pub limits: Limits,
    /// Rank 0 (Unix): the descriptor of a listening socket already bound to `master_port`,
    /// inherited from the launcher (`EP_RDZV_LISTEN_FD`), listened on instead of binding, so
    /// the port cannot be taken between the launcher choosing it and rank 0 listening.
    pub inherited_listener: Option<i32>,
}

/// Bounds on what a peer can make this process hold or wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest blob one rank may contribute to a collective (and so the largest `Data`
    /// frame; rank 0's all-gather reply may hold `world_size` of them, up to [`MAX_PAYLOAD`]).
    pub max_blob: usize,
    /// Rank 0: connections that have not yet proved who they are, at most (fewer where rank 0
    /// runs out of descriptors); when full, the oldest is dropped to make room for a new one
    /// once it has had 20 ms to answer, and the new one is closed otherwise.
    pub max_pending: usize,
    /// Rank 0: how long a new connection has to complete its handshake before it is dropped.
    /// Each rank: how long it waits for rank 0's challenge before reconnecting.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_blob: 64 << 20,
            max_pending: 64,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl RendezvousConfig {
    /// A loopback configuration (used by tests and by single-node jobs).
    pub fn local(rank: usize, world_size: usize, port: u16, timeout: Duration) -> Self {
        RendezvousConfig {
            rank,
            world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            connect_timeout: timeout,
            op_timeout: timeout,
            token: None,
            open: false,
            job_id: String::new(),
            limits: Limits::default(),
            inherited_listener: None,
        }
    }

    /// This configuration with `token` as the job's secret.
    pub fn with_token(mut self, token: JobToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Checks the configuration as [`Rendezvous::connect`] does, without touching the network.
    pub fn check(&self) -> Result<()> {
        self.validate()
    }

    /// Whether `master_addr` names this host only (a loopback IP or `localhost`): a job there
    /// may run without a token. Anything else, names included, counts as reachable from other
    /// hosts.
    pub fn is_loopback(&self) -> bool {
        Host::parse(&self.master_addr).is_ok_and(|h| h.is_loopback())
    }

    fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(RendezvousError::InvalidConfig {
                rank: self.rank,
                detail,
            })
        };
        if self.world_size == 0 || self.world_size > u32::MAX as usize {
            return bad(format!("world_size {} out of 1..=2^32-1", self.world_size));
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} >= world_size {}",
                self.rank, self.world_size
            ));
        }
        if let Err(detail) = Host::parse(&self.master_addr) {
            return bad(detail);
        }
        if self.connect_timeout.is_zero() || self.op_timeout.is_zero() {
            return bad("timeouts must be nonzero".into());
        }
        let l = &self.limits;
        if l.max_blob == 0 || l.max_blob as u64 > MAX_PAYLOAD {
            return bad(format!(
                "limits.max_blob {} out of 1..={MAX_PAYLOAD}",
                l.max_blob
            ));
        }
        if l.max_pending == 0 || l.handshake_timeout.is_zero() {
            return bad("limits.max_pending and limits.handshake_timeout must be nonzero".into());
        }
        if self.job_id.len() > auth::MAX_JOB_ID_LEN {
            return bad(format!(
                "job id of {} bytes, above the limit {}",
                self.job_id.len(),
                auth::MAX_JOB_ID_LEN
            ));
        }
        if self.token.is_none() && !self.open && self.world_size > 1 && !self.is_loopback() {
            return Err(RendezvousError::NoJobToken {
                rank: self.rank,
                addr: self.addr_string(),
            });
        }
        Ok(())
    }

    fn addr_string(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    fn resolve(&self) -> std::result::Result<Vec<SocketAddr>, String> {
        let addrs: Vec<SocketAddr> = match Host::parse(&self.master_addr)? {
            Host::Ip(ip) => vec![SocketAddr::new(ip, self.master_port)],
            Host::Name(name) => (name, self.master_port)
                .to_socket_addrs()
                .map_err(|e| format!("cannot resolve {}: {e}", self.addr_string()))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(format!("{} resolves to no address", self.addr_string()));
        }
        Ok(addrs)
    }
}

// ---------------------------------------------------------------------------------------------
// Frames

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Hello = 1,
    Welcome = 2,
    Data = 3,
    Abort = 4,
    Bye = 5,
    Challenge = 6,
    Admit = 7,
}

impl Kind {
    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Data,
            4 => Kind::Abort,
            5 => Kind::Bye,
            6 => Kind::Challenge,
            7 => Kind::Admit,
            _ => return None,
        })
    }
}

/// Which way a link faces, for the payload limits of what it may receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Facing {
    /// Rank 0's side of a connection that has not proved who it is: only a hello may come.
    Unidentified,
    /// Rank 0's side of a link to an admitted rank.
    Member,
    /// A rank's side of its link to rank 0 before rank 0 has proved itself: only handshake
    /// frames (the welcome may follow the admission in the same read), so an impostor cannot
    /// make the rank buffer more than a failure report.
    RootUnproven,
    /// A rank's side of its link to rank 0.
    Root,
}

/// What one link may receive: a payload limit per frame kind (and, for `Data`, per operation),
/// derived from the world size and [`Limits::max_blob`].
#[derive(Debug, Clone, Copy)]
struct FrameLimits {
    facing: Facing,
    world: usize,
    max_blob: usize,
}

impl FrameLimits {
    /// Rank 0's all-gather reply: a count, then world x (length, blob).
    fn gathered(&self) -> u64 {
        (self.world as u64)
            .saturating_mul(8 + self.max_blob as u64)
            .saturating_add(4)
            .min(MAX_PAYLOAD)
    }

    /// The largest payload a frame of `kind` for `op` may carry on this link.
    fn max_payload(&self, kind: Kind, op: Op) -> std::result::Result<u64, String> {
        if self.facing == Facing::Unidentified && kind != Kind::Hello {
            return Err(format!(
                "a new connection must start with a hello, not {kind:?}"
            ));
        }
        if self.facing == Facing::RootUnproven
            && !matches!(
                kind,
                Kind::Challenge | Kind::Admit | Kind::Welcome | Kind::Abort
            )
        {
            return Err(format!("rank 0 sent {kind:?} before admitting this rank"));
        }
        Ok(match kind {
            Kind::Hello => HELLO_LEN as u64,
            Kind::Challenge => CHALLENGE_LEN as u64,
            Kind::Admit => ADMIT_LEN as u64,
            Kind::Welcome => WELCOME_LEN as u64,
            Kind::Abort => MAX_ABORT as u64,
            Kind::Bye => 0,
            Kind::Data => match (self.facing, op) {
                (_, Op::Connect | Op::CheckPeers) => 0,
                (Facing::Root, Op::AllGather | Op::Barrier) => self.gathered(),
                _ => self.max_blob as u64,
            },
        })
    }

    /// The most bytes the link buffers (unparsed bytes plus parsed frames not yet consumed):
    /// one largest frame, so a peer cannot make it hold more than what it may legitimately send.
    fn read_budget(&self) -> usize {
        // Past the handshake (a member, a proven rank 0) every frame carries its tag.
        let largest = match self.facing {
            Facing::Unidentified => HELLO_LEN as u64,
            Facing::RootUnproven => MAX_ABORT as u64,
            Facing::Member => (self.max_blob.max(MAX_ABORT) + TAG_LEN) as u64,
            Facing::Root => self.gathered().max(MAX_ABORT as u64) + TAG_LEN as u64,
        };
        HEADER_LEN + largest as usize
    }
}

#[derive(Debug)]
struct Frame {
    kind: Kind,
    op: Op,
    seq: u64,
    src: usize,
    payload: Vec<u8>,
}

fn encode(kind: Kind, op: Op, seq: u64, src: usize, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    v.push(kind as u8);
    v.push(op.code());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(src as u32).to_le_bytes());
    v.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Parses one frame from the front of `buf`: `Ok(None)` when more bytes are needed.
/// `trailer`: the bytes after the payload that the header's length counts too (the tag of a
/// sealed link, [`TAG_LEN`]; 0 before the handshake is done). The frame's payload excludes them;
/// the caller checks them, at `total - trailer..total`.
fn parse(
    buf: &[u8],
    limits: &FrameLimits,
    trailer: usize,
) -> std::result::Result<Option<(Frame, usize)>, String> {
    if buf.len() < HEADER_LEN {
        // Reject a wrong magic as early as possible (a stray client, an HTTP probe, ...).
        let n = buf.len().min(4);
        if buf[..n] != MAGIC[..n] {
            return Err(format!(
                "bad magic {:02x?} (not an ep-launch rendezvous peer)",
                &buf[..n]
            ));
        }
        return Ok(None);
    }
    if buf[..4] != MAGIC {
        return Err(format!(
            "bad magic {:02x?} (not an ep-launch rendezvous peer)",
            &buf[..4]
        ));
    }
    let u16_at = |i: usize| u16::from_le_bytes([buf[i], buf[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&buf[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let version = u16_at(4);
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "peer speaks rendezvous protocol version {version}, this rank version {PROTOCOL_VERSION}"
        ));
    }
    let kind = Kind::from_code(buf[6]).ok_or_else(|| format!("unknown frame kind {}", buf[6]))?;
    let op = Op::from_code(buf[7]).ok_or_else(|| format!("unknown operation code {}", buf[7]))?;
    let seq = u64_at(8);
    let src = u32_at(16) as usize;
    let len = u64_at(20);
    let limit = limits.max_payload(kind, op)?.min(MAX_PAYLOAD);
    let Some(payload_len) = len.checked_sub(trailer as u64) else {
        return Err(format!(
            "{kind:?} frame for {op} of {len} bytes is too short for its {trailer}-byte tag"
        ));
    };
    if payload_len > limit {
        return Err(format!(
            "{kind:?} frame for {op} of {payload_len} bytes exceeds the limit {limit}"
        ));
    }
    let total = HEADER_LEN + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = buf[HEADER_LEN..total - trailer].to_vec();
    Ok(Some((
        Frame {
            kind,
            op,
            seq,
            src,
            payload,
        },
        total,
    )))
}

fn encode_blobs(blobs: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = blobs.iter().map(|b| b.len() + 8).sum();
    let mut v = Vec::with_capacity(4 + total);
    v.extend_from_slice(&(blobs.len() as u32).to_le_bytes());
    for b in blobs {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    }
    v
}

fn decode_blobs(buf: &[u8]) -> std::result::Result<Vec<Vec<u8>>, String> {
    let take = |pos: &mut usize, n: usize| -> std::result::Result<&[u8], String> {
        let end = pos
            .checked_add(n)
            .filter(|&e| e <= buf.len())
            .ok_or_else(|| format!("all_gather payload truncated at byte {}", *pos))?;
        let s = &buf[*pos..end];
        *pos = end;
        Ok(s)
    };
    let mut pos = 0;
    let mut b4 = [0u8; 4];
    b4.copy_from_slice(take(&mut pos, 4)?);
    let count = u32::from_le_bytes(b4) as usize;
    let mut out = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let mut b8 = [0u8; 8];
        b8.copy_from_slice(take(&mut pos, 8)?);
        let len = u64::from_le_bytes(b8);
        let len = usize::try_from(len).map_err(|_| format!("blob length {len} too large"))?;
        out.push(take(&mut pos, len)?.to_vec());
    }
    if pos != buf.len() {
        return Err(format!(
            "all_gather payload has {} trailing bytes",
            buf.len() - pos
        ));
    }
    Ok(out)
}

/// Abort payload: failure kind, culprit rank, message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AbortKind {
    Lost = 1,
    Timeout = 2,
    Other = 3,
}

fn abort_payload(err: &RendezvousError) -> Vec<u8> {
    let (kind, culprit, msg) = match err {
        RendezvousError::PeerLost { peer, cause, .. } => (AbortKind::Lost, *peer, cause.clone()),
        RendezvousError::Timeout { peer, .. } => (AbortKind::Timeout, *peer, err.to_string()),
        RendezvousError::Broken { first, .. } => return abort_payload(first),
        other => (
            AbortKind::Other,
            other.peer().unwrap_or(usize::MAX),
            other.to_string(),
        ),
    };
    let mut v = vec![kind as u8];
    v.extend_from_slice(&(culprit.min(u32::MAX as usize) as u32).to_le_bytes());
    let mut end = msg.len().min(MAX_ABORT - v.len());
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    v.extend_from_slice(&msg.as_bytes()[..end]);
    v
}

// ---------------------------------------------------------------------------------------------
// Links

/// Why a link cannot deliver more frames.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fault {
    /// The peer said goodbye (and may have closed).
    Clean,
    /// The connection closed or reset without a goodbye.
    Lost(String),
    /// The peer sent bytes that are not a valid frame.
    Bad(String),
    /// A frame failed its integrity check (see [`seal`]): altered, injected, replayed or
    /// reordered on the way.
    Forged(String),
}

/// One connection to a peer: a nonblocking socket, the bytes read so far and the frames parsed.
struct Link {
    peer: usize,
    stream: TcpStream,
    limits: FrameLimits,
    rbuf: Vec<u8>,
    inbox: VecDeque<Frame>,
    fault: Option<Fault>,
    /// Once the handshake is done: the tags of what is sent and received.
    seal: Option<Seal>,
    /// A rank's link to rank 0: the admission has arrived (see [`Link::held`]).
    admitted: bool,
}

impl Link {
    fn new(peer: usize, stream: TcpStream, limits: FrameLimits) -> std::io::Result<Link> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        Ok(Link {
            peer,
            stream,
            limits,
            rbuf: Vec::new(),
            inbox: VecDeque::new(),
            fault: None,
            seal: None,
            admitted: false,
        })
    }

    /// Bytes held for this link: unparsed input plus parsed frames not yet consumed.
    fn buffered(&self) -> usize {
        self.rbuf.len()
            + self
                .inbox
                .iter()
                .map(|f| HEADER_LEN + f.payload.len())
                .sum::<usize>()
    }

    /// Reads whatever is available without blocking (but never more than the link's read
    /// budget: past it the peer waits, on TCP flow control, until frames are consumed) and
    /// parses complete frames into the inbox. Returns whether anything happened.
    fn pump(&mut self) -> bool {
        if self.fault.is_some() {
            return false;
        }
        let budget = self.limits.read_budget();
        let mut progress = false;
        // Bytes held back while the limits changed (see `held`) are parsed first.
        if !self.rbuf.is_empty() && !self.held() {
            let before = self.inbox.len();
            if !self.parse_frames() {
                return true;
            }
            progress = self.inbox.len() != before;
        }
        let mut closed: Option<String> = None;
        let mut chunk = [0u8; 64 * 1024];
        loop {
            let room = budget.saturating_sub(self.buffered()).min(chunk.len());
            if room == 0 || self.held() {
                break;
            }
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) => {
                    closed = Some(
                        "connection closed without a goodbye (process exited or crashed)".into(),
                    );
                    break;
                }
                Ok(n) => {
                    self.rbuf.extend_from_slice(&chunk[..n]);
                    progress = true;
                    if !self.parse_frames() {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    closed = Some(format!("connection error: {e}"));
                    break;
                }
            }
        }
        if let Some(cause) = closed {
            progress = true;
            if self.fault.is_none() {
                // Frames parsed before the close stay deliverable; the fault only says that no
                // more will come, and whether the peer said goodbye first.
                let clean = self.inbox.iter().any(|f| f.kind == Kind::Bye);
                self.fault = Some(if clean {
                    Fault::Clean
                } else {
                    Fault::Lost(cause)
                });
            }
        }
        progress
    }

    /// Whether parsing waits: a rank has rank 0's admission in hand (or has taken it from the
    /// inbox) but has not checked its proof yet. What follows it (the welcome, maybe a
    /// broadcast) is parsed under the limits for a proven rank 0, and checked against its tag,
    /// once the proof is checked and the link sealed; under none before.
    fn held(&self) -> bool {
        self.limits.facing == Facing::RootUnproven && self.admitted
    }

    /// Moves every complete frame from the read buffer to the inbox; false (and a fault) on
    /// bytes that are not a valid frame for this link.
    fn parse_frames(&mut self) -> bool {
        let mut consumed = 0;
        let ok = loop {
            if self.held() {
                break true;
            }
            let trailer = if self.seal.is_some() { TAG_LEN } else { 0 };
            match parse(&self.rbuf[consumed..], &self.limits, trailer) {
                Ok(Some((frame, n))) => {
                    if let Some(seal) = self.seal.as_mut() {
                        let bytes = &self.rbuf[consumed..consumed + n];
                        let (head, rest) = bytes.split_at(HEADER_LEN);
                        let (payload, tag) = rest.split_at(rest.len() - TAG_LEN);
                        if let Err(detail) = seal.open_next(head, payload, tag) {
                            self.fault = Some(Fault::Forged(detail));
                            break false;
                        }
                    }
                    consumed += n;
                    if self.limits.facing == Facing::RootUnproven && frame.kind == Kind::Admit {
                        self.admitted = true;
                    }
                    self.inbox.push_back(frame);
                }
                Ok(None) => break true,
                Err(detail) => {
                    self.fault = Some(Fault::Bad(detail));
                    break false;
                }
            }
        };
        self.rbuf.drain(..consumed);
        ok
    }

    /// Waits (bounded by `until`) for the next frame; `Err` says why none came.
    fn next_frame(&mut self, until: Instant) -> std::result::Result<Frame, String> {
        loop {
            let progress = self.pump();
            if let Some(f) = self.inbox.pop_front() {
                return Ok(f);
            }
            match &self.fault {
                Some(Fault::Clean) => return Err("the peer said goodbye".into()),
                Some(Fault::Lost(c) | Fault::Bad(c) | Fault::Forged(c)) => return Err(c.clone()),
                None => {}
            }
            if Instant::now() >= until {
                return Err("timed out waiting for the next handshake message".into());
            }
            if !progress {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }

    /// Writes one whole frame (as [`encode`] made it) before `deadline`, reading meanwhile so
    /// neither side can block the other on full buffers. On a sealed link the frame goes out
    /// with its tag (the header's length counting it).
    fn send(&mut self, frame: &[u8], deadline: Instant) -> std::result::Result<(), SendFault> {
        let Some(seal) = self.seal.as_mut() else {
            return self.write_parts(&[frame], deadline);
        };
        if frame.len() < HEADER_LEN {
            return Err(SendFault::Lost(format!(
                "internal error: a {}-byte frame is shorter than its header",
                frame.len()
            )));
        }
        let (head, payload) = frame.split_at(HEADER_LEN);
        let mut head: [u8; HEADER_LEN] = head
            .try_into()
            .unwrap_or_else(|_| unreachable!("split at HEADER_LEN"));
        let len = (payload.len() + TAG_LEN) as u64;
        head[20..28].copy_from_slice(&len.to_le_bytes());
        let tag = seal.seal_next(&head, payload);
        self.write_parts(&[&head, payload, &tag], deadline)
    }

    /// Writes `parts` one after the other, whole, before `deadline` (see [`Link::send`]).
    fn write_parts(
        &mut self,
        parts: &[&[u8]],
        deadline: Instant,
    ) -> std::result::Result<(), SendFault> {
        for part in parts {
            let mut off = 0;
            while off < part.len() {
                match self.stream.write(&part[off..]) {
                    Ok(0) => {
                        return Err(SendFault::Lost("connection closed (wrote 0 bytes)".into()))
                    }
                    Ok(n) => off += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            return Err(SendFault::Timeout);
                        }
                        self.pump();
                        std::thread::sleep(POLL_SLEEP);
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(SendFault::Lost(format!("send failed: {e}"))),
                }
            }
        }
        Ok(())
    }
}

enum SendFault {
    Lost(String),
    Timeout,
}

// ---------------------------------------------------------------------------------------------
// The group

struct Inner {
    /// Sequence number of the last call started (0: connecting).
    seq: u64,
    /// Rank 0: links to ranks 1..world_size, in rank order. Others: the one link to rank 0.
    links: Vec<Link>,
    /// The first failure; the group refuses further calls once set.
    broken: Option<RendezvousError>,
}

/// A connected group of `world_size` processes (or threads). `Sync`: the collectives take
/// `&self` and are serialized by an internal lock; every rank must call the same collectives in
/// the same order.
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    op_timeout: Duration,
    max_blob: usize,
    inner: Mutex<Inner>,
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

    /// Reads the torchrun-style environment ([`ProcessConfig::from_env`](crate::env::ProcessConfig::from_env))
    /// and forms the group.
    pub fn from_env(
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> std::result::Result<Self, crate::Error> {
        let pc = crate::env::ProcessConfig::from_env()?;
        Ok(Self::connect(
            &pc.rendezvous_config(connect_timeout, op_timeout),
        )?)
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave Inner half-updated in a way that matters:
        // the worst case is a group that fails its next call, which it reports.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn from_links(cfg: &RendezvousConfig, links: Vec<Link>) -> Self {
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

    fn accept_all(cfg: &RendezvousConfig, listener: TcpListener) -> Result<Self> {
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
        let mut door = admission::Door::new(cfg, addr);
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
            &(world as u32).to_le_bytes(),
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

    fn connect_to_root(cfg: &RendezvousConfig) -> Result<Self> {
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
            match join::dial(cfg, deadline) {
                Ok(mut link) => match join::handshake(cfg, &mut link, deadline) {
                    Ok(key) => {
                        // Rank 0 proved itself: from now on it may send collective results,
                        // each frame (both ways) tagged under the connection's key.
                        link.limits.facing = Facing::Root;
                        link.seal = Some(Seal::new(key, false));
                        break link;
                    }
                    Err(join::Handshake::Retry(cause)) => {
                        last_error = cause;
                        pause = Duration::from_millis(1);
                    }
                    Err(join::Handshake::Fatal(err)) => return Err(err),
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
    /// what they would see if this process crashed. For failure tests.
    #[doc(hidden)]
    pub fn abandon(self) {
        // Dropping the streams closes them; Drop then finds no link to say goodbye on.
        self.lock().links.clear();
    }

    // -- internals ------------------------------------------------------------------------

    fn too_large(&self, op: Op, seq: u64, len: usize) -> RendezvousError {
        RendezvousError::BlobTooLarge {
            rank: self.rank,
            op,
            seq,
            len,
            limit: self.max_blob,
        }
    }

    fn begin(&self, inner: &mut Inner, op: Op) -> Result<u64> {
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
    fn finish<T>(&self, inner: &mut Inner, op: Op, seq: u64, r: Result<T>) -> Result<T> {
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

    fn gather_op(&self, op: Op, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
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

    fn send_to(
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

    fn send_all(&self, inner: &mut Inner, bytes: &[u8], op: Op, seq: u64) -> Result<()> {
        let deadline = after(self.op_timeout);
        for i in 0..inner.links.len() {
            self.send_to(inner, i, bytes, op, seq, deadline)?;
        }
        Ok(())
    }

    /// The error a link's state means right now, if any: a reported abort, a goodbye, a
    /// closed/reset connection or garbage bytes. A data frame waiting in the inbox is not an
    /// error here.
    fn link_error(&self, link: &Link, op: Op, seq: u64) -> Option<RendezvousError> {
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
    fn poll_faults(&self, inner: &mut Inner, op: Op, seq: u64) -> Result<()> {
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
    fn collect(&self, inner: &mut Inner, op: Op, seq: u64) -> Result<Vec<Vec<u8>>> {
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

impl RendezvousError {
    /// The peer whose connection is gone, for which sending an abort is pointless.
    fn peer_if_lost(&self) -> Option<usize> {
        match self {
            RendezvousError::PeerLost { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

/// How much longer than rank 0 the other ranks wait, so rank 0's relayed report arrives first.
fn grace(timeout: Duration) -> Duration {
    (timeout / 8).min(Duration::from_secs(2))
}

/// The error an `Abort` frame from `reporter` means to this rank.
fn abort_error(rank: usize, reporter: usize, op: Op, seq: u64, payload: &[u8]) -> RendezvousError {
    if payload.len() < 5 {
        return RendezvousError::Aborted {
            rank,
            peer: reporter,
            reporter,
            op,
            seq,
            detail: "malformed abort report".into(),
        };
    }
    let culprit = u32::from_le_bytes([payload[1], payload[2], payload[3], payload[4]]) as usize;
    let culprit = if culprit == u32::MAX as usize {
        reporter
    } else {
        culprit
    };
    let msg = String::from_utf8_lossy(&payload[5..]).into_owned();
    match payload[0] {
        k if k == AbortKind::Lost as u8 => RendezvousError::PeerLost {
            rank,
            peer: culprit,
            op,
            seq,
            cause: format!("reported by rank {reporter}: {msg}"),
        },
        k if k == AbortKind::Timeout as u8 && culprit != rank => RendezvousError::Aborted {
            rank,
            peer: culprit,
            reporter,
            op,
            seq,
            detail: format!("timed out: {msg}"),
        },
        _ => RendezvousError::Aborted {
            rank,
            peer: culprit,
            reporter,
            op,
            seq,
            detail: msg,
        },
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(facing: Facing) -> FrameLimits {
        FrameLimits {
            facing,
            world: 4,
            max_blob: 1000,
        }
    }

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let member = limits(Facing::Member);
        let bytes = encode(Kind::Data, Op::Barrier, 7, 3, b"hello");
        let (f, n) = parse(&bytes, &member, 0).unwrap().unwrap();
        assert_eq!(n, bytes.len());
        assert_eq!(
            (f.kind, f.op, f.seq, f.src),
            (Kind::Data, Op::Barrier, 7, 3)
        );
        assert_eq!(f.payload, b"hello");
        // Incomplete: needs more bytes, not an error.
        assert!(parse(&bytes[..bytes.len() - 1], &member, 0)
            .unwrap()
            .is_none());
        assert!(parse(&bytes[..3], &member, 0).unwrap().is_none());
        // Wrong magic, wrong version, huge length.
        assert!(parse(b"GET / HTTP/1.1\r\n", &member, 0)
            .unwrap_err()
            .contains("magic"));
        let mut v = bytes.clone();
        v[4] = 99;
        assert!(parse(&v, &member, 0).unwrap_err().contains("version"));
        let mut v = bytes.clone();
        v[20..28].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(parse(&v, &member, 0).unwrap_err().contains("exceeds"));
    }

    #[test]
    fn payload_limits_follow_the_operation_and_direction() {
        let header_claiming = |kind: Kind, op: Op, len: u64| {
            let mut v = encode(kind, op, 1, 1, &[]);
            v[20..28].copy_from_slice(&len.to_le_bytes());
            v
        };
        let (member, root, new) = (
            limits(Facing::Member),
            limits(Facing::Root),
            limits(Facing::Unidentified),
        );
        // A blob from a rank: max_blob; rank 0's gathered reply: world x (8 + max_blob) + 4.
        let blob = header_claiming(Kind::Data, Op::AllGather, 1000);
        assert!(parse(&blob, &member, 0).unwrap().is_none());
        let over = header_claiming(Kind::Data, Op::AllGather, 1001);
        assert!(parse(&over, &member, 0).unwrap_err().contains("exceeds"));
        assert!(parse(&over, &root, 0).unwrap().is_none());
        let gathered = header_claiming(Kind::Data, Op::AllGather, 4 * 1008 + 4);
        assert!(parse(&gathered, &root, 0).unwrap().is_none());
        let gathered = header_claiming(Kind::Data, Op::AllGather, 4 * 1008 + 5);
        assert!(parse(&gathered, &root, 0).unwrap_err().contains("exceeds"));
        let bcast = header_claiming(Kind::Data, Op::Broadcast, 1001);
        assert!(parse(&bcast, &root, 0).unwrap_err().contains("exceeds"));
        // Handshake frames: their exact sizes; data on connect: none.
        for (kind, len) in [
            (Kind::Hello, HELLO_LEN),
            (Kind::Challenge, CHALLENGE_LEN),
            (Kind::Admit, ADMIT_LEN),
            (Kind::Welcome, WELCOME_LEN),
            (Kind::Bye, 0),
            (Kind::Abort, MAX_ABORT),
        ] {
            let ok = header_claiming(kind, Op::Connect, len as u64);
            assert!(parse(&ok, &root, 0).is_ok(), "{kind:?}");
            let big = header_claiming(kind, Op::Connect, len as u64 + 1);
            assert!(parse(&big, &root, 0).is_err(), "{kind:?}");
        }
        assert!(parse(&header_claiming(Kind::Data, Op::Connect, 1), &member, 0).is_err());
        // A new connection may only say hello, of hello size.
        assert!(parse(
            &header_claiming(Kind::Hello, Op::Connect, HELLO_LEN as u64),
            &new,
            0
        )
        .unwrap()
        .is_none());
        assert!(
            parse(&header_claiming(Kind::Data, Op::AllGather, 1), &new, 0)
                .unwrap_err()
                .contains("must start with a hello")
        );
        assert!(parse(&header_claiming(Kind::Hello, Op::Connect, 1 << 30), &new, 0).is_err());
        // On a sealed link the length counts the tag too: the limit is on what precedes it,
        // and a frame too short to hold a tag is refused.
        let tagged = header_claiming(Kind::Data, Op::AllGather, 1000 + TAG_LEN as u64);
        assert!(parse(&tagged, &member, TAG_LEN).unwrap().is_none());
        let tagged = header_claiming(Kind::Data, Op::AllGather, 1001 + TAG_LEN as u64);
        assert!(parse(&tagged, &member, TAG_LEN)
            .unwrap_err()
            .contains("exceeds"));
        let short = header_claiming(Kind::Bye, Op::Connect, TAG_LEN as u64 - 1);
        assert!(parse(&short, &member, TAG_LEN)
            .unwrap_err()
            .contains("too short"));
        // And what a link buffers is one largest frame.
        assert_eq!(new.read_budget(), HEADER_LEN + HELLO_LEN);
        assert_eq!(member.read_budget(), HEADER_LEN + MAX_ABORT + TAG_LEN);
    }

    #[test]
    fn abort_reports_are_truncated_to_their_limit() {
        let err = RendezvousError::InvalidConfig {
            rank: 1,
            detail: "é".repeat(MAX_ABORT),
        };
        let p = abort_payload(&err);
        assert!(p.len() <= MAX_ABORT);
        assert!(std::str::from_utf8(&p[5..]).is_ok());
    }

    #[test]
    fn a_multi_host_job_needs_a_token_or_open() {
        let mut c = RendezvousConfig::local(0, 2, 29500, Duration::from_secs(1));
        for loopback in ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"] {
            c.master_addr = loopback.into();
            assert!(c.is_loopback(), "{loopback}");
            c.check().unwrap();
        }
        for remote in ["10.1.2.3", "node17", "::ffff:10.0.0.1", "192.0.2.1"] {
            c.master_addr = remote.into();
            assert!(!c.is_loopback(), "{remote}");
            let e = c.check().unwrap_err();
            assert!(
                matches!(e, RendezvousError::NoJobToken { rank: 0, .. }),
                "{e}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains("EP_JOB_TOKEN") && msg.contains("EP_RDZV_OPEN=1"),
                "{msg}"
            );
            // One rank alone needs no secret; open or a token makes it acceptable.
            let alone = RendezvousConfig {
                world_size: 1,
                ..c.clone()
            };
            alone.check().unwrap();
            RendezvousConfig {
                open: true,
                ..c.clone()
            }
            .check()
            .unwrap();
            c.clone()
                .with_token(JobToken::new(*b"0123456789abcdef").unwrap())
                .check()
                .unwrap();
        }
    }

    #[test]
    fn blob_lists_round_trip_and_truncation_is_an_error() {
        let blobs = vec![b"a".to_vec(), vec![], vec![7u8; 300]];
        let enc = encode_blobs(&blobs);
        assert_eq!(decode_blobs(&enc).unwrap(), blobs);
        for cut in 0..enc.len() {
            assert!(decode_blobs(&enc[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = enc.clone();
        long.push(0);
        assert!(decode_blobs(&long).unwrap_err().contains("trailing"));
    }

    #[test]
    fn invalid_configs_are_typed() {
        let mut c = RendezvousConfig::local(2, 2, 1, Duration::from_secs(1));
        assert!(matches!(
            Rendezvous::connect(&c),
            Err(RendezvousError::InvalidConfig { rank: 2, .. })
        ));
        c.rank = 0;
        c.op_timeout = Duration::ZERO;
        assert!(matches!(
            Rendezvous::connect(&c),
            Err(RendezvousError::InvalidConfig { rank: 0, .. })
        ));
    }
}
