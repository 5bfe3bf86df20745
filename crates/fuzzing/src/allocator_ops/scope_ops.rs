//! Scope steps: bound and unbound allocations of the open scope, bursts, forgotten scoped
//! buffers, and the scope's exit, each checked against the model.

use super::{Burst, Harness, Live, OpenScope, Scoped, dev_err, excused, mapped};
use crate::program::BURST_SIZES;
use std::time::Duration;
use tidepool::device::{Access, AccessKind, DeviceAddr, Kernel, Launch, SimDevice};
use tidepool::{AllocError, PoolKind, Residency, ScopedBuffer};

impl Harness<'_> {
    /// [`Op::ScopeForget`]: a bound buffer, maybe read on another stream, then forgotten.
    ///
    /// [`Op::ScopeForget`]: crate::program::Op::ScopeForget
    pub(super) fn scope_forget(
        &mut self,
        bytes: u64,
        used: bool,
        stream: u8,
    ) -> Result<(), String> {
        let other = self.stream(stream)?;
        let Some(open) = &self.scope else { return Ok(()) };
        let calls_before = self.reserve_calls();
        let ooms_before = self.alloc.stats().num_ooms;
        let b = match open.scope.alloc(bytes) {
            Ok(b) => b,
            Err(e) => return self.scope_alloc_failed(open, bytes, e, calls_before, ooms_before),
        };
        if bytes > 0 {
            self.check_scoped(open, bytes, Scoped::of_bound(&b))?;
        }
        let s = open.scope.stream();
        if used && bytes > 0 && other != s {
            self.order_after(other, s)?;
            let kernel = Kernel {
                name: "read-forgotten",
                accesses: vec![Access { ptr: b.ptr(), bytes, kind: AccessKind::Read }],
                sleep: Duration::from_micros(5),
                body: None,
                replay: None,
            };
            self.dev.launch(other, kernel).map_err(|e| dev_err("launch", e))?;
            open.scope.record_stream(&b, other).map_err(|e| format!("record_stream: {e}"))?;
        }
        std::mem::forget(b);
        Ok(())
    }

    /// Drops the open scope, if any: its live unbound buffers are counted as escapes, and an
    /// anonymous scope touches no plan counter.
    pub(super) fn exit_scope(&mut self) -> Result<(), String> {
        let Some(open) = self.scope.take() else { return Ok(()) };
        let escaping =
            self.live.iter().filter(|l| l.run == Some(open.run) && l.buf.block_size() > 0).count()
                as u64;
        let before = self.alloc.stats();
        drop(open.scope);
        let after = self.alloc.stats();
        let escapes = after.scope_escapes - before.scope_escapes;
        ensure!(escapes == escaping, "{escapes} escapes counted, {escaping} unbound buffers live");
        let plan = |s: &tidepool::MemoryStats| (s.plan_hits, s.plan_misses, s.plan_fallbacks);
        ensure!(
            open.named || plan(&before) == plan(&after),
            "an anonymous scope moved the plan counters: {:?} -> {:?}",
            plan(&before),
            plan(&after)
        );
        Ok(())
    }

    /// Checks a buffer `Scope::alloc` or `alloc_unbound` made for `bytes` (not zero).
    fn check_scoped(&self, open: &OpenScope<'_>, bytes: u64, b: Scoped) -> Result<(), String> {
        let (Some(rounded), Some(now)) =
            (open.config.sizing.round(bytes), self.alloc.config().sizing.round(bytes))
        else {
            return Err(format!("a scoped request of {bytes} bytes beyond MAX_REQUEST succeeded"));
        };
        let s = open.scope.stream();
        let align = self.granularity;
        // The scope rounds with its own configuration; pool blocks come from the allocator's.
        ensure!(
            b.len == bytes
                && b.stream == s
                && b.size >= rounded.min(now)
                && b.size.is_multiple_of(align)
                && b.ptr != DeviceAddr::NULL
                && b.ptr.0.is_multiple_of(align),
            "bad scoped buffer for {bytes} bytes (rounded {rounded}) on {s}: {b:?}"
        );
        ensure!(!b.planned || open.named, "an anonymous scope served a planned buffer: {b:?}");
        ensure!(!b.planned || b.size == rounded, "a planned slice of the wrong size: {b:?}");
        Ok(())
    }

    /// `alloc_unbound` in the open scope; the buffer joins the live list.
    pub(super) fn scope_alloc(&mut self, bytes: u64) -> Result<(), String> {
        let Some(open) = &self.scope else { return Ok(()) };
        let s = open.scope.stream();
        let calls_before = self.reserve_calls();
        let ooms_before = self.alloc.stats().num_ooms;
        let made = open.scope.alloc_unbound(bytes);
        let run = Some(open.run);
        match made {
            Ok(b) if bytes == 0 => {
                ensure!(
                    b.ptr() == DeviceAddr::NULL && b.block_size() == 0 && b.stream() == s,
                    "a zero-byte scoped buffer must be empty at NULL on {s}: {b:?}"
                );
                let users = vec![s];
                let (residency, kind) = (Some(Residency::Transient), PoolKind::Small);
                self.live.push(Live { buf: b, residency, kind, users, run });
            }
            Ok(b) => {
                self.check_scoped(open, bytes, Scoped::of(&b))?;
                let config = if b.is_planned() { open.config.clone() } else { self.alloc.config() };
                let kind = config.sizing.kind(config.sizing.round(bytes).unwrap_or(bytes));
                let users = vec![s];
                let residency = Self::placed(&config, kind, Residency::Transient, &self.dev);
                self.live.push(Live { buf: b, residency, kind, users, run });
            }
            Err(e) => self.scope_alloc_failed(open, bytes, e, calls_before, ooms_before)?,
        }
        Ok(())
    }

    /// A scoped allocation of `bytes` failed with `e`: it must have a reason.
    fn scope_alloc_failed(
        &self,
        open: &OpenScope<'_>,
        bytes: u64,
        e: AllocError,
        calls_before: u64,
        ooms_before: u64,
    ) -> Result<(), String> {
        let s = open.scope.stream();
        match e {
            AllocError::InvalidSize { requested } => {
                let fits = open.config.sizing.round(bytes).is_some()
                    && self.alloc.config().sizing.round(bytes).is_some();
                ensure!(
                    !fits && requested == bytes,
                    "InvalidSize({requested}) for a valid scoped request of {bytes} bytes"
                );
            }
            AllocError::OutOfMemory(report) => {
                // One failed request, counted once the ladder gave up (a plan region's denied
                // reservation counts nothing; a rejection is not counted as an out-of-memory).
                let ooms = self.alloc.stats().num_ooms;
                ensure!(
                    ooms == ooms_before + u64::from(!report.rejected),
                    "num_ooms went {ooms_before} -> {ooms}"
                );
                ensure!(
                    report.requested == bytes && report.stream == s,
                    "OOM report does not describe the scoped request ({bytes} on {s}): {report:?}"
                );
                self.explain_oom(&report, calls_before)?;
            }
            e if excused(&e) => self.note_excused(),
            e => return Err(format!("scoped alloc of {bytes} bytes on {s}: unexpected error {e}")),
        }
        Ok(())
    }

    /// `n` bound allocations in the open scope, freed in an order drawn from `seed` (some
    /// between the allocations, the rest at the end). Each new buffer must be inside a live
    /// device segment and an allocated transient block of the scope's stream, and overlap no
    /// live buffer, bound or not.
    pub(super) fn scope_burst(&self, n: u8, seed: u32) -> Result<(), String> {
        let Some(open) = &self.scope else { return Ok(()) };
        let scope = &open.scope;
        let mut rng = Burst::new(seed);
        let outside: Vec<(u64, u64)> = self
            .live
            .iter()
            .map(|l| &l.buf)
            .chain(&self.others)
            .filter(|b| b.block_size() > 0)
            .map(|b| (b.ptr().0, b.block_size()))
            .collect();
        let mut held: Vec<ScopedBuffer<'_, SimDevice>> = Vec::new();
        for _ in 0..n {
            let bytes = BURST_SIZES[rng.below(BURST_SIZES.len())];
            let calls_before = self.reserve_calls();
            let ooms_before = self.alloc.stats().num_ooms;
            match scope.alloc(bytes) {
                Ok(b) => {
                    self.check_scoped(open, bytes, Scoped::of_bound(&b))?;
                    let (lo, hi) = (b.ptr().0, b.ptr().0 + b.block_size());
                    let segs = self.dev.live_segments();
                    ensure!(
                        segs.iter().any(|&(p, len)| p.0 <= lo && hi <= p.0 + len)
                            || mapped(&self.dev.live_mappings(), lo, hi),
                        "bound {b:?} is in no live device segment or mapping: {segs:x?}"
                    );
                    let spans = outside
                        .iter()
                        .copied()
                        .chain(held.iter().map(|h| (h.ptr().0, h.block_size())));
                    for (p, len) in spans {
                        ensure!(hi <= p || p + len <= lo, "bound {b:?} overlaps [{p:#x}, +{len})");
                    }
                    self.check_in_block(
                        b.ptr(),
                        b.block_size(),
                        b.stream(),
                        &self.alloc.snapshot(),
                    )
                    .map_err(|e| format!("bound {b:?}: {e}"))?;
                    held.push(b);
                }
                Err(e) => self.scope_alloc_failed(open, bytes, e, calls_before, ooms_before)?,
            }
            if !held.is_empty() && rng.below(3) == 0 {
                drop(held.remove(rng.below(held.len())));
            }
        }
        while !held.is_empty() {
            drop(held.remove(rng.below(held.len())));
        }
        Ok(())
    }
}
