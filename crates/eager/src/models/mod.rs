//! Small models written with the eager ops, forward and backward by hand, and the training loop
//! the examples, the `tidepool demo` command, the tests and the benchmarks share.
//!
//! - [`data`]: a seeded PRNG and a synthetic classification data set (Gaussian clusters).
//! - [`mlp`]: a ReLU MLP with a cross-entropy loss.
//! - [`transformer`]: one pre-norm transformer block (attention + MLP, layer norm, residuals)
//!   between an embedding and an output projection, trained on next-token prediction.
//! - [`train`]: the MLP training loop with per-step memory statistics, on one stream or with a
//!   copy stream that loads the next batch while the compute stream works.

pub mod data;
pub mod mlp;
pub mod train;
pub mod transformer;
