//! The PyO3 glue: the `ep_dispatch._ep_dispatch` module. Host values cross as `bytes` and ints
//! (the Python package turns numpy arrays into them); the GPU calls take torch tensors
//! themselves and check them here (`rank`, `tensors`);
//! every error becomes the Python exception class of `ep_dispatch.errors` that matches it, with
//! our message and the error's fields as attributes.

use crate::error::BindError;
use crate::gpu;
use crate::host::{self, OutputBytes, ScalesKind};
use crate::keywords;
use ep_kernels::GpuError;
use ep_reference::{DispatchOutput, Error};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
mod c_abi;
mod exceptions;
mod rank;
mod reader;
#[cfg(feature = "testing")]
mod stand_in;
mod tensors;

use exceptions::{to_py, IntoPy};
use rank::{config, duration, CallSpec, GpuRank};

fn slices<'a>(v: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    v.iter().map(|b| b.as_bytes()).collect()
}

fn output_dict<'py>(py: Python<'py>, out: &DispatchOutput) -> PyResult<Bound<'py, PyDict>> {
    let OutputBytes {
        recv_x,
        recv_x_scales,
        recv_count,
        layout_range,
        src_info,
    } = host::output_bytes(out);
    let d = PyDict::new(py);
    d.set_item("recv_x", PyBytes::new(py, &recv_x))?;
    match recv_x_scales {
        None => {
            d.set_item("recv_x_scales", py.None())?;
            d.set_item("scales_kind", py.None())?;
        }
        Some((kind, b)) => {
            d.set_item("recv_x_scales", PyBytes::new(py, &b))?;
            let k = match kind {
                ScalesKind::F32 => "float32",
                ScalesKind::PackedUe8m0 => "ue8m0",
            };
            d.set_item("scales_kind", k)?;
        }
    }
    d.set_item("recv_count", PyBytes::new(py, &recv_count))?;
    d.set_item("layout_range", PyBytes::new(py, &layout_range))?;
    d.set_item("src_info", PyBytes::new(py, &src_info))?;
    Ok(d)
}

/// Validates a config; raises `ConfigError` (or `ArgumentError`) naming the bad value.
#[pyfunction]
#[pyo3(signature = (num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden, top_k, use_fp8=true, round_scale=false, use_ue8m0=false))]
#[allow(clippy::too_many_arguments)]
fn validate_config(
    num_ranks: usize,
    num_experts: usize,
    num_max_dispatch_tokens_per_rank: usize,
    hidden: usize,
    top_k: usize,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> PyResult<()> {
    config(
        num_ranks,
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k,
        use_fp8,
        round_scale,
        use_ue8m0,
    )
    .map(|_| ())
}

/// Checks one rank's routing (`topk_idx`: int64 bytes, n x K) against the config: token count,
/// expert range, duplicates. Returns n.
#[pyfunction]
#[pyo3(signature = (rank, num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden, top_k, topk_idx))]
#[allow(clippy::too_many_arguments)]
fn check_routing(
    rank: usize,
    num_ranks: usize,
    num_experts: usize,
    num_max_dispatch_tokens_per_rank: usize,
    hidden: usize,
    top_k: usize,
    topk_idx: Bound<'_, PyBytes>,
) -> PyResult<usize> {
    let cfg = config(
        num_ranks,
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k,
        false,
        false,
        false,
    )?;
    let t = host::i64s("topk_idx", topk_idx.as_bytes()).py_err()?;
    let n = t.len() / top_k;
    ep_reference::input::check_dispatch_inputs(&cfg, rank, n * hidden, &t).py_err()
}

/// The oracle's dispatch of every rank: one dict of DeepEP-shaped bytes per rank.
#[pyfunction]
#[pyo3(signature = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, hidden, top_k, use_fp8=true, round_scale=false, use_ue8m0=false))]
#[allow(clippy::too_many_arguments)]
fn oracle_dispatch<'py>(
    py: Python<'py>,
    x: Vec<Bound<'py, PyBytes>>,
    topk_idx: Vec<Bound<'py, PyBytes>>,
    num_max_dispatch_tokens_per_rank: usize,
    num_experts: usize,
    hidden: usize,
    top_k: usize,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> PyResult<Bound<'py, PyList>> {
    let cfg = config(
        x.len(),
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k,
        use_fp8,
        round_scale,
        use_ue8m0,
    )?;
    let (xs, ts) = host::dispatch_inputs(&slices(&x), &slices(&topk_idx)).py_err()?;
    let outs = host::oracle_dispatch(&cfg, &xs, &ts).py_err()?;
    let list = PyList::empty(py);
    for o in &outs {
        list.append(output_dict(py, o)?)?;
    }
    Ok(list)
}

/// The oracle's combine of every rank: bf16 bytes `[n_r, H]` per rank.
#[pyfunction]
#[pyo3(signature = (y, topk_idx, topk_weights, num_max_dispatch_tokens_per_rank, num_experts, hidden, top_k, use_logfmt=false))]
#[allow(clippy::too_many_arguments)]
fn oracle_combine<'py>(
    py: Python<'py>,
    y: Vec<Bound<'py, PyBytes>>,
    topk_idx: Vec<Bound<'py, PyBytes>>,
    topk_weights: Vec<Bound<'py, PyBytes>>,
    num_max_dispatch_tokens_per_rank: usize,
    num_experts: usize,
    hidden: usize,
    top_k: usize,
    use_logfmt: bool,
) -> PyResult<Bound<'py, PyList>> {
    let cfg = config(
        y.len(),
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k,
        false,
        false,
        false,
    )?;
    let (ys, ws) = host::combine_inputs(&slices(&y), &slices(&topk_weights)).py_err()?;
    let ts = slices(&topk_idx)
        .iter()
        .enumerate()
        .map(|(r, b)| host::i64s(&format!("topk_idx[{r}]"), b))
        .collect::<Result<Vec<_>, _>>()
        .py_err()?;
    let format = if use_logfmt {
        ep_reference::CombineFormat::LogFmt
    } else {
        ep_reference::CombineFormat::Bf16
    };
    let outs = host::oracle_combine(&cfg, &ys, &ts, &ws, format).py_err()?;
    let list = PyList::empty(py);
    for o in &outs {
        list.append(PyBytes::new(py, &host::bf16_bytes(o)))?;
    }
    Ok(list)
}

/// One dispatch + combine on the CPU backend (`path`: 'per_expert' or 'batched'), one thread per
/// rank: `(dispatch dicts, combine bytes)`, comparable with the oracle's.
#[pyfunction]
#[pyo3(signature = (path, x, topk_idx, y, topk_weights, num_max_dispatch_tokens_per_rank, num_experts, hidden, top_k, use_fp8=true, round_scale=false, use_ue8m0=false, timeout_s=10.0))]
#[allow(clippy::too_many_arguments)]
fn cpu_roundtrip<'py>(
    py: Python<'py>,
    path: &str,
    x: Vec<Bound<'py, PyBytes>>,
    topk_idx: Vec<Bound<'py, PyBytes>>,
    y: Vec<Bound<'py, PyBytes>>,
    topk_weights: Vec<Bound<'py, PyBytes>>,
    num_max_dispatch_tokens_per_rank: usize,
    num_experts: usize,
    hidden: usize,
    top_k: usize,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    timeout_s: f64,
) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
    let p = keywords::path(path).py_err()?;
    let timeout = duration("timeout_s", timeout_s)?;
    let cfg = config(
        x.len(),
        num_experts,
        num_max_dispatch_tokens_per_rank,
        hidden,
        top_k,
        use_fp8,
        round_scale,
        use_ue8m0,
    )?;
    let (xs, ts) = host::dispatch_inputs(&slices(&x), &slices(&topk_idx)).py_err()?;
    let (ys, ws) = host::combine_inputs(&slices(&y), &slices(&topk_weights)).py_err()?;
    let (outs, comb) = host::cpu_roundtrip(p, &cfg, &xs, &ts, &ys, &ws, timeout).py_err()?;
    let d = PyList::empty(py);
    for o in &outs {
        d.append(output_dict(py, o)?)?;
    }
    let c = PyList::empty(py);
    for o in &comb {
        c.append(PyBytes::new(py, &host::bf16_bytes(o)))?;
    }
    Ok((d, c))
}

/// f32 (little-endian bytes) -> bf16 bits, rounded as the contract rounds.
#[pyfunction]
fn bf16_from_f32<'py>(py: Python<'py>, data: Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyBytes>> {
    let v = host::f32s("data", data.as_bytes()).py_err()?;
    Ok(PyBytes::new(py, &host::bf16_bits_from_f32(&v)))
}

/// bf16 bits -> f32 (exact).
#[pyfunction]
fn f32_from_bf16<'py>(py: Python<'py>, data: Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyBytes>> {
    let b = host::f32_from_bf16_bits("data", data.as_bytes()).py_err()?;
    Ok(PyBytes::new(py, &b))
}

/// Bytes of GPU memory one rank's buffers take on `transport` (ep-kernels' layout, with the NCCL
/// staging where that transport allocates it; see `gpu::size_hint`).
#[pyfunction]
#[pyo3(signature = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, top_k=None, transport="auto"))]
fn size_hint(
    num_max_dispatch_tokens_per_rank: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
    top_k: Option<usize>,
    transport: &str,
) -> PyResult<u64> {
    let t = keywords::transport(transport).py_err()?;
    gpu::size_hint(
        num_max_dispatch_tokens_per_rank,
        hidden,
        num_ranks,
        num_experts,
        top_k,
        t,
    )
    .py_err()
}

/// At least `need` usable GPUs, or `NoDeviceError` saying why. Returns how many there are.
#[pyfunction]
fn probe_devices(need: usize) -> PyResult<usize> {
    gpu::probe(need).py_err()
}

/// Checks our `path=` and `transport=` keywords (raises `ArgumentError` naming the keyword),
/// then that the path runs on that transport (`UnsupportedError` saying why not).
#[pyfunction]
fn check_keywords(path: &str, transport: &str, timeout_s: f64) -> PyResult<()> {
    let p = keywords::path(path).py_err()?;
    let t = keywords::transport(transport).py_err()?;
    duration("timeout_s", timeout_s)?;
    gpu::check_path_on(p, t).py_err()
}

/// What this process needs for `transport` beyond a GPU (NCCL for 'nccl'), or `NoDeviceError`
/// saying what is missing.
#[pyfunction]
fn probe_transport(transport: &str) -> PyResult<()> {
    let t = keywords::transport(transport).py_err()?;
    gpu::probe_transport(t).py_err()
}

/// Test hook: raises a sample of the error `kind` (a Rust variant name), so the tests can check
/// that every variant maps to its Python class with its fields. Not part of the API.
#[pyfunction]
fn _raise_sample_error(kind: &str) -> PyResult<()> {
    use ep_reference::{Op, Phase, Side};
    let phase = Phase {
        op: Op::Combine,
        side: Side::Recv,
    };
    let e: BindError = match kind {
        "Timeout" => Error::Timeout {
            rank: 1,
            peer: 3,
            phase,
            call: 7,
            waited_ms: 2000,
        }
        .into(),
        "PeerMismatch" => Error::PeerMismatch {
            rank: 0,
            peer: 2,
            phase,
            call: 4,
            expected: 5,
            got: 6,
        }
        .into(),
        "OutOfMemory" => Error::OutOfMemory {
            needed: 1 << 40,
            available: 1 << 30,
        }
        .into(),
        "HandleMismatch" => Error::HandleMismatch {
            rank: 0,
            expected: "group 1".into(),
            got: "group 2".into(),
        }
        .into(),
        "Cuda" => GpuError::Cuda("cuLaunchKernel: CUDA_ERROR_LAUNCH_FAILED".into()).into(),
        "Nccl" => GpuError::Nccl("ncclSend: unhandled system error".into()).into(),
        "Process" => GpuError::Process("peer 1 closed the rendezvous".into()).into(),
        "Unsupported" => {
            GpuError::Unsupported("8 ranks cannot be spread evenly over 3 GPUs".into()).into()
        }
        "TooManyRanks" => GpuError::TooManyRanks {
            ranks: 257,
            max: 256,
        }
        .into(),
        "GpuTimeout" => GpuError::Contract(Error::Timeout {
            rank: 0,
            peer: 1,
            phase,
            call: 2,
            waited_ms: 10,
        })
        .into(),
        "PeerFailed" => GpuError::PeerFailed {
            rank: 1,
            peer: 0,
            phase,
            call: 4,
        }
        .into(),
        "NotBuilt" => BindError::NotBuilt("dispatch".into()),
        other => {
            return Err(to_py(BindError::argument(
                "kind",
                format!("{other:?} has no sample"),
            )))
        }
    };
    Err(to_py(e))
}

#[pymodule]
fn _ep_dispatch(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("DEVICE_API", gpu::DEVICE_API)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(check_routing, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(oracle_combine, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_roundtrip, m)?)?;
    m.add_function(wrap_pyfunction!(bf16_from_f32, m)?)?;
    m.add_function(wrap_pyfunction!(f32_from_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(probe_devices, m)?)?;
    m.add_function(wrap_pyfunction!(check_keywords, m)?)?;
    m.add_function(wrap_pyfunction!(probe_transport, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_sample_error, m)?)?;
    m.add_class::<CallSpec>()?;
    m.add_class::<GpuRank>()?;
    // The C ABI the C++ torch extension calls the native ranks through.
    m.add("_c_api", c_abi::capsule(m.py())?)?;
    #[cfg(feature = "testing")]
    m.add_class::<stand_in::StandInRank>()?;
    Ok(())
}
