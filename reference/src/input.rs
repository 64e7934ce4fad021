//! Validation of one rank's inputs (DESIGN.md "Inputs on rank r" and "Errors"). Every path calls
//! these before anything moves.

use crate::config::Config;
use crate::error::{Error, Result};

/// Checks `x` and `topk_idx` of rank `rank` and returns its token count n_r.
pub fn check_dispatch_inputs(
    cfg: &Config,
    rank: usize,
    x_len: usize,
    topk_idx: &[i64],
) -> Result<usize> {
    if topk_idx.len() % cfg.top_k != 0 {
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
    if x_len != n * cfg.hidden {
        return Err(Error::ShapeMismatch {
            rank,
            tensor: "x",
            expected: n * cfg.hidden,
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
    let expected_y = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
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
    let n = check_dispatch_inputs(
        cfg,
        rank,
        (topk_idx.len() / cfg.top_k) * cfg.hidden,
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
            expected: cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden,
            got: out.config.num_local_experts() * out.config.rows_per_expert() * out.config.hidden,
            shape: format!(
                "made for {}, this group is {}",
                out.config.describe(),
                cfg.describe()
            ),
        });
    }
    Ok(())
}
