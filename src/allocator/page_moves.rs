//! Page moves between streams (expandable segments): a growth that would create pages first
//! takes whole free chunks other streams' transient ranges have cached.
//!
//! ```text
//!  donor range   [ busy ][ free chunk ][ busy ]          taker range  [ busy ]·····
//!                         │ strict: after the donor's work    ▲
//!                         │ wait_event: at once, the taker    │ mapped at its new place first
//!                         │ waits for the donor's event       │
//!                         └──────── unmapped here once the event completes (retiring)
//! ```
//!
//! The old mapping retires (`Vm::retiring`) until the donor's event completes, so the donor's
//! unfinished work never loses its memory; a growth that fails after taking chunks gives those
//! still mapped at their old place back to their donor (`give_back_taken`).

use super::expandable::*;
use super::*;
use crate::device::PhysHandle;
use page_table::Chunk;

impl<D: Device> Shared<D> {
    /// A growth failed after taking chunks: those whose old mapping still retires (`wait_event`:
    /// the donor's work may be unfinished) go back to their donor, where they are still mapped
    /// — each becomes a free run of its range again, as before the growth, with no device call
    /// and no host wait (also during a capture, where no wait is allowed); the rest of `chunks`
    /// (new chunks, chunks unmapped from an idle donor) goes back to the device. `from`: the
    /// retiring entries before the growth; `taken`: how many chunks lead `chunks` that the
    /// growth took (the rest it created). A taken chunk released here served no other stream:
    /// its pages are no longer counted as moved (broken build `failed_take_counted`: they are).
    ///
    /// Broken mode `UnsettledMoves`: nothing goes back to a donor, and chunks whose old mapping
    /// still holds their memory are released (counted in no range until a later poll). Broken
    /// build `taken_waited_for` (the fix before this one): it waits for the donors' events on
    /// the host, a counted sync, which a capture refuses — the chunks are then released while
    /// mapped.
    pub(super) fn give_back_taken(
        &self,
        st: &mut State,
        from: usize,
        chunks: &mut Vec<(PhysHandle, u64)>,
        taken: usize,
    ) {
        // Handles, unlike positions, survive `give_back_moved`'s removals (a failure path: the
        // vector allocates at most once per failed growth).
        let taken: Vec<PhysHandle> = chunks[..taken].iter().map(|c| c.0).collect();
        let moved = st.vm.retiring.len() > from && !self.broken(Broken::UnsettledMoves);
        if moved && cfg!(tidepool_broken = "taken_waited_for") {
            let taken = st.vm.retiring.split_off(from);
            let older = std::mem::replace(&mut st.vm.retiring, taken);
            self.poll_retiring(st, !self.device.capture_underway());
            st.vm.retiring.splice(0..0, older);
        } else if moved {
            self.give_back_moved(st, from, chunks);
        }
        if !cfg!(tidepool_broken = "failed_take_counted") {
            let released = chunks.iter().filter(|c| taken.contains(&c.0)).map(|c| c.1).sum();
            st.vm.counts.sub_moves(released);
        }
        self.drop_handles(st, chunks);
    }

    /// [`Shared::give_back_taken`]'s return of the chunks still mapped at their old place to
    /// their donors; they leave `chunks`.
    fn give_back_moved(&self, st: &mut State, from: usize, chunks: &mut Vec<(PhysHandle, u64)>) {
        let page = st.vm.page;
        let taken = st.vm.retiring.split_off(from);
        for mut entry in taken {
            let mut back = Vec::new();
            entry.pages.retain(|&(d, va, n, then)| match then {
                Then::Moved(h) if chunks.iter().any(|c| c.0 == h) => {
                    back.push((d, va, n, h));
                    false
                }
                _ => true,
            });
            for (d, va, n, h) in back {
                chunks.retain(|c| c.0 != h);
                let range = st.vm.ranges.get_mut(&d).expect("the donor's range");
                for p in (va..va + n * page).step_by(page as usize) {
                    range.retiring.remove(&p);
                }
                range.pages.insert(Chunk { handle: h, lo: va, pages: n });
                st.vm.counts.sub_moves(n);
                self.join_pages(st, d, va, n * page);
            }
            match entry.pages.is_empty() {
                true => st.free_events.push(entry.event),
                false => st.vm.retiring.push(entry),
            }
        }
    }

    /// Takes up to `n` pages, in whole free chunks, cached by other streams' transient ranges for
    /// a growth of `key`: under `strict` only from a stream whose work has completed, under `wait_event`
    /// from any (the growing stream waits for it on the device; the old mapping is kept until
    /// the event completes).
    pub(super) fn take_pages(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        n: u64,
        room: u64,
        got: &mut Vec<(PhysHandle, u64)>,
    ) -> Result<(), AllocError> {
        let donor =
            |r: &Range| r.key.stream != key.stream && r.key.residency == Residency::Transient;
        if n == 0 || config.cross_stream == CrossStream::Never || !st.vm.ranges.values().any(donor)
        {
            return Ok(());
        }
        let donors: Vec<u64> = st
            .vm
            .ranges
            .values()
            .filter(|r| r.key.stream != key.stream && r.key.residency == Residency::Transient)
            .map(|r| r.base)
            .collect();
        let mut taken = 0;
        for d in donors {
            let want = n.saturating_sub(taken);
            if want == 0 {
                break;
            }
            let runs = self.free_page_runs(st, d, want, room - taken, true, |_| true);
            if runs.is_empty() {
                continue;
            }
            let owner = st.vm.ranges[&d].key.stream;
            let failed = self.broken(Broken::VmEventErrors);
            // No event for this donor (`cuEventCreate` refused): nothing orders a move from it,
            // as for a refused record. Returning the error here would lose the chunks already
            // taken from earlier donors (in `got`, out of every range).
            let event = match self.event(st) {
                Ok(e) => e,
                // BROKEN (`VmEventErrors`, `taken_chunks_lost`): the allocation fails.
                Err(e) if failed || cfg!(tidepool_broken = "taken_chunks_lost") => return Err(e),
                Err(_) => break,
            };
            let done = match self.device.record_event(event, owner) {
                // The owner was destroyed here, hence drained (see `gone_drained`; a stream
                // forgotten otherwise may still run work on these pages: the next donor).
                Err(DeviceError::UnknownStream(_)) if self.gone_drained(owner) => true,
                // Nothing orders a move from this donor: the next one (or new memory).
                Err(e) => {
                    st.free_events.push(event);
                    if failed {
                        return Err(e.into()); // BROKEN: the allocation fails
                    }
                    continue;
                }
                Ok(()) if self.broken_skip_events.load(Ordering::Relaxed) => true,
                Ok(()) => match config.cross_stream {
                    CrossStream::Strict | CrossStream::Never => {
                        self.device.query_event(event).unwrap_or(false)
                    }
                    CrossStream::WaitEvent => {
                        if let Err(e) = self.device.wait_event(key.stream, event) {
                            st.free_events.push(event);
                            if failed {
                                return Err(e.into()); // BROKEN: the allocation fails
                            }
                            continue;
                        }
                        self.device.query_event(event).unwrap_or(false)
                    }
                },
            };
            if !done && config.cross_stream != CrossStream::WaitEvent {
                st.free_events.push(event);
                continue;
            }
            let mut retire = Vec::new();
            let page = st.vm.page;
            for (block, a, b) in runs {
                self.carve_unmapped(st, (d, block), a, b, owner);
                let range = st.vm.ranges.get_mut(&d).expect("donor");
                let mut va = a;
                while va < b {
                    let c = range.pages.remove(va).expect("a mapped chunk");
                    got.push((c.handle, c.pages));
                    taken += c.pages;
                    st.vm.counts.add_moves(c.pages);
                    if done && self.device.vm_unmap(DeviceAddr(va), c.pages * page).is_ok() {
                        st.vm.counts.add_unmaps(1);
                    } else {
                        range.retiring.extend((va..va + c.pages * page).step_by(page as usize));
                        retire.push((d, va, c.pages, Then::Moved(c.handle)));
                    }
                    va += c.pages * page;
                }
            }
            if retire.is_empty() {
                st.free_events.push(event);
            } else {
                st.vm.retiring.push(Retiring { event, pages: retire });
            }
        }
        Ok(())
    }
}
