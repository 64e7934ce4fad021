//! Per-expert dispatch's (per_expert.cu `ep_per_expert::dispatch`) send and receive: one
//! message per selection, stamped with the epoch, and one signal per expert; then the receive's
//! wait per (local expert, source) and its search for this call's messages by their stamp.

use crate::gpu_protocol::gone::Gone;
use crate::gpu_protocol::orderings::{fence_before_pe_signal, SIGNAL_STORE};
use crate::gpu_protocol::peers::{is_gone, PeerSet};
use crate::gpu_protocol::shrink::{receive_skips, wait_peer_signals, Peer};
use crate::gpu_protocol::state::{
    payload, read_entry, write_entry, BlockReport, Entry, Group, Input, Launch, WaitEnd, STALE,
};
use crate::gpu_protocol::waits::{peer_bad, report_timeout, wait_signal};
use crate::gpu_protocol::words::{signal_word, PF_PE_COUNT, PH_DISPATCH_RECV};

/// Role: a per-expert sender block writes one message per selection of each expert it owns,
/// stamped with the u64 epoch, and signals each expert itself (per-expert dispatch, "`---- send`").
/// Shrink mode: nothing goes to a destination in `gone` ("`if (is_gone(gone, d)) continue;`").
#[allow(clippy::too_many_arguments)]
pub(crate) fn per_expert_send(
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
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let dests: Vec<usize> = g.dests(rank).collect();
    // A failed group's data (reached only by mutant gpu_no_failed_check): marked STALE.
    let mark = if stale { STALE } else { 0 };
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
                    payload(input.call, rank, t) | mark,
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
/// is proposed once every expert's signal is there); one agreed lost joins the block's live set
/// (`GONE_ADD(s)`) and counts 0 (`gone` itself is not refreshed in the loop, as in the kernel:
/// the next wait for it sees the mask).
#[allow(clippy::too_many_arguments)]
pub(crate) fn per_expert_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u64,
    gone: PeerSet,
    set: &mut Gone<'_>,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let sources: Vec<usize> = g.sources(rank).collect();
    // for (int l = bid; l < L && p.stage != 1; l += p.blocks_per_rank)
    for l in (bid..l_n).step_by(me.blocks) {
        for &s in &sources {
            if kp.fail_receive == Some(rank) {
                // The model's certain failure: this wait ran out (report_timeout, cnt < 0).
                report_timeout(g.err(rank), rank, s, PH_DISPATCH_RECV, epoch, 0);
                rep.failed_wait = Some(WaitEnd::TimedOut);
                return;
            }
            let got = if kp.shrink {
                // else if (SHRINK(p)) got = is_gone(c.gone, s) ? PEER_LOST : wait_peer_signals(..., sig_pe(me, R) + s, (u64)R, L, l, epoch);
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
            // if (got == PEER_LOST) { GONE_ADD(s); got = 0; }
            // else if ((nc || c >= 0) && peer_bad(p, rank, s, PF_PE_COUNT, c, T)) c = -1;
            let got = got.and_then(|c| match c {
                Peer::Lost => {
                    set.add(s);
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
                // if (cnt < 0) return;
                Err(e) => {
                    rep.failed_wait = Some(e);
                    return;
                }
            };
            let region = (l * r_n + s) * t_n;
            let mut found = 0;
            // for (int c0 = 0; c0 < T && base - begin < cnt; ...)
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
