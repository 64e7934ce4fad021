//! The library face: dispatch and combine on device tensors, enqueued on the caller's CUDA
//! stream, with no host synchronisation and no host copy of tensor data.
//!
//! A call names the ranks this process runs: in process mode (`ep_group::new_process`) its one
//! rank; in a single-process group every rank (all ranks of a GPU run in ONE launch, so they are
//! issued together: one entry per rank, one stream per GPU). [`RankEp`] is the one-rank form
//! (`dispatch(stream, x, topk_idx, n_tokens, out)`), shaped like DeepEP's low-latency calls.
//!
//! - Inputs are cudarc views on the group's device and context (checked: [`GpuError::WrongDevice`]);
//!   sizes are checked on the host against the config (`Error::ShapeMismatch`).
//! - Dispatch writes DeepEP's low-latency outputs: recv_x `[L, R*T, H]` (bf16 rows, or e4m3 bytes),
//!   scales `[L, R*T, H/128]` f32 or UE8M0-packed `[L, R*T, H/512]` i32, recv_count `[L]` i32,
//!   layout_range `[L, R]` i64 (two i32: begin in the low half, count in the high half),
//!   src_info `[L, R*T]` i32; into the caller's buffers ([`DeviceDispatchOut`], bytes for recv_x
//!   and scales) or, with `None`, into buffers the group owns (read with
//!   `GpuGroup::read_dispatch_output`).
//! - The routing is checked on the device: an expert outside [-1, E) or repeated within a token
//!   stops the rank before it writes or sends anything, and the next [`GpuGroup::check`] (or
//!   `sync`) returns `ExpertOutOfRange` / `DuplicateExpert` naming rank, token, slot and value.
//!   After that the group refuses later calls (as after a timeout).
//! - The token count is a host value ([`Tokens::Host`], checked, baked into a captured graph) or
//!   an i32 in device memory ([`Tokens::Device`], read by the kernel and checked against T): with
//!   the latter a captured graph serves any count up to T.
//! - The handle: combine uses the routing and token count of the dispatch whose
//!   [`DeviceHandle`] it gets; that must be the latest dispatch on that path (the group keeps one
//!   handle's state). Combine reduces with the routing its dispatch kept, so its topk_idx is
//!   checked for shape only: the dispatched tensor or a copy of its values at any address.
//! - Combine's rows travel as bf16, or in LogFMT-10 with `combine_device_opts` /
//!   `combine_send_opts` (`CombineOpts::format(CombineFormat::LogFmt)`, DeepEP's `use_logfmt`): H a multiple of 128
//!   and no NCCL peer, else refused before anything is enqueued
//!   ([`GpuGroup::check_combine_format`]).
//! - Receive hook: `dispatch_send` / `dispatch_recv` (and `combine_send` / `combine_recv`) are the
//!   two halves of the fused call (the same kernel, stage 1: send and signal; stage 2: wait,
//!   receive), so other kernels may run on the stream in between. Same bits as the fused call.
//! - The NCCL transport works here in [`NcclSizes::Capacity`] mode only (exact sizes read the
//!   headers on the host mid-call; refused with a typed `Unsupported`), batched path only. A call
//!   is then: a memset poisoning the send headers, the pack kernel, ONE grouped
//!   `ncclSend`/`ncclRecv` (headers + capacity) and the unpack kernel, all enqueued on the
//!   caller's stream: stream-ordered, no host synchronisation. NCCL receives are not bounded on
//!   the device: the caller's own stream synchronisation is the wait (poll it with a bound, as
//!   [`GpuGroup::sync`] does for the group's streams). Graph capture: NCCL (>= 2.9) captures
//!   point-to-point calls; issue one uncaptured call first (NCCL connects peers on first use),
//!   and keep one GPU per process (NCCL warns that several GPUs per process may deadlock at
//!   graph launch). The receive hooks split the same way (send half: pack + exchange).
//!
//! Ordering: the group's internal buffers are reused by every call, so calls on one group must
//! be issued in program order on streams that are ordered with each other (the usual case: one
//! stream per GPU). The host-slice harness runs on the group's own stream: synchronise before
//! switching between it and the device API (a harness combine after a device dispatch is
//! refused: the harness does not hold that routing). Two groups must not run on one GPU at the
//! same time (see the crate docs).

use crate::error::{cuda, GpuError};
use crate::runtime::device_io::{
    CombineIn, CombineOpts, DeviceDispatchOut, DispatchIn, DispatchOutSizes, Tokens,
};
use crate::runtime::driver;
use crate::runtime::group::{kind, GpuGroup};
use crate::runtime::layout::IoTable;
use crate::runtime::nccl::check_sizes;
use crate::runtime::options::NcclSizes;
use cudarc::driver::sys;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use ep_reference::{CombineFormat, Error, Op, Path};
use half::bf16;

/// What combine needs from its dispatch: which group, path and call it was, and the routing
/// tensors it used. Returned by a dispatch (or its receive half).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHandle {
    group: u64,
    path: Path,
    call: u64,
    /// Per rank of the call: topk_idx's address, and the combine output's minimum length.
    topk: Vec<u64>,
    out_len: Vec<usize>,
}

impl DeviceHandle {
    pub fn path(&self) -> Path {
        self.path
    }
}

/// The send half of a dispatch ([`GpuGroup::dispatch_send`]): pass it to `dispatch_recv`.
#[derive(Debug)]
#[must_use = "the receive half must be issued before the next call"]
pub struct DispatchHook {
    handle: DeviceHandle,
    io: Vec<IoTable>,
}

/// The send half of a combine ([`GpuGroup::combine_send`]): pass it to `combine_recv`.
#[derive(Debug)]
#[must_use = "the receive half must be issued before the next call"]
pub struct CombineHook {
    path: Path,
    format: CombineFormat,
    io: Vec<IoTable>,
}

fn shape(rank: usize, tensor: &'static str, need: usize, got: usize, what: String) -> GpuError {
    Error::ShapeMismatch {
        rank,
        tensor,
        expected: need,
        got,
        shape: what,
    }
    .into()
}

/// `len >= need` or a shape error.
fn at_least(rank: usize, tensor: &'static str, need: usize, got: usize) -> Result<(), GpuError> {
    if got < need {
        return Err(shape(
            rank,
            tensor,
            need,
            got,
            format!("at least {need} elements"),
        ));
    }
    Ok(())
}

impl GpuGroup {
    /// The ranks a device-API call covers, in order: this process's rank, or every rank.
    pub fn device_ranks(&self) -> std::ops::Range<usize> {
        match self.own {
            Some(r) => r..r + 1,
            None => 0..self.cfg.num_ranks,
        }
    }

    /// What one rank's [`DeviceDispatchOut`] must hold.
    pub fn dispatch_out_sizes(&self) -> DispatchOutSizes {
        let c = &self.cfg;
        let rows = c.num_local_experts() * c.num_ranks * c.max_tokens_per_rank;
        DispatchOutSizes {
            recv_x_bytes: rows * c.recv_x_row_bytes(),
            recv_scales_bytes: rows * c.scales_per_row() * 4,
            recv_count: c.num_local_experts(),
            layout_range: c.num_local_experts() * c.num_ranks,
            src_info: rows,
        }
    }

    /// Checks a device-API call of `op` on `path`: usable group (else the refused call's poison
    /// goes to the peers on the caller's streams, `poison_refused`), no NCCL, one stream per
    /// device on its context, one entry per rank of [`GpuGroup::device_ranks`]. Returns the raw
    /// streams.
    fn device_call_check(
        &mut self,
        op: Op,
        path: Path,
        streams: &[&CudaStream],
        entries: usize,
    ) -> Result<Vec<sys::CUstream>, GpuError> {
        if let Err(e) = self.check_usable() {
            if let Ok(raw) = self.caller_streams(streams) {
                self.poison_refused(op, path, &raw);
            }
            return Err(e);
        }
        // A path the group has no receive buffers for, before any host work for the call.
        crate::runtime::footprint::check_launch(self.buffers, false, op, path, 0, false, &[])?;
        if self.nccl.is_some() && self.nccl_sizes != NcclSizes::Capacity {
            return Err(GpuError::Unsupported(
                "the device API over NCCL needs NcclSizes::Capacity: exact sizes read the batch \
                 headers on the host in the middle of the call (a host round trip, not \
                 stream-ordered)"
                    .into(),
            ));
        }
        let want = self.device_ranks().len();
        if entries != want {
            return Err(Error::WrongRankCount {
                expected: want,
                got: entries,
            }
            .into());
        }
        self.caller_streams(streams)
    }

    /// The caller's streams, one per GPU of the group, each on its GPU's context (else
    /// `ShapeMismatch` / `WrongDevice`): the raw handles to enqueue on.
    pub(crate) fn caller_streams(
        &self,
        streams: &[&CudaStream],
    ) -> Result<Vec<sys::CUstream>, GpuError> {
        if streams.len() != self.devs.len() {
            return Err(shape(
                0,
                "streams",
                self.devs.len(),
                streams.len(),
                "one stream per GPU of the group".into(),
            ));
        }
        for (s, di) in streams.iter().zip(0..) {
            self.stream_on(s, di)?;
        }
        Ok(streams.iter().map(|s| s.cu_stream()).collect())
    }

    /// `stream` must belong to the context of device `di`.
    pub(crate) fn stream_on(&self, stream: &CudaStream, di: usize) -> Result<(), GpuError> {
        let d = &self.devs[di];
        if stream.context().cu_ctx() != d.ctx.cu_ctx() {
            return Err(GpuError::WrongDevice {
                what: "the stream",
                expected: d.ctx.ordinal(),
                got: stream.context().ordinal(),
            });
        }
        Ok(())
    }

    /// Tensor `t` must live on the context of the device that runs rank `r`.
    fn same_ctx<T, S: DeviceSlice<T>>(
        &self,
        r: usize,
        what: &'static str,
        t: &S,
    ) -> Result<(), GpuError> {
        let d = &self.devs[self.dev_of(r)];
        if t.stream().context().cu_ctx() != d.ctx.cu_ctx() {
            return Err(GpuError::WrongDevice {
                what,
                expected: d.ctx.ordinal(),
                got: t.stream().context().ordinal(),
            });
        }
        Ok(())
    }

    /// Dispatch of every rank of [`GpuGroup::device_ranks`] on `path`, enqueued on `streams`
    /// (one per GPU). `outs`: one [`DeviceDispatchOut`] per rank, or None for the group's own
    /// buffers. Returns without waiting; errors found by the kernels surface at
    /// [`GpuGroup::check`].
    pub fn dispatch_device(
        &mut self,
        path: Path,
        streams: &[&CudaStream],
        ranks: &[DispatchIn<'_>],
        outs: Option<&mut [DeviceDispatchOut<'_>]>,
    ) -> Result<DeviceHandle, GpuError> {
        let hook = self.dispatch_part(path, streams, ranks, outs, 0)?;
        Ok(hook.handle)
    }

    /// The send half of [`GpuGroup::dispatch_device`]: checks, stores and signals every
    /// token; the receive half ([`GpuGroup::dispatch_recv`]) waits and writes the outputs.
    pub fn dispatch_send(
        &mut self,
        path: Path,
        streams: &[&CudaStream],
        ranks: &[DispatchIn<'_>],
        outs: Option<&mut [DeviceDispatchOut<'_>]>,
    ) -> Result<DispatchHook, GpuError> {
        self.dispatch_part(path, streams, ranks, outs, 1)
    }

    /// The receive half of a dispatch; returns the handle for combine.
    pub fn dispatch_recv(
        &mut self,
        hook: DispatchHook,
        streams: &[&CudaStream],
    ) -> Result<DeviceHandle, GpuError> {
        let raw = self.device_call_check(
            Op::Dispatch,
            hook.handle.path,
            streams,
            hook.handle.topk.len(),
        )?;
        if hook.handle.group != self.id {
            return Err(GpuError::Handle("a dispatch hook of another group".into()));
        }
        self.stage_on(
            Op::Dispatch,
            hook.handle.path,
            2,
            &raw,
            &hook.io,
            CombineFormat::Bf16,
        )?;
        self.finish_device_call(Op::Dispatch, hook.handle.path);
        Ok(hook.handle)
    }

    fn dispatch_part(
        &mut self,
        path: Path,
        streams: &[&CudaStream],
        ranks: &[DispatchIn<'_>],
        outs: Option<&mut [DeviceDispatchOut<'_>]>,
        stage: i32,
    ) -> Result<DispatchHook, GpuError> {
        let raw = self.device_call_check(Op::Dispatch, path, streams, ranks.len())?;
        let cfg = self.cfg;
        let (t, h, k) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k);
        let sizes = self.dispatch_out_sizes();
        if let Some(o) = outs.as_deref() {
            if o.len() != ranks.len() {
                return Err(Error::WrongRankCount {
                    expected: ranks.len(),
                    got: o.len(),
                }
                .into());
            }
        }
        // Host checks of every shape first: nothing is enqueued unless all pass.
        let mut ns = Vec::with_capacity(ranks.len());
        for (i, inp) in ranks.iter().enumerate() {
            let r = self.device_ranks().start + i;
            let n = match inp.n_tokens {
                Tokens::Host(n) => {
                    if n > t {
                        return Err(Error::TooManyTokens {
                            rank: r,
                            tokens: n,
                            max: t,
                        }
                        .into());
                    }
                    n
                }
                Tokens::Device(v) => {
                    at_least(r, "n_tokens", 1, v.len())?;
                    self.same_ctx(r, "n_tokens", v)?;
                    t // the kernel reads at most T tokens
                }
            };
            at_least(r, "x", n * h, inp.x.len())?;
            at_least(r, "topk_idx", n * k, inp.topk_idx.len())?;
            self.same_ctx(r, "x", inp.x)?;
            self.same_ctx(r, "topk_idx", inp.topk_idx)?;
            if let Some(o) = outs.as_deref() {
                let o = &o[i];
                at_least(r, "recv_x", sizes.recv_x_bytes, o.recv_x.len())?;
                match &o.recv_scales {
                    Some(s) => at_least(r, "recv_scales", sizes.recv_scales_bytes, s.len())?,
                    None if sizes.recv_scales_bytes > 0 => {
                        return Err(shape(
                            r,
                            "recv_scales",
                            sizes.recv_scales_bytes,
                            0,
                            "FP8 dispatch needs a scales buffer".into(),
                        ))
                    }
                    None => {}
                }
                at_least(r, "recv_count", sizes.recv_count, o.recv_count.len())?;
                at_least(r, "layout_range", sizes.layout_range, o.layout_range.len())?;
                at_least(r, "src_info", sizes.src_info, o.src_info.len())?;
                self.same_ctx(r, "recv_x", &o.recv_x)?;
                self.same_ctx(r, "recv_count", &o.recv_count)?;
                self.same_ctx(r, "layout_range", &o.layout_range)?;
                self.same_ctx(r, "src_info", &o.src_info)?;
                if let Some(s) = &o.recv_scales {
                    self.same_ctx(r, "recv_scales", s)?;
                }
                if let Some(s) = &o.recv_stats {
                    at_least(r, "recv_stats", sizes.recv_count, s.len())?;
                    self.same_ctx(r, "recv_stats", s)?;
                }
                if let Some(s) = &o.wait_stats {
                    at_least(r, "wait_stats", self.cfg.num_ranks, s.len())?;
                    self.same_ctx(r, "wait_stats", s)?;
                }
            }
            ns.push(n);
        }
        if self.nccl.is_some() {
            check_sizes(&self.cfg, path, self.nccl_sizes)?;
        }
        // The addresses, per device table. The SyncOnDrop guards (cudarc's event tracking:
        // the stream waits for earlier writes of each tensor, and records this use) live until
        // the launch is enqueued.
        let mut io = self.io_tables();
        let mut topk = Vec::with_capacity(ranks.len());
        let mut out_len = Vec::with_capacity(ranks.len());
        let mut guards = Vec::new();
        for (i, inp) in ranks.iter().enumerate() {
            let r = self.device_ranks().start + i;
            let di = self.dev_of(r);
            let s = streams[di];
            let slot = &mut io[di].r[r - self.devs[di].first_rank];
            let (x, gx) = inp.x.device_ptr(s);
            let (tk, gt) = inp.topk_idx.device_ptr(s);
            guards.push(gx);
            guards.push(gt);
            slot.x = x;
            slot.topk = tk;
            topk.push(tk);
            out_len.push(ns[i] * h);
            match inp.n_tokens {
                Tokens::Device(v) => {
                    let (p, g) = v.device_ptr(s);
                    guards.push(g);
                    slot.ntok = p;
                }
                Tokens::Host(n) => {
                    // The count goes into the rank's meta word, in stream order.
                    self.devs[di].bind()?;
                    // SAFETY: `meta` is a live 16-byte buffer of this group on the bound
                    // context; the stream belongs to it (checked).
                    cuda("set n_tokens", unsafe {
                        driver::memset_d32_async(self.ptrs[r].meta, n as u32, 1, raw[di])
                    })?;
                }
            }
        }
        if let Some(o) = outs {
            for (i, o) in o.iter_mut().enumerate() {
                let r = self.device_ranks().start + i;
                let di = self.dev_of(r);
                let s = streams[di];
                let slot = &mut io[di].r[r - self.devs[di].first_rank];
                let (p, g) = o.recv_x.device_ptr_mut(s);
                slot.recv_x = p;
                guards.push(g);
                if let Some(sc) = o.recv_scales.as_mut() {
                    let (p, g) = sc.device_ptr_mut(s);
                    slot.recv_scales = p;
                    guards.push(g);
                }
                let (p, g) = o.recv_count.device_ptr_mut(s);
                slot.recv_count = p;
                guards.push(g);
                let (p, g) = o.layout_range.device_ptr_mut(s);
                slot.layout = p;
                guards.push(g);
                let (p, g) = o.src_info.device_ptr_mut(s);
                slot.src_info = p;
                guards.push(g);
                if let Some(st) = o.recv_stats.as_mut() {
                    let (p, g) = st.device_ptr_mut(s);
                    slot.recv_stats = p;
                    guards.push(g);
                }
                if let Some(st) = o.wait_stats.as_mut() {
                    let (p, g) = st.device_ptr_mut(s);
                    slot.wait_stats = p;
                    guards.push(g);
                }
            }
        }
        self.stage_on(Op::Dispatch, path, stage, &raw, &io, CombineFormat::Bf16)?;
        drop(guards);
        let call = self.calls[kind(Op::Dispatch, path)] + 1;
        if stage == 0 {
            self.finish_device_call(Op::Dispatch, path);
        }
        Ok(DispatchHook {
            handle: DeviceHandle {
                group: self.id,
                path,
                call,
                topk,
                out_len,
            },
            io,
        })
    }

    /// Stage 0 (whole call), 1 (send half) or 2 (receive half) on the caller's streams: one
    /// kernel launch, or over NCCL the pack / exchange / unpack sequence of that part (bf16
    /// only: a combine's `format` was checked, [`GpuGroup::check_combine_format`]).
    fn stage_on(
        &mut self,
        op: Op,
        path: Path,
        stage: i32,
        streams: &[sys::CUstream],
        io: &[IoTable],
        format: CombineFormat,
    ) -> Result<(), GpuError> {
        if self.nccl.is_some() {
            self.nccl_call(op, path, streams, io, stage)
        } else {
            self.launch_stage_on(op, path, stage, streams, io, format)
        }
    }

    /// Bookkeeping after a whole device-API call (or its receive half) was enqueued.
    fn finish_device_call(&mut self, op: Op, path: Path) {
        if op == Op::Dispatch {
            self.last_dispatch = Some(path);
        }
        self.last_op = Some(op);
        self.calls[kind(op, path)] += 1;
        // The harness's host copy of the routing no longer describes the device state.
        for v in &mut self.topk {
            v.clear();
        }
    }

    /// Combine of every rank of [`GpuGroup::device_ranks`] after the dispatch of `handle`,
    /// enqueued on `streams`; rank i's n x H result goes to `outs[i]`. The rows travel as bf16.
    pub fn combine_device(
        &mut self,
        streams: &[&CudaStream],
        handle: &DeviceHandle,
        ranks: &[CombineIn<'_>],
        outs: &mut [CudaViewMut<'_, bf16>],
    ) -> Result<(), GpuError> {
        self.combine_device_opts(
            streams,
            handle,
            ranks,
            outs,
            CombineOpts::format(CombineFormat::Bf16),
        )
    }

    /// [`GpuGroup::combine_device`] with every option ([`CombineOpts`]): the rows in
    /// `opts.format` (DeepEP's `use_logfmt`), as `EpRank::combine_with` on the CPU: LogFMT-10
    /// rows are encoded by their owner and decoded in the reduction, the bits of
    /// `ep_reference::oracle::combine_with`; and the wait statistics. A format the group cannot
    /// run is refused before anything is enqueued ([`GpuGroup::check_combine_format`]).
    pub fn combine_device_opts(
        &mut self,
        streams: &[&CudaStream],
        handle: &DeviceHandle,
        ranks: &[CombineIn<'_>],
        outs: &mut [CudaViewMut<'_, bf16>],
        opts: CombineOpts<'_, '_>,
    ) -> Result<(), GpuError> {
        // The whole call: its receive half ran in the same launch, the hook has nothing due.
        let _whole = self.combine_part(streams, handle, ranks, outs, 0, opts)?;
        Ok(())
    }

    /// The send half of [`GpuGroup::combine_device`]: every expert row goes back to its source.
    pub fn combine_send(
        &mut self,
        streams: &[&CudaStream],
        handle: &DeviceHandle,
        ranks: &[CombineIn<'_>],
        outs: &mut [CudaViewMut<'_, bf16>],
    ) -> Result<CombineHook, GpuError> {
        self.combine_send_opts(
            streams,
            handle,
            ranks,
            outs,
            CombineOpts::format(CombineFormat::Bf16),
        )
    }

    /// [`GpuGroup::combine_send`] with every option ([`CombineOpts`]): the rows in
    /// `opts.format`, which the hook's receive half decodes ([`GpuGroup::combine_device_opts`]),
    /// and the statistics the receive half adds its waits to.
    pub fn combine_send_opts(
        &mut self,
        streams: &[&CudaStream],
        handle: &DeviceHandle,
        ranks: &[CombineIn<'_>],
        outs: &mut [CudaViewMut<'_, bf16>],
        opts: CombineOpts<'_, '_>,
    ) -> Result<CombineHook, GpuError> {
        self.combine_part(streams, handle, ranks, outs, 1, opts)
    }

    /// The receive half of a combine: waits for the rows and reduces them into the outputs
    /// given to `combine_send`.
    pub fn combine_recv(
        &mut self,
        hook: CombineHook,
        streams: &[&CudaStream],
    ) -> Result<(), GpuError> {
        let n = self.device_ranks().len();
        let raw = self.device_call_check(Op::Combine, hook.path, streams, n)?;
        self.stage_on(Op::Combine, hook.path, 2, &raw, &hook.io, hook.format)?;
        self.finish_device_call(Op::Combine, hook.path);
        Ok(())
    }

    fn combine_part(
        &mut self,
        streams: &[&CudaStream],
        handle: &DeviceHandle,
        ranks: &[CombineIn<'_>],
        outs: &mut [CudaViewMut<'_, bf16>],
        stage: i32,
        opts: CombineOpts<'_, '_>,
    ) -> Result<CombineHook, GpuError> {
        let CombineOpts { format, wait_stats } = opts;
        let path = handle.path;
        let raw = self.device_call_check(Op::Combine, path, streams, ranks.len())?;
        if handle.group != self.id {
            return Err(GpuError::Handle("a handle of another group".into()));
        }
        self.check_combine_format(format)?;
        self.check_combine_path(path)?;
        let latest = self.calls[kind(Op::Dispatch, path)];
        if handle.call != latest {
            return Err(GpuError::Handle(format!(
                "the handle is of {} dispatch call {}, the group holds call {latest}'s state",
                path.name(),
                handle.call
            )));
        }
        if outs.len() != ranks.len() || handle.topk.len() != ranks.len() {
            return Err(Error::WrongRankCount {
                expected: handle.topk.len(),
                got: outs.len().min(ranks.len()),
            }
            .into());
        }
        if let Some(ws) = wait_stats.as_deref() {
            if ws.len() != ranks.len() {
                return Err(Error::WrongRankCount {
                    expected: ranks.len(),
                    got: ws.len(),
                }
                .into());
            }
            for (i, w) in ws.iter().enumerate() {
                let r = self.device_ranks().start + i;
                at_least(r, "wait_stats", self.cfg.num_ranks, w.len())?;
                self.same_ctx(r, "wait_stats", w)?;
            }
        }
        let cfg = self.cfg;
        let y_len = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
        let (t, k) = (cfg.max_tokens_per_rank, cfg.top_k);
        for (i, inp) in ranks.iter().enumerate() {
            let r = self.device_ranks().start + i;
            at_least(r, "y", y_len, inp.y.len())?;
            // The weights are read for the dispatched tokens: at most T (Tokens::Device).
            let n_max = handle.out_len[i] / cfg.hidden;
            at_least(r, "topk_weights", n_max.min(t) * k, inp.topk_weights.len())?;
            at_least(r, "out", handle.out_len[i], outs[i].len())?;
            self.same_ctx(r, "y", inp.y)?;
            self.same_ctx(r, "topk_weights", inp.topk_weights)?;
            self.same_ctx(r, "out", &outs[i])?;
            // The routing combine reduces with is its dispatch's (the group keeps it with the
            // handle): topk_idx is checked for its shape only, so a copy of the dispatched
            // values at another address (vLLM's EPLB passes one) is accepted.
            at_least(r, "topk_idx", n_max.min(t) * k, inp.topk_idx.len())?;
            self.same_ctx(r, "topk_idx", inp.topk_idx)?;
        }
        let mut io = self.io_tables();
        let mut guards = Vec::new();
        // Rank i's statistics, in rank order (their count was checked above).
        let mut waits = wait_stats.map(|ws| ws.iter_mut());
        for (i, (inp, out)) in ranks.iter().zip(outs.iter_mut()).enumerate() {
            let r = self.device_ranks().start + i;
            let di = self.dev_of(r);
            let s = streams[di];
            let slot = &mut io[di].r[r - self.devs[di].first_rank];
            let (p, g) = inp.y.device_ptr(s);
            slot.y = p;
            guards.push(g);
            let (p, g) = inp.topk_weights.device_ptr(s);
            slot.weights = p;
            guards.push(g);
            let (p, g) = out.device_ptr_mut(s);
            slot.out = p;
            guards.push(g);
            if let Some(w) = waits.as_mut().and_then(|it| it.next()) {
                let (p, g) = w.device_ptr_mut(s);
                slot.wait_stats = p;
                guards.push(g);
            }
        }
        self.stage_on(Op::Combine, path, stage, &raw, &io, format)?;
        drop(guards);
        if stage == 0 {
            self.finish_device_call(Op::Combine, path);
        }
        Ok(CombineHook { path, format, io })
    }

    /// The one-rank face of a process-mode group (or of a single-rank group).
    pub fn rank_ep(&mut self) -> Result<RankEp<'_>, GpuError> {
        if self.device_ranks().len() != 1 {
            return Err(GpuError::Unsupported(format!(
                "RankEp is one rank; this group runs {} ranks in this process (use dispatch_device)",
                self.device_ranks().len()
            )));
        }
        Ok(RankEp { group: self })
    }
}

/// One rank's dispatch/combine on the caller's stream (process mode: one rank per process).
pub struct RankEp<'g> {
    group: &'g mut GpuGroup,
}

impl RankEp<'_> {
    /// Dispatch of this rank's `n_tokens` tokens on `path` (see the module docs).
    pub fn dispatch(
        &mut self,
        path: Path,
        stream: &CudaStream,
        x: &CudaView<'_, bf16>,
        topk_idx: &CudaView<'_, i64>,
        n_tokens: Tokens<'_>,
        out: Option<&mut DeviceDispatchOut<'_>>,
    ) -> Result<DeviceHandle, GpuError> {
        let inp = [DispatchIn {
            x,
            topk_idx,
            n_tokens,
        }];
        let outs = out.map(std::slice::from_mut);
        self.group.dispatch_device(path, &[stream], &inp, outs)
    }

    /// Combine of this rank after the dispatch of `handle`: `out` receives n x H bf16.
    pub fn combine(
        &mut self,
        stream: &CudaStream,
        y: &CudaView<'_, bf16>,
        topk_idx: &CudaView<'_, i64>,
        topk_weights: &CudaView<'_, f32>,
        handle: &DeviceHandle,
        out: &mut CudaViewMut<'_, bf16>,
    ) -> Result<(), GpuError> {
        self.combine_with(
            stream,
            y,
            topk_idx,
            topk_weights,
            handle,
            out,
            CombineFormat::Bf16,
        )
    }

    /// [`RankEp::combine`] with the rows in `format` ([`GpuGroup::combine_device_opts`]).
    #[allow(clippy::too_many_arguments)]
    pub fn combine_with(
        &mut self,
        stream: &CudaStream,
        y: &CudaView<'_, bf16>,
        topk_idx: &CudaView<'_, i64>,
        topk_weights: &CudaView<'_, f32>,
        handle: &DeviceHandle,
        out: &mut CudaViewMut<'_, bf16>,
        format: CombineFormat,
    ) -> Result<(), GpuError> {
        let inp = [CombineIn {
            y,
            topk_idx,
            topk_weights,
        }];
        let mut o = [out.slice_mut(..)];
        self.group
            .combine_device_opts(&[stream], handle, &inp, &mut o, CombineOpts::format(format))
    }

    /// Reads the device error word ([`GpuGroup::check`]).
    pub fn check(&mut self) -> Result<(), GpuError> {
        self.group.check()
    }
}
