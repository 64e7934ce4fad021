//! The caller's tensors of a device-API call (`device_api`): a rank's dispatch and combine
//! inputs, its dispatch outputs and their sizes, a combine's options (format, wait statistics).

use cudarc::driver::{CudaView, CudaViewMut};
use ep_reference::CombineFormat;
use half::bf16;

/// A rank's token count for a device-API dispatch.
#[derive(Debug, Clone, Copy)]
pub enum Tokens<'a> {
    /// Known on the host (checked against T).
    Host(usize),
    /// One i32 in device memory, read by the kernel when it runs (checked there against T).
    Device(&'a CudaView<'a, i32>),
}

/// One rank's dispatch inputs: x `[n, H]` bf16, topk_idx `[n, K]` i64.
#[derive(Debug)]
pub struct DispatchIn<'a> {
    pub x: &'a CudaView<'a, bf16>,
    pub topk_idx: &'a CudaView<'a, i64>,
    pub n_tokens: Tokens<'a>,
}

/// One rank's combine inputs: y `[L, R*T, H]` bf16 (the expert outputs in the dispatch layout),
/// topk_idx (the dispatched tensor) and topk_weights `[n, K]` f32.
#[derive(Debug)]
pub struct CombineIn<'a> {
    pub y: &'a CudaView<'a, bf16>,
    pub topk_idx: &'a CudaView<'a, i64>,
    pub topk_weights: &'a CudaView<'a, f32>,
}

/// A device-API combine's options beyond its tensors (`GpuGroup::combine_device_opts`,
/// `combine_send_opts`): the rows' format, and DeepEP's `combine_wait_recv_cost_stats`.
#[derive(Debug)]
pub struct CombineOpts<'s, 'a> {
    /// bf16 rows, or LogFMT-10 (`use_logfmt`).
    pub format: CombineFormat,
    /// One `[R]` i64 per rank of the call: the receive adds the SM clock cycles (`clock64`) it
    /// waited for each owner's rows (NCCL owners, whose rows arrive before the kernel, and a
    /// group of every rank on one GPU with `zero_copy_local`, which reads the rows in place and
    /// waits for nobody, add nothing). The batched path counts one wait per owner, the
    /// per-expert path one per expert and owner, as its dispatch does.
    pub wait_stats: Option<&'s mut [CudaViewMut<'a, i64>]>,
}

impl CombineOpts<'_, '_> {
    /// `format`, no statistics.
    pub fn format(format: CombineFormat) -> Self {
        CombineOpts {
            format,
            wait_stats: None,
        }
    }
}

/// Caller-allocated dispatch outputs of one rank (sizes: [`GpuGroup::dispatch_out_sizes`](crate::GpuGroup::dispatch_out_sizes)).
#[derive(Debug)]
pub struct DeviceDispatchOut<'a> {
    /// L*R*T rows of `recv_x_row_bytes` bytes (bf16 rows, or e4m3 bytes).
    pub recv_x: CudaViewMut<'a, u8>,
    /// FP8 modes: L*R*T rows of `scales_per_row` 4-byte words (f32, or UE8M0 packed in i32).
    pub recv_scales: Option<CudaViewMut<'a, u8>>,
    /// `[L]` rows received per local expert.
    pub recv_count: CudaViewMut<'a, i32>,
    /// `[L, R]` (begin, count) as two i32 in one i64.
    pub layout_range: CudaViewMut<'a, i64>,
    /// `[L, R*T]` source token of each received row.
    pub src_info: CudaViewMut<'a, i32>,
    /// `[L]`, DeepEP's `cumulative_local_expert_recv_stats`: a good call adds its `recv_count`
    /// to it on the device (a failed call adds nothing).
    pub recv_stats: Option<CudaViewMut<'a, i32>>,
    /// `[R]`, DeepEP's `dispatch_wait_recv_cost_stats`: the receive adds the SM clock cycles
    /// (`clock64`) it waited for each source's tokens (NCCL sources, which arrive before the
    /// kernel, add nothing). The batched path counts one wait per source, the per-expert path
    /// one per local expert and source, as DeepEP's kernel does.
    pub wait_stats: Option<CudaViewMut<'a, i64>>,
}

/// Element counts of one rank's dispatch outputs (what [`DeviceDispatchOut`] must hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchOutSizes {
    pub recv_x_bytes: usize,
    pub recv_scales_bytes: usize,
    pub recv_count: usize,
    pub layout_range: usize,
    pub src_info: usize,
}
