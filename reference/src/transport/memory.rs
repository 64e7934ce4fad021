//! The memory check made at construction: a config whose buffers cannot fit fails with the size
//! it needed.

use crate::error::{Error, Result};

/// Bytes the OS reports available (MemAvailable), or `None` where it cannot tell.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Fails with [`Error::OutOfMemory`] when `needed` exceeds `limit` (or, without one, what the
/// OS reports available).
pub fn check(needed: u64, limit: Option<u64>) -> Result<()> {
    let available = limit.or_else(available_bytes).unwrap_or(u64::MAX);
    if needed > available {
        return Err(Error::OutOfMemory { needed, available });
    }
    Ok(())
}
