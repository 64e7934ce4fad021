//! GPU tests: both paths bit-identical to the oracle. A custom runner (`harness = false`): each
//! test needs a CUDA GPU (some two, some NCCL too) and NVRTC, as it declares beside its code
//! (its module's `TESTS`, one `gpu_test!` per test function); where they are missing it prints
//! `SKIPPED: <test>: <reason>` and is counted as skipped, never as passed. The summary line gives
//! passed / failed / skipped, and the process fails when a test failed. Tests run one at a time
//! (a launch occupies every multiprocessor). Arguments: an optional name filter; cargo's flags
//! (`--nocapture`, `--test-threads=N`, ...) are accepted and ignored.

mod common;
mod device;
mod errors;
mod graphs;
mod logfmt;
mod memory;
mod nccl;
mod paths;
mod wide;

use ep_test_runner::{GpuTest, Runner};
use errors::{trap_child, TRAP_CHILD};

/// Every module's tests (each module's `TESTS`: its test functions and what each needs), in the
/// order they run.
const TESTS: &[&[GpuTest]] = &[
    paths::TESTS,
    logfmt::TESTS,
    nccl::TESTS,
    device::TESTS,
    graphs::TESTS,
    errors::TESTS,
    wide::TESTS,
    memory::TESTS,
];

fn main() {
    if std::env::var_os(TRAP_CHILD).is_some() {
        trap_child();
    }
    let mut runner = Runner::new("gpu tests");
    runner.run_all(TESTS);
    runner.finish()
}
