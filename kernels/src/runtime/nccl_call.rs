//! The NCCL call logic of a group: one call (or half of one) over NCCL as pack stage, grouped
//! send/recv and unpack stage; capacity mode's header poison; the exchanges of dispatch and
//! combine, built from the message plan (`nccl::plan`) and run in NCCL-sized groups
//! (`nccl::rounds`); the bounded host waits on the streams (NCCL receives are not bounded on
//! the device: past the group's timeout the communicators are aborted and the group refuses
//! later calls). These are `GpuGroup` methods, so they sit beside `group.rs` rather than in
//! `nccl/`, which `group.rs` uses (`Comms`): the layering check refuses that circle.
use crate::error::{cuda, GpuError};
use crate::runtime::driver;
use crate::runtime::group::{kind, GpuGroup};
use crate::runtime::layout::{combine_capacity_rows, prod, IoTable};
use crate::runtime::nccl::{
    by_expert_chunks, combine_ops, dispatch_headers, dispatch_payload, experts_per_group, P2p,
    Sizing, Tagged, POISON_HDR,
};
use crate::runtime::options::NcclSizes;
use cudarc::driver::{result, sys};
use ep_reference::{CombineFormat, Error, Op, Path, Phase, Side};

impl GpuGroup {
    /// The rank of device `di` and its NCCL peers.
    pub(crate) fn nccl_peers(&self, di: usize) -> (usize, Vec<usize>) {
        let m = self.masks[di];
        (
            self.devs[di].first_rank,
            (0..self.cfg.num_ranks).filter(|&d| m.contains(d)).collect(),
        )
    }

    /// Refuses what the NCCL sizing mode cannot do on `path`.
    pub(crate) fn check_nccl_mode(&self, path: Path) -> Result<(), GpuError> {
        self.check_nccl_sizes(path, self.nx.sizes)
    }

    fn check_nccl_sizes(&self, path: Path, sizes: NcclSizes) -> Result<(), GpuError> {
        if sizes == NcclSizes::Capacity && path == Path::PerExpert {
            let c = &self.cfg;
            return Err(GpuError::Unsupported(format!(
                "the per-expert path over NCCL needs exact sizes (NcclSizes::Exact): with a fixed \
                 capacity each of its L = {} messages per peer would carry T = {} entries, \
                 L*T = {} entries per peer instead of at most T*K = {}",
                c.num_local_experts(),
                c.max_tokens_per_rank,
                c.num_local_experts().saturating_mul(c.max_tokens_per_rank),
                c.max_tokens_per_rank.saturating_mul(c.top_k)
            )));
        }
        Ok(())
    }

    /// One call (or half of one) over NCCL on `streams` with the tensors `io`: `part` 0 the
    /// whole call, 1 pack + exchange (the send hook), 2 unpack (the receive hook).
    pub(crate) fn nccl_call(
        &mut self,
        op: Op,
        path: Path,
        streams: &[sys::CUstream],
        io: &[IoTable],
        part: i32,
    ) -> Result<(), GpuError> {
        // Combine sizes its messages as its dispatch did (exact sizes need that dispatch's
        // headers; a capacity dispatch left none), whatever the mode is now.
        let sizes = match op {
            Op::Dispatch => self.nx.sizes,
            Op::Combine => self.nx.dispatch_sizes.unwrap_or(self.nx.sizes),
        };
        self.check_nccl_sizes(path, sizes)?;
        if part != 2 {
            if op == Op::Dispatch && sizes == NcclSizes::Capacity {
                self.poison_send_headers(streams)?;
            }
            // bf16 rows: a LogFMT combine is refused with NCCL (check_combine_format).
            self.launch_stage_on(op, path, 1, streams, io, CombineFormat::Bf16)?;
            match op {
                Op::Dispatch => {
                    // Unknown until the exchange is queued (a failed one leaves no sizes).
                    self.nx.dispatch_sizes = None;
                    self.nccl_dispatch_exchange(path, streams)?;
                    self.nx.dispatch_sizes = Some(sizes);
                }
                Op::Combine => self.nccl_combine_exchange(path, sizes, streams)?,
            }
        }
        if part != 1 {
            self.launch_stage_on(op, path, 2, streams, io, CombineFormat::Bf16)?;
        }
        Ok(())
    }

    /// Capacity mode has no host look at the headers before they travel: a rank whose pack
    /// stage stops (bad input, or a group that had already failed: the kernels' poison path)
    /// writes none, and an earlier call's (valid-looking) header would go out. So every send
    /// header word is first set to i32::MAX in stream order; the pack stage overwrites it when
    /// it succeeds, and a peer's unpack reads the poison left in place as the sender's failure
    /// (ERR_PEER_FAILED: `GpuError::PeerFailed` naming the sender and the call), on the device,
    /// with no host involved. (Not -1: the unpack takes a negative count for a wait that
    /// already failed and leaves without a report of its own.)
    fn poison_send_headers(&self, streams: &[sys::CUstream]) -> Result<(), GpuError> {
        let words = prod(
            "the send headers",
            &[self.cfg.num_ranks, 2 + self.cfg.num_local_experts()],
        )?;
        for (di, dev) in self.devs.iter().enumerate() {
            let r = dev.first_rank;
            dev.bind()?;
            // SAFETY: snd_hdr holds R*(2+L) i32 of this rank on the bound context; the stream
            // belongs to it (checked by the caller).
            cuda("poison the send headers", unsafe {
                driver::memset_d32_async(self.ptrs[r].snd_hdr, POISON_HDR, words, streams[di])
            })?;
        }
        Ok(())
    }

    /// The group's message sizes for the NCCL plan, with `cap_rows` capacity rows of combine
    /// per peer. The entry sizes are the group's own (positive, from its config).
    fn nccl_sizing(&self, cap_rows: usize) -> Sizing {
        Sizing {
            t: self.cfg.max_tokens_per_rank,
            k: self.cfg.top_k,
            l: self.cfg.num_local_experts(),
            r_all: self.cfg.num_ranks,
            eb: self.params.entry_bytes as usize,
            peb: self.params.pe_entry_bytes as usize,
            rowb: 2 * self.cfg.hidden,
            cap_rows,
        }
    }

    /// Dispatch over NCCL, after the pack kernel. Capacity: the headers (tokens, selections,
    /// rows per local expert) and the full T-entry batch of every (me, peer) pair in one group.
    /// Exact: the headers, read back to size the payload, then the batches (batched: one per
    /// peer; per-expert: one per (peer, local expert) with rows) into each peer's receive
    /// region for me, exactly where NVLink would put them.
    pub(crate) fn nccl_dispatch_exchange(
        &mut self,
        path: Path,
        streams: &[sys::CUstream],
    ) -> Result<(), GpuError> {
        // Combine's capacity rows (`nccl_combine_exchange`); dispatch sizes no combine rows.
        let s = self.nccl_sizing(0);
        let hw = s.header_words();
        let capacity = self.nx.sizes == NcclSizes::Capacity;
        let mut ops = Vec::new();
        for di in 0..self.devs.len() {
            let (_, peers) = self.nccl_peers(di);
            let p = self.ptrs[self.devs[di].first_rank];
            ops.push(dispatch_headers(&s, &p, &peers, capacity)?);
        }
        self.nccl_group_on(&ops, streams)?;
        if capacity {
            return Ok(());
        }
        let call = self.calls[kind(Op::Dispatch, path)] + 1;
        self.wait_streams_on(streams, Op::Dispatch, call)?;
        // A rank whose pack stage found bad input skipped writing its headers and batches: what
        // sits in them is an earlier call's, valid-looking. Read the error word before anything
        // of this call is sent, so no peer takes that data for this call's (the loom model
        // `verify/src/gpu_protocol/` found this); the peers' own waits then end bounded.
        self.check()?;
        let mut ops: Vec<Tagged> = Vec::new();
        for di in 0..self.devs.len() {
            let (r, peers) = self.nccl_peers(di);
            let p = self.ptrs[r];
            self.devs[di].bind()?;
            let words = s.r_all * hw;
            let (mut sh, mut rh) = (vec![0i32; words], vec![0i32; words]);
            // SAFETY: both headers hold R*(2+L) i32 on the bound context; the stream is idle.
            unsafe {
                cuda(
                    "read send headers",
                    result::memcpy_dtoh_sync(&mut sh, p.snd_hdr),
                )?;
                cuda(
                    "read recv headers",
                    result::memcpy_dtoh_sync(&mut rh, p.rcv_hdr),
                )?;
            }
            // Every header word is bounded before it sizes a transfer; a bad
            // one marks the group broken.
            let (v, sels) = dispatch_payload(&s, path, r, &p, &peers, &sh, &rh)
                .inspect_err(|e| self.broken = Some(e.clone()))?;
            for (d, mine, theirs) in sels {
                self.sels[di].0[d] = mine;
                self.sels[di].1[d] = theirs;
            }
            self.nx.hdrs[di] = (sh, rh);
            ops.push(v);
        }
        self.nccl_rounds(ops, streams)
    }

    /// The tagged payload operations, in groups of [`experts_per_group`] local experts.
    fn nccl_rounds(
        &mut self,
        ops: Vec<Vec<(usize, P2p)>>,
        streams: &[sys::CUstream],
    ) -> Result<(), GpuError> {
        let chunk = experts_per_group(self.cfg.num_ranks, self.devs.len());
        for round in by_expert_chunks(ops, self.cfg.num_local_experts(), chunk) {
            if round.iter().any(|v| !v.is_empty()) {
                self.nccl_group_on(&round, streams)?;
            }
        }
        Ok(())
    }

    /// Combine over NCCL, after the pack kernel: rows for source s go back to s's receive
    /// region for me. Exact: the sizes come from the dispatch headers (no host round trip);
    /// batched one message per peer, per-expert one per (peer, local expert). Capacity:
    /// T * min(K, L) rows per peer (batched only).
    pub(crate) fn nccl_combine_exchange(
        &mut self,
        path: Path,
        sizes: NcclSizes,
        streams: &[sys::CUstream],
    ) -> Result<(), GpuError> {
        let s = self.nccl_sizing(combine_capacity_rows(&self.cfg)?);
        let mut ops: Vec<Tagged> = Vec::new();
        for di in 0..self.devs.len() {
            let (r, peers) = self.nccl_peers(di);
            let p = self.ptrs[r];
            ops.push(combine_ops(
                &s,
                sizes,
                path,
                &p,
                &peers,
                &self.sels[di],
                &self.nx.hdrs[di],
            )?);
        }
        self.nccl_rounds(ops, streams)
    }

    /// The grouped send/recv `ops` (one list per device) on `streams` (one per device).
    pub(crate) fn nccl_group_on(
        &mut self,
        ops: &[Vec<P2p>],
        streams: &[sys::CUstream],
    ) -> Result<(), GpuError> {
        let comms = self.comms.as_mut().ok_or_else(|| {
            GpuError::Nccl(
                "NCCL peers but no communicators (the group was not built for NCCL)".into(),
            )
        })?;
        for d in &self.devs {
            d.bind()?;
        }
        let r = comms.group(streams, ops);
        if let Err(e) = &r {
            self.broken = Some(e.clone());
        }
        r
    }

    /// Waits for every device's stream, bounded by the group's timeout (polling, so that an
    /// NCCL receive from a dead peer cannot hang the process). Past the timeout the
    /// communicators are aborted and the group refuses later calls.
    pub(crate) fn wait_streams(&mut self, op: Op, call: u64) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        self.wait_streams_on(&streams, op, call)
    }

    /// [`GpuGroup::wait_streams`] on the given streams (one per device).
    pub(crate) fn wait_streams_on(
        &mut self,
        streams: &[sys::CUstream],
        op: Op,
        call: u64,
    ) -> Result<(), GpuError> {
        let t0 = std::time::Instant::now();
        let limit = std::time::Duration::from_nanos(self.params.timeout_ns);
        for (di, &stream) in streams.iter().enumerate().take(self.devs.len()) {
            self.devs[di].bind()?;
            loop {
                // SAFETY: the stream belongs to the bound context (checked by the caller).
                match unsafe { driver::stream_done(stream) } {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        let err =
                            GpuError::Cuda(format!("kernel or NCCL transfer failed: {:?}", e.0));
                        self.broken = Some(err.clone());
                        return Err(err);
                    }
                }
                if t0.elapsed() > limit {
                    let (rank, peers) = self.nccl_peers(di);
                    // The lowest NCCL peer other than this rank (NCCL does not say which
                    // receive is stuck; with two ranks it is exact).
                    let peer = peers.iter().copied().find(|&p| p != rank).unwrap_or(rank);
                    let e = Error::Timeout {
                        rank,
                        peer,
                        phase: Phase {
                            op,
                            side: Side::Recv,
                        },
                        call,
                        waited_ms: t0.elapsed().as_millis() as u64,
                    };
                    if let Some(c) = self.comms.as_mut() {
                        c.abort(&e);
                    }
                    self.broken = Some(GpuError::from(e.clone()));
                    return Err(e.into());
                }
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        Ok(())
    }
}
