//! GPU tests: both paths bit-identical to the oracle. A custom runner (`harness = false`): each
//! test needs a CUDA GPU (some two) and NVRTC; where they are missing it prints
//! `SKIPPED: <test>: <reason>` and is counted as skipped, never as passed. The summary line gives
//! passed / failed / skipped, and the process fails when a test failed. Tests run one at a time
//! (a launch occupies every multiprocessor). Arguments: an optional name filter; cargo's flags
//! (`--nocapture`, `--test-threads=N`, ...) are accepted and ignored.

mod runner;

use ep_kernels::runtime::{probe_devices, PeerPlan, ProcessRank};
use ep_kernels::testing::{random_inputs, random_y, verify_case, verify_paths, Rng, Routing};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, NcclSizes, Path, Transport};
use ep_reference::{Config, Error, Mode, Op, Side};

/// (name, GPUs needed, test)
const TESTS: &[(&str, usize, fn())] = &[
    (
        "gpu_r1_both_paths_equal_oracle",
        1,
        gpu_r1_both_paths_equal_oracle,
    ),
    (
        "gpu_virtual_r2_r4_r8_both_paths_equal_oracle",
        1,
        gpu_virtual_r2_r4_r8_both_paths_equal_oracle,
    ),
    (
        "gpu_two_gpus_r2_r4_both_paths_equal_oracle",
        2,
        gpu_two_gpus_r2_r4_both_paths_equal_oracle,
    ),
    (
        "gpu_skewed_routing_all_tokens_to_one_expert",
        1,
        gpu_skewed_routing_all_tokens_to_one_expert,
    ),
    (
        "gpu_standard_setting_r1_r2_r8_equal_oracle",
        1,
        gpu_standard_setting_r1_r2_r8_equal_oracle,
    ),
    (
        "gpu_1000_consecutive_calls_on_the_same_buffers",
        1,
        gpu_1000_consecutive_calls_on_the_same_buffers,
    ),
    (
        "gpu_fp8_cast_is_bit_identical_to_the_cpu",
        1,
        gpu_fp8_cast_is_bit_identical_to_the_cpu,
    ),
    (
        "gpu_stalled_peer_times_out_with_rank_peer_phase_call",
        1,
        gpu_stalled_peer_times_out_with_rank_peer_phase_call,
    ),
    (
        "gpu_bad_inputs_are_typed_errors",
        1,
        gpu_bad_inputs_are_typed_errors,
    ),
    (
        "gpu_nccl_r1_self_send_both_paths_both_sizes_equal_oracle",
        1,
        gpu_nccl_r1_self_send_both_paths_both_sizes_equal_oracle,
    ),
    (
        "gpu_nccl_two_gpus_r2_both_paths_both_sizes_equal_oracle",
        2,
        gpu_nccl_two_gpus_r2_both_paths_both_sizes_equal_oracle,
    ),
    (
        "gpu_nccl_bad_input_is_a_typed_error_both_sizes",
        1,
        gpu_nccl_bad_input_is_a_typed_error_both_sizes,
    ),
    (
        "gpu_nccl_two_gpus_bad_input_is_a_typed_error_both_sizes",
        2,
        gpu_nccl_two_gpus_bad_input_is_a_typed_error_both_sizes,
    ),
    (
        "gpu_nccl_device_api_capacity_equals_oracle_and_graph_replays",
        1,
        gpu_nccl_device_api_capacity_equals_oracle_and_graph_replays,
    ),
    (
        "gpu_nccl_two_gpus_device_api_capacity_equals_oracle",
        2,
        gpu_nccl_two_gpus_device_api_capacity_equals_oracle,
    ),
    (
        "gpu_device_api_r1_r2_r4_r8_all_modes_equal_oracle",
        1,
        gpu_device_api_r1_r2_r4_r8_all_modes_equal_oracle,
    ),
    (
        "gpu_device_api_two_gpus_r2_r4_equal_oracle",
        2,
        gpu_device_api_two_gpus_r2_r4_equal_oracle,
    ),
    (
        "gpu_device_api_checks_stream_and_shapes_on_the_host",
        1,
        gpu_device_api_checks_stream_and_shapes_on_the_host,
    ),
    (
        "gpu_device_bad_input_typed_error_no_stray_write",
        1,
        gpu_device_bad_input_typed_error_no_stray_write,
    ),
    (
        "gpu_graph_dispatch_expert_combine_1000_replays",
        1,
        gpu_graph_dispatch_expert_combine_1000_replays,
    ),
    (
        "gpu_graph_with_receive_hook_split_1000_replays",
        1,
        gpu_graph_with_receive_hook_split_1000_replays,
    ),
    (
        "gpu_epochs_past_2_32_and_the_signal_tag_wrap",
        1,
        gpu_epochs_past_2_32_and_the_signal_tag_wrap,
    ),
    (
        "gpu_rank_ep_process_mode_equals_oracle",
        1,
        gpu_rank_ep_process_mode_equals_oracle,
    ),
    (
        "gpu_error_reaches_the_next_call_without_a_sync",
        1,
        gpu_error_reaches_the_next_call_without_a_sync,
    ),
    (
        "gpu_trap_on_error_ends_the_context_and_still_names_the_error",
        1,
        gpu_trap_on_error_ends_the_context_and_still_names_the_error,
    ),
    (
        "gpu_shrink_masks_a_lost_peer_and_the_group_goes_on",
        1,
        gpu_shrink_masks_a_lost_peer_and_the_group_goes_on,
    ),
];

fn main() {
    if std::env::var_os(TRAP_CHILD).is_some() {
        trap_child();
    }
    let mut runner = runner::Runner::new("gpu tests");
    for &(name, gpus, test) in TESTS {
        let probe = runner::probe(gpus, name.contains("nccl"));
        runner.run(name, probe, || {
            test();
            runner::Verdict::Ok(String::new())
        });
    }
    runner.finish()
}

const MODES: [Mode; 4] = [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0];

/// The options every test starts from: the library's defaults, with the wait bound raised by
/// `EP_GPU_TEST_TIMEOUT_MS` where set (compute-sanitizer slows the kernels many times over; the
/// timeout tests set their own bound and are not affected).
fn test_opts() -> GpuOptions {
    let mut o = GpuOptions::default();
    match runner::env_num::<u64>("EP_GPU_TEST_TIMEOUT_MS") {
        Ok(Some(ms)) => o.timeout_ns = ms.saturating_mul(1_000_000),
        Ok(None) => {}
        Err(e) => panic!("{e} (milliseconds)"),
    }
    o
}

fn group(cfg: &Config, gpus: usize) -> GpuGroup {
    group_with(cfg, gpus, true)
}

fn group_with(cfg: &Config, gpus: usize, zero_copy_local: bool) -> GpuGroup {
    GpuGroup::new(
        cfg,
        GpuOptions {
            num_gpus: gpus,
            zero_copy_local,
            ..test_opts()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", cfg.describe()))
}

/// Random configs at R ranks on `gpus` GPUs, every mode, with masked slots, empty ranks and
/// uneven token counts.
fn random_configs(r: usize, gpus: usize, seed: u64, zero_copy_local: bool) -> usize {
    let mut rng = Rng::new(seed);
    let mut checks = 0;
    for (i, mode) in MODES.iter().enumerate() {
        let l = [1, 2, 3, 5][i];
        let e = r * l;
        let k = (1 + rng.below(8)).min(e);
        let t = [1, 7, 16, 33][i];
        let h = if mode.is_fp8() {
            512 * (1 + rng.below(3)) + if *mode == Mode::FP8 { 128 } else { 0 }
        } else {
            [72, 256, 1001, 7168][i]
        };
        let cfg = Config::new(r, e, t, h, k, *mode).unwrap();
        let mut g = group_with(&cfg, gpus, zero_copy_local);
        for round in 0..3 {
            let tokens: Vec<usize> = (0..r)
                .map(|s| {
                    if (s + round) % 3 == 2 {
                        0
                    } else {
                        rng.below(t + 1)
                    }
                })
                .collect();
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.15 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}"));
        }
        println!(
            "ok: {} tokens per rank varied, 3 rounds, both paths, zero_copy_local={zero_copy_local}",
            cfg.describe()
        );
    }
    checks
}

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

fn nccl_opts(r: usize, sizes: NcclSizes) -> GpuOptions {
    GpuOptions {
        num_gpus: r,
        transport: Transport::Nccl,
        nccl_sizes: sizes,
        ..test_opts()
    }
}

/// The NCCL transport forced on R ranks over R GPUs with `sizes`: random configs in every mode
/// (3 rounds on the same buffers, uneven and empty ranks) and the standard setting, bitwise.
/// Exact sizes: both paths (per-expert: one NCCL message per (peer, local expert)). Capacity:
/// the batched path; per-expert is refused with a typed error naming exact sizes.
fn nccl_case(r: usize, seed: u64, sizes: NcclSizes) -> usize {
    let opts = nccl_opts(r, sizes);
    let paths: &[Path] = match sizes {
        NcclSizes::Exact => &[Path::PerExpert, Path::Batched],
        NcclSizes::Capacity => &[Path::Batched],
    };
    let mut rng = Rng::new(seed);
    let mut checks = 0;
    for (i, mode) in MODES.iter().enumerate() {
        let l = [1, 2, 3, 5][i];
        let e = r * l;
        let k = (1 + rng.below(8)).min(e);
        let t = [1, 7, 16, 33][i];
        let h = if mode.is_fp8() {
            512 * (1 + rng.below(3)) + if *mode == Mode::FP8 { 128 } else { 0 }
        } else {
            [72, 256, 1001, 7168][i]
        };
        let cfg = Config::new(r, e, t, h, k, *mode).unwrap();
        let mut g = GpuGroup::new(&cfg, opts).unwrap_or_else(|e| panic!("{}: {e}", cfg.describe()));
        for round in 0..3 {
            let tokens: Vec<usize> = (0..r)
                .map(|s| {
                    if (s + round) % 3 == 2 {
                        0
                    } else {
                        rng.below(t + 1)
                    }
                })
                .collect();
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.15 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            checks += verify_paths(&mut g, &data, &y, paths)
                .unwrap_or_else(|e| panic!("nccl {}: {e}", sizes.name()));
        }
        if sizes == NcclSizes::Capacity {
            let x: Vec<_> = (0..r).map(|_| Vec::new()).collect();
            let idx: Vec<Vec<i64>> = (0..r).map(|_| Vec::new()).collect();
            match g.dispatch(Path::PerExpert, &x, &idx) {
                Err(GpuError::Unsupported(m)) => assert!(m.contains("NcclSizes::Exact"), "{m}"),
                other => panic!("per-expert in capacity mode: {other:?}"),
            }
        }
        println!(
            "ok: nccl {} {} 3 rounds {paths:?}",
            sizes.name(),
            cfg.describe()
        );
    }
    let cfg = Config::new(r, 256, 128, 7168, 8, Mode::FP8).unwrap();
    let mut g = GpuGroup::new(&cfg, opts).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..2 {
        let data = random_inputs(
            &cfg,
            &vec![128; r],
            Routing::Random { masked: 0.05 },
            &mut rng,
        );
        let y = random_y(&cfg, &mut rng);
        checks += verify_paths(&mut g, &data, &y, paths)
            .unwrap_or_else(|e| panic!("nccl {}: {e}", sizes.name()));
    }
    println!(
        "ok: nccl {} standard setting {}",
        sizes.name(),
        cfg.describe()
    );
    checks
}

fn gpu_nccl_r1_self_send_both_paths_both_sizes_equal_oracle() {
    // verify_paths: 2 checks per path per round.
    assert_eq!(nccl_case(1, 61, NcclSizes::Exact), (4 * 3 + 2) * 2 * 2);
    assert_eq!(nccl_case(1, 63, NcclSizes::Capacity), (4 * 3 + 2) * 2);
    // Two ranks on one GPU cannot use NCCL: a typed error, not a hang.
    let cfg = Config::new(2, 4, 8, 256, 2, Mode::Bf16).unwrap();
    let r = GpuGroup::new(
        &cfg,
        GpuOptions {
            transport: Transport::Nccl,
            ..Default::default()
        },
    );
    assert!(matches!(r, Err(GpuError::Unsupported(_))), "{:?}", r.err());
}

fn gpu_nccl_two_gpus_r2_both_paths_both_sizes_equal_oracle() {
    assert_eq!(nccl_case(2, 62, NcclSizes::Exact), (4 * 3 + 2) * 2 * 2);
    assert_eq!(nccl_case(2, 64, NcclSizes::Capacity), (4 * 3 + 2) * 2);
}

/// Bad routing on rank 0 over NCCL. Exact sizes (the host harness): checked on the host before
/// anything moves, the group stays usable. Capacity sizes through the device API (routing in
/// device memory, so only the kernel sees it: the error word path): the pack stage stops, its
/// send headers stay poisoned (i32::MAX), the peers' unpack rejects them on the device, and `check`
/// returns rank 0's ExpertOutOfRange (the cause before its consequences); no hang, and the
/// group refuses later calls.
fn nccl_bad_input(r: usize) {
    let cfg = Config::new(r, 4 * r, 4, 512, 2, Mode::FP8).unwrap();
    let mut rng = Rng::new(300 + r as u64);
    let bad_e = 4 * r as i64 + 5;
    {
        let mut g = GpuGroup::new(&cfg, nccl_opts(r, NcclSizes::Exact)).unwrap();
        for path in [Path::PerExpert, Path::Batched] {
            let data = random_inputs(&cfg, &vec![4; r], Routing::Random { masked: 0.0 }, &mut rng);
            let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
            let mut idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
            g.dispatch(path, &x, &idx).unwrap();
            idx[0][1] = bad_e;
            match g.dispatch(path, &x, &idx) {
                Err(GpuError::Contract(Error::ExpertOutOfRange {
                    rank: 0, expert, ..
                })) => {
                    assert_eq!(expert, bad_e)
                }
                other => panic!(
                    "exact {}: expected ExpertOutOfRange, got {other:?}",
                    path.name()
                ),
            }
            let y = random_y(&cfg, &mut rng);
            verify_paths(&mut g, &data, &y, &[path]).unwrap_or_else(|e| panic!("after: {e}"));
            println!(
                "ok: nccl exact {} R={r}: bad input refused on the host",
                path.name()
            );
        }
    }
    let mut g = GpuGroup::new(&cfg, nccl_opts(r, NcclSizes::Capacity)).unwrap();
    let cs: Vec<_> = (0..r).map(context).collect();
    let streams: Vec<Arc<CudaStream>> = cs.iter().map(|c| c.1.clone()).collect();
    let data = random_inputs(&cfg, &vec![4; r], Routing::Random { masked: 0.0 }, &mut rng);
    let y = random_y(&cfg, &mut rng);
    device_case(&mut g, &streams, Path::Batched, &data, &y, false);
    // The last rank's routing is bad: over two GPUs its peer (rank 0, on GPU 0, read first by
    // `check`) reports the poisoned header it got, and `check` still names the cause.
    let last = r - 1;
    let mut bad = data.clone();
    bad[last].topk_idx[1] = bad_e;
    let mut ins: Vec<RankIn> = (0..r).map(|q| RankIn::new(&cfg, &streams[q])).collect();
    let mut outs: Vec<RankOut> = (0..r).map(|q| RankOut::new(&g, &streams[q])).collect();
    for q in 0..r {
        ins[q].set(&streams[q], &bad[q], None);
        streams[q].synchronize().unwrap();
    }
    let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
    let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
    let dins: Vec<DispatchIn> = (0..r)
        .map(|q| DispatchIn {
            x: &xs[q],
            topk_idx: &ts[q],
            n_tokens: Tokens::Host(4),
        })
        .collect();
    let sref: Vec<&CudaStream> = streams.iter().map(|s| s.as_ref()).collect();
    let t0 = std::time::Instant::now();
    {
        let mut douts: Vec<DeviceDispatchOut> = outs.iter_mut().map(|o| o.dispatch_out()).collect();
        g.dispatch_device(Path::Batched, &sref, &dins, Some(&mut douts))
            .unwrap();
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    let words = g.device_errors_for_test().unwrap();
    println!("nccl capacity R={r}, bad routing on rank {last}: error words {words:?}");
    if r == 2 {
        // Not silent on the peer: rank 0 rejected rank 1's poisoned token count.
        match &words[0] {
            Some(GpuError::PeerData {
                rank: 0,
                peer: 1,
                value,
                ..
            }) => assert_eq!(*value, i32::MAX as i64),
            other => panic!("rank 0 should report rank 1's poisoned header, got {other:?}"),
        }
    }
    match g.check() {
        Err(GpuError::Contract(Error::ExpertOutOfRange {
            rank,
            token: 0,
            slot: 1,
            expert,
            ..
        })) if rank == last => assert_eq!(expert, bad_e),
        other => panic!("capacity device API: expected ExpertOutOfRange, got {other:?}"),
    }
    assert!(t0.elapsed().as_secs() < 10, "took {:?}", t0.elapsed());
    {
        let mut douts: Vec<DeviceDispatchOut> = outs.iter_mut().map(|o| o.dispatch_out()).collect();
        assert!(g
            .dispatch_device(Path::Batched, &sref, &dins, Some(&mut douts))
            .is_err());
    }
    println!("ok: nccl capacity device API R={r}: bad routing found by the kernel, typed error");
}

fn gpu_nccl_bad_input_is_a_typed_error_both_sizes() {
    nccl_bad_input(1);
}

fn gpu_nccl_two_gpus_bad_input_is_a_typed_error_both_sizes() {
    nccl_bad_input(2);
}

/// The device API over NCCL, capacity sizes, on the caller's streams: every mode bitwise
/// against the oracle (caller outputs and the group's own), exact sizes and the per-expert
/// path refused with typed errors.
fn nccl_device_case(r: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let cs: Vec<_> = (0..r).map(context).collect();
    let streams: Vec<Arc<CudaStream>> = cs.iter().map(|c| c.1.clone()).collect();
    for mode in MODES {
        let h = if mode == Mode::FP8 { 640 } else { 512 };
        let cfg = Config::new(r, 3 * r, 16, h, 3, mode).unwrap();
        let mut g = GpuGroup::new(&cfg, nccl_opts(r, NcclSizes::Capacity)).unwrap();
        for (round, owned) in [false, true, false].into_iter().enumerate() {
            let tokens: Vec<usize> = (0..r)
                .map(|q| {
                    if (q + round) % 3 == 2 {
                        0
                    } else {
                        rng.below(17)
                    }
                })
                .collect();
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            device_case(&mut g, &streams, Path::Batched, &data, &y, owned);
        }
        // Per-expert needs exact sizes; exact sizes need the host: both refused, typed.
        let data = random_inputs(&cfg, &vec![1; r], Routing::Random { masked: 0.0 }, &mut rng);
        let ins: Vec<RankIn> = (0..r).map(|q| RankIn::new(&cfg, &streams[q])).collect();
        let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
        let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
        let dins: Vec<DispatchIn> = (0..r)
            .map(|q| DispatchIn {
                x: &xs[q],
                topk_idx: &ts[q],
                n_tokens: Tokens::Host(data[q].topk_idx.len() / 3),
            })
            .collect();
        let sref: Vec<&CudaStream> = streams.iter().map(|s| s.as_ref()).collect();
        match g.dispatch_device(Path::PerExpert, &sref, &dins, None) {
            Err(GpuError::Unsupported(m)) => assert!(m.contains("exact"), "{m}"),
            other => panic!("per-expert device API in capacity mode: {other:?}"),
        }
        g.set_nccl_sizes(NcclSizes::Exact);
        match g.dispatch_device(Path::Batched, &sref, &dins, None) {
            Err(GpuError::Unsupported(m)) => assert!(m.contains("Capacity"), "{m}"),
            other => panic!("device API in exact mode: {other:?}"),
        }
        println!("ok: nccl device API capacity {} 3 rounds", cfg.describe());
    }
}

fn gpu_nccl_device_api_capacity_equals_oracle_and_graph_replays() {
    nccl_device_case(1, 71);
    // The whole call (memset, pack, grouped send/recv, unpack) captured into a CUDA graph on
    // one GPU, after an uncaptured call (NCCL connects on first use), replayed.
    graph_case_on(Path::Batched, false, true);
    graph_case_on(Path::Batched, true, true);
}

fn gpu_nccl_two_gpus_device_api_capacity_equals_oracle() {
    nccl_device_case(2, 72);
}

// ------------------------------------------------------------------ the device API

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use ep_kernels::{CombineIn, DeviceDispatchOut, DeviceHandle, DispatchIn, Tokens};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::{DispatchOutput, RecvScales, RecvX};
use half::bf16;
use std::sync::Arc;

/// Elements of guard on each side of every output buffer.
const GUARD: usize = 96;

/// A device buffer of `len` elements with `GUARD` elements of a known value on each side.
struct Guarded<T> {
    buf: CudaSlice<T>,
    len: usize,
    fill: T,
}

impl<T: DeviceRepr + Copy + PartialEq + std::fmt::Debug + Default> Guarded<T> {
    fn new(s: &Arc<CudaStream>, len: usize, fill: T) -> Self {
        Guarded {
            buf: s.clone_htod(&vec![fill; len + 2 * GUARD]).unwrap(),
            len,
            fill,
        }
    }
    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.buf.slice_mut(GUARD..GUARD + self.len)
    }
    /// The inside; panics when a guard element changed (a stray write).
    fn read(&self, s: &Arc<CudaStream>, what: &str) -> Vec<T> {
        let all = s.clone_dtoh(&self.buf).unwrap();
        for (i, v) in all[..GUARD]
            .iter()
            .chain(&all[GUARD + self.len..])
            .enumerate()
        {
            assert_eq!(*v, self.fill, "{what}: guard element {i} was written");
        }
        all[GUARD..GUARD + self.len].to_vec()
    }
}

/// One rank's caller-allocated outputs (dispatch and combine), guarded.
struct RankOut {
    recv_x: Guarded<u8>,
    scales: Option<Guarded<u8>>,
    count: Guarded<i32>,
    layout: Guarded<i64>,
    src: Guarded<i32>,
    out: Guarded<u16>,
}

impl RankOut {
    fn new(g: &GpuGroup, s: &Arc<CudaStream>) -> RankOut {
        let z = g.dispatch_out_sizes();
        let cfg = g.config();
        RankOut {
            recv_x: Guarded::new(s, z.recv_x_bytes, 0xA5),
            scales: (z.recv_scales_bytes > 0).then(|| Guarded::new(s, z.recv_scales_bytes, 0x5A)),
            count: Guarded::new(s, z.recv_count, -7),
            layout: Guarded::new(s, z.layout_range, -9),
            src: Guarded::new(s, z.src_info, -11),
            out: Guarded::new(s, cfg.max_tokens_per_rank * cfg.hidden, 0x4321),
        }
    }
    fn dispatch_out(&mut self) -> DeviceDispatchOut<'_> {
        DeviceDispatchOut {
            recv_x: self.recv_x.view_mut(),
            recv_scales: self.scales.as_mut().map(|g| g.view_mut()),
            recv_count: self.count.view_mut(),
            layout_range: self.layout.view_mut(),
            src_info: self.src.view_mut(),
        }
    }
    /// The dispatch output in the oracle's form (guards checked).
    fn read_dispatch(&self, cfg: &Config, s: &Arc<CudaStream>) -> DispatchOutput {
        let mut d = DispatchOutput::zeroed(cfg);
        let bytes = self.recv_x.read(s, "recv_x");
        match &mut d.recv_x {
            RecvX::Bf16(v) => {
                for (o, c) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            RecvX::Fp8(v) => v.copy_from_slice(&bytes),
        }
        if let Some(g) = &self.scales {
            let b = g.read(s, "recv_scales");
            let w = b.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
            match &mut d.recv_scales {
                Some(RecvScales::F32(v)) => {
                    for (o, c) in v.iter_mut().zip(w) {
                        *o = f32::from_le_bytes(c);
                    }
                }
                Some(RecvScales::Ue8m0(v)) => {
                    for (o, c) in v.iter_mut().zip(w) {
                        *o = i32::from_le_bytes(c);
                    }
                }
                None => {}
            }
        }
        d.recv_count = self.count.read(s, "recv_count");
        d.layout_range = self
            .layout
            .read(s, "layout_range")
            .iter()
            .map(|&v| (v as i32, (v >> 32) as i32))
            .collect();
        d.src_info = self.src.read(s, "src_info");
        d
    }
    fn check_untouched(&self, s: &Arc<CudaStream>) {
        let _ = self.recv_x.read(s, "recv_x");
        if let Some(g) = &self.scales {
            let _ = g.read(s, "recv_scales");
        }
        let _ = self.count.read(s, "recv_count");
        let _ = self.layout.read(s, "layout_range");
        let _ = self.src.read(s, "src_info");
        let _ = self.out.read(s, "out");
    }
}

/// One rank's inputs on the device, padded to T tokens.
/// (bf16 tensors are held as u16 and viewed as bf16: cudarc's DeviceRepr for bf16 needs its
/// `f16` feature, which the library itself does not need.)
struct RankIn {
    x: CudaSlice<u16>,
    topk: CudaSlice<i64>,
    w: CudaSlice<f32>,
    y: CudaSlice<u16>,
    n: CudaSlice<i32>,
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|b| b.to_bits()).collect()
}

/// A u16 buffer seen as bf16.
fn as_bf16(s: &CudaSlice<u16>) -> cudarc::driver::CudaView<'_, bf16> {
    // SAFETY: u16 and bf16 have the same size, and every bit pattern is a valid bf16.
    unsafe { s.transmute::<bf16>(s.len()).unwrap() }
}

impl RankIn {
    fn new(cfg: &Config, s: &Arc<CudaStream>) -> RankIn {
        let (t, h, k) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k);
        let ylen = cfg.num_local_experts() * cfg.rows_per_expert() * h;
        RankIn {
            x: s.alloc_zeros(t * h).unwrap(),
            topk: s.clone_htod(&vec![-1i64; t * k]).unwrap(),
            w: s.alloc_zeros(t * k).unwrap(),
            y: s.alloc_zeros(ylen).unwrap(),
            n: s.alloc_zeros(1).unwrap(),
        }
    }
    /// Copies host data into the (same) device buffers, on the stream.
    fn set(&mut self, s: &Arc<CudaStream>, d: &ep_kernels::testing::RankData, y: Option<&[bf16]>) {
        if !d.x.is_empty() {
            s.memcpy_htod(&bits(&d.x), &mut self.x.slice_mut(..d.x.len()))
                .unwrap();
            s.memcpy_htod(&d.topk_idx, &mut self.topk.slice_mut(..d.topk_idx.len()))
                .unwrap();
            s.memcpy_htod(
                &d.topk_weights,
                &mut self.w.slice_mut(..d.topk_weights.len()),
            )
            .unwrap();
        }
        if let Some(y) = y {
            s.memcpy_htod(&bits(y), &mut self.y).unwrap();
        }
    }
}

fn context(ordinal: usize) -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = CudaContext::new(ordinal).unwrap();
    // SAFETY: nothing of this context is in use yet; the tests order their work on one stream
    // per GPU themselves (and graph capture must not see cudarc's cross-stream events).
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().unwrap();
    (ctx, s)
}

fn oracle_of(
    cfg: &Config,
    data: &[ep_kernels::testing::RankData],
    y: &[Vec<bf16>],
) -> (Vec<DispatchOutput>, Vec<Vec<bf16>>) {
    let inputs: Vec<RankInput> = data
        .iter()
        .map(|d| RankInput {
            x: &d.x,
            topk_idx: &d.topk_idx,
        })
        .collect();
    let want = oracle::dispatch(cfg, &inputs).unwrap();
    let cin: Vec<CombineInput> = data
        .iter()
        .zip(y)
        .map(|(d, y)| CombineInput {
            y,
            topk_idx: &d.topk_idx,
            topk_weights: &d.topk_weights,
        })
        .collect();
    (want, oracle::combine(cfg, &cin).unwrap())
}

/// Device-API dispatch + combine of every rank, outputs in caller buffers (guarded) or, with
/// `owned`, in the group's own buffers; compared bit for bit with the oracle.
fn device_case(
    g: &mut GpuGroup,
    streams: &[Arc<CudaStream>],
    path: Path,
    data: &[ep_kernels::testing::RankData],
    y: &[Vec<bf16>],
    owned: bool,
) {
    let cfg = *g.config();
    let r = cfg.num_ranks;
    let per = r / streams.len();
    let st = |rank: usize| &streams[rank / per];
    let mut ins: Vec<RankIn> = (0..r).map(|q| RankIn::new(&cfg, st(q))).collect();
    for q in 0..r {
        ins[q].set(st(q), &data[q], Some(&y[q]));
    }
    let mut outs: Vec<RankOut> = (0..r).map(|q| RankOut::new(g, st(q))).collect();
    for s in streams {
        s.synchronize().unwrap();
    }
    let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
    let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
    let ws: Vec<_> = ins.iter().map(|i| i.w.slice(..)).collect();
    let ys: Vec<_> = ins.iter().map(|i| as_bf16(&i.y)).collect();
    let dins: Vec<DispatchIn> = (0..r)
        .map(|q| DispatchIn {
            x: &xs[q],
            topk_idx: &ts[q],
            n_tokens: Tokens::Host(data[q].topk_idx.len() / cfg.top_k),
        })
        .collect();
    let sref: Vec<&CudaStream> = streams.iter().map(|s| s.as_ref()).collect();
    let handle = {
        let mut douts: Vec<DeviceDispatchOut> = outs.iter_mut().map(|o| o.dispatch_out()).collect();
        g.dispatch_device(
            path,
            &sref,
            &dins,
            if owned { None } else { Some(&mut douts) },
        )
        .unwrap()
    };
    let cins: Vec<CombineIn> = (0..r)
        .map(|q| CombineIn {
            y: &ys[q],
            topk_idx: &ts[q],
            topk_weights: &ws[q],
        })
        .collect();
    {
        let mut fulls = out_views(&mut outs);
        let mut couts = inner(&mut fulls);
        g.combine_device(&sref, &handle, &cins, &mut couts).unwrap();
    }
    for s in streams {
        s.synchronize().unwrap();
    }
    g.check()
        .unwrap_or_else(|e| panic!("{} {}: {e}", path.name(), cfg.describe()));
    let (want, want_c) = oracle_of(&cfg, data, y);
    for q in 0..r {
        let got = if owned {
            g.read_dispatch_output(q).unwrap()
        } else {
            outs[q].read_dispatch(&cfg, st(q))
        };
        if let Some(d) = got.diff(&want[q]) {
            panic!(
                "device {} dispatch, {}, rank {q}: {d}",
                path.name(),
                cfg.describe()
            );
        }
        let n = want_c[q].len();
        let bits = outs[q].out.read(st(q), "out");
        let got_c: Vec<bf16> = bits[..n].iter().map(|&b| bf16::from_bits(b)).collect();
        if let Some(d) = ep_reference::output::combine_diff(&got_c, &want_c[q], cfg.hidden) {
            panic!(
                "device {} combine, {}, rank {q}: {d}",
                path.name(),
                cfg.describe()
            );
        }
        // Rows past n tokens are the caller's: untouched.
        assert!(
            bits[n..].iter().all(|&b| b == 0x4321),
            "combine wrote past n tokens"
        );
    }
}

/// The combine outputs (u16 buffers with guards) as whole bf16 views.
fn out_views(outs: &mut [RankOut]) -> Vec<CudaViewMut<'_, bf16>> {
    outs.iter_mut()
        .map(|o| {
            let n = o.out.len + 2 * GUARD;
            // SAFETY: u16 and bf16 have the same size, and every bit pattern is a valid bf16.
            unsafe { o.out.buf.transmute_mut::<bf16>(n).unwrap() }
        })
        .collect()
}

/// The insides (without the guards) of whole views.
fn inner<'a>(fulls: &'a mut [CudaViewMut<'_, bf16>]) -> Vec<CudaViewMut<'a, bf16>> {
    fulls
        .iter_mut()
        .map(|f| {
            let n = f.len() - 2 * GUARD;
            f.slice_mut(GUARD..GUARD + n)
        })
        .collect()
}

impl<T: DeviceRepr + Copy + PartialEq + std::fmt::Debug + Default> Guarded<T> {
    /// Panics unless the whole buffer (inside too) still holds the fill value.
    fn all_fill(&self, s: &Arc<CudaStream>, what: &str) {
        let inside = self.read(s, what);
        assert!(inside.iter().all(|v| *v == self.fill), "{what}: written");
    }
}

impl RankOut {
    /// A failed dispatch's outputs: no row, scale, source index or combine row written (the
    /// counts and layout pairs are checked by the caller).
    fn check_failed_dispatch(&self, s: &Arc<CudaStream>) {
        self.recv_x.all_fill(s, "recv_x");
        if let Some(g) = &self.scales {
            g.all_fill(s, "recv_scales");
        }
        self.src.all_fill(s, "src_info");
        self.out.all_fill(s, "out");
        let _ = self.count.read(s, "recv_count");
        let _ = self.layout.read(s, "layout_range");
    }
}

/// Random configs (every mode) at R ranks over the given streams' GPUs, device API, both paths,
/// caller buffers, plus one round with the group's own buffers.
fn device_configs(r: usize, streams: &[Arc<CudaStream>], seed: u64) {
    let mut rng = Rng::new(seed);
    for (i, mode) in MODES.iter().enumerate() {
        let l = [1, 2, 3, 5][i];
        let e = r * l;
        let k = (1 + rng.below(8)).min(e);
        let t = [1, 7, 16, 33][i];
        let h = if mode.is_fp8() {
            512 * (1 + rng.below(3)) + if *mode == Mode::FP8 { 128 } else { 0 }
        } else {
            [72, 256, 1001, 7168][i]
        };
        let cfg = Config::new(r, e, t, h, k, *mode).unwrap();
        let mut g = group(&cfg, streams.len());
        for round in 0..3 {
            let tokens: Vec<usize> = (0..r)
                .map(|s| {
                    if (s + round) % 3 == 2 {
                        0
                    } else {
                        rng.below(t + 1)
                    }
                })
                .collect();
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.15 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            for path in [Path::PerExpert, Path::Batched] {
                device_case(&mut g, streams, path, &data, &y, round == 2);
            }
        }
        println!("ok: device API {} 3 rounds, both paths", cfg.describe());
    }
}

fn gpu_device_api_r1_r2_r4_r8_all_modes_equal_oracle() {
    let (_c, s) = context(0);
    for (r, seed) in [(1, 31), (2, 32), (4, 34), (8, 38)] {
        device_configs(r, std::slice::from_ref(&s), seed);
    }
}

fn gpu_device_api_two_gpus_r2_r4_equal_oracle() {
    let (_c0, s0) = context(0);
    let (_c1, s1) = context(1);
    for (r, seed) in [(2, 42), (4, 44)] {
        device_configs(r, &[s0.clone(), s1.clone()], seed);
    }
}

fn gpu_device_api_checks_stream_and_shapes_on_the_host() {
    let cfg = Config::new(2, 4, 4, 128, 2, Mode::Bf16).unwrap();
    let mut g = group(&cfg, 1);
    let (_c, s) = context(0);
    let ins: Vec<RankIn> = (0..2).map(|_| RankIn::new(&cfg, &s)).collect();
    let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
    let short = s.alloc_zeros::<i64>(3).unwrap();
    let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
    let sv = short.slice(..);
    // n_tokens above T, and a topk_idx too short for n tokens: typed host errors, nothing enqueued.
    let bad_n = [
        DispatchIn {
            x: &xs[0],
            topk_idx: &ts[0],
            n_tokens: Tokens::Host(5),
        },
        DispatchIn {
            x: &xs[1],
            topk_idx: &ts[1],
            n_tokens: Tokens::Host(0),
        },
    ];
    assert!(matches!(
        g.dispatch_device(Path::Batched, &[&s], &bad_n, None),
        Err(GpuError::Contract(Error::TooManyTokens {
            rank: 0,
            tokens: 5,
            ..
        }))
    ));
    let bad_len = [
        DispatchIn {
            x: &xs[0],
            topk_idx: &ts[0],
            n_tokens: Tokens::Host(1),
        },
        DispatchIn {
            x: &xs[1],
            topk_idx: &sv,
            n_tokens: Tokens::Host(2),
        },
    ];
    assert!(matches!(
        g.dispatch_device(Path::Batched, &[&s], &bad_len, None),
        Err(GpuError::Contract(Error::ShapeMismatch {
            rank: 1,
            tensor: "topk_idx",
            ..
        }))
    ));
    // One entry per rank.
    assert!(matches!(
        g.dispatch_device(Path::Batched, &[&s], &bad_len[..1], None),
        Err(GpuError::Contract(Error::WrongRankCount { .. }))
    ));
    if probe_devices(2).is_ok() {
        // A stream of another device.
        let (_c1, s1) = context(1);
        let ok = [
            DispatchIn {
                x: &xs[0],
                topk_idx: &ts[0],
                n_tokens: Tokens::Host(1),
            },
            DispatchIn {
                x: &xs[1],
                topk_idx: &ts[1],
                n_tokens: Tokens::Host(1),
            },
        ];
        let r = g.dispatch_device(Path::Batched, &[&s1], &ok, None);
        assert!(matches!(r, Err(GpuError::WrongDevice { .. })), "{r:?}");
    }
    // A process-mode-only face on a two-rank group.
    assert!(g.rank_ep().is_err());
    // Rank checks of the harness read-back (issue 10 item 7).
    assert!(matches!(
        g.read_dispatch_output(2),
        Err(GpuError::Contract(Error::RankOutOfRange {
            rank: 2,
            ranks: 2
        }))
    ));
    assert!(matches!(
        g.read_combine_output(7),
        Err(GpuError::Contract(Error::RankOutOfRange {
            rank: 7,
            ranks: 2
        }))
    ));
}

/// Bad routing in device memory: caught by the kernel, typed at check(), the bad rank's outputs
/// untouched, no write outside any output of any rank, later calls refused.
fn gpu_device_bad_input_typed_error_no_stray_write() {
    let mut rng = Rng::new(77);
    for mode in [Mode::Bf16, Mode::FP8_UE8M0] {
        let cfg = Config::new(2, 8, 4, 512, 2, mode).unwrap();
        for path in [Path::PerExpert, Path::Batched] {
            for case in ["out of range", "below -1", "duplicate", "n above T"] {
                let mut g = group(&cfg, 1);
                let (_c, s) = context(0);
                let mut data =
                    random_inputs(&cfg, &[4, 4], Routing::Random { masked: 0.0 }, &mut rng);
                let k = cfg.top_k;
                let first = data[1].topk_idx[2 * k];
                match case {
                    "out of range" => data[1].topk_idx[2 * k + 1] = 8,
                    "below -1" => data[1].topk_idx[2 * k + 1] = -2,
                    "duplicate" => data[1].topk_idx[2 * k + 1] = first,
                    _ => {}
                }
                let mut ins: Vec<RankIn> = (0..2).map(|_| RankIn::new(&cfg, &s)).collect();
                for q in 0..2 {
                    ins[q].set(&s, &data[q], None);
                }
                let n1: i32 = if case == "n above T" { 5 } else { 4 };
                s.memcpy_htod(&[4i32], &mut ins[0].n).unwrap();
                s.memcpy_htod(&[n1], &mut ins[1].n).unwrap();
                let mut outs: Vec<RankOut> = (0..2).map(|_| RankOut::new(&g, &s)).collect();
                s.synchronize().unwrap();
                let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
                let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
                let nsv: Vec<_> = ins.iter().map(|i| i.n.slice(..)).collect();
                let dins: Vec<DispatchIn> = (0..2)
                    .map(|q| DispatchIn {
                        x: &xs[q],
                        topk_idx: &ts[q],
                        n_tokens: Tokens::Device(&nsv[q]),
                    })
                    .collect();
                {
                    let mut douts: Vec<DeviceDispatchOut> =
                        outs.iter_mut().map(|o| o.dispatch_out()).collect();
                    g.dispatch_device(path, &[&s], &dins, Some(&mut douts))
                        .unwrap();
                }
                s.synchronize().unwrap();
                let err = g.check().unwrap_err();
                println!("{} {} {case}: {err}", mode.name(), path.name());
                match (case, &err) {
                    (
                        "out of range",
                        GpuError::Contract(Error::ExpertOutOfRange {
                            rank: 1,
                            token: 2,
                            slot: 1,
                            expert: 8,
                            num_experts: 8,
                        }),
                    ) => {}
                    (
                        "below -1",
                        GpuError::Contract(Error::ExpertOutOfRange {
                            rank: 1,
                            token: 2,
                            slot: 1,
                            expert: -2,
                            ..
                        }),
                    ) => {}
                    (
                        "duplicate",
                        GpuError::Contract(Error::DuplicateExpert {
                            rank: 1,
                            token: 2,
                            first_slot: 0,
                            second_slot: 1,
                            expert,
                        }),
                    ) if *expert == first => {}
                    (
                        "n above T",
                        GpuError::Contract(Error::TooManyTokens {
                            rank: 1,
                            tokens: 5,
                            max: 4,
                        }),
                    ) => {}
                    _ => panic!("{case}: unexpected {err:?}"),
                }
                // The bad rank wrote no row; nobody wrote outside an output. Both ranks' calls
                // failed (rank 0's waits stop on the device's error), so both present the
                // contract's failed dispatch: every count and layout pair 0.
                outs[1].check_failed_dispatch(&s);
                outs[0].check_untouched(&s);
                for o in &outs {
                    assert!(o.count.read(&s, "recv_count").iter().all(|&c| c == 0));
                    assert!(o.layout.read(&s, "layout_range").iter().all(|&c| c == 0));
                }
                // Later calls are refused with the same error.
                let mut douts: Vec<DeviceDispatchOut> =
                    outs.iter_mut().map(|o| o.dispatch_out()).collect();
                assert_eq!(
                    g.dispatch_device(path, &[&s], &dins, Some(&mut douts))
                        .unwrap_err(),
                    err
                );
            }
        }
    }
}

const NEGATE_SRC: &str = r#"
extern "C" __global__ void ep_test_negate(const unsigned short* in, unsigned short* out, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = in[i] ^ 0x8000u;
}
"#;

/// The expert kernel of the graph test: y = -recv_x, bit for bit (bf16 sign flip).
fn negate(s: &Arc<CudaStream>, f: &cudarc::driver::CudaFunction, from: u64, to: u64, n: u64) {
    let mut b = s.launch_builder(f);
    b.arg(&from);
    b.arg(&to);
    b.arg(&n);
    // SAFETY: ep_test_negate(const u16*, u16*, u64): `from` and `to` hold n u16 each.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (64, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .unwrap();
}

fn dev_ptr<T>(s: &Arc<CudaStream>, b: &CudaSlice<T>) -> u64 {
    let (p, _g) = b.device_ptr(s);
    p
}

/// dispatch -> expert kernel -> combine captured in one graph on the caller's stream, replayed
/// 1000 times with fresh routing, token counts (through device memory) and x, every replay
/// checked bit for bit against the oracle. With `hook`, each call as its send and receive
/// halves with an unrelated kernel in between.
fn graph_case(path: Path, hook: bool) {
    graph_case_on(path, hook, false)
}

/// [`graph_case`]; with `nccl`, one rank over NCCL (self-send, capacity sizes) after one
/// uncaptured warm-up call, 200 replays.
fn graph_case_on(path: Path, hook: bool, nccl: bool) {
    let cfg = if nccl {
        Config::new(1, 4, 16, 256, 4, Mode::Bf16).unwrap()
    } else {
        Config::new(2, 8, 16, 256, 4, Mode::Bf16).unwrap()
    };
    let r = cfg.num_ranks;
    let (ctx, s) = context(0);
    let mut g = if nccl {
        let mut g = GpuGroup::new(&cfg, nccl_opts(1, NcclSizes::Capacity)).unwrap();
        let mut rng = Rng::new(17);
        let data = random_inputs(&cfg, &[9], Routing::Random { masked: 0.1 }, &mut rng);
        let y = random_y(&cfg, &mut rng);
        device_case(&mut g, std::slice::from_ref(&s), path, &data, &y, false);
        g
    } else {
        group(&cfg, 1)
    };
    let ptx = cudarc::nvrtc::compile_ptx(NEGATE_SRC).unwrap();
    let f = ctx
        .load_module(ptx)
        .unwrap()
        .load_function("ep_test_negate")
        .unwrap();
    let mut ins: Vec<RankIn> = (0..r).map(|_| RankIn::new(&cfg, &s)).collect();
    let mut outs: Vec<RankOut> = (0..r).map(|_| RankOut::new(&g, &s)).collect();
    let scratch = s.alloc_zeros::<u16>(4096).unwrap();
    let ylen = (cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden) as u64;
    s.synchronize().unwrap();
    let graph = {
        let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
        let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
        let ws: Vec<_> = ins.iter().map(|i| i.w.slice(..)).collect();
        let ys: Vec<_> = ins.iter().map(|i| as_bf16(&i.y)).collect();
        let nsv: Vec<_> = ins.iter().map(|i| i.n.slice(..)).collect();
        let dins: Vec<DispatchIn> = (0..r)
            .map(|q| DispatchIn {
                x: &xs[q],
                topk_idx: &ts[q],
                n_tokens: Tokens::Device(&nsv[q]),
            })
            .collect();
        let cins: Vec<CombineIn> = (0..r)
            .map(|q| CombineIn {
                y: &ys[q],
                topk_idx: &ts[q],
                topk_weights: &ws[q],
            })
            .collect();
        let recv: Vec<u64> = outs
            .iter()
            .map(|o| dev_ptr(&s, &o.recv_x.buf) + GUARD as u64)
            .collect();
        let yp: Vec<u64> = ins.iter().map(|i| dev_ptr(&s, &i.y)).collect();
        let sp = dev_ptr(&s, &scratch);
        s.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        let handle: DeviceHandle = {
            let mut douts: Vec<DeviceDispatchOut> =
                outs.iter_mut().map(|o| o.dispatch_out()).collect();
            if hook {
                let h = g
                    .dispatch_send(path, &[&s], &dins, Some(&mut douts))
                    .unwrap();
                negate(&s, &f, sp, sp, 4096); // other work between the halves
                g.dispatch_recv(h, &[&s]).unwrap()
            } else {
                g.dispatch_device(path, &[&s], &dins, Some(&mut douts))
                    .unwrap()
            }
        };
        for q in 0..r {
            negate(&s, &f, recv[q], yp[q], ylen);
        }
        {
            let mut fulls = out_views(&mut outs);
            let mut couts = inner(&mut fulls);
            if hook {
                let h = g.combine_send(&[&s], &handle, &cins, &mut couts).unwrap();
                negate(&s, &f, sp, sp, 4096);
                g.combine_recv(h, &[&s]).unwrap();
            } else {
                g.combine_device(&[&s], &handle, &cins, &mut couts).unwrap();
            }
        }
        s.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .unwrap()
    };
    let mut rng = Rng::new(5000 + hook as u64 * 7 + (path == Path::Batched) as u64);
    let t = cfg.max_tokens_per_rank;
    for rep in 0..if nccl { 200 } else { 1000 } {
        let tokens: Vec<usize> = (0..r).map(|_| rng.below(t + 1)).collect();
        let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
        for q in 0..r {
            ins[q].set(&s, &data[q], None);
            s.memcpy_htod(&[tokens[q] as i32], &mut ins[q].n).unwrap();
        }
        graph.launch().unwrap();
        s.synchronize().unwrap();
        g.check().unwrap_or_else(|e| panic!("replay {rep}: {e}"));
        let inputs: Vec<RankInput> = data
            .iter()
            .map(|d| RankInput {
                x: &d.x,
                topk_idx: &d.topk_idx,
            })
            .collect();
        let want = oracle::dispatch(&cfg, &inputs).unwrap();
        let y: Vec<Vec<bf16>> = want
            .iter()
            .map(|w| match &w.recv_x {
                RecvX::Bf16(v) => v
                    .iter()
                    .map(|b| bf16::from_bits(b.to_bits() ^ 0x8000))
                    .collect(),
                RecvX::Fp8(_) => unreachable!("bf16 config"),
            })
            .collect();
        let cin: Vec<CombineInput> = data
            .iter()
            .zip(&y)
            .map(|(d, y)| CombineInput {
                y,
                topk_idx: &d.topk_idx,
                topk_weights: &d.topk_weights,
            })
            .collect();
        let want_c = oracle::combine(&cfg, &cin).unwrap();
        for q in 0..r {
            if let Some(d) = outs[q].read_dispatch(&cfg, &s).diff(&want[q]) {
                panic!(
                    "{} hook={hook} replay {rep} rank {q} dispatch: {d}",
                    path.name()
                );
            }
            let n = want_c[q].len();
            let got: Vec<bf16> = outs[q].out.read(&s, "out")[..n]
                .iter()
                .map(|&b| bf16::from_bits(b))
                .collect();
            if let Some(d) = ep_reference::output::combine_diff(&got, &want_c[q], cfg.hidden) {
                panic!(
                    "{} hook={hook} replay {rep} rank {q} combine: {d}",
                    path.name()
                );
            }
        }
    }
    println!(
        "ok: {} hook={hook}: 1000 graph replays equal the oracle",
        path.name()
    );
}

fn gpu_graph_dispatch_expert_combine_1000_replays() {
    for path in [Path::PerExpert, Path::Batched] {
        graph_case(path, false);
    }
}

fn gpu_graph_with_receive_hook_split_1000_replays() {
    for path in [Path::PerExpert, Path::Batched] {
        graph_case(path, true);
    }
}

/// The device epochs started just below 2^32 (where u32 epochs wrapped to 0) and below the
/// signal tag's modulus (2^40 - 1): calls across both points stay bit-identical.
fn gpu_epochs_past_2_32_and_the_signal_tag_wrap() {
    let mut rng = Rng::new(4242);
    let cfg = Config::new(4, 16, 8, 512, 4, Mode::FP8).unwrap();
    for start in [(1u64 << 32) - 3, (1u64 << 40) - 5] {
        let mut g = group(&cfg, 1);
        g.set_epochs_for_test(start).unwrap();
        for round in 0..6 {
            let tokens: Vec<usize> = (0..4).map(|_| rng.below(9)).collect();
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            verify_case(&mut g, &data, &y)
                .unwrap_or_else(|e| panic!("start {start} round {round}: {e}"));
        }
        assert_eq!(g.calls(), [start + 6; 4]);
        println!("ok: 6 calls of each kind from epoch {start}");
    }
}

/// Process mode's one-rank face (RankEp) on a one-rank process-mode group: the caller's
/// stream, caller outputs, both paths, every mode, bit for bit against the oracle.
fn gpu_rank_ep_process_mode_equals_oracle() {
    let mut rng = Rng::new(91);
    let (_c, s) = context(0);
    for mode in MODES {
        let h = if mode == Mode::FP8 { 640 } else { 512 };
        let cfg = Config::new(1, 4, 16, h, 3, mode).unwrap();
        // One rank: its own payload is the whole exchange (the handshake and the node plan of
        // a process group are ep-group's; a rank of one maps no peer).
        let me = ProcessRank::new(&cfg, GpuOptions::default(), 0, 0).unwrap();
        let all = vec![me.payload().to_vec()];
        let plan = PeerPlan {
            nccl_mask: 0,
            ipc_peers: Vec::new(),
            nodes: 1,
        };
        let mut g = me.join(&all, &plan).unwrap();
        for path in [Path::PerExpert, Path::Batched] {
            let n = rng.below(17);
            let data = random_inputs(&cfg, &[n], Routing::Random { masked: 0.1 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            let mut inp = RankIn::new(&cfg, &s);
            inp.set(&s, &data[0], Some(&y[0]));
            let mut out = RankOut::new(&g, &s);
            s.synchronize().unwrap();
            let (x, t, w, yv) = (
                as_bf16(&inp.x),
                inp.topk.slice(..),
                inp.w.slice(..),
                as_bf16(&inp.y),
            );
            let mut ep = g.rank_ep().unwrap();
            let handle = {
                let mut o = out.dispatch_out();
                ep.dispatch(path, &s, &x, &t, Tokens::Host(n), Some(&mut o))
                    .unwrap()
            };
            {
                let mut fulls = out_views(std::slice::from_mut(&mut out));
                let mut couts = inner(&mut fulls);
                ep.combine(&s, &yv, &t, &w, &handle, &mut couts[0]).unwrap();
            }
            s.synchronize().unwrap();
            ep.check().unwrap();
            let (want, want_c) = oracle_of(&cfg, &data, &y);
            if let Some(d) = out.read_dispatch(&cfg, &s).diff(&want[0]) {
                panic!("RankEp {} {}: {d}", path.name(), cfg.describe());
            }
            let got: Vec<bf16> = out.out.read(&s, "out")[..n * h]
                .iter()
                .map(|&b| bf16::from_bits(b))
                .collect();
            if let Some(d) = ep_reference::output::combine_diff(&got, &want_c[0], h) {
                panic!("RankEp {} combine {}: {d}", path.name(), cfg.describe());
            }
            // A combine with another topk_idx tensor than the dispatched one is refused.
            let other = s.clone_htod(&vec![-1i64; 16 * 3]).unwrap();
            let ov = other.slice(..);
            let mut fulls = out_views(std::slice::from_mut(&mut out));
            let mut couts = inner(&mut fulls);
            assert!(matches!(
                g.rank_ep()
                    .unwrap()
                    .combine(&s, &yv, &ov, &w, &handle, &mut couts[0]),
                Err(GpuError::Handle(_))
            ));
        }
        println!("ok: RankEp (process mode) {} both paths", cfg.describe());
    }
}

const SPIN_SRC: &str = r#"
extern "C" __global__ void ep_test_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"#;

/// The spin kernel, loaded on `s`'s context.
fn spin_kernel(s: &Arc<CudaStream>) -> cudarc::driver::CudaFunction {
    let ptx = cudarc::nvrtc::compile_ptx(SPIN_SRC).unwrap();
    s.context().load_module(ptx).unwrap().load_function("ep_test_spin").unwrap()
}

/// Keeps stream `s` busy for `ns` nanoseconds (one thread spinning on %globaltimer).
fn spin(s: &Arc<CudaStream>, f: &cudarc::driver::CudaFunction, ns: u64) {
    let mut b = s.launch_builder(f);
    b.arg(&ns);
    // SAFETY: ep_test_spin(u64) takes one value and touches no memory.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .unwrap();
}

/// cuStreamQuery of stream `s` (NOT_READY: work queued or running; no wait).
fn query(s: &Arc<CudaStream>) -> cudarc::driver::sys::CUresult {
    s.context().bind_to_thread().unwrap();
    // SAFETY: a live stream of the bound context.
    unsafe { cudarc::driver::sys::cuStreamQuery(s.cu_stream()) }
}

/// Device-API dispatch of every rank into `outs` on stream `s`, token counts on the host.
fn dispatch_all(
    g: &mut GpuGroup,
    path: Path,
    s: &Arc<CudaStream>,
    ins: &[RankIn],
    n: &[usize],
    outs: &mut [RankOut],
) -> Result<DeviceHandle, GpuError> {
    let xs: Vec<_> = ins.iter().map(|i| as_bf16(&i.x)).collect();
    let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
    let dins: Vec<DispatchIn> = (0..ins.len())
        .map(|q| DispatchIn {
            x: &xs[q],
            topk_idx: &ts[q],
            n_tokens: Tokens::Host(n[q]),
        })
        .collect();
    let mut douts: Vec<DeviceDispatchOut> = outs.iter_mut().map(|o| o.dispatch_out()).collect();
    g.dispatch_device(path, &[s.as_ref()], &dins, Some(&mut douts))
}

/// Device-API combine of every rank into `outs` on stream `s`.
fn combine_all(
    g: &mut GpuGroup,
    s: &Arc<CudaStream>,
    h: &DeviceHandle,
    ins: &[RankIn],
    outs: &mut [RankOut],
) -> Result<(), GpuError> {
    let ts: Vec<_> = ins.iter().map(|i| i.topk.slice(..)).collect();
    let ws: Vec<_> = ins.iter().map(|i| i.w.slice(..)).collect();
    let ys: Vec<_> = ins.iter().map(|i| as_bf16(&i.y)).collect();
    let cins: Vec<CombineIn> = (0..ins.len())
        .map(|q| CombineIn {
            y: &ys[q],
            topk_idx: &ts[q],
            topk_weights: &ws[q],
        })
        .collect();
    let mut fulls = out_views(outs);
    let mut couts = inner(&mut fulls);
    g.combine_device(&[s.as_ref()], h, &cins, &mut couts)
}

/// Polls `g` (no sync) until it reports an error, at most 5 s.
fn poll_until_error(g: &GpuGroup) -> GpuError {
    let t0 = std::time::Instant::now();
    loop {
        if let Err(e) = g.poll() {
            return e;
        }
        assert!(t0.elapsed().as_secs() < 5, "no error reached the host in 5 s");
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// [issue 20 item 1] A peer that never signals: its waiting ranks' kernels record a timeout,
/// which reaches the host through the error word's mirror while the stream is still busy (a
/// 2 s spin queued behind the failed call), and the next call raises it at its entry. The
/// failed call's outputs are the contract's: dispatch presents no row (every count and layout
/// pair 0), combine's rows are NaN; nothing outside the outputs is written.
fn gpu_error_reaches_the_next_call_without_a_sync() {
    let mut rng = Rng::new(21);
    for path in [Path::Batched, Path::PerExpert] {
        for op in [Op::Dispatch, Op::Combine] {
            let cfg = Config::new(4, 8, 8, 256, 2, Mode::Bf16).unwrap();
            // zero_copy off: combine signals even between ranks of one GPU.
            let mut g = group_with(&cfg, 1, false);
            g.set_timeout_ns(50_000_000);
            let (_c, s) = context(0);
            let spinner = spin_kernel(&s);
            let data = random_inputs(&cfg, &[8; 4], Routing::Random { masked: 0.0 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            let mut ins: Vec<RankIn> = (0..4).map(|_| RankIn::new(&cfg, &s)).collect();
            for q in 0..4 {
                ins[q].set(&s, &data[q], Some(&y[q]));
            }
            let mut outs: Vec<RankOut> = (0..4).map(|_| RankOut::new(&g, &s)).collect();
            let n = [8usize; 4];
            // Call 1 is fine.
            let h = dispatch_all(&mut g, path, &s, &ins, &n, &mut outs).unwrap();
            combine_all(&mut g, &s, &h, &ins, &mut outs).unwrap();
            s.synchronize().unwrap();
            g.poll().unwrap();
            // Call 2: rank 2 never signals (in the op under test).
            let h = match op {
                Op::Dispatch => {
                    g.set_fault_rank(Some(2));
                    dispatch_all(&mut g, path, &s, &ins, &n, &mut outs).unwrap()
                }
                Op::Combine => {
                    let h = dispatch_all(&mut g, path, &s, &ins, &n, &mut outs).unwrap();
                    s.synchronize().unwrap();
                    g.poll().unwrap();
                    g.set_fault_rank(Some(2));
                    combine_all(&mut g, &s, &h, &ins, &mut outs).unwrap();
                    h
                }
            };
            // A 2 s spin behind the failed call: the error must reach the host while it runs.
            spin(&s, &spinner, 2_000_000_000);
            let t0 = std::time::Instant::now();
            let err = poll_until_error(&g);
            let seen = t0.elapsed();
            let rc = query(&s);
            let t1 = std::time::Instant::now();
            s.synchronize().unwrap();
            let drained = t1.elapsed();
            println!(
                "{} {op:?}: {err} (on the host after {seen:?}; then cuStreamQuery {rc:?}, and \
                 the stream drained {drained:?} later)",
                path.name()
            );
            assert!(
                drained.as_millis() > 500,
                "the error was read only after the stream drained (or the spin did not run)"
            );
            match &err {
                GpuError::Contract(Error::Timeout {
                    peer: 2,
                    phase,
                    call,
                    rank,
                    ..
                }) => {
                    assert!(*rank < 4);
                    assert_eq!((phase.op, phase.side), (op, Side::Recv));
                    assert_eq!(*call, 2);
                }
                other => panic!("expected a timeout naming peer 2, got {other}"),
            }
            // The next call raises the same error at its entry, before anything is enqueued.
            let again = match op {
                Op::Dispatch => dispatch_all(&mut g, path, &s, &ins, &n, &mut outs).map(|_| ()),
                Op::Combine => combine_all(&mut g, &s, &h, &ins, &mut outs),
            };
            assert_eq!(again.unwrap_err(), err);
            for (q, o) in outs.iter().enumerate() {
                o.check_untouched(&s); // guards: nothing written outside an output
                match op {
                    Op::Dispatch => {
                        assert!(o.count.read(&s, "recv_count").iter().all(|&c| c == 0), "rank {q}: counts of a failed dispatch");
                        assert!(o.layout.read(&s, "layout_range").iter().all(|&c| c == 0), "rank {q}: layout of a failed dispatch");
                    }
                    Op::Combine => {
                        let out = o.out.read(&s, "out");
                        assert!(out[..8 * 256].iter().all(|&b| b == 0x7FFF), "rank {q}: rows of a failed combine");
                        assert!(out[8 * 256..].iter().all(|&b| b == 0x4321), "rank {q}: combine wrote past n");
                    }
                }
            }
        }
    }
}

/// Set in the child process of the trap test.
const TRAP_CHILD: &str = "EP_GPU_TEST_TRAP_CHILD";

/// The trap test's child: a group with `trap_on_error`, a peer that never signals. Prints the
/// stream's CUDA error and the error the host mirror names, then exits 0 (1 when something
/// else happened).
fn trap_child() -> ! {
    let mut rng = Rng::new(5);
    let cfg = Config::new(2, 4, 4, 256, 2, Mode::Bf16).unwrap();
    let mut g = GpuGroup::new(
        &cfg,
        GpuOptions {
            trap_on_error: true,
            timeout_ns: 50_000_000,
            ..GpuOptions::default()
        },
    )
    .unwrap();
    let data = random_inputs(&cfg, &[4; 2], Routing::Random { masked: 0.0 }, &mut rng);
    let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
    let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
    g.dispatch(Path::Batched, &x, &idx).unwrap();
    g.set_fault_rank(Some(1));
    let r = g.dispatch(Path::Batched, &x, &idx);
    println!("trap child: call 2: {r:?}");
    println!("trap child: mirror: {:?}", g.poll());
    let named = matches!(
        g.poll(),
        Err(GpuError::Contract(Error::Timeout { peer: 1, .. }))
    );
    // A trap leaves the context unusable: a fresh allocation on it fails.
    let dead = CudaContext::new(0)
        .and_then(|c| c.default_stream().alloc_zeros::<u8>(16).map(|_| ()))
        .is_err();
    let trapped = r.is_err() && dead;
    println!("trap child: trapped={trapped} named={named}");
    std::process::exit(if trapped && named { 0 } else { 1 })
}

/// [issue 20 item 2] `trap_on_error`: the kernel traps (the context is lost, as with DeepEP's
/// kernels), and the error is still named from the host mirror. Runs in a child process: a
/// trap poisons the context of the process it happens in.
fn gpu_trap_on_error_ends_the_context_and_still_names_the_error() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .env(TRAP_CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "trap child: {:?}", out.status);
    assert!(text.contains("trapped=true named=true"));
}

/// [issue 20 item 3] Shrink mode (DeepEP's `enable_shrink`), 4 virtual ranks, both paths, BF16
/// and FP8: rank 2 stops signalling (in dispatch, then separately in combine): its peers mask
/// it instead of failing, and every survivor's outputs equal the oracle on the masked routing,
/// in the call that lost it and after; every survivor's mask names it. A later call skips it
/// without waiting. `clean_mask` brings every rank back; `update_mask` masks by hand.
fn gpu_shrink_masks_a_lost_peer_and_the_group_goes_on() {
    use ep_kernels::testing::verify_masked;
    let mut rng = Rng::new(33);
    let none = [false; 4];
    let lost2 = [false, false, true, false];
    for mode in [Mode::Bf16, Mode::FP8] {
        for path in [Path::Batched, Path::PerExpert] {
            for fail_in in [Op::Dispatch, Op::Combine] {
                let cfg = Config::new(4, 8, 8, 256, 3, mode).unwrap();
                let mut g = GpuGroup::new(
                    &cfg,
                    GpuOptions {
                        enable_shrink: true,
                        zero_copy_local: false,
                        timeout_ns: 50_000_000,
                        ..test_opts()
                    },
                )
                .unwrap();
                let what = format!("{} {} fail in {fail_in:?}", mode.name(), path.name());
                let call = |g: &mut GpuGroup, masked: &[bool; 4], rng: &mut Rng| {
                    let tokens: Vec<usize> = (0..4).map(|_| rng.below(9)).collect();
                    let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, rng);
                    let y = random_y(&cfg, rng);
                    verify_masked(g, path, &data, &y, masked)
                        .unwrap_or_else(|e| panic!("{what}: {e}"))
                };
                call(&mut g, &none, &mut rng);
                let survivors = [0usize, 1, 3];
                for r in 0..4 {
                    assert_eq!(g.mask_status(r).unwrap(), none.to_vec());
                }
                match fail_in {
                    Op::Dispatch => g.set_fault_rank(Some(2)),
                    Op::Combine => {
                        // The dispatch of this call is whole; rank 2 stops in its combine.
                        let tokens = [8usize; 4];
                        let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.0 }, &mut rng);
                        let y = random_y(&cfg, &mut rng);
                        let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
                        let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
                        let w: Vec<_> = data.iter().map(|d| d.topk_weights.clone()).collect();
                        g.dispatch(path, &x, &idx).unwrap();
                        g.set_fault_rank(Some(2));
                        let got = g.combine(path, &y, &w).unwrap();
                        // The rows are where this call's (whole) dispatch put them; the slots of
                        // rank 2's experts drop out of the sums. A zero weight drops a slot bit
                        // for bit (fmaf(0, y, acc) == acc for finite y: acc starts at +0 and an
                        // fmaf onto +0 never yields -0).
                        let l = cfg.num_local_experts() as i64;
                        let w0: Vec<Vec<f32>> = (0..4)
                            .map(|r| {
                                w[r].iter()
                                    .zip(&idx[r])
                                    .map(|(&wt, &e)| if e >= 0 && e / l == 2 { 0.0 } else { wt })
                                    .collect()
                            })
                            .collect();
                        let cin: Vec<CombineInput> = (0..4)
                            .map(|r| CombineInput {
                                y: &y[r],
                                topk_idx: &idx[r],
                                topk_weights: &w0[r],
                            })
                            .collect();
                        let want = oracle::combine(&cfg, &cin).unwrap();
                        for &r in &survivors {
                            if let Some(d) = ep_reference::output::combine_diff(&got[r], &want[r], cfg.hidden) {
                                panic!("{what}: combine that lost rank 2, rank {r}: {d}");
                            }
                        }
                    }
                }
                // The call that loses rank 2 (dispatch case), then one with rank 2 masked.
                let t0 = std::time::Instant::now();
                let checked = call(&mut g, &lost2, &mut rng);
                let first = t0.elapsed();
                let t1 = std::time::Instant::now();
                call(&mut g, &lost2, &mut rng);
                let later = t1.elapsed();
                assert_eq!(checked, 3);
                g.poll().unwrap();
                for &r in &survivors {
                    assert_eq!(g.mask_status(r).unwrap(), lost2.to_vec(), "{what}: rank {r}'s mask");
                }
                println!("ok: {what}: survivors equal the masked oracle; calls after the loss took {first:?} and {later:?} (wait bound 50 ms)");
                // Everyone back: clean on every rank (one process here), rank 2 signals again.
                g.clean_mask(None).unwrap();
                g.set_fault_rank(None);
                call(&mut g, &none, &mut rng);
                for r in 0..4 {
                    assert_eq!(g.mask_status(r).unwrap(), none.to_vec(), "{what}: cleaned");
                }
                // By hand: rank 1 masked on every rank (rank 1 too: its outputs carry no meaning).
                g.update_mask(None, 1, true).unwrap();
                call(&mut g, &[false, true, false, false], &mut rng);
                g.clean_mask(None).unwrap();
                call(&mut g, &none, &mut rng);
                g.poll().unwrap();
            }
        }
    }
}
