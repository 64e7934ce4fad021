//! The one place the bindings call the GPU backend (`ep_kernels`). Everything else in this crate
//! is host code; the Python `Buffer` reaches the GPU only through [`probe`], [`size_hint`] and
//! [`RankGroup`].
//!
//! [`RankGroup`] is one rank of a process-mode group (`ep_group::new_process`: the CUDA IPC
//! handles, and rank 0's NCCL unique id on the transports that use NCCL, exchanged in one blob
//! per rank through the caller's all-gather, i.e. `torch.distributed` over the Buffer's group),
//! driven through ep-kernels' device API (`GpuGroup::dispatch_device`, `dispatch_send` /
//! `dispatch_recv`, and the same for combine): dispatch and combine are enqueued on
//! the caller's raw `CUstream` (torch's current stream, borrowed: never synchronised) with the
//! caller's device pointers (torch tensors' `data_ptr()`), wrapped as borrowed cudarc views that
//! are never freed here.

use crate::error::{BindError, Result};
use crate::spec::check_dims;
pub use crate::spec::{CombinePtrs, DispatchPtrs, Spec};
pub use crate::tensor::Ptr;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};
use ep_group::AllGather;
use ep_kernels::runtime::{hint_bytes, probe_devices, CombineHook, DispatchHook};
use ep_kernels::{
    Buffers, DeviceDispatchOut, DeviceHandle, GpuError, GpuGroup, GpuOptions, NcclSizes, Path,
    Tokens, Transport,
};
use ep_reference::{bf16, CombineFormat, Config, Mode};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// The device API this build enqueues through (None would mean: no GPU execution).
pub const DEVICE_API: Option<&str> =
    Some("ep_kernels::GpuGroup device API (process mode; caller's CUDA stream and tensors)");

/// At least `need` usable devices (driver present, NVRTC present), or `NoDevice` saying why.
pub fn probe(need: usize) -> Result<usize> {
    probe_devices(need).map_err(|why| GpuError::NoDevice(why).into())
}

/// Bytes of GPU memory one rank's buffers take for this shape on `transport` with both buffer
/// sets ([`BUFFER_SETS`]): ep-kernels' own layout for the Buffer's options ([`options`]: the
/// default path's receive area, none of the group's own tensors;
/// `ep_kernels::runtime::hint_bytes`), in BF16 (the largest payload, as DeepEP's hint also assumes)
/// with `top_k` (None: 16, the largest the contract allows, so the hint bounds every top-k), plus
/// the NCCL staging buffer on the transports that allocate it ([`has_staging`]). NCCL's own
/// memory (its communicator's buffers, allocated by libnccl) is not included.
pub fn size_hint(
    num_max_dispatch_tokens_per_rank: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
    top_k: Option<usize>,
    transport: Transport,
) -> Result<u64> {
    let cfg = Config::new(
        num_ranks,
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k.unwrap_or(16),
        Mode::Bf16,
    )?;
    check_dims(&cfg)?;
    // The GPU's rank limit (256): a hint for a group the kernels refuse would mislead.
    ep_kernels::runtime::check_ranks(cfg.num_ranks)?;
    // What the Buffer allocates: its groups' options, both buffer sets (the second is formed
    // once two operations are in flight, as DeepEP's hint counts its double buffer).
    let opts = options(transport, Duration::from_secs(10), false);
    Ok(hint_bytes(&cfg, &opts, has_staging(transport), BUFFER_SETS)? as u64)
}

/// Buffer sets the `Buffer` forms per shape at most (two operations in flight).
pub const BUFFER_SETS: usize = 2;

/// Whether a rank on `transport` allocates the NCCL staging buffer, as `ProcessRank::new`
/// decides it: on every transport but `Auto` (under `TwoTier`, whether some peer is on another
/// node is known only after the exchange, and the allocation, whose size the handshake checks,
/// comes before it).
pub fn has_staging(transport: Transport) -> bool {
    transport != Transport::Auto
}

/// Refuses a path the transport cannot run through the device API. NCCL can carry traffic on
/// `Nccl` (every peer) and `TwoTier` (the peers on other nodes); there this Buffer runs NCCL with
/// fixed capacities ([`NcclSizes::Capacity`]), which only the batched path has: the per-expert
/// path's NCCL messages need exact sizes, read from the batch headers on the host in the middle
/// of the call, and a stream-ordered Buffer never waits for its stream mid-call.
pub fn check_path_on(path: Path, transport: Transport) -> Result<()> {
    if path == Path::PerExpert && transport != Transport::Auto {
        let reach = if transport == Transport::Nccl {
            "every peer is"
        } else {
            "the peers on other nodes are"
        };
        return Err(GpuError::Unsupported(format!(
            "path='{}' with transport='{}': {reach} reached through NCCL, and the \
             per-expert path's NCCL messages need exact sizes, which the host reads from the \
             batch headers in the middle of the call (a host round trip); this Buffer enqueues \
             on torch's current stream without synchronising it (stream-ordered, capturable), \
             so it runs NCCL with fixed capacities, which only the batched path has. Use \
             path='{}' (the same bits), or transport='{}' within one node",
            path.name(),
            transport.name(),
            Path::Batched.name(),
            Transport::Auto.name(),
        ))
        .into());
    }
    Ok(())
}

/// The group's options for this Buffer: one GPU per process, the wait bound, the transport,
/// fixed-capacity NCCL sizes wherever NCCL can carry traffic (the device API refuses exact sizes:
/// they need a host round trip mid-call), and DeepEP's column-major FP8 scales (the Buffer's
/// `recv_x` scales tensor has DeepEP's strides, as DeepGEMM takes them). The group holds none of
/// its own tensors (every call passes the caller's: `Buffers::own_tensors`) and the receive area
/// of the default path only (batched; [`RankGroup::new`] sets the Buffer's own path).
pub fn options(transport: Transport, timeout: Duration, trap_on_error: bool) -> GpuOptions {
    GpuOptions {
        buffers: Buffers {
            path: Some(Path::Batched),
            own_tensors: false,
        },
        num_gpus: 1,
        timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
        transport,
        trap_on_error,
        enable_shrink: false,
        scales_column_major: true,
        nccl_sizes: if has_staging(transport) {
            NcclSizes::Capacity
        } else {
            NcclSizes::default()
        },
        ..GpuOptions::default()
    }
}

/// Whether this process can run `transport`, as far as can be told before any collective step:
/// `Nccl` needs libnccl here (`TwoTier` needs it only across nodes, which the exchange finds out
/// and names then).
pub fn probe_transport(transport: Transport) -> Result<()> {
    if transport == Transport::Nccl && !ep_kernels::runtime::nccl::nccl_present() {
        return Err(GpuError::NoDevice(
            "transport='nccl' needs NCCL, and no libnccl can be loaded in this process (the \
             loader is asked for libnccl.so, then versioned names, not libnccl.so.2: put a \
             libnccl.so link to NCCL's libnccl.so.2 in a folder on LD_LIBRARY_PATH)"
                .into(),
        )
        .into());
    }
    Ok(())
}

/// A caller-owned device buffer seen as a cudarc slice for the length of one call; dropping it
/// gives the address back without freeing it.
struct Borrowed<T>(Option<CudaSlice<T>>);

impl<T> Borrowed<T> {
    /// # Safety
    /// `ptr` must address `len` live elements of `T` on the stream's context (or `len` is 0),
    /// valid until the work enqueued with it has run (the caller keeps the tensor alive).
    unsafe fn new(stream: &Arc<CudaStream>, (ptr, len): Ptr) -> Borrowed<T> {
        // SAFETY: as the caller guarantees; the slice is leaked (never freed) in Drop.
        Borrowed(Some(unsafe { stream.upgrade_device_ptr::<T>(ptr, len) }))
    }

    fn view(&self) -> CudaView<'_, T> {
        self.0.as_ref().expect("present until drop").slice(..)
    }

    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.0.as_mut().expect("present until drop").slice_mut(..)
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            // The memory is torch's: hand the address back without freeing it.
            let _ = s.leak();
        }
    }
}

/// How many dispatch handles a rank keeps; the device API only combines the latest one per path
/// and names an older one as stale.
const KEPT_HANDLES: usize = 4;

/// One rank of a process-mode group: this process's rank, its GPU, the peers' buffers.
pub struct RankGroup {
    group: GpuGroup,
    path: Path,
    /// Our own reference to the device's primary context (the one torch and the group use), with
    /// cudarc's per-slice event tracking off: borrowed tensors get no events, so a call records
    /// nothing but the kernels and can be captured in a CUDA graph.
    ctx: Arc<CudaContext>,
    next_handle: u64,
    /// The latest dispatches' handles, by id, with their token counts (combine's tensors are
    /// checked against them).
    handles: VecDeque<(u64, DeviceHandle, usize)>,
    /// The send half of a dispatch whose receive half (the hook) is still due, and its id.
    pending_dispatch: Option<(u64, DispatchHook, usize)>,
    /// The same for a combine (ids count combines: [`RankGroup::combine`] returns them).
    pending_combine: Option<(u64, CombineHook)>,
    next_combine: u64,
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        // Kernels enqueued on the caller's streams may still use the group's buffers (and the
        // peers' mappings); the group's own Drop only waits for its own stream. Wait for every
        // stream of the context before the buffers go.
        let _ = self.ctx.synchronize();
    }
}

impl RankGroup {
    /// Forms the group (collective: every rank calls it with the same config and options) on
    /// the spec's device; the spec's config was validated when it was made. `all_gather`
    /// exchanges one blob per rank in rank order (the Python side passes
    /// `torch.distributed.all_gather_object` over the Buffer's group).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &Spec,
        path: Path,
        transport: Transport,
        timeout: Duration,
        trap_on_error: bool,
        enable_shrink: bool,
        rank: usize,
        all_gather: &mut AllGather<'_>,
    ) -> Result<RankGroup> {
        let cfg = spec.config();
        let ordinal = usize::try_from(spec.device())
            .map_err(|_| BindError::argument("device", "a GPU group needs a CUDA device"))?;
        check_path_on(path, transport)?;
        probe_transport(transport)?;
        let opts = GpuOptions {
            enable_shrink,
            buffers: Buffers {
                path: Some(path),
                own_tensors: false,
            },
            ..options(transport, timeout, trap_on_error)
        };
        let group = ep_group::new_process(cfg, opts, rank, ordinal, all_gather)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            GpuError::Cuda(format!(
                "retain the primary context of GPU {ordinal}: {e:?}"
            ))
        })?;
        // SAFETY: every slice made on this context borrows a torch tensor for one call; torch
        // orders its own streams, and the kernels run on the caller's stream in program order,
        // so cudarc's events have nothing to add.
        unsafe { ctx.disable_event_tracking() };
        Ok(RankGroup {
            group,
            path,
            ctx,
            next_handle: 1,
            handles: VecDeque::new(),
            pending_dispatch: None,
            pending_combine: None,
            next_combine: 1,
        })
    }

    pub fn config(&self) -> &Config {
        self.group.config()
    }

    pub fn path(&self) -> Path {
        self.path
    }

    pub fn describe_devices(&self) -> String {
        self.group.describe_devices()
    }

    /// The peers this rank reaches through NCCL (the others through CUDA IPC), ascending.
    pub fn nccl_peers(&self) -> Vec<usize> {
        self.group.nccl_mask().ranks()
    }

    /// Errors the kernels recorded (a timed-out wait, bad routing, bad peer data), as the
    /// contract's errors; after one, the group refuses further calls. Synchronous: reads a
    /// device word (not for use inside CUDA graph capture).
    pub fn check(&mut self) -> Result<()> {
        Ok(self.group.check()?)
    }

    /// What the kernels recorded so far, without waiting for them (the error word's host
    /// mirror; no stream is synchronised, so it may be called during capture too). Every call
    /// makes this check at its entry.
    pub fn poll(&self) -> Result<()> {
        Ok(self.group.poll()?)
    }

    /// Test hook (feature `testing`): `Some(r)`: rank r never signals (its peers' waits run out).
    #[cfg(feature = "testing")]
    pub fn set_fault_rank(&mut self, rank: Option<usize>) {
        self.group.set_fault_rank(rank);
    }

    /// Copies this rank's mask (i32 `[R]`, 1: masked) into the caller's buffer `out` on `stream`.
    pub fn query_mask(&self, stream: u64, out: Ptr) -> Result<()> {
        let s = self.stream(stream);
        // SAFETY: the Python side checked `out` (int32, [R], on this device, contiguous) and
        // keeps it alive; the copy is ordered on the caller's stream.
        let mut o = unsafe { Borrowed::<i32>::new(&s, out) };
        let own = self.group.own_rank().unwrap_or(0);
        Ok(self.group.query_mask_device(&s, own, &mut o.view_mut())?)
    }

    /// Masks or unmasks `peer` in this rank's mask, on `stream`.
    pub fn update_mask(&mut self, stream: u64, peer: usize, masked: bool) -> Result<()> {
        let s = self.stream(stream);
        Ok(self.group.update_mask(Some(&[&s]), peer, masked)?)
    }

    /// Clears this rank's mask and resets its protocol state, on `stream` (every rank must
    /// clean before any calls again: `GpuGroup::clean_mask`).
    pub fn clean_mask(&mut self, stream: u64) -> Result<()> {
        let s = self.stream(stream);
        Ok(self.group.clean_mask(Some(&[&s]))?)
    }

    /// The id of the dispatch whose send half waits for its receive half, if any.
    pub fn pending_dispatch(&self) -> Option<u64> {
        self.pending_dispatch.as_ref().map(|(id, _, _)| *id)
    }

    /// The id of the combine whose send half waits for its receive half, if any.
    pub fn pending_combine(&self) -> Option<u64> {
        self.pending_combine.as_ref().map(|(id, _)| *id)
    }

    fn stream(&self, raw: u64) -> Arc<CudaStream> {
        // SAFETY: `raw` is the caller's live CUstream on this device's primary context (torch's
        // current stream); the wrapper does not own it and lives only for this call.
        unsafe { self.ctx.wrap_borrowed_stream(raw as sys::CUstream) }
    }

    fn keep(&mut self, id: u64, h: DeviceHandle, tokens: usize) {
        if self.handles.len() == KEPT_HANDLES {
            self.handles.pop_front();
        }
        self.handles.push_back((id, h, tokens));
    }

    /// The token count of dispatch `handle` (what combine's tensors are checked against), or
    /// why that dispatch cannot be combined.
    pub fn dispatched_tokens(&self, handle: u64) -> Result<usize> {
        Ok(self.held(handle)?.1)
    }

    /// The device handle of dispatch `handle` and its token count, or the error naming why it
    /// is not held ([`RankGroup::dispatched_tokens`]).
    fn held(&self, handle: u64) -> Result<(&DeviceHandle, usize)> {
        if let Some((_, h, n)) = self.handles.iter().find(|(id, _, _)| *id == handle) {
            return Ok((h, *n));
        }
        if self.pending_dispatch() == Some(handle) {
            return Err(BindError::argument(
                "handle",
                "its dispatch's receive hook was not called yet",
            ));
        }
        Err(GpuError::Handle(format!(
            "dispatch handle {handle} is no longer held (this rank keeps the last \
             {KEPT_HANDLES}, and combines only the latest dispatch per path)"
        ))
        .into())
    }

    /// Enqueues a whole dispatch on `stream`; returns the handle id combine takes.
    pub fn dispatch(&mut self, stream: u64, p: &DispatchPtrs) -> Result<u64> {
        self.dispatch_part(stream, p, false)
    }

    /// Enqueues a dispatch's send half on `stream`; returns the id its receive half
    /// ([`RankGroup::dispatch_recv`]) completes, the handle id combine takes after it.
    pub fn dispatch_send(&mut self, stream: u64, p: &DispatchPtrs) -> Result<u64> {
        self.dispatch_part(stream, p, true)
    }

    /// Enqueues the receive half of the dispatch `id` on `stream`: true; false where a later
    /// call enqueued it already (a call enqueues a due receive half before its own work).
    pub fn dispatch_recv(&mut self, stream: u64, id: u64) -> Result<bool> {
        let Some((id, hook, n)) = self.pending_dispatch.take_if(|(due, _, _)| *due == id) else {
            return self.issued(id, self.next_handle, "dispatch");
        };
        let s = self.stream(stream);
        let handle = self.group.dispatch_recv(hook, &[&s])?;
        self.keep(id, handle, n);
        Ok(true)
    }

    /// `Ok(false)` for a call `id` issued before `next` (its receive half was enqueued), else
    /// the argument error of an id this rank never gave.
    fn issued(&self, id: u64, next: u64, what: &str) -> Result<bool> {
        if id >= 1 && id < next {
            return Ok(false);
        }
        Err(BindError::argument(
            "hook",
            format!("{what} {id} was never sent by this rank"),
        ))
    }

    fn dispatch_part(&mut self, stream: u64, p: &DispatchPtrs, send_only: bool) -> Result<u64> {
        let s = self.stream(stream);
        if let Some((pid, hook, n)) = self.pending_dispatch.take() {
            // The previous dispatch's receive half is still due: it is enqueued now, ahead of
            // this call (the kernels keep one dispatch's state; the native rank keeps that
            // call's tensors alive until then, and its hook becomes a no-op). Refusing here
            // instead would leave the send half pending for good, and every later call refused.
            let handle = self.group.dispatch_recv(hook, &[&s])?;
            self.keep(pid, handle, n);
        }
        // SAFETY (all borrows): every tensor was checked against the group's spec (dtype,
        // shape, strides, device: `Spec::dispatch`) and is kept referenced (by the returned
        // outputs, the handle, the native rank while a receive half is due) while the kernels
        // run.
        let x = unsafe { Borrowed::<bf16>::new(&s, p.x) };
        let topk = unsafe { Borrowed::<i64>::new(&s, p.topk_idx) };
        let mut recv_x = unsafe { Borrowed::<u8>::new(&s, p.recv_x) };
        let mut scales = p
            .recv_x_scales
            .map(|q| unsafe { Borrowed::<u8>::new(&s, q) });
        let mut count = unsafe { Borrowed::<i32>::new(&s, p.recv_count) };
        let mut layout = unsafe { Borrowed::<i64>::new(&s, p.layout_range) };
        let mut src = unsafe { Borrowed::<i32>::new(&s, p.src_info) };
        let mut recv_stats = p.recv_stats.map(|q| unsafe { Borrowed::<i32>::new(&s, q) });
        let mut wait_stats = p.wait_stats.map(|q| unsafe { Borrowed::<i64>::new(&s, q) });
        let mut out = DeviceDispatchOut {
            recv_x: recv_x.view_mut(),
            recv_scales: scales.as_mut().map(|b| b.view_mut()),
            recv_count: count.view_mut(),
            layout_range: layout.view_mut(),
            src_info: src.view_mut(),
            recv_stats: recv_stats.as_mut().map(|b| b.view_mut()),
            wait_stats: wait_stats.as_mut().map(|b| b.view_mut()),
        };
        let (xv, tv) = (x.view(), topk.view());
        let id = self.next_handle;
        let ins = [ep_kernels::DispatchIn {
            x: &xv,
            topk_idx: &tv,
            n_tokens: Tokens::Host(p.num_tokens),
        }];
        let outs = std::slice::from_mut(&mut out);
        if send_only {
            let hook = self
                .group
                .dispatch_send(self.path, &[&s], &ins, Some(outs))?;
            self.pending_dispatch = Some((id, hook, p.num_tokens));
        } else {
            let handle = self
                .group
                .dispatch_device(self.path, &[&s], &ins, Some(outs))?;
            self.keep(id, handle, p.num_tokens);
        }
        self.next_handle += 1;
        Ok(id)
    }

    /// Enqueues a whole combine on `stream` after the dispatch of handle `handle`, its rows in
    /// `format` (DeepEP's `use_logfmt`: [`CombineFormat::LogFmt`]; refused, with nothing
    /// enqueued, where H is not a multiple of 128 or NCCL carries traffic); returns the
    /// combine's id.
    pub fn combine(
        &mut self,
        stream: u64,
        handle: u64,
        p: &CombinePtrs,
        format: CombineFormat,
    ) -> Result<u64> {
        self.combine_part(stream, handle, p, false, format)
    }

    /// Enqueues a combine's send half; returns the id its receive half completes.
    pub fn combine_send(
        &mut self,
        stream: u64,
        handle: u64,
        p: &CombinePtrs,
        format: CombineFormat,
    ) -> Result<u64> {
        self.combine_part(stream, handle, p, true, format)
    }

    /// Enqueues the receive half of combine `id` (as [`RankGroup::dispatch_recv`]).
    pub fn combine_recv(&mut self, stream: u64, id: u64) -> Result<bool> {
        let Some((_, hook)) = self.pending_combine.take_if(|(due, _)| *due == id) else {
            return self.issued(id, self.next_combine, "combine");
        };
        let s = self.stream(stream);
        self.group.combine_recv(hook, &[&s])?;
        Ok(true)
    }

    fn combine_part(
        &mut self,
        stream: u64,
        handle: u64,
        p: &CombinePtrs,
        send_only: bool,
        format: CombineFormat,
    ) -> Result<u64> {
        // Refused before the due receive half goes out or anything is borrowed.
        self.group.check_combine_format(format)?;
        let s = self.stream(stream);
        if let Some((_, hook)) = self.pending_combine.take() {
            // As in `dispatch_part`: the previous combine's receive half first.
            self.group.combine_recv(hook, &[&s])?;
        }
        let h = self.held(handle)?.0.clone();
        // SAFETY: as in `dispatch_part` (`Spec::combine` checked every tensor).
        let y = unsafe { Borrowed::<bf16>::new(&s, p.y) };
        let topk = unsafe { Borrowed::<i64>::new(&s, p.topk_idx) };
        let w = unsafe { Borrowed::<f32>::new(&s, p.topk_weights) };
        let mut out = unsafe { Borrowed::<bf16>::new(&s, p.out) };
        let (yv, tv, wv) = (y.view(), topk.view(), w.view());
        let ins = [ep_kernels::CombineIn {
            y: &yv,
            topk_idx: &tv,
            topk_weights: &wv,
        }];
        let mut outs = [out.view_mut()];
        let mut waits = p.wait_stats.map(|q| unsafe { Borrowed::<i64>::new(&s, q) });
        let mut wait_view = waits.as_mut().map(|b| [b.view_mut()]);
        let opts = ep_kernels::CombineOpts {
            format,
            wait_stats: wait_view.as_mut().map(|v| &mut v[..]),
        };
        let id = self.next_combine;
        if send_only {
            let hook = self
                .group
                .combine_send_opts(&[&s], &h, &ins, &mut outs, opts)?;
            self.pending_combine = Some((id, hook));
        } else {
            self.group
                .combine_device_opts(&[&s], &h, &ins, &mut outs, opts)?;
        }
        self.next_combine += 1;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One buffer set of the Buffer's groups on `transport` (the layout the group allocates, in
    /// whole allocation pages).
    fn one_set(cfg: &Config, transport: Transport) -> u64 {
        let o = options(transport, Duration::from_secs(10), false);
        let b = ep_kernels::runtime::footprint(cfg, &o, has_staging(transport)).unwrap();
        b.next_multiple_of(ep_kernels::runtime::ALLOC_GRANULE) as u64
    }

    #[test]
    fn size_hint_is_the_kernels_layout() {
        // DeepEP's standard setting with K = 8: both buffer sets of the Buffer's groups.
        let got = size_hint(128, 7168, 8, 256, Some(8), Transport::Auto).unwrap();
        let cfg = Config::new(8, 256, 128, 7168, 8, Mode::Bf16).unwrap();
        assert_eq!(got, BUFFER_SETS as u64 * one_set(&cfg, Transport::Auto));
        // The timeout does not change the layout (the hint's is not the Buffer's).
        let o = options(Transport::Auto, Duration::from_secs(1), true);
        assert_eq!(
            ep_kernels::runtime::hint_bytes(&cfg, &o, false, 1).unwrap() as u64,
            one_set(&cfg, Transport::Auto)
        );
        // No top_k: the bound over every top_k, so at least the K = 8 figure.
        let bound = size_hint(128, 7168, 8, 256, None, Transport::Auto).unwrap();
        assert!(bound > got, "{bound} vs {got}");
    }

    #[test]
    fn size_hint_follows_the_ranks_up_to_256_and_refuses_past() {
        let mut last = 0;
        for r in [8, 16, 32, 64, 128, 256] {
            let got = size_hint(128, 7168, r, 2 * r, Some(8), Transport::Auto).unwrap();
            assert!(got > last, "R = {r}: {got} <= {last}");
            last = got;
        }
        assert!(matches!(
            size_hint(128, 7168, 257, 257, Some(8), Transport::Auto),
            Err(BindError::Gpu(GpuError::TooManyRanks {
                ranks: 257,
                max: 256
            }))
        ));
    }

    #[test]
    fn size_hint_counts_the_staging_where_new_process_allocates_it() {
        let cfg = Config::new(8, 256, 128, 7168, 8, Mode::Bf16).unwrap();
        let with = BUFFER_SETS as u64 * one_set(&cfg, Transport::Nccl);
        let without = BUFFER_SETS as u64 * one_set(&cfg, Transport::Auto);
        assert!(with > without, "{with} vs {without}");
        // NCCL and two-tier ranks both allocate the staging (new_process: every transport but
        // Auto); Auto does not.
        for (t, want) in [
            (Transport::Auto, without),
            (Transport::Nccl, with),
            (Transport::TwoTier, with),
        ] {
            assert_eq!(
                size_hint(128, 7168, 8, 256, Some(8), t).unwrap(),
                want,
                "{t:?}"
            );
        }
        // One rank (NCCL self-send): the staging's combine rows are bumped to R = 2.
        let one = Config::new(1, 8, 16, 512, 4, Mode::Bf16).unwrap();
        assert_eq!(
            size_hint(16, 512, 1, 8, Some(4), Transport::Nccl).unwrap(),
            BUFFER_SETS as u64 * one_set(&one, Transport::Nccl)
        );
    }

    #[test]
    fn nccl_runs_with_capacity_sizes_and_auto_is_unchanged() {
        let t = Duration::from_secs(3);
        for tr in [Transport::Nccl, Transport::TwoTier] {
            let o = options(tr, t, false);
            assert_eq!(o.nccl_sizes, NcclSizes::Capacity, "{tr:?}");
            assert_eq!(
                (o.transport, o.num_gpus, o.timeout_ns),
                (tr, 1, 3_000_000_000)
            );
        }
        let auto = options(Transport::Auto, t, false);
        assert!(!auto.trap_on_error);
        assert!(
            auto.scales_column_major,
            "the Buffer allocates DeepEP's scale strides"
        );
        assert!(options(Transport::Auto, t, true).trap_on_error);
        let default = GpuOptions::default();
        assert_eq!(auto.transport, Transport::Auto);
        assert_eq!(auto.nccl_sizes, default.nccl_sizes);
        assert_eq!(auto.zero_copy_local, default.zero_copy_local);
        assert_eq!(auto.blocks_per_rank, default.blocks_per_rank);
        // A timeout past u64 nanoseconds saturates.
        assert_eq!(
            options(Transport::Auto, Duration::MAX, false).timeout_ns,
            u64::MAX
        );
    }

    #[test]
    fn per_expert_is_refused_where_nccl_carries_traffic_and_says_why() {
        for tr in [Transport::Auto, Transport::Nccl, Transport::TwoTier] {
            check_path_on(Path::Batched, tr).unwrap();
        }
        check_path_on(Path::PerExpert, Transport::Auto).unwrap();
        for (tr, name, reach) in [
            (
                Transport::Nccl,
                "nccl",
                "every peer is reached through NCCL",
            ),
            (
                Transport::TwoTier,
                "two-tier",
                "the peers on other nodes are reached through NCCL",
            ),
        ] {
            let e = check_path_on(Path::PerExpert, tr).unwrap_err();
            assert!(
                matches!(e, BindError::Gpu(GpuError::Unsupported(_))),
                "{e:?}"
            );
            let m = e.to_string();
            for words in [
                &format!("path='per-expert' with transport='{name}'") as &str,
                reach,
                "exact sizes",
                "host round trip",
                "stream-ordered",
                "path='batched'",
            ] {
                assert!(m.contains(words), "{words:?} not in {m}");
            }
        }
    }

    #[test]
    fn size_hint_refuses_bad_and_huge_shapes() {
        let e = size_hint(128, 7168, 3, 256, None, Transport::Auto).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config: num_experts = 256 is not a multiple of num_ranks = 3"
        );
        let e = size_hint(1 << 40, 7168, 8, 256, None, Transport::Nccl).unwrap_err();
        // The config's bounds (ep_reference::config) refuse it first, naming value and limit.
        assert!(
            e.to_string()
                .contains("1099511627776 exceeds the limit 65536"),
            "{e}"
        );
        let e = size_hint(1 << 30, 1 << 30, 1, 1 << 10, None, Transport::TwoTier).unwrap_err();
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
    }

    #[test]
    fn without_a_gpu_probe_says_why() {
        // On a machine with a GPU this passes trivially; on CI (no driver) it must say why.
        match probe(1) {
            Ok(n) => assert!(n >= 1),
            Err(e) => assert!(e.to_string().starts_with("no usable GPU: "), "{e}"),
        }
    }
}
