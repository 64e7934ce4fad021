//! Which machine runs the comparison: the CPU backend (always there) or the GPU backend
//! ([`crate::gpu`]). Both take a [`BenchSpec`] ([`crate::spec`]) and return a [`PointResult`]
//! assembled by [`crate::report::assemble`].

use crate::report::PointResult;
use crate::spec::{BenchError, BenchSpec};
use crate::{cpu, gpu};

/// What `--backend` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// The GPU when one is usable, the CPU otherwise.
    Auto,
    Cpu,
    Gpu,
}

/// The backend that runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    /// With the device's name.
    Gpu(String),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Gpu(_) => "gpu",
        }
    }

    /// Default (timed iterations, warm-up iterations): the CPU backend copies every byte with
    /// the cores the ranks share, so it takes few; a GPU takes the usual hundreds.
    pub fn default_iters(&self) -> (usize, usize) {
        match self {
            Backend::Cpu => (20, 3),
            Backend::Gpu(_) => (200, 20),
        }
    }
}

/// Resolves `--backend`. `Auto` falls back to the CPU and says why in the second value.
pub fn choose(choice: BackendChoice) -> Result<(Backend, Option<String>), BenchError> {
    match choice {
        BackendChoice::Cpu => Ok((Backend::Cpu, None)),
        BackendChoice::Gpu => gpu::probe()
            .map(|d| (Backend::Gpu(d), None))
            .map_err(|why| BenchError::Backend(format!("--backend gpu: {why}"))),
        BackendChoice::Auto => Ok(match gpu::probe() {
            Ok(d) => (Backend::Gpu(d), None),
            Err(why) => (
                Backend::Cpu,
                Some(format!("no GPU backend ({why}); using the CPU backend")),
            ),
        }),
    }
}

/// Runs one point on `backend`; `progress` gets short status lines.
pub fn run_point(
    backend: &Backend,
    spec: &BenchSpec,
    progress: &dyn Fn(&str),
) -> Result<PointResult, BenchError> {
    spec.rounds()?;
    match backend {
        Backend::Cpu => cpu::run(spec, progress),
        Backend::Gpu(device) => gpu::run(device, spec, progress),
    }
}
