//! The vocabulary every layer shares: stream ids, device addresses, residency, pool kinds,
//! block states and size units, and `SortedMap`, the small sorted table both the simulated
//! device and the allocator keep addresses in. It sits below the device, pool and allocator layers, so each of
//! them can name these without importing another layer (see `docs/ARCHITECTURE.md`).

mod error_chain;
mod sorted_map;
mod stat;

pub(crate) use sorted_map::SortedMap;

pub use error_chain::ErrorChain;
pub use stat::{BlockStats, DurationStat, Stat, StatGroup};

use std::fmt;

/// 1 KiB.
pub const KIB: u64 = 1 << 10;
/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;
/// The largest request tidepool accepts at all (256 TiB); larger ones are an error, not an OOM.
pub const MAX_REQUEST: u64 = 1 << 48;
/// The smallest size class of [`HostAllocator`](crate::HostAllocator) (smaller requests round
/// up to it).
pub const MIN_HOST_BLOCK: u64 = 512;

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
///
/// An id is a number, not a handle. `CudaDevice`s take theirs from one sequence for the whole
/// process, so a stream of one GPU (or of one `CudaDevice` handle) is unknown to every other:
/// an [`UnknownStream`](crate::AllocError::UnknownStream) error there. Each `SimDevice` numbers
/// its own streams from 1 (tests name them), so on another simulated device the same number is
/// that device's stream of that number, or unknown. Keep a stream id with the device (or
/// [`Allocators::for_device`](crate::Allocators)) that made it.
///
/// ```
/// use tidepool::{Allocators, Config, Device};
/// let all = Allocators::sim(2, 1 << 30, Config::default()).unwrap();
/// let (d0, d1) = (all.for_device(0).unwrap().device(), all.for_device(1).unwrap().device());
/// let s = d0.create_stream().unwrap();
/// assert!(all.for_device(1).unwrap().alloc(10, s).is_err()); // device 1 has no such stream
/// assert_eq!(d1.create_stream().unwrap(), s); // now it has: its own first stream, same number
/// ```
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

/// A byte count that displays with binary units, to two decimals: `512 B`, `1.50 KiB`,
/// `3.64 GiB`. The one byte formatter of the workspace (summaries, errors, replay reports).
///
/// ```
/// use tidepool::Bytes;
/// assert_eq!(Bytes(1536).to_string(), "1.50 KiB");
/// assert_eq!(format!("{:>9}", Bytes(512)), "    512 B");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        if self.0 < 1024 {
            return f.pad(&format!("{} B", self.0));
        }
        let mut v = self.0 as f64 / 1024.0;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        f.pad(&format!("{v:.2} {}", UNITS[unit]))
    }
}
