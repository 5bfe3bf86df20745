//! A private pool reused by a later capture: its cached memory was last used by ordinary
//! (uncaptured) work, on the capturing stream or on others, which a graph's replays are not
//! ordered after by themselves — a replay runs after the work of the stream it is launched on,
//! and a stream that joins the capture brings none of its earlier work into the graph.

mod common;

use common::{N, gated_write, replayable_write as write, wait_stream as wait};
use std::sync::Arc;
use tidepool::device::{Capture, Launch};
use tidepool::{
    Allocator, Buffer, Config, Device, DeviceAddr, Graph, MIB, MemPool, PoolOptions, SimDevice,
    StreamId,
};

/// The small segment size (2 MiB).
const SEG: u64 = 2 * MIB;

struct Setup {
    dev: Arc<SimDevice>,
    s: StreamId,
    t: StreamId,
    alloc: Allocator<SimDevice>,
    pool: MemPool<SimDevice>,
}

fn setup() -> Setup {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pool = alloc.new_pool(PoolOptions::default()).unwrap();
    Setup { dev, s, t, alloc, pool }
}

/// A block of the pool on `on`, written by unfinished ordinary work there and freed: returns
/// its address and the gate that lets the write finish.
fn cached_busy_block(
    Setup { dev, alloc, pool, .. }: &Setup,
    on: StreamId,
) -> (u64, std::sync::mpsc::Sender<()>) {
    let guard = alloc.use_pool(pool, on).unwrap();
    let b = alloc.alloc(N, on).unwrap();
    drop(guard);
    let (k, gate) = gated_write(b.ptr(), 1);
    dev.launch(on, k).unwrap();
    let ptr = b.ptr().0;
    drop(b); // on its own stream: cached in the pool at once (stream order)
    (ptr, gate)
}

/// The rest of a capture begun on `s`: with `fork`, `t` joins it, allocates N bytes and writes
/// them, and is joined back; else `s` does. Returns the buffer and the graph.
fn capture_a_write(
    Setup { dev, s, t, alloc, .. }: &Setup,
    fork: bool,
) -> (Buffer<SimDevice>, Graph<SimDevice>) {
    let on = if fork { *t } else { *s };
    if fork {
        wait(dev, *t, *s); // t joins
    }
    let b = alloc.alloc(N, on).unwrap();
    dev.launch(on, write(&b, 2)).unwrap();
    if fork {
        wait(dev, *s, *t);
    }
    (b, alloc.end_capture(*s).unwrap())
}

#[test]
fn a_joined_stream_reusing_the_pools_cached_block_is_ordered_after_its_earlier_work() {
    let st = setup();
    let (ptr, gate) = cached_busy_block(&st, st.t);
    let Setup { dev, s, alloc, pool, .. } = &st;
    alloc.begin_capture(*s, Some(pool)).unwrap();
    let (b, graph) = capture_a_write(&st, true);
    assert_eq!(b.ptr().0, ptr, "the pool's cached block of t");
    assert_eq!(pool.stats().num_host_syncs, 0, "ordered by an event");
    graph.launch(*s).unwrap();
    gate.send(()).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(common::device_bytes(dev, &b), vec![2; N as usize], "the replay wrote last");
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_graph_launched_on_another_stream_is_ordered_after_the_pools_earlier_work() {
    let st = setup();
    let (ptr, gate) = cached_busy_block(&st, st.s);
    let Setup { dev, s, t, alloc, pool } = &st;
    alloc.begin_capture(*s, Some(pool)).unwrap();
    let (b, graph) = capture_a_write(&st, false);
    assert_eq!(b.ptr().0, ptr, "the pool's cached block of s");
    graph.launch(*t).unwrap();
    gate.send(()).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_pool_block_freed_outside_the_capture_is_not_handed_to_a_stream_that_joins_later() {
    let st = setup();
    let Setup { dev, s, t, alloc, pool } = &st;
    let guard = alloc.use_pool(pool, *t).unwrap();
    let out = alloc.alloc(N, *t).unwrap();
    drop(guard);
    alloc.begin_capture(*s, Some(pool)).unwrap();
    // t is outside the capture: ordinary work, unfinished, then the free.
    let (k, gate) = gated_write(out.ptr(), 1);
    dev.launch(*t, k).unwrap();
    let ptr = out.ptr().0;
    drop(out);
    wait(dev, *t, *s); // t joins now
    let b = alloc.alloc(N, *t).unwrap();
    assert_ne!(b.ptr().0, ptr, "kept out of the capture");
    assert_eq!(
        pool.stats().blocks.active_bytes.all.current,
        2 * N,
        "pending until the capture ends"
    );
    dev.launch(*t, write(&b, 2)).unwrap();
    wait(dev, *s, *t);
    let graph = alloc.end_capture(*s).unwrap();
    assert_eq!(pool.stats().blocks.active_bytes.all.current, N, "back in the pool");
    graph.launch(*s).unwrap();
    gate.send(()).unwrap();
    dev.synchronize().unwrap();
    let v = dev.violations();
    assert!(v.is_empty(), "{:?} (block {:#x}, first at {ptr:#x})", v, b.ptr().0);
}

#[test]
fn where_the_device_refuses_events_a_device_wide_wait_orders_the_capture() {
    let st = setup();
    let (ptr, gate) = cached_busy_block(&st, st.t);
    gate.send(()).unwrap(); // (the wait below would otherwise wait for good)
    let Setup { dev, s, t, alloc, pool } = &st;
    dev.fail_event_records(true);
    alloc.begin_capture(*s, Some(pool)).unwrap();
    dev.fail_event_records(false);
    // One wait for t's work (no event could mark it), one for the start event's.
    assert_eq!(pool.stats().num_host_syncs, 2);
    let (b, graph) = capture_a_write(&st, true);
    assert_eq!(b.ptr().0, ptr);
    graph.launch(*t).unwrap(); // elsewhere: nothing left to wait for
    dev.synchronize().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_capture_that_nothing_can_order_is_refused_and_leaves_the_pool_usable() {
    let st = setup();
    let (ptr, gate) = cached_busy_block(&st, st.t);
    gate.send(()).unwrap();
    let Setup { dev, s, alloc, pool, .. } = &st;
    let u = dev.create_stream().unwrap();
    alloc.begin_capture(u, None).unwrap(); // another capture: no host wait allowed
    dev.fail_event_records(true);
    let r = alloc.begin_capture(*s, Some(pool));
    dev.fail_event_records(false);
    assert!(
        matches!(r, Err(tidepool::AllocError::Capture { stream, .. }) if stream == *s),
        "{r:?}"
    );
    assert!(!alloc.is_capturing(*s));
    assert_eq!(pool.graphs(), 0, "the pool was let go of");
    drop(alloc.end_capture(u).unwrap());
    pool.check_invariants().unwrap();
    // The same capture once the device can order it.
    alloc.begin_capture(*s, Some(pool)).unwrap();
    let (b, graph) = capture_a_write(&st, true);
    assert_eq!(b.ptr().0, ptr);
    graph.launch(*s).unwrap();
    dev.synchronize().unwrap();
    drop((b, graph));
    pool.check_invariants().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// Two captures underway into one pool (`begin_capture_sharing`): the first's stream cannot be
/// waited on (it is capturing), and the sharing contract orders its graph's work, so the second
/// capture begins without ordering after it.
#[test]
fn a_capture_sharing_a_pool_with_one_underway_begins() {
    let Setup { dev, s, t, alloc, pool } = setup();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let a = alloc.alloc(N, s).unwrap(); // the pool now has memory on s
    dev.launch(s, write(&a, 1)).unwrap();
    // SAFETY: the graphs are replayed in capture order, never concurrently.
    unsafe { alloc.begin_capture_sharing(t, &pool) }.unwrap();
    let b = alloc.alloc(N, t).unwrap();
    assert_ne!(a.ptr(), b.ptr());
    dev.launch(t, write(&b, 2)).unwrap();
    let g2 = alloc.end_capture(t).unwrap();
    let g1 = alloc.end_capture(s).unwrap();
    g1.launch(s).unwrap();
    wait(&dev, t, s);
    g2.launch(t).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(pool.stats().num_host_syncs, 0);
    drop((a, b, g1, g2));
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// The stream a capture began on is destroyed; its graph, launched elsewhere, still waits on
/// the start event recorded there (CUDA keeps an event of a destroyed stream).
#[test]
fn a_graph_whose_origin_stream_is_gone_launches_elsewhere() {
    let st = setup();
    let (_, gate) = cached_busy_block(&st, st.s);
    let Setup { dev, s, t, alloc, pool } = &st;
    alloc.begin_capture(*s, Some(pool)).unwrap();
    let (b, graph) = capture_a_write(&st, false);
    gate.send(()).unwrap();
    alloc.destroy_stream(*s).unwrap();
    graph.launch(*t).unwrap();
    dev.synchronize().unwrap();
    drop((b, graph));
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// Two captures share a pool; a block of it is freed outside both, by unfinished ordinary work
/// on `u`; one capture ends (either one: the block was kept out by one of them, whichever the
/// table found: the rounds cover both with odds of 1 − 2⁻¹⁶), and `u` joins the other, which
/// must not hand it out either.
#[test]
fn a_block_kept_out_of_a_shared_pool_stays_out_until_the_last_capture_into_it_ends() {
    for round in 0..16 {
        let first_ends = round % 2;
        let Setup { dev, s, t, alloc, pool } = setup();
        let u = dev.create_stream().unwrap();
        let guard = alloc.use_pool(&pool, u).unwrap();
        let out = alloc.alloc(N, u).unwrap();
        drop(guard);
        alloc.begin_capture(s, Some(&pool)).unwrap();
        // SAFETY: the graphs are replayed in capture order, never concurrently.
        unsafe { alloc.begin_capture_sharing(t, &pool) }.unwrap();
        let (k, gate) = gated_write(out.ptr(), 1);
        dev.launch(u, k).unwrap();
        let ptr = out.ptr().0;
        drop(out);
        let (ends, goes_on) = if first_ends == 0 { (s, t) } else { (t, s) };
        let ended = alloc.end_capture(ends).unwrap();
        wait(&dev, u, goes_on); // u joins the capture still underway
        let b = alloc.alloc(N, u).unwrap();
        assert_ne!(b.ptr().0, ptr, "kept out while a capture into the pool is underway");
        dev.launch(u, write(&b, 2)).unwrap();
        wait(&dev, goes_on, u);
        let graph = alloc.end_capture(goes_on).unwrap();
        ended.launch(ends).unwrap();
        wait(&dev, goes_on, ends);
        graph.launch(goes_on).unwrap();
        gate.send(()).unwrap();
        dev.synchronize().unwrap();
        drop((b, ended, graph));
        pool.check_invariants().unwrap();
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }
}

/// The pool's memory was last used on `u` (`t`), which now captures into another graph: nothing can
/// order that work before a new capture into the pool. An event recorded on `u` would be a
/// node of `u`'s capture, and `s` waiting on it would join that capture (CUDA's fork), and no
/// device-wide wait is allowed while a capture is underway. So `begin_capture(s, pool)` is
/// refused with a clear error, and `u`'s capture is left alone: it ends, and its graph
/// replays. Once it is over, the same capture into the pool begins, forks `u` in, which is
/// handed the block, and replays with no violation. The runtime broken mode `CaptureForks` lets the allocator record
/// its events in a capture: `s` then joins `u`'s capture, and the device refuses the capture
/// of `s` (`cuStreamBeginCapture`, 401) instead of the allocator's clear refusal.
#[test]
fn a_pool_a_capturing_stream_used_last_refuses_a_new_capture_and_leaves_that_capture_alone() {
    capturing_stream_used_the_pool_last(false).unwrap();
    let broken = capturing_stream_used_the_pool_last(true);
    assert!(broken.is_err(), "the broken mode was not caught: {broken:?}");
}

fn capturing_stream_used_the_pool_last(broken: bool) -> Result<(), String> {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.set_broken(tidepool::hooks::Broken::CaptureForks, broken);
    let pool = alloc.new_pool(PoolOptions::default()).unwrap(); // a pool has its allocator's
    let st = Setup { dev, s, t, alloc, pool };
    let (ptr, gate) = cached_busy_block(&st, t);
    let Setup { dev, s, t: u, alloc, pool } = &st;
    let u = *u;
    alloc.begin_capture(u, None).unwrap();
    let other = alloc.alloc(N, u).unwrap();
    dev.launch(u, write(&other, 3)).unwrap();
    let r = alloc.begin_capture(*s, Some(pool));
    let refused = "the work that last used the pool's memory could not be ordered before it";
    if !matches!(&r, Err(tidepool::AllocError::Capture { stream, reason })
        if stream == s && *reason == refused)
    {
        return Err(format!("begin_capture(s, pool): {r:?}"));
    }
    if alloc.is_capturing(*s) || pool.graphs() != 0 {
        return Err("the refused capture left s capturing or the pool claimed".into());
    }
    let graph = alloc.end_capture(u).map_err(|e| format!("u's capture: {e}"))?;
    graph.launch(u).map_err(|e| e.to_string())?;
    gate.send(()).unwrap();
    alloc.begin_capture(*s, Some(pool)).map_err(|e| format!("after u's capture: {e}"))?;
    let (b, g) = capture_a_write(&st, true);
    assert_eq!(b.ptr().0, ptr, "the pool's block, once ordered");
    g.launch(*s).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(common::device_bytes(dev, &other), vec![3; N as usize]);
    drop((b, g, graph, other));
    pool.check_invariants()?;
    alloc.check_invariants()?;
    match dev.violations() {
        v if v.is_empty() => Ok(()),
        v => Err(format!("{v:?}")),
    }
}

/// A graph dropped while another capture is underway cannot wait for its launches (the device
/// refuses to synchronise then): its pool stays busy — no guard nor capture is given it — until
/// a later `empty_cache` has synchronised, since a replay still queued may write the pool's free
/// memory. Then the pool serves again, and nothing overlapped (found in review: the pool was
/// claimable at once, and a new owner's bytes were overwritten by the queued replay; broken
/// build `graph_drop_frees_pool`).
#[test]
fn a_graph_dropped_during_another_capture_keeps_its_pool_until_a_synchronisation() {
    let Setup { dev, s, t, alloc, pool } = setup();
    let u = dev.create_stream().unwrap();
    // The graph: a temporary of its pool, written by a captured kernel, freed in the capture.
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    let wrote = tmp.ptr();
    dev.launch(s, write(&tmp, 1)).unwrap();
    drop(tmp);
    let g = alloc.end_capture(s).unwrap();
    // A replay queued on `t` behind unfinished work.
    let other = alloc.alloc(N, t).unwrap();
    let (k, gate) = gated_write(other.ptr(), 9);
    dev.launch(t, k).unwrap();
    common::drop_graph_during_capture(&alloc, g, t, u);
    assert_eq!(pool.graphs(), 1, "the dropped graph's hold stays");
    assert!(matches!(alloc.use_pool(&pool, s), Err(tidepool::AllocError::PoolBusy { .. })));
    assert!(matches!(
        alloc.begin_capture(s, Some(&pool)),
        Err(tidepool::AllocError::PoolBusy { .. })
    ));
    gate.send(()).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(pool.graphs(), 0, "let go once the device synchronised");
    let guard = alloc.use_pool(&pool, s).unwrap();
    let reuse = alloc.alloc(N, s).unwrap();
    assert_eq!(reuse.ptr(), wrote, "the pool's block, now that no replay can write it");
    dev.launch(s, write(&reuse, 2)).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(common::device_bytes(&dev, &reuse)[0], 2);
    drop((reuse, guard, other));
    assert_eq!(dev.violations(), vec![]);
    pool.check_invariants().unwrap();
}

/// As above, but nothing calls `empty_cache` before the allocator goes: what the dropped graph
/// held (its pool, whose free memory a queued replay may write, and a general buffer freed
/// during its capture) is let go of as the general allocator's last handle goes, once the
/// device synchronised, and every segment goes back to the device (found in review: the holds
/// waited in the family for an `empty_cache` that never came, and held the allocators that
/// hold the family: both segments stayed reserved for the rest of the process; broken build
/// `graph_holds_kept_at_drop`).
#[test]
fn a_graph_dropped_during_another_capture_gives_its_memory_back_as_the_allocator_goes() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t, u) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let before = alloc.alloc(MIB, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    dev.launch(s, write(&tmp, 1)).unwrap();
    drop((tmp, before)); // the graph's pool block, and a general buffer the graph holds
    let g = alloc.end_capture(s).unwrap();
    common::drop_graph_during_capture(&alloc, g, t, u);
    held_segments_go_with(&dev, || drop(alloc));
    assert_eq!(dev.live_events(), 0);
    common::assert_no_leak(&dev);
}

/// The same holds stand in the way of a request that runs out of memory: the out-of-memory
/// ladder lets them go (after a device synchronisation), as `empty_cache` does and as PyTorch's
/// `release_cached_blocks` frees the pools no graph uses any more, and the request is served
/// where the dropped graph's pool was (found in review: it failed, with 24 MiB free of 64, until
/// an `empty_cache`; broken build `graph_holds_kept_at_oom`).
#[test]
fn the_out_of_memory_ladder_lets_go_of_what_a_graph_dropped_during_a_capture_held() {
    let dev = Arc::new(SimDevice::backed(64 * MIB));
    let (s, t, u) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    alloc.begin_capture(s, None).unwrap();
    drop(alloc.alloc(40 * MIB, s).unwrap()); // the graph's pool keeps its free 40 MiB
    let g = alloc.end_capture(s).unwrap();
    common::drop_graph_during_capture(&alloc, g, t, u);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(0x7f00_0000_0000), 40 * MIB)]);
    let got = alloc.alloc(40 * MIB, s).unwrap();
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(0x7f00_0280_0000), 40 * MIB)]);
    assert_eq!(got.ptr().0, 0x7f00_0280_0000);
    let st = alloc.stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (0, 1), "rescued: a retry, no failure");
    assert_eq!(st.blocks.reserved_bytes.all.current, 40 * MIB);
    drop(got);
    alloc.check_invariants().unwrap();
    drop(alloc);
    common::assert_no_leak(&dev);
}

/// Checks that the general allocator's segment and the graph pool's are live, runs `release`,
/// and checks that both went back with one device synchronisation and a release
/// (`cuMemFree` synchronises) per segment.
fn held_segments_go_with(dev: &SimDevice, release: impl FnOnce()) {
    let (general, graphs) = (0x7f00_0000_0000, 0x7f00_0020_0000);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(general), SEG), (DeviceAddr(graphs), SEG)]);
    let syncs = dev.counters().host_syncs;
    release();
    assert_eq!(dev.live_segments(), vec![], "every segment of the family back");
    assert_eq!(dev.counters().host_syncs, syncs + 3);
}

/// A graph of `alloc` launched on `t`, whose capture freed a buffer of the general allocator
/// (held by the graph) and a temporary of the graph's pool: what the two families' tests below
/// leave holds, in the general allocator's segment and the graph pool's.
fn launched_graph_holding_a_general_buffer(
    dev: &Arc<SimDevice>,
    alloc: &Allocator<SimDevice>,
    s: StreamId,
    t: StreamId,
) -> Graph<SimDevice> {
    let before = alloc.alloc(MIB, s).unwrap();
    alloc.begin_capture(s, None).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    dev.launch(s, write(&tmp, 1)).unwrap();
    drop((tmp, before));
    let g = alloc.end_capture(s).unwrap();
    g.launch(t).unwrap();
    g
}

/// The general allocator's last handle goes while another family's capture is underway, after
/// one of its graphs was dropped during that capture: the device refuses the synchronisation
/// that would let go of what the graph held, and nothing of the family is left to try again.
/// The other allocator of the device lets go of it as its capture ends: every segment of the
/// family goes back (found in review: the holds held the allocators, which held the family and
/// its holds, a cycle, and both segments stayed reserved for the rest of the process; broken
/// build `orphaned_graph_holds`).
#[test]
fn holds_left_as_the_allocator_goes_during_another_familys_capture_go_as_it_ends() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t, u) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let other = Allocator::new(dev.clone(), Config::default()).unwrap();
    let g = launched_graph_holding_a_general_buffer(&dev, &alloc, s, t);
    other.begin_capture(u, None).unwrap();
    drop(g); // cannot synchronise: the other family's capture is underway
    drop(alloc); // nor can its last handle
    held_segments_go_with(&dev, || drop(other.end_capture(u).unwrap()));
    other.check_invariants().unwrap();
    drop(other);
    assert_eq!(dev.live_events(), 0);
    common::assert_no_leak(&dev);
}

/// A graph outlives its general allocator and is dropped during another family's capture: what
/// it held waits in a family none of whose calls is left. The other allocator's `empty_cache`
/// after the capture lets go of it (found in review: it stayed for good, a cycle; broken build
/// `orphaned_graph_holds`).
#[test]
fn a_graph_dropped_during_another_capture_after_its_allocator_went_lets_go_later() {
    let dev = Arc::new(SimDevice::backed(256 * MIB));
    let (s, t, u) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let other = Allocator::new(dev.clone(), Config::default()).unwrap();
    let g = launched_graph_holding_a_general_buffer(&dev, &alloc, s, t);
    drop(alloc); // the graph keeps its pool, and the general buffer it holds its segment
    let (general, graphs) = (0x7f00_0000_0000, 0x7f00_0020_0000);
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(general), SEG), (DeviceAddr(graphs), SEG)]);
    // A capture begun on the device itself: no allocator sees it end.
    dev.begin_capture(u).unwrap();
    drop(g); // cannot synchronise
    let raw = dev.end_capture(u).unwrap();
    dev.destroy_graph(raw).unwrap();
    assert_eq!(dev.live_segments().len(), 2, "nothing has asked yet");
    other.empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![], "every segment of the gone family back");
    drop(other);
    assert_eq!(dev.live_events(), 0);
    common::assert_no_leak(&dev);
}

/// A pool's own `empty_cache` lets go of the hold its graph, dropped during another capture,
/// left in the family (after a device synchronisation, as the general allocator's does), then
/// empties the pool: before, it answered `PoolBusy` ("a CUDA graph uses the pool") with the
/// graph long gone, until the general allocator's `empty_cache` (found in review; broken build
/// `pool_empty_keeps_graph_holds`).
#[test]
fn a_pools_empty_cache_lets_go_of_what_its_dropped_graph_held() {
    let Setup { dev, s, t, alloc, pool } = setup();
    let u = dev.create_stream().unwrap();
    alloc.begin_capture(s, Some(&pool)).unwrap();
    let tmp = alloc.alloc(N, s).unwrap();
    dev.launch(s, write(&tmp, 1)).unwrap();
    drop(tmp);
    let g = alloc.end_capture(s).unwrap();
    common::drop_graph_during_capture(&alloc, g, t, u);
    assert_eq!(pool.graphs(), 1, "the dropped graph's hold waits for a synchronisation");
    assert_eq!(dev.live_segments(), vec![(DeviceAddr(0x7f00_0000_0000), SEG)]);
    let syncs = dev.counters().host_syncs;
    pool.empty_cache().unwrap();
    assert_eq!(pool.graphs(), 0);
    assert_eq!(dev.live_segments(), vec![]);
    // The synchronisation, and the segment's release.
    assert_eq!(dev.counters().host_syncs, syncs + 2);
    assert_eq!(pool.stats().num_host_syncs, 2);
    pool.check_invariants().unwrap();
    drop((pool, alloc));
    common::assert_no_leak(&dev);
}
