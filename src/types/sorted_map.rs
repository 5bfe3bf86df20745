//! `SortedMap`: a map kept as one vector sorted by key, for small address tables on hot paths:
//! the expandable segments' (ranges by base address and by pool key, a range's runs by base
//! address) and the simulated device's virtual memory (ranges, mappings by address).
//!
//! ```text
//!  entries  [(k0, v0) (k1, v1) (k2, v2) …]    k0 < k1 < k2: lookups by binary search,
//!                                              first / last / ranges as slices
//! ```
//!
//! The allocator's tables hold a few entries (a range per stream, pool kind and residency; a run
//! per stretch of mapped pages, one while nothing was released), and the slow path reads them
//! on every search of an expandable pool and every growth; the device's mappings grow by one
//! per growth, almost always at the top. A vector answers those reads with a binary search and
//! no pointer chasing, and walks them with the slice code every other table uses, where a
//! `BTreeMap` brought its node code into the hot path (and out of the instruction cache).
//! Inserts and removals move the entries above them: a few words at the top, and a `memmove`
//! of the table at worst.

use std::ops::{Bound, RangeBounds};

/// Entries up to which a lookup scans rather than searches.
const SCAN_MAX: usize = 8;

/// A map sorted by key, as one vector. See the module docs.
#[derive(Clone, Debug)]
pub(crate) struct SortedMap<K, V> {
    entries: Vec<(K, V)>,
}

impl<K, V> Default for SortedMap<K, V> {
    fn default() -> Self {
        SortedMap { entries: Vec::new() }
    }
}

impl<K: Ord + Copy, V> SortedMap<K, V> {
    /// Where `k` is, or where it would go.
    #[inline]
    fn find(&self, k: &K) -> Result<usize, usize> {
        self.entries.binary_search_by(|(x, _)| x.cmp(k))
    }

    /// The index of `k`'s entry: a scan for equality in a table of a few entries (the
    /// allocator's range tables; no comparisons for order, no unpredictable halving), else a
    /// binary search.
    #[inline]
    fn position(&self, k: &K) -> Option<usize> {
        if self.entries.len() <= SCAN_MAX {
            self.entries.iter().position(|(x, _)| x == k)
        } else {
            self.find(k).ok()
        }
    }

    /// Inserts `v` at `k`; returns the value it replaces. A key above all others is pushed
    /// with no search (tables that grow at the top: a range's mappings, its runs).
    pub(crate) fn insert(&mut self, k: K, v: V) -> Option<V> {
        if self.entries.last().is_none_or(|(x, _)| *x < k) {
            self.entries.push((k, v));
            return None;
        }
        match self.find(&k) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, v)),
            Err(i) => {
                self.entries.insert(i, (k, v));
                None
            }
        }
    }

    /// Removes the entry at `k`.
    pub(crate) fn remove(&mut self, k: &K) -> Option<V> {
        self.find(k).ok().map(|i| self.entries.remove(i).1)
    }

    /// The value at `k`.
    #[inline]
    pub(crate) fn get(&self, k: &K) -> Option<&V> {
        self.position(k).map(|i| &self.entries[i].1)
    }

    /// The value at `k`, to change.
    #[inline]
    pub(crate) fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        self.position(k).map(|i| &mut self.entries[i].1)
    }

    /// Whether `k` has an entry.
    #[inline]
    pub(crate) fn contains_key(&self, k: &K) -> bool {
        self.position(k).is_some()
    }

    /// No entry.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries in key order.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &V)> + Clone {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    /// Keys in order.
    pub(crate) fn keys(&self) -> impl DoubleEndedIterator<Item = &K> + Clone {
        self.entries.iter().map(|(k, _)| k)
    }

    /// Values in key order.
    pub(crate) fn values(&self) -> impl DoubleEndedIterator<Item = &V> + Clone {
        self.entries.iter().map(|(_, v)| v)
    }

    /// The entry with the largest key.
    #[inline]
    pub(crate) fn last(&self) -> Option<(&K, &V)> {
        self.entries.last().map(|(k, v)| (k, v))
    }

    /// The entry with the largest key at or below `k`.
    #[inline]
    pub(crate) fn floor(&self, k: &K) -> Option<(&K, &V)> {
        if let Some((x, v)) = self.entries.last().filter(|(x, _)| x <= k) {
            return Some((x, v)); // at or above the top: no search
        }
        let i = self.entries.partition_point(|(x, _)| x <= k);
        i.checked_sub(1).map(|i| (&self.entries[i].0, &self.entries[i].1))
    }

    /// The entry with the largest key at or below `k`, its value to change.
    #[inline]
    pub(crate) fn floor_mut(&mut self, k: &K) -> Option<(&K, &mut V)> {
        let i = match self.entries.last() {
            Some((x, _)) if x <= k => self.entries.len(), // at or above the top: no search
            _ => self.entries.partition_point(|(x, _)| x <= k),
        };
        i.checked_sub(1).map(|i| {
            let (k, v) = &mut self.entries[i];
            (&*k, v)
        })
    }

    /// Entries whose keys lie in `r`, in key order.
    pub(crate) fn range(
        &self,
        r: impl RangeBounds<K>,
    ) -> impl DoubleEndedIterator<Item = (&K, &V)> + Clone {
        let lo = match r.start_bound() {
            Bound::Included(k) => self.entries.partition_point(|(x, _)| x < k),
            Bound::Excluded(k) => self.entries.partition_point(|(x, _)| x <= k),
            Bound::Unbounded => 0,
        };
        let hi = match r.end_bound() {
            Bound::Included(k) => self.entries.partition_point(|(x, _)| x <= k),
            Bound::Excluded(k) => self.entries.partition_point(|(x, _)| x < k),
            Bound::Unbounded => self.entries.len(),
        };
        self.entries[lo..hi.max(lo)].iter().map(|(k, v)| (k, v))
    }
}

impl<K: Ord + Copy, V> std::ops::Index<&K> for SortedMap<K, V> {
    type Output = V;

    #[inline]
    fn index(&self, k: &K) -> &V {
        self.get(k).expect("no entry for the key")
    }
}

#[cfg(test)]
mod tests {
    use super::SortedMap;
    use std::collections::BTreeMap;

    #[test]
    fn answers_as_a_btree_map_does() {
        let mut m = SortedMap::default();
        let mut b = BTreeMap::new();
        // A fixed pseudo-random sequence of inserts and removals over a small key space.
        let mut x = 0x2545_f491_u64;
        for step in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x % 40;
            if x.is_multiple_of(3) {
                assert_eq!(m.remove(&k), b.remove(&k), "remove {k} at step {step}");
            } else {
                assert_eq!(m.insert(k, step), b.insert(k, step), "insert {k} at step {step}");
            }
            assert_eq!(m.len(), b.len());
            assert_eq!(m.is_empty(), b.is_empty());
            assert_eq!(m.get(&k), b.get(&k));
            assert_eq!(m.contains_key(&(k + 1)), b.contains_key(&(k + 1)));
            assert_eq!(m.last(), b.last_key_value());
            let (lo, hi) = (x % 20, x % 20 + (x >> 8) % 25);
            assert!(m.range(lo..hi).eq(b.range(lo..hi)), "range {lo}..{hi}");
            assert!(m.range(..=lo).rev().eq(b.range(..=lo).rev()), "range ..={lo}");
            assert!(m.range(hi..).eq(b.range(hi..)), "range {hi}..");
            assert_eq!(m.floor(&lo), b.range(..=lo).next_back(), "floor {lo}");
            assert_eq!(
                m.floor_mut(&hi).map(|(k, v)| (*k, *v)),
                b.range(..=hi).next_back().map(|(k, v)| (*k, *v))
            );
        }
        assert!(m.iter().eq(b.iter()));
        assert!(m.keys().eq(b.keys()));
        assert!(m.values().eq(b.values()));
        if let Some((&k, _)) = b.iter().next() {
            *m.get_mut(&k).unwrap() = 7;
            assert_eq!(m[&k], 7);
        }
    }

    #[test]
    fn an_empty_or_inverted_range_is_empty() {
        let mut m = SortedMap::default();
        m.insert(5u64, ());
        m.insert(9, ());
        assert_eq!(m.range(7..7).count(), 0);
        assert_eq!(m.range(6..9).count(), 0);
        assert_eq!(m.range(5..=9).count(), 2);
        #[allow(clippy::reversed_empty_ranges)]
        let inverted = m.range(9..5).count();
        assert_eq!(inverted, 0);
    }
}
