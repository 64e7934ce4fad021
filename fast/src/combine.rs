//! Batched combine: the experts' rank packs, per destination, every row bound there into one
//! contiguous batch (local expert ascending, then the dispatch layout's row order, i.e. token
//! order) with one signal; the tokens' rank finds each row from its own routing and reduces in
//! the contract's order.

use ep_reference::error::{Error, Op, Phase, Side};
use ep_reference::numerics::logfmt_wire;
use ep_reference::numerics::reduce::fma_bf16_row;
use ep_reference::payload::bf16_bytes;
use ep_reference::sync::{Arc, Deadline};
use ep_reference::transport::Waiter;
use ep_reference::{bf16, bf16_from_f32, CallStats, CombineFormat, Handle, RankMask, Result};

use crate::shared::Shared;

/// One rank's combine call in flight. `stage` may run on several threads at once.
pub struct CombineCall<'a> {
    sh: Arc<Shared>,
    w: Waiter,
    rank: usize,
    epoch: u64,
    y: &'a [bf16],
    topk_weights: &'a [f32],
    handle: &'a Handle,
    format: CombineFormat,
    /// Per destination s: (local expert, first row in the layout, rows, offset in the batch).
    segments: Vec<Vec<(usize, usize, usize, usize)>>,
    totals: Vec<usize>,
    /// The ranks this call neither writes to nor waits for: those of the handle's mask, those
    /// masked when it started, and those masked while it waited for their credits.
    skip: RankMask,
    /// This rank was masked (in its dispatch, or when this call started): it sends nothing,
    /// waits for nobody, and its output is undefined.
    masked: bool,
    deadline: Deadline,
}

impl<'a> CombineCall<'a> {
    pub(crate) fn begin(
        sh: Arc<Shared>,
        w: Waiter,
        mut deadline: Deadline,
        y: &'a [bf16],
        topk_weights: &'a [f32],
        handle: &'a Handle,
        format: CombineFormat,
    ) -> Result<CombineCall<'a>> {
        let cfg = sh.cfg;
        let (r, l_n, rank) = (cfg.num_ranks, cfg.num_local_experts(), w.rank);
        sh.mask.begin_call(rank, Op::Combine, w.call);
        // The dispatch's mask as well as today's: never wait for rows it did not send.
        let mut skip = handle.mask.clone();
        skip.union_with(&sh.mask.snapshot());
        let masked = skip.is_masked(rank);
        if !masked {
            crate::shared::open_call(
                &sh,
                &sh.combine_credit,
                &sh.combine_finish[rank * r..(rank + 1) * r],
                w,
                &mut deadline,
                &mut skip,
            )?;
        }
        let mut segments = vec![Vec::new(); r];
        let mut totals = vec![0usize; r];
        for (s, segs) in segments.iter_mut().enumerate() {
            if masked || skip.is_masked(s) {
                continue;
            }
            for l in 0..l_n {
                let (begin, count) = handle.range(l, s);
                if count > 0 {
                    segs.push((l, begin, count, totals[s]));
                    totals[s] += count;
                }
            }
        }
        Ok(CombineCall {
            sh,
            w,
            rank,
            epoch: w.call,
            y,
            topk_weights,
            handle,
            format,
            segments,
            totals,
            skip,
            masked,
            deadline,
        })
    }

    pub fn workers(&self) -> usize {
        self.sh.opts.staging_workers
    }

    /// Worker `worker` of `workers`: copies its share of the segments into the destinations'
    /// batches, counts (worker 0), then signals the destinations `s % workers == worker`.
    pub fn stage(&self, worker: usize, workers: usize) -> Result<()> {
        let sh = &*self.sh;
        let cfg = &sh.cfg;
        let (r, h) = (cfg.num_ranks, cfg.hidden);
        let per = cfg.rows_per_expert();
        let finish = &sh.combine_finish[self.rank * r..(self.rank + 1) * r];
        sh.maybe_panic(self.rank, worker);
        if self.masked {
            return Ok(());
        }
        let all = self
            .segments
            .iter()
            .enumerate()
            .flat_map(|(s, segs)| segs.iter().map(move |seg| (s, seg)));
        for (s, &(l, begin, count, offset)) in all.skip(worker).step_by(workers) {
            let region = &sh.combine[s * r + self.rank];
            for i in 0..count {
                let row = l * per + begin + i;
                let src = &self.y[row * h..(row + 1) * h];
                // SAFETY: batch row offset + i of region (s, rank) is this segment's alone and
                // the segment is this worker's alone; `begin` acquired s's credit for the
                // previous call (s is not masked: masked ranks have no segments); s reads
                // after our signal, which follows the finish counter.
                unsafe {
                    region.rows.with_row_mut(offset + i, |m| match self.format {
                        CombineFormat::Bf16 => m[..2 * h].copy_from_slice(bf16_bytes(src)),
                        CombineFormat::LogFmt => {
                            logfmt_wire::encode_row(src, m);
                        }
                    })
                };
            }
            finish[s].staged(count as u64);
        }
        if worker == 0 {
            for (f, &total) in finish.iter().zip(&self.totals) {
                f.counted(total as u64);
            }
        }
        for s in (worker..r).step_by(workers) {
            let total = finish[s].wait_done(&self.deadline).ok_or_else(|| {
                Error::timeout(
                    self.rank,
                    self.rank,
                    Op::Combine,
                    Side::Send,
                    self.epoch,
                    &self.deadline,
                )
            })?;
            if !self.skip.is_masked(s) {
                sh.combine[s * r + self.rank]
                    .signal
                    .post(self.epoch, total as u32);
            }
        }
        Ok(())
    }

    /// Waits for every experts' rank's batch and reduces this rank's tokens.
    pub fn receive(&self) -> Result<Vec<bf16>> {
        let sh = &*self.sh;
        let cfg = &sh.cfg;
        let (r, e_n, l_n, h, k) = (
            cfg.num_ranks,
            cfg.num_experts,
            cfg.num_local_experts(),
            cfg.hidden,
            cfg.top_k,
        );
        let n = self.handle.num_tokens();
        if self.masked {
            sh.combine_credit.grant_all(self.rank, self.epoch);
            return Ok(vec![bf16::ZERO; n * h]);
        }
        // Wait for every experts' rank not masked; one masked, or given up in shrink mode,
        // while we waited sends nothing we read.
        let mut skip = self.skip.clone();
        let mut got = vec![0usize; r];
        let mut deadline = self.deadline;
        for (d, g) in got.iter_mut().enumerate() {
            if skip.is_masked(d) {
                continue;
            }
            let signal = &sh.combine[self.rank * r + d].signal;
            match sh.mask.wait(self.w, d, Side::Recv, &mut deadline, || {
                signal.poll(self.epoch)
            })? {
                Some(c) => *g = c as usize,
                None => skip.set(d, true),
            }
        }
        // The routing without the masked ranks' experts. Where each (token, slot) row sits in
        // its batch: rows of expert e from this rank are in token order, after the rows of the
        // same rank's lower local experts.
        let topk = &skip.apply(cfg, self.rank, &self.handle.topk_idx);
        let mut per_expert = vec![0usize; e_n];
        let mut row_of = vec![usize::MAX; topk.len()];
        for (i, &e) in topk.iter().enumerate() {
            if e >= 0 {
                row_of[i] = per_expert[e as usize];
                per_expert[e as usize] += 1;
            }
        }
        let mut offset = vec![0usize; e_n];
        let mut expected = vec![0usize; r];
        for e in 0..e_n {
            offset[e] = expected[e / l_n];
            expected[e / l_n] += per_expert[e];
        }
        for (d, &want) in expected.iter().enumerate() {
            if skip.is_masked(d) {
                continue;
            }
            let got = got[d];
            if got != want {
                return Err(Error::PeerMismatch {
                    rank: self.rank,
                    peer: d,
                    phase: Phase {
                        op: Op::Combine,
                        side: Side::Recv,
                    },
                    call: self.epoch,
                    expected: want,
                    got,
                });
            }
        }
        let mut out = vec![bf16::ZERO; n * h];
        let mut acc = vec![0f32; h];
        for t in 0..n {
            acc.fill(0.0);
            for slot in 0..k {
                let i = t * k + slot;
                let e = topk[i];
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let w = self.topk_weights[i];
                let region = &sh.combine[self.rank * r + e / l_n];
                // SAFETY: the signal's acquire above synchronized with the experts' rank's
                // release post, which followed every write of its batch (its rank is not
                // masked: the masked routing names none of its experts); it is not rewritten
                // before our credit below.
                unsafe {
                    region
                        .rows
                        .with_rows(offset[e] + row_of[i], 1, |row| match self.format {
                            CombineFormat::Bf16 => fma_bf16_row(&mut acc, w, &row[..2 * h]),
                            CombineFormat::LogFmt => logfmt_wire::fma_row(&mut acc, w, row),
                        });
                }
            }
            for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                *o = bf16_from_f32(*a);
            }
        }
        sh.combine_credit.grant_all(self.rank, self.epoch);
        Ok(out)
    }

    /// The bytes this call's rows take on the wire: 2H a row as bf16, each row's encoded
    /// size as LogFMT.
    fn wire_bytes(&self) -> u64 {
        let h = self.sh.cfg.hidden;
        match self.format {
            CombineFormat::Bf16 => self.totals.iter().map(|&c| (c * 2 * h) as u64).sum(),
            CombineFormat::LogFmt => {
                let per = self.sh.cfg.rows_per_expert();
                let rows = self
                    .segments
                    .iter()
                    .flatten()
                    .flat_map(|&(l, begin, count, _)| {
                        (begin..begin + count).map(move |i| l * per + i)
                    });
                rows.map(|row| logfmt_wire::row_bytes(&self.y[row * h..(row + 1) * h]) as u64)
                    .sum()
            }
        }
    }

    /// Ends the call after every worker returned (see `DispatchCall::end`).
    pub fn end(self, res: Result<Vec<bf16>>) -> (CallStats, Result<Vec<bf16>>) {
        let sh = &*self.sh;
        let r = sh.cfg.num_ranks;
        for f in &sh.combine_finish[self.rank * r..(self.rank + 1) * r] {
            f.reset();
        }
        let signals = if self.masked {
            0
        } else {
            (0..r).filter(|&s| !self.skip.is_masked(s)).count() as u64
        };
        let stats = CallStats {
            messages: self.totals.iter().filter(|&&c| c > 0).count() as u64,
            signals,
            wire_bytes: self.wire_bytes(),
        };
        if res.is_err() {
            sh.combine_credit.grant_all(self.rank, self.epoch);
        }
        (stats, res)
    }
}
