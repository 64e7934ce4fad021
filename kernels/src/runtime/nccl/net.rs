//! What a network transport is to the rest of the library: the point-to-point operations of a
//! group ([`P2p`]) and the raw calls of its communicators ([`Network`]). NCCL implements it on the
//! GPU (`comms::Nccl`); a CPU network implements it in the tests (`mock::CpuNet`). Neither
//! decides anything about failures: `abort::Guarded` does, the same for both.

use crate::error::GpuError;

/// One point-to-point operation of a group.
#[derive(Debug)]
pub(crate) enum P2p {
    Send { buf: u64, bytes: usize, peer: usize },
    Recv { buf: u64, bytes: usize, peer: usize },
}

/// The communicators of a transport, one per device (index = the group's device index), as raw
/// calls without policy: they neither refuse a call nor abort by themselves, and report every
/// failure as an error built at once (NCCL's text for it is gone after an abort).
/// `abort::Guarded` holds one and decides when to abort, and refuses every call after that.
pub(crate) trait Network {
    /// Where a device's operations are queued (a CUDA stream for NCCL).
    type Queue: Copy;

    /// How many communicators there are (0 once they were aborted or destroyed).
    fn devices(&self) -> usize;

    /// The group rank of communicator `i` (errors name it).
    fn rank(&self, i: usize) -> usize;

    /// Posts `ops[i]` on (communicator i, `queues[i]`) as one group; zero-byte operations are
    /// left out (both sides know the same sizes, so they leave out the same pairs). The caller
    /// has checked that there are enough communicators and queues. Returns once the group is
    /// handed over (its completion may still be in progress: [`Network::progress`]), or the
    /// first failure.
    fn post(&mut self, queues: &[Self::Queue], ops: &[Vec<P2p>]) -> Result<(), GpuError>;

    /// Whether communicator `i` finished what was started on it (its creation, a group's
    /// enqueue and connections): `Ok(true)` done, `Ok(false)` still in progress, or the failure
    /// of the step `what`.
    fn progress(&mut self, i: usize, what: &'static str) -> Result<bool, GpuError>;

    /// Aborts every communicator (their pending work is dropped, peers waiting on them fail).
    /// Called at most once; nothing is called on them after it.
    fn abort_all(&mut self);

    /// Destroys every communicator in order (their work is done). Called at most once, and
    /// never after [`Network::abort_all`].
    fn destroy_all(&mut self);
}
