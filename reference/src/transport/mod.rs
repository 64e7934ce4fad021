//! The CPU backend's communication primitives, shared by the per-expert and batched paths:
//! epoch-tagged signals, credits that make buffer reuse safe, the group's rank mask, per-call
//! statistics, and the memory check. All atomics come from [`crate::sync`], so loom checks this code as shipped.

pub mod mask_table;
pub mod memory;
pub mod signal;
pub mod stats;

pub use mask_table::{MaskTable, Waiter};
pub use signal::{Credit, CreditTable, Signal};
pub use stats::CallStats;
