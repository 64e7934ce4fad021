//! A toy MoE layer on the GPU with the device API, end to end on one CUDA stream:
//!
//! router scores -> top-k (a kernel of this file) -> dispatch -> a per-expert kernel (dequantize
//! the received rows, scale them by an expert factor) -> combine, with no host synchronisation
//! until the end; then everything is downloaded once and checked bit for bit against
//! `ep_reference::oracle`.
//!
//! ```text
//! cargo run --release --example moe_layer                 # 2 virtual ranks on GPU 0
//! cargo run --release --example moe_layer -- --ranks 4 --mode fp8-ue8m0
//! cargo run --release --example moe_layer -- --nprocs 2   # one process per rank (RankEp)
//! ```
//!
//! Flags: `--ranks R` (virtual ranks in this process, default 2), `--nprocs N` (N processes of
//! one rank each, started like `ep-bench --nprocs`; a torchrun-style launcher may start them
//! too), `--gpus G` (process mode: rank i uses GPU `LOCAL_RANK % G`, default 1), `--tokens T`
//! (64), `--hidden H` (1024), `--experts E` (16), `--top-k K` (4), `--mode bf16|fp8|fp8-ue8m0`
//! (fp8), `--path per-expert|batched|both` (both), `--seed S` (1).
//!
//! Without a usable GPU (or without NVRTC) it prints `SKIPPED: moe_layer: <why>` and exits 0.

use ep_group::{new_process, GroupError};
use ep_kernels::cudarc;
use ep_kernels::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg,
};
use ep_kernels::testing::Rng;
use ep_kernels::{
    CombineIn, DeviceDispatchOut, DispatchIn, GpuError, GpuGroup, GpuOptions, Path, Tokens,
};
use ep_reference::numerics::fp8::{e4m3_to_f32, pow2i};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::{bf16, bf16_from_f32, Config, DispatchOutput, Mode, RecvScales, RecvX};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// The two kernels of the layer: top-k over the router scores, and the experts.
const KERNELS: &str = include_str!("moe_layer.cu");

#[derive(Debug, thiserror::Error)]
enum LayerError {
    #[error("{flag} {value}: {why}")]
    Flag {
        flag: &'static str,
        value: String,
        why: String,
    },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Group(#[from] GroupError),
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("{0}")]
    Mismatch(String),
    #[error("launch: {0}")]
    Launch(String),
}

fn cuda<T, E: std::fmt::Debug>(what: &str, r: Result<T, E>) -> Result<T, LayerError> {
    r.map_err(|e| LayerError::Cuda(format!("{what}: {e:?}")))
}

#[derive(Debug, Clone)]
struct Args {
    ranks: usize,
    nprocs: Option<usize>,
    gpus: usize,
    tokens: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    mode: Mode,
    paths: Vec<Path>,
    seed: u64,
}

fn parse(argv: &[String]) -> Result<Args, LayerError> {
    let mut a = Args {
        ranks: 2,
        nprocs: None,
        gpus: 1,
        tokens: 64,
        hidden: 1024,
        experts: 16,
        top_k: 4,
        mode: Mode::FP8,
        paths: vec![Path::PerExpert, Path::Batched],
        seed: 1,
    };
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let flag: &'static str = match flag.as_str() {
            "--ranks" => "--ranks",
            "--nprocs" => "--nprocs",
            "--gpus" => "--gpus",
            "--tokens" => "--tokens",
            "--hidden" => "--hidden",
            "--experts" => "--experts",
            "--top-k" => "--top-k",
            "--mode" => "--mode",
            "--path" => "--path",
            "--seed" => "--seed",
            other => {
                return Err(LayerError::Flag {
                    flag: "argument",
                    value: other.into(),
                    why: "unknown flag".into(),
                })
            }
        };
        let value = it.next().ok_or_else(|| LayerError::Flag {
            flag,
            value: String::new(),
            why: "needs a value".into(),
        })?;
        let bad = |why: &str| LayerError::Flag {
            flag,
            value: value.clone(),
            why: why.into(),
        };
        let num = || -> Result<usize, LayerError> {
            match value.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(bad("a positive integer")),
            }
        };
        match flag {
            "--ranks" => a.ranks = num()?,
            "--nprocs" => a.nprocs = Some(num()?),
            "--gpus" => a.gpus = num()?,
            "--tokens" => a.tokens = num()?,
            "--hidden" => a.hidden = num()?,
            "--experts" => a.experts = num()?,
            "--top-k" => a.top_k = num()?,
            "--seed" => a.seed = num()? as u64,
            "--mode" => {
                a.mode = match value.as_str() {
                    "bf16" => Mode::Bf16,
                    "fp8" => Mode::FP8,
                    "fp8-ue8m0" => Mode::FP8_UE8M0,
                    _ => return Err(bad("bf16, fp8 or fp8-ue8m0")),
                }
            }
            _ => {
                a.paths = match value.as_str() {
                    "per-expert" => vec![Path::PerExpert],
                    "batched" => vec![Path::Batched],
                    "both" => vec![Path::PerExpert, Path::Batched],
                    _ => return Err(bad("per-expert, batched or both")),
                }
            }
        }
    }
    if a.experts > 4096 {
        return Err(LayerError::Flag {
            flag: "--experts",
            value: a.experts.to_string(),
            why: "the toy top-k kernel scans every expert per slot: at most 4096".into(),
        });
    }
    Ok(a)
}

fn config(a: &Args, ranks: usize) -> Result<Config, LayerError> {
    Config::new(ranks, a.experts, a.tokens, a.hidden, a.top_k, a.mode).map_err(|e| {
        LayerError::Flag {
            flag: "--ranks/--experts/--tokens/--hidden/--top-k",
            value: format!(
                "R={ranks} E={} T={} H={} K={}",
                a.experts, a.tokens, a.hidden, a.top_k
            ),
            why: e.to_string(),
        }
    })
}

// ------------------------------------------------------------------ host side of the layer

/// One rank's host inputs: its token count, tokens `[n, H]` and router scores `[n, E]`.
struct HostRank {
    n: usize,
    x: Vec<bf16>,
    scores: Vec<f32>,
}

/// Every rank's inputs, the same in every process (all derive them from the seed).
fn host_inputs(cfg: &Config, seed: u64) -> Vec<HostRank> {
    let mut rng = Rng::new(seed);
    (0..cfg.num_ranks)
        .map(|_| {
            let n = 1 + rng.below(cfg.max_tokens_per_rank);
            let x = (0..n * cfg.hidden)
                .map(|_| bf16::from_f32(rng.unit() * 4.0))
                .collect();
            // Scores in (0, 2]: positive, so the weights' sum is never zero.
            let scores = (0..n * cfg.num_experts)
                .map(|_| rng.unit() + 1.0 + f32::EPSILON)
                .collect();
            HostRank { n, x, scores }
        })
        .collect()
}

/// The host twin of `moe_topk`.
fn host_topk(cfg: &Config, h: &HostRank) -> (Vec<i64>, Vec<f32>) {
    let (e, k) = (cfg.num_experts, cfg.top_k);
    let mut idx = vec![0i64; h.n * k];
    let mut w = vec![0f32; h.n * k];
    for t in 0..h.n {
        let s = &h.scores[t * e..(t + 1) * e];
        let ti = &mut idx[t * k..(t + 1) * k];
        let mut sum = 0f32;
        for slot in 0..k {
            let mut best: Option<usize> = None;
            for (c, &v) in s.iter().enumerate() {
                let taken = ti[..slot].contains(&(c as i64));
                if !taken
                    && match best {
                        None => true,
                        Some(b) => v > s[b],
                    }
                {
                    best = Some(c);
                }
            }
            let b = best.expect("K <= E (checked by the config)");
            ti[slot] = b as i64;
            sum += s[b];
        }
        for slot in 0..k {
            w[t * k + slot] = s[ti[slot] as usize] / sum;
        }
    }
    (idx, w)
}

/// The host twin of `moe_expert`, on the oracle's dispatch output of rank `rank`.
fn host_experts(cfg: &Config, rank: usize, d: &DispatchOutput) -> Vec<bf16> {
    let (l, rows, h) = (cfg.num_local_experts(), cfg.rows_per_expert(), cfg.hidden);
    let spr = cfg.scales_per_row();
    let mut y = vec![bf16::ZERO; l * rows * h];
    for le in 0..l {
        let f = 0.5f32 + 0.25 * ((rank * l + le) % 4) as f32;
        for i in 0..d.recv_count[le] as usize {
            let row = le * rows + i;
            for j in 0..h {
                let v = match (&d.recv_x, &d.recv_scales) {
                    (RecvX::Bf16(x), _) => x[row * h + j].to_f32(),
                    (RecvX::Fp8(x), Some(RecvScales::F32(s))) => {
                        e4m3_to_f32(x[row * h + j]) * s[row * spr + j / 128]
                    }
                    (RecvX::Fp8(x), Some(RecvScales::Ue8m0(s))) => {
                        let byte = (s[row * spr + j / 512] >> (8 * ((j / 128) % 4))) & 0xFF;
                        e4m3_to_f32(x[row * h + j]) * pow2i(byte - 127)
                    }
                    (RecvX::Fp8(_), None) => unreachable!("FP8 output without scales"),
                };
                y[row * h + j] = bf16_from_f32(v * f);
            }
        }
    }
    y
}

/// The oracle's answer for every rank: (dispatch outputs, combine outputs, topk_idx, weights).
type Expected = (
    Vec<DispatchOutput>,
    Vec<Vec<bf16>>,
    Vec<Vec<i64>>,
    Vec<Vec<f32>>,
);

fn expected(cfg: &Config, host: &[HostRank]) -> Result<Expected, LayerError> {
    let (idx, w): (Vec<_>, Vec<_>) = host.iter().map(|h| host_topk(cfg, h)).unzip();
    let inputs: Vec<RankInput> = host
        .iter()
        .zip(&idx)
        .map(|(h, t)| RankInput {
            x: &h.x,
            topk_idx: t,
        })
        .collect();
    let disp = oracle::dispatch(cfg, &inputs).map_err(|e| LayerError::Mismatch(e.to_string()))?;
    let ys: Vec<Vec<bf16>> = disp
        .iter()
        .enumerate()
        .map(|(r, d)| host_experts(cfg, r, d))
        .collect();
    let cin: Vec<CombineInput> = ys
        .iter()
        .zip(&idx)
        .zip(&w)
        .map(|((y, t), w)| CombineInput {
            y,
            topk_idx: t,
            topk_weights: w,
        })
        .collect();
    let comb = oracle::combine(cfg, &cin).map_err(|e| LayerError::Mismatch(e.to_string()))?;
    Ok((disp, comb, idx, w))
}

// ------------------------------------------------------------------ device side of the layer

/// The compiled kernels on one context.
struct Kernels {
    topk: CudaFunction,
    expert: CudaFunction,
}

fn kernels(ctx: &Arc<CudaContext>) -> Result<Kernels, LayerError> {
    let opts = cudarc::nvrtc::CompileOptions {
        // No FMA contraction: the host twins round every product on its own.
        fmad: Some(false),
        ..Default::default()
    };
    let ptx = cuda("NVRTC", cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts))?;
    let m = cuda("load module", ctx.load_module(ptx))?;
    Ok(Kernels {
        topk: cuda("moe_topk", m.load_function("moe_topk"))?,
        expert: cuda("moe_expert", m.load_function("moe_expert"))?,
    })
}

/// One rank's device buffers (bf16 tensors held as u16 bits).
struct RankBufs {
    n: usize,
    scores: CudaSlice<f32>,
    x: CudaSlice<u16>,
    topk: CudaSlice<i64>,
    w: CudaSlice<f32>,
    recv_x: CudaSlice<u8>,
    scales: Option<CudaSlice<u8>>,
    count: CudaSlice<i32>,
    layout: CudaSlice<i64>,
    src: CudaSlice<i32>,
    y: CudaSlice<u16>,
    out: CudaSlice<u16>,
}

/// Uploads one rank's inputs (once, before the layer) and allocates its outputs.
fn rank_bufs(
    g: &GpuGroup,
    s: &Arc<CudaStream>,
    cfg: &Config,
    h: &HostRank,
) -> Result<RankBufs, LayerError> {
    let z = g.dispatch_out_sizes();
    let (t, hd, k) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k);
    let ylen = cfg.num_local_experts() * cfg.rows_per_expert() * hd;
    let xb: Vec<u16> = h.x.iter().map(|v| v.to_bits()).collect();
    Ok(RankBufs {
        n: h.n,
        scores: cuda("upload scores", s.clone_htod(&h.scores))?,
        x: cuda("upload x", s.clone_htod(&xb))?,
        topk: cuda("alloc topk", s.alloc_zeros(t * k))?,
        w: cuda("alloc weights", s.alloc_zeros(t * k))?,
        recv_x: cuda("alloc recv_x", s.alloc_zeros(z.recv_x_bytes))?,
        scales: match z.recv_scales_bytes {
            0 => None,
            b => Some(cuda("alloc scales", s.alloc_zeros(b))?),
        },
        count: cuda("alloc recv_count", s.alloc_zeros(z.recv_count))?,
        layout: cuda("alloc layout_range", s.alloc_zeros(z.layout_range))?,
        src: cuda("alloc src_info", s.alloc_zeros(z.src_info))?,
        y: cuda("alloc y", s.alloc_zeros(ylen))?,
        out: cuda("alloc out", s.alloc_zeros(t * hd))?,
    })
}

/// A u16 buffer seen as bf16.
fn as_bf16(s: &CudaSlice<u16>) -> CudaView<'_, bf16> {
    // SAFETY: u16 and bf16 have the same size and alignment, and every bit pattern is a bf16.
    unsafe { s.transmute::<bf16>(s.len()) }.expect("same length")
}

fn launch_topk(
    s: &Arc<CudaStream>,
    k: &Kernels,
    cfg: &Config,
    b: &mut RankBufs,
) -> Result<(), LayerError> {
    let (n, e, kk) = (b.n as i32, cfg.num_experts as i32, cfg.top_k as i32);
    let lc = LaunchConfig {
        grid_dim: (b.n.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = s.launch_builder(&k.topk);
    l.arg(&b.scores).arg(&n).arg(&e).arg(&kk);
    l.arg(&mut b.topk).arg(&mut b.w);
    // SAFETY: the argument list matches moe_topk's signature; scores holds n*E floats and
    // topk/weights T*K >= n*K elements (n <= T).
    cuda("launch moe_topk", unsafe { l.launch(lc) })?;
    Ok(())
}

fn launch_experts(
    s: &Arc<CudaStream>,
    k: &Kernels,
    cfg: &Config,
    rank: usize,
    b: &mut RankBufs,
) -> Result<(), LayerError> {
    let rows = cfg.num_local_experts() * cfg.rows_per_expert();
    let mode: i32 = match cfg.mode {
        Mode::Bf16 => 0,
        Mode::Fp8 { ue8m0: false, .. } => 1,
        Mode::Fp8 { ue8m0: true, .. } => 2,
    };
    let (rpe, h, spr) = (
        cfg.rows_per_expert() as i32,
        cfg.hidden as i32,
        cfg.scales_per_row() as i32,
    );
    let base = (rank * cfg.num_local_experts()) as i32;
    let grid = u32::try_from(rows).map_err(|_| LayerError::Flag {
        flag: "--experts/--tokens",
        value: format!("{rows} rows"),
        why: "more rows than one grid dimension holds".into(),
    })?;
    let lc = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = s.launch_builder(&k.expert);
    l.arg(&b.recv_x);
    // BF16 mode reads no scales: any valid pointer will do.
    l.arg(b.scales.as_ref().unwrap_or(&b.recv_x));
    l.arg(&b.count)
        .arg(&rpe)
        .arg(&h)
        .arg(&mode)
        .arg(&spr)
        .arg(&base);
    l.arg(&mut b.y);
    // SAFETY: matches moe_expert's signature; recv_x/scales/count hold the L*R*T rows the
    // dispatch layout has, y L*R*T*H bf16.
    cuda("launch moe_expert", unsafe { l.launch(lc) })?;
    Ok(())
}

/// One rank's (dispatch output, combine output, topk_idx, topk_weights).
type Downloaded = (DispatchOutput, Vec<bf16>, Vec<i64>, Vec<f32>);

/// One rank's device results, downloaded after the stream finished.
fn download(s: &Arc<CudaStream>, cfg: &Config, b: &RankBufs) -> Result<Downloaded, LayerError> {
    let mut d = DispatchOutput::zeroed(cfg);
    let bytes = cuda("read recv_x", s.clone_dtoh(&b.recv_x))?;
    match &mut d.recv_x {
        RecvX::Bf16(v) => {
            for (o, c) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        RecvX::Fp8(v) => v.copy_from_slice(&bytes),
    }
    if let Some(sc) = &b.scales {
        let b = cuda("read scales", s.clone_dtoh(sc))?;
        let w = b.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
        match &mut d.recv_scales {
            Some(RecvScales::F32(v)) => v
                .iter_mut()
                .zip(w)
                .for_each(|(o, c)| *o = f32::from_le_bytes(c)),
            Some(RecvScales::Ue8m0(v)) => v
                .iter_mut()
                .zip(w)
                .for_each(|(o, c)| *o = i32::from_le_bytes(c)),
            None => {}
        }
    }
    d.recv_count = cuda("read recv_count", s.clone_dtoh(&b.count))?;
    d.layout_range = cuda("read layout_range", s.clone_dtoh(&b.layout))?
        .iter()
        .map(|&v| (v as i32, (v >> 32) as i32))
        .collect();
    d.src_info = cuda("read src_info", s.clone_dtoh(&b.src))?;
    let k = b.n * cfg.top_k;
    let out = cuda("read out", s.clone_dtoh(&b.out))?[..b.n * cfg.hidden]
        .iter()
        .map(|&v| bf16::from_bits(v))
        .collect();
    let topk = cuda("read topk", s.clone_dtoh(&b.topk))?[..k].to_vec();
    let w = cuda("read weights", s.clone_dtoh(&b.w))?[..k].to_vec();
    Ok((d, out, topk, w))
}

/// Compares rank `r`'s device results with the oracle's.
fn verify(
    cfg: &Config,
    r: usize,
    exp: &Expected,
    got: &RankBufs,
    s: &Arc<CudaStream>,
) -> Result<(), LayerError> {
    let (d, out, topk, w) = download(s, cfg, got)?;
    let bad = |what: &str, why: String| LayerError::Mismatch(format!("rank {r} {what}: {why}"));
    if topk != exp.2[r] {
        return Err(bad(
            "top-k",
            "the device's expert ids differ from the host's".into(),
        ));
    }
    if w.iter()
        .map(|v| v.to_bits())
        .ne(exp.3[r].iter().map(|v| v.to_bits()))
    {
        return Err(bad(
            "top-k",
            "the device's weights differ from the host's".into(),
        ));
    }
    if let Some(why) = d.diff(&exp.0[r]) {
        return Err(bad("dispatch", why));
    }
    if let Some(why) = ep_reference::output::combine_diff(&out, &exp.1[r], cfg.hidden) {
        return Err(bad("combine", why));
    }
    Ok(())
}

// ------------------------------------------------------------------ the two ways to run it

/// Every rank in this process, on GPU 0: one stream, one `dispatch_device`/`combine_device`
/// call per layer covering all ranks.
fn virtual_ranks(a: &Args) -> Result<(), LayerError> {
    let cfg = config(a, a.ranks)?;
    let host = host_inputs(&cfg, a.seed);
    let exp = expected(&cfg, &host)?;
    let ctx = cuda("context", CudaContext::new(0))?;
    let s = cuda("stream", ctx.new_stream())?;
    let k = kernels(&ctx)?;
    let mut g = GpuGroup::new(&cfg, GpuOptions::default())?;
    for &path in &a.paths {
        let mut bufs = host
            .iter()
            .map(|h| rank_bufs(&g, &s, &cfg, h))
            .collect::<Result<Vec<_>, _>>()?;
        // The layer: everything below is enqueued on `s`; the host waits once, at the end.
        for b in bufs.iter_mut() {
            launch_topk(&s, &k, &cfg, b)?;
        }
        let handle = {
            let (ins_bufs, mut outs): (Vec<_>, Vec<DeviceDispatchOut>) = bufs
                .iter_mut()
                .map(|b| {
                    let o = DeviceDispatchOut {
                        recv_x: b.recv_x.slice_mut(..),
                        recv_scales: b.scales.as_mut().map(|v| v.slice_mut(..)),
                        recv_count: b.count.slice_mut(..),
                        layout_range: b.layout.slice_mut(..),
                        src_info: b.src.slice_mut(..),
                    };
                    ((&b.x, &b.topk), o)
                })
                .unzip();
            let xs: Vec<_> = ins_bufs.iter().map(|(x, _)| as_bf16(x)).collect();
            let ts: Vec<_> = ins_bufs.iter().map(|(_, t)| t.slice(..)).collect();
            let ins: Vec<DispatchIn> = (0..cfg.num_ranks)
                .map(|r| DispatchIn {
                    x: &xs[r],
                    topk_idx: &ts[r],
                    n_tokens: Tokens::Host(host[r].n),
                })
                .collect();
            g.dispatch_device(path, &[&s], &ins, Some(&mut outs))?
        };
        for (r, b) in bufs.iter_mut().enumerate() {
            launch_experts(&s, &k, &cfg, r, b)?;
        }
        {
            let (ins_bufs, mut outs): (Vec<_>, Vec<_>) = bufs
                .iter_mut()
                .map(|b| ((&b.y, &b.topk, &b.w), b.out.slice_mut(..)))
                .unzip();
            let ys: Vec<_> = ins_bufs.iter().map(|(y, _, _)| as_bf16(y)).collect();
            let ts: Vec<_> = ins_bufs.iter().map(|(_, t, _)| t.slice(..)).collect();
            let ws: Vec<_> = ins_bufs.iter().map(|(_, _, w)| w.slice(..)).collect();
            let ins: Vec<CombineIn> = (0..cfg.num_ranks)
                .map(|r| CombineIn {
                    y: &ys[r],
                    topk_idx: &ts[r],
                    topk_weights: &ws[r],
                })
                .collect();
            // bf16 output views over the u16 buffers.
            let mut views: Vec<_> = outs
                .iter_mut()
                .map(|o| {
                    let len = o.len();
                    // SAFETY: as in `as_bf16`, for a mutable view.
                    unsafe { o.transmute_mut::<bf16>(len) }.expect("same length")
                })
                .collect();
            g.combine_device(&[&s], &handle, &ins, &mut views)?;
        }
        cuda("synchronize", s.synchronize())?;
        g.check()?;
        for (r, b) in bufs.iter().enumerate() {
            verify(&cfg, r, &exp, b, &s)?;
        }
        let sel: usize = exp.2.iter().map(|t| t.len()).sum();
        println!(
            "PASS: moe_layer {} path, {} virtual ranks on one GPU, {} ({} tokens, {sel} selections): top-k -> dispatch -> experts -> combine on one stream, bit-identical to the oracle",
            path.name(),
            cfg.num_ranks,
            cfg.describe(),
            host.iter().map(|h| h.n).sum::<usize>()
        );
    }
    Ok(())
}

/// This process is one rank of a launch (ep_launch or torchrun variables): the group forms
/// through the rendezvous, and the layer runs through [`ep_kernels::RankEp`].
fn one_rank(a: &Args) -> Result<(), LayerError> {
    let rdzv = ep_launch::Rendezvous::from_env(Duration::from_secs(60), Duration::from_secs(60))
        .map_err(|e| LayerError::Launch(format!("rendezvous: {e}")))?;
    let (rank, world) = (rdzv.rank(), rdzv.world_size());
    let local = ep_launch::ProcessConfig::from_env()
        .map(|p| p.local_rank)
        .unwrap_or(rank);
    let ordinal = local % a.gpus;
    let cfg = config(a, world)?;
    let host = host_inputs(&cfg, a.seed);
    let exp = expected(&cfg, &host)?;
    let ctx = cuda("context", CudaContext::new(ordinal))?;
    let s = cuda("stream", ctx.new_stream())?;
    let k = kernels(&ctx)?;
    let mut g = new_process(&cfg, GpuOptions::default(), rank, ordinal, &mut |b| {
        rdzv.all_gather(b).map_err(|e| e.to_string())
    })?;
    for &path in &a.paths {
        let mut b = rank_bufs(&g, &s, &cfg, &host[rank])?;
        launch_topk(&s, &k, &cfg, &mut b)?;
        let mut ep = g.rank_ep()?;
        let handle = {
            let (x, t) = (as_bf16(&b.x), b.topk.slice(..));
            let mut out = DeviceDispatchOut {
                recv_x: b.recv_x.slice_mut(..),
                recv_scales: b.scales.as_mut().map(|v| v.slice_mut(..)),
                recv_count: b.count.slice_mut(..),
                layout_range: b.layout.slice_mut(..),
                src_info: b.src.slice_mut(..),
            };
            ep.dispatch(path, &s, &x, &t, Tokens::Host(b.n), Some(&mut out))?
        };
        launch_experts(&s, &k, &cfg, rank, &mut b)?;
        {
            let (y, t, w) = (as_bf16(&b.y), b.topk.slice(..), b.w.slice(..));
            let len = b.out.len();
            // SAFETY: u16 and bf16 have the same size and alignment.
            let mut out = unsafe { b.out.transmute_mut::<bf16>(len) }.expect("same length");
            ep.combine(&s, &y, &t, &w, &handle, &mut out)?;
        }
        cuda("synchronize", s.synchronize())?;
        ep.check()?;
        verify(&cfg, rank, &exp, &b, &s)?;
        // Every rank done with this path before the next reuses the group's buffers, and
        // before any process exits and unmaps what its peers wrote into.
        rdzv.all_gather(&[])
            .map_err(|e| LayerError::Launch(format!("barrier: {e}")))?;
        println!(
            "PASS: moe_layer {} path, rank {rank} of {world} processes (GPU {ordinal}), {} ({} tokens here): top-k -> dispatch -> experts -> combine on one stream via RankEp, bit-identical to the oracle",
            path.name(),
            cfg.describe(),
            b.n
        );
    }
    Ok(())
}

/// Starts `n` processes of this program, one rank each, and waits for them.
fn launch(a: &Args, argv: &[String], n: usize) -> Result<(), LayerError> {
    let mut child = Vec::new();
    let mut it = argv.iter();
    while let Some(v) = it.next() {
        if v == "--nprocs" {
            it.next();
        } else {
            child.push(v.clone());
        }
    }
    let exe = std::env::current_exe().map_err(|e| LayerError::Launch(e.to_string()))?;
    let l = ep_launch::spawn_local(n, exe, &child, &[])
        .map_err(|e| LayerError::Launch(e.to_string()))?;
    l.wait(Duration::from_secs(240))
        .map_err(|e| LayerError::Launch(e.to_string()))?;
    println!(
        "PASS: moe_layer: all {n} processes (one rank each, {} GPU(s)) exited 0; {} paths",
        a.gpus,
        a.paths.len()
    );
    Ok(())
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let a = match parse(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("moe_layer: {e}");
            return ExitCode::from(2);
        }
    };
    let launched = ep_launch::is_launched_by_ep_launch() || ep_launch::is_launched_externally();
    if !launched {
        if let Err(why) = ep_kernels::runtime::probe() {
            println!("SKIPPED: moe_layer: no usable GPU: {why}");
            return ExitCode::SUCCESS;
        }
        if !ep_kernels::compile::nvrtc_present() {
            println!("SKIPPED: moe_layer: libnvrtc cannot be opened");
            return ExitCode::SUCCESS;
        }
    }
    let r = match (launched, a.nprocs) {
        (true, _) => one_rank(&a),
        (false, Some(n)) => launch(&a, &argv, n),
        (false, None) => virtual_ranks(&a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("FAIL: moe_layer: {e}");
            ExitCode::from(1)
        }
    }
}
