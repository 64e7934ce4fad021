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
//! completed without a timeout, so a bound too tight to let anything finish cannot pass. And in
//! every interleaving, failed or not, each launch's end (`check_exit`): one block is the last
//! out, and when some block saw the call fail (its `s_fail`, bad input, poison or a failed
//! wait), the last block out knows it from the exit count (`call_failed`) and writes the failed
//! call's outputs (frame.cuh `last_block_out`, "`if (last_out && call_failed)`", past the send
//! half's "`if (stage == 1) return;`"); excused only where a report that lost the claim ran out of its wait for
//! the winner's code (`claim_unseen`: loom starved the winner for the whole bound).
//! (Unbounded spins are not an option: with two blocks waiting for a third, loom would explore
//! the two yielding to each other for ever.)
//!
//! Which model covers which wait of the kernels:
//! The kernels name these models in `// loom:` comments next to the code each one covers.
//! - `batched_two_senders_one_receiver`: the block-completion counter and the signal (batched
//!   dispatch's `fence_rel(p)`, "`atomicAdd(state + ST_SENT + KIND, 1u)`", `fence_rel(p)`,
//!   "`st_release(p, sig_bat(tab[d]) + rank, ...)`") and the receiver's `wait_signal`, one call.
//! - `batched_consecutive_calls` (and `per_expert_consecutive_calls`): the tag in the signal
//!   (no signal of call 1 taken for call 2), the ack (`frame_end`'s "`st_release(p,
//!   ack_words(c.tab[s], p.R, KIND) + c.rank, c.epoch)`": `sig_bat_ack` / `sig_pe_ack`) and the
//!   sender's ack wait before it overwrites the buffers (`wait_acks`; batched: the pre-load
//!   `a.v0` then "`if (a.waits && a.v0 < c.epoch - 1ull) bad = !wait_ack(...)`"; per-expert:
//!   `wait_ack` in `tid < R`).
//! - `batched_tag_wrap`, `per_expert_tag_wrap`: the same two calls across the tag's wrap
//!   (epochs 2^40 - 2 -> 2^40 - 1, tags 2^40 - 1 -> 1; common.cuh `sig_tag`, and `wait_signal`'s
//!   match "`(v >> SIG_COUNT_BITS) == tag`"): the previous call's signal, whose tag is now the
//!   larger, is never taken.
//! - `batched_one_sender_two_receivers`: `last_block_out`'s exit counter, which must carry every
//!   receiving block's reads into the last block's ack (frame.cuh `last_block_out`), and a
//!   block's failure (a wait that ran out: "`f ? 1u + EXIT_FAILED : 1u`") into the last
//!   block's `call_failed` (mutant `gpu_exit_no_fail_flag`).
//! - `per_expert_two_senders_one_receiver`: the per-expert signal of each (expert, source) and
//!   the epoch-stamped messages (per-expert dispatch's `fence_rel(p)` then "`st_release(p,
//!   sig_pe(tab[d], R) + (u64)l * R + rank, ...)`", its `wait_signal`, and the header match
//!   "`hv.x == (u32)epoch && hv.w == (u32)(epoch >> 32)`").
//! - `fault_timeout_stops_every_waiter`, `slow_sender_timeout_refused_or_correct`: the bounded
//!   waits, the error word (common.cuh `report_error`, `failed`) and the host's refusal after a
//!   timeout (runtime/error_word.rs `GpuGroup::sync` and `GpuGroup::check`, runtime/mod.rs
//!   `check_usable`); `fault_timeout_stops_every_waiter` also a report that loses the claim to
//!   another block of its rank (`report_error`'s wait for the winner's code).
//! - `fault_two_ranks_one_device_both_time_out`: the same with two ranks on one device (one
//!   error word), one block each: a report that loses the claim to the other rank's block
//!   waits for the winner's code (common.cuh `report_error_at`, "`while (ld_volatile_u32(w)
//!   == 0u && globaltimer() - t0 < 100000ull)`"), or its rank's last block out would not know
//!   that its call failed (mutant `gpu_loser_no_wait`).
//! - `bad_input_sender_peer_*`, `bad_input_receiver_then_enqueued_call`: the device-side input
//!   check (`in_bad`: "`__syncthreads_or(bad) | s_bad<KIND>`", then "`if (s_fail<KIND> ||
//!   in_bad) { poison_peers(...); return false; }`"): the bad rank skips its waits and sends,
//!   stores the poison, and still counts out, publishes its epoch and acks; what its peers see
//!   on the same device (the flag or the poison) and on another (the poison or a timeout, ranked
//!   after the input error by error_word.rs `cause_first`).
//! - `batched_hook_split_one_call`: the receive hook's split of batched dispatch over NVLink
//!   (a send-half launch, stage 1, then a receive-half launch, stage 2, per rank and call):
//!   stage 2's pre-load of its sources' signals at kernel start ("`pre.sig0 =
//!   ld_acquire(p, sig_bat(me) + s)`", `preload_signals`) and `wait_signal_pre`, which takes
//!   a count from it with no further load (mutant `gpu_preload_relaxed`), else waits as
//!   `wait_signal` does (mutant `gpu_wait_relaxed`).
//! - `batched_hook_split_consecutive_calls`, `batched_hook_split_tag_wrap`: two split calls:
//!   the receive half's `frame_end` acks (stage 1 counts no exit and publishes nothing: "`if
//!   (stage == 1) return;`"), the send half's ack wait (mutant `gpu_no_ack_wait`), and a pre-loaded word of
//!   call 1 never taken for call 2's (across the tag's wrap too: mutant `gpu_tag_ge`).
//!   Batched combine's stage-2 pre-load of `sig_cb` is the same pattern and has no model of its
//!   own.
//! - `batched_two_senders_one_receiver_two_calls` (the slow one): all of the batched orderings
//!   at once, two sender blocks and one receiver block over two calls.
//! - `capacity_bad_input_sender_header_poisoned`: NCCL capacity mode (batched): the host's
//!   poisoning of the send headers (nccl/call.rs `poison_send_headers`) and the unpack's bound on
//!   the received token count, across a call whose sender stops on bad input (mutant
//!   `gpu_no_hdr_poison`).
//! - `failed_rank_poisons_enqueued_calls`, `per_expert_failed_rank_poisons_enqueued_calls`: a
//!   rank whose call fails, with its next launches already enqueued and a peer behind it: each
//!   block's look at the error word at its start (`s_fail`), the poison it stores instead of
//!   the call (poison.cuh `poison_peers`), the receiver's `is_poison` in `wait_signal`
//!   (`ERR_PEER_FAILED`); mutants `gpu_no_failed_check`, `gpu_no_poison`.
//! - `shrink_*`: shrink mode, in `loom_gpu_shrink.rs`.
#![cfg(ep_loom)]

mod loom_gpu;
use loom_gpu::*;

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

/// The receive hook's split calls `c` (batched dispatch over NVLink, rank 0 to rank 1, each
/// rank running per call its send half then its receive half, in stream order, with no host
/// sync; every wait bounded at one poll) on a group that completed `base` calls, checked by
/// the host. Some interleaving must complete with `want` true of rank 1's receive halves (block
/// 0's report, one per call), as `what` says.
fn hook_split(
    ranks: Vec<(usize, usize)>,
    base: u64,
    c: Vec<Input>,
    want: fn(&[&BlockReport]) -> bool,
    what: &'static str,
) {
    let seen = std::sync::Arc::new(AtomicBool::new(false));
    let saw = seen.clone();
    model(move || {
        let g = group_after(Kind::Batched, ranks.clone(), 1, base);
        let done = run_calls_with(g, bounded(1), c.clone(), c.clone(), run_halves);
        let completed = host_check(g, &done);
        let rx: Vec<&BlockReport> = done
            .iter()
            .filter(|d| d.rank == 1)
            .map(|d| &d.reps[0])
            .collect();
        if completed && want(&rx) {
            saw.store(true, StdOrdering::Relaxed);
        }
        completed
    });
    assert!(
        seen.load(StdOrdering::Relaxed),
        "no interleaving completed with {what}"
    );
}

/// One split call: rank 0 sends its two tokens to rank 1 (two sender blocks: the signal is the
/// last one's). Rank 1's receive half pre-loads rank 0's signal at its start
/// (`preload_signals`); when rank 0's send half signalled before that, the count is taken from
/// the pre-load alone (`wait_signal_pre`), whose acquire must order the entries' reads (mutant
/// `gpu_preload_relaxed`), and some interleaving must do so; else it waits as ever.
#[test]
fn batched_hook_split_one_call() {
    hook_split(
        vec![(0, 2), (1, 1)],
        0,
        vec![input(1, 0, 0)],
        |rx| rx[0].preload_taken,
        "rank 1's count taken from its pre-load",
    );
}

/// Two split calls on the same buffers, one block each side: the receive half's ack (its
/// `frame_end` acks every NVLink source; the send half's publishes nothing) lets rank 0's call-2
/// send half overwrite the entries, and rank 1's call-2 receive half may pre-load call 1's
/// signal (call 2's send half has not signalled yet): a stale tag, which it must not take for
/// call 2's, and some interleaving must pre-load it.
fn hook_split_consecutive(base: u64) {
    hook_split(
        vec![(0, 1), (1, 1)],
        base,
        vec![input(1, 0, 0), input(2, 0, 0)],
        |rx| rx[1].preload_stale,
        "rank 1's call 2 pre-loading call 1's signal",
    );
}

#[test]
fn batched_hook_split_consecutive_calls() {
    hook_split_consecutive(0);
}

/// [`batched_hook_split_consecutive_calls`] across the tag's wrap ([`BEFORE_WRAP`]): the
/// pre-loaded call-1 word has the larger tag (mutant `gpu_tag_ge`).
#[test]
fn batched_hook_split_tag_wrap() {
    hook_split_consecutive(BEFORE_WRAP);
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
/// sees the flag, or runs out too, loses the claim and waits for the winner's code, or starts
/// after the report and is poisoned at its start; every block leaves. The host's sync turns
/// the word into the timeout, and the group refuses call 2.
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
            fail_receive: None,
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
        let rx = [b0, reps[1].clone()];
        // A block that starts after the other's report is a failed group's block: poisoned at
        // its start, with no wait of its own.
        assert!(rx
            .iter()
            .all(|r| (r.failed_wait.is_some() || r.poisoned) && r.read.is_empty()));
        assert!(rx.iter().any(|r| r.failed_wait == Some(WaitEnd::TimedOut)));
        if rx.iter().any(|r| r.failed_wait == Some(WaitEnd::SawError)) {
            seen.store(true, StdOrdering::Relaxed);
        }
        // Both blocks saw the call fail: the last one out knows, whichever it is.
        check_exit(0, &reps[..1], true);
        check_exit(1, &rx, true);
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

/// Rank 0 (device 0) never signals (the `fault_rank` hook); ranks 1 and 2 share device 1, so
/// one error word, and wait for it with one block each. Both waits may run out: the first to
/// claim the word reports, and the other's `report_error` loses the claim ("`atomicCAS(w + 7,
/// 0u, 1u)`" reads 1) with nothing of its rank to bring its failure into the exit count but
/// its own look at the error word, which nothing orders after the winner's "`atomicExch(w,
/// code)`" but the loser's wait for the code (common.cuh `report_error_at`, "`while
/// (ld_volatile_u32(w) == 0u && globaltimer() - t0 < 100000ull)`"). Each rank's last block out
/// must know that its call failed (`check_exit`; mutant `gpu_loser_no_wait`: the loser's rank
/// misses it), and some interleaving must have both waits run out and the loser see the code.
#[test]
fn fault_two_ranks_one_device_both_time_out() {
    let waited = std::sync::Arc::new(AtomicBool::new(false));
    let seen = waited.clone();
    loom::model(move || {
        let g: &'static Group = Box::leak(Box::new(Group::new(Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (1, 1), (1, 1)],
            links: vec![(0, 1), (0, 2)],
            max_tokens: 1,
            local_experts: 1,
            build: Build::Narrow,
        })));
        let kp = Launch {
            fault_rank: Some(0),
            ..bounded(1)
        };
        // Rank 0's token 0 is bound for rank 1, its token 1 for rank 2.
        let c1 = Input {
            call: 1,
            route: vec![vec![vec![(1, 0)], vec![(2, 0)]], vec![], vec![]],
        };
        let others: Vec<_> = [0, 2]
            .into_iter()
            .map(|rank| {
                let c1 = c1.clone();
                thread::spawn(move || dispatch_block(g, &kp, &c1, rank, 0))
            })
            .collect();
        let r1 = dispatch_block(g, &kp, &c1, 1, 0);
        let mut reps: Vec<BlockReport> = others.into_iter().map(|t| t.join().unwrap()).collect();
        reps.insert(1, r1);
        for (rank, r) in reps.iter().enumerate() {
            check_exit(rank, std::slice::from_ref(r), true);
        }
        // Ranks 1 and 2: a wait that ran out, or saw the flag, or a start after the report
        // (poisoned, no wait); nothing read.
        let rx = &reps[1..];
        assert!(rx
            .iter()
            .all(|r| (r.failed_wait.is_some() || r.poisoned) && r.read.is_empty()));
        if rx.iter().all(|r| r.failed_wait == Some(WaitEnd::TimedOut))
            && rx.iter().any(|r| r.claim_lost && !r.claim_unseen)
        {
            seen.store(true, StdOrdering::Relaxed);
        }
        let mut host = Host::default();
        let t = host.sync(g).unwrap_err();
        assert!(
            matches!(
                t,
                DeviceError::Timeout {
                    rank: 1 | 2,
                    peer: 0,
                    phase: PH_DISPATCH_RECV,
                    call: 1
                }
            ),
            "{t:?}"
        );
        assert_eq!(host.check_usable(), Err(t), "call 2 must be refused");
    });
    assert!(
        waited.load(StdOrdering::Relaxed),
        "no interleaving had both ranks' waits run out and the loser see the code"
    );
}

/// Two sender blocks and one receiver block, and the host's sync after each call (`dispatch` =
/// launch + sync, runtime/launch.rs and error_word.rs). Call 1 has a bound of one poll: depending on the interleaving
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
/// its sends, stores the poison in its signal words instead, and still counts out, publishes
/// epoch 1 and acks its sources. Rank 1 never takes a valid signal. `same_device`: its wait must
/// stop on the error flag or on the poison (a bound that never expires), or it starts after the
/// flag and is poisoned itself; otherwise its wait ends on the poison (`PeerFailed`) or its own
/// bound, reported on its own device, and the host names the input error first. Either way
/// call 2 is refused.
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
            fail_receive: None,
        };
        let c1 = input(1, 0, 0);
        let tx = {
            let c1 = c1.clone();
            thread::spawn(move || dispatch_block(g, &kp, &c1, 0, 0))
        };
        let rx = dispatch_block(g, &kp, &c1, 1, 0);
        let tx = tx.join().unwrap();
        check_exit(0, std::slice::from_ref(&tx), true);
        check_exit(1, std::slice::from_ref(&rx), true);
        assert!(tx.bad_input && tx.poisoned && tx.last_out && tx.epoch == 1);
        assert!(tx.failed_wait.is_none());
        assert!(rx.read.is_empty() && rx.last_out && !rx.bad_input);
        let by_itself = if same_device {
            WaitEnd::SawError
        } else {
            WaitEnd::TimedOut
        };
        // On the same device rank 1 may start after the flag: then it is a failed group's
        // launch itself (poisoned at its start, no wait).
        if !(same_device && rx.poisoned) {
            let end = rx.failed_wait.expect("rank 1's wait cannot succeed");
            assert!(end == by_itself || end == WaitEnd::PeerFailed, "{end:?}");
        }
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
/// back with no sync. Its call 1 reads nothing but acks call 1 (`frame_end`, "`if (last_out &&
/// threadIdx.x == 0)`"); rank 0's call 2 then overwrites the buffers. Rank 1's call 2 finds its
/// group failed (`s_fail`): it reads nothing and stores the poison, but still publishes epoch 2
/// and acks: the bad call leaves the epochs in step, its early ack is safe, and rank 0, which
/// only waits for acks, completes both calls.
#[test]
fn bad_input_receiver_then_enqueued_call() {
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
        for (rank, r) in [(0, &tx1), (0, &tx2), (1, &rx1), (1, &rx2)] {
            check_exit(rank, std::slice::from_ref(r), true);
        }
        assert!(rx1.bad_input && rx1.read.is_empty() && rx1.last_out);
        for r in [&tx1, &tx2] {
            assert_eq!(r.failed_wait, None, "rank 0 only waits for rank 1's acks");
        }
        assert_eq!((tx2.epoch, rx2.epoch), (2, 2), "the epochs stay in step");
        assert!(
            rx2.poisoned && rx2.read.is_empty() && rx2.last_out,
            "{rx2:?}"
        );
        let mut host = Host::default();
        assert_eq!(host.sync(g), Err(DeviceError::BadInput { rank: 1 }));
        true
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

/// One batched dispatch over NCCL in capacity mode (nccl/call.rs `Link::call`): the host poisons
/// every rank's send headers, the pack launches run, the grouped exchange, the unpack launches.
/// Returns the pack and the unpack reports per rank, each launch's end checked
/// ([`check_exit`]: the pack stage writes no outputs).
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
    for (r, (pack, unpack)) in packs.iter().zip(&unpacks).enumerate() {
        check_exit(r, pack, false);
        check_exit(r, unpack, true);
    }
    (packs, unpacks)
}

/// NCCL capacity mode (batched; rank 0 sends to rank 1 over NCCL, two devices), two calls with
/// no host sync between them. Call 1 is good: rank 1 consumes exactly its entries. In call 2
/// rank 0's routing is bad: its pack stage writes no header and no batch, and the exchange,
/// with no host look, sends what is in them. The header must be the host's poison, so that
/// rank 1's unpack reports `ERR_PEER_FAILED` and reads nothing, never call 1's
/// header and rows taken as call 2's (mutant `gpu_no_hdr_poison`); the host names the input
/// error first (error_word.rs `cause_first`), and both ranks' epochs stay in step. The unpack takes
/// the poison for what it is: the sender's failure (`ERR_PEER_FAILED` naming rank 0, call 2).
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
            Some(DeviceError::PeerFailed {
                rank: 1,
                peer: 0,
                call: 2,
            }),
            "rank 1's unpack takes the poisoned header for rank 0's failure"
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

/// Rank 0's call 1 fails in its receive (a wait that ran out: `Launch::fail_receive`, after its
/// send went out) with its calls 2 and 3 already launched behind it (enqueued: no host look in
/// between, as in process mode, graph replay or an engine that checks later); rank 1 makes
/// calls 1 and 2 at any pace, one call behind among them. Two devices (two error words, as two
/// processes), links both ways, one block and one token each way. What must hold in every
/// interleaving:
/// - no rank ever reads an entry of a rank whose group had failed (the model marks such data
///   `STALE`; mutant `gpu_no_failed_check`: rank 0's call 2 finds rank 1's ack already there,
///   skips its ack wait, and sends);
/// - rank 0's calls 2 and 3 read nothing and store the poison (every block);
/// - each of rank 1's calls either consumed exactly its entries or failed (its wait reported a
///   timeout or the peer's failure); its call 2 never completes, rank 0 sent nothing valid for it;
/// - in some interleaving rank 1's call ends on the poison, with `ERR_PEER_FAILED` naming rank
///   0 (mutant `gpu_no_poison`: rank 1 only ever times out).
fn failed_rank_poisons(kind: Kind) {
    let learned = std::sync::Arc::new(AtomicBool::new(false));
    let seen = learned.clone();
    model(move || {
        let g: &'static Group = Box::leak(Box::new(Group::new(Setup {
            kind,
            ranks: vec![(0, 1), (1, 1)],
            links: vec![(0, 1), (1, 0)],
            max_tokens: 1,
            local_experts: 1,
            build: Build::Narrow,
        })));
        let call = |c: u64| Input {
            call: c,
            route: vec![vec![vec![(1, 0)]], vec![vec![(0, 0)]]],
        };
        let kp = bounded(2);
        let fails = Launch {
            fail_receive: Some(0),
            ..kp
        };
        let tx = thread::spawn(move || {
            (1..=3)
                .map(|c| launch(g, if c == 1 { fails } else { kp }, &call(c), 0))
                .collect::<Vec<_>>()
        });
        let rx: Vec<Vec<BlockReport>> = (1..=2).map(|c| launch(g, kp, &call(c), 1)).collect();
        let tx = tx.join().unwrap();
        for (rank, reps) in tx.iter().map(|r| (0, r)).chain(rx.iter().map(|r| (1, r))) {
            check_exit(rank, reps, true);
        }
        for reps in tx.iter().chain(&rx) {
            for r in reps {
                let stale: Vec<_> = r.read.iter().filter(|e| e.payload & STALE != 0).collect();
                assert!(stale.is_empty(), "took a failed rank's data: {stale:?}");
            }
        }
        assert_eq!(tx[0][0].failed_wait, Some(WaitEnd::TimedOut));
        for reps in &tx[1..] {
            assert!(reps.iter().all(|r| r.read.is_empty()), "{reps:?}");
            // The poison path itself. Not asserted under the mutant that removes it
            // (`gpu_no_failed_check`): that mutant must fail on its harm, a peer reading a
            // failed rank's data, not on this.
            #[cfg(not(ep_mutant = "gpu_no_failed_check"))]
            assert!(reps.iter().all(|r| r.poisoned), "{reps:?}");
        }
        for (i, reps) in rx.iter().enumerate() {
            let r = &reps[0];
            if r.failed_wait.is_none() && !r.poisoned {
                assert_eq!(r.read, g.expected(&call(i as u64 + 1), 1), "call {}", i + 1);
            }
        }
        let r2 = &rx[1][0];
        assert!(
            r2.failed_wait.is_some() || r2.poisoned,
            "rank 1's call 2 cannot complete"
        );
        let mut host = Host::default();
        let first = host.sync(g).unwrap_err();
        assert!(
            matches!(
                first,
                DeviceError::Timeout {
                    rank: 0,
                    peer: 1,
                    call: 1,
                    ..
                }
            ),
            "{first:?}"
        );
        let on_rank1 = device_error(g, 1);
        if rx
            .iter()
            .any(|reps| reps[0].failed_wait == Some(WaitEnd::PeerFailed))
        {
            assert!(
                matches!(
                    on_rank1,
                    Some(DeviceError::PeerFailed {
                        rank: 1,
                        peer: 0,
                        ..
                    })
                ),
                "{on_rank1:?}"
            );
            seen.store(true, StdOrdering::Relaxed);
        }
        rx[0][0].failed_wait.is_none()
    });
    assert!(
        learned.load(StdOrdering::Relaxed),
        "no interleaving had rank 1 learn of rank 0's failure from its poison"
    );
}

#[test]
fn failed_rank_poisons_enqueued_calls() {
    failed_rank_poisons(Kind::Batched);
}

#[test]
fn per_expert_failed_rank_poisons_enqueued_calls() {
    failed_rank_poisons(Kind::PerExpert);
}
