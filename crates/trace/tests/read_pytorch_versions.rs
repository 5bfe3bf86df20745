//! PyTorch snapshots of versions and shapes the project has no real file of, written by
//! tests/fixtures/make_version_snapshots.py (its docstring says what each holds): exact events
//! and figures, or the exact error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tidepool_trace::{Event, Tag, Trace, read_trace};

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
