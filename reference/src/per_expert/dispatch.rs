//! Per-expert dispatch on rank `src`: one message per selection, one signal per expert.

use super::{wait_credits, Shared, MESSAGE_META_BYTES};
use crate::error::{Error, Op, Result, Side};
use crate::output::DispatchOutput;
use crate::payload::Encoder;
use crate::sync::Deadline;
use crate::transport::CallStats;
use half::bf16;

#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    sh: &Shared,
    rank: usize,
    epoch: u64,
    timeout: std::time::Duration,
    n: usize,
    x: &[bf16],
    topk_idx: &[i64],
    out: &mut DispatchOutput,
) -> Result<CallStats> {
    let cfg = &sh.cfg;
    let (r, e_n, l_n, h, k) = (
        cfg.num_ranks,
        cfg.num_experts,
        cfg.num_local_experts(),
        cfg.hidden,
        cfg.top_k,
    );
    let deadline = Deadline::after(timeout);
    let mut stats = CallStats::default();

    // Send. The credits say every destination finished reading our previous call's messages.
    wait_credits(&sh.dispatch_credit, rank, epoch, &deadline, Op::Dispatch)?;
    let mut enc = Encoder::new(cfg);
    let mut payload = vec![0u8; cfg.payload_bytes()];
    let mut sent = vec![0usize; e_n];
    let msg_bytes = MESSAGE_META_BYTES + payload.len();
    for t in 0..n {
        enc.encode(&x[t * h..(t + 1) * h], &mut payload);
        for &e in topk_idx[t * k..(t + 1) * k].iter().filter(|&&e| e >= 0) {
            let e = e as usize;
            let (d, l) = (e / l_n, e % l_n);
            let region = &sh.dispatch[(d * l_n + l) * r + rank];
            // SAFETY: this rank is the only writer of region (d, l, rank); the credit wait above
            // ordered the receiver's reads of the previous call before this write, and the
            // receiver reads it only after the signal posted below.
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
        sh.dispatch[(d * l_n + l) * r + rank]
            .signal
            .post(epoch, count as u32);
        stats.signals += 1;
    }

    // Receive: R signals per local expert, then pack canonically (source, then token order).
    let mut counts = vec![0usize; l_n * r];
    for l in 0..l_n {
        for s in 0..r {
            let region = &sh.dispatch[(rank * l_n + l) * r + s];
            counts[l * r + s] = region.signal.wait(epoch, &deadline).ok_or_else(|| {
                Error::timeout(rank, s, Op::Dispatch, Side::Recv, epoch, &deadline)
            })? as usize;
        }
    }
    out.set_layout(&counts);
    for l in 0..l_n {
        for s in 0..r {
            let (begin, count) = out.range(l, s);
            let region = &sh.dispatch[(rank * l_n + l) * r + s];
            // SAFETY: the acquire in `wait` above synchronized with the sender's release post,
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
