//! `_StandInRank` (feature `testing`): a native rank that enqueues nothing, so that the C ABI's
//! entries (`c_abi`) and the Buffer's extension path run without a GPU. Its calls are checked
//! exactly as a `GpuRank`'s (the same `CallSpec`, the same [`Enqueue`] path); what passes then
//! goes to a Python `target`:
//! - a target with `dispatch_checked(stream, send_only, addrs)`, `dispatched_tokens(handle)` and
//!   `combine_checked(stream, handle, send_only, addrs, use_logfmt)` gets the checked addresses
//!   (as `CallSpec.check_dispatch` / `check_combine` return them) and returns the ids, so the
//!   plumbing tests' stand-in world writes its outputs through them;
//! - any other target is never called by an entry: the rank counts ids itself (the host-cost
//!   measurement, `call_costs.py`, times the extension path with no Python in the entry).
//!
//! A receive half (the C ABI's `recv` entry, which the extension's hooks call) follows the GPU
//! rank's rules (`gpu::RankGroup::dispatch_recv`): the pending send half's id enqueues it once
//! and frees the tensors it held (true), an id a later call already completed is a no-op
//! (false), an id this rank never gave is the `ArgumentError` of argument `hook`. A forwarding
//! target is asked first (`dispatch_recv(stream, id)` / `combine_recv(stream, id)`), so a test
//! can count the receive halves or make one raise.
//!
//! `dispatch_recv` / `combine_recv` are the same receive halves as `GpuRank`'s methods; every
//! other attribute (`poll`, ...) is the target's.

use super::rank::{combine_addrs, dispatch_addrs, CallSpec, Enqueue, Held};
use crate::error::BindError;
use crate::spec::{CombinePtrs, DispatchPtrs};
use ep_kernels::GpuError;
use ep_reference::{CombineFormat, Op};
use pyo3::intern;
use pyo3::prelude::*;
use std::collections::VecDeque;

use super::exceptions::{to_py, IntoPy};

/// How many dispatches' token counts a stand-in keeps (as `gpu::RankGroup` keeps 4 handles).
const KEPT: usize = 4;

#[pyclass(unsendable, module = "ep_dispatch._ep_dispatch", name = "_StandInRank")]
pub(super) struct StandInRank {
    spec: Py<CallSpec>,
    target: Py<PyAny>,
    /// The target takes the checked calls (it has `dispatch_checked`).
    forward: bool,
    next_dispatch: u64,
    next_combine: u64,
    tokens: VecDeque<(u64, usize)>,
    /// The tensors of the latest dispatch (combine) send half, held as a `GpuRank` holds them.
    held_dispatch: Option<Held>,
    held_combine: Option<Held>,
    /// The id of the dispatch (combine) send half whose receive half is still due.
    pending_dispatch: Option<u64>,
    pending_combine: Option<u64>,
    /// Receive halves enqueued (dispatch, combine): what a hook did, for the tests.
    recvs: (u64, u64),
}

#[pymethods]
impl StandInRank {
    #[new]
    fn new(py: Python<'_>, spec: Py<CallSpec>, target: Py<PyAny>) -> PyResult<StandInRank> {
        let forward = target.bind(py).hasattr(intern!(py, "dispatch_checked"))?;
        Ok(StandInRank {
            spec,
            target,
            forward,
            next_dispatch: 1,
            next_combine: 1,
            tokens: VecDeque::new(),
            held_dispatch: None,
            held_combine: None,
            pending_dispatch: None,
            pending_combine: None,
            recvs: (0, 0),
        })
    }

    /// The Python object the checked calls and every other attribute go to.
    #[getter]
    fn target(&self, py: Python<'_>) -> Py<PyAny> {
        self.target.clone_ref(py)
    }

    /// How many objects the latest dispatch and combine send halves hold.
    fn held_counts(&self) -> (usize, usize) {
        let n = |h: &Option<Held>| h.as_ref().map_or(0, Vec::len);
        (n(&self.held_dispatch), n(&self.held_combine))
    }

    /// How many receive halves were enqueued, `(dispatch, combine)`: each `recv` of the send
    /// half then due.
    fn recv_counts(&self) -> (u64, u64) {
        self.recvs
    }

    /// The receive half of dispatch `id`, as `GpuRank.dispatch_recv` (the C ABI's `recv`).
    fn dispatch_recv(&mut self, py: Python<'_>, stream: u64, id: u64) -> PyResult<bool> {
        self.enqueue_recv(py, stream, Op::Dispatch, id)
    }

    /// The receive half of combine `id`, as `GpuRank.combine_recv`.
    fn combine_recv(&mut self, py: Python<'_>, stream: u64, id: u64) -> PyResult<bool> {
        self.enqueue_recv(py, stream, Op::Combine, id)
    }

    fn __getattr__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        Ok(self.target.bind(py).getattr(name)?.unbind())
    }
}

impl Enqueue for StandInRank {
    fn call_spec(&self) -> &CallSpec {
        self.spec.get()
    }

    fn enqueue_dispatch(
        &mut self,
        py: Python<'_>,
        stream: u64,
        p: &DispatchPtrs,
        send: Option<Held>,
    ) -> PyResult<u64> {
        let id = if self.forward {
            let args = (stream, send.is_some(), dispatch_addrs(p));
            let t = self.target.bind(py);
            t.call_method1(intern!(py, "dispatch_checked"), args)?
                .extract()?
        } else {
            self.next_dispatch += 1;
            self.next_dispatch - 1
        };
        if self.tokens.len() == KEPT {
            self.tokens.pop_front();
        }
        self.tokens.push_back((id, p.num_tokens));
        // A due receive half went out first (as a GPU rank enqueues it): this call's is due now.
        self.pending_dispatch = send.is_some().then_some(id);
        self.held_dispatch = send;
        Ok(id)
    }

    fn dispatched_tokens(&self, py: Python<'_>, handle: u64) -> PyResult<usize> {
        if self.forward {
            let t = self.target.bind(py);
            return t
                .call_method1(intern!(py, "dispatched_tokens"), (handle,))?
                .extract();
        }
        let held = self.tokens.iter().find(|(id, _)| *id == handle);
        held.map(|&(_, n)| n)
            .ok_or_else(|| GpuError::Handle(format!("dispatch handle {handle} is no longer held")))
            .map_err(BindError::from)
            .py_err()
    }

    fn enqueue_combine(
        &mut self,
        py: Python<'_>,
        stream: u64,
        handle: u64,
        p: &CombinePtrs,
        format: CombineFormat,
        send: Option<Held>,
    ) -> PyResult<u64> {
        let id = if self.forward {
            let logfmt = format == CombineFormat::LogFmt;
            let args = (stream, handle, send.is_some(), combine_addrs(p), logfmt);
            let t = self.target.bind(py);
            t.call_method1(intern!(py, "combine_checked"), args)?
                .extract()?
        } else {
            self.next_combine += 1;
            self.next_combine - 1
        };
        self.pending_combine = send.is_some().then_some(id);
        self.held_combine = send;
        Ok(id)
    }

    fn enqueue_recv(&mut self, py: Python<'_>, stream: u64, op: Op, id: u64) -> PyResult<bool> {
        // As a GPU rank: the pending send half is taken (its tensors freed) before the receive
        // half is enqueued, so one that fails is not due again.
        let (pending, held, next, count) = match op {
            Op::Dispatch => (
                &mut self.pending_dispatch,
                &mut self.held_dispatch,
                self.next_dispatch,
                &mut self.recvs.0,
            ),
            Op::Combine => (
                &mut self.pending_combine,
                &mut self.held_combine,
                self.next_combine,
                &mut self.recvs.1,
            ),
        };
        let due = pending.take_if(|p| *p == id).is_some();
        if due {
            *held = None;
            *count += 1;
        }
        if self.forward {
            // The target gave the ids: it says what its receive half did.
            let method = match op {
                Op::Dispatch => intern!(py, "dispatch_recv"),
                Op::Combine => intern!(py, "combine_recv"),
            };
            let t = self.target.bind(py);
            return t.call_method1(method, (stream, id))?.extract();
        }
        if due || (id >= 1 && id < next) {
            return Ok(due);
        }
        let m = format!("{op} {id} was never sent by this rank");
        Err(to_py(BindError::argument("hook", m)))
    }
}
