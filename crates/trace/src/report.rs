//! The replay report: per policy peak reserved, peak allocated, fragmentation
//! (1 − peak live / peak reserved), device calls, host syncs and median ns/op, rendered as a
//! text table (binary byte units) or as one JSON object:
//!
//! ```text
//! {"trace": str, "events": int, "peak_live_bytes": int,
//!  "policies": [{"name": str, "peak_reserved_bytes": int, "peak_allocated_bytes": int,
//!                "fragmentation": float, "device_mallocs": int, "device_frees": int,
//!                "device_maps": int, "device_unmaps": int, "host_syncs": int,
//!                "ns_per_op": float}]}
//! ```

use std::fmt::Write as _;

use serde::Serialize;

use super::event::Trace;
use super::policy::PolicyResult;
use tidepool::Bytes;

/// Everything one replay run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Trace name.
    pub trace: String,
    /// Number of events.
    pub events: usize,
    /// Peak live requested bytes: the lower bound for every policy.
    pub peak_live_bytes: u64,
    /// Live requested bytes after each event.
    pub live_timeline: Vec<u64>,
    /// One result per policy, in run order.
    pub policies: Vec<PolicyResult>,
}

#[derive(Serialize)]
struct JsonReport<'a> {
    trace: &'a str,
    events: usize,
    peak_live_bytes: u64,
    policies: Vec<JsonPolicy<'a>>,
}

#[derive(Serialize)]
struct JsonPolicy<'a> {
    name: &'a str,
    peak_reserved_bytes: u64,
    peak_allocated_bytes: u64,
    fragmentation: f64,
    device_mallocs: u64,
    device_frees: u64,
    device_maps: u64,
    device_unmaps: u64,
    host_syncs: u64,
    ns_per_op: f64,
}

/// 1 − peak live / peak reserved (0 when nothing was reserved).
pub fn fragmentation(peak_live: u64, peak_reserved: u64) -> f64 {
    if peak_reserved == 0 { 0.0 } else { 1.0 - peak_live as f64 / peak_reserved as f64 }
}

impl Report {
    /// A report for `trace` from policy results.
    pub fn new(trace: &Trace, policies: Vec<PolicyResult>) -> Self {
        Report {
            trace: trace.name.clone(),
            events: trace.events.len(),
            peak_live_bytes: trace.peak_live_bytes(),
            live_timeline: trace.live_bytes_timeline(),
            policies,
        }
    }

    /// The JSON object described in the module docs (one line).
    pub fn to_json(&self) -> String {
        let report = JsonReport {
            trace: &self.trace,
            events: self.events,
            peak_live_bytes: self.peak_live_bytes,
            policies: self
                .policies
                .iter()
                .map(|p| JsonPolicy {
                    name: &p.name,
                    peak_reserved_bytes: p.peak_reserved_bytes,
                    peak_allocated_bytes: p.peak_allocated_bytes,
                    fragmentation: fragmentation(self.peak_live_bytes, p.peak_reserved_bytes),
                    device_mallocs: p.device_mallocs,
                    device_frees: p.device_frees,
                    device_maps: p.device_maps,
                    device_unmaps: p.device_unmaps,
                    host_syncs: p.host_syncs,
                    // JSON has no NaN/inf; a policy reporting one gets 0.
                    ns_per_op: if p.ns_per_op.is_finite() { p.ns_per_op } else { 0.0 },
                })
                .collect(),
        };
        serde_json::to_string(&report).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The text table, followed by each policy's notes.
    pub fn to_table(&self) -> String {
        let header = [
            "policy",
            "peak reserved",
            "peak allocated",
            "frag",
            "mallocs",
            "frees",
            "maps",
            "unmaps",
            "syncs",
            "ns/op",
        ];
        let mut rows: Vec<[String; 10]> = vec![header.map(String::from)];
        for p in &self.policies {
            rows.push([
                p.name.clone(),
                Bytes(p.peak_reserved_bytes).to_string(),
                Bytes(p.peak_allocated_bytes).to_string(),
                format!(
                    "{:.1}%",
                    100.0 * fragmentation(self.peak_live_bytes, p.peak_reserved_bytes)
                ),
                p.device_mallocs.to_string(),
                p.device_frees.to_string(),
                p.device_maps.to_string(),
                p.device_unmaps.to_string(),
                p.host_syncs.to_string(),
                format!("{:.1}", p.ns_per_op),
            ]);
        }
        rows.push([
            "lower bound".into(),
            Bytes(self.peak_live_bytes).to_string(),
            Bytes(self.peak_live_bytes).to_string(),
            "0.0%".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
        let mut widths = [0usize; 10];
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "trace {}: {} events, peak live {} ({} B)",
            self.trace,
            self.events,
            Bytes(self.peak_live_bytes),
            self.peak_live_bytes
        );
        for (i, row) in rows.iter().enumerate() {
            let mut line = String::new();
            for (c, (cell, w)) in row.iter().zip(widths).enumerate() {
                if c == 0 {
                    let _ = write!(line, "{cell:<w$}");
                } else {
                    let _ = write!(line, "  {cell:>w$}");
                }
            }
            let _ = writeln!(out, "{}", line.trim_end());
            if i == 0 {
                let total: usize = widths.iter().sum::<usize>() + 2 * (widths.len() - 1);
                let _ = writeln!(out, "{}", "-".repeat(total));
            }
        }
        for p in &self.policies {
            if !p.extra.is_empty() {
                let notes: Vec<String> = p.extra.iter().map(|(k, v)| format!("{k} {v}")).collect();
                let _ = writeln!(out, "  {}: {}", p.name, notes.join(", "));
            }
        }
        out
    }
}
