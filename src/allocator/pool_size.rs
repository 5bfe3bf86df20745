//! The initial pool (`initial_pool_size_mb`, RMM's `initial_pool_size`): one segment reserved
//! when the allocator is made, a transient large-pool segment of the default stream, served
//! from like any other (split and coalesced as usual) and kept until the allocator goes:
//! `empty_cache`, the garbage collection and the out-of-memory ladder leave it. The maximum
//! (`max_pool_size_mb`) is a cap on reserved bytes, enforced where segments are reserved
//! ([`Config::limit`]).
//!
//! ```text
//!  Allocator::new ─▶ reserve(initial) ─▶ pool: [ free ··········· initial ··········· ]
//!  alloc(4 MiB)   ─▶ best fit          ─▶ pool: [ 4 MiB ][ free ····················· ]
//! ```
//!
//! The caps (`memory_limit_mb`, `per_process_memory_fraction`, `max_pool_size_mb`) hold for
//! the general allocator and its private pools *together*, as PyTorch's
//! `allowed_memory_maximum` holds for every pool of a device: each allocator counts its
//! reserved bytes into the family's total as it lets go of its lock (`count_in_family`), and
//! a check charges what it is about to reserve with a compare-and-swap on that total
//! (`within_limit`), so two allocators reserving at once cannot both pass on the same room.
//!
//! ```text
//!  Family::reserved ══ Σ family_share        family_share = reserved bytes last counted in
//!  within_limit(add): count own change in ─▶ CAS total + add ≤ limit ─▶ family_share += add
//!  every section's end: total += reserved − family_share  (a refused or rolled-back
//!                       reservation is taken back here, a growth's real size put in)
//! ```

use super::*;
use crate::config::ConfigError;
use crate::stats::PoolKind;

impl<D: Device> Allocator<D> {
    /// Reserves the initial pool, if one is configured. A device that cannot hold it fails
    /// [`Allocator::new`] with the device's error (out of memory: the report).
    pub(super) fn reserve_initial_pool(&self) -> Result<(), AllocError> {
        let sh = &self.shared;
        let config = sh.config.load_full();
        let bytes = config.initial_pool_size;
        if bytes == 0 {
            return Ok(());
        }
        let size = bytes.next_multiple_of(config.sizing.min_block_size);
        let key = PoolKey {
            residency: Residency::Transient,
            stream: StreamId::DEFAULT,
            kind: PoolKind::Large,
        };
        let mut st = sh.lock_state();
        sh.check_stream(&mut st, StreamId::DEFAULT)?;
        match sh.reserve(&mut st, &config, key, size) {
            Ok(block) => {
                let base = st.pool.block(block).addr;
                st.initial = Some(base);
                Ok(())
            }
            Err(AllocError::OutOfMemory(_)) => {
                let report = sh.oom_report(&st, &config, key, size, size, size);
                Err(AllocError::OutOfMemory(Box::new(report)))
            }
            Err(e) => Err(e),
        }
    }
}

impl<D: Device> Shared<D> {
    /// [`Allocator::set_config`]'s check of `config` against the initial pool this allocator
    /// keeps: a `max_split_size` at or below its size would make it an oversize block, never
    /// split and never spent on a smaller request, idle for good (as `Config::validate`
    /// refuses for a configuration's own initial pool).
    pub(super) fn keeps_initial_pool_under(&self, config: &Config) -> Result<(), ConfigError> {
        let st = self.lock_state();
        let Some(base) = st.initial else { return Ok(()) };
        let size = st.pool.segments().find(|(_, s)| s.base == base).map_or(0, |(_, s)| s.size);
        let split = config.sizing.max_split_size;
        // BROKEN (`initial_pool_oversize`): accepted.
        if size < split || cfg!(tidepool_broken = "initial_pool_oversize") {
            return Ok(());
        }
        Err(ConfigError::Inconsistent(format!(
            "max_split_size_mb ({}) must exceed the initial pool this allocator keeps ({}): {}",
            crate::config::mib_or_bytes(split),
            crate::config::mib_or_bytes(size),
            crate::config::INITIAL_POOL_OVERSIZE
        )))
    }

    /// Whether `add` more reserved bytes keep the family within `config`'s cap (always, with
    /// none); where they do, they are charged to the family's total at once, so that another
    /// allocator's check sees them before this one reserves them. The caller holds the lock
    /// and reserves (or fails and rolls back) before letting go of it.
    #[cfg_attr(tidepool_broken = "cap_check", allow(unreachable_code, unused_mut))]
    pub(super) fn within_limit(&self, st: &mut State, config: &Config, add: u64) -> bool {
        let Some(limit) = config.limit(self.device_total) else {
            return true;
        };
        if self.broken(Broken::LimitPerPool) {
            // BROKEN: each allocator of the family gets the whole cap to itself.
            return st.pool.reserved_bytes() + add <= limit;
        }
        let total = &self.family.reserved;
        let mut now = self.family_reserved(st);
        #[cfg(tidepool_broken = "cap_check")]
        {
            // BROKEN (loom): check, then add — two allocators can both pass on the same room.
            if now.saturating_add(add) > limit {
                return false;
            }
            total.fetch_add(add, Ordering::AcqRel);
            st.family_share += add;
            return true;
        }
        loop {
            if now.saturating_add(add) > limit {
                return false;
            }
            match total.compare_exchange_weak(now, now + add, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(seen) => now = seen,
            }
        }
        st.family_share += add;
        true
    }

    /// The family's reserved bytes, this allocator's own counted in first: what the caps and
    /// the garbage collection's threshold compare with. The caller holds the lock.
    pub(super) fn family_reserved(&self, st: &mut State) -> u64 {
        self.count_in_family(st);
        self.family.reserved.load(Ordering::Acquire)
    }

    /// Brings this allocator's share of the family's total to its reserved bytes. The caller
    /// holds the lock.
    #[inline(always)]
    pub(super) fn count_in_family(&self, st: &mut State) {
        let now = st.pool.reserved_bytes();
        if now != st.family_share {
            self.count_in_family_now(st, now);
        }
    }

    /// [`Shared::count_in_family`] where the reserved bytes moved (out of line).
    #[cold]
    #[inline(never)]
    fn count_in_family_now(&self, st: &mut State, now: u64) {
        let share = st.family_share;
        let total = &self.family.reserved;
        match now > share {
            true => total.fetch_add(now - share, Ordering::AcqRel),
            false => total.fetch_sub(share - now, Ordering::AcqRel),
        };
        st.family_share = now;
    }
}
