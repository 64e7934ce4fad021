//! What can go wrong in the example, each kind naming what it is about.

use ep_group::GroupError;
use ep_kernels::GpuError;

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// A setting of the flags that the library refuses (clap checked each flag on its own).
    #[error("{flag} {value}: {why}")]
    Flag {
        flag: &'static str,
        value: String,
        why: String,
    },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Group(#[from] GroupError),
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The layer's outputs differ from the oracle's.
    #[error("{0}")]
    Mismatch(String),
    #[error("launch: {0}")]
    Launch(String),
}

/// A cudarc result as a [`LayerError::Cuda`] saying what was being done.
pub fn cuda<T, E: std::fmt::Debug>(what: &str, r: Result<T, E>) -> Result<T, LayerError> {
    r.map_err(|e| LayerError::Cuda(format!("{what}: {e:?}")))
}
