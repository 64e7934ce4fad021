//! Bit-exact numerics of the contract: bf16 rounding, the FP8 e4m3 cast with its scales, and
//! the LogFMT-10 combine format. The GPU kernels implement the same functions; kernels/ tests
//! them against these.

pub mod bf16;
pub mod fp8;
pub mod logfmt;
pub mod logfmt_wire;
pub mod reduce;
