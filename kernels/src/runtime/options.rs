//! What a caller chooses for a group: how peers are reached ([`Transport`]), how the NCCL
//! transport sizes its messages ([`NcclSizes`]), the group's options ([`GpuOptions`]). The path
//! of a call is ep-reference's [`Path`](ep_reference::Path): every backend runs the same two.

use ep_reference::names::{self, UnknownName};
use ep_reference::Path;
use std::fmt;
use std::str::FromStr;

/// How a rank reaches each peer (both paths; the per-expert path over NCCL needs
/// [`NcclSizes::Exact`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// NVLink (peer access, or CUDA IPC between processes) for every peer that shares it, NCCL
    /// for the others (one rank per GPU needed there).
    #[default]
    Auto,
    /// NCCL for every peer, this rank itself included (one rank per GPU: NCCL refuses two ranks
    /// on one device). Both paths: batched (one payload message per peer) and per-expert (one
    /// message per (peer, local expert) batch, needs [`NcclSizes::Exact`]).
    Nccl,
    /// Process mode across nodes: CUDA IPC (NVLink) to the peers of this rank's node, NCCL to
    /// the others; the node of every rank comes from the handshake (ep-group's `topology`). On one
    /// node (and in a single-process group) it is `Auto`.
    TwoTier,
}

impl Transport {
    /// Every transport, the default first.
    pub const ALL: [Transport; 3] = [Transport::Auto, Transport::Nccl, Transport::TwoTier];

    /// The transport's one name: in flags (`ep-bench --transport`), the Python API's
    /// `transport=` keyword and reports; parsed back by `FromStr` (that spelling only).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Nccl => "nccl",
            Transport::TwoTier => "two-tier",
        }
    }
}

impl FromStr for Transport {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Transport, UnknownName> {
        names::parse("transport", s, &Transport::ALL, Transport::name)
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// How the NCCL transport sizes its payload messages (peers reached through NCCL only).
///
/// - `Exact`: dispatch first exchanges the batch headers, the host waits for them (a bounded
///   poll of the streams), reads the counts, checks them (`check_header`) and sends exactly the
///   rows there are; combine reuses those counts. A host round trip per dispatch: the host
///   blocks mid-call to read device data, so the call is neither ordered on a caller's stream
///   nor graph-capturable, and the device API refuses it. Both paths. The default: it sends the
///   fewest bytes (capacity doubles combine's at the standard setting), and on NCCL's network
///   transport, the one this transport exists for, it wins the round trip by 2.1x
///   (BENCHMARKS.md, "The network transport"; on NCCL's NVLink transport capacity wins).
/// - `Capacity`: headers and payloads go in ONE NCCL group with no host synchronisation (the
///   send headers are poisoned first, so a rank stopped by bad input sends a count its peers
///   reject on the device instead of an earlier call's header):
///   dispatch sends the header plus the full T entries per peer, combine T * min(K, L) rows per
///   peer (the most selections one source can have on one destination: at most T tokens, each
///   selects at most min(K, L) of its L experts); the unpack kernels read the real counts from
///   the received header (bounded on the device). Stream-ordered and, as NCCL point-to-point
///   calls may be captured into CUDA graphs, capturable. Batched path only: per-expert would
///   have to send L * T entries per peer (every local expert's full region), so it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NcclSizes {
    /// Header round trip through the host, then exact payload sizes.
    #[default]
    Exact,
    /// Header + fixed capacity in one group, no host round trip.
    Capacity,
}

impl NcclSizes {
    /// Both sizings, the default first.
    pub const ALL: [NcclSizes; 2] = [NcclSizes::Exact, NcclSizes::Capacity];

    /// The sizing's one name (`ep-bench --nccl-sizes`, reports), parsed back by `FromStr`.
    pub fn name(self) -> &'static str {
        match self {
            NcclSizes::Exact => "exact",
            NcclSizes::Capacity => "capacity",
        }
    }
}

impl FromStr for NcclSizes {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<NcclSizes, UnknownName> {
        names::parse("NCCL sizing", s, &NcclSizes::ALL, NcclSizes::name)
    }
}

impl fmt::Display for NcclSizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// Which of its buffers a group allocates beyond those every call needs (memory that
/// grows with what is sent). The default allocates everything; a caller that runs one
/// path and passes its own tensors to every call (the Python `Buffer`) needs neither the other
/// path's receive area nor the group's own copies of the E x T-row tensors, which are most of a
/// rank's memory at the standard setting (`runtime::footprint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buffers {
    /// The paths the group runs: `None` both; `Some(p)` only `p`: the other path's receive area
    /// (per-expert: L x R x T messages; batched: R x T entries) is not allocated, and a call of
    /// the other path is refused before anything is launched (`GpuError::Unsupported`).
    pub path: Option<Path>,
    /// The group's own `y`, `recv_x`, `recv_scales` and `src_info` (E x T rows each): what the
    /// host harness (`upload_*`, `dispatch`, `combine`, `download_*`) and a device-API dispatch
    /// without outputs use. `false`: not allocated; every dispatch must pass its outputs and every
    /// combine its `y` (the device API does), anything else is refused before any launch. The
    /// small ones (x, topk_idx, weights, out, recv_count, layout) stay: a call the host refuses
    /// because the group failed still runs on them (poison.cuh).
    pub own_tensors: bool,
}

impl Default for Buffers {
    fn default() -> Self {
        Buffers {
            path: None,
            own_tensors: true,
        }
    }
}

impl Buffers {
    /// Whether the group allocates the receive area of `path`.
    pub fn runs(&self, path: Path) -> bool {
        self.path.is_none_or(|p| p == path)
    }
}

/// Options of a [`GpuGroup`](crate::runtime::GpuGroup).
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// Devices to spread the ranks over (R % num_gpus == 0).
    pub num_gpus: usize,
    /// Bound of every wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Blocks per rank; None: the multiprocessors of a device divided among its ranks.
    pub blocks_per_rank: Option<usize>,
    /// Batched combine: a source reads the rows of owners on its own GPU in place instead of
    /// receiving them as a put (signals unchanged). Peers on other GPUs always get the put.
    pub zero_copy_local: bool,
    /// Which transport the batched path uses per peer pair.
    pub transport: Transport,
    /// NCCL transport: exact sizes after a host round trip, or a fixed capacity without one.
    pub nccl_sizes: NcclSizes,
    /// Trap (end the CUDA context, as DeepEP's kernels do) right after recording an error,
    /// instead of leaving the kernel cleanly and raising at the next call. The error is still
    /// named: its host mirror survives the trap. Off by default (a trap poisons the context).
    pub trap_on_error: bool,
    /// Shrink mode (DeepEP's `enable_shrink`): a wait for a peer that runs out masks that peer
    /// on the waiting rank instead of failing the call; a masked peer is neither sent to nor
    /// waited for, and the selections of its experts count as -1 (docs/contract.md, "Masked
    /// ranks"). The mask: [`GpuGroup::mask_status`](crate::runtime::GpuGroup::mask_status), [`GpuGroup::update_mask`](crate::runtime::GpuGroup::update_mask),
    /// [`GpuGroup::clean_mask`](crate::runtime::GpuGroup::clean_mask). CUDA IPC and peer access only (not over NCCL, whose receives
    /// the kernels cannot bound), up to the kernels' 256 ranks.
    pub enable_shrink: bool,
    /// FP8 dispatch's `recv_scales` ([L, R*T, G] words, G = H/128 f32 or H/512 packed UE8M0)
    /// in DeepEP's layout: column-major in the last two dimensions, word strides
    /// (R*T*G, 1, R*T), as DeepGEMM's grouped GEMM takes them. Off: row-major (R*T*G, G, 1).
    /// The values are the same either way; only where each word lives changes.
    pub scales_column_major: bool,
    /// Which buffers the group allocates ([`Buffers`]; default: all of them).
    pub buffers: Buffers,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            num_gpus: 1,
            timeout_ns: 2_000_000_000,
            blocks_per_rank: None,
            zero_copy_local: true,
            transport: Transport::Auto,
            nccl_sizes: NcclSizes::default(),
            trap_on_error: false,
            enable_shrink: false,
            scales_column_major: false,
            buffers: Buffers::default(),
        }
    }
}
