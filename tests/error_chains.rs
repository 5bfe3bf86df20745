//! Error chains print each layer once. A wrapper error — [`AllocError::Device`],
//! [`AllocError::Config`], [`ConfigError::Env`], [`HostAllocError::OutOfMemory`],
//! [`HostAllocError::Device`] — says what failed at its own layer in `Display` and gives the
//! inner error from `source()`, never both (the Rust API guidelines' rule, and the error-handling
//! working group's): whatever walks the chain (anyhow's `{:#}`, eyre, a command line's "caused
//! by" list) printed the inner message twice when the wrapper repeated it (found in review).
//! Broken build `cfg(tidepool_broken = "error_text_doubled")`: the wrappers repeat it again.

use std::error::Error;
use std::sync::Arc;
use tidepool::device::DeviceError;
use tidepool::{
    AllocError, Allocator, Config, ConfigError, ENV_VAR, ErrorChain, HostAllocError, HostAllocator,
    SimDevice, StreamId,
};

/// `outer` says `own` and nothing of `inner`, whose message and value its `source()` gives; the
/// chain is the two, each once.
fn says_its_layer_only<I: Error + PartialEq + 'static>(outer: &dyn Error, inner: &I, own: &str) {
    let text = outer.to_string();
    let inner_text = inner.to_string();
    assert_eq!(text, own);
    assert!(!text.contains(&inner_text), "the wrapper repeats its source: {text}");
    let source = outer.source().expect("the inner error is the source");
    assert_eq!(source.downcast_ref::<I>(), Some(inner), "the source is the inner error itself");
    let whole = ErrorChain(outer).to_string();
    assert_eq!(whole, format!("{own}: {}", ErrorChain(inner)));
    assert_eq!(whole.matches(&inner_text).count(), 1, "{whole}");
    assert_eq!(whole.matches(own).count(), 1, "{whole}");
}

#[test]
fn alloc_error_device_says_a_device_call_failed_and_leaves_why_to_its_source() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev, Config::default()).unwrap();
    // Capturing the legacy default stream is refused by the device.
    let e = alloc.begin_capture(StreamId::DEFAULT, None).unwrap_err();
    let AllocError::Device(inner) = &e else { panic!("expected a device error, got {e:?}") };
    assert!(!inner.to_string().is_empty());
    says_its_layer_only(&e, inner, "a device call of the allocator failed");
    // Made by hand too: any device error.
    let inner = DeviceError::UnknownStream(StreamId(7));
    says_its_layer_only(
        &AllocError::from(inner.clone()),
        &inner,
        "a device call of the allocator failed",
    );
}

#[test]
fn alloc_error_config_says_the_configuration_was_refused_and_leaves_why_to_its_source() {
    let dev = Arc::new(SimDevice::new(1 << 30));
    let e = Allocator::new(dev.clone(), Config::default().with_max_split_size_mb(5))
        .map(|_| ())
        .unwrap_err();
    let AllocError::Config(inner) = &e else { panic!("expected a configuration error: {e:?}") };
    says_its_layer_only(&e, inner, "the allocator refused its configuration");
    assert_eq!(
        ErrorChain(&e).to_string(),
        "the allocator refused its configuration: inconsistent configuration: max_split_size_mb \
         (5 MiB) must be at least large_segment_mb (20 MiB)"
    );
    // Three layers: the variable's error inside the allocator's.
    let env = ConfigError::Env { var: ENV_VAR, error: Box::new(inner.clone()) };
    let e = AllocError::from(env.clone());
    says_its_layer_only(&e, &env, "the allocator refused its configuration");
    assert_eq!(
        ErrorChain(&e).to_string(),
        "the allocator refused its configuration: TIDEPOOL_ALLOC_CONF holds an invalid \
         configuration: inconsistent configuration: max_split_size_mb (5 MiB) must be at least \
         large_segment_mb (20 MiB)"
    );
    assert_eq!(ErrorChain(&e).to_string().matches(&inner.to_string()).count(), 1);
}

#[test]
fn config_error_env_names_the_variable_and_leaves_why_to_its_source() {
    for conf in ["warp_speed:9", "max_split_size_mb", "max_split_size_mb:5", "cross_stream:lazy"] {
        let inner = Config::parse(conf).unwrap_err();
        let e = ConfigError::Env { var: ENV_VAR, error: Box::new(inner.clone()) };
        says_its_layer_only(&e, &inner, "TIDEPOOL_ALLOC_CONF holds an invalid configuration");
    }
}

#[test]
fn host_out_of_memory_says_what_it_asked_for_and_leaves_the_devices_answer_to_its_source() {
    let dev = Arc::new(SimDevice::backed(1 << 30));
    let pinned = HostAllocator::new(dev.clone());
    dev.fail_nth_host_alloc(Some(1));
    let e = pinned.alloc(1000).unwrap_err();
    let HostAllocError::OutOfMemory { error, .. } = &e else { panic!("expected OOM: {e:?}") };
    says_its_layer_only(
        &e,
        error,
        "out of pinned host memory allocating 1000 B (class 1.00 KiB; 0 B held)",
    );
    assert_eq!(
        ErrorChain(&e).to_string(),
        format!("out of pinned host memory allocating 1000 B (class 1.00 KiB; 0 B held): {error}")
    );
}

#[test]
fn host_device_error_says_a_device_call_failed_and_leaves_why_to_its_source() {
    // A copy to an unbacked simulated device is refused by the device.
    let dev = Arc::new(SimDevice::new(1 << 30));
    let alloc = Allocator::new(dev.clone(), Config::default()).unwrap();
    let pinned = HostAllocator::new(dev.clone());
    let buf = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    let mut staging = pinned.alloc(4096).unwrap();
    let e = staging.upload(&buf).unwrap_err();
    let HostAllocError::Device(inner) = &e else { panic!("expected a device error: {e:?}") };
    says_its_layer_only(&e, inner, "a device call on pinned host memory failed");
    assert!(
        ErrorChain(&e).to_string().contains("SimDevice::backed(capacity)"),
        "the way out is in the chain"
    );
}

/// The variants that wrap nothing have no source, and say everything themselves.
#[test]
fn errors_that_wrap_nothing_have_no_source() {
    let leaves: [&dyn Error; 4] = [
        &AllocError::InvalidSize { requested: u64::MAX },
        &AllocError::UnknownStream(StreamId(3)),
        &HostAllocError::ZeroSize,
        &ConfigError::UnknownKey("warp_speed".into()),
    ];
    for e in leaves {
        assert!(e.source().is_none(), "{e}");
        assert_eq!(ErrorChain(e).to_string(), e.to_string());
    }
}
