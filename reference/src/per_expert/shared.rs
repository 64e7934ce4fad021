//! What the per-expert path's ranks share: the message layout, the receiving regions, the
//! group's communication memory ([`Shared`]) and the credit wait both directions make.

use crate::config::{checked_product, checked_sum, Config};
use crate::error::Result;
use crate::mask::RankMask;
use crate::numerics::logfmt_wire::slot_bytes;
use crate::sync::{Deadline, SharedRows};
use crate::transport::{CreditTable, MaskTable, Signal, Waiter};

/// Bytes of metadata in front of each per-expert dispatch message (the source token index,
/// padded to 16 bytes as DeepEP does).
pub const MESSAGE_META_BYTES: usize = 16;

/// One receiving region: rows, the signal its one sender posts, for one call at a time.
pub(crate) struct Region {
    pub rows: SharedRows,
    pub signal: Signal,
}

impl Region {
    pub(crate) fn new(rows: usize, row_bytes: usize) -> Region {
        Region {
            rows: SharedRows::new(rows, row_bytes),
            signal: Signal::new(),
        }
    }
}

/// Memory every rank can write: the group's communication buffers.
pub(crate) struct Shared {
    pub cfg: Config,
    pub group_id: u64,
    /// Dispatch regions, index `(dst * L + l) * R + src`: T messages each.
    pub dispatch: Vec<Region>,
    pub dispatch_credit: CreditTable,
    /// Combine regions, index `dst * E + e` (dst: the token's rank, e: the global expert):
    /// T row slots of `logfmt_wire::slot_bytes(H)` bytes (a bf16 row's 2H, or a LogFMT row's
    /// largest), indexed by token.
    pub combine: Vec<Region>,
    /// Combine credits (src: the experts' rank, dst: the tokens' rank).
    pub combine_credit: CreditTable,
    /// The group's rank mask and every rank's call counts (`transport::mask_table`).
    pub mask: MaskTable,
}

impl Shared {
    pub(crate) fn dispatch_message_bytes(cfg: &Config) -> usize {
        MESSAGE_META_BYTES + cfg.payload_bytes()
    }

    /// Communication memory of the whole group, in bytes: R x E regions of T dispatch
    /// messages and T combine row slots. Fails with
    /// [`Error::LimitExceeded`](crate::Error::LimitExceeded) where that does not fit in a
    /// `usize`.
    pub fn try_bytes_needed(cfg: &Config) -> Result<usize> {
        let row = checked_sum(
            "bytes of one per-expert message and combine row",
            &[Self::dispatch_message_bytes(cfg), slot_bytes(cfg.hidden)],
        )?;
        checked_product(
            "per-expert communication bytes (num_ranks x num_experts x max_tokens_per_rank x row bytes)",
            &[cfg.num_ranks, cfg.num_experts, cfg.max_tokens_per_rank, row],
        )
    }

    /// [`Shared::try_bytes_needed`], `u64::MAX` where it does not fit.
    pub fn bytes_needed(cfg: &Config) -> u64 {
        Self::try_bytes_needed(cfg).map_or(u64::MAX, |b| b as u64)
    }
}

/// Waits for the credit of call `w.call - 1` of every destination not in `skip` (masked ones
/// join `skip`).
pub(crate) fn wait_credits(
    credits: &CreditTable,
    mask: &MaskTable,
    w: Waiter,
    deadline: &mut Deadline,
    skip: &mut RankMask,
) -> Result<()> {
    credits.wait_unmasked_writable(mask, w, w.call, deadline, skip)
}
