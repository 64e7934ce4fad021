//! The dispatch output in DeepEP's low-latency shapes, and the handle combine needs.

use crate::config::{Config, Mode};
use crate::error::{Error, Result};
use crate::mask::RankMask;
use half::bf16;

/// `recv_x`: L x (R*T) x H.
#[derive(Debug, Clone, PartialEq)]
pub enum RecvX {
    Bf16(Vec<bf16>),
    /// e4m3 bytes.
    Fp8(Vec<u8>),
}

/// `recv_scales`: L x (R*T) x (H/128) f32, or with UE8M0 L x (R*T) x (H/512) packed i32.
#[derive(Debug, Clone, PartialEq)]
pub enum RecvScales {
    F32(Vec<f32>),
    Ue8m0(Vec<i32>),
}

/// What dispatch hands rank r.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchOutput {
    pub config: Config,
    pub recv_x: RecvX,
    pub recv_scales: Option<RecvScales>,
    /// L: rows received by each local expert.
    pub recv_count: Vec<i32>,
    /// L x R pairs (begin, count): rows of local expert l from source rank s.
    pub layout_range: Vec<(i32, i32)>,
    /// L x (R*T): the token index on its source rank.
    pub src_info: Vec<i32>,
}

impl DispatchOutput {
    /// An output with every buffer allocated (zeroed) for `cfg`, on zeroed pages: only the
    /// rows a dispatch writes cost memory.
    pub fn zeroed(cfg: &Config) -> DispatchOutput {
        let l = cfg.num_local_experts();
        let rows = l * cfg.rows_per_expert();
        let recv_x = match cfg.mode {
            Mode::Bf16 => RecvX::Bf16(crate::numerics::bf16::zeroed(rows * cfg.hidden)),
            Mode::Fp8 { .. } => RecvX::Fp8(vec![0u8; rows * cfg.hidden]),
        };
        let recv_scales = match cfg.mode {
            Mode::Bf16 => None,
            Mode::Fp8 { ue8m0: false, .. } => {
                Some(RecvScales::F32(vec![0.0; rows * cfg.scales_per_row()]))
            }
            Mode::Fp8 { ue8m0: true, .. } => {
                Some(RecvScales::Ue8m0(vec![0; rows * cfg.scales_per_row()]))
            }
        };
        DispatchOutput {
            config: *cfg,
            recv_x,
            recv_scales,
            recv_count: vec![0; l],
            layout_range: vec![(0, 0); l * cfg.num_ranks],
            src_info: vec![0; rows],
        }
    }

    /// DeepEP's packed view of `layout_range`: `(begin << 32) | count` as i64.
    pub fn layout_range_packed(&self) -> Vec<i64> {
        self.layout_range
            .iter()
            .map(|&(b, c)| ((b as i64) << 32) | (c as u32 as i64))
            .collect()
    }

    /// (begin, count) of local expert `l` from source `s`.
    pub fn range(&self, l: usize, s: usize) -> (usize, usize) {
        let (b, c) = self.layout_range[l * self.config.num_ranks + s];
        (b as usize, c as usize)
    }

    /// Fills `recv_count` and `layout_range` from per-(l, s) counts, canonically: begin(l, s)
    /// is the sum of counts of sources before s.
    pub fn set_layout(&mut self, counts: &[usize]) {
        let r = self.config.num_ranks;
        for l in 0..self.config.num_local_experts() {
            let mut begin = 0usize;
            for s in 0..r {
                let c = counts[l * r + s];
                self.layout_range[l * r + s] = (begin as i32, c as i32);
                begin += c;
            }
            self.recv_count[l] = begin as i32;
        }
    }

    /// Writes one received row: its payload bytes as the wire carries them (see
    /// [`crate::payload`]) land in `recv_x` and `recv_scales` at (local expert, row).
    pub fn write_row(&mut self, l: usize, row: usize, src_token: usize, payload: &[u8]) {
        let cfg = self.config;
        let idx = l * cfg.rows_per_expert() + row;
        self.src_info[idx] = src_token as i32;
        let xb = cfg.recv_x_row_bytes();
        match &mut self.recv_x {
            RecvX::Bf16(v) => {
                crate::payload::bf16_bytes_mut(&mut v[idx * cfg.hidden..(idx + 1) * cfg.hidden])
                    .copy_from_slice(&payload[..xb])
            }
            RecvX::Fp8(v) => v[idx * xb..(idx + 1) * xb].copy_from_slice(&payload[..xb]),
        }
        let spr = cfg.scales_per_row();
        match &mut self.recv_scales {
            None => {}
            Some(RecvScales::F32(v)) => {
                for (d, c) in v[idx * spr..(idx + 1) * spr]
                    .iter_mut()
                    .zip(payload[xb..].chunks_exact(4))
                {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Some(RecvScales::Ue8m0(v)) => {
                for (d, c) in v[idx * spr..(idx + 1) * spr]
                    .iter_mut()
                    .zip(payload[xb..].chunks_exact(4))
                {
                    *d = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }

    /// Compares the meaningful part (rows below `recv_count`) of two outputs bit for bit and
    /// describes the first difference.
    pub fn diff(&self, other: &DispatchOutput) -> Option<String> {
        if self.config != other.config {
            return Some(format!(
                "configs differ: {} vs {}",
                self.config.describe(),
                other.config.describe()
            ));
        }
        if self.recv_count != other.recv_count {
            return Some(format!(
                "recv_count differs: {:?} vs {:?}",
                self.recv_count, other.recv_count
            ));
        }
        if self.layout_range != other.layout_range {
            return Some("layout_range differs".to_string());
        }
        let cfg = self.config;
        let per = cfg.rows_per_expert();
        for l in 0..cfg.num_local_experts() {
            for row in 0..self.recv_count[l] as usize {
                let i = l * per + row;
                if self.src_info[i] != other.src_info[i] {
                    return Some(format!(
                        "src_info[{l}][{row}]: {} vs {}",
                        self.src_info[i], other.src_info[i]
                    ));
                }
                if self.row_bits(i) != other.row_bits(i) {
                    return Some(format!("recv_x/recv_scales differ at expert {l} row {row}"));
                }
            }
        }
        None
    }

    fn row_bits(&self, i: usize) -> (Vec<u8>, Vec<u32>) {
        let cfg = self.config;
        let h = cfg.hidden;
        let x = match &self.recv_x {
            RecvX::Bf16(v) => v[i * h..(i + 1) * h]
                .iter()
                .flat_map(|b| b.to_bits().to_le_bytes())
                .collect(),
            RecvX::Fp8(v) => v[i * h..(i + 1) * h].to_vec(),
        };
        let spr = cfg.scales_per_row();
        let s = match &self.recv_scales {
            None => Vec::new(),
            Some(RecvScales::F32(v)) => v[i * spr..(i + 1) * spr]
                .iter()
                .map(|f| f.to_bits())
                .collect(),
            Some(RecvScales::Ue8m0(v)) => v[i * spr..(i + 1) * spr]
                .iter()
                .map(|&w| w as u32)
                .collect(),
        };
        (x, s)
    }
}

/// Compares two combine outputs (n x `hidden` bf16) bit for bit and describes the first
/// difference (token, channel, both bit patterns), or a length mismatch.
pub fn combine_diff(a: &[bf16], b: &[bf16], hidden: usize) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())?;
    Some(format!(
        "token {} channel {}: {:#06x} vs {:#06x}",
        i / hidden,
        i % hidden,
        a[i].to_bits(),
        b[i].to_bits()
    ))
}

/// What combine needs from a dispatch: who dispatched, with which config and routing, and the
/// received layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Handle {
    /// Identifies the communicator that made the handle.
    pub group_id: u64,
    pub rank: usize,
    pub config: Config,
    /// The dispatched `topk_idx` of this rank (n_r x K).
    pub topk_idx: Vec<i64>,
    /// L x R (begin, count), as in the output.
    pub layout_range: Vec<(i32, i32)>,
    pub recv_count: Vec<i32>,
    pub src_info: Vec<i32>,
    /// The ranks masked for this dispatch: those it skipped and those masked by its end (see
    /// [`crate::mask`]). Its combine treats them as masked too, whatever the mask is then, so
    /// that it never waits for rows its dispatch did not send. None for a dispatch without a
    /// mask; this rank among them when it was masked itself (then its combine does nothing).
    pub mask: RankMask,
}

impl Handle {
    pub fn new(group_id: u64, rank: usize, topk_idx: &[i64], out: &DispatchOutput) -> Handle {
        Handle {
            group_id,
            rank,
            config: out.config,
            topk_idx: topk_idx.to_vec(),
            layout_range: out.layout_range.clone(),
            recv_count: out.recv_count.clone(),
            src_info: out.src_info.clone(),
            mask: RankMask::none(out.config.num_ranks),
        }
    }

    /// The handle with `mask` as the ranks its dispatch treated as masked.
    ///
    /// # Panics
    /// When `mask` is not of this handle's group size.
    pub fn with_mask(mut self, mask: RankMask) -> Handle {
        assert_eq!(
            mask.num_ranks(),
            self.config.num_ranks,
            "mask of another group size"
        );
        self.mask = mask;
        self
    }

    pub fn num_tokens(&self) -> usize {
        self.topk_idx.len() / self.config.top_k
    }

    /// (begin, count) of local expert `l` from source `s`.
    pub fn range(&self, l: usize, s: usize) -> (usize, usize) {
        let (b, c) = self.layout_range[l * self.config.num_ranks + s];
        (b as usize, c as usize)
    }

    /// Checks that this handle belongs to (`group_id`, `rank`, `cfg`) and that combine was given
    /// the routing that was dispatched.
    pub fn check(&self, group_id: u64, rank: usize, cfg: &Config, topk_idx: &[i64]) -> Result<()> {
        if self.group_id != group_id || self.rank != rank || self.config != *cfg {
            return Err(Error::HandleMismatch {
                rank,
                expected: format!("group {group_id} rank {rank} ({})", cfg.describe()),
                got: format!(
                    "group {} rank {} ({})",
                    self.group_id,
                    self.rank,
                    self.config.describe()
                ),
            });
        }
        if topk_idx.len() != self.topk_idx.len() {
            return Err(Error::ShapeMismatch {
                rank,
                tensor: "topk_idx",
                expected: self.topk_idx.len(),
                got: topk_idx.len(),
                shape: "the dispatched n x top_k".to_string(),
            });
        }
        if let Some(i) = (0..topk_idx.len()).find(|&i| topk_idx[i] != self.topk_idx[i]) {
            return Err(Error::TopkMismatch {
                rank,
                token: i / cfg.top_k,
                slot: i % cfg.top_k,
                expected: self.topk_idx[i],
                got: topk_idx[i],
            });
        }
        Ok(())
    }
}
