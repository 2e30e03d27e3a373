//! Reinforcement learning for agentstack: the pieces the trainer is built from.
//!
//! - [`loss`]: the GRPO family (token or sequence ratios, clip-higher, DAPO/GRPO/Dr.
//!   GRPO aggregation, KL k1/k2/k3, truncated importance sampling), each checked
//!   against finite differences.
//! - [`advantage`]: group-relative advantages (std-normalised or Dr. GRPO), dynamic
//!   sampling, overlong filtering and the soft overlong penalty, on-policy
//!   distillation's per-token reverse KL.
//! - [`lora`]: adapters beside a model's weights (rank, alpha, targets), saved as
//!   safetensors; [`policy`]: completion log-probabilities with gradients, and a
//!   reference sampler; [`optim`]: AdamW with clipping and a schedule.
//! - [`train`]: the loop behind `agentstack train` (rollouts, learning, weight sync,
//!   evaluation, checkpoints a killed run resumes from exactly).
//!
//! ```
//! use agentstack_rl::advantage::{group_advantages, Normalization};
//!
//! let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], Normalization::Std);
//! assert!(a[0] > 0.0 && a[1] < 0.0);
//! ```

pub mod advantage;
pub mod config;
pub mod export;
pub mod lora;
pub mod loss;
pub mod optim;
pub mod plot;
pub mod policy;
pub mod train;
