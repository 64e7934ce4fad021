//! The differential run (`ep_verify::differential`): `EP_DIFF_CASES` random small configs
//! (3,000 by default: CI), both CPU paths bitwise against the oracle, about a quarter of the
//! multi-rank cases with masked ranks (against the masked oracle on the unmasked ranks).
//!
//! - `EP_DIFF_CASES=100000` runs the deep version (a night).
//! - `EP_DIFF_BASE=<n>` shifts the seeds (case i has seed n + i; default 0).
//! - `EP_DIFF_SEED=<n>` replays exactly the case of seed n, as a failure prints it:
//!   `EP_DIFF_SEED=<n> cargo test --release -p ep-verify --test differential`.
//!
//! It prints how many cases ran, of which kinds, and how long they took.

use std::io::Write;
use std::time::Instant;

use ep_reference::workload::{Routing, Values};
use ep_verify::differential::Case;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number: {e}")),
    )
}

/// Goes around the test harness's capture, so that CI's log shows the counts on success too.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

#[test]
fn differential_random_configs() {
    if let Some(seed) = env_u64("EP_DIFF_SEED") {
        let c = Case::from_seed(seed);
        say(&format!("differential: replaying {}", c.describe()));
        if let Err(msg) = c.run() {
            panic!("{}\n{msg}", c.describe());
        }
        say("differential: the case passes");
        return;
    }
    let n = env_u64("EP_DIFF_CASES").unwrap_or(3000);
    let base = env_u64("EP_DIFF_BASE").unwrap_or(0);
    let t0 = Instant::now();
    let (mut modes, mut special, mut empty, mut skewed, mut masked) = ([0u64; 4], 0, 0, 0, 0);
    let (mut masked_ranks, mut logfmt) = (0u64, 0u64);
    let mut failures = Vec::new();
    let mut ran = 0u64;
    for i in 0..n {
        ran += 1;
        let c = Case::from_seed(base.wrapping_add(i));
        modes[ep_verify::differential::MODES
            .iter()
            .position(|m| *m == c.cfg.mode)
            .expect("one of the four modes")] += 1;
        special += matches!(c.values, Values::Special { .. }) as u64;
        empty += c.tokens.contains(&0) as u64;
        skewed += matches!(c.routing, Routing::Skewed { .. }) as u64;
        masked += matches!(
            c.routing,
            Routing::Random { masked } | Routing::Skewed { masked, .. } if masked > 0.0
        ) as u64;
        masked_ranks += u64::from(!c.mask.is_empty());
        logfmt += u64::from(c.format == ep_reference::CombineFormat::LogFmt);
        if let Err(msg) = c.run() {
            say(&format!(
                "differential: FAILED {}\n  {msg}\n  replay: EP_DIFF_SEED={} cargo test --release -p ep-verify --test differential",
                c.describe(),
                c.seed
            ));
            failures.push(c.seed);
            if failures.len() >= 5 {
                break;
            }
        }
    }
    say(&format!(
        "differential: {ran} cases (seeds {base}..{}) in {:.1} s: modes bf16/fp8/fp8+round/fp8+ue8m0 {modes:?}, \
         special values {special}, an empty rank {empty}, skewed {skewed}, masked slots {masked}, \
         masked ranks {masked_ranks}, logfmt combine {logfmt}",
        base.wrapping_add(ran),
        t0.elapsed().as_secs_f64()
    ));
    assert!(
        n < 100 || logfmt > 0,
        "differential: no LogFMT combine among {ran} cases"
    );
    assert!(
        failures.is_empty(),
        "differential: cases failed, seeds {failures:?} (replay each with EP_DIFF_SEED=<seed>)"
    );
}
