//! CPU-time clocks. The scheduler thread's CPU time is what the simulated clock charges for the
//! engine's own scheduling work, so time the thread spends preempted by other processes on a
//! busy machine does not count as work (wall time would charge it, and only to the run with more
//! threads); the process's CPU time tells a bench how much of the cores it used itself.

use std::time::Duration;

/// CPU time consumed by the calling thread so far (`CLOCK_THREAD_CPUTIME_ID`); zero if the
/// clock cannot be read.
#[must_use]
pub fn thread_cpu_time() -> Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time consumed by every thread of this process so far (`CLOCK_PROCESS_CPUTIME_ID`); zero
/// if the clock cannot be read.
#[must_use]
pub fn process_cpu_time() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call, and both CPU-time
    // clocks this module passes are clocks every supported (Linux) kernel provides.
    let rc = unsafe { libc::clock_gettime(clock, &raw mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u32::try_from(ts.tv_nsec).unwrap_or(0);
    Duration::new(secs, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_grows_with_work_and_not_with_sleep() {
        let start = thread_cpu_time();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let worked = thread_cpu_time();
        assert!(worked > start, "busy work consumed no CPU time ({x})");
        let wall = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        let wall = wall.elapsed();
        let slept = thread_cpu_time().saturating_sub(worked);
        // A sleeping thread is not running: its CPU time grows by less than the time slept.
        assert!(slept < wall, "{slept:?} of CPU time while sleeping {wall:?}");
    }

    #[test]
    fn the_process_clock_counts_this_thread_and_another_s_work() {
        let before = process_cpu_time();
        let own = thread_cpu_time();
        let other = std::thread::spawn(|| {
            let mut x = 0u64;
            for i in 0..5_000_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
            thread_cpu_time()
        })
        .join()
        .unwrap();
        let after = process_cpu_time();
        // The process's clock includes the other thread's whole run and this thread's time.
        assert!(after >= before + other, "{before:?} + {other:?} > {after:?}");
        assert!(after >= own, "{after:?} < this thread's {own:?}");
    }
}
