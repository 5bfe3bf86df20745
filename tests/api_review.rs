//! The public API as a downstream user meets it: what an error says when a user gets something
//! wrong, read as the user reads it (its `Display`), and which way it points them.

use std::sync::Arc;
use tidepool::{AllocError, Allocator, Config, HostAllocator, SimDevice, StreamId};

/// A configuration built with the setters (no environment variable involved) that contradicts
/// itself is refused naming the keys, not `TIDEPOOL_ALLOC_CONF`, which the user never set (and
/// `Config::parse`, which a command line's `--config` uses, the same).
#[test]
fn a_configuration_error_blames_no_variable_the_user_did_not_set() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let config = Config::default().with_max_split_size_mb(5);
    let e = Allocator::new(dev.clone(), config).map(|_| ()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "configuration error: inconsistent configuration: max_split_size_mb (5 MiB) must be at \
         least large_segment_mb (20 MiB)"
    );
    let e = Config::parse("expandable_segments:yes").unwrap_err();
    assert_eq!(e.to_string(), "bad value `yes` for `expandable_segments`: expected true or false");
    let e = Config::parse("warp_speed:9").unwrap_err().to_string();
    assert!(e.starts_with("unknown key `warp_speed`; valid keys: max_split_size_mb, "), "{e}");
    assert!(!e.contains("TIDEPOOL_ALLOC_CONF"), "{e}");
    // Nothing was made.
    assert_eq!((dev.reserved_bytes(), dev.counters().mallocs), (0, 0));
}

/// The README's first device is `SimDevice::new` (unbacked); its pinned-memory example copies to
/// it. The copy is refused, and the error says how to get a device that copies, rather than
/// only that the memory is unbacked. The staging buffer and the allocators stay usable.
#[test]
fn a_copy_to_an_unbacked_simulated_device_says_to_make_a_backed_one() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = HostAllocator::new(dev.clone());
    let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let mut staging = pinned.alloc(4096).unwrap();
    staging.as_mut_slice().unwrap().fill(7);
    let e = staging.upload(&buf).unwrap_err().to_string();
    assert!(e.contains("copies to or from unbacked device memory"), "{e}");
    assert!(e.contains("SimDevice::backed(capacity)"), "the way out is named: {e}");
    let e = staging.download(&buf).unwrap_err().to_string();
    assert!(e.contains("SimDevice::backed(capacity)"), "{e}");
    // Nothing was enqueued: the buffer is still the host's, with its bytes.
    assert!(staging.pending_streams().is_empty());
    assert_eq!(staging.as_slice().unwrap(), &[7u8; 4096][..]);
    drop((staging, buf));
    pinned.check_invariants().unwrap();
    alloc.check_invariants().unwrap();

    // The same program on a backed device copies.
    let dev = Arc::new(SimDevice::backed(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = HostAllocator::new(dev.clone());
    let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let mut staging = pinned.alloc(4096).unwrap();
    staging.as_mut_slice().unwrap().fill(7);
    staging.upload(&buf).unwrap();
    let mut back = pinned.alloc(4096).unwrap();
    back.download(&buf).unwrap();
    assert_eq!(back.as_slice().unwrap(), &[7u8; 4096][..]);
    assert!(matches!(alloc.alloc(10, StreamId(99)), Err(AllocError::UnknownStream(_))));
    assert_eq!(dev.violations(), vec![]);
}

/// A cap smaller than the segment a request needs (a 2 MiB small segment under
/// `max_pool_size_mb:1`, or `per_process_memory_fraction:0`) refuses every such request however
/// much is freed; the report's only advice was to free tensors or lower `max_split_size_mb`.
/// It now says the cap must be raised, and only where that is so.
#[test]
fn an_oom_under_a_cap_smaller_than_the_segment_says_to_raise_the_cap() {
    let raise = "no freeing can make room: raise the cap.";
    let dev = Arc::new(SimDevice::new(1 << 30));
    for (conf, cap) in
        [("max_pool_size_mb:1", "1.00 MiB"), ("per_process_memory_fraction:0", "0 B")]
    {
        let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
        let e = alloc.alloc(4096, StreamId::DEFAULT).unwrap_err();
        let AllocError::OutOfMemory(report) = &e else { panic!("{conf}: {e}") };
        assert_eq!((report.segment, report.reserved), (2 << 20, 0), "{conf}");
        let msg = e.to_string();
        assert!(
            msg.ends_with(&format!(
                " The new segment alone (2.00 MiB) exceeds the cap ({cap}: the smallest of \
                 memory_limit_mb, max_pool_size_mb and per_process_memory_fraction × the \
                 device, of those set), so {raise}"
            )),
            "{conf}: {msg}"
        );
        assert_eq!(alloc.stats().num_ooms, 1);
        assert_eq!(dev.reserved_bytes(), 0);
    }
    // A cap that fits the segment but is full: freeing helps, the old advice stands alone.
    let alloc = Allocator::new(dev.clone(), Config::parse("max_pool_size_mb:4").unwrap()).unwrap();
    let full: Vec<_> = (0..4).map(|_| alloc.alloc(1 << 20, StreamId::DEFAULT).unwrap()).collect();
    assert_eq!(dev.reserved_bytes(), 4 << 20); // two 2 MiB segments of two blocks each: the cap
    let msg = alloc.alloc(1 << 20, StreamId::DEFAULT).unwrap_err().to_string();
    assert!(
        msg.ends_with("lowering max_split_size_mb to reduce fragmentation, may help."),
        "{msg}"
    );
    assert!(!msg.contains(raise), "{msg}");
    drop(full);
    assert_eq!(alloc.alloc(1 << 20, StreamId::DEFAULT).unwrap().len(), 1 << 20);
}
