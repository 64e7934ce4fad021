//! Validation of one rank's inputs (docs/contract.md "Inputs on rank r" and "Errors"). Every path calls
//! these before anything moves.

use crate::config::Config;
use crate::error::{Error, Result};

/// L x R x T x H, saturating (it fits for a valid config; another never matches a real
/// buffer's length).
fn layout_elements(cfg: &Config) -> usize {
    crate::config::checked_product(
        "layout elements",
        &[
            cfg.num_local_experts(),
            cfg.num_ranks,
            cfg.max_tokens_per_rank,
            cfg.hidden,
        ],
    )
    .unwrap_or(usize::MAX)
}

/// Checks `x` and `topk_idx` of rank `rank` and returns its token count n_r.
pub fn check_dispatch_inputs(
    cfg: &Config,
    rank: usize,
    x_len: usize,
    topk_idx: &[i64],
) -> Result<usize> {
    if !topk_idx.len().is_multiple_of(cfg.top_k) {
        return Err(Error::ShapeMismatch {
            rank,
            tensor: "topk_idx",
            expected: topk_idx.len().next_multiple_of(cfg.top_k),
            got: topk_idx.len(),
            shape: format!("n x {} for top_k = {}", cfg.top_k, cfg.top_k),
        });
    }
    let n = topk_idx.len() / cfg.top_k;
    if n > cfg.max_tokens_per_rank {
        return Err(Error::TooManyTokens {
            rank,
            tokens: n,
            max: cfg.max_tokens_per_rank,
        });
    }
    // n <= T, so for a valid config n x H fits; saturate for any other (no slice is that long).
    let expected_x = n.saturating_mul(cfg.hidden);
    if x_len != expected_x {
        return Err(Error::ShapeMismatch {
            rank,
            tensor: "x",
            expected: expected_x,
            got: x_len,
            shape: format!("{n} tokens x hidden {}", cfg.hidden),
        });
    }
    check_topk(cfg, rank, topk_idx)?;
    Ok(n)
}

/// Every index in [-1, E); no expert twice in one token.
pub fn check_topk(cfg: &Config, rank: usize, topk_idx: &[i64]) -> Result<()> {
    for (token, row) in topk_idx.chunks_exact(cfg.top_k).enumerate() {
        for (slot, &e) in row.iter().enumerate() {
            if e < -1 || e >= cfg.num_experts as i64 {
                return Err(Error::ExpertOutOfRange {
                    rank,
                    token,
                    slot,
                    expert: e,
                    num_experts: cfg.num_experts,
                });
            }
            if e == -1 {
                continue;
            }
            if let Some(first) = row[..slot].iter().position(|&p| p == e) {
                return Err(Error::DuplicateExpert {
                    rank,
                    token,
                    expert: e,
                    first_slot: first,
                    second_slot: slot,
                });
            }
        }
    }
    Ok(())
}

/// Checks combine's tensors against the config and returns n_r.
pub fn check_combine_inputs(
    cfg: &Config,
    rank: usize,
    y_len: usize,
    topk_idx: &[i64],
    topk_weights_len: usize,
) -> Result<usize> {
    let expected_y = layout_elements(cfg);
    if y_len != expected_y {
        return Err(Error::ShapeMismatch {
            rank,
            tensor: "y",
            expected: expected_y,
            got: y_len,
            shape: format!(
                "{} local experts x {} rows x hidden {}",
                cfg.num_local_experts(),
                cfg.rows_per_expert(),
                cfg.hidden
            ),
        });
    }
    // combine has no `x`: pass the length that matches, so only topk_idx is checked (the
    // product saturates: an over-long topk_idx fails as TooManyTokens, not by wrapping).
    let n = check_dispatch_inputs(
        cfg,
        rank,
        (topk_idx.len() / cfg.top_k).saturating_mul(cfg.hidden),
        topk_idx,
    )?;
    if topk_weights_len != topk_idx.len() {
        return Err(Error::ShapeMismatch {
            rank,
            tensor: "topk_weights",
            expected: topk_idx.len(),
            got: topk_weights_len,
            shape: format!("{n} tokens x top_k {}", cfg.top_k),
        });
    }
    Ok(n)
}

/// An output buffer handed to `dispatch_into` must have been made for this config.
pub fn check_output(cfg: &Config, rank: usize, out: &crate::output::DispatchOutput) -> Result<()> {
    if out.config != *cfg {
        return Err(Error::ShapeMismatch {
            rank,
            tensor: "dispatch output",
            expected: layout_elements(cfg),
            got: layout_elements(&out.config),
            shape: format!(
                "made for {}, this group is {}",
                out.config.describe(),
                cfg.describe()
            ),
        });
    }
    Ok(())
}
