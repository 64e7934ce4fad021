//! Process mode's handshake: nothing a peer says about its memory is trusted unchecked.
//!
//! Before any peer allocation is mapped (or any NCCL communicator formed), every rank publishes a
//! [`Hello`]: the library and protocol versions, a fingerprint of the CUDA sources its kernels
//! were compiled from (they define what a peer writes where), the full [`Config`](ep_reference::Config) (mode, `round_scale` and
//! `ue8m0` included), the transport and its NCCL sizing, the wait bound, `zero_copy_local`, its rank, and the byte
//! size of its one allocation. The record travels in the same all-gather round as the CUDA IPC
//! handle (or the NCCL unique id): [`exchange()`] prepends it to the caller's payload, and strips
//! and checks every peer's record before handing the payloads back. Every rank compares every
//! peer with itself, so all ranks fail together, before anything is mapped, when any two differ.
//!
//! Decoding is defensive: the length is checked before anything is read (at most [`MAX_BLOB`](crate::wire::MAX_BLOB)
//! bytes), the magic and the protocol byte come first, every field is bounded, and trailing bytes
//! are refused. A malformed record is [`GroupError::PeerBlob`](crate::GroupError::PeerBlob) naming the peer; any difference is
//! [`GroupError::PeerMismatch`](crate::GroupError::PeerMismatch) naming the field, both values and both ranks.
//!
//! After a peer's IPC handle is opened, ep-kernels (`ProcessRank::join`) asks the driver how large the mapped
//! allocation is and refuses one smaller than this rank's layout of it.
//!
//! Wire format (little-endian): `b"EPhs"`, protocol `u8`, library version (`u8` length, 1..=64
//! printable ASCII bytes), kernel fingerprint `u64`, R, E, T, H, K (`u64` each), mode `u8` (0 bf16, 1 fp8), mode flags `u8`
//! (bit 0 round_scale, bit 1 ue8m0; 0 for bf16), transport `u8` (0 auto, 1 nccl, 2 two-tier),
//! zero_copy_local `u8` (0/1), NCCL sizes `u8` (0 exact, 1 capacity), shrink `u8` (0/1), timeout_ns `u64`, rank `u64`, allocation bytes `u64`, node id source
//! `u8` (0 `EP_NODE_ID`, 1 `GROUP_RANK`, 2 hostname), node id (`u8` length, 1..=64 printable ASCII
//! bytes without spaces), payload length `u16` (<= [`MAX_PAYLOAD`](crate::wire::MAX_PAYLOAD)), payload.
//!
//! The node id ([`crate::topology`]) is the one field peers may differ in: it says which peers
//! share this rank's node (CUDA IPC) and which do not (NCCL, `Transport::TwoTier`). Its source
//! must be the same on every rank (ids of different kinds are never compared).

//!
//! - [`crate::wire`] (one floor below): the wire format's constants and bounds, the reader,
//!   [`BlobError`](crate::wire::BlobError);
//! - [`record`]: the record ([`Hello`]), its encoder and decoder, the kernel fingerprint;
//! - [`compare`]: a peer's record against this rank's, field by field;
//! - [`exchange()`]: one all-gather round of records and payloads, every peer checked.

pub mod compare;
pub mod exchange;
pub mod record;

pub use exchange::{exchange, exchange_records, verify_all, verify_records, AllGather};
pub use record::{kernel_fingerprint, Hello};

#[cfg(test)]
mod tests;
