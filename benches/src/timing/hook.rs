//! The receive-hook split (DeepEP's `return_recv_hook`): dispatch and combine each issued as a
//! send half and a receive half through the device API, timed with events around each half
//! and profiled under CUPTI.

use crate::timing::events::{cuda_err, Events};
use crate::timing::kernel::{canonical, kernel_names, per_half_us};
use ep_kernels::runtime::{GpuGroup, Path};
use ep_kernels::{CombineOpts, GpuError};
use half::bf16;

/// One path's receive-hook split (DeepEP's `return_recv_hook`): each of dispatch and combine
/// issued as its send half and its receive half through the device API
/// ([`GpuGroup::dispatch_send`] ... [`GpuGroup::combine_recv`]), on streams of the caller's
/// own, one launch per half (no graph). Event figures: stream time between CUDA events around
/// each half, per call (slowest device), in microseconds.
#[derive(Debug, Clone)]
pub struct HookSplit {
    pub dispatch_send_us: Vec<f64>,
    pub dispatch_recv_us: Vec<f64>,
    pub combine_send_us: Vec<f64>,
    pub combine_recv_us: Vec<f64>,
    /// CUPTI kernel time of each half (a separate profiled run of as many calls): dispatch
    /// send, dispatch recv, combine send, combine recv; `Err(why)` where CUPTI is missing.
    pub kernel: Result<[Vec<f64>; 4], String>,
}

/// Why a hook-split run stopped: its combine output differs from the oracle (the run fails),
/// or a CUDA/API error (the split is reported missing, with this reason).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HookError {
    #[error("{0}")]
    Mismatch(String),
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// A u16 buffer seen as bf16.
fn bf16_view(b: &cudarc::driver::CudaSlice<u16>) -> cudarc::driver::CudaView<'_, bf16> {
    // SAFETY: u16 and bf16 have the same size and alignment; every bit pattern is a bf16.
    unsafe { b.transmute::<bf16>(b.len()) }.expect("same length")
}

/// u16 buffers seen as mutable bf16 views.
fn bf16_views(
    bufs: &mut [cudarc::driver::CudaSlice<u16>],
) -> Vec<cudarc::driver::CudaViewMut<'_, bf16>> {
    bufs.iter_mut()
        .map(|b| {
            let n = b.len();
            // SAFETY: as in `bf16_view`, for a mutable view.
            unsafe { b.transmute_mut::<bf16>(n) }.expect("same length")
        })
        .collect()
}

/// The group's own `y` of one rank ([`GpuGroup::own_y`]) seen as a cudarc slice for the hook
/// split's calls; dropping it gives the address back without freeing it (the group owns it).
struct BorrowedY(Option<cudarc::driver::CudaSlice<u16>>);

impl Drop for BorrowedY {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            let _ = s.leak();
        }
    }
}

/// Times the receive-hook split of `path`: uploads every rank's x, topk_idx and weights to
/// buffers of its own (on one new stream per GPU of the group) and combines the group's own y
/// (what the harness's last combine upload put there: the y `want_combine` was computed from;
/// a second L x R*T x H copy per rank would not fit beside the group at 64 ranks and more),
/// runs `warmup` split pairs and checks the last combine bit for bit against `want_combine`
/// (the oracle's), then times `iters` pairs with events around each half, then profiles
/// `iters` more under CUPTI. Synchronises before it returns (also on errors: the buffers it
/// frees are idle).
#[allow(clippy::too_many_arguments)]
pub fn hook_split(
    g: &mut GpuGroup,
    path: Path,
    x: &[Vec<bf16>],
    topk_idx: &[Vec<i64>],
    topk_weights: &[Vec<f32>],
    want_combine: &[Vec<bf16>],
    iters: usize,
    warmup: usize,
) -> Result<HookSplit, HookError> {
    use cudarc::driver::{result, CudaContext, CudaSlice};
    use ep_kernels::runtime::{CombineIn, DispatchIn, Tokens};
    let cfg = *g.config();
    let (r, k) = (cfg.num_ranks, cfg.top_k);
    let gerr =
        |what: &str, e: cudarc::driver::DriverError| -> HookError { cuda_err(what, e).into() };
    // One stream per GPU of the group, on a context object of our own with cudarc's
    // cross-stream event tracking off (all work here is on that one stream per GPU).
    let mut streams = Vec::new();
    for (c, _) in g.streams() {
        let ctx = CudaContext::new(c.ordinal()).map_err(|e| gerr("context", e))?;
        // SAFETY: nothing of this context object is in use yet; every buffer below is used on
        // its GPU's one stream only, so the implicit events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let s = ctx.new_stream().map_err(|e| gerr("stream", e))?;
        streams.push((ctx, s));
    }
    let per = r / streams.len();
    let st = |q: usize| &streams[q / per].1;
    let bits = |v: &[bf16]| -> Vec<u16> { v.iter().map(|b| b.to_bits()).collect() };
    struct Bufs {
        x: CudaSlice<u16>,
        t: CudaSlice<i64>,
        w: CudaSlice<f32>,
        y: BorrowedY,
    }
    let mut bufs = Vec::with_capacity(r);
    let mut outbufs: Vec<CudaSlice<u16>> = Vec::with_capacity(r);
    for q in 0..r {
        let s = st(q);
        let (y_ptr, y_len) = g.own_y(q)?;
        let up = |e| gerr("upload", e);
        // Zero-length inputs (a rank without tokens) still need a valid allocation.
        let pad = |v: Vec<u16>| if v.is_empty() { vec![0u16] } else { v };
        let t = if topk_idx[q].is_empty() {
            vec![-1i64]
        } else {
            topk_idx[q].clone()
        };
        let w = if topk_weights[q].is_empty() {
            vec![0f32]
        } else {
            topk_weights[q].clone()
        };
        bufs.push(Bufs {
            x: s.clone_htod(&pad(bits(&x[q]))).map_err(up)?,
            t: s.clone_htod(&t).map_err(up)?,
            w: s.clone_htod(&w).map_err(up)?,
            // SAFETY: rank q's own y, `y_len` bf16 (u16) values on this GPU's context, which
            // the group keeps until it drops; every use is on `s` before this function
            // synchronises and returns, and the slice is given back unfreed (BorrowedY).
            y: BorrowedY(Some(unsafe { s.upgrade_device_ptr::<u16>(y_ptr, y_len) })),
        });
        outbufs.push(s.alloc_zeros(x[q].len().max(1)).map_err(up)?);
    }
    let xs: Vec<_> = bufs.iter().map(|b| bf16_view(&b.x)).collect();
    let ts: Vec<_> = bufs.iter().map(|b| b.t.slice(..)).collect();
    let ws: Vec<_> = bufs.iter().map(|b| b.w.slice(..)).collect();
    let ys: Vec<_> = bufs
        .iter()
        .map(|b| bf16_view(b.y.0.as_ref().expect("present until drop")))
        .collect();
    let dins: Vec<DispatchIn> = (0..r)
        .map(|q| DispatchIn {
            x: &xs[q],
            topk_idx: &ts[q],
            n_tokens: Tokens::Host(topk_idx[q].len() / k),
        })
        .collect();
    let cins: Vec<CombineIn> = (0..r)
        .map(|q| CombineIn {
            y: &ys[q],
            topk_idx: &ts[q],
            topk_weights: &ws[q],
        })
        .collect();
    let sref: Vec<&cudarc::driver::CudaStream> = streams.iter().map(|(_, s)| s.as_ref()).collect();
    let raw: Vec<_> = streams
        .iter()
        .map(|(c, s)| (c.clone(), s.cu_stream()))
        .collect();
    let sync_all = || -> Result<(), HookError> {
        for (_, s) in &streams {
            s.synchronize().map_err(|e| gerr("synchronize", e))?;
        }
        Ok(())
    };
    // One split pair; `mark(i)` records event i of the pair (0..5) when timing.
    let pair = |g: &mut GpuGroup,
                ov: &mut [cudarc::driver::CudaViewMut<'_, bf16>],
                mark: &mut dyn FnMut(usize) -> Result<(), GpuError>|
     -> Result<(), GpuError> {
        mark(0)?;
        let hk = g.dispatch_send(path, &sref, &dins, None)?;
        mark(1)?;
        let handle = g.dispatch_recv(hk, &sref)?;
        mark(2)?;
        let ch = g.combine_send_opts(
            &sref,
            &handle,
            &cins,
            ov,
            CombineOpts::format(g.combine_format()),
        )?;
        mark(3)?;
        g.combine_recv(ch, &sref)?;
        mark(4)
    };
    let run = (|| -> Result<HookSplit, HookError> {
        let mut ov = bf16_views(&mut outbufs);
        for _ in 0..warmup.max(1) {
            pair(g, &mut ov, &mut |_| Ok(()))?;
        }
        sync_all()?;
        g.check()?;
        drop(ov);
        for (q, o) in outbufs.iter().enumerate() {
            let got = st(q).clone_dtoh(o).map_err(|e| gerr("download", e))?;
            let n = want_combine[q].len();
            if got[..n]
                .iter()
                .zip(&want_combine[q])
                .any(|(a, b)| *a != b.to_bits())
            {
                return Err(HookError::Mismatch(format!(
                    "{} combine through the receive hook differs from the oracle on rank {q}",
                    path.name()
                )));
            }
        }
        let mut ov = bf16_views(&mut outbufs);
        let n_ev = iters
            .checked_mul(5)
            .ok_or_else(|| GpuError::Unsupported(format!("{iters} timed calls")))?;
        let evs = Events::new(&raw, n_ev)?;
        for it in 0..iters {
            pair(g, &mut ov, &mut |i| {
                for (d, (ctx, s)) in raw.iter().enumerate() {
                    ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
                    // SAFETY: event and stream of this (bound) context.
                    unsafe { result::event::record(evs.per_dev[d].1[5 * it + i], *s) }
                        .map_err(|e| cuda_err("record", e))?;
                }
                Ok(())
            })?;
        }
        sync_all()?;
        g.check()?;
        let mut halves = [
            vec![0f64; iters],
            vec![0f64; iters],
            vec![0f64; iters],
            vec![0f64; iters],
        ];
        for (ctx, ev) in &evs.per_dev {
            ctx.bind_to_thread().map_err(|e| gerr("bind", e))?;
            for it in 0..iters {
                for (i, half) in halves.iter_mut().enumerate() {
                    // SAFETY: both events were recorded on this context and have completed.
                    let ms = unsafe { result::event::elapsed(ev[5 * it + i], ev[5 * it + i + 1]) }
                        .map_err(|e| gerr("elapsed", e))?;
                    half[it] = half[it].max(ms as f64 * 1e3);
                }
            }
        }
        drop(evs);
        let kernel = if iters == 0 {
            Err("no timed calls (--iters 0)".to_string())
        } else {
            match crate::cupti::KernelTimer::start() {
                Err(e) => Err(e.to_string()),
                Ok(timer) => {
                    let mut ran = Ok(());
                    for _ in 0..iters {
                        ran = pair(g, &mut ov, &mut |_| Ok(()));
                        if ran.is_err() {
                            break;
                        }
                    }
                    let synced = sync_all();
                    // Finish the timer whatever the run did: CUPTI's state is per process.
                    let recs = timer.finish();
                    ran?;
                    synced?;
                    g.check()?;
                    let devices: Vec<u32> = raw.iter().map(|(c, _)| c.ordinal() as u32).collect();
                    let (dn, cn) = kernel_names(path);
                    recs.map_err(|e| e.to_string())
                        .map(canonical)
                        .and_then(|recs| {
                            let (ds, dr) = per_half_us(&recs, dn, &devices, iters)?;
                            let (cs, cr) = per_half_us(&recs, cn, &devices, iters)?;
                            Ok([ds, dr, cs, cr])
                        })
                }
            }
        };
        let [ds, dr, cs, cr] = halves;
        Ok(HookSplit {
            dispatch_send_us: ds,
            dispatch_recv_us: dr,
            combine_send_us: cs,
            combine_recv_us: cr,
            kernel,
        })
    })();
    // Whatever happened, nothing of ours may still run when the buffers are freed.
    let _ = sync_all();
    run
}
