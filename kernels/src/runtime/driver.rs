//! The CUDA driver calls of the runtime that cudarc's `result` layer does not wrap, written in
//! its style: one FFI call each, the `CUresult` as `Result<_, DriverError>`, out-parameters
//! returned as values. With cudarc's `result` (used as it is: `result::memcpy_htod_sync`,
//! `result::launch_kernel`, ...) this is the runtime's one layer over `cudarc::driver::sys`: no
//! other file of the runtime calls a `sys` function (the NCCL calls are `nccl/comms.rs`'s, the
//! NVRTC calls `compile.rs`'s). Handles and addresses keep cudarc's `sys` types.
//!
//! A function is safe where the driver checks everything it is given (device ordinals,
//! addresses it looks up in its own tables, a context cudarc keeps alive) and nothing the
//! caller holds can be written; it is an `unsafe fn` where it writes device memory, unmaps it,
//! or takes a raw handle the driver cannot check (a stream or a kernel), with its contract under
//! `# Safety`.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self, CUdeviceptr, CUstream};
use cudarc::driver::CudaContext;
use std::ffi::c_void;

/// Whether libcuda can be opened (dynamic loading): nothing else here may be called without it.
pub(crate) fn present() -> bool {
    // SAFETY: only tries to dlopen libcuda and reports whether that worked.
    unsafe { sys::is_culib_present() }
}

/// `cuDeviceCanAccessPeer`: whether device `a` can map device `b`'s memory.
pub(crate) fn can_access_peer(a: &CudaContext, b: &CudaContext) -> Result<bool, DriverError> {
    let mut can = 0i32;
    // SAFETY: both device handles come from live contexts (the driver checks them anyway);
    // `can` is a local the driver writes.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }.result()?;
    Ok(can != 0)
}

/// `cuCtxEnablePeerAccess`: lets the bound context map `peer`'s memory. Access that is already
/// on counts as done.
pub(crate) fn enable_peer_access(peer: &CudaContext) -> Result<(), DriverError> {
    // SAFETY: `peer`'s context is alive while the reference is (cudarc holds it); the call
    // changes the bound context's mappings only, no memory the caller holds.
    let rc = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
    if rc == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    rc.result()
}

/// `cuMemGetAddressRange`: the base and size of the allocation holding `p` (the driver looks
/// `p` up; an address it does not know is an error).
pub(crate) fn address_range(p: CUdeviceptr) -> Result<(CUdeviceptr, usize), DriverError> {
    let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
    // SAFETY: the driver writes the two locals only.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) }.result()?;
    Ok((base, size))
}

/// `cuIpcGetMemHandle`: the IPC handle of the allocation at `base` (a `cuMemAlloc` allocation
/// of the bound context; the driver refuses any other address).
pub(crate) fn ipc_handle(base: CUdeviceptr) -> Result<sys::CUipcMemHandle, DriverError> {
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: the driver writes the local handle only.
    unsafe { sys::cuIpcGetMemHandle(&mut h, base) }.result()?;
    Ok(h)
}

/// `cuIpcOpenMemHandle` with lazy peer access: maps the allocation another process exported as
/// `h` into the bound context. The caller closes it ([`ipc_close`]).
pub(crate) fn ipc_open(h: sys::CUipcMemHandle) -> Result<CUdeviceptr, DriverError> {
    let mut p: CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: the driver checks the handle's bytes and writes the local address only; a new
    // mapping aliases nothing this process holds.
    unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, flags) }.result()?;
    Ok(p)
}

/// `cuIpcCloseMemHandle`: unmaps a peer's allocation.
///
/// # Safety
/// `p` came from [`ipc_open`] on the bound context, is closed once, and no queued or later work
/// uses it.
pub(crate) unsafe fn ipc_close(p: CUdeviceptr) -> Result<(), DriverError> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuIpcCloseMemHandle(p) }.result()
}

/// `cuMemHostGetDevicePointer`: the device address of pinned host memory allocated with
/// `CU_MEMHOSTALLOC_DEVICEMAP` (the driver looks `host` up; other memory is an error).
pub(crate) fn host_device_ptr(host: *mut c_void) -> Result<CUdeviceptr, DriverError> {
    let mut dev: CUdeviceptr = 0;
    // SAFETY: the driver reads nothing at `host` (it looks the address up in its table of
    // pinned allocations) and writes the local only.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }.result()?;
    Ok(dev)
}

/// `cuMemsetD32Async`: sets `words` u32 from `dst` to `value`, in `stream`'s order.
///
/// # Safety
/// `dst .. dst + 4 * words` lies inside a live allocation of the bound context that no other
/// work reads or writes unordered with `stream`; `stream` is a live stream of that context.
pub(crate) unsafe fn memset_d32_async(
    dst: CUdeviceptr,
    value: u32,
    words: usize,
    stream: CUstream,
) -> Result<(), DriverError> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuMemsetD32Async(dst, value, words, stream) }.result()
}

/// `cuMemsetD2D32Async`: sets the first `width` u32 of each of `height` rows `pitch` bytes
/// apart from `dst` to `value`, in `stream`'s order.
///
/// # Safety
/// Every row written lies inside a live allocation of the bound context that no other work
/// reads or writes unordered with `stream`; `stream` is a live stream of that context.
pub(crate) unsafe fn memset_d2d32_async(
    dst: CUdeviceptr,
    pitch: usize,
    value: u32,
    width: usize,
    height: usize,
    stream: CUstream,
) -> Result<(), DriverError> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuMemsetD2D32Async(dst, pitch, value, width, height, stream) }.result()
}

/// `cuStreamQuery`: `Ok(true)` once every operation queued on `stream` has finished,
/// `Ok(false)` while some still runs, the driver's error otherwise (a failed kernel or
/// transfer).
///
/// # Safety
/// `stream` is a live stream of the bound context.
pub(crate) unsafe fn stream_done(stream: CUstream) -> Result<bool, DriverError> {
    // SAFETY: the caller's contract above.
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        rc => Err(DriverError(rc)),
    }
}
