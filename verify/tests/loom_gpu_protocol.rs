//! loom models of the CUDA kernels' protocol, on `ep_verify::gpu_protocol` (the kernels'
//! synchronisation written line for line on the `ep_reference::sync` shim; that module says how
//! blocks, launches, instructions and bounded waits map onto the model).
//!
//! Run: `RUSTFLAGS="--cfg ep_loom" LOOM_MAX_PREEMPTIONS=4 cargo test --release -p ep-verify
//! --test loom_gpu_protocol`. `.ci/loom.sh` runs them, then the `gpu_*` mutants, each of which
//! one of these models must reject.
//!
//! Every wait is bounded (a poll or two: see [`bounded`]), as on the device. loom then explores
//! the interleavings where a wait runs out as well, and the models check the contract the host
//! sees: either the host's sync reports the timeout (and the group refuses later calls), or
//! every rank consumed exactly its call's entries. Each model also checks that some interleaving
//! completed without a timeout, so a bound too tight to let anything finish cannot pass.
//! (Unbounded spins are not an option: with two blocks waiting for a third, loom would explore
//! the two yielding to each other for ever.)
//!
//! Which model covers which wait of the kernels:
//! - `batched_two_senders_one_receiver`: the block-completion counter and the signal
//!   (batched.cu:161-172) and the receiver's `wait_signal` (batched.cu:182), one call.
//! - `batched_consecutive_calls` (and `per_expert_consecutive_calls`): the epoch in the signal
//!   (no signal of call 1 taken for call 2), the ack (batched.cu:311) and the sender's
//!   `wait_ack` (batched.cu:46) before it overwrites the buffers.
//! - `batched_one_sender_two_receivers`: `last_block_out`'s exit counter, which must carry every
//!   receiving block's reads into the last block's ack (common.cuh `last_block_out`).
//! - `per_expert_two_senders_one_receiver`: the per-expert signal of each (expert, source) and
//!   the epoch-stamped messages (per_expert.cu:82-83, :92, :101).
//! - `fault_timeout_stops_every_waiter`, `slow_sender_timeout_refused_or_correct`: the bounded
//!   waits, the error word (common.cuh `report_timeout`, `failed`) and the host's refusal after
//!   a timeout (runtime.rs `GpuGroup::sync`, `check_usable`).
//! - `batched_two_senders_one_receiver_two_calls` (the slow one): all of the batched orderings
//!   at once, two sender blocks and one receiver block over two calls.
#![cfg(ep_loom)]

use std::sync::atomic::{AtomicBool, Ordering as StdOrdering};
use std::time::Duration;

use ep_verify::gpu_protocol::{
    dispatch_block, merged, BlockReport, Group, Host, Input, Kind, Launch, Setup, Timeout, WaitEnd,
    PH_DISPATCH_RECV,
};
use loom::thread;

/// Every wait gives up after this many polls past the first (a `Deadline` of N ms under loom).
fn bounded(polls: u64) -> Launch {
    Launch {
        timeout: Duration::from_millis(polls),
        fault_rank: None,
    }
}

/// The shape of most models: ranks 0 (device 0) and 1 (device 1), rank 0 sends to rank 1.
/// Leaked: loom threads need 'static borrows (a new group per interleaving).
fn group(kind: Kind, ranks: Vec<(usize, usize)>, local_experts: usize) -> &'static Group {
    Box::leak(Box::new(Group::new(Setup {
        kind,
        ranks,
        links: vec![(0, 1)],
        max_tokens: 2,
        local_experts,
    })))
}

/// Rank 0's two tokens, both bound for rank 1 (local experts `l0`, `l1`); rank 1 has none.
fn input(call: u64, l0: usize, l1: usize) -> Input {
    Input {
        call,
        route: vec![vec![vec![(1, l0)], vec![(1, l1)]], vec![]],
    }
}

/// One launch of every block of `rank`: blocks 1.. on loom threads, block 0 on this one. It
/// returns when every block has ended (the stream's order before the next launch).
fn launch(g: &'static Group, kp: Launch, input: &Input, rank: usize) -> Vec<BlockReport> {
    let others: Vec<_> = (1..g.ranks[rank].blocks)
        .map(|b| {
            let input = input.clone();
            thread::spawn(move || dispatch_block(g, &kp, &input, rank, b))
        })
        .collect();
    let mut reps = vec![dispatch_block(g, &kp, input, rank, 0)];
    reps.extend(others.into_iter().map(|t| t.join().unwrap()));
    reps
}

/// One rank's launch of one call, checked once the host knows that no wait failed.
struct Done {
    rank: usize,
    input: Input,
    reps: Vec<BlockReport>,
}

/// The host's sync after every launch ended. A timeout: it names a waiting rank and call, and
/// the group refuses what follows. Otherwise: on every rank exactly one block was the last
/// out, every block ran the call's epoch, and every rank consumed exactly its call's entries.
/// Returns whether the calls completed.
fn host_check(g: &Group, done: &[Done]) -> bool {
    let mut host = Host::default();
    if let Err(t) = host.sync(g) {
        assert!(
            t.rank < 2 && t.peer < 2 && t.call >= 1 && t.call <= 2,
            "{t:?}"
        );
        assert!(done
            .iter()
            .any(|d| d.reps.iter().any(|r| r.failed_wait.is_some())));
        assert_eq!(host.check_usable(), Err(t), "the next call must be refused");
        return false;
    }
    for d in done {
        let rank = d.rank;
        assert_eq!(
            d.reps.iter().filter(|r| r.last_out).count(),
            1,
            "exactly one block of rank {rank} is the last out"
        );
        for r in &d.reps {
            assert_eq!(r.epoch as u64, d.input.call, "rank {rank}'s epoch");
            assert_eq!(r.failed_wait, None, "a failed wait raises the error word");
        }
        assert_eq!(
            merged(&d.reps),
            g.expected(&d.input, rank),
            "rank {rank} consumed call {}'s entries",
            d.input.call
        );
    }
    true
}

/// Runs `body` under loom and requires some interleaving to have completed (no timeout).
fn model(body: impl Fn() -> bool + Sync + Send + 'static) {
    let completed = std::sync::Arc::new(AtomicBool::new(false));
    let seen = completed.clone();
    loom::model(move || {
        if body() {
            seen.store(true, StdOrdering::Relaxed);
        }
    });
    assert!(
        completed.load(StdOrdering::Relaxed),
        "no interleaving completed: the wait bound is too tight for the model"
    );
}

/// Rank 0 runs `tx_calls` launches, rank 1 `rx_calls`, with no host sync between them, then
/// the host checks.
fn calls(g: &'static Group, kp: Launch, tx: Vec<Input>, rx: Vec<Input>) -> bool {
    let rx_thread = thread::spawn(move || {
        rx.into_iter()
            .map(|input| Done {
                rank: 1,
                reps: launch(g, kp, &input, 1),
                input,
            })
            .collect::<Vec<_>>()
    });
    let mut done: Vec<Done> = tx
        .into_iter()
        .map(|input| Done {
            rank: 0,
            reps: launch(g, kp, &input, 0),
            input,
        })
        .collect();
    done.extend(rx_thread.join().unwrap());
    host_check(g, &done)
}

#[test]
fn batched_two_senders_one_receiver() {
    model(|| {
        let g = group(Kind::Batched, vec![(0, 2), (1, 1)], 1);
        let c = vec![input(1, 0, 0)];
        calls(g, bounded(1), c.clone(), c)
    });
}

#[test]
fn per_expert_two_senders_one_receiver() {
    model(|| {
        let g = group(Kind::PerExpert, vec![(0, 2), (1, 1)], 2);
        let c = vec![input(1, 0, 1)];
        calls(g, bounded(1), c.clone(), c)
    });
}

/// Two calls on the same buffers, one block each side. Per-expert: call 2 sends both tokens to
/// local expert 0 (slot 0 is rewritten, slot 1 is new) and none to local expert 1, whose region
/// keeps call 1's message, stale. (Slot 0 of expert 0 must be rewritten: the sender's first
/// expert is the one written before any fence of the call.)
fn consecutive(kind: Kind) {
    model(move || {
        let g = group(kind, vec![(0, 1), (1, 1)], 2);
        let c = vec![input(1, 0, 1), input(2, 0, 0)];
        calls(g, bounded(1), c.clone(), c)
    });
}

#[test]
fn batched_consecutive_calls() {
    consecutive(Kind::Batched);
}

#[test]
fn per_expert_consecutive_calls() {
    consecutive(Kind::PerExpert);
}

/// One sender block, two receiver blocks (one entry each). Only the last block out acks, so
/// the exit counter must carry the other block's reads into the ack before the sender's
/// second call overwrites the entries.
#[test]
fn batched_one_sender_two_receivers() {
    model(|| {
        let g = group(Kind::Batched, vec![(0, 1), (1, 2)], 1);
        let c = vec![input(1, 0, 0), input(2, 0, 0)];
        calls(g, bounded(1), c.clone(), c[..1].to_vec())
    });
}

/// Two sender blocks and one receiver block over two calls, no host sync between them: every
/// ordering of the batched dispatch at once (about 2.5 minutes on 2 cores at
/// LOOM_MAX_PREEMPTIONS=4; the smaller models above each isolate one ordering, for the mutants).
#[test]
fn batched_two_senders_one_receiver_two_calls() {
    model(|| {
        let g = group(Kind::Batched, vec![(0, 2), (1, 1)], 1);
        let c = vec![input(1, 0, 0), input(2, 0, 0)];
        calls(g, bounded(1), c.clone(), c)
    });
}

/// Rank 0 never signals (the `fault_rank` hook); rank 1's two blocks wait on one device. The
/// first wait out of time reports (rank 1, peer 0, dispatch receive, call 1); the other block
/// sees the flag, or runs out too and loses the report; every block leaves. The host's sync
/// turns the word into the timeout, and the group refuses call 2.
#[test]
fn fault_timeout_stops_every_waiter() {
    let saw_flag = std::sync::Arc::new(AtomicBool::new(false));
    let seen = saw_flag.clone();
    loom::model(move || {
        let g = group(Kind::Batched, vec![(0, 1), (1, 2)], 1);
        let kp = Launch {
            timeout: Duration::from_millis(2),
            fault_rank: Some(0),
        };
        let c1 = input(1, 0, 0);
        let blocks: Vec<_> = [(0, 0), (1, 1)]
            .into_iter()
            .map(|(rank, bid)| {
                let c1 = c1.clone();
                thread::spawn(move || dispatch_block(g, &kp, &c1, rank, bid))
            })
            .collect();
        let b0 = dispatch_block(g, &kp, &c1, 1, 0);
        let reps: Vec<BlockReport> = blocks.into_iter().map(|t| t.join().unwrap()).collect();
        let rx = [&b0, &reps[1]];
        assert!(rx
            .iter()
            .all(|r| r.failed_wait.is_some() && r.read.is_empty()));
        assert!(rx.iter().any(|r| r.failed_wait == Some(WaitEnd::TimedOut)));
        if rx.iter().any(|r| r.failed_wait == Some(WaitEnd::SawError)) {
            seen.store(true, StdOrdering::Relaxed);
        }
        assert_eq!(rx.iter().filter(|r| r.last_out).count(), 1);
        let mut host = Host::default();
        let want = Timeout {
            rank: 1,
            peer: 0,
            phase: PH_DISPATCH_RECV,
            call: 1,
        };
        assert_eq!(host.sync(g), Err(want));
        // Call 2: runtime.rs `dispatch` starts with check_usable.
        assert_eq!(host.check_usable(), Err(want), "call 2 must be refused");
    });
    assert!(
        saw_flag.load(StdOrdering::Relaxed),
        "no interleaving had a waiter stopped by the error word"
    );
}

/// Two sender blocks and one receiver block, and the host's sync after each call (runtime.rs
/// `dispatch` = launch + sync). Call 1 has a bound of one poll: depending on the interleaving
/// the receiver gets the signal or times out. After a timeout the host reports it and refuses
/// call 2; otherwise call 2 runs and is correct. Both outcomes must occur.
#[test]
fn slow_sender_timeout_refused_or_correct() {
    let timed_out = std::sync::Arc::new(AtomicBool::new(false));
    let seen = timed_out.clone();
    model(move || {
        let g = group(Kind::Batched, vec![(0, 2), (1, 1)], 1);
        let c1 = vec![input(1, 0, 0)];
        let mut host = Host::default();
        if !calls(g, bounded(1), c1.clone(), c1) {
            let t = host.sync(g).unwrap_err();
            assert_eq!(
                t,
                Timeout {
                    rank: 1,
                    peer: 0,
                    phase: PH_DISPATCH_RECV,
                    call: 1
                }
            );
            assert_eq!(host.check_usable(), Err(t), "call 2 must be refused");
            seen.store(true, StdOrdering::Relaxed);
            return false;
        }
        let c2 = vec![input(2, 0, 0)];
        calls(g, bounded(3), c2.clone(), c2)
    });
    assert!(
        timed_out.load(StdOrdering::Relaxed),
        "no interleaving timed out in call 1"
    );
}
