//! `LaneLock`: the lock of one stream-cache lane, built for an owner that takes it on every hit
//! and a reclaimer (the global-lock side) that takes it rarely.
//!
//! A lane is *biased* to the first thread that uses it for a hit or a free (its owner): the
//! owner enters with no atomic read-modify-write, by an asymmetric Dekker handshake with the
//! rare side (`sync/asym.rs`); every other thread takes the CAS lock.
//!
//! ```text
//!   state = owner << 1 | locked        busy (the owner is inside)
//!
//!   owner      the owner's entry                    everyone else (the CAS path)
//!   ─────────  ───────────────────────────────────  ─────────────────────────────────────────
//!   NONE       (none)                               CAS the lock bit; a hit or free claims
//!                                                   the lane: owner = me (membarrier only)
//!   thread t   busy = true, light fence, then       CAS the lock bit, heavy fence, wait for
//!              state = t << 1 (one load) enters,    !busy; a hit or free (a second user)
//!              else busy = false and the CAS path   then makes the lane SHARED
//!   SHARED     (none: never biased again)           CAS the lock bit (nobody enters light)
//!
//!   let go:    the owner: busy = false (Release)    a CAS holder: lock bit cleared (Release)
//! ```
//!
//! The owner's entry is a store, a compiler fence and two loads where the process has
//! membarrier (Linux), in place of a locked CAS (a full fence on x86): the fast path's two lane
//! locks (a hit and its free) were the largest remaining cost of a hit. The rare side pays a
//! membarrier instead, only where the lane is biased to another thread. The owner changes only
//! with the lock bit held, and from one thread to `SHARED` only after the heavy fence and the
//! wait; an owner's entry reads the owner and the bit in one load after its fence, so a stale
//! owner either finished before the change (the changer waited for it) or sees it.
//!
//! `std::sync::Mutex` pays a second RMW to let go (a `swap`, to learn whether a waiter sleeps on
//! the futex). Nothing here sleeps: holders never block while holding a lane (the fast path holds
//! it for a few dozen instructions, the global-lock side for a flush, a credit revocation or a
//! statistics copy, and takes no other lock under it), so a waiter spins briefly and then yields
//! its core.
//!
//! Under loom the data sits in loom's `UnsafeCell` and each guard holds a tracked pointer, so a
//! lock that fails to exclude shows up as a concurrent access in every model that drives a
//! stream cache (broken variants: `lane_lock`, a load then a store instead of the CAS;
//! `asym_fence`, the owner's fence left out; `asym_wait`, the CAS holder not waiting for the
//! owner).

use crate::sync::asym::{biasing, heavy_fence, light_fence};
use crate::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::ops::{Deref, DerefMut};

/// Spins on a taken lock before yielding the core to its holder.
#[cfg(not(loom))]
const SPINS: u32 = 64;

/// `state`'s lock bit: a thread holds the lane by the CAS.
const LOCKED: u64 = 1;
/// Owner: no thread used the lane yet.
const NONE: u64 = 0;
/// Owner: two threads used the lane; it is never biased again.
const SHARED: u64 = u64::MAX >> 1;

/// A lock around `T`; see the module docs.
pub struct LaneLock<T> {
    /// `owner << 1 | locked`, where the owner is [`NONE`], a thread's token ([`thread_token`])
    /// or [`SHARED`], stored only with the lock bit held. One word, so that the owner's entry
    /// checks both with one load.
    state: AtomicU64,
    /// The owner is inside (set and cleared by the owner alone).
    busy: AtomicBool,
    #[cfg(not(loom))]
    data: std::cell::UnsafeCell<T>,
    #[cfg(loom)]
    data: loom::cell::UnsafeCell<T>,
}

// SAFETY: the data is reached only through a guard, and a guard exists only where the lock bit
// is held by its thread (the CAS that sets it is Acquire, the store that clears it Release) or
// where the owner is inside by the handshake (its `busy` store, the fence pair, its Acquire
// load of `state` finding the bit clear and itself the owner; a CAS holder waits, after its
// heavy fence, for `busy` clear with an Acquire load that reads the owner's Release store), so
// one guard exists at a time and each holder sees the previous holder's writes. `T: Send`
// because the holder may be any thread.
unsafe impl<T: Send> Sync for LaneLock<T> {}

impl<T> LaneLock<T> {
    /// An unlocked lock around `value`, biased to no thread yet.
    pub fn new(value: T) -> LaneLock<T> {
        #[cfg(not(loom))]
        let data = std::cell::UnsafeCell::new(value);
        #[cfg(loom)]
        let data = loom::cell::UnsafeCell::new(value);
        LaneLock { state: AtomicU64::new(NONE << 1), busy: AtomicBool::new(false), data }
    }

    /// Takes the lock for a hit or a free of this lane (the fast path): the owner enters
    /// without a CAS; the first thread to use the lane becomes its owner (where the process has
    /// membarrier), and a second makes it shared.
    #[inline(always)]
    pub fn lock_hot(&self) -> LaneGuard<'_, T> {
        let me = thread_token();
        if self.enter_light(me) {
            return self.guard(true);
        }
        self.lock_cas(me, true)
    }

    /// Takes the lock for anything else (the global-lock side, a statistics copy), leaving
    /// the lane's owner as it is: the owner still enters without a CAS.
    #[inline]
    pub fn lock(&self) -> LaneGuard<'_, T> {
        let me = thread_token();
        if self.enter_light(me) {
            return self.guard(true);
        }
        self.lock_cas(me, false)
    }

    /// Takes the lock if it is free now (`None`: another thread holds it, or its owner is
    /// inside).
    pub fn try_lock(&self) -> Option<LaneGuard<'_, T>> {
        let me = thread_token();
        if self.enter_light(me) {
            return Some(self.guard(true));
        }
        let owner = self.try_acquire()?;
        if is_other(owner, me) {
            heavy_fence();
            if self.busy.load(Ordering::Acquire) && !cfg!(tidepool_broken = "asym_wait") {
                self.unlock();
                return None;
            }
        }
        Some(self.guard(false))
    }

    /// Whether the lane is biased to this thread (for tests).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn owned_by_this_thread(&self) -> bool {
        self.state.load(Ordering::Relaxed) >> 1 == thread_token()
    }

    /// Whether two threads used the lane, so that it is no longer biased (for tests).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn is_shared(&self) -> bool {
        self.state.load(Ordering::Relaxed) >> 1 == SHARED
    }

    #[inline(always)]
    fn guard(&self, light: bool) -> LaneGuard<'_, T> {
        LaneGuard {
            lock: self,
            light,
            #[cfg(loom)]
            ptr: Some(self.data.get_mut()),
        }
    }

    /// The owner's entry: announce, fence, then check that no CAS holder is inside and that
    /// the lane is still biased to `me` (one load of `state`); else withdraw.
    #[inline(always)]
    fn enter_light(&self, me: u64) -> bool {
        let mine = me << 1;
        if self.state.load(Ordering::Relaxed) != mine {
            return false;
        }
        self.busy.store(true, Ordering::Relaxed);
        light_fence();
        if self.state.load(Ordering::Acquire) == mine {
            return true;
        }
        self.busy.store(false, Ordering::Release);
        false
    }

    /// The CAS path: takes the lock bit, then waits for a light owner that may be inside;
    /// with `claim` (a hit or free), takes a lane nobody used and un-biases one used by
    /// another thread.
    #[cold]
    #[inline(never)]
    fn lock_cas(&self, me: u64, claim: bool) -> LaneGuard<'_, T> {
        let owner = match self.try_acquire() {
            Some(owner) => owner,
            None => self.lock_contended(),
        };
        if is_other(owner, me) {
            // BROKEN (`asym_wait`): enters while the owner may be inside.
            if !cfg!(tidepool_broken = "asym_wait") {
                heavy_fence();
                self.wait_owner_out();
            }
            if claim {
                self.set_owner(SHARED);
            }
        } else if owner == NONE && claim && biasing() {
            // Nobody can be inside: only an owner enters light.
            self.set_owner(me);
        }
        self.guard(false)
    }

    /// Makes `owner` the lane's owner; the caller holds the lock bit.
    fn set_owner(&self, owner: u64) {
        self.state.store(owner << 1 | LOCKED, Ordering::Relaxed);
    }

    /// Lets the lock bit go (a CAS holder), keeping the owner.
    #[inline(always)]
    fn unlock(&self) {
        let s = self.state.load(Ordering::Relaxed);
        self.state.store(s & !LOCKED, Ordering::Release);
    }

    /// Waits for the owner to leave (or to withdraw, having seen the lock bit): loads, as
    /// under loom (where a read-modify-write here would add a store of its own to `busy`,
    /// which loom mis-orders against the owner's next announcement).
    fn wait_owner_out(&self) {
        #[cfg(not(loom))]
        let mut spins = 0;
        while self.busy.load(Ordering::Acquire) {
            #[cfg(not(loom))]
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            crate::sync::thread::yield_now();
        }
    }

    /// Takes the lock bit if it is clear now; returns the owner then.
    #[inline(always)]
    fn try_acquire(&self) -> Option<u64> {
        let s = self.state.load(Ordering::Relaxed);
        if s & LOCKED != 0 {
            return None;
        }
        #[cfg(tidepool_broken = "lane_lock")]
        {
            // BROKEN: looks, then takes: two threads can both see it free and both take it.
            crate::sync::thread::yield_now();
            self.state.store(s | LOCKED, Ordering::Relaxed);
            return Some(s >> 1);
        }
        #[cfg(not(tidepool_broken = "lane_lock"))]
        self.state
            .compare_exchange(s, s | LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| s >> 1)
    }

    /// Waits for the lock bit and takes it; returns the owner then.
    fn lock_contended(&self) -> u64 {
        #[cfg(not(loom))]
        let mut spins = 0;
        loop {
            if let Some(owner) = self.try_acquire() {
                return owner;
            }
            #[cfg(not(loom))]
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            crate::sync::thread::yield_now();
        }
    }
}

/// The lock held; the data reachable through it. Letting it go is one `Release` store.
pub struct LaneGuard<'a, T> {
    lock: &'a LaneLock<T>,
    /// Entered by the owner's handshake (let go by clearing `busy`), else by the CAS.
    light: bool,
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
        match self.light {
            true => self.lock.busy.store(false, Ordering::Release),
            false => self.lock.unlock(),
        }
    }
}

/// Whether `owner` (read as the lock bit was taken: only holders store it) is a thread other
/// than `me`, which may be inside by the handshake.
#[inline]
fn is_other(owner: u64, me: u64) -> bool {
    owner != me && owner != NONE && owner != SHARED
}

/// This thread's token: a number no other thread of the process has had, never [`NONE`] or
/// [`SHARED`] (a lane biased to a thread that has exited stays biased to a token nobody holds,
/// until another thread's hit makes it shared).
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn thread_token() -> u64 {
    use std::cell::Cell;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    thread_local! {
        // A constant initialiser: reading it is one thread-local load, no lazy-init check.
        static TOKEN: Cell<u64> = const { Cell::new(NONE) };
    }
    TOKEN.with(|t| match t.get() {
        NONE => {
            let token = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            t.set(token);
            token
        }
        token => token,
    })
}

/// This thread's token, with loom's counter and thread-locals (reset for every execution).
#[cfg(loom)]
pub(crate) fn thread_token() -> u64 {
    loom::lazy_static! {
        static ref NEXT: AtomicU64 = AtomicU64::new(1);
    }
    loom::thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|t| *t)
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

    /// The first thread to take the lane for a hit owns it (and enters without the CAS); the
    /// global-lock side's lock leaves the bias alone; a second thread's hit shares the lane.
    #[test]
    fn the_first_hot_user_owns_the_lane_and_a_second_hot_user_shares_it() {
        // Without membarrier (`TIDEPOOL_MEMBARRIER=0`, CI runs these tests so too) no lane is
        // ever biased: every thread takes the CAS.
        let biased = crate::sync::asym::biasing();
        let lock = Arc::new(LaneLock::new(0u64));
        assert!(!lock.owned_by_this_thread() && !lock.is_shared());
        *lock.lock() += 1; // not a hit: claims nothing
        assert!(!lock.owned_by_this_thread());
        *lock.lock_hot() += 1;
        assert_eq!(lock.owned_by_this_thread(), biased);
        let l2 = lock.clone();
        std::thread::spawn(move || {
            *l2.lock() += 1; // the global-lock side on another thread: the bias stays
            assert!(!l2.owned_by_this_thread() && !l2.is_shared());
        })
        .join()
        .unwrap();
        assert_eq!(lock.owned_by_this_thread(), biased);
        let l2 = lock.clone();
        std::thread::spawn(move || *l2.lock_hot() += 1).join().unwrap();
        assert_eq!(lock.is_shared(), biased);
        assert!(!lock.owned_by_this_thread());
        *lock.lock_hot() += 1; // shared for good (or never biased): a hit claims nothing
        assert_eq!(lock.is_shared(), biased);
        assert!(!lock.owned_by_this_thread());
        assert_eq!(*lock.lock(), 5);
    }

    /// The owner enters without the CAS while two other threads take the lock the global-lock
    /// side's way (which leaves the bias alone): every increment survives, and the owner still
    /// owns the lane at the end, so its entries were the light ones. (Broken orderings are
    /// caught by the loom model `a_lane_owner_entering_without_a_cas_against_other_threads`;
    /// this checks the real fences on real cores.)
    #[test]
    fn an_owner_entering_light_excludes_cas_holders() {
        let lock = Arc::new(LaneLock::new((0u64, false)));
        let bump = |g: &mut super::LaneGuard<'_, (u64, bool)>| {
            assert!(!g.1, "two holders inside at once");
            g.1 = true;
            let v = g.0;
            std::hint::black_box(&v);
            g.0 = v + 1;
            g.1 = false;
        };
        let owner = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    bump(&mut lock.lock_hot());
                }
                lock.owned_by_this_thread()
            })
        };
        let others: Vec<_> = (0..2)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        match i % 2 {
                            0 => bump(&mut lock.lock()),
                            _ => {
                                if let Some(mut g) = lock.try_lock() {
                                    bump(&mut g)
                                } else {
                                    bump(&mut lock.lock())
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        let biased = crate::sync::asym::biasing();
        assert_eq!(owner.join().unwrap(), biased, "the owner lost its bias");
        for t in others {
            t.join().unwrap();
        }
        assert_eq!(lock.lock().0, 24_000);
    }

    /// While the owner is inside, another thread's `try_lock` fails and its `lock` waits; once
    /// the owner leaves, both succeed.
    #[test]
    fn a_cas_holder_waits_for_the_owner_inside() {
        use std::sync::mpsc::channel;
        let lock = Arc::new(LaneLock::new(0u64));
        let (inside_tx, inside_rx) = channel();
        let (leave_tx, leave_rx) = channel::<()>();
        let owner = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                *lock.lock_hot() += 1; // claims
                let mut g = lock.lock_hot(); // light
                inside_tx.send(()).unwrap();
                leave_rx.recv().unwrap();
                *g += 1;
            })
        };
        inside_rx.recv().unwrap();
        assert!(lock.try_lock().is_none(), "try_lock entered beside the owner");
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let g = lock.lock();
                *g
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "lock entered beside the owner");
        leave_tx.send(()).unwrap();
        owner.join().unwrap();
        assert_eq!(waiter.join().unwrap(), 2, "the waiter did not see the owner's write");
        assert_eq!(*lock.try_lock().expect("free"), 2);
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
