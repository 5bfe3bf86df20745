//! One device's trace: its entries in time order, the blocks live before the history began,
//! annotations made scopes, and the events the replayer runs.

use super::HOW_TO_RECORD;
use super::entries::{Action, Resized, Unknown, parse_entry};
use super::segments::Segment;
use super::settings::Annotation;
use super::values::count;
use crate::error::{ErrorKind, Location, TraceError};
use crate::event::{Event, Op, Tag, Trace};
use crate::read::pickle::Seq;
use crate::read::rmm_log::StreamIds;
use crate::snapshot::{AllocatorSettings, SnapshotInfo};
use crate::validate::Validator;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// One device's part of the snapshot.
pub(super) struct DeviceInput<'a> {
    pub(super) device: u32,
    /// The device's list of entries (`None`: none).
    pub(super) entries: Option<Seq<'a>>,
    pub(super) segments: &'a [Segment],
    pub(super) annotations: &'a [&'a Annotation],
    /// Whether another device of the snapshot has entries: the history was recorded (PyTorch
    /// records every device at once), and this device did nothing while it was.
    pub(super) recorded_elsewhere: bool,
}

/// Scope markers from annotations, placed between entries by time.
struct Scopes<'a> {
    /// (time, START?, name), in time order.
    pub(super) pending: Vec<(i128, bool, &'a str)>,
    next: usize,
    /// The open outermost scope: (index in scope_names, instance id, name).
    open: Option<(u32, u64, &'a str)>,
    /// Names of open annotations nested in it (skipped).
    nested: Vec<&'a str>,
    instances: u64,
    /// Scope name -> index in `scope_names`.
    pub(super) index: HashMap<&'a str, u32>,
}

impl<'a> Scopes<'a> {
    pub(super) fn new(annotations: &[&'a Annotation]) -> Self {
        let mut pending: Vec<(i128, bool, &str)> =
            annotations.iter().filter_map(|a| Some((a.time, a.stage?, a.name.as_str()))).collect();
        pending.sort_by_key(|&(t, _, _)| t);
        Scopes {
            pending,
            next: 0,
            open: None,
            nested: Vec::new(),
            instances: 0,
            index: HashMap::new(),
        }
    }

    /// Emits the markers due before an entry at `time` (all remaining ones when `None`).
    fn emit(
        &mut self,
        time: Option<i128>,
        trace: &mut Trace,
        out: &mut Vec<(Event, i128)>,
        at: i128,
    ) {
        while let Some(&(t, start, name)) = self.pending.get(self.next) {
            let due = match time {
                None => true,
                Some(now) => {
                    if start {
                        t <= now
                    } else {
                        t < now
                    }
                }
            };
            if !due {
                break;
            }
            self.next += 1;
            if start {
                if self.open.is_some() {
                    self.nested.push(name);
                    trace.skip("external_annotations (nested)");
                    continue;
                }
                let index = *self.index.entry(name).or_insert_with(|| {
                    trace.scope_names.push(name.to_string());
                    u32::try_from(trace.scope_names.len() - 1).unwrap_or(u32::MAX)
                });
                let id = self.instances;
                self.instances += 1;
                self.open = Some((index, id, name));
                out.push((marker(Op::ScopeEnter, id, index), at));
            } else if self.nested.last() == Some(&name) {
                self.nested.pop();
            } else {
                match self.open {
                    Some((index, id, open)) if open == name => {
                        out.push((marker(Op::ScopeExit, id, index), at));
                        self.open = None;
                        self.nested.clear();
                    }
                    _ => trace.skip("external_annotations (END without START)"),
                }
            }
        }
    }

    /// Closes a scope still open at the end of the window.
    fn close(&mut self, out: &mut Vec<(Event, i128)>, at: i128) -> Option<&'a str> {
        let (index, id, name) = self.open.take()?;
        out.push((marker(Op::ScopeExit, id, index), at));
        Some(name)
    }
}

fn marker(op: Op, id: u64, scope: u32) -> Event {
    Event { op, id, bytes: 0, stream: 0, tag: Tag::Act, scope: Some(scope) }
}

fn clamp_u64(x: i128) -> u64 {
    u64::try_from(x.max(0)).unwrap_or(u64::MAX)
}

/// Builds the trace of one device: in time order when the entries have times, else (or when
/// time order is not a consistent history: a clock that stepped back between two entries
/// can put an alloc before the free of the block it reuses) in the list's order, the order
/// PyTorch recorded them in under its allocator lock.
pub(super) fn device_trace(
    input: &DeviceInput<'_>,
    settings: Option<&Arc<AllocatorSettings>>,
    name: &str,
) -> Result<Trace, TraceError> {
    match device_trace_in(input, settings, name, true) {
        // BROKEN (`time_order_only`): no second reading in list order.
        Err(e)
            if matches!(
                e.kind,
                ErrorKind::AllocOfLiveAddress(_) | ErrorKind::FreeOfUnknownAddress(_)
            ) && !cfg!(tidepool_broken = "time_order_only") =>
        {
            let mut trace = device_trace_in(input, settings, name, false).map_err(|_| e)?;
            if let Some(info) = trace.snapshot.as_mut() {
                info.notes.push(
                    "in time_us order the entries allocate a live address or free one twice; \
                     they were read in the order of the list"
                        .into(),
                );
            }
            Ok(trace)
        }
        other => other,
    }
}

fn device_trace_in(
    input: &DeviceInput<'_>,
    settings: Option<&Arc<AllocatorSettings>>,
    name: &str,
    time_order: bool,
) -> Result<Trace, TraceError> {
    let device = input.device as usize;
    let mut entries = input
        .entries
        .iter()
        .flat_map(|e| e.iter())
        .enumerate()
        .map(|(i, e)| parse_entry(device, i, e))
        .collect::<Result<Vec<_>, _>>()?;
    let mut info = SnapshotInfo {
        device: input.device,
        history: !entries.is_empty(),
        entries: entries.len() as u64,
        // BROKEN (`settings_copied_per_device`): each device's trace had a copy of its own.
        settings: match cfg!(tidepool_broken = "settings_copied_per_device") {
            true => settings.map(|s| Arc::new(AllocatorSettings::clone(s))),
            false => settings.cloned(),
        },
        ..SnapshotInfo::default()
    };
    let timed = !entries.is_empty() && entries.iter().all(|e| e.time.is_some());
    if timed {
        let out_of_order = entries.windows(2).filter(|w| w[1].time < w[0].time).count() as u64;
        info.reordered = if time_order { out_of_order } else { 0 };
        if info.reordered > 0 {
            entries.sort_by_key(|e| e.time);
            info.notes.push(match info.reordered {
                1 => "1 entry was out of time_us order and was put in order".into(),
                n => format!("{n} entries were out of time_us order and were put in order"),
            });
        }
    }
    let free_action = if entries.iter().any(|e| e.action == Action::Free) {
        Action::Free
    } else {
        Action::FreeRequested
    };

    let mut trace = Trace { name: name.to_string(), ..Trace::default() };
    let mut streams = StreamIds::default();
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new(); // addr -> (id, bytes)
    // Addresses freed in the window and not allocated since.
    let mut freed: HashSet<u64> = HashSet::new();
    // Where no `alloc` is recorded (`skip_actions`), or an action this reader does not know
    // may have allocated, a second free may be of a block the reader did not see allocated.
    let double_free_known = entries.iter().any(|e| e.action == Action::Alloc)
        && !entries.iter().any(|e| e.action == Action::Unknown);
    let mut next_id = 0u64;
    let mut freed_before: Vec<Event> = Vec::new();
    // Body events with the change of reserved bytes since the start of the window.
    let mut body: Vec<(Event, i128)> = Vec::new();
    let (mut delta, mut max_delta, mut min_delta) = (0i128, 0i128, 0i128);
    let mut unknown = Unknown::default();
    let mut resized = Resized::default();
    let mut scopes = Scopes::new(input.annotations);
    for a in input.annotations {
        if a.stage.is_none() {
            trace.skip("external_annotations (stage neither START nor END)");
        }
    }
    if !timed && !scopes.pending.is_empty() {
        for _ in &scopes.pending {
            trace.skip("external_annotations (no time_us in the trace)");
        }
        scopes.pending.clear();
    }

    for e in &entries {
        if timed {
            scopes.emit(e.time, &mut trace, &mut body, delta);
        }
        let at = |kind| TraceError::new(Location::Entry { device, index: e.index }, kind);
        match e.action {
            Action::Alloc => {
                if live.contains_key(&e.addr) {
                    return Err(at(ErrorKind::AllocOfLiveAddress(e.addr)));
                }
                freed.remove(&e.addr);
                let stream = streams.id(e.stream);
                live.insert(e.addr, (next_id, e.size));
                body.push((Event::alloc(next_id, e.size, stream, Tag::Act), delta));
                next_id += 1;
            }
            a if a == free_action => {
                let stream = streams.id(e.stream);
                let (id, bytes) = match live.remove(&e.addr) {
                    Some(x) => {
                        freed.insert(e.addr);
                        // PyTorch records a free with its allocation's requested size: another
                        // size is a fork's or a broken recording. The free is of the block the
                        // allocation made, so it is replayed at that size, and a note says so
                        // (the RMM reader refuses one: RMM's `deallocate` frees the bytes it is
                        // given).
                        // BROKEN (`snapshot_resize_unnoted`): no note.
                        if x.1 != e.size && !cfg!(tidepool_broken = "snapshot_resize_unnoted") {
                            resized.see(e.index, x.1, e.size);
                        }
                        x
                    }
                    // Freed in the window and not allocated since: a block from before the
                    // window cannot be there (it would have overlapped the window's own), and
                    // PyTorch frees a block once.
                    // BROKEN (`snapshot_double_free_prewindow`): read as a block from before.
                    None if freed.contains(&e.addr)
                        && double_free_known
                        && !cfg!(tidepool_broken = "snapshot_double_free_prewindow") =>
                    {
                        return Err(at(ErrorKind::FreeOfUnknownAddress(e.addr)));
                    }
                    None => {
                        freed.insert(e.addr);
                        // Allocated before the recorded window: live from its start.
                        freed_before.push(Event::alloc(next_id, e.size, stream, Tag::Act));
                        trace.pre_window.freed_blocks += 1;
                        trace.pre_window.freed_bytes =
                            trace.pre_window.freed_bytes.saturating_add(e.size);
                        next_id += 1;
                        (next_id - 1, e.size)
                    }
                };
                body.push((Event::free(id, bytes, stream, Tag::Act), delta));
            }
            Action::SegmentUp | Action::SegmentDown => {
                let size = i128::from(e.size);
                delta += if e.action == Action::SegmentUp { size } else { -size };
                max_delta = max_delta.max(delta);
                min_delta = min_delta.min(delta);
                info.reserved.segment_events += 1;
                trace.skip(e.name);
            }
            Action::Free | Action::FreeRequested | Action::Marker => {
                trace.skip(e.name);
            }
            Action::Unknown => unknown.skip(e.name, &mut trace),
        }
    }
    info.notes.extend(unknown.note());
    info.notes.extend(resized.note());
    if timed {
        scopes.emit(None, &mut trace, &mut body, delta);
        if let Some(open) = scopes.close(&mut body, delta) {
            info.notes.push(format!(
                "annotation `{open}` has no END: its scope runs to the end of the window"
            ));
        }
    }
    info.annotation_scopes = scopes.instances;

    // Blocks live at the snapshot that the window never allocated: live throughout. A block
    // pending its free holds its memory until its `free_completed`, after the snapshot, so it is
    // live too where `free_completed` is the free; where `free_requested` is (no entry completes
    // a free), its free was requested in the window (and read there) or before it.
    let pending_live =
        free_action == Action::Free || !entries.iter().any(|e| e.action == Action::FreeRequested);
    let mut persistent: Vec<Event> = Vec::new();
    let mut at_snapshot: u128 = 0;
    for seg in input.segments {
        at_snapshot += u128::from(seg.total_size);
        for b in &seg.blocks {
            if live.contains_key(&b.address) || (b.pending && !pending_live) {
                continue;
            }
            let stream = streams.id(seg.stream);
            persistent.push(Event::alloc(next_id, b.requested, stream, Tag::Param));
            next_id += 1;
            trace.pre_window.live_blocks += 1;
            trace.pre_window.live_bytes = trace.pre_window.live_bytes.saturating_add(b.requested);
        }
    }

    // PyTorch's reserved bytes, backwards from the snapshot.
    let at_snapshot = i128::try_from(at_snapshot).unwrap_or(i128::MAX);
    let mut start = at_snapshot.saturating_sub(delta);
    info.reserved.consistent = start.saturating_add(min_delta) >= 0;
    if !info.reserved.consistent {
        start = -min_delta;
        info.notes.push(
            "the segment entries free more than the snapshot's segments account for; PyTorch's \
             reserved bytes are raised so that their lowest point is 0"
                .into(),
        );
    }
    info.reserved.at_start = clamp_u64(start);
    info.reserved.at_snapshot = clamp_u64(at_snapshot);
    info.reserved.peak = clamp_u64(start.saturating_add(max_delta));

    let prelude = persistent.len() + freed_before.len();
    let mut events = Vec::with_capacity(prelude + body.len());
    let mut timeline = Vec::with_capacity(prelude + body.len());
    for e in persistent.into_iter().chain(freed_before) {
        events.push(e);
        timeline.push(info.reserved.at_start);
    }
    for (e, d) in body {
        events.push(e);
        timeline.push(clamp_u64(start.saturating_add(d)));
    }
    info.reserved.timeline = timeline;
    trace.events = events;
    // BROKEN (`history_note_per_device`): a device with no entries of a recorded snapshot
    // read as a snapshot taken without a history.
    if !info.history
        && input.recorded_elsewhere
        && !cfg!(tidepool_broken = "history_note_per_device")
    {
        info.notes.push(format!(
            "no entries on this device: the history was recorded (other devices have entries), \
             and this device allocated and freed nothing while it was (or its entries were cut); \
             this is the static picture at the snapshot ({} live, tagged persistent)",
            count(trace.pre_window.live_blocks, "block")
        ));
    } else if !info.history {
        info.notes.push(format!(
            "no allocation history: the snapshot was taken without \
             torch.cuda.memory._record_memory_history(), so this is the static picture at the \
             snapshot ({} live, tagged persistent). To replay the workload, {HOW_TO_RECORD}",
            count(trace.pre_window.live_blocks, "block")
        ));
    }
    trace.snapshot = Some(info);

    let mut validator = Validator::new();
    for e in &trace.events {
        validator.check(e).map_err(|k| TraceError::new(Location::Input, k))?;
    }
    validator.finish().map_err(|k| TraceError::new(Location::Input, k))?;
    Ok(trace)
}
