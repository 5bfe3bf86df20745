//! Readers never panic: arbitrary bytes, mutated CSV rows and arbitrary bytes behind a
//! pickle or gzip header all give `Ok` or a `TraceError`.

use proptest::prelude::*;
use tidepool_trace::read_trace_bytes;

const GOOD: &str = "seq,op,id,bytes,stream,tag\n0,alloc,0,1024,0,param\n1,scope_enter,0,0,0,s\n2,alloc,1,512,0,act\n3,free,1,512,0,act\n4,scope_exit,0,0,0,s\n";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = read_trace_bytes(&data);
    }

    #[test]
    fn arbitrary_after_pickle_proto(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = vec![0x80, 0x04];
        bytes.extend(data);
        let _ = read_trace_bytes(&bytes);
    }

    #[test]
    fn arbitrary_after_gzip_magic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = vec![0x1f, 0x8b];
        bytes.extend(data);
        let _ = read_trace_bytes(&bytes);
    }

    #[test]
    fn mutated_csv(pos in 0..GOOD.len(), byte in any::<u8>(), delete in any::<bool>()) {
        let mut bytes = GOOD.as_bytes().to_vec();
        if delete { bytes.remove(pos); } else { bytes[pos] = byte; }
        if let Ok(t) = read_trace_bytes(&bytes) {
            t.validate().unwrap();
        }
    }

    #[test]
    fn rmm_rows(action in "(allocate|free|allocate failure|x)", ptr in 0u64..4, size in any::<u64>()) {
        let log = format!("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x1,8,0\n1,t,{action},{ptr:#x},{size},0x7\n");
        if let Ok(t) = read_trace_bytes(log.as_bytes()) {
            t.validate().unwrap();
        }
    }
}
