//! Kernel durations from CUPTI's activity API: the quantity DeepEP's test reports.
//!
//! DeepEP times its kernels with the PyTorch profiler (kineto), which reads CUPTI's
//! `CONCURRENT_KERNEL` activity records: for every kernel launch, the GPU timestamps at which the
//! kernel started and ended. The figure it prints is each kernel's own duration (end - start),
//! averaged over the profiled calls. CUDA events around a launch measure something else: the
//! stream's time from one event to the next, which includes the launch gap and anything queued in
//! between. [`KernelTimer`] collects the same records as kineto, through cudarc's `cupti` feature,
//! and [`per_call_us`] / [`summarize`] turn them into durations.
//!
//! libcupti is loaded at run time (cudarc's `dynamic-loading`), like libcuda and libnvrtc: where
//! it cannot be opened, [`KernelTimer::start`] returns [`CuptiError::Unavailable`] and callers keep
//! their event figures. CUPTI's activity state is per process, so one timer at a time
//! ([`CuptiError::Busy`] otherwise).
//!
//! All of the crate's CUPTI `unsafe` is in this module: the two buffer callbacks CUPTI calls, and
//! the record parsing they do.

use cudarc::cupti::result::{activity, CuptiError as RawError};
use cudarc::cupti::sys;
use std::alloc::{alloc, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Why CUPTI kernel times are not available, or what went wrong collecting them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CuptiError {
    /// libcupti could not be loaded (or panicked while loading a symbol).
    #[error("CUPTI unavailable: {0}")]
    Unavailable(String),
    /// Another [`KernelTimer`] of this process is running.
    #[error("a CUPTI kernel timer is already running in this process")]
    Busy,
    /// A CUPTI call failed.
    #[error("CUPTI {call} failed: {detail}")]
    Call { call: &'static str, detail: String },
    /// CUPTI could not store every record (no buffer, or a full one): the figures would be short.
    #[error("CUPTI dropped {dropped} kernel record(s) ({no_buffer} buffer request(s) failed)")]
    Dropped { dropped: u64, no_buffer: u64 },
    /// The records do not hold the calls asked for (see [`per_call_us`]).
    #[error("CUPTI records of {kernel}: {detail}")]
    Records { kernel: String, detail: String },
}

/// One kernel's activity record: CUPTI's GPU timestamps (nanoseconds) and where it ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRecord {
    /// The kernel's (unmangled for `extern "C"`) name.
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    /// CUDA device ordinal.
    pub device: u32,
    /// CUPTI's context and stream ids.
    pub context: u32,
    pub stream: u32,
    /// Correlates the record with the launch API call.
    pub correlation: u32,
}

impl KernelRecord {
    /// The kernel's own GPU duration, microseconds.
    pub fn duration_us(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 * 1e-3
    }
}

/// Per kernel name: how often it ran and its mean / min / max duration (DeepEP prints the mean).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelSummary {
    pub name: String,
    pub calls: usize,
    pub mean_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

/// Records grouped by kernel name, in name order.
pub fn summarize(records: &[KernelRecord]) -> Vec<KernelSummary> {
    let mut by: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in records {
        by.entry(&r.name).or_default().push(r.duration_us());
    }
    by.into_iter()
        .map(|(name, d)| KernelSummary {
            name: name.to_string(),
            calls: d.len(),
            mean_us: d.iter().sum::<f64>() / d.len() as f64,
            min_us: d.iter().copied().fold(f64::INFINITY, f64::min),
            max_us: d.iter().copied().fold(0.0, f64::max),
        })
        .collect()
}

/// Per-call durations of kernel `name` over `calls` calls, each call having launched it
/// `launches` times on each device in `devices` (1 normally, 2 where a call is a pack and an
/// unpack launch). On one device, call i's figure is the sum of its launches' durations (in
/// start order); across devices, the slowest device's, as the event figures take it. An error
/// when a device has another number of records than `calls * launches`.
pub fn per_call_us(
    records: &[KernelRecord],
    name: &str,
    devices: &[u32],
    calls: usize,
    launches: usize,
) -> Result<Vec<f64>, CuptiError> {
    let bad = |detail: String| CuptiError::Records {
        kernel: name.to_string(),
        detail,
    };
    let want = calls
        .checked_mul(launches)
        .ok_or_else(|| bad(format!("{calls} calls x {launches} launches overflow")))?;
    let mut out = vec![0f64; calls];
    for &d in devices {
        let mut mine: Vec<&KernelRecord> = records
            .iter()
            .filter(|r| r.name == name && r.device == d)
            .collect();
        if mine.len() != want {
            return Err(bad(format!(
                "{} record(s) on device {d}, expected {calls} call(s) x {launches} launch(es)",
                mine.len()
            )));
        }
        mine.sort_by_key(|r| r.start_ns);
        for (i, call) in mine.chunks_exact(launches.max(1)).enumerate() {
            let us: f64 = call.iter().map(|r| r.duration_us()).sum();
            out[i] = out[i].max(us);
        }
    }
    Ok(out)
}

/// Records collected by the completion callback since the running timer started.
static RECORDS: Mutex<Vec<KernelRecord>> = Mutex::new(Vec::new());
/// Records CUPTI reported dropped, and buffer requests this module could not serve.
static DROPPED: AtomicU64 = AtomicU64::new(0);
static NO_BUFFER: AtomicU64 = AtomicU64::new(0);
/// Set while a [`KernelTimer`] exists (one per process).
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The callbacks are registered once per process; the outcome is kept.
static REGISTERED: OnceLock<Result<(), CuptiError>> = OnceLock::new();

/// Size of each activity buffer handed to CUPTI (CUPTI's samples use 8 MiB, 8-byte aligned).
const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_ALIGN: usize = 8;

fn records() -> MutexGuard<'static, Vec<KernelRecord>> {
    // A poisoned lock only means a panic elsewhere while holding it; the Vec itself is whole.
    RECORDS.lock().unwrap_or_else(|p| p.into_inner())
}

fn call(what: &'static str, r: Result<(), RawError>) -> Result<(), CuptiError> {
    r.map_err(|e| CuptiError::Call {
        call: what,
        detail: format!("{:?}", e.0),
    })
}

/// Ok if libcupti can be opened here, the reason otherwise. Never panics.
pub fn available() -> Result<(), CuptiError> {
    // SAFETY: only tries to dlopen libcupti (the names cudarc knows) and reports whether it worked.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CuptiError::Unavailable(
            "libcupti not found (put CUDA's targets/<arch>/lib on LD_LIBRARY_PATH)".into(),
        ))
    }
}

/// CUPTI calls `buffer_requested` for an empty buffer to fill with records.
///
/// # Safety
/// Called by CUPTI only, with valid out-pointers.
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max: *mut usize) {
    let ptr = match Layout::from_size_align(BUFFER_BYTES, BUFFER_ALIGN) {
        // SAFETY: the layout has a nonzero size; the block is freed in `buffer_completed` with
        // the same layout (CUPTI hands every requested buffer back there).
        Ok(l) => unsafe { alloc(l) },
        Err(_) => std::ptr::null_mut(),
    };
    if ptr.is_null() {
        NO_BUFFER.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: CUPTI passes valid pointers to write the buffer, its size and the record limit
    // into. A null buffer with size 0 tells CUPTI to drop the records (counted as dropped).
    unsafe {
        *buffer = ptr;
        *size = if ptr.is_null() { 0 } else { BUFFER_BYTES };
        *max = 0; // as many records as fit
    }
}

/// CUPTI calls `buffer_completed` with a buffer holding `valid` bytes of records. The kernel
/// records are copied out (names included: they belong to CUPTI), then the buffer is freed.
///
/// # Safety
/// Called by CUPTI only, with a buffer from `buffer_requested` (or null) and `valid <= size`.
unsafe extern "C" fn buffer_completed(
    ctx: cudarc::driver::sys::CUcontext,
    stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    if buffer.is_null() {
        return;
    }
    // Nothing may unwind out of an extern "C" function: a panic while parsing loses this
    // buffer's records (counted as dropped), never the process.
    let parsed = std::panic::catch_unwind(|| {
        // SAFETY: `buffer` holds `valid` bytes of records written by CUPTI.
        unsafe { parse(buffer, valid) }
    });
    match parsed {
        Ok(v) => records().extend(v),
        Err(_) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
    let mut dropped = 0usize;
    // SAFETY: the context and stream id are the ones CUPTI passed for this buffer; `dropped` is
    // a valid out-pointer.
    if unsafe { activity::get_num_dropped_records(ctx, stream, &mut dropped) }.is_ok() {
        DROPPED.fetch_add(dropped as u64, Ordering::Relaxed);
    }
    if let Ok(l) = Layout::from_size_align(BUFFER_BYTES, BUFFER_ALIGN) {
        // SAFETY: `buffer` was allocated in `buffer_requested` with this layout, and CUPTI is done
        // with it once it has been handed back here.
        unsafe { dealloc(buffer, l) };
    }
}

/// The kernel records among the `valid` bytes at `buffer`.
///
/// # Safety
/// `buffer` must hold `valid` bytes of CUPTI activity records.
unsafe fn parse(buffer: *mut u8, valid: usize) -> Vec<KernelRecord> {
    let mut out = Vec::new();
    let mut rec: *mut sys::CUpti_Activity = std::ptr::null_mut();
    loop {
        // SAFETY: `buffer`/`valid` as CUPTI gave them; `rec` is null at first, then the previous
        // record, as cuptiActivityGetNextRecord requires.
        if unsafe { activity::get_next_record(buffer, valid, &mut rec) }.is_err() || rec.is_null() {
            break; // CUPTI_ERROR_MAX_LIMIT_REACHED: no more records (or a bad buffer).
        }
        // Every record starts with its kind, a u32. Read it as a u32, not as the Rust enum: a
        // kind this binding does not know must not become an invalid enum value.
        // SAFETY: `rec` points at a record inside the buffer; records are 8-byte aligned.
        let kind = unsafe { rec.cast::<u32>().read() };
        let concurrent = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32;
        let serial = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_KERNEL as u32;
        if kind != concurrent && kind != serial {
            continue;
        }
        let k = rec.cast::<sys::CUpti_ActivityKernel10>();
        // SAFETY: a (concurrent) kernel record of CUPTI 13.0 is a CUpti_ActivityKernel10 (the
        // fields read here sit at the same offsets in versions 9 to 12). Each field is read on
        // its own through a raw place (no reference to the packed struct, no enum field read),
        // unaligned-safe. The name is a NUL-terminated string CUPTI owns; it is copied here.
        let r = unsafe {
            let name_ptr = std::ptr::addr_of!((*k).name).read_unaligned();
            let name = if name_ptr.is_null() {
                String::from("<unnamed>")
            } else {
                std::ffi::CStr::from_ptr(name_ptr)
                    .to_string_lossy()
                    .into_owned()
            };
            KernelRecord {
                name,
                start_ns: std::ptr::addr_of!((*k).start).read_unaligned(),
                end_ns: std::ptr::addr_of!((*k).end).read_unaligned(),
                device: std::ptr::addr_of!((*k).deviceId).read_unaligned(),
                context: std::ptr::addr_of!((*k).contextId).read_unaligned(),
                stream: std::ptr::addr_of!((*k).streamId).read_unaligned(),
                correlation: std::ptr::addr_of!((*k).correlationId).read_unaligned(),
            }
        };
        out.push(r);
    }
    out
}

fn register() -> Result<(), CuptiError> {
    REGISTERED
        .get_or_init(|| {
            call(
                "cuptiActivityRegisterCallbacks",
                activity::register_callbacks(Some(buffer_requested), Some(buffer_completed)),
            )
        })
        .clone()
}

fn flush_forced() -> Result<(), CuptiError> {
    call(
        "cuptiActivityFlushAll",
        activity::flush_all(sys::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32),
    )
}

/// Catches a panic from cudarc's loader (a missing symbol panics) as [`CuptiError::Unavailable`].
fn guarded<T>(f: impl FnOnce() -> Result<T, CuptiError>) -> Result<T, CuptiError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into());
        Err(CuptiError::Unavailable(why))
    })
}

/// Collects the kernel records of every launch between [`KernelTimer::start`] and
/// [`KernelTimer::finish`] (all contexts and streams of this process). Synchronise the GPU work
/// before `finish`: a kernel still running then has no end time yet.
#[derive(Debug)]
pub struct KernelTimer {
    done: bool,
}

impl KernelTimer {
    /// Registers the buffer callbacks (once per process) and enables the concurrent-kernel
    /// activity kind. Kernels keep running concurrently (the `KERNEL` kind would serialise them).
    pub fn start() -> Result<KernelTimer, CuptiError> {
        available()?;
        if ACTIVE
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(CuptiError::Busy);
        }
        // From here on, the timer owns ACTIVE: dropping it (also on the error paths below)
        // disables the kind and releases ACTIVE.
        let t = KernelTimer { done: false };
        guarded(|| {
            register()?;
            // Records of an earlier, abandoned timer must not count.
            flush_forced()?;
            records().clear();
            DROPPED.store(0, Ordering::Relaxed);
            NO_BUFFER.store(0, Ordering::Relaxed);
            call(
                "cuptiActivityEnable(CONCURRENT_KERNEL)",
                activity::enable(sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
            )
        })?;
        Ok(t)
    }

    /// Disables the kind, flushes every buffer and returns the kernel records in start order.
    /// [`CuptiError::Dropped`] when CUPTI could not keep them all.
    pub fn finish(mut self) -> Result<Vec<KernelRecord>, CuptiError> {
        self.done = true;
        let r = guarded(|| {
            call(
                "cuptiActivityDisable(CONCURRENT_KERNEL)",
                activity::disable(sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
            )?;
            flush_forced()?;
            let mut v = std::mem::take(&mut *records());
            let (dropped, no_buffer) = (
                DROPPED.swap(0, Ordering::Relaxed),
                NO_BUFFER.swap(0, Ordering::Relaxed),
            );
            if dropped > 0 || no_buffer > 0 {
                return Err(CuptiError::Dropped { dropped, no_buffer });
            }
            v.sort_by_key(|r| (r.start_ns, r.device));
            Ok(v)
        });
        ACTIVE.store(false, Ordering::Release);
        r
    }
}

impl Drop for KernelTimer {
    fn drop(&mut self) {
        if !self.done {
            let _ = guarded(|| {
                let _ = activity::disable(
                    sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                );
                let _ = flush_forced();
                records().clear();
                Ok(())
            });
            ACTIVE.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, dev: u32, start: u64, end: u64) -> KernelRecord {
        KernelRecord {
            name: name.into(),
            start_ns: start,
            end_ns: end,
            device: dev,
            context: 1,
            stream: 7,
            correlation: 0,
        }
    }

    #[test]
    fn summary_is_per_name_mean() {
        let v = [
            rec("b", 0, 0, 2_000),
            rec("a", 0, 10_000, 11_000),
            rec("b", 0, 20_000, 26_000),
        ];
        let s = summarize(&v);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].name.as_str(), s[0].calls), ("a", 1));
        assert_eq!((s[1].name.as_str(), s[1].calls), ("b", 2));
        assert!((s[1].mean_us - 4.0).abs() < 1e-12);
        assert!((s[1].min_us - 2.0).abs() < 1e-12 && (s[1].max_us - 6.0).abs() < 1e-12);
    }

    #[test]
    fn per_call_takes_the_slowest_device_and_sums_launches() {
        // Two calls on two devices; records out of order; another kernel in between.
        let v = [
            rec("k", 1, 30_000, 34_000),
            rec("k", 0, 0, 3_000),
            rec("other", 0, 5_000, 9_000),
            rec("k", 0, 20_000, 21_000),
            rec("k", 1, 1_000, 3_000),
        ];
        let got = per_call_us(&v, "k", &[0, 1], 2, 1).unwrap();
        assert_eq!(got, vec![3.0, 4.0]);
        // Two launches per call (pack + unpack): call 0 = 3 + 1.
        let got = per_call_us(&v, "k", &[0], 1, 2).unwrap();
        assert_eq!(got, vec![4.0]);
    }

    #[test]
    fn per_call_refuses_a_short_count() {
        let v = [rec("k", 0, 0, 1_000)];
        let e = per_call_us(&v, "k", &[0], 2, 1).unwrap_err();
        assert!(
            matches!(&e, CuptiError::Records { kernel, detail }
                if kernel == "k" && detail.contains("1 record(s) on device 0")),
            "{e}"
        );
        assert!(per_call_us(&v, "k", &[0], usize::MAX, 2).is_err());
    }

    #[test]
    fn reversed_timestamps_give_zero_not_a_wrap() {
        assert_eq!(rec("k", 0, 5, 1).duration_us(), 0.0);
    }

    /// Without libcupti, start says so (a typed error) instead of panicking; with it (the GPU
    /// machine), a timer starts, and a second one is refused while the first runs.
    #[test]
    fn start_without_cupti_is_a_typed_error_or_one_timer_at_a_time() {
        match KernelTimer::start() {
            Err(CuptiError::Unavailable(why)) => {
                assert!(available().is_err());
                println!("CUPTI unavailable here: {why}");
            }
            Ok(t) => {
                assert_eq!(KernelTimer::start().unwrap_err(), CuptiError::Busy);
                // Other tests of this process may launch kernels meanwhile: only the call is
                // checked here; the GPU tests check the records themselves.
                t.finish().unwrap();
                // Released: a new timer starts.
                drop(KernelTimer::start().unwrap());
            }
            Err(e) => panic!("unexpected: {e}"),
        }
    }
}
