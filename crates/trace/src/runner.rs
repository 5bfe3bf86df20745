//! Runs policies over a trace: each policy `repeats` times (timeline off), the median
//! ns/op kept, plus one untimed extra replay with the timeline on when a plot is wanted.
//! Memory figures come from the first replay (every policy here is deterministic).

use super::event::Trace;
use super::policy::{Policy, PolicyResult, ReplayError, ReplayOptions};
use super::report::Report;

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
    let mut results = Vec::with_capacity(policies.len());
    for policy in policies {
        let mut first: Option<PolicyResult> = None;
        let mut ns = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            let r = policy.replay(trace, false)?;
            ns.push(r.ns_per_op);
            first.get_or_insert(r);
            progress(policy.name());
        }
        let mut result = first.unwrap_or_else(|| unreachable_result(policy.name()));
        result.ns_per_op = median(&mut ns);
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
    PolicyResult {
        name: name.to_string(),
        peak_reserved_bytes: 0,
        peak_allocated_bytes: 0,
        device_mallocs: 0,
        device_frees: 0,
        device_maps: 0,
        device_unmaps: 0,
        host_syncs: 0,
        ns_per_op: 0.0,
        reserved_timeline: None,
        extra: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
