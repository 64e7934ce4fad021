//! The NCCL transport (cudarc's `nccl-02028` bindings, loaded at run time): one communicator
//! per GPU, grouped point-to-point sends and receives on the group's streams, what each step
//! of a call sends, the call logic around the pack and unpack kernels, and the host waits. Every
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
//! ([`GpuError::NcclTimeout`](crate::GpuError::NcclTimeout)). An aborted object refuses every
//! later group with an error naming why it was aborted, and is never destroyed.
//!
//! **Release.** `Comms::release` runs first in the group's `Drop`, before any memory or stream
//! the communicators use is freed: it waits (bounded) for the streams, destroys the communicators
//! when they are idle and healthy, and aborts them otherwise. The single-process communicators
//! (`ncclCommInitAll`) stay blocking: their peers are threads of this process and cannot vanish.
//!
//! **Peer counts.** `check_header` (`header`) bounds every count of a batch header a peer sent
//! before it sizes a transfer.
//!
//! **The pieces.** `call`: a group's transport (`Link`: the communicators, each device's rank,
//! NCCL peers and buffers, what a dispatch leaves for its combine) and one call over it: the
//! pack stage, the exchanges, the unpack stage (launched through the group: `Stages`), capacity
//! mode's header poison, the bounded host waits on the streams. `plan`: the message plan, pure
//! (which point-to-point messages each step of a call posts and how large, under both sizings;
//! capacity mode's header poison value). `rounds`: a plan's operations in groups under NCCL's
//! limit. `net`: what a transport is to the library (`P2p`, the `Network` trait: raw post /
//! progress / abort / destroy calls, no policy). `abort`: the abort logic above (the bounded
//! poll, `Guarded`: aborted on a failure or past the bound, the cause recorded, later groups
//! refused, release's destroy-or-abort), written once for any `Network`. `comms`: NCCL as a
//! `Network` (`Nccl`, every NCCL FFI call) and `Comms` = `Guarded<Nccl>` with its
//! constructors. `header`: the batch header checks. `mock` (tests only): a CPU `Network` that
//! pairs every rank's messages as NCCL does and injects failures, so that the plans' sizing
//! (`plan`), the header checks and the abort logic all run in CI without a GPU.

mod abort;
mod call;
mod comms;
mod header;
#[cfg(test)]
pub(crate) mod mock;
mod net;
mod plan;
mod rounds;

pub(crate) use call::{check_sizes, Call, Link, Stages};
pub(crate) use comms::Comms;
pub use comms::{nccl_present, setup_timeout, unique_id, ABORT_WAIT, SETUP_FLOOR};
#[cfg(test)]
pub(crate) use header::check_header;
