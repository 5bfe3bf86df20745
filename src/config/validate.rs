//! [`Config::validate`]: the rules a configuration keeps whichever way it was made.

use super::{Config, ConfigError, MIN_ALIGN};
use crate::pool::{DEFAULT_MAX_NON_SPLIT_ROUNDING, MIB};

impl Config {
    /// Checks that the size rules fit together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let z = &self.sizing;
        let fail = |why: String| Err(ConfigError::Inconsistent(why));
        // What the string form caps (sizes in MiB up to 256 TiB), for the builders too: sizes
        // past the largest request overflowed the allocator's sums (`alloc_aligned` adds the
        // alignment to the rounded size; a block of 2^63 bytes with as large an alignment
        // wrapped, and panicked in debug builds).
        // BROKEN (`sizing_unbounded`): any size accepted.
        let sizes = [
            ("min_block_size", z.min_block_size),
            ("small_size_mb", z.small_size),
            ("small_segment_mb", z.small_segment),
            ("min_large_alloc_mb", z.min_large_alloc),
            ("large_segment_mb", z.large_segment),
            ("round_large_mb", z.round_large),
        ];
        if let Some((name, v)) = sizes.iter().find(|(_, v)| *v > crate::MAX_REQUEST)
            && !cfg!(tidepool_broken = "sizing_unbounded")
        {
            return fail(format!(
                "{name} ({v} bytes) exceeds the largest request ({} bytes)",
                crate::MAX_REQUEST
            ));
        }
        if !z.min_block_size.is_power_of_two() {
            return fail(format!("min_block_size {} is not a power of two", z.min_block_size));
        }
        if z.min_block_size < MIN_ALIGN {
            return fail(format!(
                "min_block_size {} is below {MIN_ALIGN} bytes: every pointer handed out must stay \
                 {MIN_ALIGN}-byte aligned, as CUDA's and RMM's are",
                z.min_block_size
            ));
        }
        if z.small_size < z.min_block_size || !z.small_size.is_multiple_of(z.min_block_size) {
            return fail("small_size_mb must be a multiple of min_block_size".into());
        }
        if z.small_segment < z.small_size {
            return fail("small_segment_mb must be at least small_size_mb".into());
        }
        if z.min_large_alloc <= z.small_size {
            return fail("min_large_alloc_mb must exceed small_size_mb".into());
        }
        if z.large_segment < z.min_large_alloc {
            return fail("large_segment_mb must be at least min_large_alloc_mb".into());
        }
        // 0 is a multiple of everything: the own segments' rounding would divide by it.
        // BROKEN (`round_large_zero`): a zero rounding accepted (a large request panics).
        if z.round_large == 0 && !cfg!(tidepool_broken = "round_large_zero") {
            return fail("round_large_mb must be at least 1 MiB (got 0 bytes)".into());
        }
        if !z.round_large.is_multiple_of(z.min_block_size) {
            return fail("round_large_mb must be a multiple of min_block_size".into());
        }
        // PyTorch's `parseMaxSplitSize`: at least the large segment size (older releases
        // wanted more than it).
        if z.max_split_size != u64::MAX && z.max_split_size < z.large_segment {
            return fail(format!(
                "max_split_size_mb ({} MiB) must be at least large_segment_mb ({} MiB)",
                z.max_split_size / MIB,
                z.large_segment / MIB
            ));
        }
        // What the string form wants of `max_non_split_rounding_mb` (PyTorch's floor: the
        // large segment size, 20 MiB unless `large_segment_size_mb` lowers it), for the builders
        // too: a rounding of 0 let no oversize block serve even a request of its own size.
        // BROKEN (`non_split_rounding_unchecked`): any rounding accepted.
        let floor = DEFAULT_MAX_NON_SPLIT_ROUNDING.min(z.large_segment);
        if z.max_non_split_rounding < floor
            && !cfg!(tidepool_broken = "non_split_rounding_unchecked")
        {
            return fail(format!(
                "max_non_split_rounding_mb ({}) must be at least {} (the smaller of 20 MiB and \
                 large_segment_mb, as the string form wants)",
                mib_or_bytes(z.max_non_split_rounding),
                mib_or_bytes(floor)
            ));
        }
        if self.fast_cache_entries == 0 {
            return fail("fast_cache_entries must be at least 1".into());
        }
        if let Some(t) = self.garbage_collection_threshold
            && !(t > 0.0 && t < 1.0)
        {
            return fail(format!("garbage_collection_threshold {t} is not in (0, 1)"));
        }
        if let Some(f) = self.memory_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return fail(format!("per_process_memory_fraction {f} is not in [0, 1]"));
        }
        // What the string form caps (`initial_pool_size_mb` ≤ 256 TiB): the reservation is
        // rounded up to a block, which must not overflow.
        // BROKEN (`initial_pool_unbounded`): any size accepted (`u64::MAX` overflows).
        if self.initial_pool_size > crate::MAX_REQUEST
            && !cfg!(tidepool_broken = "initial_pool_unbounded")
        {
            return fail(format!(
                "initial_pool_size_mb ({} bytes) exceeds the largest request ({} bytes)",
                self.initial_pool_size,
                crate::MAX_REQUEST
            ));
        }
        // The initial pool is reserved rounded up to a block (`reserve_initial_pool`): that is
        // what a cap must hold, or a pool the check let through fails `Allocator::new` as "out
        // of memory" on an empty device. Sizes not in whole MiB (the builders take bytes) are
        // named in bytes.
        // BROKEN (`initial_pool_unrounded_check`): the size as asked is checked.
        let initial = if cfg!(tidepool_broken = "initial_pool_unrounded_check") {
            self.initial_pool_size
        } else {
            self.initial_pool_size.next_multiple_of(z.min_block_size)
        };
        for (name, cap) in
            [("max_pool_size_mb", self.max_pool_size), ("memory_limit_mb", self.memory_limit)]
        {
            if let Some(cap) = cap
                && initial > cap
            {
                let asked = self.initial_pool_size;
                let whole_mib = initial == asked && asked.is_multiple_of(MIB);
                let why = if whole_mib && cap.is_multiple_of(MIB) {
                    format!(
                        "initial_pool_size_mb ({} MiB) exceeds {name} ({} MiB)",
                        asked / MIB,
                        cap / MIB
                    )
                } else {
                    let block = z.min_block_size;
                    format!(
                        "initial_pool_size_mb ({asked} bytes, reserved as {initial} bytes: whole \
                         blocks of {block} bytes) exceeds {name} ({cap} bytes)"
                    )
                };
                return fail(why);
            }
        }
        // The initial pool is one block until a request splits it; one of at least
        // `max_split_size` is oversize (never split, never spent on a smaller request) and is
        // kept for good, so it would stand idle while every request reserved memory of its own.
        // BROKEN (`initial_pool_oversize`): accepted.
        if self.initial_pool_size > 0
            && initial >= z.max_split_size
            && !cfg!(tidepool_broken = "initial_pool_oversize")
        {
            return fail(format!(
                "initial_pool_size_mb ({}) must be below max_split_size_mb ({}): {}",
                mib_or_bytes(self.initial_pool_size),
                mib_or_bytes(z.max_split_size),
                INITIAL_POOL_OVERSIZE
            ));
        }
        if !self.caching {
            let on = [
                (self.expandable_segments, "expandable_segments"),
                (self.initial_pool_size > 0, "initial_pool_size_mb"),
                (self.garbage_collection_threshold.is_some(), "garbage_collection_threshold"),
            ];
            if let Some((_, key)) = on.iter().find(|(on, _)| *on) {
                return fail(format!(
                    "caching:false (every free returns its memory to the device) cannot be combined with {key}"
                ));
            }
        }
        Ok(())
    }
}

/// Why an initial pool of at least `max_split_size` is refused (by [`Config::validate`], and by
/// `Allocator::set_config` for the pool an allocator keeps).
pub(crate) const INITIAL_POOL_OVERSIZE: &str = "a block of at least max_split_size is never \
     split, so the initial pool would serve no smaller request";

/// `N MiB` for a whole number of MiB, else `N bytes`.
pub(crate) fn mib_or_bytes(bytes: u64) -> String {
    match bytes.is_multiple_of(MIB) {
        true => format!("{} MiB", bytes / MIB),
        false => format!("{bytes} bytes"),
    }
}
