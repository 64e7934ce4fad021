//! The GPU runtime: contexts, peer access, communication buffers, the rank-address table, and
//! the launches of both paths.
//!
//! Ranks are spread over `num_gpus` devices (R / G consecutive ranks per device). All ranks of one
//! device run in ONE launch (`blocks_per_rank` blocks each, at most one block per multiprocessor,
//! so every block is resident at once and ranks may wait for one another). Every buffer a peer
//! writes comes from `cuMemAlloc` (not cudarc's stream-ordered pool, which peers cannot reach).
//! Signals carry the call's epoch (kept on the device, advanced by the kernels themselves), so a
//! call never takes an earlier call's signal and no host value changes between calls: a call is a
//! single kernel launch per device with no host synchronisation, and can be captured in a graph.
//! Every wait is bounded by `%globaltimer`; a wait that runs out writes (rank, peer, phase, call)
//! to a host-visible error word and the kernel exits; the host turns it into
//! [`ep_reference::Error::Timeout`].

use crate::compile::{self, Family};
use crate::GpuError;
use cudarc::driver::{result, sys, CudaContext};
use ep_reference::{
    input::{check_combine_inputs, check_dispatch_inputs},
    Config, DispatchOutput, Error, Mode, Op, Phase, RecvScales, RecvX, Side,
};
use half::bf16;
use std::ffi::c_void;
use std::sync::Arc;

/// Which of the two transports to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// One message per selection, one signal per (expert, source).
    PerExpert,
    /// One deduplicated batch and one signal per (source, destination).
    Batched,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::PerExpert => "per-expert",
            Path::Batched => "batched",
        }
    }
}

/// Threads per block (NTHREADS in common.cuh).
pub const NTHREADS: u32 = 512;
const HDR_BYTES: usize = 80;
const PE_HDR: usize = 16;
const MAX_RANKS: usize = 32;

/// Every device address of one rank (`struct RankPtrs` in common.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RankPtrs {
    x: u64,
    topk: u64,
    weights: u64,
    y: u64,
    meta: u64,
    recv_x: u64,
    recv_scales: u64,
    recv_count: u64,
    layout: u64,
    src_info: u64,
    out: u64,
    row_tk: u64,
    comb_map: u64,
    comb_pos: u64,
    comb_cnt: u64,
    bat_buf: u64,
    bat_meta: u64,
    pe_buf: u64,
    cmb_buf: u64,
    sig: u64,
    state: u64,
    bat_cnt: u64,
    snd_buf: u64,
    snd_hdr: u64,
    rcv_hdr: u64,
}

/// Kernel parameters (`struct KParams` in common.cuh), passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KParams {
    pub table: u64,
    pub err: u64,
    pub timeout_ns: u64,
    pub r: i32,
    pub e: i32,
    pub l: i32,
    pub t: i32,
    pub h: i32,
    pub k: i32,
    pub fp8: i32,
    pub round_scale: i32,
    pub ue8m0: i32,
    pub rank_base: i32,
    pub ranks_here: i32,
    pub blocks_per_rank: i32,
    pub xrow: i32,
    pub spr: i32,
    pub entry_bytes: i32,
    pub pe_entry_bytes: i32,
    pub fault_rank: i32,
    pub sys_scope: i32,
    pub zero_copy: i32,
    pub pad1: i32,
    pub prof: u64,
    pub nccl_mask: u32,
    pub stage: i32,
}

/// Byte sizes of one rank's buffers, in the order of [`RankPtrs`].
fn rank_sizes(c: &Config, nccl: bool) -> [usize; 25] {
    let (r, e, l, t, h, k) = (
        c.num_ranks,
        c.num_experts,
        c.num_local_experts(),
        c.max_tokens_per_rank,
        c.hidden,
        c.top_k,
    );
    let rt = r * t;
    [
        t * h * 2,                                // x
        t * k * 8,                                // topk
        t * k * 4,                                // weights
        l * rt * h * 2,                           // y
        16,                                       // meta
        l * rt * c.recv_x_row_bytes(),            // recv_x
        (l * rt * c.scales_per_row() * 4).max(4), // recv_scales
        l * 4,                                    // recv_count
        l * r * 8,                                // layout
        l * rt * 4,                               // src_info
        t * h * 2,                                // out
        l * rt * 4,                               // row_tk
        r * t * k * 4,                            // comb_map
        t * k * 4,                                // comb_pos
        r * 4,                                    // comb_cnt
        r * t * entry_bytes(c),                   // bat_buf
        r * 8,                                    // bat_meta
        l * r * t * pe_entry_bytes(c),            // pe_buf
        r * t * k * h * 2,                        // cmb_buf
        (6 * r + l * r + e) * 8,                  // sig
        64,                                       // state
        r * l * 4,                                // bat_cnt
        if nccl {
            (r * t * entry_bytes(c)).max(r * t * k * h * 2) // snd_buf
        } else {
            16
        },
        r * (2 + l) * 4, // snd_hdr
        r * (2 + l) * 4, // rcv_hdr
    ]
}

fn align(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// Bytes of one batched-dispatch entry: 64-byte header + payload, 16-aligned.
pub fn entry_bytes(c: &Config) -> usize {
    align(HDR_BYTES + c.payload_bytes(), 16)
}
/// Bytes of one per-expert message: 16-byte header + payload, 16-aligned.
pub fn pe_entry_bytes(c: &Config) -> usize {
    align(PE_HDR + c.payload_bytes(), 16)
}

/// Device memory one rank needs.
pub fn bytes_per_rank(c: &Config) -> usize {
    bytes_per_rank_with(c, false)
}

/// Device memory one rank needs, with the NCCL staging buffer when `nccl`.
pub fn bytes_per_rank_with(c: &Config, nccl: bool) -> usize {
    rank_sizes(c, nccl).iter().map(|&s| align(s, 256)).sum()
}

/// Dynamic shared memory of every kernel (the `Smem` carve-up in common.cuh).
fn smem_bytes(c: &Config) -> usize {
    let (r, t, k, e, l) = (
        c.num_ranks,
        c.max_tokens_per_rank,
        c.top_k,
        c.num_experts,
        c.num_local_experts(),
    );
    let w = t.div_ceil(32);
    // rowp (T*K u64), sk, sdl, tokpos, selpos, tot, scratch, m_a/b/c, bm, pw, cls, beg, rcnt
    4 * (2 * t * k
        + 2 * t * k
        + 2 * t * r
        + 2 * r
        + 32
        + 3 * NTHREADS as usize
        + 2 * e * w
        + 2 * l * r
        + 80)
}

fn cuda<T>(what: &str, r: Result<T, result::DriverError>) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Cuda(format!("{what}: {e:?}")))
}

/// A usable CUDA driver and at least `need` devices, or why not. Never panics.
pub fn probe_devices(need: usize) -> Result<usize, String> {
    // SAFETY: only tries to dlopen libcuda and reports whether that worked.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda not found)".into());
    }
    if !compile::nvrtc_present() {
        return Err("no NVRTC (libnvrtc not found on LD_LIBRARY_PATH)".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e:?}"))? as usize;
    if n < need {
        return Err(format!("{n} CUDA device(s), {need} needed"));
    }
    Ok(n)
}

/// The loaded kernels of one device.
struct Funcs {
    fp8: sys::CUfunction,
    empty: sys::CUfunction,
    pe_dispatch: sys::CUfunction,
    pe_combine: sys::CUfunction,
    bat_dispatch: sys::CUfunction,
    bat_combine: sys::CUfunction,
}

/// One GPU: its context, stream, modules and the table of every rank's addresses.
struct Dev {
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    funcs: Funcs,
    modules: Vec<sys::CUmodule>,
    table: sys::CUdeviceptr,
    err: sys::CUdeviceptr,
    sms: usize,
    first_rank: usize,
    ranks: usize,
    allocs: Vec<sys::CUdeviceptr>,
}

fn load_family(f: &Family, arch: &str) -> Result<(sys::CUmodule, Vec<sys::CUfunction>), GpuError> {
    let cubin = compile::cubin(f, arch)?;
    // SAFETY: `cubin` is a complete CUBIN image produced by NVRTC for this device's arch; the
    // right context is bound by the caller.
    let module = cuda("cuModuleLoadData", unsafe {
        result::module::load_data(cubin.as_ptr().cast())
    })?;
    let mut fs = Vec::new();
    for k in f.kernels {
        let name = std::ffi::CString::new(*k).expect("kernel names have no NUL");
        // SAFETY: `module` was just loaded; `name` is a kernel it defines.
        fs.push(cuda(k, unsafe {
            result::module::get_function(module, name)
        })?);
    }
    Ok((module, fs))
}

impl Dev {
    fn new(ordinal: usize, first_rank: usize, ranks: usize) -> Result<Dev, GpuError> {
        let ctx = cuda("context", CudaContext::new(ordinal))?;
        cuda("bind", ctx.bind_to_thread())?;
        let (major, minor) = cuda("compute capability", ctx.compute_capability())?;
        let arch = format!("sm_{major}{minor}");
        let sms = cuda(
            "SM count",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )? as usize;
        let mut modules = Vec::new();
        let mut all = Vec::new();
        for f in [compile::FP8, compile::PER_EXPERT, compile::BATCHED] {
            let (m, fs) = load_family(&f, &arch)?;
            modules.push(m);
            all.extend(fs);
        }
        let funcs = Funcs {
            fp8: all[0],
            empty: all[1],
            pe_dispatch: all[2],
            pe_combine: all[3],
            bat_dispatch: all[4],
            bat_combine: all[5],
        };
        let stream = cuda(
            "stream",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        Ok(Dev {
            ctx,
            stream,
            funcs,
            modules,
            table: 0,
            err: 0,
            sms,
            first_rank,
            ranks,
            allocs: Vec::new(),
        })
    }

    /// Sets every kernel's dynamic shared memory to `smem` bytes and checks that `ranks` x
    /// `blocks_per_rank` blocks of each can be resident at once (one launch holds every rank of
    /// this device, and its blocks wait on each other). Binds nothing: call after [`Dev::bind`].
    fn check_residency(
        &self,
        smem: usize,
        ranks: usize,
        blocks_per_rank: usize,
    ) -> Result<(), GpuError> {
        for f in [
            self.funcs.pe_dispatch,
            self.funcs.pe_combine,
            self.funcs.bat_dispatch,
            self.funcs.bat_combine,
        ] {
            if smem > 48 * 1024 {
                // SAFETY: `f` is a loaded kernel of the bound context.
                let rc = unsafe {
                    sys::cuFuncSetAttribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                };
                cuda("cuFuncSetAttribute", rc.result())?;
            }
            let mut per_sm = 0i32;
            // SAFETY: `f` is a loaded kernel; `per_sm` receives the answer.
            let rc = unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut per_sm,
                    f,
                    NTHREADS as i32,
                    smem,
                )
            };
            cuda("occupancy", rc.result())?;
            if per_sm < 1 || ranks * blocks_per_rank > self.sms * per_sm as usize {
                return Err(GpuError::Unsupported(format!(
                    "{ranks} ranks x {blocks_per_rank} blocks cannot be resident together on a GPU \
                     with {} SMs ({per_sm} blocks/SM at {smem} bytes of shared memory)",
                    self.sms
                )));
            }
        }
        Ok(())
    }

    fn bind(&self) -> Result<(), GpuError> {
        cuda("bind", self.ctx.bind_to_thread())
    }

    fn alloc(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, GpuError> {
        // SAFETY: the context of this device is bound; plain cuMemAlloc memory (reachable by
        // peers once peer access is on), freed in Drop.
        let p = cuda("cuMemAlloc", unsafe { result::malloc_sync(bytes.max(16)) })?;
        self.allocs.push(p);
        // SAFETY: `p` is a fresh allocation of at least `bytes` bytes on the bound context.
        cuda("memset", unsafe {
            result::memset_d8_sync(p, 0, bytes.max(16))
        })?;
        Ok(p)
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: all work on this device is finished (synchronised below) before anything is
        // freed; the pointers and handles were created on this context and are not used again.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            for &p in &self.allocs {
                let _ = result::free_sync(p);
            }
            for &m in &self.modules {
                let _ = result::module::unload(m);
            }
            let _ = result::stream::destroy(self.stream);
        }
    }
}

/// How the batched path reaches a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// NVLink (peer access, or CUDA IPC between processes) for every peer that shares it, NCCL
    /// for the others (one rank per GPU needed there).
    #[default]
    Auto,
    /// NCCL for every peer, this rank itself included (one rank per GPU: NCCL refuses two ranks
    /// on one device). Batched path only; the per-expert path refuses it.
    Nccl,
}

/// Process mode's exchange: every rank's blob, in rank order (e.g. `Rendezvous::all_gather`).
pub type AllGather<'a> = dyn FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String> + 'a;

/// Options of a [`GpuGroup`].
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// Devices to spread the ranks over (R % num_gpus == 0).
    pub num_gpus: usize,
    /// Bound of every wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Blocks per rank; None: the multiprocessors of a device divided among its ranks.
    pub blocks_per_rank: Option<usize>,
    /// Batched combine: a source reads the rows of owners on its own GPU in place instead of
    /// receiving them as a put (signals unchanged). Peers on other GPUs always get the put.
    pub zero_copy_local: bool,
    /// Which transport the batched path uses per peer pair.
    pub transport: Transport,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            num_gpus: 1,
            timeout_ns: 2_000_000_000,
            blocks_per_rank: None,
            zero_copy_local: true,
            transport: Transport::Auto,
        }
    }
}

/// R ranks on one or more GPUs: the communication buffers, and dispatch/combine on both paths.
pub struct GpuGroup {
    cfg: Config,
    devs: Vec<Dev>,
    ptrs: Vec<RankPtrs>,
    params: KParams,
    blocks_per_rank: usize,
    smem: usize,
    n_tokens: Vec<usize>,
    topk: Vec<Vec<i64>>,
    last_dispatch: Option<Path>,
    calls: [u64; 4],
    broken: Option<GpuError>,
    /// Per device: bit d set when its rank reaches peer d through NCCL.
    masks: Vec<u32>,
    /// The NCCL communicators (one per device) when any mask is nonzero.
    comms: Option<crate::nccl::Comms>,
    /// Per device, from the last dispatch's headers: selections sent to each peer (rows that
    /// come back in combine) and received from each peer (rows that go back).
    sels: Vec<(Vec<usize>, Vec<usize>)>,
    /// Process mode: the one rank this process runs (its table holds the peers' IPC addresses).
    own: Option<usize>,
    /// Peer allocations opened through CUDA IPC (closed on drop).
    ipc_opened: Vec<sys::CUdeviceptr>,
    last_op: Option<Op>,
}

impl Drop for GpuGroup {
    fn drop(&mut self) {
        // [nccl hook, issue 10 item 5] Communicators go before the streams and memory they use:
        // a bounded wait for the streams, then destroy (idle, healthy) or abort (busy, failed).
        if let Some(c) = self.comms.take() {
            let t = std::time::Duration::from_nanos(self.params.timeout_ns);
            c.release(&self.streams(), t, self.broken.is_none());
        }
        for dev in &self.devs {
            let _ = dev.bind();
            // SAFETY: the stream belongs to the bound context.
            let _ = unsafe { result::stream::synchronize(dev.stream) };
        }
        if let Some(d) = self.devs.first() {
            let _ = d.bind();
            for &p in &self.ipc_opened {
                // SAFETY: `p` was opened with cuIpcOpenMemHandle on this context; work is done.
                let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
            }
        }
    }
}

/// The addresses of one rank's buffers inside its one allocation at `base`.
fn carve_rank(base: u64, sizes: &[usize; 25]) -> RankPtrs {
    let mut f = [0u64; 25];
    let mut off = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        f[i] = base + off;
        off += align(s, 256) as u64;
    }
    RankPtrs {
        x: f[0],
        topk: f[1],
        weights: f[2],
        y: f[3],
        meta: f[4],
        recv_x: f[5],
        recv_scales: f[6],
        recv_count: f[7],
        layout: f[8],
        src_info: f[9],
        out: f[10],
        row_tk: f[11],
        comb_map: f[12],
        comb_pos: f[13],
        comb_cnt: f[14],
        bat_buf: f[15],
        bat_meta: f[16],
        pe_buf: f[17],
        cmb_buf: f[18],
        sig: f[19],
        state: f[20],
        bat_cnt: f[21],
        snd_buf: f[22],
        snd_hdr: f[23],
        rcv_hdr: f[24],
    }
}

/// The peer mask of a rank that reaches every rank in 0..r through NCCL.
fn all_peers(r: usize) -> u32 {
    if r >= 32 {
        u32::MAX
    } else {
        (1u32 << r) - 1
    }
}

fn kind(op: Op, path: Path) -> usize {
    match (op, path) {
        (Op::Dispatch, Path::Batched) => 0,
        (Op::Dispatch, Path::PerExpert) => 1,
        (Op::Combine, Path::Batched) => 2,
        (Op::Combine, Path::PerExpert) => 3,
    }
}

impl GpuGroup {
    /// Allocates every rank's buffers (R / num_gpus ranks per device), enables peer access,
    /// uploads the address table. Fails with [`Error::OutOfMemory`] (the size it needed) when a
    /// device lacks the memory.
    pub fn new(cfg: &Config, opts: GpuOptions) -> Result<GpuGroup, GpuError> {
        cfg.validate()?;
        let g = opts.num_gpus.max(1);
        probe_devices(g).map_err(GpuError::NoDevice)?;
        let r = cfg.num_ranks;
        if r > MAX_RANKS {
            return Err(GpuError::Unsupported(format!(
                "{r} ranks; the GPU kernels support at most {MAX_RANKS}"
            )));
        }
        if r % g != 0 {
            return Err(GpuError::Unsupported(format!(
                "{r} ranks cannot be spread evenly over {g} GPUs"
            )));
        }
        let per = r / g;
        let mut devs = Vec::new();
        for d in 0..g {
            devs.push(Dev::new(d, d * per, per)?);
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
                let mut can = 0i32;
                // SAFETY: valid device handles; `can` receives the answer.
                let rc = unsafe {
                    sys::cuDeviceCanAccessPeer(
                        &mut can,
                        devs[a].ctx.cu_device(),
                        devs[b].ctx.cu_device(),
                    )
                };
                cuda("cuDeviceCanAccessPeer", rc.result())?;
                if can == 0 {
                    if per == 1 {
                        // Transport::Auto: this pair goes through NCCL.
                        nccl_pairs.push((a, b));
                        continue;
                    }
                    return Err(GpuError::Unsupported(format!(
                        "GPU {a} cannot access GPU {b}, and NCCL needs one rank per GPU"
                    )));
                }
                // SAFETY: the context of `a` is bound; `b`'s context is live.
                let rc = unsafe { sys::cuCtxEnablePeerAccess(devs[b].ctx.cu_ctx(), 0) };
                if rc != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                    cuda("cuCtxEnablePeerAccess", rc.result())?;
                }
            }
        }
        // Memory.
        let mut masks = vec![0u32; g];
        if opts.transport == Transport::Nccl {
            masks = vec![all_peers(r); g];
        }
        for &(a, b) in &nccl_pairs {
            masks[a] |= 1 << b;
        }
        let use_nccl = masks.iter().any(|&m| m != 0);
        let comms = if use_nccl {
            for d in &devs {
                d.bind()?;
            }
            Some(crate::nccl::Comms::init_all(g)?)
        } else {
            None
        };
        let need = bytes_per_rank_with(cfg, use_nccl) * per + (1 << 20);
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
        let sizes = rank_sizes(cfg, use_nccl);
        let mut ptrs = vec![RankPtrs::default(); r];
        for dev in devs.iter_mut() {
            dev.bind()?;
            for slot in ptrs.iter_mut().skip(dev.first_rank).take(dev.ranks) {
                let total: usize = sizes.iter().map(|&s| align(s, 256)).sum();
                let base = dev.alloc(total)?;
                *slot = carve_rank(base, &sizes);
            }
        }
        for dev in devs.iter_mut() {
            dev.bind()?;
            let table = dev.alloc(std::mem::size_of::<RankPtrs>() * r)?;
            // SAFETY: `table` holds R RankPtrs; RankPtrs is plain old data.
            cuda("upload table", unsafe {
                result::memcpy_htod_sync(table, &ptrs)
            })?;
            dev.table = table;
            dev.err = dev.alloc(32)?;
        }
        let (fp8, round_scale, ue8m0) = match cfg.mode {
            Mode::Bf16 => (0, 0, 0),
            Mode::Fp8 { round_scale, ue8m0 } => (1, round_scale as i32, ue8m0 as i32),
        };
        let params = KParams {
            table: 0,
            err: 0,
            timeout_ns: opts.timeout_ns,
            r: r as i32,
            e: cfg.num_experts as i32,
            l: cfg.num_local_experts() as i32,
            t: cfg.max_tokens_per_rank as i32,
            h: cfg.hidden as i32,
            k: cfg.top_k as i32,
            fp8,
            round_scale,
            ue8m0,
            rank_base: 0,
            ranks_here: per as i32,
            blocks_per_rank: bpr as i32,
            xrow: cfg.recv_x_row_bytes() as i32,
            spr: cfg.scales_per_row() as i32,
            entry_bytes: entry_bytes(cfg) as i32,
            pe_entry_bytes: pe_entry_bytes(cfg) as i32,
            fault_rank: -1,
            sys_scope: (g > 1) as i32,
            zero_copy: opts.zero_copy_local as i32,
            pad1: 0,
            prof: 0,
            nccl_mask: 0,
            stage: 0,
        };
        Ok(GpuGroup {
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
            sels: vec![(vec![0; r], vec![0; r]); g],
            masks,
            comms,
            own: None,
            ipc_opened: Vec::new(),
            last_op: None,
        })
    }

    /// Process mode: this process runs rank `rank` of `cfg.num_ranks` on GPU `ordinal`. Every
    /// rank allocates its buffers in one cuMemAlloc allocation; `all_gather` (e.g.
    /// `ep_launch::Rendezvous::all_gather`) exchanges a blob per rank: the allocation's CUDA IPC
    /// handle (Transport::Auto: every peer is reached through CUDA IPC and the NVLink kernels run
    /// between processes exactly as between ranks of one process) and, from rank 0, the NCCL
    /// unique id (Transport::Nccl: every peer, self included, through NCCL; no IPC).
    /// All ranks must call it with the same config and options.
    pub fn new_process(
        cfg: &Config,
        opts: GpuOptions,
        rank: usize,
        ordinal: usize,
        all_gather: &mut AllGather<'_>,
    ) -> Result<GpuGroup, GpuError> {
        cfg.validate()?;
        probe_devices(ordinal + 1).map_err(GpuError::NoDevice)?;
        let r = cfg.num_ranks;
        if r > MAX_RANKS || rank >= r {
            return Err(GpuError::Unsupported(format!(
                "rank {rank} of {r} (at most {MAX_RANKS} ranks)"
            )));
        }
        let nccl = opts.transport == Transport::Nccl;
        let mut dev = Dev::new(ordinal, rank, 1)?;
        let smem = smem_bytes(cfg);
        let bpr = opts.blocks_per_rank.unwrap_or(dev.sms).max(1);
        dev.check_residency(smem, 1, bpr)?;
        let need = bytes_per_rank_with(cfg, nccl) + (1 << 20);
        let (free, _) = cuda("cuMemGetInfo", result::mem_get_info())?;
        if need > free {
            return Err(Error::OutOfMemory {
                needed: need as u64,
                available: free as u64,
            }
            .into());
        }
        let sizes = rank_sizes(cfg, nccl);
        let total: usize = sizes.iter().map(|&s| align(s, 256)).sum();
        let base = dev.alloc(total)?; // zeroed before its handle leaves this process
        let mut blob = vec![0u8; 64];
        if !nccl {
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: `base` is a cuMemAlloc allocation of the bound context.
            cuda(
                "cuIpcGetMemHandle",
                unsafe { sys::cuIpcGetMemHandle(&mut h, base) }.result(),
            )?;
            for (d, &b) in blob.iter_mut().zip(h.reserved.iter()) {
                *d = b as u8;
            }
        } else if rank == 0 {
            blob.extend(crate::nccl::unique_id()?);
        }
        // [handshake hook, issue 10 item 4] Versions, config, transport and allocation size
        // travel with the handle; every peer is checked before anything is mapped.
        let hello = crate::handshake::Hello::new(cfg, &opts, rank, total);
        let all = crate::handshake::exchange(all_gather, &hello, &blob)?;
        if all.len() != r || all.iter().any(|b| b.len() < 64) {
            return Err(GpuError::Process(format!(
                "handle exchange returned {} blobs, want {r} of at least 64 bytes",
                all.len()
            )));
        }
        let mut ptrs = vec![RankPtrs::default(); r];
        ptrs[rank] = carve_rank(base, &sizes);
        let mut ipc_opened = Vec::new();
        let comms = if nccl {
            let t = std::time::Duration::from_nanos(opts.timeout_ns); // [nccl hook, item 5]
            Some(crate::nccl::Comms::init_rank(r, rank, &all[0][64..], t)?)
        } else {
            for (peer, b) in all.iter().enumerate() {
                if peer == rank {
                    continue;
                }
                let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
                for (d, &x) in h.reserved.iter_mut().zip(&b[..64]) {
                    *d = x as _;
                }
                let mut p: sys::CUdeviceptr = 0;
                // SAFETY: `h` is the handle rank `peer` exported for its live allocation; the
                // opened mapping is closed in Drop.
                let rc = unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut p,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                };
                cuda(
                    &format!("cuIpcOpenMemHandle (rank {rank}, peer {peer})"),
                    rc.result(),
                )?;
                crate::handshake::check_mapping(rank, peer, p, total)?; // [handshake hook]
                ipc_opened.push(p);
                ptrs[peer] = carve_rank(p, &sizes);
            }
            None
        };
        let table = dev.alloc(std::mem::size_of::<RankPtrs>() * r)?;
        // SAFETY: `table` holds R RankPtrs; RankPtrs is plain old data.
        cuda("upload table", unsafe {
            result::memcpy_htod_sync(table, &ptrs)
        })?;
        dev.table = table;
        dev.err = dev.alloc(32)?;
        let (fp8, round_scale, ue8m0) = match cfg.mode {
            Mode::Bf16 => (0, 0, 0),
            Mode::Fp8 { round_scale, ue8m0 } => (1, round_scale as i32, ue8m0 as i32),
        };
        let params = KParams {
            timeout_ns: opts.timeout_ns,
            r: r as i32,
            e: cfg.num_experts as i32,
            l: cfg.num_local_experts() as i32,
            t: cfg.max_tokens_per_rank as i32,
            h: cfg.hidden as i32,
            k: cfg.top_k as i32,
            fp8,
            round_scale,
            ue8m0,
            rank_base: rank as i32,
            ranks_here: 1,
            blocks_per_rank: bpr as i32,
            xrow: cfg.recv_x_row_bytes() as i32,
            spr: cfg.scales_per_row() as i32,
            entry_bytes: entry_bytes(cfg) as i32,
            pe_entry_bytes: pe_entry_bytes(cfg) as i32,
            fault_rank: -1,
            sys_scope: 1,
            zero_copy: opts.zero_copy_local as i32,
            ..Default::default()
        };
        Ok(GpuGroup {
            cfg: *cfg,
            devs: vec![dev],
            ptrs,
            params,
            blocks_per_rank: bpr,
            smem,
            n_tokens: vec![0; r],
            topk: vec![Vec::new(); r],
            last_dispatch: None,
            calls: [0; 4],
            broken: None,
            masks: vec![if nccl { all_peers(r) } else { 0 }],
            comms,
            sels: vec![(vec![0; r], vec![0; r])],
            own: Some(rank),
            ipc_opened,
            last_op: None,
        })
    }

    /// Process mode: this process's rank.
    pub fn own_rank(&self) -> Option<usize> {
        self.own
    }

    fn own_or_err(&self) -> Result<usize, GpuError> {
        self.own.ok_or_else(|| {
            GpuError::Unsupported("dispatch_rank/combine_rank need a group from new_process".into())
        })
    }

    /// Process mode: uploads this rank's dispatch inputs (checked), launches, waits, reads back.
    pub fn dispatch_rank(
        &mut self,
        path: Path,
        x: &[bf16],
        topk_idx: &[i64],
    ) -> Result<DispatchOutput, GpuError> {
        self.upload_rank_dispatch(x, topk_idx)?;
        self.launch(Op::Dispatch, path)?;
        self.sync()?;
        self.read_dispatch_output(self.own_or_err()?)
    }

    /// Process mode: uploads this rank's dispatch inputs (checked). Nothing is launched.
    pub fn upload_rank_dispatch(&mut self, x: &[bf16], topk_idx: &[i64]) -> Result<(), GpuError> {
        self.check_usable()?;
        let r = self.own_or_err()?;
        let n = check_dispatch_inputs(&self.cfg, r, x.len(), topk_idx)?;
        let p = self.ptrs[r];
        self.devs[0].bind()?;
        let meta = [n as i32, 0, 0, 0];
        // SAFETY: the buffers hold T rows (n <= T checked) on the bound context.
        unsafe {
            if n > 0 {
                cuda("upload x", result::memcpy_htod_sync(p.x, x))?;
                cuda("upload topk", result::memcpy_htod_sync(p.topk, topk_idx))?;
            }
            cuda("upload meta", result::memcpy_htod_sync(p.meta, &meta))?;
        }
        self.n_tokens[r] = n;
        self.topk[r] = topk_idx.to_vec();
        self.finish_uploads()
    }

    /// Process mode: uploads this rank's combine inputs (checked against the last dispatch).
    pub fn upload_rank_combine(&mut self, y: &[bf16], w: &[f32]) -> Result<(), GpuError> {
        self.check_usable()?;
        let r = self.own_or_err()?;
        check_combine_inputs(&self.cfg, r, y.len(), &self.topk[r], w.len())?;
        let p = self.ptrs[r];
        self.devs[0].bind()?;
        // SAFETY: y holds L*R*T*H values, w n*K (checked); buffers sized so, bound context.
        unsafe {
            cuda("upload y", result::memcpy_htod_sync(p.y, y))?;
            if !w.is_empty() {
                cuda("upload weights", result::memcpy_htod_sync(p.weights, w))?;
            }
        }
        self.finish_uploads()
    }

    /// Process mode: combine of this rank (after a dispatch on the same path).
    pub fn combine_rank(
        &mut self,
        path: Path,
        y: &[bf16],
        w: &[f32],
    ) -> Result<Vec<bf16>, GpuError> {
        self.check_combine_path(path)?;
        self.upload_rank_combine(y, w)?;
        self.launch(Op::Combine, path)?;
        self.sync()?;
        self.read_combine_output(self.own_or_err()?)
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

    /// Test hook: `Some(r)` makes rank r never signal in dispatch (its peers' waits time out).
    #[doc(hidden)]
    pub fn set_fault_rank(&mut self, rank: Option<usize>) {
        self.params.fault_rank = rank.map(|r| r as i32).unwrap_or(-1);
    }
    /// The bound of every wait.
    pub fn set_timeout_ns(&mut self, ns: u64) {
        self.params.timeout_ns = ns;
    }

    fn check_usable(&self) -> Result<(), GpuError> {
        match &self.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Uploads every rank's dispatch inputs (checked first). Nothing is launched.
    pub fn upload_dispatch_inputs(
        &mut self,
        x: &[Vec<bf16>],
        topk_idx: &[Vec<i64>],
    ) -> Result<(), GpuError> {
        let cfg = self.cfg;
        if self.own.is_some() {
            return Err(GpuError::Unsupported(
                "a process-mode group holds one rank: use upload_rank_dispatch".into(),
            ));
        }
        if x.len() != cfg.num_ranks || topk_idx.len() != cfg.num_ranks {
            return Err(Error::ShapeMismatch {
                rank: 0,
                tensor: "inputs",
                expected: cfg.num_ranks,
                got: x.len().min(topk_idx.len()),
                shape: "one x and one topk_idx per rank".into(),
            }
            .into());
        }
        let mut ns = Vec::with_capacity(cfg.num_ranks);
        for r in 0..cfg.num_ranks {
            ns.push(check_dispatch_inputs(&cfg, r, x[r].len(), &topk_idx[r])?);
        }
        for r in 0..cfg.num_ranks {
            let dev = self.dev_of(r);
            self.devs[dev].bind()?;
            let p = self.ptrs[r];
            let meta = [ns[r] as i32, 0, 0, 0];
            // SAFETY: each destination was allocated with room for T rows (n <= T checked above)
            // on the bound context; the host slices are plain data.
            unsafe {
                if !x[r].is_empty() {
                    cuda("upload x", result::memcpy_htod_sync(p.x, &x[r]))?;
                    cuda(
                        "upload topk",
                        result::memcpy_htod_sync(p.topk, &topk_idx[r]),
                    )?;
                }
                cuda("upload meta", result::memcpy_htod_sync(p.meta, &meta))?;
            }
            self.n_tokens[r] = ns[r];
            self.topk[r] = topk_idx[r].clone();
        }
        self.finish_uploads()
    }

    /// Uploads every rank's combine inputs (y in the dispatch layout, and the weights), checked
    /// against the routing of the last dispatch.
    pub fn upload_combine_inputs(
        &mut self,
        y: &[Vec<bf16>],
        topk_weights: &[Vec<f32>],
    ) -> Result<(), GpuError> {
        let cfg = self.cfg;
        if self.own.is_some() {
            return Err(GpuError::Unsupported(
                "a process-mode group holds one rank: use upload_rank_combine".into(),
            ));
        }
        if y.len() != cfg.num_ranks || topk_weights.len() != cfg.num_ranks {
            return Err(Error::ShapeMismatch {
                rank: 0,
                tensor: "inputs",
                expected: cfg.num_ranks,
                got: y.len().min(topk_weights.len()),
                shape: "one y and one topk_weights per rank".into(),
            }
            .into());
        }
        for r in 0..cfg.num_ranks {
            check_combine_inputs(&cfg, r, y[r].len(), &self.topk[r], topk_weights[r].len())?;
        }
        for r in 0..cfg.num_ranks {
            let dev = self.dev_of(r);
            self.devs[dev].bind()?;
            let p = self.ptrs[r];
            // SAFETY: y holds L*R*T*H values (checked), the weights n*K <= T*K; the buffers were
            // allocated with those sizes on the bound context.
            unsafe {
                cuda("upload y", result::memcpy_htod_sync(p.y, &y[r]))?;
                if !topk_weights[r].is_empty() {
                    cuda(
                        "upload weights",
                        result::memcpy_htod_sync(p.weights, &topk_weights[r]),
                    )?;
                }
            }
        }
        self.finish_uploads()
    }

    /// The uploads go through the legacy stream, the kernels through this group's non-blocking
    /// stream: wait until every copy has landed before anything is launched.
    fn finish_uploads(&self) -> Result<(), GpuError> {
        for dev in &self.devs {
            cuda("synchronize after upload", dev.ctx.synchronize())?;
        }
        Ok(())
    }

    /// Combine reads the handle the last dispatch left on the device: it must be on the same path.
    fn check_combine_path(&self, path: Path) -> Result<(), GpuError> {
        if self.last_dispatch != Some(path) {
            return Err(GpuError::PathMismatch {
                combine: path.name(),
                dispatch: self.last_dispatch.map(|p| p.name()).unwrap_or("none"),
            });
        }
        Ok(())
    }

    fn dev_of(&self, rank: usize) -> usize {
        if self.own.is_some() {
            return 0;
        }
        rank / (self.cfg.num_ranks / self.devs.len())
    }

    /// Launches one call of `op` on `path` on every device. No host synchronisation.
    pub fn launch(&mut self, op: Op, path: Path) -> Result<(), GpuError> {
        self.launch_inner(Some((op, path)))
    }

    /// Launches the empty kernel with the same grid on every device (overhead baseline).
    pub fn launch_empty(&mut self) -> Result<(), GpuError> {
        self.launch_inner(None)
    }

    fn launch_inner(&mut self, what: Option<(Op, Path)>) -> Result<(), GpuError> {
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
    /// (receive side); -1 = the empty kernel.
    fn launch_stage(&self, op: Op, path: Path, stage: i32) -> Result<(), GpuError> {
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
            dev.bind()?;
            let mut args = [(&mut kp as *mut KParams).cast::<c_void>()];
            let grid = (dev.ranks * self.blocks_per_rank) as u32;
            // SAFETY: `f` is a kernel of this device's module taking one KParams by value (the
            // same #[repr(C)] layout as in common.cuh); every address in it and in the table is
            // a live allocation of this group; the grid fits on the device at once (checked in
            // new); the launch copies the parameter before returning.
            cuda("launch", unsafe {
                result::launch_kernel(
                    f,
                    (grid, 1, 1),
                    (NTHREADS, 1, 1),
                    self.smem as u32,
                    dev.stream,
                    &mut args,
                )
            })?;
        }
        Ok(())
    }

    /// The rank of device `di` and its NCCL peers.
    fn nccl_peers(&self, di: usize) -> (usize, Vec<usize>) {
        let m = self.masks[di];
        (
            self.devs[di].first_rank,
            (0..self.cfg.num_ranks)
                .filter(|&d| (m >> d) & 1 == 1)
                .collect(),
        )
    }

    fn streams_raw(&self) -> Vec<sys::CUstream> {
        self.devs.iter().map(|d| d.stream).collect()
    }

    /// Dispatch over NCCL, after the pack kernel: the headers (tokens, selections, rows per
    /// local expert) of every (me, peer) pair, read back to size the payload, then the batches
    /// themselves into each peer's receive region for me, exactly where NVLink would put them.
    fn nccl_dispatch_exchange(&mut self) -> Result<(), GpuError> {
        let (l, t) = (self.cfg.num_local_experts(), self.cfg.max_tokens_per_rank);
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
                // [nccl hook, issue 10 item 4] Every count is bounded before it sizes a transfer.
                let (hw, k) = (2 + l, self.cfg.top_k);
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
    fn nccl_combine_exchange(&mut self) -> Result<(), GpuError> {
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

    fn nccl_group(&mut self, ops: &[Vec<crate::nccl::P2p>]) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        let comms = self
            .comms
            .as_ref()
            .expect("NCCL transport without communicators");
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
    fn wait_streams(&mut self, op: Op, call: u64) -> Result<(), GpuError> {
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

    /// One call of (op, path) with `%globaltimer` stamps: for every block of device 0, the
    /// stamps of phases 0..8 (0 where a phase was not reached), in ns. Debugging aid.
    pub fn profile(&mut self, op: Op, path: Path) -> Result<Vec<[u64; 8]>, GpuError> {
        let grid = self.devs[0].ranks * self.blocks_per_rank;
        self.devs[0].bind()?;
        let buf = self.devs[0].alloc(grid * 64)?;
        self.params.prof = buf;
        let r = self.launch(op, path).and_then(|_| self.sync());
        self.params.prof = 0;
        r?;
        let mut host = vec![0u64; grid * 8];
        self.devs[0].bind()?;
        // SAFETY: `buf` holds grid*8 u64 on the bound context; the device is idle.
        cuda("read profile", unsafe {
            result::memcpy_dtoh_sync(&mut host, buf)
        })?;
        Ok(host
            .chunks_exact(8)
            .map(|c| c.try_into().unwrap())
            .collect())
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
        for dev in &self.devs {
            dev.bind()?;
            let mut w = [0u32; 8];
            // SAFETY: `err` holds 8 u32 on the bound context; the stream is idle.
            cuda("read error word", unsafe {
                result::memcpy_dtoh_sync(&mut w, dev.err)
            })?;
            if w[0] != 0 {
                let (op, side) = match w[3] {
                    0 => (Op::Dispatch, Side::Send),
                    1 => (Op::Dispatch, Side::Recv),
                    2 => (Op::Combine, Side::Send),
                    _ => (Op::Combine, Side::Recv),
                };
                let e = Error::Timeout {
                    rank: w[1] as usize,
                    peer: w[2] as usize,
                    phase: Phase { op, side },
                    call: w[4] as u64,
                    waited_ms: w[5] as u64 / 1000,
                };
                self.broken = Some(GpuError::from(e.clone()));
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Dispatch on every rank: uploads, launches, waits, reads every rank's output back.
    pub fn dispatch(
        &mut self,
        path: Path,
        x: &[Vec<bf16>],
        topk_idx: &[Vec<i64>],
    ) -> Result<Vec<DispatchOutput>, GpuError> {
        self.check_usable()?;
        self.upload_dispatch_inputs(x, topk_idx)?;
        self.launch(Op::Dispatch, path)?;
        self.sync()?;
        (0..self.cfg.num_ranks)
            .map(|r| self.read_dispatch_output(r))
            .collect()
    }

    /// Combine on every rank (after a dispatch on the same path): returns each rank's n_r x H.
    pub fn combine(
        &mut self,
        path: Path,
        y: &[Vec<bf16>],
        topk_weights: &[Vec<f32>],
    ) -> Result<Vec<Vec<bf16>>, GpuError> {
        self.check_usable()?;
        self.check_combine_path(path)?;
        self.upload_combine_inputs(y, topk_weights)?;
        self.launch(Op::Combine, path)?;
        self.sync()?;
        (0..self.cfg.num_ranks)
            .map(|r| self.read_combine_output(r))
            .collect()
    }

    /// Reads rank r's dispatch output (after [`GpuGroup::sync`]).
    pub fn read_dispatch_output(&self, r: usize) -> Result<DispatchOutput, GpuError> {
        let cfg = self.cfg;
        let p = self.ptrs[r];
        self.devs[self.dev_of(r)].bind()?;
        let mut out = DispatchOutput::zeroed(&cfg);
        let l = cfg.num_local_experts();
        let mut counts = vec![0i32; l];
        let mut layout = vec![0i32; l * cfg.num_ranks * 2];
        // SAFETY: every buffer was allocated with exactly these element counts (rank_sizes) on
        // the bound context; the device is idle (synchronised).
        unsafe {
            cuda(
                "read recv_count",
                result::memcpy_dtoh_sync(&mut counts, p.recv_count),
            )?;
            cuda(
                "read layout",
                result::memcpy_dtoh_sync(&mut layout, p.layout),
            )?;
            cuda(
                "read src_info",
                result::memcpy_dtoh_sync(&mut out.src_info, p.src_info),
            )?;
            match &mut out.recv_x {
                RecvX::Bf16(v) => cuda("read recv_x", result::memcpy_dtoh_sync(v, p.recv_x))?,
                RecvX::Fp8(v) => cuda("read recv_x", result::memcpy_dtoh_sync(v, p.recv_x))?,
            }
            match &mut out.recv_scales {
                None => {}
                Some(RecvScales::F32(v)) => {
                    cuda("read scales", result::memcpy_dtoh_sync(v, p.recv_scales))?
                }
                Some(RecvScales::Ue8m0(v)) => {
                    cuda("read scales", result::memcpy_dtoh_sync(v, p.recv_scales))?
                }
            }
        }
        out.recv_count = counts;
        out.layout_range = layout.chunks_exact(2).map(|c| (c[0], c[1])).collect();
        Ok(out)
    }

    /// Reads rank r's combine output (n_r x H, after [`GpuGroup::sync`]).
    pub fn read_combine_output(&self, r: usize) -> Result<Vec<bf16>, GpuError> {
        let p = self.ptrs[r];
        self.devs[self.dev_of(r)].bind()?;
        let mut out = vec![bf16::ZERO; self.n_tokens[r] * self.cfg.hidden];
        if !out.is_empty() {
            // SAFETY: `out` holds n_r*H <= T*H values of the rank's output buffer; device idle.
            cuda("read out", unsafe {
                result::memcpy_dtoh_sync(&mut out, p.out)
            })?;
        }
        Ok(out)
    }

    /// Runs the payload encoder alone on `rows` (n x H bf16) on device 0: per row, the bytes the
    /// wire carries (e4m3 + scales, or bf16). For testing the FP8 cast bit for bit.
    pub fn encode_rows(&mut self, rows: &[bf16]) -> Result<Vec<Vec<u8>>, GpuError> {
        let cfg = self.cfg;
        let n = rows.len() / cfg.hidden;
        let eb = align(cfg.payload_bytes(), 16);
        let mut kp = self.params;
        kp.entry_bytes = eb as i32;
        let dev = &mut self.devs[0];
        dev.bind()?;
        let x = dev.alloc(rows.len() * 2)?;
        let out = dev.alloc(n * eb)?;
        // SAFETY: `x` was allocated for exactly rows.len() bf16 on the bound context.
        cuda("upload rows", unsafe { result::memcpy_htod_sync(x, rows) })?;
        cuda("synchronize after upload", dev.ctx.synchronize())?;
        let (mut a, mut b, mut c) = (kp, x, out);
        let mut nn = n as i32;
        let mut args = [
            (&mut a as *mut KParams).cast::<c_void>(),
            (&mut b as *mut u64).cast::<c_void>(),
            (&mut c as *mut u64).cast::<c_void>(),
            (&mut nn as *mut i32).cast::<c_void>(),
        ];
        let grid = (n as u32).clamp(1, 1024);
        // SAFETY: ep_fp8_encode_rows(KParams, const u16*, u8*, int): the argument types match;
        // x holds n*H values, out n rows of eb bytes.
        cuda("launch encode", unsafe {
            result::launch_kernel(
                dev.funcs.fp8,
                (grid, 1, 1),
                (NTHREADS, 1, 1),
                0,
                dev.stream,
                &mut args,
            )
        })?;
        // SAFETY: the stream belongs to the bound context.
        cuda("sync encode", unsafe {
            result::stream::synchronize(dev.stream)
        })?;
        let mut host = vec![0u8; n * eb];
        // SAFETY: `out` holds n*eb bytes; the device is idle.
        cuda("read encode", unsafe {
            result::memcpy_dtoh_sync(&mut host, out)
        })?;
        Ok(host
            .chunks_exact(eb)
            .map(|c| c[..cfg.payload_bytes()].to_vec())
            .collect())
    }

    /// Calls launched so far per (op, path): [batched dispatch, per-expert dispatch, batched
    /// combine, per-expert combine].
    pub fn calls(&self) -> [u64; 4] {
        self.calls
    }

    /// The streams and contexts, for event timing (crate-internal).
    pub(crate) fn streams(&self) -> Vec<(Arc<CudaContext>, sys::CUstream)> {
        self.devs
            .iter()
            .map(|d| (d.ctx.clone(), d.stream))
            .collect()
    }
}
