//! The check: the layer's outputs downloaded once, after the stream finished, and compared bit
//! for bit with what `ep_reference::oracle` says the same layer computes. The host twins of the
//! two kernels (top-k, experts) give the oracle the routing and the expert outputs; the oracle
//! gives the dispatch and combine outputs of every rank.

use crate::error::{cuda, LayerError};
use crate::inputs::HostRank;
use crate::layer::RankBufs;
use ep_kernels::cudarc::driver::CudaStream;
use ep_reference::numerics::fp8::{e4m3_to_f32, pow2i};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::{bf16, bf16_from_f32, Config, DispatchOutput, RecvScales, RecvX};
use std::sync::Arc;

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
pub type Expected = (
    Vec<DispatchOutput>,
    Vec<Vec<bf16>>,
    Vec<Vec<i64>>,
    Vec<Vec<f32>>,
);

pub fn expected(cfg: &Config, host: &[HostRank]) -> Result<Expected, LayerError> {
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
pub fn verify(
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
