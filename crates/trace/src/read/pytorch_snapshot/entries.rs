//! The history's entries (`device_traces`): their actions, the ones tidepool does not know,
//! and frees recorded with another size than their allocation's.

use super::values::{field, key, record, stream_field, time_us};
use crate::error::{ErrorKind, Location, TraceError, echo};
use crate::event::Trace;
use crate::read::pickle::Obj;

/// What a trace entry does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Alloc,
    /// `free_completed` or `free`.
    Free,
    FreeRequested,
    /// `segment_alloc`, `segment_map`: reserved grows.
    SegmentUp,
    /// `segment_free`, `segment_unmap`: reserved shrinks.
    SegmentDown,
    /// `oom`, `snapshot`, `user_defined`, `annotate`.
    Marker,
    /// An action this reader does not know: skipped, counted and noted.
    Unknown,
}

/// Distinct unknown actions counted under their own names; more are counted together (the
/// names come from the input, so their number is bounded here, not by it).
const MAX_UNKNOWN_NAMES: usize = 8;

/// The unknown actions of one device, for the skipped counts and the note.
#[derive(Default)]
pub(super) struct Unknown {
    /// Distinct names seen (at most [`MAX_UNKNOWN_NAMES`]), each cut by `echo`.
    names: Vec<String>,
    pub(super) entries: u64,
}

impl Unknown {
    pub(super) fn skip(&mut self, name: &str, trace: &mut Trace) {
        self.entries += 1;
        let name = echo(name);
        if !self.names.contains(&name) {
            if self.names.len() == MAX_UNKNOWN_NAMES {
                trace.skip("other unknown actions");
                return;
            }
            self.names.push(name.clone());
        }
        trace.skip(&format!("{name} (unknown action)"));
    }

    pub(super) fn note(&self) -> Option<String> {
        if self.entries == 0 {
            return None;
        }
        let names: Vec<String> = self.names.iter().map(|n| format!("`{n}`")).collect();
        let more = if self.names.len() == MAX_UNKNOWN_NAMES { " and others" } else { "" };
        Some(format!(
            "{} of action{} {}{more} unknown to this reader {} skipped (as PyTorch's viewer \
             skips them); if such an entry allocates or frees memory, the replay misses it",
            if self.entries == 1 { "1 entry".into() } else { format!("{} entries", self.entries) },
            if self.names.len() == 1 && more.is_empty() { "" } else { "s" },
            names.join(", "),
            if self.entries == 1 { "was" } else { "were" },
        ))
    }
}

/// One trace entry with what the reader uses.
pub(super) struct Entry<'a> {
    pub(super) index: usize,
    pub(super) action: Action,
    /// The action's name (for counting skipped entries).
    pub(super) name: &'a str,
    pub(super) addr: u64,
    pub(super) size: u64,
    pub(super) stream: u64,
    pub(super) time: Option<i128>,
}

/// Frees recorded with another size than their allocation's: how many, and the first.
#[derive(Default)]
pub(super) struct Resized {
    frees: u64,
    /// The first: its entry's index, the allocation's size and the free's.
    first: Option<(usize, u64, u64)>,
}

impl Resized {
    pub(super) fn see(&mut self, index: usize, allocated: u64, freed: u64) {
        self.frees += 1;
        self.first.get_or_insert((index, allocated, freed));
    }

    pub(super) fn note(&self) -> Option<String> {
        let (index, allocated, freed) = self.first?;
        let (count, first, each) = match self.frees {
            1 => ("1 free was".to_string(), "", "it is"),
            n => (format!("{n} frees were"), "the first, ", "each is"),
        };
        Some(format!(
            "{count} recorded with another size than its allocation's ({first}entry {index}: \
             {freed} B freed, {allocated} B allocated); {each} replayed as a free of the block \
             its allocation made"
        ))
    }
}

pub(super) fn parse_entry(
    device: usize,
    index: usize,
    entry: Obj<'_>,
) -> Result<Entry<'_>, TraceError> {
    let structure =
        |s: String| TraceError::new(Location::Entry { device, index }, ErrorKind::BadStructure(s));
    match entry {
        Obj::Dict(_) => record(entry, &structure)?,
        _ => return Err(structure("entry is not a dict".into())),
    }
    let name = match key(entry, "action") {
        Some(Obj::Str(s)) => s,
        Some(_) => return Err(structure("`action` is not a string".into())),
        None => return Err(structure("missing key `action`".into())),
    };
    let action = match name {
        "alloc" => Action::Alloc,
        "free_completed" | "free" => Action::Free,
        "free_requested" => Action::FreeRequested,
        "segment_alloc" | "segment_map" => Action::SegmentUp,
        "segment_free" | "segment_unmap" => Action::SegmentDown,
        // `workspace_snapshot`: torch_npu (Ascend) writes the same snapshot format with it.
        "oom" | "snapshot" | "user_defined" | "workspace_snapshot" => Action::Marker,
        // `annotate` (`torch.cuda.memory._annotate_memory`, PyTorch's main branch): metadata
        // attached to a live allocation, its `addr` that allocation's: nothing is allocated or
        // freed.
        // BROKEN (`annotate_refused`): an unknown action that refused the whole snapshot.
        #[cfg(not(tidepool_broken = "annotate_refused"))]
        "annotate" => Action::Marker,
        // Any other action is one this reader does not know (PyTorch keeps adding them):
        // skipped and counted, as `MemoryViz.js` ignores it, with a note (see `Unknown`).
        // BROKEN (`unknown_action_refused`): it refused the whole snapshot.
        #[cfg(not(tidepool_broken = "unknown_action_refused"))]
        _ => Action::Unknown,
        #[cfg(tidepool_broken = "unknown_action_refused")]
        other => {
            return Err(TraceError::new(
                Location::Entry { device, index },
                ErrorKind::UnknownOp(echo(other)),
            ));
        }
    };
    let time = match key(entry, "time_us") {
        None | Some(Obj::None) => None,
        Some(v) => Some(time_us(v).map_err(structure)?),
    };
    let (addr, size, stream) = if matches!(action, Action::Marker | Action::Unknown) {
        (0, 0, 0)
    } else {
        (
            field(entry, "addr", &structure)?,
            field(entry, "size", &structure)?,
            stream_field(entry, &structure)?,
        )
    };
    Ok(Entry { index, action, name, addr, size, stream, time })
}
