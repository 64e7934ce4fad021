//! The one place the bindings call the GPU backend (`ep_kernels`). Everything else in this crate
//! is host code; the Python `Buffer` reaches the GPU only through [`probe`], [`size_hint`] and
//! [`RankGroup`].
//!
//! State of the wiring: process mode (one rank per process, the CUDA IPC handles or NCCL unique
//! id exchanged through a caller-supplied all-gather) exists in `ep_kernels` and is used by
//! [`RankGroup::new`]. Enqueueing dispatch/combine on the caller's raw `CUstream` with the
//! caller's device pointers (torch tensors) needs ep-kernels' device API, which this build does
//! not have yet: [`RankGroup::dispatch`] and [`RankGroup::combine`] return
//! [`BindError::NotBuilt`], and [`DEVICE_API`] is `None`.

use crate::error::{BindError, Result};
use ep_kernels::runtime::{bytes_per_rank_with, probe_devices, AllGather};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, Path, Transport};
use ep_reference::{Config, Mode};
use std::time::Duration;

/// The device API this build enqueues through, or `None` where it has none (then every GPU
/// call fails with [`BindError::NotBuilt`]).
pub const DEVICE_API: Option<&str> = None;

fn not_built(what: &str) -> BindError {
    BindError::NotBuilt(format!(
        "{what}: this build of ep_dispatch has no GPU device API (ep-kernels cannot yet enqueue \
         on a caller's CUDA stream with caller-owned device pointers); the oracle, the argument \
         checks and the size hint work, GPU execution does not"
    ))
}

/// At least `need` usable devices (driver present, NVRTC present), or `NoDevice` saying why.
pub fn probe(need: usize) -> Result<usize> {
    probe_devices(need).map_err(|why| GpuError::NoDevice(why).into())
}

/// The largest value the kernels take for one dimension (they receive them as `int`).
const MAX_DIM: usize = i32::MAX as usize;

/// Refuses shapes whose buffer arithmetic could overflow, before `ep_kernels` computes sizes
/// with plain arithmetic: every dimension fits an `int`, and an upper bound of one rank's bytes
/// (every buffer of the layout is at most one of these terms, times 8, plus alignment) fits u64.
fn check_dims(cfg: &Config) -> Result<()> {
    for (argument, v) in [
        ("num_ranks", cfg.num_ranks),
        ("num_experts", cfg.num_experts),
        ("num_max_dispatch_tokens_per_rank", cfg.max_tokens_per_rank),
        ("hidden", cfg.hidden),
    ] {
        if v > MAX_DIM {
            return Err(BindError::argument(
                argument,
                format!("{v} exceeds the largest supported {MAX_DIM}"),
            ));
        }
    }
    let (r, e, l, t, h, k) = (
        cfg.num_ranks as u128,
        cfg.num_experts as u128,
        cfg.num_local_experts() as u128,
        cfg.max_tokens_per_rank as u128,
        cfg.hidden as u128,
        cfg.top_k as u128,
    );
    let rows = l * r * t + r * t * k + t * k + e + r * l + r + 1;
    let bound = 8 * rows * (2 * h + 512) + 26 * 256 + (1 << 20);
    if bound > u64::MAX as u128 / 2 {
        return Err(BindError::argument(
            "num_max_dispatch_tokens_per_rank",
            format!(
                "the buffers of {} do not fit in 64-bit sizes",
                cfg.describe()
            ),
        ));
    }
    Ok(())
}

/// Bytes of GPU memory one rank's buffers take for this shape: ep-kernels' own layout
/// (`bytes_per_rank_with`), in BF16 (the largest payload, as DeepEP's hint also assumes) with
/// `top_k` (None: 16, the largest the contract allows, so the hint bounds every top-k), plus the
/// NCCL staging buffer when `nccl`.
pub fn size_hint(
    num_max_dispatch_tokens_per_rank: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
    top_k: Option<usize>,
    nccl: bool,
) -> Result<u64> {
    let cfg = Config::new(
        num_ranks,
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k.unwrap_or(16),
        Mode::Bf16,
    )?;
    check_dims(&cfg)?;
    Ok(bytes_per_rank_with(&cfg, nccl) as u64)
}

/// Parses our `transport=` keyword.
pub fn transport(name: &str) -> Result<Transport> {
    match name {
        "auto" => Ok(Transport::Auto),
        "nccl" => Ok(Transport::Nccl),
        other => Err(BindError::argument(
            "transport",
            format!("{other:?} is not a transport (expected 'auto' or 'nccl')"),
        )),
    }
}

/// Parses our `path=` keyword.
pub fn path(name: &str) -> Result<Path> {
    match name {
        "batched" => Ok(Path::Batched),
        "per_expert" => Ok(Path::PerExpert),
        other => Err(BindError::argument(
            "path",
            format!("{other:?} is not a path (expected 'batched' or 'per_expert')"),
        )),
    }
}

/// Which half of a call to enqueue: both (DeepEP's default), or the send half now and the
/// receive half later (`return_recv_hook=True`: the hook enqueues [`Phases::Recv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phases {
    Both,
    Send,
    Recv,
}

impl Phases {
    pub fn parse(name: &str) -> Result<Phases> {
        match name {
            "both" => Ok(Phases::Both),
            "send" => Ok(Phases::Send),
            "recv" => Ok(Phases::Recv),
            other => Err(BindError::argument(
                "phases",
                format!("{other:?} is not one of 'both', 'send', 'recv'"),
            )),
        }
    }
}

/// Device addresses of one dispatch (each a torch tensor's `data_ptr()`, checked by the caller
/// for dtype, shape, device and contiguity).
#[derive(Debug, Clone, Copy)]
pub struct DispatchPtrs {
    /// `bf16 [n, H]`.
    pub x: u64,
    /// `int64 [n, K]`.
    pub topk_idx: u64,
    pub num_tokens: usize,
    /// `[L, R*T, H]` e4m3 or bf16.
    pub recv_x: u64,
    /// `float32 [L, R*T, H/128]` / packed `int32 [L, R*T, H/512]`; 0 in BF16.
    pub recv_x_scales: u64,
    /// `int32 [L]`.
    pub recv_count: u64,
    /// `int32 [L, R*T]`.
    pub src_info: u64,
    /// `int64 [L, R]` packed `(begin << 32) | count`.
    pub layout_range: u64,
}

/// Device addresses of one combine.
#[derive(Debug, Clone, Copy)]
pub struct CombinePtrs {
    /// `bf16 [L, R*T, H]`: the expert outputs in the dispatch layout.
    pub y: u64,
    /// `int64 [n, K]`, the dispatched routing.
    pub topk_idx: u64,
    /// `float32 [n, K]`.
    pub topk_weights: u64,
    pub num_tokens: usize,
    /// `bf16 [n, H]`.
    pub out: u64,
}

/// One rank of a process-mode group: this process's rank, its GPU, the peers' buffers.
pub struct RankGroup {
    group: GpuGroup,
    path: Path,
}

impl RankGroup {
    /// Forms the group (collective: every rank calls it with the same config and options).
    /// `all_gather` exchanges one blob per rank in rank order (the Python side passes
    /// `torch.distributed.all_gather_object` over the Buffer's group).
    pub fn new(
        cfg: &Config,
        path: Path,
        transport: Transport,
        timeout: Duration,
        rank: usize,
        ordinal: usize,
        all_gather: &mut AllGather<'_>,
    ) -> Result<RankGroup> {
        cfg.validate()?;
        check_dims(cfg)?;
        if path == Path::PerExpert && transport == Transport::Nccl {
            return Err(BindError::argument(
                "transport",
                "'nccl' needs path='batched' (the per-expert path runs over NVLink only)",
            ));
        }
        let opts = GpuOptions {
            num_gpus: 1,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            transport,
            ..GpuOptions::default()
        };
        let group = GpuGroup::new_process(cfg, opts, rank, ordinal, all_gather)?;
        Ok(RankGroup { group, path })
    }

    pub fn config(&self) -> &Config {
        self.group.config()
    }

    pub fn path(&self) -> Path {
        self.path
    }

    pub fn describe_devices(&self) -> String {
        self.group.describe_devices()
    }

    /// Enqueues a dispatch on `stream` (a raw `CUstream`, borrowed: not synchronised).
    pub fn dispatch(&mut self, _stream: u64, _phases: Phases, _p: &DispatchPtrs) -> Result<()> {
        Err(not_built("dispatch"))
    }

    /// Enqueues a combine on `stream`.
    pub fn combine(&mut self, _stream: u64, _phases: Phases, _p: &CombinePtrs) -> Result<()> {
        Err(not_built("combine"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_hint_is_the_kernels_layout() {
        // DeepEP's standard setting with K = 8.
        let got = size_hint(128, 7168, 8, 256, Some(8), false).unwrap();
        let cfg = Config::new(8, 256, 128, 7168, 8, Mode::Bf16).unwrap();
        assert_eq!(got, bytes_per_rank_with(&cfg, false) as u64);
        // No top_k: the bound over every top_k, so at least the K = 8 figure.
        let bound = size_hint(128, 7168, 8, 256, None, false).unwrap();
        assert!(bound > got, "{bound} vs {got}");
        // The NCCL staging buffer adds to it.
        assert!(size_hint(128, 7168, 8, 256, Some(8), true).unwrap() > got);
    }

    #[test]
    fn size_hint_refuses_bad_and_huge_shapes() {
        let e = size_hint(128, 7168, 3, 256, None, false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config: num_experts = 256 is not a multiple of num_ranks = 3"
        );
        let e = size_hint(1 << 40, 7168, 8, 256, None, false).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("argument `num_max_dispatch_tokens_per_rank`: 1099511627776 exceeds"),
            "{e}"
        );
        let e = size_hint(1 << 30, 1 << 30, 1, 1 << 10, None, false).unwrap_err();
        assert!(e.to_string().contains("do not fit in 64-bit sizes"), "{e}");
    }

    #[test]
    fn keywords_parse_or_name_the_argument() {
        assert_eq!(path("batched").unwrap(), Path::Batched);
        assert_eq!(path("per_expert").unwrap(), Path::PerExpert);
        assert_eq!(transport("nccl").unwrap(), Transport::Nccl);
        assert_eq!(Phases::parse("recv").unwrap(), Phases::Recv);
        assert!(path("fast").unwrap_err().to_string().starts_with("argument `path`"));
        assert!(transport("ib")
            .unwrap_err()
            .to_string()
            .starts_with("argument `transport`"));
    }

    #[test]
    fn without_a_gpu_probe_says_why() {
        // On a machine with a GPU this passes trivially; on CI (no driver) it must say why.
        match probe(1) {
            Ok(n) => assert!(n >= 1),
            Err(e) => assert!(e.to_string().starts_with("no usable GPU: "), "{e}"),
        }
    }
}
