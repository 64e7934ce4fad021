//! Summary statistics of latency samples.

use serde::Serialize;

/// The nearest-rank percentile `p` (0..=100) of `sorted` (ascending): the smallest sample such
/// that at least `p` percent of the samples are at or below it. `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    debug_assert!(
        sorted.windows(2).all(|w| w[0] <= w[1]),
        "samples must be sorted"
    );
    let p = p.clamp(0.0, 100.0);
    // rank = ceil(p/100 * n), 1-based, at least 1.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median: the mean of the two middle samples for an even count.
pub fn median(sorted: &[f64]) -> Option<f64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// Latency summary in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub samples: usize,
    pub mean_us: f64,
    pub median_us: f64,
    pub p99_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Summary {
    /// Summarizes `samples` (any order). `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Summary {
            samples: s.len(),
            mean_us: s.iter().sum::<f64>() / s.len().max(1) as f64,
            median_us: median(&s)?,
            p99_us: percentile(&s, 99.0)?,
            min_us: *s.first()?,
            max_us: *s.last()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&s, 99.0), Some(99.0));
        assert_eq!(percentile(&s, 50.0), Some(50.0));
        assert_eq!(percentile(&s, 100.0), Some(100.0));
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        // With fewer than 100 samples p99 is the maximum.
        let s: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&s, 99.0), Some(20.0));
        assert_eq!(percentile(&s, 95.0), Some(19.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 99.0), None);
    }

    #[test]
    fn median_even_and_odd() {
        assert_eq!(median(&[1.0, 2.0, 10.0]), Some(2.0));
        assert_eq!(median(&[1.0, 2.0, 4.0, 10.0]), Some(3.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn summary_sorts_its_input() {
        let s = Summary::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!(s.samples, 5);
        assert_eq!(s.median_us, 3.0);
        assert_eq!(s.mean_us, 3.0);
        assert_eq!(s.min_us, 1.0);
        assert_eq!(s.max_us, 5.0);
        assert_eq!(s.p99_us, 5.0);
        assert!(Summary::of(&[]).is_none());
    }
}
