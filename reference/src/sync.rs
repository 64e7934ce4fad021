//! The one place the protocol code gets its atomics, cells and spin hint from.
//!
//! Normally these are std's. Built with `RUSTFLAGS="--cfg ep_loom"` they are loom's, so the loom
//! models in `verify/` check the very functions that ship (the tokio / crossbeam pattern).
//! Under loom, time does not pass by itself: a [`Deadline`] counts polls instead (see there).

#[cfg(not(ep_loom))]
pub use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(ep_loom))]
pub use std::sync::Arc;

#[cfg(ep_loom)]
pub use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(ep_loom)]
pub use loom::sync::Arc;

/// The hint every spin loop calls between polls. Under loom it yields, which tells the model
/// checker this thread waits for another.
#[inline]
pub fn spin_loop() {
    #[cfg(not(ep_loom))]
    std::hint::spin_loop();
    #[cfg(ep_loom)]
    loom::thread::yield_now();
}

/// A bound on a wait.
///
/// With std it is a point in time. Under loom, where the model checker decides the schedule and
/// real time means nothing, a timeout of N milliseconds allows N polls (and any timeout of an
/// hour or more never expires), so a model can make a wait time out on purpose.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    #[cfg(not(ep_loom))]
    start: std::time::Instant,
    timeout: std::time::Duration,
}

impl Deadline {
    pub fn after(timeout: std::time::Duration) -> Deadline {
        Deadline {
            #[cfg(not(ep_loom))]
            start: std::time::Instant::now(),
            timeout,
        }
    }

    /// A deadline with the same timeout, starting now: what a call's later waits get after
    /// a wait that ran out was resolved by masking its peer (`transport::mask_table`), so that each
    /// of them still has a whole timeout. Under loom every wait has its own polls anyway.
    pub fn restarted(&self) -> Deadline {
        Deadline::after(self.timeout)
    }

    /// Milliseconds since the deadline was set (under loom: the timeout itself), saturating at
    /// `u64::MAX`.
    ///
    /// No `Instant + Duration` is ever computed: a wait compares the time elapsed with the
    /// timeout, so any timeout, `Duration::MAX` included, is fine (it never expires).
    pub fn waited_ms(&self) -> u64 {
        #[cfg(not(ep_loom))]
        let ms = self.start.elapsed().as_millis();
        #[cfg(ep_loom)]
        let ms = self.timeout.as_millis();
        u64::try_from(ms).unwrap_or(u64::MAX)
    }

    /// Spins until `ready` returns `Some`, or gives up when the deadline passes.
    /// Returns `None` on timeout. `ready` is polled at least once.
    pub fn spin_until<T>(&self, mut ready: impl FnMut() -> Option<T>) -> Option<T> {
        #[cfg(not(ep_loom))]
        {
            let mut polls: u32 = 0;
            loop {
                if let Some(v) = ready() {
                    return Some(v);
                }
                polls = polls.wrapping_add(1);
                // Reading the clock costs more than a poll: look at it every 64 polls, and let
                // the OS run the peer when this core is oversubscribed.
                if polls.is_multiple_of(64) {
                    if self.start.elapsed() >= self.timeout {
                        return ready();
                    }
                    std::thread::yield_now();
                } else {
                    spin_loop();
                }
            }
        }
        #[cfg(ep_loom)]
        {
            let unbounded = self.timeout >= std::time::Duration::from_secs(3600);
            let mut left = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
            loop {
                if let Some(v) = ready() {
                    return Some(v);
                }
                if !unbounded {
                    if left == 0 {
                        return None;
                    }
                    left -= 1;
                }
                spin_loop();
            }
        }
    }
}

/// Raw shared bytes that several threads write and read at disjoint rows, ordered by the
/// protocol's atomics rather than by a lock.
///
/// With std this is plain memory. Under loom every row also owns a `loom::cell::UnsafeCell<()>`
/// that each access touches, so loom reports any row access that the protocol's
/// release/acquire pairs do not order (a reader that could see stale bytes, or two writers).
pub struct SharedRows {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    row_bytes: usize,
    rows: usize,
    #[cfg(ep_loom)]
    track: Box<[loom::cell::UnsafeCell<()>]>,
}

// SAFETY: SharedRows hands out row slices only through `unsafe` methods whose callers promise
// that no two threads access the same row at the same time unless both only read; the
// protocol's release/acquire pairs establish that order (and loom checks it).
unsafe impl Sync for SharedRows {}
// SAFETY: the bytes are owned; moving the owner between threads is fine.
unsafe impl Send for SharedRows {}

impl SharedRows {
    /// `rows` rows of `row_bytes` each, zeroed. The allocation is lazily backed by the OS, so
    /// rows never written cost no physical memory.
    ///
    /// # Panics
    /// When `rows * row_bytes` does not fit in a `usize` (a wrapped size would make every row
    /// past the wrap an out-of-bounds write). The paths size their regions from a validated
    /// [`Config`](crate::Config), whose sizes always fit (`Config::validate`).
    pub fn new(rows: usize, row_bytes: usize) -> SharedRows {
        let len = rows.checked_mul(row_bytes).unwrap_or_else(|| {
            panic!("SharedRows: {rows} rows x {row_bytes} bytes overflow usize")
        });
        let boxed = vec![0u8; len].into_boxed_slice();
        // The box is turned back into one in Drop; until then only raw pointers reach it, so
        // rows handed to different threads never alias a `&mut` to the whole buffer.
        let ptr = std::ptr::NonNull::new(Box::into_raw(boxed) as *mut u8).expect("non-null box");
        SharedRows {
            ptr,
            len,
            row_bytes,
            rows,
            #[cfg(ep_loom)]
            track: (0..rows).map(|_| loom::cell::UnsafeCell::new(())).collect(),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Runs `f` on row `row` for writing.
    ///
    /// # Safety
    /// No other thread may access row `row` while `f` runs; the caller's protocol orders this
    /// write before any later read of the row.
    pub unsafe fn with_row_mut<R>(&self, row: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        assert!(row < self.rows, "row {row} out of {}", self.rows);
        // SAFETY: in bounds (checked above); exclusivity is the caller's promise.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().add(row * self.row_bytes),
                self.row_bytes,
            )
        };
        #[cfg(ep_loom)]
        {
            self.track[row].with_mut(|_| f(bytes))
        }
        #[cfg(not(ep_loom))]
        {
            f(bytes)
        }
    }

    /// Runs `f` on rows `first..first + n`, which the caller reads.
    ///
    /// # Safety
    /// Every write to these rows must happen-before this call (the protocol's acquire of the
    /// writer's release signal), and no thread may write them while `f` runs.
    pub unsafe fn with_rows<R>(&self, first: usize, n: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        // `first + n` could wrap for a huge `n`: compare without adding.
        assert!(
            first <= self.rows && n <= self.rows - first,
            "rows {first}+{n} out of {}",
            self.rows
        );
        // SAFETY: in bounds (checked above); no concurrent writer is the caller's promise.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr().add(first * self.row_bytes),
                n * self.row_bytes,
            )
        };
        #[cfg(ep_loom)]
        {
            // Touch every row read, so loom checks each against its writer.
            for t in &self.track[first..first + n] {
                t.with(|_| ());
            }
        }
        f(bytes)
    }
}

impl Drop for SharedRows {
    fn drop(&mut self) {
        // SAFETY: ptr and len come from Box::into_raw of a boxed slice of exactly len bytes in
        // `new`, and Drop runs once, with no row borrowed (&mut self).
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            )));
        }
    }
}

/// A memory fence, std's or loom's. The loom model of the GPU protocol (`ep_verify::gpu_protocol`)
/// mirrors the kernels' `fence.acq_rel` with it.
#[inline]
pub fn fence(order: Ordering) {
    #[cfg(not(ep_loom))]
    std::sync::atomic::fence(order);
    #[cfg(ep_loom)]
    loom::sync::atomic::fence(order);
}
