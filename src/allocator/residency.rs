//! Residency placement: where a persistent or a transient block goes, and what a new segment is.
//!
//! ```text
//!  request (residency r, stream s)
//!    ├─ small pool (≤ 1 MiB) ─▶ counted transient: both residencies share the stream's small
//!    │                          segments (or small range), and its stream caches
//!    └─ large pool
//!         ├─ ordinary segments ─▶ best fit over the free blocks of (r, s) and (other, s):
//!         │                       the smaller block wins, a tie goes to r
//!         └─ expandable ranges ─▶ r's own range only (a block there pins a page, not a segment;
//!                                 ranges kept after `expandable_segments` is turned off too)
//!  nothing fits ─▶ a new segment (or growth) keyed r
//!  a block is accounted, and cached once freed, by its segment's residency
//! ```
//!
//! Residency decides what a *segment* is, not where a block may sit: a segment reserved for a
//! persistent request is persistent — `empty_cache`, the garbage collection and the
//! out-of-memory ladder never release it, `release_persistent` does — and one reserved for a
//! transient request is recycled by them. A segment holding any live block (either residency)
//! is never released. Free space is shared: keeping the residencies apart left free space that
//! one residency could not use (the tails of the weights' 20 MiB segments, the activations'
//! freed memory when the optimizer state is made after backward), and cost up to 5.2 % over the
//! caching allocator on the shipped traces (`docs/eager-memory.md`); with shared free space the
//! placement is the caching allocator's and so is the peak. `Broken::ResidencySplit` restores
//! the split (`tests/scopes.rs` catches it).

use super::*;
use crate::config::MIN_ALIGN;
use crate::stats::PoolKind;

impl<D: Device> Shared<D> {
    /// Whether the two residencies share free space in the large pool: on ordinary segments
    /// (an expandable range keeps each residency's pages apart).
    /// (The device's answer is asked once: [`Shared::vm_supported`].)
    fn shares_large(&self, st: &mut State, config: &Config) -> bool {
        let over_ranges = config.expandable_segments && self.vm_supported(st);
        !(over_ranges || self.broken(Broken::ResidencySplit))
    }

    /// Whether requests are served by expandable ranges (asked for, and the device can).
    pub(super) fn over_ranges(&self, config: &Config) -> bool {
        config.expandable_segments && self.device.supports_virtual_memory()
    }

    /// The residency a request of `kind` is placed and accounted with: small-pool requests are
    /// transient (both residencies share the small segments).
    pub(super) fn placed_residency(
        &self,
        config: &Config,
        kind: PoolKind,
        residency: Residency,
    ) -> Residency {
        let split = self.broken(Broken::ResidencySplit) && !self.over_ranges(config);
        match kind {
            PoolKind::Small if !split => Residency::Transient,
            _ => residency,
        }
    }

    /// The residency a stream-cache lookup asks with (the caches hold small-pool blocks only,
    /// all counted transient; see [`Shared::placed_residency`]).
    #[inline]
    pub(super) fn cached_residency(&self, residency: Residency) -> Residency {
        match self.broken(Broken::ResidencySplit) {
            true => residency,
            false => Residency::Transient,
        }
    }

    /// The free block a request for `key` takes (`align` above [`crate::config::MIN_ALIGN`]:
    /// one that holds `rounded` bytes at an aligned address), if any: the best fit of `key`,
    /// or of the other residency's blocks of the same stream and pool where those are shared
    /// and offer a smaller block. See the module docs.
    #[inline(always)]
    pub(super) fn find_placed(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
        align: u64,
    ) -> Option<BlockId> {
        let own = self.find_aligned(st, config, key, rounded, align);
        let other = self.other_placed(st, config, key, rounded, align);
        match (own, other) {
            (Some(a), Some(b)) if st.pool.block(b).size < st.pool.block(a).size => Some(b),
            (Some(a), _) => Some(a),
            (None, b) => b,
        }
    }

    /// `key`'s best fit for `rounded` bytes at `align`.
    #[inline(always)]
    fn find_aligned(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
        align: u64,
    ) -> Option<BlockId> {
        match align > MIN_ALIGN {
            true => st.pool.find_free_aligned(key, rounded, align, &config.sizing),
            false => self.find_free(st, config, key, rounded),
        }
    }

    /// The other residency's block [`Shared::find_placed`] weighs against `key`'s own best
    /// fit (it wins where it is smaller): its best fit of the same stream's large pool where
    /// free space is shared, else none.
    #[inline(always)]
    pub(super) fn other_placed(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
        align: u64,
    ) -> Option<BlockId> {
        if key.kind != PoolKind::Large || !self.shares_large(st, config) {
            return None;
        }
        let residency = match key.residency {
            Residency::Persistent => Residency::Transient,
            Residency::Transient => Residency::Persistent,
        };
        let other_key = PoolKey { residency, ..key };
        if !st.pool.has_key(other_key) {
            return None; // the other residency never had a segment on this stream
        }
        // A range keeps each residency's pages apart whatever the configuration is now (ranges
        // made while `expandable_segments` was on stay after it is turned off).
        self.find_aligned(st, config, other_key, rounded, align).filter(|&b| {
            st.vm.is_empty()
                || !st.vm.contains(st.pool.block(b).addr)
                || self.broken(Broken::SharedRanges)
        })
    }
}
