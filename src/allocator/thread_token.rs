//! Thread tokens: who owns a stream-cache lane (`lane_lock.rs`), and whether that thread has
//! ended, so that a lane whose owner thread is gone passes to the next thread that uses it
//! instead of staying on the compare-and-swap for good.
//!
//! ```text
//!   token = generation << SLOT_BITS | slot          a thread alive holds one slot
//!   GENERATIONS: [g0][g1][g2] …                     the generation of each slot's thread now
//!                      ▲
//!   a thread ends ─────┘ its slot's generation + 1 (Release), then the slot is free again
//!   ended(token) = GENERATIONS[slot] (Acquire) ≠ the token's generation
//! ```
//!
//! A thread's token is made at its first take of a lane and kept in a constant thread-local
//! (one load, no lazy-init check, readable at any time: the hit path reads it). A second
//! thread-local, made only then, ends the token as the thread ends: it first makes this thread's
//! token [`RETIRED`] (a token that never owns a lane), then moves the slot's generation on. So
//! a thread that reads a token as ended (`Acquire`) knows the ended thread will never again
//! read its old token, even in a destructor of its own that runs later and frees a buffer: it
//! may take the lane over. Slots are recycled (a free list under a mutex, touched only as
//! threads begin and end), so the table stays as large as the most threads alive at once that
//! took a lane; past [`SLOTS`] of them a thread gets an *unslotted* token, unique but never
//! ended (its lanes behave as before this module: no hand-over). The main thread's
//! thread-locals are not destroyed at exit, which is harmless: the process ends with it.
//!
//! Under loom the table, the free list and the thread-locals are loom's, reset for every
//! execution of a model, and a model ends a thread's token by calling `retire` (loom runs no
//! thread-local destructors).

#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

/// Bits of a token that name its slot.
const SLOT_BITS: u32 = 12;
/// Threads alive at once that hold a slotted token.
#[cfg(not(loom))]
pub(crate) const SLOTS: usize = 1 << SLOT_BITS;
/// Fewer under loom (the models run two or three threads).
#[cfg(loom)]
pub(crate) const SLOTS: usize = 4;
/// Set in every unslotted token (and in [`RETIRED`]): never ended.
const UNSLOTTED: u64 = 1 << 63;
/// The token of a thread whose token has ended (its thread-local destructors are running):
/// never stored as a lane's owner.
pub(crate) const RETIRED: u64 = u64::MAX;

/// This thread's token: unique for the process's life, never 0 (no owner).
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn thread_token() -> u64 {
    match TOKEN.with(|t| t.get()) {
        0 => first_token(),
        token => token,
    }
}

#[cfg(not(loom))]
thread_local! {
    // A constant initialiser and no destructor: one thread-local load, usable at any time
    // (also while this thread's other thread-locals are destroyed).
    static TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    // Made with the token; ends it as the thread ends.
    static ENDS: Ends = const { Ends(std::cell::Cell::new(None)) };
}

/// The generation of each slot's thread (a slot's first thread is generation 1).
#[cfg(not(loom))]
static GENERATIONS: [AtomicU64; SLOTS] = [const { AtomicU64::new(1) }; SLOTS];

/// Slots no thread alive holds: those never handed out (`next` up) and those given back.
#[cfg(not(loom))]
static FREE: std::sync::Mutex<FreeSlots> =
    std::sync::Mutex::new(FreeSlots { next: 0, given_back: Vec::new() });

/// The count behind unslotted tokens.
#[cfg(not(loom))]
static UNSLOTTED_NEXT: AtomicU64 = AtomicU64::new(1);

struct FreeSlots {
    next: usize,
    given_back: Vec<usize>,
}

impl FreeSlots {
    fn take(&mut self) -> Option<usize> {
        if let Some(slot) = self.given_back.pop() {
            return Some(slot);
        }
        (self.next < SLOTS).then(|| {
            self.next += 1;
            self.next - 1
        })
    }
}

/// Ends this thread's token when dropped (at thread exit).
#[cfg(not(loom))]
struct Ends(std::cell::Cell<Option<usize>>);

#[cfg(not(loom))]
impl Drop for Ends {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            end_slot(slot);
        }
    }
}

/// The slow half of [`thread_token`]: this thread's first token.
#[cfg(not(loom))]
#[cold]
#[inline(never)]
fn first_token() -> u64 {
    let token = match crate::sync::lock(&FREE).take() {
        // The destructor that ends it is registered first: if this thread-local cannot be
        // reached any more (this thread is ending), the slot goes back and the token is
        // unslotted.
        Some(slot) => match ENDS.try_with(|e| e.0.set(Some(slot))) {
            Ok(()) => slotted(slot),
            Err(_) => {
                crate::sync::lock(&FREE).given_back.push(slot);
                UNSLOTTED | UNSLOTTED_NEXT.fetch_add(1, Ordering::Relaxed)
            }
        },
        None => UNSLOTTED | UNSLOTTED_NEXT.fetch_add(1, Ordering::Relaxed),
    };
    TOKEN.with(|t| t.set(token));
    token
}

/// The token of the thread that holds `slot` now.
#[cfg(not(loom))]
fn slotted(slot: usize) -> u64 {
    // The slot came through `FREE`'s mutex, after its last thread's generation step.
    GENERATIONS[slot].load(Ordering::Relaxed) << SLOT_BITS | slot as u64
}

/// Ends the token of this thread, which holds `slot`: retired first, then the generation moves
/// on (so whoever sees it moved also sees this thread never use the old token again), then the
/// slot is free.
#[cfg(not(loom))]
fn end_slot(slot: usize) {
    TOKEN.with(|t| t.set(RETIRED));
    // BROKEN: the generation moves on while this thread may still use its old token.
    if cfg!(tidepool_broken = "token_ends_early") {
        TOKEN.with(|t| t.set(slotted(slot)));
    }
    GENERATIONS[slot].fetch_add(1, Ordering::Release);
    crate::sync::lock(&FREE).given_back.push(slot);
}

/// Whether the thread whose token this is has ended (its token retired): `false` for 0 (no
/// owner), unslotted tokens and [`RETIRED`].
#[inline]
pub(crate) fn ended(token: u64) -> bool {
    if token == 0 || token & UNSLOTTED != 0 {
        return false;
    }
    let slot = (token & ((1 << SLOT_BITS) - 1)) as usize;
    generation(slot) != token >> SLOT_BITS
}

#[cfg(not(loom))]
fn generation(slot: usize) -> u64 {
    GENERATIONS[slot].load(Ordering::Acquire)
}

// ---- loom: the same protocol over loom's primitives, reset for every execution ----

#[cfg(loom)]
loom::lazy_static! {
    static ref GENERATIONS: Vec<loom::sync::atomic::AtomicU64> =
        (0..SLOTS).map(|_| loom::sync::atomic::AtomicU64::new(1)).collect();
    static ref FREE: loom::sync::Mutex<FreeSlots> =
        loom::sync::Mutex::new(FreeSlots { next: 0, given_back: Vec::new() });
}

#[cfg(loom)]
loom::thread_local! {
    static TOKEN: std::cell::Cell<u64> = std::cell::Cell::new(0);
    static SLOT: std::cell::Cell<Option<usize>> = std::cell::Cell::new(None);
}

/// This thread's token, from loom's thread-locals.
#[cfg(loom)]
pub(crate) fn thread_token() -> u64 {
    use loom::sync::atomic::Ordering;
    let token = TOKEN.with(std::cell::Cell::get);
    if token != 0 {
        return token;
    }
    let slot = FREE.lock().unwrap().take().expect("loom models run at most SLOTS threads");
    SLOT.with(|s| s.set(Some(slot)));
    let token = GENERATIONS[slot].load(Ordering::Relaxed) << SLOT_BITS | slot as u64;
    TOKEN.with(|t| t.set(token));
    token
}

#[cfg(loom)]
fn generation(slot: usize) -> u64 {
    GENERATIONS[slot].load(loom::sync::atomic::Ordering::Acquire)
}

/// Ends this thread's token, as its thread-local destructor does under `std`.
#[cfg(loom)]
pub fn retire() {
    use loom::sync::atomic::Ordering;
    let Some(slot) = SLOT.with(|s| s.take()) else { return };
    TOKEN.with(|t| t.set(RETIRED));
    #[cfg(tidepool_broken = "token_ends_early")]
    // BROKEN: the generation moves on while this thread may still use its old token.
    TOKEN.with(|t| t.set(GENERATIONS[slot].load(Ordering::Relaxed) << SLOT_BITS | slot as u64));
    GENERATIONS[slot].fetch_add(1, Ordering::Release);
    FREE.lock().unwrap().given_back.push(slot);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{RETIRED, ended, thread_token};

    /// A thread's token is its own and stays; once the thread is gone it has ended, and a
    /// later thread that reuses its slot gets a different token.
    #[test]
    fn a_token_ends_with_its_thread_and_is_never_handed_out_again() {
        let (first, again) =
            std::thread::spawn(|| (thread_token(), thread_token())).join().unwrap();
        assert_eq!(first, again);
        assert_ne!(first, 0);
        assert_ne!(first, RETIRED);
        assert!(ended(first), "its thread is gone");
        let mine = thread_token();
        assert!(!ended(mine), "this thread is alive");
        let later: Vec<u64> =
            (0..8).map(|_| std::thread::spawn(thread_token).join().unwrap()).collect();
        assert!(later.iter().all(|&t| t != first && t != mine && ended(t)), "{later:?}");
        assert!(!ended(0) && !ended(RETIRED));
    }

    /// A thread-local destructor that runs after the token's end (a buffer kept in a
    /// thread-local, freed as its thread ends) never uses the ended token: whoever can see it
    /// ended may hand its lanes over.
    #[test]
    fn destructors_that_run_after_the_end_see_the_retired_token() {
        struct Late(u64, std::sync::mpsc::Sender<(bool, u64)>);
        impl Drop for Late {
            fn drop(&mut self) {
                let _ = self.1.send((ended(self.0), thread_token()));
            }
        }
        thread_local! {
            static LATE: std::cell::RefCell<Option<Late>> = const { std::cell::RefCell::new(None) };
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let token = std::thread::spawn(move || {
            // Registered before the token's own destructor, so (glibc runs them in reverse
            // order of registration) destroyed after it.
            LATE.with(|_| ());
            let token = thread_token();
            LATE.with(|l| *l.borrow_mut() = Some(Late(token, tx)));
            token
        })
        .join()
        .unwrap();
        let (ended_then, late) = rx.recv().unwrap();
        assert!(ended(token));
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(ended_then, "the token's destructor ran first");
        }
        if ended_then {
            assert_eq!(late, RETIRED, "a destructor after the end must not use the ended token");
        }
    }
}
