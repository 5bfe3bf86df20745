//! The replay loops' stopwatch: CPU time of the replaying thread (`CLOCK_THREAD_CPUTIME_ID`)
//! where the platform has it, else wall time.
//!
//! Replays are single-threaded and make no blocking calls in their timed loops (the simulated
//! device is unbacked and runs no kernels), so on an idle machine the two agree; on a loaded
//! one, wall time also counts the time the thread waited for a core, which no policy controls
//! and which swamps the figures of short traces. Every policy is timed with this same clock.

use std::time::Instant;

/// Measures the time between [`Stopwatch::start`] and [`Stopwatch::elapsed_ns`].
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch {
    cpu: Option<u128>,
    wall: Instant,
}

impl Stopwatch {
    /// Starts measuring.
    pub fn start() -> Stopwatch {
        Stopwatch { cpu: thread_cpu_ns(), wall: Instant::now() }
    }

    /// Nanoseconds since [`Stopwatch::start`]: the thread's CPU time where available.
    pub fn elapsed_ns(&self) -> u128 {
        match (self.cpu, thread_cpu_ns()) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => self.wall.elapsed().as_nanos(),
        }
    }
}

/// CPU time consumed by the calling thread, in nanoseconds.
#[cfg(unix)]
fn thread_cpu_ns() -> Option<u128> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128)
}

#[cfg(not(unix))]
fn thread_cpu_ns() -> Option<u128> {
    None
}

#[cfg(test)]
mod tests {
    use super::Stopwatch;

    #[cfg(unix)]
    #[test]
    fn time_spent_off_the_cpu_does_not_count() {
        let w = Stopwatch::start();
        std::thread::sleep(std::time::Duration::from_millis(60));
        let slept = w.elapsed_ns();
        assert!(slept < 20_000_000, "a sleeping thread used {slept} ns of CPU");
        let w = Stopwatch::start();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        std::hint::black_box(x);
        assert!(w.elapsed_ns() > 0, "work on the thread counts");
    }
}
