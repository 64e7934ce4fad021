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
//! The kernels name these models in `// loom:` comments next to the code each one covers.
//! - `batched_two_senders_one_receiver`: the block-completion counter and the signal (batched
//!   dispatch's `fence_rel(p)`, "`atomicAdd(state + ST_SENT + KIND, 1u)`", `fence_rel(p)`,
//!   "`st_release(p, sig_bat(tab[d]) + rank, ...)`") and the receiver's `wait_signal`, one call.
//! - `batched_consecutive_calls` (and `per_expert_consecutive_calls`): the tag in the signal
//!   (no signal of call 1 taken for call 2), the ack (`finish:`'s "`st_release(p,
//!   sig_bat_ack(tab[s], R) + rank, (u64)epoch)`" / `sig_pe_ack`) and the sender's ack wait
//!   before it overwrites the buffers (batched: the pre-load `ack0` then "`if (!in_bad && acker
//!   && ack0 < epoch - 1ull) wbad = !wait_ack(...)`"; per-expert: `wait_ack` in `tid < R`).
//! - `batched_tag_wrap`, `per_expert_tag_wrap`: the same two calls across the tag's wrap
//!   (epochs 2^40 - 2 -> 2^40 - 1, tags 2^40 - 1 -> 1; common.cuh `sig_tag`, and `wait_signal`'s
//!   match "`(v >> SIG_COUNT_BITS) == tag`"): the previous call's signal, whose tag is now the
//!   larger, is never taken.
//! - `batched_one_sender_two_receivers`: `last_block_out`'s exit counter, which must carry every
//!   receiving block's reads into the last block's ack (common.cuh `last_block_out`).
//! - `per_expert_two_senders_one_receiver`: the per-expert signal of each (expert, source) and
//!   the epoch-stamped messages (per-expert dispatch's `fence_rel(p)` then "`st_release(p,
//!   sig_pe(tab[d], R) + (u64)l * R + rank, ...)`", its `wait_signal`, and the header match
//!   "`hv.x == (u32)epoch && hv.w == (u32)(epoch >> 32)`").
//! - `fault_timeout_stops_every_waiter`, `slow_sender_timeout_refused_or_correct`: the bounded
//!   waits, the error word (common.cuh `report_error`, `failed`) and the host's refusal after a
//!   timeout (runtime/launch.rs `GpuGroup::sync`, errors.rs `GpuGroup::check`, runtime/mod.rs
//!   `check_usable`).
//! - `bad_input_sender_peer_*`, `bad_input_receiver_then_good_call`: the device-side input
//!   check (`in_bad`: batched "`__syncthreads_or(bad) | s_bad`", then "`if
//!   (__syncthreads_or(wbad) || in_bad) goto finish;`"): the bad rank skips its waits and sends
//!   but still counts out, publishes its epoch and acks; what its peers see on the same device
//!   (the flag) and on another (a timeout, ranked after the input error by errors.rs
//!   `cause_first`).
//! - `batched_two_senders_one_receiver_two_calls` (the slow one): all of the batched orderings
//!   at once, two sender blocks and one receiver block over two calls.
//! - `capacity_bad_input_sender_header_poisoned`: NCCL capacity mode (batched): the host's
//!   poisoning of the send headers (launch.rs `poison_send_headers`) and the unpack's bound on
//!   the received token count, across a call whose sender stops on bad input (mutant
//!   `gpu_no_hdr_poison`).
//! - `shrink_*`: shrink mode, the rank mask (common.cuh, "shrink mode (the rank mask)":
//!   `agree_at`, `wait_peer_signals`, `wait_peer_ack`, `masked_peers`; batched dispatch's
//!   `s_gone` / `gone` and `finish:`'s "no ack to a masked peer"; runtime/mask.rs `update_mask`
//!   and `clean_mask`). `shrink_two_blocks_agree_at_the_timeout_edge` and its per-expert twin:
//!   the blocks of a rank agree on a peer whose signal lands at the timeout's edge (mutant
//!   `gpu_no_agreement`); `shrink_masked_peer_signals_ignored`: a masked peer's signal, with this
//!   call's tag, and its region are left alone, and the masked peer masks back at its next ack
//!   wait (mutant `gpu_masked_peer_waited`); `shrink_unmask_with_clean`: a peer lost in call 1 is
//!   taken back after every rank's clean, bit for bit (mutant `gpu_clean_keeps_signals`).
#![cfg(ep_loom)]

use std::sync::atomic::{AtomicBool, Ordering as StdOrdering};
use std::time::Duration;

use ep_verify::gpu_protocol::{
    ack_word, batched_pack_block, batched_unpack_block, clean_mask, device_error, dispatch_block,
    entry_at, is_gone, mask_status, merged, nccl_capacity_exchange, payload, poison_send_headers,
    update_mask, BlockReport, DeviceError, Entry, Group, Host, Input, Kind, Launch, Setup, WaitEnd,
    PF_BATCH_TOKENS, PH_DISPATCH_RECV, POISON_HDR,
};
use loom::thread;

/// Every wait gives up after this many polls past the first (a `Deadline` of N ms under loom).
fn bounded(polls: u64) -> Launch {
    Launch {
        timeout: Duration::from_millis(polls),
        fault_rank: None,
        bad_input: None,
        shrink: false,
    }
}

/// The shape of most models: ranks 0 (device 0) and 1 (device 1), rank 0 sends to rank 1.
/// Leaked: loom threads need 'static borrows (a new group per interleaving).
fn group(kind: Kind, ranks: Vec<(usize, usize)>, local_experts: usize) -> &'static Group {
    group_after(kind, ranks, local_experts, 0)
}

/// [`group`] whose ranks have completed `base` calls already.
fn group_after(
    kind: Kind,
    ranks: Vec<(usize, usize)>,
    local_experts: usize,
    base: u64,
) -> &'static Group {
    Box::leak(Box::new(Group::after_calls(
        Setup {
            kind,
            ranks,
            links: vec![(0, 1)],
            max_tokens: 2,
            local_experts,
        },
        base,
    )))
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
        let DeviceError::Timeout {
            rank, peer, call, ..
        } = t
        else {
            panic!("only timeouts in these models: {t:?}");
        };
        assert!(
            rank < 2 && peer < 2 && call > g.base && call <= g.base + 2,
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
            assert_eq!(r.epoch, g.base + d.input.call, "rank {rank}'s epoch");
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
    model_bounded(None, body)
}

/// [`model`] with at most `bound` preemptions (`None`: `LOOM_MAX_PREEMPTIONS`, as `model`);
/// a bound above `LOOM_MAX_PREEMPTIONS` is lowered to it.
fn model_bounded(bound: Option<usize>, body: impl Fn() -> bool + Sync + Send + 'static) {
    let completed = std::sync::Arc::new(AtomicBool::new(false));
    let seen = completed.clone();
    let mut builder = loom::model::Builder::new();
    if let Some(b) = bound {
        builder.preemption_bound = Some(builder.preemption_bound.map_or(b, |env| env.min(b)));
    }
    builder.check(move || {
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
    host_check(g, &run_calls(g, kp, tx, rx))
}

/// The launches of [`calls`], unchecked: rank 0's first, then rank 1's.
fn run_calls(g: &'static Group, kp: Launch, tx: Vec<Input>, rx: Vec<Input>) -> Vec<Done> {
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
    done
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
fn consecutive(kind: Kind, base: u64) {
    model(move || {
        let g = group_after(kind, vec![(0, 1), (1, 1)], 2, base);
        let c = vec![input(1, 0, 1), input(2, 0, 0)];
        calls(g, bounded(1), c.clone(), c)
    });
}

#[test]
fn batched_consecutive_calls() {
    consecutive(Kind::Batched, 0);
}

#[test]
fn per_expert_consecutive_calls() {
    consecutive(Kind::PerExpert, 0);
}

/// Calls completed before [`batched_tag_wrap`]'s first call: its calls have epochs 2^40 - 2
/// (tag 2^40 - 1, the largest) and 2^40 - 1 (tag 1). The group starts as if call 2^40 - 3 had
/// just ended, with that call's signals in every word.
const BEFORE_WRAP: u64 = (1 << 40) - 3;

/// The two consecutive calls across the tag's wrap: call 2's receiver finds call 1's signal
/// (tag 2^40 - 1) in the word while it waits for tag 1, and must not take it (mutant
/// `gpu_tag_ge`: a `>=` match, right everywhere but here).
#[test]
fn batched_tag_wrap() {
    consecutive(Kind::Batched, BEFORE_WRAP);
}

#[test]
fn per_expert_tag_wrap() {
    consecutive(Kind::PerExpert, BEFORE_WRAP);
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

/// Preemption bound of [`batched_two_senders_one_receiver_two_calls`], below CI's
/// LOOM_MAX_PREEMPTIONS=4 to keep the loom step under 6 minutes: at 4 that one model takes
/// 132 s and `.ci/loom.sh` 445 s cold (258 s warm) on the 2-core dev machine; at 3 the model
/// takes 20 s and the step 287 s cold. `.ci/loom.sh` checks that each of its 7 mutants is still
/// rejected at 3, and every ordering it checks is also isolated by a smaller model above that
/// runs at the full bound. Run it at 4 by hand with `EP_LOOM_FULL_BOUND=1`.
const TWO_CALLS_PREEMPTIONS: usize = 3;

/// Two sender blocks and one receiver block over two calls, no host sync between them: every
/// ordering of the batched dispatch at once (the smaller models above each isolate one
/// ordering, for the mutants).
#[test]
fn batched_two_senders_one_receiver_two_calls() {
    let bound = std::env::var_os("EP_LOOM_FULL_BOUND")
        .is_none()
        .then_some(TWO_CALLS_PREEMPTIONS);
    model_bounded(bound, || {
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
            bad_input: None,
            shrink: false,
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
        let want = DeviceError::Timeout {
            rank: 1,
            peer: 0,
            phase: PH_DISPATCH_RECV,
            call: 1,
        };
        assert_eq!(host.sync(g), Err(want));
        // Call 2: runtime/launch.rs `launch_inner` starts with check_usable.
        assert_eq!(host.check_usable(), Err(want), "call 2 must be refused");
    });
    assert!(
        saw_flag.load(StdOrdering::Relaxed),
        "no interleaving had a waiter stopped by the error word"
    );
}

/// Two sender blocks and one receiver block, and the host's sync after each call (`dispatch` =
/// launch + sync, runtime/launch.rs). Call 1 has a bound of one poll: depending on the interleaving
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
                DeviceError::Timeout {
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

/// Rank 0's routing is bad (`in_bad`): it reports `ERR_EXPERT_RANGE`, skips its ack waits and
/// its sends, and still counts out, publishes epoch 1 and acks its sources. Rank 1 waits for a
/// signal that never comes. `same_device`: its wait must stop on the error flag (a bound that
/// never expires); otherwise it runs out of time and reports on its own device, and the host
/// names the input error first. Either way call 2 is refused.
fn bad_input_sender(same_device: bool) {
    loom::model(move || {
        let (dev1, timeout) = if same_device {
            (0, Duration::from_secs(7200))
        } else {
            (1, Duration::from_millis(1))
        };
        let g = group(Kind::Batched, vec![(0, 1), (dev1, 1)], 1);
        let kp = Launch {
            timeout,
            fault_rank: None,
            bad_input: Some(0),
            shrink: false,
        };
        let c1 = input(1, 0, 0);
        let tx = {
            let c1 = c1.clone();
            thread::spawn(move || dispatch_block(g, &kp, &c1, 0, 0))
        };
        let rx = dispatch_block(g, &kp, &c1, 1, 0);
        let tx = tx.join().unwrap();
        assert!(tx.bad_input && tx.last_out && tx.epoch == 1 && tx.failed_wait.is_none());
        assert!(rx.read.is_empty() && rx.last_out && !rx.bad_input);
        let want_wait = if same_device {
            WaitEnd::SawError
        } else {
            WaitEnd::TimedOut
        };
        assert_eq!(rx.failed_wait, Some(want_wait));
        let mut host = Host::default();
        let want = DeviceError::BadInput { rank: 0 };
        assert_eq!(host.sync(g), Err(want), "the input error is named first");
        assert_eq!(host.check_usable(), Err(want), "call 2 must be refused");
    });
}

#[test]
fn bad_input_sender_peer_on_the_same_device() {
    bad_input_sender(true);
}

#[test]
fn bad_input_sender_peer_on_another_device() {
    bad_input_sender(false);
}

/// Rank 1 (the receiver) has bad routing in call 1 and good routing in call 2, launched back to
/// back with no sync. Its call 1 reads nothing but acks call 1 (`finish:`, "`if (last_out && p.stage != 1)`"); rank 0's
/// call 2 then overwrites the buffers, and rank 1's call 2 must consume exactly call 2's
/// entries: the bad call leaves the epochs in step and its early ack is safe.
#[test]
fn bad_input_receiver_then_good_call() {
    model(|| {
        let g = group(Kind::Batched, vec![(0, 1), (1, 1)], 1);
        let c = [input(1, 0, 0), input(2, 0, 0)];
        // Bounds that never expire: rank 0 only waits for rank 1's ack of call 1, which comes
        // unconditionally; rank 1's call 2 ends on the signal or on its device's error flag
        // (raised by its own call 1, and never cleared: it stops within 64 polls on the device).
        let kp = Launch {
            timeout: Duration::from_secs(7200),
            ..bounded(0)
        };
        let bad = Launch {
            bad_input: Some(1),
            ..kp
        };
        let tx = {
            let c = c.clone();
            thread::spawn(move || {
                let r1 = dispatch_block(g, &kp, &c[0], 0, 0);
                let r2 = dispatch_block(g, &kp, &c[1], 0, 0);
                (r1, r2)
            })
        };
        let rx1 = dispatch_block(g, &bad, &c[0], 1, 0);
        let rx2 = dispatch_block(g, &kp, &c[1], 1, 0);
        let (tx1, tx2) = tx.join().unwrap();
        assert!(rx1.bad_input && rx1.read.is_empty() && rx1.last_out);
        for r in [&tx1, &tx2] {
            assert_eq!(r.failed_wait, None, "rank 0 only waits for rank 1's acks");
        }
        assert_eq!((tx2.epoch, rx2.epoch), (2, 2), "the epochs stay in step");
        let completed = rx2.failed_wait.is_none();
        if !completed {
            assert_eq!(rx2.failed_wait, Some(WaitEnd::SawError));
        } else {
            assert_eq!(rx2.read, g.expected(&c[1], 1), "call 2 consumed exactly");
        }
        let mut host = Host::default();
        assert_eq!(host.sync(g), Err(DeviceError::BadInput { rank: 1 }));
        completed
    });
}

/// Every block of every rank in one launch each (all at once: loom threads, the first block on
/// this one); returns when all ended, the reports per rank in block order.
fn every_block(
    g: &'static Group,
    run: impl Fn(usize, usize) -> BlockReport + Clone + Send + 'static,
) -> Vec<Vec<BlockReport>> {
    let all: Vec<(usize, usize)> = (0..g.ranks.len())
        .flat_map(|r| (0..g.ranks[r].blocks).map(move |b| (r, b)))
        .collect();
    let others: Vec<_> = all[1..]
        .iter()
        .map(|&(r, b)| {
            let run = run.clone();
            thread::spawn(move || run(r, b))
        })
        .collect();
    let mut reps: Vec<Vec<BlockReport>> = vec![Vec::new(); g.ranks.len()];
    reps[all[0].0].push(run(all[0].0, all[0].1));
    for (&(r, _), t) in all[1..].iter().zip(others) {
        reps[r].push(t.join().unwrap());
    }
    reps
}

/// One batched dispatch over NCCL in capacity mode (launch.rs `nccl_call`): the host poisons
/// every rank's send headers, the pack launches run, the grouped exchange, the unpack launches.
/// Returns the pack and the unpack reports per rank.
fn capacity_call(
    g: &'static Group,
    kp: Launch,
    input: &Input,
) -> (Vec<Vec<BlockReport>>, Vec<Vec<BlockReport>>) {
    for r in 0..g.ranks.len() {
        poison_send_headers(g, r);
    }
    let packs = {
        let input = input.clone();
        every_block(g, move |r, b| batched_pack_block(g, &kp, &input, r, b))
    };
    nccl_capacity_exchange(g);
    let unpacks = every_block(g, move |r, b| batched_unpack_block(g, &kp, r, b));
    (packs, unpacks)
}

/// NCCL capacity mode (batched; rank 0 sends to rank 1 over NCCL, two devices), two calls with
/// no host sync between them. Call 1 is good: rank 1 consumes exactly its entries. In call 2
/// rank 0's routing is bad: its pack stage writes no header and no batch, and the exchange,
/// with no host look, sends what is in them. The header must be the host's poison, so that
/// rank 1's unpack reports `ERR_PEER_DATA` (tokens, i32::MAX) and reads nothing, never call 1's
/// header and rows taken as call 2's (mutant `gpu_no_hdr_poison`); the host names the input
/// error first (errors.rs `cause_first`), and both ranks' epochs stay in step.
#[test]
fn capacity_bad_input_sender_header_poisoned() {
    model(|| {
        let g = group(Kind::Batched, vec![(0, 1), (1, 1)], 1);
        // No wait in this path (NCCL peers: no signal, no ack): the bound never matters.
        let kp = Launch {
            timeout: Duration::from_secs(7200),
            ..bounded(0)
        };
        let c = [input(1, 0, 0), input(2, 0, 0)];
        let (_, rx1) = capacity_call(g, kp, &c[0]);
        assert_eq!(
            device_error(g, 0).or(device_error(g, 1)),
            None,
            "call 1 is clean"
        );
        assert_eq!(
            merged(&rx1[1]),
            g.expected(&c[0], 1),
            "call 1 consumed exactly"
        );
        let bad = Launch {
            bad_input: Some(0),
            ..kp
        };
        let (tx2, rx2) = capacity_call(g, bad, &c[1]);
        assert!(tx2[0].iter().all(|r| r.bad_input && r.read.is_empty()));
        let stale = merged(&rx2[1]);
        assert!(
            stale.is_empty(),
            "rank 1 took a stale header as call 2's and read {stale:?}"
        );
        assert!(rx2[1].iter().all(|r| r.failed_wait.is_some()));
        assert_eq!(
            device_error(g, 1),
            Some(DeviceError::PeerData {
                rank: 1,
                peer: 0,
                field: PF_BATCH_TOKENS,
                value: POISON_HDR,
            }),
            "rank 1's unpack rejects the poisoned token count"
        );
        for (rank, reps) in tx2.iter().chain(&rx2).enumerate() {
            assert!(reps.iter().all(|r| r.epoch == 2), "rank {} epoch", rank % 2);
        }
        let mut host = Host::default();
        assert_eq!(
            host.sync(g),
            Err(DeviceError::BadInput { rank: 0 }),
            "the input error is named first"
        );
        true
    });
}

// ---------------------------------------------------------------- shrink mode (the rank mask)

/// `kp` in shrink mode (`p.shrink`).
fn shrink(kp: Launch) -> Launch {
    Launch { shrink: true, ..kp }
}

/// The host's sync after every launch ended, in shrink mode. A peer lost at the timeout's edge
/// is no error: the sync finds nothing, unless a block's wait again (its own wait ran out while
/// "arrived" was agreed) ran out too, which reports a timeout, and then the group refuses what
/// follows. Otherwise, on every rank: one block last out, the call's epoch (`before_clean`: the
/// calls made before the last `clean_mask`), no failed wait; every block left out the same
/// peers (the agreement: every block of these models waits for every source); no entry of a
/// peer left out was read, and the rank consumed exactly its call's entries from the others.
/// Returns whether the calls completed.
fn shrink_check(g: &Group, done: &[Done], before_clean: u64) -> bool {
    let mut host = Host::default();
    if let Err(t) = host.sync(g) {
        assert!(matches!(t, DeviceError::Timeout { .. }), "{t:?}");
        assert!(
            done.iter().any(|d| d
                .reps
                .iter()
                .any(|r| r.waited_again && r.failed_wait == Some(WaitEnd::TimedOut))),
            "in shrink mode only a wait again reports a timeout: {t:?}"
        );
        assert_eq!(host.check_usable(), Err(t), "the next call must be refused");
        return false;
    }
    for d in done {
        let (rank, call) = (d.rank, d.input.call);
        assert_eq!(
            d.reps.iter().filter(|r| r.last_out).count(),
            1,
            "exactly one block of rank {rank} is the last out"
        );
        let gone = d.reps[0].gone;
        for r in &d.reps {
            assert_eq!(r.epoch, g.base + call - before_clean, "rank {rank}'s epoch");
            assert_eq!(r.failed_wait, None, "a failed wait raises the error word");
            assert_eq!(
                r.gone, gone,
                "the blocks of rank {rank} disagree on the lost peers in call {call}"
            );
            if let Some(e) = r.read.iter().find(|e| is_gone(gone, e.src)) {
                panic!("rank {rank} read a masked peer's entries in call {call}: {e:?}");
            }
        }
        let want: Vec<Entry> = g
            .expected(&d.input, rank)
            .into_iter()
            .filter(|e| !is_gone(gone, e.src))
            .collect();
        assert_eq!(
            merged(&d.reps),
            want,
            "rank {rank} consumed call {call}'s entries, less the peers left out ({gone:#b})"
        );
    }
    true
}

/// Shrink mode, one call: rank 0 (one block) sends both its tokens to rank 1, whose two blocks
/// wait for rank 0's signal for one poll: at the timeout's edge one block may see it while the
/// other runs out. Both must end with the same verdict (common.cuh `agree_at`): "arrived", and
/// both read their entries after the signal (the block that ran out waits again: loom's cells
/// catch a read before the write), and rank 1 acks rank 0; or "lost", and neither reads, rank 1
/// masks rank 0 and does not ack it. Either way no error. Both verdicts, and a block waiting
/// again then reading, must occur. Mutant `gpu_no_agreement` (each block goes on with its own
/// verdict): one block reads, the other drops rank 0.
///
/// Batched: one entry per block (entry j to block j % 2). Per-expert: the two tokens go to local
/// experts 0 and 1, one per block, and each block's wait covers both of rank 0's signal words
/// (`wait_peer_signals` with nw = L), its own and the other block's.
fn two_blocks_agree(kind: Kind, local_experts: usize, l1: usize) {
    let seen = std::sync::Arc::new([(); 3].map(|_| AtomicBool::new(false)));
    let s = seen.clone();
    model(move || {
        let g = group(kind, vec![(0, 1), (1, 2)], local_experts);
        let c = vec![input(1, 0, l1)];
        let done = run_calls(g, shrink(bounded(1)), c.clone(), c);
        if !shrink_check(g, &done, 0) {
            return false;
        }
        let rx = &done[1].reps;
        let lost = is_gone(rx[0].gone, 0);
        assert_eq!(
            mask_status(g, 1),
            [lost, false],
            "rank 1 masks rank 0 iff lost"
        );
        assert_eq!(mask_status(g, 0), [false, false], "rank 0 lost nobody");
        assert_eq!(
            ack_word(g, 0, 1),
            !lost as u64,
            "rank 1 acks call 1 to rank 0 iff it arrived"
        );
        s[lost as usize].store(true, StdOrdering::Relaxed);
        if rx.iter().any(|r| r.waited_again && !r.read.is_empty()) {
            s[2].store(true, StdOrdering::Relaxed);
        }
        true
    });
    let [arrived, lost, again] = &*seen;
    assert!(
        arrived.load(StdOrdering::Relaxed),
        "no interleaving had rank 0 arrive"
    );
    assert!(
        lost.load(StdOrdering::Relaxed),
        "no interleaving lost rank 0"
    );
    assert!(
        again.load(StdOrdering::Relaxed),
        "no interleaving had a block run out, wait again and read"
    );
}

#[test]
fn shrink_two_blocks_agree_at_the_timeout_edge() {
    two_blocks_agree(Kind::Batched, 1, 0);
}

#[test]
fn shrink_per_expert_two_blocks_agree_at_the_timeout_edge() {
    two_blocks_agree(Kind::PerExpert, 2, 1);
}

/// One thread per rank (rank 0's on this one), each running its launches of `per_rank` in
/// order with no host sync between them; returns them all, rank by rank.
fn run_ranks(g: &'static Group, kp: Launch, per_rank: Vec<Vec<Input>>) -> Vec<Done> {
    let mut per_rank = per_rank.into_iter().enumerate();
    let (_, first) = per_rank.next().expect("rank 0");
    let run = move |rank: usize, inputs: Vec<Input>| {
        inputs
            .into_iter()
            .map(|input| Done {
                rank,
                reps: launch(g, kp, &input, rank),
                input,
            })
            .collect::<Vec<_>>()
    };
    let others: Vec<_> = per_rank
        .map(|(rank, inputs)| thread::spawn(move || run(rank, inputs)))
        .collect();
    let mut done = run(0, first);
    for t in others {
        done.extend(t.join().unwrap());
    }
    done
}

/// Shrink mode, three ranks, two calls with no sync between them: ranks 0 and 2 each send both
/// their tokens to rank 1. Rank 1's process has masked rank 0 (runtime/mask.rs `update_mask`,
/// before rank 1's call 1); rank 0's has not, so rank 0's call 1 writes rank 1's region and
/// signals with call 1's tag, which is rank 1's call's. Rank 1 must not wait for that signal
/// nor read rank 0's region (loom's cells: rank 0 writes it while rank 1 runs), whether it
/// lands during rank 1's call 1 or late, during call 2, and must not ack rank 0; meanwhile it
/// exchanges with rank 2 as usual (at the timeout's edge: arrived or lost, agreed). Rank 0's
/// call 2 waits for rank 1's ack of call 1 in vain, takes rank 1 as lost (no error) and
/// neither writes nor signals: rank 1's region of rank 0 keeps call 1's entries. Mutant
/// `gpu_masked_peer_waited` (the receive ignores the mask): rank 1 takes rank 0's signal and
/// reads the masked peer's entries.
#[test]
fn shrink_masked_peer_signals_ignored() {
    let both = std::sync::Arc::new(AtomicBool::new(false));
    let seen = both.clone();
    model(move || {
        let g: &'static Group = Box::leak(Box::new(Group::new(Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (1, 1), (2, 1)],
            links: vec![(0, 1), (2, 1)],
            max_tokens: 2,
            local_experts: 1,
        })));
        update_mask(g, 1, 0, true);
        let c: Vec<Input> = (1..=2)
            .map(|call| Input {
                call,
                route: vec![
                    vec![vec![(1, 0)], vec![(1, 0)]],
                    vec![],
                    vec![vec![(1, 0)], vec![(1, 0)]],
                ],
            })
            .collect();
        let done = run_ranks(g, shrink(bounded(1)), vec![c.clone(), c.clone(), c]);
        // One block per rank: no wait again, nothing can report.
        assert!(shrink_check(g, &done, 0), "no error in shrink mode here");
        let gone = |rank: usize, call: u64| {
            let d = done.iter().find(|d| d.rank == rank && d.input.call == call);
            d.expect("launched").reps[0].gone
        };
        assert_eq!(gone(0, 1), 0, "rank 0 does not know");
        assert_eq!(
            gone(0, 2),
            0b010,
            "rank 0 lost rank 1 at the ack wait of call 2"
        );
        for call in 1..=2 {
            assert!(
                is_gone(gone(1, call), 0),
                "rank 1 left rank 0 out of call {call}"
            );
        }
        assert_eq!(mask_status(g, 0), [false, true, false]);
        assert!(mask_status(g, 1)[0]);
        assert_eq!(ack_word(g, 0, 1), 0, "no ack to a masked peer");
        for t in 0..2 {
            assert_eq!(
                entry_at(g, 1, t),
                ([t as u32, 0, 0, 0], payload(1, 0, t)),
                "rank 0 wrote nothing to rank 1 in call 2"
            );
        }
        if gone(1, 2) == 0b001 {
            seen.store(true, StdOrdering::Relaxed);
        }
        true
    });
    assert!(
        both.load(StdOrdering::Relaxed),
        "no interleaving had rank 1 take rank 2's entries in both calls"
    );
}

/// Shrink mode: call 1 loses rank 0 on rank 1 at the timeout's edge (or not: both occur);
/// then, every launch ended, every rank's clean (runtime/mask.rs `clean_mask`: the mask, the
/// decisions, the signal and ack words, the epochs and counters); then call 2 on both ranks
/// from epoch 0 again (epoch 1: call 1's tag), with a bound that never expires. Rank 1 must
/// take rank 0 back and consume exactly call 2's entries, bit for bit. Rank 0's call-1 signal,
/// ignored by a rank 1 that had lost rank 0, carries that same tag: left in its word (mutant
/// `gpu_clean_keeps_signals`), rank 1 takes it as call 2's and reads the region while rank 0
/// rewrites it.
#[test]
fn shrink_unmask_with_clean() {
    let masked = std::sync::Arc::new(AtomicBool::new(false));
    let seen = masked.clone();
    model(move || {
        let g = group(Kind::Batched, vec![(0, 1), (1, 1)], 1);
        let c1 = vec![input(1, 0, 0)];
        let done = run_calls(g, shrink(bounded(1)), c1.clone(), c1);
        assert!(
            shrink_check(g, &done, 0),
            "one block per rank: no wait again"
        );
        if mask_status(g, 1)[0] {
            seen.store(true, StdOrdering::Relaxed);
        }
        clean_mask(g);
        for rank in 0..2 {
            assert_eq!(mask_status(g, rank), [false, false], "rank {rank}'s mask");
        }
        let never = Launch {
            timeout: Duration::from_secs(7200),
            ..shrink(bounded(0))
        };
        let c2 = vec![input(2, 0, 0)];
        let done = run_calls(g, never, c2.clone(), c2);
        assert!(shrink_check(g, &done, 1), "nothing can run out");
        assert_eq!(done[1].reps[0].gone, 0, "rank 1 took rank 0 back");
        assert_eq!(merged(&done[1].reps), g.expected(&done[1].input, 1));
        true
    });
    assert!(
        masked.load(StdOrdering::Relaxed),
        "no interleaving masked rank 0 in call 1"
    );
}
