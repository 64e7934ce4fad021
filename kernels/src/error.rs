//! The GPU library's error type.

/// Errors of the GPU backend.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// Bad input, a config the device cannot hold, or a timed-out wait: the contract's errors.
    #[error(transparent)]
    Contract(#[from] ep_reference::Error),
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An NCCL call failed.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// A CUDA IPC handle exchange or a peer process failed.
    #[error("multi-process: {0}")]
    Process(String),
    /// NVRTC failed to compile a kernel.
    #[error("NVRTC: {0}")]
    Compile(String),
    /// No usable GPU (no driver, no NVRTC, too few devices).
    #[error("no usable GPU: {0}")]
    NoDevice(String),
    /// A config outside what the GPU kernels support (e.g. uneven ranks per GPU).
    #[error("unsupported on the GPU: {0}")]
    Unsupported(String),
    /// More ranks than the GPU kernels take (`ep_kernels::runtime::MAX_RANKS`, 256); the
    /// specification and the CPU paths go further.
    #[error("{ranks} ranks; the GPU kernels support at most {max}")]
    TooManyRanks { ranks: usize, max: usize },
    /// A peer-supplied count or header field outside its bound (caught on the device before use).
    #[error("rank {rank}: rank {peer} sent {field} = {value}, outside [0, {limit}]")]
    PeerData {
        rank: usize,
        peer: usize,
        field: &'static str,
        value: i64,
        limit: u64,
    },
    /// A peer published that its group failed (a poisoned signal or batch header: its kernels
    /// send nothing valid once its group recorded an error, or its input was bad), so this
    /// rank's call `call` of `phase` could not complete; its outputs are the failed call's.
    #[error("rank {rank}: rank {peer} failed (its group recorded an error), so {phase} call {call} could not complete")]
    PeerFailed {
        rank: usize,
        peer: usize,
        phase: ep_reference::Phase,
        call: u64,
    },
    /// A caller's stream (or tensor) belongs to another device or context than the group's.
    #[error("{what} belongs to device {got}, the group's ranks there run on device {expected}")]
    WrongDevice {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A device-API handle used with another group, path or call than it came from.
    #[error("stale or foreign handle: {0}")]
    Handle(String),
    /// Combine was called on another path than the last dispatch.
    #[error(
        "combine on the {combine} path needs a dispatch on that path (last dispatch: {dispatch})"
    )]
    PathMismatch {
        combine: &'static str,
        dispatch: &'static str,
    },
    /// Process mode: a peer runs another version, config, transport or buffer layout than this
    /// rank (found before any of its memory was mapped, or when the mapping is too small).
    #[error("rank {rank} and rank {peer} disagree on {field}: rank {rank} has {ours}, rank {peer} has {theirs}")]
    PeerMismatch {
        field: &'static str,
        ours: String,
        theirs: String,
        rank: usize,
        peer: usize,
    },
    /// A count a peer sent (an NCCL batch header) is out of bounds; nothing was sized by it.
    #[error("rank {rank}: rank {peer} sent {field} = {value}, expected {expected}")]
    PeerCount {
        rank: usize,
        peer: usize,
        field: &'static str,
        value: i64,
        expected: String,
    },
    /// An NCCL step that waits on peers (communicator set-up, a grouped send/receive) did not
    /// finish in time; the communicators were aborted and the group is unusable.
    #[error("rank {rank}: {what} did not complete within {waited_ms} ms (a peer is dead, stalled or missing); the NCCL communicators were aborted")]
    NcclTimeout {
        rank: usize,
        what: &'static str,
        waited_ms: u64,
    },
}

/// A driver call's result as ours: a failure becomes [`GpuError::Cuda`] naming `what` was done.
pub(crate) fn cuda<T>(
    what: &str,
    r: Result<T, cudarc::driver::result::DriverError>,
) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Cuda(format!("{what}: {e:?}")))
}
