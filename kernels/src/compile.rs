//! Run-time compilation of the CUDA sources with NVRTC (one module per family), in the style of
//! candle-kernels: the `.cu` files are embedded with `include_str!`, prefixed with the shared
//! headers, and compiled for the device's architecture with FMA contraction off (`--fmad=false`;
//! the kernels write `fmaf` where docs/contract.md asks for a fused multiply-add).

use crate::GpuError;
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::Mutex;

/// Shared types, signals, bounded waits, bf16 rounding, the combine reduction.
pub const COMMON_CUH: &str = include_str!("cu/common.cuh");
/// The FP8 cast (bit-identical to `ep_reference::numerics::fp8`) and the payload encoder.
pub const FP8_CUH: &str = include_str!("cu/fp8.cuh");

/// One module: a `.cu` file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

pub const FP8: Family = Family {
    name: "fp8.cu",
    source: include_str!("cu/fp8.cu"),
    kernels: &["ep_fp8_encode_rows", "ep_empty"],
};
pub const PER_EXPERT: Family = Family {
    name: "per_expert.cu",
    source: include_str!("cu/per_expert.cu"),
    kernels: &["ep_per_expert_dispatch", "ep_per_expert_combine"],
};
pub const BATCHED: Family = Family {
    name: "batched.cu",
    source: include_str!("cu/batched.cu"),
    kernels: &["ep_batched_dispatch", "ep_batched_combine"],
};
/// Every module the crate loads.
pub const FAMILIES: [Family; 3] = [FP8, PER_EXPERT, BATCHED];

impl Family {
    /// The translation unit NVRTC compiles: the headers, then the family's file.
    pub fn full_source(&self) -> String {
        format!("{COMMON_CUH}\n{FP8_CUH}\n{}", self.source)
    }
}

/// Whether libnvrtc can be opened (it is loaded dynamically).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library and reports whether that worked.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// A compiled module: the CUBIN for the requested architecture and NVRTC's log (with
/// `verbose`, ptxas's register/spill report for every kernel).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// The NVRTC options every module is built with.
pub fn options(arch: &str, verbose: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_string(),
        "--std=c++17".to_string(),
    ];
    if verbose {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

/// Compiles one family to a CUBIN for `arch` (e.g. "sm_90").
pub fn compile(f: &Family, arch: &str, verbose: bool) -> Result<Compiled, GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoDevice(
            "libnvrtc not found (put it on LD_LIBRARY_PATH)".into(),
        ));
    }
    let src = CString::new(f.full_source()).map_err(|e| GpuError::Compile(e.to_string()))?;
    let name = CString::new(f.name).map_err(|e| GpuError::Compile(e.to_string()))?;
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| GpuError::Compile(format!("{}: {e:?}", f.name)))?;
    let opts = options(arch, verbose);
    // SAFETY: `prog` is a live program created above; the options are valid C strings.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: `prog` is live; the log is NUL-terminated by NVRTC.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|v| {
            // SAFETY: NVRTC returns a NUL-terminated buffer.
            unsafe { CStr::from_ptr(v.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    let result = match compiled {
        Err(e) => Err(GpuError::Compile(format!(
            "{} ({arch}, {opts:?}): {e:?}\n{log}",
            f.name
        ))),
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; `size` receives the CUBIN's length.
            let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
            if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(GpuError::Compile(format!(
                    "{}: no CUBIN ({r:?}); is {arch} a real architecture?",
                    f.name
                )))
            } else {
                let mut cubin = vec![0u8; size];
                // SAFETY: `cubin` holds exactly the `size` bytes NVRTC reported.
                let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) };
                if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(GpuError::Compile(format!(
                        "{}: nvrtcGetCUBIN {r:?}",
                        f.name
                    )))
                } else {
                    Ok(Compiled { cubin, log })
                }
            }
        }
    };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// CUBINs by (family, arch).
type CubinCache = HashMap<(&'static str, String), Vec<u8>>;
static CUBINS: Mutex<Option<CubinCache>> = Mutex::new(None);

/// [`compile`] once per (family, arch) per process.
pub fn cubin(f: &Family, arch: &str) -> Result<Vec<u8>, GpuError> {
    let key = (f.name, arch.to_string());
    if let Some(c) = CUBINS
        .lock()
        .ok()
        .and_then(|m| m.as_ref().and_then(|m| m.get(&key).cloned()))
    {
        return Ok(c);
    }
    let c = compile(f, arch, false)?.cubin;
    if let Ok(mut m) = CUBINS.lock() {
        m.get_or_insert_with(HashMap::new).insert(key, c.clone());
    }
    Ok(c)
}
