//! One benchmark point ([`BenchSpec`]), its bounds, and why a point produced no figures
//! ([`BenchError`]): what every backend takes and returns.

use std::fmt;

use ep_reference::workload::{Routing, Workload};
use ep_reference::{Config, CpuOptions};

/// One benchmark point.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    pub cfg: Config,
    /// Tokens on every rank (<= T).
    pub tokens: usize,
    /// Probability that a top-k slot is -1.
    pub masked: f64,
    pub seed: u64,
    pub iters: usize,
    pub warmup: usize,
    /// CPU backend knobs (staging workers, timeout).
    pub cpu: CpuOptions,
    /// GPU backend: GPUs to spread the ranks over (1 = every rank a virtual rank on GPU 0).
    pub gpus: usize,
    /// GPU backend: replay the timed calls from a CUDA graph (one GPU only) or launch them one
    /// by one; `None`: a graph on one GPU, launches on several.
    pub graph: Option<bool>,
    /// GPU backend: `Some(sizes)` runs every peer through NCCL (one rank per GPU) with that
    /// sizing for the batched path (per-expert always runs exact sizes); `None`: NVLink.
    pub nccl: Option<ep_kernels::NcclSizes>,
    /// The combine's format (`--logfmt`: LogFMT-10).
    pub combine: ep_reference::CombineFormat,
    /// GPU backend: recv_scales in DeepEP's column-major layout
    /// (`GpuOptions::scales_column_major`; `--scales-column-major`), else row-major.
    pub scales_column_major: bool,
}

/// The most timed iterations of one point (`--iters`). Each keeps one latency per rank, path
/// and operation, so 10^5 already holds about 3 GB at the largest R (1024); more is a typo, not
/// a benchmark.
pub const MAX_ITERS: usize = 100_000;
/// The most warm-up iterations of one point (`--warmup`).
pub const MAX_WARMUP: usize = 100_000;

impl BenchSpec {
    /// Warm-up plus timed rounds of this point: `iters` in `1..=MAX_ITERS` and `warmup` at most
    /// `MAX_WARMUP`, else a config error naming the count (`iters` or `warmup`).
    pub fn rounds(&self) -> Result<usize, BenchError> {
        let over = |what: &'static str, value: usize, limit: usize| {
            BenchError::Config(ep_reference::Error::LimitExceeded {
                what,
                value: value as u128,
                limit: limit as u128,
            })
        };
        if self.iters == 0 {
            return Err(BenchError::Config(ep_reference::Error::ZeroSize {
                what: "iters",
            }));
        }
        if self.iters > MAX_ITERS {
            return Err(over("iters", self.iters, MAX_ITERS));
        }
        if self.warmup > MAX_WARMUP {
            return Err(over("warmup", self.warmup, MAX_WARMUP));
        }
        // Both bounded above: cannot overflow; checked all the same.
        self.warmup
            .checked_add(self.iters)
            .ok_or_else(|| over("warmup + iters", self.warmup, usize::MAX - self.iters))
    }

    /// Every rank's inputs: random routing with `masked` -1 slots.
    pub fn workload(&self) -> Workload {
        Workload::uniform(
            &self.cfg,
            self.tokens,
            Routing::Random {
                masked: self.masked,
            },
            self.seed,
        )
    }
}

/// Why a point produced no figures.
#[derive(Debug)]
pub enum BenchError {
    /// Bad config or inputs, or a group that cannot be built (e.g. out of memory): the typed
    /// error of ep-reference.
    Config(ep_reference::Error),
    /// A path failed while running.
    Path {
        path: ep_reference::Path,
        err: ep_reference::Error,
    },
    /// The paths' outputs differ from each other or from the oracle: nothing is timed.
    Mismatch(String),
    /// The backend is not usable.
    Backend(String),
    /// A flag the chosen backend does not implement.
    Unsupported {
        flag: &'static str,
        backend: &'static str,
    },
}

impl BenchError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            BenchError::Config(_) | BenchError::Unsupported { .. } => 2,
            BenchError::Mismatch(_) => 3,
            BenchError::Path { .. } | BenchError::Backend(_) => 1,
        }
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Config(e) => write!(f, "{e}"),
            BenchError::Path { path, err } => write!(f, "{path} path failed: {err}"),
            BenchError::Mismatch(m) => write!(
                f,
                "outputs are not bitwise equal, refusing to time anything: {m}"
            ),
            BenchError::Backend(m) => write!(f, "{m}"),
            BenchError::Unsupported { flag, backend } => write!(
                f,
                "{flag} is not implemented on the {backend} backend yet: drop {flag}, or add --backend cpu"
            ),
        }
    }
}

impl std::error::Error for BenchError {}

impl From<ep_reference::Error> for BenchError {
    fn from(e: ep_reference::Error) -> BenchError {
        BenchError::Config(e)
    }
}
