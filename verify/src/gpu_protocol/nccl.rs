//! The NCCL transport with capacity sizes (batched dispatch; the module docs' "Launches"): the
//! host's poisoning of the send headers, the pack stage, the grouped exchange (a rendezvous of
//! both ranks' streams) and the unpack stage, which bounds the peer's header instead of waiting
//! for a signal.

use ep_reference::sync::SharedRows;

use crate::gpu_protocol::block::{block_start, finish, input_check, Stage};
use crate::gpu_protocol::orderings::{RELAXED, SENT_ADD};
use crate::gpu_protocol::state::{
    payload, read_entry, write_entry, BlockReport, Entry, Group, Input, Launch, WaitEnd, STALE,
};
use crate::gpu_protocol::waits::{peer_bad, report_peer_failed};
use crate::gpu_protocol::words::{PF_BATCH_TOKENS, PH_DISPATCH_RECV};

/// runtime/nccl/plan.rs `POISON_HDR`: what capacity mode writes into every send-header word before the
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

/// Host: nccl/call.rs `poison_send_headers`, "`driver::memset_d32_async(dev.ptrs.snd_hdr,
/// POISON_HDR, words, streams[di])`" in `Link::call` before the pack stage of a capacity
/// dispatch, in stream order (the caller runs it before `rank`'s pack launch).
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
/// the same prologue as [`dispatch_block`] (no ack wait: `a.waits` is false for NCCL peers); on
/// good input its share of every batch into `snd_buf` ("`(u8*)me.snd_buf + ((u64)d * T +
/// sm.tokpos[t * R + d]) * p.entry_bytes`"), block 0 the header ("`meta = (int*)me.snd_hdr +
/// tid * HDR_WORDS(L)`", "`meta[0] = sm.tot[tid]`"), then the `ST_SENT` count with no signal
/// (`if (!via_nccl(p, d))`); on bad input straight to the end (`frame_end`), which in stage 1 publishes
/// nothing.
///
/// [`dispatch_block`]: crate::gpu_protocol::dispatch_block
pub fn batched_pack_block(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
) -> BlockReport {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    // s_fail = p.refused || failed(p); s_epoch = ld_epoch(state, KIND) + 1ull;
    let (failed_before, mut rep) = block_start(g, rank);
    let epoch = rep.epoch;
    rep.bad_input = input_check(g, kp, rank);
    // if (s_fail || in_bad) { poison_peers(...) (no NCCL peer: its header keeps the host's
    // poison); return false; }
    rep.poisoned = rep.failed_start || rep.bad_input;
    // A failed group's data (reached only by mutant gpu_no_failed_check): marked STALE.
    let mark = if failed_before { STALE } else { 0 };
    if !rep.poisoned {
        for d in g.dests(rank) {
            let batch = g.batch(input, rank, d);
            for (pos, &t) in batch.iter().enumerate() {
                if t % me.blocks == bid {
                    write_entry(
                        &me.snd_buf,
                        d * t_n + pos,
                        [t as u32, 0, 0, 0],
                        payload(input.call, rank, t) | mark,
                    );
                }
            }
            // if (bid == 0 && tid < R) { meta = snd_hdr + tid * HDR_WORDS(L); meta[0] = sm.tot[tid]; }
            if bid == 0 {
                write_hdr(&me.snd_hdr, d, batch.len() as u32);
            }
        }
        // if (count_in(p, c.state + ST_SENT + KIND, 1u) == (u32)p.blocks_per_rank - 1u)
        let old = me.sent.fetch_add(1, SENT_ADD);
        if old as usize == me.blocks - 1 {
            // for (d ...) if (!via_nccl(p, d)) st_release(...): every destination is NCCL here.
            me.sent.store(0, RELAXED);
        }
    }
    finish(g, kp, rank, epoch, &mut rep, Stage::NCCL_PACK);
    rep
}

/// Host and NCCL: nccl/call.rs `dispatch_exchange` in capacity mode, one grouped exchange
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
/// prologue with `s_fail` and no routing ("`if (STAGE == 2) { if (s_fail<KIND>) return; }`":
/// its pack stage checked the routing, and raised the error word on bad input), then per
/// source the count from its header instead of a signal ("`if (via_nccl(p, tid)) c = ((const
/// int*)me.rcv_hdr)[tid * HDR_WORDS(L)]`"), bounded ("`bad = c < 0 || peer_bad(p, rank, tid,
/// PF_BATCH_TOKENS, c, T)`"; the header is an `int`: the poison is i32::MAX, past T), then its
/// share of the entries; `frame_end` writes a failed call's outputs, publishes the epoch and
/// acks no NCCL source.
pub fn batched_unpack_block(g: &Group, kp: &Launch, rank: usize, bid: usize) -> BlockReport {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    // s_fail = p.refused || failed(p); s_epoch = ld_epoch(state, KIND) + 1ull;
    let (_, mut rep) = block_start(g, rank);
    let epoch = rep.epoch;
    // if (STAGE == 2) { if (s_fail<KIND>) return; }
    if !rep.failed_start {
        let mut counts = Vec::new();
        for s in g.sources(rank) {
            let c = read_hdr(&me.rcv_hdr, s) as i32 as i64;
            // if (c == HDR_POISON) { report_peer_failed(p, rank, tid, PH_DISPATCH_RECV, epoch); c = -1; }
            if c == POISON_HDR as i64 {
                report_peer_failed(g.err(rank), rank, s, PH_DISPATCH_RECV, epoch);
                rep.failed_wait.get_or_insert(WaitEnd::PeerFailed);
            } else if c < 0 || peer_bad(g.err(rank), rank, s, PF_BATCH_TOKENS, c, t_n as i64) {
                rep.failed_wait.get_or_insert(WaitEnd::SawError);
            } else {
                counts.push((s, c as usize));
            }
        }
        // return !__syncthreads_or(bad);  (receive_signals)
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
    finish(g, kp, rank, epoch, &mut rep, Stage::NCCL_UNPACK);
    rep
}
