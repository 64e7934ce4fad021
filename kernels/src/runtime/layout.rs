//! The memory layout shared with the kernels: the rank-address table entry (`RankPtrs`), the
//! kernel parameters (`KParams`), every buffer's byte size (checked arithmetic), and the carving
//! of one rank's single allocation into its buffers.

use crate::error::GpuError;
use ep_reference::numerics::logfmt_wire::slot_bytes;
use ep_reference::{CombineFormat, Config};

/// Threads per block (NTHREADS in common.cuh).
pub const NTHREADS: u32 = 512;
pub(crate) const HDR_BYTES: usize = 80;
pub(crate) const PE_HDR: usize = 16;
pub use crate::variant::{Variant, MASK_WORDS, MAX_RANKS, NARROW_RANKS};

/// `ranks` against [`MAX_RANKS`]: the typed error past it.
pub fn check_ranks(ranks: usize) -> Result<(), GpuError> {
    if ranks > MAX_RANKS {
        return Err(GpuError::TooManyRanks {
            ranks,
            max: MAX_RANKS,
        });
    }
    Ok(())
}

/// A set of ranks below [`MAX_RANKS`] (bit d % 32 of word d / 32: rank d), e.g. the peers a rank
/// reaches through NCCL (the kernels' `nccl_mask`).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PeerMask(pub [u32; MASK_WORDS]);

impl PeerMask {
    /// No rank.
    pub const EMPTY: PeerMask = PeerMask([0; MASK_WORDS]);

    /// Ranks 0..r (r at most [`MAX_RANKS`]; more are clipped).
    pub fn first(r: usize) -> PeerMask {
        let mut m = PeerMask::EMPTY;
        for d in 0..r.min(MAX_RANKS) {
            m.insert(d);
        }
        m
    }

    /// The set of the ranks in `ranks` (each below [`MAX_RANKS`]).
    pub fn of(ranks: impl IntoIterator<Item = usize>) -> PeerMask {
        let mut m = PeerMask::EMPTY;
        for d in ranks {
            m.insert(d);
        }
        m
    }

    /// Adds rank d (below [`MAX_RANKS`]).
    pub fn insert(&mut self, d: usize) {
        self.0[d / 32] |= 1 << (d % 32);
    }

    /// Whether rank d is in the set.
    pub fn contains(&self, d: usize) -> bool {
        d < MAX_RANKS && (self.0[d / 32] >> (d % 32)) & 1 == 1
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// The ranks in the set, ascending.
    pub fn ranks(&self) -> Vec<usize> {
        (0..MAX_RANKS).filter(|&d| self.contains(d)).collect()
    }

    /// The first 32 ranks as one word (tests and logs).
    pub fn low_word(&self) -> u32 {
        self.0[0]
    }
}

impl std::fmt::Debug for PeerMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerMask{:?}", self.ranks())
    }
}

/// Every device address of one rank (`struct RankPtrs` in common.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RankPtrs {
    pub(crate) x: u64,
    pub(crate) topk: u64,
    pub(crate) weights: u64,
    pub(crate) y: u64,
    pub(crate) meta: u64,
    pub(crate) recv_x: u64,
    pub(crate) recv_scales: u64,
    pub(crate) recv_count: u64,
    pub(crate) layout: u64,
    pub(crate) src_info: u64,
    pub(crate) out: u64,
    pub(crate) row_tk: u64,
    pub(crate) comb_map: u64,
    pub(crate) comb_pos: u64,
    pub(crate) comb_cnt: u64,
    pub(crate) bat_buf: u64,
    pub(crate) bat_meta: u64,
    pub(crate) pe_buf: u64,
    pub(crate) cmb_buf: u64,
    pub(crate) sig: u64,
    pub(crate) state: u64,
    pub(crate) bat_cnt: u64,
    pub(crate) snd_buf: u64,
    pub(crate) snd_hdr: u64,
    pub(crate) rcv_hdr: u64,
    pub(crate) shrink: u64,
}

/// Buffers in one rank's allocation (the fields of [`RankPtrs`]).
pub(crate) const NUM_BUFFERS: usize = 26;

/// u64 decision words per peer in the shrink buffer: one per (kernel kind, recv or ack)
/// (`shr_decide` in shrink.cuh); the rank mask (R i32) follows them.
pub(crate) const SHRINK_DECISIONS: usize = 2 * NUM_KINDS;

/// A rank's caller-supplied tensors for one call (`struct IoPtrs` in common.cuh): each nonzero
/// address replaces the group's own buffer of that name; `ntok` points to an i32 token count;
/// `recv_stats` (i32 `[L]`) and `wait_stats` (i64 `[R]`) are the caller's statistics, added to
/// where nonzero (stats.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct IoPtrs {
    pub x: u64,
    pub topk: u64,
    pub weights: u64,
    pub y: u64,
    pub out: u64,
    pub recv_x: u64,
    pub recv_scales: u64,
    pub recv_count: u64,
    pub layout: u64,
    pub src_info: u64,
    pub ntok: u64,
    pub recv_stats: u64,
    pub wait_stats: u64,
}

/// The kernels' second parameter (`struct IoTable`): one entry per rank of the launch, in rank
/// order from the device's first rank. All zero: the group's own buffers (the host harness).
/// As many entries as the device's build takes ([`Variant::io_capacity`]): the launch passes
/// their bytes as the parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IoTable {
    pub r: Vec<IoPtrs>,
}

impl IoTable {
    /// All zero, `entries` long.
    pub(crate) fn new(entries: usize) -> IoTable {
        IoTable {
            r: vec![IoPtrs::default(); entries],
        }
    }
}

/// Signal counts have this many bits (SIG_COUNT_BITS in common.cuh): T*K must stay below.
pub(crate) const SIG_COUNT_BITS: u32 = 24;
/// The count field all ones (SIG_POISON in common.cuh): a failed rank's signal, never a count.
pub(crate) const SIG_POISON: u32 = (1 << SIG_COUNT_BITS) - 1;

/// Byte offset of the u64 epochs inside a rank's `state` buffer (ST_EPOCH64 in common.cuh).
/// Read on the host by the test hook `GpuGroup::set_epochs_for_test` alone (feature `testing`).
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) const STATE_EPOCH_OFFSET: u64 = 64;
/// u32 words of a device's error word (see common.cuh).
pub(crate) const ERR_WORDS: usize = 16;
/// Kernel kinds (NUM_KINDS in common.cuh), each with its own epoch.
pub(crate) const NUM_KINDS: usize = 4;

/// Kernel parameters (`struct KParams` in common.cuh), passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KParams {
    pub table: u64,
    pub err: u64,
    pub timeout_ns: u64,
    pub r: i32,
    pub e: i32,
    pub l: i32,
    pub t: i32,
    pub h: i32,
    pub k: i32,
    pub fp8: i32,
    pub round_scale: i32,
    pub ue8m0: i32,
    pub rank_base: i32,
    pub ranks_here: i32,
    pub blocks_per_rank: i32,
    pub xrow: i32,
    pub spr: i32,
    pub entry_bytes: i32,
    pub pe_entry_bytes: i32,
    pub fault_rank: i32,
    pub sys_scope: i32,
    pub zero_copy: i32,
    pub pad1: i32,
    pub prof: u64,
    /// Bit d % 32 of word d / 32: peer d is reached through NCCL ([`PeerMask`]).
    pub nccl_mask: [u32; MASK_WORDS],
    pub stage: i32,
    pub pad2: i32,
    /// The device's error-word mirror in mapped pinned host memory (its device address).
    pub err_host: u64,
    /// 1: the kernels trap after recording an error ([`GpuOptions::trap_on_error`]).
    pub trap: i32,
    /// 1: shrink mode ([`GpuOptions::enable_shrink`]).
    pub shrink: i32,
    /// 1: recv_scales in DeepEP's column-major layout ([`GpuOptions::scales_column_major`]).
    pub scol: i32,
    /// 1: a call the host refused because the group failed (`GpuGroup::poison_refused`): every
    /// block sends the poison (poison.cuh) and nothing else, as if the error word were set.
    pub refused: i32,
    /// Combine: 1: the rows travel in LogFMT-10 (logfmt.cuh), 0: bf16.
    pub logfmt: i32,
    /// Combine: the byte stride of cmb_buf's first T*K rows ([`cmb_row_bytes`]).
    pub cmb_row: i32,
}

/// `a * b * ...` for the size of `what`, or a typed error naming it (no silent wrap in release).
pub(crate) fn prod(what: &str, fs: &[usize]) -> Result<usize, GpuError> {
    fs.iter()
        .try_fold(1usize, |a, &f| a.checked_mul(f))
        .ok_or_else(|| {
            GpuError::Unsupported(format!(
                "the size of {what} ({}) does not fit in usize",
                fs.iter()
                    .map(|f| f.to_string())
                    .collect::<Vec<_>>()
                    .join(" x ")
            ))
        })
}

/// `v` as the i32 the kernels take for `what`, or a typed error naming it.
pub(crate) fn to_i32(what: &str, v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| {
        GpuError::Unsupported(format!(
            "{what} = {v} exceeds the kernels' i32 limit ({})",
            i32::MAX
        ))
    })
}

/// Byte sizes of one rank's buffers, in the order of [`RankPtrs`]; every product checked.
pub(crate) fn rank_sizes(c: &Config, nccl: bool) -> Result<[usize; NUM_BUFFERS], GpuError> {
    let (r, e, l, t, h, k) = (
        c.num_ranks,
        c.num_experts,
        c.num_local_experts(),
        c.max_tokens_per_rank,
        c.hidden,
        c.top_k,
    );
    if prod("T x K", &[t, k])? >= SIG_POISON as usize {
        return Err(GpuError::Unsupported(format!(
            "T x K = {} x {} must stay below 2^{SIG_COUNT_BITS} - 1 (the count field of a \
             signal; all ones is the poison of a failed rank)",
            t, k
        )));
    }
    let eb = entry_bytes_checked(c)?;
    let peb = pe_entry_bytes_checked(c)?;
    // cmb_buf: T*K rows, each put by its owner at t*K+k (both paths), of a LogFMT row's largest
    // size where H suits LogFMT (else 2H); with NCCL, R*T*K rows more for what NCCL lands
    // (batched: peer d's batch at T*K + d*T*K; per-expert: packed from T*K), all rows 2H then
    // (NCCL carries bf16 rows only), which holds the T*K LogFMT rows too (4H >= 2H + H/32).
    let cmb = if nccl {
        prod("cmb_buf", &[r + 1, t, k, h, 2])?
    } else {
        prod("cmb_buf", &[t, k, slot_bytes(h)])?
    };
    let sig_words = 6usize
        .checked_mul(r)
        .and_then(|a| a.checked_add(l.checked_mul(r)?))
        .and_then(|a| a.checked_add(e))
        .ok_or_else(|| GpuError::Unsupported("the signal array size overflows".into()))?;
    let hdr = prod("snd_hdr", &[r, 2usize.saturating_add(l), 4])?;
    let sizes = [
        prod("x", &[t, h, 2])?,
        prod("topk", &[t, k, 8])?,
        prod("weights", &[t, k, 4])?,
        prod("y", &[l, r, t, h, 2])?,
        16,
        prod("recv_x", &[l, r, t, c.recv_x_row_bytes()])?,
        prod("recv_scales", &[l, r, t, c.scales_per_row(), 4])?.max(4),
        prod("recv_count", &[l, 4])?,
        prod("layout", &[l, r, 8])?,
        prod("src_info", &[l, r, t, 4])?,
        prod("out", &[t, h, 2])?,
        prod("row_tk", &[l, r, t, 4])?,
        prod("comb_map", &[r, t, k, 4])?,
        prod("comb_pos", &[t, k, 4])?,
        prod("comb_cnt", &[r, 4])?,
        prod("bat_buf", &[r, t, eb])?,
        prod("bat_meta", &[r, 8])?,
        prod("pe_buf", &[l, r, t, peb])?,
        cmb,
        prod("sig", &[sig_words, 8])?,
        128, // state: u32 counters, then the u64 epochs at STATE_EPOCH_OFFSET
        prod("bat_cnt", &[r, l, 4])?,
        if nccl {
            // Staging: batched dispatch R*T entries, per-expert dispatch R*T*K messages (at
            // most T*K selections go to one destination), combine R*T*K rows.
            prod("snd_buf", &[r, t, eb])?
                .max(prod("snd_buf", &[r, t, k, peb])?)
                .max(prod("snd_buf", &[r, t, k, h, 2])?)
        } else {
            16
        },
        hdr,
        hdr,
        // shrink: the decision words (u64) and the rank mask (i32 per peer)
        prod("shrink", &[r, SHRINK_DECISIONS * 8 + 4])?,
    ];
    // Every buffer is 256-aligned inside the one allocation: the total must fit too.
    total_bytes(&sizes)?;
    Ok(sizes)
}

/// The byte stride of cmb_buf's first T*K rows in a combine of `format`: a bf16 row's 2H, or
/// with LogFMT the largest encoded row (every group raw: 2H + H/32, a multiple of 4).
pub(crate) fn cmb_row_bytes(c: &Config, format: CombineFormat) -> Result<i32, GpuError> {
    let bytes = match format {
        CombineFormat::Bf16 => prod("a combine row", &[c.hidden, 2])?,
        CombineFormat::LogFmt => slot_bytes(c.hidden),
    };
    to_i32("a combine row's bytes", bytes)
}

/// The bytes of one rank's allocation: every buffer rounded up to 256.
pub(crate) fn total_bytes(sizes: &[usize; NUM_BUFFERS]) -> Result<usize, GpuError> {
    sizes
        .iter()
        .try_fold(0usize, |a, &s| {
            a.checked_add(s.checked_next_multiple_of(256)?)
        })
        .ok_or_else(|| GpuError::Unsupported("one rank's buffers exceed usize".into()))
}

pub(crate) fn align(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// Bytes of one batched-dispatch entry: 80-byte header + payload, 16-aligned (saturated at
/// usize::MAX for configs no group accepts).
pub fn entry_bytes(c: &Config) -> usize {
    entry_bytes_checked(c).unwrap_or(usize::MAX)
}
/// Bytes of one per-expert message: 16-byte header + payload, 16-aligned (saturated).
pub fn pe_entry_bytes(c: &Config) -> usize {
    pe_entry_bytes_checked(c).unwrap_or(usize::MAX)
}

pub(crate) fn entry_bytes_checked(c: &Config) -> Result<usize, GpuError> {
    HDR_BYTES
        .checked_add(c.payload_bytes())
        .and_then(|v| v.checked_next_multiple_of(16))
        .ok_or_else(|| GpuError::Unsupported("the batched entry size overflows".into()))
}
pub(crate) fn pe_entry_bytes_checked(c: &Config) -> Result<usize, GpuError> {
    PE_HDR
        .checked_add(c.payload_bytes())
        .and_then(|v| v.checked_next_multiple_of(16))
        .ok_or_else(|| GpuError::Unsupported("the per-expert entry size overflows".into()))
}

/// Device memory one rank needs.
pub fn bytes_per_rank(c: &Config) -> Result<usize, GpuError> {
    bytes_per_rank_with(c, false)
}

/// Device memory one rank needs, with the NCCL staging buffer when `nccl`.
pub fn bytes_per_rank_with(c: &Config, nccl: bool) -> Result<usize, GpuError> {
    total_bytes(&rank_sizes(c, nccl)?)
}

/// Dynamic shared memory of every kernel (the `Smem` carve-up in common.cuh), for the build the
/// group loads ([`Variant`]: the wide build past [`NARROW_RANKS`] ranks).
pub fn smem_bytes(c: &Config) -> usize {
    let (r, t, k, e, l) = (
        c.num_ranks,
        c.max_tokens_per_rank,
        c.top_k,
        c.num_experts,
        c.num_local_experts(),
    );
    let w = t.div_ceil(32);
    if r > NARROW_RANKS {
        // rowp (T*K u64), sk, sdl, tokpos and selpos (per slot: T*K each), tot, scratch,
        // m_a/b/c, bm, pw, cls, beg, rcnt (R), dbm, dpw, spw (R*W each)
        return 4
            * (2 * t * k
                + 2 * t * k
                + 2 * t * k
                + 2 * r
                + 32
                + 3 * NTHREADS as usize
                + 2 * e * w
                + 2 * l * r
                + r
                + 3 * r * w);
    }
    // rowp (T*K u64), sk, sdl, tokpos, selpos (T*R each), tot, scratch, m_a/b/c, bm, pw, cls,
    // beg, rcnt
    4 * (2 * t * k
        + 2 * t * k
        + 2 * t * r
        + 2 * r
        + 32
        + 3 * NTHREADS as usize
        + 2 * e * w
        + 2 * l * r
        + 80)
}

/// The dynamic shared memory a block may use on sm_90 (H100/H200: 227 KB).
pub const SMEM_LIMIT_SM90: usize = 227 * 1024;

/// The addresses of one rank's buffers inside its one allocation at `base`.
pub(crate) fn carve_rank(base: u64, sizes: &[usize; NUM_BUFFERS]) -> RankPtrs {
    let mut f = [0u64; NUM_BUFFERS];
    let mut off = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        f[i] = base + off;
        off += align(s, 256) as u64;
    }
    RankPtrs {
        x: f[0],
        topk: f[1],
        weights: f[2],
        y: f[3],
        meta: f[4],
        recv_x: f[5],
        recv_scales: f[6],
        recv_count: f[7],
        layout: f[8],
        src_info: f[9],
        out: f[10],
        row_tk: f[11],
        comb_map: f[12],
        comb_pos: f[13],
        comb_cnt: f[14],
        bat_buf: f[15],
        bat_meta: f[16],
        pe_buf: f[17],
        cmb_buf: f[18],
        sig: f[19],
        state: f[20],
        bat_cnt: f[21],
        snd_buf: f[22],
        snd_hdr: f[23],
        rcv_hdr: f[24],
        shrink: f[25],
    }
}

/// Combine capacity of one (owner, source) NCCL pair in [`NcclSizes::Capacity`] mode: the most
/// selections a source can have on one destination, T tokens times min(K, L) experts each (a
/// token selects an expert at most once, and a destination holds L of them).
pub(crate) fn combine_capacity_rows(c: &Config) -> Result<usize, GpuError> {
    prod(
        "combine capacity rows",
        &[c.max_tokens_per_rank, c.top_k.min(c.num_local_experts())],
    )
}

/// The per-expert NCCL messages of one (rank, peer) pair from a checked header's rows per local
/// expert: (first entry, entries) of each local expert's message, packed in expert order (the
/// pack kernel stages them the same way). Every value is bounded by the header check (rows <=
/// T each, summing to at most T*K), and the sum is checked here again.
pub(crate) fn pe_messages(
    rows: &[i32],
    t: usize,
    k: usize,
) -> Result<Vec<(usize, usize)>, GpuError> {
    let mut at = 0usize;
    let mut v = Vec::with_capacity(rows.len());
    for (l, &r) in rows.iter().enumerate() {
        let n = usize::try_from(r).ok().filter(|&n| n <= t).ok_or_else(|| {
            GpuError::Unsupported(format!(
                "per-expert message of local expert {l}: {r} rows, outside 0..={t} (T)"
            ))
        })?;
        v.push((at, n));
        at = at
            .checked_add(n)
            .filter(|&a| a <= t.saturating_mul(k))
            .ok_or_else(|| {
                GpuError::Unsupported(format!(
                    "per-expert messages sum past T*K = {} rows at local expert {l}",
                    t.saturating_mul(k)
                ))
            })?;
    }
    Ok(v)
}

/// The peer mask of a rank that reaches every rank in 0..r through NCCL.
pub fn all_peers(r: usize) -> PeerMask {
    PeerMask::first(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::variant::MAX_LOCAL;
    use ep_reference::Mode;

    fn cfg(r: usize, e: usize, t: usize, h: usize, k: usize) -> Config {
        // Built directly: the sizes must be checked here whatever Config::validate accepts.
        Config {
            num_ranks: r,
            num_experts: e,
            max_tokens_per_rank: t,
            hidden: h,
            top_k: k,
            mode: Mode::Bf16,
        }
    }

    #[test]
    fn sizes_that_wrap_are_typed_errors_not_small_buffers() {
        // T = 2^60 + 1 would make unchecked products wrap to a few bytes.
        let c = cfg(1, 1, (1 << 60) + 1, 16, 1);
        assert!(matches!(
            rank_sizes(&c, false),
            Err(GpuError::Unsupported(_))
        ));
        assert!(bytes_per_rank(&c).is_err());
        // T*K small, H huge: the buffer products overflow.
        let c = cfg(2, 2, 4, usize::MAX / 4, 1);
        assert!(matches!(
            rank_sizes(&c, true),
            Err(GpuError::Unsupported(m)) if m.contains("does not fit")
        ));
        assert!(bytes_per_rank_with(&c, true).is_err());
    }

    #[test]
    fn signal_counts_must_fit_their_bits() {
        let c = cfg(1, 16, 1 << 21, 128, 8); // T*K = 2^24
        assert!(matches!(
            rank_sizes(&c, false),
            Err(GpuError::Unsupported(m)) if m.contains("2^24")
        ));
        // T*K = 2^24 - 1 would be the poison (common.cuh SIG_POISON): refused too.
        let c = cfg(1, 16, ((1 << 24) - 1) / 15, 128, 15);
        assert!(matches!(
            rank_sizes(&c, false),
            Err(GpuError::Unsupported(m)) if m.contains("poison")
        ));
    }

    #[test]
    fn the_standard_setting_has_every_buffer_and_a_256_aligned_total() {
        let c = cfg(8, 256, 128, 7168, 8);
        let s = rank_sizes(&c, false).unwrap();
        assert_eq!(s[0], 128 * 7168 * 2); // x
        assert_eq!(s[20], 128); // state: counters + u64 epochs
        let total = total_bytes(&s).unwrap();
        assert_eq!(total % 256, 0);
        assert!(total >= s.iter().sum::<usize>());
        assert!(to_i32("h", 1 << 31)
            .unwrap_err()
            .to_string()
            .contains("i32"));
    }

    #[test]
    fn nccl_staging_holds_every_message() {
        let c = Config {
            mode: Mode::FP8,
            ..cfg(2, 256, 128, 7168, 8)
        };
        let s = rank_sizes(&c, true).unwrap();
        let (t, k, rowb) = (128, 8, 2 * 7168);
        // snd_buf (22): per-expert dispatch R*T*K messages, combine R*T*K rows.
        assert!(s[22] >= 2 * t * k * pe_entry_bytes(&c));
        assert!(s[22] >= 2 * t * k * rowb);
        assert!(s[22] >= 2 * t * entry_bytes(&c));
        // cmb_buf (18): T*K rows whatever R (each row at its t*K+k), of a raw LogFMT row
        // (2H + H/32) where H % 128 == 0, else 2H; with NCCL, R*T*K more for what NCCL lands,
        // every row 2H (NCCL carries bf16 only).
        let lf_row = rowb + 7168 / 32;
        let one = Config {
            num_ranks: 1,
            num_experts: 8,
            ..c
        };
        assert_eq!(rank_sizes(&one, true).unwrap()[18], 2 * t * k * rowb);
        assert_eq!(rank_sizes(&one, false).unwrap()[18], t * k * lf_row);
        assert_eq!(s[18], 3 * t * k * rowb);
        let wide = Config {
            num_ranks: 256,
            ..c
        };
        assert_eq!(rank_sizes(&wide, false).unwrap()[18], t * k * lf_row);
        let odd = cfg(2, 4, 8, 200, 2);
        assert_eq!(rank_sizes(&odd, false).unwrap()[18], 8 * 2 * 400);
        // The stride each launch takes: 2H in bf16, a raw LogFMT row's size with LogFMT.
        assert_eq!(cmb_row_bytes(&c, CombineFormat::Bf16).unwrap(), 2 * 7168);
        assert_eq!(
            cmb_row_bytes(&c, CombineFormat::LogFmt).unwrap(),
            lf_row as i32
        );
        assert_eq!(lf_row % 4, 0, "bodies stay 4-aligned");
        // Capacity combine: T * min(K, L) rows.
        assert_eq!(combine_capacity_rows(&c).unwrap(), 128 * 8);
        assert_eq!(
            combine_capacity_rows(&cfg(4, 8, 128, 128, 8)).unwrap(),
            128 * 2
        );
        assert!(combine_capacity_rows(&cfg(1, 2, usize::MAX, 128, 4)).is_err());
    }

    #[test]
    fn per_expert_messages_are_packed_and_bounded() {
        assert_eq!(
            pe_messages(&[2, 0, 3], 4, 2).unwrap(),
            vec![(0, 2), (2, 0), (2, 3)]
        );
        assert!(pe_messages(&[], 4, 2).unwrap().is_empty());
        // A count past T, negative, or a sum past T*K is an error, never a transfer size.
        for bad in [&[5, 0][..], &[-1, 2], &[i32::MIN], &[4, 4, 1]] {
            assert!(
                matches!(pe_messages(bad, 4, 2), Err(GpuError::Unsupported(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn kernel_parameters_fit_the_launch_limit() {
        // The kernels take (KParams, IoTable) by value: the narrow build under the classic 4 KiB
        // parameter limit, the wide-IO build (256 entries) under CUDA 12.1's 32764 bytes.
        let kp = std::mem::size_of::<KParams>();
        let entry = std::mem::size_of::<IoPtrs>();
        assert_eq!(kp, 184); // the same fields as common.cuh's KParams
        assert_eq!(entry, 13 * 8);
        let narrow = Variant::for_group(32, 32, 132, false);
        let wide = Variant::for_group(256, 256, 132, true);
        assert_eq!(narrow, Variant::default());
        assert!(kp + narrow.io_capacity() * entry <= 4096);
        assert_eq!(
            kp + Variant::for_group(1, 1, 132, false).io_capacity() * entry,
            288
        );
        assert!(wide.wide && wide.wide_io && wide.two_blocks);
        assert!(kp + wide.io_capacity() * entry <= 32764);
        assert_eq!(IoTable::new(wide.io_capacity()).r.len(), MAX_RANKS);
    }

    #[test]
    fn variants_follow_the_ranks_and_the_narrow_one_defines_nothing() {
        assert_eq!(Variant::for_group(8, 8, 132, false).defines(), "");
        assert_eq!(Variant::for_group(32, 2, 132, false), Variant::default());
        // One rank on the GPU (process mode, a one-rank group): a one-entry IoTable.
        let one = Variant::for_group(32, 1, 132, false);
        assert_eq!((one.wide, one.wide_io, one.one_io), (false, false, true));
        assert_eq!(one.defines(), "#define EP_MAX_LOCAL 1\n");
        assert_eq!(one.io_capacity(), 1);
        assert_eq!(IoTable::new(one.io_capacity()).r.len(), 1);
        // Process mode past 32 ranks: wide peer sets, one rank here (one-entry IoTable).
        let p = Variant::for_group(256, 1, 132, false);
        assert_eq!(
            (p.wide, p.wide_io, p.one_io, p.two_blocks),
            (true, false, true, false)
        );
        assert_eq!(
            p.defines(),
            "#define EP_MASK_WORDS 8\n#define EP_MAX_LOCAL 1\n"
        );
        assert_eq!(p.io_capacity(), 1);
        // Two ranks here: the 32-entry table.
        assert_eq!(
            Variant::for_group(256, 2, 132, false).io_capacity(),
            MAX_LOCAL
        );
        let v = Variant::for_group(64, 64, 132, false);
        assert_eq!((v.wide, v.wide_io, v.two_blocks), (true, true, false));
        assert!(v.defines().contains("EP_MAX_LOCAL 256"));
        assert!(Variant::for_group(256, 256, 132, false)
            .defines()
            .contains("EP_MIN_BLOCKS 2"));
        // The plain build: its define on top of the size build's, and nothing else changes.
        let q = Variant::for_group(8, 8, 132, true);
        assert_eq!(q.defines(), "#define EP_PLAIN 1\n");
        assert_eq!(q.io_capacity(), MAX_LOCAL);
        let w = Variant::for_group(64, 64, 132, true);
        assert_eq!(w.defines(), format!("{}#define EP_PLAIN 1\n", v.defines()));
        for v in [one, p, v, q, w, Variant::for_group(8, 1, 132, true)] {
            assert!(Variant::all().contains(&v));
        }
    }

    #[test]
    fn the_plain_build_is_refused_with_nccl_peers_or_shrink_mode() {
        let plain = Variant::for_group(8, 8, 132, true);
        let general = Variant::for_group(8, 8, 132, false);
        assert!(plain.check_plain(false, false).is_ok());
        assert!(plain.check_plain(true, false).unwrap_err().contains("NCCL"));
        assert!(plain
            .check_plain(false, true)
            .unwrap_err()
            .contains("shrink"));
        for (n, s) in [(false, false), (true, false), (false, true), (true, true)] {
            assert!(general.check_plain(n, s).is_ok());
        }
    }

    #[test]
    fn the_rank_limit_is_one_constant_with_a_typed_error() {
        assert!(check_ranks(MAX_RANKS).is_ok());
        assert_eq!(
            check_ranks(MAX_RANKS + 1),
            Err(GpuError::TooManyRanks {
                ranks: 257,
                max: 256
            })
        );
        assert_eq!(MAX_RANKS, 256);
        const { assert!(MAX_RANKS <= ep_reference::config::MAX_RANKS) };
    }

    #[test]
    fn peer_masks_hold_every_rank_up_to_the_limit() {
        let m = PeerMask::of([0, 31, 32, 200, 255]);
        assert_eq!(m.ranks(), vec![0, 31, 32, 200, 255]);
        assert!(m.contains(200) && !m.contains(201) && !m.contains(4096));
        assert_eq!(m.low_word(), 0x8000_0001);
        assert_eq!(all_peers(256).ranks().len(), 256);
        assert_eq!(all_peers(33).ranks(), (0..33).collect::<Vec<_>>());
        assert_eq!(all_peers(4).low_word(), 0b1111);
        assert!(PeerMask::EMPTY.is_empty() && !all_peers(1).is_empty());
        assert_eq!(format!("{:?}", PeerMask::of([1, 40])), "PeerMask[1, 40]");
    }

    /// Every kernel's dynamic shared memory fits sm_90's 227 KB up to 256 ranks at T = 128, with
    /// H and K at the standard setting (H = 7168, K = 8) and L = 1..8 local experts (E = R * L),
    /// in every mode. (The narrow build's T x R table would need 297 KB at R = 256.)
    #[test]
    fn shared_memory_fits_the_device_up_to_256_ranks() {
        for r in [8, 16, 24, 32, 33, 48, 64, 96, 128, 160, 192, 224, 256] {
            for l in [1, 2, 4, 8] {
                for mode in [Mode::Bf16, Mode::FP8] {
                    let c = Config {
                        mode,
                        ..cfg(r, r * l, 128, 7168, 8)
                    };
                    let b = smem_bytes(&c);
                    assert!(
                        b <= SMEM_LIMIT_SM90,
                        "R = {r}, L = {l}: {b} bytes of shared memory > {SMEM_LIMIT_SM90}"
                    );
                }
            }
        }
        // The narrow build's sizes are as before (R <= 32 unchanged).
        let c = cfg(32, 256, 128, 7168, 8);
        assert_eq!(
            smem_bytes(&c),
            4 * (4 * 128 * 8 + 2 * 128 * 32 + 64 + 32 + 1536 + 2 * 256 * 4 + 2 * 8 * 32 + 80)
        );
        // What the wide build saves at R = 256: no T x R table.
        let wide = cfg(256, 256, 128, 7168, 8);
        assert!(smem_bytes(&wide) < 100 * 1024, "{}", smem_bytes(&wide));
    }
}
