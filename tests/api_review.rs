//! The public API as a downstream user meets it: what an error says when a user gets something
//! wrong, read as the user reads it (its `Display`), and which way it points them.

use std::sync::Arc;
use tidepool::{Allocator, Config, SimDevice};

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

