//! `PYTORCH_CUDA_ALLOC_CONF` strings copied from PyTorch jobs configure tidepool unchanged, and
//! mean what they mean there: the rounding of PyTorch's `test_cuda` allocator-settings test,
//! `expandable_segments:True`, the per-interval `roundup_power2_divisions` list, and the keys
//! that have no effect here (accepted, listed in `memory_summary`).

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
