//! The group: its state ([`GpuGroup`]: devices, buffers, the address table, the NCCL
//! transport, call counts), its release, and building it with every rank in this process
//! (`GpuGroup::new`, ranks spread over the GPUs, peer access). One rank per process (CUDA IPC or
//! NCCL) is built by [`ProcessRank`](crate::runtime::ProcessRank).
use crate::error::{cuda, GpuError};
use crate::runtime::device::{probe_devices, Dev, HostMirror};
use crate::runtime::driver;
use crate::runtime::footprint::{footprint, plan_sizes};
use crate::runtime::layout::{
    all_peers, carve_rank, check_ranks, cmb_row_bytes, entry_bytes_checked, pe_entry_bytes_checked,
    smem_bytes, to_i32, total_bytes, IoTable, KParams, PeerMask, RankPtrs, ERR_WORDS,
};
use crate::runtime::nccl::{Comms, Link};
use crate::runtime::options::{Buffers, GpuOptions, NcclSizes, Transport};
use crate::runtime::streams::{drain_streams, Drain};
use cudarc::driver::{result, sys, CudaContext};
use ep_reference::{CombineFormat, Config, Error, Mode, Op, Path};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// R ranks on one or more GPUs: the communication buffers, and dispatch/combine on both paths.
pub struct GpuGroup {
    /// Unique per group in this process (device-API handles name their group).
    pub(crate) id: u64,
    pub(crate) cfg: Config,
    pub(crate) devs: Vec<Dev>,
    pub(crate) ptrs: Vec<RankPtrs>,
    pub(crate) params: KParams,
    pub(crate) blocks_per_rank: usize,
    pub(crate) smem: usize,
    pub(crate) n_tokens: Vec<usize>,
    pub(crate) topk: Vec<Vec<i64>>,
    pub(crate) last_dispatch: Option<Path>,
    pub(crate) calls: [u64; 4],
    pub(crate) broken: Option<GpuError>,
    /// Per device: the peers its rank reaches through NCCL.
    pub(crate) masks: Vec<PeerMask>,
    /// The NCCL transport (communicators, one per device) when any mask is nonzero.
    pub(crate) nccl: Option<Link>,
    /// Process mode: the one rank this process runs (its table holds the peers' IPC addresses).
    pub(crate) own: Option<usize>,
    /// Peer allocations opened through CUDA IPC (closed on drop).
    /// Held for its Drop (closes the mappings).
    #[allow(dead_code)]
    pub(crate) ipc_opened: IpcMappings,
    pub(crate) last_op: Option<Op>,
    /// How the NCCL transport sizes its messages ([`GpuGroup::set_nccl_sizes`]).
    pub(crate) nccl_sizes: NcclSizes,
    /// Which buffers the allocation holds ([`Buffers`]); launches that need others are refused.
    pub(crate) buffers: Buffers,
    /// The format of the combines of the group's own-buffer calls (`launch`, the harness, the
    /// profile): [`GpuGroup::set_combine_format`].
    pub(crate) combine_format: CombineFormat,
}

impl Drop for GpuGroup {
    fn drop(&mut self) {
        // Communicators go before the streams and memory they use: a bounded
        // wait for the streams, then destroy (idle, healthy) or abort (busy, failed).
        let t = std::time::Duration::from_nanos(self.params.timeout_ns);
        if let Some(link) = self.nccl.take() {
            link.release(&self.streams(), t, self.broken.is_none());
        }
        // Then a bounded wait for every stream: our kernels end within their own wait bound, so
        // twice the group's bound (at least 1 s) suffices for anything that can finish. A stream
        // still busy after that waits on a peer that stopped (an NCCL receive the abort did not
        // end; an unbounded synchronize would hang here). Freeing memory
        // under it would block as well (cuMemFree synchronises), so the devices and the peers'
        // mappings are then leaked, not freed: the caller gets to report its error instead of
        // hanging, and the process's exit reclaims them.
        let bound = t.saturating_mul(2).max(std::time::Duration::from_secs(1));
        if drain_streams(&self.streams(), bound) == Drain::Busy {
            std::mem::forget(std::mem::take(&mut self.devs));
            std::mem::forget(std::mem::replace(
                &mut self.ipc_opened,
                IpcMappings {
                    ctx: None,
                    ptrs: Vec::new(),
                },
            ));
        }
        // Otherwise the fields: the devices synchronise (idle now) and free their allocations,
        // `ipc_opened` closes the peers' mappings (its own Drop, which also runs when
        // `ProcessRank::join` fails half-way).
    }
}

/// Peer allocations opened through CUDA IPC, closed on drop (also on an error path of
/// `ProcessRank::join`, before the group exists).
pub(crate) struct IpcMappings {
    pub(crate) ctx: Option<Arc<CudaContext>>,
    pub(crate) ptrs: Vec<sys::CUdeviceptr>,
}

impl Drop for IpcMappings {
    fn drop(&mut self) {
        if let Some(ctx) = &self.ctx {
            let _ = ctx.bind_to_thread();
            for &p in &self.ptrs {
                // SAFETY: `p` was opened with cuIpcOpenMemHandle on this context and is closed
                // once, here, with no work left that uses it: in the group's Drop after its
                // streams drained (a stream still busy leaks these mappings instead), or on a
                // failed `ProcessRank::join`, before anything was queued.
                let _ = unsafe { driver::ipc_close(p) };
            }
        }
    }
}

pub(crate) fn kind(op: Op, path: Path) -> usize {
    match (op, path) {
        (Op::Dispatch, Path::Batched) => 0,
        (Op::Dispatch, Path::PerExpert) => 1,
        (Op::Combine, Path::Batched) => 2,
        (Op::Combine, Path::PerExpert) => 3,
    }
}

impl GpuGroup {
    /// Process mode: this process's rank.
    pub fn own_rank(&self) -> Option<usize> {
        self.own
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn num_gpus(&self) -> usize {
        self.devs.len()
    }

    pub fn blocks_per_rank(&self) -> usize {
        self.blocks_per_rank
    }

    /// "NVIDIA H200 (sm_90, 132 SMs) x 1".
    pub fn describe_devices(&self) -> String {
        let d = &self.devs[0];
        let name = d.ctx.name().unwrap_or_else(|_| "?".into());
        let (a, b) = d.ctx.compute_capability().unwrap_or((0, 0));
        format!("{name} (sm_{a}{b}, {} SMs) x {}", d.sms, self.devs.len())
    }

    /// Test hook (feature `testing`): `Some(r)` makes rank r never signal, in dispatch and in
    /// combine (its peers' waits time out).
    #[cfg(feature = "testing")]
    pub fn set_fault_rank(&mut self, rank: Option<usize>) {
        // A rank past i32 names no rank of the group (R <= MAX_RANKS), as i32::MAX does: never
        // truncated onto a real one.
        self.params.fault_rank = rank.map_or(-1, |r| i32::try_from(r).unwrap_or(i32::MAX));
    }

    /// The NCCL transport's sizing mode (see [`NcclSizes`]).
    pub fn nccl_sizes(&self) -> NcclSizes {
        self.nccl_sizes
    }

    /// Changes the NCCL sizing mode for later calls. In process mode every rank must make the
    /// same change before the same call (the two sides of a message must agree on its size):
    /// the handshake compares the modes the ranks start with, a later divergence is not
    /// detected.
    pub fn set_nccl_sizes(&mut self, sizes: NcclSizes) {
        self.nccl_sizes = sizes;
    }

    /// The format of every later combine that the group's own-buffer calls issue:
    /// [`GpuGroup::launch`] of `Op::Combine`, the harness's `combine` / `combine_rank`, and the
    /// profiles (the device API's calls name theirs: `combine_device_opts`, ...). Refused,
    /// changing nothing, where the group cannot run it ([`GpuGroup::check_combine_format`]).
    pub fn set_combine_format(&mut self, format: CombineFormat) -> Result<(), GpuError> {
        self.check_combine_format(format)?;
        self.combine_format = format;
        Ok(())
    }

    /// The format [`GpuGroup::set_combine_format`] set (bf16 until then).
    pub fn combine_format(&self) -> CombineFormat {
        self.combine_format
    }

    /// Whether this group can combine in `format`: LogFMT needs H a multiple of 128
    /// (`Error::HiddenNotMultiple` with mode "logfmt", as the CPU paths refuse it) and a group
    /// without NCCL: the NCCL transport's messages carry bf16 rows only, so a LogFMT combine of
    /// a group with NCCL peers (transport `Nccl` or `TwoTier`) is `GpuError::Unsupported`,
    /// naming both.
    pub fn check_combine_format(&self, format: CombineFormat) -> Result<(), GpuError> {
        format.check(&self.cfg)?;
        if format == CombineFormat::LogFmt && self.nccl.is_some() {
            return Err(GpuError::Unsupported(
                "a LogFMT combine (CombineFormat::LogFmt, DeepEP's use_logfmt) over NCCL: the \
                 NCCL transport carries bf16 rows only; LogFMT runs where every peer is reached \
                 through CUDA IPC / NVLink (transport Auto), or combine in bf16"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Which buffers the group allocated ([`GpuOptions::buffers`]).
    pub fn buffers(&self) -> Buffers {
        self.buffers
    }

    /// Refuses what needs the group's own E x T-row tensors where it holds none.
    pub(crate) fn own_tensors_or_err(&self, what: &str) -> Result<(), GpuError> {
        if self.buffers.own_tensors {
            return Ok(());
        }
        Err(GpuError::Unsupported(format!(
            "{what}: this group holds no tensors of its own (GpuOptions::buffers.own_tensors = \
             false); use the device API with the caller's tensors"
        )))
    }

    /// Whether the group reaches any peer through NCCL.
    pub fn uses_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// The bound of every wait.
    pub fn set_timeout_ns(&mut self, ns: u64) {
        self.params.timeout_ns = ns;
    }

    /// What the kernels have recorded so far, without waiting for them: `Ok` while nothing
    /// failed, else the error the next call would raise (naming rank, peer, phase and call for
    /// a timeout). Reads the error words' host mirrors only: no stream is synchronised, so it
    /// may be called while kernels run, e.g. to bound a caller's own wait. Unlike [`check`],
    /// it does not need the calls to have finished, and an error it sees is raised again by
    /// every later call.
    ///
    /// [`check`]: GpuGroup::check
    pub fn poll(&self) -> Result<(), GpuError> {
        self.check_usable()
    }

    /// Refuses a call on a group that failed: an error `check` or `sync` already returned, or
    /// one the kernels recorded since (read from the error words' host mirrors: no stream is
    /// synchronised, so a call enqueued behind a failed one raises at its entry).
    pub(crate) fn check_usable(&self) -> Result<(), GpuError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        match self.recorded_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn dev_of(&self, rank: usize) -> usize {
        if self.own.is_some() {
            return 0;
        }
        rank / (self.cfg.num_ranks / self.devs.len())
    }

    /// Calls launched so far per (op, path): [batched dispatch, per-expert dispatch, batched
    /// combine, per-expert combine].
    pub fn calls(&self) -> [u64; 4] {
        self.calls
    }

    /// The group's streams with their contexts, one per device (for event timing: the timing
    /// harness records its events on them).
    pub fn streams(&self) -> Vec<(Arc<CudaContext>, sys::CUstream)> {
        self.devs
            .iter()
            .map(|d| (d.ctx.clone(), d.stream))
            .collect()
    }
}

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh id for a group (handles name the group they came from).
pub(crate) fn next_group_id() -> u64 {
    NEXT_GROUP_ID.fetch_add(1, Ordering::Relaxed)
}

impl GpuGroup {
    /// Allocates every rank's buffers (R / num_gpus ranks per device), enables peer access,
    /// uploads the address table. Fails with [`Error::OutOfMemory`] (the size it needed) when a
    /// device lacks the memory.
    pub fn new(cfg: &Config, opts: GpuOptions) -> Result<GpuGroup, GpuError> {
        cfg.validate()?;
        // The rank limit before any device work (typed: GpuError::TooManyRanks).
        check_ranks(cfg.num_ranks)?;
        let g = opts.num_gpus.max(1);
        probe_devices(g).map_err(GpuError::NoDevice)?;
        let r = cfg.num_ranks;
        if !r.is_multiple_of(g) {
            return Err(GpuError::Unsupported(format!(
                "{r} ranks cannot be spread evenly over {g} GPUs"
            )));
        }
        let per = r / g;
        let mut devs = Vec::new();
        for d in 0..g {
            devs.push(Dev::new(d, d * per, per, r)?);
        }
        if opts.transport == Transport::Nccl && per != 1 {
            return Err(GpuError::Unsupported(format!(
                "Transport::Nccl needs one rank per GPU ({r} ranks on {g} GPUs): NCCL refuses two ranks on one device"
            )));
        }
        // Peer access between every pair of devices (pairs without it go through NCCL).
        let mut nccl_pairs = Vec::new();
        for a in 0..g {
            for b in 0..g {
                if a == b {
                    continue;
                }
                devs[a].bind()?;
                let can = cuda(
                    "cuDeviceCanAccessPeer",
                    driver::can_access_peer(&devs[a].ctx, &devs[b].ctx),
                )?;
                if !can {
                    if per == 1 {
                        // Transport::Auto: this pair goes through NCCL.
                        nccl_pairs.push((a, b));
                        continue;
                    }
                    return Err(GpuError::Unsupported(format!(
                        "GPU {a} cannot access GPU {b}, and NCCL needs one rank per GPU"
                    )));
                }
                // The context of `a` is bound.
                cuda(
                    "cuCtxEnablePeerAccess",
                    driver::enable_peer_access(&devs[b].ctx),
                )?;
            }
        }
        // Memory.
        let mut masks = vec![PeerMask::EMPTY; g];
        if opts.transport == Transport::Nccl {
            masks = vec![all_peers(r); g];
        }
        for &(a, b) in &nccl_pairs {
            masks[a].insert(b);
        }
        let use_nccl = masks.iter().any(|m| !m.is_empty());
        check_shrink(&opts, r, use_nccl)?;
        // Each device's build: the plain one where its ranks reach no peer through NCCL and
        // shrink mode is off.
        for (dev, mask) in devs.iter_mut().zip(&masks) {
            dev.bind()?;
            dev.load_kernels(mask.is_empty() && !opts.enable_shrink)?;
        }
        let comms = if use_nccl {
            for d in &devs {
                d.bind()?;
            }
            Some(Comms::init_all(g)?)
        } else {
            None
        };
        let need = footprint(cfg, &opts, use_nccl)?
            .checked_mul(per)
            .and_then(|b| b.checked_add(1 << 20))
            .ok_or_else(|| GpuError::Unsupported("the group's memory overflows usize".into()))?;
        for dev in &devs {
            dev.bind()?;
            let (free, _) = cuda("cuMemGetInfo", result::mem_get_info())?;
            if need > free {
                return Err(Error::OutOfMemory {
                    needed: need as u64,
                    available: free as u64,
                }
                .into());
            }
        }
        // Co-residency: every block of a launch must be resident at once.
        let smem = smem_bytes(cfg);
        let sms = devs[0].sms;
        let bpr = opts.blocks_per_rank.unwrap_or((sms / per).max(1)).max(1);
        for dev in &devs {
            dev.bind()?;
            dev.check_residency(smem, per, bpr)?;
        }
        let sizes = plan_sizes(cfg, use_nccl, opts.buffers)?;
        let mut ptrs = vec![RankPtrs::default(); r];
        for dev in devs.iter_mut() {
            dev.bind()?;
            for slot in ptrs.iter_mut().skip(dev.first_rank).take(dev.ranks) {
                let total = total_bytes(&sizes)?;
                let base = dev.alloc(total)?;
                *slot = carve_rank(base, &sizes);
            }
        }
        for dev in devs.iter_mut() {
            dev.bind()?;
            upload_table(dev, &ptrs)?;
        }
        let params = kparams(cfg, &opts, bpr, 0, per, g > 1)?;
        // Over NCCL every device runs one rank (checked above).
        let nccl = comms.map(|c| link(c, cfg, &params, &devs, &masks, &ptrs));
        Ok(GpuGroup {
            id: next_group_id(),
            cfg: *cfg,
            devs,
            ptrs,
            params,
            blocks_per_rank: bpr,
            smem,
            n_tokens: vec![0; r],
            topk: vec![Vec::new(); r],
            last_dispatch: None,
            calls: [0; 4],
            broken: None,
            masks,
            nccl,
            own: None,
            ipc_opened: IpcMappings {
                ctx: None,
                ptrs: Vec::new(),
            },
            last_op: None,
            nccl_sizes: opts.nccl_sizes,
            buffers: opts.buffers,
            combine_format: CombineFormat::Bf16,
        })
    }
}

impl GpuGroup {
    /// Process mode: the peers this rank reaches through NCCL (the rest through CUDA IPC); in a
    /// single-process group, the first device's mask.
    pub fn nccl_mask(&self) -> PeerMask {
        self.masks.first().copied().unwrap_or_default()
    }

    /// One all-zero IoTable per device, as long as its build takes (the group's own buffers).
    pub(crate) fn io_tables(&self) -> Vec<IoTable> {
        self.devs
            .iter()
            .map(|d| IoTable::new(d.variant.io_capacity()))
            .collect()
    }
}

/// Shrink mode's limit: no NCCL peer (an NCCL receive is not bounded by the kernels, so a lost
/// peer could not be detected and masked). Any number of ranks up to the kernels' limit (the
/// wide build keeps a call's masked peers in MAX_RANKS / 32 words).
pub(crate) fn check_shrink(opts: &GpuOptions, ranks: usize, nccl: bool) -> Result<(), GpuError> {
    if !opts.enable_shrink {
        return Ok(());
    }
    if nccl {
        return Err(GpuError::Unsupported(
            "shrink mode with NCCL peers: NCCL receives are not bounded by the kernels' waits,              so a lost peer cannot be masked (use CUDA IPC / peer access within a node)"
                .into(),
        ));
    }
    check_ranks(ranks)
}

/// The NCCL transport over `comms` of a group whose device i runs the rank `devs[i].first_rank`
/// with the NCCL peers `masks[i]`.
pub(crate) fn link(
    comms: Comms,
    cfg: &Config,
    params: &KParams,
    devs: &[Dev],
    masks: &[PeerMask],
    ptrs: &[RankPtrs],
) -> Link {
    let devices = devs
        .iter()
        .zip(masks)
        .map(|(d, m)| {
            let peers = (0..cfg.num_ranks).filter(|&p| m.contains(p)).collect();
            (d.ctx.clone(), d.first_rank, peers, ptrs[d.first_rank])
        })
        .collect();
    let entry_bytes = (params.entry_bytes as usize, params.pe_entry_bytes as usize);
    Link::new(comms, cfg, entry_bytes, devices)
}

/// Uploads the rank address table to `dev` (the bound context) and allocates its error word.
pub(crate) fn upload_table(dev: &mut Dev, ptrs: &[RankPtrs]) -> Result<(), GpuError> {
    let table = dev.alloc(std::mem::size_of_val(ptrs))?;
    // SAFETY: `table` holds ptrs.len() RankPtrs; RankPtrs is plain old data.
    cuda("upload table", unsafe {
        result::memcpy_htod_sync(table, ptrs)
    })?;
    dev.table = table;
    dev.err = dev.alloc(4 * ERR_WORDS)?;
    dev.err_host = HostMirror::alloc()?;
    Ok(())
}

/// The kernel parameters of a group: `ranks_here` ranks from `rank_base` on each device,
/// system-scope fences where ranks span GPUs or processes (`sys_scope`).
pub(crate) fn kparams(
    cfg: &Config,
    opts: &GpuOptions,
    bpr: usize,
    rank_base: usize,
    ranks_here: usize,
    sys_scope: bool,
) -> Result<KParams, GpuError> {
    let (fp8, round_scale, ue8m0) = match cfg.mode {
        Mode::Bf16 => (0, 0, 0),
        Mode::Fp8 { round_scale, ue8m0 } => (1, round_scale as i32, ue8m0 as i32),
    };
    // Every `as i32` below is in range: the config bounds E, T and H by 65536 and a row's bytes
    // by i32::MAX (Config::validate), the kernels take R <= MAX_RANKS (256), and blocks per rank are
    // at most the device's SMs (checked against the occupancy calculator).
    Ok(KParams {
        timeout_ns: opts.timeout_ns,
        r: cfg.num_ranks as i32,
        e: cfg.num_experts as i32,
        l: cfg.num_local_experts() as i32,
        t: cfg.max_tokens_per_rank as i32,
        h: cfg.hidden as i32,
        k: cfg.top_k as i32,
        fp8,
        round_scale,
        ue8m0,
        rank_base: rank_base as i32,
        ranks_here: ranks_here as i32,
        blocks_per_rank: bpr as i32,
        xrow: cfg.recv_x_row_bytes() as i32,
        spr: cfg.scales_per_row() as i32,
        entry_bytes: to_i32("entry bytes", entry_bytes_checked(cfg)?)?,
        pe_entry_bytes: to_i32("per-expert entry bytes", pe_entry_bytes_checked(cfg)?)?,
        fault_rank: -1,
        sys_scope: sys_scope as i32,
        zero_copy: opts.zero_copy_local as i32,
        trap: opts.trap_on_error as i32,
        shrink: opts.enable_shrink as i32,
        scol: opts.scales_column_major as i32,
        cmb_row: cmb_row_bytes(cfg, CombineFormat::Bf16)?,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::layout::MAX_RANKS;
    use crate::runtime::process::ProcessRank;

    /// Past the kernels' limit every way of forming a group fails with the typed error, before
    /// any device work (so this runs on a machine without a GPU); up to it the limit is not
    /// what refuses (without a GPU: NoDevice).
    #[test]
    fn past_256_ranks_is_a_typed_error_before_any_device_work() {
        let too_many = Config::new(MAX_RANKS + 1, MAX_RANKS + 1, 8, 128, 2, Mode::Bf16).unwrap();
        let want = GpuError::TooManyRanks {
            ranks: 257,
            max: 256,
        };
        assert_eq!(
            GpuGroup::new(&too_many, GpuOptions::default()).err(),
            Some(want.clone())
        );
        assert_eq!(
            ProcessRank::check(&too_many, 0, 0).err(),
            Some(want.clone())
        );
        let shrink = GpuOptions {
            enable_shrink: true,
            ..GpuOptions::default()
        };
        assert_eq!(check_shrink(&shrink, 257, false).err(), Some(want));
        // Shrink mode takes every size up to the limit now (one word per 32 peers).
        assert!(check_shrink(&shrink, 256, false).is_ok());
        assert!(check_shrink(&shrink, 64, true).is_err()); // NCCL peers, as before
        let fits = Config::new(MAX_RANKS, MAX_RANKS, 8, 128, 2, Mode::Bf16).unwrap();
        if probe_devices(1).is_err() {
            assert!(matches!(
                GpuGroup::new(&fits, GpuOptions::default()),
                Err(GpuError::NoDevice(_))
            ));
        }
        assert!(
            GpuError::TooManyRanks {
                ranks: 300,
                max: 256
            }
            .to_string()
                == "300 ranks; the GPU kernels support at most 256"
        );
    }
}
