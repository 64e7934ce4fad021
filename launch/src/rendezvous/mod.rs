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
//! payload alone. Every frame after them, both ways, is sealed (`seal`, protocol version 3):
//! `len` counts the payload and a 32-byte tag after it, `HMAC-SHA256(session key, direction |
//! frame number | header | payload)`, the key derived from the handshake
//! (`auth::session_key`). A frame that fails its tag (altered, injected, replayed,
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

pub(crate) mod address;
pub(crate) mod admission;
pub(crate) mod collective;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod frame;
pub(crate) mod join;
pub(crate) mod link;
pub(crate) mod seal;

pub use collective::Rendezvous;
pub use config::{Limits, RendezvousConfig};
pub use error::{RendezvousError, Result};
pub use frame::{Op, MAX_PAYLOAD, PROTOCOL_VERSION};
