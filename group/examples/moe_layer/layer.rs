//! The layer itself, what a user of the library writes: top-k over the router scores (a kernel
//! of this example), dispatch, the experts (a kernel of this example: dequantize each received
//! row, scale it by its expert's factor), combine, all enqueued on one CUDA stream with no host
//! synchronisation in between. [`virtual_layer`] runs it for every rank of a group in this
//! process (`GpuGroup`'s device API, one call for all ranks); [`rank_layer`] for the one rank of
//! a process (`RankEp`).

use crate::error::{cuda, LayerError};
use crate::inputs::HostRank;
use ep_kernels::cudarc;
use ep_kernels::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg,
};
use ep_kernels::{CombineIn, DeviceDispatchOut, DispatchIn, GpuGroup, Path, RankEp, Tokens};
use ep_reference::{bf16, Config, Mode};
use std::sync::Arc;

/// The two kernels of the layer: top-k over the router scores, and the experts.
const KERNELS: &str = include_str!("../moe_layer.cu");

/// The compiled kernels on one context.
pub struct Kernels {
    topk: CudaFunction,
    expert: CudaFunction,
}

pub fn kernels(ctx: &Arc<CudaContext>) -> Result<Kernels, LayerError> {
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
pub struct RankBufs {
    pub n: usize,
    pub scores: CudaSlice<f32>,
    pub x: CudaSlice<u16>,
    pub topk: CudaSlice<i64>,
    pub w: CudaSlice<f32>,
    pub recv_x: CudaSlice<u8>,
    pub scales: Option<CudaSlice<u8>>,
    pub count: CudaSlice<i32>,
    pub layout: CudaSlice<i64>,
    pub src: CudaSlice<i32>,
    pub y: CudaSlice<u16>,
    pub out: CudaSlice<u16>,
}

/// Uploads one rank's inputs (once, before the layer) and allocates its outputs.
pub fn rank_bufs(
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
pub fn as_bf16(s: &CudaSlice<u16>) -> CudaView<'_, bf16> {
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

/// The layer for every rank of `g` (all in this process), enqueued on `s`: top-k per rank, one
/// `dispatch_device` for all ranks, the experts per rank, one `combine_device`. Returns once
/// everything is enqueued; the caller waits for `s` (and then asks `g.check()`).
pub fn virtual_layer(
    g: &mut GpuGroup,
    s: &Arc<CudaStream>,
    k: &Kernels,
    cfg: &Config,
    path: Path,
    bufs: &mut [RankBufs],
) -> Result<(), LayerError> {
    for b in bufs.iter_mut() {
        launch_topk(s, k, cfg, b)?;
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
                    recv_stats: None,
                    wait_stats: None,
                };
                ((&b.x, &b.topk, b.n), o)
            })
            .unzip();
        let xs: Vec<_> = ins_bufs.iter().map(|(x, _, _)| as_bf16(x)).collect();
        let ts: Vec<_> = ins_bufs.iter().map(|(_, t, _)| t.slice(..)).collect();
        let ins: Vec<DispatchIn> = (0..cfg.num_ranks)
            .map(|r| DispatchIn {
                x: &xs[r],
                topk_idx: &ts[r],
                n_tokens: Tokens::Host(ins_bufs[r].2),
            })
            .collect();
        g.dispatch_device(path, &[s], &ins, Some(&mut outs))?
    };
    for (r, b) in bufs.iter_mut().enumerate() {
        launch_experts(s, k, cfg, r, b)?;
    }
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
    g.combine_device(&[s], &handle, &ins, &mut views)?;
    Ok(())
}

/// The layer for this process's one rank `rank`, enqueued on `s` through `ep`: top-k, dispatch,
/// the experts, combine. Returns once everything is enqueued; the caller waits for `s` (and then
/// asks `ep.check()`).
pub fn rank_layer(
    ep: &mut RankEp<'_>,
    s: &Arc<CudaStream>,
    k: &Kernels,
    cfg: &Config,
    path: Path,
    rank: usize,
    b: &mut RankBufs,
) -> Result<(), LayerError> {
    launch_topk(s, k, cfg, b)?;
    let handle = {
        let (x, t) = (as_bf16(&b.x), b.topk.slice(..));
        let mut out = DeviceDispatchOut {
            recv_x: b.recv_x.slice_mut(..),
            recv_scales: b.scales.as_mut().map(|v| v.slice_mut(..)),
            recv_count: b.count.slice_mut(..),
            layout_range: b.layout.slice_mut(..),
            src_info: b.src.slice_mut(..),
            recv_stats: None,
            wait_stats: None,
        };
        ep.dispatch(path, s, &x, &t, Tokens::Host(b.n), Some(&mut out))?
    };
    launch_experts(s, k, cfg, rank, b)?;
    let (y, t, w) = (as_bf16(&b.y), b.topk.slice(..), b.w.slice(..));
    let len = b.out.len();
    // SAFETY: u16 and bf16 have the same size and alignment.
    let mut out = unsafe { b.out.transmute_mut::<bf16>(len) }.expect("same length");
    ep.combine(s, &y, &t, &w, &handle, &mut out)?;
    Ok(())
}
