//! Launching the kernels (one launch per device and call, or the NCCL pack / exchange / unpack
//! stages), the bounded host waits, and `sync`, which turns the device error word into a typed error.
use super::*;

impl GpuGroup {
    /// Launches one call of `op` on `path` on every device. No host synchronisation.
    pub fn launch(&mut self, op: Op, path: Path) -> Result<(), GpuError> {
        self.launch_inner(Some((op, path)))
    }

    /// Launches the empty kernel with the same grid on every device (overhead baseline).
    pub fn launch_empty(&mut self) -> Result<(), GpuError> {
        self.launch_inner(None)
    }

    pub(crate) fn launch_inner(&mut self, what: Option<(Op, Path)>) -> Result<(), GpuError> {
        self.check_usable()?;
        let (op, path) = what.unwrap_or((Op::Dispatch, Path::Batched));
        if op == Op::Combine {
            self.check_combine_path(path)?;
        }
        let nccl = self.comms.is_some();
        if nccl && what.is_some() && path == Path::PerExpert {
            return Err(GpuError::Unsupported(
                "the per-expert path runs over NVLink only; NCCL peers need the batched path"
                    .into(),
            ));
        }
        if nccl && what.is_some() {
            // NCCL transport: pack kernel, grouped send/recv, unpack kernel.
            self.launch_stage(op, path, 1)?;
            match op {
                Op::Dispatch => self.nccl_dispatch_exchange()?,
                Op::Combine => self.nccl_combine_exchange()?,
            }
            self.launch_stage(op, path, 2)?;
        } else {
            self.launch_stage(op, path, if what.is_none() { -1 } else { 0 })?;
        }
        if what.is_none() {
            return Ok(());
        }
        if op == Op::Dispatch {
            self.last_dispatch = Some(path);
        }
        self.last_op = Some(op);
        self.calls[kind(op, path)] += 1;
        Ok(())
    }

    /// One launch per device: stage 0 = the whole call, 1 = pack (send side), 2 = unpack
    /// (receive side); -1 = the empty kernel. On the group's streams, with its own buffers.
    pub(crate) fn launch_stage(&self, op: Op, path: Path, stage: i32) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        let io = vec![IoTable::default(); self.devs.len()];
        self.launch_stage_on(op, path, stage, &streams, &io)
    }

    /// [`GpuGroup::launch_stage`] on the given streams (one per device) with the given tensors
    /// (one table per device; zero entries: the group's own buffers).
    pub(crate) fn launch_stage_on(
        &self,
        op: Op,
        path: Path,
        stage: i32,
        streams: &[sys::CUstream],
        io: &[IoTable],
    ) -> Result<(), GpuError> {
        let what = (stage >= 0).then_some(());
        for (di, dev) in self.devs.iter().enumerate() {
            let f = match (op, path) {
                _ if what.is_none() => dev.funcs.empty,
                (Op::Dispatch, Path::Batched) => dev.funcs.bat_dispatch,
                (Op::Dispatch, Path::PerExpert) => dev.funcs.pe_dispatch,
                (Op::Combine, Path::Batched) => dev.funcs.bat_combine,
                (Op::Combine, Path::PerExpert) => dev.funcs.pe_combine,
            };
            let mut kp = self.params;
            kp.table = dev.table;
            kp.err = dev.err;
            kp.rank_base = dev.first_rank as i32;
            kp.ranks_here = dev.ranks as i32;
            kp.nccl_mask = self.masks[di];
            kp.stage = stage.max(0);
            let mut iot = io[di];
            dev.bind()?;
            let mut args = [
                (&mut kp as *mut KParams).cast::<c_void>(),
                (&mut iot as *mut IoTable).cast::<c_void>(),
            ];
            let grid = (dev.ranks * self.blocks_per_rank) as u32;
            // SAFETY: `f` is a kernel of this device's module taking (KParams, IoTable) by value
            // (the same #[repr(C)] layouts as in common.cuh); every address in them and in the
            // table is a live allocation of this group or a caller tensor whose size the device
            // API checked; `streams[di]` belongs to this device's context (checked by the
            // caller); the grid fits on the device at once (checked in new); the launch copies
            // the parameters before returning.
            cuda("launch", unsafe {
                result::launch_kernel(
                    f,
                    (grid, 1, 1),
                    (NTHREADS, 1, 1),
                    self.smem as u32,
                    streams[di],
                    &mut args,
                )
            })?;
        }
        Ok(())
    }

    /// Combine reads the handle the last dispatch left on the device: it must be on the same path.
    pub(crate) fn check_combine_path(&self, path: Path) -> Result<(), GpuError> {
        if self.last_dispatch != Some(path) {
            return Err(GpuError::PathMismatch {
                combine: path.name(),
                dispatch: self.last_dispatch.map(|p| p.name()).unwrap_or("none"),
            });
        }
        Ok(())
    }

    /// The rank of device `di` and its NCCL peers.
    pub(crate) fn nccl_peers(&self, di: usize) -> (usize, Vec<usize>) {
        let m = self.masks[di];
        (
            self.devs[di].first_rank,
            (0..self.cfg.num_ranks)
                .filter(|&d| (m >> d) & 1 == 1)
                .collect(),
        )
    }

    pub(crate) fn streams_raw(&self) -> Vec<sys::CUstream> {
        self.devs.iter().map(|d| d.stream).collect()
    }

    /// Dispatch over NCCL, after the pack kernel: the headers (tokens, selections, rows per
    /// local expert) of every (me, peer) pair, read back to size the payload, then the batches
    /// themselves into each peer's receive region for me, exactly where NVLink would put them.
    pub(crate) fn nccl_dispatch_exchange(&mut self) -> Result<(), GpuError> {
        let (l, t) = (self.cfg.num_local_experts(), self.cfg.max_tokens_per_rank);
        let k = self.cfg.top_k;
        let hb = (2 + l) * 4;
        let eb = self.params.entry_bytes as usize;
        let mut ops = Vec::new();
        for di in 0..self.devs.len() {
            let (r, peers) = self.nccl_peers(di);
            let p = self.ptrs[r];
            let mut v = Vec::new();
            for &d in &peers {
                v.push(crate::nccl::P2p::Send {
                    buf: p.snd_hdr + (d * hb) as u64,
                    bytes: hb,
                    peer: d,
                });
                v.push(crate::nccl::P2p::Recv {
                    buf: p.rcv_hdr + (d * hb) as u64,
                    bytes: hb,
                    peer: d,
                });
            }
            ops.push(v);
        }
        self.nccl_group(&ops)?;
        let call = self.calls[kind(Op::Dispatch, Path::Batched)] + 1;
        self.wait_streams(Op::Dispatch, call)?;
        // A rank whose pack stage found bad input skipped writing its headers and batches: what
        // sits in them is an earlier call's, valid-looking. Read the error word before anything
        // of this call is sent, so no peer takes that data for this call's (the loom model
        // `verify/src/gpu_protocol.rs` found this); the peers' own waits then end bounded.
        self.check()?;
        let mut ops = Vec::new();
        for di in 0..self.devs.len() {
            let (r, peers) = self.nccl_peers(di);
            let p = self.ptrs[r];
            self.devs[di].bind()?;
            let words = self.cfg.num_ranks * (2 + l);
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
            let mut v = Vec::new();
            for &d in &peers {
                // [issue 10 item 4] Every header word, ours and the peer's, is bounded (tokens
                // <= T, selections within tokens..=tokens*K, per-expert rows summing to the
                // selections) before it sizes a transfer; a bad one marks the group broken.
                let hw = 2 + l;
                let (sw, rw) = (&sh[d * hw..][..hw], &rh[d * hw..][..hw]);
                let (mine, theirs) = crate::nccl::check_pair(r, d, sw, rw, t, k)
                    .inspect_err(|e| self.broken = Some(e.clone()))?;
                let (to_tok, to_sel) = (mine.tokens, mine.selections);
                let (from_tok, from_sel) = (theirs.tokens, theirs.selections);
                self.sels[di].0[d] = to_sel;
                self.sels[di].1[d] = from_sel;
                v.push(crate::nccl::P2p::Send {
                    buf: p.snd_buf + (d * t * eb) as u64,
                    bytes: to_tok * eb,
                    peer: d,
                });
                v.push(crate::nccl::P2p::Recv {
                    buf: p.bat_buf + (d * t * eb) as u64,
                    bytes: from_tok * eb,
                    peer: d,
                });
            }
            ops.push(v);
        }
        self.nccl_group(&ops)
    }

    /// Combine over NCCL, after the pack kernel: rows for source s go back to s's receive
    /// region for me. The sizes are known from the dispatch headers: no host round trip.
    pub(crate) fn nccl_combine_exchange(&mut self) -> Result<(), GpuError> {
        let (t, k) = (self.cfg.max_tokens_per_rank, self.cfg.top_k);
        let rowb = 2 * self.cfg.hidden;
        let mut ops = Vec::new();
        for di in 0..self.devs.len() {
            let (r, peers) = self.nccl_peers(di);
            let p = self.ptrs[r];
            let mut v = Vec::new();
            for &d in &peers {
                let region = (d * t * k * rowb) as u64;
                v.push(crate::nccl::P2p::Send {
                    buf: p.snd_buf + region,
                    bytes: self.sels[di].1[d] * rowb,
                    peer: d,
                });
                v.push(crate::nccl::P2p::Recv {
                    buf: p.cmb_buf + region,
                    bytes: self.sels[di].0[d] * rowb,
                    peer: d,
                });
            }
            ops.push(v);
        }
        self.nccl_group(&ops)
    }

    pub(crate) fn nccl_group(&mut self, ops: &[Vec<crate::nccl::P2p>]) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        let comms = self.comms.as_ref().ok_or_else(|| {
            GpuError::Nccl(
                "NCCL peers but no communicators (the group was not built for NCCL)".into(),
            )
        })?;
        for d in &self.devs {
            d.bind()?;
        }
        let r = crate::nccl::grouped(comms, &streams, ops);
        if let Err(e) = &r {
            self.broken = Some(e.clone());
        }
        r
    }

    /// Waits for every device's stream, bounded by the group's timeout (polling, so that an
    /// NCCL receive from a dead peer cannot hang the process). Past the timeout the
    /// communicators are aborted and the group refuses later calls.
    pub(crate) fn wait_streams(&mut self, op: Op, call: u64) -> Result<(), GpuError> {
        let t0 = std::time::Instant::now();
        let limit = std::time::Duration::from_nanos(self.params.timeout_ns);
        for di in 0..self.devs.len() {
            let dev = &self.devs[di];
            dev.bind()?;
            loop {
                // SAFETY: the stream belongs to the bound context.
                let rc = unsafe { sys::cuStreamQuery(dev.stream) };
                if rc == sys::CUresult::CUDA_SUCCESS {
                    break;
                }
                if rc != sys::CUresult::CUDA_ERROR_NOT_READY {
                    let err = GpuError::Cuda(format!("kernel or NCCL transfer failed: {rc:?}"));
                    self.broken = Some(err.clone());
                    return Err(err);
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
                        c.abort();
                    }
                    self.broken = Some(GpuError::from(e.clone()));
                    return Err(e.into());
                }
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
        Ok(())
    }

    /// Waits for every device and turns a timed-out wait into [`Error::Timeout`].
    pub fn sync(&mut self) -> Result<(), GpuError> {
        self.check_usable()?;
        if self.comms.is_some() {
            // NCCL receives are not bounded on the device: poll with the timeout.
            let op = self.last_op.unwrap_or(Op::Dispatch);
            let call = self.calls[kind(op, Path::Batched)];
            self.wait_streams(op, call)?;
        }
        for dev in &self.devs {
            dev.bind()?;
            // SAFETY: the stream belongs to this device's bound context.
            if let Err(e) = unsafe { result::stream::synchronize(dev.stream) } {
                let err = GpuError::Cuda(format!("kernel failed: {e:?}"));
                self.broken = Some(err.clone());
                return Err(err);
            }
        }
        self.check()
    }
}
