//! What a PyTorch user brings works as it does there: `PYTORCH_CUDA_ALLOC_CONF` strings copied
//! from PyTorch jobs configure tidepool unchanged (the rounding of PyTorch's `test_cuda`
//! allocator-settings test, `expandable_segments:True`, the per-interval
//! `roundup_power2_divisions` list, and the keys that have no effect here, accepted and listed in
//! `memory_summary`), and `memory_stats()` reads with `torch.cuda.memory_stats()`'s keys.

use std::sync::Arc;
use tidepool::device::SimDevice;
use tidepool::{Allocator, Config, MIB, StreamId};

const S0: StreamId = StreamId::DEFAULT;

fn allocator(conf: &str) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(SimDevice::new(8 << 30));
    let alloc = Allocator::new(dev.clone(), Config::parse(conf).unwrap()).unwrap();
    (dev, alloc)
}

fn allocated(alloc: &Allocator<SimDevice>) -> u64 {
    alloc.stats().blocks.allocated_bytes.all.current
}

fn requested(alloc: &Allocator<SimDevice>) -> u64 {
    alloc.stats().blocks.requested_bytes.all.current
}

/// PyTorch's `test_cuda` allocator-settings scenario: an 84 MiB tensor under `[64:8,...]` takes
/// `power2_div(nbytes, 8)` = 88 MiB, a 400 MiB one under `256:2` takes 512 MiB; the requested
/// bytes stay exact. Then the same string with `expandable_segments:True`.
#[test]
fn the_list_form_rounds_each_interval_as_pytorch() {
    for expandable in ["False", "True"] {
        let conf = format!(
            "garbage_collection_threshold:0.5,expandable_segments:{expandable},\
             roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"
        );
        let (dev, alloc) = allocator(&conf);
        assert_eq!(alloc.config().expandable_segments, expandable == "True");
        let nbytes = 84 * MIB;
        let w = alloc.alloc(nbytes, S0).unwrap();
        assert_eq!(allocated(&alloc), 88 * MIB, "{conf}");
        assert_eq!(requested(&alloc), nbytes);
        let nbytes_big = 400 * MIB;
        let v = alloc.alloc(nbytes_big, S0).unwrap();
        assert_eq!(allocated(&alloc), 88 * MIB + 512 * MIB);
        assert_eq!(requested(&alloc), nbytes + nbytes_big);
        // 1 GiB and up: one division, plain 512-byte rounding.
        let big = alloc.alloc(1500 * MIB + 1, S0).unwrap();
        assert_eq!(allocated(&alloc), 88 * MIB + 512 * MIB + 1500 * MIB + 512);
        drop((w, v, big));
        assert_eq!(allocated(&alloc), 0);
        alloc.empty_cache().unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(dev.reserved_bytes(), 0, "{conf}");
    }
}

/// Unsloth's default string: 256 divisions for small sizes (a 200 KiB + 1 request rounds to a
/// 512-byte step, 1 MiB + 1 to a 4 KiB step), 128 in 64..128 MiB.
#[test]
fn unsloths_default_string_works() {
    let (_dev, alloc) =
        allocator("expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]");
    let a = alloc.alloc(200 * 1024 + 1, S0).unwrap();
    assert_eq!(allocated(&alloc), 200 * 1024 + 512);
    let b = alloc.alloc(MIB + 1, S0).unwrap();
    assert_eq!(allocated(&alloc), 200 * 1024 + 512 + MIB + 4096);
    let c = alloc.alloc(100 * MIB + 1, S0).unwrap();
    assert_eq!(allocated(&alloc), 200 * 1024 + 512 + MIB + 4096 + 100 * MIB + 512 * 1024);
    // The same sizes again hit the cached blocks: the rounding is the same on every path.
    let before = alloc.stats().num_device_alloc;
    drop((a, b, c));
    let again = [200 * 1024 + 1, MIB + 1, 100 * MIB + 1].map(|n| alloc.alloc(n, S0).unwrap());
    assert_eq!(allocated(&alloc), 200 * 1024 + 512 + MIB + 4096 + 100 * MIB + 512 * 1024);
    assert_eq!(alloc.stats().num_device_alloc, before);
    drop(again);
    alloc.check_invariants().unwrap();
}

/// Keys PyTorch has for host memory and locking are accepted, checked, and named in the summary;
/// `backend:cudaMallocAsync` is refused with the reason.
#[test]
fn keys_without_effect_are_accepted_and_shown() {
    let (_dev, alloc) = allocator(
        "backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
         pinned_num_register_threads:8",
    );
    let summary = alloc.memory_summary();
    for kv in [
        "release_lock_on_cudamalloc:True",
        "pinned_use_cuda_host_register:True",
        "pinned_num_register_threads:8",
    ] {
        let line = summary.lines().find(|l| l.contains(kv)).unwrap_or_else(|| panic!("{summary}"));
        assert!(line.contains("PyTorch key, accepted: no effect here"), "{line}");
    }
    let e = Config::parse("backend:cudaMallocAsync").unwrap_err().to_string();
    assert!(e.contains("bad value `cudaMallocAsync` for `backend`"), "{e}");
    // A threshold without a cap collects against the device's memory (8 GiB × 0.5).
    let (_dev, alloc) = allocator("garbage_collection_threshold:0.5");
    let summary = alloc.memory_summary();
    assert!(summary.contains("garbage collection: 0.5 (4.00 GiB)"), "{summary}");
}

/// `memory_stats()` has `torch.cuda.memory_stats()`'s keys and figures: a 1000-byte tensor in a
/// 2 MiB small segment, a 3 MiB one split off a 20 MiB large segment (its 17 MiB remainder an
/// inactive split), then the small one freed.
#[test]
fn memory_stats_has_pytorchs_keys_and_figures() {
    let (_dev, alloc) = allocator("max_split_size_mb:64");
    let small = alloc.alloc(1000, S0).unwrap();
    let large = alloc.alloc(3 * MIB, S0).unwrap();
    drop(small);
    let m = alloc.memory_stats();
    // Nine block figures × five groups × four fields, two oversize figures, seven counters
    // (`num_oom_rejections` among them).
    assert_eq!(m.len(), 9 * 5 * 4 + 2 * 4 + 7);
    assert_eq!(m["num_oom_rejections"], 0);
    let want: [(&str, i64); 22] = [
        ("allocation.all.current", 1),
        ("allocation.all.peak", 2),
        ("allocation.all.allocated", 2),
        ("allocation.all.freed", 1),
        ("allocation.small_pool.freed", 1),
        ("allocated_bytes.all.current", 3 << 20),
        ("allocated_bytes.small_pool.peak", 1024),
        ("allocated_bytes.large_pool.current", 3 << 20),
        ("requested_bytes.all.allocated", (3 << 20) + 1000),
        ("requested_bytes.small_pool.current", 0),
        ("reserved_bytes.all.current", 22 << 20),
        ("reserved_bytes.small_pool.current", 2 << 20),
        ("reserved_bytes.large_pool.current", 20 << 20),
        ("reserved_bytes.transient.current", 22 << 20),
        ("segment.all.current", 2),
        ("inactive_split_bytes.large_pool.current", 17 << 20),
        ("inactive_split.large_pool.current", 1),
        ("active_bytes.all.current", 3 << 20),
        ("num_device_alloc", 2),
        ("num_device_free", 0),
        ("num_alloc_retries", 0),
        ("max_split_size", 64 << 20),
    ];
    for (key, v) in want {
        assert_eq!(m[key], v, "{key}");
    }
    drop(large);
    alloc.empty_cache().unwrap();
    let m = alloc.memory_stats();
    assert_eq!((m["reserved_bytes.all.current"], m["num_device_free"]), (0, 2));
    assert_eq!(m["reserved_bytes.all.peak"], 22 << 20);
    // On expandable segments PyTorch counts page maps and unmaps as device calls too.
    let (_dev, alloc) = allocator("expandable_segments:True");
    let b = alloc.alloc(3 * MIB, S0).unwrap();
    let s = alloc.stats();
    let m = alloc.memory_stats();
    assert_eq!((s.num_device_alloc, m["max_split_size"]), (0, -1));
    assert!(s.num_device_map >= 1);
    assert_eq!(m["num_device_alloc"], s.num_device_map as i64);
    drop(b);
    alloc.empty_cache().unwrap();
    let s = alloc.stats();
    assert_eq!(alloc.memory_stats()["num_device_free"], s.num_device_unmap as i64);
    assert!(s.num_device_unmap >= 1);
}
