//! The vocabulary every layer shares: stream ids, device addresses, residency, pool kinds,
//! block states and size units. It sits below the device, pool and allocator layers, so each of
//! them can name these without importing another layer (see `docs/ARCHITECTURE.md`).

mod stat;

pub use stat::{BlockStats, Stat, StatGroup};

use std::fmt;

/// 1 KiB.
pub const KIB: u64 = 1 << 10;
/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;
/// The largest request tidepool accepts at all (256 TiB); larger ones are an error, not an OOM.
pub const MAX_REQUEST: u64 = 1 << 48;

/// A device address. `DeviceAddr::NULL` is what a zero-byte buffer points to.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DeviceAddr(pub u64);

impl DeviceAddr {
    /// The null device pointer (zero-byte buffers point here, as in PyTorch).
    pub const NULL: DeviceAddr = DeviceAddr(0);

    /// The address `bytes` past this one.
    pub fn offset(self, bytes: u64) -> DeviceAddr {
        DeviceAddr(self.0 + bytes)
    }
}

impl fmt::Debug for DeviceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DeviceAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A stream: an in-order queue of device work. Stream 0 is the default stream.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct StreamId(pub u32);

impl StreamId {
    /// The stream that exists from the start.
    pub const DEFAULT: StreamId = StreamId(0);
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {}", self.0)
    }
}

/// Which pool a block comes from: requests up to `small_size` (1 MiB) are small.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum PoolKind {
    /// Requests ≤ 1 MiB, packed into 2 MiB segments.
    Small,
    /// Larger requests, from 20 MiB segments or their own.
    Large,
}

/// How long a block lives: persistent (weights, optimizer state) or transient (activations).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub enum Residency {
    /// Never evicted from the cache by `empty_cache`, trimming or the out-of-memory ladder.
    Persistent,
    /// Recycled freely; the default.
    #[default]
    Transient,
}

/// Where a block is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BlockState {
    /// In the free index, reusable.
    Free,
    /// Handed to a user.
    Allocated,
    /// Freed by its user, waiting for events on other streams before it is reusable.
    Pending,
}
