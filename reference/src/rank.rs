//! What every path offers a rank ([`EpRank`]), so tests and benchmarks drive them the same
//! way, and running a group's ranks on threads ([`run_ranks`]).

use crate::config::{CombineFormat, Config};
use crate::error::Result;
use crate::mask::RankMask;
use crate::output::{DispatchOutput, Handle};
use crate::transport::CallStats;
use half::bf16;

/// One rank's endpoint of an expert-parallel group, as DeepEP's low-latency `Buffer` offers it.
/// Every rank of the group must make the same sequence of calls (each call is collective).
pub trait EpRank: Send {
    fn rank(&self) -> usize;
    fn config(&self) -> &Config;

    /// Sends this rank's tokens (`x`: n x H, `topk_idx`: n x K) to their experts and returns what
    /// this rank's local experts received, plus the handle combine needs.
    ///
    /// A call rejected for bad input moves nothing and does not count as a collective step.
    fn dispatch(&mut self, x: &[bf16], topk_idx: &[i64]) -> Result<(DispatchOutput, Handle)> {
        let mut out = DispatchOutput::zeroed(self.config());
        let handle = self.dispatch_into(x, topk_idx, &mut out)?;
        Ok((out, handle))
    }

    /// [`EpRank::dispatch`] into an output allocated once (by [`DispatchOutput::zeroed`] for
    /// this config) and reused call after call, as DeepEP's callers reuse their tensors. Rows
    /// past `recv_count` keep whatever an earlier call left there.
    fn dispatch_into(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        out: &mut DispatchOutput,
    ) -> Result<Handle>;

    /// Sends the expert outputs `y` (L x (R*T) x H, in the dispatch layout) back and returns this
    /// rank's tokens, reduced with `topk_weights` in the contract's order (n x H): the rows
    /// travel as bf16 ([`CombineFormat::Bf16`]).
    fn combine(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &Handle,
    ) -> Result<Vec<bf16>> {
        self.combine_with(y, topk_idx, topk_weights, handle, CombineFormat::Bf16)
    }

    /// [`EpRank::combine`] with the rows in `format` (DeepEP's `use_logfmt`); a format the
    /// config does not suit is refused before anything moves ([`CombineFormat::check`]).
    fn combine_with(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &Handle,
        format: CombineFormat,
    ) -> Result<Vec<bf16>>;

    /// What the last successful call put on the wire.
    fn last_stats(&self) -> CallStats;

    /// DeepEP's `update_mask_buffer(rank, mask)`: masks (`true`) or unmasks (`false`) rank
    /// `rank` (docs/contract.md, "Masked ranks"). Later calls neither send to a masked rank nor
    /// wait for it, and a call of a masked rank sends nothing, waits for nobody, still counts as
    /// a call, and returns outputs the contract leaves undefined.
    ///
    /// Masking is valid at any time. Unmasking is valid only while every rank of the group is
    /// between calls and all have made the same number of dispatch calls and of combine calls,
    /// and every rank's next call starts after it; a group whose counts differ is refused with
    /// [`Error::UnmaskOutOfStep`](crate::Error::UnmaskOutOfStep), and nothing changes. A rank
    /// outside the group is [`Error::RankOutOfRange`](crate::Error::RankOutOfRange).
    ///
    /// On the CPU backend the ranks share one mask: masking a rank on one endpoint masks it
    /// for all (calling it on every endpoint, as DeepEP's users do, changes nothing more).
    fn update_mask(&mut self, rank: usize, masked: bool) -> Result<()>;

    /// DeepEP's `query_mask_buffer`: the ranks masked now, by a caller or by a wait that ran
    /// out in shrink mode ([`CpuOptions::enable_shrink`](crate::CpuOptions::enable_shrink)).
    fn query_mask(&self) -> RankMask;

    /// DeepEP's `clean_mask_buffer`: unmasks every rank, under the rule of
    /// [`EpRank::update_mask`]'s unmasking.
    fn clean_mask(&mut self) -> Result<()>;
}

/// A fresh id for a communicator, so handles from another one are recognised.
pub fn next_group_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Runs `f` on every rank at once, one thread per rank, and returns the results in rank order.
pub fn run_ranks<R, T, F>(ranks: &mut [R], f: F) -> Vec<T>
where
    R: Send,
    T: Send,
    F: Fn(&mut R) -> T + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.iter_mut().map(|r| s.spawn(|| f(r))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}
