//! PyTorch snapshots replayed per device: the synthetic multi-device, multi-stream fixture
//! (tests/fixtures/make_multi_device_snapshot.py) with exact figures per device and policy,
//! under the default configuration and under the snapshot's own (`--config from-snapshot`),
//! the `pytorch (recorded)` row of the reports of the real snapshots, and tidepool's own
//! `dump_snapshot` read back.

use std::path::Path;

use tidepool_trace::policy::alloc_steps;
use tidepool_trace::policy::{AllocStep, Mode};
use tidepool_trace::report::{RECORDED_ROW, Report};
use tidepool_trace::runner::run_policies;
use tidepool_trace::{ReadOptions, ReplayOptions, Trace, read_traces, read_traces_bytes, registry};

const MIB: u64 = 1 << 20;

fn fixture() -> Vec<Trace> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multi_device_snapshot.pickle");
    read_traces(&path, &ReadOptions::default()).unwrap()
}

fn replay(trace: &Trace, config: Option<String>) -> Report {
    let opts = ReplayOptions { repeats: 1, config, timeline: true };
    let policies = registry(&opts).unwrap();
    run_policies(trace, &policies, &opts, &mut |_| {}).unwrap()
}

/// (policy, peak reserved, peak allocated, device mallocs) per policy.
fn figures(r: &Report) -> Vec<(&str, u64, u64, u64)> {
    r.policies
        .iter()
        .map(|p| (p.name.as_str(), p.peak_reserved_bytes, p.peak_allocated_bytes, p.device_mallocs))
        .collect()
}

#[test]
fn each_device_replays_on_its_own_device_and_streams() {
    let traces = fixture();
    // Device 0 runs on three streams (default, S1, S2), device 1 on one side stream.
    let streams = |t: &Trace| alloc_steps(t, Mode::Caching).2;
    assert_eq!(streams(&traces[0]), vec![0, 1, 2]);
    assert_eq!(streams(&traces[1]), vec![0, 1]);
    let (steps, _, _) = alloc_steps(&traces[0], Mode::Scoped);
    assert!(steps.iter().any(|s| matches!(s, AllocStep::Enter { .. })));

    // Device 0: tidepool's segments are per stream: a 20 MiB large segment on the default
    // stream (W1, X, Q), 2 MiB small segments for EARLY (1 MiB) and Y (S1), a 20 MiB large one
    // for Z (S2). Expandable segments map only the 2 MiB pages the blocks need.
    let r0 = replay(&traces[0], None);
    assert_eq!((r0.device(), r0.peak_live_bytes), (Some(0), 13_146_228));
    assert_eq!(r0.recorded_peak_reserved(), Some(30 * MIB));
    assert_eq!(
        figures(&r0),
        vec![
            ("caching", 44 * MIB, 13_146_624, 4),
            ("residency", 44 * MIB, 13_146_624, 4),
            ("scoped", 44 * MIB, 13_146_624, 4),
            ("expandable", 16 * MIB, 13_146_624, 0),
            ("offset-allocator", 13_146_368, 13_146_368, 1),
            ("range-alloc", 13_146_368, 13_146_368, 1),
            ("planned", 13_146_368, 13_146_368, 1),
        ]
    );
    // Device 1 on its own: nothing of device 0 is left in it.
    let r1 = replay(&traces[1], None);
    assert_eq!((r1.device(), r1.peak_live_bytes), (Some(1), 2_900_000));
    assert_eq!(r1.recorded_peak_reserved(), Some(6 * MIB));
    assert_eq!(
        figures(&r1),
        vec![
            ("caching", 22 * MIB, 2_900_992, 2),
            ("residency", 22 * MIB, 2_900_992, 2),
            ("scoped", 22 * MIB, 2_900_992, 2),
            ("expandable", 4 * MIB, 2_900_992, 0),
            ("offset-allocator", 2_900_480, 2_900_480, 1),
            ("range-alloc", 2_900_480, 2_900_480, 1),
            ("planned", 2_900_480, 2_900_480, 1),
        ]
    );
}

#[test]
fn from_snapshot_configuration_replays_under_the_snapshot_settings() {
    let traces = fixture();
    let config = traces[0].snapshot.as_ref().unwrap().settings.as_ref().unwrap().to_config();
    assert_eq!(
        config.config,
        "max_split_size_mb:64,roundup_power2_divisions:4,expandable_segments:true,\
         garbage_collection_threshold:0.8"
    );
    // Rounding to quarter powers of two: more allocated; on expandable segments, as the
    // snapshot's PyTorch ran: the pages of the default replay's `expandable` row, no mallocs.
    let r0 = replay(&traces[0], Some(config.config.clone()));
    assert_eq!(figures(&r0)[0], ("caching", 16 * MIB, 13_632_000, 0));
    let r1 = replay(&traces[1], Some(config.config));
    assert_eq!(figures(&r1)[0], ("caching", 4 * MIB, 3_080_192, 0));
}

#[test]
fn reports_show_the_recorded_row_skipped_kinds_and_settings() {
    let traces = fixture();
    let r = replay(&traces[0], None);
    let table = r.to_table();
    assert!(
        table.starts_with(
            "trace multi_device_snapshot, device 0: 11 events, peak live 12.54 MiB (13146228 B)\n"
        ),
        "{table}"
    );
    for line in [
        "  allocated before the recording, live from its start: 1 block still live at its end \
         (3.81 MiB, tagged persistent), 1 block freed in it (1.00 MiB)\n",
        "  skipped: external_annotations (nested) 1, free_requested 2, oom 1, segment_alloc 1, \
         segment_map 1, segment_unmap 1, snapshot 1, user_defined 1\n",
        "  out of memory: the trace records 1 `oom` entry (PyTorch failed an allocation)\n",
        "  scopes: 1 from external_annotations START/END",
        "pytorch (recorded)      30.00 MiB   2.393               -  58.2%        -      -     -       -      -",
        "  pytorch (recorded): reserved 20971520 at the start of the window, 23068672 at the \
         snapshot, 3 segment entries\n",
    ] {
        assert!(table.contains(line), "missing {line:?} in\n{table}");
    }
    assert!(
        table.contains("allocator_settings: PYTORCH_CUDA_ALLOC_CONF \"expandable_segments:True")
    );
    let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(json["device"], 0);
    assert_eq!(json["history"], true);
    assert_eq!(json["skipped"]["oom"], 1);
    assert_eq!(json["skipped"]["user_defined"], 1);
    assert_eq!(json["pre_window"]["live_bytes"], 4_000_000);
    assert_eq!(json["pytorch_recorded"]["peak_reserved_bytes"], 30 * MIB);
    assert_eq!(json["pytorch_recorded"]["reserved_at_start_bytes"], 20 * MIB);
    assert_eq!(json["pytorch_recorded"]["reserved_at_snapshot_bytes"], 22 * MIB);
    assert_eq!(json["allocator_settings"]["expandable_segments"], "True");
    assert_eq!(json["policies"][0]["name"], "caching");
    assert_eq!(json["policies"][0]["ratio_to_peak_live"], 44.0 * MIB as f64 / 13_146_228.0);
}

/// The real snapshots' reports: peak live and the `pytorch (recorded)` row are truth.json's.
#[test]
fn real_snapshot_reports_carry_pytorch_reserved() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/snapshots");
    for (file, peak_live, recorded) in [
        ("cs336_wedsonlin_medium128_training.pickle", 7_013_335_044u64, 7_235_174_400u64),
        ("ftcourse_memory_snapshot.pickle", 5_876_132_840, 6_471_811_072),
        ("layoutediting_dump_snapshot_emptytraces.pickle", 10_637_601_344, 11_276_386_304),
    ] {
        let traces = read_traces(&dir.join(file), &ReadOptions::default()).unwrap();
        let opts = ReplayOptions { repeats: 1, config: None, timeline: false };
        let caching: Vec<_> = registry(&opts).unwrap().into_iter().take(1).collect();
        let r = run_policies(&traces[0], &caching, &opts, &mut |_| {}).unwrap();
        assert_eq!(r.peak_live_bytes, peak_live, "{file}");
        assert_eq!(r.recorded_peak_reserved(), Some(recorded), "{file}");
        let table = r.to_table();
        assert!(table.contains(RECORDED_ROW), "{table}");
        let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(json["pytorch_recorded"]["peak_reserved_bytes"].as_u64(), Some(recorded));
        assert_eq!(json["peak_live_bytes"].as_u64(), Some(peak_live));
        // tidepool's caching policy replays the window; its peak is at least the live peak.
        assert!(r.policies[0].peak_reserved_bytes >= peak_live, "{file}");
    }
}

/// tidepool's own `dump_snapshot` pickle reads back: blocks allocated before `record_history`
/// are live from the start (persistent when still live), and PyTorch's-format reserved bytes are
/// the allocator's own. (Sizes are multiples of 512: tidepool's history records a block's
/// rounded size where PyTorch records the requested size.)
#[test]
fn tidepool_dump_snapshot_reads_back() {
    use std::sync::Arc;
    use tidepool::{Allocator, Config, Device, HistoryOptions, SimDevice, StreamId};

    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let weights = alloc.alloc(8 * MIB, StreamId::DEFAULT).unwrap(); // live throughout
    let early = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap(); // freed in the window
    alloc.reset_peak_stats();
    alloc.record_history(HistoryOptions::new(1000));
    let side = dev.create_stream().unwrap();
    let a = alloc.alloc(5 * MIB, side).unwrap();
    let b = alloc.alloc(1024, StreamId::DEFAULT).unwrap();
    drop(early);
    drop(a);
    let c = alloc.alloc(30 * MIB, StreamId::DEFAULT).unwrap();
    drop(c);
    drop(b);
    let pickle = alloc.snapshot_pickle();
    let traces = read_traces_bytes(&pickle, &ReadOptions::default()).unwrap();
    assert_eq!(traces.len(), 1);
    let t = &traces[0];
    t.validate().unwrap();
    assert_eq!(t.peak_live_bytes(), 8 * MIB + 30 * MIB + 1024);
    assert_eq!(
        t.pre_window,
        tidepool_trace::PreWindow {
            freed_blocks: 1,
            freed_bytes: 3 * MIB,
            live_blocks: 1,
            live_bytes: 8 * MIB
        }
    );
    assert_eq!(alloc_steps(t, Mode::Caching).2.len(), 2, "the side stream is a stream of its own");
    let info = t.snapshot.as_ref().unwrap();
    assert!(info.history && info.reserved.consistent);
    assert_eq!(info.reserved.at_snapshot, alloc.reserved_bytes());
    assert_eq!(info.reserved.peak, alloc.stats().blocks.reserved_bytes.all.peak);
    assert!(info.settings.is_some());
    drop(weights);
}

/// tidepool's dump reads back with PyTorch's reserved figures exact through what moves them in
/// a window, under expandable segments (maps and unmaps), stitching and the global lock too: a
/// free waiting on another stream's kernel, a private pool's segments (the family's reserved
/// bytes), an out-of-memory failure whose ladder releases cached segments, `empty_cache` of
/// the allocator and of the pool, and the pool dropped. Each dump validates; reserved at its
/// start is what the allocator held when recording began, and at the snapshot what the family
/// holds.
#[test]
fn tidepool_dumps_read_back_with_the_familys_reserved_bytes() {
    use std::sync::{Arc, mpsc};
    use tidepool::device::{Access, AccessKind, Kernel, Launch};
    use tidepool::{AllocError, StreamId};
    use tidepool::{Allocator, Config, Device, HistoryOptions, MemPool, PoolOptions, SimDevice};

    for conf in [
        "",
        "expandable_segments:true",
        "expandable_segments:true,expandable_stitching:true",
        "global_lock:true",
    ] {
        let dev = Arc::new(SimDevice::new(512 * MIB));
        let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        let s = dev.create_stream().unwrap();
        let read = alloc.alloc(10 * MIB, s).unwrap();
        let small = alloc.alloc(700, s).unwrap();
        let big = alloc.alloc(30 * MIB, StreamId::DEFAULT).unwrap();
        let at_start = alloc.reserved_bytes();
        alloc.record_history(HistoryOptions::new(1000));
        let check = |at: &str, pools: &[&MemPool<SimDevice>]| {
            let traces =
                read_traces_bytes(&alloc.snapshot_pickle(), &ReadOptions::default()).unwrap();
            traces[0].validate().unwrap_or_else(|e| panic!("{conf:?} {at}: {e:?}"));
            let r = &traces[0].snapshot.as_ref().unwrap().reserved;
            let pooled: u64 =
                pools.iter().map(|p| p.stats().blocks.reserved_bytes.all.current).sum();
            let family = alloc.reserved_bytes() + pooled;
            assert_eq!(
                (r.consistent, r.at_start, r.at_snapshot),
                (true, at_start, family),
                "{conf:?} {at}"
            );
        };
        let pool = alloc.new_pool(PoolOptions::default()).unwrap();
        let in_pool = {
            let _guard = alloc.use_pool(&pool, s).unwrap();
            drop(alloc.alloc(50 * MIB, s).unwrap()); // cached in the pool
            alloc.alloc(5 * MIB, s).unwrap()
        };
        drop(small);
        // (Made after the pool: a failed check drops the gate first, so the kernel ends
        // before the pool's release waits for the device.)
        let (open, gate) = mpsc::channel::<()>();
        let acc = vec![Access { ptr: read.ptr(), bytes: read.len(), kind: AccessKind::Read }];
        let kernel = Kernel::new("gated", acc, move |_| {
            let _ = gate.recv();
        });
        dev.launch(StreamId::DEFAULT, kernel).unwrap();
        read.record_stream(StreamId::DEFAULT).unwrap();
        drop(read); // pending until the kernel ends
        check("a free pending, a pool", &[&pool]);
        open.send(()).unwrap();
        dev.synchronize().unwrap();
        drop(big);
        let held: Vec<_> = (0..6).map(|i| alloc.alloc((20 + i) * MIB, s).unwrap()).collect();
        let failed = alloc.alloc(400 * MIB, s);
        assert!(matches!(failed, Err(AllocError::OutOfMemory(_))), "{conf:?}");
        check("out of memory", &[&pool]);
        drop(held);
        alloc.empty_cache().unwrap();
        drop(in_pool);
        pool.empty_cache().unwrap();
        check("emptied", &[&pool]);
        drop(pool);
        check("the pool dropped", &[]);
    }
}

/// A snapshot of an allocator configured with PyTorch's per-interval `roundup_power2_divisions`
/// and expandable segments records both in PyTorch's form (a dict of interval → divisions,
/// `expandable_segments` True), and `--config from-snapshot` maps them back to the same
/// configuration.
#[test]
fn snapshot_settings_round_trip_through_from_snapshot() {
    use std::sync::Arc;
    use tidepool::{Allocator, Config, SimDevice, StreamId};

    let conf = "expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]";
    let config = Config::parse(conf).unwrap();
    let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), config.clone()).unwrap();
    let b = alloc.alloc(3 * MIB, StreamId::DEFAULT).unwrap();
    let traces = read_traces_bytes(&alloc.snapshot_pickle(), &ReadOptions::default()).unwrap();
    drop(b);
    let settings = traces[0].snapshot.as_ref().unwrap().settings.clone().unwrap();
    assert_eq!(settings.expandable_segments, Some(true));
    assert_eq!(settings.roundup_power2_divisions.len(), 16);
    assert_eq!(settings.roundup_power2_divisions[5], ("32".to_string(), 256));
    assert_eq!(settings.roundup_power2_divisions[7], ("128".to_string(), 0));
    let mapped = settings.to_config();
    let back = Config::parse(&mapped.config).unwrap();
    assert_eq!(back.sizing.roundup_power2_divisions, config.sizing.roundup_power2_divisions);
    assert!(back.expandable_segments);
}

/// Named scopes recorded in tidepool's own dump come back as scopes: the outermost ranges (two
/// runs of `step`) are the trace's scope instances, the nested `fwd` is skipped, and every
/// allocation and free of a run falls between its markers — while recording, a scope takes no
/// plan and keeps no local cache, so each of them is in the history (the broken build
/// `scopes_unrecorded` follows the plan learned in the first run, whose allocations then go
/// unrecorded, and the second run reads empty).
#[test]
fn tidepool_dump_scopes_read_back_as_scopes() {
    use std::sync::Arc;
    use tidepool::{Allocator, Config, HistoryOptions, SimDevice, StreamId};
    use tidepool_trace::Op;

    let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    alloc.record_history(HistoryOptions::new(1000));
    // Twenty runs back to back: the end of one and the first allocation of the next often fall
    // in one microsecond of the history's clock (broken build `history_ties` misreads them).
    for _ in 0..20 {
        let step = alloc.named_scope("step", StreamId::DEFAULT);
        let a = step.alloc(3 * MIB).unwrap();
        {
            let fwd = alloc.named_scope("fwd", StreamId::DEFAULT);
            drop(fwd.alloc(MIB).unwrap());
            drop(fwd.alloc(MIB).unwrap()); // a reuse: recorded too
        }
        drop(a);
    }
    let traces = read_traces_bytes(&alloc.snapshot_pickle(), &ReadOptions::default()).unwrap();
    let t = &traces[0];
    t.validate().unwrap();
    assert_eq!(t.scope_names, vec!["step".to_string()]);
    let ops: Vec<Op> = t.events.iter().map(|e| e.op).collect();
    use Op::{Alloc as A, Free as F, ScopeEnter as In, ScopeExit as Out};
    let run = [In, A, A, F, A, F, F, Out];
    assert_eq!(ops, [run; 20].concat());
    assert_eq!(alloc.stats().plan_hits, 0, "no plan while recording");
}

/// `Allocators::dump_snapshot` writes every device's history in one pickle, as PyTorch's
/// snapshot holds every device: read back, it is one trace per device, each with its own
/// allocations, scopes and reserved bytes, and nothing of the other device.
#[test]
fn a_snapshot_of_several_devices_reads_back_one_trace_per_device() {
    use tidepool::{Allocators, Config, HistoryOptions, StreamId};
    use tidepool_trace::Op;

    let all = Allocators::sim(2, 1 << 30, Config::default()).unwrap();
    all.record_history(HistoryOptions::new(1000));
    let (d0, d1) = (all.for_device(0).unwrap(), all.for_device(1).unwrap());
    let keep = d0.alloc(5 * MIB, StreamId::DEFAULT).unwrap();
    {
        let step = d1.named_scope("step", StreamId::DEFAULT);
        drop(step.alloc(3 * MIB).unwrap());
        drop(step.alloc(MIB).unwrap());
    }
    let traces = read_traces_bytes(&all.snapshot_pickle(), &ReadOptions::default()).unwrap();
    assert_eq!(traces.len(), 2);
    let ops = |t: &Trace| t.events.iter().map(|e| e.op).collect::<Vec<Op>>();
    use Op::{Alloc as A, Free as F, ScopeEnter as In, ScopeExit as Out};
    assert_eq!(ops(&traces[0]), vec![A]);
    assert_eq!(ops(&traces[1]), vec![In, A, F, A, F, Out]);
    assert_eq!((traces[0].peak_live_bytes(), traces[1].peak_live_bytes()), (5 * MIB, 3 * MIB));
    assert!(traces[0].scope_names.is_empty());
    for (n, t) in traces.iter().enumerate() {
        t.validate().unwrap();
        let info = t.snapshot.as_ref().unwrap();
        let reserved = all.for_device(n).unwrap().reserved_bytes();
        assert_eq!(info.reserved.at_snapshot, reserved, "device {n}");
        assert_eq!(replay(t, None).device(), Some(n as u32));
    }
    drop(keep);
}
