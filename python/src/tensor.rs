//! What a tensor whose address the bindings take must be: its dtype, shape, strides and device,
//! checked against what the group's config says, before the address goes anywhere. Pure Rust:
//! the PyO3 glue (`py::tensors`) reads a tensor's [`Meta`] and calls [`check`]; everything here is
//! tested without Python.
//!
//! A tensor passes when its dtype is the one wanted, its shape equals the wanted one (every
//! dimension fixed by the config, or by the call's token count), it lies on the wanted device,
//! and its strides are the wanted layout's (row-major, or DeepEP's column-major scales), where
//! dimensions of size 1 may have any stride and a tensor with no elements any strides, as torch's
//! `is_contiguous` reads them. What passes is its address and element count ([`Ptr`]).

use crate::error::{BindError, Result};

/// A device buffer: its address and its length in elements.
pub type Ptr = (u64, usize);

/// The dtypes of the Buffer's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    Fp8E4m3,
    F32,
    I32,
    I64,
}

impl Dtype {
    /// Every dtype, in the order the Python side hands their torch objects over.
    pub const ALL: [Dtype; 5] = [
        Dtype::Bf16,
        Dtype::Fp8E4m3,
        Dtype::F32,
        Dtype::I32,
        Dtype::I64,
    ];

    /// torch's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "torch.bfloat16",
            Dtype::Fp8E4m3 => "torch.float8_e4m3fn",
            Dtype::F32 => "torch.float32",
            Dtype::I32 => "torch.int32",
            Dtype::I64 => "torch.int64",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::Fp8E4m3 => 1,
            Dtype::Bf16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::I64 => 8,
        }
    }
}

/// How a tensor's elements are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Contiguous, row-major (torch's `is_contiguous()`).
    RowMajor,
    /// DeepEP's FP8 scales `[L, R*T, G]`: column-major in the last two dimensions, strides
    /// `(R*T*G, 1, R*T)` (DeepGEMM asserts them).
    ColumnMajorLastTwo,
}

/// What one tensor must be.
#[derive(Debug, Clone, Copy)]
pub struct Want<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub layout: Layout,
}

/// What a tensor says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub ptr: u64,
    /// None: a dtype none of ours (`other_dtype` says which).
    pub dtype: Option<Dtype>,
    /// The name of a dtype none of ours (empty where `dtype` is one of ours).
    pub other_dtype: String,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    /// torch's `get_device()`: the CUDA ordinal, -1 on the host.
    pub device: i64,
}

fn shape_text(shape: &[usize]) -> String {
    let s: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", s.join(", "))
}

/// The strides `layout` gives `shape`, in elements.
pub fn strides_of(shape: &[usize], layout: Layout) -> Vec<i64> {
    let mut st = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for (i, &d) in shape.iter().enumerate().rev() {
        st[i] = acc;
        acc *= d as i64;
    }
    if layout == Layout::ColumnMajorLastTwo && shape.len() == 3 {
        let (rows, g) = (shape[1] as i64, shape[2] as i64);
        st = vec![rows * g, 1, rows];
    }
    st
}

/// Checks `meta` of the tensor `name` against `want` on `device`; returns its address and
/// element count, or an `ArgumentError` naming the tensor and what is wrong with it.
pub fn check(name: &str, meta: &Meta, want: Want<'_>, device: i64) -> Result<Ptr> {
    if meta.dtype != Some(want.dtype) {
        return Err(BindError::argument(
            name,
            format!(
                "dtype {}, expected {}",
                meta.dtype.map_or(meta.other_dtype.as_str(), |d| d.name()),
                want.dtype.name()
            ),
        ));
    }
    let same = meta.shape.len() == want.shape.len()
        && meta
            .shape
            .iter()
            .zip(want.shape)
            .all(|(&g, &w)| g >= 0 && g as usize == w);
    if !same {
        let got: Vec<String> = meta.shape.iter().map(|d| d.to_string()).collect();
        return Err(BindError::argument(
            name,
            format!(
                "shape [{}], expected {}",
                got.join(", "),
                shape_text(want.shape)
            ),
        ));
    }
    if meta.device != device {
        let on = |d: i64| {
            if d < 0 {
                "the host".to_string()
            } else {
                format!("cuda:{d}")
            }
        };
        return Err(BindError::argument(
            name,
            format!(
                "on {}, expected {} (the Buffer's device)",
                on(meta.device),
                on(device)
            ),
        ));
    }
    let numel: usize = want.shape.iter().product();
    if numel > 0 {
        let strides = strides_of(want.shape, want.layout);
        let ok = meta.strides.len() == strides.len()
            && want
                .shape
                .iter()
                .zip(meta.strides.iter().zip(&strides))
                .all(|(&d, (g, w))| d == 1 || g == w);
        if !ok {
            let what = match want.layout {
                Layout::RowMajor => "is not contiguous (call .contiguous() first)".to_string(),
                Layout::ColumnMajorLastTwo => format!(
                    "strides {:?}, expected {:?} (column-major in the last two dimensions, \
                     as DeepEP's)",
                    meta.strides, strides
                ),
            };
            return Err(BindError::argument(name, what));
        }
        if meta.ptr == 0 {
            return Err(BindError::argument(name, "has no memory (data_ptr() is 0)"));
        }
    }
    Ok((meta.ptr, numel))
}

/// Element counts in bytes: `(ptr, elements)` of `dtype` as `(ptr, bytes)`.
pub fn in_bytes((ptr, n): Ptr, dtype: Dtype) -> Ptr {
    (ptr, n * dtype.size())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(dtype: Dtype, shape: &[usize], layout: Layout) -> Meta {
        Meta {
            ptr: 0x1000,
            dtype: Some(dtype),
            other_dtype: String::new(),
            shape: shape.iter().map(|&d| d as i64).collect(),
            strides: strides_of(shape, layout),
            device: 0,
        }
    }

    const X: Want<'static> = Want {
        dtype: Dtype::Bf16,
        shape: &[4, 512],
        layout: Layout::RowMajor,
    };

    fn msg(r: Result<Ptr>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn a_good_tensor_gives_its_address_and_length() {
        let m = meta(Dtype::Bf16, &[4, 512], Layout::RowMajor);
        assert_eq!(check("x", &m, X, 0).unwrap(), (0x1000, 2048));
        assert_eq!(in_bytes((0x1000, 2048), Dtype::Bf16), (0x1000, 4096));
    }

    #[test]
    fn each_fault_is_named() {
        let m = meta(Dtype::F32, &[4, 512], Layout::RowMajor);
        assert_eq!(
            msg(check("x", &m, X, 0)),
            "argument `x`: dtype torch.float32, expected torch.bfloat16"
        );
        let mut m = meta(Dtype::F32, &[4, 512], Layout::RowMajor);
        (m.dtype, m.other_dtype) = (None, "torch.float16".into());
        assert_eq!(
            msg(check("x", &m, X, 0)),
            "argument `x`: dtype torch.float16, expected torch.bfloat16"
        );
        let m = meta(Dtype::Bf16, &[4, 256], Layout::RowMajor);
        assert_eq!(
            msg(check("x", &m, X, 0)),
            "argument `x`: shape [4, 256], expected [4, 512]"
        );
        let m = meta(Dtype::Bf16, &[4, 512, 1], Layout::RowMajor);
        assert!(msg(check("x", &m, X, 0)).contains("shape [4, 512, 1]"));
        let m = meta(Dtype::Bf16, &[4, 512], Layout::RowMajor);
        assert_eq!(
            msg(check("x", &m, X, 1)),
            "argument `x`: on cuda:0, expected cuda:1 (the Buffer's device)"
        );
        let mut m = meta(Dtype::Bf16, &[4, 512], Layout::RowMajor);
        m.strides = vec![1, 4]; // a transpose's view
        assert_eq!(
            msg(check("x", &m, X, 0)),
            "argument `x`: is not contiguous (call .contiguous() first)"
        );
        let mut m = meta(Dtype::Bf16, &[4, 512], Layout::RowMajor);
        m.ptr = 0;
        assert!(msg(check("x", &m, X, 0)).contains("data_ptr() is 0"));
    }

    #[test]
    fn strides_of_size_one_and_empty_tensors_are_free_as_in_torch() {
        let w = Want {
            dtype: Dtype::Bf16,
            shape: &[1, 512],
            layout: Layout::RowMajor,
        };
        let mut m = meta(Dtype::Bf16, &[1, 512], Layout::RowMajor);
        m.strides = vec![7, 1];
        check("x", &m, w, 0).unwrap();
        let w = Want {
            dtype: Dtype::Bf16,
            shape: &[0, 512],
            layout: Layout::RowMajor,
        };
        let mut m = meta(Dtype::Bf16, &[0, 512], Layout::RowMajor);
        m.strides = vec![1, 1];
        m.ptr = 0;
        assert_eq!(check("x", &m, w, 0).unwrap(), (0, 0));
    }

    #[test]
    fn scales_must_be_column_major_in_the_last_two_dimensions() {
        let shape = [2, 12, 4];
        let w = Want {
            dtype: Dtype::F32,
            shape: &shape,
            layout: Layout::ColumnMajorLastTwo,
        };
        assert_eq!(
            strides_of(&shape, Layout::ColumnMajorLastTwo),
            vec![48, 1, 12]
        );
        let good = meta(Dtype::F32, &shape, Layout::ColumnMajorLastTwo);
        assert_eq!(check("recv_x_scales", &good, w, 0).unwrap(), (0x1000, 96));
        let row = meta(Dtype::F32, &shape, Layout::RowMajor);
        let m = msg(check("recv_x_scales", &row, w, 0));
        assert!(
            m.contains("strides [48, 4, 1], expected [48, 1, 12]"),
            "{m}"
        );
    }
}
