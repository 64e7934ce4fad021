//! The two paths ([`Path`]) and what every path offers a rank ([`EpRank`]), so tests and
//! benchmarks drive them the same way.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::config::{CombineFormat, Config};
use crate::error::{Error, Result};
use crate::mask::RankMask;
use crate::names::{self, UnknownName};
use crate::output::{DispatchOutput, Handle};
use crate::transport::CallStats;
use half::bf16;

/// Which of the two protocols moves a call's data (docs/contract.md section 6), on every
/// backend: the per-expert reference or the per-destination batches. The same bits either way.
///
/// One name each ([`Path::name`], shown by `Display`): `per-expert` and `batched`, as flags,
/// reports and error messages spell them. The one parse (`FromStr`) takes those names and
/// `per_expert`, the spelling of the Python API's `path=` keyword.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// One message per selection, one signal per (expert, source).
    PerExpert,
    /// One deduplicated batch and one signal per (source, destination).
    Batched,
}

impl Path {
    /// Both paths, the reference first.
    pub const ALL: [Path; 2] = [Path::PerExpert, Path::Batched];

    /// The path's name in flags and reports.
    pub fn name(self) -> &'static str {
        match self {
            Path::PerExpert => "per-expert",
            Path::Batched => "batched",
        }
    }
}

/// Other spellings the parse takes: `per_expert`, the Python API's `path=` keyword since its
/// first release (never shown: every message names [`Path::name`]).
const PATH_ALIASES: [(&str, Path); 1] = [("per_expert", Path::PerExpert)];

impl FromStr for Path {
    type Err = UnknownName;

    /// The path [`Path::name`] (or an alias: `per_expert`) spells `s`.
    fn from_str(s: &str) -> std::result::Result<Path, UnknownName> {
        names::parse_or_alias("path", s, &Path::ALL, Path::name, &PATH_ALIASES)
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// One rank's endpoint of an expert-parallel group, as DeepEP's low-latency `Buffer` offers it.
/// Every rank of the group must make the same sequence of calls (each call is collective).
pub trait EpRank: Send {
    fn rank(&self) -> usize;
    fn config(&self) -> &Config;

    /// Sends this rank's tokens (`x`: n x H, `topk_idx`: n x K) to their experts and returns what
    /// this rank's local experts received, plus the handle combine needs.
    ///
    /// A call rejected for bad input moves nothing and does not count as a collective step.
    fn dispatch(&mut self, x: &[bf16], topk_idx: &[i64]) -> Result<(DispatchOutput, Handle)> {
        let mut out = DispatchOutput::zeroed(self.config());
        let handle = self.dispatch_into(x, topk_idx, &mut out)?;
        Ok((out, handle))
    }

    /// [`EpRank::dispatch`] into an output allocated once (by [`DispatchOutput::zeroed`] for
    /// this config) and reused call after call, as DeepEP's callers reuse their tensors. Rows
    /// past `recv_count` keep whatever an earlier call left there.
    fn dispatch_into(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        out: &mut DispatchOutput,
    ) -> Result<Handle>;

    /// Sends the expert outputs `y` (L x (R*T) x H, in the dispatch layout) back and returns this
    /// rank's tokens, reduced with `topk_weights` in the contract's order (n x H): the rows
    /// travel as bf16 ([`CombineFormat::Bf16`]).
    fn combine(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &Handle,
    ) -> Result<Vec<bf16>> {
        self.combine_with(y, topk_idx, topk_weights, handle, CombineFormat::Bf16)
    }

    /// [`EpRank::combine`] with the rows in `format` (DeepEP's `use_logfmt`); a format the
    /// config does not suit is refused before anything moves ([`CombineFormat::check`]).
    fn combine_with(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &Handle,
        format: CombineFormat,
    ) -> Result<Vec<bf16>>;

    /// What the last successful call put on the wire.
    fn last_stats(&self) -> CallStats;

    /// DeepEP's `update_mask_buffer(rank, mask)`: masks (`true`) or unmasks (`false`) rank
    /// `rank` (docs/contract.md, "Masked ranks"). Later calls neither send to a masked rank nor
    /// wait for it, and a call of a masked rank sends nothing, waits for nobody, still counts as
    /// a call, and returns outputs the contract leaves undefined.
    ///
    /// Masking is valid at any time. Unmasking is valid only while every rank of the group is
    /// between calls and all have made the same number of dispatch calls and of combine calls,
    /// and every rank's next call starts after it; a group whose counts differ is refused with
    /// [`Error::UnmaskOutOfStep`], and nothing changes. A rank
    /// outside the group is [`Error::RankOutOfRange`].
    ///
    /// On the CPU backend the ranks share one mask: masking a rank on one endpoint masks it
    /// for all (calling it on every endpoint, as DeepEP's users do, changes nothing more).
    fn update_mask(&mut self, rank: usize, masked: bool) -> Result<()>;

    /// DeepEP's `query_mask_buffer`: the ranks masked now, by a caller or by a wait that ran
    /// out in shrink mode ([`CpuOptions::enable_shrink`]).
    fn query_mask(&self) -> RankMask;

    /// DeepEP's `clean_mask_buffer`: unmasks every rank, under the rule of
    /// [`EpRank::update_mask`]'s unmasking.
    fn clean_mask(&mut self) -> Result<()>;
}

/// Knobs of the CPU backend.
#[derive(Debug, Clone, Copy)]
pub struct CpuOptions {
    /// Bound on every wait of one call.
    pub timeout: Duration,
    /// Staging workers per rank (batched path only); 0 picks one per core the ranks leave
    /// free, at least 1 and at most 4 ([`CpuOptions::workers_for`]). At most
    /// [`MAX_STAGING_WORKERS`]: a group asked for more is refused ([`CpuOptions::check`]).
    pub staging_workers: usize,
    /// Communication memory allowed; `None` means what the OS reports available.
    pub memory_limit: Option<u64>,
    /// DeepEP's shrink mode: a wait for a peer that runs out masks that peer (see
    /// [`EpRank::update_mask`]) instead of failing the call, and the call completes as the
    /// masked contract says; the waiting rank's outputs then equal the masked oracle's
    /// (`oracle::dispatch_masked`) with that peer masked. Off (the default), such a wait fails
    /// the call with [`Error::Timeout`] and masks nothing. A wait for the
    /// rank's own staging never masks.
    pub enable_shrink: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            timeout: Duration::from_secs(10),
            staging_workers: 0,
            memory_limit: None,
            enable_shrink: false,
        }
    }
}

/// The most staging workers a rank may be given ([`CpuOptions::staging_workers`]). Each worker
/// is a thread of its rank for every call, so past the machine's cores they only contend; 256
/// is above the cores of any machine the CPU backend runs on, and low enough that the OS is
/// never asked for an absurd number of threads (`usize::MAX` overflowed a vector, 10^6 failed
/// to spawn). A fixed number, not one derived from the cores, so a command line that works on
/// one machine is accepted on every other.
pub const MAX_STAGING_WORKERS: usize = 256;

impl CpuOptions {
    /// Checks the options every group checks before it is built: `staging_workers` at most
    /// [`MAX_STAGING_WORKERS`], else [`Error::LimitExceeded`] naming `staging_workers`.
    pub fn check(&self) -> Result<()> {
        if self.staging_workers > MAX_STAGING_WORKERS {
            return Err(Error::LimitExceeded {
                what: "staging_workers",
                value: self.staging_workers as u128,
                limit: MAX_STAGING_WORKERS as u128,
            });
        }
        Ok(())
    }

    /// The staging workers each of `ranks` ranks gets: `staging_workers`, or where that is 0,
    /// the cores per rank (each call starts its workers as threads, and on a machine with fewer
    /// cores than ranks an extra thread costs more than it saves).
    pub fn workers_for(&self, ranks: usize) -> usize {
        if self.staging_workers > 0 {
            return self.staging_workers;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / ranks.max(1)).clamp(1, 4)
    }
}

/// A fresh id for a communicator, so handles from another one are recognised.
pub fn next_group_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Runs `f` on every rank at once, one thread per rank, and returns the results in rank order.
pub fn run_ranks<R, T, F>(ranks: &mut [R], f: F) -> Vec<T>
where
    R: Send,
    T: Send,
    F: Fn(&mut R) -> T + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks.iter_mut().map(|r| s.spawn(|| f(r))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_path_has_one_name_and_one_parse() {
        for p in Path::ALL {
            assert_eq!(p.name().parse::<Path>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
        }
        assert_eq!(Path::PerExpert.name(), "per-expert");
        // The Python keyword's spelling parses too, and is never shown.
        assert_eq!("per_expert".parse::<Path>(), Ok(Path::PerExpert));
        let e = "per expert".parse::<Path>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"per expert\" is not a path (expected 'per-expert' or 'batched')"
        );
        assert!("Batched".parse::<Path>().is_err());
        // Display pads like a str (report tables align on it).
        assert_eq!(format!("[{:<11}]", Path::Batched), "[batched    ]");
    }
}
