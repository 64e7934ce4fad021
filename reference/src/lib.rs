//! # ep-reference
//!
//! The executable specification of ep-dispatch (see `docs/contract.md`):
//! - the types every path shares: [`Config`], the inputs' checks, [`DispatchOutput`], [`Handle`],
//!   [`Error`];
//! - the contract's numerics, bit for bit: [`bf16`] rounding, the FP8 cast ([`numerics::fp8`])
//!   and the LogFMT-10 combine format ([`numerics::logfmt`], chosen by [`CombineFormat`]);
//! - the [`oracle`]: every rank's outputs computed directly from the contract, with or without a
//!   [`RankMask`] (DeepEP's shrink mode, [`mask`]);
//! - the CPU backend's transport ([`transport`], on the [`sync`] shim that loom swaps in);
//! - the **per-expert** protocol on that backend ([`per_expert`]): one message per selection;
//! - which of the two protocols a call runs ([`Path`]), with the one parse of the workspace's
//!   choice names ([`names`]);
//! - what every path offers a rank ([`EpRank`], [`rank`]) and the CPU backend's knobs
//!   ([`CpuOptions`], [`options`]).

pub mod config;
pub mod error;
pub mod input;
pub mod mask;
pub mod names;
pub mod numerics;
pub mod options;
pub mod oracle;
pub mod output;
pub mod path;
pub mod payload;
pub mod per_expert;
pub mod rank;
pub mod sync;
pub mod transport;
pub mod workload;

pub use config::{CombineFormat, Config, Mode};
pub use error::{Error, Op, Phase, Result, Side};
pub use half::bf16;
pub use mask::RankMask;
pub use names::UnknownName;
pub use numerics::bf16::{from_f32_rne as bf16_from_f32, to_f32 as bf16_to_f32};
pub use options::CpuOptions;
pub use output::{DispatchOutput, Handle, RecvScales, RecvX};
pub use path::Path;
pub use rank::EpRank;
pub use transport::CallStats;
