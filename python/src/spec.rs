//! [`Spec`]: a group's shape, validated once, and the checks of every tensor a call hands the
//! native side. A `Spec` can only be made from a config that passed `Config::new` and the
//! bindings' own size bound, so whatever holds one (the native rank, the Python `CallSpec`) never
//! validates again; each call's tensors are checked against it ([`Spec::dispatch`],
//! [`Spec::combine`]) and only then become the addresses the device API takes.

use crate::error::{BindError, Result};
use crate::tensor::{check, in_bytes, Dtype, Layout, Meta, Ptr, Want};
use ep_reference::{Config, Mode};

/// The largest value the kernels take for one dimension (they receive them as `int`).
const MAX_DIM: usize = i32::MAX as usize;

/// Refuses shapes whose buffer arithmetic could overflow, before `ep_kernels` computes sizes
/// with plain arithmetic: every dimension fits an `int`, and an upper bound of one rank's bytes
/// (every buffer of the layout is at most one of these terms, times 8, plus alignment) fits u64.
pub(crate) fn check_dims(cfg: &Config) -> Result<()> {
    for (argument, v) in [
        ("num_ranks", cfg.num_ranks),
        ("num_experts", cfg.num_experts),
        ("num_max_dispatch_tokens_per_rank", cfg.max_tokens_per_rank),
        ("hidden", cfg.hidden),
    ] {
        if v > MAX_DIM {
            return Err(BindError::argument(
                argument,
                format!("{v} exceeds the largest supported {MAX_DIM}"),
            ));
        }
    }
    let (r, e, l, t, h, k) = (
        cfg.num_ranks as u128,
        cfg.num_experts as u128,
        cfg.num_local_experts() as u128,
        cfg.max_tokens_per_rank as u128,
        cfg.hidden as u128,
        cfg.top_k as u128,
    );
    let rows = l * r * t + r * t * k + t * k + e + r * l + r + 1;
    let bound = 8 * rows * (2 * h + 512) + 26 * 256 + (1 << 20);
    if bound > u64::MAX as u128 / 2 {
        return Err(BindError::argument(
            "num_max_dispatch_tokens_per_rank",
            format!(
                "the buffers of {} do not fit in 64-bit sizes",
                cfg.describe()
            ),
        ));
    }
    Ok(())
}

/// Addresses of one dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchPtrs {
    /// `bf16 [n, H]`.
    pub x: Ptr,
    /// `int64 [n, K]`.
    pub topk_idx: Ptr,
    pub num_tokens: usize,
    /// `[L, R*T, H]` e4m3 or bf16, length in bytes.
    pub recv_x: Ptr,
    /// `float32 [L, R*T, H/128]` / packed `int32 [L, R*T, H/512]`, length in bytes; None in BF16.
    pub recv_x_scales: Option<Ptr>,
    /// `int32 [L]`.
    pub recv_count: Ptr,
    /// `int32 [L, R*T]`.
    pub src_info: Ptr,
    /// `int32 [L, R, 2]` (begin, count), length in int64 entries (`L * R`).
    pub layout_range: Ptr,
    /// `cumulative_local_expert_recv_stats`, `int32 [L]`: the kernels add `recv_count` to it.
    pub recv_stats: Option<Ptr>,
    /// `dispatch_wait_recv_cost_stats`, `int64 [R]`: the kernels add their wait per source.
    pub wait_stats: Option<Ptr>,
}

/// Addresses of one combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombinePtrs {
    /// `bf16 [L, R*T, H]`: the expert outputs in the dispatch layout.
    pub y: Ptr,
    /// `int64 [n, K]` (the dispatched tensor or a copy of its values).
    pub topk_idx: Ptr,
    /// `float32 [n, K]`.
    pub topk_weights: Ptr,
    /// `bf16 [n, H]`.
    pub out: Ptr,
    /// `combine_wait_recv_cost_stats`, `int64 [R]`: the kernels add their wait per owner.
    pub wait_stats: Option<Ptr>,
}

/// The tensors of one dispatch, as they describe themselves.
pub struct DispatchMetas<'a> {
    pub x: &'a Meta,
    pub topk_idx: &'a Meta,
    pub recv_x: &'a Meta,
    pub recv_x_scales: Option<&'a Meta>,
    pub recv_count: &'a Meta,
    pub src_info: &'a Meta,
    pub layout_range: &'a Meta,
    /// `cumulative_local_expert_recv_stats`, `int32 [L]` (the Buffer adds `recv_count` to it).
    pub recv_stats: Option<&'a Meta>,
    /// `dispatch_wait_recv_cost_stats`, `int64 [R]` (checked as DeepEP checks it; unused).
    pub wait_stats: Option<&'a Meta>,
}

/// The tensors of one combine.
pub struct CombineMetas<'a> {
    pub y: &'a Meta,
    pub topk_idx: &'a Meta,
    pub topk_weights: &'a Meta,
    pub out: &'a Meta,
    /// `combine_wait_recv_cost_stats`, `int64 [R]`.
    pub wait_stats: Option<&'a Meta>,
}

/// A validated group shape and the device its tensors live on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    cfg: Config,
    device: i64,
}

fn row_major(dtype: Dtype, shape: &[usize]) -> Want<'_> {
    Want {
        dtype,
        shape,
        layout: Layout::RowMajor,
    }
}

impl Spec {
    /// Validates the config (the contract's rules and the bindings' size bound) once.
    /// `device`: the CUDA ordinal every tensor must be on (-1: the host, as the CPU stand-in
    /// tests of the Buffer's plumbing pass).
    pub fn new(cfg: Config, device: i64) -> Result<Spec> {
        cfg.validate()?;
        check_dims(&cfg)?;
        Ok(Spec { cfg, device })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> i64 {
        self.device
    }

    fn fp8(&self) -> Option<bool> {
        match self.cfg.mode {
            Mode::Bf16 => None,
            Mode::Fp8 { ue8m0, .. } => Some(ue8m0),
        }
    }

    /// Checks every tensor of a dispatch (the token count n is `x`'s rows, at most T); returns
    /// their addresses.
    pub fn dispatch(&self, m: &DispatchMetas<'_>) -> Result<DispatchPtrs> {
        let c = &self.cfg;
        let (t, h, k, r) = (c.max_tokens_per_rank, c.hidden, c.top_k, c.num_ranks);
        let (l, rt) = (c.num_local_experts(), c.num_ranks * c.max_tokens_per_rank);
        let dev = self.device;
        let n = match m.x.shape.as_slice() {
            &[n, _] if n >= 0 => n as usize,
            got => {
                return Err(BindError::argument(
                    "x",
                    format!("shape {got:?}, expected [*, {h}] (tokens x hidden)"),
                ))
            }
        };
        let x = check("x", m.x, row_major(Dtype::Bf16, &[n, h]), dev)?;
        if n > t {
            return Err(BindError::argument(
                "x",
                format!("{n} tokens exceed num_max_dispatch_tokens_per_rank = {t}"),
            ));
        }
        let topk_idx = check("topk_idx", m.topk_idx, row_major(Dtype::I64, &[n, k]), dev)?;
        let (recv_x, scales) = match self.fp8() {
            None => {
                let p = check("recv_x", m.recv_x, row_major(Dtype::Bf16, &[l, rt, h]), dev)?;
                if m.recv_x_scales.is_some() {
                    return Err(BindError::argument(
                        "recv_x_scales",
                        "given for a BF16 dispatch (it has no scales)",
                    ));
                }
                (in_bytes(p, Dtype::Bf16), None)
            }
            Some(ue8m0) => {
                let p = check(
                    "recv_x",
                    m.recv_x,
                    row_major(Dtype::Fp8E4m3, &[l, rt, h]),
                    dev,
                )?;
                let (dtype, g) = if ue8m0 {
                    (Dtype::I32, h / 512)
                } else {
                    (Dtype::F32, h / 128)
                };
                let s = m.recv_x_scales.ok_or_else(|| {
                    BindError::argument("recv_x_scales", "an FP8 dispatch needs its scales tensor")
                })?;
                let want = Want {
                    dtype,
                    shape: &[l, rt, g],
                    layout: Layout::ColumnMajorLastTwo,
                };
                let q = check("recv_x_scales", s, want, dev)?;
                (p, Some(in_bytes(q, dtype)))
            }
        };
        let recv_count = check("recv_count", m.recv_count, row_major(Dtype::I32, &[l]), dev)?;
        let src_info = check("src_info", m.src_info, row_major(Dtype::I32, &[l, rt]), dev)?;
        let (lp, pairs) = check(
            "layout_range",
            m.layout_range,
            row_major(Dtype::I32, &[l, r, 2]),
            dev,
        )?;
        let recv_stats = m
            .recv_stats
            .map(|s| {
                let name = "cumulative_local_expert_recv_stats";
                check(name, s, row_major(Dtype::I32, &[l]), dev)
            })
            .transpose()?;
        let wait_stats = m
            .wait_stats
            .map(|s| {
                let name = "dispatch_wait_recv_cost_stats";
                check(name, s, row_major(Dtype::I64, &[r]), dev)
            })
            .transpose()?;
        Ok(DispatchPtrs {
            x,
            topk_idx,
            num_tokens: n,
            recv_x,
            recv_x_scales: scales,
            recv_count,
            src_info,
            layout_range: (lp, pairs / 2),
            recv_stats,
            wait_stats,
        })
    }

    /// Checks every tensor of a combine after a dispatch of `n` tokens; returns their addresses.
    pub fn combine(&self, n: usize, m: &CombineMetas<'_>) -> Result<CombinePtrs> {
        let c = &self.cfg;
        let (h, k, r) = (c.hidden, c.top_k, c.num_ranks);
        let (l, rt) = (c.num_local_experts(), c.num_ranks * c.max_tokens_per_rank);
        let dev = self.device;
        let y = check("x", m.y, row_major(Dtype::Bf16, &[l, rt, h]), dev)?;
        let topk_idx = check("topk_idx", m.topk_idx, row_major(Dtype::I64, &[n, k]), dev)?;
        let topk_weights = check(
            "topk_weights",
            m.topk_weights,
            row_major(Dtype::F32, &[n, k]),
            dev,
        )?;
        let out = check("out", m.out, row_major(Dtype::Bf16, &[n, h]), dev)?;
        let wait_stats = m
            .wait_stats
            .map(|s| {
                let name = "combine_wait_recv_cost_stats";
                check(name, s, row_major(Dtype::I64, &[r]), dev)
            })
            .transpose()?;
        Ok(CombinePtrs {
            y,
            topk_idx,
            topk_weights,
            out,
            wait_stats,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::strides_of;

    fn meta(dtype: Dtype, shape: &[usize], layout: Layout, ptr: u64) -> Meta {
        Meta {
            ptr,
            dtype: Some(dtype),
            other_dtype: String::new(),
            shape: shape.iter().map(|&d| d as i64).collect(),
            strides: strides_of(shape, layout),
            device: 3,
        }
    }

    fn rm(dtype: Dtype, shape: &[usize], ptr: u64) -> Meta {
        meta(dtype, shape, Layout::RowMajor, ptr)
    }

    // R = 2, E = 8 (L = 4), T = 6, H = 512, K = 3.
    fn spec(mode: Mode) -> Spec {
        Spec::new(Config::new(2, 8, 6, 512, 3, mode).unwrap(), 3).unwrap()
    }

    #[test]
    fn a_config_is_validated_when_the_spec_is_made() {
        let bad = Config {
            num_experts: 7,
            ..Config::new(2, 8, 6, 512, 3, Mode::Bf16).unwrap()
        };
        assert!(Spec::new(bad, 0)
            .unwrap_err()
            .to_string()
            .contains("multiple"));
    }

    #[test]
    fn a_dispatch_gives_the_addresses_and_lengths_the_device_api_takes() {
        let s = spec(Mode::FP8);
        let (x, t) = (rm(Dtype::Bf16, &[5, 512], 1), rm(Dtype::I64, &[5, 3], 2));
        let rx = rm(Dtype::Fp8E4m3, &[4, 12, 512], 3);
        let sc = meta(Dtype::F32, &[4, 12, 4], Layout::ColumnMajorLastTwo, 4);
        let (c, si, lr) = (
            rm(Dtype::I32, &[4], 5),
            rm(Dtype::I32, &[4, 12], 6),
            rm(Dtype::I32, &[4, 2, 2], 7),
        );
        let m = DispatchMetas {
            x: &x,
            topk_idx: &t,
            recv_x: &rx,
            recv_x_scales: Some(&sc),
            recv_count: &c,
            src_info: &si,
            layout_range: &lr,
            recv_stats: None,
            wait_stats: None,
        };
        let p = s.dispatch(&m).unwrap();
        assert_eq!(
            p,
            DispatchPtrs {
                x: (1, 5 * 512),
                topk_idx: (2, 15),
                num_tokens: 5,
                recv_x: (3, 4 * 12 * 512),
                recv_x_scales: Some((4, 4 * 12 * 4 * 4)),
                recv_count: (5, 4),
                src_info: (6, 48),
                layout_range: (7, 8),
                recv_stats: None,
                wait_stats: None,
            }
        );
        // The statistics, where given, go to the kernels with their lengths.
        let (rs, ws) = (rm(Dtype::I32, &[4], 8), rm(Dtype::I64, &[2], 9));
        let q = s
            .dispatch(&DispatchMetas {
                recv_stats: Some(&rs),
                wait_stats: Some(&ws),
                ..m
            })
            .unwrap();
        assert_eq!((q.recv_stats, q.wait_stats), (Some((8, 4)), Some((9, 2))));
        // Row-major scales, too many tokens, a missing scales tensor: each named.
        let row = rm(Dtype::F32, &[4, 12, 4], 4);
        let e = s
            .dispatch(&DispatchMetas {
                recv_x_scales: Some(&row),
                ..m
            })
            .unwrap_err();
        assert!(e.to_string().starts_with("argument `recv_x_scales`"), "{e}");
        let big = rm(Dtype::Bf16, &[7, 512], 1);
        let big_t = rm(Dtype::I64, &[7, 3], 2);
        let e = s
            .dispatch(&DispatchMetas {
                x: &big,
                topk_idx: &big_t,
                ..m
            })
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument `x`: 7 tokens exceed num_max_dispatch_tokens_per_rank = 6"
        );
        let e = s
            .dispatch(&DispatchMetas {
                recv_x_scales: None,
                ..m
            })
            .unwrap_err();
        assert!(e.to_string().contains("needs its scales"), "{e}");
        let stats = rm(Dtype::I64, &[4], 8);
        let e = s
            .dispatch(&DispatchMetas {
                recv_stats: Some(&stats),
                ..m
            })
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("argument `cumulative_local_expert_recv_stats`: dtype"),
            "{e}"
        );
    }

    #[test]
    fn a_combine_checks_every_tensor_against_the_dispatched_token_count() {
        let s = spec(Mode::Bf16);
        let y = rm(Dtype::Bf16, &[4, 12, 512], 1);
        let (t, w, o) = (
            rm(Dtype::I64, &[5, 3], 2),
            rm(Dtype::F32, &[5, 3], 3),
            rm(Dtype::Bf16, &[5, 512], 4),
        );
        let m = CombineMetas {
            y: &y,
            topk_idx: &t,
            topk_weights: &w,
            out: &o,
            wait_stats: None,
        };
        assert_eq!(s.combine(5, &m).unwrap().out, (4, 5 * 512));
        let e = s.combine(4, &m).unwrap_err();
        assert_eq!(
            e.to_string(),
            "argument `topk_idx`: shape [5, 3], expected [4, 3]"
        );
        let mut other = o.clone();
        other.device = 0;
        let e = s
            .combine(5, &CombineMetas { out: &other, ..m })
            .unwrap_err();
        assert!(e.to_string().contains("on cuda:0, expected cuda:3"), "{e}");
    }
}
