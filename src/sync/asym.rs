//! Asymmetric fences: a *light* fence for the side of a protocol that runs on every operation,
//! and a *heavy* one for the side that runs rarely, which together order memory as two
//! `SeqCst` fences would. The lane locks use them (`allocator/lane_lock.rs`): a lane's owner
//! thread enters it with a store, a light fence and a load, the global-lock side with a CAS, a
//! heavy fence and a load (Dekker's pattern: of two threads that each store, fence, then load
//! the other's flag, at least one sees the other's store).
//!
//! ```text
//!   owner, every hit                      reclaimer, rare (a flush, a credit revocation)
//!   store busy = true                     CAS locked = true
//!   light_fence()   a compiler fence  ◀── heavy_fence()   membarrier(2): every running thread
//!   load locked                           of the process executes a full fence, so the pair
//!                                         orders as two SeqCst fences
//!                                         load busy
//! ```
//!
//! On Linux the heavy fence is `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (an IPI to the
//! cores running this process's threads: a few hundred nanoseconds to microseconds), registered
//! once per process. Under loom both are `fence(SeqCst)` (loom models those fences), which is
//! the ordering the pair provides by membarrier's contract.
//!
//! Whether membarrier is used is decided once per process, by the first caller of [`biasing`]:
//! a lane lock biases a lane to an owner only where it answers `true`, so light fences run only
//! on biased lanes, and a heavy fence is only ever needed against a biased lane's owner: with
//! no membarrier (another OS, an old kernel, a sandbox that refuses the call, or
//! `TIDEPOOL_MEMBARRIER=0` in the environment) nothing is biased, every thread takes the CAS
//! as before, and neither fence runs.

use super::atomic::Ordering;

/// Whether lanes may be biased to an owner: the process has membarrier (decided, and
/// registered, at the first call). Always under loom, whose fences model the pair.
pub(crate) fn biasing() -> bool {
    #[cfg(not(loom))]
    return native::enabled();
    #[cfg(loom)]
    return true;
}

/// The light side: a compiler fence (the heavy side's membarrier orders the owner's store
/// and load); `fence(SeqCst)` under loom.
#[inline(always)]
pub(crate) fn light_fence() {
    #[cfg(not(loom))]
    std::sync::atomic::compiler_fence(Ordering::SeqCst);
    // BROKEN (`asym_fence`): under loom, the owner's store and load are not ordered at all.
    #[cfg(all(loom, not(tidepool_broken = "asym_fence")))]
    super::atomic::fence(Ordering::SeqCst);
}

/// The heavy side: a membarrier (only ever against a biased lane's owner, so [`biasing`]
/// answered `true`); `fence(SeqCst)` under loom.
#[cold]
pub(crate) fn heavy_fence() {
    #[cfg(not(loom))]
    {
        debug_assert!(native::enabled(), "a heavy fence with no membarrier");
        native::membarrier();
    }
    #[cfg(loom)]
    super::atomic::fence(Ordering::SeqCst);
}

#[cfg(not(loom))]
mod native {
    use std::sync::OnceLock;

    /// The decision: membarrier registered and used (`true`), or no lane biased (`false`).
    static DECISION: OnceLock<bool> = OnceLock::new();

    /// The decision, made now if not yet (`TIDEPOOL_MEMBARRIER=0` turns biasing off).
    pub(super) fn enabled() -> bool {
        *DECISION.get_or_init(|| {
            std::env::var("TIDEPOOL_MEMBARRIER").as_deref() != Ok("0") && register()
        })
    }

    #[cfg(target_os = "linux")]
    const QUERY: libc::c_int = 0;
    #[cfg(target_os = "linux")]
    const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    #[cfg(target_os = "linux")]
    const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    #[cfg(target_os = "linux")]
    fn call(cmd: libc::c_int) -> libc::c_long {
        // SAFETY: membarrier(2) takes two integers and a CPU id (unused without
        // MEMBARRIER_CMD_FLAG_CPU), reads and writes no memory of ours, and reports every
        // failure (an unknown command, a kernel without it, a filter refusing it) as -1.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_uint, 0 as libc::c_int) }
    }

    /// Registers the process for private expedited membarriers, if the kernel offers them.
    #[cfg(target_os = "linux")]
    fn register() -> bool {
        let offered = call(QUERY);
        let both = libc::c_long::from(PRIVATE_EXPEDITED | REGISTER_PRIVATE_EXPEDITED);
        offered >= 0 && offered & both == both && call(REGISTER_PRIVATE_EXPEDITED) == 0
    }

    #[cfg(not(target_os = "linux"))]
    fn register() -> bool {
        false
    }

    /// A full fence on every running thread of the process. The process registered (the
    /// decision was `true`); should the call fail anyway (a child after `fork`, which may not
    /// inherit the registration), it registers again, then falls back to the global command
    /// (slow, but it needs no registration). Were all to fail, owners that relaxed their fences
    /// would be left unordered, so it stops the process rather than go on unsoundly.
    #[cfg(target_os = "linux")]
    pub(super) fn membarrier() {
        const GLOBAL: libc::c_int = 1;
        let done = call(PRIVATE_EXPEDITED) == 0
            || call(REGISTER_PRIVATE_EXPEDITED) == 0 && call(PRIVATE_EXPEDITED) == 0
            || call(GLOBAL) == 0;
        if !done {
            eprintln!("tidepool: membarrier failed after registration; stopping (lane locks)");
            std::process::abort();
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn membarrier() {
        unreachable!("membarrier is never decided on outside Linux")
    }
}
