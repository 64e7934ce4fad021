//! Per-expert combine on rank `rank`: every expert row goes back to its token's rank on its own;
//! the token's rank reduces in the contract's order.

use crate::config::CombineFormat;
use crate::error::{Result, Side};
use crate::mask::RankMask;
use crate::numerics::bf16::from_f32_rne;
use crate::numerics::logfmt_wire;
use crate::numerics::reduce::fma_bf16_row;
use crate::output::Handle;
use crate::payload::bf16_bytes;
use crate::per_expert::shared::{wait_credits, Shared};
use crate::sync::Deadline;
use crate::transport::{CallStats, Waiter};
use half::bf16;

/// Runs call `w.call` of rank `w.rank` with the rows in `format`; `skip` as in `dispatch::run`
/// (it starts with the handle's mask as well as the mask when the call started).
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    sh: &Shared,
    w: Waiter,
    timeout: std::time::Duration,
    y: &[bf16],
    topk_weights: &[f32],
    handle: &Handle,
    skip: &mut RankMask,
    format: CombineFormat,
) -> Result<(Vec<bf16>, CallStats)> {
    let cfg = &sh.cfg;
    let (rank, epoch) = (w.rank, w.call);
    let (r, e_n, l_n, h, k) = (
        cfg.num_ranks,
        cfg.num_experts,
        cfg.num_local_experts(),
        cfg.hidden,
        cfg.top_k,
    );
    let per = cfg.rows_per_expert();
    let mut deadline = Deadline::after(timeout);
    let mut stats = CallStats::default();

    // Send every received row of every local expert back to its token's rank, at the token's
    // index in the (destination, expert) region; nothing to a masked rank.
    wait_credits(&sh.combine_credit, &sh.mask, w, &mut deadline, skip)?;
    for l in 0..l_n {
        let e = rank * l_n + l;
        for s in 0..r {
            if skip.is_masked(s) {
                continue;
            }
            let (begin, count) = handle.range(l, s);
            let region = &sh.combine[s * e_n + e];
            for row in begin..begin + count {
                let t = handle.src_info[l * per + row] as usize;
                let src = &y[(l * per + row) * h..(l * per + row + 1) * h];
                // SAFETY: this rank alone writes region (s, e); the credit wait ordered the
                // previous call's reads before this write (s is not masked); s reads after our
                // signal.
                let bytes = unsafe {
                    region.rows.with_row_mut(t, |m| match format {
                        CombineFormat::Bf16 => {
                            m[..2 * h].copy_from_slice(bf16_bytes(src));
                            2 * h
                        }
                        CombineFormat::LogFmt => logfmt_wire::encode_row(src, m),
                    })
                };
                stats.messages += 1;
                stats.wire_bytes += bytes as u64;
            }
            region.signal.post(epoch, count as u32);
            stats.signals += 1;
        }
    }

    // Receive one signal per global expert, a rank's L experts whole or not at all (masked, or
    // given up in shrink mode), then reduce in slot order with one fma each, skipping the
    // slots of masked ranks' experts.
    for q in 0..r {
        if skip.is_masked(q) {
            continue;
        }
        for e in q * l_n..(q + 1) * l_n {
            let signal = &sh.combine[rank * e_n + e].signal;
            if sh
                .mask
                .wait(w, q, Side::Recv, &mut deadline, || signal.poll(epoch))?
                .is_none()
            {
                skip.set(q, true);
                break;
            }
        }
    }
    let routing = skip.apply(cfg, rank, &handle.topk_idx);
    let n = handle.num_tokens();
    let mut out = vec![bf16::ZERO; n * h];
    let mut acc = vec![0f32; h];
    for t in 0..n {
        acc.fill(0.0);
        for slot in 0..k {
            let e = routing[t * k + slot];
            if e < 0 {
                continue;
            }
            let w = topk_weights[t * k + slot];
            let region = &sh.combine[rank * e_n + e as usize];
            // SAFETY: the signal poll above acquired the expert rank's release post, which
            // followed its write of this row (its rank is not masked: the masked routing names
            // none of its experts); it is not rewritten before our credit below.
            unsafe {
                region.rows.with_rows(t, 1, |row| match format {
                    CombineFormat::Bf16 => fma_bf16_row(&mut acc, w, &row[..2 * h]),
                    CombineFormat::LogFmt => logfmt_wire::fma_row(&mut acc, w, row),
                });
            }
        }
        for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = from_f32_rne(*a);
        }
    }
    sh.combine_credit.grant_all(rank, epoch);
    Ok((out, stats))
}
