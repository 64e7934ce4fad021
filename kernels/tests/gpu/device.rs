//! The device API: dispatch and combine on device tensors on the caller's stream, against the
//! oracle, with guard elements around every output; host-side checks; bad input.

use crate::common::*;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaViewMut, DeviceRepr};
use ep_kernels::runtime::probe_devices;
use ep_kernels::testing::{random_inputs, random_y, Rng, Routing};
use ep_kernels::{CombineIn, CombineOpts, DeviceDispatchOut, DispatchIn, Tokens};
use ep_kernels::{GpuError, GpuGroup, Path};
use ep_reference::oracle::{self, CombineInput};
use ep_reference::{CombineFormat, Config, Error, Mode};
use ep_reference::{DispatchOutput, RecvScales, RecvX};
use ep_test_runner::{gpu_test, GpuTest};
use half::bf16;
use std::sync::Arc;

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_device_api_r1_r2_r4_r8_all_modes_equal_oracle, gpus: 1),
    gpu_test!(gpu_device_api_two_gpus_r2_r4_equal_oracle, gpus: 2),
    gpu_test!(gpu_device_api_checks_stream_and_shapes_on_the_host, gpus: 1),
    gpu_test!(gpu_device_bad_input_typed_error_no_stray_write, gpus: 1),
];

pub(crate) const GUARD: usize = 96;

/// A device buffer of `len` elements with `GUARD` elements of a known value on each side.
pub(crate) struct Guarded<T> {
    pub(crate) buf: CudaSlice<T>,
    pub(crate) len: usize,
    pub(crate) fill: T,
}

impl<T: DeviceRepr + Copy + PartialEq + std::fmt::Debug + Default> Guarded<T> {
    pub(crate) fn new(s: &Arc<CudaStream>, len: usize, fill: T) -> Self {
        Guarded {
            buf: s.clone_htod(&vec![fill; len + 2 * GUARD]).unwrap(),
            len,
            fill,
        }
    }
    pub(crate) fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.buf.slice_mut(GUARD..GUARD + self.len)
    }
    /// The inside; panics when a guard element changed (a stray write).
    pub(crate) fn read(&self, s: &Arc<CudaStream>, what: &str) -> Vec<T> {
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
pub(crate) struct RankOut {
    pub(crate) recv_x: Guarded<u8>,
    pub(crate) scales: Option<Guarded<u8>>,
    pub(crate) count: Guarded<i32>,
    pub(crate) layout: Guarded<i64>,
    pub(crate) src: Guarded<i32>,
    pub(crate) out: Guarded<u16>,
    /// DeepEP's cumulative_local_expert_recv_stats `[L]` and dispatch_wait_recv_cost_stats
    /// `[R]`, from zero: a good dispatch adds its counts and its waits.
    pub(crate) recv_stats: Guarded<i32>,
    pub(crate) wait_stats: Guarded<i64>,
}

impl RankOut {
    pub(crate) fn new(g: &GpuGroup, s: &Arc<CudaStream>) -> RankOut {
        let z = g.dispatch_out_sizes();
        let cfg = g.config();
        RankOut {
            recv_x: Guarded::new(s, z.recv_x_bytes, 0xA5),
            scales: (z.recv_scales_bytes > 0).then(|| Guarded::new(s, z.recv_scales_bytes, 0x5A)),
            count: Guarded::new(s, z.recv_count, -7),
            layout: Guarded::new(s, z.layout_range, -9),
            src: Guarded::new(s, z.src_info, -11),
            out: Guarded::new(s, cfg.max_tokens_per_rank * cfg.hidden, 0x4321),
            recv_stats: Guarded::new(s, cfg.num_local_experts(), 0),
            wait_stats: Guarded::new(s, cfg.num_ranks, 0),
        }
    }
    pub(crate) fn dispatch_out(&mut self) -> DeviceDispatchOut<'_> {
        DeviceDispatchOut {
            recv_x: self.recv_x.view_mut(),
            recv_scales: self.scales.as_mut().map(|g| g.view_mut()),
            recv_count: self.count.view_mut(),
            layout_range: self.layout.view_mut(),
            src_info: self.src.view_mut(),
            recv_stats: Some(self.recv_stats.view_mut()),
            wait_stats: Some(self.wait_stats.view_mut()),
        }
    }
    /// The dispatch output in the oracle's form (guards checked).
    pub(crate) fn read_dispatch(&self, cfg: &Config, s: &Arc<CudaStream>) -> DispatchOutput {
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
    pub(crate) fn check_untouched(&self, s: &Arc<CudaStream>) {
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
pub(crate) struct RankIn {
    pub(crate) x: CudaSlice<u16>,
    pub(crate) topk: CudaSlice<i64>,
    pub(crate) w: CudaSlice<f32>,
    pub(crate) y: CudaSlice<u16>,
    pub(crate) n: CudaSlice<i32>,
}

pub(crate) fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|b| b.to_bits()).collect()
}

/// A u16 buffer seen as bf16.
pub(crate) fn as_bf16(s: &CudaSlice<u16>) -> cudarc::driver::CudaView<'_, bf16> {
    // SAFETY: u16 and bf16 have the same size, and every bit pattern is a valid bf16.
    unsafe { s.transmute::<bf16>(s.len()).unwrap() }
}

impl RankIn {
    pub(crate) fn new(cfg: &Config, s: &Arc<CudaStream>) -> RankIn {
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
    pub(crate) fn set(
        &mut self,
        s: &Arc<CudaStream>,
        d: &ep_kernels::testing::RankData,
        y: Option<&[bf16]>,
    ) {
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

pub(crate) fn context(ordinal: usize) -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = CudaContext::new(ordinal).unwrap();
    // SAFETY: nothing of this context is in use yet; the tests order their work on one stream
    // per GPU themselves (and graph capture must not see cudarc's cross-stream events).
    unsafe { ctx.disable_event_tracking() };
    let s = ctx.new_stream().unwrap();
    (ctx, s)
}

pub(crate) fn oracle_of(
    cfg: &Config,
    data: &[ep_kernels::testing::RankData],
    y: &[Vec<bf16>],
    format: CombineFormat,
) -> (Vec<DispatchOutput>, Vec<Vec<bf16>>) {
    let inputs = ep_kernels::testing::rank_inputs(data);
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
    (want, oracle::combine_with(cfg, &cin, format).unwrap())
}

/// How [`device_case_with`] runs a case.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Case {
    /// The dispatch's outputs in the group's own buffers (else in guarded caller buffers).
    pub(crate) owned: bool,
    /// The combine's row format.
    pub(crate) format: CombineFormat,
    /// The combine as its send half and receive half (else one whole call).
    pub(crate) halves: bool,
}

/// [`device_case_with`] with a whole bf16 combine; a refusal panics.
pub(crate) fn device_case(
    g: &mut GpuGroup,
    streams: &[Arc<CudaStream>],
    path: Path,
    data: &[ep_kernels::testing::RankData],
    y: &[Vec<bf16>],
    owned: bool,
) {
    let case = Case {
        owned,
        format: CombineFormat::Bf16,
        halves: false,
    };
    device_case_with(g, streams, path, data, y, case)
        .unwrap_or_else(|e| panic!("device {} combine refused: {e}", path.name()));
}

/// Device-API dispatch + combine of every rank, the dispatch's outputs in caller buffers
/// (guarded) or in the group's own buffers, the combine's in guarded caller buffers, in
/// `case.format`, whole or as its two halves; compared bit for bit with the oracle (a
/// difference panics), the statistics checked. `Err`: the combine call's refusal (nothing was
/// enqueued for it).
pub(crate) fn device_case_with(
    g: &mut GpuGroup,
    streams: &[Arc<CudaStream>],
    path: Path,
    data: &[ep_kernels::testing::RankData],
    y: &[Vec<bf16>],
    case: Case,
) -> Result<(), GpuError> {
    let Case {
        owned,
        format,
        halves,
    } = case;
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
    // combine_wait_recv_cost_stats, from zero (the caller's; apart from `outs`, which the
    // combine's output views borrow).
    let mut cwaits: Vec<Guarded<i64>> = (0..r).map(|q| Guarded::new(st(q), r, 0)).collect();
    {
        let mut fulls = out_views(&mut outs);
        let mut couts = inner(&mut fulls);
        let mut wviews: Vec<_> = cwaits.iter_mut().map(|w| w.view_mut()).collect();
        let opts = CombineOpts {
            format,
            wait_stats: Some(&mut wviews),
        };
        if halves {
            let hook = g.combine_send_opts(&sref, &handle, &cins, &mut couts, opts)?;
            g.combine_recv(hook, &sref).unwrap();
        } else {
            g.combine_device_opts(&sref, &handle, &cins, &mut couts, opts)?;
        }
    }
    for s in streams {
        s.synchronize().unwrap();
    }
    g.check()
        .unwrap_or_else(|e| panic!("{} {}: {e}", path.name(), cfg.describe()));
    let (want, want_c) = oracle_of(&cfg, data, y, format);
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
        if !owned {
            // One good call on zeroed statistics: they hold its counts, and a wait per
            // source that is never negative (none for the one-rank path, which waits for
            // nobody, or for NCCL sources, which arrive before the kernel).
            let counts = outs[q].count.read(st(q), "recv_count");
            assert_eq!(outs[q].recv_stats.read(st(q), "recv_stats"), counts);
            let waits = outs[q].wait_stats.read(st(q), "wait_stats");
            assert!(waits.iter().all(|&w| w >= 0), "{waits:?}");
            if r > 1 && !g.uses_nccl() {
                assert!(waits.iter().any(|&w| w > 0), "no wait counted: {waits:?}");
            }
        }
        let n = want_c[q].len();
        let bits = outs[q].out.read(st(q), "out");
        let got_c: Vec<bf16> = bits[..n].iter().map(|&b| bf16::from_bits(b)).collect();
        if let Some(d) = ep_reference::output::combine_diff(&got_c, &want_c[q], cfg.hidden) {
            panic!(
                "device {} combine ({}, halves {halves}), {}, rank {q}: {d}",
                path.name(),
                format.name(),
                cfg.describe()
            );
        }
        // Combine's waits: never negative; the per-expert path waits for every owner's
        // signals (the batched one, every rank on this GPU with zero_copy_local, reads the
        // rows in place and waits for nobody).
        let cw = cwaits[q].read(st(q), "combine wait_stats");
        assert!(cw.iter().all(|&w| w >= 0), "{cw:?}");
        if r > 1 && path == Path::PerExpert && !g.uses_nccl() {
            assert!(cw.iter().any(|&w| w > 0), "no combine wait counted: {cw:?}");
        }
        // Rows past n tokens are the caller's: untouched.
        assert!(
            bits[n..].iter().all(|&b| b == 0x4321),
            "combine wrote past n tokens"
        );
    }
    Ok(())
}

/// The combine outputs (u16 buffers with guards) as whole bf16 views.
pub(crate) fn out_views(outs: &mut [RankOut]) -> Vec<CudaViewMut<'_, bf16>> {
    outs.iter_mut()
        .map(|o| {
            let n = o.out.len + 2 * GUARD;
            // SAFETY: u16 and bf16 have the same size, and every bit pattern is a valid bf16.
            unsafe { o.out.buf.transmute_mut::<bf16>(n).unwrap() }
        })
        .collect()
}

/// The insides (without the guards) of whole views.
pub(crate) fn inner<'a>(fulls: &'a mut [CudaViewMut<'_, bf16>]) -> Vec<CudaViewMut<'a, bf16>> {
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
    pub(crate) fn all_fill(&self, s: &Arc<CudaStream>, what: &str) {
        let inside = self.read(s, what);
        assert!(inside.iter().all(|v| *v == self.fill), "{what}: written");
    }
}

impl RankOut {
    /// A failed dispatch's outputs: no row, scale, source index or combine row written (the
    /// counts and layout pairs are checked by the caller).
    pub(crate) fn check_failed_dispatch(&self, s: &Arc<CudaStream>) {
        self.recv_x.all_fill(s, "recv_x");
        if let Some(g) = &self.scales {
            g.all_fill(s, "recv_scales");
        }
        self.src.all_fill(s, "src_info");
        self.out.all_fill(s, "out");
        // A failed call adds no rows to the statistics (its waits may count).
        self.recv_stats.all_fill(s, "recv_stats");
        let _ = self.count.read(s, "recv_count");
        let _ = self.layout.read(s, "layout_range");
    }
}

/// Random configs (every mode) at R ranks over the given streams' GPUs, device API, both paths,
/// caller buffers, plus one round with the group's own buffers.
pub(crate) fn device_configs(r: usize, streams: &[Arc<CudaStream>], seed: u64) {
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
            let tokens = round_tokens(r, t, round, &mut rng);
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
    // Rank checks of the harness read-back.
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
