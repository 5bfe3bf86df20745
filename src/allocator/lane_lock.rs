//! `LaneLock`: the lock of one stream-cache lane, *biased* towards the thread that uses the
//! lane (its owner), which takes it on every hit and every free, where every other thread (the
//! global-lock side: flushes, credit revocations, statistics; a buffer dropped on another
//! thread) takes it rarely.
//!
//! ```text
//!  owner, biased:    owner_in = 1; light fence; biased? ──yes──▶ held        no atomic RMW
//!                                                  └─no──▶ owner_in = 0, then as unbiased
//!                    let go: owner_in = 0 (Release)
//!  anyone else:      CAS locked false → true (Acquire)
//!                    if biased: biased = 0; heavy fence; wait while owner_in ──▶ held
//!                    let go: locked = false (Release)
//!  owner, unbiased:  CAS locked, as anyone else; after REBIAS such takes with no other
//!                    thread's between them, biased = 1 again
//! ```
//!
//! The light and heavy fences are `membarrier.rs`'s asymmetric pair: the owner's is a compiler
//! fence, the other thread's a `membarrier` system call that makes every running thread of the
//! process pass a full barrier. So of the owner's check (`owner_in` stored, `biased` loaded) and
//! the other thread's (`biased` cleared, `owner_in` loaded) at least one sees the other's store:
//! either the owner backs off, or the other thread waits until the owner lets go. A hit and its
//! free then cost no atomic read-modify-write (an uncontended CAS is ~10 ns on the 2-core
//! machine the benchmarks run on: half of a hit-and-free pair), and another thread's take costs
//! one system call (~0.1 µs with one thread, a few µs with many) the first time after the
//! owner's last biased stretch. A lane taken by other threads often stays unbiased: the owner
//! re-biases only after `REBIAS` takes in a row with no other thread's.
//!
//! `biased` changes only under `locked`: the first user's claim and the owner's re-bias set it
//! as their guard lets go (never while the owner still holds `locked`, which would let it take
//! a second, biased guard), another thread's take clears it. Once it is clear, the owner's next take goes through
//! `locked` (synchronising with whoever held the lane), so every biased stretch begins after
//! the last other holder let go. Where the heavy fence does not exist (not Linux, or the
//! command refused), `biased` is never set and every take is the compare-and-swap.
//!
//! The owner is the first thread that takes the lane to serve a hit or cache a free
//! ([`LaneLock::lock_claiming`]); other takes ([`LaneLock::lock`]) never claim, so a lane is
//! not claimed by the global-lock side that flushes every lane. An owner is replaced only once
//! its thread has ended (`thread_token.rs`: an ended thread never reads its token again): the
//! next user's claiming take revokes the bias, becomes the owner and biases the lane for
//! itself, so a pool of threads that come and go does not leave its lanes on the CAS.
//!
//! Nothing here sleeps: holders never block while holding a lane (the fast path holds it for a
//! few dozen instructions, the global-lock side for a flush, a credit revocation or a
//! statistics copy, and takes no other lock under it), so a waiter spins briefly and then yields
//! its core.
//!
//! Under loom the data sits in loom's `UnsafeCell` and each guard holds a tracked pointer, so a
//! lock that fails to exclude shows up as a concurrent access in every model that drives a
//! stream cache (broken variants `lane_lock`: a load, then a store, instead of the CAS;
//! `lane_bias`: another thread's take without the heavy fence).

use super::thread_token::{self, RETIRED, thread_token};
use crate::membarrier;
use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::ops::{Deref, DerefMut};

/// Spins on a taken lock before yielding the core to its holder.
#[cfg(not(loom))]
const SPINS: u32 = 64;

/// The owner's takes through `locked`, with no other thread's between them, after which the
/// lane is biased again (one loom step in the models, so that they explore re-biasing).
#[cfg(not(loom))]
const REBIAS: u32 = 1024;
#[cfg(loom)]
const REBIAS: u32 = 1;

/// A lock around `T`; see the module docs.
pub struct LaneLock<T> {
    /// The compare-and-swap lock: every take but the owner's biased one.
    locked: AtomicBool,
    /// The owner may take the lane with the light fence alone. Changed only under `locked`.
    biased: AtomicBool,
    /// The owner holds the lane through the bias.
    owner_in: AtomicBool,
    /// The owner's thread token (0: none yet); set once, under `locked`.
    owner: AtomicU64,
    /// The owner's takes through `locked` since another thread's; read and written under it.
    calm: AtomicU32,
    /// Whether the lane may be biased at all (`LaneLock::set_biasing`); read under `locked`.
    may_bias: AtomicBool,
    #[cfg(not(loom))]
    data: std::cell::UnsafeCell<T>,
    #[cfg(loom)]
    data: loom::cell::UnsafeCell<T>,
}

// SAFETY: the data is reached only through a guard, and one guard exists at a time: guards of
// the compare-and-swap path exclude each other through `locked` (set by an Acquire CAS, cleared
// by a Release store); a biased guard excludes them through the fence pair on `owner_in` and
// `biased` (module docs), and only the owner's thread can hold one. `T: Send` because the
// holder may be any thread.
unsafe impl<T: Send> Sync for LaneLock<T> {}

impl<T> LaneLock<T> {
    /// An unlocked lock around `value`, with no owner yet; `may_bias`: see
    /// [`LaneLock::set_biasing`].
    pub fn new(may_bias: bool, value: T) -> LaneLock<T> {
        #[cfg(not(loom))]
        let data = std::cell::UnsafeCell::new(value);
        #[cfg(loom)]
        let data = loom::cell::UnsafeCell::new(value);
        LaneLock {
            locked: AtomicBool::new(false),
            biased: AtomicBool::new(false),
            owner_in: AtomicBool::new(false),
            owner: AtomicU64::new(0),
            calm: AtomicU32::new(0),
            may_bias: AtomicBool::new(may_bias),
            data,
        }
    }

    /// Takes the lock, waiting (spinning, then yielding) while another thread holds it. Never
    /// claims the lane for this thread (the global-lock side's takes).
    #[inline(always)]
    pub fn lock(&self) -> LaneGuard<'_, T> {
        self.lock_as(false)
    }

    /// [`LaneLock::lock`] by a user of the lane (a hit, a free cached here): the first such
    /// thread becomes the lane's owner.
    #[inline(always)]
    pub fn lock_claiming(&self) -> LaneGuard<'_, T> {
        self.lock_as(true)
    }

    #[inline(always)]
    fn lock_as(&self, claim: bool) -> LaneGuard<'_, T> {
        let me = thread_token();
        // Only this thread ever stores its own token here, so reading it means this thread
        // is the owner (a stale read of another value sends an owner down the CAS path, which
        // is correct too).
        if self.owner.load(Ordering::Relaxed) == me {
            if self.enter_biased() {
                return self.guard(Hold::Biased);
            }
            return self.lock_owner_unbiased();
        }
        self.lock_other(me, claim)
    }

    /// The owner's side of the fence pair: `true` when it holds the lane through the bias.
    #[inline(always)]
    fn enter_biased(&self) -> bool {
        debug_assert!(!self.owner_in.load(Ordering::Relaxed), "a lane taken twice by its owner");
        self.owner_in.store(true, Ordering::Relaxed);
        membarrier::light();
        if self.biased.load(Ordering::Acquire) {
            return true;
        }
        self.owner_in.store(false, Ordering::Release);
        false
    }

    /// The owner's take through `locked` while the lane is not biased; biases it again after
    /// `REBIAS` such takes in a row.
    #[inline(always)]
    fn lock_owner_unbiased(&self) -> LaneGuard<'_, T> {
        self.acquire();
        let calm = self.calm.load(Ordering::Relaxed) + 1;
        if calm >= REBIAS {
            return self.guard(self.rebias());
        }
        self.calm.store(calm, Ordering::Relaxed);
        self.guard(Hold::Locked)
    }

    /// Under `locked`, by the owner: how to let go, biasing the lane as the guard goes (if
    /// biasing may be on here at all). Not at once: the owner holds the lane through `locked`
    /// until then, and a bias set now would let it take a second guard (`try_lock`).
    #[cold]
    fn rebias(&self) -> Hold {
        self.calm.store(0, Ordering::Relaxed);
        match self.may_bias.load(Ordering::Relaxed) && membarrier::supported() {
            true => Hold::LockedThenBias,
            false => Hold::Locked,
        }
    }

    /// Another thread's take (or the first user's, which claims the lane).
    #[inline(never)]
    fn lock_other(&self, me: u64, claim: bool) -> LaneGuard<'_, T> {
        self.acquire();
        if claim && me != RETIRED {
            let owner = self.owner.load(Ordering::Relaxed);
            // No owner yet, or one whose thread has ended and never reads its token again
            // (`thread_token.rs`; BROKEN: such a lane stays on the CAS for good): once any bias
            // is revoked, the lane is this thread's, biased from the moment this take lets go.
            if owner == 0 || (!cfg!(tidepool_broken = "owner_kept") && thread_token::ended(owner)) {
                self.revoke_bias();
                self.owner.store(me, Ordering::Relaxed);
                return self.guard(self.rebias());
            }
        }
        self.revoke_bias();
        self.guard(Hold::Locked)
    }

    /// Under `locked`: clears the bias and waits until the owner is out, and restarts the
    /// owner's count towards a re-bias.
    #[inline]
    fn revoke_bias(&self) {
        if self.clear_bias() {
            self.wait_owner_out();
        }
    }

    /// Under `locked`, another thread's side of the fence pair: restarts the owner's count
    /// towards a re-bias and, if the lane was biased, clears the bias and passes the heavy
    /// fence (`true`): from then on the owner's check backs off, and `owner_in` says whether
    /// it is inside.
    #[inline]
    fn clear_bias(&self) -> bool {
        self.calm.store(0, Ordering::Relaxed);
        if !self.biased.load(Ordering::Relaxed) {
            return false;
        }
        self.biased.store(false, Ordering::Relaxed);
        #[cfg(not(tidepool_broken = "lane_bias"))]
        membarrier::heavy();
        #[cfg(tidepool_broken = "lane_bias")]
        // BROKEN: no heavy fence, so the owner's check may still read the bias.
        crate::sync::thread::yield_now();
        true
    }

    /// Waits until the owner lets go of a biased hold.
    fn wait_owner_out(&self) {
        #[cfg(not(loom))]
        let mut spins = 0;
        while self.owner_in.load(Ordering::Acquire) {
            #[cfg(not(loom))]
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            crate::sync::thread::yield_now();
        }
    }

    /// Takes the lock if that needs no wait (`None`: another thread holds it, or the owner
    /// does through the bias). Never claims the lane.
    pub fn try_lock(&self) -> Option<LaneGuard<'_, T>> {
        let me = thread_token();
        if self.owner.load(Ordering::Relaxed) == me {
            // Held by this very thread already (only the owner sets `owner_in`): as `locked`
            // held, no second guard.
            if self.owner_in.load(Ordering::Relaxed) {
                return None;
            }
            if self.enter_biased() {
                return Some(self.guard(Hold::Biased));
            }
            return self.try_acquire().then(|| self.guard(Hold::Locked));
        }
        if !self.try_acquire() {
            return None;
        }
        if self.clear_bias() && self.owner_in.load(Ordering::Acquire) {
            // The owner is in (or backing off): give the bias back untouched and let go.
            // Nothing was read or written, so its hold, if any, goes on undisturbed.
            self.biased.store(true, Ordering::Relaxed);
            self.locked.store(false, Ordering::Release);
            return None;
        }
        Some(self.guard(Hold::Locked))
    }

    /// Turns biasing on or off for this lane (off: every take is the compare-and-swap).
    /// Takes the lock as another thread would, so a bias in force is revoked first.
    pub fn set_biasing(&self, on: bool) {
        // Only this changes it: no change, nothing to revoke.
        if self.may_bias.load(Ordering::Relaxed) == on {
            return;
        }
        self.acquire();
        self.revoke_bias();
        self.may_bias.store(on, Ordering::Relaxed);
        self.locked.store(false, Ordering::Release);
    }

    /// Whether the owner holds the lane through the bias now, or may from its next take.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn is_biased(&self) -> bool {
        self.biased.load(Ordering::Relaxed)
    }

    #[inline(always)]
    fn guard(&self, hold: Hold) -> LaneGuard<'_, T> {
        LaneGuard {
            lock: self,
            hold,
            _thread: std::marker::PhantomData,
            #[cfg(loom)]
            ptr: Some(self.data.get_mut()),
        }
    }

    /// The compare-and-swap, waiting while another thread holds `locked`.
    #[inline(always)]
    fn acquire(&self) {
        if !self.try_acquire() {
            self.lock_contended();
        }
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

/// How a guard holds its lane, so how it lets go.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Hold {
    /// The owner, through the bias: `owner_in` cleared.
    Biased,
    /// Through `locked`: cleared.
    Locked,
    /// The owner through `locked`, biasing the lane as it lets go.
    LockedThenBias,
}

/// The lock held; the data reachable through it. Letting it go is one `Release` store.
///
/// Not `Send`, as `std`'s `MutexGuard`: a biased guard is the owner thread's (its `owner_in`),
/// and a guard let go on another thread would let the owner take a second one while it is
/// held. (`tests/soundness.rs::a_lane_guard_is_not_send` checks it at compile time.)
pub struct LaneGuard<'a, T> {
    lock: &'a LaneLock<T>,
    hold: Hold,
    /// `!Send` (and `!Sync`): see the type's docs.
    _thread: std::marker::PhantomData<*const ()>,
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
        match self.hold {
            Hold::Biased => self.lock.owner_in.store(false, Ordering::Release),
            Hold::Locked => self.lock.locked.store(false, Ordering::Release),
            Hold::LockedThenBias => {
                // Still under `locked`: another thread's next take sees the bias and revokes it.
                self.lock.biased.store(true, Ordering::Relaxed);
                self.lock.locked.store(false, Ordering::Release);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::LaneLock;
    use std::sync::Arc;

    /// Adds one under `g` as a read, then a write (a lost update shows if two holders overlap).
    fn add_one(mut g: super::LaneGuard<'_, u64>) {
        let v = *g;
        std::hint::black_box(&v);
        *g = v + 1;
    }

    /// Four threads add to one counter under the lock: no increment is lost.
    #[test]
    fn excludes_across_threads() {
        let lock = Arc::new(LaneLock::new(true, 0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        add_one(lock.lock());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 40_000);
    }

    /// Whether this machine has the heavy fence (the bias is never set without it).
    fn bias_here() -> bool {
        let on = crate::membarrier::supported();
        if !on {
            eprintln!("membarrier is refused here: checking that no lane is ever biased");
        }
        on
    }

    /// The first user becomes the owner, biased at once; another thread's take revokes the
    /// bias; the owner biases the lane again after exactly `REBIAS` takes through the CAS.
    #[test]
    fn the_owner_is_biased_until_another_thread_takes_the_lane() {
        let on = bias_here();
        let lock = Arc::new(LaneLock::new(true, 0u64));
        assert!(!lock.is_biased(), "no owner yet");
        // A take that does not claim (the global-lock side's) leaves it unowned.
        *lock.lock() += 1;
        assert!(!lock.is_biased());
        *lock.lock_claiming() += 1;
        assert_eq!(lock.is_biased(), on);
        let l2 = lock.clone();
        std::thread::spawn(move || *l2.lock() += 10).join().unwrap();
        assert!(!lock.is_biased(), "another thread's take revokes the bias");
        for _ in 0..super::REBIAS - 1 {
            *lock.lock() += 1;
        }
        assert!(!lock.is_biased(), "one take short of REBIAS");
        *lock.lock() += 1;
        assert_eq!(lock.is_biased(), on);
        // Only the owner's takes count: another thread's claim does not take the lane over.
        let l2 = lock.clone();
        std::thread::spawn(move || *l2.lock_claiming() += 10).join().unwrap();
        assert!(!lock.is_biased());
        assert_eq!(*lock.lock(), 1 + 1 + 10 + u64::from(super::REBIAS) + 10);
    }

    /// The owner takes the lane through the bias while other threads take it with `lock` and
    /// `try_lock` (each take revoking the bias the owner set again): no increment is lost.
    #[test]
    fn a_biased_owner_and_other_threads_exclude_each_other() {
        bias_here();
        let lock = Arc::new(LaneLock::new(true, 0u64));
        let tried = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let owner = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                for _ in 0..40_000 {
                    add_one(lock.lock_claiming());
                }
            })
        };
        let others: Vec<_> = (0..2)
            .map(|_| {
                let (lock, tried) = (lock.clone(), tried.clone());
                std::thread::spawn(move || {
                    for i in 0..3_000 {
                        if i % 2 == 0 {
                            add_one(lock.lock());
                        } else if let Some(g) = lock.try_lock() {
                            add_one(g);
                            tried.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        owner.join().unwrap();
        for t in others {
            t.join().unwrap();
        }
        let extra = tried.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(*lock.lock(), 40_000 + 2 * 1_500 + extra);
    }

    /// Biasing turned off revokes a bias in force, and the owner's takes never set it again;
    /// turned on, the owner's takes do.
    #[test]
    fn biasing_turned_off_revokes_and_stays_off() {
        let on = bias_here();
        let lock = LaneLock::new(true, 0u64);
        *lock.lock_claiming() += 1;
        assert_eq!(lock.is_biased(), on);
        lock.set_biasing(false);
        assert!(!lock.is_biased());
        for _ in 0..2 * super::REBIAS {
            *lock.lock_claiming() += 1;
        }
        assert!(!lock.is_biased());
        lock.set_biasing(true);
        for _ in 0..super::REBIAS {
            *lock.lock() += 1;
        }
        assert_eq!(lock.is_biased(), on);
        assert_eq!(*lock.lock(), 1 + 3 * u64::from(super::REBIAS));
    }

    /// The owner holding the lane through the bias is refused a second guard by `try_lock`
    /// (as a CAS holder is), so no two guards alias the data.
    #[test]
    fn the_owner_gets_no_second_guard() {
        bias_here();
        let lock = LaneLock::new(true, 0u64);
        let g = lock.lock_claiming();
        assert!(lock.try_lock().is_none());
        drop(g);
        assert!(lock.try_lock().is_some());
    }

    /// A biased guard dropped during a panic lets the lane go: another thread then takes it.
    #[test]
    fn a_biased_guard_is_released_on_unwind() {
        bias_here();
        let lock = Arc::new(LaneLock::new(true, 1u32));
        let l2 = lock.clone();
        let r = std::thread::spawn(move || {
            drop(l2.lock_claiming());
            let _g = l2.lock_claiming();
            panic!("the owner panics while holding the lane");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*lock.lock(), 1);
    }

    /// A guard dropped during a panic lets the lock go.
    #[test]
    fn released_on_unwind() {
        let lock = Arc::new(LaneLock::new(true, 1u32));
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
