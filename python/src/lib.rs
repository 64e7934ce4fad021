//! # ep-python
//!
//! Python bindings of ep-dispatch, importable as `ep_dispatch` (the native part is
//! `ep_dispatch._ep_dispatch`, the Python package beside this crate wraps it):
//! - the oracle and the CPU paths on host data, so tests check the GPU `Buffer` bit for bit;
//! - config and argument checks that raise Python exceptions carrying our typed errors;
//! - `Buffer`, DeepEP's low-latency API over the GPU backend, which this crate reaches through
//!   one module ([`gpu`]).
//!
//! Without the `python` feature (the workspace build) this is a plain Rust library: the host
//! conversions, the size hint and the GPU boundary are tested by `cargo test` with no Python.

pub mod error;
pub mod gpu;
pub mod host;
pub mod keywords;
#[cfg(feature = "python")]
mod py;
pub mod spec;
pub mod tensor;

pub use error::{BindError, Result};
