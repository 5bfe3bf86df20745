//! PyTorch snapshots of versions and shapes the project has no real file of, written by
//! tests/fixtures/make_version_snapshots.py (its docstring says what each holds): exact events
//! and figures, or the exact error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tidepool_trace::{Event, Op, PreWindow, Tag, Trace, read_trace};

const MB: u64 = 1 << 20;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn counts(items: &[(&str, u64)]) -> BTreeMap<String, u64> {
    items.iter().map(|&(k, n)| (k.to_string(), n)).collect()
}

fn read(name: &str) -> Trace {
    read_trace(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// PyTorch main's `annotate` entries (`torch.cuda.memory._annotate_memory`: metadata attached
/// to a live allocation) are markers; the snapshot was refused as naming an unknown action.
/// The pinned host allocator's `host_segments` / `host_traces` are not the device's.
#[test]
fn annotate_entries_are_markers_and_host_traces_are_not_read() {
    let t = read("annotate_snapshot.pickle");
    assert_eq!(t.events, vec![Event::alloc(0, 512, 0, Tag::Act), Event::free(0, 512, 0, Tag::Act)]);
    assert_eq!(
        t.skipped,
        counts(&[
            ("annotate", 2),
            ("free_requested", 1),
            ("segment_alloc", 1),
            ("segment_free", 1)
        ])
    );
    let s = t.snapshot.as_ref().unwrap();
    assert_eq!(
        (s.entries, s.reserved.at_start, s.reserved.peak, s.reserved.at_snapshot),
        (7, 0, 2 * MB, 0)
    );
    assert_eq!(s.reserved.timeline, vec![2 * MB, 2 * MB]);
}

/// A block freed while another stream used it stays `active_pending_free` until its
/// `free_completed`, after the snapshot: its memory is held through the window. One allocated
/// before the window (only its `free_requested` in it) was dropped, so the 8 MiB it held were
/// missing from every figure; one allocated in the window stayed live, as now both do.
#[test]
fn a_block_pending_its_free_is_live_to_the_end_of_the_window() {
    let t = read("pending_free_snapshot.pickle");
    let p = 8 * MB - 512;
    assert_eq!(
        t.events,
        vec![
            Event::alloc(3, p, 0, Tag::Param), // P: allocated before the window, pending
            Event::alloc(0, 2 * MB, 0, Tag::Act), // A
            Event::alloc(1, 4 * MB, 0, Tag::Act), // Q: freed in the window, pending
            Event::alloc(2, MB, 0, Tag::Act),
            Event::free(2, MB, 0, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), p + 7 * MB);
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 0, freed_bytes: 0, live_blocks: 1, live_bytes: p }
    );
    assert_eq!(t.skipped, counts(&[("free_requested", 3)]));
    let s = t.snapshot.as_ref().unwrap();
    assert_eq!((s.history, s.entries, s.reserved.at_snapshot), (true, 7, 20 * MB));
    assert!(s.notes.is_empty(), "{:?}", s.notes);
}

/// Recorded with `skip_actions=["free_completed"]`, `free_requested` is the free: both pending
/// blocks were freed in the window (P from its start), and neither is live again at its end.
#[test]
fn a_pending_block_freed_by_its_free_requested_is_not_counted_twice() {
    let t = read("pending_free_requested_snapshot.pickle");
    let p = 8 * MB - 512;
    assert_eq!(
        t.events,
        vec![
            Event::alloc(1, p, 0, Tag::Act),
            Event::alloc(0, 2 * MB, 0, Tag::Act),
            Event::free(1, p, 0, Tag::Act),
            Event::alloc(2, 4 * MB, 0, Tag::Act),
            Event::free(2, 4 * MB, 0, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), p + 2 * MB);
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 1, freed_bytes: p, live_blocks: 0, live_bytes: 0 }
    );
}

/// With no history, the static picture holds the pending blocks' memory too.
#[test]
fn the_static_picture_holds_pending_blocks() {
    let t = read("pending_free_static_snapshot.pickle");
    let p = 8 * MB - 512;
    assert_eq!(
        t.events,
        vec![
            Event::alloc(0, 2 * MB, 0, Tag::Param),
            Event::alloc(1, p, 0, Tag::Param),
            Event::alloc(2, 4 * MB, 0, Tag::Param),
        ]
    );
    assert_eq!(t.peak_live_bytes(), p + 6 * MB);
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 0, freed_bytes: 0, live_blocks: 3, live_bytes: p + 6 * MB }
    );
    assert!(!t.snapshot.as_ref().unwrap().history);
}

/// PyTorch 1.13's blocks have no `requested_size`: the block allocated before the window holds
/// its history's newest `real_size` (1000 B, as `_memory_viz.py` reads it), not its rounded
/// 1024 B. Addresses follow from the segment's; the window opens with a free of a block it
/// never saw allocated; no entry has a time.
#[test]
fn a_pytorch_1_13_snapshot_reads_its_blocks_requested_sizes_from_their_history() {
    let t = read("pytorch_1_13_snapshot.pickle");
    assert_eq!(
        t.events,
        vec![
            Event::alloc(3, 1000, 0, Tag::Param),
            Event::alloc(0, 4096, 0, Tag::Act),
            Event::free(0, 4096, 0, Tag::Act),
            Event::alloc(1, 512, 0, Tag::Act),
            Event::alloc(2, 3000, 0, Tag::Act),
            Event::free(2, 3000, 0, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), 1000 + 4096);
    assert_eq!(
        t.pre_window,
        PreWindow { freed_blocks: 1, freed_bytes: 4096, live_blocks: 1, live_bytes: 1000 }
    );
    assert_eq!(t.skipped, counts(&[("free_requested", 2)]));
    let s = t.snapshot.as_ref().unwrap();
    assert_eq!((s.entries, s.reordered, s.reserved.at_snapshot), (6, 0, 2 * MB));
}

/// A snapshot pickled in protocol 0 or 1 has no `PROTO` opcode to sniff: it was read as a CSV
/// file and refused for its header. It reads as the same snapshot in protocol 2.
#[test]
fn snapshots_pickled_in_protocols_0_and_1_read_as_in_protocol_2() {
    let want = read("pytorch_1_13_snapshot.pickle");
    for (file, name) in [
        ("protocol_0_snapshot.pickle", "protocol_0_snapshot"),
        ("protocol_1_snapshot.pickle", "protocol_1_snapshot"),
    ] {
        let mut t = read(file);
        assert_eq!(t.name, name);
        t.name.clone_from(&want.name);
        assert_eq!(t, want, "{file}");
    }
}

/// `torch.save(snapshot, f)` writes a zip archive around the pickle: said so, with what to do
/// (it was "line 1: line is not valid UTF-8").
#[test]
fn a_torch_save_archive_is_named_with_what_to_replay_instead() {
    let e = read_trace(&fixture("torch_save_snapshot.pt")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "input: not a PyTorch memory snapshot: the file is a zip archive, as torch.save() \
         writes: replay the pickle inside it (`unzip FILE '*/data.pkl'`), or save the snapshot \
         with pickle.dump() as torch.cuda.memory._dump_snapshot() does"
    );
}

/// PyTorch 2.6+ with `expandable_segments:True` (make_newer_snapshots.py): the segment grows
/// and shrinks by `segment_map`/`segment_unmap`, entries carry `compile_context` and
/// `user_metadata`, annotations and settings carry newer keys. Every figure exact.
#[test]
fn an_expandable_segments_snapshot_of_newer_pytorch_reads() {
    let t = read("expandable_snapshot.pickle");
    let scope = |op| Event { op, id: 0, bytes: 0, stream: 0, tag: Tag::Act, scope: Some(0) };
    assert_eq!(
        t.events,
        vec![
            scope(Op::ScopeEnter),
            Event::alloc(0, MB, 0, Tag::Act),
            Event::alloc(1, MB, 0, Tag::Act),
            Event::alloc(2, 2 * MB - 100, 0, Tag::Act),
            Event::free(0, MB, 0, Tag::Act),
            Event::free(1, MB, 0, Tag::Act),
            scope(Op::ScopeExit),
        ]
    );
    assert_eq!(t.scope_names, vec!["## forward ##".to_string()]);
    assert_eq!(t.peak_live_bytes(), 4 * MB - 100);
    assert_eq!(t.pre_window, PreWindow::default());
    assert_eq!(
        t.skipped,
        counts(&[("free_requested", 2), ("segment_map", 2), ("segment_unmap", 1)])
    );
    let s = t.snapshot.as_ref().unwrap();
    assert_eq!(
        (s.entries, s.reserved.at_start, s.reserved.peak, s.reserved.at_snapshot),
        (10, 0, 4 * MB, 2 * MB)
    );
    assert_eq!(s.reserved.segment_events, 3);
    assert_eq!(s.reserved.timeline, [2, 2, 2, 4, 4, 4, 4].map(|m| m * MB).to_vec());
    assert_eq!(s.annotation_scopes, 1);
    assert_eq!(s.settings.as_ref().unwrap().expandable_segments, Some(true));
    assert!(s.notes.is_empty(), "{:?}", s.notes);
}

/// A window cut by `max_entries` (make_newer_snapshots.py) opens with frees of blocks
/// allocated before it, one of whose addresses it allocates again: those are from before the
/// window, not double frees, and a block live throughout is persistent.
#[test]
fn a_window_cut_by_the_ring_reads_its_earlier_blocks() {
    let t = read("ring_snapshot.pickle");
    assert_eq!(
        t.events,
        vec![
            Event::alloc(3, 8 * MB, 0, Tag::Param), // L: live throughout
            Event::alloc(0, 4 * MB, 0, Tag::Act),   // P: freed first
            Event::alloc(1, MB, 0, Tag::Act),       // Q: freed first
            Event::free(0, 4 * MB, 0, Tag::Act),
            Event::free(1, MB, 0, Tag::Act),
            Event::alloc(2, MB / 2, 0, Tag::Act), // R at Q's address
            Event::free(2, MB / 2, 0, Tag::Act),
        ]
    );
    assert_eq!(t.peak_live_bytes(), 13 * MB);
    assert_eq!(
        t.pre_window,
        PreWindow { live_blocks: 1, live_bytes: 8 * MB, freed_blocks: 2, freed_bytes: 5 * MB }
    );
    assert_eq!(t.skipped, counts(&[("free_requested", 2), ("snapshot", 1)]));
    let s = t.snapshot.as_ref().unwrap();
    assert_eq!(
        (s.entries, s.reserved.at_start, s.reserved.peak, s.reserved.at_snapshot),
        (7, 20 * MB, 20 * MB, 20 * MB)
    );
}
