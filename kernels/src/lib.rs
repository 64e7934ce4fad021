//! # ep-kernels
//!
//! The CUDA backend of ep-dispatch: both paths of docs/contract.md (per-expert and per-destination
//! batched dispatch/combine) as CUDA kernels, compiled at run time with NVRTC (`compile`), run
//! by a small runtime over one or more GPUs with peer access (`runtime`; its library face is
//! `runtime::device_api`, device tensors on the caller's stream). Every output is bit-identical
//! to `ep_reference::oracle`. Nothing here times anything: the timing harness (CUDA events,
//! CUPTI) is in ep-benches (`ep_benches::timing`).
//!
//! Where there is no CUDA driver (or no NVRTC), nothing touches the GPU: [`runtime::probe_devices`]
//! and [`runtime::probe`] say why, and the tests print `SKIPPED: <reason>`.
//!
//! ## How the GPU paths realise docs/contract.md (and where they choose)
//!
//! - **One launch per call and device.** All ranks of a device run in one kernel launch
//!   (`blocks_per_rank` blocks each, one block per SM, checked against the occupancy calculator),
//!   so they are resident together and can wait on each other. Two groups must not launch on the
//!   same GPU at once: their blocks could interleave their residency (a wait would then end in
//!   `Error::Timeout`, not a hang).
//! - **Epochs on the device.** Each rank keeps, per kernel kind, the number of completed calls as
//!   a u64 (it never wraps). A kernel reads it at start (epoch = calls + 1), and the last block to
//!   leave publishes it. A signal is `(tag << 24) | count` with `tag = epoch mod (2^40 - 1) + 1`
//!   (never 0, the zeroed initial words; consecutive calls differ, and every call rewrites every
//!   signal it waits on), stored with release and read with acquire (gpu scope on one GPU, system
//!   scope across GPUs); counts stay below 2^24 (T*K is checked). Per-expert message headers
//!   carry the whole u64 epoch. No host value changes between calls, so a call can be replayed
//!   from a CUDA graph. The receiver acknowledges each call (the u64 epoch in the sender's ack
//!   word) after it has consumed the buffers, and a sender waits for the previous call's ack
//!   before it overwrites them.
//! - **Bounded waits.** Every wait polls `%globaltimer`. Past `timeout_ns` it writes
//!   (rank, peer, phase, call) to the device's error word and the kernel exits; waits elsewhere
//!   see the flag and exit too. Nothing traps. [`GpuGroup::sync`] (or [`GpuGroup::check`] after
//!   the caller synchronised its stream) turns the word into `ep_reference::Error::Timeout`, and
//!   the group refuses later calls.
//! - **Checks on the device.** Dispatch checks the routing it reads (an expert outside [-1, E),
//!   or twice in a token) and the token count (at most T) before it writes or sends anything;
//!   receivers bound every count and header field a peer wrote before using it as a size or an
//!   index. The error word carries (rank, token, slot, value) or (rank, peer, field, value,
//!   limit); the host reports `ExpertOutOfRange`, `DuplicateExpert`, `TooManyTokens` or
//!   [`GpuError::PeerData`], and the group refuses later calls (build a new one).
//! - **The device API** ([`runtime::device_api`]): dispatch and combine on cudarc device tensors,
//!   enqueued on the caller's stream with no host synchronisation, outputs into the caller's
//!   buffers or the group's; send and receive halves (the receive hook); capturable in a CUDA
//!   graph (token counts may be read from device memory). The host-slice calls (`dispatch`,
//!   `combine`, `upload_*`, `read_*`) are the test and benchmark harness.
//! - **Finish counting.** docs/contract.md's `FINISHED_SUM_TAG` counter is replaced by a block-completion
//!   counter. In the batched path every block adds 1 after a release fence, and the block that
//!   completes the count stores the (source, destination) signals. In the per-expert path one
//!   block owns each expert and signals it itself.
//! - **Batched dispatch.** Each token is stored once per destination, as an 80-byte header (source
//!   token, selection offset, and each slot's local expert and its index among the source's tokens
//!   for that expert) plus the payload, contiguous per (source, destination). The last sender block
//!   also ships per-(expert, source) row counts. The receiver computes begin(l, s) and expands every
//!   entry in parallel into the canonical rows.
//! - **Per-expert dispatch.** Each selection is its own message at slot t of region (l, s), with a
//!   header stamped with the epoch. The receiver finds this call's messages in token order.
//! - **Batched combine, same-GPU owners.** With `GpuOptions::zero_copy_local` (the default), a
//!   source reads the rows of owners on its own GPU in place, through the owner's handle, and no
//!   put is made. When every rank is on one GPU, no combine signal is needed either: every row and
//!   handle is complete when the launch starts. Peers on other GPUs always get the put and the
//!   signal. `zero_copy_local: false` runs the put path on one GPU too, and the tests run both.
//! - **LogFMT-10 combine (both paths; docs/contract.md 4.1).** A combine may carry its rows in
//!   LogFMT (`GpuGroup::set_combine_format`, `combine_device_opts`, ...): the owner's warp encodes
//!   each row into the source's receive slot (stride 2H + H/32), the source's reduction decodes
//!   it in its `fmaf` loop (`cu/logfmt.cuh`, bit-identical to `ep_reference::numerics::logfmt`).
//!   Every row is put then, none read in place; refused over NCCL (`GpuError::Unsupported`).
//! - **NCCL transport (both paths).** `GpuOptions::transport` chooses per peer pair:
//!   `Transport::Auto` is NVLink where the peers share it (peer access, or CUDA IPC between
//!   processes) and NCCL for pairs without peer access. `Transport::Nccl` forces NCCL for every
//!   peer, self included. `Transport::TwoTier` (process mode across nodes) reaches the ranks of
//!   this rank's node through CUDA IPC and the others through NCCL; every rank's node id
//!   (`EP_NODE_ID`, else torchrun's `GROUP_RANK`, else the hostname) travels in the handshake
//!   (ep-group's `topology`). NCCL peers are a bit mask (`KParams::nccl_mask`) and the call is split
//!   in two. The pack stage (`stage` 1) writes what goes to each NCCL destination into this
//!   rank's staging buffer (`snd_buf`) with a header of (tokens, selections, rows per local
//!   expert) in `snd_hdr`: the batched path one batch per destination in its entry layout, the
//!   per-expert path its messages packed in expert order (one per local expert with rows). The
//!   host then exchanges them with grouped `ncclSend`/`ncclRecv`, sized by
//!   `GpuOptions::nccl_sizes` ([`NcclSizes`]): `Exact` exchanges the headers first, waits for
//!   them (a bounded host round trip), checks them and sends exactly the rows there are (batched:
//!   one payload message per peer; per-expert: one per (peer, local expert)); `Capacity` (batched
//!   only) sends the header and the full capacity in one group with no host synchronisation
//!   (stream-ordered, graph-capturable; the send headers are poisoned first so a rank stopped by
//!   bad input cannot send an earlier call's). Everything lands where NVLink would have put it.
//!   The unpack stage (`stage` 2) takes the counts from `rcv_hdr` instead of waiting for signals.
//!   Combine sends the rows back the same way, sized from the dispatch headers (exact) or by
//!   T x min(K, L) rows per peer (capacity). NCCL pairs need no epoch acks: stream order keeps a
//!   call's unpack ahead of the next call's transfers. Host waits on NCCL work are bounded. Past
//!   the timeout the communicators are aborted and the call fails with `Error::Timeout`. The
//!   device API reaches NCCL in capacity mode (on the caller's stream).
//! - **Process mode.** One rank per process ([`runtime::ProcessRank`]). The rank's buffers are
//!   one `cuMemAlloc` allocation. Its IPC handle (or rank 0's NCCL unique id) is exchanged by the
//!   process-group layer (ep-group: `ep_group::new_process`, the handshake, the node plan, over
//!   a caller-supplied `all_gather` such as `ep_launch::Rendezvous`), and the peers' handles are
//!   opened to build the address table ([`runtime::ProcessRank::join`]). The kernels are the
//!   same.
//! - **Limits**: R <= 256 ([`runtime::MAX_RANKS`]; past it `GpuError::TooManyRanks`, before any
//!   device work); a clear `GpuError::Unsupported` for ranks not spread evenly over the GPUs, and
//!   the routing tables must fit in shared memory (about 227 KB: [`runtime::smem_bytes`], roughly
//!   16·T·K + 8·T·R + 8·E·⌈T/32⌉ + 8·L·R bytes + 6 KB for R <= 32; past 32 ranks the wide build
//!   keeps positions per top-k slot instead of the T x R table: 24·T·K + 8·E·⌈T/32⌉ + 8·L·R +
//!   12·R·⌈T/32⌉ bytes + 6 KB).
//! - **Builds** ([`runtime::Variant`]): a group of at most 32 ranks loads the kernels as the
//!   files are; past 32 ranks the wide build (peer sets of 8 words in shared memory), past 32
//!   ranks on one GPU an IoTable of 256 entries (a 22.7 KB kernel parameter, CUDA >= 12.1), and
//!   past the GPU's SM count two blocks per SM. Each build is its own cache entry.
//! - **FP8.** `cvt.rn.satfinite.e4m3x2.f32`; every NaN becomes 0x7F, as in the reference (the
//!   GPU's f32 multiply already returns the positive canonical NaN).
//! - **Kernel cache.** NVRTC takes seconds per process, so the CUBINs are kept on disk
//!   ([`compile::cache`]): in `$EP_KERNEL_CACHE` if set (`EP_KERNEL_CACHE=off` disables it),
//!   else `$XDG_CACHE_HOME/ep-dispatch/kernels`, else `~/.cache/ep-dispatch/kernels`, one file
//!   per module named by the SHA-256 of its full source, every NVRTC option, the architecture and
//!   NVRTC's version (major.minor), holding its length and SHA-256 (checked on every read).
//!   Entries are written atomically (temporary file, fsync, rename), so the ranks of a job and
//!   later runs share them; a corrupt or unreadable entry is recompiled and rewritten, and an
//!   unusable cache folder only means compiling, never an error.

pub mod compile;
mod error;
pub mod runtime;
/// The test machinery (feature `testing`, off by default): the GPU tests' and harnesses' inputs
/// and oracle checks. The crate's own unit tests have it too.
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod variant;

/// The cudarc this crate is built on (its `CudaStream`, `CudaView`, ... are the device API's types).
pub use cudarc;
pub use error::GpuError;
pub use runtime::{
    Buffers, CombineIn, CombineOpts, DeviceDispatchOut, DeviceHandle, DispatchIn, GpuGroup,
    GpuOptions, NcclSizes, Path, RankEp, Tokens, Transport,
};
