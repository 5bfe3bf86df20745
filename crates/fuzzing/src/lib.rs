//! Fuzz harnesses, shared by the cargo-fuzz targets in `fuzz/` and by this crate's
//! `tests/fuzz_corpus.rs`, which replays every committed corpus input and crash artifact under
//! `cargo test --workspace` (or `cargo test -p tidepool-fuzzing`).
//!
//! ```text
//!   fuzz/fuzz_targets/<target>.rs ──┐
//!                                   ├──▶ tidepool_fuzzing::<target>(data: &[u8])
//!   tests/fuzz_corpus.rs ───────────┘       (panics on a bug)
//! ```
//!
//! - [`allocator_ops`](fn@allocator_ops): a program of allocator, stream, scope and
//!   fault-injection operations ([`program`]) run on the sanitized SimDevice against a
//!   reference model.
//! - [`config_parse`](fn@config_parse): arbitrary text into `Config::parse`.
//! - [`trace_parse`](fn@trace_parse): arbitrary bytes into every trace reader.
//!
//! The module is always compiled (it costs no dependency): programs are decoded from bytes by
//! the hand-written [`input`] decoder rather than the `arbitrary` crate, so the same code runs
//! under libFuzzer and under `cargo test`.

mod allocator_ops;
mod config_parse;
pub mod input;
pub mod program;
mod trace_parse;

pub use allocator_ops::{Options, allocator_ops, run as run_program};
pub use config_parse::config_parse;
pub use trace_parse::trace_parse;
