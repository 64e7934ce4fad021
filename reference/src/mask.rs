//! DeepEP's "shrink mode" rank mask: a set of ranks the group no longer sends to nor waits for.
//!
//! The rule (docs/contract.md, "Masked ranks"): a call with mask M equals, bit for bit on every
//! rank outside M, the same call with every top-k slot that names an expert of a rank in M set
//! to -1, and with the ranks in M sending nothing (as if all their own slots were -1). The
//! outputs of a rank in M are not defined and are never compared.
//!
//! [`RankMask`] is that set as a value: the oracle takes one ([`crate::oracle::dispatch_masked`],
//! [`crate::oracle::combine_masked`]), the endpoints report theirs
//! ([`crate::EpRank::query_mask`]), and [`RankMask::apply`] turns a rank's routing into the
//! routing the rule says it effectively uses.

use crate::config::Config;
use crate::error::{Error, Result};

/// One flag per rank of a group: `true` for a masked rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct RankMask {
    masked: Vec<bool>,
}

impl RankMask {
    /// The mask of a group of `num_ranks` ranks with no rank masked.
    pub fn none(num_ranks: usize) -> RankMask {
        RankMask {
            masked: vec![false; num_ranks],
        }
    }

    /// The mask of a group of `num_ranks` ranks with exactly `ranks` masked (repeats are
    /// fine). A rank outside `0..num_ranks` is [`Error::RankOutOfRange`] naming it.
    pub fn from_ranks(num_ranks: usize, ranks: &[usize]) -> Result<RankMask> {
        let mut m = RankMask::none(num_ranks);
        for &r in ranks {
            if r >= num_ranks {
                return Err(Error::RankOutOfRange {
                    rank: r,
                    ranks: num_ranks,
                });
            }
            m.masked[r] = true;
        }
        Ok(m)
    }

    /// Whether rank `r` is masked.
    ///
    /// # Panics
    /// When `r >= num_ranks()`.
    pub fn is_masked(&self, r: usize) -> bool {
        self.masked[r]
    }

    /// Masks (`true`) or unmasks (`false`) rank `r`.
    ///
    /// # Panics
    /// When `r >= num_ranks()`.
    pub fn set(&mut self, r: usize, masked: bool) {
        self.masked[r] = masked;
    }

    /// The masked ranks, ascending.
    pub fn masked(&self) -> impl Iterator<Item = usize> + '_ {
        self.masked
            .iter()
            .enumerate()
            .filter_map(|(r, &m)| m.then_some(r))
    }

    /// How many ranks are masked.
    pub fn count(&self) -> usize {
        self.masked.iter().filter(|&&m| m).count()
    }

    /// The group's size.
    pub fn num_ranks(&self) -> usize {
        self.masked.len()
    }

    /// Whether no rank is masked.
    pub fn is_empty(&self) -> bool {
        !self.masked.contains(&true)
    }

    /// The flags, one per rank (DeepEP's `query_mask_buffer` fills an int tensor like this).
    pub fn as_slice(&self) -> &[bool] {
        &self.masked
    }

    /// Masks every rank that `other` masks as well.
    ///
    /// # Panics
    /// When the two masks are of groups of different sizes.
    pub fn union_with(&mut self, other: &RankMask) {
        assert_eq!(
            self.num_ranks(),
            other.num_ranks(),
            "masks of groups of different sizes"
        );
        for (a, &b) in self.masked.iter_mut().zip(&other.masked) {
            *a |= b;
        }
    }

    /// The routing rank `rank` effectively uses under this mask: every slot -1 when `rank`
    /// itself is masked, else every slot whose expert's rank (`e / L`) is masked set to -1 and
    /// every other slot as given.
    ///
    /// Values that are not expert ids of `cfg` (below -1, or naming a rank outside the mask)
    /// are left as they are, so that the input checks still see them.
    ///
    /// # Panics
    /// When `rank >= num_ranks()`.
    pub fn apply(&self, cfg: &Config, rank: usize, topk_idx: &[i64]) -> Vec<i64> {
        if self.is_masked(rank) {
            return vec![-1; topk_idx.len()];
        }
        let l_n = cfg.num_local_experts().max(1) as i64;
        topk_idx
            .iter()
            .map(|&e| {
                let owner_masked = e >= 0 && self.masked.get((e / l_n) as usize) == Some(&true);
                if owner_masked {
                    -1
                } else {
                    e
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Mode;

    #[test]
    fn construction_and_queries() {
        let m = RankMask::none(4);
        assert_eq!((m.num_ranks(), m.count(), m.is_empty()), (4, 0, true));
        assert_eq!(m.masked().count(), 0);
        let mut m = RankMask::from_ranks(4, &[3, 1, 3]).unwrap();
        assert_eq!(m.masked().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!((m.count(), m.is_empty()), (2, false));
        assert!(m.is_masked(1) && m.is_masked(3) && !m.is_masked(0) && !m.is_masked(2));
        assert_eq!(m.as_slice(), &[false, true, false, true]);
        m.set(1, false);
        m.set(0, true);
        assert_eq!(m.masked().collect::<Vec<_>>(), vec![0, 3]);
        let mut u = RankMask::from_ranks(4, &[2]).unwrap();
        u.union_with(&m);
        assert_eq!(u.masked().collect::<Vec<_>>(), vec![0, 2, 3]);
        assert_eq!(RankMask::from_ranks(4, &[]).unwrap(), RankMask::none(4));
    }

    #[test]
    fn a_rank_outside_the_group_is_refused_by_name() {
        assert_eq!(
            RankMask::from_ranks(4, &[1, 4]),
            Err(Error::RankOutOfRange { rank: 4, ranks: 4 })
        );
        assert_eq!(
            RankMask::from_ranks(0, &[0]),
            Err(Error::RankOutOfRange { rank: 0, ranks: 0 })
        );
    }

    #[test]
    #[should_panic]
    fn is_masked_out_of_range_panics() {
        RankMask::none(2).is_masked(2);
    }

    #[test]
    fn apply_drops_the_slots_of_masked_ranks() {
        // 4 ranks, 2 local experts each: expert e lives on rank e / 2.
        let cfg = Config::new(4, 8, 4, 128, 3, Mode::Bf16).unwrap();
        let topk = [0, 3, 5, -1, 7, 2, 6, 1, 4];
        let none = RankMask::none(4);
        assert_eq!(none.apply(&cfg, 0, &topk), topk.to_vec());
        // Rank 1 (experts 2, 3) and rank 3 (experts 6, 7) masked.
        let m = RankMask::from_ranks(4, &[1, 3]).unwrap();
        assert_eq!(
            m.apply(&cfg, 0, &topk),
            vec![0, -1, 5, -1, -1, -1, -1, 1, 4]
        );
        assert_eq!(m.apply(&cfg, 2, &topk), m.apply(&cfg, 0, &topk));
        // A masked rank effectively sends nothing.
        assert_eq!(m.apply(&cfg, 1, &topk), vec![-1; 9]);
        assert_eq!(m.apply(&cfg, 3, &[]), Vec::<i64>::new());
        // Ids that are not valid are left for the input checks.
        assert_eq!(m.apply(&cfg, 0, &[-2, 8, 100, 6]), vec![-2, 8, 100, -1]);
    }
}
