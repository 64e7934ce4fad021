//! Batched dispatch: stage each token once per destination straight into the destination's
//! batch region, let the finish counter tell the sender when the batch is whole, post one signal
//! per (source, destination); the receiver expands every batch into the canonical layout.

use ep_reference::error::{Error, Op, Side};
use ep_reference::payload::Encoder;
use ep_reference::sync::{Arc, Deadline};
use ep_reference::transport::Waiter;
use ep_reference::{bf16, CallStats, DispatchOutput, Handle, RankMask, Result};

use crate::batch::{self, Plan};
use crate::shared::Shared;

/// One rank's dispatch call in flight. `stage` may run on several threads at once.
pub struct DispatchCall<'a> {
    sh: Arc<Shared>,
    w: Waiter,
    rank: usize,
    epoch: u64,
    x: &'a [bf16],
    topk_idx: &'a [i64],
    plan: Plan,
    /// The ranks this call neither writes to nor waits for: masked when it started, or while
    /// it waited for their credits.
    skip: RankMask,
    /// This rank was masked when the call started: it sends nothing, waits for nobody, and
    /// its outputs are undefined.
    masked: bool,
    deadline: Deadline,
}

impl<'a> DispatchCall<'a> {
    pub(crate) fn begin(
        sh: Arc<Shared>,
        w: Waiter,
        mut deadline: Deadline,
        x: &'a [bf16],
        topk_idx: &'a [i64],
    ) -> Result<DispatchCall<'a>> {
        let cfg = sh.cfg;
        let (r, rank) = (cfg.num_ranks, w.rank);
        sh.mask.begin_call(rank, Op::Dispatch, w.call);
        let mut skip = sh.mask.snapshot();
        let masked = skip.is_masked(rank);
        let plan = if masked {
            Plan::build(&cfg, &[])
        } else {
            // Staging writes straight into the destinations' regions: each must have finished
            // reading our previous batch (the credit's acquire orders those reads first).
            crate::shared::open_call(
                &sh,
                &sh.dispatch_credit,
                &sh.dispatch_finish[rank * r..(rank + 1) * r],
                w,
                &mut deadline,
                &mut skip,
            )?;
            // Nothing for a masked destination: its credit was not waited for.
            #[cfg(not(ep_mutant = "masked_peer_written"))]
            let plan = Plan::build(&cfg, &skip.apply(&cfg, rank, topk_idx));
            // Mutant for the loom self-check: a masked destination's credit is skipped, but
            // its batch is still staged into its region, which it may still be reading.
            #[cfg(ep_mutant = "masked_peer_written")]
            let plan = Plan::build(&cfg, topk_idx);
            plan
        };
        Ok(DispatchCall {
            sh,
            w,
            rank,
            epoch: w.call,
            x,
            topk_idx,
            plan,
            skip,
            masked,
            deadline,
        })
    }

    pub fn workers(&self) -> usize {
        self.sh.opts.staging_workers
    }

    /// Worker `worker` of `workers`: stages its share of the tokens, counts (worker 0), then
    /// sends the batches of destinations `d % workers == worker` once they are whole.
    pub fn stage(&self, worker: usize, workers: usize) -> Result<()> {
        let sh = &*self.sh;
        let cfg = &sh.cfg;
        let (r, h) = (cfg.num_ranks, cfg.hidden);
        let n = self.plan.routes.len();
        let (lo, hi) = (n * worker / workers, n * (worker + 1) / workers);
        let meta = batch::meta_bytes(cfg);
        let mut enc = Encoder::new(cfg);
        let finish = &sh.dispatch_finish[self.rank * r..(self.rank + 1) * r];
        sh.maybe_panic(self.rank, worker);
        if self.masked {
            return Ok(());
        }
        for t in lo..hi {
            let routes = &self.plan.routes[t];
            if routes.is_empty() {
                continue;
            }
            // Quantize once per token, into the first destination's entry; the others copy it.
            let mut first: Option<(usize, usize)> = None;
            for (d, pos, locals) in routes {
                let region = &sh.dispatch[d * r + self.rank];
                // SAFETY: entry `pos` of region (d, rank) belongs to token t alone (the plan
                // gives every token its own position) and to this worker alone (tokens are
                // split between workers); `begin` acquired d's credit for the previous call (d
                // is not masked: the plan names no masked destination); d reads it only after
                // our signal, which follows this write's release below.
                unsafe {
                    region.rows.with_row_mut(*pos, |entry| {
                        batch::write_meta(&mut entry[..meta], t, locals);
                        match first {
                            None => enc.encode(&self.x[t * h..(t + 1) * h], &mut entry[meta..]),
                            Some((d0, p0)) => {
                                sh.dispatch[d0 * r + self.rank]
                                    .rows
                                    .with_rows(p0, 1, |src| {
                                        entry[meta..].copy_from_slice(&src[meta..])
                                    })
                            }
                        }
                    });
                }
                first.get_or_insert((*d, *pos));
                finish[*d].staged(1);
            }
        }
        if worker == 0 {
            for (f, &count) in finish.iter().zip(&self.plan.counts) {
                f.counted(count as u64);
            }
        }
        for d in (worker..r).step_by(workers) {
            let count = finish[d].wait_done(&self.deadline).ok_or_else(|| {
                Error::timeout(
                    self.rank,
                    self.rank,
                    Op::Dispatch,
                    Side::Send,
                    self.epoch,
                    &self.deadline,
                )
            })?;
            if !self.skip.is_masked(d) {
                sh.dispatch[d * r + self.rank]
                    .signal
                    .post(self.epoch, count as u32);
            }
        }
        Ok(())
    }

    /// Waits for every source's batch and expands them into the canonical layout in `out`
    /// (made for this config).
    pub fn receive(&self, out: &mut DispatchOutput) -> Result<()> {
        let sh = &*self.sh;
        let cfg = &sh.cfg;
        let (r, l_n) = (cfg.num_ranks, cfg.num_local_experts());
        let meta = batch::meta_bytes(cfg);
        let mut counts = vec![0usize; r];
        if self.masked {
            out.set_layout(&vec![0; l_n * r]);
            sh.dispatch_credit.grant_all(self.rank, self.epoch);
            return Ok(());
        }
        // Not from a masked source (its count stays 0), nor from one masked, or given up in
        // shrink mode, while we waited.
        let mut deadline = self.deadline;
        for (s, c) in counts.iter_mut().enumerate() {
            if self.skip.is_masked(s) {
                continue;
            }
            let signal = &sh.dispatch[self.rank * r + s].signal;
            let got = sh.mask.wait(self.w, s, Side::Recv, &mut deadline, || {
                signal.poll(self.epoch)
            })?;
            *c = got.unwrap_or(0) as usize;
        }
        // Rows per (local expert, source), from the batches' metadata.
        let mut per = vec![0usize; l_n * r];
        for (s, &c) in counts.iter().enumerate() {
            let region = &sh.dispatch[self.rank * r + s];
            // SAFETY: the signal's acquire above synchronized with the sender's release post
            // (a source without one has a count of 0: none of its entries is read),
            // which followed every staged write of these entries (finish counter); the sender
            // rewrites them only after our credit, granted below.
            unsafe {
                region.rows.with_rows(0, c, |bytes| {
                    for entry in bytes.chunks_exact(region.rows.row_bytes()) {
                        for l in batch::read_meta(&entry[..meta]).1 {
                            per[l * r + s] += 1;
                        }
                    }
                });
            }
        }
        out.set_layout(&per);
        for (s, &c) in counts.iter().enumerate() {
            let region = &sh.dispatch[self.rank * r + s];
            let mut next: Vec<usize> = (0..l_n).map(|l| out.range(l, s).0).collect();
            // SAFETY: as above.
            unsafe {
                region.rows.with_rows(0, c, |bytes| {
                    for entry in bytes.chunks_exact(region.rows.row_bytes()) {
                        let (t, locals) = batch::read_meta(&entry[..meta]);
                        for l in locals {
                            out.write_row(l, next[l], t, &entry[meta..]);
                            next[l] += 1;
                        }
                    }
                });
            }
        }
        sh.dispatch_credit.grant_all(self.rank, self.epoch);
        Ok(())
    }

    /// Ends the call after every worker returned: resets the finish counters, gives up the call
    /// on error (granting credits so peers can go on), and builds the handle.
    pub fn end(self, res: Result<()>, out: &DispatchOutput) -> (CallStats, Result<Handle>) {
        let sh = &*self.sh;
        let r = sh.cfg.num_ranks;
        for f in &sh.dispatch_finish[self.rank * r..(self.rank + 1) * r] {
            f.reset();
        }
        let entry = batch::entry_bytes(&sh.cfg) as u64;
        let signals = if self.masked {
            0
        } else {
            (0..r).filter(|&d| !self.skip.is_masked(d)).count() as u64
        };
        let stats = CallStats {
            messages: self.plan.counts.iter().filter(|&&c| c > 0).count() as u64,
            signals,
            wire_bytes: self.plan.counts.iter().map(|&c| c as u64 * entry).sum(),
        };
        match res {
            Ok(()) => {
                // The ranks this dispatch went on without, and those masked by its end: its
                // combine treats them all as masked.
                let mut mask = self.skip.clone();
                mask.union_with(&sh.mask.snapshot());
                let handle = Handle::new(sh.group_id, self.rank, self.topk_idx, out);
                (stats, Ok(handle.with_mask(mask)))
            }
            Err(e) => {
                sh.dispatch_credit.grant_all(self.rank, self.epoch);
                (stats, Err(e))
            }
        }
    }
}
