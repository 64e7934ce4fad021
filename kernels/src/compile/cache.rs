//! The on-disk cache of compiled kernels (CUBINs), so that a process does not pay NVRTC's
//! seconds when an earlier one (another rank of the job, an earlier run) compiled the same code.
//!
//! - **Where**: `$EP_KERNEL_CACHE` if set (the value `off` disables the cache), else
//!   `$XDG_CACHE_HOME/ep-dispatch/kernels` (an absolute `XDG_CACHE_HOME`), else
//!   `~/.cache/ep-dispatch/kernels`; with none of them (no `HOME`), no cache. See [`location`].
//! - **Key**: SHA-256 over, each length-prefixed: the entry format's version, the module's name,
//!   the full source text NVRTC compiles, every NVRTC option in order, the target architecture
//!   and NVRTC's version (`nvrtcVersion`, major.minor). Anything that changes the CUBIN changes
//!   the key, so an entry is never stale; old entries are simply no longer read ([`key`]).
//! - **Entry**: one file `<key in hex>.cubin`: a 4-byte magic `EPKC`, the format version (u32),
//!   the key (32 bytes), the CUBIN's length (u64) and its SHA-256 (32 bytes), then the CUBIN
//!   ([`encode`]). A read checks all of it ([`decode`]): a truncated, corrupt, foreign or
//!   unreadable entry is ignored, the module recompiled and the entry rewritten.
//! - **Writes are atomic**: a temporary file in the same folder, written, `fsync`ed, then renamed
//!   over the entry; readers see the old entry, the new one or none, never part of one. Ranks
//!   that start together on a cold cache each compile and each write the same bytes.
//! - **Never fatal**: any IO error (no folder, read-only, full disk) means the module is compiled
//!   as if there were no cache; the cache never fails a call and never panics.

use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable naming the cache folder, or `off`.
pub const ENV: &str = "EP_KERNEL_CACHE";
/// The value of [`ENV`] that disables the cache.
pub const OFF: &str = "off";
/// The entry format; part of the key and of every entry's header.
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 4] = b"EPKC";
/// magic + version + key + length + content hash.
pub const HEADER_LEN: usize = 4 + 4 + 32 + 8 + 32;
/// Entries larger than this are not read (a CUBIN of this crate is well under 1 MiB).
const MAX_ENTRY: u64 = 256 << 20;

/// A cache key: the SHA-256 of everything that determines the CUBIN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// Lower-case hex, the entry's file name without its extension.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The key of a module named `name` with translation unit `source`, compiled with `options` for
/// `arch` by NVRTC `nvrtc_version` (major, minor). Each part is length-prefixed, so no two
/// different inputs hash the same bytes.
pub fn key(
    name: &str,
    source: &str,
    options: &[String],
    arch: &str,
    nvrtc_version: (i32, i32),
) -> Key {
    let mut h = Sha256::new();
    let mut part = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(b"ep-dispatch kernel cache");
    part(&FORMAT_VERSION.to_le_bytes());
    part(name.as_bytes());
    part(source.as_bytes());
    part(&(options.len() as u64).to_le_bytes());
    for o in options {
        part(o.as_bytes());
    }
    part(arch.as_bytes());
    part(&nvrtc_version.0.to_le_bytes());
    part(&nvrtc_version.1.to_le_bytes());
    Key(h.finalize().into())
}

/// The cache folder, from the values of the environment variables `var` returns: `None` when
/// the cache is disabled (`EP_KERNEL_CACHE=off`) or no folder can be named. An empty value
/// counts as unset; a relative `XDG_CACHE_HOME` is ignored, as the XDG spec asks.
pub fn location(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(v) = set(ENV) {
        if v == OFF {
            return None;
        }
        return Some(PathBuf::from(v));
    }
    if let Some(x) = set("XDG_CACHE_HOME").map(PathBuf::from) {
        if x.is_absolute() {
            return Some(x.join("ep-dispatch").join("kernels"));
        }
    }
    set("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("ep-dispatch")
            .join("kernels")
    })
}

/// [`location`] from this process's environment.
pub fn dir() -> Option<PathBuf> {
    location(|name| std::env::var_os(name))
}

/// The entry file of `key` in `dir`.
pub fn entry_path(dir: &Path, key: &Key) -> PathBuf {
    dir.join(format!("{}.cubin", key.hex()))
}

/// An entry's bytes: header (magic, version, key, length, SHA-256 of the content), content.
pub fn encode(key: &Key, content: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + content.len());
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    v.extend_from_slice(&key.0);
    v.extend_from_slice(&(content.len() as u64).to_le_bytes());
    v.extend_from_slice(&Sha256::digest(content));
    v.extend_from_slice(content);
    v
}

/// Why an entry was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// Shorter than its header, or than the length the header gives.
    Truncated,
    /// Longer than the header says.
    TrailingBytes,
    BadMagic,
    OtherVersion(u32),
    /// The header names another key (a misnamed or copied file).
    OtherKey,
    /// The content's SHA-256 is not the one stored.
    BadHash,
    /// Empty content: never a valid CUBIN.
    Empty,
}

/// The content of an entry for `key`, after checking every header field and the hash.
pub fn decode<'a>(key: &Key, bytes: &'a [u8]) -> Result<&'a [u8], Reject> {
    if bytes.len() < HEADER_LEN {
        return Err(Reject::Truncated);
    }
    let (head, content) = bytes.split_at(HEADER_LEN);
    if &head[..4] != MAGIC {
        return Err(Reject::BadMagic);
    }
    let version = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(Reject::OtherVersion(version));
    }
    if head[8..40] != key.0 {
        return Err(Reject::OtherKey);
    }
    let len = u64::from_le_bytes(head[40..48].try_into().expect("8 bytes"));
    match (content.len() as u64).cmp(&len) {
        std::cmp::Ordering::Less => return Err(Reject::Truncated),
        std::cmp::Ordering::Greater => return Err(Reject::TrailingBytes),
        std::cmp::Ordering::Equal => {}
    }
    if content.is_empty() {
        return Err(Reject::Empty);
    }
    if Sha256::digest(content).as_slice() != &head[48..80] {
        return Err(Reject::BadHash);
    }
    Ok(content)
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A checked entry's content.
    Hit(Vec<u8>),
    /// No entry.
    Miss,
    /// An entry that failed its checks (it will be overwritten).
    Rejected(Reject),
    /// The entry could not be read.
    Unreadable(io::Error),
}

/// Reads and checks the entry of `key` in `dir`.
pub fn read(dir: &Path, key: &Key) -> Lookup {
    let path = entry_path(dir, key);
    let mut f = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Lookup::Miss,
        Err(e) => return Lookup::Unreadable(e),
    };
    let mut bytes = Vec::new();
    // One byte past the limit tells an oversized entry from one at the limit.
    if let Err(e) = (&mut f).take(MAX_ENTRY + 1).read_to_end(&mut bytes) {
        return Lookup::Unreadable(e);
    }
    if bytes.len() as u64 > MAX_ENTRY {
        return Lookup::Rejected(Reject::TrailingBytes);
    }
    match decode(key, &bytes) {
        Ok(c) => Lookup::Hit(c.to_vec()),
        Err(r) => Lookup::Rejected(r),
    }
}

/// Writes the entry of `key` atomically: a temporary file in `dir` (created if missing),
/// written and `fsync`ed, then renamed over the entry (and the folder `fsync`ed, where the
/// platform allows). On error the temporary file is removed and the entry left as it was.
pub fn write(dir: &Path, key: &Key, content: &[u8]) -> io::Result<PathBuf> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    fs::create_dir_all(dir)?;
    let path = entry_path(dir, key);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(
        ".{}.{}.{}.{nanos}.tmp",
        key.hex(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let res = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(&encode(key, content))?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &path)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res?;
    // The rename itself durable: best effort (not every platform opens folders).
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fresh folder under the system's temporary folder, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "ep-kernel-cache-test-{}-{tag}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&p);
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn opts() -> Vec<String> {
        super::super::options("sm_90", false)
    }

    fn k0() -> Key {
        key(
            "fp8.cu",
            "__global__ void k() {}",
            &opts(),
            "sm_90",
            (13, 0),
        )
    }

    #[test]
    fn key_changes_with_each_input() {
        let base = k0();
        assert_eq!(base, k0(), "the key is deterministic");
        let mut other_opts = opts();
        other_opts[1] = "--fmad=true".into();
        let mut more_opts = opts();
        more_opts.push("--ptxas-options=-v".into());
        let variants = [
            key(
                "batched.cu",
                "__global__ void k() {}",
                &opts(),
                "sm_90",
                (13, 0),
            ),
            key("fp8.cu", "__global__ void k(){}", &opts(), "sm_90", (13, 0)),
            key(
                "fp8.cu",
                "__global__ void k() {} ",
                &opts(),
                "sm_90",
                (13, 0),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &other_opts,
                "sm_90",
                (13, 0),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &more_opts,
                "sm_90",
                (13, 0),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &opts()[..2],
                "sm_90",
                (13, 0),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &opts(),
                "sm_100",
                (13, 0),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &opts(),
                "sm_90",
                (13, 1),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &opts(),
                "sm_90",
                (12, 0),
            ),
            // The boundary between two parts moved: the length prefixes tell them apart.
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &["--a".to_string(), "b".to_string()],
                "sm_90",
                (13, 0),
            ),
            key(
                "fp8.cu",
                "__global__ void k() {}",
                &["--ab".to_string()],
                "sm_90",
                (13, 0),
            ),
        ];
        let mut seen: HashMap<Key, usize> = HashMap::new();
        seen.insert(base, usize::MAX);
        for (i, k) in variants.iter().enumerate() {
            if let Some(j) = seen.insert(*k, i) {
                panic!("variant {i} has the key of {j}");
            }
        }
        // Every family's real translation unit has its own key.
        let real: Vec<Key> = super::super::FAMILIES
            .iter()
            .map(|f| key(f.name, &f.full_source(), &opts(), "sm_90", (13, 0)))
            .collect();
        assert!(real[0] != real[1] && real[1] != real[2] && real[0] != real[2]);
        assert_eq!(base.hex().len(), 64);
    }

    #[test]
    fn location_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            location(env(&[
                (ENV, "/c/ep"),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/home/u")
            ])),
            Some(PathBuf::from("/c/ep"))
        );
        assert_eq!(
            location(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/home/u")])),
            Some(PathBuf::from("/x/ep-dispatch/kernels"))
        );
        assert_eq!(
            location(env(&[("HOME", "/home/u")])),
            Some(PathBuf::from("/home/u/.cache/ep-dispatch/kernels"))
        );
        // Relative XDG_CACHE_HOME and empty values are ignored.
        assert_eq!(
            location(env(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/ep-dispatch/kernels"))
        );
        assert_eq!(
            location(env(&[(ENV, ""), ("XDG_CACHE_HOME", ""), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/ep-dispatch/kernels"))
        );
        assert_eq!(location(env(&[])), None);
    }

    #[test]
    fn disabled_by_env() {
        let off = |name: &str| match name {
            ENV => Some(OsString::from(OFF)),
            "XDG_CACHE_HOME" => Some(OsString::from("/x")),
            "HOME" => Some(OsString::from("/home/u")),
            _ => None,
        };
        assert_eq!(location(off), None);
    }

    #[test]
    fn atomic_write_then_read_round_trip() {
        let d = TempDir::new("rt");
        let dir = d.0.join("nested").join("kernels"); // created by the write
        let k = k0();
        assert!(matches!(read(&dir, &k), Lookup::Miss));
        let content: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let path = write(&dir, &k, &content).unwrap();
        assert_eq!(path, entry_path(&dir, &k));
        match read(&dir, &k) {
            Lookup::Hit(c) => assert_eq!(c, content),
            other => panic!("{other:?}"),
        }
        // Overwriting replaces the entry; no temporary file is left behind.
        let newer = vec![0xABu8; 4096];
        write(&dir, &k, &newer).unwrap();
        assert!(matches!(read(&dir, &k), Lookup::Hit(c) if c == newer));
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![format!("{}.cubin", k.hex())]);
        // Another key is a miss in the same folder.
        let k2 = key("x", "y", &[], "sm_90", (13, 0));
        assert!(matches!(read(&dir, &k2), Lookup::Miss));
    }

    #[test]
    fn concurrent_writers_leave_one_whole_entry() {
        let d = TempDir::new("conc");
        let k = k0();
        let content = vec![0x5Au8; 300_000];
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..5 {
                        write(&d.0, &k, &content).unwrap();
                        match read(&d.0, &k) {
                            Lookup::Hit(c) => assert_eq!(c, content),
                            other => panic!("a reader saw {other:?}"),
                        }
                    }
                });
            }
        });
        assert_eq!(fs::read_dir(&d.0).unwrap().count(), 1);
    }

    #[test]
    fn corrupt_entries_are_rejected() {
        let d = TempDir::new("corrupt");
        let k = k0();
        let content: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let good = encode(&k, &content);
        let path = entry_path(&d.0, &k);
        fs::create_dir_all(&d.0).unwrap();
        let cases: Vec<(&str, Vec<u8>, Reject)> = vec![
            ("empty file", vec![], Reject::Truncated),
            (
                "half a header",
                good[..HEADER_LEN / 2].to_vec(),
                Reject::Truncated,
            ),
            (
                "truncated content",
                good[..good.len() - 1].to_vec(),
                Reject::Truncated,
            ),
            (
                "a byte too many",
                [&good[..], &[0]].concat(),
                Reject::TrailingBytes,
            ),
            (
                "flipped content bit",
                {
                    let mut b = good.clone();
                    b[HEADER_LEN + 1234] ^= 0x10;
                    b
                },
                Reject::BadHash,
            ),
            (
                "flipped hash bit",
                {
                    let mut b = good.clone();
                    b[50] ^= 1;
                    b
                },
                Reject::BadHash,
            ),
            (
                "bad magic",
                {
                    let mut b = good.clone();
                    b[0] = b'X';
                    b
                },
                Reject::BadMagic,
            ),
            (
                "other version",
                {
                    let mut b = good.clone();
                    b[4] = 9;
                    b
                },
                Reject::OtherVersion(9),
            ),
            (
                "another key's entry under this name",
                encode(&key("x", "y", &[], "sm_90", (13, 0)), &content),
                Reject::OtherKey,
            ),
            (
                "length field says less",
                {
                    let mut b = good.clone();
                    b[40..48].copy_from_slice(&4999u64.to_le_bytes());
                    b
                },
                Reject::TrailingBytes,
            ),
            ("empty content", encode(&k, &[]), Reject::Empty),
        ];
        for (what, bytes, want) in cases {
            fs::write(&path, &bytes).unwrap();
            match read(&d.0, &k) {
                Lookup::Rejected(r) => assert_eq!(r, want, "{what}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        // A rewrite repairs it.
        write(&d.0, &k, &content).unwrap();
        assert!(matches!(read(&d.0, &k), Lookup::Hit(c) if c == content));
    }

    #[test]
    fn unreadable_entry_is_reported_not_trusted() {
        let d = TempDir::new("unreadable");
        let k = k0();
        // A folder where the entry should be: opening works on Linux, reading fails.
        fs::create_dir_all(entry_path(&d.0, &k)).unwrap();
        assert!(matches!(
            read(&d.0, &k),
            Lookup::Unreadable(_) | Lookup::Rejected(_)
        ));
        // And the write cannot replace a folder: an error, not a panic.
        assert!(write(&d.0, &k, b"cubin").is_err());
        let leftovers = fs::read_dir(&d.0).unwrap().count();
        assert_eq!(leftovers, 1, "the temporary file was removed");
    }

    #[test]
    fn unwritable_dir_is_an_error_not_a_panic() {
        let d = TempDir::new("unwritable");
        // A file where the folder should be: create_dir_all fails, whoever runs the test
        // (root ignores permission bits, so a read-only folder would not do).
        fs::create_dir_all(&d.0).unwrap();
        let blocker = d.0.join("file");
        fs::write(&blocker, b"not a folder").unwrap();
        let dir = blocker.join("kernels");
        let k = k0();
        assert!(write(&dir, &k, b"cubin").is_err());
        assert!(matches!(
            read(&dir, &k),
            Lookup::Unreadable(_) | Lookup::Miss
        ));
    }
}
