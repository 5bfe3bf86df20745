//! The offline planner baseline: knows every lifetime in advance (as a graph compiler does)
//! and packs all buffers into one region with [`pack_greedy_by_size`], aligned to 256 bytes.
//! Never-freed buffers live until the end of the trace. The region is one device malloc;
//! peak reserved = the region size from the first event on; allocated = peak of live
//! aligned bytes. Planning happens before the timed loop (it is offline work) and its
//! duration is reported as a note; the timed loop looks up each allocation's offset.

use std::time::Instant;

use super::fixed_heap::GRANULE;
use super::slots::{Slotted, Step};
use super::{Policy, PolicyResult, ReplayError};
use crate::clock::Stopwatch;
use crate::event::Trace;
use tidepool::packing::{align_up, pack_greedy_by_size};

/// The `planned` baseline.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlannedPolicy;

const NAME: &str = "planned";

impl Policy for PlannedPolicy {
    fn name(&self) -> &'static str {
        NAME
    }

    fn replay(&self, trace: &Trace, timeline: bool) -> Result<PolicyResult, ReplayError> {
        let plan_start = Instant::now();
        let intervals: Vec<(u64, u64, u64)> =
            trace.lifetimes().iter().map(|l| (l.bytes, l.alloc as u64, l.free as u64)).collect();
        let plan = pack_greedy_by_size(&intervals, GRANULE)
            .map_err(|e| ReplayError::new(NAME, e.to_string()))?;
        let plan_ms = plan_start.elapsed().as_secs_f64() * 1e3;
        // Lifetimes come in allocation order, which is the slot order.
        let slotted = Slotted::new(trace);
        let sizes: Vec<u64> =
            intervals.iter().map(|&(b, _, _)| align_up(b, GRANULE).unwrap_or(u64::MAX)).collect();

        let mut tl = if timeline { Some(Vec::with_capacity(slotted.steps.len())) } else { None };
        let (mut live, mut peak, mut top) = (0u64, 0u64, 0u64);
        let start = Stopwatch::start();
        for step in &slotted.steps {
            match *step {
                Step::Alloc { slot, .. } => {
                    top = top.max(plan.offsets[slot] + sizes[slot]);
                    live += sizes[slot];
                    peak = peak.max(live);
                }
                Step::Free { slot } => live -= sizes[slot],
                Step::Marker => {}
            }
            if let Some(tl) = tl.as_mut() {
                tl.push(plan.total_size);
            }
        }
        let elapsed_ns = start.elapsed_ns();
        debug_assert!(top <= plan.total_size);
        Ok(PolicyResult {
            name: NAME.to_string(),
            peak_reserved_bytes: plan.total_size,
            peak_allocated_bytes: peak,
            device_mallocs: u64::from(plan.total_size > 0),
            // The region is held to the end, as every policy's memory is (see `fixed_heap.rs`).
            device_frees: u64::from(
                cfg!(tidepool_broken = "baseline_teardown_free") && plan.total_size > 0,
            ),
            device_maps: 0,
            device_unmaps: 0,
            host_syncs: 0,
            ns_per_op: elapsed_ns as f64 / trace.events.len().max(1) as f64,
            reserved_timeline: tl,
            extra: vec![("plan time".into(), format!("{plan_ms:.1} ms"))],
        })
    }
}
