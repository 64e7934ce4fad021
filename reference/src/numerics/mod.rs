//! Bit-exact numerics of the contract: bf16 rounding and the FP8 e4m3 cast with its scales.
//! The GPU kernels implement the same functions; kernels/ tests them against these.

pub mod bf16;
pub mod fp8;
pub mod reduce;
