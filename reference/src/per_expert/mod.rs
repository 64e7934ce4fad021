//! The per-expert protocol on the CPU backend: every selection is its own message, written into
//! the owning rank's region for (local expert, source rank); one signal per expert per source.
//! Combine sends every expert row back on its own. Simple, obviously right, slow: the
//! executable form of docs/contract.md's "Per-expert (the reference)". Masked ranks (DeepEP's
//! shrink mode) are skipped as [`crate::transport::mask_table`] describes.

mod combine;
mod dispatch;
mod shared;

use crate::config::{CombineFormat, Config};
use crate::error::{Op, Result};
use crate::mask::RankMask;
use crate::numerics::logfmt_wire::slot_bytes;
use crate::options::CpuOptions;
use crate::output::{DispatchOutput, Handle};
use crate::rank::{next_group_id, EpRank};
use crate::sync::Arc;
use crate::transport::{memory, CallStats, CreditTable, MaskTable, Waiter};
use half::bf16;

pub use shared::MESSAGE_META_BYTES;
use shared::{Region, Shared};

/// Communication memory the per-expert path needs for `cfg`, in bytes (`u64::MAX` where the
/// size does not fit in a `usize`; see [`try_bytes_needed`]).
pub fn bytes_needed(cfg: &Config) -> u64 {
    Shared::bytes_needed(cfg)
}

/// Communication memory the per-expert path needs for `cfg`, in bytes, or
/// [`Error::LimitExceeded`](crate::Error::LimitExceeded) where it does not fit in a `usize`.
pub fn try_bytes_needed(cfg: &Config) -> Result<usize> {
    Shared::try_bytes_needed(cfg)
}

/// The per-expert path's endpoint for one rank.
pub struct PerExpertRank {
    shared: Arc<Shared>,
    rank: usize,
    timeout: std::time::Duration,
    shrink: bool,
    dispatch_calls: u64,
    combine_calls: u64,
    stats: CallStats,
}

/// Builds the group: one endpoint per rank, sharing its buffers.
pub fn group(cfg: &Config, opts: CpuOptions) -> Result<Vec<PerExpertRank>> {
    cfg.validate()?;
    // This path has no staging workers, but the options are checked alike on every path.
    opts.check()?;
    memory::check(Shared::try_bytes_needed(cfg)? as u64, opts.memory_limit)?;
    let (r, e, t) = (cfg.num_ranks, cfg.num_experts, cfg.max_tokens_per_rank);
    let shared = Arc::new(Shared {
        cfg: *cfg,
        group_id: next_group_id(),
        dispatch: (0..r * e)
            .map(|_| Region::new(t, Shared::dispatch_message_bytes(cfg)))
            .collect(),
        dispatch_credit: CreditTable::new(r),
        combine: (0..r * e)
            .map(|_| Region::new(t, slot_bytes(cfg.hidden)))
            .collect(),
        combine_credit: CreditTable::new(r),
        mask: MaskTable::new(r),
    });
    Ok((0..r)
        .map(|rank| PerExpertRank {
            shared: shared.clone(),
            rank,
            timeout: opts.timeout,
            shrink: opts.enable_shrink,
            dispatch_calls: 0,
            combine_calls: 0,
            stats: CallStats::default(),
        })
        .collect())
}

impl PerExpertRank {
    /// The bound on every wait of this rank's next calls (initially `CpuOptions::timeout`).
    pub fn set_timeout(&mut self, timeout: std::time::Duration) {
        self.timeout = timeout;
    }

    fn waiter(&self, op: Op, call: u64) -> Waiter {
        Waiter {
            rank: self.rank,
            shrink: self.shrink,
            op,
            call,
        }
    }
}

impl EpRank for PerExpertRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn config(&self) -> &Config {
        &self.shared.cfg
    }

    fn dispatch_into(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        out: &mut DispatchOutput,
    ) -> Result<Handle> {
        let n =
            crate::input::check_dispatch_inputs(&self.shared.cfg, self.rank, x.len(), topk_idx)?;
        crate::input::check_output(&self.shared.cfg, self.rank, out)?;
        self.dispatch_calls += 1;
        let epoch = self.dispatch_calls;
        let sh = &*self.shared;
        sh.mask.begin_call(self.rank, Op::Dispatch, epoch);
        let mut skip = sh.mask.snapshot();
        if skip.is_masked(self.rank) {
            // A masked rank sends nothing and waits for nobody; its outputs are undefined
            // (here: nothing received). It read nothing, so peers may reuse its buffers.
            sh.dispatch_credit.grant_all(self.rank, epoch);
            out.set_layout(&vec![0; sh.cfg.num_local_experts() * sh.cfg.num_ranks]);
            self.stats = CallStats::default();
            return Ok(Handle::new(sh.group_id, self.rank, topk_idx, out).with_mask(skip));
        }
        let w = self.waiter(Op::Dispatch, epoch);
        let res = dispatch::run(sh, w, self.timeout, n, x, topk_idx, &mut skip, out);
        match res {
            Ok(stats) => {
                self.stats = stats;
                skip.union_with(&sh.mask.snapshot());
                Ok(Handle::new(sh.group_id, self.rank, topk_idx, out).with_mask(skip))
            }
            Err(e) => {
                // Give the call up: peers may reuse our buffers (see `transport::signal`).
                sh.dispatch_credit.grant_all(self.rank, epoch);
                Err(e)
            }
        }
    }

    fn combine_with(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &Handle,
        format: CombineFormat,
    ) -> Result<Vec<bf16>> {
        let sh = &*self.shared;
        format.check(&sh.cfg)?;
        crate::input::check_combine_inputs(
            &sh.cfg,
            self.rank,
            y.len(),
            topk_idx,
            topk_weights.len(),
        )?;
        handle.check(sh.group_id, self.rank, &sh.cfg, topk_idx)?;
        self.combine_calls += 1;
        let epoch = self.combine_calls;
        sh.mask.begin_call(self.rank, Op::Combine, epoch);
        // The dispatch's mask as well as today's: never wait for rows it did not send.
        let mut skip = handle.mask.clone();
        skip.union_with(&sh.mask.snapshot());
        if skip.is_masked(self.rank) {
            sh.combine_credit.grant_all(self.rank, epoch);
            self.stats = CallStats::default();
            return Ok(vec![bf16::ZERO; handle.num_tokens() * sh.cfg.hidden]);
        }
        let w = self.waiter(Op::Combine, epoch);
        match combine::run(
            sh,
            w,
            self.timeout,
            y,
            topk_weights,
            handle,
            &mut skip,
            format,
        ) {
            Ok((out, stats)) => {
                self.stats = stats;
                Ok(out)
            }
            Err(e) => {
                sh.combine_credit.grant_all(self.rank, epoch);
                Err(e)
            }
        }
    }

    fn update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.shared.mask.update(self.rank, rank, masked)
    }

    fn query_mask(&self) -> RankMask {
        self.shared.mask.snapshot()
    }

    fn clean_mask(&mut self) -> Result<()> {
        self.shared.mask.clean(self.rank)
    }

    fn last_stats(&self) -> CallStats {
        self.stats
    }
}
