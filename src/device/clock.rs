//! Vector clocks: what a stream's later work is ordered after, by stream. The simulator's
//! sanitizer and capture branches keep one per stream and event; `CudaDevice` keeps one per
//! branch of a capture underway (`cuda/capture_order.rs`).
//!
//! ```text
//!   Clock [(stream 1, pos 7), (stream 3, pos 5)]    sorted by stream; absent = 0
//!   record on A at p:  event = clock[A] ∪ {A: p}     wait(B, event):  clock[B] = max(clock[B], event)
//! ```

/// A vector clock: for each stream, the last position this clock is ordered after.
/// A small vector sorted by stream id (few streams, cheap to clone into events).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Clock(Vec<(u32, u64)>);

impl Clock {
    /// The position of `stream` this clock is ordered after (0: none).
    pub(crate) fn get(&self, stream: u32) -> u64 {
        match self.0.binary_search_by_key(&stream, |&(s, _)| s) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }

    /// Raises the entry of `stream` to at least `pos`.
    pub(crate) fn raise(&mut self, stream: u32, pos: u64) {
        match self.0.binary_search_by_key(&stream, |&(s, _)| s) {
            Ok(i) => self.0[i].1 = self.0[i].1.max(pos),
            Err(i) => self.0.insert(i, (stream, pos)),
        }
    }

    /// Element-wise maximum with `other`.
    pub(crate) fn join(&mut self, other: &Clock) {
        for &(s, p) in &other.0 {
            self.raise(s, p);
        }
    }

    /// Drops the entry of `stream` (a destroyed stream has no unfinished work left).
    pub(crate) fn forget(&mut self, stream: u32) {
        self.0.retain(|&(s, _)| s != stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_join_takes_maximum() {
        let mut a = Clock::default();
        a.raise(3, 5);
        a.raise(1, 2);
        let mut b = Clock::default();
        b.raise(1, 7);
        b.raise(2, 1);
        a.join(&b);
        assert_eq!(a, Clock(vec![(1, 7), (2, 1), (3, 5)]));
        assert_eq!(a.get(4), 0);
        a.forget(2);
        assert_eq!(a, Clock(vec![(1, 7), (3, 5)]));
    }
}
