//! The GPU kernels' synchronisation as Rust on the `ep_reference::sync` shim, so that loom can
//! check it (`tests/loom_gpu_protocol.rs`, built with `--cfg ep_loom`; the same functions run on
//! std threads in the normal build).
//!
//! One function per role. Each step cites the kernel code it mirrors (files under
//! `kernels/src/cu/`) by function and a quoted fragment, not by line number; the kernels carry
//! `// loom: gpu_protocol::<item>` comments at the same places. Only the synchronisation is
//! kept: routing tables, quantisation and the expansion into canonical rows are computation on
//! data that the orderings below publish. Payload entries are [`ROW_BYTES`]-byte rows of
//! [`SharedRows`]: every access touches a loom cell, so loom reports a read that the orderings
//! do not place after its write ("Causality violation"), and a write of call 2 that could land
//! on a row call 1 still reads.
//!
//! # How the device maps onto the model
//! - **A block is one thread.** The kernels order a block's threads with `__syncthreads` and let
//!   one thread fence, count and signal. A `bar.sync` then that thread's `fence.acq_rel` is
//!   cumulative in the PTX memory model, so one thread doing the block's work in program order
//!   has the same orderings. The model has one warp per block: send unit (token) t belongs to
//!   block `t % blocks`, receive unit j (over every source's entries) to block `j % blocks`.
//!   Which thread of the block does a step matters only through the barriers around it: batched
//!   dispatch's ack wait is thread `32 + d` (`acker`), its signal thread 0, its receive waits
//!   threads `tid < R`; each is followed or preceded by a `__syncthreads[_or]`.
//! - **Instructions.** `fence.acq_rel.{gpu,sys}` (common.cuh `fence_rel`) is `fence(AcqRel)`;
//!   `st.release` a `Release` store; `ld.acquire` an `Acquire` load; `atomicAdd`, `atomicCAS`,
//!   `atomicExch` relaxed read-modify-writes (CUDA's atomics are relaxed); `ld.volatile` and the
//!   plain stores of the `state` counters relaxed atomics; `__threadfence_system`
//!   `fence(SeqCst)`. The u64 epoch word (`ST_EPOCH64`, common.cuh `ld_epoch`) and the
//!   payload entries are plain memory (loom cells). Scopes (.gpu / .sys) are not modelled: the
//!   kernels use the narrowest one that covers every rank.
//! - **Launches.** [`dispatch_block`] is one block of a stage-0 launch (the whole call over
//!   NVLink / peer memory). The NCCL transport splits a call into stage 1 (pack), a host NCCL
//!   exchange and stage 2 (unpack), with no signals or acks for NCCL peers (`via_nccl`: the
//!   stream orders them); only its capacity mode's header poisoning is modelled
//!   ([`batched_pack_block`], [`nccl_capacity_exchange`], [`batched_unpack_block`]). The next
//!   launch on a device's stream starts after every block of the previous one ended (the tests
//!   join them). Nothing else orders two calls: no host synchronisation between calls is
//!   assumed (`GpuGroup::launch` back to back, process mode, CUDA graph replay), so only the
//!   acks order a call's reads on one device before the next call's writes from another.
//! - **Pairs.** The kernels run every (source, destination) pair, self included, count 0 too. A
//!   model lists the pairs it checks ([`Setup::links`]); pairs share nothing but the block
//!   counters and the error word, which the model keeps.
//! - **Bounded waits.** `%globaltimer` is a [`Deadline`]: under loom a timeout of N ms is N polls
//!   and one of an hour or more never expires. The kernels look at the error word and the clock
//!   every 64 polls, the model on every poll.
//! - **Shrink mode** ([`Launch::shrink`]; common.cuh, "shrink mode (the rank mask)"). Each
//!   rank's mask words (`int`: `ld.volatile` reads, `atomicExch`) and decision words (u64, one
//!   per (recv | ack, peer) of the model's kernel kind: a volatile read, then `atomicCAS`) are
//!   relaxed atomics of its [`Rank`]. A block reads the mask at its start (`masked_peers`:
//!   `gone0`); a masked peer is neither waited for nor sent to nor read (no count, no entry),
//!   and the last block out acks no peer masked by then. Any other peer's wait
//!   (`wait_peer_signals`, `wait_peer_ack`) proposes "arrived" once every word the peer owes is
//!   there, "lost" when the peer turns out masked or the [`Deadline`] runs out, and `agree`
//!   installs the call's first verdict for every block (a lost one masks the peer; a block that
//!   ran out under "arrived" waits again, bounded). A model loses a rank at the timeout's edge
//!   (a wait of one poll that its signal may or may not beat), by never signalling
//!   (`fault_rank`), or by the host's [`update_mask`] before a launch. [`clean_mask`] is the
//!   host's zeroing (runtime/mask.rs `GpuGroup::clean_mask`), run with every launch joined:
//!   every rank restarts from epoch 0. Not modelled: combine's shrink path (the same
//!   `wait_peer_signals` / `wait_peer_ack` and the same no-ack rule, on the combine words),
//!   the routing's "a masked owner's selection counts as -1" and the peer-written row counts
//!   and headers it then leaves unread (computation on data the model has no words for: only
//!   the signal's count and the entries), NCCL peers (shrink mode is CUDA IPC / peer access
//!   only), and the host's barrier after a clean (the joins).
//! - **Input checks.** Batched dispatch checks its routing in its one routing pass (the `route`
//!   lambda, "`v < -1 || v >= (i64)E`": `ERR_EXPERT_RANGE`; then the repeats, `ERR_DUP_EXPERT`),
//!   per-expert dispatch in common.cuh `load_topk(..., true)`, both the token count in
//!   `read_ntok` (`ERR_TOKENS`); all report with `report_error` before anything is written and
//!   set `in_bad`. [`Launch::bad_input`] makes one rank's routing bad. Peer-supplied counts are
//!   bounded with `peer_bad` (common.cuh); the model's peers are honest on NVLink, so there that
//!   check only mirrors the path; over NCCL the poisoned header exercises it.
//! - **The one-rank path** (batched.cu `direct`: "`R == 1 && p.stage == 0 && p.nccl_mask ==
//!   0u`") is not modelled and needs no model: the rank is its own only source and destination,
//!   its blocks write the caller's canonical rows straight from `x` with no batch, no signal and
//!   no expansion, so no block reads what another block or rank wrote in this call. What is
//!   left of the protocol there is the model's: the ack wait (on its own ack, published by the
//!   previous launch's last block out, which the stream ordered before this launch: `ack0`
//!   already holds `epoch - 1` and nothing is waited for) and `last_block_out` with the epoch
//!   and self-ack (`finish`, checked by `batched_one_sender_two_receivers`).
//!
//! # Mutants
//! `--cfg ep_mutant="..."` weakens one ordering; `.ci/loom.sh` builds each and requires a model
//! to fail. A weakened fence keeps only its other half (`fence(Acquire)` or `fence(Release)`).
//! The signal and ack stores come right after a `fence.acq_rel` of the same thread, which is
//! itself a release fence: making only the store relaxed is an equivalent mutant (the protocol
//! stays correct, and loom agrees). So `gpu_signal_relaxed` and `gpu_ack_store_relaxed` drop
//! the store's release *and* the release half of the fences before it in that thread.
//! `gpu_no_hdr_poison` is not an ordering: it drops the host's poisoning of the NCCL send
//! headers, and the model `capacity_bad_input_sender_header_poisoned` must see the peer take the
//! previous call's header as this call's (an assertion, not a causality violation).
//! Shrink mode's mutants are not orderings either, and only the `shrink_*` models kill them:
//! `gpu_no_agreement` (each block goes on with its own verdict; `shrink_*two_blocks_agree_at_the_timeout_edge`:
//! the blocks of a rank disagree), `gpu_masked_peer_waited` (the receive ignores the mask;
//! `shrink_masked_peer_signals_ignored`: a masked peer's entries are read) and
//! `gpu_clean_keeps_signals` (the clean leaves the signal and ack words; `shrink_unmask_with_clean`:
//! a call-1 signal is taken for call 2's, a causality violation).
//!
//! # What the model found in the kernels
//! Checked against the kernels after the device-API change (u64 epochs, tagged signals, input
//! and peer-data checks on the device, the NCCL stage split) and again after issue 11's speed
//! work (the pre-loaded ack, the one-pass routing check, the one-rank path, per-expert over
//! NCCL, capacity-mode NCCL sizes). No ordering is missing.
//! Observations:
//! - The `.release` of the signal stores (batched dispatch "`st_release(p, sig_bat(tab[d]) +
//!   rank, signal_word(epoch, ...))`", per-expert "`st_release(p, sig_pe(tab[d], R) + ...`") and
//!   of the ack stores (`finish:` of both, "`st_release(p, sig_bat_ack(tab[s], R) + rank, (u64)
//!   epoch)`" / `sig_pe_ack`) is redundant: the same thread has just run `fence.acq_rel` (the
//!   `fence_rel(p)` after the `ST_SENT` count, the one before per-expert's signal, the one in
//!   common.cuh `last_block_out`), which makes a relaxed store a release pattern. Harmless; kept
//!   as belt and braces.
//! - Batched dispatch's ack wait moved (issue 11): thread `32 + d` issues its first `ld_acquire`
//!   of `sig_bat_ack(me, R) + d` (`ack0`) at kernel start, before `s_epoch` is read and before
//!   the routing checks, and calls `wait_ack` only after `in_bad` is known and only if
//!   "`ack0 < epoch - 1ull`". That is the same protocol: `ack0` is an acquire load, and a value
//!   `>= epoch - 1` is a release store of the destination's last block out that happened after
//!   its reads of call `epoch - 1` (acks only grow); nothing is written to a destination before
//!   the `__syncthreads_or(wbad)` that follows, whatever thread acquired. The model now does the
//!   same (`preload_acks`, then `sender_wait_acks` skips an ack already seen); per-expert
//!   dispatch still waits in threads `tid < R` after `load_topk`, without a pre-load.
//! - In per-expert dispatch a block that owns several experts writes the second expert's
//!   messages after the first expert's `fence_rel` (before its signal), so only the first
//!   expert's writes rely on `wait_ack`'s acquire alone (the consecutive-calls model rewrites
//!   exactly those).
//! - Tags: `sig_tag` (common.cuh) wraps between epochs 2^40 - 2 (tag 2^40 - 1) and
//!   2^40 - 1 (tag 1); that is the only place where a stale tag is *larger* than the current
//!   one, so a receiver that compared with `>=` (as `wait_ack` rightly does for acks) would
//!   take the previous call's signal there and nowhere else. The `*_tag_wrap` models run two
//!   calls across it (mutant `gpu_tag_ge`). 2^40 - 1 -> 2^40 is tag 1 -> 2, no wrap.
//! - A rank whose routing or token count is bad (`in_bad`: batched "`__syncthreads_or(bad) |
//!   s_bad`", per-expert "`load_topk(...) | s_bad`") skips its ack waits ("`if (!in_bad &&
//!   acker && ...`"; its `ack0` load is left unused) and goes to `finish` in every block (each
//!   block checks the same routing), so it neither sends nor receives nor counts itself in
//!   `ST_SENT`; but its last block out still publishes the epoch and acks every source
//!   ("`if (last_out && p.stage != 1)`") for a call whose data it never read. That is sound: an
//!   ack only lets a source overwrite this rank's receive buffers, and the epochs stay in step,
//!   so a next call launched without a sync is exchanged correctly (model
//!   `bad_input_receiver_then_good_call`). Its peers see no signal: on the same device their
//!   waits stop on the error flag within 64 polls; on another device they run the whole
//!   `timeout_ns` and report a timeout there, which the host ranks after the input error
//!   (errors.rs `cause_first`: input, then peer data, then timeouts; `GpuGroup::check`). If the
//!   caller's routing changed while the launch ran, blocks could disagree on `in_bad` and the
//!   next item applies.
//! - A batched dispatch block whose `wait_ack` fails skips the send side ("`if
//!   (__syncthreads_or(wbad) || in_bad) goto finish;`" jumps over the `ST_SENT` `atomicAdd`). If
//!   only some blocks of a rank fail, the count is left non-zero and a later launch on the same
//!   state would signal before every block has written. The host's refusal of every call after
//!   an error (errors.rs `GpuGroup::check` sets `broken`; runtime/mod.rs `check_usable`, first
//!   thing in launch.rs `launch_inner` and `sync`) is what keeps this from happening: it is
//!   needed, not just prudent. Back to back `launch`es without a sync (benchmarks, graph
//!   replay) after an error give garbage until the next sync reports it.
//! - Shrink mode's agreement orders nothing: `agree_at` is a relaxed CAS (and the mask a
//!   relaxed `atomicExch`), so a block that ran out while another block's "arrived" was agreed
//!   has no happens-before with that block's acquire of the signal. What makes its reads safe
//!   is its own wait again ("Agreed "arrived" after this block ran out"), an acquire load of
//!   the same words: without it the block would read the entries unordered after their writes.
//!   That wait is bounded and reports a timeout when it runs out, which would need the store,
//!   already seen by a block of the same rank, to stay invisible for a whole timeout. loom's
//!   own progress rule (a load after a yield does not return again a value the thread saw
//!   before it, when a newer one exists) makes it succeed at its first poll in the models,
//!   which accept a reported timeout all the same; `shrink_*two_blocks_agree_at_the_timeout_edge`
//!   requires some interleaving where a block waited again and then read its entries.
//! - Shrink mode's "no ack to a masked peer" is read from the mask by the last block out
//!   ("`const u32 masked = masked_peers(p, me)`"), not from its own `gone`: a peer lost by
//!   another block is in it, because every block's `atomicExch` of the mask comes before that
//!   block's `last_block_out` fence and exit count, which the last block acquires. A peer that
//!   is masked here without knowing it (lost at the timeout's edge, or masked by the host)
//!   learns it at its next call's ack wait for this rank (every pair runs, count 0 too), which
//!   runs out and masks this rank in turn (model `shrink_masked_peer_signals_ignored`): the
//!   masks end up symmetric with no message of their own.
//! - NCCL transport, exact sizes (`NcclSizes::Exact`, not modelled): a rank with bad input also
//!   skips, in its pack stage (`p.stage` 1), the writes of `snd_hdr` and the staged batches, so
//!   what sits there is an earlier call's, valid-looking. launch.rs `nccl_dispatch_exchange`
//!   reads the error word ("`self.check()?;`") after the header exchange and `wait_streams_on`,
//!   before it reads the headers back to size the payload: no batch of the call is sent, and the
//!   peers' NCCL waits end at their bound instead of taking stale rows (not yet run on a GPU).
//! - NCCL transport, capacity sizes (`NcclSizes::Capacity`, modelled for batched dispatch):
//!   header and the whole T-entry region go in one grouped exchange with no host look. The
//!   host first sets every send-header word to `POISON_HDR` = i32::MAX (launch.rs
//!   `poison_send_headers`, in stream order before the pack kernel); a good pack stage
//!   overwrites it, a bad one leaves it; the peer's unpack (stage 2: "`c = ((const
//!   int*)me.rcv_hdr)[tid * HDR_WORDS(L)]`" instead of `wait_signal`) bounds it with
//!   `peer_bad(..., PF_BATCH_TOKENS, c, T)` and reports `ERR_PEER_DATA` instead of taking the
//!   previous call's header and rows (model `capacity_bad_input_sender_header_poisoned`, mutant
//!   `gpu_no_hdr_poison`). Not modelled there: the other header words (selections, rows per
//!   local expert: the same poison, bounded by `PF_SELECTIONS` / `PF_EXPERT_ROWS` after the
//!   token count already failed), the combine exchange, per-expert over NCCL (exact sizes only:
//!   `check_nccl_sizes`), and NCCL's own transfer, which the model treats as a rendezvous of
//!   both ranks' streams between the two stages.
//!
//! [`SharedRows`]: ep_reference::sync::SharedRows
//! [`Deadline`]: ep_reference::sync::Deadline

mod orderings;
mod shrink;
mod state;
mod waits;
mod words;

pub use shrink::{clean_mask, is_gone, mask_status, update_mask, DEC_ACK, DEC_RECV};
pub use state::{
    merged, payload, BlockReport, Entry, ErrorWord, Group, Input, Kind, Launch, Rank, Setup,
    WaitEnd,
};
pub use words::{
    sig_tag, signal_word, ERR_EXPERT_RANGE, ERR_PEER_DATA, ERR_TIMEOUT, PF_BATCH_TOKENS,
    PH_DISPATCH_RECV, PH_DISPATCH_SEND, ROW_BYTES, SIG_COUNT_BITS,
};

#[allow(unused_imports)]
use orderings::{
    fence_after_last_exit, fence_after_last_sent, fence_before_exit_add, fence_before_pe_signal,
    fence_before_sent_add, tag_matches, ACK_LOAD, ACK_STORE, RELAXED, SIGNAL_LOAD, SIGNAL_STORE,
};
#[allow(unused_imports)]
use shrink::{masked_peers, receive_skips, wait_peer_ack, wait_peer_signals, Peer};
#[allow(unused_imports)]
use state::{read_entry, write_entry};
#[allow(unused_imports)]
use waits::{failed, peer_bad, report_error, report_timeout, wait_ack, wait_signal};
#[allow(unused_imports)]
use words::{PF_PE_COUNT, SIG_COUNT_MASK};

#[allow(unused_imports)]
use std::time::Duration;

#[allow(unused_imports)]
use ep_reference::sync::{fence, AtomicU64, Deadline, Ordering, SharedRows};

// ---------------------------------------------------------------- the roles

/// Role: the start of every block (thread 0: "`s_epoch = ld_epoch(state, KIND) + 1ull`"): this call's epoch.
fn block_epoch(me: &Rank) -> u64 {
    // s_epoch = ld_epoch(state, KIND) + 1ull;
    // SAFETY: the only write is the previous launch's last block out (`finish`), which ended
    // before this launch started.
    let calls = unsafe {
        me.epoch
            .with_rows(0, 1, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    calls + 1
}

/// Role: the device-side input check (batched: the routing pass's `route` lambda and the
/// repeats loop; per-expert: common.cuh `load_topk(..., true)`): a bad index is reported before
/// anything is written. Returns `in_bad`.
fn input_check(g: &Group, kp: &Launch, rank: usize) -> bool {
    if kp.bad_input != Some(rank) {
        return false;
    }
    // report_error(p.err, ERR_EXPERT_RANGE, rank, token, slot, value, value >> 32, E);
    let e_n = (g.ranks.len() * g.setup.local_experts) as u32;
    report_error(
        g.err(rank),
        ERR_EXPERT_RANGE,
        [rank as u32, 0, 0, e_n, 0, e_n],
    );
    true
}

/// Role: batched dispatch's pre-load of every destination's ack, at kernel start, before the
/// epoch is read and before the routing checks (thread `32 + d`, `acker`: "`if (acker) ack0 =
/// ld_acquire(p, sig_bat_ack(me, R) + ackd)`"). Per-expert dispatch has none. Returns `ack0`
/// per destination, in `Group::dests` order.
fn preload_acks(g: &Group, rank: usize) -> Vec<u64> {
    g.dests(rank)
        .map(|d| g.ranks[rank].ack[d].load(ACK_LOAD))
        .collect()
}

/// Role: the sender of the next call waits for every destination's ack of the previous call
/// before it overwrites their buffers; skipped when the input is bad. Batched (`ack0` given):
/// thread `32 + d`, after the routing checks, "`if (!in_bad && acker && ack0 < epoch - 1ull)
/// wbad = !wait_ack(...)`", then "`if (__syncthreads_or(wbad) || in_bad) goto finish;`".
/// Per-expert (`ack0` none): threads `tid < R` after `load_topk`, "`if (!in_bad && tid < R &&
/// p.stage != 2 && !via_nccl(p, tid)) bad = !wait_ack(...)`".
/// Shrink mode (both kernels; `ack0` unused): a destination masked at the block's start
/// (`gone0`) is not waited for, the others with [`wait_peer_ack`]; one agreed lost joins `gone`
/// (batched "`if (r == PEER_LOST) atomicOr(&s_gone, 1u << ackd); else wbad = !r;`").
#[allow(clippy::too_many_arguments)]
fn sender_wait_acks(
    g: &Group,
    kp: &Launch,
    rank: usize,
    epoch: u64,
    ack0: Option<&[u64]>,
    gone0: u32,
    gone: &mut u32,
    rep: &mut BlockReport,
) -> Option<WaitEnd> {
    let mut bad = None;
    #[cfg(not(ep_mutant = "gpu_no_ack_wait"))]
    for (i, d) in g.dests(rank).enumerate() {
        // if (!in_bad && acker && p.shrink) { if (!is_gone(gone0, ackd)) { r = wait_peer_ack(...); ... } }
        if kp.shrink {
            if is_gone(gone0, d) {
                continue;
            }
            // wait_peer_ack(peer_wait(p, me, KIND, DEC_ACK, rank, ackd, PH_DISPATCH_SEND), sig_bat_ack(me, R) + ackd, epoch - 1ull, epoch)
            match wait_peer_ack(g, kp, rank, d, epoch - 1, epoch, rep) {
                Ok(Peer::Lost) => *gone |= 1 << d,
                Ok(Peer::Arrived(_)) => {}
                Err(e) => {
                    bad.get_or_insert(e);
                }
            }
            continue;
        }
        // ack0 < epoch - 1ull: the pre-load (an acquire) did not see the ack yet.
        if ack0.is_some_and(|a| a[i] >= epoch - 1) {
            continue;
        }
        // wait_ack(p, sig_bat_ack(me, R) + ackd, epoch - 1ull, epoch, rank, ackd, PH_DISPATCH_SEND)
        if let Err(e) = wait_ack(
            g,
            kp,
            &g.ranks[rank].ack[d],
            epoch - 1,
            epoch,
            rank,
            d,
            PH_DISPATCH_SEND,
        ) {
            bad.get_or_insert(e);
        }
    }
    #[cfg(ep_mutant = "gpu_no_ack_wait")]
    let _ = (g, kp, rank, epoch, ack0, gone0, gone, rep);
    bad
}

/// Role: a batched sender block writes its share of every batch, then counts itself out; the
/// block that completes the count stores every destination's signal with the call's tag
/// (batched dispatch, "`---- send`" under "`if (p.stage != 2 && !direct)`"). Nothing goes to
/// a destination in `gone` (shrink mode: masked, or lost at the ack wait): a masked one's
/// selections count as -1 in the routing, then "`mask &= ~gone`" and the signal's "`if
/// (!via_nccl(p, d) && !is_gone(gone, d))`".
#[allow(clippy::too_many_arguments)]
fn batched_send(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: u32,
) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    for d in g.dests(rank).filter(|&d| !is_gone(gone, d)) {
        let batch = g.batch(input, rank, d);
        // for (int u = u_first; u < n * segs; u += stride), u_first = bid * NWARPS + warp; u < n * segs; u += blocks_per_rank * NWARPS)
        for (pos, &t) in batch.iter().enumerate() {
            if t % me.blocks != bid {
                continue;
            }
            // entry = tab[d].bat_buf + ((u64)rank * T + sm.tokpos[t * R + d]) * p.entry_bytes;
            // seg_store(p, sg, xr, g * 512, entry + HDR_BYTES); ((int*)entry)[0] = t; (the header)
            write_entry(
                &g.ranks[d].buf,
                rank * t_n + pos,
                [t as u32, 0, 0, 0],
                payload(input.call, rank, t),
            );
        }
        counts.push((d, batch.len() as u32));
    }
    // __syncthreads(); if (tid == 0) { fence_rel(p);
    fence_before_sent_add();
    // const u32 old = atomicAdd(state + ST_SENT + KIND, 1u);
    let old = me.sent.fetch_add(1, RELAXED);
    // if (old == (u32)p.blocks_per_rank - 1u)
    if old as usize == me.blocks - 1 {
        // state[ST_SENT + KIND] = 0u;
        me.sent.store(0, RELAXED);
        // fence_rel(p);
        fence_after_last_sent();
        // if (rank != p.fault_rank) for (int d = 0; d < R; d++) if (!via_nccl(p, d))
        if kp.fault_rank != Some(rank) {
            for (d, count) in counts {
                // st_release(p, sig_bat(tab[d]) + rank, signal_word(epoch, (u32)sm.tot[d]));
                g.ranks[d].sig[rank].store(signal_word(epoch, count), SIGNAL_STORE);
            }
        }
    }
}

/// Role: a batched receiver block waits for every source's signal (acquire, bounded, stopped
/// by the error word), bounds the count, then reads its share of the entries
/// (batched dispatch, the block under "`if (p.stage != 1 && !direct)`"). Shrink mode: a source
/// in `gone` is not waited for, the others with [`wait_peer_signals`]; one agreed lost joins
/// `rep.gone` ("`atomicOr(&s_gone, 1u << tid); c = 0;`"): nothing of either is read.
fn batched_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: u32,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    // if (tid < R) (not via_nccl(p, tid): NVLink source)
    for s in g.sources(rank) {
        let got = if kp.shrink {
            // else if (p.shrink) c = is_gone(gone, tid) ? PEER_LOST : wait_peer_signals(..., sig_bat(me) + tid, 0, 1, 0, epoch);
            if receive_skips(gone, s) {
                Ok(Peer::Lost)
            } else {
                wait_peer_signals(g, kp, rank, s, &[s], 0, epoch, rep)
            }
        } else {
            // c = wait_signal(p, sig_bat(me) + tid, epoch, rank, tid, PH_DISPATCH_RECV);
            wait_signal(g, kp, &me.sig[s], epoch, rank, s, PH_DISPATCH_RECV).map(Peer::Arrived)
        };
        match got {
            // if (c == PEER_LOST) { atomicOr(&s_gone, 1u << tid); c = 0; }
            Ok(Peer::Lost) => rep.gone |= 1 << s,
            Ok(Peer::Arrived(c)) => {
                // bad = c < 0 || peer_bad(p, rank, tid, PF_BATCH_TOKENS, c, T);
                if peer_bad(g.err(rank), rank, s, PF_BATCH_TOKENS, c as i64, t_n as i64) {
                    rep.failed_wait.get_or_insert(WaitEnd::SawError);
                } else {
                    counts.push((s, c as usize));
                }
            }
            Err(e) => {
                rep.failed_wait.get_or_insert(e);
            }
        }
    }
    // if (__syncthreads_or(bad)) goto finish;
    if rep.failed_wait.is_some() {
        return;
    }
    // units u0 = bid * NWARPS + warp, u0 += nw (load_unit / store_unit): entry j of every source's
    // batch, one after the other (sm.rcnt), belongs to block j % blocks.
    let mut j = 0;
    for (s, c) in counts {
        for pos in 0..c {
            if j % me.blocks == bid {
                // load_unit: h = me.bat_buf + ((u64)s * T + j) * p.entry_bytes; loads of h
                let (header, payload) = read_entry(&me.buf, s * t_n + pos);
                rep.read.push(Entry {
                    src: s,
                    local: 0,
                    pos,
                    token: header[0] as u64,
                    payload,
                });
            }
            j += 1;
        }
    }
}

/// Role: a per-expert sender block writes one message per selection of each expert it owns,
/// stamped with the u64 epoch, and signals each expert itself (per-expert dispatch, "`---- send`").
/// Shrink mode: nothing goes to a destination in `gone` ("`if (is_gone(gone, d)) continue;`").
#[allow(clippy::too_many_arguments)]
fn per_expert_send(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: u32,
) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let dests: Vec<usize> = g.dests(rank).collect();
    // for (int e = bid; e < E && p.stage != 2; e += p.blocks_per_rank)
    for e in (bid..r_n * l_n).step_by(me.blocks) {
        // const int d = e / L, l = e % L;
        let (d, l) = (e / l_n, e % l_n);
        // if (is_gone(gone, d)) continue;  // block-uniform
        if !dests.contains(&d) || is_gone(gone, d) {
            continue;
        }
        let region = (l * r_n + rank) * t_n;
        let mut count = 0u32;
        for (t, sels) in input.route[rank].iter().enumerate() {
            if let Some(k) = sels.iter().position(|&sel| sel == (d, l)) {
                // entry = region + (u64)tt * p.pe_entry_bytes; seg_store(..., entry + PE_HDR);
                // header {(u32)epoch, tt, sm.m_b[m] (slot), (u32)(epoch >> 32)}
                write_entry(
                    &g.ranks[d].buf,
                    region + t,
                    [epoch as u32, t as u32, k as u32, (epoch >> 32) as u32],
                    payload(input.call, rank, t),
                );
                count += 1;
            }
        }
        // __syncthreads(); if (tid == 0 && rank != p.fault_rank && !nc)
        if kp.fault_rank != Some(rank) {
            // fence_rel(p);
            fence_before_pe_signal();
            // st_release(p, sig_pe(tab[d], R) + (u64)l * R + rank, signal_word(epoch, (u32)count));
            g.ranks[d].sig[l * r_n + rank].store(signal_word(epoch, count), SIGNAL_STORE);
        }
    }
}

/// Role: a per-expert receiver block, per local expert it owns and per source in order, waits
/// for the (l, s) signal, then finds this call's messages by their epoch stamp
/// (per-expert dispatch, "`---- receive`"). Shrink mode: a source in `gone` is not waited for,
/// the others with [`wait_peer_signals`] over all L of the source's words (`mine` = l: "arrived"
/// is proposed once every expert's signal is there); one agreed lost joins `rep.gone` and
/// counts 0 (`gone` itself is not refreshed in the loop, as in the kernel: the next wait for it
/// sees the mask).
fn per_expert_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: u32,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let sources: Vec<usize> = g.sources(rank).collect();
    // for (int l = bid; l < L && p.stage != 1; l += p.blocks_per_rank)
    for l in (bid..l_n).step_by(me.blocks) {
        for &s in &sources {
            let got = if kp.shrink {
                // else if (p.shrink) c = is_gone(gone, s) ? PEER_LOST : wait_peer_signals(..., sig_pe(me, R) + s, (u64)R, L, l, epoch);
                if receive_skips(gone, s) {
                    Ok(Peer::Lost)
                } else {
                    let words: Vec<usize> = (0..l_n).map(|i| i * r_n + s).collect();
                    wait_peer_signals(g, kp, rank, s, &words, l, epoch, rep)
                }
            } else {
                // tid 0: c = wait_signal(p, sig_pe(me, R) + (u64)l * R + s, epoch, rank, s, PH_DISPATCH_RECV);
                wait_signal(
                    g,
                    kp,
                    &me.sig[l * r_n + s],
                    epoch,
                    rank,
                    s,
                    PH_DISPATCH_RECV,
                )
                .map(Peer::Arrived)
            };
            // if (c == PEER_LOST) { atomicOr(&s_gone, 1u << s); c = 0; }
            // else if ((nc || c >= 0) && peer_bad(p, rank, s, PF_PE_COUNT, c, T)) c = -1;
            let got = got.and_then(|c| match c {
                Peer::Lost => {
                    rep.gone |= 1 << s;
                    Ok(0)
                }
                Peer::Arrived(c) => {
                    if peer_bad(g.err(rank), rank, s, PF_PE_COUNT, c as i64, t_n as i64) {
                        Err(WaitEnd::SawError)
                    } else {
                        Ok(c as usize)
                    }
                }
            });
            let cnt = match got {
                Ok(c) => c,
                // if (cnt < 0) goto finish;
                Err(e) => {
                    rep.failed_wait = Some(e);
                    return;
                }
            };
            let region = (l * r_n + s) * t_n;
            let mut found = 0;
            // for (int c = 0; c < T && base - begin < cnt; ...)
            for j in 0..t_n {
                if found >= cnt {
                    break;
                }
                // one 16-byte load of the header, hv = *(const uint4*)(region + ...);
                // has = hv.x == (u32)epoch && hv.w == (u32)(epoch >> 32)
                let (h, payload) = read_entry(&me.buf, region + j);
                if h[0] == epoch as u32 && h[3] == (epoch >> 32) as u32 {
                    rep.read.push(Entry {
                        src: s,
                        local: l,
                        pos: j,
                        token: h[1] as u64,
                        payload,
                    });
                    found += 1;
                }
            }
        }
    }
}

/// Role: the end of every block (common.cuh `last_block_out`); returns whether this
/// block is the last one out.
fn last_block_out(me: &Rank) -> bool {
    // __syncthreads(); if (threadIdx.x == 0) { fence_rel(p);
    fence_before_exit_add();
    // u32 old = atomicAdd(state + ST_EXIT + kind, 1u);
    let old = me.exit.fetch_add(1, RELAXED);
    // s_last = (old == (u32)p.blocks_per_rank - 1u);
    let last = old as usize == me.blocks - 1;
    if last {
        // state[ST_EXIT + kind] = 0u; fence_rel(p);
        me.exit.store(0, RELAXED);
        fence_after_last_exit();
    }
    last
}

/// Role: the last block out publishes the epoch and acknowledges to every source that this rank
/// consumed the call (`finish:` of both dispatch kernels). `stage` 0: the whole call; 1 (pack):
/// neither epoch nor acks ("`if (last_out && p.stage != 1)`"); 2 (unpack): the epoch, and no
/// ack to its sources, which the model's stage 2 only has over NCCL ("`if (!via_nccl(p, s))`").
/// Shrink mode: no ack to a source masked now (the mask read again by the last block out,
/// "`const u32 masked = masked_peers(p, me)`": masked before the call or lost in it).
fn finish(g: &Group, kp: &Launch, rank: usize, epoch: u64, rep: &mut BlockReport, stage: u8) {
    let me = &g.ranks[rank];
    rep.last_out = last_block_out(me);
    // if (last_out && p.stage != 1)
    if rep.last_out && stage != 1 {
        // ((u64*)state)[ST_EPOCH64 + KIND] = epoch;
        // SAFETY: every block of this launch read the word before its exit count, which the
        // last block out acquired (`last_block_out`); the next launch starts after this one.
        unsafe {
            me.epoch
                .with_row_mut(0, |b| b.copy_from_slice(&epoch.to_le_bytes()))
        };
        // const u32 masked = masked_peers(p, me);  // shrink: no ack to a masked peer
        let masked = masked_peers(kp, me);
        for s in g.sources(rank).filter(|_| stage == 0) {
            // if (!via_nccl(p, s) && !is_gone(masked, s)) st_release(p, sig_bat_ack(tab[s], R) + rank, (u64)epoch);
            if !is_gone(masked, s) {
                g.ranks[s].ack[rank].store(epoch, ACK_STORE);
            }
        }
    }
}

/// One block of one stage-0 dispatch launch, every role in kernel order (batched.cu
/// `ep_batched_dispatch` / per_expert.cu `ep_per_expert_dispatch`).
pub fn dispatch_block(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
) -> BlockReport {
    let me = &g.ranks[rank];
    // Batched: thread 32 + d's first ld_acquire of the ack, before anything else.
    let ack0 = (g.setup.kind == Kind::Batched).then(|| preload_acks(g, rank));
    let epoch = block_epoch(me);
    // s_gone = masked_peers(p, me); ... const u32 gone0 = s_gone;
    let gone0 = masked_peers(kp, me);
    let mut rep = BlockReport {
        epoch,
        gone: gone0,
        ..BlockReport::default()
    };
    // batched: in_bad = __syncthreads_or(bad) | s_bad; per-expert: load_topk(...) | s_bad
    rep.bad_input = input_check(g, kp, rank);
    // if (!in_bad && acker && ack0 < epoch - 1ull) wbad = !wait_ack(...) (per-expert: tid < R)
    let mut gone = gone0;
    if !rep.bad_input {
        rep.failed_wait = sender_wait_acks(
            g,
            kp,
            rank,
            epoch,
            ack0.as_deref(),
            gone0,
            &mut gone,
            &mut rep,
        );
    }
    // gone = s_gone;  // masked, or lost at the acknowledgement: nothing is sent there
    rep.gone = gone;
    // if (__syncthreads_or(wbad) || in_bad) goto finish; (per-expert: __syncthreads_or(bad))
    if !rep.bad_input && rep.failed_wait.is_none() {
        match g.setup.kind {
            Kind::Batched => {
                batched_send(g, kp, input, rank, bid, epoch, gone);
                batched_receive(g, kp, rank, bid, epoch, gone, &mut rep);
            }
            Kind::PerExpert => {
                per_expert_send(g, kp, input, rank, bid, epoch, gone);
                per_expert_receive(g, kp, rank, bid, epoch, gone, &mut rep);
            }
        }
    }
    finish(g, kp, rank, epoch, &mut rep, 0);
    rep
}

// ---------------------------------------------------------------- NCCL, capacity sizes (batched)

/// launch.rs `POISON_HDR`: what capacity mode writes into every send-header word before the
/// pack stage, a token count (i32::MAX) no peer accepts.
pub const POISON_HDR: u32 = i32::MAX as u32;

fn write_hdr(rows: &SharedRows, row: usize, v: u32) {
    // SAFETY: a header word is written by the host before the pack launch, by block 0 of the
    // pack launch, or by the exchange after it; the launches and the exchange are ordered by
    // the stream (the tests join them), and loom checks it through the row's cell.
    unsafe { rows.with_row_mut(row, |b| b.copy_from_slice(&v.to_le_bytes())) }
}

fn read_hdr(rows: &SharedRows, row: usize) -> u32 {
    // SAFETY: as `write_hdr`: reads are ordered after the writes by the stream.
    unsafe {
        rows.with_rows(row, 1, |b| {
            u32::from_le_bytes(b.try_into().expect("4 bytes"))
        })
    }
}

/// Host: launch.rs `poison_send_headers`, "`cuMemsetD32Async(self.ptrs[r].snd_hdr, POISON_HDR,
/// words, streams[di])`" in `nccl_call` before the pack stage of a capacity dispatch, in stream
/// order (the caller runs it before `rank`'s pack launch).
pub fn poison_send_headers(g: &Group, rank: usize) {
    #[cfg(not(ep_mutant = "gpu_no_hdr_poison"))]
    for d in 0..g.ranks.len() {
        write_hdr(&g.ranks[rank].snd_hdr, d, POISON_HDR);
    }
    // Mutant: no poisoning; a pack stage that stops on bad input leaves the previous call's
    // header, valid-looking, in `snd_hdr`.
    #[cfg(ep_mutant = "gpu_no_hdr_poison")]
    let _ = (g, rank);
}

/// One block of batched dispatch's pack stage (`p.stage` 1) with every destination over NCCL:
/// the same prologue as [`dispatch_block`] (no ack wait: `acker` is false for NCCL peers); on
/// good input its share of every batch into `snd_buf` ("`(u8*)me.snd_buf + ((u64)d * T +
/// sm.tokpos[t * R + d]) * p.entry_bytes`"), block 0 the header ("`meta = (int*)me.snd_hdr +
/// tid * HDR_WORDS(L)`", "`meta[0] = sm.tot[tid]`"), then the `ST_SENT` count with no signal
/// (`if (!via_nccl(p, d))`); on bad input straight to `finish`, which in stage 1 publishes
/// nothing.
pub fn batched_pack_block(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
) -> BlockReport {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let epoch = block_epoch(me);
    let mut rep = BlockReport {
        epoch,
        ..BlockReport::default()
    };
    rep.bad_input = input_check(g, kp, rank);
    // if (__syncthreads_or(wbad) || in_bad) goto finish;
    if !rep.bad_input {
        for d in g.dests(rank) {
            let batch = g.batch(input, rank, d);
            for (pos, &t) in batch.iter().enumerate() {
                if t % me.blocks == bid {
                    write_entry(
                        &me.snd_buf,
                        d * t_n + pos,
                        [t as u32, 0, 0, 0],
                        payload(input.call, rank, t),
                    );
                }
            }
            // if (bid == 0 && tid < R) { meta = snd_hdr + tid * HDR_WORDS(L); meta[0] = sm.tot[tid]; }
            if bid == 0 {
                write_hdr(&me.snd_hdr, d, batch.len() as u32);
            }
        }
        fence_before_sent_add();
        let old = me.sent.fetch_add(1, RELAXED);
        if old as usize == me.blocks - 1 {
            me.sent.store(0, RELAXED);
            fence_after_last_sent();
            // for (d ...) if (!via_nccl(p, d)) st_release(...): every destination is NCCL here.
        }
    }
    finish(g, kp, rank, epoch, &mut rep, 1);
    rep
}

/// Host and NCCL: launch.rs `nccl_dispatch_exchange` in capacity mode, one grouped exchange
/// per pair with no host look at the headers: `snd_hdr` row d of s into `rcv_hdr` row s of d,
/// and the whole T-entry region d of s's `snd_buf` into region s of d's `bat_buf`. Run after
/// every pack launch ended and before any unpack launch starts (NCCL's rendezvous, in stream
/// order on both sides).
pub fn nccl_capacity_exchange(g: &Group) {
    let t_n = g.setup.max_tokens;
    for &(s, d) in &g.setup.links {
        let (src, dst) = (&g.ranks[s], &g.ranks[d]);
        write_hdr(&dst.rcv_hdr, s, read_hdr(&src.snd_hdr, d));
        for j in 0..t_n {
            let (h, p) = read_entry(&src.snd_buf, d * t_n + j);
            write_entry(&dst.buf, s * t_n + j, h, p);
        }
    }
}

/// One block of batched dispatch's unpack stage (`p.stage` 2) with every source over NCCL: the
/// same prologue (the same routing, so the same `in_bad`), then per source the count from its
/// header instead of a signal ("`if (via_nccl(p, tid)) c = ((const int*)me.rcv_hdr)[tid *
/// HDR_WORDS(L)]`"), bounded ("`bad = c < 0 || peer_bad(p, rank, tid, PF_BATCH_TOKENS, c, T)`";
/// the header is an `int`: the poison is i32::MAX, past T), then its share of the entries;
/// `finish` publishes the epoch and acks no NCCL source.
pub fn batched_unpack_block(g: &Group, kp: &Launch, rank: usize, bid: usize) -> BlockReport {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let epoch = block_epoch(me);
    let mut rep = BlockReport {
        epoch,
        ..BlockReport::default()
    };
    rep.bad_input = input_check(g, kp, rank);
    if !rep.bad_input {
        let mut counts = Vec::new();
        for s in g.sources(rank) {
            let c = read_hdr(&me.rcv_hdr, s) as i32 as i64;
            if c < 0 || peer_bad(g.err(rank), rank, s, PF_BATCH_TOKENS, c, t_n as i64) {
                rep.failed_wait.get_or_insert(WaitEnd::SawError);
            } else {
                counts.push((s, c as usize));
            }
        }
        // if (__syncthreads_or(bad)) goto finish;
        if rep.failed_wait.is_none() {
            let mut j = 0;
            for (s, c) in counts {
                for pos in 0..c {
                    if j % me.blocks == bid {
                        let (header, payload) = read_entry(&me.buf, s * t_n + pos);
                        rep.read.push(Entry {
                            src: s,
                            local: 0,
                            pos,
                            token: header[0] as u64,
                            payload,
                        });
                    }
                    j += 1;
                }
            }
        }
    }
    finish(g, kp, rank, epoch, &mut rep, 2);
    rep
}

// ---------------------------------------------------------------- the host

/// A device error as the host decodes it (kernels/src/runtime/errors.rs `decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceError {
    Timeout {
        rank: u32,
        peer: u32,
        phase: u32,
        /// The whole u64 epoch: words 4 (low) and 6 (high).
        call: u64,
    },
    /// `ERR_EXPERT_RANGE`: this rank's routing was bad.
    BadInput { rank: u32 },
    /// `ERR_PEER_DATA`: the receiving rank, the peer, the field (`PF_*`) and its value.
    PeerData {
        rank: u32,
        peer: u32,
        field: u32,
        value: u32,
    },
}

/// The host side of kernels/src/runtime/ that the protocol relies on.
#[derive(Debug, Default)]
pub struct Host {
    broken: Option<DeviceError>,
}

impl Host {
    /// runtime/mod.rs `GpuGroup::check_usable`: a group that failed refuses every later
    /// call (the first thing in launch.rs `launch_inner` and `sync`).
    pub fn check_usable(&self) -> Result<(), DeviceError> {
        match self.broken {
            Some(t) => Err(t),
            None => Ok(()),
        }
    }

    /// launch.rs `GpuGroup::sync` then errors.rs `GpuGroup::check`, once the streams are
    /// synchronised (the caller joined every block of the launch): reads every device's error
    /// word; the first error, input errors, then peer data, then timeouts (`cause_first`),
    /// fails the group.
    pub fn sync(&mut self, g: &Group) -> Result<(), DeviceError> {
        self.check_usable()?;
        let mut found: Vec<DeviceError> = (0..g.devices.len())
            .filter_map(|dev| device_error(g, dev))
            .collect();
        // found.sort_by_key(cause_first);
        found.sort_by_key(cause_first);
        if let Some(&e) = found.first() {
            // self.broken = Some(e.clone());
            self.broken = Some(e);
            return Err(e);
        }
        Ok(())
    }
}

/// errors.rs `cause_first`: bad input is the cause, bad peer data next (a peer of a rank stopped
/// by bad input, over NCCL in capacity mode), timeouts (waits for the stopped rank) last.
fn cause_first(e: &DeviceError) -> u8 {
    match e {
        DeviceError::Timeout { .. } => 2,
        DeviceError::PeerData { .. } => 1,
        DeviceError::BadInput { .. } => 0,
    }
}

/// Device `dev`'s error word as errors.rs `decode` reads it (None: nothing reported). Call once
/// every block of the launches has ended (joined): the host copies the word after the stream
/// synchronised.
pub fn device_error(g: &Group, dev: usize) -> Option<DeviceError> {
    let e = &g.devices[dev];
    // cuMemcpyDtoH of err after the stream synchronised: ordered by the join.
    let code = e.code.load(RELAXED) as u32;
    if code == 0 {
        return None;
    }
    // SAFETY: every block of the launch ended (joined): no writer is left.
    let w: Vec<u32> = unsafe {
        e.fields.with_rows(0, 1, |b| {
            b.chunks(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        })
    };
    Some(match code {
        ERR_TIMEOUT => DeviceError::Timeout {
            rank: w[0],
            peer: w[1],
            phase: w[2],
            call: w[3] as u64 | (w[5] as u64) << 32,
        },
        ERR_EXPERT_RANGE => DeviceError::BadInput { rank: w[0] },
        _ => DeviceError::PeerData {
            rank: w[0],
            peer: w[1],
            field: w[2],
            value: w[3],
        },
    })
}

/// `rank`'s ack word of destination `d` (`sig_bat_ack(rank)[d]` / `sig_pe_ack`: the last call
/// `d` acknowledged to `rank`), read by the host once every block ended (the caller joined them).
pub fn ack_word(g: &Group, rank: usize, d: usize) -> u64 {
    g.ranks[rank].ack[d].load(RELAXED)
}

/// Entry `row` of `rank`'s receive buffer (`bat_buf` / `pe_buf`) as the host reads it once
/// every block ended (the caller joined them): its header words and payload.
pub fn entry_at(g: &Group, rank: usize, row: usize) -> ([u32; 4], u64) {
    read_entry(&g.ranks[rank].buf, row)
}

#[cfg(all(test, not(ep_loom)))]
mod tests {
    //! The model on std threads: not a proof (loom's tests are), but it shows the functions run
    //! the protocol end to end in the normal build.
    use super::*;
    use std::sync::Arc;
    use std::thread;

    fn two_calls(kind: Kind) {
        let setup = Setup {
            kind,
            ranks: vec![(0, 2), (1, 1)],
            links: vec![(0, 1)],
            max_tokens: 2,
            local_experts: 2,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_secs(10),
            fault_rank: None,
            bad_input: None,
            shrink: false,
        };
        let inputs: Vec<Input> = (1..=3)
            .map(|c| Input {
                call: c,
                route: vec![vec![vec![(1, 0)], vec![(1, 1)]], vec![]],
            })
            .collect();
        let rx = {
            let (g, inputs) = (g.clone(), inputs.clone());
            thread::spawn(move || {
                for input in &inputs {
                    let rep = dispatch_block(&g, &kp, input, 1, 0);
                    assert_eq!(rep.read, g.expected(input, 1), "call {}", input.call);
                    assert!(rep.last_out);
                }
            })
        };
        for input in &inputs {
            let b1 = {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, 0, 1))
            };
            let r0 = dispatch_block(&g, &kp, input, 0, 0);
            let r1 = b1.join().unwrap();
            assert_eq!(r0.epoch, input.call);
            assert!(r0.last_out ^ r1.last_out, "exactly one block is last out");
        }
        rx.join().unwrap();
    }

    #[test]
    fn batched_two_blocks_three_calls_std() {
        for _ in 0..50 {
            two_calls(Kind::Batched);
        }
    }

    #[test]
    fn per_expert_two_blocks_three_calls_std() {
        for _ in 0..50 {
            two_calls(Kind::PerExpert);
        }
    }

    #[test]
    fn fault_rank_times_out_and_the_host_refuses_the_next_call() {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (0, 2)],
            links: vec![(0, 1)],
            max_tokens: 1,
            local_experts: 1,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_millis(50),
            fault_rank: Some(0),
            bad_input: None,
            shrink: false,
        };
        let input = Input {
            call: 1,
            route: vec![vec![vec![(1, 0)]], vec![]],
        };
        let blocks: Vec<_> = [(0, 0), (1, 0), (1, 1)]
            .into_iter()
            .map(|(r, b)| {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, r, b))
            })
            .collect();
        let reps: Vec<BlockReport> = blocks.into_iter().map(|b| b.join().unwrap()).collect();
        assert!(reps[1].failed_wait.is_some() && reps[2].failed_wait.is_some());
        let mut host = Host::default();
        let want = DeviceError::Timeout {
            rank: 1,
            peer: 0,
            phase: PH_DISPATCH_RECV,
            call: 1,
        };
        assert_eq!(host.sync(&g), Err(want));
        assert_eq!(host.check_usable(), Err(want));
    }

    #[test]
    fn tags_are_never_zero_and_wrap_once_per_2_40_minus_1_calls() {
        let m = (1u64 << 40) - 1;
        assert_eq!(sig_tag(0), 1);
        assert_eq!(sig_tag(1), 2);
        assert_eq!(sig_tag(m - 1), m, "the largest tag");
        assert_eq!(sig_tag(m), 1, "the wrap");
        assert_eq!(sig_tag(m + 1), 2);
        assert_eq!(sig_tag(u64::MAX), u64::MAX % m + 1);
        for e in [1, m - 1, m, m + 1, u64::MAX] {
            assert_ne!(sig_tag(e), 0);
            assert_ne!(sig_tag(e), sig_tag(e - 1), "consecutive calls differ");
        }
        let w = signal_word(m - 1, 5);
        assert_eq!(
            (w >> SIG_COUNT_BITS, w & SIG_COUNT_MASK),
            (m, 5),
            "tag fills the top 40 bits"
        );
    }

    #[test]
    fn bad_input_rank_skips_its_sends_acks_and_the_host_names_it() {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (1, 1)],
            links: vec![(0, 1)],
            max_tokens: 1,
            local_experts: 1,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_millis(50),
            fault_rank: None,
            bad_input: Some(1),
            shrink: false,
        };
        let input = Input {
            call: 1,
            route: vec![vec![vec![(1, 0)]], vec![]],
        };
        let blocks: Vec<_> = [0, 1]
            .into_iter()
            .map(|r| {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, r, 0))
            })
            .collect();
        let reps: Vec<BlockReport> = blocks.into_iter().map(|b| b.join().unwrap()).collect();
        assert!(reps[1].bad_input && reps[1].read.is_empty() && reps[1].last_out);
        assert_eq!(
            g.ranks[0].ack[1].load(RELAXED),
            1,
            "the bad rank acks call 1"
        );
        let mut host = Host::default();
        assert_eq!(host.sync(&g), Err(DeviceError::BadInput { rank: 1 }));
        assert_eq!(host.check_usable(), Err(DeviceError::BadInput { rank: 1 }));
    }

    #[test]
    fn shrink_lost_rank_is_masked_not_reported_and_clean_takes_it_back() {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (1, 2)],
            links: vec![(0, 1)],
            max_tokens: 2,
            local_experts: 1,
        };
        let g = Arc::new(Group::new(setup));
        let input = |call| Input {
            call,
            route: vec![vec![vec![(1, 0)], vec![(1, 0)]], vec![]],
        };
        let run = |kp: Launch, input: &Input| -> Vec<BlockReport> {
            let blocks: Vec<_> = [(0, 0), (1, 0), (1, 1)]
                .into_iter()
                .map(|(r, b)| {
                    let (g, input) = (g.clone(), input.clone());
                    thread::spawn(move || dispatch_block(&g, &kp, &input, r, b))
                })
                .collect();
            blocks.into_iter().map(|b| b.join().unwrap()).collect()
        };
        // Call 1: rank 0 never signals; rank 1's blocks run out and agree that it is lost.
        let lossy = Launch {
            timeout: Duration::from_millis(50),
            fault_rank: Some(0),
            bad_input: None,
            shrink: true,
        };
        let reps = run(lossy, &input(1));
        for r in &reps[1..] {
            assert_eq!((r.gone, r.failed_wait), (0b01, None));
            assert!(r.read.is_empty());
        }
        assert_eq!(Host::default().sync(&g), Ok(()), "a lost peer is no error");
        assert_eq!(mask_status(&g, 1), [true, false]);
        assert_eq!(ack_word(&g, 0, 1), 0, "no ack to a masked peer");
        // Every rank cleans; call 2 starts from epoch 0 again and takes rank 0 back.
        clean_mask(&g);
        let good = Launch {
            timeout: Duration::from_secs(10),
            fault_rank: None,
            ..lossy
        };
        let c2 = input(2);
        let reps = run(good, &c2);
        for r in &reps {
            assert_eq!((r.epoch, r.gone, r.failed_wait), (1, 0, None));
        }
        assert_eq!(merged(&reps[1..]), g.expected(&c2, 1));
        assert_eq!(ack_word(&g, 0, 1), 1);
    }

    /// One capacity-mode call, blocks one after the other (the loom model runs them at once).
    fn capacity_call(g: &Group, kp: &Launch, input: &Input) -> Vec<BlockReport> {
        for r in 0..g.ranks.len() {
            poison_send_headers(g, r);
        }
        for r in 0..g.ranks.len() {
            batched_pack_block(g, kp, input, r, 0);
        }
        nccl_capacity_exchange(g);
        (0..g.ranks.len())
            .map(|r| batched_unpack_block(g, kp, r, 0))
            .collect()
    }

    #[test]
    fn capacity_poisoned_header_of_a_bad_sender_is_rejected_by_the_peer() {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (1, 1)],
            links: vec![(0, 1)],
            max_tokens: 2,
            local_experts: 1,
        };
        let g = Group::new(setup);
        let kp = Launch {
            timeout: Duration::from_secs(10),
            fault_rank: None,
            bad_input: None,
            shrink: false,
        };
        let c1 = Input {
            call: 1,
            route: vec![vec![vec![(1, 0)], vec![(1, 0)]], vec![]],
        };
        let rx = capacity_call(&g, &kp, &c1);
        assert_eq!(merged(&rx[1..]), g.expected(&c1, 1));
        let c2 = Input { call: 2, ..c1 };
        let bad = Launch {
            bad_input: Some(0),
            ..kp
        };
        let rx = capacity_call(&g, &bad, &c2);
        assert!(rx[1].read.is_empty(), "stale rows taken: {:?}", rx[1].read);
        assert_eq!(
            device_error(&g, 1),
            Some(DeviceError::PeerData {
                rank: 1,
                peer: 0,
                field: PF_BATCH_TOKENS,
                value: POISON_HDR
            })
        );
        assert_eq!(
            Host::default().sync(&g),
            Err(DeviceError::BadInput { rank: 0 })
        );
    }
}
