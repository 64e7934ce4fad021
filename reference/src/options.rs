//! The CPU backend's knobs ([`CpuOptions`]), shared by both CPU paths.

use std::time::Duration;

use crate::error::{Error, Result};

/// Knobs of the CPU backend.
#[derive(Debug, Clone, Copy)]
pub struct CpuOptions {
    /// Bound on every wait of one call.
    pub timeout: Duration,
    /// Staging workers per rank (batched path only); 0 picks one per core the ranks leave
    /// free, at least 1 and at most 4 ([`CpuOptions::workers_for`]). At most
    /// [`MAX_STAGING_WORKERS`]: a group asked for more is refused ([`CpuOptions::check`]).
    pub staging_workers: usize,
    /// Communication memory allowed; `None` means what the OS reports available.
    pub memory_limit: Option<u64>,
    /// DeepEP's shrink mode: a wait for a peer that runs out masks that peer (see
    /// [`EpRank::update_mask`](crate::EpRank::update_mask)) instead of failing the call, and the call completes as the
    /// masked contract says; the waiting rank's outputs then equal the masked oracle's
    /// (`oracle::dispatch_masked`) with that peer masked. Off (the default), such a wait fails
    /// the call with [`Error::Timeout`] and masks nothing. A wait for the
    /// rank's own staging never masks.
    pub enable_shrink: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            timeout: Duration::from_secs(10),
            staging_workers: 0,
            memory_limit: None,
            enable_shrink: false,
        }
    }
}

/// The most staging workers a rank may be given ([`CpuOptions::staging_workers`]). Each worker
/// is a thread of its rank for every call, so past the machine's cores they only contend; 256
/// is above the cores of any machine the CPU backend runs on, and low enough that the OS is
/// never asked for an absurd number of threads (`usize::MAX` overflowed a vector, 10^6 failed
/// to spawn). A fixed number, not one derived from the cores, so a command line that works on
/// one machine is accepted on every other.
pub const MAX_STAGING_WORKERS: usize = 256;

impl CpuOptions {
    /// Checks the options every group checks before it is built: `staging_workers` at most
    /// [`MAX_STAGING_WORKERS`], else [`Error::LimitExceeded`] naming `staging_workers`.
    pub fn check(&self) -> Result<()> {
        if self.staging_workers > MAX_STAGING_WORKERS {
            return Err(Error::LimitExceeded {
                what: "staging_workers",
                value: self.staging_workers as u128,
                limit: MAX_STAGING_WORKERS as u128,
            });
        }
        Ok(())
    }

    /// The staging workers each of `ranks` ranks gets: `staging_workers`, or where that is 0,
    /// the cores per rank (each call starts its workers as threads, and on a machine with fewer
    /// cores than ranks an extra thread costs more than it saves).
    pub fn workers_for(&self, ranks: usize) -> usize {
        if self.staging_workers > 0 {
            return self.staging_workers;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / ranks.max(1)).clamp(1, 4)
    }
}
