//! `RequestPlan`: everything an allocation decides from the configuration, taken from *one*
//! configuration, so an allocation racing `set_config` follows either the old configuration or
//! the new one, never a mix.
//!
//! ```text
//!   set_config ──store──▶ ArcCell<Config> ──load (once)──▶ RequestPlan { config, rounded, kind, fast }
//!       │                                                   └─ the same `config` goes down the slow path
//!       └──(global lock)──▶ State::config ──(global lock held)──▶ RequestPlan::with
//! ```
//!
//! The slow path plans under the global lock from the locked state's copy of the configuration
//! (`set_config` replaces both under that lock, so they never differ while it is held): no load
//! of the swappable cell on the slow path.

use super::AllocError;
use crate::config::Config;
use crate::stats::PoolKind;
use crate::sync::{Arc, ArcCell, ArcRef};

/// An allocation's decisions from one configuration, held as `C` (a load of the swappable
/// cell, or the locked state's `Arc`). See the module docs.
pub struct RequestPlan<C = ArcRef<Config>> {
    /// The configuration they were made with (held for the whole allocation).
    pub config: C,
    /// The request rounded to its block size.
    pub rounded: u64,
    /// The pool that serves it.
    pub kind: PoolKind,
    /// Whether the stream caches may serve it without the global lock (small-pool requests).
    pub fast: bool,
}

impl RequestPlan {
    /// Plans a request of `bytes` (> 0) under the configuration in `cell` now (one load). The
    /// allocator plans under the global lock instead ([`RequestPlan::with`]); the loom model
    /// `config_swap_during_allocation` checks this one-load protocol.
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn new(cell: &ArcCell<Config>, bytes: u64) -> Result<RequestPlan, AllocError> {
        let config = cell.load();
        // (The error is built only on the error path: `ok_or` built and dropped it each time.)
        let Some(rounded) = config.sizing.round(bytes) else {
            return Err(AllocError::InvalidSize { requested: bytes });
        };
        #[cfg(tidepool_broken = "config")]
        let kind = cell.load().sizing.kind(rounded); // BROKEN: a second load may see another config.
        #[cfg(not(tidepool_broken = "config"))]
        let kind = config.sizing.kind(rounded);
        // The lane loop serves small-pool blocks; a large one is reused under the global lock
        // (`Shared::reuse_large`) where that is exactly the pool's best fit.
        let fast = config.fast_path() && kind == crate::stats::PoolKind::Small;
        Ok(RequestPlan { config, rounded, kind, fast })
    }
}

impl RequestPlan<Arc<Config>> {
    /// Plans a request of `bytes` (> 0) under `config`, which the caller holds as one value
    /// for the whole allocation.
    #[inline]
    pub fn with(config: Arc<Config>, bytes: u64) -> Result<RequestPlan<Arc<Config>>, AllocError> {
        // (The error is built only on the error path: `ok_or` built and dropped it each time.)
        let Some(rounded) = config.sizing.round(bytes) else {
            return Err(AllocError::InvalidSize { requested: bytes });
        };
        let kind = config.sizing.kind(rounded);
        let fast = config.fast_path() && kind == PoolKind::Small;
        Ok(RequestPlan { config, rounded, kind, fast })
    }
}
