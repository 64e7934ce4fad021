//! Batched dispatch's (batched_dispatch.cu `ep_batched::dispatch`) send and receive over NVLink / peer
//! memory: a block's share of every batch, the count of blocks out and the signal of the block
//! that completes it; then the receive's waits for every source and its share of the entries.

use crate::gpu_protocol::gone::{Gone, OR_RECEIVE};
use crate::gpu_protocol::orderings::{RELAXED, SENT_ADD, SIGNAL_STORE};
use crate::gpu_protocol::peers::{is_gone, PeerSet};
use crate::gpu_protocol::shrink::{receive_skips, wait_peer_signals, Peer};
use crate::gpu_protocol::state::{
    payload, read_entry, write_entry, BlockReport, Entry, Group, Input, Launch, WaitEnd, STALE,
};
use crate::gpu_protocol::waits::{
    peer_bad, preload_takes, report_timeout, wait_signal, wait_signal_pre,
};
use crate::gpu_protocol::words::{signal_word, PF_BATCH_TOKENS, PH_DISPATCH_RECV};

/// Role: a batched sender block writes its share of every batch, then counts itself out; the
/// block that completes the count stores every destination's signal with the call's tag
/// (batched dispatch, "`---- send`" under "`if (p.stage != 2 && !direct)`"). Nothing goes to
/// a destination in `gone` (shrink mode: masked, or lost at the ack wait): a masked one's
/// selections count as -1 in the routing, then "`mask &= ~gone`" and the signal's "`if
/// (!via_nccl(p, d) && !is_gone(gone, d))`".
#[allow(clippy::too_many_arguments)]
pub(crate) fn batched_send(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: PeerSet,
    stale: bool,
) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    // A failed group's data (reached only by mutant gpu_no_failed_check): marked STALE.
    let mark = if stale { STALE } else { 0 };
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
                payload(input.call, rank, t) | mark,
            );
        }
        counts.push((d, batch.len() as u32));
    }
    // __syncthreads(); if (tid == 0) {
    // if (count_in(p, c.state + ST_SENT + KIND, 1u) == (u32)p.blocks_per_rank - 1u)
    let old = me.sent.fetch_add(1, SENT_ADD);
    if old as usize == me.blocks - 1 {
        // if (rank != p.fault_rank) for (int d = 0; d < R; d++) if (!via_nccl(p, d))
        if kp.fault_rank != Some(rank) {
            for (d, count) in counts {
                // st_release(p, sig_bat(tab[d]) + rank, signal_word(epoch, (u32)sm.tot[d]));
                g.ranks[d].sig[rank].store(signal_word(epoch, count), SIGNAL_STORE);
            }
        }
        // c.state[ST_SENT + KIND] = 0u;
        me.sent.store(0, RELAXED);
    }
}

/// Role: a batched receiver block waits for every source's signal (acquire, bounded, stopped
/// by the error word), bounds the count, then reads its share of the entries
/// (batched dispatch, the block under "`if (p.stage != 1 && !direct)`": stage 0, and the
/// receive half of the receive hook's split). Shrink mode: a source in `gone` is not waited
/// for, the others with [`wait_peer_signals`]; one agreed lost joins the block's live set
/// (`GONE_ADD(tid); cnt = 0;`): nothing of either is read. Then the
/// `__syncthreads_or(bad)` and, if no wait failed, the snapshot that the expansion reads
/// (`GONE_SNAPSHOT(gone)`), which becomes `rep.gone`. `sig0`: the receive half's (stage 2)
/// pre-loaded signal words (`presig_of`, hook.rs `preload_signals`), in `Group::sources` order,
/// each waited for with [`wait_signal_pre`]; `None` in stage 0 and in shrink mode.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batched_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: PeerSet,
    sig0: Option<&[u64]>,
    set: &mut Gone<'_>,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    // if (tid < R) (not via_nccl(p, tid): NVLink source)
    for (i, s) in g.sources(rank).enumerate() {
        if kp.fail_receive == Some(rank) {
            // The model's certain failure: this wait ran out (report_timeout, return -1).
            report_timeout(g.err(rank), rank, s, PH_DISPATCH_RECV, epoch, 0);
            rep.failed_wait.get_or_insert(WaitEnd::TimedOut);
            break;
        }
        let got = if kp.shrink {
            // else if (SHRINK(p)) cnt = is_gone(c.gone, tid) ? PEER_LOST : wait_peer_signals(..., sig_bat(me) + tid, 0, 1, 0, epoch);
            if receive_skips(gone, s) {
                Ok(Peer::Lost)
            } else {
                wait_peer_signals(g, kp, rank, s, &[s], 0, epoch, rep)
            }
        } else if let Some(sig0) = sig0 {
            // (what the model reports of it: which way wait_signal_pre went)
            if preload_takes(sig0[i], epoch) {
                rep.preload_taken = true;
            } else {
                rep.preload_stale = true;
            }
            // else c = presig ? wait_signal_pre(p, sig_bat(me) + tid, sig0, epoch, rank, tid, PH_DISPATCH_RECV)
            wait_signal_pre(g, kp, &me.sig[s], sig0[i], epoch, rank, s, PH_DISPATCH_RECV)
                .map(Peer::Arrived)
        } else {
            //                 : wait_signal(p, sig_bat(me) + tid, epoch, rank, tid, PH_DISPATCH_RECV);
            wait_signal(g, kp, &me.sig[s], epoch, rank, s, PH_DISPATCH_RECV).map(Peer::Arrived)
        };
        match got {
            // if (cnt == PEER_LOST) { GONE_ADD(tid); cnt = 0; }
            Ok(Peer::Lost) => set.add(s),
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
    // return !__syncthreads_or(bad);  (receive_signals)
    if set.sync_or(OR_RECEIVE, rep.failed_wait.is_some()) {
        rep.gone = set.live();
        return;
    }
    // GONE_SNAPSHOT(gone);  // + the sources lost in this call: their counts below are 0
    rep.gone = set.snapshot();
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
