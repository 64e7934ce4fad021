//! fast == per-expert == oracle, bit for bit, on every output, over random configs and routings,
//! a quarter of the multi-rank cases with masked ranks (DeepEP's shrink mode: then the unmasked
//! ranks equal the masked oracle). proptest prints the failing case (config, token counts,
//! routing, mask, seed) and shrinks it.

use ep_reference::workload::{Routing, Workload};
use ep_reference::{oracle, per_expert, CombineFormat, Config, CpuOptions, Mode, Path, RankMask};
use ep_verify::{
    check_against_oracle, check_against_oracle_format, check_against_oracle_masked, logfmt_packable,
};
use proptest::prelude::*;

/// Elements of all ranks' dispatch outputs (E x R*T x H) allowed per case, to bound memory.
const OUTPUT_BUDGET: usize = 60_000_000;
/// Multiply-adds of the oracle's combine (R x T x K x H) allowed per case, to bound time.
const WORK_BUDGET: usize = 8_000_000;

#[derive(Debug, Clone)]
struct Case {
    cfg: Config,
    tokens: Vec<usize>,
    routing: Routing,
    workers: usize,
    seed: u64,
    /// The masked ranks (never all).
    mask: Vec<usize>,
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![
        Just(Mode::Bf16),
        Just(Mode::FP8),
        Just(Mode::FP8_ROUND),
        Just(Mode::FP8_UE8M0)
    ]
}

/// No rank masked in three cases of four; else 1..R-1 distinct ranks.
fn mask_of(r: usize) -> BoxedStrategy<Vec<usize>> {
    if r < 2 {
        return Just(Vec::new()).boxed();
    }
    prop_oneof![
        3 => Just(Vec::new()),
        1 => prop::sample::subsequence((0..r).collect::<Vec<_>>(), 1..r),
    ]
    .boxed()
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![1usize, 2, 3, 4, 8, 16]),
        prop::sample::select(vec![128usize, 256, 7168]),
        1usize..=16,
        mode(),
        any::<u64>(),
        1usize..=3,
    )
        .prop_flat_map(|(r, h, k, mode, seed, workers)| {
            let h = if matches!(mode, Mode::Fp8 { ue8m0: true, .. }) && h % 512 != 0 {
                512
            } else {
                h
            };
            let max_local = 288 / r;
            (Just((r, h, k, mode, seed, workers)), 1usize..=max_local)
        })
        .prop_flat_map(|((r, h, k, mode, seed, workers), l)| {
            let e = r * l;
            let t_mem = OUTPUT_BUDGET / (e * r * h);
            let t_work = WORK_BUDGET / (r * k * h);
            let t_max = t_mem.min(t_work).clamp(1, 512);
            (
                Just((r, h, k, mode, seed, workers, e)),
                1usize..=t_max,
                prop_oneof![
                    6 => (0.0f64..0.5).prop_map(|m| Routing::Random { masked: m }),
                    1 => Just(Routing::OneExpert),
                    1 => (0usize..r).prop_map(|rank| Routing::OneRank { rank }),
                    1 => Just(Routing::EveryRank),
                ],
            )
        })
        .prop_flat_map(|((r, h, k, mode, seed, workers, e), t, routing)| {
            let cfg = Config::new(r, e, t, h, k, mode).expect("generated config is valid");
            (
                prop::collection::vec(
                    prop_oneof![1 => Just(0usize), 1 => Just(t), 3 => 0usize..=t],
                    r,
                ),
                Just((cfg, routing, workers, seed)),
                mask_of(r),
            )
        })
        .prop_map(|(tokens, (cfg, routing, workers, seed), mask)| Case {
            cfg,
            tokens,
            routing,
            workers,
            seed,
            mask,
        })
}

fn run_case(c: &Case) -> Result<(), String> {
    let w = Workload::generate(&c.cfg, &c.tokens, c.routing, c.seed);
    let opts = CpuOptions {
        staging_workers: c.workers,
        ..CpuOptions::default()
    };
    let mask = RankMask::from_ranks(c.cfg.num_ranks, &c.mask).map_err(|e| e.to_string())?;
    let ys = w.expert_outputs(c.seed);
    let mut reference = per_expert::group(&c.cfg, opts).map_err(|e| e.to_string())?;
    check_against_oracle_masked(Path::PerExpert.name(), &mut reference, &w, &ys, &mask)?;
    let mut fast = ep_fast::group(&c.cfg, opts).map_err(|e| e.to_string())?;
    check_against_oracle_masked(Path::Batched.name(), &mut fast, &w, &ys, &mask)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn batched_equals_per_expert_equals_oracle(c in case()) {
        if let Err(msg) = run_case(&c) {
            prop_assert!(false, "{msg}\ncase: {} tokens {:?} routing {:?} workers {} seed {} masked {:?}",
                c.cfg.describe(), c.tokens, c.routing, c.workers, c.seed, c.mask);
        }
    }
}

/// The standard decode setting at 8 ranks, every dispatch mode, both paths.
#[test]
fn standard_setting_all_modes() {
    for mode in [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0] {
        let cfg = Config::new(8, 256, 32, 7168, 8, mode).unwrap();
        let w = Workload::uniform(&cfg, 32, Routing::Random { masked: 0.05 }, 7);
        let mut a = per_expert::group(&cfg, CpuOptions::default()).unwrap();
        check_against_oracle(Path::PerExpert.name(), &mut a, &w, 7).unwrap();
        let mut b = ep_fast::group(&cfg, CpuOptions::default()).unwrap();
        check_against_oracle(Path::Batched.name(), &mut b, &w, 7).unwrap();
    }
}

/// The LogFMT combine (DeepEP's `use_logfmt`): both paths equal the oracle's LogFMT combine bit
/// for bit, with and without masked ranks, on outputs whose groups mostly pack; and it differs
/// from the bf16 combine (the format is really applied), and H not a multiple of 128 is refused.
#[test]
fn logfmt_combine_both_paths_equal_the_oracle() {
    for (r, e, t, h, k, masked) in [
        (8, 64, 16, 7168, 8, vec![]),
        (4, 16, 24, 512, 5, vec![2]),
        (1, 3, 9, 128, 2, vec![]),
    ] {
        let cfg = Config::new(r, e, t, h, k, Mode::FP8).unwrap();
        let w = Workload::uniform(&cfg, t, Routing::Random { masked: 0.1 }, 3);
        let mut ys = w.expert_outputs(4);
        logfmt_packable(&mut ys, h);
        let mask = RankMask::from_ranks(r, &masked).unwrap();
        let f = CombineFormat::LogFmt;
        let mut a = per_expert::group(&cfg, CpuOptions::default()).unwrap();
        check_against_oracle_format(Path::PerExpert.name(), &mut a, &w, &ys, &mask, f).unwrap();
        let mut b = ep_fast::group(&cfg, CpuOptions::default()).unwrap();
        check_against_oracle_format(Path::Batched.name(), &mut b, &w, &ys, &mask, f).unwrap();
        let lf = oracle::combine_with(&cfg, &w.combine_inputs(&ys), f).unwrap();
        let bf = oracle::combine(&cfg, &w.combine_inputs(&ys)).unwrap();
        assert_ne!(lf, bf, "r {r} h {h}: LogFMT changed nothing");
    }
    let cfg = Config::new(2, 4, 4, 200, 2, Mode::Bf16).unwrap();
    let w = Workload::uniform(&cfg, 4, Routing::Random { masked: 0.0 }, 1);
    let ys = w.expert_outputs(1);
    let want = ep_reference::Error::HiddenNotMultiple {
        hidden: 200,
        multiple: 128,
        mode: "logfmt",
    };
    let got = oracle::combine_with(&cfg, &w.combine_inputs(&ys), CombineFormat::LogFmt);
    assert_eq!(got, Err(want.clone()));
    let mut a = per_expert::group(&cfg, CpuOptions::default()).unwrap();
    let handles = dispatch_handles(&mut a, &w);
    let res = ep_verify::combine_all_with(&mut a, &w, &ys, &handles, CombineFormat::LogFmt);
    assert!(res.iter().all(|g| g.as_ref() == Err(&want)), "{res:?}");
}

fn dispatch_handles<R: ep_reference::EpRank>(
    ranks: &mut [R],
    w: &Workload,
) -> Vec<ep_reference::Handle> {
    ep_verify::dispatch_all(ranks, w)
        .into_iter()
        .map(|g| g.unwrap().1)
        .collect()
}

/// Many consecutive calls on the same buffers, each with new inputs, stay equal to the oracle;
/// the same inputs twice give the same bytes.
#[test]
fn consecutive_calls_reuse_buffers() {
    let cfg = Config::new(4, 32, 16, 256, 6, Mode::FP8).unwrap();
    let opts = CpuOptions {
        staging_workers: 3,
        ..CpuOptions::default()
    };
    let mut a = per_expert::group(&cfg, opts).unwrap();
    let mut b = ep_fast::group(&cfg, opts).unwrap();
    for call in 0..60u64 {
        let tokens: Vec<usize> = (0..4)
            .map(|r| ((call as usize * 7 + r * 5) % 17).min(16))
            .collect();
        let w = Workload::generate(&cfg, &tokens, Routing::Random { masked: 0.2 }, call);
        check_against_oracle(Path::PerExpert.name(), &mut a, &w, call).unwrap();
        check_against_oracle(Path::Batched.name(), &mut b, &w, call).unwrap();
    }
    let w = Workload::uniform(&cfg, 16, Routing::Random { masked: 0.1 }, 99);
    let first = ep_verify::dispatch_all(&mut b, &w);
    let second = ep_verify::dispatch_all(&mut b, &w);
    for (x, y) in first.iter().zip(&second) {
        let (x, y) = (&x.as_ref().unwrap().0, &y.as_ref().unwrap().0);
        assert_eq!(x.diff(y), None);
    }
}

/// `dispatch_into` reuses one output across calls: every call still equals the oracle on the
/// meaningful rows, although rows past `recv_count` keep older contents. An output made for
/// another config is refused.
#[test]
fn dispatch_into_reuses_outputs() {
    use ep_reference::rank::run_ranks;
    use ep_reference::{oracle, DispatchOutput, EpRank, Error};

    fn run<R: EpRank>(mut ranks: Vec<R>, cfg: &Config) {
        let mut outs: Vec<DispatchOutput> = (0..cfg.num_ranks)
            .map(|_| DispatchOutput::zeroed(cfg))
            .collect();
        for call in 0..6u64 {
            let tokens: Vec<usize> = (0..cfg.num_ranks)
                .map(|r| (call as usize * 3 + r) % 9)
                .collect();
            let w = Workload::generate(cfg, &tokens, Routing::Random { masked: 0.1 }, call);
            let want = oracle::dispatch(cfg, &w.dispatch_inputs()).unwrap();
            let mut pairs: Vec<(&mut R, &mut DispatchOutput)> =
                ranks.iter_mut().zip(outs.iter_mut()).collect();
            let res = run_ranks(&mut pairs, |(rk, out)| {
                let me = rk.rank();
                rk.dispatch_into(&w.x[me], &w.topk_idx[me], out)
            });
            for (r, res) in res.into_iter().enumerate() {
                res.unwrap();
                assert_eq!(outs[r].diff(&want[r]), None, "call {call} rank {r}");
            }
        }
        let other = Config::new(
            cfg.num_ranks,
            cfg.num_experts,
            cfg.max_tokens_per_rank,
            256,
            cfg.top_k,
            cfg.mode,
        )
        .unwrap();
        let mut wrong = DispatchOutput::zeroed(&other);
        let w = Workload::uniform(cfg, 1, Routing::Random { masked: 0.0 }, 1);
        let e = ranks[0]
            .dispatch_into(&w.x[0], &w.topk_idx[0], &mut wrong)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::ShapeMismatch {
                    tensor: "dispatch output",
                    ..
                }
            ),
            "{e}"
        );
    }
    let cfg = Config::new(3, 12, 8, 128, 4, Mode::FP8_ROUND).unwrap();
    run(
        per_expert::group(&cfg, CpuOptions::default()).unwrap(),
        &cfg,
    );
    run(ep_fast::group(&cfg, CpuOptions::default()).unwrap(), &cfg);
}

/// The mask changes from call to call on the same buffers (set, called, cleaned: the unmask
/// rule holds each time): a rank masked in one call and back in the next never has an earlier
/// call's signal taken for the current one, and every unmasked rank equals the masked oracle.
#[test]
fn masks_that_change_between_calls_reuse_buffers() {
    let cfg = Config::new(4, 16, 8, 128, 4, Mode::FP8).unwrap();
    let opts = CpuOptions {
        staging_workers: 2,
        ..CpuOptions::default()
    };
    let masks: [&[usize]; 8] = [&[], &[1], &[1], &[], &[0, 3], &[2], &[], &[1, 2, 3]];
    let mut a = per_expert::group(&cfg, opts).unwrap();
    let mut b = ep_fast::group(&cfg, opts).unwrap();
    for call in 0..24u64 {
        let m = masks[call as usize % masks.len()];
        let mask = RankMask::from_ranks(4, m).unwrap();
        let tokens: Vec<usize> = (0..4).map(|r| (call as usize * 5 + r * 3) % 9).collect();
        let w = Workload::generate(&cfg, &tokens, Routing::Random { masked: 0.1 }, call);
        let ys = w.expert_outputs(call);
        check_against_oracle_masked(Path::PerExpert.name(), &mut a, &w, &ys, &mask).unwrap();
        check_against_oracle_masked(Path::Batched.name(), &mut b, &w, &ys, &mask).unwrap();
    }
}

/// A combine treats as masked every rank its dispatch did: unmasking between the two (every
/// rank in step) changes nothing for that combine, which equals the masked oracle of its
/// dispatch's mask; the next calls are whole again.
#[test]
fn unmask_between_dispatch_and_combine_keeps_the_dispatch_mask() {
    use ep_reference::oracle;
    use ep_reference::output::combine_diff;
    use ep_reference::EpRank;

    fn run<R: EpRank>(mut ranks: Vec<R>) {
        let cfg = *ranks[0].config();
        let w = Workload::uniform(&cfg, 6, Routing::EveryRank, 20);
        check_against_oracle("first", &mut ranks, &w, 20).unwrap();
        let w = Workload::uniform(&cfg, 6, Routing::EveryRank, 21);
        let ys = w.expert_outputs(21);
        let mask = RankMask::from_ranks(3, &[2]).unwrap();
        ranks[1].update_mask(2, true).unwrap();
        let handles: Vec<_> = ep_verify::dispatch_all(&mut ranks, &w)
            .into_iter()
            .map(|r| r.unwrap().1)
            .collect();
        assert_eq!(handles[0].mask, mask);
        ranks[0].clean_mask().unwrap();
        let got = ep_verify::combine_all(&mut ranks, &w, &ys, &handles);
        let want = oracle::combine_masked(&cfg, &w.combine_inputs(&ys), &mask).unwrap();
        for r in 0..2 {
            let out = got[r].as_ref().unwrap();
            assert_eq!(combine_diff(out, &want[r], cfg.hidden), None, "rank {r}");
        }
        assert!(got[2].is_ok());
        let w = Workload::uniform(&cfg, 6, Routing::EveryRank, 22);
        check_against_oracle("after the unmask", &mut ranks, &w, 22).unwrap();
    }
    let cfg = Config::new(3, 6, 6, 128, 3, Mode::Bf16).unwrap();
    run(per_expert::group(&cfg, CpuOptions::default()).unwrap());
    run(ep_fast::group(&cfg, CpuOptions::default()).unwrap());
}
