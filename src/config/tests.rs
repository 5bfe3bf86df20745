//! The configuration parser's tests.

use super::*;
use crate::ErrorChain;
use crate::pool::RoundupDivisions;

#[test]
fn every_key_parses() {
    let c = Config::parse(
        "max_split_size_mb:256, roundup_power2_divisions:8,min_block_size:1024,small_size_mb:2,\
         small_segment_mb:4,large_segment_mb:40,min_large_alloc_mb:20,round_large_mb:4,\
         memory_limit_mb:4096,per_process_memory_fraction:0.5,cross_stream:wait_event,\
         fast_cache:false,fast_cache_entries:4,fast_cache_bytes_mb:8,global_lock:true,\
         expandable_segments:true,release_threshold_mb:0,garbage_collection_threshold:0.75,\
         initial_pool_size_mb:64,max_pool_size_mb:2048,caching:true,\
         max_non_split_rounding_mb:30,backend:native,expandable_stitching:true,\
         graph_capture_record_stream_reuse:True,biased_lanes:false,\
         throw_on_cudamalloc_oom:True",
    )
    .unwrap();
    let z = c.sizing;
    assert_eq!(z.max_split_size, 256 * MIB);
    assert_eq!(z.roundup_power2_divisions, RoundupDivisions::uniform(8).unwrap());
    assert_eq!(z.max_non_split_rounding, 30 * MIB);
    assert_eq!(z.min_block_size, 1024);
    assert_eq!(z.small_size, 2 * MIB);
    assert_eq!(z.small_segment, 4 * MIB);
    assert_eq!(z.large_segment, 40 * MIB);
    assert_eq!(z.min_large_alloc, 20 * MIB);
    assert_eq!(z.round_large, 4 * MIB);
    assert_eq!(c.memory_limit, Some(4096 * MIB));
    assert_eq!(c.memory_fraction, Some(0.5));
    assert_eq!(c.cross_stream, CrossStream::WaitEvent);
    assert!(!c.fast_cache);
    assert_eq!(c.fast_cache_entries, 4);
    assert_eq!(c.fast_cache_bytes, 8 * MIB);
    assert!(c.global_lock);
    assert!(!c.biased_lanes);
    assert!(Config::default().biased_lanes);
    assert!(!c.fast_path());
    assert!(c.expandable_segments);
    assert!(c.stitching);
    assert!(c.graph_capture_record_stream_reuse);
    assert_eq!(c.release_threshold, 0);
    assert_eq!(c.garbage_collection_threshold, Some(0.75));
    assert_eq!(c.initial_pool_size, 64 * MIB);
    assert_eq!(c.max_pool_size, Some(2048 * MIB));
    assert!(c.caching);
    assert!(c.throw_on_oom && !Config::default().throw_on_oom);
    // The cap is the smallest of the three limits; the collection starts at 3/4 of it.
    assert_eq!(c.limit(16384 * MIB), Some(2048 * MIB)); // max_pool_size
    assert_eq!(c.limit(2048 * MIB), Some(1024 * MIB)); // the fraction
    assert_eq!(c.clone().with_max_pool_size(8192 * MIB).limit(16384 * MIB), Some(4096 * MIB));
    assert_eq!(c.gc_limit(16384 * MIB), Some(1536 * MIB));
    assert_eq!(KEYS.len(), 31, "a new key needs a line in this test");
}

#[test]
fn large_segment_size_mb_is_pytorchs_spelling() {
    let c = Config::parse("large_segment_size_mb:64").unwrap();
    assert_eq!((c.sizing.large_segment, c.sizing.max_non_split_rounding), (64 * MIB, 64 * MIB));
    // A larger rounding stays; PyTorch's floor of 10 MiB is exclusive.
    let c = Config::parse("max_non_split_rounding_mb:100,large_segment_size_mb:32").unwrap();
    assert_eq!((c.sizing.large_segment, c.sizing.max_non_split_rounding), (32 * MIB, 100 * MIB));
    // As PyTorch: the rounding follows a smaller large segment too, an explicit one must
    // reach it wherever the keys stand, and a huge max_split_size_mb is clamped.
    let c = Config::parse("large_segment_size_mb:12,max_split_size_mb:12").unwrap();
    assert_eq!(c.sizing.max_non_split_rounding, 12 * MIB);
    for s in [
        "max_non_split_rounding_mb:32,large_segment_size_mb:64",
        "large_segment_size_mb:64,max_non_split_rounding_mb:32",
    ] {
        assert!(Config::parse(s).is_err(), "{s}");
    }
    let c = Config::parse("max_split_size_mb:1000000000").unwrap();
    assert_eq!(c.sizing.max_split_size, (1 << 28) * MIB);
    let e = Config::parse("large_segment_size_mb:10").unwrap_err();
    assert!(e.to_string().contains("above 10"), "{e}");
    // max_split_size must still be at least the large segment.
    assert!(Config::parse("large_segment_size_mb:64,max_split_size_mb:40").is_err());
    let c = Config::parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:False");
    assert_eq!(c.unwrap().no_effect.len(), 2);
    assert!(Config::parse("throw_on_cudamalloc_oom:maybe").is_err());
}

#[test]
fn expandable_segments_reserve_is_a_share_or_gib() {
    let r = |v: &str| Config::parse(&format!("expandable_segments_reserve:{v}"));
    assert_eq!(r("0.25").unwrap().expandable_reserve, Some(ExpandableReserve::Fraction(0.25)));
    assert_eq!(r("1.5").unwrap().expandable_reserve, Some(ExpandableReserve::Fraction(1.5)));
    assert_eq!(r("2g").unwrap().expandable_reserve, Some(ExpandableReserve::Bytes(2 << 30)));
    assert_eq!(r("0.5G").unwrap().expandable_reserve, Some(ExpandableReserve::Bytes(1 << 29)));
    for bad in ["0", "-1", "nan", "inf", "G", "1T", "", "1e400"] {
        assert!(r(bad).is_err(), "{bad}");
    }
    assert_eq!(Config::default().expandable_reserve, None);
    assert_eq!(ExpandableReserve::Bytes(u64::MAX).bytes(1), crate::types::MAX_REQUEST);
    assert_eq!(ExpandableReserve::Fraction(1e300).bytes(1 << 30), crate::types::MAX_REQUEST);
}

#[test]
fn pinned_keys_set_the_host_config() {
    let d = Config::default().pinned;
    assert_eq!((d.max_round_threshold, d.max_cached_size), (u64::MAX, u64::MAX));
    assert!(d.rounds(u64::MAX) && d.caches(u64::MAX));
    let c = Config::parse("pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:128");
    let p = c.unwrap().pinned;
    assert_eq!((p.max_round_threshold, p.max_cached_size), (64 * MIB, 128 * MIB));
    assert!(p.rounds(64 * MIB) && !p.rounds(64 * MIB + 1));
    // A class past the cached size is not rounded (it would never be cached).
    let c = Config::parse("pinned_max_cached_size_mb:3").unwrap().pinned;
    assert!(c.rounds(2 * MIB) && !c.rounds(2 * MIB + 1) && c.caches(3 * MIB));
    assert!(p.caches(128 * MIB) && !p.caches(128 * MIB + 1));
    // 0 is PyTorch's "never": nothing rounded, nothing cached.
    let z = Config::parse("pinned_max_cached_size_mb:0").unwrap().pinned;
    assert!(!z.rounds(1) && !z.caches(1) && z.caches(0));
    for bad in ["pinned_max_cached_size_mb:-1", "pinned_max_round_threshold_mb:1.5"] {
        assert!(Config::parse(bad).is_err(), "{bad}");
    }
    // Accepted with no effect, PyTorch's check kept (greater than 0).
    let r = Config::parse("pinned_reserve_segment_size_mb:64,pinned_free_catch_all:True");
    assert_eq!(r.unwrap().no_effect.len(), 2);
    assert!(Config::parse("pinned_reserve_segment_size_mb:0").is_err());
}

#[test]
fn fast_path_defaults_and_global_lock() {
    let d = Config::default();
    assert!(d.fast_cache && !d.global_lock && d.fast_path());
    assert_eq!((d.fast_cache_entries, d.fast_cache_bytes), (1024, 32 * MIB));
    assert!(!Config::parse("global_lock:true").unwrap().fast_path());
    assert!(!Config::parse("fast_cache:false").unwrap().fast_path());
    assert!(Config::parse("global_lock:false,fast_cache:true").unwrap().fast_path());
}

#[test]
fn expandable_keys() {
    let d = Config::default();
    assert!(!d.expandable_segments);
    assert_eq!(d.release_threshold, DEFAULT_RELEASE_THRESHOLD);
    let c = Config::parse("expandable_segments:true,release_threshold_mb:64").unwrap();
    assert!(c.expandable_segments);
    assert_eq!(c.release_threshold, 64 * MIB);
    let c = Config::parse("release_threshold_mb:0").unwrap();
    assert_eq!(c.release_threshold, 0);
    assert_eq!(Config::parse("release_threshold_mb:none").unwrap().release_threshold, u64::MAX);
    let built = Config::default().with_expandable_segments(true).with_release_threshold(0);
    assert_eq!(built, Config::parse("expandable_segments:true,release_threshold_mb:0").unwrap());
}

#[test]
fn empty_string_is_the_default() {
    assert_eq!(Config::parse("").unwrap(), Config::default());
    assert_eq!(Config::default().cross_stream, CrossStream::Strict);
    assert_eq!(Config::parse("cross_stream:never").unwrap().cross_stream, CrossStream::Never);
    assert_eq!(Config::parse(" , ,").unwrap(), Config::default());
    assert_eq!(Config::default().limit(1 << 30), None);
}

#[test]
fn unknown_key_names_it_and_lists_valid_keys() {
    let e = Config::parse("max_split_size_mb:64,foo:1").unwrap_err();
    assert_eq!(e, ConfigError::UnknownKey("foo".into()));
    let msg = e.to_string();
    assert!(msg.contains("unknown key `foo`"), "{msg}");
    for (k, _) in KEYS {
        assert!(msg.contains(k), "{msg} lacks {k}");
    }
}

#[test]
fn bad_values_name_key_and_value() {
    for (s, key) in [
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("max_split_size_mb:0", "max_split_size_mb"),
        ("max_split_size_mb:-5", "max_split_size_mb"),
        ("max_split_size_mb:99999999999999999999", "max_split_size_mb"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:8589934592", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[64:3]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[65:8]", "roundup_power2_divisions"),
        ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb"),
        ("max_non_split_rounding_mb:x", "max_non_split_rounding_mb"),
        ("backend:cudaMallocAsync", "backend"),
        ("expandable_segments:TRUE", "expandable_segments"),
        ("pinned_num_register_threads:3", "pinned_num_register_threads"),
        ("pinned_num_register_threads:256", "pinned_num_register_threads"),
        ("pinned_use_cuda_host_register:yes", "pinned_use_cuda_host_register"),
        ("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc"),
        ("min_block_size:1000", "min_block_size"),
        ("min_block_size:0", "min_block_size"),
        ("min_block_size:1", "min_block_size"),
        ("min_block_size:128", "min_block_size"),
        ("per_process_memory_fraction:-0.1", "per_process_memory_fraction"),
        ("per_process_memory_fraction:1.5", "per_process_memory_fraction"),
        ("per_process_memory_fraction:NaN", "per_process_memory_fraction"),
        ("cross_stream:lazy", "cross_stream"),
        ("memory_limit_mb:", "memory_limit_mb"),
        ("fast_cache:yes", "fast_cache"),
        ("fast_cache_entries:0", "fast_cache_entries"),
        ("fast_cache_entries:70000", "fast_cache_entries"),
        ("fast_cache_bytes_mb:0", "fast_cache_bytes_mb"),
        ("global_lock:1", "global_lock"),
        ("expandable_segments:on", "expandable_segments"),
        ("release_threshold_mb:-1", "release_threshold_mb"),
        ("release_threshold_mb:inf", "release_threshold_mb"),
        ("garbage_collection_threshold:0", "garbage_collection_threshold"),
        ("garbage_collection_threshold:1", "garbage_collection_threshold"),
        ("garbage_collection_threshold:NaN", "garbage_collection_threshold"),
        ("initial_pool_size_mb:-1", "initial_pool_size_mb"),
        ("initial_pool_size_mb:268435457", "initial_pool_size_mb"),
        ("max_pool_size_mb:0", "max_pool_size_mb"),
        ("caching:off", "caching"),
    ] {
        match Config::parse(s) {
            Err(ConfigError::BadValue { key: k, value, .. }) => {
                assert_eq!(k, key, "{s}");
                assert_eq!(value, s.split_once(':').unwrap().1, "{s}");
            }
            other => panic!("{s}: expected BadValue, got {other:?}"),
        }
    }
    // A key after `>` is PyTorch's too (`parseRoundUpPower2Divisions` reads the list in one
    // loop): `>` fills from interval 1, then 64 fills the intervals below it and its own.
    let d = Config::parse("roundup_power2_divisions:[>:8,64:2]").unwrap();
    let d = d.sizing.roundup_power2_divisions;
    assert_eq!(
        (0..16).map(|i| d.interval(i)).collect::<Vec<_>>(),
        [2, 2, 2, 2, 2, 2, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    );
    let msg = Config::parse("cross_stream:lazy").unwrap_err().to_string();
    assert_eq!(msg, "bad value `lazy` for `cross_stream`: expected strict, wait_event or never");
}

#[test]
fn malformed_and_inconsistent() {
    assert_eq!(
        Config::parse("max_split_size_mb").unwrap_err(),
        ConfigError::Malformed("max_split_size_mb".into())
    );
    let e = Config::parse("max_split_size_mb:19").unwrap_err();
    assert!(
        matches!(e, ConfigError::Inconsistent(ref m) if m.contains("must be at least large_segment_mb")),
        "{e}"
    );
    assert!(matches!(Config::parse("small_size_mb:16"), Err(ConfigError::Inconsistent(_))));
    assert!(matches!(Config::parse("min_large_alloc_mb:1"), Err(ConfigError::Inconsistent(_))));
    assert!(matches!(Config::parse("small_size_mb:4"), Err(ConfigError::Inconsistent(_))));
}

#[test]
fn control_keys_and_their_consistency() {
    let d = Config::default();
    assert_eq!(
        (d.garbage_collection_threshold, d.initial_pool_size, d.max_pool_size, d.caching),
        (None, 0, None, true)
    );
    assert_eq!(d.gc_limit(1 << 30), None);
    // Without a cap the threshold is a share of the device's memory (PyTorch's documented
    // behaviour), so PyTorch's common `garbage_collection_threshold:0.6,...` strings work.
    let no_cap = Config::parse("garbage_collection_threshold:0.5,max_split_size_mb:128");
    assert_eq!(no_cap.unwrap().gc_limit(1 << 30), Some(1 << 29));
    let inconsistent = |s: &str, what: &str| match Config::parse(s) {
        Err(ConfigError::Inconsistent(m)) => assert!(m.contains(what), "{s}: {m}"),
        other => panic!("{s}: expected Inconsistent, got {other:?}"),
    };
    inconsistent("initial_pool_size_mb:64,max_pool_size_mb:32", "exceeds max_pool_size_mb");
    inconsistent("initial_pool_size_mb:64,memory_limit_mb:32", "exceeds memory_limit_mb");
    inconsistent("caching:false,expandable_segments:true", "expandable_segments");
    inconsistent("caching:false,initial_pool_size_mb:2", "initial_pool_size_mb");
    inconsistent(
        "caching:false,memory_limit_mb:8,garbage_collection_threshold:0.5",
        "garbage_collection_threshold",
    );
    // A threshold with any of the three caps is fine.
    for (cap, gc) in [
        ("memory_limit_mb:64", 32),
        ("per_process_memory_fraction:0.5", 64),
        ("max_pool_size_mb:64", 32),
    ] {
        let c = Config::parse(&format!("garbage_collection_threshold:0.5,{cap}")).unwrap();
        assert_eq!(c.gc_limit(256 * MIB), Some(gc * MIB), "{cap}");
    }
    // The setters build the same configurations, and validate() checks them.
    let built = Config::default()
        .with_max_pool_size(64 * MIB)
        .with_garbage_collection_threshold(0.5)
        .with_initial_pool_size(32 * MIB);
    assert_eq!(
        built,
        Config::parse(
            "max_pool_size_mb:64,garbage_collection_threshold:0.5,initial_pool_size_mb:32"
        )
        .unwrap()
    );
    assert!(Config::default().with_garbage_collection_threshold(0.5).validate().is_ok());
    assert!(Config::default().with_garbage_collection_threshold(1.5).validate().is_err());
    assert!(Config::default().with_memory_fraction(0.0).validate().is_ok());
    assert!(Config::default().with_memory_fraction(-0.01).validate().is_err());
    let off = Config::default().with_caching(false);
    assert!(!off.fast_path() && off.validate().is_ok());
    assert_eq!(off, Config::parse("caching:false").unwrap());
}

/// Strings copied from PyTorch jobs parse unchanged and mean what they mean there.
#[test]
fn pytorch_strings_work_unchanged() {
    // Unsloth's default.
    let c = Config::parse(
        "expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]",
    )
    .unwrap();
    assert!(c.expandable_segments);
    let d = c.sizing.roundup_power2_divisions;
    assert_eq!(
        [d.for_size(40 * MIB), d.for_size(100 * MIB), d.for_size(4096 * MIB)],
        [256, 128, 32]
    );
    // c10's own parser test string, with the newer generic key names.
    let c = Config::parse(
        "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,\
         roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],backend:native,\
         expandable_segments:True,release_lock_on_device_malloc:True,\
         pinned_use_device_host_register:True,pinned_num_register_threads:8,\
         pinned_use_background_threads:True",
    )
    .unwrap();
    assert_eq!(c.sizing.max_split_size, 40 * MIB);
    assert_eq!(c.sizing.max_non_split_rounding, 30 * MIB);
    assert_eq!(c.garbage_collection_threshold, Some(0.5));
    assert_eq!(c.sizing.roundup_power2_divisions.for_size(1024 * MIB), 4);
    assert_eq!(
        c.no_effect,
        [
            "release_lock_on_device_malloc:True",
            "pinned_use_device_host_register:True",
            "pinned_num_register_threads:8",
            "pinned_use_background_threads:True"
        ]
    );
    // A key given twice keeps its last value, once.
    let c = Config::parse("pinned_num_register_threads:8,pinned_num_register_threads:4");
    assert_eq!(c.unwrap().no_effect, ["pinned_num_register_threads:4"]);
    // `False` and spaces, as PyTorch's lexer allows.
    let c = Config::parse(
        " expandable_segments : False , roundup_power2_divisions : [ 64 : 8 , > : 2 ] ",
    );
    let c = c.unwrap();
    assert!(!c.expandable_segments);
    assert_eq!(c.sizing.roundup_power2_divisions.for_size(MIB), 8);
    assert_eq!(c.sizing.roundup_power2_divisions.for_size(200 * MIB), 2);
    // Brackets must balance.
    for bad in ["roundup_power2_divisions:[64:8", "roundup_power2_divisions:64:8]", "a:]["] {
        assert!(matches!(Config::parse(bad), Err(ConfigError::Malformed(_))), "{bad}");
    }
    let e = Config::parse("backend:cudaMallocAsync").unwrap_err().to_string();
    assert!(e.contains("does not hand requests to cudaMallocAsync"), "{e}");
}

#[test]
fn no_caching_variable() {
    assert!(Config::from_vars(None, None).unwrap().caching);
    assert!(Config::from_vars(None, Some("0")).unwrap().caching);
    assert!(!Config::from_vars(None, Some("1")).unwrap().caching);
    let c = Config::from_vars(Some("max_split_size_mb:64"), Some("1")).unwrap();
    assert!(!c.caching && c.sizing.max_split_size == 64 * MIB);
    assert!(matches!(
        Config::from_vars(None, Some("yes")),
        Err(ConfigError::BadValue { ref key, .. }) if key == NO_CACHING_ENV_VAR
    ));
    assert!(matches!(
        Config::from_vars(Some("expandable_segments:true"), Some("1")),
        Err(ConfigError::Inconsistent(_))
    ));
}

/// The variable is named where the string came from it, and only there: an error of
/// `Config::parse` (a `--config` flag, a string in code) or of the setters named
/// `TIDEPOOL_ALLOC_CONF`, which the user never set, and the caching variable's bad value
/// was said to be *in* `TIDEPOOL_ALLOC_CONF`.
#[test]
fn errors_name_the_variable_they_came_from() {
    let e = Config::from_vars(Some("warp_speed:9"), None).unwrap_err();
    let inner = ConfigError::UnknownKey("warp_speed".into());
    assert_eq!(e, ConfigError::Env { var: ENV_VAR, error: Box::new(inner.clone()) });
    // The variable here, what is wrong with it in the source: each said once down the chain.
    assert_eq!(e.to_string(), "TIDEPOOL_ALLOC_CONF holds an invalid configuration");
    assert!(inner.to_string().starts_with("unknown key `warp_speed`; valid keys: "));
    let source = std::error::Error::source(&e).unwrap();
    assert_eq!(source.downcast_ref::<ConfigError>(), Some(&inner));
    assert!(source.source().is_none());
    let e = Config::from_vars(Some("max_split_size_mb:5"), None).unwrap_err();
    assert_eq!(
        ErrorChain(&e).to_string(),
        "TIDEPOOL_ALLOC_CONF holds an invalid configuration: inconsistent configuration: \
         max_split_size_mb (5 MiB) must be at least large_segment_mb (20 MiB)"
    );
    let e = Config::from_vars(None, Some("yes")).unwrap_err();
    assert_eq!(e.to_string(), "bad value `yes` for `TIDEPOOL_NO_MEMORY_CACHING`: expected 1 or 0");
    let e = Config::from_vars(Some("expandable_segments:true"), Some("1")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "inconsistent configuration: caching:false (every free returns its memory to the \
         device) cannot be combined with expandable_segments (TIDEPOOL_ALLOC_CONF with \
         TIDEPOOL_NO_MEMORY_CACHING=1)"
    );
    // Not from the variable: no variable named.
    for e in [
        Config::parse("warp_speed:9").unwrap_err(),
        Config::parse("max_split_size_mb").unwrap_err(),
        Config::parse("cross_stream:lazy").unwrap_err(),
        Config::default().with_max_split_size_mb(5).validate().unwrap_err(),
    ] {
        assert!(!e.to_string().contains(ENV_VAR), "{e}");
        assert!(std::error::Error::source(&e).is_none());
    }
    assert_eq!(
        Config::parse("max_split_size_mb").unwrap_err().to_string(),
        "malformed entry `max_split_size_mb`: expected key:value"
    );
}

/// `ConfigError::Env`, the one wrapper: its message names the variable and not the inner
/// error, which is its source, so a reader of the chain prints each once.
#[test]
fn the_variables_error_leaves_the_inner_message_to_its_source() {
    for (conf, inner) in [
        ("warp_speed:9", Config::parse("warp_speed:9").unwrap_err()),
        ("max_split_size_mb", Config::parse("max_split_size_mb").unwrap_err()),
        ("max_split_size_mb:5", Config::parse("max_split_size_mb:5").unwrap_err()),
    ] {
        let e = Config::from_vars(Some(conf), None).unwrap_err();
        let text = e.to_string();
        assert!(!text.contains(&inner.to_string()), "{conf}: {text}");
        assert_eq!(text, "TIDEPOOL_ALLOC_CONF holds an invalid configuration");
        let source = std::error::Error::source(&e).expect("the inner error is the source");
        assert_eq!(source.downcast_ref::<ConfigError>(), Some(&inner), "{conf}");
        let whole = ErrorChain(&e).to_string();
        assert_eq!(whole, format!("{text}: {inner}"));
        assert_eq!(whole.matches(&inner.to_string()).count(), 1, "{whole}");
    }
}

#[test]
fn apply_is_all_or_nothing() {
    let mut c = Config::parse("max_split_size_mb:64").unwrap();
    let before = c.clone();
    assert!(c.apply("roundup_power2_divisions:4,bogus:1").is_err());
    assert_eq!(c, before);
    c.apply("roundup_power2_divisions:4").unwrap();
    assert_eq!(c.sizing.roundup_power2_divisions.for_size(1), 4);
    assert_eq!(c.sizing.max_split_size, 64 * MIB);
}
