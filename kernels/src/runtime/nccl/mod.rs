//! The NCCL side of the NCCL transport (cudarc's `nccl-02028` bindings, loaded at run time): one
//! communicator per GPU, grouped point-to-point sends and receives on the group's streams. Every
//! call here needs libnccl; [`nccl_present`] says whether it is there, so nothing panics on a
//! machine without it.
//!
//! **Bounded host waits.** A process-mode communicator is created non-blocking
//! (`ncclCommInitRankConfig` with `blocking = 0`): the call returns `ncclInProgress` and the
//! host polls `ncclCommGetAsyncError` until the communicator is ready, at most
//! [`setup_timeout`]. A grouped send/receive on such a communicator may return `ncclInProgress`
//! too (the first one sets up its connections, which waits on the peers); it is polled the same
//! way before anything else is queued on its streams. Past the deadline, or on any NCCL error,
//! every communicator of the object is aborted (`ncclCommAbort` asks NCCL's kernels and proxy
//! threads to quit), and the error names the rank and the step
//! ([`GpuError::NcclTimeout`](crate::GpuError::NcclTimeout)). An aborted object is never
//! destroyed again.
//!
//! **Release.** `Comms::release` runs first in the group's `Drop`, before any memory or stream
//! the communicators use is freed: it waits (bounded) for the streams, destroys the communicators
//! when they are idle and healthy, and aborts them otherwise. The single-process communicators
//! (`ncclCommInitAll`) stay blocking: their peers are threads of this process and cannot vanish.
//!
//! **Peer counts.** `check_header` (`header`) bounds every count of a batch header a peer sent
//! before it sizes a transfer.

mod comms;
mod header;

pub use comms::{nccl_present, setup_timeout, unique_id, ABORT_WAIT, SETUP_FLOOR};
pub(crate) use comms::{Comms, NcclNet, Network, P2p};
#[cfg(test)]
pub(crate) use header::check_header;
pub(crate) use header::check_pair;
