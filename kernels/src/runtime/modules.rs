//! The kernel modules this process has loaded: one per device, build ([`Variant`]) and family,
//! loaded by the first group that needs it and reused by every later one, as cudarc and
//! candle-kernels keep one module per context for the process. So forming a group allocates
//! its buffers and nothing else (the Python `Buffer`'s size hint is the layout's bytes), and a
//! second group of a build loads nothing.
//!
//! A loaded module stays for the process: the table holds its device's primary context, so the
//! context (and with it every module and function handle in the table) lives as long as the
//! process does.

use crate::compile::{self, Family};
use crate::error::{cuda, GpuError};
use crate::runtime::layout::Variant;
use cudarc::driver::{result, sys, CudaContext};
use std::sync::{Arc, Mutex};

/// (device ordinal, family, build, architecture).
type Key = (usize, &'static str, Variant, String);

/// One loaded module: its context (held, see the module docs), the module, its kernels in the
/// family's order. Handles are kept as addresses: the table is shared between threads.
struct Entry {
    _ctx: Arc<CudaContext>,
    _module: usize,
    funcs: Vec<usize>,
}

static LOADED: Mutex<Vec<(Key, Entry)>> = Mutex::new(Vec::new());

/// The kernels of family `f` in build `v` on `ctx`'s device (bound to this thread by the
/// caller), in `f.kernels`' order: loaded now if this process has not loaded them yet. Each
/// kernel may take up to the device's opt-in shared memory (less its static share), so any
/// group's launch and residency check may use the bytes it needs.
pub(crate) fn kernels(
    ctx: &Arc<CudaContext>,
    f: &Family,
    v: &Variant,
    arch: &str,
) -> Result<Vec<sys::CUfunction>, GpuError> {
    let key: Key = (ctx.ordinal(), f.name, *v, arch.to_string());
    // A panic elsewhere while the lock was held leaves the table whole (entries are pushed
    // complete), so a poisoned lock is used as it is.
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, e)) = loaded.iter().find(|(k, _)| *k == key) {
        return Ok(e.funcs.iter().map(|&a| a as sys::CUfunction).collect());
    }
    let (module, funcs) = load(ctx, f, v, arch)?;
    loaded.push((
        key,
        Entry {
            _ctx: ctx.clone(),
            _module: module as usize,
            funcs: funcs.iter().map(|&p| p as usize).collect(),
        },
    ));
    Ok(funcs)
}

/// Loads family `f` in build `v` and finds its kernels; on any failure the module is unloaded.
fn load(
    ctx: &Arc<CudaContext>,
    f: &Family,
    v: &Variant,
    arch: &str,
) -> Result<(sys::CUmodule, Vec<sys::CUfunction>), GpuError> {
    let cubin = compile::cubin_variant(f, v, arch)?;
    let optin = cuda(
        "opt-in shared memory",
        ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        ),
    )?;
    // SAFETY: `cubin` is a complete CUBIN image produced by NVRTC for this device's arch; the
    // caller bound `ctx` to this thread.
    let module = cuda("cuModuleLoadData", unsafe {
        result::module::load_data(cubin.as_ptr().cast())
    })?;
    let found = functions(module, f, optin);
    if found.is_err() {
        // SAFETY: nothing of `module` is in use: its functions were not handed out.
        let _ = unsafe { result::module::unload(module) };
    }
    Ok((module, found?))
}

/// The kernels of `f` in the loaded `module`, each allowed `optin` bytes of shared memory less
/// its static share as its dynamic shared memory.
fn functions(
    module: sys::CUmodule,
    f: &Family,
    optin: i32,
) -> Result<Vec<sys::CUfunction>, GpuError> {
    let mut fs = Vec::new();
    for k in f.kernels {
        let name = std::ffi::CString::new(k.symbol)
            .map_err(|_| GpuError::Unsupported(format!("kernel symbol {}", k.name)))?;
        // SAFETY: `module` is loaded on the bound context; `name` is a NUL-terminated symbol.
        let func = cuda(k.name, unsafe {
            result::module::get_function(module, name)
        })?;
        // SAFETY: `func` is a kernel of the loaded module.
        let fixed = cuda("static shared memory", unsafe {
            result::function::get_function_attribute(
                func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )
        })?;
        // SAFETY: as above; the value is at most what the device lets a block opt in to.
        cuda("cuFuncSetAttribute", unsafe {
            result::function::set_function_attribute(
                func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (optin - fixed).max(0),
            )
        })?;
        fs.push(func);
    }
    Ok(fs)
}
