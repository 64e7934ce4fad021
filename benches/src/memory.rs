//! How much host memory one benchmark point will take, estimated from its config before
//! anything is generated, and the check ep-bench makes with it: a point that cannot fit fails in
//! milliseconds with the sizes and the flags to lower, instead of building inputs for a minute
//! and aborting in the allocator.
//!
//! The estimate counts the bytes the run writes (touches), not the address space it reserves:
//! the large layouts (`y`, `recv_x`, the communication regions) are allocated zeroed and
//! only their meaningful rows are ever written, so at the standard setting most of their
//! reserved bytes never cost memory. It is an upper bound on those writes: every token is taken
//! to select K experts, and every written region is rounded up to whole pages. Separately, no
//! single buffer may exceed the machine's memory and swap (Linux refuses such a reservation
//! outright, and Rust aborts).

use ep_reference::Config;

use crate::backend::Backend;

const PAGE: f64 = 4096.0;
/// Threads' stacks, the program, the allocator's slack.
const BASE: f64 = 64.0 * 1024.0 * 1024.0;
/// What the CUDA driver holds on the host for a process with a context and our modules
/// (a bound, not a measurement of ours: `/usr/bin/time -v` on the GPU machine tells).
const GPU_RUNTIME: f64 = 1024.0 * 1024.0 * 1024.0;

/// What one point needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// Bytes written, summed over every buffer alive at once (an upper bound).
    pub touched: u64,
    /// The largest single buffer, in bytes, and what it is.
    pub largest: u64,
    pub largest_what: &'static str,
    /// The parts of `touched`: (what, bytes).
    pub parts: Vec<(&'static str, u64)>,
    /// Reservations that the groups themselves check against MemAvailable when they are built
    /// (`ep_reference::transport::memory::check`): (what, bytes).
    pub reserved: Vec<(&'static str, u64)>,
}

/// What the machine has, from /proc/meminfo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// MemAvailable.
    pub available: u64,
    /// MemTotal + SwapTotal: the most one reservation may be.
    pub total_with_swap: u64,
}

impl MemInfo {
    /// Parses the text of /proc/meminfo; `None` where MemAvailable or MemTotal is missing.
    pub fn parse(text: &str) -> Option<MemInfo> {
        let field = |name: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib.saturating_mul(1024))
        };
        Some(MemInfo {
            available: field("MemAvailable:")?,
            total_with_swap: field("MemTotal:")?.saturating_add(field("SwapTotal:").unwrap_or(0)),
        })
    }

    /// This machine's, or `None` where /proc/meminfo cannot be read (then nothing is checked).
    pub fn read() -> Option<MemInfo> {
        MemInfo::parse(&std::fs::read_to_string("/proc/meminfo").ok()?)
    }
}

/// Bytes as GB with one decimal.
pub fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// Whole pages of `bytes` written in each of `regions` regions (each starts on a fresh page).
fn pages(bytes: f64, regions: f64) -> f64 {
    bytes + regions.min(bytes) * PAGE
}

/// The estimate of one point (`tokens` on every rank, config `cfg`) on `backend`.
pub fn estimate(cfg: &Config, tokens: usize, backend: &Backend) -> Estimate {
    let f = |v: usize| v as f64;
    let (r, e, t, h, k) = (
        f(cfg.num_ranks),
        f(cfg.num_experts),
        f(cfg.max_tokens_per_rank),
        f(cfg.hidden),
        f(cfg.top_k),
    );
    let n = r * f(tokens); // tokens of all ranks
    let s = n * k; // selections, at most
    let layout_rows = e * t; // one rank's dispatch layout: L x R x T = E x T
    let y_rank = layout_rows * 2.0 * h; // one rank's y (bf16)
                                        // One received row: the row, its scales, its src_info entry.
    let recv_row = f(cfg.recv_x_row_bytes()) + 4.0 * f(cfg.scales_per_row()) + 4.0;
    let inputs = n * (2.0 * h + 12.0 * k);
    let combine_out = n * 2.0 * h;
    // Every rank's dispatch output: the buffers are zeroed pages (`DispatchOutput::zeroed`), so
    // only the received rows cost memory, at most all selections.
    let dispatch_set = pages(s * recv_row, r * e);
    // One rank's output: each source's tokens at most once per local expert, min(K, L) rows.
    let one_rank_rows = (r * t * k.min(e / r)).min(s);
    let mut parts: Vec<(&'static str, f64)> = vec![("inputs (x, topk_idx, topk_weights)", inputs)];
    let mut reserved = Vec::new();
    match backend {
        Backend::Cpu => {
            let payload = f(cfg.payload_bytes());
            parts.extend([
                // Meaningful rows only (ep_benches::cpu::expert_outputs).
                ("expert outputs y", pages(s * 2.0 * h, r * e)),
                (
                    "dispatch outputs (oracle and both groups)",
                    3.0 * dispatch_set,
                ),
                ("combine outputs (oracle and both paths)", 3.0 * combine_out),
                (
                    "per-expert communication regions",
                    pages(s * (16.0 + payload + 2.0 * h), 2.0 * r * e),
                ),
                (
                    "batched communication regions",
                    pages(s * (48.0 + payload + 2.0 * h), 2.0 * r * r),
                ),
            ]);
            reserved = vec![
                (
                    "the per-expert path's communication buffers",
                    ep_reference::per_expert::bytes_needed(cfg),
                ),
                (
                    "the batched path's communication buffers",
                    ep_fast::Shared::bytes_needed(cfg),
                ),
            ];
        }
        // crate::timing: the oracle's outputs once, one rank's read-back at a time, y drawn
        // and uploaded for the received rows only (`crate::timing::run::HostSide`).
        Backend::Gpu(_) => parts.extend([
            (
                "expert outputs y (received rows)",
                pages(s * 2.0 * h, r * e),
            ),
            ("the oracle's dispatch outputs", dispatch_set),
            (
                "one rank's dispatch output read back",
                pages(one_rank_rows * recv_row, e / r),
            ),
            ("combine outputs (oracle and one path's)", 2.0 * combine_out),
            (
                "the CUDA driver's host side (context, modules)",
                GPU_RUNTIME,
            ),
        ]),
    }
    let touched = BASE + parts.iter().map(|p| p.1).sum::<f64>();
    let recv_x_rank = layout_rows * f(cfg.recv_x_row_bytes());
    let (largest, largest_what) = if y_rank >= recv_x_rank {
        (
            y_rank,
            "one rank's expert outputs y (experts x T x hidden x 2 bytes)",
        )
    } else {
        (
            recv_x_rank,
            "one rank's recv_x (experts x T x hidden bytes)",
        )
    };
    Estimate {
        // `f64 as u64` saturates.
        touched: touched as u64,
        largest: largest as u64,
        largest_what,
        parts: parts.into_iter().map(|(w, b)| (w, b as u64)).collect(),
        reserved,
    }
}

/// What one GPU holds for `ep-bench --backend gpu` (`crate::timing::run`) with `ranks_per_gpu`
/// ranks on it, in bytes, from ep-kernels' layout ([`ep_kernels::runtime::footprint`]): one
/// path's group at a time (its own tensors, that path's receive area only; each rank's set one
/// allocation in whole [`ep_kernels::runtime::ALLOC_GRANULE`] pages, and the group's 1 MiB of
/// slack), and the receive-hook split's
/// buffers of each rank (x, topk_idx, weights and the combine output; it combines the group's
/// own y). The CUDA context, the modules and CUPTI's buffers come on top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuBytes {
    /// The larger path's group: bytes per rank.
    pub group_per_rank: u64,
    /// The hook split's buffers: bytes per rank.
    pub hook_per_rank: u64,
    /// Both, for every rank of the GPU, and the slack.
    pub total: u64,
}

/// [`GpuBytes`] of `cfg` with `ranks_per_gpu` ranks on one GPU; `staging`: the NCCL transport
/// (its staging buffers). `None` where a size overflows (no group of it can be built).
pub fn gpu_device_bytes(cfg: &Config, ranks_per_gpu: usize, staging: bool) -> Option<GpuBytes> {
    use ep_kernels::runtime::{footprint, ALLOC_GRANULE};
    use ep_kernels::{Buffers, GpuOptions};
    let mut group = 0usize;
    for path in ep_reference::Path::ALL {
        let opts = GpuOptions {
            buffers: Buffers {
                path: Some(path),
                own_tensors: true,
            },
            ..GpuOptions::default()
        };
        let one = footprint(cfg, &opts, staging)
            .ok()?
            .checked_next_multiple_of(ALLOC_GRANULE)?;
        group = group.max(one);
    }
    let (t, h, k) = (cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k);
    // x and the combine output (T x H bf16 each), topk_idx (T x K i64), weights (T x K f32).
    let hook = t
        .checked_mul(h)?
        .checked_mul(4)?
        .checked_add(t.checked_mul(k)?.checked_mul(12)?)?;
    let total = group
        .checked_add(hook)?
        .checked_mul(ranks_per_gpu)?
        .checked_add(1 << 20)?;
    Some(GpuBytes {
        group_per_rank: group as u64,
        hook_per_rank: hook as u64,
        total: total as u64,
    })
}

/// Why a point does not fit.
#[derive(Debug, Clone, PartialEq)]
pub enum Shortfall {
    /// More bytes written than MemAvailable.
    Available { needed: u64, available: u64 },
    /// A group's buffers, which it checks against MemAvailable itself, do not fit.
    Reserved {
        what: &'static str,
        bytes: u64,
        available: u64,
    },
    /// One buffer larger than memory and swap together.
    Buffer {
        bytes: u64,
        what: &'static str,
        total_with_swap: u64,
    },
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shortfall::Available { needed, available } => write!(
                f,
                "needs about {} of memory, and {} is available (MemAvailable)",
                gb(*needed),
                gb(*available)
            ),
            Shortfall::Reserved {
                what,
                bytes,
                available,
            } => write!(
                f,
                "needs {} for {what} (reserved when the group is built), and {} is available (MemAvailable)",
                gb(*bytes),
                gb(*available)
            ),
            Shortfall::Buffer {
                bytes,
                what,
                total_with_swap,
            } => write!(
                f,
                "would allocate one buffer of {} ({what}): more than this machine's memory and swap together ({})",
                gb(*bytes),
                gb(*total_with_swap)
            ),
        }
    }
}

/// Checks `est` against `mem`.
pub fn check(est: &Estimate, mem: &MemInfo) -> Result<(), Shortfall> {
    if est.largest > mem.total_with_swap {
        return Err(Shortfall::Buffer {
            bytes: est.largest,
            what: est.largest_what,
            total_with_swap: mem.total_with_swap,
        });
    }
    if let Some(&(what, bytes)) = est.reserved.iter().find(|r| r.1 > mem.available) {
        return Err(Shortfall::Reserved {
            what,
            bytes,
            available: mem.available,
        });
    }
    if est.touched > mem.available {
        return Err(Shortfall::Available {
            needed: est.touched,
            available: mem.available,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    const MEMINFO: &str = "MemTotal:       24684092 kB\nMemFree:  1 kB\nMemAvailable:   23052264 kB\nSwapTotal:  1024 kB\n";

    #[test]
    fn meminfo_parses() {
        let m = MemInfo::parse(MEMINFO).unwrap();
        assert_eq!(m.available, 23052264 * 1024);
        assert_eq!(m.total_with_swap, (24684092 + 1024) * 1024);
        assert_eq!(MemInfo::parse("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn the_standard_setting_fits_a_small_machine_and_huge_tokens_do_not() {
        let mem = MemInfo::parse(MEMINFO).unwrap();
        let std = Config::new(8, 256, 128, 7168, 8, Mode::FP8).unwrap();
        let est = estimate(&std, 128, &Backend::Cpu);
        assert!(est.touched < 4_000_000_000, "{est:?}");
        assert_eq!(check(&est, &mem), Ok(()));
        // T = 60000: ~3.8M selections of ~40 KB each.
        let big = Config::new(8, 256, 60_000, 7168, 8, Mode::FP8).unwrap();
        let est = estimate(&big, 60_000, &Backend::Cpu);
        assert!(est.touched > 100_000_000_000, "{est:?}");
        match check(&est, &mem) {
            Err(Shortfall::Buffer { bytes, .. }) => assert_eq!(bytes, 256 * 60_000 * 7168 * 2),
            other => panic!("{other:?}"),
        }
        // A machine with room for any single buffer still lacks the bytes.
        let roomy = MemInfo {
            available: mem.available,
            total_with_swap: u64::MAX,
        };
        assert!(matches!(
            check(&est, &roomy),
            Err(Shortfall::Reserved { .. })
        ));
        let all = MemInfo {
            available: est.reserved.iter().map(|r| r.1).max().unwrap(),
            total_with_swap: u64::MAX,
        };
        assert_eq!(check(&est, &all), Ok(()));
        // The GPU backend's host side writes y for the received rows: 3.8M rows of 14 KB
        // (55 GB), not the capacity (8 x 220 GB).
        let est = estimate(&big, 60_000, &Backend::Gpu("test".into()));
        assert!(est.reserved.is_empty());
        match check(&est, &roomy) {
            Err(Shortfall::Available { needed, .. }) => {
                assert!(needed > 8 * 60_000 * 8 * 7168 * 2, "{needed}");
                assert!(needed < 8 * 256 * 60_000 * 7168 * 2, "{needed}");
            }
            other => panic!("{other:?}"),
        }
        // The per-expert group's own check at T = 1024 (45.6 GB) is made up front.
        let t1024 = Config::new(8, 256, 1024, 7168, 8, Mode::FP8).unwrap();
        let est = estimate(&t1024, 1024, &Backend::Cpu);
        match check(&est, &mem) {
            Err(Shortfall::Reserved { bytes, .. }) => {
                assert_eq!(bytes, ep_reference::per_expert::bytes_needed(&t1024))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bf16_layouts_count_their_received_rows() {
        let c = Config::new(2, 8, 64, 1024, 2, Mode::Bf16).unwrap();
        let est = estimate(&c, 1, &Backend::Cpu);
        // Zeroed pages: three sets of the received rows (2 ranks x 1 token x K = 2 selections of
        // a 2 KB row, its src_info entry), each of the 16 (rank, expert) regions a page more;
        // the whole layout (3 x 2 x 8 x 64 rows) would be 6.3 MB.
        let rows = 4 * (2 * 1024 + 4);
        let part = est
            .parts
            .iter()
            .find(|p| p.0.starts_with("dispatch outputs"))
            .unwrap();
        assert_eq!(part.1, 3 * (rows + 16 * 4096));
        assert!(part.1 < 3 * 2 * 8 * 64 * (2 * 1024 + 4) / 10);
    }

    fn std_cfg(r: usize) -> Config {
        Config::new(r, 256, 128, 7168, 8, Mode::FP8).unwrap()
    }

    /// The GPU backend's host side at 64 and 128 virtual ranks of the standard setting stays
    /// below 8 GB: nothing of the L x R*T capacity is written but the received rows (the whole
    /// y alone was 470 MB per rank, 60 GB at R = 128).
    #[test]
    fn the_gpu_backends_host_side_stays_below_8_gb_at_128_ranks() {
        let gpu = Backend::Gpu("test".into());
        for r in [64, 128] {
            let c = std_cfg(r);
            let est = estimate(&c, 128, &gpu);
            assert!(est.touched < 8_000_000_000, "R = {r}: {est:?}");
            let y = est.parts.iter().find(|p| p.0.starts_with("expert outputs"));
            // At most R*T*K rows of 2H bytes, and a page per (rank, expert) region.
            let rows = (r * 128 * 8 * 2 * 7168) as u64;
            assert_eq!(y.unwrap().1, rows + (r * 256 * 4096) as u64, "R = {r}");
            // What the capacity would cost: every rank's y written out.
            let capacity = (r * 256 * 128 * 7168 * 2) as u64;
            assert!(capacity > 4 * est.touched, "R = {r}");
        }
        let est = estimate(&std_cfg(128), 128, &gpu);
        assert!(est.touched > 2_000_000_000, "{est:?}");
    }

    /// What the GPU holds for ep-bench at 64 and 128 virtual ranks of the standard setting,
    /// from the layout: one path's group (the per-expert one, the larger) and the hook split's
    /// small buffers fit an H200 (149 GB free after the context, BENCHMARKS.md); 256 ranks do not.
    #[test]
    fn ep_bench_fits_an_h200_at_64_and_128_virtual_ranks() {
        const H200_FREE: u64 = 149_000_000_000;
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let b64 = gpu_device_bytes(&std_cfg(64), 64, false).unwrap();
        let b128 = gpu_device_bytes(&std_cfg(128), 128, false).unwrap();
        // Per rank: y 448 MiB, recv_x 224, the per-expert area E*T messages 231.5, scales 7;
        // the batched area R*T entries is smaller (58 MiB at R = 64, 117 at 128).
        assert!((900.0..940.0).contains(&mib(b64.group_per_rank)), "{b64:?}");
        assert!(
            (900.0..940.0).contains(&mib(b128.group_per_rank)),
            "{b128:?}"
        );
        assert!(b128.hook_per_rank < 4 << 20, "{b128:?}");
        assert!(b64.total < H200_FREE * 6 / 10, "{b64:?}");
        assert!(b128.total < H200_FREE * 9 / 10, "{b128:?}");
        // Both paths in one group, or a second y per rank for the split, leave less than 2%.
        let two_y = b128.total + 128 * 256 * 128 * 7168 * 2;
        assert!(two_y > H200_FREE, "{two_y}");
        let b256 = gpu_device_bytes(&std_cfg(256), 256, false).unwrap();
        assert!(b256.total > H200_FREE, "{b256:?}");
        // The NCCL staging adds the combine rows of every peer.
        let n = gpu_device_bytes(&std_cfg(64), 1, true).unwrap();
        assert!(n.group_per_rank > b64.group_per_rank, "{n:?}");
    }
}
