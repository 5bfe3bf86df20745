//! The eager layer's host-to-device uploads go through the back end's pinned host allocator
//! (SimDevice): staging blocks are cached by size class and reused only after the upload that
//! read them ran. Unfinished uploads are made with a gate: a kernel on the stream that blocks
//! until the test opens a channel, so an upload enqueued after it cannot have run yet.

use std::sync::mpsc;
use tidepool::StreamId;
use tidepool::device::{Capture, Device, Kernel, Launch};
use tidepool_eager::{Eager, SimEager, Tensor};

fn clean(e: &SimEager) {
    e.synchronize().unwrap();
    assert_eq!(e.device().violations(), vec![]);
    assert_eq!(e.device().kernel_failures(), vec![]);
}

fn gate(e: &SimEager, stream: StreamId) -> mpsc::Sender<()> {
    let (open, gate) = mpsc::channel::<()>();
    let k = Kernel::new("gate", vec![], move |_| {
        let _ = gate.recv();
    });
    e.device().launch(stream, k).unwrap();
    open
}

#[test]
fn uploads_stage_through_pinned_blocks_cached_by_size_class() {
    let eager = Eager::sim(64 << 20).unwrap();
    let s = StreamId::DEFAULT;
    let w = Tensor::parameter(&eager, &[1.0, 2.0, 3.0, 4.0], &[2, 2], s).unwrap();
    // Uploads are asynchronous: a block is reusable once its copy ran (here: after a sync).
    eager.synchronize().unwrap();
    for step in 0..5 {
        let st = eager.step("step", s);
        let cx = st.ctx();
        let x = cx.tensor(&[step as f32; 2], &[1, 2]).unwrap(); // 8 bytes: class 512
        let big = cx.tensor(&vec![0.5; 1000], &[1000]).unwrap(); // 4000 bytes: class 4096
        let y = cx.matmul(&x, &w).unwrap();
        let f = step as f32;
        assert_eq!(y.to_host().unwrap(), vec![4.0 * f, 6.0 * f]);
        assert_eq!(big.to_host().unwrap(), vec![0.5; 1000]);
    }
    let pinned = eager.backend().host_allocator();
    let stats = pinned.stats();
    assert_eq!(stats.num_host_alloc, 2, "one block per size class, reused every step");
    assert_eq!(eager.device().host_counters().copies_to_device, 11);
    assert_eq!(eager.stats().uploads, 11);
    assert_eq!(stats.allocation.current, 0, "staging buffers are dropped at once");
    pinned.check_invariants().unwrap();
    clean(&eager);
}

#[test]
fn a_staging_block_is_reused_only_after_its_upload_ran() {
    let eager = Eager::sim(64 << 20).unwrap();
    let s = eager.device().create_stream().unwrap();
    let pinned = eager.backend().host_allocator();
    let cx = eager.ctx(s);

    let open = gate(&eager, s);
    let a = cx.tensor(&[1.0; 64], &[64]).unwrap();
    assert_eq!(eager.device().host_copies_in_flight(), 1);
    assert_eq!(pinned.stats().pending_bytes, 512, "the block waits for its upload");
    // The same class while the first upload is held: a second pinned block.
    let b = cx.tensor(&[2.0; 64], &[64]).unwrap();
    assert_eq!(pinned.stats().num_host_alloc, 2);

    open.send(()).unwrap();
    assert_eq!(a.to_host().unwrap(), vec![1.0; 64], "a's bytes were not overwritten by b's");
    assert_eq!(b.to_host().unwrap(), vec![2.0; 64]);
    // Both uploads ran: no new block for more uploads of the class.
    for v in 0..10 {
        let t = cx.tensor(&[v as f32; 64], &[64]).unwrap();
        assert_eq!(t.to_host().unwrap(), vec![v as f32; 64]);
    }
    assert_eq!(pinned.stats().num_host_alloc, 2);
    pinned.process_events().unwrap();
    assert_eq!(pinned.stats().pending_bytes, 0);
    pinned.check_invariants().unwrap();
    clean(&eager);
}

#[test]
fn copy_from_host_and_empty_uploads() {
    let eager = Eager::sim(64 << 20).unwrap();
    let cx = eager.ctx(StreamId::DEFAULT);
    let mut t = cx.tensor(&[0.0; 3], &[3]).unwrap();
    eager.synchronize().unwrap();
    t.copy_from_host(&[7.0, 8.0, 9.0]).unwrap();
    assert_eq!(t.to_host().unwrap(), vec![7.0, 8.0, 9.0]);
    let e = cx.tensor(&[], &[0]).unwrap();
    assert_eq!(e.to_host().unwrap(), Vec::<f32>::new());
    assert_eq!(eager.backend().host_allocator().stats().num_host_alloc, 1);
    clean(&eager);
}

/// Staging is the back end's choice, not the caller's: where no pinned block can be had for an
/// upload (the device's pinned memory is exhausted: a locked-memory limit, a host short of
/// memory, one upload larger than can be pinned), it falls back to the plain copy and the tensor
/// holds its values. It used to fail with the pinned allocator's out-of-memory error: the tensor,
/// the parameter and the in-place copy below were refused though the device had room for them.
/// Broken build `pinned_oom_fails_upload`.
#[test]
fn an_upload_with_no_pinned_memory_left_falls_back_to_a_plain_copy() {
    let eager = Eager::sim(64 << 20).unwrap();
    let dev = eager.device();
    dev.set_host_capacity(4096);
    let pinned = eager.backend().host_allocator();
    let cx = eager.ctx(StreamId::DEFAULT);
    // 8 KiB: more than can be pinned.
    let data: Vec<f32> = (0..2048).map(|i| i as f32).collect();
    let big = cx.tensor(&data, &[2048]).unwrap();
    assert_eq!(big.to_host().unwrap(), data);
    assert_eq!(dev.host_counters().copies_to_device, 0, "copied by a kernel, nothing staged");
    let s = pinned.stats();
    assert_eq!((s.num_host_alloc, s.reserved_bytes.current, s.num_ooms), (0, 0, 1));
    // A small upload still stages through a pinned block.
    let small = cx.tensor(&[3.0; 10], &[10]).unwrap();
    assert_eq!(small.to_host().unwrap(), vec![3.0; 10]);
    assert_eq!(dev.host_counters().copies_to_device, 1);
    // A parameter and an in-place copy of the large size fall back the same way.
    let mut w = Tensor::parameter(&eager, &data, &[2048], StreamId::DEFAULT).unwrap();
    assert_eq!(w.to_host().unwrap(), data);
    w.copy_from_host(&[0.5; 2048]).unwrap();
    assert_eq!(w.to_host().unwrap(), vec![0.5; 2048]);
    assert_eq!(dev.host_counters().copies_to_device, 1);
    assert_eq!(eager.stats().uploads, 4);
    // (No refusal freed the cache: 8 KiB could never be pinned. The small block stays.)
    let s = pinned.stats();
    assert_eq!((s.num_host_alloc, s.num_host_free, s.reserved_bytes.current), (1, 0, 512));
    assert_eq!((s.num_ooms, s.num_alloc_retries), (3, 0));
    // While a capture is underway the error stays: a copy from pageable memory cannot be
    // captured (the device refuses the plain copy's kernel; CUDA would end the capture).
    let c = dev.create_stream().unwrap();
    let mut t = eager.ctx(c).zeros(&[2048]).unwrap();
    eager.synchronize().unwrap();
    dev.begin_capture(c).unwrap();
    let err = t.copy_from_host(&data).unwrap_err();
    assert!(err.to_string().contains("out of pinned host memory"), "{err}");
    dev.destroy_graph(dev.end_capture(c).unwrap()).unwrap();
    pinned.check_invariants().unwrap();
    clean(&eager);
}

/// An upload larger than the device could ever pin (its host capacity) goes straight to the
/// plain copy and leaves every pinned cache as it was: the back end's and a peer pinned
/// allocator's of the same device keep their cached blocks, to the byte. It used to free the
/// back end's whole cache and then ask the peers to free theirs before giving up, for a block
/// that could not fit whatever was freed. Broken build `pinned_oversize_evicts`.
#[test]
fn an_upload_too_large_to_pin_leaves_the_pinned_caches_alone() {
    let eager = Eager::sim(64 << 20).unwrap();
    let dev = eager.device();
    dev.set_host_capacity(64 << 10);
    let pinned = eager.backend().host_allocator();
    let peer = tidepool::HostAllocator::new(dev.clone());
    drop(peer.alloc(16 << 10).unwrap()); // cached by the peer: 16 KiB
    let cx = eager.ctx(StreamId::DEFAULT);
    let small = cx.tensor(&[1.0; 1000], &[1000]).unwrap(); // a 4 KiB staging block, cached
    eager.synchronize().unwrap();
    pinned.process_events().unwrap();
    let cached = |h: &tidepool::HostAllocator<tidepool::SimDevice>| {
        let s = h.stats();
        (s.cached_bytes, s.reserved_bytes.current, s.num_host_free, s.num_alloc_retries)
    };
    assert_eq!((cached(pinned), cached(&peer)), ((4096, 4096, 0, 0), (16384, 16384, 0, 0)));

    // 128 KiB: more than the 64 KiB that could ever be pinned.
    let data: Vec<f32> = (0..32 << 10).map(|i| i as f32).collect();
    let big = cx.tensor(&data, &[data.len()]).unwrap();
    assert_eq!(big.to_host().unwrap(), data);
    assert_eq!(dev.host_counters().copies_to_device, 1, "only the small upload was staged");
    assert_eq!(
        (cached(pinned), cached(&peer)),
        ((4096, 4096, 0, 0), (16384, 16384, 0, 0)),
        "both caches as they were"
    );
    assert_eq!(pinned.stats().num_ooms, 1, "one refused pinned allocation");
    assert_eq!(dev.host_reserved_bytes(), 20 << 10);
    // A request that fits once the caches are freed still frees them (own, then the peer's).
    let fits = pinned.alloc(64 << 10).unwrap();
    assert_eq!(cached(pinned), (0, 64 << 10, 1, 1));
    assert_eq!(cached(&peer), (0, 0, 1, 0));
    drop((fits, small));
    pinned.check_invariants().unwrap();
    peer.check_invariants().unwrap();
    clean(&eager);
}

/// An upload whose copy was enqueued but whose event could not be recorded (an injected
/// `cuEventRecord` failure): the staging block is waited for at once (one device
/// synchronisation, counted in the pinned allocator's host syncs) and goes back to the cache,
/// reusable, and the upload stands. It used to fail the upload and leave the block pending
/// until something synchronised that pinned allocator (only its `empty_cache` does; the eager
/// layer's own synchronisations never told it), so every later upload of the class pinned a
/// new block. Where the wait fails too, the upload fails and the block stays pending, never
/// reused before a later synchronisation. Broken build `staging_record_failure_pending`.
#[test]
fn a_staging_block_whose_event_record_failed_is_waited_for_and_cached() {
    let eager = Eager::sim(64 << 20).unwrap();
    let dev = eager.device();
    let pinned = eager.backend().host_allocator();
    let s = dev.create_stream().unwrap();
    let cx = eager.ctx(s);
    let figures = || {
        let st = pinned.stats();
        (st.pending_bytes, st.cached_bytes, st.num_host_syncs, st.num_host_alloc)
    };

    dev.fail_event_records(true);
    let t = cx.tensor(&[5.0; 64], &[64]);
    dev.fail_event_records(false);
    assert_eq!(figures(), (0, 512, 1, 1), "waited for and cached at once");
    assert_eq!(t.unwrap().to_host().unwrap(), vec![5.0; 64]);
    eager.synchronize().unwrap();
    let u = cx.tensor(&[6.0; 64], &[64]).unwrap();
    assert_eq!(u.to_host().unwrap(), vec![6.0; 64]);
    eager.synchronize().unwrap();
    pinned.process_events().unwrap();
    assert_eq!(figures(), (0, 512, 1, 1), "the same block served the next upload");

    // The record and the wait both fail (the copy held behind a gate): the error, and the
    // block stays pending; the next upload gets a new block.
    let open = gate(&eager, s);
    dev.fail_event_records(true);
    dev.fail_host_syncs(true);
    assert!(cx.tensor(&[7.0; 64], &[64]).is_err());
    dev.fail_event_records(false);
    dev.fail_host_syncs(false);
    assert_eq!(figures(), (512, 0, 1, 1), "pending, not reused, not lost");
    let v = cx.tensor(&[8.0; 64], &[64]).unwrap();
    assert_eq!(figures().3, 2, "a new block beside the pending one");
    open.send(()).unwrap();
    assert_eq!(v.to_host().unwrap(), vec![8.0; 64]);
    eager.synchronize().unwrap();
    pinned.empty_cache().unwrap();
    let st = pinned.stats();
    assert_eq!((st.pending_bytes, st.reserved_bytes.current, st.num_host_syncs), (0, 0, 2));
    pinned.check_invariants().unwrap();
    clean(&eager);
}

/// On a GPU (feature `cuda`): uploads stage through `cuMemHostAlloc` blocks, reused once their
/// copies completed. Skips, printing why, without a GPU or without NVRTC/cuBLAS.
#[cfg(feature = "cuda")]
#[test]
fn cuda_uploads_stage_through_pinned_memory() {
    use tidepool::{Config, CudaDevice};
    use tidepool_eager::CudaBackend;
    if let Some(reason) = CudaDevice::unavailable_reason() {
        println!("skipping: {reason}");
        return;
    }
    let device = CudaDevice::new(0).unwrap();
    let backend = match CudaBackend::new(device.clone()) {
        Ok(b) => b,
        Err(e) => {
            println!("skipping: {e}");
            return;
        }
    };
    let eager = Eager::new(backend, Config::default()).unwrap();
    let cx = eager.ctx(StreamId::DEFAULT);
    for v in 0..10 {
        let data: Vec<f32> = (0..100_000).map(|i| (i + v) as f32).collect();
        let t = cx.tensor(&data, &[100_000]).unwrap();
        assert_eq!(t.to_host().unwrap(), data);
    }
    let pinned = eager.backend().host_allocator();
    assert_eq!(pinned.stats().num_host_alloc, 1, "one staging block, reused");
    pinned.check_invariants().unwrap();
    drop(cx);
    pinned.empty_cache().unwrap();
    assert!(device.live_host_allocations().is_empty());
}
