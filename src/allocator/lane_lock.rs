//! `LaneLock`: the lock of one stream-cache lane, built for an owner that takes it on every hit
//! and a reclaimer (the global-lock side) that takes it rarely.
//!
//! ```text
//!   lock:    CAS locked false → true (Acquire)      one atomic RMW, on a line only this lane's
//!            └─ taken: spin on a load, then yield    threads touch (the cache is padded)
//!   unlock:  store locked = false (Release)          a plain store: no RMW, no waiter to wake
//! ```
//!
//! `std::sync::Mutex` pays a second RMW to let go (a `swap`, to learn whether a waiter sleeps on
//! the futex). Nothing here sleeps: holders never block while holding a lane (the fast path holds
//! it for a few dozen instructions, the global-lock side for a flush, a credit revocation or a
//! statistics copy, and takes no other lock under it), so a waiter spins briefly and then yields
//! its core. A hit and its free therefore cost one uncontended RMW each.
//!
//! Under loom the data sits in loom's `UnsafeCell` and each guard holds a tracked pointer, so a
//! lock that fails to exclude shows up as a concurrent access in every model that drives a
//! stream cache (broken variant `lane_lock`: a load, then a store, instead of the CAS).

use crate::sync::atomic::{AtomicBool, Ordering};
use std::ops::{Deref, DerefMut};

/// Spins on a taken lock before yielding the core to its holder.
#[cfg(not(loom))]
const SPINS: u32 = 64;

/// A lock around `T`; see the module docs.
pub struct LaneLock<T> {
    locked: AtomicBool,
    #[cfg(not(loom))]
    data: std::cell::UnsafeCell<T>,
    #[cfg(loom)]
    data: loom::cell::UnsafeCell<T>,
}

// SAFETY: the data is reached only through a guard, and `locked` admits one guard at a time
// (the CAS that sets it is Acquire, the store that clears it Release, so each holder sees the
// previous holder's writes). `T: Send` because the holder may be any thread.
unsafe impl<T: Send> Sync for LaneLock<T> {}

impl<T> LaneLock<T> {
    /// An unlocked lock around `value`.
    pub fn new(value: T) -> LaneLock<T> {
        #[cfg(not(loom))]
        let data = std::cell::UnsafeCell::new(value);
        #[cfg(loom)]
        let data = loom::cell::UnsafeCell::new(value);
        LaneLock { locked: AtomicBool::new(false), data }
    }

    /// Takes the lock, waiting (spinning, then yielding) while another thread holds it.
    #[inline(always)]
    pub fn lock(&self) -> LaneGuard<'_, T> {
        if !self.try_acquire() {
            self.lock_contended();
        }
        LaneGuard {
            lock: self,
            #[cfg(loom)]
            ptr: Some(self.data.get_mut()),
        }
    }

    /// Takes the lock if it is free now (`None`: another thread holds it).
    pub fn try_lock(&self) -> Option<LaneGuard<'_, T>> {
        self.try_acquire().then(|| LaneGuard {
            lock: self,
            #[cfg(loom)]
            ptr: Some(self.data.get_mut()),
        })
    }

    #[inline(always)]
    fn try_acquire(&self) -> bool {
        #[cfg(tidepool_broken = "lane_lock")]
        {
            // BROKEN: looks, then takes: two threads can both see it free and both take it.
            if self.locked.load(Ordering::Acquire) {
                return false;
            }
            crate::sync::thread::yield_now();
            self.locked.store(true, Ordering::Relaxed);
            true
        }
        #[cfg(not(tidepool_broken = "lane_lock"))]
        self.locked.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Kept out of line, so that the uncontended path inlined into its callers is the CAS alone.
    #[cold]
    #[inline(never)]
    #[cfg(not(loom))]
    fn lock_contended(&self) {
        let mut spins = 0;
        loop {
            // Test, then test-and-set: wait on plain loads, so waiters do not bounce the line.
            while self.locked.load(Ordering::Relaxed) {
                if spins < SPINS {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    crate::sync::thread::yield_now();
                }
            }
            if self.try_acquire() {
                return;
            }
        }
    }

    /// Under loom a waiter retries the CAS itself: an RMW always reads the latest value, where
    /// a plain load may go on reading a stale `true` (a path loom would explore without end).
    #[cfg(loom)]
    fn lock_contended(&self) {
        while !self.try_acquire() {
            crate::sync::thread::yield_now();
        }
    }
}

/// The lock held; the data reachable through it. Letting it go is one `Release` store.
pub struct LaneGuard<'a, T> {
    lock: &'a LaneLock<T>,
    /// Loom's tracked access, ended before the lock is let go.
    #[cfg(loom)]
    ptr: Option<loom::cell::MutPtr<T>>,
}

impl<T> Deref for LaneGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        #[cfg(not(loom))]
        // SAFETY: this guard holds the lock, so no other reference to the data exists.
        return unsafe { &*self.lock.data.get() };
        #[cfg(loom)]
        // SAFETY: as above; loom checks it.
        return unsafe { loom::cell::MutPtr::deref(self.ptr.as_ref().expect("held")) };
    }
}

impl<T> DerefMut for LaneGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        #[cfg(not(loom))]
        // SAFETY: this guard holds the lock, so no other reference to the data exists.
        return unsafe { &mut *self.lock.data.get() };
        #[cfg(loom)]
        // SAFETY: as above; loom checks it.
        return unsafe { loom::cell::MutPtr::deref(self.ptr.as_ref().expect("held")) };
    }
}

impl<T> Drop for LaneGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        #[cfg(loom)]
        drop(self.ptr.take());
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::LaneLock;
    use std::sync::Arc;

    /// Four threads add to one counter under the lock: no increment is lost.
    #[test]
    fn excludes_across_threads() {
        let lock = Arc::new(LaneLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        let mut g = lock.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 40_000);
    }

    /// A guard dropped during a panic lets the lock go.
    #[test]
    fn released_on_unwind() {
        let lock = Arc::new(LaneLock::new(1u32));
        let l2 = lock.clone();
        let r = std::thread::spawn(move || {
            let _g = l2.lock();
            panic!("holder panics");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*lock.lock(), 1);
    }
}
