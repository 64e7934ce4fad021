//! The numbers themselves, against independent math: what the oracle and both CPU paths compute
//! must lie within the error bounds of the formats, measured in f64 by code written here (not
//! by `ep_reference::numerics`), so that a misreading of the contract shared by the oracle and
//! the paths cannot pass. The bitwise tests (equivalence.rs, differential.rs) check that the
//! paths agree with the oracle; these check that the oracle computes what the formats promise.
//!
//! The bounds, derived from the formats (every constant below says where it comes from):
//!
//! - **FP8 e4m3** (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, largest 448, smallest
//!   normal 2^-6, smallest subnormal 2^-9). The quantized value is `v = x * scale` and the
//!   dequantized one `deq = float(q) * scale_inv`. In a normal binade `[2^e, 2^(e+1))` the step
//!   is `2^(e-3)`, so rounding to nearest errs by at most `2^(e-4) <= 2^-4 |v|`; below `2^-6`
//!   the step is `2^-9` and the error at most `2^-10` (absolute); saturation at 448 errs less
//!   (|v| exceeds 448 only by f32 rounding of the scale). Scaled back by `scale_inv`:
//!   `|deq - x| <= max(2^-4 |x|, 2^-10 * scale_inv)`, exactly, with `round_scale` (power-of-two
//!   scales make `x * scale` and `q * scale_inv` exact). Without it, `scale` and `scale_inv`
//!   are each rounded (3 f32 roundings in their product, one in `x * scale`): the bound gains
//!   `2^-20 |x|` (more than the `5 * 2^-24 |x| (1 + 2^-4)` those roundings can add).
//!   The scale itself: `scale_inv = max(amax, 1e-4) / 448` within 2 f32 roundings (relative
//!   `2^-22` allowed), or with `round_scale` exactly `2^ceil(log2(max(amax, 1e-4) / 448))`, and
//!   with UE8M0 its byte is that exponent plus 127.
//! - **Combine** `out = bf16(acc)`, `acc` an f32 fma chain over the valid slots. Each fma rounds
//!   once, so `|acc - S| <= gamma_n * sum |w y|` with `gamma_n = n u / (1 - n u)`, `u = 2^-24`,
//!   n valid slots (plus `n * 2^-150` for results in f32's subnormal range), where `S` is the
//!   exact sum. bf16 keeps 8 significant bits: rounding errs by at most `2^-8 |acc|` for normal
//!   values and `2^-134` (half the smallest bf16 subnormal) below. `S` is computed here in f64:
//!   each product `w * y` is exact (24 + 8 bits), the sum errs by at most `n * 2^-53 * sum|w y|`,
//!   added to the bound.
//! - **BF16 dispatch** moves bits: every row equals its input row bit for bit (NaN payloads and
//!   signed zeros included).
//!
//! The rows' places are computed here too, from `topk_idx` alone (canonical order: source rank,
//! then token, ascending), and `recv_count`, `layout_range` and `src_info` are checked against them.
//!
//! Dequantization is done in f64, where `float(q) * scale_inv` is exact. In f32 it can overflow:
//! with `round_scale`, a group whose amax is near bf16's largest value gets `scale_inv = 2^120`
//! and a code of 256, and `256 * 2^120 = 2^128` is past f32's range (see
//! `round_scale_dequantizes_past_f32_at_the_top_of_bf16`).
//!
//! Each checker returns, with its verdict, the largest ratio error / bound it met: the
//! `*_bounds_are_tight` tests show the bounds are reached (so they are not vacuous), and the
//! `*_rejects_*` tests feed deliberately wrong outputs to each checker and expect it to fail.

mod bounds;
mod logfmt;

use std::collections::HashMap;

use ep_reference::workload::{Routing, Values, Workload};
use ep_reference::{
    bf16, oracle, per_expert, Config, CpuOptions, DispatchOutput, EpRank, Mode, Path, RecvScales,
    RecvX,
};
use ep_verify::{combine_all, dispatch_all};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use bounds::*;

/// The largest finite bf16, the stand-in for the generator's infinities.
const BF16_MAX_BITS: u16 = 0x7F7F;

/// Makes the generator's values finite and spreads their magnitudes: NaN becomes 0, and a
/// magnitude above `limit` (infinity included) becomes `limit` with its sign; each 128-channel
/// group is then scaled by 2^s, s uniform in [-140, 120] (bf16's subnormals to near its top; a
/// group that would pass `limit` keeps its values), with probability 1/2, or zeroed with
/// probability 1/8; single channels are zeroed with probability 1/32.
fn spread(rows: &mut [bf16], rng: &mut StdRng, limit: bf16) {
    let limit = limit.to_f32();
    let clamp = |v: bf16| -> bf16 {
        if v.is_nan() {
            bf16::ZERO
        } else if v.to_f32().abs() > limit {
            bf16::from_f32(limit.copysign(v.to_f32()))
        } else {
            v
        }
    };
    for v in rows.iter_mut() {
        *v = clamp(*v);
    }
    for group in rows.chunks_mut(128) {
        let pick = rng.random_range(0..8);
        if pick == 0 {
            group.fill(bf16::ZERO);
        } else if pick < 5 {
            let f = 2f32.powi(rng.random_range(-140..=120));
            let scaled: Vec<bf16> = group
                .iter()
                .map(|v| bf16::from_f32(v.to_f32() * f))
                .collect();
            if scaled.iter().all(|v| v.to_f32().abs() <= limit) {
                group.copy_from_slice(&scaled);
            }
        }
        for v in group.iter_mut() {
            if rng.random_ratio(1, 32) {
                *v = bf16::ZERO;
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    cfg: Config,
    tokens: Vec<usize>,
    routing: Routing,
    /// `Values::Special { share }` for the generator (0: its normal values).
    special: f64,
    seed: u64,
}

impl Case {
    /// The workload: the generator's, with `x` spread ([`spread`]) unless the mode is BF16
    /// (whose rows travel as bits, so the generator's NaNs and infinities stay).
    fn workload(&self) -> Workload {
        let values = if self.special > 0.0 {
            Values::Special {
                share: self.special,
            }
        } else {
            Values::Normal
        };
        let mut w =
            Workload::generate_with(&self.cfg, &self.tokens, self.routing, values, self.seed);
        if self.cfg.mode.is_fp8() {
            let mut rng = StdRng::seed_from_u64(self.seed ^ 0x5EED);
            for x in &mut w.x {
                spread(x, &mut rng, bf16::from_bits(BF16_MAX_BITS));
            }
        }
        w
    }

    /// Expert outputs: the generator's, finite, spread like `x` but at most 2^120 in magnitude, so
    /// that no sum of K <= 16 of them weighted by |w| < 1 leaves f32's (or bf16's) range: the
    /// bound holds for sums that do not overflow.
    fn expert_outputs(&self, w: &Workload) -> Vec<Vec<bf16>> {
        let values = if self.special > 0.0 {
            Values::Special {
                share: self.special,
            }
        } else {
            Values::Normal
        };
        let mut ys = w.expert_outputs_with(self.seed, values);
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0xC0DE);
        for y in &mut ys {
            spread(y, &mut rng, bf16::from_f32(2f32.powi(120)));
        }
        ys
    }

    fn describe(&self) -> String {
        format!(
            "{} tokens {:?} routing {:?} special {} seed {}",
            self.cfg.describe(),
            self.tokens,
            self.routing,
            self.special,
            self.seed
        )
    }
}

fn case(modes: Vec<Mode>) -> impl Strategy<Value = Case> {
    (
        1usize..=4,
        1usize..=4,
        1usize..=12,
        prop::sample::select(vec![128usize, 256, 512, 1024]),
        1usize..=8,
        prop::sample::select(modes),
        prop_oneof![Just(0.0f64), 0.0f64..0.3],
        any::<u64>(),
    )
        .prop_flat_map(|(r, l, t, h, k, mode, special, seed)| {
            let h = if matches!(mode, Mode::Fp8 { ue8m0: true, .. }) {
                h.max(512)
            } else {
                h
            };
            let cfg = Config::new(r, r * l, t, h, k, mode).expect("generated config is valid");
            (
                prop::collection::vec(0usize..=t, r),
                prop_oneof![
                    4 => (0.0f64..0.5).prop_map(|m| Routing::Random { masked: m }),
                    1 => Just(Routing::EveryRank),
                    1 => Just(Routing::OneExpert),
                ],
                Just((cfg, special, seed)),
            )
        })
        .prop_map(|(tokens, routing, (cfg, special, seed))| Case {
            cfg,
            tokens,
            routing,
            special,
            seed,
        })
}

/// Every rank's dispatch output from the oracle, the per-expert path and the batched path.
fn dispatch_everywhere(w: &Workload) -> Vec<(&'static str, Vec<DispatchOutput>)> {
    fn run<R: EpRank>(
        ranks: Result<Vec<R>, ep_reference::Error>,
        w: &Workload,
    ) -> Vec<DispatchOutput> {
        let mut ranks = ranks.expect("group");
        dispatch_all(&mut ranks, w)
            .into_iter()
            .map(|o| o.expect("dispatch").0)
            .collect()
    }
    let cfg = &w.config;
    vec![
        (
            "oracle",
            oracle::dispatch(cfg, &w.dispatch_inputs()).expect("oracle dispatch"),
        ),
        (
            Path::PerExpert.name(),
            run(per_expert::group(cfg, CpuOptions::default()), w),
        ),
        (
            Path::Batched.name(),
            run(ep_fast::group(cfg, CpuOptions::default()), w),
        ),
    ]
}

/// Every rank's combine output from the oracle and both paths (each after its own dispatch).
fn combine_everywhere(w: &Workload, ys: &[Vec<bf16>]) -> Vec<(&'static str, Vec<Vec<bf16>>)> {
    fn run<R: EpRank>(
        ranks: Result<Vec<R>, ep_reference::Error>,
        w: &Workload,
        ys: &[Vec<bf16>],
    ) -> Vec<Vec<bf16>> {
        let mut ranks = ranks.expect("group");
        let handles: Vec<_> = dispatch_all(&mut ranks, w)
            .into_iter()
            .map(|o| o.expect("dispatch").1)
            .collect();
        combine_all(&mut ranks, w, ys, &handles)
            .into_iter()
            .map(|o| o.expect("combine"))
            .collect()
    }
    let cfg = &w.config;
    vec![
        (
            "oracle",
            oracle::combine(cfg, &w.combine_inputs(ys)).expect("oracle combine"),
        ),
        (
            Path::PerExpert.name(),
            run(per_expert::group(cfg, CpuOptions::default()), w, ys),
        ),
        (
            Path::Batched.name(),
            run(ep_fast::group(cfg, CpuOptions::default()), w, ys),
        ),
    ]
}

fn fp8_case(c: &Case) -> Result<f64, String> {
    let w = c.workload();
    let mut worst = 0.0f64;
    for (name, outs) in dispatch_everywhere(&w) {
        for (d, out) in outs.iter().enumerate() {
            worst = worst.max(check_fp8(&w, d, out).map_err(|e| format!("{name}: {e}"))?);
        }
    }
    Ok(worst)
}

fn bf16_case(c: &Case) -> Result<(), String> {
    let w = c.workload();
    for (name, outs) in dispatch_everywhere(&w) {
        for (d, out) in outs.iter().enumerate() {
            check_bf16(&w, d, out).map_err(|e| format!("{name}: {e}"))?;
        }
    }
    Ok(())
}

fn combine_case(c: &Case) -> Result<f64, String> {
    let w = c.workload();
    let ys = c.expert_outputs(&w);
    let mut worst = 0.0f64;
    for (name, outs) in combine_everywhere(&w, &ys) {
        worst = worst.max(check_combine(&w, &ys, &outs).map_err(|e| format!("{name}: {e}"))?);
    }
    Ok(worst)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// FP8 dispatch (every scale mode): each dequantized value within e4m3's bound of its input,
    /// each scale as amax asks, on the oracle and both paths.
    #[test]
    fn fp8_dispatch_within_e4m3_bound(c in case(vec![Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0])) {
        if let Err(msg) = fp8_case(&c) {
            prop_assert!(false, "{msg}\ncase: {}", c.describe());
        }
    }

    /// BF16 dispatch: every row is its input row, bit for bit, on the oracle and both paths.
    #[test]
    fn bf16_dispatch_is_bit_identical(c in case(vec![Mode::Bf16])) {
        if let Err(msg) = bf16_case(&c) {
            prop_assert!(false, "{msg}\ncase: {}", c.describe());
        }
    }

    /// Combine: each output within bf16's bound of the f64 weighted sum, on the oracle and both
    /// paths (the dispatch mode does not matter to combine; both kinds are run).
    #[test]
    fn combine_within_bf16_bound(c in case(vec![Mode::Bf16, Mode::FP8])) {
        if let Err(msg) = combine_case(&c) {
            prop_assert!(false, "{msg}\ncase: {}", c.describe());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The bounds are reached, and the checkers reject wrong outputs.

fn fixed_case(mode: Mode, seed: u64) -> Case {
    let h = if matches!(mode, Mode::Fp8 { ue8m0: true, .. }) {
        512
    } else {
        256
    };
    Case {
        cfg: Config::new(2, 4, 16, h, 3, mode).unwrap(),
        tokens: vec![16, 11],
        routing: Routing::Random { masked: 0.1 },
        special: 0.05,
        seed,
    }
}

/// With power-of-two scales the e4m3 bound is exact, and values close to it occur: the largest
/// error / bound over a few thousand values passes 0.9 (a bound twice too loose would not).
#[test]
fn fp8_bounds_are_tight() {
    for mode in [Mode::FP8_ROUND, Mode::FP8] {
        let worst = fp8_case(&fixed_case(mode, 3)).unwrap();
        assert!(
            worst > 0.9 && worst <= 1.0,
            "{}: worst ratio {worst}",
            mode.name()
        );
    }
}

/// bf16 rounding reaches close to its half step of 2^-8 relative.
#[test]
fn combine_bounds_are_tight() {
    let worst = combine_case(&fixed_case(Mode::Bf16, 5)).unwrap();
    assert!(worst > 0.8 && worst <= 1.0, "worst ratio {worst}");
}

/// The oracle's dispatch of a fixed FP8 case, and its workload.
fn fp8_oracle(mode: Mode) -> (Workload, Vec<DispatchOutput>) {
    let w = fixed_case(mode, 11).workload();
    let outs = oracle::dispatch(&w.config, &w.dispatch_inputs()).unwrap();
    for (d, out) in outs.iter().enumerate() {
        check_fp8(&w, d, out).unwrap();
    }
    (w, outs)
}

/// Applies `f` to rank 0's meaningful rows and expects `check_fp8` to fail.
fn expect_fp8_rejected(mode: Mode, what: &str, f: impl Fn(&mut DispatchOutput, usize)) {
    let (w, mut outs) = fp8_oracle(mode);
    let rows: usize = outs[0].recv_count.iter().map(|&c| c as usize).sum();
    assert!(rows > 0);
    for l in 0..w.config.num_local_experts() {
        for i in 0..outs[0].recv_count[l] as usize {
            f(&mut outs[0], l * w.config.rows_per_expert() + i);
        }
    }
    let r = check_fp8(&w, 0, &outs[0]);
    assert!(r.is_err(), "{} ({what}) passed the check", mode.name());
    println!("{} ({what}) rejected: {}", mode.name(), r.unwrap_err());
}

#[test]
fn fp8_check_rejects_wrong_scales() {
    // A scale off by 2^-20 (the bound on the scale is 2^-22).
    expect_fp8_rejected(Mode::FP8, "scale_inv * (1 + 2^-20)", |o, idx| {
        if let Some(RecvScales::F32(v)) = &mut o.recv_scales {
            for s in &mut v[idx * 2..idx * 2 + 2] {
                *s *= 1.0 + 2f32.powi(-20);
            }
        }
    });
    // A power-of-two scale one step too large (values stay within the e4m3 bound of the
    // scaled inputs, but the scale is not the one amax asks for).
    expect_fp8_rejected(Mode::FP8_ROUND, "scale_inv * 2", |o, idx| {
        if let Some(RecvScales::F32(v)) = &mut o.recv_scales {
            for s in &mut v[idx * 2..idx * 2 + 2] {
                *s *= 2.0;
            }
        }
    });
    // A UE8M0 byte one too small.
    expect_fp8_rejected(Mode::FP8_UE8M0, "UE8M0 byte - 1", |o, idx| {
        if let Some(RecvScales::Ue8m0(v)) = &mut o.recv_scales {
            let mut b = v[idx].to_le_bytes();
            b[1] = b[1].wrapping_sub(1);
            v[idx] = i32::from_le_bytes(b);
        }
    });
}

#[test]
fn fp8_check_rejects_wrong_codes() {
    // Each row's largest code (which maps amax onto 448) two steps lower: an error of at
    // least 1.5 steps, past the half step e4m3 allows.
    for mode in [Mode::FP8, Mode::FP8_ROUND] {
        expect_fp8_rejected(mode, "largest code - 2", |o, idx| {
            let h = o.config.hidden;
            if let RecvX::Fp8(v) = &mut o.recv_x {
                let row = &mut v[idx * h..(idx + 1) * h];
                let (c, _) = row
                    .iter()
                    .enumerate()
                    .max_by_key(|(_, q)| *q & 0x7F)
                    .unwrap();
                if row[c] & 0x7F >= 2 {
                    row[c] -= 2;
                }
            }
        });
    }
    // Truncation instead of rounding to nearest: each nonzero code one step toward zero
    // where the input lay past the half step.
    expect_fp8_rejected(Mode::FP8_ROUND, "codes one step toward zero", |o, idx| {
        let h = o.config.hidden;
        if let RecvX::Fp8(v) = &mut o.recv_x {
            for q in &mut v[idx * h..(idx + 1) * h] {
                if *q & 0x7F != 0 {
                    *q -= 1;
                }
            }
        }
    });
}

#[test]
fn bf16_check_rejects_a_changed_bit() {
    let w = fixed_case(Mode::Bf16, 13).workload();
    let mut outs = oracle::dispatch(&w.config, &w.dispatch_inputs()).unwrap();
    check_bf16(&w, 0, &outs[0]).unwrap();
    // The lowest mantissa bit of one channel of the last meaningful row.
    let l = (0..w.config.num_local_experts())
        .find(|&l| outs[0].recv_count[l] > 0)
        .unwrap();
    let idx = l * w.config.rows_per_expert() + outs[0].recv_count[l] as usize - 1;
    if let RecvX::Bf16(v) = &mut outs[0].recv_x {
        let c = &mut v[idx * w.config.hidden + 77];
        *c = bf16::from_bits(c.to_bits() ^ 1);
    }
    let r = check_bf16(&w, 0, &outs[0]);
    assert!(r.is_err(), "a flipped bit passed");
    // A row in the wrong place: the layout check.
    let mut outs = oracle::dispatch(&w.config, &w.dispatch_inputs()).unwrap();
    outs[0].src_info[idx] += 1;
    assert!(
        check_bf16(&w, 0, &outs[0]).is_err(),
        "a wrong src_info passed"
    );
}

#[test]
fn combine_check_rejects_wrong_sums() {
    let c = fixed_case(Mode::Bf16, 17);
    let w = c.workload();
    let ys = c.expert_outputs(&w);
    let good = oracle::combine(&w.config, &w.combine_inputs(&ys)).unwrap();
    check_combine(&w, &ys, &good).unwrap();
    let mutate = |f: &dyn Fn(bf16) -> bf16| -> Vec<Vec<bf16>> {
        good.iter()
            .map(|o| o.iter().map(|&v| f(v)).collect())
            .collect()
    };
    // Two bf16 steps away from the rounded sum: past half a step.
    let two_steps = mutate(&|v| {
        if v.to_bits() & 0x7FFF != 0 && v.is_finite() {
            bf16::from_bits(v.to_bits() + 2)
        } else {
            v
        }
    });
    assert!(check_combine(&w, &ys, &two_steps).is_err());
    // Truncated instead of rounded to nearest (the f32 accumulator cut to bf16): from the
    // oracle's inputs, each sum recomputed and its low 16 bits dropped.
    let cfg = &w.config;
    let mut truncated = good.clone();
    let want_f32 = {
        // The contract's fma chain, kept in f32 (from the same slots the oracle uses).
        let (w, ys) = (&w, &ys);
        let l_n = cfg.num_local_experts();
        let places: Vec<HashMap<(usize, usize), usize>> = (0..cfg.num_experts)
            .map(|e| {
                expected_rows(w, e / l_n, e % l_n)
                    .into_iter()
                    .enumerate()
                    .map(|(i, st)| (st, i))
                    .collect()
            })
            .collect();
        move |s: usize, t: usize, ch: usize| -> f32 {
            let (k, h, per) = (cfg.top_k, cfg.hidden, cfg.rows_per_expert());
            let mut acc = 0.0f32;
            for slot in 0..k {
                let e = w.topk_idx[s][t * k + slot];
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let row = (e % l_n) * per + places[e][&(s, t)];
                acc = w.topk_weights[s][t * k + slot]
                    .mul_add(ys[e / l_n][row * h + ch].to_f32(), acc);
            }
            acc
        }
    };
    for (s, out) in truncated.iter_mut().enumerate() {
        for (i, v) in out.iter_mut().enumerate() {
            let acc = want_f32(s, i / cfg.hidden, i % cfg.hidden);
            *v = bf16::from_bits((acc.to_bits() >> 16) as u16);
        }
    }
    assert!(check_combine(&w, &ys, &truncated).is_err());
    // One weight's sign lost (|w| instead of w) in every sum.
    let mut w_abs = w.clone();
    for ws in &mut w_abs.topk_weights {
        for x in ws.iter_mut() {
            *x = x.abs();
        }
    }
    let abs_outs = oracle::combine(cfg, &w_abs.combine_inputs(&ys)).unwrap();
    assert!(check_combine(&w, &ys, &abs_outs).is_err());
}

/// With `round_scale`, a group at the top of bf16 gets scale_inv 2^120 and its largest value
/// rounds up to the code for 256: `float(q) * scale_inv` is 2^128, past f32's largest value, so a
/// consumer that dequantizes in f32 gets infinity there (in f64, or as a fused multiply into a
/// wider accumulator, the value is within bound). A property of the contract, not of a path.
#[test]
fn round_scale_dequantizes_past_f32_at_the_top_of_bf16() {
    let cfg = Config::new(1, 1, 1, 128, 1, Mode::FP8_ROUND).unwrap();
    let mut w = Workload::uniform(&cfg, 1, Routing::OneExpert, 1);
    w.x[0].fill(bf16::ZERO);
    w.x[0][0] = bf16::from_bits(BF16_MAX_BITS); // 1.9921875 * 2^127
    let out = &oracle::dispatch(&cfg, &w.dispatch_inputs()).unwrap()[0];
    let (RecvX::Fp8(q), Some(RecvScales::F32(s))) = (&out.recv_x, &out.recv_scales) else {
        unreachable!()
    };
    assert_eq!(s[0], 2f32.powi(120));
    assert_eq!(e4m3_value(q[0]), Some(256.0));
    assert!((256.0f32 * s[0]).is_infinite());
    check_fp8(&w, 0, out).unwrap();
}
