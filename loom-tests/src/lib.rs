//! Loom models of tidepool's lock-free protocols live in `tests/`; run them with
//! `scripts/loom.sh` (`RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p
//! tidepool-loom-tests --release --target-dir target/loom`).
//!
//! This library holds what the models share: [`LoomDevice`], a tiny [`Device`] built on loom's
//! primitives, with a minimal stream-order check of its own (a hand-out of memory that another
//! stream's unfinished work still uses panics), so models can drive the real `Allocator`.

#[cfg(loom)]
mod device;
#[cfg(loom)]
pub use device::LoomDevice;
