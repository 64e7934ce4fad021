//! Debugging and testing aids: `%globaltimer` stamps per block and phase, and the payload
//! encoder run alone.
use crate::error::{cuda, GpuError};
use crate::runtime::group::GpuGroup;
use crate::runtime::layout::{align, KParams, NTHREADS};
#[cfg(feature = "testing")]
use crate::runtime::layout::{NUM_KINDS, STATE_EPOCH_OFFSET};
use cudarc::driver::result;
use ep_reference::{Op, Path};
use half::bf16;
use std::ffi::c_void;

/// Stamps per block of the phase profile (common.cuh `PROF_SLOTS`).
pub const PROF_SLOTS: usize = 16;

impl GpuGroup {
    /// One call of (op, path) with `%globaltimer` stamps: for every block of device 0, the
    /// stamps of slots 0..PROF_SLOTS (0 where a phase was not reached in this call), in ns,
    /// thread 0's view. Debugging aid. Batched dispatch: p0 start, p6 routing loaded, p8 repeat
    /// check, p9 per-expert prefix, p10 per-destination scan, p7 routing checked, p1 set-up
    /// done, p2 sent (one rank: rows written), p3 signals in, p11 row counts loaded, p4
    /// expanded, p5 out (exit counter; a send half counts no exit and stamps no p5); the last
    /// block out only: p13 failure check, p12 epoch and acks stored. Batched combine: p0
    /// start, p8 row-address table (LogFMT, K > 8, or H not a multiple of 8), p1 set-up done, p2
    /// sent, p3 signals in, p4 reduced, p5, p13, p12 as dispatch. A LogFMT combine (both
    /// paths) adds, in its last encoding round, p9 meta words done and p10 group constants
    /// done (both before p2), and p14 warp 0's reduction run set up (after p3).
    pub fn profile(&mut self, op: Op, path: Path) -> Result<Vec<[u64; PROF_SLOTS]>, GpuError> {
        let (buf, grid) = self.clear_stamps(0)?;
        self.params.prof = buf;
        let r = self.launch(op, path).and_then(|_| self.sync());
        self.params.prof = 0;
        r?;
        self.read_stamps(buf, grid)
    }

    /// The receive-hook split of one call of (op, path) with `%globaltimer` stamps: the send half
    /// (stage 1) and the receive half (stage 2), one launch each on the group's streams with its
    /// own buffers, back to back; per half, for every block of device 0, the stamps as in
    /// [`GpuGroup::profile`] (0 where a phase was not reached), in ns. Not over NCCL. The
    /// receive half of batched dispatch also stamps p6 when its row places are known.
    pub fn profile_halves(
        &mut self,
        op: Op,
        path: Path,
    ) -> Result<[Vec<[u64; PROF_SLOTS]>; 2], GpuError> {
        self.check_usable()?;
        if self.nccl.is_some() {
            return Err(GpuError::Unsupported(
                "the phase profile of the halves runs on NVLink / one-GPU groups only".into(),
            ));
        }
        if op == Op::Combine {
            self.check_combine_path(path)?;
        }
        let (send, grid) = self.clear_stamps(0)?;
        let (recv, _) = self.clear_stamps(1)?;
        let mut r = Ok(());
        for (stage, b) in [(1, send), (2, recv)] {
            self.params.prof = b;
            r = r.and_then(|_| self.launch_stage(op, path, stage));
        }
        self.params.prof = 0;
        if r.is_ok() {
            // Both halves went out: one call, as `launch` counts it.
            self.record_call(op, path);
        }
        r.and_then(|_| self.sync())?;
        Ok([self.read_stamps(send, grid)?, self.read_stamps(recv, grid)?])
    }

    /// Scratch buffer `slot` of device 0 sized for one stamp row per block of a launch there,
    /// zeroed on the stream the profiled launch follows on (so that stamps of an earlier profile
    /// never pass for phases this one did not reach); and the launch's grid.
    fn clear_stamps(&mut self, slot: usize) -> Result<(u64, usize), GpuError> {
        let grid = self.devs[0].ranks * self.blocks_per_rank;
        let bytes = grid * PROF_SLOTS * 8;
        self.devs[0].bind()?;
        let buf = self.devs[0].scratch(slot, bytes)?;
        // SAFETY: `buf` holds `bytes` bytes on the bound context; `stream` belongs to it.
        cuda("clear profile", unsafe {
            result::memset_d8_async(buf, 0, bytes, self.devs[0].stream)
        })?;
        Ok((buf, grid))
    }

    /// The stamps [`GpuGroup::clear_stamps`]' buffer holds, a row per block; the device is idle.
    fn read_stamps(&self, buf: u64, grid: usize) -> Result<Vec<[u64; PROF_SLOTS]>, GpuError> {
        let mut host = vec![0u64; grid * PROF_SLOTS];
        self.devs[0].bind()?;
        // SAFETY: `buf` holds grid * PROF_SLOTS u64 on the bound context (clear_stamps); the
        // caller synchronised, so no launch writes it.
        cuda("read profile", unsafe {
            result::memcpy_dtoh_sync(&mut host, buf)
        })?;
        Ok(host
            .chunks_exact(PROF_SLOTS)
            // A chunk of exactly PROF_SLOTS values always converts.
            .map(|c| <[u64; PROF_SLOTS]>::try_from(c).unwrap_or([0; PROF_SLOTS]))
            .collect())
    }

    /// Runs the payload encoder alone on `rows` (n x H bf16) on device 0: per row, the bytes the
    /// wire carries (e4m3 + scales, or bf16). For testing the FP8 cast bit for bit.
    pub fn encode_rows(&mut self, rows: &[bf16]) -> Result<Vec<Vec<u8>>, GpuError> {
        let cfg = self.cfg;
        let n = rows.len() / cfg.hidden;
        let eb = align(cfg.payload_bytes(), 16);
        let mut kp = self.params;
        kp.entry_bytes = eb as i32;
        let dev = &mut self.devs[0];
        dev.bind()?;
        let x = dev.scratch(0, rows.len() * 2)?;
        let out = dev.scratch(1, n * eb)?;
        // SAFETY: `x` was allocated for exactly rows.len() bf16 on the bound context.
        cuda("upload rows", unsafe { result::memcpy_htod_sync(x, rows) })?;
        cuda("synchronize after upload", dev.ctx.synchronize())?;
        let (mut a, mut b, mut c) = (kp, x, out);
        let mut nn = n as i32;
        let mut args = [
            (&mut a as *mut KParams).cast::<c_void>(),
            (&mut b as *mut u64).cast::<c_void>(),
            (&mut c as *mut u64).cast::<c_void>(),
            (&mut nn as *mut i32).cast::<c_void>(),
        ];
        let grid = (n as u32).clamp(1, 1024);
        // SAFETY: ep_fp8_encode_rows(KParams, const u16*, u8*, int): the argument types match;
        // x holds n*H values, out n rows of eb bytes.
        cuda("launch encode", unsafe {
            result::launch_kernel(
                dev.funcs.fp8,
                (grid, 1, 1),
                (NTHREADS, 1, 1),
                0,
                dev.stream,
                &mut args,
            )
        })?;
        // SAFETY: the stream belongs to the bound context.
        cuda("sync encode", unsafe {
            result::stream::synchronize(dev.stream)
        })?;
        let mut host = vec![0u8; n * eb];
        // SAFETY: `out` holds n*eb bytes; the device is idle.
        cuda("read encode", unsafe {
            result::memcpy_dtoh_sync(&mut host, out)
        })?;
        Ok(host
            .chunks_exact(eb)
            .map(|c| c[..cfg.payload_bytes()].to_vec())
            .collect())
    }

    /// Test hook (feature `testing`): sets every kernel kind's completed-call count (the device epochs) of every rank
    /// of this process to `calls`, and the acknowledgements peers wait for to match, as if the
    /// group had already made that many calls of each kind (to test the epochs past 2^32 without
    /// 2^32 calls). Every rank of the job must set the same value between calls.
    #[cfg(feature = "testing")]
    pub fn set_epochs_for_test(&mut self, calls: u64) -> Result<(), GpuError> {
        self.check_usable()?;
        let r = self.cfg.num_ranks;
        for rank in self.device_ranks() {
            let di = self.dev_of(rank);
            let p = self.ptrs[rank];
            self.devs[di].bind()?;
            cuda("synchronize", self.devs[di].ctx.synchronize())?;
            let ep = [calls; NUM_KINDS];
            // Acks live at sig words [R, 2R) (batched dispatch) and [3R, 6R) (batched combine,
            // per-expert dispatch, per-expert combine); see sig_* in common.cuh.
            let acks = vec![calls; r];
            // SAFETY: `state` holds 128 bytes (epochs at STATE_EPOCH_OFFSET), `sig` at least 6R
            // u64 words; both live allocations of the bound context; the device is idle.
            unsafe {
                cuda(
                    "set epochs",
                    result::memcpy_htod_sync(p.state + STATE_EPOCH_OFFSET, &ep),
                )?;
                for base in [r, 3 * r, 4 * r, 5 * r] {
                    cuda(
                        "set acks",
                        result::memcpy_htod_sync(p.sig + 8 * base as u64, &acks),
                    )?;
                }
            }
        }
        self.calls = [calls; NUM_KINDS];
        Ok(())
    }
}
