//! Bad configuration values given through the builder API (not the string form, which has
//! its own checks) are refused with a clear error by `Allocator::new` and `set_config`, and the
//! allocator refusing them keeps working and leaks nothing.

mod common;

use std::sync::Arc;
use tidepool::device::{AccessKind, Launch};
use tidepool::{
    AllocError, Allocator, Config, ConfigError, Device, MAX_REQUEST, SimDevice, Sizing, StreamId,
};

/// A large (own-segment) request and a small one succeed, and once freed and the cache
/// emptied the device holds nothing.
fn still_works(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    let large = alloc.alloc(30 << 20, StreamId::DEFAULT).unwrap();
    let small = alloc.alloc(4 << 10, StreamId::DEFAULT).unwrap();
    assert_eq!(large.len(), 30 << 20);
    drop((large, small));
    alloc.check_invariants().unwrap();
    alloc.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![]);
    assert_eq!(alloc.reserved_bytes(), 0);
}

fn inconsistent(r: Result<Allocator<SimDevice>, AllocError>) -> String {
    match r {
        Err(AllocError::Config(ConfigError::Inconsistent(why))) => why,
        Err(e) => panic!("expected an inconsistent configuration, got {e}"),
        Ok(_) => panic!("expected an inconsistent configuration, got an allocator"),
    }
}

/// `round_large` 0 (the own segments' rounding) was accepted — 0 is a multiple of every
/// block size — and the first large request divided by it (a panic).
#[test]
fn a_zero_round_large_is_refused() {
    let mut sizing = Sizing::default();
    sizing.round_large = 0;
    let bad = Config::default().with_sizing(sizing);
    let dev = Arc::new(SimDevice::new(1 << 30));
    let why = inconsistent(Allocator::new(dev.clone(), bad.clone()));
    assert_eq!(why, "round_large_mb must be at least 1 MiB (got 0 bytes)");
    assert_eq!(bad.validate(), Err(ConfigError::Inconsistent(why.clone())));
    assert_eq!(dev.live_segments(), vec![]);
    // Refused by a working allocator too, which keeps its configuration.
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let held = alloc.alloc(1 << 20, StreamId::DEFAULT).unwrap();
    assert_eq!(alloc.set_config(bad), Err(ConfigError::Inconsistent(why)));
    assert_eq!(alloc.config().sizing.round_large, Sizing::default().round_large);
    drop(held);
    still_works(&dev, &alloc);
}

/// `max_non_split_rounding` below the string form's floor (20 MiB, or the large segment size
/// where `large_segment_size_mb` lowers it) was accepted through the builder: at 0 an oversize
/// block served no request at all, not even one of its own size. Both forms refuse it now, with
/// the key named; what the string form accepts, the builder accepts too.
#[test]
fn a_non_split_rounding_below_the_string_forms_floor_is_refused() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    for (bytes, named) in [(0, "0 MiB"), (1, "1 bytes"), (19 << 20, "19 MiB")] {
        let mut sizing = Sizing::default();
        sizing.max_non_split_rounding = bytes;
        let bad = Config::default().with_max_split_size_mb(40).with_sizing(sizing);
        let why = inconsistent(Allocator::new(dev.clone(), bad.clone()));
        assert_eq!(
            why,
            format!(
                "max_non_split_rounding_mb ({named}) must be at least 20 MiB (the smaller of \
                 20 MiB and large_segment_mb, as the string form wants)"
            )
        );
        assert_eq!(bad.validate(), Err(ConfigError::Inconsistent(why.clone())));
        assert_eq!(dev.live_segments(), vec![]);
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        assert_eq!(alloc.set_config(bad), Err(ConfigError::Inconsistent(why)));
        assert_eq!(alloc.config().sizing.max_non_split_rounding, 20 << 20);
        still_works(&dev, &alloc);
    }
    // The string form refuses the same values (as a bad value of the key).
    for s in ["max_non_split_rounding_mb:0", "max_non_split_rounding_mb:19"] {
        match Config::parse(s) {
            Err(ConfigError::BadValue { key, .. }) => assert_eq!(key, "max_non_split_rounding_mb"),
            other => panic!("{s}: expected a bad value, got {other:?}"),
        }
    }
    // What the string form accepts passes the builder's check: 20 MiB, and a smaller large
    // segment's own size (`large_segment_size_mb:12` sets both to 12 MiB).
    let from_string = Config::parse("large_segment_size_mb:12,max_split_size_mb:12").unwrap();
    assert_eq!(from_string.sizing.max_non_split_rounding, 12 << 20);
    let built = Config::default().with_sizing(from_string.sizing);
    assert_eq!(built.validate(), Ok(()));
    let mut sizing = Sizing::default();
    sizing.max_non_split_rounding = 20 << 20;
    assert_eq!(Config::default().with_sizing(sizing).validate(), Ok(()));
    // Below that large segment's size, refused in bytes where it is not whole MiB.
    let mut sizing = from_string.sizing;
    sizing.max_non_split_rounding = (12 << 20) - 512;
    assert_eq!(
        Config::default().with_sizing(sizing).validate(),
        Err(ConfigError::Inconsistent(
            "max_non_split_rounding_mb (12582400 bytes) must be at least 12 MiB (the smaller of \
             20 MiB and large_segment_mb, as the string form wants)"
                .into()
        ))
    );
}

/// An initial pool beyond the largest request (`u64::MAX`) overflowed rounding it up to a
/// block (a panic in `Allocator::new`); the string form caps it at 256 TiB already.
#[test]
fn an_initial_pool_past_the_largest_request_is_refused() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    for bytes in [MAX_REQUEST + 1, u64::MAX - 1, u64::MAX] {
        let bad = Config::default().with_initial_pool_size(bytes);
        let why = inconsistent(Allocator::new(dev.clone(), bad.clone()));
        assert_eq!(
            why,
            format!(
                "initial_pool_size_mb ({bytes} bytes) exceeds the largest request \
                 ({MAX_REQUEST} bytes)"
            )
        );
        assert_eq!(dev.live_segments(), vec![]);
        let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
        assert_eq!(alloc.set_config(bad), Err(ConfigError::Inconsistent(why)));
        still_works(&dev, &alloc);
    }
    // At the largest request itself: an out-of-memory error on this device, nothing held.
    let r = Allocator::new(dev.clone(), Config::default().with_initial_pool_size(MAX_REQUEST));
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{:?}", r.map(|_| ()));
    assert_eq!(dev.live_segments(), vec![]);
}

/// A backed simulated device (kernels read and write host memory) larger than the host: a
/// segment the host cannot hold aborted the process (`vec![0; n]`: "memory allocation of …
/// bytes failed"); now the device refuses it as out of memory, and the allocator's error says
/// so. 256 TiB is past any host's address space, so the host refuses it everywhere.
#[test]
fn a_backed_segment_the_host_cannot_hold_is_out_of_memory() {
    use tidepool::Device;
    use tidepool::device::DeviceError;
    let dev = Arc::new(SimDevice::backed(u64::MAX));
    assert_eq!(dev.reserve(MAX_REQUEST), Err(DeviceError::OutOfMemory { requested: MAX_REQUEST }));
    assert_eq!(dev.counters().failed_mallocs, 1);
    assert_eq!(dev.live_segments(), vec![]);
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    match alloc.alloc(MAX_REQUEST, StreamId::DEFAULT) {
        Err(AllocError::OutOfMemory(report)) => assert_eq!(report.requested, MAX_REQUEST),
        other => panic!("expected out of memory, got {:?}", other.map(|b| b.len())),
    }
    still_works(&dev, &alloc);
    // Expandable segments: a physical page the host cannot hold (pages of 128 TiB here).
    let dev = Arc::new(SimDevice::backed(1 << 60));
    dev.set_virtual_memory(true);
    dev.set_vm_granularity(1 << 47);
    let config = Config::default().with_expandable_segments(true);
    let alloc = Allocator::new(dev.clone(), config).unwrap();
    let r = alloc.alloc(1 << 20, StreamId::DEFAULT);
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{:?}", r.map(|b| b.len()));
    assert!(dev.vm_counters().failed_creates > 0);
    alloc.check_invariants().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!((dev.live_physical(), dev.physical_bytes(), dev.live_mappings()), (0, 0, vec![]));
}

/// Expandable segments over a device of more than 2^63 bytes: the default virtual range (twice
/// the device, rounded up to a page) overflowed (a panic at the first allocation). It is capped
/// at the largest request now, as `expandable_segments_reserve` already was.
#[test]
fn expandable_segments_over_a_huge_device_reserve_at_most_the_largest_request() {
    let dev = Arc::new(SimDevice::new(u64::MAX));
    dev.set_virtual_memory(true);
    let alloc =
        Allocator::new(dev.clone(), Config::default().with_expandable_segments(true)).unwrap();
    let buf = alloc.alloc(30 << 20, StreamId::DEFAULT).unwrap();
    assert_eq!(dev.live_segments(), vec![], "an ordinary segment instead of a range");
    let ranges = alloc.expandable_ranges();
    assert_eq!(ranges.len(), 1);
    assert_eq!(ranges[0].virtual_size, MAX_REQUEST);
    drop(buf);
    still_works(&dev, &alloc);
    alloc.release_persistent().unwrap();
    assert_eq!((dev.live_physical(), dev.physical_bytes()), (0, 0));
}

/// A configuration refused while blocks are live, waiting in a stream cache and pending behind
/// another stream's use changes nothing: the string form is refused by the parser (the
/// configuration it was applied to unchanged), the same rules broken field by field are
/// refused by `set_config` before it touches anything (the stream caches are not flushed: the
/// cached block is still a lock-free hit), and nothing leaks.
#[test]
fn a_refused_configuration_leaves_live_cached_and_pending_blocks_as_they_were() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let s = StreamId::DEFAULT;
    let other = dev.create_stream().unwrap();
    let live = alloc.alloc(30 << 20, s).unwrap();
    let pending = alloc.alloc(8 << 20, s).unwrap();
    let (kernel, gate) = common::gated(pending.ptr(), 8 << 20, AccessKind::Read);
    dev.launch(other, kernel).unwrap();
    pending.record_stream(other).unwrap();
    drop(pending); // waits for an event behind the gated kernel on `other`
    let small = alloc.alloc(4096, s).unwrap();
    drop(small); // waits in the stream's cache
    let (config, stats) = (alloc.config(), alloc.stats());
    assert_eq!(stats.cached_fast_bytes, 4096);
    assert_eq!(stats.blocks.active_bytes.all.current, (30 << 20) + (8 << 20));
    let bad_value = |key: &str, value: &str, expected: &str| ConfigError::BadValue {
        key: key.into(),
        value: value.into(),
        expected: expected.into(),
    };
    for (s, error) in [
        ("bogus_key:1", ConfigError::UnknownKey("bogus_key".into())),
        (
            "max_split_size_mb:abc",
            bad_value("max_split_size_mb", "abc", "a whole number of MiB, at least 1"),
        ),
        (
            "garbage_collection_threshold:1",
            bad_value("garbage_collection_threshold", "1", "a number in (0, 1)"),
        ),
        (
            "roundup_power2_divisions:[64:8",
            ConfigError::Malformed("`[` without `]` in `roundup_power2_divisions:[64:8`".into()),
        ),
        ("expandable_segments", ConfigError::Malformed("expandable_segments".into())),
        (
            "max_split_size_mb:10",
            ConfigError::Inconsistent(
                "max_split_size_mb (10 MiB) must be at least large_segment_mb (20 MiB)".into(),
            ),
        ),
    ] {
        let mut c = (*config).clone();
        assert_eq!(c.apply(s), Err(error), "{s}");
        assert_eq!(c, *config, "{s}");
    }
    type Spoil = fn(&mut Config);
    let refused: [(Spoil, &str); 3] = [
        (|c| c.fast_cache_entries = 0, "fast_cache_entries must be at least 1"),
        (|c| c.memory_fraction = Some(1.5), "per_process_memory_fraction 1.5 is not in [0, 1]"),
        (
            |c| (c.caching, c.expandable_segments) = (false, true),
            "caching:false (every free returns its memory to the device) cannot be combined \
             with expandable_segments",
        ),
    ];
    for (spoil, why) in refused {
        let mut bad = (*config).clone();
        spoil(&mut bad);
        assert_eq!(alloc.set_config(bad), Err(ConfigError::Inconsistent(why.into())));
        assert_eq!(*alloc.config(), *config);
        assert_eq!(alloc.stats(), stats);
    }
    let locked = alloc.stats().locked_allocations;
    let hit = alloc.alloc(4096, s).unwrap();
    assert_eq!(alloc.stats().locked_allocations, locked);
    drop((hit, live));
    gate.send(()).unwrap();
    still_works(&dev, &alloc);
}
