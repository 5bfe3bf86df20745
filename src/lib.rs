//! tidepool: a stream-ordered caching allocator for CUDA device memory.
//!
//! It splits and coalesces blocks, frees them in stream order, keeps the segments of persistent
//! memory (weights) cached when those of transient memory (activations) are recycled, and runs on a simulated device
//! ([`SimDevice`], with a stream-order sanitizer) where there is no GPU, or on a real one
//! (`CudaDevice`, feature `cuda`). The architecture, layer by layer, is in
//! `docs/ARCHITECTURE.md` of this repository:
//!
//! ```text
//!  interop (CudaBuffer)  ─▶ allocator (Allocator, Buffer, Scope) ─▶ pool (blocks, best fit)
//!                                     │                              │
//!                                     ▼                              ▼
//!                        device (Device, SimDevice, CudaDevice) ─▶ types ─▶ sync (std/loom)
//! ```
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
//!
//! Features: `cuda` (`CudaDevice` and `CudaBuffer` over cudarc's driver API, loaded at run
//! time), `cuda-XXXXX` (the CUDA version cudarc binds, the application's choice), `test-hooks`
//! (test-only internals; never in an application).

mod allocator;
mod config;
pub mod device;
mod host;
mod interop;
mod membarrier;
pub mod packing;
mod peers;
mod pickle;
mod pool;
mod registry;
mod stats;
pub(crate) mod sync;
mod types;

pub use allocator::{
    Action, AllocError, Allocator, Annotation, BlockInfo, Buffer, Graph, HistoryContext,
    HistoryOptions, MemPool, OomReport, PoolGuard, PoolOptions, RangeInfo, Scope, ScopedBuffer,
    SegmentInfo, TraceEntry,
};
pub use config::{
    Config, ConfigError, CrossStream, ENV_VAR, ExpandableReserve, HostConfig, KEYS as CONFIG_KEYS,
    NO_CACHING_ENV_VAR, NO_EFFECT_KEYS as CONFIG_NO_EFFECT_KEYS,
};
pub use device::{
    AccessKind, Capture, CaptureMark, Device, DeviceError, GraphId, SimConfig, SimDevice,
};
pub use host::{HostAllocError, HostAllocator, HostStats, MIN_HOST_BLOCK, PinnedBuffer};
pub use pool::{RoundupDivisions, Sizing};
pub use registry::Allocators;
pub use stats::MemoryStats;
pub use types::{
    BlockState, BlockStats, Bytes, DeviceAddr, DurationStat, ErrorChain, GIB, KIB, MAX_REQUEST,
    MIB, PoolKind, Residency, Stat, StatGroup, StreamId,
};

/// The cudarc this crate is built against (feature `cuda`), so users name the same version.
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use device::CudaDevice;
#[cfg(feature = "cuda")]
pub use interop::{CudaBuffer, FromBufferError};

/// Test-only internals (feature `test-hooks`): the pool, the lock-free pieces the loom models
/// drive, deliberately broken modes and lock counters. Not a stable API; never enable it in an
/// application.
#[cfg(feature = "test-hooks")]
pub mod hooks {
    pub use crate::allocator::internals::*;
    pub use crate::config::KEYS;
    pub use crate::pool::{BlockId, Pool, PoolKey, SegmentId};
}
