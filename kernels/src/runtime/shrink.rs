//! Shrink mode's rank mask (DeepEP's `enable_shrink` and its three mask calls): query, update
//! and clean, enqueued in stream order. The kernels' side (the mask words, the agreement of a
//! rank's blocks on a lost peer) is in shrink.cuh.
//!
//! Each rank of a group keeps its own mask: `mask[d] != 0` means rank d is masked on that rank.
//! A wait that runs out masks the peer it waited for (every survivor waits for every peer in
//! dispatch, so a lost rank is masked on all of them within the call that lost it).
//!
//! Unmasking a peer that missed calls is only sound from a common start: the ranks' call
//! counts (the signals' epochs) differ by the calls it missed. [`GpuGroup::clean_mask`] is that
//! start: it zeroes the mask and the protocol words of this process's ranks. Every rank of the
//! group calls it, with no call in flight anywhere, and no rank makes its next call before every
//! rank's clean has run (the caller's barrier, e.g. `torch.distributed.barrier()` after
//! synchronising the stream).

use crate::error::{cuda, GpuError};
use crate::runtime::driver;
use crate::runtime::group::GpuGroup;
use crate::runtime::layout::{rank_sizes, SHRINK_DECISIONS};
use cudarc::driver::{result, sys};
use cudarc::driver::{CudaStream, CudaViewMut, DevicePtrMut};
use ep_reference::{Error, Path};

/// Byte offset of the mask inside a rank's `shrink` buffer (after the decision words).
fn mask_offset(r: usize) -> u64 {
    (SHRINK_DECISIONS * 8 * r) as u64
}

impl GpuGroup {
    /// Whether the group runs in shrink mode ([`GpuOptions::enable_shrink`](crate::GpuOptions::enable_shrink)).
    pub fn shrink_enabled(&self) -> bool {
        self.params.shrink != 0
    }

    fn check_shrink_call(&self) -> Result<(), GpuError> {
        if !self.shrink_enabled() {
            return Err(GpuError::Unsupported(
                "the rank mask needs shrink mode (GpuOptions::enable_shrink)".into(),
            ));
        }
        Ok(())
    }

    /// Rank `rank` must be one this process runs.
    fn runs_rank(&self, rank: usize) -> Result<(), GpuError> {
        if !self.device_ranks().contains(&rank) {
            return Err(GpuError::Unsupported(format!(
                "rank {rank} is not run by this process (its ranks: {:?})",
                self.device_ranks()
            )));
        }
        Ok(())
    }

    /// The streams to enqueue on: the caller's (one per device, on its context), or the
    /// group's own.
    fn mask_streams(
        &self,
        streams: Option<&[&CudaStream]>,
    ) -> Result<Vec<sys::CUstream>, GpuError> {
        match streams {
            None => Ok(self.streams_raw()),
            Some(ss) => self.caller_streams(ss),
        }
    }

    /// Rank `rank`'s mask (true: masked), read now without waiting for queued calls:
    /// synchronise their stream first to read what they left.
    pub fn mask_status(&self, rank: usize) -> Result<Vec<bool>, GpuError> {
        self.check_shrink_call()?;
        self.runs_rank(rank)?;
        let r = self.cfg.num_ranks;
        let dev = &self.devs[self.dev_of(rank)];
        dev.bind()?;
        let mut m = vec![0i32; r];
        // SAFETY: the shrink buffer of `rank` holds R i32 of mask at mask_offset (layout.rs),
        // on the bound context.
        cuda("read the mask", unsafe {
            result::memcpy_dtoh_sync(&mut m, self.ptrs[rank].shrink + mask_offset(r))
        })?;
        Ok(m.into_iter().map(|v| v != 0).collect())
    }

    /// Copies rank `rank`'s mask (i32 per rank, 1: masked) into `out` on `stream`, in stream
    /// order (DeepEP's `low_latency_query_mask_buffer`; capturable).
    pub fn query_mask_device(
        &self,
        stream: &CudaStream,
        rank: usize,
        out: &mut CudaViewMut<'_, i32>,
    ) -> Result<(), GpuError> {
        self.check_shrink_call()?;
        self.runs_rank(rank)?;
        let r = self.cfg.num_ranks;
        let di = self.dev_of(rank);
        self.stream_on(stream, di)?;
        if out.len() < r {
            return Err(Error::ShapeMismatch {
                rank,
                tensor: "mask_status",
                expected: r,
                got: out.len(),
                shape: format!("at least [{r}] int32"),
            }
            .into());
        }
        let (dst, _g) = out.device_ptr_mut(stream);
        self.devs[di].bind()?;
        // SAFETY: `dst` holds at least R i32 on this context (checked); the source is the
        // rank's mask (R i32); the copy is ordered on the caller's stream.
        cuda("copy the mask", unsafe {
            result::memcpy_dtod_async(
                dst,
                self.ptrs[rank].shrink + mask_offset(r),
                4 * r,
                stream.cu_stream(),
            )
        })
    }

    /// Masks (`masked`) or unmasks `peer` in the mask of every rank this process runs, in
    /// stream order (DeepEP's `low_latency_update_mask_buffer`). Unmasking a peer that missed
    /// calls needs [`GpuGroup::clean_mask`] on every rank instead (see the module docs).
    pub fn update_mask(
        &mut self,
        streams: Option<&[&CudaStream]>,
        peer: usize,
        masked: bool,
    ) -> Result<(), GpuError> {
        self.check_shrink_call()?;
        let r = self.cfg.num_ranks;
        if peer >= r {
            return Err(Error::RankOutOfRange {
                rank: peer,
                ranks: r,
            }
            .into());
        }
        let raw = self.mask_streams(streams)?;
        for rank in self.device_ranks() {
            let di = self.dev_of(rank);
            self.devs[di].bind()?;
            // SAFETY: mask[peer] of `rank` is one i32 inside its shrink buffer on the bound
            // context; the stream belongs to it.
            cuda("update the mask", unsafe {
                driver::memset_d32_async(
                    self.ptrs[rank].shrink + mask_offset(r) + 4 * peer as u64,
                    masked as u32,
                    1,
                    raw[di],
                )
            })?;
        }
        Ok(())
    }

    /// Clears the mask of every rank this process runs and resets their protocol state (signal
    /// and acknowledgement words, epochs, the shrink decisions, the per-expert message tags), in
    /// stream order (DeepEP's `low_latency_clean_mask_buffer`). Every rank of the group calls
    /// it with no call in flight, and none calls again before all have cleaned (module docs).
    /// A combine then needs a new dispatch first. loom model: ep-verify's
    /// `gpu_protocol::clean_mask`, model `shrink_unmask_with_clean` (mutant
    /// `gpu_clean_keeps_signals`).
    pub fn clean_mask(&mut self, streams: Option<&[&CudaStream]>) -> Result<(), GpuError> {
        self.check_shrink_call()?;
        let sizes = rank_sizes(&self.cfg, self.nccl.is_some())?;
        let (sig, state, shrink) = (sizes[19], sizes[20], sizes[25]);
        let peb = self.params.pe_entry_bytes as usize;
        let (l, r, t) = (
            self.cfg.num_local_experts(),
            self.cfg.num_ranks,
            self.cfg.max_tokens_per_rank,
        );
        let raw = self.mask_streams(streams)?;
        for rank in self.device_ranks() {
            let di = self.dev_of(rank);
            let p = self.ptrs[rank];
            self.devs[di].bind()?;
            for (what, at, bytes) in [
                ("signals", p.sig, sig),
                ("state", p.state, state),
                ("shrink", p.shrink, shrink),
            ] {
                // SAFETY: each buffer of `rank` is `bytes` long (rank_sizes) on the bound
                // context; every size is a multiple of 4; the stream belongs to the context.
                cuda(what, unsafe {
                    driver::memset_d32_async(at, 0, bytes / 4, raw[di])
                })?;
            }
            // The per-expert headers carry the epoch that wrote them (the receive scan takes
            // an entry of this call by it): zero the first 16 bytes of every entry. A group
            // formed for the batched path only holds no per-expert area.
            if self.buffers.runs(Path::PerExpert) {
                // SAFETY: pe_buf holds L*R*T entries of `peb` bytes (a multiple of 16) on the
                // bound context (the plan keeps it where the per-expert path runs); 4 u32 per
                // row, pitch `peb`.
                cuda("per-expert headers", unsafe {
                    driver::memset_d2d32_async(p.pe_buf, peb, 0, 4, l * r * t, raw[di])
                })?;
            }
        }
        self.last_dispatch = None;
        Ok(())
    }
}
