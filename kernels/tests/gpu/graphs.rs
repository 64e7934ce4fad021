//! CUDA graphs (dispatch, an expert kernel, combine; the receive-hook split) replayed 1000
//! times, epochs past 2^32, and one rank per process through the device API.

use crate::common::*;
use crate::device::*;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use ep_kernels::runtime::{PeerMask, PeerPlan, ProcessRank};
use ep_kernels::testing::{random_inputs, random_y, verify_case, Rng, Routing};
use ep_kernels::{CombineIn, DeviceDispatchOut, DeviceHandle, DispatchIn, Tokens};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, NcclSizes, Path};
use ep_reference::oracle::{self, CombineInput};
use ep_reference::RecvX;
use ep_reference::{CombineFormat, Config, Mode};
use ep_test_runner::{gpu_test, GpuTest};
use half::bf16;
use std::sync::Arc;

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_graph_dispatch_expert_combine_1000_replays, gpus: 1),
    gpu_test!(gpu_graph_with_receive_hook_split_1000_replays, gpus: 1),
    gpu_test!(gpu_epochs_past_2_32_and_the_signal_tag_wrap, gpus: 1),
    gpu_test!(gpu_rank_ep_process_mode_equals_oracle, gpus: 1),
];

pub(crate) const NEGATE_SRC: &str = r#"
extern "C" __global__ void ep_test_negate(const unsigned short* in, unsigned short* out, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        out[i] = in[i] ^ 0x8000u;
}
"#;

/// The expert kernel of the graph test: y = -recv_x, bit for bit (bf16 sign flip).
pub(crate) fn negate(
    s: &Arc<CudaStream>,
    f: &cudarc::driver::CudaFunction,
    from: u64,
    to: u64,
    n: u64,
) {
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

pub(crate) fn dev_ptr<T>(s: &Arc<CudaStream>, b: &CudaSlice<T>) -> u64 {
    let (p, _g) = b.device_ptr(s);
    p
}

/// dispatch -> expert kernel -> combine captured in one graph on the caller's stream, replayed
/// 1000 times with fresh routing, token counts (through device memory) and x, every replay
/// checked bit for bit against the oracle. With `hook`, each call as its send and receive
/// halves with an unrelated kernel in between.
pub(crate) fn graph_case(path: Path, hook: bool) {
    graph_case_on(path, hook, false)
}

/// [`graph_case`]; with `nccl`, one rank over NCCL (self-send, capacity sizes) after one
/// uncaptured warm-up call, 200 replays.
pub(crate) fn graph_case_on(path: Path, hook: bool, nccl: bool) {
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
        let inputs = ep_kernels::testing::rank_inputs(&data);
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
            nccl_mask: PeerMask::EMPTY,
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
            let (want, want_c) = oracle_of(&cfg, &data, &y, CombineFormat::Bf16);
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
            // A copy of the dispatched routing at another address (vLLM's EPLB passes one)
            // combines bit for bit alike; a tensor too short for the dispatched tokens is a
            // shape error.
            if n == 0 {
                continue;
            }
            let other = s.clone_htod(&data[0].topk_idx).unwrap();
            let ov = other.slice(..);
            {
                let mut fulls = out_views(std::slice::from_mut(&mut out));
                let mut couts = inner(&mut fulls);
                g.rank_ep()
                    .unwrap()
                    .combine(&s, &yv, &ov, &w, &handle, &mut couts[0])
                    .unwrap();
            }
            s.synchronize().unwrap();
            let again: Vec<bf16> = out.out.read(&s, "out")[..n * h]
                .iter()
                .map(|&b| bf16::from_bits(b))
                .collect();
            assert_eq!(bits(&again), bits(&got), "combine with a copy of topk_idx");
            let short = s.clone_htod(&vec![-1i64; 1]).unwrap();
            let sv1 = short.slice(..);
            let mut fulls = out_views(std::slice::from_mut(&mut out));
            let mut couts = inner(&mut fulls);
            assert!(matches!(
                g.rank_ep()
                    .unwrap()
                    .combine(&s, &yv, &sv1, &w, &handle, &mut couts[0]),
                Err(GpuError::Contract(ep_reference::Error::ShapeMismatch {
                    tensor: "topk_idx",
                    ..
                }))
            ));
        }
        println!("ok: RankEp (process mode) {} both paths", cfg.describe());
    }
}
