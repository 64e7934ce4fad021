//! Launching the kernels: one launch per device and call (or per stage: pack, unpack), the
//! refused call's poison launch, and the host's count of the calls that went out. Over NCCL a
//! call's pack / exchange / unpack sequence is the transport's (`nccl::Link::call`), which
//! launches its stages through the group ([`Stages`]).
use crate::error::{cuda, GpuError};
use crate::runtime::footprint::check_launch;
use crate::runtime::group::{kind, GpuGroup};
use crate::runtime::layout::{cmb_row_bytes, IoTable, KParams, NTHREADS};
use crate::runtime::nccl::{Call, Link, Stages};
use cudarc::driver::{result, sys};
use ep_reference::{CombineFormat, Mode, Op, Path};
use std::ffi::c_void;
use std::time::Duration;

impl GpuGroup {
    /// Launches one call of `op` on `path` on every device (a combine in the group's
    /// [`GpuGroup::combine_format`]). No host synchronisation.
    pub fn launch(&mut self, op: Op, path: Path) -> Result<(), GpuError> {
        self.launch_inner(Some((op, path)))
    }

    /// Launches the empty kernel with the same grid on every device (overhead baseline).
    pub fn launch_empty(&mut self) -> Result<(), GpuError> {
        self.launch_inner(None)
    }

    pub(crate) fn launch_inner(&mut self, what: Option<(Op, Path)>) -> Result<(), GpuError> {
        let (op, path) = what.unwrap_or((Op::Dispatch, Path::Batched));
        if let Err(e) = self.check_usable() {
            if what.is_some() {
                self.poison_refused(op, path, &self.streams_raw());
            }
            return Err(e);
        }
        if op == Op::Combine {
            self.check_combine_path(path)?;
            self.check_combine_format(self.combine_format)?;
        }
        let nccl = self.nccl.is_some();
        if nccl && what.is_some() {
            // NCCL transport: pack kernel, grouped send/recv, unpack kernel.
            let streams = self.streams_raw();
            let io = self.io_tables();
            self.nccl_call(op, path, &streams, &io, 0)?;
        } else {
            self.launch_stage(op, path, if what.is_none() { -1 } else { 0 })?;
        }
        if what.is_none() {
            return Ok(());
        }
        self.record_call(op, path);
        Ok(())
    }

    /// The host's count of a call of (op, path) that went out: combine's path check and the
    /// calls' numbers (the device counts the same in its epochs).
    pub(crate) fn record_call(&mut self, op: Op, path: Path) {
        if op == Op::Dispatch {
            self.last_dispatch = Some(path);
        }
        self.last_op = Some(op);
        self.calls[kind(op, path)] += 1;
    }

    /// What a call of `op` that the group refuses (it failed: `check_usable`) still does: it
    /// tells the peers. The call's kernel is enqueued on `streams` with the group's own buffers
    /// and `refused` set, so every block stores the poison of this call in the signal words it
    /// owes its peers (poison.cuh) and sends nothing else; a peer's matching call then ends at
    /// once with `GpuError::PeerFailed` naming this rank instead of waiting out its bound. The
    /// epoch and the call count advance as for any call, so the next refused call poisons the
    /// next call's words. Not over NCCL (a refused call exchanges nothing; its peers' NCCL waits
    /// are bounded on their hosts). A launch that fails is dropped: the caller returns the
    /// group's error either way.
    pub(crate) fn poison_refused(&mut self, op: Op, path: Path, streams: &[sys::CUstream]) {
        if self.nccl.is_some() {
            return;
        }
        let io = self.io_tables();
        self.params.refused = 1;
        // The poison sends no rows: the format does not matter.
        let launched = self.launch_stage_on(op, path, 0, streams, &io, CombineFormat::Bf16);
        self.params.refused = 0;
        if launched.is_ok() {
            self.calls[kind(op, path)] += 1;
        }
    }

    /// One launch per device: stage 0 = the whole call, 1 = pack (send side), 2 = unpack
    /// (receive side); -1 = the empty kernel. On the group's streams, with its own buffers; a
    /// combine in the group's [`GpuGroup::combine_format`].
    pub(crate) fn launch_stage(&self, op: Op, path: Path, stage: i32) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        let io = self.io_tables();
        self.launch_stage_on(op, path, stage, &streams, &io, self.combine_format)
    }

    /// [`GpuGroup::launch_stage`] on the given streams (one per device) with the given tensors
    /// (one table per device; zero entries: the group's own buffers); a combine's rows in
    /// `format` (checked by the caller: [`GpuGroup::check_combine_format`]).
    pub(crate) fn launch_stage_on(
        &self,
        op: Op,
        path: Path,
        stage: i32,
        streams: &[sys::CUstream],
        io: &[IoTable],
        format: CombineFormat,
    ) -> Result<(), GpuError> {
        let what = (stage >= 0).then_some(());
        // Nothing is launched on any device unless every device's launch has its buffers.
        for (di, dev) in self.devs.iter().enumerate() {
            let entries = &io[di].r;
            check_launch(
                self.buffers,
                self.cfg.mode != Mode::Bf16,
                op,
                path,
                stage,
                self.params.refused != 0,
                &entries[..dev.ranks.min(entries.len())],
            )?;
        }
        for (di, dev) in self.devs.iter().enumerate() {
            // Per-expert: one kernel for every stage (kp.stage picks the code); batched: the
            // kernel of the stage's own module, which holds only that stage's code.
            let s = match usize::try_from(stage) {
                Ok(s) if s < 3 => s,
                _ if what.is_none() => 0,
                _ => return Err(GpuError::Unsupported(format!("launch stage {stage}"))),
            };
            let f = match (op, path) {
                _ if what.is_none() => dev.funcs.empty,
                (Op::Dispatch, Path::Batched) => dev.funcs.bat_dispatch[s],
                (Op::Dispatch, Path::PerExpert) => dev.funcs.pe_dispatch,
                (Op::Combine, Path::Batched) => dev.funcs.bat_combine[s],
                (Op::Combine, Path::PerExpert) => dev.funcs.pe_combine,
            };
            // The plain build has no NCCL or shrink-mode code (Variant::check_plain).
            dev.variant
                .check_plain(!self.masks[di].is_empty(), self.params.shrink != 0)
                .map_err(|m| GpuError::Unsupported(m.into()))?;
            let mut kp = self.params;
            kp.table = dev.table;
            kp.err = dev.err;
            kp.err_host = dev.err_host.dev;
            kp.rank_base = dev.first_rank as i32;
            kp.ranks_here = dev.ranks as i32;
            kp.nccl_mask = self.masks[di].0;
            kp.stage = stage.max(0);
            if op == Op::Combine && format == CombineFormat::LogFmt {
                // Every row is encoded into its receive slot (cmb_row apart): none is read in
                // place on its own GPU, whatever zero_copy_local says.
                kp.logfmt = 1;
                kp.zero_copy = 0;
                kp.cmb_row = cmb_row_bytes(&self.cfg, format)?;
            }
            // The table's bytes are the kernel's IoTable parameter: exactly as many entries as
            // the device's build declares.
            let iot: &IoTable = &io[di];
            if iot.r.len() != dev.variant.io_capacity() {
                return Err(GpuError::Unsupported(format!(
                    "an IoTable of {} entries for a build that takes {}",
                    iot.r.len(),
                    dev.variant.io_capacity()
                )));
            }
            dev.bind()?;
            let mut args = [
                (&mut kp as *mut KParams).cast::<c_void>(),
                // Read only: the driver copies the parameter bytes at launch.
                iot.r.as_ptr().cast_mut().cast::<c_void>(),
            ];
            let grid = (dev.ranks * self.blocks_per_rank) as u32;
            // SAFETY: `f` is a kernel of this device's module taking (KParams, IoTable) by value
            // (the same #[repr(C)] layouts as in common.cuh, the table as long as the build's
            // EP_MAX_LOCAL, checked above); every address in them and in the
            // table is a live allocation of this group or a caller tensor whose size the device
            // API checked; `streams[di]` belongs to this device's context (checked by the
            // caller); the grid fits on the device at once (checked in new); the launch copies
            // the parameters before returning.
            cuda("launch", unsafe {
                result::launch_kernel(
                    f,
                    (grid, 1, 1),
                    (NTHREADS, 1, 1),
                    self.smem as u32,
                    streams[di],
                    &mut args,
                )
            })?;
        }
        Ok(())
    }

    /// Combine reads the handle the last dispatch left on the device: it must be on the same path.
    pub(crate) fn check_combine_path(&self, path: Path) -> Result<(), GpuError> {
        if self.last_dispatch != Some(path) {
            return Err(GpuError::PathMismatch {
                combine: path.name(),
                dispatch: self.last_dispatch.map(|p| p.name()).unwrap_or("none"),
            });
        }
        Ok(())
    }

    pub(crate) fn streams_raw(&self) -> Vec<sys::CUstream> {
        self.devs.iter().map(|d| d.stream).collect()
    }

    /// One call (or half of one) over NCCL on `streams` with the tensors `io`: `part` 0 the
    /// whole call, 1 pack + exchange (the send hook), 2 unpack (the receive hook).
    pub(crate) fn nccl_call(
        &mut self,
        op: Op,
        path: Path,
        streams: &[sys::CUstream],
        io: &[IoTable],
        part: i32,
    ) -> Result<(), GpuError> {
        let call = Call {
            op,
            path,
            streams,
            io,
            part,
            sizes: self.nccl_sizes,
            dispatch_call: self.calls[kind(Op::Dispatch, path)] + 1,
            timeout: Duration::from_nanos(self.params.timeout_ns),
        };
        self.with_link(|link, group| link.call(group, &call))
    }

    /// Waits for every device's stream, bounded by the group's timeout (over NCCL: a receive
    /// from a dead peer must not hang the process); past it the communicators are aborted and
    /// the group fails ([`Link::wait_streams`]).
    pub(crate) fn wait_nccl_streams(&mut self, op: Op, call: u64) -> Result<(), GpuError> {
        let streams = self.streams_raw();
        let timeout = Duration::from_nanos(self.params.timeout_ns);
        self.with_link(|link, group| link.wait_streams(group, &streams, op, call, timeout))
    }

    /// Runs `f` on the group's NCCL transport with the group as its [`Stages`]. The link is out
    /// of the group while `f` runs, and back before this returns: what `Stages` does (launch a
    /// stage, read the error words, mark the group failed) does not look at it.
    fn with_link<T>(
        &mut self,
        f: impl FnOnce(&mut Link, &mut GpuGroup) -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        let mut link = self.nccl.take().ok_or_else(|| {
            GpuError::Nccl(
                "NCCL peers but no communicators (the group was not built for NCCL)".into(),
            )
        })?;
        let r = f(&mut link, self);
        self.nccl = Some(link);
        r
    }
}

/// What the NCCL transport needs of the group: its pack and unpack launches (bf16 rows: a
/// LogFMT combine is refused over NCCL), its error words, its failed state.
impl Stages for GpuGroup {
    fn launch_stage(
        &self,
        op: Op,
        path: Path,
        stage: i32,
        streams: &[sys::CUstream],
        io: &[IoTable],
    ) -> Result<(), GpuError> {
        self.launch_stage_on(op, path, stage, streams, io, CombineFormat::Bf16)
    }

    fn check(&mut self) -> Result<(), GpuError> {
        GpuGroup::check(self)
    }

    fn fail(&mut self, e: &GpuError) {
        self.broken = Some(e.clone());
    }
}
