//! Bounded host waits for a set of streams (the group's release, the NCCL transport's).

use crate::runtime::driver;
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

/// How a bounded wait for a set of streams ended ([`drain_streams`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drain {
    /// Every stream finished its work.
    Idle,
    /// Some stream was still running at the bound.
    Busy,
    /// None was running, but some context could not be bound or some stream reported an
    /// error (a faulted context): nothing more will run there.
    Failed,
}

/// Polls every stream (each with its context) until it finishes, at most `bound` in all. Every
/// stream is looked at, so a failed one never hides a busy one after it.
pub(crate) fn drain_streams(
    streams: &[(Arc<CudaContext>, sys::CUstream)],
    bound: std::time::Duration,
) -> Drain {
    let t0 = std::time::Instant::now();
    let mut failed = false;
    for (ctx, s) in streams {
        if ctx.bind_to_thread().is_err() {
            failed = true;
            continue;
        }
        loop {
            // SAFETY: `s` is a live stream of the bound context (the caller's).
            match unsafe { driver::stream_done(*s) } {
                Ok(true) => break,
                Ok(false) if t0.elapsed() < bound => {
                    std::thread::sleep(std::time::Duration::from_micros(50))
                }
                Ok(false) => return Drain::Busy,
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
    }
    if failed {
        Drain::Failed
    } else {
        Drain::Idle
    }
}
