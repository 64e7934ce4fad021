//! Reading what a torch tensor says about itself ([`Meta`]) from Rust, for the checks of
//! `crate::spec`: five attribute reads per tensor (`dtype`, `shape`, `stride()`, `get_device()`,
//! `data_ptr()`), each a C-level call into torch that allocates no object the collector tracks
//! but the shape and stride tuples (freed at once). The dtype is compared by identity with the
//! torch dtype objects the Python side handed over once ([`Dtypes`]), so no torch import happens
//! here and a test can pass stand-ins for tensors and dtypes (duck typing, as torch's own
//! `__cuda_array_interface__` readers do).
//!
//! Under torch's default-device mode (`torch.set_default_device`) each of these reads would go
//! through the mode's Python `__torch_function__`; the Buffer makes its calls with torch
//! functions disabled (`torch._C.DisableTorchFunction`), as DeepEP's C++ reads its tensors
//! where no mode reaches.

use super::exceptions::to_py;
use crate::error::BindError;
use crate::tensor::{Dtype, Meta};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// The torch dtype objects of [`Dtype::ALL`], in that order.
pub(super) struct Dtypes([Py<PyAny>; 5]);

impl Dtypes {
    /// From the tuple `(bfloat16, float8_e4m3fn, float32, int32, int64)`.
    pub(super) fn new(t: &Bound<'_, PyTuple>) -> PyResult<Dtypes> {
        if t.len() != Dtype::ALL.len() {
            return Err(to_py(BindError::argument(
                "dtypes",
                format!(
                    "{} objects, expected torch's ({})",
                    t.len(),
                    Dtype::ALL.map(Dtype::name).join(", ")
                ),
            )));
        }
        let get = |i: usize| t.get_item(i).map(Bound::unbind);
        Ok(Dtypes([get(0)?, get(1)?, get(2)?, get(3)?, get(4)?]))
    }

    fn of(&self, d: &Bound<'_, PyAny>) -> Option<Dtype> {
        self.0.iter().position(|o| d.is(o)).map(|i| Dtype::ALL[i])
    }
}

/// The `ArgumentError` of an argument `name` that is no tensor (`t`: what was passed).
pub(super) fn not_a_tensor(name: &str, t: &Bound<'_, PyAny>) -> PyErr {
    let ty = t
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    to_py(BindError::argument(
        name,
        format!("expected a torch.Tensor, got {ty}"),
    ))
}

/// What tensor `t` (the argument `name`) says about itself; an `ArgumentError` naming it where
/// it is no tensor.
pub(super) fn meta(name: &str, t: &Bound<'_, PyAny>, dtypes: &Dtypes) -> PyResult<Meta> {
    let py = t.py();
    let read = || -> PyResult<Meta> {
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let known = dtypes.of(&dtype);
        let other_dtype = match known {
            Some(_) => String::new(),
            None => dtype.str()?.to_string(),
        };
        Ok(Meta {
            ptr: t.call_method0(intern!(py, "data_ptr"))?.extract()?,
            dtype: known,
            other_dtype,
            shape: t.getattr(intern!(py, "shape"))?.extract()?,
            strides: t.call_method0(intern!(py, "stride"))?.extract()?,
            device: t.call_method0(intern!(py, "get_device"))?.extract()?,
        })
    };
    read().map_err(|_| not_a_tensor(name, t))
}

/// The name of tensor `t`'s dtype (`str(t.dtype)`, e.g. "torch.float16"), for the message of a
/// dtype none of ours; `not_a_tensor` where it has none.
pub(super) fn dtype_text(name: &str, t: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = t.py();
    let read = || -> PyResult<String> { Ok(t.getattr(intern!(py, "dtype"))?.str()?.to_string()) };
    read().map_err(|_| not_a_tensor(name, t))
}

/// [`meta`] of an optional tensor (None stays None).
pub(super) fn meta_opt(
    name: &str,
    t: Option<&Bound<'_, PyAny>>,
    dtypes: &Dtypes,
) -> PyResult<Option<Meta>> {
    t.filter(|t| !t.is_none())
        .map(|t| meta(name, t, dtypes))
        .transpose()
}
