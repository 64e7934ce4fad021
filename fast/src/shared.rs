//! What the batched path's ranks share: the receiving regions, the group's communication
//! buffers ([`Shared`]) and the opening of a call on one side.

use crate::batch;
use crate::finish::FinishCounter;
use ep_reference::config::{checked_product, checked_sum};
use ep_reference::numerics::logfmt_wire::slot_bytes;
use ep_reference::sync::{Deadline, SharedRows};
use ep_reference::transport::{CreditTable, MaskTable, Signal, Waiter};
use ep_reference::{Config, CpuOptions, RankMask, Result};

/// A (destination, source) receiving region: the batch rows and the one signal.
pub(crate) struct Region {
    pub rows: SharedRows,
    pub signal: Signal,
}

/// The group's communication buffers, allocated once.
pub struct Shared {
    pub(crate) cfg: Config,
    pub(crate) opts: CpuOptions,
    pub(crate) group_id: u64,
    /// Dispatch batches, index `dst * R + src`: up to T entries each.
    pub(crate) dispatch: Vec<Region>,
    pub(crate) dispatch_credit: CreditTable,
    /// Dispatch finish counters, index `src * R + dst` (owned by the source).
    pub(crate) dispatch_finish: Vec<FinishCounter>,
    /// Combine batches, index `dst * R + src` (dst: the tokens' rank, src: the experts' rank):
    /// up to T * min(K, L) row slots of `logfmt_wire::slot_bytes(H)` bytes (a bf16 row's 2H, or a
    /// LogFMT row's largest).
    pub(crate) combine: Vec<Region>,
    pub(crate) combine_credit: CreditTable,
    pub(crate) combine_finish: Vec<FinishCounter>,
    /// The group's rank mask and every rank's call counts (`ep_reference::transport::mask_table`).
    pub(crate) mask: MaskTable,
    /// Unit tests' fault injection: (rank, worker) whose next staging panics.
    #[cfg(test)]
    pub(crate) panic_at: std::sync::Mutex<Option<(usize, usize)>>,
}

impl Shared {
    /// Unit tests' fault injection: panics once if (rank, worker) was armed.
    #[cfg(test)]
    pub(crate) fn maybe_panic(&self, rank: usize, worker: usize) {
        let mut at = self.panic_at.lock().unwrap();
        if *at == Some((rank, worker)) {
            *at = None;
            drop(at);
            panic!("injected fault in staging worker {worker} of rank {rank}");
        }
    }

    #[cfg(not(test))]
    #[inline(always)]
    pub(crate) fn maybe_panic(&self, _rank: usize, _worker: usize) {}
}

impl Shared {
    pub(crate) fn combine_rows(cfg: &Config) -> usize {
        cfg.max_tokens_per_rank * cfg.top_k.min(cfg.num_local_experts())
    }

    /// Communication memory of the whole group, in bytes: R x R dispatch regions of T entries
    /// and R x R combine regions of T x min(K, L) row slots. Fails with
    /// [`ep_reference::Error::LimitExceeded`] where that does not fit in a `usize`.
    pub fn try_bytes_needed(cfg: &Config) -> Result<usize> {
        let d = checked_product(
            "bytes of one batched dispatch region (max_tokens_per_rank x entry bytes)",
            &[cfg.max_tokens_per_rank, batch::entry_bytes(cfg)],
        )?;
        let c = checked_product(
            "bytes of one batched combine region (max_tokens_per_rank x min(top_k, L) x row slot bytes)",
            &[Self::combine_rows(cfg), slot_bytes(cfg.hidden)],
        )?;
        let pair = checked_sum("bytes of one batched (source, destination) pair", &[d, c])?;
        checked_product(
            "batched communication bytes (num_ranks^2 x pair bytes)",
            &[cfg.num_ranks, cfg.num_ranks, pair],
        )
    }

    /// [`Shared::try_bytes_needed`], `u64::MAX` where it does not fit.
    pub fn bytes_needed(cfg: &Config) -> u64 {
        Self::try_bytes_needed(cfg).map_or(u64::MAX, |b| b as u64)
    }
}

/// Opens call `w.call` of `w.rank` on one side (dispatch or combine): every destination not in
/// `skip` must have released our previous batch before staging writes into it (a destination
/// masked meanwhile joins `skip`, and is not written; on a timeout the call is given up, see
/// [`CreditTable::grant_all`]), then the finish counters are opened. `deadline` is restarted
/// where shrink masked a peer (`MaskTable::wait`).
pub(crate) fn open_call(
    sh: &Shared,
    credits: &CreditTable,
    finish: &[FinishCounter],
    w: Waiter,
    deadline: &mut Deadline,
    skip: &mut RankMask,
) -> Result<()> {
    if let Err(e) = credits.wait_unmasked_writable(&sh.mask, w, w.call, deadline, skip) {
        credits.grant_all(w.rank, w.call);
        return Err(e);
    }
    for f in finish {
        f.open();
    }
    Ok(())
}
