//! The configuration keys: every one `Config::parse` accepts ([`KEYS`]) and PyTorch's keys
//! that are accepted with no effect here ([`NO_EFFECT_KEYS`]).

/// Every key `Config::parse` accepts, with what it sets.
pub const KEYS: &[(&str, &str)] = &[
    ("max_split_size_mb", "blocks of at least this many MiB are never split (≥ large_segment_mb)"),
    (
        "roundup_power2_divisions",
        "round sizes to this many steps between powers of two: 0 or a power of two, or PyTorch's \
         per-interval list [64:8,256:4,>:1] (keys in MiB)",
    ),
    (
        "max_non_split_rounding_mb",
        "an oversized block (≥ max_split_size) serves a large request it exceeds by less than \
         this many MiB (≥ 20; default 20)",
    ),
    ("backend", "native (the only backend: PyTorch's key, for its strings)"),
    ("min_block_size", "rounding granularity in bytes (a power of two, 256..=1048576)"),
    ("small_size_mb", "largest request of the small pool, MiB"),
    ("small_segment_mb", "segment size of the small pool, MiB"),
    ("large_segment_mb", "segment size of the large pool, MiB"),
    ("min_large_alloc_mb", "requests of at least this many MiB get their own segment"),
    ("round_large_mb", "own segments are rounded to a multiple of this many MiB"),
    ("memory_limit_mb", "never reserve more than this many MiB"),
    (
        "per_process_memory_fraction",
        "never reserve more than this share of device memory, in [0, 1]",
    ),
    ("cross_stream", "cross-stream reuse: strict, wait_event or never"),
    (
        "fast_cache",
        "per-stream caches that skip the global lock on a same-size reuse: true or false",
    ),
    ("fast_cache_entries", "blocks a stream caches per size class, 1..=65536"),
    (
        "fast_cache_bytes_mb",
        "MiB of small blocks a stream cache lane holds (and of its one large block), 1..=1048576",
    ),
    ("global_lock", "route everything through one mutex (no fast cache): true or false"),
    (
        "biased_lanes",
        "per-stream caches taken with no atomic read-modify-write by the thread that uses them \
         (Linux membarrier): true or false",
    ),
    (
        "expandable_segments",
        "one growing virtual range per stream, pool and residency, mapped page by page: true or false",
    ),
    (
        "expandable_stitching",
        "with expandable segments, serve a large request from free pages in pieces, mapped again \
         at one address (GMLake's stitching): true or false",
    ),
    (
        "expandable_segments_reserve",
        "with expandable segments, virtual addresses per range: a share of the device's memory \
         (0.25; above 1 allowed) or GiB with a G suffix (16G); default twice the device",
    ),
    (
        "release_threshold_mb",
        "with expandable segments, free MiB a transient range keeps mapped (0.., or none: no limit)",
    ),
    (
        "garbage_collection_threshold",
        "once reserved is past this share of the cap, release idle cached large segments, oldest first, in (0, 1)",
    ),
    ("initial_pool_size_mb", "MiB reserved up front and kept (0: none)"),
    ("max_pool_size_mb", "never reserve more than this many MiB (like memory_limit_mb)"),
    (
        "graph_capture_record_stream_reuse",
        "reuse, within a CUDA graph capture, a block used on a side stream once that stream was \
         joined back (PyTorch's key): true or false",
    ),
    (
        "caching",
        "false: every allocation is its own device allocation, every free returns it (debugging)",
    ),
    (
        "throw_on_cudamalloc_oom",
        "refuse at once, with no cache release or retry, a reservation past the cap (or the \
         device's total): true or false (PyTorch's key)",
    ),
    (
        "pinned_max_round_threshold_mb",
        "pinned host memory: requests above this many MiB get a block of their own size, not \
         the next power of two (0..; PyTorch's key; HostAllocator::with_config)",
    ),
    (
        "pinned_max_cached_size_mb",
        "pinned host memory: freed blocks above this many MiB go back to the device instead of \
         the cache, and requests above it are not rounded (0..; PyTorch's key)",
    ),
    (
        "large_segment_size_mb",
        "PyTorch's spelling of large_segment_mb (> 10); also raises max_non_split_rounding_mb \
         to it",
    ),
];

/// PyTorch keys accepted with no effect on device memory (their values checked as PyTorch
/// checks them: `true` or `false`, `pinned_num_register_threads` a power of two ≤ 128; kept in
/// [`Config::no_effect`]), with what they concern.
///
/// [`Config::no_effect`]: super::Config::no_effect
pub const NO_EFFECT_KEYS: &[(&str, &str)] = &[
    ("release_lock_on_cudamalloc", "locking only"),
    ("release_lock_on_device_malloc", "locking only"),
    ("pinned_use_cuda_host_register", "pinned host memory"),
    ("pinned_use_device_host_register", "pinned host memory"),
    ("pinned_num_register_threads", "pinned host memory"),
    ("pinned_use_background_threads", "pinned host memory"),
    ("release_lock_on_hipmalloc", "locking only (ROCm's spelling)"),
    ("pinned_use_hip_host_register", "pinned host memory (ROCm's spelling)"),
    (
        "pinned_reserve_segment_size_mb",
        "pinned host memory (a segment carved by a bump pointer; every tidepool pinned block is \
         its own host allocation, cached)",
    ),
    ("pinned_free_catch_all", "pinned host memory (tidepool's frees report errors as values)"),
];
