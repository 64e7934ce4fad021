//! # ep-fast
//!
//! The per-destination batched path (docs/contract.md "Two ways to move the same data"): every token
//! bound for a destination rank travels in one batch, once, with its list of local experts there;
//! one put and one signal per (source, destination) pair; the receiver expands the batch into the
//! canonical per-expert layout. Combine batches every row bound for a rank the same way.
//!
//! On the CPU backend each rank stages with several workers that follow the finish-counter
//! protocol ([`finish`]); the buffers are allocated once per group and reused call after call,
//! with epoch-tagged signals and credits (`ep_reference::transport`). DeepEP's shrink mode (a
//! rank mask, `EpRank::update_mask`, `CpuOptions::enable_shrink`) works as
//! `ep_reference::transport::mask_table` describes for both CPU paths.
//!
//! Under `--cfg ep_loom` the staging workers cannot be spawned as scoped threads (loom has no
//! scope): drive [`DispatchCall`] / [`CombineCall`] from loom threads instead, or use one worker.

pub mod batch;
mod combine;
mod dispatch;
pub mod finish;
mod shared;

pub use combine::CombineCall;
pub use dispatch::DispatchCall;
pub use shared::Shared;

use ep_reference::bf16;
use ep_reference::numerics::logfmt_wire::slot_bytes;
use ep_reference::rank::next_group_id;
use ep_reference::sync::{Arc, Deadline, SharedRows};
use ep_reference::transport::{memory, CreditTable, MaskTable, Signal, Waiter};
use ep_reference::{
    CallStats, CombineFormat, Config, CpuOptions, DispatchOutput, EpRank, Handle, Path, RankMask,
    Result,
};

use finish::FinishCounter;
use shared::Region;

/// One rank of either path's CPU group ([`path_group`]).
pub type AnyRank = Box<dyn EpRank>;

/// `path`'s group on the CPU backend, one builder for every caller (the benchmark, the Python
/// package): the per-expert reference protocol (`ep_reference::per_expert`) or this crate's
/// batched one ([`group`]); one endpoint per rank, refused as the path's own builder refuses.
pub fn path_group(path: Path, cfg: &Config, opts: CpuOptions) -> Result<Vec<AnyRank>> {
    fn boxed<R: EpRank + 'static>(ranks: Vec<R>) -> Vec<AnyRank> {
        ranks.into_iter().map(|r| Box::new(r) as AnyRank).collect()
    }
    Ok(match path {
        Path::PerExpert => boxed(ep_reference::per_expert::group(cfg, opts)?),
        Path::Batched => boxed(group(cfg, opts)?),
    })
}

/// Builds the group: one endpoint per rank, sharing its buffers. Options out of range
/// ([`CpuOptions::check`]: more than `MAX_STAGING_WORKERS` staging workers) are refused with
/// [`ep_reference::Error::LimitExceeded`].
pub fn group(cfg: &Config, opts: CpuOptions) -> Result<Vec<BatchedRank>> {
    cfg.validate()?;
    opts.check()?;
    memory::check(Shared::try_bytes_needed(cfg)? as u64, opts.memory_limit)?;
    let r = cfg.num_ranks;
    let region = |rows, bytes| Region {
        rows: SharedRows::new(rows, bytes),
        signal: Signal::new(),
    };
    let shared = Arc::new(Shared {
        cfg: *cfg,
        opts: CpuOptions {
            staging_workers: opts.workers_for(r),
            ..opts
        },
        group_id: next_group_id(),
        dispatch: (0..r * r)
            .map(|_| region(cfg.max_tokens_per_rank, batch::entry_bytes(cfg)))
            .collect(),
        dispatch_credit: CreditTable::new(r),
        dispatch_finish: (0..r * r).map(|_| FinishCounter::new()).collect(),
        combine: (0..r * r)
            .map(|_| region(Shared::combine_rows(cfg), slot_bytes(cfg.hidden)))
            .collect(),
        combine_credit: CreditTable::new(r),
        combine_finish: (0..r * r).map(|_| FinishCounter::new()).collect(),
        mask: MaskTable::new(r),
        #[cfg(test)]
        panic_at: std::sync::Mutex::new(None),
    });
    Ok((0..r)
        .map(|rank| BatchedRank {
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

/// The batched path's endpoint for one rank.
pub struct BatchedRank {
    shared: Arc<Shared>,
    rank: usize,
    timeout: std::time::Duration,
    shrink: bool,
    dispatch_calls: u64,
    combine_calls: u64,
    stats: CallStats,
}

impl BatchedRank {
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The bound on every wait of this rank's next calls (initially `CpuOptions::timeout`).
    pub fn set_timeout(&mut self, timeout: std::time::Duration) {
        self.timeout = timeout;
    }

    fn waiter(&self, op: ep_reference::Op, call: u64) -> Waiter {
        Waiter {
            rank: self.rank,
            shrink: self.shrink,
            op,
            call,
        }
    }

    /// Starts a dispatch: checks the inputs, advances the call number, waits until every
    /// destination has released our previous batch, and opens the finish counters. Drive the
    /// returned call with [`DispatchCall::stage`] (once per worker, from any threads) and
    /// [`DispatchCall::receive`], then [`DispatchCall::end`] it.
    pub fn dispatch_begin<'a>(
        &mut self,
        x: &'a [bf16],
        topk_idx: &'a [i64],
    ) -> Result<DispatchCall<'a>> {
        let cfg = self.shared.cfg;
        ep_reference::input::check_dispatch_inputs(&cfg, self.rank, x.len(), topk_idx)?;
        self.dispatch_calls += 1;
        DispatchCall::begin(
            self.shared.clone(),
            self.waiter(ep_reference::Op::Dispatch, self.dispatch_calls),
            Deadline::after(self.timeout),
            x,
            topk_idx,
        )
    }

    /// Starts a combine with the rows in `format`; drive it like a dispatch
    /// ([`CombineCall::stage`], then [`CombineCall::receive`] and [`CombineCall::end`]).
    pub fn combine_begin<'a>(
        &mut self,
        y: &'a [bf16],
        topk_idx: &[i64],
        topk_weights: &'a [f32],
        handle: &'a Handle,
        format: CombineFormat,
    ) -> Result<CombineCall<'a>> {
        let sh = &self.shared;
        format.check(&sh.cfg)?;
        ep_reference::input::check_combine_inputs(
            &sh.cfg,
            self.rank,
            y.len(),
            topk_idx,
            topk_weights.len(),
        )?;
        handle.check(sh.group_id, self.rank, &sh.cfg, topk_idx)?;
        self.combine_calls += 1;
        CombineCall::begin(
            sh.clone(),
            self.waiter(ep_reference::Op::Combine, self.combine_calls),
            Deadline::after(self.timeout),
            y,
            topk_weights,
            handle,
            format,
        )
    }
}

/// The message of a caught panic.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Runs `f`, turning a panic into `on_panic(message)`.
fn catch<T>(
    on_panic: &(impl Fn(String) -> ep_reference::Error + Sync),
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(on_panic(panic_message(&*p))))
}

/// Runs `stage(worker, workers)` on `workers` threads (the caller's among them), then
/// `receive` on the caller's thread, and returns the first error: a panic of any worker first
/// (turned into `on_panic(message)`: the other errors of the call, typically workers that
/// timed out waiting for the one that panicked, follow from it), then the caller's own.
///
/// A panic never escapes: the caller always gets to end the call (`DispatchCall::end` resets
/// the finish counters and gives the call up), so the rank's next call starts clean. The
/// panic's bytes are not trusted: the call fails, and its peers see a rank that gave up.
fn drive<T>(
    workers: usize,
    stage: impl Fn(usize, usize) -> Result<()> + Sync,
    receive: impl FnOnce() -> Result<T>,
    on_panic: impl Fn(String) -> ep_reference::Error + Sync,
) -> Result<T> {
    let panicked =
        |e: &ep_reference::Error| matches!(e, ep_reference::Error::WorkerPanicked { .. });
    if workers == 1 {
        return catch(&on_panic, || {
            stage(0, 1)?;
            receive()
        });
    }
    std::thread::scope(|s| {
        let stage = &stage;
        let on_panic = &on_panic;
        let others: Vec<_> = (1..workers)
            .map(|w| s.spawn(move || catch(on_panic, || stage(w, workers))))
            .collect();
        let received = catch(on_panic, || stage(0, workers).and_then(|()| receive()));
        let mut first_panic = None;
        let mut joined = Ok(());
        for h in others {
            // `catch` already turned the worker's panic into an error; a join error is
            // left for a panic that escaped it (e.g. in the panic's own Drop).
            let r = h
                .join()
                .unwrap_or_else(|p| Err(on_panic(panic_message(&*p))));
            if let Err(e) = &r {
                if panicked(e) && first_panic.is_none() {
                    first_panic = Some(e.clone());
                }
            }
            if joined.is_ok() {
                joined = r;
            }
        }
        if let Err(e) = &received {
            if panicked(e) {
                return Err(e.clone());
            }
        }
        if let Some(e) = first_panic {
            return Err(e);
        }
        received.and_then(|v| joined.map(|()| v))
    })
}

fn worker_panicked(
    rank: usize,
    op: ep_reference::Op,
    call: u64,
    message: String,
) -> ep_reference::Error {
    ep_reference::Error::WorkerPanicked {
        rank,
        op,
        call,
        message,
    }
}

impl EpRank for BatchedRank {
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
        ep_reference::input::check_output(&self.shared.cfg, self.rank, out)?;
        let call = self.dispatch_begin(x, topk_idx)?;
        let (rank, epoch) = (self.rank, self.dispatch_calls);
        let res = drive(
            call.workers(),
            |w, n| call.stage(w, n),
            || call.receive(out),
            |message| worker_panicked(rank, ep_reference::Op::Dispatch, epoch, message),
        );
        let (stats, res) = call.end(res, out);
        let handle = res?;
        self.stats = stats;
        Ok(handle)
    }

    fn combine_with(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &Handle,
        format: CombineFormat,
    ) -> Result<Vec<bf16>> {
        let call = self.combine_begin(y, topk_idx, topk_weights, handle, format)?;
        let (rank, epoch) = (self.rank, self.combine_calls);
        let res = drive(
            call.workers(),
            |w, n| call.stage(w, n),
            || call.receive(),
            |message| worker_panicked(rank, ep_reference::Op::Combine, epoch, message),
        );
        let (stats, res) = call.end(res);
        let out = res?;
        self.stats = stats;
        Ok(out)
    }

    fn last_stats(&self) -> CallStats {
        self.stats
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::rank::run_ranks;
    use ep_reference::workload::{Routing, Workload};
    use ep_reference::{oracle, Error, Mode, Op};
    use std::time::Duration;

    fn arm(ranks: &[BatchedRank], rank: usize, worker: usize) {
        *ranks[0].shared.panic_at.lock().unwrap() = Some((rank, worker));
    }

    /// Every rank dispatches and combines `w`; both results must be the oracle's.
    fn round_is_correct(ranks: &mut [BatchedRank], w: &Workload, seed: u64) {
        let cfg = w.config;
        let want = oracle::dispatch(&cfg, &w.dispatch_inputs()).unwrap();
        let got = run_ranks(ranks, |r| {
            let me = r.rank();
            r.dispatch(&w.x[me], &w.topk_idx[me])
        });
        let mut handles = Vec::new();
        for (me, g) in got.into_iter().enumerate() {
            let (out, h) = g.unwrap_or_else(|e| panic!("rank {me}: {e}"));
            assert_eq!(out.diff(&want[me]), None, "rank {me}");
            handles.push(h);
        }
        let ys = w.expert_outputs(seed);
        let want = oracle::combine(&cfg, &w.combine_inputs(&ys)).unwrap();
        let got = run_ranks(ranks, |r| {
            let me = r.rank();
            r.combine(&ys[me], &w.topk_idx[me], &w.topk_weights[me], &handles[me])
        });
        for (me, g) in got.into_iter().enumerate() {
            let out = g.unwrap_or_else(|e| panic!("rank {me}: {e}"));
            let d = ep_reference::output::combine_diff(&out, &want[me], cfg.hidden);
            assert_eq!(d, None, "rank {me}");
        }
    }

    /// A staging worker that panics fails its call with `WorkerPanicked` (not its rank's thread,
    /// and without leaving the finish counters open, which would time out every later call of
    /// that rank), and the group goes on, correct.
    fn a_panicking_worker_fails_only_its_call(worker: usize, workers: usize, op: Op) {
        let cfg = Config::new(2, 8, 8, 128, 3, Mode::FP8).unwrap();
        let opts = CpuOptions {
            timeout: Duration::from_millis(300),
            staging_workers: workers,
            memory_limit: None,
            enable_shrink: false,
        };
        let mut ranks = group(&cfg, opts).unwrap();
        let w = Workload::uniform(&cfg, 8, Routing::Random { masked: 0.0 }, 1);
        let ys = w.expert_outputs(1);
        if op == Op::Dispatch {
            arm(&ranks, 0, worker);
        }
        let res = run_ranks(&mut ranks, |r| {
            let me = r.rank();
            r.dispatch(&w.x[me], &w.topk_idx[me])
        });
        let mut handles = Vec::new();
        let mut outcome = Vec::new();
        for r in res {
            match r {
                Ok((_, h)) => handles.push(h),
                Err(e) => outcome.push(e),
            }
        }
        if op == Op::Combine {
            assert!(outcome.is_empty(), "{outcome:?}");
            arm(&ranks, 0, worker);
            outcome = run_ranks(&mut ranks, |r| {
                let me = r.rank();
                r.combine(&ys[me], &w.topk_idx[me], &w.topk_weights[me], &handles[me])
                    .err()
            })
            .into_iter()
            .flatten()
            .collect();
        }
        match outcome.first() {
            Some(Error::WorkerPanicked {
                rank: 0,
                op: got_op,
                call: 1,
                message,
            }) => {
                assert_eq!(*got_op, op);
                assert!(
                    message.contains("injected fault in staging worker"),
                    "{message}"
                );
            }
            other => panic!("expected WorkerPanicked on rank 0, got {other:?}"),
        }
        // Rank 1 either finished or timed out waiting for rank 0, never anything else.
        for e in &outcome[1..] {
            assert!(
                matches!(
                    e,
                    Error::Timeout {
                        rank: 1,
                        peer: 0,
                        ..
                    }
                ),
                "{e}"
            );
        }
        // The next calls of every rank work and are correct.
        for seed in 2..4 {
            let w = Workload::uniform(&cfg, 8, Routing::Random { masked: 0.1 }, seed);
            round_is_correct(&mut ranks, &w, seed);
        }
    }

    #[test]
    fn a_panicking_spawned_worker_fails_only_its_dispatch() {
        a_panicking_worker_fails_only_its_call(1, 2, Op::Dispatch);
    }

    #[test]
    fn a_panicking_caller_worker_fails_only_its_dispatch() {
        a_panicking_worker_fails_only_its_call(0, 2, Op::Dispatch);
        a_panicking_worker_fails_only_its_call(0, 1, Op::Dispatch);
    }

    #[test]
    fn a_panicking_worker_fails_only_its_combine() {
        a_panicking_worker_fails_only_its_call(1, 2, Op::Combine);
        a_panicking_worker_fails_only_its_call(0, 1, Op::Combine);
    }

    /// A group asked for more staging workers than the documented maximum (2^64-1 would be a
    /// vector of that many thread handles, 10^6 threads fail to spawn, 10^8 abort) is refused
    /// when it is built, with the typed error naming the option; the maximum itself works.
    #[test]
    fn absurd_staging_worker_counts_are_a_typed_error() {
        let cfg = Config::new(2, 8, 8, 128, 3, Mode::FP8).unwrap();
        for workers in [257, 1_000_000, 100_000_000, usize::MAX] {
            let opts = CpuOptions {
                staging_workers: workers,
                ..CpuOptions::default()
            };
            match group(&cfg, opts).map(|_| ()) {
                Err(Error::LimitExceeded { what, value, limit }) => {
                    assert_eq!(
                        (what, value, limit),
                        (
                            "staging_workers",
                            workers as u128,
                            ep_reference::options::MAX_STAGING_WORKERS as u128
                        )
                    );
                }
                other => panic!("{workers} workers: expected LimitExceeded, got {other:?}"),
            }
        }
        let opts = CpuOptions {
            staging_workers: 256,
            ..CpuOptions::default()
        };
        let mut ranks = group(&cfg, opts).unwrap();
        let w = Workload::uniform(&cfg, 8, Routing::Random { masked: 0.1 }, 3);
        round_is_correct(&mut ranks, &w, 3);
    }

    #[test]
    fn huge_timeouts_do_not_overflow() {
        let cfg = Config::new(2, 8, 8, 128, 3, Mode::FP8).unwrap();
        let opts = CpuOptions {
            timeout: Duration::MAX,
            ..CpuOptions::default()
        };
        let mut ranks = group(&cfg, opts).unwrap();
        let w = Workload::uniform(&cfg, 8, Routing::Random { masked: 0.1 }, 5);
        round_is_correct(&mut ranks, &w, 5);
        for r in &mut ranks {
            r.set_timeout(Duration::from_secs(u64::MAX));
        }
        round_is_correct(&mut ranks, &w, 6);
    }
}
