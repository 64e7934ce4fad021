//! Launching the kernels (one launch per device and call, or the NCCL pack / exchange / unpack
//! stages), the bounded host waits, and `sync`, which turns the device error word into a typed error.
use crate::error::GpuError;
use crate::runtime::device::cuda;
use crate::runtime::exchange::{combine_ops, dispatch_headers, dispatch_payload, Sizing, Tagged};
use crate::runtime::footprint::check_launch;
use crate::runtime::group::{kind, GpuGroup};
use crate::runtime::layout::{combine_capacity_rows, prod, IoTable, KParams, NTHREADS};
use crate::runtime::options::NcclSizes;
use cudarc::driver::{result, sys};
use ep_reference::{Error, Mode, Op, Path, Phase, Side};
use std::ffi::c_void;

/// What capacity mode writes into every send header word before the pack stage (i32::MAX: a
/// token count no peer accepts, see `poison_send_headers`).
pub(crate) const POISON_HDR: u32 = i32::MAX as u32;

/// The most point-to-point calls the per-expert path puts in one NCCL group (NCCL documents a
/// limit of 2048 calls between ncclGroupStart and ncclGroupEnd; half of it, to stay clear).
pub(crate) const MAX_GROUP_OPS: usize = 1024;

/// Local experts per NCCL group of the per-expert exchange: every rank of R sends and receives
/// one message per (peer, local expert), `devices` communicators per group call. From the
/// config alone, so every rank (process) splits at the same experts and every group holds
/// both sides of each message it starts (no group waits on another's).
pub(crate) fn experts_per_group(r: usize, devices: usize) -> usize {
    (MAX_GROUP_OPS / (2 * r.max(1) * devices.max(1))).max(1)
}

/// Runs tagged operation lists (tag = local expert) as consecutive groups of `chunk` experts.
fn by_expert_chunks(
    ops: Vec<Vec<(usize, crate::runtime::nccl::P2p)>>,
    l: usize,
    chunk: usize,
) -> Vec<Vec<Vec<crate::runtime::nccl::P2p>>> {
    let rounds = l.div_ceil(chunk.max(1)).max(1);
    let mut out: Vec<Vec<Vec<crate::runtime::nccl::P2p>>> = (0..rounds)
        .map(|_| (0..ops.len()).map(|_| Vec::new()).collect())
        .collect();
    for (di, list) in ops.into_iter().enumerate() {
        for (tag, op) in list {
            out[(tag / chunk.max(1)).min(rounds - 1)][di].push(op);
        }
    }
    out
}

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
        let (op, path) = what.unwrap_or((Op::Dispatch, Path::Batched));
        if let Err(e) = self.check_usable() {
            if what.is_some() {
                self.poison_refused(op, path, &self.streams_raw());
            }
            return Err(e);
        }
        if op == Op::Combine {
            self.check_combine_path(path)?;
        }
        let nccl = self.comms.is_some();
        if nccl && what.is_some() {
            // NCCL transport: pack kernel, grouped send/recv, unpack kernel.
            let streams = self.streams_raw();
            let io = self.io_tables();
            self.nccl_call(op, path, &streams, &io, 0)?;
        } else {
            self.launch_stage(op, path, if what.is_none() { -1 } else { 0 })?;
        }
        if what.is_none() {
            return Ok(());
        }
        self.record_call(op, path);
        Ok(())
    }

    /// The host's count of a call of (op, path) that went out: combine's path check and the
    /// calls' numbers (the device counts the same in its epochs).
    pub(crate) fn record_call(&mut self, op: Op, path: Path) {
        if op == Op::Dispatch {
            self.last_dispatch = Some(path);
        }
        self.last_op = Some(op);
        self.calls[kind(op, path)] += 1;
    }

    /// What a call of `op` that the group refuses (it failed: `check_usable`) still does: it
    /// tells the peers. The call's kernel is enqueued on `streams` with the group's own buffers
    /// and `refused` set, so every block stores the poison of this call in the signal words it
    /// owes its peers (poison.cuh) and sends nothing else; a peer's matching call then ends at
    /// once with `GpuError::PeerFailed` naming this rank instead of waiting out its bound. The
    /// epoch and the call count advance as for any call, so the next refused call poisons the
    /// next call's words. Not over NCCL (a refused call exchanges nothing; its peers' NCCL waits
    /// are bounded on their hosts). A launch that fails is dropped: the caller returns the
    /// group's error either way.
    pub(crate) fn poison_refused(&mut self, op: Op, path: Path, streams: &[sys::CUstream]) {
        if self.comms.is_some() {
            return;
        }
        let io = self.io_tables();
        self.params.refused = 1;
        let launched = self.launch_stage_on(op, path, 0, streams, &io);
        self.params.refused = 0;
        if launched.is_ok() {
            self.calls[kind(op, path)] += 1;
        }
    }

    /// One launch per device: stage 0 = the whole call, 1 = pack (send side), 2 = unpack
    /// (receive side); -1 = the empty kernel. On the group's streams, with its own buffers.
    pub(crate) fn launch_stage(&self, op: Op, path: Path, stage: i32) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        let io = self.io_tables();
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
        // Nothing is launched on any device unless every device's launch has its buffers.
        for (di, dev) in self.devs.iter().enumerate() {
            let entries = &io[di].r;
            check_launch(
                self.buffers,
                self.cfg.mode != Mode::Bf16,
                op,
                path,
                stage,
                self.params.refused != 0,
                &entries[..dev.ranks.min(entries.len())],
            )?;
        }
        for (di, dev) in self.devs.iter().enumerate() {
            // The batched path has a kernel per stage (batched.cu); per-expert one for all three.
            let f = match (op, path, stage) {
                _ if what.is_none() => dev.funcs.empty,
                (Op::Dispatch, Path::Batched, 1) => dev.funcs.bat_halves[0],
                (Op::Dispatch, Path::Batched, 2) => dev.funcs.bat_halves[1],
                (Op::Combine, Path::Batched, 1) => dev.funcs.bat_halves[2],
                (Op::Combine, Path::Batched, 2) => dev.funcs.bat_halves[3],
                (Op::Dispatch, Path::Batched, _) => dev.funcs.bat_dispatch,
                (Op::Dispatch, Path::PerExpert, _) => dev.funcs.pe_dispatch,
                (Op::Combine, Path::Batched, _) => dev.funcs.bat_combine,
                (Op::Combine, Path::PerExpert, _) => dev.funcs.pe_combine,
            };
            // The plain build has no NCCL or shrink-mode code (Variant::check_plain).
            dev.variant
                .check_plain(!self.masks[di].is_empty(), self.params.shrink != 0)
                .map_err(|m| GpuError::Unsupported(m.into()))?;
            let mut kp = self.params;
            kp.table = dev.table;
            kp.err = dev.err;
            kp.err_host = dev.err_host.dev;
            kp.rank_base = dev.first_rank as i32;
            kp.ranks_here = dev.ranks as i32;
            kp.nccl_mask = self.masks[di].0;
            kp.stage = stage.max(0);
            // The table's bytes are the kernel's IoTable parameter: exactly as many entries as
            // the device's build declares.
            let iot: &IoTable = &io[di];
            if iot.r.len() != dev.variant.io_capacity() {
                return Err(GpuError::Unsupported(format!(
                    "an IoTable of {} entries for a build that takes {}",
                    iot.r.len(),
                    dev.variant.io_capacity()
                )));
            }
            dev.bind()?;
            let mut args = [
                (&mut kp as *mut KParams).cast::<c_void>(),
                // Read only: the driver copies the parameter bytes at launch.
                iot.r.as_ptr().cast_mut().cast::<c_void>(),
            ];
            let grid = (dev.ranks * self.blocks_per_rank) as u32;
            // SAFETY: `f` is a kernel of this device's module taking (KParams, IoTable) by value
            // (the same #[repr(C)] layouts as in common.cuh, the table as long as the build's
            // EP_MAX_LOCAL, checked above); every address in them and in the
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
            (0..self.cfg.num_ranks).filter(|&d| m.contains(d)).collect(),
        )
    }

    pub(crate) fn streams_raw(&self) -> Vec<sys::CUstream> {
        self.devs.iter().map(|d| d.stream).collect()
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
            self.launch_stage_on(op, path, 1, streams, io)?;
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
            self.launch_stage_on(op, path, 2, streams, io)?;
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
                sys::cuMemsetD32Async(self.ptrs[r].snd_hdr, POISON_HDR, words, streams[di]).result()
            })?;
        }
        Ok(())
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
        let s = Sizing {
            t: self.cfg.max_tokens_per_rank,
            k: self.cfg.top_k,
            l: self.cfg.num_local_experts(),
            r_all: self.cfg.num_ranks,
            eb: self.params.entry_bytes as usize,
            peb: self.params.pe_entry_bytes as usize,
            rowb: 2 * self.cfg.hidden,
            // Combine's (`nccl_combine_exchange`); dispatch sizes no combine rows.
            cap_rows: 0,
        };
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
        ops: Vec<Vec<(usize, crate::runtime::nccl::P2p)>>,
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
        let s = Sizing {
            t: self.cfg.max_tokens_per_rank,
            k: self.cfg.top_k,
            l: self.cfg.num_local_experts(),
            r_all: self.cfg.num_ranks,
            eb: self.params.entry_bytes as usize,
            peb: self.params.pe_entry_bytes as usize,
            rowb: 2 * self.cfg.hidden,
            cap_rows: combine_capacity_rows(&self.cfg)?,
        };
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
        ops: &[Vec<crate::runtime::nccl::P2p>],
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
        for di in 0..self.devs.len() {
            let dev = &self.devs[di];
            dev.bind()?;
            loop {
                // SAFETY: the stream belongs to the bound context (checked by the caller).
                let rc = unsafe { sys::cuStreamQuery(streams[di]) };
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

    /// Test hook (feature `testing`): every device's decoded error word (None: clear), read
    /// without changing the group's state (so a test sees what each device reported, not only
    /// the first error).
    #[cfg(feature = "testing")]
    pub fn device_errors_for_test(&self) -> Result<Vec<Option<GpuError>>, GpuError> {
        self.device_errors()
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
                // A kernel that trapped (GpuOptions::trap_on_error) recorded its cause first:
                // the mirror still names it after the context is lost.
                let err = self
                    .recorded_error()
                    .unwrap_or_else(|| GpuError::Cuda(format!("kernel failed: {e:?}")));
                self.broken = Some(err.clone());
                return Err(err);
            }
        }
        self.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_expert_groups_stay_under_the_nccl_limit_and_split_alike() {
        // R = 2 on 2 GPUs in one process: 2 comms x 2 peers x 2 ops x 128 experts = 1024.
        assert_eq!(experts_per_group(2, 2), 128);
        assert_eq!(experts_per_group(2, 1), 256);
        // Eight GPUs in one process: 8 comms x 8 peers x 2 = 128 ops per expert.
        assert_eq!(experts_per_group(8, 8), 8);
        assert!(experts_per_group(8, 8) * 2 * 8 * 8 <= MAX_GROUP_OPS);
        // Never 0, even past the limit with one expert.
        assert_eq!(experts_per_group(1024, 64), 1);
        assert_eq!(experts_per_group(0, 0), MAX_GROUP_OPS / 2);
        let op = |peer| crate::runtime::nccl::P2p::Send {
            buf: 0,
            bytes: 1,
            peer,
        };
        // Tags 0..5 in chunks of 2: rounds {0,1}, {2,3}, {4}; device order kept.
        let ops = vec![
            (0..5).map(|l| (l, op(l))).collect::<Vec<_>>(),
            vec![(4, op(9))],
        ];
        let r = by_expert_chunks(ops, 5, 2);
        let peers = |v: &Vec<crate::runtime::nccl::P2p>| {
            v.iter()
                .map(|o| match o {
                    crate::runtime::nccl::P2p::Send { peer, .. }
                    | crate::runtime::nccl::P2p::Recv { peer, .. } => *peer,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(r.len(), 3);
        assert_eq!(peers(&r[0][0]), vec![0, 1]);
        assert_eq!(peers(&r[1][0]), vec![2, 3]);
        assert_eq!(peers(&r[2][0]), vec![4]);
        assert!(r[0][1].is_empty() && r[1][1].is_empty());
        assert_eq!(peers(&r[2][1]), vec![9]);
        // The batched path tags everything 0: one group.
        assert_eq!(by_expert_chunks(vec![vec![(0, op(1))]], 128, 128).len(), 1);
    }
}
