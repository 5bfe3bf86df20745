//! The public API as a downstream user meets it: what an error says when a user gets something
//! wrong, read as the user reads it (its `Display`, down the `source()` chain for the errors that
//! wrap another), and which way it points them.

use std::sync::Arc;
use tidepool::{
    AllocError, Allocator, Config, Device, ErrorChain, HostAllocError, HostAllocator, SimDevice,
    StreamId,
};

/// A configuration built with the setters (no environment variable involved) that contradicts
/// itself is refused naming the keys, not `TIDEPOOL_ALLOC_CONF`, which the user never set (and
/// `Config::parse`, which a command line's `--config` uses, the same).
#[test]
fn a_configuration_error_blames_no_variable_the_user_did_not_set() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let config = Config::default().with_max_split_size_mb(5);
    let e = Allocator::new(dev.clone(), config).map(|_| ()).unwrap_err();
    // The allocator's layer, then the configuration's (its source), each once.
    assert_eq!(e.to_string(), "the allocator refused its configuration");
    let source = std::error::Error::source(&e).expect("the configuration's error").to_string();
    assert_eq!(
        source,
        "inconsistent configuration: max_split_size_mb (5 MiB) must be at least large_segment_mb \
         (20 MiB)"
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
    // As a user reads it: the whole chain (the pinned allocator's layer, then the device's).
    let e = ErrorChain(&staging.upload(&buf).unwrap_err()).to_string();
    assert!(e.starts_with("a device call on pinned host memory failed: "), "{e}");
    assert!(e.contains("copies to or from unbacked device memory"), "{e}");
    assert!(e.contains("SimDevice::backed(capacity)"), "the way out is named: {e}");
    let e = ErrorChain(&staging.download(&buf).unwrap_err()).to_string();
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

/// The README puts a step's activations in a scope, and stages host data through pinned memory;
/// but `PinnedBuffer::upload` and `download` took only a `Buffer`, so a scope's buffer could be
/// filled from pinned memory only through `unsafe copy_to_device` (what the eager layer does).
/// `upload_scoped` / `download_scoped` are the checked forms: across three runs of a named
/// scope on a side stream (the last two served from its learned plan) the bytes go in and
/// come back, on the scope's stream, with no sanitizer violation; a shorter buffer or one of
/// another device is refused, copying nothing.
#[test]
fn a_scopes_buffer_is_filled_and_read_through_pinned_memory() {
    let dev = Arc::new(SimDevice::backed(64 << 20));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = HostAllocator::new(dev.clone());
    let side = dev.create_stream().unwrap();
    for run in 0..3u8 {
        let scope = alloc.named_scope("step", side);
        let x = scope.alloc(4096).unwrap();
        let y = scope.alloc(8192).unwrap();
        let mut up = pinned.alloc(4096).unwrap();
        up.as_mut_slice().unwrap().fill(run + 1);
        up.upload_scoped(&x).unwrap();
        assert_eq!(up.pending_streams(), [side]); // on the scope's stream
        up.upload_scoped(&y).unwrap(); // the first 4096 bytes of the larger buffer
        let mut down = pinned.alloc(4096).unwrap();
        down.download_scoped(&y).unwrap();
        assert_eq!(down.as_slice().unwrap(), &[run + 1; 4096][..], "run {run}");
        // Too short, and another device's: refused, nothing enqueued.
        let mut big = pinned.alloc(8192 + 512).unwrap();
        let e = big.upload_scoped(&y).unwrap_err();
        assert_eq!(e, HostAllocError::OutOfRange { offset: 0, bytes: 8192 + 512, len: 8192 });
        assert!(big.pending_streams().is_empty());
        let other = Arc::new(SimDevice::backed(16 << 20));
        let other_pinned = HostAllocator::new(other.clone());
        let mut foreign = other_pinned.alloc(4096).unwrap();
        assert_eq!(foreign.download_scoped(&x), Err(HostAllocError::WrongDevice));
        assert_eq!(other.counters().launches, 0);
        drop((up, down, big, x, y));
    }
    let s = alloc.stats();
    assert_eq!((s.plan_hits, s.plan_misses), (4, 0)); // runs 2 and 3 followed the plan
    dev.synchronize().unwrap();
    assert_eq!(dev.violations(), vec![]);
    alloc.check_invariants().unwrap();
    pinned.check_invariants().unwrap();
}

/// An unknown stream id is refused; the message said only "never created, or destroyed". The
/// two ways a user gets there that it did not name — another device's stream id (ids are per
/// device), an application's stream not adopted (what `CudaBuffer::order_for` reports as
/// `StreamId(u32::MAX)`) — are named now, with the way to a usable stream.
#[test]
fn an_unknown_stream_error_names_the_ways_to_a_usable_stream() {
    let all = tidepool::Allocators::sim(2, 1 << 30, Config::default()).unwrap();
    let s = all.for_device(0).unwrap().device().create_stream().unwrap();
    let e = all.for_device(1).unwrap().alloc(4096, s).unwrap_err();
    assert_eq!(e, AllocError::UnknownStream(s));
    assert_eq!(
        e.to_string(),
        "stream 1 does not exist on the allocator's device (never created there, destroyed, or \
         another device's: a stream id is its device's own): refused, nothing changed; use a \
         stream the device made (Device::create_stream) or adopted (adopt_stream)"
    );
    assert_eq!(
        AllocError::UnknownStream(StreamId(u32::MAX)).to_string(),
        "the stream is not one of the allocator's device (another context's, or an \
         application's stream not adopted): refused, nothing changed; adopt it first \
         (CudaDevice::adopt_stream)"
    );
    assert_eq!(all.for_device(1).unwrap().device().counters().mallocs, 0);
}

/// The unknown-key message lists PyTorch's keys that are accepted with no effect too (after
/// tidepool's own): a user who looks for `release_lock_on_cudamalloc` there would otherwise
/// think it refused, though a `PYTORCH_CUDA_ALLOC_CONF` string with it works unchanged.
#[test]
fn an_unknown_key_lists_the_keys_accepted_with_no_effect_too() {
    let e = Config::parse("warp_speed:9").unwrap_err().to_string();
    let keys: Vec<&str> = tidepool::CONFIG_KEYS.iter().map(|(k, _)| *k).collect();
    let want = format!(
        "unknown key `warp_speed`; valid keys: {}; accepted with no effect (PyTorch's): \
         release_lock_on_cudamalloc, release_lock_on_device_malloc, \
         pinned_use_cuda_host_register, pinned_use_device_host_register, \
         pinned_num_register_threads, pinned_use_background_threads, release_lock_on_hipmalloc, \
         pinned_use_hip_host_register, pinned_reserve_segment_size_mb, pinned_free_catch_all",
        keys.join(", ")
    );
    assert_eq!(e, want);
    // Every key named there is accepted.
    for (k, _) in tidepool::CONFIG_NO_EFFECT_KEYS {
        let value = match *k {
            "pinned_num_register_threads" => "8",
            "pinned_reserve_segment_size_mb" => "64",
            _ => "True",
        };
        assert!(Config::parse(&format!("{k}:{value}")).is_ok(), "{k}");
    }
}
