//! Several devices: one allocator per device, as PyTorch keeps one caching allocator per GPU.
//! A buffer always goes back to the allocator of its own device (it holds it); a buffer handed
//! to another device's allocator is refused like any foreign buffer.
//!
//! ```text
//!  Allocators ── [0] Allocator<D> over device 0
//!              ├ [1] Allocator<D> over device 1        for_device(n) → &Allocator<D>
//!              └ …                                      stats() per device, total_stats() summed
//!  record_history / dump_snapshot: every device's, in one pickle (segments' `device` = n,
//!                                  device_traces[n] = device n's history), as PyTorch's
//! ```

use crate::allocator::{AllocError, Allocator, HistoryOptions};
use crate::config::Config;
use crate::device::{Device, SimConfig, SimDevice};
use crate::stats::MemoryStats;
use crate::sync::Arc;

/// One allocator per device, indexed by the device's position (its ordinal).
///
/// ```
/// use tidepool::{Allocators, Config, StreamId};
///
/// let all = Allocators::sim(2, 1 << 30, Config::default()).unwrap();
/// let a = all.for_device(0).unwrap().alloc(4 << 20, StreamId::DEFAULT).unwrap();
/// let b = all.for_device(1).unwrap().alloc(8 << 20, StreamId::DEFAULT).unwrap();
/// assert_eq!(all.total_stats().blocks.allocated_bytes.all.current, 12 << 20);
/// assert!(all.for_device(2).is_err());
/// # drop((a, b));
/// ```
pub struct Allocators<D: Device> {
    allocators: Vec<Allocator<D>>,
}

impl<D: Device> Allocators<D> {
    /// An allocator with `config` over each device, in order: device `n` is `for_device(n)`.
    ///
    /// Positions are the registry's device numbers ([`Allocators::for_device`], the snapshot's
    /// `device_traces[n]`), whatever each device's own [`Device::ordinal`] (which an allocator's
    /// own [`Allocator::dump_snapshot`] stamps): give the devices in ordinal order from 0, as
    /// [`Allocators::sim`] and `Allocators::cuda` do, or the two disagree (a registry of GPU 1
    /// alone calls it device 0).
    pub fn new(
        devices: impl IntoIterator<Item = Arc<D>>,
        config: Config,
    ) -> Result<Allocators<D>, AllocError> {
        let allocators = devices
            .into_iter()
            .map(|d| Allocator::new(d, config.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Allocators { allocators })
    }

    /// The allocator of device `ordinal`; [`AllocError::UnknownDevice`] past the last one.
    pub fn for_device(&self, ordinal: usize) -> Result<&Allocator<D>, AllocError> {
        self.allocators
            .get(ordinal)
            .ok_or(AllocError::UnknownDevice { ordinal, count: self.allocators.len() })
    }

    /// How many devices.
    pub fn len(&self) -> usize {
        self.allocators.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.allocators.is_empty()
    }

    /// The allocators, device 0 first.
    pub fn iter(&self) -> impl Iterator<Item = &Allocator<D>> {
        self.allocators.iter()
    }

    /// Each device's statistics, device 0 first.
    pub fn stats(&self) -> Vec<MemoryStats> {
        self.allocators.iter().map(Allocator::stats).collect()
    }

    /// All devices' statistics summed ([`MemoryStats::accumulate`]: peaks are the sum of the
    /// per-device peaks).
    pub fn total_stats(&self) -> MemoryStats {
        let mut total = MemoryStats::default();
        for s in self.stats() {
            total.accumulate(&s);
        }
        total
    }

    /// Returns every device's unused cached memory ([`Allocator::empty_cache`]). A device whose
    /// release fails does not keep the others' caches: every device is emptied and the first
    /// error is returned.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let mut first = Ok(());
        for a in &self.allocators {
            if let Err(e) = a.empty_cache() {
                first = first.and(Err(e));
                // BROKEN (`registry_stops_at_error`): the devices after it keep their caches.
                if cfg!(tidepool_broken = "registry_stops_at_error") {
                    break;
                }
            }
        }
        first
    }

    /// Starts (or stops) recording every device's memory history
    /// ([`Allocator::record_history`]), as PyTorch's `_record_memory_history` does for every
    /// device.
    pub fn record_history(&self, options: HistoryOptions) {
        for a in &self.allocators {
            a.record_history(options.clone());
        }
    }

    /// Every device's snapshot in one pickle, as PyTorch's `torch.cuda.memory._snapshot()`
    /// holds every device: each segment and range mark with its device's index,
    /// `device_traces[n]` device `n`'s history, and device 0's settings (as `allocator_settings`;
    /// the allocators share their configuration). `tidepool replay` replays each device apart.
    ///
    /// ```
    /// use tidepool::{Allocators, Config, HistoryOptions, StreamId};
    ///
    /// let all = Allocators::sim(2, 1 << 30, Config::default()).unwrap();
    /// all.record_history(HistoryOptions::new(1000));
    /// drop(all.for_device(1).unwrap().alloc(4 << 20, StreamId::DEFAULT).unwrap());
    /// assert_eq!(all.for_device(0).unwrap().history().len(), 0); // device 1's work only
    /// assert_eq!(all.for_device(1).unwrap().history().len(), 4);
    /// let path = std::env::temp_dir().join(format!("tidepool-doc-{}.pickle", std::process::id()));
    /// all.dump_snapshot(&path).unwrap();
    /// let bytes = std::fs::read(&path).unwrap();
    /// assert_eq!(bytes, all.snapshot_pickle());
    /// assert!(bytes.starts_with(&[0x80, 2]) && bytes.ends_with(b".")); // a protocol-2 pickle
    /// # std::fs::remove_file(path).unwrap();
    /// ```
    pub fn snapshot_pickle(&self) -> Vec<u8> {
        let parts = self.allocators.iter().enumerate().map(|(n, a)| a.snapshot_part(n));
        let settings = self.allocators.first().map(Allocator::snapshot_settings);
        let settings = settings.unwrap_or_else(|| crate::pickle::Py::dict([]));
        crate::allocator::dump::pickle_of(parts.collect(), settings)
    }

    /// Writes [`Allocators::snapshot_pickle`] to `path`.
    pub fn dump_snapshot(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        std::fs::write(path, self.snapshot_pickle())
    }
}

impl Allocators<SimDevice> {
    /// `n` simulated devices of `capacity` bytes each, every one with its own streams, capacity
    /// and sanitizer.
    pub fn sim(
        n: usize,
        capacity: u64,
        config: Config,
    ) -> Result<Allocators<SimDevice>, AllocError> {
        let devices = (0..n).map(|ordinal| {
            let config = SimConfig { capacity, ..SimConfig::default() };
            Arc::new(SimDevice::with_config(config).with_ordinal(ordinal))
        });
        Allocators::new(devices, config)
    }
}

#[cfg(feature = "cuda")]
impl Allocators<crate::device::CudaDevice> {
    /// Every CUDA device of the machine, in ordinal order.
    pub fn cuda(config: Config) -> Result<Allocators<crate::device::CudaDevice>, AllocError> {
        let n = crate::device::CudaDevice::device_count()?;
        let devices = (0..n).map(crate::device::CudaDevice::new).collect::<Result<Vec<_>, _>>()?;
        Allocators::new(devices, config)
    }
}
