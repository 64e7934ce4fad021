//! The NCCL transport: both paths and both sizings against the oracle, bad input as a typed
//! error, the device API in capacity mode.

use crate::common::*;
use crate::device::*;
use crate::graphs::*;
use cudarc::driver::CudaStream;
use ep_kernels::testing::{random_inputs, random_y, verify_paths, Rng, Routing};
use ep_kernels::{DeviceDispatchOut, DispatchIn, Tokens};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, NcclSizes, Path, Transport};
use ep_reference::{Config, Error, Mode};
use ep_test_runner::{gpu_test, GpuTest};
use std::sync::Arc;

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_nccl_r1_self_send_both_paths_both_sizes_equal_oracle, gpus: 1, nccl),
    gpu_test!(gpu_nccl_two_gpus_r2_both_paths_both_sizes_equal_oracle, gpus: 2, nccl),
    gpu_test!(gpu_nccl_bad_input_is_a_typed_error_both_sizes, gpus: 1, nccl),
    gpu_test!(gpu_nccl_two_gpus_bad_input_is_a_typed_error_both_sizes, gpus: 2, nccl),
    gpu_test!(gpu_nccl_device_api_capacity_equals_oracle_and_graph_replays, gpus: 1, nccl),
    gpu_test!(gpu_nccl_two_gpus_device_api_capacity_equals_oracle, gpus: 2, nccl),
];

/// The NCCL transport forced on R ranks over R GPUs with `sizes`: random configs in every mode
/// (3 rounds on the same buffers, uneven and empty ranks) and the standard setting, bitwise.
/// Exact sizes: both paths (per-expert: one NCCL message per (peer, local expert)). Capacity:
/// the batched path; per-expert is refused with a typed error naming exact sizes.
pub(crate) fn nccl_case(r: usize, seed: u64, sizes: NcclSizes) -> usize {
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
            let tokens = round_tokens(r, t, round, &mut rng);
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
pub(crate) fn nccl_bad_input(r: usize) {
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
        // Not silent on the peer: rank 0 took rank 1's poisoned header for what it is.
        match &words[0] {
            Some(GpuError::PeerFailed {
                rank: 0, peer: 1, ..
            }) => {}
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
pub(crate) fn nccl_device_case(r: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let cs: Vec<_> = (0..r).map(context).collect();
    let streams: Vec<Arc<CudaStream>> = cs.iter().map(|c| c.1.clone()).collect();
    for mode in MODES {
        let h = if mode == Mode::FP8 { 640 } else { 512 };
        let cfg = Config::new(r, 3 * r, 16, h, 3, mode).unwrap();
        let mut g = GpuGroup::new(&cfg, nccl_opts(r, NcclSizes::Capacity)).unwrap();
        for (round, owned) in [false, true, false].into_iter().enumerate() {
            let tokens = round_tokens(r, 16, round, &mut rng);
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
