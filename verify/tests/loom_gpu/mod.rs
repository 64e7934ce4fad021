//! The harness the GPU protocol's loom models share (`loom_gpu_protocol`, `loom_gpu_shrink`):
//! launches, the host's checks, bounded models. See `loom_gpu_protocol.rs` for what maps onto
//! what. Each test binary uses part of it.
#![allow(dead_code, unused_imports)]

pub use std::sync::atomic::{AtomicBool, Ordering as StdOrdering};
pub use std::time::Duration;

pub use ep_verify::gpu_protocol::{
    ack_word, batched_pack_block, batched_unpack_block, clean_mask, device_error, dispatch_block,
    dispatch_block_in, entry_at, gone_word_thread, hook_recv_block, hook_send_block, is_gone,
    mask_status, merged, nccl_capacity_exchange, payload, poison_send_headers, update_mask,
    BlockReport, BlockShared, Build, DeviceError, Entry, Group, Host, Input, Kind, Launch, PeerSet,
    Setup, WaitEnd, WideMutant, PF_BATCH_TOKENS, PH_DISPATCH_RECV, POISON_HDR, STALE,
};
pub use loom::thread;

/// Every wait gives up after this many polls past the first (a `Deadline` of N ms under loom).
pub fn bounded(polls: u64) -> Launch {
    Launch {
        timeout: Duration::from_millis(polls),
        fault_rank: None,
        bad_input: None,
        shrink: false,
        fail_receive: None,
    }
}

/// The shape of most models: ranks 0 (device 0) and 1 (device 1), rank 0 sends to rank 1.
/// Leaked: loom threads need 'static borrows (a new group per interleaving).
pub fn group(kind: Kind, ranks: Vec<(usize, usize)>, local_experts: usize) -> &'static Group {
    group_after(kind, ranks, local_experts, 0)
}

/// [`group`] whose ranks have completed `base` calls already.
pub fn group_after(
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
            build: Build::Narrow,
        },
        base,
    )))
}

/// Rank 0's two tokens, both bound for rank 1 (local experts `l0`, `l1`); rank 1 has none.
pub fn input(call: u64, l0: usize, l1: usize) -> Input {
    Input {
        call,
        route: vec![vec![vec![(1, l0)], vec![(1, l1)]], vec![]],
    }
}

/// One launch of every block of `rank`: blocks 1.. on loom threads, block 0 on this one. It
/// returns when every block has ended (the stream's order before the next launch). The wide
/// build: each block also gets its word threads (`gone_word_thread`, threads 1..W of the block,
/// on loom threads) over a new `BlockShared`, joined with it.
pub fn launch(g: &'static Group, kp: Launch, input: &Input, rank: usize) -> Vec<BlockReport> {
    let wide = matches!(g.setup.build, Build::Wide { .. });
    launch_blocks(g, rank, |b| -> Box<dyn FnOnce() -> BlockReport + Send> {
        let input = input.clone();
        if !wide {
            return Box::new(move || dispatch_block(g, &kp, &input, rank, b));
        }
        // Leaked: loom threads need 'static borrows (a new block memory per launch).
        let shared: &'static BlockShared = Box::leak(Box::new(BlockShared::new(g)));
        let words: Vec<_> = (1..shared.threads())
            .map(|tid| thread::spawn(move || gone_word_thread(shared, tid)))
            .collect();
        Box::new(move || {
            let rep = dispatch_block_in(g, &kp, &input, rank, b, Some(shared));
            for t in words {
                t.join().unwrap();
            }
            rep
        })
    })
}

/// One call of `rank` as the receive hook splits it over NVLink (batched dispatch, the narrow
/// build): its send-half launch (stage 1, `hook_send_block`), then in stream order its
/// receive-half launch (stage 2, `hook_recv_block`), each as [`launch`] runs one. Returns the
/// send half's reports and the receive half's.
pub fn launch_halves(
    g: &'static Group,
    kp: Launch,
    input: &Input,
    rank: usize,
) -> (Vec<BlockReport>, Vec<BlockReport>) {
    assert_eq!(
        g.setup.build,
        Build::Narrow,
        "the split is modelled in the narrow build"
    );
    let send = launch_blocks(g, rank, |b| -> Box<dyn FnOnce() -> BlockReport + Send> {
        let input = input.clone();
        Box::new(move || hook_send_block(g, &kp, &input, rank, b))
    });
    let recv = launch_blocks(g, rank, |b| -> Box<dyn FnOnce() -> BlockReport + Send> {
        Box::new(move || hook_recv_block(g, &kp, rank, b))
    });
    (send, recv)
}

/// Every block of one launch of `rank` (`block(b)` runs block b): blocks 1.. on loom threads,
/// block 0 on this one; returns when every block has ended, the reports in block order.
fn launch_blocks(
    g: &Group,
    rank: usize,
    block: impl Fn(usize) -> Box<dyn FnOnce() -> BlockReport + Send>,
) -> Vec<BlockReport> {
    let others: Vec<_> = (1..g.ranks[rank].blocks)
        .map(|b| thread::spawn(block(b)))
        .collect();
    let mut reps = vec![block(0)()];
    reps.extend(others.into_iter().map(|t| t.join().unwrap()));
    reps
}

/// One rank's call (its launch, or the receive hook's two), checked once the host knows that
/// no wait failed.
pub struct Done {
    pub rank: usize,
    pub input: Input,
    /// The launch that receives: stage 0 (the whole call), or the receive hook's receive half.
    pub reps: Vec<BlockReport>,
    /// The receive hook's send half (stage 1, before `reps` on the stream); empty for stage 0.
    pub send: Vec<BlockReport>,
}

/// Whether a block saw its call fail: its group had failed at its start (`s_fail`), its input
/// was bad, it stored the poison, or a wait of its own failed.
pub fn saw_failure(r: &BlockReport) -> bool {
    r.failed_start || r.bad_input || r.poisoned || r.failed_wait.is_some()
}

/// The end of one launch of `rank` (`reps`: every block's report; `outputs`: the launch writes
/// the call's outputs, `p.stage != 1`), in every interleaving, failed or not. A send half
/// (`!outputs`: the receive hook's stage 1, the NCCL pack) counts no exit ("`if (stage == 1)
/// return;`"): no block is the last out and none writes outputs. Any other launch: exactly one
/// block is the last out; when some block saw the call fail ([`saw_failure`]), the last block
/// out knows it from the exit count (`call_failed`: frame.cuh `last_block_out`, which does not
/// load the error word after the count; mutant `gpu_exit_no_fail_flag`) and writes the failed
/// call's outputs ("`if (last_out && call_failed) fail_dispatch_outputs(...)`"); no other block
/// writes them. The one excuse: a block whose report lost the claim and whose wait for the
/// winner's code ran out (`claim_unseen`: loom starved the winner for the whole bound, which on
/// the device is a winner stalled for 100 us between two adjacent instructions) may have gone
/// out seeing the group not failed.
pub fn check_exit(rank: usize, reps: &[BlockReport], outputs: bool) {
    if !outputs {
        assert!(
            reps.iter().all(|r| !r.last_out && !r.failed_outputs),
            "rank {rank}'s send half counts no exit and writes no outputs: {reps:?}"
        );
        return;
    }
    let last: Vec<&BlockReport> = reps.iter().filter(|r| r.last_out).collect();
    assert_eq!(
        last.len(),
        1,
        "exactly one block of rank {rank}'s launch is the last out"
    );
    let last = last[0];
    if reps.iter().any(saw_failure) {
        assert!(
            last.call_failed || reps.iter().any(|r| r.claim_unseen),
            "rank {rank}'s last block out must know that a block saw the call fail: {reps:?}"
        );
    }
    assert_eq!(
        last.failed_outputs, last.call_failed,
        "rank {rank}'s last block out writes a failed call's outputs iff it found the call failed"
    );
    assert!(
        reps.iter().all(|r| r.last_out || !r.failed_outputs),
        "only the last block out of rank {rank} writes outputs"
    );
}

/// The host's sync after every launch ended. First, in every launch ([`check_exit`]): exactly
/// one block was the last out, and it knew whether the call failed. A timeout: it names a
/// waiting rank and call, and the group refuses what follows. Otherwise: every block ran the
/// call's epoch, every rank consumed exactly its call's entries (and wrote no failed call's
/// outputs), and a send half (the receive hook's stage 1) read none. Returns whether the
/// calls completed.
pub fn host_check(g: &Group, done: &[Done]) -> bool {
    for d in done {
        check_exit(d.rank, &d.reps, true);
        if !d.send.is_empty() {
            check_exit(d.rank, &d.send, false);
        }
    }
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
        assert!(done.iter().any(|d| d
            .reps
            .iter()
            .chain(&d.send)
            .any(|r| r.failed_wait.is_some())));
        assert_eq!(host.check_usable(), Err(t), "the next call must be refused");
        return false;
    }
    for d in done {
        let rank = d.rank;
        for r in d.reps.iter().chain(&d.send) {
            assert_eq!(r.epoch, g.base + d.input.call, "rank {rank}'s epoch");
            assert_eq!(r.failed_wait, None, "a failed wait raises the error word");
            assert!(
                !r.failed_outputs,
                "rank {rank} wrote a failed call's outputs"
            );
        }
        assert!(
            d.send.iter().all(|r| r.read.is_empty()),
            "rank {rank}'s send half reads nothing"
        );
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
pub fn model(body: impl Fn() -> bool + Sync + Send + 'static) {
    model_bounded(None, body)
}

/// [`model`] with at most `bound` preemptions (`None`: `LOOM_MAX_PREEMPTIONS`, as `model`);
/// a bound above `LOOM_MAX_PREEMPTIONS` is lowered to it.
pub fn model_bounded(bound: Option<usize>, body: impl Fn() -> bool + Sync + Send + 'static) {
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
pub fn calls(g: &'static Group, kp: Launch, tx: Vec<Input>, rx: Vec<Input>) -> bool {
    host_check(g, &run_calls(g, kp, tx, rx))
}

/// The launches of [`calls`], unchecked: rank 0's first, then rank 1's.
pub fn run_calls(g: &'static Group, kp: Launch, tx: Vec<Input>, rx: Vec<Input>) -> Vec<Done> {
    run_calls_with(g, kp, tx, rx, run_whole)
}

/// One call of `rank` in one stage-0 launch.
pub fn run_whole(g: &'static Group, kp: Launch, input: Input, rank: usize) -> Done {
    Done {
        rank,
        reps: launch(g, kp, &input, rank),
        send: Vec::new(),
        input,
    }
}

/// One call of `rank` in the receive hook's two launches.
pub fn run_halves(g: &'static Group, kp: Launch, input: Input, rank: usize) -> Done {
    let (send, reps) = launch_halves(g, kp, &input, rank);
    Done {
        rank,
        reps,
        send,
        input,
    }
}

/// Rank 0's calls on this thread and rank 1's on a loom thread, each call run by `run`
/// ([`run_whole`], [`run_halves`]), unchecked: rank 0's first, then rank 1's.
pub fn run_calls_with(
    g: &'static Group,
    kp: Launch,
    tx: Vec<Input>,
    rx: Vec<Input>,
    run: fn(&'static Group, Launch, Input, usize) -> Done,
) -> Vec<Done> {
    let rx_thread = thread::spawn(move || {
        rx.into_iter()
            .map(|input| run(g, kp, input, 1))
            .collect::<Vec<_>>()
    });
    let mut done: Vec<Done> = tx.into_iter().map(|input| run(g, kp, input, 0)).collect();
    done.extend(rx_thread.join().unwrap());
    done
}
