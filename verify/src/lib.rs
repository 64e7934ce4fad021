//! # ep-verify
//!
//! The checks every change is gated on: the batched path equals the per-expert path equals the
//! oracle, bit for bit, on every output (tests in `tests/`), and loom models of the signaling
//! protocol run on the shipped code (`tests/loom_*.rs`, built with `--cfg ep_loom`).
//!
//! This library holds the harness the tests share: run a path on a workload and compare it, and
//! [`gpu_protocol`], the CUDA kernels' synchronisation as a model that loom checks.

mod check;
pub mod differential;
pub mod gpu_protocol;

pub use check::{
    check_against_oracle, check_against_oracle_format, check_against_oracle_masked,
    check_against_oracle_with, combine_all, combine_all_with, dispatch_all, logfmt_packable,
};
