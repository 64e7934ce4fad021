//! Per-expert combine on rank `rank`: every expert row goes back to its token's rank on its own;
//! the token's rank reduces in the contract's order.

use super::{wait_credits, Shared};
use crate::error::{Error, Op, Result, Side};
use crate::numerics::bf16::from_f32_rne;
use crate::numerics::reduce::fma_bf16_row;
use crate::output::Handle;
use crate::payload::bf16_bytes;
use crate::sync::Deadline;
use crate::transport::CallStats;
use half::bf16;

pub(super) fn run(
    sh: &Shared,
    rank: usize,
    epoch: u64,
    timeout: std::time::Duration,
    y: &[bf16],
    topk_weights: &[f32],
    handle: &Handle,
) -> Result<(Vec<bf16>, CallStats)> {
    let cfg = &sh.cfg;
    let (r, e_n, l_n, h, k) = (
        cfg.num_ranks,
        cfg.num_experts,
        cfg.num_local_experts(),
        cfg.hidden,
        cfg.top_k,
    );
    let per = cfg.rows_per_expert();
    let deadline = Deadline::after(timeout);
    let mut stats = CallStats::default();

    // Send every received row of every local expert back to its token's rank, at the token's
    // index in the (destination, expert) region.
    wait_credits(&sh.combine_credit, rank, epoch, &deadline, Op::Combine)?;
    for l in 0..l_n {
        let e = rank * l_n + l;
        for s in 0..r {
            let (begin, count) = handle.range(l, s);
            let region = &sh.combine[s * e_n + e];
            for row in begin..begin + count {
                let t = handle.src_info[l * per + row] as usize;
                let src = bf16_bytes(&y[(l * per + row) * h..(l * per + row + 1) * h]);
                // SAFETY: this rank alone writes region (s, e); the credit wait ordered the
                // previous call's reads before this write; s reads after our signal.
                unsafe { region.rows.with_row_mut(t, |m| m.copy_from_slice(src)) };
                stats.messages += 1;
                stats.wire_bytes += 2 * h as u64;
            }
            region.signal.post(epoch, count as u32);
            stats.signals += 1;
        }
    }

    // Receive one signal per global expert, then reduce in slot order with one fma each.
    for e in 0..e_n {
        if sh.combine[rank * e_n + e]
            .signal
            .wait(epoch, &deadline)
            .is_none()
        {
            return Err(Error::timeout(
                rank,
                e / l_n,
                Op::Combine,
                Side::Recv,
                epoch,
                &deadline,
            ));
        }
    }
    let n = handle.num_tokens();
    let mut out = vec![bf16::ZERO; n * h];
    let mut acc = vec![0f32; h];
    for t in 0..n {
        acc.fill(0.0);
        for slot in 0..k {
            let e = handle.topk_idx[t * k + slot];
            if e < 0 {
                continue;
            }
            let w = topk_weights[t * k + slot];
            let region = &sh.combine[rank * e_n + e as usize];
            // SAFETY: the signal wait above acquired the expert rank's release post, which
            // followed its write of this row; it is not rewritten before our credit below.
            unsafe {
                region
                    .rows
                    .with_rows(t, 1, |row| fma_bf16_row(&mut acc, w, row));
            }
        }
        for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = from_f32_rne(*a);
        }
    }
    sh.combine_credit.grant_all(rank, epoch);
    Ok((out, stats))
}
