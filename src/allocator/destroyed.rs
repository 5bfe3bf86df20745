//! The streams an allocator family destroyed, kept as runs of consecutive ids.
//!
//! [`Shared::gone_drained`](super::Shared) asks whether a stream the device no longer knows
//! was destroyed through the family (drained, nothing of its work left) for as long as
//! anything of the stream may be asked about — a buffer that outlived it, a block with uses
//! on it — so the record is kept for good. Both devices number streams from a counter that
//! never goes back, so a program that makes a stream per request and destroys it through the
//! allocator destroys ids in (nearly) increasing order: kept as runs, its record stays a few
//! entries however many streams it goes through, where a map of ids grew by ~39 B a stream.
//!
//! ```text
//!  destroyed ids 3 4 5 _ 7 8 (6 alive; 7, 8 by the general allocator, FAMILY_WIDE)
//!  runs: BTreeMap { 3: (last 5, by W), 7: (last 8, by W) }   destroy 6 ─▶ { 3: (last 8, by W) }
//! ```
//!
//! A run is `first → (last, by)`: ids `first..=last`, each destroyed by pool `by`. Runs never
//! overlap, and two runs that touch have different `by` (else they are one). What is left
//! unbounded: ids destroyed by another family, or alive for good, between ours are gaps, so
//! two independent allocators that destroy interleaved streams keep a run per stream each.

use std::collections::BTreeMap;

use crate::types::StreamId;

/// Runs of destroyed stream ids. See the module docs.
#[derive(Default, Debug)]
pub(super) struct DestroyedStreams {
    /// `first → (last, by)`: ids `first..=last` destroyed by pool `by`.
    runs: BTreeMap<u32, (u32, u64)>,
    /// One entry per id, never merged: the record as it was (`Broken::DestroyedStreamsPerId`).
    per_id: bool,
}

impl DestroyedStreams {
    /// Keeps one run per id, as the map of ids did (a deliberate bug, for tests).
    #[cfg(feature = "test-hooks")]
    pub(super) fn set_per_id(&mut self, on: bool) {
        self.per_id = on;
    }

    /// Notes that pool `by` destroyed `stream` (a later note of the same id replaces `by`).
    pub(super) fn insert(&mut self, stream: StreamId, by: u64) {
        let id = stream.0;
        if self.by(stream) == Some(by) {
            return;
        }
        self.carve(id);
        let (mut first, mut last) = (id, id);
        if !self.per_id {
            // The run ending right below `id` (its `last + 1` cannot overflow: `last < id`).
            if let Some((&f, &(l, b))) = self.runs.range(..id).next_back()
                && l + 1 == id
                && b == by
            {
                self.runs.remove(&f);
                first = f;
            }
            if let Some(next) = id.checked_add(1)
                && let Some(&(l, b)) = self.runs.get(&next)
                && b == by
            {
                self.runs.remove(&next);
                last = l;
            }
        }
        self.runs.insert(first, (last, by));
    }

    /// The pool that destroyed `stream`, if the family did.
    pub(super) fn by(&self, stream: StreamId) -> Option<u64> {
        let (_, &(last, by)) = self.runs.range(..=stream.0).next_back()?;
        (stream.0 <= last).then_some(by)
    }

    /// Runs kept (the record's size).
    #[cfg(any(test, feature = "test-hooks"))]
    pub(super) fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Takes `id` out of the run that holds it, if any (the ids on either side stay).
    fn carve(&mut self, id: u32) {
        let Some((&f, &(l, b))) = self.runs.range(..=id).next_back() else { return };
        if l < id {
            return;
        }
        self.runs.remove(&f);
        if f < id {
            self.runs.insert(f, (id - 1, b));
        }
        if l > id {
            self.runs.insert(id + 1, (l, b));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = u64::MAX;

    fn runs(d: &DestroyedStreams) -> Vec<(u32, u32, u64)> {
        d.runs.iter().map(|(&f, &(l, b))| (f, l, b)).collect()
    }

    #[test]
    fn consecutive_ids_merge_in_any_order() {
        let mut d = DestroyedStreams::default();
        for id in [5, 3, 8, 4, 7] {
            d.insert(StreamId(id), W);
        }
        assert_eq!(runs(&d), vec![(3, 5, W), (7, 8, W)]);
        assert_eq!(d.by(StreamId(6)), None);
        d.insert(StreamId(6), W);
        assert_eq!(runs(&d), vec![(3, 8, W)]);
        for id in 0..12 {
            assert_eq!(d.by(StreamId(id)), (3..9).contains(&id).then_some(W), "{id}");
        }
    }

    #[test]
    fn ids_of_another_pool_split_and_rejoin() {
        let mut d = DestroyedStreams::default();
        for id in 1..=5 {
            d.insert(StreamId(id), W);
        }
        d.insert(StreamId(3), 7);
        assert_eq!(runs(&d), vec![(1, 2, W), (3, 3, 7), (4, 5, W)]);
        assert_eq!(d.by(StreamId(3)), Some(7));
        d.insert(StreamId(3), W);
        assert_eq!(runs(&d), vec![(1, 5, W)]);
        d.insert(StreamId(5), 7);
        d.insert(StreamId(6), 7);
        assert_eq!(runs(&d), vec![(1, 4, W), (5, 6, 7)]);
    }

    #[test]
    fn the_last_id_is_kept() {
        let mut d = DestroyedStreams::default();
        d.insert(StreamId(u32::MAX), W);
        d.insert(StreamId(u32::MAX - 1), W);
        assert_eq!(d.by(StreamId(u32::MAX)), Some(W));
        assert_eq!(d.by(StreamId(u32::MAX - 1)), Some(W));
        assert_eq!(d.by(StreamId(u32::MAX - 2)), None);
        d.insert(StreamId(u32::MAX), 2);
        assert_eq!(d.by(StreamId(u32::MAX)), Some(2));
        assert_eq!(d.by(StreamId(u32::MAX - 1)), Some(W));
    }

    /// Against a map of ids (what the record was): the same answer for every id after every
    /// note, runs that never overlap nor touch with the same pool, and no more runs than the
    /// maximal blocks of consecutive ids with one pool.
    fn agrees_with_a_map_of_ids(notes: &[(u32, u64)]) {
        let mut d = DestroyedStreams::default();
        let mut map = BTreeMap::new();
        for &(id, by) in notes {
            d.insert(StreamId(id), by);
            map.insert(id, by);
            for probe in 0..=24 {
                assert_eq!(d.by(StreamId(probe)), map.get(&probe).copied(), "id {probe}");
            }
            let runs = runs(&d);
            for w in runs.windows(2) {
                assert!(w[0].1 < w[1].0, "overlap: {w:?}");
                assert!(w[0].1 + 1 < w[1].0 || w[0].2 != w[1].2, "unmerged: {w:?}");
            }
            let blocks = map
                .iter()
                .zip(map.iter().skip(1))
                .filter(|((a, x), (b, y))| **a + 1 != **b || x != y)
                .count()
                + 1;
            assert_eq!(runs.len(), blocks, "{runs:?} against {map:?}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]
        #[test]
        fn the_runs_answer_as_a_map_of_ids_would(
            notes in proptest::collection::vec((0u32..24, 0u64..3), 1..60),
        ) {
            agrees_with_a_map_of_ids(&notes);
        }
    }

    #[test]
    fn per_id_keeps_a_run_each() {
        let mut d = DestroyedStreams { per_id: true, ..Default::default() };
        for id in 0..100 {
            d.insert(StreamId(id), W);
        }
        assert_eq!(d.runs(), 100);
        assert!((0..100).all(|id| d.by(StreamId(id)) == Some(W)));
    }
}
