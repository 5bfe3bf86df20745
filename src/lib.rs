//! tidepool: a stream-ordered caching allocator for CUDA device memory.
//!
//! Layers, each using only the ones below it (see `DESIGN.md`):
//! `trace` → allocator front ([`Allocator`]) → [`pool`] (pure block bookkeeping) →
//! [`device`] ([`Device`] trait, [`SimDevice`]) → `sync` (std/loom shim).

pub mod device;
pub(crate) mod sync;
pub mod trace;

pub use device::{Device, DevicePtr, SimDevice, StreamId};
