//! The host-slice harness for tests and benchmarks: checked uploads of host inputs, the
//! synchronous dispatch/combine, and the read-back of every rank's outputs.
use crate::error::GpuError;
use crate::error::cuda;
use crate::runtime::group::GpuGroup;
use cudarc::driver::result;
use ep_reference::Path;
use ep_reference::{
    input::{check_combine_inputs, check_dispatch_inputs},
    DispatchOutput, Error, Op, RecvScales, RecvX,
};
use half::bf16;

impl GpuGroup {
    pub(crate) fn own_or_err(&self) -> Result<usize, GpuError> {
        self.own.ok_or_else(|| {
            GpuError::Unsupported("dispatch_rank/combine_rank need a group from new_process".into())
        })
    }

    /// Process mode: uploads this rank's dispatch inputs (checked), launches, waits, reads back.
    pub fn dispatch_rank(
        &mut self,
        path: Path,
        x: &[bf16],
        topk_idx: &[i64],
    ) -> Result<DispatchOutput, GpuError> {
        self.upload_rank_dispatch(x, topk_idx)?;
        self.launch(Op::Dispatch, path)?;
        self.sync()?;
        self.read_dispatch_output(self.own_or_err()?)
    }

    /// Process mode: uploads this rank's dispatch inputs (checked). Nothing is launched.
    pub fn upload_rank_dispatch(&mut self, x: &[bf16], topk_idx: &[i64]) -> Result<(), GpuError> {
        self.check_usable()?;
        let r = self.own_or_err()?;
        let n = check_dispatch_inputs(&self.cfg, r, x.len(), topk_idx)?;
        let p = self.ptrs[r];
        self.devs[0].bind()?;
        let meta = [n as i32, 0, 0, 0];
        // SAFETY: the buffers hold T rows (n <= T checked) on the bound context.
        unsafe {
            if n > 0 {
                cuda("upload x", result::memcpy_htod_sync(p.x, x))?;
                cuda("upload topk", result::memcpy_htod_sync(p.topk, topk_idx))?;
            }
            cuda("upload meta", result::memcpy_htod_sync(p.meta, &meta))?;
        }
        self.n_tokens[r] = n;
        self.topk[r] = topk_idx.to_vec();
        self.finish_uploads()
    }

    /// Process mode: uploads this rank's combine inputs (checked against the last dispatch).
    pub fn upload_rank_combine(&mut self, y: &[bf16], w: &[f32]) -> Result<(), GpuError> {
        self.check_usable()?;
        self.own_tensors_or_err("upload_rank_combine")?;
        let r = self.own_or_err()?;
        check_combine_inputs(&self.cfg, r, y.len(), &self.topk[r], w.len())?;
        let p = self.ptrs[r];
        self.devs[0].bind()?;
        // SAFETY: y holds L*R*T*H values, w n*K (checked); buffers sized so, bound context.
        unsafe {
            cuda("upload y", result::memcpy_htod_sync(p.y, y))?;
            if !w.is_empty() {
                cuda("upload weights", result::memcpy_htod_sync(p.weights, w))?;
            }
        }
        self.finish_uploads()
    }

    /// Process mode: combine of this rank (after a dispatch on the same path).
    pub fn combine_rank(
        &mut self,
        path: Path,
        y: &[bf16],
        w: &[f32],
    ) -> Result<Vec<bf16>, GpuError> {
        self.check_combine_path(path)?;
        self.upload_rank_combine(y, w)?;
        self.launch(Op::Combine, path)?;
        self.sync()?;
        self.read_combine_output(self.own_or_err()?)
    }

    /// Uploads every rank's dispatch inputs (checked first). Nothing is launched.
    pub fn upload_dispatch_inputs(
        &mut self,
        x: &[Vec<bf16>],
        topk_idx: &[Vec<i64>],
    ) -> Result<(), GpuError> {
        let cfg = self.cfg;
        if self.own.is_some() {
            return Err(GpuError::Unsupported(
                "a process-mode group holds one rank: use upload_rank_dispatch".into(),
            ));
        }
        if x.len() != cfg.num_ranks || topk_idx.len() != cfg.num_ranks {
            return Err(Error::ShapeMismatch {
                rank: 0,
                tensor: "inputs",
                expected: cfg.num_ranks,
                got: x.len().min(topk_idx.len()),
                shape: "one x and one topk_idx per rank".into(),
            }
            .into());
        }
        let mut ns = Vec::with_capacity(cfg.num_ranks);
        for r in 0..cfg.num_ranks {
            ns.push(check_dispatch_inputs(&cfg, r, x[r].len(), &topk_idx[r])?);
        }
        for r in 0..cfg.num_ranks {
            let dev = self.dev_of(r);
            self.devs[dev].bind()?;
            let p = self.ptrs[r];
            let meta = [ns[r] as i32, 0, 0, 0];
            // SAFETY: each destination was allocated with room for T rows (n <= T checked above)
            // on the bound context; the host slices are plain data.
            unsafe {
                if !x[r].is_empty() {
                    cuda("upload x", result::memcpy_htod_sync(p.x, &x[r]))?;
                    cuda(
                        "upload topk",
                        result::memcpy_htod_sync(p.topk, &topk_idx[r]),
                    )?;
                }
                cuda("upload meta", result::memcpy_htod_sync(p.meta, &meta))?;
            }
            self.n_tokens[r] = ns[r];
            self.topk[r] = topk_idx[r].clone();
        }
        self.finish_uploads()
    }

    /// Uploads every rank's combine inputs (y in the dispatch layout, and the weights), checked
    /// against the routing of the last dispatch.
    pub fn upload_combine_inputs(
        &mut self,
        y: &[Vec<bf16>],
        topk_weights: &[Vec<f32>],
    ) -> Result<(), GpuError> {
        self.own_tensors_or_err("upload_combine_inputs")?;
        let cfg = self.cfg;
        if self.own.is_some() {
            return Err(GpuError::Unsupported(
                "a process-mode group holds one rank: use upload_rank_combine".into(),
            ));
        }
        if y.len() != cfg.num_ranks || topk_weights.len() != cfg.num_ranks {
            return Err(Error::ShapeMismatch {
                rank: 0,
                tensor: "inputs",
                expected: cfg.num_ranks,
                got: y.len().min(topk_weights.len()),
                shape: "one y and one topk_weights per rank".into(),
            }
            .into());
        }
        for r in 0..cfg.num_ranks {
            check_combine_inputs(&cfg, r, y[r].len(), &self.topk[r], topk_weights[r].len())?;
        }
        for r in 0..cfg.num_ranks {
            let dev = self.dev_of(r);
            self.devs[dev].bind()?;
            let p = self.ptrs[r];
            // SAFETY: y holds L*R*T*H values (checked), the weights n*K <= T*K; the buffers were
            // allocated with those sizes on the bound context.
            unsafe {
                cuda("upload y", result::memcpy_htod_sync(p.y, &y[r]))?;
                if !topk_weights[r].is_empty() {
                    cuda(
                        "upload weights",
                        result::memcpy_htod_sync(p.weights, &topk_weights[r]),
                    )?;
                }
            }
        }
        self.finish_uploads()
    }

    /// The uploads go through the legacy stream, the kernels through this group's non-blocking
    /// stream: wait until every copy has landed before anything is launched.
    pub(crate) fn finish_uploads(&self) -> Result<(), GpuError> {
        for dev in &self.devs {
            cuda("synchronize after upload", dev.ctx.synchronize())?;
        }
        Ok(())
    }

    /// Dispatch on every rank: uploads, launches, waits, reads every rank's output back.
    pub fn dispatch(
        &mut self,
        path: Path,
        x: &[Vec<bf16>],
        topk_idx: &[Vec<i64>],
    ) -> Result<Vec<DispatchOutput>, GpuError> {
        self.check_usable()?;
        self.upload_dispatch_inputs(x, topk_idx)?;
        self.launch(Op::Dispatch, path)?;
        self.sync()?;
        (0..self.cfg.num_ranks)
            .map(|r| self.read_dispatch_output(r))
            .collect()
    }

    /// Combine on every rank (after a dispatch on the same path): returns each rank's n_r x H.
    pub fn combine(
        &mut self,
        path: Path,
        y: &[Vec<bf16>],
        topk_weights: &[Vec<f32>],
    ) -> Result<Vec<Vec<bf16>>, GpuError> {
        self.check_usable()?;
        self.check_combine_path(path)?;
        self.upload_combine_inputs(y, topk_weights)?;
        self.launch(Op::Combine, path)?;
        self.sync()?;
        (0..self.cfg.num_ranks)
            .map(|r| self.read_combine_output(r))
            .collect()
    }

    /// Reads rank r's dispatch output (after [`GpuGroup::sync`]).
    pub fn read_dispatch_output(&self, r: usize) -> Result<DispatchOutput, GpuError> {
        self.check_read_rank(r)?;
        self.own_tensors_or_err("read_dispatch_output")?;
        let cfg = self.cfg;
        let p = self.ptrs[r];
        self.devs[self.dev_of(r)].bind()?;
        let mut out = DispatchOutput::zeroed(&cfg);
        let l = cfg.num_local_experts();
        let mut counts = vec![0i32; l];
        let mut layout = vec![0i32; l * cfg.num_ranks * 2];
        // SAFETY: every buffer was allocated with exactly these element counts (rank_sizes) on
        // the bound context; the device is idle (synchronised).
        unsafe {
            cuda(
                "read recv_count",
                result::memcpy_dtoh_sync(&mut counts, p.recv_count),
            )?;
            cuda(
                "read layout",
                result::memcpy_dtoh_sync(&mut layout, p.layout),
            )?;
            cuda(
                "read src_info",
                result::memcpy_dtoh_sync(&mut out.src_info, p.src_info),
            )?;
            match &mut out.recv_x {
                RecvX::Bf16(v) => cuda("read recv_x", result::memcpy_dtoh_sync(v, p.recv_x))?,
                RecvX::Fp8(v) => cuda("read recv_x", result::memcpy_dtoh_sync(v, p.recv_x))?,
            }
            match &mut out.recv_scales {
                None => {}
                Some(RecvScales::F32(v)) => {
                    cuda("read scales", result::memcpy_dtoh_sync(v, p.recv_scales))?
                }
                Some(RecvScales::Ue8m0(v)) => {
                    cuda("read scales", result::memcpy_dtoh_sync(v, p.recv_scales))?
                }
            }
        }
        if self.params.scol != 0 {
            // DeepEP's column-major scales back to the contract's row-major host layout.
            let (rt, g) = (
                cfg.num_ranks * cfg.max_tokens_per_rank,
                cfg.scales_per_row(),
            );
            match &mut out.recv_scales {
                None => {}
                Some(RecvScales::F32(v)) => *v = rows_of_columns(v, l, rt, g),
                Some(RecvScales::Ue8m0(v)) => *v = rows_of_columns(v, l, rt, g),
            }
        }
        out.recv_count = counts;
        out.layout_range = layout.chunks_exact(2).map(|c| (c[0], c[1])).collect();
        Ok(out)
    }

    /// Reads rank r's combine output (n_r x H, after [`GpuGroup::sync`]).
    pub fn read_combine_output(&self, r: usize) -> Result<Vec<bf16>, GpuError> {
        self.check_read_rank(r)?;
        let p = self.ptrs[r];
        self.devs[self.dev_of(r)].bind()?;
        let mut out = vec![bf16::ZERO; self.n_tokens[r] * self.cfg.hidden];
        if !out.is_empty() {
            // SAFETY: `out` holds n_r*H <= T*H values of the rank's output buffer; device idle.
            cuda("read out", unsafe {
                result::memcpy_dtoh_sync(&mut out, p.out)
            })?;
        }
        Ok(out)
    }

    /// Rank `r` exists and its buffers are this process's to read.
    fn check_read_rank(&self, r: usize) -> Result<(), GpuError> {
        if r >= self.cfg.num_ranks {
            return Err(Error::RankOutOfRange {
                rank: r,
                ranks: self.cfg.num_ranks,
            }
            .into());
        }
        if let Some(own) = self.own {
            if r != own {
                return Err(GpuError::Unsupported(format!(
                    "this process runs rank {own}; rank {r}'s outputs live in its own process"
                )));
            }
        }
        Ok(())
    }
}

/// `[l][rt][g]` (row-major) from `v` holding `[l][g][rt]`: recv_scales in DeepEP's layout
/// (column-major in the last two dimensions) read back into the contract's row order.
pub(crate) fn rows_of_columns<T: Copy>(v: &[T], l: usize, rt: usize, g: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(v.len());
    for e in 0..l {
        let m = &v[e * rt * g..(e + 1) * rt * g];
        for r in 0..rt {
            out.extend((0..g).map(|w| m[w * rt + r]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::rows_of_columns;

    #[test]
    fn rows_of_columns_transposes_each_expert() {
        // l = 2, rt = 3, g = 2: expert e's word (r, w) sits at e*6 + w*3 + r.
        let cols = [0, 2, 4, 1, 3, 5, 10, 12, 14, 11, 13, 15];
        assert_eq!(
            rows_of_columns(&cols, 2, 3, 2),
            [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
        );
    }
}
