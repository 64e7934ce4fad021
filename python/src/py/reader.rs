//! The tensors of a call in the order every caller hands them over (the native methods'
//! arguments, the C ABI's descriptors), and their reading: whoever reads a tensor's [`Meta`] (from
//! its Python attributes, `tensors`, or from a descriptor, `c_abi`), `rank::CallSpec` checks what
//! [`read_all`] read, so the checks have one path.

use super::exceptions::to_py;
use crate::error::BindError;
use crate::tensor::Meta;
use pyo3::prelude::*;

/// The error of a required tensor that is None, as a read of None's attributes names it.
fn absent(name: &str) -> PyErr {
    to_py(BindError::argument(
        name,
        "expected a torch.Tensor, got NoneType",
    ))
}

/// The tensors of a dispatch, in the order every caller hands them over (the native methods'
/// arguments, the C ABI's descriptors): their argument names, and whether each may be absent.
pub(super) const DISPATCH_TENSORS: [(&str, bool); 9] = [
    ("x", false),
    ("topk_idx", false),
    ("recv_x", false),
    ("recv_x_scales", true),
    ("recv_count", false),
    ("src_info", false),
    ("layout_range", false),
    ("cumulative_local_expert_recv_stats", true),
    ("dispatch_wait_recv_cost_stats", true),
];

/// The same for a combine (`x`: the expert outputs, `y` of [`crate::spec::CombineMetas`]).
pub(super) const COMBINE_TENSORS: [(&str, bool); 5] = [
    ("x", false),
    ("topk_idx", false),
    ("topk_weights", false),
    ("out", false),
    ("combine_wait_recv_cost_stats", true),
];

/// Reads what tensor `i` of a call (named `name`, absent allowed where `optional`) says about
/// itself: from a Python object (`tensors::meta`) or from a C ABI descriptor (`c_abi`).
pub(super) type Reader<'r> = dyn FnMut(usize, &'static str, bool) -> PyResult<Option<Meta>> + 'r;

/// Every tensor of a call read in order (a read error names its tensor before anything is
/// checked), the required ones present.
pub(super) fn read_all<const N: usize>(
    names: &[(&'static str, bool); N],
    read: &mut Reader<'_>,
) -> PyResult<[Option<Meta>; N]> {
    let mut out: [Option<Meta>; N] = std::array::from_fn(|_| None);
    for (i, &(name, optional)) in names.iter().enumerate() {
        out[i] = read(i, name, optional)?;
        if out[i].is_none() && !optional {
            return Err(absent(name));
        }
    }
    Ok(out)
}

/// A required tensor [`read_all`] read (present: `read_all` refused it otherwise).
pub(super) fn req<'m>(m: &'m Option<Meta>, name: &str) -> PyResult<&'m Meta> {
    m.as_ref().ok_or_else(|| absent(name))
}
