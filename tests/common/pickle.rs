//! A snapshot pickle (`Allocator::snapshot_pickle`, PyTorch's `_dump_snapshot` format) read
//! back for the tests: serde-pickle's value tree and a few accessors that panic — failing the
//! test — on a shape the dump should not have.

use serde_pickle::{HashableValue, Value};

/// The dump's top-level value.
pub fn read(bytes: &[u8]) -> Value {
    serde_pickle::value_from_slice(bytes, serde_pickle::DeOptions::new()).unwrap()
}

/// `d[k]` (`Value::None` where the dict has no such key).
pub fn get(d: &Value, k: &str) -> Value {
    match d {
        Value::Dict(m) => m.get(&HashableValue::String(k.into())).cloned().unwrap_or(Value::None),
        _ => panic!("not a dict: {d:?}"),
    }
}

/// An integer.
pub fn int(v: Value) -> i64 {
    match v {
        Value::I64(n) => n,
        other => panic!("not an int: {other:?}"),
    }
}

/// A non-negative integer (an address, a size).
pub fn uint(v: Value) -> u64 {
    u64::try_from(int(v)).expect("a non-negative int")
}

/// A list.
pub fn list(v: Value) -> Vec<Value> {
    match v {
        Value::List(l) => l,
        other => panic!("not a list: {other:?}"),
    }
}

/// A string.
pub fn string(v: Value) -> String {
    match v {
        Value::String(s) => s,
        other => panic!("not a str: {other:?}"),
    }
}

/// The entries of the dump's first device trace.
pub fn first_trace(dump: &Value) -> Vec<Value> {
    list(list(get(dump, "device_traces")).remove(0))
}
