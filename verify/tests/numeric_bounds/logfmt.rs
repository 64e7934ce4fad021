//! The LogFMT combine against the bf16 combine, on realistic inputs (expert outputs normal with
//! sigma 0.1, DeepEP's benchmark values; positive weights), with the bound of docs/contract.md
//! "4.1 LogFMT" derived here in f64:
//!
//! - each packed value errs by at most `|y| r + amax 2^-33` with `r = (2^(32/510 + 2^-16) - 1)/2
//!   + 2^-21` (the widest grid's half step, relative; below the grid, half its first point,
//!   at most `amax 2^-32 / 2`); a raw value does not err;
//! - the two fma chains then differ by at most `sum_k |w_k| e_k` plus each chain's rounding
//!   (`gamma_n sum |w y|`, counted twice) and the two bf16 roundings (`2^-8` of each output).
//!
//! Checked with `approx::abs_diff_eq!` channel by channel, and the relative L2 difference over
//! all tokens, which the test prints, must stay below 1%.

use approx::abs_diff_eq;
use ep_reference::oracle;
use ep_reference::workload::{Routing, Workload};
use ep_reference::{bf16, CombineFormat, Config, Mode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn normal(rng: &mut StdRng) -> f64 {
    let (u, v): (f64, f64) = (rng.random_range(1e-12..1.0), rng.random_range(0.0..1.0));
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

#[test]
fn logfmt_combine_stays_within_its_bound_of_the_bf16_combine() {
    let cfg = Config::new(4, 32, 32, 1024, 8, Mode::FP8).unwrap();
    let w = Workload::uniform(&cfg, 32, Routing::Random { masked: 0.05 }, 5);
    let mut rng = StdRng::seed_from_u64(17);
    let len = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
    let ys: Vec<Vec<bf16>> = (0..cfg.num_ranks)
        .map(|_| {
            (0..len)
                .map(|_| bf16::from_f64(0.1 * normal(&mut rng)))
                .collect()
        })
        .collect();
    let inputs = w.combine_inputs(&ys);
    let lf = oracle::combine_with(&cfg, &inputs, CombineFormat::LogFmt).unwrap();
    let bf = oracle::combine(&cfg, &inputs).unwrap();
    let r = ((32.0f64 / 510.0 + 2f64.powi(-16)).exp2() - 1.0) / 2.0 + 2f64.powi(-21);
    let (h, k) = (cfg.hidden, cfg.top_k);
    let gamma = |n: usize| n as f64 * 2f64.powi(-24) / (1.0 - n as f64 * 2f64.powi(-24));
    let (mut num, mut den, mut packed_rows) = (0f64, 0f64, 0usize);
    // The bound takes |y| <= 0.6 (6 sigma) and the largest |y| of all rows for amax.
    for s in 0..cfg.num_ranks {
        let idx = &w.topk_idx[s];
        let wts = &w.topk_weights[s];
        let amax_all = ys
            .iter()
            .flatten()
            .map(|v| v.to_f64().abs())
            .fold(0.0, f64::max);
        for t in 0..idx.len() / k {
            let slots: Vec<usize> = (0..k).filter(|&j| idx[t * k + j] >= 0).collect();
            let wsum: f64 = slots.iter().map(|&j| wts[t * k + j].abs() as f64).sum();
            packed_rows += slots.len();
            for c in 0..h {
                let (a, b) = (lf[s][t * h + c].to_f64(), bf[s][t * h + c].to_f64());
                let ey = 0.6 * r + amax_all * 2f64.powi(-33);
                let chain = 2.0 * gamma(slots.len()) * wsum * 0.6;
                let bound =
                    wsum * ey + chain + 2f64.powi(-8) * (a.abs() + b.abs()) + 2f64.powi(-133);
                assert!(
                    abs_diff_eq!(a, b, epsilon = bound),
                    "rank {s} token {t} channel {c}: logfmt {a} bf16 {b} bound {bound}"
                );
                num += (a - b) * (a - b);
                den += b * b;
            }
        }
    }
    assert!(packed_rows > 0);
    let rel = (num / den).sqrt();
    eprintln!("logfmt vs bf16 combine: relative L2 difference {rel:.3e}");
    assert!(rel < 0.01, "relative L2 difference {rel}");
    assert!(rel > 0.0, "LogFMT changed nothing: the rows did not pack");
}
