//! The C ABI through which the C++ torch extension (`ep_dispatch/csrc/torch_ext.cpp`) calls a
//! native rank: one entry per call (`dispatch`, `combine`, each whole or its send half, and
//! `recv`, a send half's receive half, which the extension's receive hooks call), handed over
//! once as a table of function pointers in the capsule `_ep_dispatch._c_api`, so the two
//! libraries never link against each other.
//!
//! The extension allocates a call's outputs with torch's allocator and describes every tensor
//! in a [`TensorDesc`] (address, dtype, shape, strides, device, element size, and the Python
//! object, held for a send half as the native methods hold theirs). An entry turns each
//! descriptor into the [`Meta`] the native methods read from Python attributes and runs the same
//! checks (`CallSpec::dispatch_ptrs_with`, `CallSpec::combine_ptrs_with`) and the same enqueue
//! ([`Enqueue`]) on the same rank object, borrowed mutably through PyO3 (a busy rank raises as a
//! busy native method does). It is called from Python, through the extension, with the GIL
//! held. An error is set as the Python exception the native methods raise (same class, same
//! message) and the entry returns -1; a descriptor that cannot be read (a null pointer, a kind
//! or dtype code out of range, an element size that is not its dtype's) is an `ArgumentError`
//! naming its tensor.

use super::exceptions::to_py;
use super::rank::{format_of, Enqueue, GpuRank, Held};
use super::reader::{COMBINE_TENSORS, DISPATCH_TENSORS};
#[cfg(feature = "testing")]
use super::stand_in::StandInRank;
use super::tensors::{dtype_text, not_a_tensor};
use crate::error::BindError;
use crate::tensor::{Dtype, Meta};
use ep_reference::Op;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The version of this ABI; the extension refuses a table of another. 2: the `recv` entry.
pub const ABI_VERSION: u32 = 2;

/// The capsule's name (what `PyCapsule_GetPointer` must be given).
const CAPSULE_NAME: &CStr = c"ep_dispatch._ep_dispatch._c_api";

/// [`TensorDesc::kind`]: the argument was None (an optional tensor not passed).
pub const KIND_ABSENT: u32 = 0;
/// A tensor, described by the other fields.
pub const KIND_TENSOR: u32 = 1;
/// An object that is no tensor (`obj`: it, for the message).
pub const KIND_NOT_A_TENSOR: u32 = 2;

/// The most dimensions a descriptor may have.
pub const MAX_DIMS: u32 = 64;

/// What a tensor says about itself, as the extension reads it from `at::Tensor`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TensorDesc {
    /// The Python object (borrowed for the call); null only where `kind` is [`KIND_ABSENT`].
    pub obj: *mut ffi::PyObject,
    /// [`KIND_ABSENT`], [`KIND_TENSOR`] or [`KIND_NOT_A_TENSOR`].
    pub kind: u32,
    /// The index of its dtype in [`Dtype::ALL`]; -1 for a dtype none of ours.
    pub dtype: i32,
    /// The number of dimensions, at most [`MAX_DIMS`].
    pub ndim: u32,
    /// Bytes per element (`element_size()`), which must be its dtype's.
    pub element_size: u32,
    /// `data_ptr()`.
    pub ptr: u64,
    /// `get_device()`: the CUDA ordinal, -1 on the host.
    pub device: i64,
    /// `ndim` sizes (`sizes().data()`); may be null where `ndim` is 0.
    pub shape: *const i64,
    /// `ndim` strides in elements (`strides().data()`); may be null where `ndim` is 0.
    pub strides: *const i64,
}

/// What a dispatch entry returns besides its status.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchOut {
    /// The handle id combine takes (the id of a send half's receive half).
    pub id: u64,
    /// The dispatch's token count (`x`'s rows).
    pub num_tokens: u64,
}

/// `dispatch(rank, stream, send_only, tensors, count, out)`: the tensors in the order of the
/// native `GpuRank.dispatch` (x, topk_idx, recv_x, recv_x_scales, recv_count, src_info,
/// layout_range, cumulative stats, wait stats); `send_only` 1 for the send half, 0 for a whole
/// dispatch. 0 on success (`out` written), -1 with the Python exception set.
pub type DispatchFn = unsafe extern "C" fn(
    *mut ffi::PyObject,
    u64,
    u32,
    *const TensorDesc,
    usize,
    *mut DispatchOut,
) -> c_int;

/// `combine(rank, stream, handle, flags, tensors, count, keep, id)`: the tensors in the order of
/// the native `GpuRank.combine` (x, topk_idx, topk_weights, out, wait stats); `flags` bit 0: the
/// send half only, bit 1: LogFMT; `keep` (may be null): an object held with a send half's
/// tensors (the dispatch's handle). 0 on success (`id` written), -1 with the exception set.
pub type CombineFn = unsafe extern "C" fn(
    *mut ffi::PyObject,
    u64,
    u64,
    u32,
    *const TensorDesc,
    usize,
    *mut ffi::PyObject,
    *mut u64,
) -> c_int;

/// `recv(rank, stream, op, id, enqueued)`: the receive half of the send half `id` of `op` (0
/// dispatch, 1 combine) on `stream`, as the native `GpuRank.dispatch_recv` / `combine_recv`
/// (`Enqueue::enqueue_recv`). 0 on success, `*enqueued` 1 where it was enqueued, 0 where a later
/// call had enqueued it already; -1 with the exception set.
pub type RecvFn = unsafe extern "C" fn(*mut ffi::PyObject, u64, u32, u64, *mut u32) -> c_int;

/// `echo(tensors, count, out)` (feature `testing`): `*out` becomes a new list with, per
/// descriptor, None (absent) or `(ptr, dtype name, shape, strides, device, element size)` as
/// the entries parse it.
pub type EchoFn = unsafe extern "C" fn(*const TensorDesc, usize, *mut *mut ffi::PyObject) -> c_int;

/// The table the capsule points to.
#[repr(C)]
pub struct Api {
    pub abi_version: u32,
    /// `size_of::<TensorDesc>()`, which the extension compares with its own.
    pub descriptor_size: u32,
    pub dispatch: DispatchFn,
    pub combine: CombineFn,
    pub recv: RecvFn,
    /// None where the module was built without the feature `testing`.
    pub echo: Option<EchoFn>,
}

static API: Api = Api {
    abi_version: ABI_VERSION,
    descriptor_size: std::mem::size_of::<TensorDesc>() as u32,
    dispatch: c_dispatch,
    combine: c_combine,
    recv: c_recv,
    #[cfg(feature = "testing")]
    echo: Some(c_echo),
    #[cfg(not(feature = "testing"))]
    echo: None,
};

/// The capsule holding [`API`] (the module's `_c_api`).
pub(super) fn capsule(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let table = &API as *const Api as *mut c_void;
    // SAFETY: `table` points to a static that lives as long as the process and is never written;
    // the name is a static C string; no destructor, since nothing is owned.
    let raw = unsafe { ffi::PyCapsule_New(table, CAPSULE_NAME.as_ptr(), None) };
    // SAFETY: `raw` is a new reference or null with the exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, raw) }
}

fn bad(name: &str, what: impl Into<String>) -> PyErr {
    to_py(BindError::argument(name, what))
}

/// An entry's result pointer `name`: non-null and aligned, else the entry's ArgumentError.
fn result_slot<T>(p: *mut T, name: &str) -> PyResult<()> {
    if p.is_null() || !p.is_aligned() {
        return Err(bad(name, "a null or misaligned result pointer"));
    }
    Ok(())
}

/// Runs an entry's body: 0 on success, else -1 with its error (or a panic, as `PanicException`)
/// set as the Python exception.
fn entry(body: impl FnOnce(Python<'_>) -> PyResult<()>) -> c_int {
    Python::attach(|py| match catch_unwind(AssertUnwindSafe(|| body(py))) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            e.restore(py);
            -1
        }
        Err(_) => {
            pyo3::panic::PanicException::new_err("ep_dispatch: a native call panicked").restore(py);
            -1
        }
    })
}

/// The `count` descriptors at `tensors`, `want` of them (any number where None).
///
/// # Safety
/// Where `tensors` is non-null and aligned, it points to `count` initialised descriptors that
/// stay valid and unchanged for `'a` (the entry's call).
unsafe fn descriptors<'a>(
    tensors: *const TensorDesc,
    count: usize,
    want: Option<usize>,
) -> PyResult<&'a [TensorDesc]> {
    if tensors.is_null() || !tensors.is_aligned() {
        return Err(bad("tensors", "a null or misaligned descriptor array"));
    }
    if let Some(w) = want {
        if count != w {
            return Err(bad("tensors", format!("{count} descriptors, expected {w}")));
        }
    }
    // SAFETY: non-null and aligned (checked); the caller's contract gives `count` descriptors.
    Ok(unsafe { std::slice::from_raw_parts(tensors, count) })
}

/// The object of descriptor `d` (non-null: checked).
fn object<'py>(py: Python<'py>, name: &str, d: &TensorDesc) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: a non-null `obj` is a live object the caller holds a reference to for the call
    // (the extension's argument or the output it wrapped); the GIL is held.
    unsafe { Bound::from_borrowed_ptr_or_opt(py, d.obj) }
        .ok_or_else(|| bad(name, "a descriptor with no object"))
}

fn dims<'a>(name: &str, p: *const i64, n: usize, what: &str) -> PyResult<&'a [i64]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() || !p.is_aligned() {
        return Err(bad(
            name,
            format!("a descriptor whose {what} pointer is null"),
        ));
    }
    // SAFETY: non-null and aligned (checked); the descriptor's contract gives `ndim` entries,
    // valid for the call (the tensor's own sizes or strides, alive while the caller holds it).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// What descriptor `d` of the tensor `name` says, as `tensors::meta` reads a Python tensor:
/// None where absent, `not_a_tensor` where it is no tensor.
fn desc_meta(py: Python<'_>, name: &str, d: &TensorDesc) -> PyResult<Option<Meta>> {
    match d.kind {
        KIND_ABSENT => return Ok(None),
        KIND_NOT_A_TENSOR => return Err(not_a_tensor(name, &object(py, name, d)?)),
        KIND_TENSOR => {}
        k => {
            let want = format!("{KIND_ABSENT}, {KIND_TENSOR} or {KIND_NOT_A_TENSOR}");
            return Err(bad(name, format!("descriptor kind {k}, expected {want}")));
        }
    }
    let obj = object(py, name, d)?;
    let dtype = match usize::try_from(d.dtype) {
        Ok(i) if i < Dtype::ALL.len() => Some(Dtype::ALL[i]),
        _ if d.dtype == -1 => None,
        _ => {
            return Err(bad(
                name,
                format!(
                    "descriptor dtype code {}, expected -1..={}",
                    d.dtype,
                    Dtype::ALL.len() - 1
                ),
            ))
        }
    };
    if let Some(dt) = dtype {
        if d.element_size as usize != dt.size() {
            return Err(bad(
                name,
                format!(
                    "a descriptor of element size {} for {}, whose elements are {} bytes",
                    d.element_size,
                    dt.name(),
                    dt.size()
                ),
            ));
        }
    }
    if d.ndim > MAX_DIMS {
        return Err(bad(
            name,
            format!("a descriptor of {} dimensions (at most {MAX_DIMS})", d.ndim),
        ));
    }
    let n = d.ndim as usize;
    let shape = dims(name, d.shape, n, "shape")?.to_vec();
    let strides = dims(name, d.strides, n, "strides")?.to_vec();
    let other_dtype = match dtype {
        Some(_) => String::new(),
        None => dtype_text(name, &obj)?,
    };
    Ok(Some(Meta {
        ptr: d.ptr,
        dtype,
        other_dtype,
        shape,
        strides,
        device: d.device,
    }))
}

/// Reads descriptor `i` of `descs` (the entries' `Reader`).
fn read_desc(py: Python<'_>, descs: &[TensorDesc], i: usize, name: &str) -> PyResult<Option<Meta>> {
    let d = descs
        .get(i)
        .ok_or_else(|| bad(name, format!("no descriptor {i}")))?;
    desc_meta(py, name, d)
}

/// A send half's tensors (every one present: each was read, so each has its object) and `keep`.
fn held(py: Python<'_>, descs: &[TensorDesc], keep: *mut ffi::PyObject) -> Held {
    let objs = descs
        .iter()
        .filter(|d| d.kind == KIND_TENSOR)
        .map(|d| d.obj)
        .chain(std::iter::once(keep));
    // SAFETY: as in `object`: each non-null pointer is a live object the caller holds.
    objs.filter_map(|o| unsafe { Bound::from_borrowed_ptr_or_opt(py, o) })
        .map(Bound::unbind)
        .collect()
}

/// Runs `f` on the native rank `rank` (a `GpuRank`, or with `testing` a `_StandInRank`),
/// borrowed mutably.
fn with_rank<R>(
    py: Python<'_>,
    rank: *mut ffi::PyObject,
    f: impl FnOnce(&mut dyn Enqueue) -> PyResult<R>,
) -> PyResult<R> {
    // SAFETY: a non-null `rank` is a live object the caller holds for the call; the GIL is held.
    let obj = unsafe { Bound::from_borrowed_ptr_or_opt(py, rank) }
        .ok_or_else(|| bad("rank", "null (expected a native rank)"))?;
    if let Ok(r) = obj.cast::<GpuRank>() {
        let mut r = r.try_borrow_mut()?;
        return f(&mut *r);
    }
    #[cfg(feature = "testing")]
    if let Ok(r) = obj.cast::<StandInRank>() {
        let mut r = r.try_borrow_mut()?;
        return f(&mut *r);
    }
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    Err(bad("rank", format!("a {ty}, expected a native GpuRank")))
}

unsafe extern "C" fn c_dispatch(
    rank: *mut ffi::PyObject,
    stream: u64,
    send_only: u32,
    tensors: *const TensorDesc,
    count: usize,
    out: *mut DispatchOut,
) -> c_int {
    entry(|py| {
        result_slot(out, "out")?;
        if send_only > 1 {
            return Err(bad("send_only", format!("{send_only}, expected 0 or 1")));
        }
        // SAFETY: the ABI's contract: `tensors` points to `count` descriptors valid for the call.
        let descs = unsafe { descriptors(tensors, count, Some(DISPATCH_TENSORS.len())) }?;
        with_rank(py, rank, |r| {
            let mut read = |i, name: &'static str, _| read_desc(py, descs, i, name);
            let p = r.call_spec().dispatch_ptrs_with(&mut read)?;
            let send = (send_only == 1).then(|| held(py, descs, std::ptr::null_mut()));
            let id = r.enqueue_dispatch(py, stream, &p, send)?;
            let res = DispatchOut {
                id,
                num_tokens: p.num_tokens as u64,
            };
            // SAFETY: `out` is non-null and aligned (checked), the caller's result slot.
            unsafe { out.write(res) };
            Ok(())
        })
    })
}

/// [`CombineFn`]'s `flags`.
const COMBINE_SEND_ONLY: u32 = 1;
const COMBINE_LOGFMT: u32 = 2;

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn c_combine(
    rank: *mut ffi::PyObject,
    stream: u64,
    handle: u64,
    flags: u32,
    tensors: *const TensorDesc,
    count: usize,
    keep: *mut ffi::PyObject,
    id: *mut u64,
) -> c_int {
    entry(|py| {
        result_slot(id, "id")?;
        if flags & !(COMBINE_SEND_ONLY | COMBINE_LOGFMT) != 0 {
            return Err(bad(
                "flags",
                format!("{flags:#x}, expected bits 0 and 1 only"),
            ));
        }
        // SAFETY: as in `c_dispatch`.
        let descs = unsafe { descriptors(tensors, count, Some(COMBINE_TENSORS.len())) }?;
        with_rank(py, rank, |r| {
            let n = r.dispatched_tokens(py, handle)?;
            let format = format_of(flags & COMBINE_LOGFMT != 0);
            let mut read = |i, name: &'static str, _| read_desc(py, descs, i, name);
            let p = r.call_spec().combine_ptrs_with(n, format, &mut read)?;
            let send = (flags & COMBINE_SEND_ONLY != 0).then(|| held(py, descs, keep));
            let cid = r.enqueue_combine(py, stream, handle, &p, format, send)?;
            // SAFETY: `id` is non-null and aligned (checked), the caller's result slot.
            unsafe { id.write(cid) };
            Ok(())
        })
    })
}

unsafe extern "C" fn c_recv(
    rank: *mut ffi::PyObject,
    stream: u64,
    op: u32,
    id: u64,
    enqueued: *mut u32,
) -> c_int {
    entry(|py| {
        result_slot(enqueued, "enqueued")?;
        let op = match op {
            0 => Op::Dispatch,
            1 => Op::Combine,
            _ => {
                return Err(bad(
                    "op",
                    format!("{op}, expected 0 (dispatch) or 1 (combine)"),
                ))
            }
        };
        with_rank(py, rank, |r| {
            let done = r.enqueue_recv(py, stream, op, id)?;
            // SAFETY: `enqueued` is non-null and aligned (checked), the caller's result slot.
            unsafe { enqueued.write(u32::from(done)) };
            Ok(())
        })
    })
}

#[cfg(feature = "testing")]
unsafe extern "C" fn c_echo(
    tensors: *const TensorDesc,
    count: usize,
    out: *mut *mut ffi::PyObject,
) -> c_int {
    use pyo3::types::PyList;
    entry(|py| {
        result_slot(out, "out")?;
        // SAFETY: as in `c_dispatch` (any count).
        let descs = unsafe { descriptors(tensors, count, None) }?;
        let list = PyList::empty(py);
        for (i, d) in descs.iter().enumerate() {
            match desc_meta(py, &format!("tensors[{i}]"), d)? {
                None => list.append(py.None())?,
                Some(m) => {
                    let dtype = m.dtype.map_or(m.other_dtype.clone(), |t| t.name().into());
                    let e = (m.ptr, dtype, m.shape, m.strides, m.device, d.element_size);
                    list.append(e)?
                }
            }
        }
        // SAFETY: `out` is non-null and aligned (checked); it receives the new reference.
        unsafe { out.write(list.into_ptr()) };
        Ok(())
    })
}
