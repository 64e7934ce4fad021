//! The host-slice paths against the oracle: configs, routing, repeated calls, the FP8 cast,
//! a stalled peer, bad inputs.

use crate::common::*;
use ep_kernels::testing::{random_inputs, random_y, verify_case, Rng, Routing};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, Path};
use ep_reference::{Config, Error, Mode, Op, Side};
use ep_test_runner::{gpu_test, GpuTest};

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_r1_both_paths_equal_oracle, gpus: 1),
    gpu_test!(gpu_virtual_r2_r4_r8_both_paths_equal_oracle, gpus: 1),
    gpu_test!(gpu_scales_column_major_equal_oracle, gpus: 1),
    gpu_test!(gpu_two_gpus_r2_r4_both_paths_equal_oracle, gpus: 2),
    gpu_test!(gpu_skewed_routing_all_tokens_to_one_expert, gpus: 1),
    gpu_test!(gpu_standard_setting_r1_r2_r8_equal_oracle, gpus: 1),
    gpu_test!(gpu_1000_consecutive_calls_on_the_same_buffers, gpus: 1),
    gpu_test!(gpu_fp8_cast_is_bit_identical_to_the_cpu, gpus: 1),
    gpu_test!(gpu_stalled_peer_times_out_with_rank_peer_phase_call, gpus: 1),
    gpu_test!(gpu_bad_inputs_are_typed_errors, gpus: 1),
];

fn gpu_r1_both_paths_equal_oracle() {
    for zc in [true, false] {
        assert_eq!(random_configs(1, 1, 1, zc), 4 * 3 * 4);
    }
}

fn gpu_virtual_r2_r4_r8_both_paths_equal_oracle() {
    for (r, seed) in [(2, 2), (4, 4), (8, 8)] {
        for zc in [true, false] {
            assert_eq!(random_configs(r, 1, seed, zc), 4 * 3 * 4);
        }
    }
}

/// DeepEP's recv_scales layout (column-major in the last two dimensions): both paths, every FP8
/// mode, R = 1, 2, 4, local and peer rows. The harness reads the scales back into row order, so
/// a kernel that wrote them row-major anyway (or to the wrong column) fails the oracle here.
fn gpu_scales_column_major_equal_oracle() {
    let mut rng = Rng::new(31);
    let mut checks = 0;
    for r in [1, 2, 4] {
        for mode in [Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0] {
            // G = 8 (f32) or 2 (UE8M0) scale words per row, R*T = 7r rows per expert.
            let cfg = Config::new(r, 3 * r, 7, 1024, 4, mode).unwrap();
            let mut g = GpuGroup::new(
                &cfg,
                GpuOptions {
                    scales_column_major: true,
                    ..test_opts()
                },
            )
            .unwrap_or_else(|e| panic!("{}: {e}", cfg.describe()));
            for _ in 0..2 {
                let tokens: Vec<usize> = (0..r).map(|_| 1 + rng.below(7)).collect();
                let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
                let y = random_y(&cfg, &mut rng);
                checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
    println!("ok: {checks} checks with column-major recv_scales");
}

fn gpu_two_gpus_r2_r4_both_paths_equal_oracle() {
    assert_eq!(random_configs(2, 2, 22, true), 4 * 3 * 4);
    assert_eq!(random_configs(4, 2, 44, true), 4 * 3 * 4);
}

fn gpu_skewed_routing_all_tokens_to_one_expert() {
    let mut rng = Rng::new(5);
    for r in [1, 4, 8] {
        let cfg = Config::new(r, 4 * r, 64, 1024, 4, Mode::FP8).unwrap();
        let mut g = group(&cfg, 1);
        let data = random_inputs(&cfg, &vec![64; r], Routing::AllToOne, &mut rng);
        let y = random_y(&cfg, &mut rng);
        assert_eq!(
            verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}")),
            4
        );
    }
}

fn gpu_standard_setting_r1_r2_r8_equal_oracle() {
    let mut rng = Rng::new(128);
    for r in [1, 2, 8] {
        let cfg = Config::new(r, 256, 128, 7168, 8, Mode::FP8).unwrap();
        let mut g = group(&cfg, 1);
        let data = random_inputs(
            &cfg,
            &vec![128; r],
            Routing::Random { masked: 0.05 },
            &mut rng,
        );
        let y = random_y(&cfg, &mut rng);
        assert_eq!(
            verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}")),
            4
        );
        println!("ok: standard setting {}", cfg.describe());
    }
}

fn gpu_1000_consecutive_calls_on_the_same_buffers() {
    let mut rng = Rng::new(1000);
    let cfg = Config::new(4, 16, 8, 512, 4, Mode::FP8_UE8M0).unwrap();
    let mut g = group(&cfg, 1);
    let y = random_y(&cfg, &mut rng);
    let mut checks = 0;
    for call in 0..500 {
        let tokens: Vec<usize> = (0..4).map(|_| rng.below(9)).collect();
        let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.2 }, &mut rng);
        // verify_case makes 2 dispatch + 2 combine calls: 500 rounds = 1000 calls of each op.
        checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("call {call}: {e}"));
    }
    assert_eq!(checks, 2000);
    assert_eq!(g.calls(), [500, 500, 500, 500]);
}

fn gpu_fp8_cast_is_bit_identical_to_the_cpu() {
    use ep_reference::payload::Encoder;
    use half::bf16;
    let mut rng = Rng::new(8);
    let h = 1024;
    let mut rows: Vec<bf16> = Vec::new();
    // Edge rows: zeros, tiny (amax floor), subnormal-ish, huge, every bf16 exponent, ties.
    rows.extend(vec![bf16::ZERO; h]);
    rows.extend((0..h).map(|i| bf16::from_f32(1e-7 * (i as f32 - 512.0))));
    rows.extend((0..h).map(|i| bf16::from_bits((i as u16 * 61) & 0x7F7F | ((i as u16 & 1) << 15))));
    rows.extend((0..h).map(|i| {
        bf16::from_f32(if i % 128 == 0 {
            3.0e38
        } else {
            1.0 + i as f32 / 1024.0
        })
    }));
    rows.extend((0..h).map(|i| bf16::from_f32([448.0, 464.0, -480.0, 1.0625, 2e-3][i % 5])));
    for _ in 0..59 {
        let s = [1e-5f32, 1e-2, 1.0, 100.0, 1e5][rng.below(5)];
        rows.extend((0..h).map(|_| bf16::from_f32(rng.unit() * s)));
    }
    for mode in MODES {
        let cfg = Config::new(1, 1, 64, h, 1, mode).unwrap();
        let mut g = group(&cfg, 1);
        let got = g.encode_rows(&rows).unwrap();
        let mut enc = Encoder::new(&cfg);
        let mut want = vec![0u8; cfg.payload_bytes()];
        for (t, gr) in got.iter().enumerate() {
            enc.encode(&rows[t * h..(t + 1) * h], &mut want);
            assert_eq!(gr, &want, "{}: row {t} differs", mode.name());
        }
        println!(
            "ok: {} rows x {h} encoded bit-identically in {}",
            got.len(),
            mode.name()
        );
    }
}

fn gpu_stalled_peer_times_out_with_rank_peer_phase_call() {
    let mut rng = Rng::new(9);
    for path in [Path::Batched, Path::PerExpert] {
        let cfg = Config::new(4, 8, 8, 256, 2, Mode::Bf16).unwrap();
        let mut g = group(&cfg, 1);
        g.set_timeout_ns(50_000_000);
        let data = random_inputs(&cfg, &[8; 4], Routing::Random { masked: 0.0 }, &mut rng);
        let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
        let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
        g.dispatch(path, &x, &idx).unwrap(); // call 1 is fine
        g.set_fault_rank(Some(2));
        let t0 = std::time::Instant::now();
        let err = g.dispatch(path, &x, &idx).unwrap_err();
        println!("{}: {err} (after {:?})", path.name(), t0.elapsed());
        match err {
            GpuError::Contract(Error::Timeout {
                rank,
                peer,
                phase,
                call,
                ..
            }) => {
                // Every rank (rank 2 too, waiting for itself) waits for rank 2; the first
                // wait to run out is reported.
                assert_eq!(peer, 2, "the stalled peer");
                assert!(rank < 4);
                assert_eq!((phase.op, phase.side), (Op::Dispatch, Side::Recv));
                assert_eq!(call, 2);
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(t0.elapsed().as_secs() < 10, "the wait was not bounded");
        // The group stays failed: later calls say so instead of hanging.
        assert!(g.dispatch(path, &x, &idx).is_err());
    }
}

fn gpu_bad_inputs_are_typed_errors() {
    let cfg = Config::new(2, 4, 4, 128, 2, Mode::FP8).unwrap();
    let mut g = group(&cfg, 1);
    let x = vec![vec![half::bf16::ONE; 128]; 2];
    let bad_idx = vec![vec![0i64, 9], vec![1, 2]];
    match g.dispatch(Path::Batched, &x, &bad_idx) {
        Err(GpuError::Contract(Error::ExpertOutOfRange {
            rank: 0, expert: 9, ..
        })) => {}
        other => panic!("expected ExpertOutOfRange, got {other:?}"),
    }
    let dup = vec![vec![1i64, 1], vec![1, 2]];
    assert!(matches!(
        g.dispatch(Path::Batched, &x, &dup),
        Err(GpuError::Contract(Error::DuplicateExpert { .. }))
    ));
    let too_many = vec![vec![half::bf16::ONE; 128 * 5]; 2];
    let idx5 = vec![(0..10).map(|i| (i % 2) as i64).collect::<Vec<_>>(); 2];
    assert!(matches!(
        g.dispatch(Path::Batched, &too_many, &idx5),
        Err(GpuError::Contract(Error::TooManyTokens { .. }))
    ));
    // Combine before any dispatch on that path.
    let y = vec![vec![half::bf16::ONE; cfg.num_local_experts() * cfg.rows_per_expert() * 128]; 2];
    let w = vec![vec![1.0f32; 2]; 2];
    assert!(matches!(
        g.combine(Path::PerExpert, &y, &w),
        Err(GpuError::PathMismatch { .. })
    ));
    // Too much memory for the device.
    let huge = Config::new(8, 8 * 4096, 4096, 7168, 8, Mode::Bf16).unwrap();
    assert!(matches!(
        GpuGroup::new(&huge, GpuOptions::default()),
        Err(GpuError::Contract(Error::OutOfMemory { .. }))
    ));
}
