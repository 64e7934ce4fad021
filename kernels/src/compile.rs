//! Run-time compilation of the CUDA sources with NVRTC (one module per family), in the style of
//! candle-kernels: the `.cu` files are embedded with `include_str!`, prefixed with the shared
//! headers, and compiled for the device's architecture with FMA contraction off (`--fmad=false`;
//! the kernels write `fmaf` where docs/contract.md asks for a fused multiply-add).
//!
//! [`cubin`] (what the runtime loads) keeps each CUBIN in memory for the process and on disk for
//! later processes ([`cache`]): `$EP_KERNEL_CACHE` (`off` disables it), else
//! `$XDG_CACHE_HOME/ep-dispatch/kernels`, else `~/.cache/ep-dispatch/kernels`; an entry's key
//! is the SHA-256 of the module's full source, every NVRTC option, the architecture and NVRTC's
//! version. A cold start compiles (seconds); a warm one reads three files. An unusable cache is
//! never an error: the module is compiled as if there were none.

pub mod cache;

use crate::error::GpuError;
use crate::variant::Variant;
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Shared types, signals, bounded waits, bf16 rounding, block helpers, the shared-memory carve-up.
pub const COMMON_CUH: &str = include_str!("cu/common.cuh");
/// The combine reduction of docs/contract.md (4): the weighted sums over a token's slots.
pub const REDUCE_CUH: &str = include_str!("cu/reduce.cuh");
/// Shrink mode: the rank mask, the blocks' agreement on a lost peer, the lost-peer set.
pub const SHRINK_CUH: &str = include_str!("cu/shrink.cuh");
/// What a rank whose group failed stores instead of its signals (the poison of a call).
pub const POISON_CUH: &str = include_str!("cu/poison.cuh");
/// The FP8 cast (bit-identical to `ep_reference::numerics::fp8`) and the payload encoder.
pub const FP8_CUH: &str = include_str!("cu/fp8.cuh");
/// The caller's statistics: the receive's wait per source, the dispatch's row counts.
pub const STATS_CUH: &str = include_str!("cu/stats.cuh");
/// LogFMT-10 (bit-identical to `ep_reference::numerics::logfmt`): a row's encoding and the
/// combine reduction over encoded rows.
pub const LOGFMT_CUH: &str = include_str!("cu/logfmt.cuh");
/// The start and the end the dispatch and combine kernels share: the block's view of the call,
/// the acknowledgement wait, the last block out's epoch and acknowledgements.
pub const FRAME_CUH: &str = include_str!("cu/frame.cuh");
/// The shared headers, in the order every family is compiled with them.
pub const HEADERS: [&str; 8] = [
    COMMON_CUH, REDUCE_CUH, SHRINK_CUH, POISON_CUH, FP8_CUH, STATS_CUH, LOGFMT_CUH, FRAME_CUH,
];

/// One module: a `.cu` file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [Kernel],
}

/// One kernel: its name as profilers show it and the module symbol it is loaded by.
///
/// The dispatch and combine kernels are C++ functions in a namespace (`ep_batched::dispatch`),
/// as DeepEP's are, so that a trace shows `::dispatch` / `::combine` where DeepEP's tests and
/// engines' tooling look for them; their symbols are the Itanium-mangled names of
/// `void ns::name(KParams, IoTable)` (ptxas prints them; the compile test checks each one is an
/// entry of its CUBIN). The helpers keep C names.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    pub name: &'static str,
    pub symbol: &'static str,
}

impl Kernel {
    const fn c(name: &'static str) -> Kernel {
        Kernel { name, symbol: name }
    }
}

pub const FP8: Family = Family {
    name: "fp8.cu",
    source: include_str!("cu/fp8.cu"),
    kernels: &[Kernel::c("ep_fp8_encode_rows"), Kernel::c("ep_empty")],
};
pub const PER_EXPERT: Family = Family {
    name: "per_expert.cu",
    source: include_str!("cu/per_expert.cu"),
    kernels: &[
        Kernel {
            name: "ep_per_expert::dispatch",
            symbol: "_ZN13ep_per_expert8dispatchE7KParams7IoTable",
        },
        Kernel {
            name: "ep_per_expert::combine",
            symbol: "_ZN13ep_per_expert7combineE7KParams7IoTable",
        },
    ],
};
pub const BATCHED: Family = Family {
    name: "batched.cu",
    // One module of seven files: the overview and declarations, then each operation's set-up
    // and send, its receive, and the call that runs them (pplx-garden's split by phase).
    source: concat!(
        include_str!("cu/batched.cu"),
        include_str!("cu/batched_dispatch_send.cu"),
        include_str!("cu/batched_dispatch_recv.cu"),
        include_str!("cu/batched_dispatch.cu"),
        include_str!("cu/batched_combine_send.cu"),
        include_str!("cu/batched_combine_recv.cu"),
        include_str!("cu/batched_combine.cu")
    ),
    kernels: &[
        Kernel {
            name: "ep_batched::dispatch",
            symbol: "_ZN10ep_batched8dispatchE7KParams7IoTable",
        },
        Kernel {
            name: "ep_batched::combine",
            symbol: "_ZN10ep_batched7combineE7KParams7IoTable",
        },
    ],
};
/// Every module the crate loads.
pub const FAMILIES: [Family; 3] = [FP8, PER_EXPERT, BATCHED];

impl Family {
    /// The translation unit NVRTC compiles: the headers, then the family's file.
    pub fn full_source(&self) -> String {
        let mut src = HEADERS.join("\n");
        src.push('\n');
        src.push_str(self.source);
        src
    }

    /// The translation unit of build `v`: its defines, then [`Family::full_source`] (the narrow
    /// build has none: its source, and so its cache key, is the files as they are).
    pub fn source_for(&self, v: &Variant) -> String {
        format!("{}{}", v.defines(), self.full_source())
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

fn no_nvrtc() -> GpuError {
    GpuError::NoDevice("libnvrtc not found (put it on LD_LIBRARY_PATH)".into())
}

/// NVRTC's version (major, minor), part of every cache key.
pub fn nvrtc_version() -> Result<(i32, i32), GpuError> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loadable (checked above); both pointers are to live ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| GpuError::Compile(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles one family to a CUBIN for `arch` (e.g. "sm_90").
pub fn compile(f: &Family, arch: &str, verbose: bool) -> Result<Compiled, GpuError> {
    compile_variant(f, &Variant::default(), arch, verbose)
}

/// [`compile`] of build `v` ([`Variant`]).
pub fn compile_variant(
    f: &Family,
    v: &Variant,
    arch: &str,
    verbose: bool,
) -> Result<Compiled, GpuError> {
    compile_with(f, &f.source_for(v), arch, &options(arch, verbose))
}

/// [`compile`] of `source` with the NVRTC options given (`opts` names `arch` already).
fn compile_with(
    f: &Family,
    source: &str,
    arch: &str,
    opts: &[String],
) -> Result<Compiled, GpuError> {
    if !nvrtc_present() {
        return Err(no_nvrtc());
    }
    let src = CString::new(source).map_err(|e| GpuError::Compile(e.to_string()))?;
    let name = CString::new(f.name).map_err(|e| GpuError::Compile(e.to_string()))?;
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| GpuError::Compile(format!("{}: {e:?}", f.name)))?;
    // SAFETY: `prog` is a live program created above; the options are valid C strings.
    let compiled = unsafe { nvrtc::compile_program(prog, opts) };
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

/// The disk-cache key of `f`'s CUBIN for `arch`, with the options [`cubin`] compiles with and
/// the NVRTC that is loaded (which must be there: its version is part of the key).
pub fn cache_key(f: &Family, arch: &str) -> Result<cache::Key, GpuError> {
    cache_key_variant(f, &Variant::default(), arch)
}

/// [`cache_key`] of build `v`.
pub fn cache_key_variant(f: &Family, v: &Variant, arch: &str) -> Result<cache::Key, GpuError> {
    Ok(cache::key(
        f.name,
        &f.source_for(v),
        &options(arch, false),
        arch,
        nvrtc_version()?,
    ))
}

/// Where a CUBIN of [`cubin_cached`] came from.
#[derive(Debug)]
pub enum Origin {
    /// A checked disk-cache entry.
    Disk(PathBuf),
    /// NVRTC. `found`: what the cache held instead of a usable entry (`None` with no cache);
    /// `stored`: where the new entry went, or why it could not be written (`None` with no
    /// cache). Neither is an error of the call.
    Compiled {
        found: Option<String>,
        stored: Option<Result<PathBuf, String>>,
    },
}

/// `f`'s CUBIN for `arch` through the disk cache in `dir` (`None`: no disk cache), without the
/// in-memory one: a checked entry if there is one, else compiled and written (atomically). Fails
/// only where compiling fails; any trouble with the cache falls back to compiling.
pub fn cubin_cached(
    f: &Family,
    arch: &str,
    dir: Option<&Path>,
) -> Result<(Vec<u8>, Origin), GpuError> {
    cubin_cached_variant(f, &Variant::default(), arch, dir)
}

/// [`cubin_cached`] of build `v`.
pub fn cubin_cached_variant(
    f: &Family,
    v: &Variant,
    arch: &str,
    dir: Option<&Path>,
) -> Result<(Vec<u8>, Origin), GpuError> {
    let opts = options(arch, false);
    let source = f.source_for(v);
    through_cache(
        dir,
        // Without NVRTC there is no version for the key, and nothing to compile with either.
        || Ok(cache::key(f.name, &source, &opts, arch, nvrtc_version()?)),
        || Ok(compile_with(f, &source, arch, &opts)?.cubin),
    )
}

/// The cache's logic, apart from NVRTC (so that it is tested without it): the entry of `key()` in
/// `dir` if it passes its checks, else `compile()`, written back.
fn through_cache(
    dir: Option<&Path>,
    key: impl FnOnce() -> Result<cache::Key, GpuError>,
    compile: impl FnOnce() -> Result<Vec<u8>, GpuError>,
) -> Result<(Vec<u8>, Origin), GpuError> {
    let Some(dir) = dir else {
        let c = compile()?;
        return Ok((
            c,
            Origin::Compiled {
                found: None,
                stored: None,
            },
        ));
    };
    let key = key()?;
    let found = match cache::read(dir, &key) {
        cache::Lookup::Hit(c) => return Ok((c, Origin::Disk(cache::entry_path(dir, &key)))),
        cache::Lookup::Miss => "no entry".to_string(),
        cache::Lookup::Rejected(r) => format!("entry rejected: {r:?}"),
        cache::Lookup::Unreadable(e) => format!("entry unreadable: {e}"),
    };
    let c = compile()?;
    let stored = cache::write(dir, &key, &c).map_err(|e| format!("{}: {e}", dir.display()));
    Ok((
        c,
        Origin::Compiled {
            found: Some(found),
            stored: Some(stored),
        },
    ))
}

/// CUBINs by (family, build, arch).
type CubinCache = HashMap<(&'static str, Variant, String), Vec<u8>>;
static CUBINS: Mutex<Option<CubinCache>> = Mutex::new(None);

/// `f`'s CUBIN for `arch`: from memory after the first call in a process, else through the disk
/// cache at [`cache::dir`] ([`cubin_cached`]), else compiled.
pub fn cubin(f: &Family, arch: &str) -> Result<Vec<u8>, GpuError> {
    cubin_variant(f, &Variant::default(), arch)
}

/// [`cubin`] of build `v`.
pub fn cubin_variant(f: &Family, v: &Variant, arch: &str) -> Result<Vec<u8>, GpuError> {
    let key = (f.name, *v, arch.to_string());
    if let Some(c) = CUBINS
        .lock()
        .ok()
        .and_then(|m| m.as_ref().and_then(|m| m.get(&key).cloned()))
    {
        return Ok(c);
    }
    let (c, _) = cubin_cached_variant(f, v, arch, cache::dir().as_deref())?;
    if let Ok(mut m) = CUBINS.lock() {
        m.get_or_insert_with(HashMap::new).insert(key, c.clone());
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir()
                .join(format!("ep-kernel-cache-flow-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn key() -> Result<cache::Key, GpuError> {
        Ok(cache::key(
            "t.cu",
            "src",
            &options("sm_90", false),
            "sm_90",
            (13, 0),
        ))
    }

    /// `through_cache` with a stand-in compiler that counts its calls.
    fn run(dir: Option<&Path>, calls: &Cell<u32>, out: &[u8]) -> (Vec<u8>, Origin) {
        through_cache(dir, key, || {
            calls.set(calls.get() + 1);
            Ok(out.to_vec())
        })
        .expect("the cache never fails a call")
    }

    #[test]
    fn compiles_once_then_loads() {
        let d = TempDir::new("once");
        let calls = Cell::new(0);
        let (c, o) = run(Some(&d.0), &calls, b"cubin-1");
        assert_eq!(c, b"cubin-1");
        assert!(
            matches!(&o, Origin::Compiled { found: Some(f), stored: Some(Ok(_)) } if f == "no entry"),
            "{o:?}"
        );
        // A later process (no in-memory cache here) loads it; the compiler is not called.
        let (c, o) = run(Some(&d.0), &calls, b"cubin-2");
        assert_eq!((c.as_slice(), calls.get()), (&b"cubin-1"[..], 1));
        assert!(matches!(o, Origin::Disk(_)), "{o:?}");
    }

    #[test]
    fn corrupt_entry_is_recompiled_and_rewritten() {
        let d = TempDir::new("corrupt");
        let calls = Cell::new(0);
        run(Some(&d.0), &calls, b"good cubin");
        let path = cache::entry_path(&d.0, &key().unwrap());
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xFF;
        std::fs::write(&path, &bytes).unwrap();
        let (c, o) = run(Some(&d.0), &calls, b"good cubin");
        assert_eq!((c.as_slice(), calls.get()), (&b"good cubin"[..], 2));
        assert!(
            matches!(&o, Origin::Compiled { found: Some(f), stored: Some(Ok(_)) } if f.contains("BadHash")),
            "{o:?}"
        );
        // Truncated: the same.
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let (_, o) = run(Some(&d.0), &calls, b"good cubin");
        assert!(matches!(&o, Origin::Compiled { found: Some(f), .. } if f.contains("Truncated")));
        // Rewritten: the next run loads it.
        let (c, o) = run(Some(&d.0), &calls, b"other");
        assert_eq!((c.as_slice(), calls.get()), (&b"good cubin"[..], 3));
        assert!(matches!(o, Origin::Disk(_)));
    }

    #[test]
    fn unwritable_dir_falls_back_to_compiling() {
        let d = TempDir::new("unwritable");
        std::fs::create_dir_all(&d.0).unwrap();
        let blocker = d.0.join("a-file");
        std::fs::write(&blocker, b"x").unwrap();
        let dir = blocker.join("kernels"); // cannot be created, even by root
        let calls = Cell::new(0);
        for n in 1..=2 {
            let (c, o) = run(Some(&dir), &calls, b"cubin");
            assert_eq!((c.as_slice(), calls.get()), (&b"cubin"[..], n));
            assert!(
                matches!(
                    &o,
                    Origin::Compiled {
                        stored: Some(Err(_)),
                        ..
                    }
                ),
                "{o:?}"
            );
        }
    }

    #[test]
    fn disabled_cache_compiles_and_writes_nothing() {
        let calls = Cell::new(0);
        let (_, o) = run(None, &calls, b"cubin");
        assert!(matches!(
            o,
            Origin::Compiled {
                found: None,
                stored: None
            }
        ));
        let (_, _) = run(None, &calls, b"cubin");
        assert_eq!(calls.get(), 2);
    }

    #[test]
    fn a_compile_error_is_the_calls_error() {
        let d = TempDir::new("err");
        let r = through_cache(Some(&d.0), key, || Err(GpuError::Compile("boom".into())));
        assert!(matches!(r, Err(GpuError::Compile(m)) if m == "boom"));
        assert!(matches!(
            cache::read(&d.0, &key().unwrap()),
            cache::Lookup::Miss
        ));
    }
}
