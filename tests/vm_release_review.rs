//! Expandable segments: the paths that unmap and release pages, reviewed as users break them
//! (release thresholds crossed by mixed residencies, faults in the middle of releases, kernels
//! still running on other streams), with exact device figures after every step.
//!
//! Ranges are reserved from the simulated address space in order, each twice the device's
//! capacity: the first one a test makes starts at `SIM_BASE`. Pages are 2 MiB.

mod common;

use common::{assert_no_leak, consistent};
use std::sync::Arc;
use tidepool::MIB;
use tidepool::device::{Launch, SIM_BASE, SimDevice};
use tidepool::{AllocError, Allocator, Config, Device, DeviceAddr, Residency, StreamId};

const P: u64 = 2 * MIB;
const CAP: u64 = 64 * MIB;

use common::expandable_setup as setup;

/// A stream's free persistent memory, reused in part, must not hide its transient range's
/// frees from `release_threshold`: the trim remembered the stream's free bytes at its last
/// check (persistent ones included) and skipped every check until they grew past that figure.
/// Broken build `trim_memo_stale`.
#[test]
fn reused_persistent_memory_does_not_hide_frees_from_the_release_threshold() {
    let (dev, alloc) = setup("release_threshold_mb:4", CAP);
    let s0 = StreamId::DEFAULT;
    // The persistent range is made first (at SIM_BASE), the transient one above it.
    let w = alloc.alloc_in(16 * MIB, s0, Residency::Persistent).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(SIM_BASE));
    let x = alloc.alloc(10 * MIB, s0).unwrap();
    assert_eq!(x.ptr(), DeviceAddr(SIM_BASE + 2 * CAP));
    assert_eq!(alloc.reserved_bytes(), 13 * P);
    // Weights unloaded: 16 MiB free on the stream, all persistent (never trimmed).
    drop(w);
    assert_eq!(alloc.reserved_bytes(), 13 * P);
    consistent(&dev, &alloc);
    // New weights take 10 MiB of them; 6 MiB stay free.
    let w2 = alloc.alloc_in(10 * MIB, s0, Residency::Persistent).unwrap();
    assert_eq!(w2.ptr(), DeviceAddr(SIM_BASE));
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 8 * P);
    assert_eq!(s.blocks.reserved_bytes.transient.current, 5 * P);
    // The activation goes: its range holds 10 MiB free, above the 4 MiB threshold, in one
    // 5-page chunk, which goes whole.
    let unmaps = alloc.stats().num_device_unmap;
    drop(x);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.transient.current, 0);
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 8 * P);
    assert_eq!((s.num_device_unmap, s.num_physical_release), (unmaps + 1, 1));
    assert_eq!(alloc.expandable_ranges()[1].mapped_bytes, 0);
    consistent(&dev, &alloc);
    drop(w2);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A growth maps its pages as one physical allocation (a chunk, up to 32 pages), released only
/// whole: a live 2 MiB block at the bottom of a 64 MiB chunk keeps all of it mapped. The out-of-
/// memory report and the summary say so in chunks; they said "pages that live blocks share" and
/// "whole pages", where 31 whole pages were free (and PyTorch, which maps page by page, would
/// have unmapped them). Broken build `chunk_figures_as_pages`.
#[test]
fn the_oom_report_and_the_summary_count_free_chunks_not_pages() {
    let (dev, alloc) = setup("", 64 * MIB);
    let s0 = StreamId::DEFAULT;
    let whole = alloc.alloc(64 * MIB, s0).unwrap();
    assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), 64 * MIB)]);
    drop(whole);
    let live = alloc.alloc(2 * MIB, s0).unwrap();
    assert_eq!(live.ptr(), DeviceAddr(SIM_BASE));
    let r = alloc.expandable_ranges()[0].clone();
    assert_eq!((r.mapped_bytes, r.free_bytes, r.free_page_bytes), (64 * MIB, 62 * MIB, 0));
    // 70 MiB: the free 62 MiB at the end of the run and 4 new pages, which the device cannot
    // hold; the ladder's release finds no wholly free chunk.
    match alloc.alloc(70 * MIB, s0) {
        Err(AllocError::OutOfMemory(r)) => {
            assert_eq!((r.reserved, r.mapped_free), (64 * MIB, 62 * MIB));
            assert_eq!((r.mapped_free_in_used_pages, r.mapped_free_persistent), (62 * MIB, 0));
            let msg = r.to_string();
            let want = "Expandable segments hold 62.00 MiB mapped but free: 62.00 MiB in chunks \
                        that live blocks share (a chunk, the physical allocation of up to 32 \
                        pages a growth maps, is unmapped only whole), 0 B in wholly free chunks \
                        of persistent ranges (only release_persistent releases them), 0 B in \
                        wholly free chunks that could not be released.";
            assert!(msg.ends_with(want), "{msg}");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(alloc.stats().num_device_unmap, 0);
    let summary = alloc.memory_summary();
    assert!(summary.contains("mapped; 62.00 MiB free (0 B in free chunks), 1 runs"), "{summary}");
    consistent(&dev, &alloc);
    drop(live);
    drop(alloc);
    assert_no_leak(&dev);
}

/// `release_threshold_mb:0` and a capture on another stream: a free on a stream outside the
/// capture cannot be waited for while it lasts (a capture refuses host waits), so its pages
/// stay; once the capture is over, the stream's next free gives them back, however small (the
/// trim, run during the capture, remembered the stream's free bytes as checked and skipped it
/// until they grew a page past them). Broken build `trim_in_capture`.
#[test]
fn pages_freed_during_a_capture_go_back_at_the_next_free_after_it() {
    let (dev, alloc) = setup("release_threshold_mb:0", CAP);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = alloc.alloc(8 * MIB, t).unwrap();
    let c = alloc.alloc(3 * MIB / 2, t).unwrap();
    assert_eq!(c.ptr().0, a.ptr().0 + 8 * MIB);
    // a's four pages, then c's one (no headroom under a threshold of 0).
    assert_eq!(dev.live_mappings(), vec![(a.ptr(), 8 * MIB), (c.ptr(), 2 * MIB)]);
    alloc.begin_capture(s, None).unwrap();
    let unmaps = dev.vm_counters().unmaps;
    drop(a);
    assert_eq!(dev.vm_counters().unmaps, unmaps, "nothing unmapped during the capture");
    drop(alloc.end_capture(s).unwrap());
    assert_eq!(alloc.stats().blocks.reserved_bytes.large_pool.current, 10 * MIB);
    // After the capture, 1.5 MiB freed on t: both chunks go.
    drop(c);
    let st = alloc.stats();
    assert_eq!(st.blocks.reserved_bytes.large_pool.current, 0);
    assert_eq!((st.num_device_unmap, st.num_physical_release), (unmaps + 2, 2));
    assert_eq!(dev.live_mappings(), vec![]);
    consistent(&dev, &alloc);
    drop(alloc);
    assert_no_leak(&dev);
}

/// `release_threshold_mb:0` and a capture: pages freed on two streams while it lasts stay, and
/// the first free after it, on a third stream, gives all of them back. (The trim that ran under
/// the capture took the list of streams whose free bytes changed and stopped at the first: the
/// others left the list, and their pages stayed mapped until each stream freed again.) Broken
/// build `capture_drops_trims`.
#[test]
fn pages_freed_on_several_streams_during_a_capture_go_back_at_the_first_free_after_it() {
    let (dev, alloc) = setup("release_threshold_mb:0", CAP);
    let [s, t, u, v] = [(); 4].map(|_| dev.create_stream().unwrap());
    let a = alloc.alloc(4 * MIB, t).unwrap();
    let b = alloc.alloc(6 * MIB, u).unwrap();
    let c = alloc.alloc(2 * MIB, v).unwrap();
    assert_eq!(alloc.stats().blocks.reserved_bytes.large_pool.current, 12 * MIB);
    alloc.begin_capture(s, None).unwrap();
    let unmaps = dev.vm_counters().unmaps;
    // Both freed in one go, so that one trim finds both streams changed.
    alloc.free_batch(vec![a, b]).unwrap();
    assert_eq!(dev.vm_counters().unmaps, unmaps, "nothing unmapped during the capture");
    drop(alloc.end_capture(s).unwrap());
    assert_eq!(alloc.stats().blocks.reserved_bytes.large_pool.current, 12 * MIB);
    // After the capture, a free on v: t's two pages, u's three and v's one go.
    drop(c);
    let st = alloc.stats();
    assert_eq!(st.blocks.reserved_bytes.large_pool.current, 0);
    assert_eq!((st.num_device_unmap, st.num_physical_release), (unmaps + 3, 3));
    assert_eq!(dev.live_mappings(), vec![]);
    consistent(&dev, &alloc);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A `set_config` lowering `release_threshold_mb` applies to the next free, however small: the
/// trim's memory of what it checked under the old threshold went with it (kept, the stream was
/// skipped until a page more was freed, and 6 MiB stayed mapped under a threshold of 0).
/// Broken build `threshold_memo_kept`.
#[test]
fn a_lowered_release_threshold_applies_to_the_next_free() {
    let (dev, alloc) = setup("release_threshold_mb:8", CAP);
    let s0 = StreamId::DEFAULT;
    let w = alloc.alloc_in(10 * MIB, s0, Residency::Persistent).unwrap();
    let a = alloc.alloc(6 * MIB, s0).unwrap();
    let b = alloc.alloc(3 * MIB / 2, s0).unwrap();
    assert_eq!(
        (a.ptr(), b.ptr()),
        (DeviceAddr(SIM_BASE + 2 * CAP), DeviceAddr(SIM_BASE + 2 * CAP + 6 * MIB))
    );
    // 16 MiB free on the stream, 6 MiB of them transient: under 8 MiB, nothing goes.
    drop(w);
    drop(a);
    assert_eq!(alloc.stats().blocks.reserved_bytes.transient.current, 4 * P);
    alloc
        .set_config(Config::parse("expandable_segments:true,release_threshold_mb:0").unwrap())
        .unwrap();
    // 1.5 MiB more: every wholly free transient chunk goes (a's three pages, then b's page).
    drop(b);
    let s = alloc.stats();
    assert_eq!(s.blocks.reserved_bytes.transient.current, 0);
    assert_eq!(s.blocks.reserved_bytes.persistent.current, 5 * P);
    assert_eq!((s.num_device_unmap, s.num_physical_release), (2, 2));
    consistent(&dev, &alloc);
    drop(alloc);
    assert_no_leak(&dev);
}

/// A named scope's learning run gives its stream's freed transient pages back at once (as
/// `release_threshold_mb:0` would), from its opening on, whatever an earlier run left the trim
/// remembering: here the free persistent bytes of a first run, spent since with no threshold to
/// follow them down. The block freed into the stream's cache before the run, which its opening
/// frees into the pool, was kept mapped. Broken build `learning_memo_kept`.
#[test]
fn a_second_learning_run_gives_its_freed_pages_back_from_its_opening() {
    let (dev, alloc) = setup("", CAP);
    let s = dev.create_stream().unwrap();
    let w = alloc.alloc_in(10 * MIB, s, Residency::Persistent).unwrap();
    assert_eq!(w.ptr(), DeviceAddr(SIM_BASE));
    let first = alloc.named_scope("load", s);
    drop(w); // 10 MiB free on s, persistent: the run's trim releases none of it
    drop(first);
    let w2 = alloc.alloc_in(8 * MIB, s, Residency::Persistent).unwrap();
    assert_eq!(w2.ptr(), DeviceAddr(SIM_BASE));
    let x = alloc.alloc(4 * MIB, s).unwrap();
    assert_eq!(x.ptr(), DeviceAddr(SIM_BASE + 2 * CAP));
    drop(x); // into the stream's cache: no learning run, no threshold
    assert_eq!(alloc.stats().blocks.reserved_bytes.transient.current, 2 * P);
    let run = alloc.named_scope("step", s);
    let st = alloc.stats();
    assert_eq!(st.blocks.reserved_bytes.transient.current, 0);
    assert_eq!(st.blocks.reserved_bytes.persistent.current, 5 * P);
    assert_eq!((st.num_device_unmap, st.num_physical_release), (1, 1));
    consistent(&dev, &alloc);
    drop(run);
    drop(w2);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Nothing cached, nothing reserved, nothing mapped, after `unmaps` unmaps and as many physical
/// releases: every page given back.
fn all_given_back(dev: &SimDevice, alloc: &Allocator<SimDevice>, unmaps: u64, lock: bool) {
    let st = alloc.stats();
    assert_eq!(st.cached_fast_bytes, 0, "lock {lock}");
    assert_eq!(st.blocks.reserved_bytes.all.current, 0, "lock {lock}");
    assert_eq!((st.num_device_unmap, st.num_physical_release), (unmaps, unmaps), "lock {lock}");
    assert_eq!(dev.live_mappings(), vec![], "lock {lock}");
    consistent(dev, alloc);
}

/// On both paths: `before` leaves free pages mapped on a new stream `s`, then a named scope's
/// learning run opens on `s`, and the opening's trim gives them back: one unmap, one release,
/// nothing mapped, nothing left in the stream caches.
fn learning_run_opening_gives_back(
    before: impl Fn(&Allocator<SimDevice>, &SimDevice, StreamId, bool),
) {
    for lock in [false, true] {
        let dev = Arc::new(SimDevice::backed(CAP));
        let config = Config::parse("expandable_segments:true").unwrap().with_global_lock(lock);
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        let s = dev.create_stream().unwrap();
        before(&alloc, &dev, s, lock);
        let run = alloc.named_scope("step", s);
        all_given_back(&dev, &alloc, 1, lock);
        drop(run);
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// A named scope's learning run opens on a stream whose small block (1 MiB, alone in its page
/// of the small range) waits in the stream's cache: the opening frees it into the pool, and the
/// run's trim gives its page back, as under `global_lock`. Broken build
/// `learning_small_lanes_kept`: the page stayed mapped (until an out-of-memory ladder's flush).
#[test]
fn a_learning_runs_opening_gives_back_the_page_of_a_small_block_cached_before_it() {
    learning_run_opening_gives_back(|alloc, dev, s, lock| {
        let x = alloc.alloc(MIB, s).unwrap();
        assert_eq!(x.ptr(), DeviceAddr(SIM_BASE));
        drop(x); // no learning run, no threshold: the page stays
        let st = alloc.stats();
        assert_eq!(st.cached_fast_bytes, if lock { 0 } else { MIB }, "lock {lock}");
        assert_eq!(st.blocks.reserved_bytes.all.current, P);
        assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), P)]);
    });
}

/// A learning run's opening gives its stream's free pages back even when the stream's free
/// bytes did not change since the last trim: another stream's learning run opening in between
/// took the stream from the trims' list and skipped it (no threshold), and the stream was then
/// never listed again, so its 8 MiB stayed mapped through its own run. On the fast path the
/// list also depended on whether the stream's last free went to its lane (nothing changed in
/// the pool) or to the pool: both paths now unmap at the opening. Broken build
/// `learning_trim_unlisted`.
#[test]
fn a_learning_runs_opening_gives_back_pages_an_earlier_trim_skipped() {
    learning_run_opening_gives_back(|alloc, dev, s, lock| {
        let a = alloc.alloc(8 * MIB, s).unwrap();
        assert_eq!(a.ptr(), DeviceAddr(SIM_BASE));
        drop(a); // no learning run, no threshold: the pages stay (in `s`'s lane on the fast path)
        // Another stream's learning run: its opening flushes the lanes' large blocks and trims,
        // taking `s` from the list (no threshold for `s`: nothing released).
        drop(alloc.named_scope("other", StreamId::DEFAULT));
        let st = alloc.stats();
        assert_eq!(st.cached_fast_bytes, 0, "lock {lock}");
        assert_eq!(st.blocks.reserved_bytes.all.current, 8 * MIB, "lock {lock}");
        assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), 8 * MIB)], "lock {lock}");
    });
}

/// `destroy_stream` whose release of the stream's pages the device refuses: the error comes
/// after the stream is gone (as the documentation says), the pages stay counted and mapped,
/// and `release_stream` on the gone stream gives them and its range back.
#[test]
fn a_refused_unmap_at_destroy_stream_leaves_the_pages_to_release_stream() {
    let (dev, alloc) = setup("", CAP);
    let s = dev.create_stream().unwrap();
    let a = alloc.alloc(8 * MIB, s).unwrap();
    let b = alloc.alloc(70 * MIB / 2, s).unwrap();
    assert_eq!(dev.live_mappings(), vec![(a.ptr(), 8 * MIB), (b.ptr(), 36 * MIB)]);
    drop((a, b));
    dev.fail_nth_vm_unmap(Some(2));
    let refused = alloc.destroy_stream(s);
    assert!(matches!(&refused, Err(AllocError::Device(_))), "{refused:?}");
    assert!(!dev.live_streams().contains(&s));
    // The top chunk went, the other stays, counted.
    assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), 8 * MIB)]);
    assert_eq!(alloc.reserved_bytes(), 8 * MIB);
    consistent(&dev, &alloc);
    alloc.release_stream(s).unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    assert_eq!(alloc.expandable_ranges(), vec![]);
    assert_eq!((dev.live_mappings(), dev.virtual_bytes()), (vec![], 0));
    let st = alloc.stats();
    assert_eq!((st.num_device_unmap, st.num_physical_release), (2, 2));
    consistent(&dev, &alloc);
    drop(alloc);
    assert_no_leak(&dev);
}

/// Under `release_threshold_mb:0`, two new streams `s` and `t`: a 4 MiB block of `t`, at the
/// range's bottom, written by a kernel of `t` that waits for the gate returned, and freed: its
/// pages are trimmed at once and retire behind that kernel.
type Retiring =
    (Arc<SimDevice>, Allocator<SimDevice>, StreamId, StreamId, std::sync::mpsc::Sender<()>);
fn retiring_behind_a_kernel() -> Retiring {
    let (dev, alloc) = setup("release_threshold_mb:0", CAP);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let b = alloc.alloc(4 * MIB, t).unwrap();
    assert_eq!(b.ptr(), DeviceAddr(SIM_BASE));
    let (k, open) = common::gated_write_bytes(b.ptr(), 4 * MIB, 3);
    dev.launch(t, k).unwrap();
    drop(b);
    (dev, alloc, s, t, open)
}

/// A learning run's end (a named scope's first run) on stream `s` releases `s`'s free pages,
/// waiting for what retires in `s`'s ranges. A trim of another stream `t`, whose kernel still
/// runs, retires behind `t`'s event: the run's end only queries it — no host wait for `t`'s
/// work — and it goes at the first lock section after that work is done. Broken build
/// `adopt_waits_all`: the run's end waited on the host for `t`'s kernel.
#[test]
fn a_learning_runs_end_waits_for_no_other_streams_retiring_pages() {
    let (dev, alloc, s, t, open) = retiring_behind_a_kernel();
    let retiring = |a: &Allocator<SimDevice>| {
        a.expandable_ranges().iter().map(|r| (r.stream, r.retiring_pages)).collect::<Vec<_>>()
    };
    assert_eq!(retiring(&alloc), vec![(t, 2)]);
    let opener = common::open_on_next_sync(&dev, open);
    let run = alloc.named_scope("step", s);
    let x = run.alloc(6 * MIB).unwrap();
    assert_eq!(x.ptr(), DeviceAddr(SIM_BASE + 2 * CAP));
    drop(x);
    drop(run);
    assert_eq!(alloc.stats().num_host_syncs, 0);
    assert_eq!(retiring(&alloc), vec![(t, 2), (s, 0)]);
    // t's old pages, and the 6 MiB region the run's plan keeps mapped for its next runs.
    let region = (DeviceAddr(SIM_BASE + 2 * CAP), 6 * MIB);
    assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), 4 * MIB), region]);
    assert_eq!(alloc.reserved_bytes(), 10 * MIB, "t's pages held until unmapped");
    dev.synchronize().unwrap(); // a host sync of the test's: the gate opens
    opener.join().unwrap();
    alloc.check_invariants().unwrap(); // a lock section: the old mapping goes
    assert_eq!(retiring(&alloc), vec![(t, 0), (s, 0)]);
    assert_eq!(alloc.stats().num_host_syncs, 0);
    assert_eq!(dev.live_mappings(), vec![region]);
    consistent(&dev, &alloc);
    drop(alloc);
    assert_no_leak(&dev);
}

/// The out-of-memory ladder, climbed during a capture on another stream, meets pages retiring
/// behind a running kernel: a capture refuses host waits (and event queries), so none is tried
/// or counted; the allocation fails, and the pages go once the kernel is done and the capture
/// over. Broken build `wait_counted_in_capture`: the refused wait was counted as a host sync.
#[test]
fn the_ladder_in_a_capture_counts_no_refused_wait() {
    let (dev, alloc) = setup("release_threshold_mb:0", 8 * MIB);
    let (s, t, c) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let b = alloc.alloc(4 * MIB, t).unwrap();
    let (k, open) = common::gated_write_bytes(b.ptr(), 4 * MIB, 3);
    dev.launch(t, k).unwrap();
    drop(b); // trimmed at once: retires behind t's kernel
    alloc.begin_capture(c, None).unwrap();
    let e = alloc.alloc(8 * MIB, s).map(|b| b.ptr());
    assert!(matches!(e, Err(AllocError::OutOfMemory(_))), "{e:?}");
    assert_eq!(alloc.stats().num_host_syncs, 0);
    assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), 4 * MIB)]);
    drop(alloc.end_capture(c).unwrap());
    open.send(()).unwrap();
    dev.synchronize().unwrap();
    alloc.check_invariants().unwrap(); // a lock section: the pages go
    assert_eq!(dev.live_mappings(), vec![]);
    assert_eq!(alloc.stats().num_host_syncs, 0);
    consistent(&dev, &alloc);
    let x = alloc.alloc(8 * MIB, s).unwrap(); // the whole device again
    drop(x);
    drop(alloc);
    assert_no_leak(&dev);
}

/// The out-of-memory ladder during a capture on another stream, with a block whose free waits
/// on another stream's event (`record_stream`): a capture refuses the host wait for it, so the
/// ladder waits for nothing (as PyTorch skips `release_cached_blocks` during a capture) and the
/// allocation fails out of memory, on ordinary and on expandable segments alike; once the
/// capture is over, the same request succeeds. Broken build `ladder_waits_in_capture`: over
/// expandable segments the refused wait failed the allocation with the device's error (and
/// counted a host sync).
#[test]
fn the_ladder_in_a_capture_fails_out_of_memory_not_on_the_refused_wait() {
    for expandable in [false, true] {
        let dev = std::sync::Arc::new(SimDevice::backed(32 * MIB));
        let config = Config::default().with_expandable_segments(expandable);
        let alloc = Allocator::new(dev.clone(), config).unwrap();
        let (s, t, c) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let b = alloc.alloc(2 * MIB, s).unwrap();
        let (k, open) = common::gated_write_bytes(b.ptr(), 2 * MIB, 3);
        dev.launch(t, k).unwrap();
        b.record_stream(t).unwrap();
        drop(b); // its free waits on t's event
        alloc.begin_capture(c, None).unwrap();
        let e = alloc.alloc(32 * MIB, s).map(|b| b.ptr());
        assert!(matches!(e, Err(AllocError::OutOfMemory(_))), "{expandable}: {e:?}");
        assert_eq!(alloc.stats().num_host_syncs, 0, "{expandable}");
        drop(alloc.end_capture(c).unwrap());
        let opener = common::open_on_next_sync(&dev, open);
        // The ladder waits for t's event, releases (an ordinary segment's `cudaFree` is a host
        // sync too), and retries.
        let x = alloc.alloc(32 * MIB, s).unwrap();
        let syncs = if expandable { 1 } else { 2 };
        assert_eq!(alloc.stats().num_host_syncs, syncs, "{expandable}");
        opener.join().unwrap();
        drop(x);
        alloc.check_invariants().unwrap();
        assert_eq!(dev.violations(), vec![]);
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// The allocator goes while a kernel still writes pages it freed, and the device fails every
/// host wait: the pages (retiring behind the kernel's event under `release_threshold_mb:0`,
/// mapped and free without it) stay mapped under the kernel, left to the family for after a
/// device-wide synchronisation; the pool that remains gives them back once the device waits
/// again. Broken build `unwaited_pages_unmapped`: the leftovers were unmapped at once, under
/// the running kernel (the sanitizer's violation, and the kernel's write failed).
#[test]
fn an_allocator_gone_while_host_waits_fail_leaves_its_pages_mapped_under_the_kernel() {
    for conf in ["release_threshold_mb:0", ""] {
        let (dev, alloc) = setup(conf, CAP);
        let t = dev.create_stream().unwrap();
        let pool = alloc.new_pool(tidepool::PoolOptions::default()).unwrap();
        let b = alloc.alloc(4 * MIB, t).unwrap();
        assert_eq!(b.ptr(), DeviceAddr(SIM_BASE));
        let (k, open) = common::gated_write_bytes(b.ptr(), 4 * MIB, 3);
        dev.launch(t, k).unwrap();
        drop(b);
        let retiring: Vec<usize> =
            alloc.expandable_ranges().iter().map(|r| r.retiring_pages).collect();
        assert_eq!(retiring, vec![if conf.is_empty() { 0 } else { 2 }], "{conf}");
        dev.fail_host_syncs(true);
        drop(alloc);
        let mapped = vec![(DeviceAddr(SIM_BASE), 4 * MIB)];
        assert_eq!(dev.live_mappings(), mapped, "{conf}: still under the kernel");
        assert_eq!(dev.physical_bytes(), 4 * MIB, "{conf}");
        assert_eq!(dev.violations(), vec![], "{conf}");
        pool.empty_cache().unwrap(); // the device still refuses the synchronisation
        assert_eq!(dev.live_mappings(), mapped, "{conf}");
        dev.fail_host_syncs(false);
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        assert_eq!(dev.violations(), vec![], "{conf}: the kernel wrote its pages");
        pool.empty_cache().unwrap(); // synchronises, then gives the family's leftovers back
        assert_eq!((dev.live_mappings(), dev.physical_bytes()), (vec![], 0), "{conf}");
        drop(pool);
        assert_no_leak(&dev);
    }
}

/// Small blocks freed under `release_threshold_mb:0` give their page back at once, as under
/// `global_lock:true`: the stream caches are closed there, since a block waiting in one is not
/// free in the pool (large blocks were kept out of them already). Broken build
/// `lanes_under_threshold`: the blocks waited in the stream's cache, their page mapped.
///
/// And a half-free page's last block, freed, gives the page back, however little the stream's
/// free bytes grew: the trim remembers the free bytes it could not release (half a page beside
/// a live block) and skips the stream until they grow a page past them, unless a free left a
/// page's worth of free bytes together. Broken build `trim_memo_whole_page`: the page stayed
/// mapped.
#[test]
fn small_blocks_freed_under_a_threshold_of_zero_give_their_page_back() {
    for lock in [false, true] {
        let dev = std::sync::Arc::new(SimDevice::backed(CAP));
        let config = Config::parse("expandable_segments:true,release_threshold_mb:0").unwrap();
        let alloc = Allocator::new(dev.clone(), config.with_global_lock(lock)).unwrap();
        let s0 = StreamId::DEFAULT;
        // Two pages of the small range, each its own chunk; c leaves half of the second free.
        let [a, b, c] = [0; 3].map(|_| alloc.alloc(MIB, s0).unwrap());
        let at = |m: u64| DeviceAddr(SIM_BASE + m * MIB);
        assert_eq!([a.ptr(), b.ptr(), c.ptr()], [at(0), at(1), at(2)]);
        assert_eq!(alloc.stats().blocks.reserved_bytes.small_pool.current, 2 * P);
        // The trim checks the stream again once its free bytes grew a page past its last
        // check (1 MiB, after c): at b's free, and the first page goes.
        drop(a);
        drop(b);
        let s = alloc.stats();
        assert_eq!(s.blocks.reserved_bytes.small_pool.current, P, "lock {lock}");
        assert_eq!((s.num_device_unmap, s.num_physical_release), (1, 1), "lock {lock}");
        assert_eq!(s.cached_fast_bytes, 0);
        consistent(&dev, &alloc);
        // c was the second page's last block: 1 MiB more free, and the page is free whole.
        drop(c);
        let s = alloc.stats();
        assert_eq!(s.blocks.reserved_bytes.small_pool.current, 0, "lock {lock}");
        assert_eq!((s.num_device_unmap, s.num_physical_release), (2, 2), "lock {lock}");
        assert_eq!(s.blocks.inactive_split.small_pool.current, 0);
        consistent(&dev, &alloc);
        // And the range serves again from a fresh page, at its bottom.
        let d = alloc.alloc(MIB, s0).unwrap();
        assert_eq!(d.ptr(), at(0));
        assert_eq!(alloc.stats().blocks.reserved_bytes.small_pool.current, P);
        consistent(&dev, &alloc);
        drop(d);
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// A `set_config` that switches expandable segments off keeps the ranges, their blocks and their
/// trims. Under `release_threshold_mb:0` (first) and in a learning run opened before the switch
/// (second), a block freed into a range gives its pages back, as `global_lock:true` does; the
/// stream caches were opened by the configuration alone (no expandable segments), so the fast
/// path cached the freed blocks and kept their pages mapped (8 MiB and a page of the small
/// range; 8 MiB). Broken build `switched_off_ranges_cached`.
#[test]
fn ranges_left_by_switching_expandable_segments_off_still_give_freed_pages_back() {
    for lock in [false, true] {
        let with = |c: &str| Config::parse(c).unwrap().with_global_lock(lock);
        // Under a threshold set with the switch.
        let dev = Arc::new(SimDevice::backed(CAP));
        let alloc = Allocator::new(dev.clone(), with("expandable_segments:true")).unwrap();
        let s0 = StreamId::DEFAULT;
        let a = alloc.alloc(8 * MIB, s0).unwrap();
        let b = alloc.alloc(MIB, s0).unwrap();
        assert_eq!((a.ptr(), b.ptr()), (DeviceAddr(SIM_BASE), DeviceAddr(SIM_BASE + 2 * CAP)));
        alloc.set_config(with("release_threshold_mb:0")).unwrap();
        drop(a);
        drop(b);
        all_given_back(&dev, &alloc, 2, lock);
        // The next request takes an ordinary segment: nothing is cached in the ranges.
        let c = alloc.alloc(8 * MIB, s0).unwrap();
        assert_eq!(c.ptr(), DeviceAddr(SIM_BASE + 4 * CAP), "lock {lock}");
        drop(c);
        drop(alloc);
        assert_no_leak(&dev);

        // In a learning run opened before the switch.
        let dev = Arc::new(SimDevice::backed(CAP));
        let alloc = Allocator::new(dev.clone(), with("expandable_segments:true")).unwrap();
        let s = dev.create_stream().unwrap();
        let run = alloc.named_scope("step", s);
        let a = alloc.alloc(8 * MIB, s).unwrap();
        assert_eq!(a.ptr(), DeviceAddr(SIM_BASE));
        alloc.set_config(with("")).unwrap();
        drop(a);
        all_given_back(&dev, &alloc, 1, lock);
        drop(run);
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// `release_stream(s)` and `destroy_stream(s)` give back `s`'s pages and ranges, waiting for
/// what retires there: another stream `t`'s trimmed pages, retiring behind `t`'s running
/// kernel, are only queried (no host wait for `t`'s work) and go at the first lock section
/// after it is done, as at a learning run's end. Broken build `release_stream_waits_all`: both
/// waited on the host for `t`'s kernel (a host sync).
#[test]
fn a_streams_release_waits_for_no_other_streams_retiring_pages() {
    for destroy in [false, true] {
        let (dev, alloc, s, t, open) = retiring_behind_a_kernel();
        let x = alloc.alloc(6 * MIB, s).unwrap();
        assert_eq!(x.ptr(), DeviceAddr(SIM_BASE + 2 * CAP));
        drop(x); // s is idle: unmapped at once
        let ranges = |a: &Allocator<SimDevice>| {
            a.expandable_ranges().iter().map(|r| (r.stream, r.retiring_pages)).collect::<Vec<_>>()
        };
        assert_eq!(ranges(&alloc), vec![(t, 2), (s, 0)]);
        let opener = common::open_on_next_sync(&dev, open);
        match destroy {
            true => alloc.destroy_stream(s).unwrap(),
            false => alloc.release_stream(s).unwrap(),
        }
        let st = alloc.stats();
        assert_eq!(st.num_host_syncs, 0, "destroy {destroy}");
        assert_eq!((st.num_device_unmap, st.num_physical_release), (1, 1), "destroy {destroy}");
        assert_eq!(ranges(&alloc), vec![(t, 2)], "destroy {destroy}: s's range is gone");
        assert_eq!(dev.live_mappings(), vec![(DeviceAddr(SIM_BASE), 4 * MIB)]);
        assert_eq!(alloc.reserved_bytes(), 4 * MIB, "t's pages held until unmapped");
        dev.synchronize().unwrap(); // a host sync of the test's: the gate opens
        opener.join().unwrap();
        alloc.check_invariants().unwrap(); // a lock section: the old mapping goes
        assert_eq!(ranges(&alloc), vec![(t, 0)]);
        let st = alloc.stats();
        assert_eq!(st.num_host_syncs, 0);
        assert_eq!((st.num_device_unmap, st.num_physical_release), (2, 2));
        consistent(&dev, &alloc);
        drop(alloc);
        assert_no_leak(&dev);
    }
}

/// Expandable segments and `release_threshold_mb:0`, switched to the threshold alone while
/// stream `s`'s ranges are left (its pages already given back): the stream caches close while
/// ranges are left (a block freed into one gives its pages back, which a lane would not). Once
/// the last range goes — `release_stream(s)` (`how` 0), `destroy_stream(s)` (1), or
/// `empty_cache` of `s` destroyed on the device (2) — nothing of the configuration closes them:
/// a small block freed on the default stream waits in its lane, and the next request of its
/// size is a hit, with no set_config in between. Broken build `lanes_closed_after_ranges`: they
/// stayed closed until the next `set_config` (every request took the global lock, nothing
/// cached).
#[test]
fn the_stream_caches_open_again_once_the_last_range_left_by_a_switch_goes() {
    for how in 0..3 {
        let dev = Arc::new(SimDevice::backed(CAP));
        let on = Config::parse("expandable_segments:true,release_threshold_mb:0").unwrap();
        let alloc = Allocator::new(dev.clone(), on).unwrap();
        let (s0, s) = (StreamId::DEFAULT, dev.create_stream().unwrap());
        let a = alloc.alloc(8 * MIB, s).unwrap();
        assert_eq!(a.ptr(), DeviceAddr(SIM_BASE));
        alloc.set_config(Config::parse("release_threshold_mb:0").unwrap()).unwrap();
        drop(a); // its pages go back at once; the range stays
        // The default stream's lanes are made while the range is left: closed.
        let b = alloc.alloc(MIB / 2, s0).unwrap();
        drop(b);
        let st = alloc.stats();
        assert_eq!((st.cached_fast_bytes, st.locked_allocations), (0, 2), "how {how}");
        assert_eq!(alloc.expandable_ranges().len(), 1, "how {how}");
        match how {
            0 => alloc.release_stream(s).unwrap(),
            1 => alloc.destroy_stream(s).unwrap(),
            _ => {
                dev.destroy_stream(s).unwrap();
                alloc.empty_cache().unwrap();
            }
        }
        assert_eq!(alloc.expandable_ranges(), vec![], "how {how}");
        let c = alloc.alloc(MIB / 2, s0).unwrap();
        let at = c.ptr();
        drop(c);
        assert_eq!(alloc.stats().cached_fast_bytes, MIB / 2, "how {how}: c waits in its lane");
        let d = alloc.alloc(MIB / 2, s0).unwrap();
        assert_eq!(d.ptr(), at, "how {how}");
        let st = alloc.stats();
        assert_eq!((st.cached_fast_bytes, st.locked_allocations), (0, 3), "how {how}: d a hit");
        // One ordinary small segment, nothing mapped.
        assert_eq!(st.blocks.reserved_bytes.all.current, 2 * MIB, "how {how}");
        assert_eq!(dev.live_mappings(), vec![], "how {how}");
        alloc.check_invariants().unwrap();
        drop(d);
        drop(alloc);
        assert_no_leak(&dev);
    }
}
