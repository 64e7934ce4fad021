//! Host data in and out of the oracle and the CPU paths, with no Python in sight: raw
//! little-endian bytes (what a numpy array or a `bytes` object holds) become typed slices after a
//! length check that names the argument, and outputs become DeepEP-shaped byte buffers.

use crate::error::{BindError, Result};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::{
    bf16, rank::run_ranks, CombineFormat, Config, CpuOptions, DispatchOutput, Mode, Path,
    RecvScales, RecvX,
};
use std::time::Duration;

/// DeepEP's three FP8 flags as our mode. `round_scale` and `use_ue8m0` only matter with
/// `use_fp8`, as in DeepEP; `use_ue8m0` without `round_scale` is the contract's config error.
pub fn mode(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> Mode {
    if use_fp8 {
        Mode::Fp8 {
            round_scale,
            ue8m0: use_ue8m0,
        }
    } else {
        Mode::Bf16
    }
}

/// Reads `bytes` as little-endian values of `N` bytes each.
fn values<const N: usize, T>(
    argument: &str,
    what: &str,
    bytes: &[u8],
    f: fn([u8; N]) -> T,
) -> Result<Vec<T>> {
    if !bytes.len().is_multiple_of(N) {
        return Err(BindError::argument(
            argument,
            format!(
                "{} bytes is not a whole number of {what} values ({N} bytes each)",
                bytes.len()
            ),
        ));
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks_exact yields N bytes")))
        .collect())
}

/// bf16 values from their little-endian bits.
pub fn bf16s(argument: &str, bytes: &[u8]) -> Result<Vec<bf16>> {
    values(argument, "bf16", bytes, |b: [u8; 2]| {
        bf16::from_bits(u16::from_le_bytes(b))
    })
}

pub fn i64s(argument: &str, bytes: &[u8]) -> Result<Vec<i64>> {
    values(argument, "int64", bytes, i64::from_le_bytes)
}

pub fn f32s(argument: &str, bytes: &[u8]) -> Result<Vec<f32>> {
    values(argument, "float32", bytes, f32::from_le_bytes)
}

fn le_bytes<T: Copy, const N: usize>(v: &[T], f: fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// f32 -> bf16 bits, rounded as the contract rounds (nearest even, canonical NaN).
pub fn bf16_bits_from_f32(v: &[f32]) -> Vec<u8> {
    le_bytes(v, |x| {
        ep_reference::bf16_from_f32(x).to_bits().to_le_bytes()
    })
}

/// bf16 bits -> f32 (exact).
pub fn f32_from_bf16_bits(argument: &str, bytes: &[u8]) -> Result<Vec<u8>> {
    let v = bf16s(argument, bytes)?;
    Ok(le_bytes(&v, |x| ep_reference::bf16_to_f32(x).to_le_bytes()))
}

/// What `scales` holds (the dtype the Python side gives the array).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalesKind {
    /// `float32 [L, R*T, H/128]`.
    F32,
    /// UE8M0 exponent bytes packed four per `int32`: `[L, R*T, H/512]`.
    PackedUe8m0,
}

/// One rank's dispatch output as little-endian bytes in DeepEP's low-latency shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputBytes {
    /// `[L, R*T, H]`: e4m3 bytes (FP8) or bf16 bits (BF16).
    pub recv_x: Vec<u8>,
    pub recv_x_scales: Option<(ScalesKind, Vec<u8>)>,
    /// `int32 [L]`.
    pub recv_count: Vec<u8>,
    /// `int64 [L, R]`, DeepEP's packed `(begin << 32) | count`.
    pub layout_range: Vec<u8>,
    /// `int32 [L, R*T]`.
    pub src_info: Vec<u8>,
}

pub fn output_bytes(out: &DispatchOutput) -> OutputBytes {
    let recv_x = match &out.recv_x {
        RecvX::Bf16(v) => le_bytes(v, |x| x.to_bits().to_le_bytes()),
        RecvX::Fp8(v) => v.clone(),
    };
    let recv_x_scales = out.recv_scales.as_ref().map(|s| match s {
        RecvScales::F32(v) => (ScalesKind::F32, le_bytes(v, f32::to_le_bytes)),
        RecvScales::Ue8m0(v) => (ScalesKind::PackedUe8m0, le_bytes(v, i32::to_le_bytes)),
    });
    OutputBytes {
        recv_x,
        recv_x_scales,
        recv_count: le_bytes(&out.recv_count, i32::to_le_bytes),
        layout_range: le_bytes(&out.layout_range_packed(), i64::to_le_bytes),
        src_info: le_bytes(&out.src_info, i32::to_le_bytes),
    }
}

/// Every rank's rows and routing (or expert outputs and weights), typed.
pub type RankInputs<A, B> = (Vec<Vec<A>>, Vec<Vec<B>>);

/// Every rank's typed dispatch inputs from their bytes (`x[r]`: bf16 bits, `topk_idx[r]`: int64).
pub fn dispatch_inputs(xs: &[&[u8]], topks: &[&[u8]]) -> Result<RankInputs<bf16, i64>> {
    if xs.len() != topks.len() {
        return Err(BindError::argument(
            "topk_idx",
            format!(
                "{} ranks of topk_idx for {} ranks of x",
                topks.len(),
                xs.len()
            ),
        ));
    }
    let x = xs
        .iter()
        .enumerate()
        .map(|(r, b)| bf16s(&format!("x[{r}]"), b))
        .collect::<Result<_>>()?;
    let t = topks
        .iter()
        .enumerate()
        .map(|(r, b)| i64s(&format!("topk_idx[{r}]"), b))
        .collect::<Result<_>>()?;
    Ok((x, t))
}

/// Every rank's typed combine inputs (`y[r]`: bf16 bits, `topk_weights[r]`: float32).
pub fn combine_inputs(ys: &[&[u8]], ws: &[&[u8]]) -> Result<RankInputs<bf16, f32>> {
    if ys.len() != ws.len() {
        return Err(BindError::argument(
            "topk_weights",
            format!(
                "{} ranks of topk_weights for {} ranks of y",
                ws.len(),
                ys.len()
            ),
        ));
    }
    let y = ys
        .iter()
        .enumerate()
        .map(|(r, b)| bf16s(&format!("y[{r}]"), b))
        .collect::<Result<_>>()?;
    let w = ws
        .iter()
        .enumerate()
        .map(|(r, b)| f32s(&format!("topk_weights[{r}]"), b))
        .collect::<Result<_>>()?;
    Ok((y, w))
}

/// The oracle's dispatch of every rank.
pub fn oracle_dispatch(
    cfg: &Config,
    xs: &[Vec<bf16>],
    topks: &[Vec<i64>],
) -> Result<Vec<DispatchOutput>> {
    let inputs: Vec<RankInput<'_>> = xs
        .iter()
        .zip(topks)
        .map(|(x, t)| RankInput { x, topk_idx: t })
        .collect();
    Ok(oracle::dispatch(cfg, &inputs)?)
}

/// The oracle's combine of every rank (`n_r x H` bf16 each), the rows in `format`
/// (`oracle::combine_with`: LogFMT-10's round trip where asked).
pub fn oracle_combine(
    cfg: &Config,
    ys: &[Vec<bf16>],
    topks: &[Vec<i64>],
    ws: &[Vec<f32>],
    format: CombineFormat,
) -> Result<Vec<Vec<bf16>>> {
    if topks.len() != ys.len() {
        return Err(BindError::argument(
            "topk_idx",
            format!(
                "{} ranks of topk_idx for {} ranks of y",
                topks.len(),
                ys.len()
            ),
        ));
    }
    let inputs: Vec<CombineInput<'_>> = ys
        .iter()
        .zip(topks)
        .zip(ws)
        .map(|((y, t), w)| CombineInput {
            y,
            topk_idx: t,
            topk_weights: w,
        })
        .collect();
    Ok(oracle::combine_with(cfg, &inputs, format)?)
}

/// bf16 rows as little-endian bits.
pub fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    le_bytes(v, |x| x.to_bits().to_le_bytes())
}

/// One dispatch and one combine on the CPU backend (one thread per rank): every rank's dispatch
/// output and combine output. `ys` are the expert outputs in the dispatch layout.
pub fn cpu_roundtrip(
    path: Path,
    cfg: &Config,
    xs: &[Vec<bf16>],
    topks: &[Vec<i64>],
    ys: &[Vec<bf16>],
    ws: &[Vec<f32>],
    timeout: Duration,
) -> Result<(Vec<DispatchOutput>, Vec<Vec<bf16>>)> {
    for (argument, got) in [
        ("x", xs.len()),
        ("topk_idx", topks.len()),
        ("y", ys.len()),
        ("topk_weights", ws.len()),
    ] {
        if got != cfg.num_ranks {
            return Err(BindError::argument(
                argument,
                format!("expected inputs for {} ranks, got {got}", cfg.num_ranks),
            ));
        }
    }
    let opts = CpuOptions {
        timeout,
        ..CpuOptions::default()
    };
    let mut ranks = ep_fast::path_group(path, cfg, opts)?;
    let results = run_ranks(&mut ranks, |r| {
        let me = r.rank();
        let (out, handle) = r.dispatch(&xs[me], &topks[me])?;
        let combined = r.combine(&ys[me], &topks[me], &ws[me], &handle)?;
        Ok::<_, ep_reference::Error>((out, combined))
    });
    let mut outs = Vec::with_capacity(results.len());
    let mut combined = Vec::with_capacity(results.len());
    for r in results {
        let (o, c) = r?;
        outs.push(o);
        combined.push(c);
    }
    Ok((outs, combined))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_i64(v: &[i64]) -> Vec<u8> {
        le_bytes(v, i64::to_le_bytes)
    }

    #[test]
    fn byte_lengths_are_checked_and_name_the_argument() {
        let e = bf16s("x[1]", &[0u8; 3]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument `x[1]`: 3 bytes is not a whole number of bf16 values (2 bytes each)"
        );
        assert!(i64s("topk_idx", &[0u8; 12]).is_err());
        assert!(f32s("w", &[0u8; 6]).is_err());
        assert_eq!(i64s("t", &le_i64(&[-1, 7])).unwrap(), vec![-1, 7]);
    }

    #[test]
    fn bf16_conversion_rounds_to_nearest_even() {
        // 1 + 2^-8 is a tie between 1.0 (0x3F80, even) and 0x3F81.
        let b = bf16_bits_from_f32(&[1.0 + 2f32.powi(-8), -2.0]);
        assert_eq!(b, vec![0x80, 0x3F, 0x00, 0xC0]);
        let back = f32_from_bf16_bits("x", &b).unwrap();
        assert_eq!(
            back,
            [1.0f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat()
        );
    }

    /// A case small enough to check by hand: R=2, E=4 (L=2), T=2, H=128 bf16, K=2.
    #[test]
    fn hand_checked_dispatch_layout() {
        let cfg = Config::new(2, 4, 2, 128, 2, Mode::Bf16).unwrap();
        let row = |v: f32| vec![ep_reference::bf16_from_f32(v); 128];
        // Rank 0: token 0 -> experts 1 and 2, token 1 -> expert 1. Rank 1: token 0 -> 3, -1.
        let xs = vec![[row(1.0), row(2.0)].concat(), row(3.0)];
        let topks = vec![vec![1, 2, 1, -1], vec![3, -1]];
        let outs = oracle_dispatch(&cfg, &xs, &topks).unwrap();
        // Rank 0 holds experts 0 and 1: expert 1 gets rank 0's tokens 0 and 1.
        let b0 = output_bytes(&outs[0]);
        assert_eq!(b0.recv_count, le_bytes(&[0i32, 2], i32::to_le_bytes));
        // layout_range[l][s] packed (begin << 32) | count: (l=1, s=0) = (0, 2), (l=1, s=1) = (2, 0).
        assert_eq!(b0.layout_range, le_i64(&[0, 0, 2, 2 << 32]));
        // src_info of expert 1 (rows 4.. of L x R*T = 2 x 4): tokens 0 and 1.
        assert_eq!(
            &b0.src_info[16..24],
            &le_bytes(&[0i32, 1], i32::to_le_bytes)[..]
        );
        // Rank 1 holds experts 2 and 3: one row each, from rank 0 token 0 and rank 1 token 0.
        let b1 = output_bytes(&outs[1]);
        assert_eq!(b1.recv_count, le_bytes(&[1i32, 1], i32::to_le_bytes));
        assert_eq!(b1.layout_range, le_i64(&[1, 1 << 32, 0, 1]));
        // Expert 3 row 0 carries rank 1's token (3.0 = 0x4040).
        let row_bytes = 128 * 2;
        let at = 4 * row_bytes; // local expert 1, row 0
        assert_eq!(&b1.recv_x[at..at + 2], &[0x40, 0x40]);
        assert!(b1.recv_x_scales.is_none());
    }

    #[test]
    fn cpu_paths_match_the_oracle() {
        let cfg = Config::new(2, 4, 3, 128, 2, Mode::FP8).unwrap();
        let mk = |seed: u32, n: usize| -> Vec<bf16> {
            (0..n)
                .map(|i| {
                    let v = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32;
                    ep_reference::bf16_from_f32(v / 37.0 - 13.0)
                })
                .collect()
        };
        let xs = vec![mk(1, 3 * 128), mk(2, 2 * 128)];
        let topks = vec![vec![0, 3, 2, -1, 1, 2], vec![3, 0, -1, -1]];
        let rows = cfg.num_local_experts() * cfg.rows_per_expert() * 128;
        let ys = vec![mk(3, rows), mk(4, rows)];
        let ws = vec![
            vec![0.5, 0.25, 1.0, 0.0, -2.0, 0.125],
            vec![0.75, 1.5, 9.0, 9.0],
        ];
        let want = oracle_dispatch(&cfg, &xs, &topks).unwrap();
        let want_c = oracle_combine(&cfg, &ys, &topks, &ws, CombineFormat::Bf16).unwrap();
        for path in Path::ALL {
            let (got, got_c) =
                cpu_roundtrip(path, &cfg, &xs, &topks, &ys, &ws, Duration::from_secs(10)).unwrap();
            for r in 0..2 {
                assert_eq!(got[r].diff(&want[r]), None, "{path:?} rank {r}");
                assert_eq!(got_c[r], want_c[r], "{path:?} rank {r}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_the_contracts_errors() {
        let cfg = Config::new(1, 2, 1, 128, 1, Mode::Bf16).unwrap();
        let xs = vec![vec![bf16::ZERO; 128]];
        let e = oracle_dispatch(&cfg, &xs, &[vec![5]]).unwrap_err();
        assert!(matches!(
            e,
            BindError::Contract(ep_reference::Error::ExpertOutOfRange { expert: 5, .. })
        ));
        let e = cpu_roundtrip(
            Path::Batched,
            &cfg,
            &xs,
            &[vec![0]],
            &[],
            &[vec![1.0]],
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument `y`: expected inputs for 1 ranks, got 0"
        );
    }
}
