//! loom models of the signaling protocol, run on the code that ships: the CPU paths' atomics and
//! shared rows come from `ep_reference::sync`, which `--cfg ep_loom` switches to loom's. Every
//! payload row access also touches a loom cell, so loom reports any read that the protocol's
//! release/acquire pairs do not order after its write.
//!
//! Run: `RUSTFLAGS="--cfg ep_loom" LOOM_MAX_PREEMPTIONS=4 cargo test --release -p ep-verify
//! --test loom_protocol`. `.ci/loom.sh` does, in `target/loom`, then the mutants
//! `--cfg ep_mutant="signal_relaxed"` / `"finish_relaxed"` / `"credit_relaxed"` /
//! `"masked_peer_written"`, each of which one of these models must reject with a causality
//! violation (a mutant's cfg reaches the
//! workspace crates only, through a `RUSTC_WORKSPACE_WRAPPER` under `target/loom/mutants/`).
//!
//! Under loom a timeout of N ms allows N polls, and one of an hour or more never expires
//! (`ep_reference::sync::Deadline`).
#![cfg(ep_loom)]

use std::time::Duration;

use ep_reference::error::{Op, Phase, Side};
use ep_reference::oracle;
use ep_reference::workload::{Routing, Workload};
use ep_reference::{per_expert, Config, CpuOptions, EpRank, Error, Mode, RankMask};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;

const FOREVER: Duration = Duration::from_secs(7200);

fn opts(workers: usize) -> CpuOptions {
    CpuOptions {
        timeout: FOREVER,
        staging_workers: workers,
        memory_limit: Some(1 << 30),
        enable_shrink: false,
    }
}

/// A tiny workload; `leak` gives the 'static borrows loom threads need.
fn workload(cfg: &Config, tokens: &[usize], seed: u64) -> &'static Workload {
    Box::leak(Box::new(Workload::generate(
        cfg,
        tokens,
        Routing::Random { masked: 0.0 },
        seed,
    )))
}

fn expect_dispatch(w: &Workload, rank: usize, got: &ep_reference::DispatchOutput) {
    let want = oracle::dispatch(&w.config, &w.dispatch_inputs()).unwrap();
    assert_eq!(got.diff(&want[rank]), None, "rank {rank}");
}

fn expect_masked_dispatch(
    w: &Workload,
    rank: usize,
    got: &ep_reference::DispatchOutput,
    mask: &RankMask,
) {
    let want = oracle::dispatch_masked(&w.config, &w.dispatch_inputs(), mask).unwrap();
    assert_eq!(got.diff(&want[rank]), None, "rank {rank} under {mask:?}");
}

/// Model 1: two staging workers and the sender (worker 0, which also counts and receives).
/// The sender must not signal before worker 1's token is staged, and must read the full count:
/// the receiver reads both tokens' rows and the output equals the oracle's.
#[test]
fn staging_workers_then_sender() {
    loom::model(|| {
        // One rank, one expert row per token: tokens 0 and 1 go to different workers.
        let cfg = Config::new(1, 2, 2, 128, 1, Mode::Bf16).unwrap();
        let w = workload(&cfg, &[2], 1);
        let mut ranks = ep_fast::group(&cfg, opts(2)).unwrap();
        let call = Arc::new(ranks[0].dispatch_begin(&w.x[0], &w.topk_idx[0]).unwrap());
        let worker1 = {
            let call = call.clone();
            loom::thread::spawn(move || call.stage(1, 2))
        };
        call.stage(0, 2).unwrap();
        let mut out = ep_reference::DispatchOutput::zeroed(&cfg);
        call.receive(&mut out).unwrap();
        worker1.join().unwrap().unwrap();
        let call = Arc::try_unwrap(call).ok().expect("workers joined");
        let (stats, res) = call.end(Ok(()), &out);
        res.unwrap();
        assert_eq!(stats.messages, 1);
        expect_dispatch(w, 0, &out);
    });
}

/// Model 2: payload, then release signal; acquire, then read. Two ranks dispatch to each other
/// (every token goes to both), on both paths; each must read the other's rows only after its
/// signal, and get exactly the oracle's bytes.
fn payload_then_signal<R: EpRank + 'static>(
    group: fn(&Config, CpuOptions) -> ep_reference::Result<Vec<R>>,
) {
    loom::model(move || {
        let cfg = Config::new(2, 2, 1, 128, 2, Mode::Bf16).unwrap();
        let w = workload(&cfg, &[1, 1], 2);
        let mut ranks = group(&cfg, opts(1)).unwrap();
        let mut r1 = ranks.pop().unwrap();
        let mut r0 = ranks.pop().unwrap();
        let t = loom::thread::spawn(move || {
            let (out, _) = r1.dispatch(&w.x[1], &w.topk_idx[1]).unwrap();
            expect_dispatch(w, 1, &out);
        });
        let (out, _) = r0.dispatch(&w.x[0], &w.topk_idx[0]).unwrap();
        expect_dispatch(w, 0, &out);
        t.join().unwrap();
    });
}

#[test]
fn payload_then_signal_batched() {
    payload_then_signal(ep_fast::group);
}

#[test]
fn payload_then_signal_per_expert() {
    payload_then_signal(per_expert::group);
}

/// Ranks 0 and 1 of a two-rank batched group where K = E = 2 (every token goes to both ranks,
/// so every call crosses in both directions), and two calls' inputs.
fn pair(
    seeds: [u64; 2],
) -> (
    ep_fast::BatchedRank,
    ep_fast::BatchedRank,
    [&'static Workload; 2],
) {
    pair_with(seeds, false)
}

/// [`pair`], in shrink mode or not.
fn pair_with(
    seeds: [u64; 2],
    enable_shrink: bool,
) -> (
    ep_fast::BatchedRank,
    ep_fast::BatchedRank,
    [&'static Workload; 2],
) {
    let cfg = Config::new(2, 2, 1, 128, 2, Mode::Bf16).unwrap();
    let calls = seeds.map(|s| workload(&cfg, &[1, 1], s));
    let opts = CpuOptions {
        enable_shrink,
        ..opts(1)
    };
    let mut ranks = ep_fast::group(&cfg, opts).unwrap();
    let r1 = ranks.pop().unwrap();
    let r0 = ranks.pop().unwrap();
    (r0, r1, calls)
}

/// Runs `body` on rank 1 in a loom thread and on rank 0 in this one.
fn on_both(
    mut r0: ep_fast::BatchedRank,
    mut r1: ep_fast::BatchedRank,
    body: impl Fn(&mut ep_fast::BatchedRank) + Copy + Send + 'static,
) {
    let t = loom::thread::spawn(move || body(&mut r1));
    body(&mut r0);
    t.join().unwrap();
}

/// Model 3: two consecutive calls on the same buffers (different tokens each call), dispatch
/// then combine. No signal of call 1 is taken for call 2 (the epoch tag), no row of call 2
/// overwrites one call 1 still reads (the credit), nothing is lost or duplicated (the outputs
/// equal the oracle's).
#[test]
fn consecutive_calls_batched() {
    loom::model(|| {
        let (r0, r1, calls) = pair([4, 5]);
        on_both(r0, r1, move |r| {
            let me = r.rank();
            for w in calls {
                let (out, h) = r.dispatch(&w.x[me], &w.topk_idx[me]).unwrap();
                expect_dispatch(w, me, &out);
                let ys = w.expert_outputs(9);
                let got = r
                    .combine(&ys[me], &w.topk_idx[me], &w.topk_weights[me], &h)
                    .unwrap();
                let want = oracle::combine(&w.config, &w.combine_inputs(&ys)).unwrap();
                assert!(got
                    .iter()
                    .zip(&want[me])
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        });
    });
}

/// Model 3b: two consecutive dispatches with no combine between them, where only the credit
/// orders the receiver's reads of call 1 before the sender's writes of call 2 (between a
/// dispatch and a combine, the combine's own signals order them too).
#[test]
fn consecutive_dispatches_batched() {
    loom::model(|| {
        let (r0, r1, calls) = pair([8, 9]);
        on_both(r0, r1, move |r| {
            let me = r.rank();
            for w in calls {
                let (out, _) = r.dispatch(&w.x[me], &w.topk_idx[me]).unwrap();
                expect_dispatch(w, me, &out);
            }
        });
    });
}

/// Model 4: a wait that times out reports the error (waiter, peer, phase, call) and leaves the
/// next call usable. Rank 1 arrives for call 1 only after rank 0 gave up on it; it still gets
/// rank 0's call-1 batch, and call 2 is correct on both.
#[test]
fn timeout_then_next_call() {
    loom::model(|| {
        let (mut r0, mut r1, calls) = pair([6, 7]);
        let gave_up = Arc::new(AtomicBool::new(false));
        let t = {
            let gave_up = gave_up.clone();
            loom::thread::spawn(move || {
                while !gave_up.load(Ordering::Acquire) {
                    loom::thread::yield_now();
                }
                for w in calls {
                    let (out, _) = r1.dispatch(&w.x[1], &w.topk_idx[1]).unwrap();
                    expect_dispatch(w, 1, &out);
                }
            })
        };
        r0.set_timeout(Duration::from_millis(3));
        let err = r0
            .dispatch(&calls[0].x[0], &calls[0].topk_idx[0])
            .unwrap_err();
        match err {
            Error::Timeout {
                rank: 0,
                peer: 1,
                phase,
                call: 1,
                ..
            } => {
                assert_eq!(
                    phase,
                    Phase {
                        op: Op::Dispatch,
                        side: Side::Recv
                    }
                )
            }
            other => panic!("expected rank 0's timeout on rank 1, got {other}"),
        }
        gave_up.store(true, Ordering::Release);
        r0.set_timeout(FOREVER);
        let (out, _) = r0.dispatch(&calls[1].x[0], &calls[1].topk_idx[0]).unwrap();
        expect_dispatch(calls[1], 0, &out);
        t.join().unwrap();
    });
}

/// Model 5: a masked peer is neither written nor read (DeepEP's shrink mode). Two ranks, every
/// token to both. Rank 1 starts call 1 while the mask is empty, then stalls; rank 0, in shrink
/// mode, gives up waiting for its batch and masks it, and completes call 1 with the masked
/// oracle's output. Rank 1 then stages, signals and reads rank 0's call-1 batch. Rank 0's call
/// 2 must not wait for rank 1's credit (it may never come), so it must not write into rank 1's
/// region either (rank 1 may be reading it), nor take rank 1's late call-1 signal for anything:
/// its output is the masked oracle's again. Rank 1's own next call, masked, returns at once.
/// The mutant `masked_peer_written` (rank 0 still stages its batch for the masked rank 1) races
/// with rank 1's read of call 1.
#[test]
fn masked_peer_is_skipped() {
    loom::model(|| {
        let (mut r0, mut r1, calls) = pair_with([10, 11], true);
        let mask = RankMask::from_ranks(2, &[1]).unwrap();
        let begun = Arc::new(AtomicBool::new(false));
        let gave_up = Arc::new(AtomicBool::new(false));
        let t = {
            let (begun, gave_up) = (begun.clone(), gave_up.clone());
            loom::thread::spawn(move || {
                let w = calls[0];
                let call = r1.dispatch_begin(&w.x[1], &w.topk_idx[1]).unwrap();
                begun.store(true, Ordering::Release);
                while !gave_up.load(Ordering::Acquire) {
                    loom::thread::yield_now();
                }
                call.stage(0, 1).unwrap();
                let mut out = ep_reference::DispatchOutput::zeroed(&w.config);
                // Rank 1's outputs are undefined now (it is masked); the call still ends well.
                call.receive(&mut out).unwrap();
                call.end(Ok(()), &out).1.unwrap();
                let w = calls[1];
                let (_, h) = r1.dispatch(&w.x[1], &w.topk_idx[1]).unwrap();
                assert!(h.mask.is_masked(1));
                assert_eq!(r1.last_stats().signals, 0, "a masked rank sends nothing");
            })
        };
        while !begun.load(Ordering::Acquire) {
            loom::thread::yield_now();
        }
        r0.set_timeout(Duration::from_millis(3));
        let (out, h) = r0.dispatch(&calls[0].x[0], &calls[0].topk_idx[0]).unwrap();
        expect_masked_dispatch(calls[0], 0, &out, &mask);
        assert_eq!(h.mask, mask);
        assert_eq!(r0.query_mask(), mask);
        gave_up.store(true, Ordering::Release);
        r0.set_timeout(FOREVER);
        let (out, _) = r0.dispatch(&calls[1].x[0], &calls[1].topk_idx[0]).unwrap();
        expect_masked_dispatch(calls[1], 0, &out, &mask);
        t.join().unwrap();
    });
}

/// Model 5b: the per-expert path in shrink mode. Rank 1 comes to call 1 only after rank 0 has
/// given up on it and masked it: its calls, masked, send nothing and return at once; rank 0's
/// two calls equal the masked oracle's.
#[test]
fn per_expert_late_rank_masked() {
    loom::model(|| {
        let cfg = Config::new(2, 2, 1, 128, 2, Mode::Bf16).unwrap();
        let calls = [12, 13].map(|s| workload(&cfg, &[1, 1], s));
        let opts = CpuOptions {
            enable_shrink: true,
            ..opts(1)
        };
        let mut ranks = per_expert::group(&cfg, opts).unwrap();
        let mut r1 = ranks.pop().unwrap();
        let mut r0 = ranks.pop().unwrap();
        let mask = RankMask::from_ranks(2, &[1]).unwrap();
        let gave_up = Arc::new(AtomicBool::new(false));
        let t = {
            let gave_up = gave_up.clone();
            loom::thread::spawn(move || {
                while !gave_up.load(Ordering::Acquire) {
                    loom::thread::yield_now();
                }
                for w in calls {
                    r1.dispatch(&w.x[1], &w.topk_idx[1]).unwrap();
                    assert_eq!(r1.last_stats().signals, 0);
                }
            })
        };
        r0.set_timeout(Duration::from_millis(3));
        let (out, _) = r0.dispatch(&calls[0].x[0], &calls[0].topk_idx[0]).unwrap();
        expect_masked_dispatch(calls[0], 0, &out, &mask);
        gave_up.store(true, Ordering::Release);
        r0.set_timeout(FOREVER);
        let (out, _) = r0.dispatch(&calls[1].x[0], &calls[1].topk_idx[0]).unwrap();
        expect_masked_dispatch(calls[1], 0, &out, &mask);
        t.join().unwrap();
    });
}
