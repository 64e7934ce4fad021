//! The host-slice harness for tests and benchmarks: checked uploads of host inputs, the
//! synchronous dispatch/combine, and the read-back of every rank's outputs.
use crate::error::{cuda, GpuError};
use crate::runtime::group::GpuGroup;
use cudarc::driver::result;
use ep_reference::Path;
use ep_reference::{
    input::{check_combine_inputs, check_dispatch_inputs},
    Config, DispatchOutput, Error, Op, RecvScales, RecvX,
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

    /// Process mode: uploads this rank's combine inputs (checked against the last dispatch). Of
    /// y only the rows the last dispatch delivered to each local expert go up (its recv_count,
    /// read back from the device): combine reads no other row.
    pub fn upload_rank_combine(&mut self, y: &[bf16], w: &[f32]) -> Result<(), GpuError> {
        self.check_usable()?;
        self.own_tensors_or_err("upload_rank_combine")?;
        let r = self.own_or_err()?;
        check_combine_inputs(&self.cfg, r, y.len(), &self.topk[r], w.len())?;
        let p = self.ptrs[r];
        let (per, h) = (self.cfg.rows_per_expert(), self.cfg.hidden);
        let mut counts = vec![0i32; self.cfg.num_local_experts()];
        self.devs[0].bind()?;
        // The last dispatch ran on the group's own (non-blocking) stream: done before its
        // counts are read on the legacy one.
        cuda(
            "synchronize before reading recv_count",
            self.devs[0].ctx.synchronize(),
        )?;
        // SAFETY: recv_count holds L i32 (rank_sizes) on the bound context, now idle; y holds
        // L*R*T*H values and w n*K (checked), and each row range lies inside y (at most R*T
        // rows per expert: row_count clamps the device's count); the buffers are sized so.
        unsafe {
            cuda(
                "read recv_count",
                result::memcpy_dtoh_sync(&mut counts, p.recv_count),
            )?;
            for (e, &c) in counts.iter().enumerate() {
                htod_part(
                    "upload y",
                    p.y,
                    y,
                    e * per * h..(e * per + row_count(c, per)) * h,
                )?;
            }
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
    /// against the routing of the last dispatch upload. Of y only the rows that routing sends
    /// each local expert go up (`received_rows`): combine reads no other row, and the L x R*T
    /// capacity is E x T rows per rank whatever is sent.
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
        let rows = received_rows(&cfg, &self.topk);
        let (per, h) = (cfg.rows_per_expert(), cfg.hidden);
        for r in 0..cfg.num_ranks {
            let dev = self.dev_of(r);
            self.devs[dev].bind()?;
            let p = self.ptrs[r];
            // SAFETY: y holds L*R*T*H values (checked) and each range lies inside it (rows at
            // most R*T per expert), the weights n*K <= T*K; the buffers were allocated with
            // those sizes on the bound context.
            unsafe {
                for (e, &n) in rows[r].iter().enumerate() {
                    htod_part("upload y", p.y, &y[r], e * per * h..(e * per + n) * h)?;
                }
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

    /// Reads rank r's dispatch output (after [`GpuGroup::sync`]): the counts, the layout, and
    /// of recv_x, recv_scales and src_info the rows below each expert's recv_count; the rest of
    /// the returned buffers stay zero, on pages never written (`DispatchOutput::zeroed`).
    pub fn read_dispatch_output(&self, r: usize) -> Result<DispatchOutput, GpuError> {
        self.check_read_rank(r)?;
        self.own_tensors_or_err("read_dispatch_output")?;
        let cfg = self.cfg;
        let p = self.ptrs[r];
        self.devs[self.dev_of(r)].bind()?;
        let mut out = DispatchOutput::zeroed(&cfg);
        let l = cfg.num_local_experts();
        let (per, h, g) = (cfg.rows_per_expert(), cfg.hidden, cfg.scales_per_row());
        let mut counts = vec![0i32; l];
        let mut layout = vec![0i32; l * cfg.num_ranks * 2];
        let scol = self.params.scol != 0;
        // SAFETY: every buffer was allocated with exactly these element counts (rank_sizes) on
        // the bound context, and every range below lies inside its host buffer (rows at most
        // R*T per expert); the device is idle (synchronised).
        unsafe {
            cuda(
                "read recv_count",
                result::memcpy_dtoh_sync(&mut counts, p.recv_count),
            )?;
            cuda(
                "read layout",
                result::memcpy_dtoh_sync(&mut layout, p.layout),
            )?;
            // The received rows only (rows past recv_count carry no meaning, docs/contract.md
            // section 3): the capacity is E x T rows, what arrives at most R x T x K over all
            // ranks. Column-major scales come whole (a few MB) and are reordered below.
            for (e, &c) in counts.iter().enumerate() {
                let rows = e * per..e * per + row_count(c, per);
                dtoh_part("read src_info", &mut out.src_info, p.src_info, rows.clone())?;
                let x = rows.start * h..rows.end * h;
                match &mut out.recv_x {
                    RecvX::Bf16(v) => dtoh_part("read recv_x", v, p.recv_x, x)?,
                    RecvX::Fp8(v) => dtoh_part("read recv_x", v, p.recv_x, x)?,
                }
                let sc = rows.start * g..rows.end * g;
                match &mut out.recv_scales {
                    Some(RecvScales::F32(v)) if !scol => {
                        dtoh_part("read scales", v, p.recv_scales, sc)?
                    }
                    Some(RecvScales::Ue8m0(v)) if !scol => {
                        dtoh_part("read scales", v, p.recv_scales, sc)?
                    }
                    _ => {}
                }
            }
            if scol {
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
        }
        if scol {
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

    /// The device address and length (L*R*T*H bf16 values) of rank r's own `y`, the buffer
    /// [`GpuGroup::upload_combine_inputs`] fills: for a caller that passes the same values to
    /// the device API (`CombineIn::y`, e.g. through `CudaStream::upgrade_device_ptr`, leaked
    /// rather than freed) instead of a second copy of the capacity per rank. The address is
    /// valid while the group lives; `Unsupported` for a group without its own tensors.
    pub fn own_y(&self, r: usize) -> Result<(u64, usize), GpuError> {
        self.check_read_rank(r)?;
        self.own_tensors_or_err("own_y")?;
        let c = &self.cfg;
        let len = c.num_local_experts() * c.rows_per_expert() * c.hidden;
        Ok((self.ptrs[r].y, len))
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

/// Rows of a recv_count as read from the device: clamped to `0..=per` (R*T), so that no copy
/// reaches past an expert's rows whatever the device wrote.
fn row_count(count: i32, per: usize) -> usize {
    usize::try_from(count).unwrap_or(0).min(per)
}

/// The rows each local expert of each rank receives from `topk` (every rank's routing; a rank's
/// vector may be empty): `out[r][l]` counts the slots that name expert `r*L + l`, at most R*T.
/// A mask only removes rows, so these are never fewer than a masked call's recv_count.
pub(crate) fn received_rows(cfg: &Config, topk: &[Vec<i64>]) -> Vec<Vec<usize>> {
    let l = cfg.num_local_experts();
    let mut rows = vec![vec![0usize; l]; cfg.num_ranks];
    for &e in topk.iter().flatten() {
        // Ids were checked at the upload (`check_dispatch_inputs`): -1 or below E.
        if let Ok(e) = usize::try_from(e) {
            if let Some(n) = rows.get_mut(e / l).and_then(|v| v.get_mut(e % l)) {
                *n += 1;
            }
        }
    }
    for n in rows.iter_mut().flatten() {
        *n = (*n).min(cfg.rows_per_expert());
    }
    rows
}

/// Uploads `src[range]` to the same elements of the device buffer at `dst`.
///
/// # Safety
/// `dst` must address a live device buffer of at least `range.end` elements of `T` on the
/// bound context (`range` inside `src` is checked by the slice index).
unsafe fn htod_part<T>(
    what: &str,
    dst: u64,
    src: &[T],
    range: std::ops::Range<usize>,
) -> Result<(), GpuError> {
    if range.is_empty() {
        return Ok(());
    }
    // `range.start` elements of `src` exist, so their bytes fit in isize.
    let at = dst + (range.start * std::mem::size_of::<T>()) as u64;
    // SAFETY: as the caller guarantees for the device side; the host slice is in bounds.
    cuda(what, unsafe { result::memcpy_htod_sync(at, &src[range]) })
}

/// Reads the elements `range` of the device buffer at `src` into `dst[range]`.
///
/// # Safety
/// As [`htod_part`], with the device buffer as the source.
unsafe fn dtoh_part<T>(
    what: &str,
    dst: &mut [T],
    src: u64,
    range: std::ops::Range<usize>,
) -> Result<(), GpuError> {
    if range.is_empty() {
        return Ok(());
    }
    // `range.start` elements of `dst` exist, so their bytes fit in isize.
    let at = src + (range.start * std::mem::size_of::<T>()) as u64;
    // SAFETY: as the caller guarantees for the device side; the host slice is in bounds.
    cuda(what, unsafe {
        result::memcpy_dtoh_sync(&mut dst[range], at)
    })
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
    use super::{received_rows, row_count, rows_of_columns};
    use ep_reference::{oracle, Config, Mode};

    /// The rows each expert receives, from every rank's routing: the oracle's recv_count on
    /// random routings (ranks without tokens included), the slots of each expert counted on its
    /// own rank; a count past R*T (only a routing that repeats an expert reaches it) is clamped.
    #[test]
    fn received_rows_are_the_oracles_recv_count() {
        use crate::testing::{random_inputs, rank_inputs, Rng, Routing};
        let cfg = Config::new(4, 16, 8, 128, 4, Mode::Bf16).unwrap();
        let mut rng = Rng::new(11);
        for tokens in [[8, 3, 0, 8], [0, 0, 0, 1], [8, 8, 8, 8]] {
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.2 }, &mut rng);
            let topk: Vec<Vec<i64>> = data.iter().map(|d| d.topk_idx.clone()).collect();
            let want: Vec<Vec<usize>> = oracle::dispatch(&cfg, &rank_inputs(&data))
                .unwrap()
                .iter()
                .map(|o| o.recv_count.iter().map(|&c| c as usize).collect())
                .collect();
            assert_eq!(received_rows(&cfg, &topk), want, "tokens {tokens:?}");
        }
        let cfg = Config::new(2, 4, 3, 128, 2, Mode::Bf16).unwrap(); // L = 2, R*T = 6
        let topk = vec![vec![0, 3, 1, -1, 0, 2], vec![3, 2, -1, -1]];
        assert_eq!(received_rows(&cfg, &topk), [[2, 1], [2, 2]]);
        assert_eq!(received_rows(&cfg, &[vec![1; 9], vec![]]), [[0, 6], [0, 0]]);
    }

    #[test]
    fn a_device_count_is_clamped_to_the_experts_rows() {
        assert_eq!(row_count(5, 6), 5);
        assert_eq!(row_count(7, 6), 6);
        assert_eq!(row_count(-1, 6), 0);
        assert_eq!(row_count(i32::MAX, 6), 6);
    }

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
