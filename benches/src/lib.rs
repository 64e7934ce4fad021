//! # ep-benches
//!
//! The side-by-side comparison of ep-dispatch's two paths, per-expert and per-destination
//! batched, on the same inputs and the same machine: the `ep-bench` program and the criterion
//! benches (`cargo bench -p ep-benches`).
//!
//! - [`spec`]: the point to run and why it may produce no figures;
//! - [`backend`]: which machine runs it (`--backend auto|cpu|gpu`);
//! - [`cpu`]: the CPU backend: checks both paths bitwise against the oracle and each other,
//!   then times every rank's own dispatch and combine;
//! - [`gpu`]: the GPU backend: the [`timing`] harness on a group of ep-kernels;
//! - [`report`]: the figures derived from raw samples and how they print;
//! - [`flags`], [`memory`]: ep-bench's checks before anything runs: config errors in the
//!   command line's words, and the memory a point needs against what the machine has;
//! - [`accounting`], [`stats`]: docs/contract.md's bandwidth accounting and the percentile math;
//! - [`timing`], [`cupti`], [`traffic`]: the GPU timing harness (CUDA events, graph replay, the
//!   receive-hook split), kernel time from CUPTI's activity records, and the wire figures of
//!   the GPU transports;
//! - [`multiproc`]: `ep-bench --nprocs`, one process per rank.

pub mod accounting;
pub mod backend;
pub mod cpu;
pub mod cupti;
pub mod flags;
pub mod gpu;
pub mod memory;
pub mod multiproc;
pub mod report;
pub mod spec;
pub mod stats;
pub mod timing;
pub mod traffic;

/// The README's code blocks, compiled (and the CPU one run) by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
