//! What one rank's allocation holds for a group's options ([`Buffers`]), in one place: the
//! layout the group and a process rank allocate ([`plan_sizes`]), the bytes the Python `Buffer`'s
//! size hint reports ([`footprint`], [`hint_bytes`]), and the check that refuses a launch which
//! would use a buffer the plan left out ([`check_launch`]).

use crate::error::GpuError;
use crate::runtime::layout::{rank_sizes, total_bytes, IoPtrs, NUM_BUFFERS};
use crate::runtime::options::{Buffers, GpuOptions};
use ep_reference::{Config, Op, Path};

/// Indices into [`rank_sizes`]'s array (the fields of `RankPtrs`).
pub(crate) mod idx {
    pub const Y: usize = 3;
    pub const RECV_X: usize = 5;
    pub const RECV_SCALES: usize = 6;
    pub const SRC_INFO: usize = 9;
    pub const BAT_BUF: usize = 15;
    pub const PE_BUF: usize = 17;
}

/// The size a left-out buffer keeps: its address stays distinct and aligned, nothing uses it.
const LEFT_OUT: usize = 16;

/// Byte sizes of one rank's buffers under `buffers`, with the NCCL staging when `staging`:
/// [`rank_sizes`] less the buffers the plan leaves out ([`Buffers`]). Every rank of a group must
/// use the same plan (peers carve each other's allocations with it; the handshake compares the
/// allocations' bytes).
pub(crate) fn plan_sizes(
    c: &Config,
    staging: bool,
    buffers: Buffers,
) -> Result<[usize; NUM_BUFFERS], GpuError> {
    let mut s = rank_sizes(c, staging)?;
    if !buffers.own_tensors {
        for i in [idx::Y, idx::RECV_X, idx::RECV_SCALES, idx::SRC_INFO] {
            s[i] = LEFT_OUT;
        }
    }
    if !buffers.runs(Path::Batched) {
        s[idx::BAT_BUF] = LEFT_OUT;
    }
    if !buffers.runs(Path::PerExpert) {
        s[idx::PE_BUF] = LEFT_OUT;
    }
    Ok(s)
}

/// Bytes of one rank's one allocation (one buffer set) for `opts`, with the NCCL staging when
/// `staging` (a group with an NCCL peer; a process rank on every transport but `Auto`).
pub fn footprint(c: &Config, opts: &GpuOptions, staging: bool) -> Result<usize, GpuError> {
    total_bytes(&plan_sizes(c, staging, opts.buffers)?)
}

/// The granularity of a large cuMemAlloc (its pages): one rank's set of buffers is one
/// allocation, so it takes its footprint rounded up to this.
pub const ALLOC_GRANULE: usize = 2 << 20;

/// What a caller that keeps `sets` operations in flight allocates per rank: `sets` groups of
/// `opts` (the Python `Buffer` forms its second set when a dispatch overlaps an earlier one of
/// the same shape: two sets from then on, as DeepEP's hint counts its double buffer).
pub fn hint_bytes(
    c: &Config,
    opts: &GpuOptions,
    staging: bool,
    sets: usize,
) -> Result<usize, GpuError> {
    // Each set of a rank is one cuMemAlloc, which takes whole 2 MiB pages.
    footprint(c, opts, staging)?
        .checked_next_multiple_of(ALLOC_GRANULE)
        .and_then(|b| b.checked_mul(sets))
        .ok_or_else(|| GpuError::Unsupported("the buffer sets' bytes overflow usize".into()))
}

/// Refuses, before anything is launched, a launch that would use a buffer `buffers` left out:
/// a path whose receive area is missing, or (without the group's own tensors) a dispatch
/// without the caller's `recv_x`, `recv_scales` and `src_info` or a combine without its `y`, for
/// any rank of the launch (`ranks`: the IoTable entries the launch's ranks read). A refused
/// call's poison launch (`refused`) uses no tensor of the plan's and is let through. The empty
/// kernel (`stage` < 0) uses nothing. `fp8`: the dispatch has scales (BF16 passes none).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_launch(
    buffers: Buffers,
    fp8: bool,
    op: Op,
    path: Path,
    stage: i32,
    refused: bool,
    ranks: &[IoPtrs],
) -> Result<(), GpuError> {
    if stage < 0 || refused {
        return Ok(());
    }
    if !buffers.runs(path) {
        return Err(GpuError::Unsupported(format!(
            "this group was formed for the {} path only (GpuOptions::buffers.path): the {} \
             path's receive buffers were not allocated",
            buffers.path.map_or("?", |p| p.name()),
            path.name()
        )));
    }
    if buffers.own_tensors {
        return Ok(());
    }
    for (i, io) in ranks.iter().enumerate() {
        let missing = match op {
            Op::Dispatch if io.recv_x == 0 || (fp8 && io.recv_scales == 0) || io.src_info == 0 => {
                "a dispatch's outputs (recv_x, recv_scales, src_info)"
            }
            Op::Combine if io.y == 0 => "a combine's y",
            _ => continue,
        };
        return Err(GpuError::Unsupported(format!(
            "{missing} for the launch's rank {i}: this group holds no tensors of its own \
             (GpuOptions::buffers.own_tensors = false), pass the caller's"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::layout::bytes_per_rank_with;
    use ep_reference::Mode;

    fn std_cfg(r: usize) -> Config {
        Config::new(r, 256, 128, 7168, 8, Mode::FP8).unwrap()
    }

    fn opts(path: Option<Path>, own_tensors: bool) -> GpuOptions {
        GpuOptions {
            buffers: Buffers { path, own_tensors },
            ..GpuOptions::default()
        }
    }

    #[test]
    fn the_default_plan_is_the_whole_layout() {
        for r in [1, 8, 64, 256] {
            let c = std_cfg(r);
            for staging in [false, true] {
                assert_eq!(
                    footprint(&c, &GpuOptions::default(), staging).unwrap(),
                    bytes_per_rank_with(&c, staging).unwrap()
                );
            }
        }
    }

    #[test]
    fn a_plan_leaves_out_exactly_its_buffers() {
        let c = std_cfg(8);
        let full = rank_sizes(&c, false).unwrap();
        let s = plan_sizes(
            &c,
            false,
            Buffers {
                path: Some(Path::Batched),
                own_tensors: false,
            },
        )
        .unwrap();
        let out = [
            idx::Y,
            idx::RECV_X,
            idx::RECV_SCALES,
            idx::SRC_INFO,
            idx::PE_BUF,
        ];
        for i in 0..NUM_BUFFERS {
            if out.contains(&i) {
                assert_eq!(s[i], LEFT_OUT, "buffer {i}");
            } else {
                assert_eq!(s[i], full[i], "buffer {i}");
            }
        }
        // At the standard setting the per-expert area alone is E*T messages (231 MiB in FP8),
        // y 448 MiB, recv_x 224 MiB.
        assert_eq!(full[idx::Y], 256 * 128 * 7168 * 2);
        assert_eq!(full[idx::RECV_X], 256 * 128 * 7168);
        let per = plan_sizes(&c, false, opts(Some(Path::PerExpert), true).buffers).unwrap();
        assert_eq!(per[idx::BAT_BUF], LEFT_OUT);
        assert_eq!(per[idx::PE_BUF], full[idx::PE_BUF]);
        // The hint is the sets' sum, each set's allocation in whole 2 MiB pages.
        let o = opts(Some(Path::Batched), false);
        let one = footprint(&c, &o, true).unwrap();
        let paged = hint_bytes(&c, &o, true, 1).unwrap();
        assert!(paged.is_multiple_of(ALLOC_GRANULE) && paged >= one && paged - one < ALLOC_GRANULE);
        assert_eq!(hint_bytes(&c, &o, true, 2).unwrap(), 2 * paged);
        assert!(footprint(&c, &o, false).unwrap() < bytes_per_rank_with(&c, false).unwrap() / 3);
    }

    #[test]
    fn launches_that_need_a_left_out_buffer_are_refused() {
        let b = Buffers {
            path: Some(Path::Batched),
            own_tensors: false,
        };
        let full = IoPtrs {
            y: 1,
            recv_x: 2,
            recv_scales: 3,
            src_info: 4,
            ..IoPtrs::default()
        };
        let none = IoPtrs::default();
        let pe = check_launch(b, true, Op::Dispatch, Path::PerExpert, 0, false, &[full]);
        assert!(matches!(pe, Err(GpuError::Unsupported(m)) if m.contains("batched path only")));
        for op in [Op::Dispatch, Op::Combine] {
            assert!(check_launch(b, true, op, Path::Batched, 0, false, &[full]).is_ok());
            assert!(check_launch(b, true, op, Path::Batched, 1, false, &[full, none]).is_err());
            // A refused call's poison and the empty kernel need nothing.
            assert!(check_launch(b, true, op, Path::Batched, 0, true, &[none]).is_ok());
            assert!(check_launch(b, true, op, Path::PerExpert, -1, false, &[none]).is_ok());
            // The default plan refuses nothing.
            let d = Buffers::default();
            assert!(check_launch(d, true, op, Path::PerExpert, 0, false, &[none]).is_ok());
        }
        let no_scales = IoPtrs {
            recv_scales: 0,
            ..full
        };
        assert!(
            check_launch(b, true, Op::Dispatch, Path::Batched, 2, false, &[no_scales]).is_err()
        );
        assert!(check_launch(b, true, Op::Combine, Path::Batched, 2, false, &[no_scales]).is_ok());
        // BF16 dispatches pass no scales.
        assert!(check_launch(
            b,
            false,
            Op::Dispatch,
            Path::Batched,
            2,
            false,
            &[no_scales]
        )
        .is_ok());
    }
}
