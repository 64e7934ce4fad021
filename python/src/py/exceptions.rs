//! Every error as the Python exception class of `ep_dispatch.errors` that matches it, with our
//! message, its kind and its fields as attributes.

use crate::error::BindError;
use ep_group::GroupError;
use ep_kernels::GpuError;
use ep_reference::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// A field of an error, set as an attribute of the Python exception.
enum Field {
    Int(i128),
    Str(String),
}

fn int(v: impl Into<i128>) -> Field {
    Field::Int(v.into())
}

fn us(v: usize) -> Field {
    Field::Int(v as i128)
}

/// The exception class (in `ep_dispatch.errors`), the error's kind, and its fields.
fn classify(e: &BindError) -> (&'static str, &'static str, Vec<(&'static str, Field)>) {
    use Error as E;
    match e {
        BindError::Contract(c) => match c {
            E::ZeroSize { what } => (
                "ConfigError",
                "ZeroSize",
                vec![("what", Field::Str(what.to_string()))],
            ),
            E::ExpertsNotDivisible { experts, ranks } => (
                "ConfigError",
                "ExpertsNotDivisible",
                vec![("experts", us(*experts)), ("ranks", us(*ranks))],
            ),
            E::TooManyLocalExperts { local, max } => (
                "ConfigError",
                "TooManyLocalExperts",
                vec![("local", us(*local)), ("max", us(*max))],
            ),
            E::HiddenNotMultiple {
                hidden,
                multiple,
                mode,
            } => (
                "ConfigError",
                "HiddenNotMultiple",
                vec![
                    ("hidden", us(*hidden)),
                    ("multiple", us(*multiple)),
                    ("mode", Field::Str(mode.to_string())),
                ],
            ),
            E::TopKOutOfRange { top_k } => {
                ("ConfigError", "TopKOutOfRange", vec![("top_k", us(*top_k))])
            }
            E::Ue8m0WithoutRoundScale => ("ConfigError", "Ue8m0WithoutRoundScale", vec![]),
            E::RankOutOfRange { rank, ranks } => (
                "ConfigError",
                "RankOutOfRange",
                vec![("rank", us(*rank)), ("ranks", us(*ranks))],
            ),
            E::UnmaskOutOfStep {
                rank,
                peer,
                other,
                op,
                calls,
                other_calls,
            } => (
                "InputError",
                "UnmaskOutOfStep",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("other", us(*other)),
                    ("op", Field::Str(op.to_string())),
                    ("calls", int(*calls)),
                    ("other_calls", int(*other_calls)),
                ],
            ),
            E::WrongRankCount { expected, got } => (
                "InputError",
                "WrongRankCount",
                vec![("expected", us(*expected)), ("got", us(*got))],
            ),
            E::TooManyTokens { rank, tokens, max } => (
                "InputError",
                "TooManyTokens",
                vec![
                    ("rank", us(*rank)),
                    ("tokens", us(*tokens)),
                    ("max", us(*max)),
                ],
            ),
            E::ExpertOutOfRange {
                rank,
                token,
                slot,
                expert,
                num_experts,
            } => (
                "InputError",
                "ExpertOutOfRange",
                vec![
                    ("rank", us(*rank)),
                    ("token", us(*token)),
                    ("slot", us(*slot)),
                    ("expert", int(*expert)),
                    ("num_experts", us(*num_experts)),
                ],
            ),
            E::DuplicateExpert {
                rank,
                token,
                expert,
                first_slot,
                second_slot,
            } => (
                "InputError",
                "DuplicateExpert",
                vec![
                    ("rank", us(*rank)),
                    ("token", us(*token)),
                    ("expert", int(*expert)),
                    ("first_slot", us(*first_slot)),
                    ("second_slot", us(*second_slot)),
                ],
            ),
            E::ShapeMismatch {
                rank,
                tensor,
                expected,
                got,
                shape,
            } => (
                "InputError",
                "ShapeMismatch",
                vec![
                    ("rank", us(*rank)),
                    ("tensor", Field::Str(tensor.to_string())),
                    ("expected", us(*expected)),
                    ("got", us(*got)),
                    ("shape", Field::Str(shape.clone())),
                ],
            ),
            E::HandleMismatch { rank, .. } => {
                ("InputError", "HandleMismatch", vec![("rank", us(*rank))])
            }
            E::TopkMismatch {
                rank,
                token,
                slot,
                expected,
                got,
            } => (
                "InputError",
                "TopkMismatch",
                vec![
                    ("rank", us(*rank)),
                    ("token", us(*token)),
                    ("slot", us(*slot)),
                    ("expected", int(*expected)),
                    ("got", int(*got)),
                ],
            ),
            E::PeerMismatch {
                rank,
                peer,
                phase,
                call,
                expected,
                got,
            } => (
                "PeerError",
                "PeerMismatch",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("phase", Field::Str(phase.to_string())),
                    ("call", int(*call)),
                    ("expected", us(*expected)),
                    ("got", us(*got)),
                ],
            ),
            E::LimitExceeded { what, value, limit } => (
                "ConfigError",
                "LimitExceeded",
                vec![
                    ("what", Field::Str(what.to_string())),
                    ("value", int(*value as i128)),
                    ("limit", int(*limit as i128)),
                ],
            ),
            E::WorkerPanicked { rank, op, call, .. } => (
                "DeviceError",
                "WorkerPanicked",
                vec![
                    ("rank", us(*rank)),
                    ("op", Field::Str(op.to_string())),
                    ("call", int(*call)),
                ],
            ),
            E::OutOfMemory { needed, available } => (
                "OutOfMemoryError",
                "OutOfMemory",
                vec![("needed", int(*needed)), ("available", int(*available))],
            ),
            E::Timeout {
                rank,
                peer,
                phase,
                call,
                waited_ms,
            } => (
                "TimeoutError",
                "Timeout",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("phase", Field::Str(phase.to_string())),
                    ("call", int(*call)),
                    ("waited_ms", int(*waited_ms)),
                ],
            ),
        },
        BindError::Gpu(g) => match g {
            GpuError::NoDevice(_) => ("NoDeviceError", "NoDevice", vec![]),
            GpuError::Cuda(_) => ("DeviceError", "Cuda", vec![]),
            GpuError::Nccl(_) => ("DeviceError", "Nccl", vec![]),
            GpuError::Compile(_) => ("DeviceError", "Compile", vec![]),
            GpuError::Process(_) => ("PeerError", "Process", vec![]),
            GpuError::Unsupported(_) => ("UnsupportedError", "Unsupported", vec![]),
            GpuError::TooManyRanks { ranks, max } => (
                "UnsupportedError",
                "TooManyRanks",
                vec![("ranks", us(*ranks)), ("max", us(*max))],
            ),
            GpuError::PathMismatch { .. } => ("InputError", "PathMismatch", vec![]),
            GpuError::Handle(_) => ("InputError", "Handle", vec![]),
            GpuError::WrongDevice {
                what,
                expected,
                got,
            } => (
                "InputError",
                "WrongDevice",
                vec![
                    ("what", Field::Str(what.to_string())),
                    ("expected", us(*expected)),
                    ("got", us(*got)),
                ],
            ),
            GpuError::PeerData {
                rank,
                peer,
                field,
                value,
                limit,
            } => (
                "PeerError",
                "PeerData",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("field", Field::Str(field.to_string())),
                    ("value", int(*value)),
                    ("limit", int(*limit)),
                ],
            ),
            GpuError::PeerFailed {
                rank,
                peer,
                phase,
                call,
            } => (
                "PeerError",
                "PeerFailed",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("phase", Field::Str(phase.to_string())),
                    ("call", int(*call)),
                ],
            ),
            GpuError::PeerMismatch {
                field,
                ours,
                theirs,
                rank,
                peer,
            } => (
                "PeerError",
                "PeerMismatch",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("field", Field::Str(field.to_string())),
                    ("ours", Field::Str(ours.clone())),
                    ("theirs", Field::Str(theirs.clone())),
                ],
            ),
            GpuError::PeerCount {
                rank,
                peer,
                field,
                value,
                ..
            } => (
                "PeerError",
                "PeerCount",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("field", Field::Str(field.to_string())),
                    ("value", int(*value)),
                ],
            ),
            GpuError::NcclTimeout {
                rank,
                what,
                waited_ms,
            } => (
                "TimeoutError",
                "NcclTimeout",
                vec![
                    ("rank", us(*rank)),
                    ("what", Field::Str(what.to_string())),
                    ("waited_ms", int(*waited_ms)),
                ],
            ),
            // Contract errors are unwrapped into BindError::Contract by `From<GpuError>`.
            GpuError::Contract(_) => ("EpError", "Contract", vec![]),
        },
        BindError::Group(g) => match g {
            GroupError::Process(_) => ("PeerError", "Process", vec![]),
            // A node id from the environment (EP_NODE_ID, GROUP_RANK) that cannot be used.
            GroupError::Node(_) => ("InputError", "Node", vec![]),
            GroupError::PeerBlob { rank, peer, .. } => (
                "PeerError",
                "PeerBlob",
                vec![("rank", us(*rank)), ("peer", us(*peer))],
            ),
            GroupError::PeerMismatch {
                field,
                ours,
                theirs,
                rank,
                peer,
            } => (
                "PeerError",
                "PeerMismatch",
                vec![
                    ("rank", us(*rank)),
                    ("peer", us(*peer)),
                    ("field", Field::Str(field.to_string())),
                    ("ours", Field::Str(ours.clone())),
                    ("theirs", Field::Str(theirs.clone())),
                ],
            ),
            // Unwrapped into BindError::Gpu / BindError::Contract by `From<GroupError>`.
            GroupError::Gpu(_) => ("EpError", "Gpu", vec![]),
        },
        BindError::Argument { argument, .. } => (
            "ArgumentError",
            "Argument",
            vec![("argument", Field::Str(argument.clone()))],
        ),
        BindError::NotBuilt(_) => ("NotBuiltError", "NotBuilt", vec![]),
    }
}

/// The Python exception for `e`: its class from `ep_dispatch.errors`, our message, `kind` and
/// the fields as attributes.
pub(super) fn to_py(e: BindError) -> PyErr {
    Python::attach(|py| {
        let msg = e.to_string();
        let (class, kind, fields) = classify(&e);
        let build = || -> PyResult<PyErr> {
            let cls = py.import("ep_dispatch.errors")?.getattr(class)?;
            let exc = cls.call1((msg.clone(),))?;
            exc.setattr("kind", kind)?;
            for (name, f) in fields {
                match f {
                    Field::Int(v) => exc.setattr(name, v)?,
                    Field::Str(s) => exc.setattr(name, s)?,
                }
            }
            Ok(PyErr::from_value(exc))
        };
        // Without the Python package (the native module imported alone) there is no class to
        // raise: keep the message.
        build().unwrap_or_else(|_| PyRuntimeError::new_err(msg))
    })
}

pub(super) trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T, E: Into<BindError>> IntoPy<T> for Result<T, E> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(|e| to_py(e.into()))
    }
}
