//! The process-group layer's error type: the GPU library's errors, and what forming a group
//! across processes adds (the node id, the peers' handshake records, the exchange itself).

use crate::node::NodeIdError;
use crate::wire::BlobError;
use ep_kernels::GpuError;

/// Errors of process mode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GroupError {
    /// The GPU library's errors (this rank's allocation, the peers' mappings, NCCL set-up, and
    /// every call of the formed group).
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// This process's node id (`EP_NODE_ID`, `GROUP_RANK`, the hostname) is invalid or missing
    /// ([`crate::topology`]).
    #[error("node id: {0}")]
    Node(#[from] NodeIdError),
    /// A peer's handshake record could not be read (nothing of it was used).
    #[error("rank {rank}: the handshake record of rank {peer} is malformed: {error}")]
    PeerBlob {
        rank: usize,
        peer: usize,
        error: BlobError,
    },
    /// A peer runs another version, config, transport or buffer layout than this rank, or sits
    /// on a node this rank's transport cannot reach (found before any of its memory is mapped).
    #[error("rank {rank} and rank {peer} disagree on {field}: rank {rank} has {ours}, rank {peer} has {theirs}")]
    PeerMismatch {
        field: &'static str,
        ours: String,
        theirs: String,
        rank: usize,
        peer: usize,
    },
    /// The exchange failed (the all-gather, or a record this rank cannot send).
    #[error("multi-process: {0}")]
    Process(String),
}

impl From<ep_reference::Error> for GroupError {
    fn from(e: ep_reference::Error) -> Self {
        GroupError::Gpu(GpuError::Contract(e))
    }
}
