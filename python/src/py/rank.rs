//! The Buffer's two native classes: [`CallSpec`], a group's shape validated once with the checks
//! of every tensor a call hands over (made without a GPU, so the checks are tested anywhere), and
//! [`GpuRank`], one rank of a process-mode GPU group with one native method per half of a call
//! (`dispatch`, `dispatch_send`, `dispatch_recv`, and the same for combine). A call takes the
//! tensors themselves, checks each against the spec (dtype, shape, strides, device), and enqueues
//! on the raw CUDA stream it is given; the rank owns a call's state: the handles, the pending
//! halves and the tensors of a send half whose receive half is still due. The C ABI (`c_abi`,
//! what the C++ torch extension calls) reaches the same rank: the same checks
//! ([`CallSpec::dispatch_ptrs_with`], [`CallSpec::combine_ptrs_with`]) on tensors it reads from
//! descriptors, and the same enqueue ([`Enqueue`]).

use super::exceptions::{to_py, IntoPy};
use super::reader::{read_all, req, Reader, COMBINE_TENSORS, DISPATCH_TENSORS};
use super::tensors::{meta, meta_opt, Dtypes};
use crate::error::BindError;
use crate::gpu::{Ptr, RankGroup, Spec};
use crate::host;
use crate::keywords;
use crate::spec::{CombineMetas, CombinePtrs, DispatchMetas, DispatchPtrs};
use crate::tensor::Meta;
use crate::tensor::{check, Dtype, Layout, Want};
use ep_reference::{CombineFormat, Config, Op};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use std::time::Duration;

/// The config of these arguments (DeepEP's names), or the error naming the bad value: the one
/// parse of a shape for the module's functions and `CallSpec`.
#[allow(clippy::too_many_arguments)]
pub(super) fn config(
    num_ranks: usize,
    num_experts: usize,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> PyResult<Config> {
    Config::new(
        num_ranks,
        num_experts,
        tokens,
        hidden,
        top_k,
        host::mode(use_fp8, round_scale, use_ue8m0),
    )
    .py_err()
}

pub(super) fn duration(argument: &str, seconds: f64) -> PyResult<Duration> {
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= 86_400.0) {
        return Err(to_py(BindError::argument(
            argument,
            format!("{seconds} is not a number of seconds in (0, 86400]"),
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A group's shape (validated once, when made) and the device its tensors live on; checks the
/// tensors of a call. Immutable.
#[pyclass(frozen, module = "ep_dispatch._ep_dispatch")]
pub(super) struct CallSpec {
    spec: Spec,
    dtypes: Dtypes,
}

/// What `CallSpec.check_dispatch` returns (see there).
pub(super) type DispatchAddrs = (
    usize,
    Ptr,
    Ptr,
    Ptr,
    Option<Ptr>,
    Ptr,
    Ptr,
    Ptr,
    Option<Ptr>,
    Option<Ptr>,
);

impl CallSpec {
    /// The one check of a dispatch's tensors, whoever reads them: reads each (`read`, in
    /// [`DISPATCH_TENSORS`] order), then checks them against the spec (`Spec::dispatch`).
    pub(super) fn dispatch_ptrs_with(&self, read: &mut Reader<'_>) -> PyResult<DispatchPtrs> {
        let m = read_all(&DISPATCH_TENSORS, read)?;
        self.spec
            .dispatch(&DispatchMetas {
                x: req(&m[0], "x")?,
                topk_idx: req(&m[1], "topk_idx")?,
                recv_x: req(&m[2], "recv_x")?,
                recv_x_scales: m[3].as_ref(),
                recv_count: req(&m[4], "recv_count")?,
                src_info: req(&m[5], "src_info")?,
                layout_range: req(&m[6], "layout_range")?,
                recv_stats: m[7].as_ref(),
                wait_stats: m[8].as_ref(),
            })
            .py_err()
    }

    /// The one check of a combine's tensors after a dispatch of `num_tokens` tokens: the format
    /// first (LogFMT needs H a multiple of 128: `HiddenNotMultiple`, mode "logfmt", as the CPU
    /// paths refuse it), then each tensor read (`read`, in [`COMBINE_TENSORS`] order) and
    /// checked against the spec (`Spec::combine`).
    pub(super) fn combine_ptrs_with(
        &self,
        num_tokens: usize,
        format: CombineFormat,
        read: &mut Reader<'_>,
    ) -> PyResult<CombinePtrs> {
        format.check(self.spec.config()).py_err()?;
        let m = read_all(&COMBINE_TENSORS, read)?;
        self.spec
            .combine(
                num_tokens,
                &CombineMetas {
                    y: req(&m[0], "x")?,
                    topk_idx: req(&m[1], "topk_idx")?,
                    topk_weights: req(&m[2], "topk_weights")?,
                    out: req(&m[3], "out")?,
                    wait_stats: m[4].as_ref(),
                },
            )
            .py_err()
    }

    /// A reader of Python tensor objects (`tensors::meta`), `ts` in the call's order.
    fn py_reader<'a, 'py>(
        &'a self,
        ts: &'a [Option<&'a Bound<'py, PyAny>>],
    ) -> impl FnMut(usize, &'static str, bool) -> PyResult<Option<Meta>> + 'a {
        move |i, name, optional| {
            let t = ts[i];
            if optional {
                meta_opt(name, t, &self.dtypes)
            } else {
                match t {
                    Some(t) => meta(name, t, &self.dtypes).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn dispatch_ptrs(
        &self,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        recv_x: &Bound<'_, PyAny>,
        recv_x_scales: Option<&Bound<'_, PyAny>>,
        recv_count: &Bound<'_, PyAny>,
        src_info: &Bound<'_, PyAny>,
        layout_range: &Bound<'_, PyAny>,
        recv_stats: Option<&Bound<'_, PyAny>>,
        wait_stats: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<DispatchPtrs> {
        let ts = [
            Some(x),
            Some(topk_idx),
            Some(recv_x),
            recv_x_scales,
            Some(recv_count),
            Some(src_info),
            Some(layout_range),
            recv_stats,
            wait_stats,
        ];
        let mut read = self.py_reader(&ts);
        self.dispatch_ptrs_with(&mut read)
    }

    /// The combine's tensors checked (as `check_combine`).
    #[allow(clippy::too_many_arguments)]
    fn combine_ptrs(
        &self,
        num_tokens: usize,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        wait_stats: Option<&Bound<'_, PyAny>>,
        format: CombineFormat,
    ) -> PyResult<CombinePtrs> {
        let ts = [
            Some(x),
            Some(topk_idx),
            Some(topk_weights),
            Some(out),
            wait_stats,
        ];
        let mut read = self.py_reader(&ts);
        self.combine_ptrs_with(num_tokens, format, &mut read)
    }

    /// `int32 [R]` on the spec's device (the shrink mode's mask).
    fn mask_ptr(&self, out: &Bound<'_, PyAny>) -> PyResult<Ptr> {
        let m = meta("mask_status", out, &self.dtypes)?;
        let r = [self.spec.config().num_ranks];
        let want = Want {
            dtype: Dtype::I32,
            shape: &r,
            layout: Layout::RowMajor,
        };
        check("mask_status", &m, want, self.spec.device()).py_err()
    }
}

#[pymethods]
impl CallSpec {
    /// Validates the shape (raises `ConfigError` / `ArgumentError` naming the bad value).
    /// `device`: the CUDA ordinal of every tensor (-1: the host, for tests); `dtypes`: torch's
    /// `(bfloat16, float8_e4m3fn, float32, int32, int64)`.
    #[new]
    #[pyo3(signature = (num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden, top_k, use_fp8, round_scale, use_ue8m0, device, dtypes))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_ranks: usize,
        num_experts: usize,
        num_max_dispatch_tokens_per_rank: usize,
        hidden: usize,
        top_k: usize,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        device: i64,
        dtypes: &Bound<'_, PyTuple>,
    ) -> PyResult<CallSpec> {
        let cfg = config(
            num_ranks,
            num_experts,
            num_max_dispatch_tokens_per_rank,
            hidden,
            top_k,
            use_fp8,
            round_scale,
            use_ue8m0,
        )?;
        Ok(CallSpec {
            spec: Spec::new(cfg, device).py_err()?,
            dtypes: Dtypes::new(dtypes)?,
        })
    }

    /// `(num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden, top_k, use_fp8,
    /// round_scale, use_ue8m0, device)`.
    #[getter]
    #[allow(clippy::type_complexity)]
    fn shape(&self) -> (usize, usize, usize, usize, usize, bool, bool, bool, i64) {
        let c = self.spec.config();
        let (fp8, round, ue8m0) = match c.mode {
            ep_reference::Mode::Bf16 => (false, false, false),
            ep_reference::Mode::Fp8 { round_scale, ue8m0 } => (true, round_scale, ue8m0),
        };
        (
            c.num_ranks,
            c.num_experts,
            c.max_tokens_per_rank,
            c.hidden,
            c.top_k,
            fp8,
            round,
            ue8m0,
            self.spec.device(),
        )
    }

    /// Checks a dispatch's tensors (`layout_range`: `int32 [L, R, 2]`, the (begin, count) pairs);
    /// returns `(num_tokens, x, topk_idx, recv_x, recv_x_scales, recv_count, src_info,
    /// layout_range, recv_stats, wait_stats)`, each tensor as `(data_ptr, length)`: elements,
    /// bytes for recv_x and its scales, int64 entries for layout_range (None for statistics not
    /// passed). What the native rank enqueues with.
    #[pyo3(signature = (x, topk_idx, recv_x, recv_x_scales, recv_count, src_info, layout_range, recv_stats=None, wait_stats=None))]
    #[allow(clippy::too_many_arguments)]
    fn check_dispatch(
        &self,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        recv_x: &Bound<'_, PyAny>,
        recv_x_scales: Option<&Bound<'_, PyAny>>,
        recv_count: &Bound<'_, PyAny>,
        src_info: &Bound<'_, PyAny>,
        layout_range: &Bound<'_, PyAny>,
        recv_stats: Option<&Bound<'_, PyAny>>,
        wait_stats: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<DispatchAddrs> {
        let p = self.dispatch_ptrs(
            x,
            topk_idx,
            recv_x,
            recv_x_scales,
            recv_count,
            src_info,
            layout_range,
            recv_stats,
            wait_stats,
        )?;
        Ok(dispatch_addrs(&p))
    }

    /// Checks a combine's tensors after a dispatch of `num_tokens` tokens (and, with
    /// `use_logfmt`, that H suits LogFMT); returns `(x, topk_idx, topk_weights, out,
    /// wait_stats)` as `(data_ptr, elements)` (None for statistics not passed).
    #[pyo3(signature = (num_tokens, x, topk_idx, topk_weights, out, wait_stats=None, use_logfmt=false))]
    #[allow(clippy::too_many_arguments)]
    fn check_combine(
        &self,
        num_tokens: usize,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        wait_stats: Option<&Bound<'_, PyAny>>,
        use_logfmt: bool,
    ) -> PyResult<CombineAddrs> {
        let f = format_of(use_logfmt);
        let p = self.combine_ptrs(num_tokens, x, topk_idx, topk_weights, out, wait_stats, f)?;
        Ok(combine_addrs(&p))
    }
}

/// A dispatch's checked addresses as `CallSpec.check_dispatch` returns them.
pub(super) fn dispatch_addrs(p: &DispatchPtrs) -> DispatchAddrs {
    (
        p.num_tokens,
        p.x,
        p.topk_idx,
        p.recv_x,
        p.recv_x_scales,
        p.recv_count,
        p.src_info,
        p.layout_range,
        p.recv_stats,
        p.wait_stats,
    )
}

/// What `CallSpec.check_combine` returns (see there).
pub(super) type CombineAddrs = (Ptr, Ptr, Ptr, Ptr, Option<Ptr>);

/// A combine's checked addresses as `CallSpec.check_combine` returns them.
pub(super) fn combine_addrs(p: &CombinePtrs) -> CombineAddrs {
    (p.y, p.topk_idx, p.topk_weights, p.out, p.wait_stats)
}

/// DeepEP's `use_logfmt` as the combine's format.
pub(super) fn format_of(use_logfmt: bool) -> CombineFormat {
    if use_logfmt {
        CombineFormat::LogFmt
    } else {
        CombineFormat::Bf16
    }
}

/// References to the tensors of a send half, kept until its receive half is enqueued.
pub(super) type Held = Vec<Py<PyAny>>;

fn hold(ts: &[&Bound<'_, PyAny>], opt: &[Option<&Bound<'_, PyAny>>]) -> Held {
    ts.iter()
        .map(|t| Bound::clone(t).unbind())
        .chain(opt.iter().flatten().map(|t| Bound::clone(t).unbind()))
        .collect()
}

/// What a rank does with a call's checked addresses: the native methods below and the C ABI's
/// entries (`c_abi`) both check the tensors with the rank's [`CallSpec`] and then call these, so
/// the two ways in share one path. `send`: `Some(tensors to hold)` for a send half (held until
/// its receive half is enqueued), None for a whole call.
pub(super) trait Enqueue {
    fn call_spec(&self) -> &CallSpec;

    fn enqueue_dispatch(
        &mut self,
        py: Python<'_>,
        stream: u64,
        p: &DispatchPtrs,
        send: Option<Held>,
    ) -> PyResult<u64>;

    /// The token count of dispatch `handle` (what its combine's tensors are checked against).
    fn dispatched_tokens(&self, py: Python<'_>, handle: u64) -> PyResult<usize>;

    #[allow(clippy::too_many_arguments)]
    fn enqueue_combine(
        &mut self,
        py: Python<'_>,
        stream: u64,
        handle: u64,
        p: &CombinePtrs,
        format: CombineFormat,
        send: Option<Held>,
    ) -> PyResult<u64>;

    /// Enqueues the receive half of the `op` call `id` (a send half's id) on `stream` and frees
    /// the tensors its send half held: true; false where a later call of that operation
    /// enqueued it already (then nothing is enqueued); the `ArgumentError` of argument `hook`
    /// for an id this rank never gave; the group's recorded error (typed) where it failed.
    fn enqueue_recv(&mut self, py: Python<'_>, stream: u64, op: Op, id: u64) -> PyResult<bool>;
}

/// One rank of a process-mode GPU group (see `gpu::RankGroup`). Not shared between threads.
#[pyclass(unsendable, module = "ep_dispatch._ep_dispatch")]
pub(super) struct GpuRank {
    inner: RankGroup,
    spec: Py<CallSpec>,
    /// The tensors of the dispatch (combine) whose receive half is still due.
    held_dispatch: Option<Held>,
    held_combine: Option<Held>,
}

impl GpuRank {
    /// After a call: a send half no longer due frees its tensors.
    fn release(&mut self) {
        if self.inner.pending_dispatch().is_none() {
            self.held_dispatch = None;
        }
        if self.inner.pending_combine().is_none() {
            self.held_combine = None;
        }
    }
}

impl Enqueue for GpuRank {
    fn call_spec(&self) -> &CallSpec {
        self.spec.get()
    }

    fn enqueue_dispatch(
        &mut self,
        _py: Python<'_>,
        stream: u64,
        p: &DispatchPtrs,
        send: Option<Held>,
    ) -> PyResult<u64> {
        let r = match send {
            None => self.inner.dispatch(stream, p),
            Some(_) => self.inner.dispatch_send(stream, p),
        }
        .py_err();
        self.release();
        if r.is_ok() && send.is_some() {
            self.held_dispatch = send;
        }
        r
    }

    fn dispatched_tokens(&self, _py: Python<'_>, handle: u64) -> PyResult<usize> {
        self.inner.dispatched_tokens(handle).py_err()
    }

    fn enqueue_combine(
        &mut self,
        _py: Python<'_>,
        stream: u64,
        handle: u64,
        p: &CombinePtrs,
        format: CombineFormat,
        send: Option<Held>,
    ) -> PyResult<u64> {
        let r = match send {
            None => self.inner.combine(stream, handle, p, format),
            Some(_) => self.inner.combine_send(stream, handle, p, format),
        }
        .py_err();
        self.release();
        if r.is_ok() && send.is_some() {
            self.held_combine = send;
        }
        r
    }

    fn enqueue_recv(&mut self, _py: Python<'_>, stream: u64, op: Op, id: u64) -> PyResult<bool> {
        let r = match op {
            Op::Dispatch => self.inner.dispatch_recv(stream, id),
            Op::Combine => self.inner.combine_recv(stream, id),
        }
        .py_err();
        self.release();
        r
    }
}

#[pymethods]
impl GpuRank {
    /// Forms the group on `spec`'s device; collective. `all_gather(blob: bytes) -> list[bytes]`
    /// exchanges one blob per rank in rank order.
    #[new]
    #[pyo3(signature = (spec, rank, path, transport, timeout_s, all_gather, trap_on_error=false, enable_shrink=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        spec: Py<CallSpec>,
        rank: usize,
        path: &str,
        transport: &str,
        timeout_s: f64,
        all_gather: Bound<'_, PyAny>,
        trap_on_error: bool,
        enable_shrink: bool,
    ) -> PyResult<GpuRank> {
        let p = keywords::path(path).py_err()?;
        let t = keywords::transport(transport).py_err()?;
        let timeout = duration("timeout_s", timeout_s)?;
        let mut gather = |blob: &[u8]| -> Result<Vec<Vec<u8>>, String> {
            let got = all_gather
                .call1((PyBytes::new(py, blob),))
                .map_err(|e| format!("all_gather raised {e}"))?;
            got.extract::<Vec<Vec<u8>>>()
                .map_err(|e| format!("all_gather did not return a list of bytes: {e}"))
        };
        let inner = RankGroup::new(
            &spec.get().spec,
            p,
            t,
            timeout,
            trap_on_error,
            enable_shrink,
            rank,
            &mut gather,
        )
        .py_err()?;
        Ok(GpuRank {
            inner,
            spec,
            held_dispatch: None,
            held_combine: None,
        })
    }

    /// "NVIDIA H200 (sm_90, 132 SMs) x 1".
    fn describe_devices(&self) -> String {
        self.inner.describe_devices()
    }

    /// Bit d set when this rank reaches peer d through NCCL (the others through CUDA IPC): a
    /// Python int of up to 256 bits (groups of up to 256 ranks).
    fn nccl_mask<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut bits = vec![false; self.inner.nccl_peers().last().map_or(0, |&d| d + 1)];
        for d in self.inner.nccl_peers() {
            bits[d] = true;
        }
        // Most significant first, as int(s, 2) reads it.
        let s: String = std::iter::once('0')
            .chain(bits.iter().rev().map(|&b| if b { '1' } else { '0' }))
            .collect();
        py.get_type::<pyo3::types::PyInt>().call1((s, 2))
    }

    /// Errors the kernels recorded (timeout, bad routing, bad peer data), raised as the
    /// contract's exceptions. Synchronous; not inside CUDA graph capture.
    fn check(&mut self) -> PyResult<()> {
        self.inner.check().py_err()
    }

    /// Raises what the kernels recorded so far, without waiting for them (no sync; every
    /// dispatch and combine makes the same check at its entry).
    fn poll(&self) -> PyResult<()> {
        self.inner.poll().py_err()
    }

    /// Copies this rank's mask into `mask_status` (`int32 [R]`, 1: masked) on `stream`.
    fn query_mask(&self, stream: u64, mask_status: &Bound<'_, PyAny>) -> PyResult<()> {
        let out = self.spec.get().mask_ptr(mask_status)?;
        self.inner.query_mask(stream, out).py_err()
    }

    /// Masks (`masked`) or unmasks `peer` in this rank's mask, on `stream`.
    fn update_mask(&mut self, stream: u64, peer: usize, masked: bool) -> PyResult<()> {
        self.inner.update_mask(stream, peer, masked).py_err()
    }

    /// Clears this rank's mask and resets its protocol state, on `stream`.
    fn clean_mask(&mut self, stream: u64) -> PyResult<()> {
        self.inner.clean_mask(stream).py_err()
    }

    /// Test hook (feature `testing`): rank `rank` (None: no rank) never signals, so its peers'
    /// waits run out.
    #[cfg(feature = "testing")]
    fn _set_fault_rank(&mut self, rank: Option<usize>) {
        self.inner.set_fault_rank(rank);
    }

    /// The id of the dispatch whose receive half is still due, or None.
    fn pending_dispatch(&self) -> Option<u64> {
        self.inner.pending_dispatch()
    }

    /// The id of the combine whose receive half is still due, or None.
    fn pending_combine(&self) -> Option<u64> {
        self.inner.pending_combine()
    }

    /// Enqueues a whole dispatch on the raw CUDA stream `stream` (a due receive half first),
    /// after checking every tensor (`CallSpec.check_dispatch`). Returns the handle id combine
    /// takes.
    #[pyo3(signature = (stream, x, topk_idx, recv_x, recv_x_scales, recv_count, src_info, layout_range, recv_stats=None, wait_stats=None))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        py: Python<'_>,
        stream: u64,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        recv_x: &Bound<'_, PyAny>,
        recv_x_scales: Option<&Bound<'_, PyAny>>,
        recv_count: &Bound<'_, PyAny>,
        src_info: &Bound<'_, PyAny>,
        layout_range: &Bound<'_, PyAny>,
        recv_stats: Option<&Bound<'_, PyAny>>,
        wait_stats: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let p = self.spec.get().dispatch_ptrs(
            x,
            topk_idx,
            recv_x,
            recv_x_scales,
            recv_count,
            src_info,
            layout_range,
            recv_stats,
            wait_stats,
        )?;
        self.enqueue_dispatch(py, stream, &p, None)
    }

    /// Enqueues a dispatch's send half (as `dispatch`); its tensors are held here until the
    /// receive half (`dispatch_recv`, or the next dispatch) is enqueued. Returns its id.
    #[pyo3(signature = (stream, x, topk_idx, recv_x, recv_x_scales, recv_count, src_info, layout_range, recv_stats=None, wait_stats=None))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_send(
        &mut self,
        py: Python<'_>,
        stream: u64,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        recv_x: &Bound<'_, PyAny>,
        recv_x_scales: Option<&Bound<'_, PyAny>>,
        recv_count: &Bound<'_, PyAny>,
        src_info: &Bound<'_, PyAny>,
        layout_range: &Bound<'_, PyAny>,
        recv_stats: Option<&Bound<'_, PyAny>>,
        wait_stats: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let p = self.spec.get().dispatch_ptrs(
            x,
            topk_idx,
            recv_x,
            recv_x_scales,
            recv_count,
            src_info,
            layout_range,
            recv_stats,
            wait_stats,
        )?;
        let ts = [x, topk_idx, recv_x, recv_count, src_info, layout_range];
        let held = hold(&ts, &[recv_x_scales, recv_stats, wait_stats]);
        self.enqueue_dispatch(py, stream, &p, Some(held))
    }

    /// Enqueues the receive half of dispatch `id` on `stream`: True; False where a later call
    /// enqueued it already.
    fn dispatch_recv(&mut self, py: Python<'_>, stream: u64, id: u64) -> PyResult<bool> {
        self.enqueue_recv(py, stream, Op::Dispatch, id)
    }

    /// Enqueues a whole combine on `stream` after the dispatch `handle` (a due receive half
    /// first), after checking every tensor against that dispatch's token count; its rows in
    /// LogFMT-10 with `use_logfmt` (H a multiple of 128, no NCCL). Returns its id.
    #[pyo3(signature = (stream, handle, x, topk_idx, topk_weights, out, wait_stats=None, use_logfmt=false))]
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &mut self,
        py: Python<'_>,
        stream: u64,
        handle: u64,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        wait_stats: Option<&Bound<'_, PyAny>>,
        use_logfmt: bool,
    ) -> PyResult<u64> {
        let n = self.dispatched_tokens(py, handle)?;
        let f = format_of(use_logfmt);
        let p = self
            .spec
            .get()
            .combine_ptrs(n, x, topk_idx, topk_weights, out, wait_stats, f)?;
        self.enqueue_combine(py, stream, handle, &p, f, None)
    }

    /// Enqueues a combine's send half (as `combine`); its tensors, and `keep` (the Buffer passes
    /// the dispatch's handle, whose tensors the receive half may read), are held until its
    /// receive half is enqueued. Returns its id.
    #[pyo3(signature = (stream, handle, x, topk_idx, topk_weights, out, wait_stats=None, keep=None, use_logfmt=false))]
    #[allow(clippy::too_many_arguments)]
    fn combine_send(
        &mut self,
        py: Python<'_>,
        stream: u64,
        handle: u64,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        topk_weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        wait_stats: Option<&Bound<'_, PyAny>>,
        keep: Option<&Bound<'_, PyAny>>,
        use_logfmt: bool,
    ) -> PyResult<u64> {
        let n = self.dispatched_tokens(py, handle)?;
        let f = format_of(use_logfmt);
        let p = self
            .spec
            .get()
            .combine_ptrs(n, x, topk_idx, topk_weights, out, wait_stats, f)?;
        let held = hold(&[x, topk_idx, topk_weights, out], &[keep, wait_stats]);
        self.enqueue_combine(py, stream, handle, &p, f, Some(held))
    }

    /// Enqueues the receive half of combine `id` (as `dispatch_recv`).
    fn combine_recv(&mut self, py: Python<'_>, stream: u64, id: u64) -> PyResult<bool> {
        self.enqueue_recv(py, stream, Op::Combine, id)
    }
}
