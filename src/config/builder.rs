//! [`Config`]'s builder methods (`with_*`), and what the allocator derives from a configuration
//! (the byte limit in force, the garbage collection's threshold, a private pool's copy).

use super::{Config, CrossStream};
use crate::pool::{MIB, RoundupDivisions, Sizing};

impl Config {
    /// With these size rules (see [`Sizing`]). [`Config::validate`] (or [`crate::Allocator::new`])
    /// checks that they fit together.
    pub fn with_sizing(mut self, sizing: Sizing) -> Config {
        self.sizing = sizing;
        self
    }

    /// Blocks of at least `mib` MiB are never split (`max_split_size_mb`).
    pub fn with_max_split_size_mb(mut self, mib: u64) -> Config {
        self.sizing.max_split_size = mib.saturating_mul(MIB);
        self
    }

    /// Rounds sizes to `divisions` steps between powers of two (`roundup_power2_divisions`).
    pub fn with_roundup_power2_divisions(mut self, divisions: RoundupDivisions) -> Config {
        self.sizing.roundup_power2_divisions = divisions;
        self
    }

    /// Never reserve more than `bytes` in all (`memory_limit_mb`, in bytes here).
    pub fn with_memory_limit(mut self, bytes: u64) -> Config {
        self.memory_limit = Some(bytes);
        self
    }

    /// Never reserve more than this share of the device (`per_process_memory_fraction`).
    pub fn with_memory_fraction(mut self, fraction: f64) -> Config {
        self.memory_fraction = Some(fraction);
        self
    }

    /// The cross-stream reuse policy (`cross_stream`).
    pub fn with_cross_stream(mut self, policy: CrossStream) -> Config {
        self.cross_stream = policy;
        self
    }

    /// Per-stream caches on or off (`fast_cache`).
    pub fn with_fast_cache(mut self, on: bool) -> Config {
        self.fast_cache = on;
        self
    }

    /// Blocks a stream may cache per size class (`fast_cache_entries`).
    pub fn with_fast_cache_entries(mut self, entries: usize) -> Config {
        self.fast_cache_entries = entries;
        self
    }

    /// Bytes of small blocks a stream cache lane may hold, and the most a large block it
    /// holds may have besides (`fast_cache_bytes_mb`, in bytes here).
    pub fn with_fast_cache_bytes(mut self, bytes: u64) -> Config {
        self.fast_cache_bytes = bytes;
        self
    }

    /// Everything under one mutex, PyTorch's design (`global_lock`).
    pub fn with_global_lock(mut self, on: bool) -> Config {
        self.global_lock = on;
        self
    }

    /// Per-stream cache locks biased towards their thread, or always a compare-and-swap
    /// (`biased_lanes`).
    pub fn with_biased_lanes(mut self, on: bool) -> Config {
        self.biased_lanes = on;
        self
    }

    /// Expandable segments on or off (`expandable_segments`).
    pub fn with_expandable_segments(mut self, on: bool) -> Config {
        self.expandable_segments = on;
        self
    }

    /// The free mapped bytes a transient expandable range keeps (`release_threshold_mb`, in bytes
    /// here; `u64::MAX`: no limit).
    pub fn with_release_threshold(mut self, bytes: u64) -> Config {
        self.release_threshold = bytes;
        self
    }

    /// PyTorch's `garbage_collection_threshold` (`garbage_collection_threshold`; it needs a cap).
    pub fn with_garbage_collection_threshold(mut self, fraction: f64) -> Config {
        self.garbage_collection_threshold = Some(fraction);
        self
    }

    /// Reserve `bytes` up front and keep them (`initial_pool_size_mb`, in bytes here; rounded up
    /// to the block granularity).
    pub fn with_initial_pool_size(mut self, bytes: u64) -> Config {
        self.initial_pool_size = bytes;
        self
    }

    /// Never reserve more than `bytes` (`max_pool_size_mb`, in bytes here).
    pub fn with_max_pool_size(mut self, bytes: u64) -> Config {
        self.max_pool_size = Some(bytes);
        self
    }

    /// Caching on or off (`caching`; off: every allocation and free goes to the device).
    pub fn with_caching(mut self, on: bool) -> Config {
        self.caching = on;
        self
    }

    /// Refuse reservations past the cap at once (`throw_on_cudamalloc_oom`, see
    /// [`Config::throw_on_oom`]).
    pub fn with_throw_on_oom(mut self, on: bool) -> Config {
        self.throw_on_oom = on;
        self
    }

    /// This configuration for a private pool of an allocator configured with it: the same,
    /// with no initial pool (the general allocator's is the only one).
    pub(crate) fn for_pool(mut self) -> Config {
        self.initial_pool_size = 0;
        self
    }

    /// Whether allocations and frees may use the per-stream caches.
    pub(crate) fn fast_path(&self) -> bool {
        self.fast_cache && !self.global_lock && self.caching
    }

    /// The byte limit in force on a device of `total` bytes: the smallest of `memory_limit`,
    /// `memory_fraction × total` and `max_pool_size`, if any is set.
    pub fn limit(&self, total: u64) -> Option<u64> {
        let frac = self.memory_fraction.map(|f| (total as f64 * f) as u64);
        [self.memory_limit, frac, self.max_pool_size].into_iter().flatten().min()
    }

    /// The reserved bytes past which the garbage collection releases idle cached segments:
    /// `garbage_collection_threshold × limit` when a cap is set, else × the device's `total`
    /// memory (as PyTorch documents it: a share of the memory the process may use).
    pub fn gc_limit(&self, total: u64) -> Option<u64> {
        let t = self.garbage_collection_threshold?;
        Some((self.limit(total).unwrap_or(total) as f64 * t) as u64)
    }
}
