//! An asymmetric fence pair: a *light* fence that costs the frequent side nothing at run time
//! (a compiler fence), and a *heavy* fence that the rare side pays for both (Linux's
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`: every running thread of the process executes
//! a full memory barrier before the call returns). Folly's `asymmetricLightBarrier` /
//! `asymmetricHeavyBarrier` and the JVM's biased locks rest on the same pair.
//!
//! ```text
//!   frequent side                      rare side
//!   store A = 1 (Relaxed)              store B = 1 (Relaxed)
//!   light()                            heavy()
//!   load  B (Acquire)                  load  A (Acquire)
//!   ─────────────────────────────────────────────────────────────
//!   at least one of the loads sees 1 (Dekker's guarantee, as if both sides had a SeqCst fence)
//! ```
//!
//! [`supported`] says whether the heavy fence exists here (Linux ≥ 4.14 with the command not
//! refused by a seccomp filter; asked and registered once per process). Where it does not, a
//! caller must not rely on the pair at all (the lane lock then takes its compare-and-swap path).
//!
//! Under loom the pair is modelled by a read-modify-write of one shared atomic on each side:
//! RMWs of one location are totally ordered and each reads the last, so whichever fence comes
//! second sees everything stored before the first, which is the pair's guarantee.

#[cfg(all(not(loom), target_os = "linux"))]
mod imp {
    use std::sync::atomic::{AtomicU8, Ordering};

    /// `membarrier(2)` commands (kernel ABI, `linux/membarrier.h`).
    const CMD_QUERY: libc::c_long = 0;
    const CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    /// 0: not asked yet; 1: registered; 2: unavailable.
    static STATE: AtomicU8 = AtomicU8::new(0);

    fn membarrier(cmd: libc::c_long) -> libc::c_long {
        // SAFETY: `membarrier` takes two integer arguments and touches no memory of ours; an
        // unknown or refused command returns -1 (ENOSYS, EINVAL or EPERM), never undefined
        // behaviour.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_uint, 0 as libc::c_int) }
    }

    pub fn supported() -> bool {
        match STATE.load(Ordering::Acquire) {
            1 => true,
            2 => false,
            _ => {
                let commands = membarrier(CMD_QUERY);
                let ok = commands >= 0
                    && commands & CMD_PRIVATE_EXPEDITED != 0
                    && membarrier(CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
                // Several threads may ask at once: registering twice is harmless, and all
                // reach the same answer.
                STATE.store(if ok { 1 } else { 2 }, Ordering::Release);
                ok
            }
        }
    }

    pub fn heavy() {
        debug_assert_eq!(STATE.load(Ordering::Relaxed), 1, "heavy fence before `supported`");
        if membarrier(CMD_PRIVATE_EXPEDITED) == 0 {
            return;
        }
        // Registered (`supported`), so refused only where the registration did not carry over
        // (a child after `fork` may start unregistered): register again, once, and retry.
        if membarrier(CMD_REGISTER_PRIVATE_EXPEDITED) == 0 && membarrier(CMD_PRIVATE_EXPEDITED) == 0
        {
            return;
        }
        // Going on would break the lane locks' exclusion silently, so this is fatal.
        eprintln!("tidepool: membarrier(PRIVATE_EXPEDITED) refused after it was registered");
        std::process::abort();
    }
}

#[cfg(all(not(loom), not(target_os = "linux")))]
mod imp {
    pub fn supported() -> bool {
        false
    }

    pub fn heavy() {
        unreachable!("no heavy fence on this platform: `supported` is false");
    }
}

/// Whether [`heavy`] exists on this machine (asked once per process).
#[cfg(not(loom))]
#[inline]
pub(crate) fn supported() -> bool {
    imp::supported()
}

/// The frequent side's fence: keeps the compiler from moving memory accesses across it; the
/// processor's ordering comes from the other side's [`heavy`].
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn light() {
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

/// The rare side's fence: returns once every thread of the process has passed a full memory
/// barrier. Only where [`supported`] said so.
#[cfg(not(loom))]
pub(crate) fn heavy() {
    imp::heavy();
}

#[cfg(loom)]
loom::lazy_static! {
    static ref PAIR: loom::sync::atomic::AtomicUsize = loom::sync::atomic::AtomicUsize::new(0);
}

/// Under loom the heavy fence is always there.
#[cfg(loom)]
pub(crate) fn supported() -> bool {
    true
}

/// Under loom: one side of the modelled pair (see the module docs).
#[cfg(loom)]
pub(crate) fn light() {
    PAIR.fetch_add(0, loom::sync::atomic::Ordering::AcqRel);
}

/// Under loom: the other side of the modelled pair.
#[cfg(loom)]
pub(crate) fn heavy() {
    PAIR.fetch_add(0, loom::sync::atomic::Ordering::AcqRel);
}

#[cfg(all(test, not(loom), target_os = "linux"))]
mod tests {
    /// On Linux (CI, this machine) the fence is there, and calling it returns.
    #[test]
    fn heavy_fence_runs_where_supported() {
        if !super::supported() {
            eprintln!("skipped: membarrier(PRIVATE_EXPEDITED) is refused here");
            return;
        }
        super::heavy();
        super::heavy();
    }
}
