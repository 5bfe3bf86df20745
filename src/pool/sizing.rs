//! Size rules: how requests are rounded, which pool serves them, how big a new segment is, and
//! when a block is split. The defaults are PyTorch's measured constants.
//!
//! ```text
//!  request ──round──▶ rounded ──┬─ ≤ small_size (1 MiB)        → small pool, 2 MiB segments
//!                               ├─ < min_large_alloc (10 MiB)  → large pool, 20 MiB segments
//!                               └─ otherwise                   → own segment, rounded to 2 MiB
//! ```

use super::divisions::RoundupDivisions;
#[cfg(test)]
use crate::types::KIB;
use crate::types::PoolKind;
pub use crate::types::{MAX_REQUEST, MIB};

/// Every request is rounded up to a multiple of this (PyTorch's `kMinBlockSize`).
pub const DEFAULT_MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served by the small pool (`kSmallSize`).
pub const DEFAULT_SMALL_SIZE: u64 = MIB;
/// Segment size of the small pool (`kSmallBuffer`).
pub const DEFAULT_SMALL_SEGMENT: u64 = 2 * MIB;
/// Segment size for requests between `small_size` and `min_large_alloc` (`kLargeBuffer`).
pub const DEFAULT_LARGE_SEGMENT: u64 = 20 * MIB;
/// Requests of at least this size get a segment of their own (`kMinLargeAlloc`).
pub const DEFAULT_MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Own segments are rounded up to a multiple of this (`kRoundLarge`).
pub const DEFAULT_ROUND_LARGE: u64 = 2 * MIB;
/// Default of [`Sizing::max_non_split_rounding`] (PyTorch's `kLargeBuffer`).
pub const DEFAULT_MAX_NON_SPLIT_ROUNDING: u64 = 20 * MIB;

/// The numeric size rules (PyTorch's constants by default). Every field is configurable through
/// [`crate::Config`] (its `TIDEPOOL_ALLOC_CONF` keys or [`crate::Config::with_sizing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sizing {
    /// Rounding granularity and smallest block (power of two).
    pub min_block_size: u64,
    /// Largest request of the small pool.
    pub small_size: u64,
    /// Segment size of the small pool.
    pub small_segment: u64,
    /// Segment size of the large pool for mid-sized requests.
    pub large_segment: u64,
    /// Requests of at least this size get their own segment.
    pub min_large_alloc: u64,
    /// Own segments are rounded up to a multiple of this.
    pub round_large: u64,
    /// Blocks of at least this size are never split, and never spent on a smaller request.
    /// `u64::MAX` (the default) means no limit.
    pub max_split_size: u64,
    /// Round requests above `min_block_size × divisions` to one of `divisions` steps between
    /// powers of two (0 or 1: off), `divisions` chosen per power-of-two size interval.
    pub roundup_power2_divisions: RoundupDivisions,
    /// An oversized block (≥ `max_split_size`) serves a large request only if it exceeds it by
    /// less than this (PyTorch's `max_non_split_rounding_mb`; default 20 MiB).
    pub max_non_split_rounding: u64,
}

impl Default for Sizing {
    fn default() -> Self {
        Sizing {
            min_block_size: DEFAULT_MIN_BLOCK_SIZE,
            small_size: DEFAULT_SMALL_SIZE,
            small_segment: DEFAULT_SMALL_SEGMENT,
            large_segment: DEFAULT_LARGE_SEGMENT,
            min_large_alloc: DEFAULT_MIN_LARGE_ALLOC,
            round_large: DEFAULT_ROUND_LARGE,
            max_split_size: u64::MAX,
            roundup_power2_divisions: RoundupDivisions::OFF,
            max_non_split_rounding: DEFAULT_MAX_NON_SPLIT_ROUNDING,
        }
    }
}

impl Sizing {
    /// Rounds a request up to its block size; `None` when the request exceeds [`MAX_REQUEST`].
    ///
    /// ```text
    /// let s = Sizing::default();
    /// assert_eq!(s.round(1), Some(512));
    /// assert_eq!(s.round(513), Some(1024));
    /// let p2 = Sizing { roundup_power2_divisions: RoundupDivisions::uniform(4).unwrap(), ..Sizing::default() };
    /// assert_eq!(p2.round(1_200_000), Some(1_310_720)); // 1 MiB + 1/4 MiB
    /// ```
    #[inline]
    pub fn round(&self, bytes: u64) -> Option<u64> {
        if bytes > MAX_REQUEST {
            return None;
        }
        if bytes <= self.min_block_size {
            return Some(self.min_block_size);
        }
        let div = self.roundup_power2_divisions.for_size(bytes);
        if div > 1 && bytes > self.min_block_size.saturating_mul(div) {
            return Some(round_power2_division(bytes, div));
        }
        let m = self.min_block_size;
        if m.is_power_of_two() {
            // No division on the hot path (validated configurations always take this branch).
            return Some((bytes + m - 1) & !(m - 1));
        }
        Some(bytes.div_ceil(m) * m)
    }

    /// The pool a rounded request belongs to.
    pub fn kind(&self, rounded: u64) -> PoolKind {
        if rounded <= self.small_size { PoolKind::Small } else { PoolKind::Large }
    }

    /// Size of a new segment for a rounded request (PyTorch's `get_allocation_size`).
    pub fn segment_size(&self, rounded: u64) -> u64 {
        if rounded <= self.small_size {
            self.small_segment
        } else if rounded < self.min_large_alloc {
            self.large_segment
        } else {
            rounded.div_ceil(self.round_large) * self.round_large
        }
    }

    /// Whether a free block of `block` bytes serving `rounded` bytes leaves a remainder worth
    /// splitting off: ≥ `min_block_size` in the small pool; in the large pool only when the request
    /// is below `max_split_size` and the remainder exceeds `small_size`.
    pub fn should_split(&self, kind: PoolKind, block: u64, rounded: u64) -> bool {
        let remaining = block - rounded;
        match kind {
            PoolKind::Small => remaining >= self.min_block_size,
            PoolKind::Large => rounded < self.max_split_size && remaining > self.small_size,
        }
    }

    /// Whether a cached free block of `block` bytes may serve a request of `rounded` bytes: an
    /// oversized block (≥ `max_split_size`) is not spent on a smaller request, nor on a large one it
    /// exceeds by `max_non_split_rounding` or more.
    pub fn may_serve(&self, block: u64, rounded: u64) -> bool {
        if rounded < self.max_split_size {
            block < self.max_split_size
        } else {
            block < rounded.saturating_add(self.max_non_split_rounding)
        }
    }
}

/// Rounds `bytes` up to the next of `divisions` equal steps between two powers of two.
fn round_power2_division(bytes: u64, divisions: u64) -> u64 {
    if bytes.is_power_of_two() {
        return bytes;
    }
    let floor = 1u64 << (63 - bytes.leading_zeros());
    let step = floor / divisions;
    if step == 0 {
        return floor << 1;
    }
    let down = bytes & !(step - 1);
    if down == bytes { bytes } else { down + step }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_to_block_size() {
        let s = Sizing::default();
        assert_eq!(s.round(0), Some(512));
        assert_eq!(s.round(512), Some(512));
        assert_eq!(s.round(513), Some(1024));
        assert_eq!(s.round(MIB + 1), Some(MIB + 512));
        assert_eq!(s.round(MAX_REQUEST), Some(MAX_REQUEST));
        assert_eq!(s.round(MAX_REQUEST + 1), None);
        assert_eq!(s.round(u64::MAX), None);
    }

    #[test]
    fn rounding_power2_divisions() {
        let four = RoundupDivisions::uniform(4).unwrap();
        let s = Sizing { roundup_power2_divisions: four, ..Sizing::default() };
        // 1 MiB..2 MiB in steps of 256 KiB.
        assert_eq!(s.round(MIB + 1), Some(MIB + 256 * KIB));
        assert_eq!(s.round(MIB + 256 * KIB), Some(MIB + 256 * KIB));
        assert_eq!(s.round(2 * MIB - 1), Some(2 * MIB));
        assert_eq!(s.round(2 * MIB), Some(2 * MIB));
        // At or below min_block_size × divisions (2 KiB), plain 512 B rounding applies.
        assert_eq!(s.round(1500), Some(1536));
        assert_eq!(s.round(2049), Some(2560));
        let eight = RoundupDivisions::uniform(8).unwrap();
        let s8 = Sizing { roundup_power2_divisions: eight, ..Sizing::default() };
        assert_eq!(s8.round(5 * MIB + 1), Some(5 * MIB + 512 * KIB));
    }

    /// Per-interval divisions, as PyTorch's `test_cuda` checks them (`power2_div(nbytes, 8)` for
    /// an 84 MiB tensor under `[64:8,...]`, `power2_div(nbytes_big, 2)` for 400 MiB under
    /// `256:2`), and Unsloth's default with 256 divisions.
    #[test]
    fn rounding_per_interval() {
        let d = RoundupDivisions::parse("[64:8,128:2,256:2,512:2,1024:1,>:1]").unwrap();
        let s = Sizing { roundup_power2_divisions: d, ..Sizing::default() };
        // 84 MiB: 64 MiB..128 MiB in steps of 8 MiB → 88 MiB.
        assert_eq!(s.round(84 * MIB), Some(88 * MIB));
        // 400 MiB: 256 MiB..512 MiB in 2 steps → 512 MiB.
        assert_eq!(s.round(400 * MIB), Some(512 * MIB));
        // 1 GiB..: one division, plain granule rounding.
        assert_eq!(s.round(1500 * MIB + 1), Some(1500 * MIB + 512));
        // Below the first key: 8 divisions (3 MiB → 2 MiB..4 MiB in 256 KiB steps).
        assert_eq!(s.round(3 * MIB + 1), Some(3 * MIB + 256 * KIB));
        let unsloth = RoundupDivisions::parse("[32:256,64:128,256:64,>:32]").unwrap();
        let s = Sizing { roundup_power2_divisions: unsloth, ..Sizing::default() };
        // 256 divisions apply above 512 B × 256 = 128 KiB: 200 KiB in 128 KiB..256 KiB → 512 B steps.
        assert_eq!(s.round(200 * KIB + 1), Some(200 * KIB + 512));
        // 1 MiB + 1 in 1 MiB..2 MiB: steps of 4 KiB.
        assert_eq!(s.round(MIB + 1), Some(MIB + 4 * KIB));
        // 100 MiB + 1 in 64 MiB..128 MiB with 128 divisions: steps of 512 KiB.
        assert_eq!(s.round(100 * MIB + 1), Some(100 * MIB + 512 * KIB));
        // 200 MiB + 1 in 128 MiB..256 MiB: not named, granule rounding.
        assert_eq!(s.round(200 * MIB + 1), Some(200 * MIB + 512));
        // Huge division counts never overflow the threshold.
        let max = RoundupDivisions::uniform(super::super::divisions::MAX_DIVISIONS).unwrap();
        let s = Sizing { roundup_power2_divisions: max, ..Sizing::default() };
        assert_eq!(s.round(3 * MIB + 1), Some(3 * MIB + 512));
    }

    #[test]
    fn pools_and_segment_sizes() {
        let s = Sizing::default();
        assert_eq!(s.kind(MIB), PoolKind::Small);
        assert_eq!(s.kind(MIB + 512), PoolKind::Large);
        assert_eq!(s.segment_size(512), 2 * MIB);
        assert_eq!(s.segment_size(MIB), 2 * MIB);
        assert_eq!(s.segment_size(MIB + 512), 20 * MIB);
        assert_eq!(s.segment_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(s.segment_size(10 * MIB), 10 * MIB);
        assert_eq!(s.segment_size(10 * MIB + 512), 12 * MIB);
        assert_eq!(s.segment_size(11 * MIB), 12 * MIB);
    }

    #[test]
    fn split_rules() {
        let s = Sizing::default();
        assert!(s.should_split(PoolKind::Small, 2 * MIB, 2 * MIB - 512));
        assert!(!s.should_split(PoolKind::Small, 1024, 1024));
        // Large: the remainder must exceed 1 MiB.
        assert!(!s.should_split(PoolKind::Large, 3 * MIB, 2 * MIB));
        assert!(s.should_split(PoolKind::Large, 3 * MIB + 512, 2 * MIB));
        let capped = Sizing { max_split_size: 64 * MIB, ..Sizing::default() };
        assert!(!capped.should_split(PoolKind::Large, 200 * MIB, 64 * MIB));
        assert!(capped.should_split(PoolKind::Large, 200 * MIB, 63 * MIB));
    }

    #[test]
    fn oversized_blocks_are_kept_for_large_requests() {
        let s = Sizing { max_split_size: 64 * MIB, ..Sizing::default() };
        assert!(s.may_serve(63 * MIB, 2 * MIB));
        assert!(!s.may_serve(64 * MIB, 2 * MIB));
        assert!(s.may_serve(80 * MIB, 64 * MIB));
        assert!(!s.may_serve(84 * MIB, 64 * MIB));
        assert!(Sizing::default().may_serve(u64::MAX - 1, 512));
        // max_non_split_rounding widens what an oversized block may serve.
        let wide = Sizing { max_non_split_rounding: 30 * MIB, ..s };
        assert!(wide.may_serve(93 * MIB, 64 * MIB));
        assert!(!wide.may_serve(94 * MIB, 64 * MIB));
    }
}
