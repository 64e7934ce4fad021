//! Every bad input of docs/contract.md gets its own typed error, on both paths, before anything moves;
//! a rank that never shows up makes the others fail with a timeout that names it, not hang, or
//! in shrink mode gets masked by them, who go on without it.

use std::time::{Duration, Instant};

use ep_reference::error::{Op, Phase, Side};
use ep_reference::rank::run_ranks;
use ep_reference::workload::{Routing, Workload};
use ep_reference::{
    bf16, oracle, per_expert, Config, CpuOptions, EpRank, Error, Mode, Path, RankMask,
};

fn cfg() -> Config {
    Config::new(2, 8, 4, 128, 2, Mode::FP8).unwrap()
}

#[test]
fn config_errors_have_their_variants() {
    assert_eq!(
        Config::new(3, 8, 4, 128, 2, Mode::Bf16),
        Err(Error::ExpertsNotDivisible {
            experts: 8,
            ranks: 3
        })
    );
    assert_eq!(
        Config::new(2, 8, 4, 200, 2, Mode::FP8),
        Err(Error::HiddenNotMultiple {
            hidden: 200,
            multiple: 128,
            mode: "fp8"
        })
    );
    assert_eq!(
        Config::new(2, 8, 4, 384, 2, Mode::FP8_UE8M0),
        Err(Error::HiddenNotMultiple {
            hidden: 384,
            multiple: 512,
            mode: "fp8-ue8m0"
        })
    );
    assert_eq!(
        Config::new(2, 8, 4, 128, 0, Mode::Bf16),
        Err(Error::TopKOutOfRange { top_k: 0 })
    );
    assert_eq!(
        Config::new(2, 8, 4, 128, 17, Mode::Bf16),
        Err(Error::TopKOutOfRange { top_k: 17 })
    );
    assert_eq!(
        Config::new(
            2,
            8,
            4,
            128,
            2,
            Mode::Fp8 {
                round_scale: false,
                ue8m0: true
            }
        ),
        Err(Error::Ue8m0WithoutRoundScale)
    );
    assert_eq!(
        Config::new(0, 8, 4, 128, 2, Mode::Bf16),
        Err(Error::ZeroSize { what: "num_ranks" })
    );
    // A BF16 config has no hidden-size rule beyond being non-zero.
    assert!(Config::new(2, 8, 4, 200, 2, Mode::Bf16).is_ok());
}

/// Runs `f` on one rank of each path and returns both errors.
fn both<F>(f: F) -> Vec<Error>
where
    F: Fn(&mut dyn EpRank) -> Result<(), Error>,
{
    let c = cfg();
    let mut a = per_expert::group(&c, CpuOptions::default()).unwrap();
    let mut b = ep_fast::group(&c, CpuOptions::default()).unwrap();
    vec![f(&mut a[0]).unwrap_err(), f(&mut b[0]).unwrap_err()]
}

fn x(n: usize) -> Vec<bf16> {
    vec![bf16::from_f32(1.0); n * 128]
}

#[test]
fn dispatch_input_errors_name_the_values() {
    for e in both(|r| r.dispatch(&x(5), &[0; 10]).map(|_| ())) {
        assert_eq!(
            e,
            Error::TooManyTokens {
                rank: 0,
                tokens: 5,
                max: 4
            }
        );
    }
    for e in both(|r| r.dispatch(&x(1), &[0, 8]).map(|_| ())) {
        assert_eq!(
            e,
            Error::ExpertOutOfRange {
                rank: 0,
                token: 0,
                slot: 1,
                expert: 8,
                num_experts: 8
            }
        );
    }
    for e in both(|r| r.dispatch(&x(2), &[0, 1, -2, 3]).map(|_| ())) {
        assert_eq!(
            e,
            Error::ExpertOutOfRange {
                rank: 0,
                token: 1,
                slot: 0,
                expert: -2,
                num_experts: 8
            }
        );
    }
    for e in both(|r| r.dispatch(&x(2), &[0, 1, 5, 5]).map(|_| ())) {
        assert_eq!(
            e,
            Error::DuplicateExpert {
                rank: 0,
                token: 1,
                expert: 5,
                first_slot: 0,
                second_slot: 1
            }
        );
    }
    for e in both(|r| r.dispatch(&x(1), &[0, 1, 2]).map(|_| ())) {
        assert!(
            matches!(
                e,
                Error::ShapeMismatch {
                    tensor: "topk_idx",
                    got: 3,
                    ..
                }
            ),
            "{e}"
        );
    }
    for e in both(|r| r.dispatch(&x(3), &[0, 1, 2, 3]).map(|_| ())) {
        assert!(
            matches!(
                e,
                Error::ShapeMismatch {
                    tensor: "x",
                    expected: 256,
                    got: 384,
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn combine_input_errors_and_foreign_handles() {
    let c = cfg();
    let w = Workload::uniform(&c, 3, Routing::Random { masked: 0.0 }, 1);
    let ys = w.expert_outputs(1);
    let other = Config::new(2, 8, 4, 256, 2, Mode::FP8).unwrap();
    let wo = Workload::uniform(&other, 3, Routing::Random { masked: 0.0 }, 1);

    fn check<R: EpRank>(
        ranks: &mut [R],
        foreign: &mut [impl EpRank],
        w: &Workload,
        wo: &Workload,
        ys: &[Vec<bf16>],
    ) {
        let handles: Vec<_> = ep_verify::dispatch_all(ranks, w)
            .into_iter()
            .map(|r| r.unwrap().1)
            .collect();
        let foreign_handles: Vec<_> = ep_verify::dispatch_all(foreign, wo)
            .into_iter()
            .map(|r| r.unwrap().1)
            .collect();
        let r0 = &mut ranks[0];
        // Wrong y shape.
        let e = r0
            .combine(&ys[0][1..], &w.topk_idx[0], &w.topk_weights[0], &handles[0])
            .unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { tensor: "y", .. }), "{e}");
        // Wrong weights shape.
        let e = r0
            .combine(&ys[0], &w.topk_idx[0], &w.topk_weights[0][1..], &handles[0])
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::ShapeMismatch {
                    tensor: "topk_weights",
                    ..
                }
            ),
            "{e}"
        );
        // Handle of another rank, and of another communicator with another config.
        let e = r0
            .combine(&ys[0], &w.topk_idx[0], &w.topk_weights[0], &handles[1])
            .unwrap_err();
        assert!(matches!(e, Error::HandleMismatch { rank: 0, .. }), "{e}");
        let e = r0
            .combine(
                &ys[0],
                &w.topk_idx[0],
                &w.topk_weights[0],
                &foreign_handles[0],
            )
            .unwrap_err();
        assert!(matches!(e, Error::HandleMismatch { .. }), "{e}");
        // Routing that differs from the dispatched one.
        let mut idx = w.topk_idx[0].clone();
        idx[1] = if idx[1] == 7 { 6 } else { 7 };
        if idx[0] == idx[1] {
            idx[0] = -1;
        }
        let e = r0
            .combine(&ys[0], &idx, &w.topk_weights[0], &handles[0])
            .unwrap_err();
        assert!(matches!(e, Error::TopkMismatch { rank: 0, .. }), "{e}");
    }
    let mut a = per_expert::group(&c, CpuOptions::default()).unwrap();
    let mut fa = per_expert::group(&other, CpuOptions::default()).unwrap();
    check(&mut a, &mut fa, &w, &wo, &ys);
    let mut b = ep_fast::group(&c, CpuOptions::default()).unwrap();
    let mut fb = ep_fast::group(&other, CpuOptions::default()).unwrap();
    check(&mut b, &mut fb, &w, &wo, &ys);
}

#[test]
fn a_config_too_big_for_memory_fails_at_construction_with_its_size() {
    let c = Config::new(8, 256, 512, 7168, 8, Mode::Bf16).unwrap();
    let opts = CpuOptions {
        memory_limit: Some(1 << 30),
        ..CpuOptions::default()
    };
    match per_expert::group(&c, opts) {
        Err(Error::OutOfMemory { needed, available }) => {
            assert_eq!(needed, per_expert::bytes_needed(&c));
            assert_eq!(available, 1 << 30);
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!(
            "a 1 GiB limit accepted {} bytes",
            per_expert::bytes_needed(&c)
        ),
    }
    match ep_fast::group(&c, opts) {
        Err(Error::OutOfMemory { needed, .. }) => {
            assert_eq!(needed, ep_fast::Shared::bytes_needed(&c))
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!(
            "a 1 GiB limit accepted {} bytes",
            ep_fast::Shared::bytes_needed(&c)
        ),
    }
}

/// Rank 2 of 3 never calls: ranks 0 and 1 fail within the timeout with an error naming rank 2;
/// then rank 2 catches up and the group goes on, correct.
fn missing_rank_times_out<R: EpRank>(mut ranks: Vec<R>) {
    let c = *ranks[0].config();
    let w = Workload::uniform(&c, 4, Routing::EveryRank, 3);
    let start = Instant::now();
    let (present, absent) = ranks.split_at_mut(2);
    let results = run_ranks(present, |r| {
        let me = r.rank();
        r.dispatch(&w.x[me], &w.topk_idx[me]).map(|_| ())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    for (me, res) in results.into_iter().enumerate() {
        let msg = res
            .as_ref()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        match res {
            Err(Error::Timeout {
                rank,
                peer,
                phase,
                call,
                ..
            }) => {
                assert_eq!((rank, peer, call), (me, 2, 1));
                assert_eq!(
                    phase,
                    Phase {
                        op: Op::Dispatch,
                        side: Side::Recv
                    }
                );
                let want = format!("rank {me} timed out");
                assert!(
                    msg.contains(&want) && msg.contains("for rank 2 in dispatch/recv (call 1)"),
                    "{msg}"
                );
            }
            other => panic!("rank {me}: expected a timeout naming rank 2, got {other:?}"),
        }
    }
    // Without shrink a wait that runs out masks nobody.
    for r in present.iter().chain(absent.iter()) {
        assert!(r.query_mask().is_empty(), "rank {}", r.rank());
    }
    // The late rank finds its peers' call-1 batches and completes call 1 on its own.
    let late = absent[0].dispatch(&w.x[2], &w.topk_idx[2]);
    let want = oracle::dispatch(&c, &w.dispatch_inputs()).unwrap();
    assert_eq!(late.unwrap().0.diff(&want[2]), None);
    // Call 2, everyone present: correct again.
    let w2 = Workload::uniform(&c, 4, Routing::Random { masked: 0.1 }, 4);
    ep_verify::check_against_oracle("after timeout", &mut ranks, &w2, 4).unwrap();
}

fn short() -> CpuOptions {
    CpuOptions {
        timeout: Duration::from_millis(300),
        ..CpuOptions::default()
    }
}

#[test]
fn per_expert_rank_that_never_sends_times_out() {
    let c = Config::new(3, 6, 4, 128, 3, Mode::FP8).unwrap();
    missing_rank_times_out(per_expert::group(&c, short()).unwrap());
}

#[test]
fn batched_rank_that_never_sends_times_out() {
    let c = Config::new(3, 6, 4, 128, 3, Mode::FP8).unwrap();
    missing_rank_times_out(ep_fast::group(&c, short()).unwrap());
}

/// A config whose sizes wrap (`bytes_needed` would say 80 bytes, and staging four tokens write
/// past the wrapped allocation) is refused by `Config::new`, and by every group built from a
/// config made by hand, with the value and the limit.
#[test]
fn a_config_whose_sizes_wrap_is_refused_before_any_buffer_exists() {
    let t = (1usize << 60) + 1;
    let want = Error::LimitExceeded {
        what: "max_tokens_per_rank",
        value: t as u128,
        limit: ep_reference::config::MAX_TOKENS_PER_RANK as u128,
    };
    assert_eq!(Config::new(1, 1, t, 16, 1, Mode::Bf16), Err(want.clone()));
    assert!(
        want.to_string()
            .contains("max_tokens_per_rank = 1152921504606846977 exceeds the limit 65536"),
        "{want}"
    );
    // The fields are public: a config built by hand reaches the groups unvalidated.
    let hand = Config {
        max_tokens_per_rank: t,
        ..Config::new(1, 1, 4, 16, 1, Mode::Bf16).unwrap()
    };
    assert_eq!(
        per_expert::group(&hand, CpuOptions::default()).err(),
        Some(want.clone())
    );
    assert_eq!(
        ep_fast::group(&hand, CpuOptions::default()).err(),
        Some(want)
    );
    // H >= 2^30 turned into negative row sizes in the kernels (`as i32`).
    let wide = Config {
        hidden: 1 << 30,
        ..Config::new(1, 1, 4, 16, 1, Mode::Bf16).unwrap()
    };
    for e in [
        per_expert::group(&wide, CpuOptions::default()).err(),
        ep_fast::group(&wide, CpuOptions::default()).err(),
        oracle::dispatch(&wide, &[]).err(),
    ] {
        assert!(
            matches!(e, Some(Error::LimitExceeded { what: "hidden", .. })),
            "{e:?}"
        );
    }
}

/// The raw shared rows refuse a size or a range that would wrap, instead of handing out memory
/// past the allocation.
#[test]
fn shared_rows_sizes_and_ranges_never_wrap() {
    use ep_reference::sync::SharedRows;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    // 2^33 rows of 2^31 bytes is 2^64 bytes: wrapped to 0 before.
    let made = catch_unwind(|| SharedRows::new(1 << 33, 1 << 31).rows());
    assert!(made.is_err(), "a 2^64-byte SharedRows was made");
    let rows = SharedRows::new(4, 8);
    // `1 + usize::MAX` wrapped to 0 and passed the bounds check.
    // SAFETY: one thread, nothing written concurrently; the call must refuse the range.
    let read = catch_unwind(AssertUnwindSafe(|| unsafe {
        rows.with_rows(1, usize::MAX, |b| b.len())
    }));
    assert!(read.is_err(), "rows 1+usize::MAX of 4 were handed out");
    // SAFETY: as above; an in-bounds range still works.
    assert_eq!(unsafe { rows.with_rows(1, 3, |b| b.len()) }, 24);
}

/// Any timeout, `Duration::MAX` included, is a valid bound (waits compare the
/// time elapsed with it; no `Instant + Duration` can overflow), on both paths.
#[test]
fn the_largest_timeouts_work_on_both_paths() {
    let c = cfg();
    let opts = CpuOptions {
        timeout: Duration::MAX,
        ..CpuOptions::default()
    };
    let w = Workload::uniform(&c, 4, Routing::Random { masked: 0.1 }, 9);
    let mut a = per_expert::group(&c, opts).unwrap();
    ep_verify::check_against_oracle(
        &format!("{}, Duration::MAX", Path::PerExpert),
        &mut a,
        &w,
        9,
    )
    .unwrap();
    for r in &mut a {
        r.set_timeout(Duration::from_secs(u64::MAX));
    }
    ep_verify::check_against_oracle(&format!("{}, u64::MAX s", Path::PerExpert), &mut a, &w, 9)
        .unwrap();
    let mut b = ep_fast::group(&c, opts).unwrap();
    ep_verify::check_against_oracle(&format!("{}, Duration::MAX", Path::Batched), &mut b, &w, 9)
        .unwrap();
    let d = ep_reference::sync::Deadline::after(Duration::MAX);
    assert!(d.waited_ms() < 60_000);
    assert_eq!(d.spin_until(|| Some(7)), Some(7));
}

fn shrink(timeout: Duration) -> CpuOptions {
    CpuOptions {
        timeout,
        enable_shrink: true,
        ..CpuOptions::default()
    }
}

/// Dispatch then combine on `present` (the ranks that call), each compared with the masked
/// oracle under `mask` on every rank that is not masked; returns how long the two calls took.
fn masked_round<R: EpRank>(
    present: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
    mask: &RankMask,
) -> Duration {
    let c = w.config;
    let start = Instant::now();
    let got = run_ranks(present, |r| {
        let me = r.rank();
        r.dispatch(&w.x[me], &w.topk_idx[me])
    });
    let want = oracle::dispatch_masked(&c, &w.dispatch_inputs(), mask).unwrap();
    let mut handles = Vec::new();
    for (me, g) in got.into_iter().enumerate() {
        let (out, h) = g.unwrap_or_else(|e| panic!("rank {me} dispatch: {e}"));
        assert_eq!(out.diff(&want[me]), None, "rank {me} dispatch");
        assert_eq!(h.mask, *mask, "rank {me}'s handle");
        handles.push(h);
    }
    let got = run_ranks(present, |r| {
        let me = r.rank();
        r.combine(&ys[me], &w.topk_idx[me], &w.topk_weights[me], &handles[me])
    });
    let want = oracle::combine_masked(&c, &w.combine_inputs(ys), mask).unwrap();
    for (me, g) in got.into_iter().enumerate() {
        let out = g.unwrap_or_else(|e| panic!("rank {me} combine: {e}"));
        assert_eq!(
            ep_reference::output::combine_diff(&out, &want[me], c.hidden),
            None,
            "rank {me} combine"
        );
    }
    start.elapsed()
}

/// Shrink mode: after a first call of all three, rank 2 of 3 stops calling. Ranks 0 and 1 mask
/// it when their wait for it runs out, instead of failing, and their call completes with the
/// masked oracle's outputs (rank 2's regions still hold its first call's rows and signals); the
/// group's mask says so on every endpoint; the next calls skip rank 2 at once (well under the
/// timeout). Unmasking it is refused while it is behind; once it has made its calls (masked,
/// they return at once) the mask can be cleaned and the whole group is correct again.
fn absent_rank_is_masked_in_shrink_mode<R: EpRank>(mut ranks: Vec<R>, timeout: Duration) {
    let c = *ranks[0].config();
    let w = Workload::uniform(&c, 4, Routing::EveryRank, 2);
    ep_verify::check_against_oracle("all three", &mut ranks, &w, 2).unwrap();
    let mask = RankMask::from_ranks(3, &[2]).unwrap();
    let w = Workload::uniform(&c, 4, Routing::EveryRank, 3);
    let ys = w.expert_outputs(3);
    let (present, absent) = ranks.split_at_mut(2);
    let took = masked_round(present, &w, &ys, &mask);
    assert!(took >= timeout, "a wait ran out, yet it took {took:?}");
    assert!(took < 4 * timeout, "took {took:?}");
    for r in present.iter().chain(absent.iter()) {
        assert_eq!(r.query_mask(), mask, "rank {}", r.rank());
    }
    // Later calls with the mask never wait for rank 2.
    for seed in 4..6 {
        let w = Workload::uniform(&c, 4, Routing::Random { masked: 0.1 }, seed);
        let ys = w.expert_outputs(seed);
        let took = masked_round(present, &w, &ys, &mask);
        assert!(took < timeout / 2, "a masked peer cost {took:?}");
    }
    // Rank 2 is 3 dispatches and 3 combines behind: no unmask.
    let behind = Error::UnmaskOutOfStep {
        rank: 0,
        peer: 2,
        other: 2,
        op: Op::Dispatch,
        calls: 4,
        other_calls: 1,
    };
    assert_eq!(present[0].clean_mask(), Err(behind.clone()));
    assert_eq!(present[0].update_mask(2, false), Err(behind));
    assert!(behind_msg_names_the_rule(
        &present[1].clean_mask().unwrap_err()
    ));
    assert_eq!(present[0].query_mask(), mask);
    // Its calls catch up at once (its outputs are undefined and not compared).
    let start = Instant::now();
    let late = &mut absent[0];
    for _ in 0..3 {
        let (_, h) = late.dispatch(&w.x[2], &w.topk_idx[2]).unwrap();
        late.combine(&ys[2], &w.topk_idx[2], &w.topk_weights[2], &h)
            .unwrap();
    }
    assert!(start.elapsed() < timeout / 2, "took {:?}", start.elapsed());
    present[1].clean_mask().unwrap();
    assert!(ranks.iter().all(|r| r.query_mask().is_empty()));
    let w = Workload::uniform(&c, 4, Routing::EveryRank, 9);
    ep_verify::check_against_oracle("unmasked again", &mut ranks, &w, 9).unwrap();
}

fn behind_msg_names_the_rule(e: &Error) -> bool {
    let msg = e.to_string();
    msg.contains("cannot unmask rank 2") && msg.contains("rank 2 has made 1 dispatch calls")
}

#[test]
fn per_expert_rank_that_never_sends_is_masked_in_shrink_mode() {
    let c = Config::new(3, 6, 4, 128, 3, Mode::FP8).unwrap();
    let t = Duration::from_millis(400);
    absent_rank_is_masked_in_shrink_mode(per_expert::group(&c, shrink(t)).unwrap(), t);
}

#[test]
fn batched_rank_that_never_sends_is_masked_in_shrink_mode() {
    let c = Config::new(3, 6, 4, 128, 3, Mode::FP8).unwrap();
    let t = Duration::from_millis(400);
    absent_rank_is_masked_in_shrink_mode(ep_fast::group(&c, shrink(t)).unwrap(), t);
}

/// Shrink mode masks a peer that is late for a combine as well (rank 2 dispatched, then never
/// combines): ranks 0 and 1 finish with the masked oracle's combine. (Rank 2 was not masked at
/// dispatch, so its rows are in the layout; as the highest source they come after every other
/// source's rows, so the layout of ranks 0 and 1's rows is the masked oracle's.)
fn late_combine_is_masked_in_shrink_mode<R: EpRank>(mut ranks: Vec<R>, timeout: Duration) {
    let c = *ranks[0].config();
    let w = Workload::uniform(&c, 4, Routing::EveryRank, 5);
    let handles: Vec<_> = ep_verify::dispatch_all(&mut ranks, &w)
        .into_iter()
        .map(|r| r.unwrap().1)
        .collect();
    let ys = w.expert_outputs(5);
    let (present, _) = ranks.split_at_mut(2);
    let start = Instant::now();
    let got = run_ranks(present, |r| {
        let me = r.rank();
        r.combine(&ys[me], &w.topk_idx[me], &w.topk_weights[me], &handles[me])
    });
    let took = start.elapsed();
    assert!(took >= timeout && took < 4 * timeout, "took {took:?}");
    let mask = RankMask::from_ranks(3, &[2]).unwrap();
    let want = oracle::combine_masked(&c, &w.combine_inputs(&ys), &mask).unwrap();
    let plain = oracle::combine(&c, &w.combine_inputs(&ys)).unwrap();
    for (me, g) in got.into_iter().enumerate() {
        let out = g.unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert_eq!(
            ep_reference::output::combine_diff(&out, &want[me], c.hidden),
            None,
            "rank {me}"
        );
        assert_ne!(out, plain[me], "rank {me}: rank 2's rows were counted");
    }
    assert_eq!(ranks[0].query_mask(), mask);
}

#[test]
fn late_combine_is_masked_in_shrink_mode_on_both_paths() {
    let c = Config::new(3, 6, 4, 128, 3, Mode::Bf16).unwrap();
    let t = Duration::from_millis(300);
    late_combine_is_masked_in_shrink_mode(per_expert::group(&c, shrink(t)).unwrap(), t);
    late_combine_is_masked_in_shrink_mode(ep_fast::group(&c, shrink(t)).unwrap(), t);
}

/// A rank outside the group cannot be masked, on either path, and a group whose calls are in
/// step unmasks at once.
#[test]
fn mask_updates_name_a_rank_outside_the_group() {
    let c = cfg();
    let mut a = per_expert::group(&c, CpuOptions::default()).unwrap();
    let mut b = ep_fast::group(&c, CpuOptions::default()).unwrap();
    let want = Err(Error::RankOutOfRange { rank: 2, ranks: 2 });
    assert_eq!(a[0].update_mask(2, true), want);
    assert_eq!(b[1].update_mask(2, false), want);
    a[1].update_mask(0, true).unwrap();
    assert_eq!(a[0].query_mask(), RankMask::from_ranks(2, &[0]).unwrap());
    assert!(b[0].query_mask().is_empty(), "another group's mask");
    a[0].update_mask(0, false).unwrap();
    assert!(a[1].query_mask().is_empty());
}
