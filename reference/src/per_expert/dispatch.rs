//! Per-expert dispatch on rank `src`: one message per selection, one signal per expert.

use crate::error::{Result, Side};
use crate::mask::RankMask;
use crate::output::DispatchOutput;
use crate::payload::Encoder;
use crate::per_expert::shared::{wait_credits, Shared, MESSAGE_META_BYTES};
use crate::sync::Deadline;
use crate::transport::{CallStats, Waiter};
use half::bf16;

/// Runs call `w.call` of rank `w.rank`. `skip` holds the ranks masked when the call started
/// (the caller has checked that `w.rank` is not among them); it gets every rank the call went
/// on without (masked, or given up in shrink mode while it waited).
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    sh: &Shared,
    w: Waiter,
    timeout: std::time::Duration,
    n: usize,
    x: &[bf16],
    topk_idx: &[i64],
    skip: &mut RankMask,
    out: &mut DispatchOutput,
) -> Result<CallStats> {
    let cfg = &sh.cfg;
    let (rank, epoch) = (w.rank, w.call);
    let (r, e_n, l_n, h, k) = (
        cfg.num_ranks,
        cfg.num_experts,
        cfg.num_local_experts(),
        cfg.hidden,
        cfg.top_k,
    );
    let mut deadline = Deadline::after(timeout);
    let mut stats = CallStats::default();

    // Send. The credits say every destination finished reading our previous call's messages;
    // a masked destination's is not waited for, and nothing is written into its regions.
    wait_credits(&sh.dispatch_credit, &sh.mask, w, &mut deadline, skip)?;
    let routing = skip.apply(cfg, rank, topk_idx);
    let mut enc = Encoder::new(cfg);
    let mut payload = vec![0u8; cfg.payload_bytes()];
    let mut sent = vec![0usize; e_n];
    let msg_bytes = MESSAGE_META_BYTES + payload.len();
    for t in 0..n {
        let mut encoded = false;
        for &e in routing[t * k..(t + 1) * k].iter().filter(|&&e| e >= 0) {
            if !encoded {
                enc.encode(&x[t * h..(t + 1) * h], &mut payload);
                encoded = true;
            }
            let e = e as usize;
            let (d, l) = (e / l_n, e % l_n);
            let region = &sh.dispatch[(d * l_n + l) * r + rank];
            // SAFETY: this rank is the only writer of region (d, l, rank); the credit wait above
            // ordered the receiver's reads of the previous call before this write (d is not
            // masked: the masked routing names none of its experts), and the receiver reads it
            // only after the signal posted below.
            unsafe {
                region.rows.with_row_mut(sent[e], |m| {
                    m[..4].copy_from_slice(&(t as i32).to_le_bytes());
                    m[MESSAGE_META_BYTES..].copy_from_slice(&payload);
                });
            }
            sent[e] += 1;
            stats.messages += 1;
            stats.wire_bytes += msg_bytes as u64;
        }
    }
    for (e, &count) in sent.iter().enumerate() {
        let (d, l) = (e / l_n, e % l_n);
        if skip.is_masked(d) {
            continue;
        }
        sh.dispatch[(d * l_n + l) * r + rank]
            .signal
            .post(epoch, count as u32);
        stats.signals += 1;
    }

    // Receive: R signals per local expert, then pack canonically (source, then token order).
    // A source is taken whole or not at all: all its L signals, or none of its rows (masked,
    // or given up in shrink mode), so its rows are never read for some experts only.
    let mut counts = vec![0usize; l_n * r];
    for s in 0..r {
        if skip.is_masked(s) {
            continue;
        }
        for l in 0..l_n {
            let signal = &sh.dispatch[(rank * l_n + l) * r + s].signal;
            match sh
                .mask
                .wait(w, s, Side::Recv, &mut deadline, || signal.poll(epoch))?
            {
                Some(c) => counts[l * r + s] = c as usize,
                None => {
                    skip.set(s, true);
                    break;
                }
            }
        }
        if skip.is_masked(s) {
            for l in 0..l_n {
                counts[l * r + s] = 0;
            }
        }
    }
    out.set_layout(&counts);
    for l in 0..l_n {
        for s in 0..r {
            let (begin, count) = out.range(l, s);
            if count == 0 {
                continue;
            }
            let region = &sh.dispatch[(rank * l_n + l) * r + s];
            // SAFETY: the acquire in `poll` above synchronized with the sender's release post,
            // which followed all its writes of these rows; the sender writes them again only
            // after our credit, granted below once we are done.
            unsafe {
                region.rows.with_rows(0, count, |bytes| {
                    for (i, m) in bytes.chunks_exact(region.rows.row_bytes()).enumerate() {
                        let src = i32::from_le_bytes([m[0], m[1], m[2], m[3]]) as usize;
                        out.write_row(l, begin + i, src, &m[MESSAGE_META_BYTES..]);
                    }
                });
            }
        }
    }
    sh.dispatch_credit.grant_all(rank, epoch);
    Ok(stats)
}
