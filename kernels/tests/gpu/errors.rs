//! Errors after the fact: an error reaches the next call without a sync, `trap_on_error` ends
//! the context and still names the error, shrink mode masks a lost peer.

use crate::common::*;
use crate::device::*;
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use ep_kernels::testing::{random_inputs, random_y, Rng, Routing};
use ep_kernels::{CombineIn, DeviceDispatchOut, DeviceHandle, DispatchIn, Tokens};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, Path};
use ep_reference::oracle::{self, CombineInput};
use ep_reference::{Config, Error, Mode, Op, Side};
use ep_test_runner::{gpu_test, GpuTest};
use std::sync::Arc;

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_error_reaches_the_next_call_without_a_sync, gpus: 1),
    gpu_test!(gpu_trap_on_error_ends_the_context_and_still_names_the_error, gpus: 1),
    gpu_test!(gpu_shrink_masks_a_lost_peer_and_the_group_goes_on, gpus: 1),
];

pub(crate) const SPIN_SRC: &str = r#"
extern "C" __global__ void ep_test_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"#;

/// The spin kernel, loaded on `s`'s context.
pub(crate) fn spin_kernel(s: &Arc<CudaStream>) -> cudarc::driver::CudaFunction {
    let ptx = cudarc::nvrtc::compile_ptx(SPIN_SRC).unwrap();
    s.context()
        .load_module(ptx)
        .unwrap()
        .load_function("ep_test_spin")
        .unwrap()
}

/// Keeps stream `s` busy for `ns` nanoseconds (one thread spinning on %globaltimer).
pub(crate) fn spin(s: &Arc<CudaStream>, f: &cudarc::driver::CudaFunction, ns: u64) {
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
pub(crate) fn query(s: &Arc<CudaStream>) -> cudarc::driver::sys::CUresult {
    s.context().bind_to_thread().unwrap();
    // SAFETY: a live stream of the bound context.
    unsafe { cudarc::driver::sys::cuStreamQuery(s.cu_stream()) }
}

/// Device-API dispatch of every rank into `outs` on stream `s`, token counts on the host.
pub(crate) fn dispatch_all(
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
pub(crate) fn combine_all(
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
pub(crate) fn poll_until_error(g: &GpuGroup) -> GpuError {
    let t0 = std::time::Instant::now();
    loop {
        if let Err(e) = g.poll() {
            return e;
        }
        assert!(
            t0.elapsed().as_secs() < 5,
            "no error reached the host in 5 s"
        );
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// A peer that never signals: its waiting ranks' kernels record a timeout,
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
                        assert!(
                            o.count.read(&s, "recv_count").iter().all(|&c| c == 0),
                            "rank {q}: counts of a failed dispatch"
                        );
                        assert!(
                            o.layout.read(&s, "layout_range").iter().all(|&c| c == 0),
                            "rank {q}: layout of a failed dispatch"
                        );
                    }
                    Op::Combine => {
                        let out = o.out.read(&s, "out");
                        assert!(
                            out[..8 * 256].iter().all(|&b| b == 0x7FFF),
                            "rank {q}: rows of a failed combine"
                        );
                        assert!(
                            out[8 * 256..].iter().all(|&b| b == 0x4321),
                            "rank {q}: combine wrote past n"
                        );
                    }
                }
            }
        }
    }
}

/// Set in the child process of the trap test.
pub(crate) const TRAP_CHILD: &str = "EP_GPU_TEST_TRAP_CHILD";

/// The trap test's child: a group with `trap_on_error`, a peer that never signals. Prints the
/// stream's CUDA error and the error the host mirror names, then exits 0 (1 when something
/// else happened).
pub(crate) fn trap_child() -> ! {
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

/// `trap_on_error`: the kernel traps (the context is lost, as with DeepEP's
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

/// Shrink mode (DeepEP's `enable_shrink`), 4 virtual ranks, both paths, BF16
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
                let mut g = GpuGroup::new(&cfg, shrink_opts()).unwrap();
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
                        let data =
                            random_inputs(&cfg, &tokens, Routing::Random { masked: 0.0 }, &mut rng);
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
                            if let Some(d) =
                                ep_reference::output::combine_diff(&got[r], &want[r], cfg.hidden)
                            {
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
                    assert_eq!(
                        g.mask_status(r).unwrap(),
                        lost2.to_vec(),
                        "{what}: rank {r}'s mask"
                    );
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
