//! The one error type of the bindings: the contract's errors, the GPU backend's, and bad
//! arguments found while turning Python values into Rust ones. The PyO3 glue maps each to its
//! Python exception class (`py/exceptions.rs`).

use ep_group::GroupError;
use ep_kernels::GpuError;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BindError {
    /// A contract error (bad config, bad input, peer mismatch, timeout, out of memory).
    #[error(transparent)]
    Contract(#[from] ep_reference::Error),
    /// The GPU backend's own errors (CUDA, NCCL, no device, unsupported, ...).
    #[error(transparent)]
    Gpu(GpuError),
    /// Process mode's own errors (the node id, the peers' handshake records, the exchange).
    #[error(transparent)]
    Group(GroupError),
    /// An argument that cannot be used as given (wrong byte length, unknown name, ...).
    #[error("argument `{argument}`: {reason}")]
    Argument { argument: String, reason: String },
    /// The GPU execution this build does not have.
    #[error("not built: {0}")]
    NotBuilt(String),
}

impl From<GpuError> for BindError {
    fn from(e: GpuError) -> Self {
        match e {
            // Keep the contract's errors as such, so a timeout raises the timeout exception.
            GpuError::Contract(c) => BindError::Contract(c),
            other => BindError::Gpu(other),
        }
    }
}

impl From<GroupError> for BindError {
    fn from(e: GroupError) -> Self {
        match e {
            GroupError::Gpu(g) => g.into(),
            other => BindError::Group(other),
        }
    }
}

impl BindError {
    pub fn argument(argument: &str, reason: impl Into<String>) -> BindError {
        BindError::Argument {
            argument: argument.to_string(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = BindError> = std::result::Result<T, E>;
