//! One call (or half of one) over NCCL: the pack stage, the grouped sends and receives, the
//! unpack stage; capacity mode's header poison; the exchanges of dispatch and combine, built
//! from the message plan (`plan`) and posted in NCCL-sized groups (`rounds`); and the bounded
//! host waits on the streams (NCCL receives are not bounded on the device: past the group's
//! timeout the communicators are aborted and the group refuses later calls).
//!
//! [`Link`] is a group's NCCL transport: the communicators, each device's rank, NCCL peers and
//! buffers, and what a dispatch leaves for its combine (its sizing, headers and selections).
//! The group it serves launches the kernels and keeps the group's error state: [`Stages`].

use crate::error::{cuda, GpuError};
use crate::runtime::driver;
use crate::runtime::layout::{combine_capacity_rows, prod, IoTable, RankPtrs};
use crate::runtime::nccl::comms::Comms;
use crate::runtime::nccl::net::P2p;
use crate::runtime::nccl::plan::{
    combine_ops, dispatch_headers, dispatch_payload, Sizing, Tagged, POISON_HDR,
};
use crate::runtime::nccl::rounds::{by_expert_chunks, experts_per_group};
use crate::runtime::options::NcclSizes;
use cudarc::driver::sys::CUstream;
use cudarc::driver::{result, CudaContext};
use ep_reference::{Config, Error, Op, Path, Phase, Side};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a call over NCCL needs of the group it serves.
pub(crate) trait Stages {
    /// Launches stage `stage` (1: pack, 2: unpack) of (`op`, `path`) on `streams` (one per
    /// device) with the tensors `io` (one table per device), rows in bf16 (a LogFMT combine is
    /// refused over NCCL before any call gets here).
    fn launch_stage(
        &self,
        op: Op,
        path: Path,
        stage: i32,
        streams: &[CUstream],
        io: &[IoTable],
    ) -> Result<(), GpuError>;

    /// The group's error words: `Err` once a kernel recorded an error (the group is then
    /// failed).
    fn check(&mut self) -> Result<(), GpuError>;

    /// Marks the group failed: every later call is refused with `e`.
    fn fail(&mut self, e: &GpuError);
}

/// One call over NCCL: what runs, where, and under which bounds.
pub(crate) struct Call<'a> {
    pub(crate) op: Op,
    pub(crate) path: Path,
    /// One stream per device.
    pub(crate) streams: &'a [CUstream],
    /// The tensors, one table per device (zero entries: the group's own buffers).
    pub(crate) io: &'a [IoTable],
    /// 0: the whole call; 1: pack and exchange (the send half); 2: unpack (the receive half).
    pub(crate) part: i32,
    /// The group's sizing mode now.
    pub(crate) sizes: NcclSizes,
    /// The number of this call of dispatch on `path` (a timed-out wait names it).
    pub(crate) dispatch_call: u64,
    /// The bound of every host wait.
    pub(crate) timeout: Duration,
}

/// One device's end of the transport.
struct Device {
    ctx: Arc<CudaContext>,
    /// The device's rank (a group over NCCL runs one rank per device).
    rank: usize,
    /// The ranks it reaches through NCCL.
    peers: Vec<usize>,
    /// Its rank's buffers.
    ptrs: RankPtrs,
    /// From the last dispatch's headers: selections sent to each peer (rows that come back in
    /// combine) and received from each peer (rows that go back).
    sels: (Vec<usize>, Vec<usize>),
    /// The headers of the last exact-size dispatch (sent, received: R * (2 + L) words each),
    /// which size the per-expert combine's messages.
    hdrs: (Vec<i32>, Vec<i32>),
}

/// A group's NCCL transport (module docs).
pub(crate) struct Link {
    comms: Comms,
    cfg: Config,
    /// Bytes of a batched and of a per-expert entry (the group's kernel parameters).
    entry_bytes: (usize, usize),
    devs: Vec<Device>,
    /// The sizing of the last dispatch whose exchange was queued (combine follows it).
    dispatch_sizes: Option<NcclSizes>,
}

/// Refuses what NCCL sizing `sizes` cannot do on `path`: the per-expert path needs exact sizes.
pub(crate) fn check_sizes(cfg: &Config, path: Path, sizes: NcclSizes) -> Result<(), GpuError> {
    if sizes == NcclSizes::Capacity && path == Path::PerExpert {
        return Err(GpuError::Unsupported(format!(
            "the per-expert path over NCCL needs exact sizes (NcclSizes::Exact): with a fixed \
             capacity each of its L = {} messages per peer would carry T = {} entries, \
             L*T = {} entries per peer instead of at most T*K = {}",
            cfg.num_local_experts(),
            cfg.max_tokens_per_rank,
            cfg.num_local_experts()
                .saturating_mul(cfg.max_tokens_per_rank),
            cfg.max_tokens_per_rank.saturating_mul(cfg.top_k)
        )));
    }
    Ok(())
}

impl Link {
    /// The transport over `comms` (communicator i on device i) of a group of `cfg` whose
    /// entries are `entry_bytes` (batched, per-expert); `devices[i]` is device i's context,
    /// rank, NCCL peers and its rank's buffers.
    pub(crate) fn new(
        comms: Comms,
        cfg: &Config,
        entry_bytes: (usize, usize),
        devices: Vec<(Arc<CudaContext>, usize, Vec<usize>, RankPtrs)>,
    ) -> Link {
        let r = cfg.num_ranks;
        Link {
            comms,
            cfg: *cfg,
            entry_bytes,
            devs: devices
                .into_iter()
                .map(|(ctx, rank, peers, ptrs)| Device {
                    ctx,
                    rank,
                    peers,
                    ptrs,
                    sels: (vec![0; r], vec![0; r]),
                    hdrs: (Vec::new(), Vec::new()),
                })
                .collect(),
            dispatch_sizes: None,
        }
    }

    /// Frees the communicators before the streams and memory they use ([`Comms::release`]).
    pub(crate) fn release(
        self,
        streams: &[(Arc<CudaContext>, CUstream)],
        timeout: Duration,
        healthy: bool,
    ) {
        self.comms.release(streams, timeout, healthy);
    }

    fn bind(&self, di: usize) -> Result<(), GpuError> {
        cuda("bind", self.devs[di].ctx.bind_to_thread())
    }

    /// The call `c` over NCCL for `group`: pack stage, grouped send/recv, unpack stage (or the
    /// part of them `c.part` names).
    pub(crate) fn call(&mut self, group: &mut impl Stages, c: &Call<'_>) -> Result<(), GpuError> {
        // Combine sizes its messages as its dispatch did (exact sizes need that dispatch's
        // headers; a capacity dispatch left none), whatever the mode is now.
        let sizes = match c.op {
            Op::Dispatch => c.sizes,
            Op::Combine => self.dispatch_sizes.unwrap_or(c.sizes),
        };
        check_sizes(&self.cfg, c.path, sizes)?;
        if c.part != 2 {
            if c.op == Op::Dispatch && sizes == NcclSizes::Capacity {
                self.poison_send_headers(c.streams)?;
            }
            group.launch_stage(c.op, c.path, 1, c.streams, c.io)?;
            match c.op {
                Op::Dispatch => {
                    // Unknown until the exchange is queued (a failed one leaves no sizes).
                    self.dispatch_sizes = None;
                    self.dispatch_exchange(group, c, sizes)?;
                    self.dispatch_sizes = Some(sizes);
                }
                Op::Combine => self.combine_exchange(group, c.path, sizes, c.streams)?,
            }
        }
        if c.part != 1 {
            group.launch_stage(c.op, c.path, 2, c.streams, c.io)?;
        }
        Ok(())
    }

    /// Capacity mode has no host look at the headers before they travel: a rank whose pack
    /// stage stops (bad input, or a group that had already failed: the kernels' poison path)
    /// writes none, and an earlier call's (valid-looking) header would go out. So every send
    /// header word is first set to `POISON_HDR` (i32::MAX) in stream order; the pack stage
    /// overwrites it when it succeeds, and a peer's unpack reads the poison left in place as
    /// the sender's failure (ERR_PEER_FAILED: `GpuError::PeerFailed` naming the sender and the
    /// call), on the device, with no host involved. (Not -1: the unpack takes a negative count
    /// for a wait that already failed and leaves without a report of its own.)
    fn poison_send_headers(&self, streams: &[CUstream]) -> Result<(), GpuError> {
        let words = prod(
            "the send headers",
            &[self.cfg.num_ranks, 2 + self.cfg.num_local_experts()],
        )?;
        for (di, dev) in self.devs.iter().enumerate() {
            self.bind(di)?;
            // SAFETY: snd_hdr holds R*(2+L) i32 of this rank on the bound context, written by
            // this rank's kernels only, in the order of this stream; the stream belongs to the
            // context (the caller's checks).
            cuda("poison the send headers", unsafe {
                driver::memset_d32_async(dev.ptrs.snd_hdr, POISON_HDR, words, streams[di])
            })?;
        }
        Ok(())
    }

    /// The group's message sizes for the NCCL plan, with `cap_rows` capacity rows of combine
    /// per peer. The entry sizes are the group's own (positive, from its config).
    fn sizing(&self, cap_rows: usize) -> Sizing {
        Sizing {
            t: self.cfg.max_tokens_per_rank,
            k: self.cfg.top_k,
            l: self.cfg.num_local_experts(),
            r_all: self.cfg.num_ranks,
            eb: self.entry_bytes.0,
            peb: self.entry_bytes.1,
            rowb: 2 * self.cfg.hidden,
            cap_rows,
        }
    }

    /// Dispatch over NCCL, after the pack kernel. Capacity: the headers (tokens, selections,
    /// rows per local expert) and the full T-entry batch of every (me, peer) pair in one group.
    /// Exact: the headers, read back to size the payload, then the batches (batched: one per
    /// peer; per-expert: one per (peer, local expert) with rows) into each peer's receive
    /// region for me, exactly where NVLink would put them.
    fn dispatch_exchange(
        &mut self,
        group: &mut impl Stages,
        c: &Call<'_>,
        sizes: NcclSizes,
    ) -> Result<(), GpuError> {
        // Combine's capacity rows (`combine_exchange`); dispatch sizes no combine rows.
        let s = self.sizing(0);
        let hw = s.header_words();
        let capacity = sizes == NcclSizes::Capacity;
        let mut ops = Vec::new();
        for d in &self.devs {
            ops.push(dispatch_headers(&s, &d.ptrs, &d.peers, capacity)?);
        }
        self.group_on(group, &ops, c.streams)?;
        if capacity {
            return Ok(());
        }
        self.wait_streams(group, c.streams, Op::Dispatch, c.dispatch_call, c.timeout)?;
        // A rank whose pack stage found bad input skipped writing its headers and batches: what
        // sits in them is an earlier call's, valid-looking. Read the error word before anything
        // of this call is sent, so no peer takes that data for this call's (the loom model
        // `verify/src/gpu_protocol/` found this); the peers' own waits then end bounded.
        group.check()?;
        let mut ops: Vec<Tagged> = Vec::new();
        for di in 0..self.devs.len() {
            self.bind(di)?;
            let words = s.r_all * hw;
            let (mut sh, mut rh) = (vec![0i32; words], vec![0i32; words]);
            let d = &mut self.devs[di];
            // SAFETY: both headers hold R*(2+L) i32 on the bound context; the stream is idle
            // (waited for above), so no kernel or transfer writes them meanwhile.
            unsafe {
                cuda(
                    "read send headers",
                    result::memcpy_dtoh_sync(&mut sh, d.ptrs.snd_hdr),
                )?;
                cuda(
                    "read recv headers",
                    result::memcpy_dtoh_sync(&mut rh, d.ptrs.rcv_hdr),
                )?;
            }
            // Every header word is bounded before it sizes a transfer; a bad one marks the
            // group broken.
            let (v, sels) = dispatch_payload(&s, c.path, d.rank, &d.ptrs, &d.peers, &sh, &rh)
                .inspect_err(|e| group.fail(e))?;
            for (peer, mine, theirs) in sels {
                d.sels.0[peer] = mine;
                d.sels.1[peer] = theirs;
            }
            d.hdrs = (sh, rh);
            ops.push(v);
        }
        self.rounds(group, ops, c.streams)
    }

    /// The tagged payload operations, in groups of [`experts_per_group`] local experts.
    fn rounds(
        &mut self,
        group: &mut impl Stages,
        ops: Vec<Vec<(usize, P2p)>>,
        streams: &[CUstream],
    ) -> Result<(), GpuError> {
        let chunk = experts_per_group(self.cfg.num_ranks, self.devs.len());
        for round in by_expert_chunks(ops, self.cfg.num_local_experts(), chunk) {
            if round.iter().any(|v| !v.is_empty()) {
                self.group_on(group, &round, streams)?;
            }
        }
        Ok(())
    }

    /// Combine over NCCL, after the pack kernel: rows for source s go back to s's receive
    /// region for me. Exact: the sizes come from the dispatch headers (no host round trip);
    /// batched one message per peer, per-expert one per (peer, local expert). Capacity:
    /// T * min(K, L) rows per peer (batched only).
    fn combine_exchange(
        &mut self,
        group: &mut impl Stages,
        path: Path,
        sizes: NcclSizes,
        streams: &[CUstream],
    ) -> Result<(), GpuError> {
        let s = self.sizing(combine_capacity_rows(&self.cfg)?);
        let mut ops: Vec<Tagged> = Vec::new();
        for d in &self.devs {
            ops.push(combine_ops(
                &s, sizes, path, &d.ptrs, &d.peers, &d.sels, &d.hdrs,
            )?);
        }
        self.rounds(group, ops, streams)
    }

    /// The grouped send/recv `ops` (one list per device) on `streams` (one per device); a
    /// failure fails the group.
    fn group_on(
        &mut self,
        group: &mut impl Stages,
        ops: &[Vec<P2p>],
        streams: &[CUstream],
    ) -> Result<(), GpuError> {
        for di in 0..self.devs.len() {
            self.bind(di)?;
        }
        self.comms
            .group(streams, ops)
            .inspect_err(|e| group.fail(e))
    }

    /// Waits for every device's stream, bounded by `timeout` in all (polling, so that an NCCL
    /// receive from a dead peer cannot hang the process). A failed stream fails the group; past
    /// the timeout the communicators are aborted, the group fails with [`Error::Timeout`]
    /// naming (`op`, receive side) and `call`.
    pub(crate) fn wait_streams(
        &mut self,
        group: &mut impl Stages,
        streams: &[CUstream],
        op: Op,
        call: u64,
        timeout: Duration,
    ) -> Result<(), GpuError> {
        let t0 = Instant::now();
        for (di, &stream) in streams.iter().enumerate().take(self.devs.len()) {
            self.bind(di)?;
            loop {
                // SAFETY: the stream belongs to the bound context (the caller's checks).
                match unsafe { driver::stream_done(stream) } {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        let err =
                            GpuError::Cuda(format!("kernel or NCCL transfer failed: {:?}", e.0));
                        group.fail(&err);
                        return Err(err);
                    }
                }
                if t0.elapsed() > timeout {
                    let d = &self.devs[di];
                    // The lowest NCCL peer other than this rank (NCCL does not say which
                    // receive is stuck; with two ranks it is exact).
                    let peer = d.peers.iter().copied().find(|&p| p != d.rank);
                    let e = Error::Timeout {
                        rank: d.rank,
                        peer: peer.unwrap_or(d.rank),
                        phase: Phase {
                            op,
                            side: Side::Recv,
                        },
                        call,
                        waited_ms: t0.elapsed().as_millis() as u64,
                    };
                    self.comms.abort(&e);
                    let e = GpuError::from(e);
                    group.fail(&e);
                    return Err(e);
                }
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
    }
}
