//! The eager layer's API as a downstream user meets it: what an error says when a user gets
//! something wrong, and which way it points them.

use std::sync::Arc;
use tidepool::{Config, SimDevice, StreamId};
use tidepool_eager::{Eager, HostBackend};

/// `HostBackend::new` over `SimDevice::new` (the unbacked device a user meets first, in the
/// README's first example) builds; its kernels cannot touch memory. Before, `to_host` answered
/// only "download of 4 floats at 0x7f0000000000 failed", and the failed kernels were recorded
/// as "host kernel write outside its declared memory", blaming the ops' declared ranges. Now
/// the download says why, and how to get a device that runs kernels; so do the failures.
#[test]
fn ops_on_an_unbacked_simulated_device_say_to_make_a_backed_one() {
    let dev = Arc::new(SimDevice::new(64 << 20));
    let e = Eager::new(HostBackend::new(dev.clone()), Config::default()).unwrap();
    let cx = e.ctx(StreamId::DEFAULT);
    let z = cx.zeros(&[4]).unwrap(); // enqueued: the fill fails on the device
    let err = z.to_host().unwrap_err().to_string();
    assert!(err.starts_with("back end error: download of 4 floats at 0x7f0000000000 failed: "));
    assert!(err.contains("kernel on unbacked memory"), "{err}");
    assert!(err.contains("SimDevice::backed(capacity)"), "the way out is named: {err}");
    let failures = dev.kernel_failures();
    let names: Vec<_> = failures.iter().map(|f| f.kernel).collect();
    assert_eq!(names, ["fill"]); // the download's error came back to the caller instead
    assert!(failures[0].message.starts_with("host kernel write failed: "), "{failures:?}");
    assert!(failures[0].message.contains("SimDevice::backed(capacity)"), "{failures:?}");
    // The allocator is unaffected: the tensor's memory goes back, nothing is left.
    drop(z);
    e.synchronize().unwrap();
    assert_eq!(e.allocator().allocated_bytes(), 0);
    e.allocator().empty_cache().unwrap();
    assert_eq!(dev.live_segments(), vec![]);
    assert_eq!(dev.violations(), vec![]);

    // The same ops on a backed device.
    let e = Eager::sim(64 << 20).unwrap();
    let z = e.ctx(StreamId::DEFAULT).zeros(&[4]).unwrap();
    assert_eq!(z.to_host().unwrap(), vec![0.0; 4]);
    assert_eq!(e.device().kernel_failures().len(), 0);
}
