//! loom models of the CUDA kernels' shrink mode (the rank mask), on `ep_verify::gpu_protocol`,
//! beside `loom_gpu_protocol.rs` (which says how the device maps onto the model) and with its
//! harness (`loom_gpu/`).
//!
//! Run: `RUSTFLAGS="--cfg ep_loom" LOOM_MAX_PREEMPTIONS=4 cargo test --release -p ep-verify
//! --test loom_gpu_shrink`; `.ci/loom.sh` runs them and their mutants.
//!
//! `shrink_*`: shrink mode, the rank mask (common.cuh, "shrink mode (the rank mask)":
//!   `agree_at`, `wait_peer_signals`, `wait_peer_ack`, `masked_peers`; batched dispatch's
//!   `s_gone` / `gone` and `frame_end`'s "no ack to a masked peer"; runtime/shrink.rs `update_mask`
//!   and `clean_mask`). `shrink_two_blocks_agree_at_the_timeout_edge` and its per-expert twin:
//!   the blocks of a rank agree on a peer whose signal lands at the timeout's edge (mutant
//!   `gpu_no_agreement`); `shrink_masked_peer_signals_ignored`: a masked peer's signal, with this
//!   call's tag, and its region are left alone, and the masked peer masks back at its next ack
//!   wait (mutant `gpu_masked_peer_waited`); `shrink_unmask_with_clean`: a peer lost in call 1 is
//!   taken back after every rank's clean, bit for bit (mutant `gpu_clean_keeps_signals`).
//!
//! `shrink_wide_*`: the wide build past 32 ranks (common.cuh `WIDE`: the gone set in
//!   `EP_MASK_WORDS` shared words, `GONE_INIT`, `GONE_ADD`, `GONE_SNAPSHOT`), at a word of 2
//!   bits so that rank 2 of 3 is where rank 32 of 33 is (the first peer of word 1; see
//!   `gpu_protocol`'s `peers` module): a block's thread 1 copies word 1 at each snapshot.
//!   `shrink_wide_receive_loses_rank_past_the_first_word`: two survivors lose a dead rank 2 at
//!   their receive and leave it out (the snapshot after the receive); `shrink_wide_ack_*` (both
//!   kernels): rank 0 loses it at its ack wait and writes nothing more to it. Their mutants are
//!   the model's runtime `WideMutant`s (not cfg mutants: these tests run them and require the
//!   model to fail, `must_fail`): `FirstWordOnly` (the snapshot copies word 0 only: the
//!   models' assertions) and `NoSnapshotBarrier` (no barrier after the copies: loom's causality
//!   violation).
#![cfg(ep_loom)]

mod loom_gpu;
use loom_gpu::*;

// ---------------------------------------------------------------- shrink mode (the rank mask)

/// `kp` in shrink mode (`p.shrink`).
fn shrink(kp: Launch) -> Launch {
    Launch { shrink: true, ..kp }
}

/// The host's sync after every launch ended, in shrink mode. First every launch's end
/// (`check_exit`: one block last out, which knows whether a block saw the call fail). A peer
/// lost at the timeout's edge is no error: the sync finds nothing, unless a block's wait again (its own wait ran out while
/// "arrived" was agreed) ran out too, which reports a timeout, and then the group refuses what
/// follows. Otherwise, on every rank: one block last out, the call's epoch (`before_clean`: the
/// calls made before the last `clean_mask`), no failed wait; every block left out the same
/// peers (the agreement: every block of these models waits for every source); no entry of a
/// peer left out was read, and the rank consumed exactly its call's entries from the others.
/// Returns whether the calls completed.
fn shrink_check(g: &Group, done: &[Done], before_clean: u64) -> bool {
    for d in done {
        check_exit(d.rank, &d.reps, true);
    }
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
            "rank {rank} consumed call {call}'s entries, less the peers left out ({:#b})",
            gone.flat()
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
            .map(|input| run_whole(g, kp, input, rank))
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
/// their tokens to rank 1. Rank 1's process has masked rank 0 (runtime/shrink.rs `update_mask`,
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
            build: Build::Narrow,
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
        assert_eq!(gone(0, 1).flat(), 0, "rank 0 does not know");
        assert_eq!(
            gone(0, 2).flat(),
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
        if gone(1, 2).flat() == 0b001 {
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
/// then, every launch ended, every rank's clean (runtime/shrink.rs `clean_mask`: the mask, the
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
        assert_eq!(done[1].reps[0].gone.flat(), 0, "rank 1 took rank 0 back");
        assert_eq!(merged(&done[1].reps), g.expected(&done[1].input, 1));
        true
    });
    assert!(
        masked.load(StdOrdering::Relaxed),
        "no interleaving masked rank 0 in call 1"
    );
}

// ---------------------------------------------------------------- the wide build (past 32 ranks)

/// Three ranks (one block each, one device each) in the wide build at 2 bits a word
/// (`ep_verify::gpu_protocol::Build`; the scaling in its `peers` module's docs): W = 2 words,
/// rank 2 is bit 0 of word 1, where rank 32 of 33 sits in the kernel's 32-bit words. Every
/// block has a second thread (`gone_word_thread`) that copies word 1 at each
/// `GONE_SNAPSHOT`; word 0 is block thread 0's.
fn wide_group(
    kind: Kind,
    links: Vec<(usize, usize)>,
    mutant: Option<WideMutant>,
) -> &'static Group {
    let g = Box::leak(Box::new(Group::new(Setup {
        kind,
        ranks: vec![(0, 1), (1, 1), (2, 1)],
        links,
        max_tokens: 2,
        local_experts: 1,
        build: Build::Wide {
            word_bits: 2,
            mutant,
        },
    })));
    let at = PeerSet::empty(2).place(2);
    assert_eq!(at, (1, 1), "rank 2 is the first peer of word 1");
    g
}

/// Runs a model that must fail under its mutant, and requires the failure to say `want` (an
/// assertion of the model, or loom's "Causality violation").
fn must_fail(want: &str, body: impl FnOnce()) {
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .expect_err("the mutant survived: the model passed");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        msg.contains(want),
        "the mutant failed, but not with {want:?}: {msg}"
    );
}

/// Shrink mode, wide build, batched, one call: ranks 0 and 1 are rank 2's destinations, but
/// rank 2 (past the first word) is dead: it never launches. Each survivor's receive waits for
/// rank 2 for one poll, proposes "lost", agrees, masks rank 2 and adds it to word 1 of its live
/// set (`GONE_ADD`: an `atomicOr` by thread 0); after the `__syncthreads_or`, word 1 reaches
/// the snapshot the expansion reads only through thread 1's copy and the barrier after it.
/// Every survivor must leave rank 2 out (its snapshot holds it and nothing else), mask it, not
/// ack it, and read nothing. The survivors share nothing here (rank 2 is dead), so their
/// launches run one after the other on this thread: interleaved, with their word threads, the
/// model ran for over five minutes and could find nothing more. Mutants: `FirstWordOnly` (the snapshot misses rank
/// 2), `NoSnapshotBarrier` (thread 0 reads word 1 of `s_gone1` while thread 1 may still write
/// it: loom's causality violation).
fn wide_receive_loses_rank_past_the_first_word(mutant: Option<WideMutant>) {
    model(move || {
        let g = wide_group(Kind::Batched, vec![(2, 0), (2, 1)], mutant);
        let c = Input {
            call: 1,
            route: vec![vec![], vec![], vec![vec![(0, 0)], vec![(1, 0)]]],
        };
        let done: Vec<Done> = (0..2)
            .map(|rank| run_whole(g, shrink(bounded(1)), c.clone(), rank))
            .collect();
        for d in &done {
            for r in &d.reps {
                assert!(
                    is_gone(r.gone, 2),
                    "rank {} did not leave out rank 2 (word 1): {:#b}",
                    d.rank,
                    r.gone.flat()
                );
                assert_eq!(r.gone.flat(), 0b100, "rank {} lost rank 2 only", d.rank);
            }
        }
        // One block per rank: no wait again, nothing can report.
        assert!(shrink_check(g, &done, 0), "no error in shrink mode here");
        for rank in 0..2 {
            assert_eq!(
                mask_status(g, rank),
                [false, false, true],
                "rank {rank}'s mask"
            );
            assert_eq!(ack_word(g, 2, rank), 0, "rank {rank} acks rank 2 nothing");
        }
        true
    });
}

#[test]
fn shrink_wide_receive_loses_rank_past_the_first_word() {
    wide_receive_loses_rank_past_the_first_word(None);
}

#[test]
fn shrink_wide_receive_mutant_first_word_only() {
    must_fail("did not leave out rank 2", || {
        wide_receive_loses_rank_past_the_first_word(Some(WideMutant::FirstWordOnly))
    });
}

#[test]
fn shrink_wide_receive_mutant_no_snapshot_barrier() {
    must_fail("Causality violation", || {
        wide_receive_loses_rank_past_the_first_word(Some(WideMutant::NoSnapshotBarrier))
    });
}

/// Shrink mode, wide build, three calls of rank 0 with no sync between them; rank 0 sends both
/// its tokens to rank 2 (past the first word), which is dead: it never launches, so it never
/// acks. Call 1 writes rank 2's region and signals. Call 2's ack wait for rank 2 runs out:
/// "lost", agreed, rank 2 masked and added to word 1 of the live set; the snapshot after the
/// `__syncthreads_or` (thread 1 copies word 1, then the barrier) must hold it, so that call 2
/// neither writes nor signals rank 2: its region keeps call 1's entries. Call 3 starts with
/// rank 2 masked (`GONE_INIT`: every word, by thread 0) and leaves it out from the start.
/// Mutants: `FirstWordOnly` (call 2's snapshot misses rank 2, and call 2 writes the lost
/// peer's region), `NoSnapshotBarrier` (loom's causality violation on word 1 of `s_gone1`).
fn wide_ack_loses_rank_past_the_first_word(kind: Kind, mutant: Option<WideMutant>) {
    model(move || {
        let g = wide_group(kind, vec![(0, 2)], mutant);
        let c: Vec<Input> = (1..=3)
            .map(|call| Input {
                call,
                route: vec![vec![vec![(2, 0)], vec![(2, 0)]], vec![], vec![]],
            })
            .collect();
        let done = run_ranks(g, shrink(bounded(1)), vec![c]);
        for t in 0..2 {
            assert_eq!(
                entry_at(g, 2, t).1,
                payload(1, 0, t),
                "rank 0 wrote to rank 2, lost at its ack wait, after call 1"
            );
        }
        // One block: no wait again, nothing can report.
        assert!(shrink_check(g, &done, 0), "no error in shrink mode here");
        for d in &done {
            assert_eq!(
                is_gone(d.reps[0].gone, 2),
                d.input.call > 1,
                "rank 0 leaves out rank 2 (word 1) from call 2 on"
            );
        }
        assert_eq!(
            mask_status(g, 0),
            [false, false, true],
            "rank 0 masks rank 2"
        );
        true
    });
}

#[test]
fn shrink_wide_ack_loses_rank_past_the_first_word() {
    wide_ack_loses_rank_past_the_first_word(Kind::Batched, None);
}

#[test]
fn shrink_wide_per_expert_ack_loses_rank_past_the_first_word() {
    wide_ack_loses_rank_past_the_first_word(Kind::PerExpert, None);
}

#[test]
fn shrink_wide_ack_mutant_first_word_only() {
    for kind in [Kind::Batched, Kind::PerExpert] {
        must_fail("wrote to rank 2", || {
            wide_ack_loses_rank_past_the_first_word(kind, Some(WideMutant::FirstWordOnly))
        });
    }
}

#[test]
fn shrink_wide_ack_mutant_no_snapshot_barrier() {
    for kind in [Kind::Batched, Kind::PerExpert] {
        must_fail("Causality violation", || {
            wide_ack_loses_rank_past_the_first_word(kind, Some(WideMutant::NoSnapshotBarrier))
        });
    }
}
