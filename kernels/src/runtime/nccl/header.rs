//! The batch headers a peer sends over the NCCL transport, bounded before anything is sized
//! by them.

use crate::error::GpuError;

/// What one checked batch header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchCounts {
    pub tokens: usize,
    pub selections: usize,
}

/// Bounds the batch header `words` = (tokens, selections, rows per local expert...) that rank
/// `from` sent to rank `rank`, before anything is sized by it: tokens in 0..=T, selections in
/// tokens..=tokens*K (a token travels to a destination only with at least one selection there),
/// each local expert's rows in 0..=tokens (no token selects an expert twice), the rows summing
/// to the selections. `words` must hold 2 + L values.
pub(crate) fn check_header(
    rank: usize,
    from: usize,
    words: &[i32],
    t: usize,
    k: usize,
) -> Result<BatchCounts, GpuError> {
    let bad = |field: &'static str, value: i64, expected: String| GpuError::PeerCount {
        rank,
        peer: from,
        field,
        value,
        expected,
    };
    if words.len() < 2 {
        return Err(bad("header words", words.len() as i64, "at least 2".into()));
    }
    let tokens = words[0] as i64;
    if tokens < 0 || tokens > t as i64 {
        return Err(bad("batch tokens", tokens, format!("0..={t} (T)")));
    }
    let max_sel = tokens * k as i64;
    let selections = words[1] as i64;
    if selections < tokens || selections > max_sel {
        return Err(bad(
            "batch selections",
            selections,
            format!("{tokens}..={max_sel} (tokens..=tokens*K)"),
        ));
    }
    let mut sum = 0i64;
    for &w in &words[2..] {
        let rows = w as i64;
        if rows < 0 || rows > tokens {
            return Err(bad(
                "rows of a local expert",
                rows,
                format!("0..={tokens} (the batch's tokens)"),
            ));
        }
        sum += rows;
    }
    if sum != selections {
        return Err(bad(
            "rows summed over local experts",
            sum,
            format!("{selections} (the batch's selections)"),
        ));
    }
    Ok(BatchCounts {
        tokens: tokens as usize,
        selections: selections as usize,
    })
}

/// The headers of one (rank, peer) pair: what `rank` sends to `peer` (its own kernel's, checked
/// all the same) and what it receives from `peer`, both bounded by [`check_header`].
pub(crate) fn check_pair(
    rank: usize,
    peer: usize,
    sent: &[i32],
    received: &[i32],
    t: usize,
    k: usize,
) -> Result<(BatchCounts, BatchCounts), GpuError> {
    Ok((
        check_header(rank, rank, sent, t, k)?,
        check_header(rank, peer, received, t, k)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(r: Result<BatchCounts, GpuError>) -> (&'static str, i64) {
        match r {
            Err(GpuError::PeerCount {
                rank: 1,
                peer: 3,
                field,
                value,
                ..
            }) => (field, value),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_peer_header_is_bounded_before_use() {
        let (t, k) = (8, 4);
        // 3 tokens, 5 selections, rows 2 + 3 over two local experts.
        assert_eq!(
            check_header(1, 3, &[3, 5, 2, 3], t, k).unwrap(),
            BatchCounts {
                tokens: 3,
                selections: 5
            }
        );
        assert_eq!(
            check_header(1, 3, &[0, 0, 0, 0], t, k).unwrap(),
            BatchCounts {
                tokens: 0,
                selections: 0
            }
        );
        assert_eq!(
            check_header(1, 3, &[8, 32, 8, 8, 8, 8], t, k)
                .unwrap()
                .selections,
            32
        );
        // Tokens past T or negative (a negative i32 once became a huge usize).
        assert_eq!(
            field(check_header(1, 3, &[9, 9, 9], t, k)),
            ("batch tokens", 9)
        );
        assert_eq!(
            field(check_header(1, 3, &[-1, 0, 0], t, k)),
            ("batch tokens", -1)
        );
        assert_eq!(
            field(check_header(1, 3, &[i32::MIN, 0], t, k)),
            ("batch tokens", i32::MIN as i64)
        );
        // Selections past tokens*K (they size the combine send out of the staging region),
        // below the tokens, or negative.
        assert_eq!(
            field(check_header(1, 3, &[2, 9, 4, 5], t, k)),
            ("batch selections", 9)
        );
        assert_eq!(
            field(check_header(1, 3, &[2, 1, 1, 0], t, k)),
            ("batch selections", 1)
        );
        assert_eq!(
            field(check_header(1, 3, &[0, -4, 0], t, k)),
            ("batch selections", -4)
        );
        // Rows per expert: one past the tokens, negative, or not summing to the selections.
        assert_eq!(
            field(check_header(1, 3, &[2, 3, 3, 0], t, k)),
            ("rows of a local expert", 3)
        );
        assert_eq!(
            field(check_header(1, 3, &[2, 3, -1, 2], t, k)),
            ("rows of a local expert", -1)
        );
        assert_eq!(
            field(check_header(1, 3, &[2, 3, 1, 1], t, k)),
            ("rows summed over local experts", 2)
        );
        assert_eq!(field(check_header(1, 3, &[1], t, k)), ("header words", 1));
        // A pair: the received header names the peer, the sent one this rank.
        assert!(check_pair(1, 3, &[1, 1, 1], &[2, 2, 2], t, k).is_ok());
        assert_eq!(
            field(check_pair(1, 3, &[1, 1, 1], &[2, 2, 3], t, k).map(|p| p.1)),
            ("rows of a local expert", 3)
        );
        assert!(matches!(
            check_pair(1, 3, &[9, 9, 9], &[0, 0, 0], t, k),
            Err(GpuError::PeerCount {
                rank: 1,
                peer: 1,
                field: "batch tokens",
                ..
            })
        ));
    }
}
