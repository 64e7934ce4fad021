//! The one runner of ep-dispatch's GPU test binaries (`harness = false`): ep-kernels' `gpu`,
//! `gpu_fuzz` and `gpu_soak`, ep-group's `gpu_process`. A dev-only crate (`publish = false`), a
//! dev-dependency of the crates whose tests use it.
//!
//! A test that cannot run here is printed as `SKIPPED: <test>: <why>` and counted as skipped,
//! never as passed; a panic counts as a failure; a test that ran out of its time budget counts as
//! incomplete, never as passed. The summary line (`<label>: N passed; N failed; N skipped; N
//! incomplete`) is what `.ci/run` sums, and the process exits 1 on a failure, 2 on an incomplete
//! run, else 0. Arguments: an optional name filter; cargo's flags (`--nocapture`,
//! `--test-threads=N`, ...) are accepted and ignored.
//!
//! A test declares itself and what it needs beside its code: each test module of a binary keeps
//! a `TESTS` table of [`GpuTest`]s, one [`gpu_test!`] per test function, which takes the test's
//! name from the function's (so a name cannot drift from its function, and a function left out
//! of its table is dead code, which the compiler reports) and states its [`Needs`] (GPUs,
//! NCCL). The binary's `main` hands the tables to [`Runner::run_all`], in the order it runs them.
//!
//! ```
//! use ep_test_runner::{gpu_test, GpuTest, Needs};
//!
//! pub(crate) const TESTS: &[GpuTest] = &[
//!     gpu_test!(gpu_two_gpus_r2_equal_oracle, gpus: 2),
//!     gpu_test!(gpu_nccl_r1_self_send_equal_oracle, gpus: 1, nccl),
//! ];
//!
//! fn gpu_two_gpus_r2_equal_oracle() { /* ... */ }
//! fn gpu_nccl_r1_self_send_equal_oracle() { /* ... */ }
//!
//! assert_eq!(TESTS[1].name, "gpu_nccl_r1_self_send_equal_oracle");
//! assert_eq!(TESTS[1].needs, Needs { gpus: 1, nccl: true });
//! // and in the binary's main: runner.run_all(&[TESTS, other_module::TESTS]);
//! ```

use std::panic::UnwindSafe;
use std::time::Instant;

/// What a test needs of the machine: where [`Needs::probe`] finds less, the test is skipped with
/// the reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// CUDA devices (with the driver and NVRTC); 0: none.
    pub gpus: usize,
    /// NCCL (libnccl.so.2).
    pub nccl: bool,
}

impl Needs {
    /// `Ok` where this machine has what is needed, else the reason it cannot run (the first
    /// thing missing: the CUDA driver, NVRTC, devices, NCCL).
    pub fn probe(self) -> Result<(), String> {
        if self.gpus > 0 {
            ep_kernels::runtime::probe_devices(self.gpus)?;
        }
        if self.nccl && !ep_kernels::runtime::nccl::nccl_present() {
            return Err("no NCCL (libnccl.so.2 not found)".to_string());
        }
        Ok(())
    }
}

/// One declared test: its name, what it needs, its code (a panic is a failure). Written with
/// [`gpu_test!`], which takes the name from the function.
#[derive(Clone, Copy, Debug)]
pub struct GpuTest {
    /// The test's name: what the filter matches and the output prints.
    pub name: &'static str,
    /// What it needs to run here.
    pub needs: Needs,
    /// The test; it passes when it returns.
    pub run: fn(),
}

/// The [`GpuTest`] of the test function `f` (a `fn()` in scope), named after it, with what it
/// needs:
///
/// - `gpu_test!(f, gpus: N)`: N CUDA devices;
/// - `gpu_test!(f, gpus: N, nccl)`: N CUDA devices and NCCL;
/// - `gpu_test!(f, needs: expr)`: the [`Needs`] `expr`.
#[macro_export]
macro_rules! gpu_test {
    ($test:ident, gpus: $gpus:expr, nccl $(,)?) => {
        $crate::gpu_test!($test, needs: $crate::Needs { gpus: $gpus, nccl: true })
    };
    ($test:ident, gpus: $gpus:expr $(,)?) => {
        $crate::gpu_test!($test, needs: $crate::Needs { gpus: $gpus, nccl: false })
    };
    ($test:ident, needs: $needs:expr $(,)?) => {
        $crate::GpuTest {
            name: stringify!($test),
            needs: $needs,
            run: $test,
        }
    };
}

/// How a test that ran ended.
pub enum Verdict {
    /// Passed; the note (may be empty) is printed after "ok".
    Ok(String),
    /// Stopped by its own time budget: what ran passed, but not all of it ran.
    Incomplete,
    /// Failed, with what went wrong (a panic prints its own message first).
    Failed(String),
}

pub struct Runner {
    label: &'static str,
    filter: Option<String>,
    passed: usize,
    failed: usize,
    skipped: usize,
    incomplete: usize,
}

impl Runner {
    /// `label` starts the summary line (e.g. "gpu tests").
    pub fn new(label: &'static str) -> Runner {
        Runner {
            label,
            filter: std::env::args().skip(1).find(|a| !a.starts_with('-')),
            passed: 0,
            failed: 0,
            skipped: 0,
            incomplete: 0,
        }
    }

    /// Whether the name filter (if any) selects `name`.
    pub fn wanted(&self, name: &str) -> bool {
        self.filter.as_deref().is_none_or(|f| name.contains(f))
    }

    /// Runs `test` if the filter selects it and `probe` says it can run here.
    pub fn run(
        &mut self,
        name: &str,
        probe: Result<(), String>,
        test: impl FnOnce() -> Verdict + UnwindSafe,
    ) {
        if !self.wanted(name) {
            return;
        }
        if let Err(why) = probe {
            println!("SKIPPED: {name}: {why}");
            self.skipped += 1;
            return;
        }
        println!("test {name} ...");
        let t0 = Instant::now();
        let secs = || t0.elapsed().as_secs_f64();
        match std::panic::catch_unwind(test) {
            Ok(Verdict::Ok(note)) if note.is_empty() => {
                println!("test {name} ... ok ({:.1} s)", secs());
                self.passed += 1;
            }
            Ok(Verdict::Ok(note)) => {
                println!("test {name} ... ok ({note}; {:.1} s)", secs());
                self.passed += 1;
            }
            Ok(Verdict::Incomplete) => {
                println!("test {name} ... INCOMPLETE (time budget; {:.1} s)", secs());
                self.incomplete += 1;
            }
            Ok(Verdict::Failed(why)) => {
                println!("test {name} ... FAILED: {why}");
                self.failed += 1;
            }
            Err(_) => {
                println!("test {name} ... FAILED (panicked)");
                self.failed += 1;
            }
        }
    }

    /// Runs each declared test of each table in order: those the filter selects and whose
    /// [`Needs`] this machine meets; the others it selects are skipped with the reason.
    pub fn run_all(&mut self, tables: &[&[GpuTest]]) {
        for test in tables.iter().copied().flatten() {
            if !self.wanted(test.name) {
                continue;
            }
            let run = test.run;
            self.run(test.name, test.needs.probe(), move || {
                run();
                Verdict::Ok(String::new())
            });
        }
    }

    /// Prints the summary line and exits with the status above.
    pub fn finish(self) -> ! {
        let Runner {
            label,
            passed,
            failed,
            skipped,
            incomplete,
            ..
        } = self;
        println!(
            "{label}: {passed} passed; {failed} failed; {skipped} skipped; {incomplete} incomplete"
        );
        std::process::exit(if failed > 0 {
            1
        } else if incomplete > 0 {
            2
        } else {
            0
        })
    }
}

/// A number from the environment variable `var`: `None` where it is unset, an error naming the
/// variable and its value where it does not parse.
pub fn env_num<T: std::str::FromStr>(var: &str) -> Result<Option<T>, String> {
    match std::env::var(var) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(format!("{var}: {e}")),
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("{var}={v:?}: not a valid number")),
    }
}
