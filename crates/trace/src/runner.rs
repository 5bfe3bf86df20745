//! Runs policies over a trace: each policy `repeats` times (timeline off), the median
//! ns/op kept, plus one untimed extra replay with the timeline on when a plot is wanted.
//! Memory figures come from the first replay (every policy here is deterministic).
//!
//! The repeats are interleaved — round `r` replays every policy once, in order — so that the
//! medians of all policies are taken over the same stretch of time: on a shared machine whose
//! load drifts, a ratio of two policies' medians then compares like with like (run one policy's
//! repeats after the other's and a load change between them lands in the ratio).

use super::event::Trace;
use super::policy::{Policy, PolicyResult, ReplayError, ReplayOptions};
use super::report::Report;

/// The most ns/op samples reserved per policy before the replays run (more grow as needed).
const MAX_RESERVED_SAMPLES: usize = 1024;

/// Median of a non-empty slice (mean of the middle two for even lengths); 0 when empty.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 }
}

/// Replays each policy and collects a [`Report`]. `progress` is called after every replay
/// (there are `policies.len() × (repeats + timeline)` of them).
pub fn run_policies(
    trace: &Trace,
    policies: &[Box<dyn Policy>],
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, ReplayError> {
    let repeats = opts.repeats.max(1);
    let mut firsts: Vec<Option<PolicyResult>> = policies.iter().map(|_| None).collect();
    // The samples grow with the replays actually run: a count from the command line is no
    // size to reserve up front (`--repeats 4294967295` asked for 32 GiB before the first
    // replay, and `usize::MAX` overflows the capacity).
    // BROKEN (`repeats_preallocated`): reserved up front.
    let reserve = match cfg!(tidepool_broken = "repeats_preallocated") {
        true => repeats,
        false => repeats.min(MAX_RESERVED_SAMPLES),
    };
    let mut ns: Vec<Vec<f64>> = policies.iter().map(|_| Vec::with_capacity(reserve)).collect();
    for _ in 0..repeats {
        for (i, policy) in policies.iter().enumerate() {
            let r = policy.replay(trace, false)?;
            ns[i].push(r.ns_per_op);
            firsts[i].get_or_insert(r);
            progress(policy.name());
        }
    }
    let mut results = Vec::with_capacity(policies.len());
    for ((policy, first), ns) in policies.iter().zip(firsts).zip(&mut ns) {
        let mut result = first.unwrap_or_else(|| unreachable_result(policy.name()));
        result.ns_per_op = median(ns);
        if opts.timeline {
            result.reserved_timeline = policy.replay(trace, true)?.reserved_timeline;
            progress(policy.name());
        }
        results.push(result);
    }
    Ok(Report::new(trace, results))
}

/// Placeholder for the (impossible) case of zero repeats; `repeats` is clamped to ≥ 1.
fn unreachable_result(name: &str) -> PolicyResult {
    PolicyResult::nothing(name)
}

#[cfg(test)]
mod tests {
    use super::{median, run_policies, unreachable_result};
    use crate::event::Trace;
    use crate::policy::{Policy, PolicyResult, ReplayError, ReplayOptions};
    use std::cell::RefCell;
    use std::rc::Rc;

    type Log = Rc<RefCell<Vec<(&'static str, bool)>>>;

    /// A policy that notes each replay in a shared log and reports a fixed ns/op.
    struct Noting {
        name: &'static str,
        log: Log,
        ns: f64,
    }

    impl Policy for Noting {
        fn name(&self) -> &'static str {
            self.name
        }
        fn replay(&self, _: &Trace, timeline: bool) -> Result<PolicyResult, ReplayError> {
            self.log.borrow_mut().push((self.name, timeline));
            let n = self.log.borrow().len() as f64;
            // Every figure 0 but the two the test reads.
            let mut r = unreachable_result(self.name);
            (r.peak_reserved_bytes, r.ns_per_op) = (n as u64, self.ns * n);
            Ok(r)
        }
    }

    /// Rounds of every policy once, then the timeline replays; each policy's median is over
    /// its own replays, and its memory figures are its first replay's.
    #[test]
    fn repeats_are_interleaved_across_policies() {
        let log: Log = Rc::default();
        let a: Box<dyn Policy> = Box::new(Noting { name: "a", log: log.clone(), ns: 1.0 });
        let b: Box<dyn Policy> = Box::new(Noting { name: "b", log: log.clone(), ns: 10.0 });
        let opts = ReplayOptions { repeats: 3, timeline: true, ..ReplayOptions::default() };
        let mut calls = Vec::new();
        let report =
            run_policies(&Trace::default(), &[a, b], &opts, &mut |n| calls.push(n.to_string()))
                .unwrap();
        let order: Vec<_> = log.borrow().clone();
        let r = |n| (n, false);
        assert_eq!(
            order,
            [r("a"), r("b"), r("a"), r("b"), r("a"), r("b"), ("a", true), ("b", true)]
        );
        assert_eq!(calls, ["a", "b", "a", "b", "a", "b", "a", "b"]);
        let p = &report.policies;
        // a's replays were the 1st, 3rd and 5th: median 3 × 1.0; b's the 2nd, 4th, 6th.
        assert_eq!((p[0].ns_per_op, p[0].peak_reserved_bytes), (3.0, 1));
        assert_eq!((p[1].ns_per_op, p[1].peak_reserved_bytes), (40.0, 2));
    }

    /// A policy whose `fail_at`-th replay fails.
    struct Failing {
        done: RefCell<usize>,
        fail_at: usize,
    }

    impl Policy for Failing {
        fn name(&self) -> &'static str {
            "failing"
        }
        fn replay(&self, _: &Trace, _: bool) -> Result<PolicyResult, ReplayError> {
            *self.done.borrow_mut() += 1;
            if *self.done.borrow() == self.fail_at {
                return Err(ReplayError::new("failing", "replay 3 failed"));
            }
            Ok(unreachable_result("failing"))
        }
    }

    /// A huge repeat count reserves nothing up front (`usize::MAX` samples overflowed the
    /// capacity, `u32::MAX` from the command line asked for 32 GiB): the replays run, here
    /// until the third fails, and its error comes back.
    #[test]
    fn huge_repeats_reserve_nothing_up_front() {
        let failing = Failing { done: RefCell::new(0), fail_at: 3 };
        let policies: [Box<dyn Policy>; 1] = [Box::new(failing)];
        let opts = ReplayOptions { repeats: usize::MAX, ..ReplayOptions::default() };
        let mut calls = 0;
        let err = run_policies(&Trace::default(), &policies, &opts, &mut |_| calls += 1)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(err, ReplayError::new("failing", "replay 3 failed"));
        assert_eq!(calls, 2);
        // The runner works on afterwards.
        let opts = ReplayOptions { repeats: 3, ..ReplayOptions::default() };
        let ok: [Box<dyn Policy>; 1] =
            [Box::new(Failing { done: RefCell::new(0), fail_at: usize::MAX })];
        let report = run_policies(&Trace::default(), &ok, &opts, &mut |_| {}).unwrap();
        assert_eq!(report.policies.len(), 1);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
