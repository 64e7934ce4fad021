//! One GPU: the CUDA context, the group's stream, the kernels it launches (from the process's
//! loaded modules, `modules`), and the plain `cuMemAlloc` allocations peers may reach; plus the
//! driver probe.

use crate::compile;
use crate::error::{cuda, GpuError};
use crate::runtime::layout::{Variant, ERR_WORDS, NTHREADS};
use crate::runtime::{driver, modules};
use cudarc::driver::{result, sys, CudaContext};
use std::sync::Arc;

/// A usable CUDA driver and at least `need` devices, or why not. Never panics.
pub fn probe_devices(need: usize) -> Result<usize, String> {
    if !driver::present() {
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

/// Ok(device description) if a usable CUDA GPU is present, Err(reason) otherwise. Never panics.
pub fn probe() -> Result<String, String> {
    std::panic::catch_unwind(|| -> Result<String, String> {
        let n = probe_devices(1)?;
        let ctx = cudarc::driver::CudaContext::new(0).map_err(|e| format!("context: {e:?}"))?;
        let name = ctx.name().map_err(|e| format!("name: {e:?}"))?;
        let (a, b) = ctx.compute_capability().map_err(|e| format!("cc: {e:?}"))?;
        Ok(format!("{name} (sm_{a}{b}) x {n}"))
    })
    .unwrap_or_else(|_| Err("the CUDA probe panicked".into()))
}

/// The loaded kernels of one device.
pub(crate) struct Funcs {
    pub(crate) fp8: sys::CUfunction,
    pub(crate) empty: sys::CUfunction,
    pub(crate) pe_dispatch: sys::CUfunction,
    pub(crate) pe_combine: sys::CUfunction,
    /// The batched kernels by stage (0 the whole call, 1 the send half, 2 the receive half):
    /// each from its own module, which holds only that stage's code.
    pub(crate) bat_dispatch: [sys::CUfunction; 3],
    pub(crate) bat_combine: [sys::CUfunction; 3],
}

/// One GPU: its context, stream, kernels and the table of every rank's addresses.
pub(crate) struct Dev {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: sys::CUstream,
    pub(crate) funcs: Funcs,
    pub(crate) table: sys::CUdeviceptr,
    pub(crate) err: sys::CUdeviceptr,
    /// The error word's host mirror: ERR_WORDS u32 of mapped pinned memory the kernels write
    /// (report_error in common.cuh) and the host reads at every call's entry without a sync.
    pub(crate) err_host: HostMirror,
    pub(crate) sms: usize,
    /// The device's architecture (`sm_90`): what the kernels are compiled for.
    pub(crate) arch: String,
    /// Ranks of the whole group (the build depends on it).
    pub(crate) group_ranks: usize,
    /// The build of the kernels loaded here (from the group's ranks, this GPU's ranks and
    /// whether they reach a peer through NCCL or run in shrink mode: [`Dev::load_kernels`]).
    pub(crate) variant: Variant,
    pub(crate) first_rank: usize,
    pub(crate) ranks: usize,
    pub(crate) allocs: Vec<sys::CUdeviceptr>,
    /// Grow-only scratch buffers (profile stamps, encoder rows), reused across calls.
    pub(crate) scratch: [(sys::CUdeviceptr, usize); 2],
}

impl Dev {
    /// Opens device `ordinal` (its primary context) for `ranks` of a group of `group_ranks` and
    /// creates the group's stream; [`Dev::load_kernels`] then loads the kernels. On any failure,
    /// what was already made is released (by `Drop`).
    pub(crate) fn new(
        ordinal: usize,
        first_rank: usize,
        ranks: usize,
        group_ranks: usize,
    ) -> Result<Dev, GpuError> {
        let ctx = cuda("context", CudaContext::new(ordinal))?;
        cuda("bind", ctx.bind_to_thread())?;
        let (major, minor) = cuda("compute capability", ctx.compute_capability())?;
        let arch = format!("sm_{major}{minor}");
        let sms = cuda(
            "SM count",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )? as usize;
        // Built first and filled in, so that an error below drops (and unloads) what it holds.
        let mut dev = Dev {
            ctx,
            stream: std::ptr::null_mut(),
            funcs: Funcs {
                fp8: std::ptr::null_mut(),
                empty: std::ptr::null_mut(),
                pe_dispatch: std::ptr::null_mut(),
                pe_combine: std::ptr::null_mut(),
                bat_dispatch: [std::ptr::null_mut(); 3],
                bat_combine: [std::ptr::null_mut(); 3],
            },
            table: 0,
            err: 0,
            err_host: HostMirror::null(),
            sms,
            arch,
            group_ranks,
            variant: Variant::for_group(group_ranks, ranks, sms, false),
            first_rank,
            ranks,
            allocs: Vec::new(),
            scratch: [(0, 0); 2],
        };
        dev.stream = cuda(
            "stream",
            result::stream::create(result::stream::StreamKind::NonBlocking),
        )?;
        Ok(dev)
    }

    /// Finds the kernels of the build for this device's ranks ([`Variant::for_group`]; `plain`
    /// when none of them reaches a peer through NCCL and shrink mode is off) in the process's
    /// modules, loading those not loaded yet (`modules`): the FP8 and per-expert modules, and
    /// the batched one once per stage ([`Variant::at_stage`]). Once, before any launch or
    /// residency check (the bound context).
    pub(crate) fn load_kernels(&mut self, plain: bool) -> Result<(), GpuError> {
        if !self.funcs.fp8.is_null() {
            return Err(GpuError::Unsupported(
                "the kernels of a device are loaded once".into(),
            ));
        }
        self.variant = Variant::for_group(self.group_ranks, self.ranks, self.sms, plain);
        let mut all = Vec::new();
        let loads = [
            (compile::FP8, 0),
            (compile::PER_EXPERT, 0),
            (compile::BATCHED, 0),
            (compile::BATCHED, 1),
            (compile::BATCHED, 2),
        ];
        for (f, stage) in loads {
            all.extend(modules::kernels(
                &self.ctx,
                &f,
                &self.variant.at_stage(stage),
                &self.arch,
            )?);
        }
        self.funcs = Funcs {
            fp8: all[0],
            empty: all[1],
            pe_dispatch: all[2],
            pe_combine: all[3],
            bat_dispatch: [all[4], all[6], all[8]],
            bat_combine: [all[5], all[7], all[9]],
        };
        Ok(())
    }

    /// Checks that `ranks` x `blocks_per_rank` blocks of every kernel, each with `smem` bytes of
    /// dynamic shared memory (within what `modules` allows each kernel), can be resident at once
    /// (one launch holds every rank of this device, and its blocks wait on each other). Binds
    /// nothing: call after [`Dev::bind`].
    pub(crate) fn check_residency(
        &self,
        smem: usize,
        ranks: usize,
        blocks_per_rank: usize,
    ) -> Result<(), GpuError> {
        for f in [self.funcs.pe_dispatch, self.funcs.pe_combine]
            .into_iter()
            .chain(self.funcs.bat_dispatch)
            .chain(self.funcs.bat_combine)
        {
            // SAFETY: `f` is a kernel of a module loaded for the process's life (`modules`).
            let per_sm = cuda("occupancy", unsafe {
                result::occupancy::max_active_block_per_multiprocessor(f, NTHREADS as i32, smem)
            })?;
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

    pub(crate) fn bind(&self) -> Result<(), GpuError> {
        cuda("bind", self.ctx.bind_to_thread())
    }

    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, GpuError> {
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

impl Dev {
    /// Scratch buffer `slot` of at least `bytes` (zeroed when it grows); reused by later calls.
    pub(crate) fn scratch(
        &mut self,
        slot: usize,
        bytes: usize,
    ) -> Result<sys::CUdeviceptr, GpuError> {
        let (p, have) = self.scratch[slot];
        if have >= bytes && p != 0 {
            return Ok(p);
        }
        let np = self.alloc(bytes)?;
        if p != 0 {
            // SAFETY: `p` is an idle scratch allocation of this (bound) context, replaced now.
            let _ = unsafe { result::free_sync(p) };
            self.allocs.retain(|&a| a != p);
        }
        self.scratch[slot] = (np, bytes);
        Ok(np)
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: all work on this device is finished (synchronised below) before anything is
        // freed; the pointers and handles were created on this context and are not used again.
        unsafe {
            if !self.stream.is_null() {
                let _ = result::stream::synchronize(self.stream);
            }
            for &p in &self.allocs {
                let _ = result::free_sync(p);
            }
            if !self.err_host.host.is_null() {
                let _ = result::free_host(self.err_host.host.cast());
            }
            if !self.stream.is_null() {
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

/// The host mirror of a device's error word: mapped pinned memory (`cuMemHostAlloc` with
/// DEVICEMAP), written by the one kernel thread that claims the device's first error and read
/// by the host with volatile loads. Freed by the owning [`Dev`]'s Drop (after its stream is
/// idle), so the kernels never write to freed memory.
pub(crate) struct HostMirror {
    /// The host address (ERR_WORDS u32).
    pub(crate) host: *mut u32,
    /// Its device address, passed to the kernels (`KParams::err_host`).
    pub(crate) dev: u64,
}

// SAFETY: the mirror is pinned host memory owned by its Dev, valid from any thread for the Dev's
// life; the host side only reads it (volatile loads), so sharing or moving the owner between
// threads is sound.
unsafe impl Send for HostMirror {}
// SAFETY: as above: `&HostMirror` only ever reads.
unsafe impl Sync for HostMirror {}

impl HostMirror {
    pub(crate) fn null() -> HostMirror {
        HostMirror {
            host: std::ptr::null_mut(),
            dev: 0,
        }
    }

    /// Allocates and zeroes the mirror on the bound context.
    pub(crate) fn alloc() -> Result<HostMirror, GpuError> {
        let bytes = 4 * ERR_WORDS;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain pinned allocation of `bytes` bytes; zeroed below before any use.
        let host = cuda("cuMemHostAlloc", unsafe {
            result::malloc_host(bytes, flags)
        })?
        .cast::<u32>();
        // SAFETY: `host` holds ERR_WORDS u32, just allocated and not yet shared.
        unsafe { std::ptr::write_bytes(host, 0, ERR_WORDS) };
        // `host` was allocated with DEVICEMAP on the bound context: its device address.
        match cuda(
            "cuMemHostGetDevicePointer",
            driver::host_device_ptr(host.cast()),
        ) {
            Ok(dev) => Ok(HostMirror { host, dev }),
            Err(e) => {
                // SAFETY: allocated above, never shared.
                let _ = unsafe { result::free_host(host.cast()) };
                Err(e)
            }
        }
    }

    /// The mirror's words, or None while its code word is 0. Reads host memory only: no
    /// stream is synchronised and no driver call is made.
    pub(crate) fn read(&self) -> Option<[u32; ERR_WORDS]> {
        if self.host.is_null() {
            return None;
        }
        // SAFETY: `host` holds ERR_WORDS u32 for the life of the owning Dev; the kernels write
        // it with plain stores, so the host reads it with volatile loads. The code word is
        // written last, after a system fence (report_error): once it reads nonzero, the
        // acquire fence below orders the reads of the other words after it.
        unsafe {
            let code = std::ptr::read_volatile(self.host);
            if code == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            let mut w = [0u32; ERR_WORDS];
            w[0] = code;
            for (i, slot) in w.iter_mut().enumerate().skip(1) {
                *slot = std::ptr::read_volatile(self.host.add(i));
            }
            Some(w)
        }
    }
}
