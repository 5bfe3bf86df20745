//! tidepool: a stream-ordered caching allocator for CUDA device memory.
//!
//! Layers, each using only the ones below it (see `DESIGN.md`):
//! `trace` → allocator front ([`Allocator`]) → [`pool`] (pure block bookkeeping) →
//! [`device`] ([`Device`] trait, [`SimDevice`]) → `sync` (std/loom shim).
//!
//! ```
//! use std::sync::Arc;
//! use tidepool::{Allocator, Config, SimDevice, StreamId};
//!
//! let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
//! let buf = alloc.alloc(4 << 20, StreamId::DEFAULT).unwrap();
//! assert_eq!(buf.len(), 4 << 20);
//! println!("{}", alloc.memory_summary());
//! ```

pub mod allocator;
pub mod config;
pub mod device;
#[cfg(not(loom))]
pub mod eager;
#[cfg(not(loom))]
pub mod fuzzing;
pub mod pool;
pub mod stats;
pub(crate) mod sync;
#[cfg(not(loom))]
pub mod trace;

pub use allocator::{AllocError, Allocator, Buffer, OomReport};
pub use config::{Config, ConfigError, CrossStream};
pub use device::{Device, DevicePtr, SimConfig, SimDevice, StreamId};
pub use stats::{MemoryStats, Residency};

/// The cudarc this crate is built against (feature `cuda`), so users name the same version.
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use device::{CudaBuffer, CudaDevice};
