use super::*;

/// `data` decoded, rendered in the canonical form of `make_pickle_vectors.py`.
fn decoded(data: &[u8]) -> Result<String, String> {
    decode(data.to_vec()).map(|p| render(p.root(), 0))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The canonical form of `make_pickle_vectors.py` (`…` past 200 levels: cycles).
fn render(o: Obj<'_>, depth: usize) -> String {
    if depth > 200 {
        return "…".into();
    }
    let all = |items: &mut dyn Iterator<Item = Obj<'_>>| {
        items.map(|x| render(x, depth + 1)).collect::<Vec<_>>()
    };
    match o {
        Obj::None => "None".into(),
        Obj::Bool(true) => "True".into(),
        Obj::Bool(false) => "False".into(),
        Obj::Int(i) => i.to_string(),
        Obj::BigInt => "bigint".into(),
        Obj::Float(f) => format!("f:{}", hex(&f.to_be_bytes())),
        Obj::Str(s) => format!("s:{}", hex(s.as_bytes())),
        Obj::Bytes(b) => format!("b:{}", hex(b)),
        Obj::List(l) => format!("[{}]", all(&mut l.iter()).join(", ")),
        Obj::Tuple(t) => format!("({})", all(&mut t.iter()).join(", ")),
        Obj::Dict(d) => {
            let items: Vec<String> = d
                .iter()
                .map(|(k, v)| format!("{}: {}", render(k, depth + 1), render(v, depth + 1)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Obj::Set(s) | Obj::FrozenSet(s) => {
            let kind = if matches!(o, Obj::Set(_)) { "set" } else { "frozenset" };
            let mut items = all(&mut s.iter());
            items.sort();
            format!("{kind}{{{}}}", items.join(", "))
        }
        Obj::Global(g) => format!("global {g}"),
    }
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}

/// Every object of `make_pickle_vectors.py`, as CPython pickles it in protocols 0 to 5,
/// decodes to what Python had.
#[test]
fn cpython_pickles_of_plain_data_decode_as_python_reads_them() {
    let vectors = include_str!("../../../tests/fixtures/pickle_vectors.txt");
    let mut n = 0;
    for line in vectors.lines() {
        let mut parts = line.splitn(3, ' ');
        let (proto, data, want) = (parts.next().unwrap(), parts.next().unwrap(), parts.next());
        let got = decoded(&unhex(data));
        assert_eq!(got.as_deref(), Ok(want.unwrap()), "protocol {proto}: {data}");
        n += 1;
    }
    assert!(n > 400, "{n} vectors");
}

#[test]
fn flat_and_shallow_pickles_decode() {
    // {"x": [1, 2]} with protocol 4 framing and memoization.
    let p = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01x\x94]\x94(K\x01K\x02es.";
    let pickle = decode(p.to_vec()).unwrap();
    let Obj::Dict(d) = pickle.root() else { panic!() };
    let Some(Obj::List(l)) = d.get("x") else { panic!() };
    assert_eq!(l.iter().collect::<Vec<_>>(), [Obj::Int(1), Obj::Int(2)]);
    assert_eq!(d.get("y"), None);
}

/// A dict key set twice reads as its last value, as in Python.
#[test]
fn the_last_of_a_repeated_key_wins() {
    let p = b"\x80\x04}(\x8c\x01kK\x01\x8c\x01kK\x02u.";
    let pickle = decode(p.to_vec()).unwrap();
    let Obj::Dict(d) = pickle.root() else { panic!() };
    assert_eq!(d.get("k"), Some(Obj::Int(2)));
    assert_eq!(d.len(), 2);
}

#[test]
fn deep_nesting_is_refused() {
    let n = 10_000;
    let mut p = b"\x80\x04".to_vec();
    p.extend(std::iter::repeat_n(b']', n));
    p.extend(std::iter::repeat_n(b'a', n - 1));
    p.push(b'.');
    assert_eq!(decoded(&p), Err("pickle nests deeper than 128 levels".into()));
    // 128 levels are fine.
    let mut p = b"\x80\x04".to_vec();
    p.extend(std::iter::repeat_n(b']', 128));
    p.extend(std::iter::repeat_n(b'a', 127));
    p.push(b'.');
    assert!(decoded(&p).is_ok());
    // Tuples nest the same way.
    let mut p = b"\x80\x04N".to_vec();
    p.extend(std::iter::repeat_n(0x85, 129));
    p.push(b'.');
    assert_eq!(decoded(&p), Err("pickle nests deeper than 128 levels".into()));
}

/// A run of marks is refused past 128 open at once; closing them keeps it cheap.
#[test]
fn runs_of_marks_are_bounded() {
    let mut p = b"\x80\x04".to_vec();
    p.extend(std::iter::repeat_n(b'(', 300_000));
    p.extend(std::iter::repeat_n(b'1', 300_000));
    p.extend(b"N.");
    assert_eq!(decoded(&p), Err("pickle nests deeper than 128 levels".into()));
    let mut p = b"\x80\x04".to_vec();
    p.extend(b"(1".repeat(300_000));
    p.extend(b"N.");
    assert_eq!(decoded(&p), Ok("None".into()));
}

/// A memo reference shares the object: a chain of 200 lists each holding the previous one
/// through the memo is 200 levels deep.
#[test]
fn memo_references_share_the_object() {
    let mut p = b"\x80\x04]\x94".to_vec();
    for i in 0..100u8 {
        p.extend([b']', b'h', i, b'a', 0x94]);
    }
    p.push(b'.');
    let mut want = "[]".to_string();
    for _ in 0..100 {
        want = format!("[{want}]");
    }
    assert_eq!(decoded(&p), Ok(want));
    // Mutation through one reference shows through the other: x = []; [x, x]; x.append(1).
    let p = b"\x80\x04]\x94(]\x94h\x01eh\x01K\x01a0.";
    assert_eq!(decoded(p), Ok("[[1], [1]]".into()));
}

/// "Billion laughs": L(i+1) = [L(i), L(i)] through the memo, 60 times, is 2^60 values if
/// copied, 61 lists here (and `DUP` the same).
#[test]
fn exponential_sharing_is_cheap() {
    let mut p = b"\x80\x04]\x94K\x01a".to_vec();
    for i in 0..60u8 {
        p.extend([b']', 0x94, b'h', i, b'a', b'h', i, b'a']);
    }
    p.push(b'.');
    let pickle = decode(p).unwrap();
    assert_eq!(pickle.containers(), 61);
    let Obj::List(top) = pickle.root() else { panic!() };
    assert_eq!(top.len(), 2);
    assert_eq!(top.get(0), top.get(1));
    // Tuples of DUPlicated tuples (the fuzzer's timeout input): 2 bytes per doubling, 2^120
    // leaves in 121 tuples; each doubling nests one level deeper.
    let doubling = |n: usize| {
        let mut p = b"\x80\x04K\x01\x85".to_vec();
        p.extend(b"2\x86".repeat(n));
        p.push(b'.');
        p
    };
    assert_eq!(decode(doubling(120)).unwrap().containers(), 121);
    assert_eq!(decoded(&doubling(1_000_000)), Err("pickle nests deeper than 128 levels".into()));
}

/// The fuzzer's inputs that once took the decoder's memory or time decode or fail at once.
#[test]
fn the_fuzzers_old_inputs_are_cheap() {
    for p in [
        &include_bytes!(
            "../../../../../fuzz/artifacts/trace_parse/timeout-ee5fb973092f80fd15a970ac968bc38daeb6ea00"
        )[..],
        &include_bytes!(
            "../../../../../fuzz/artifacts/trace_parse/oom-2f6a1e9bb5c3d0364ca7673f2428393338b6e7c3"
        )[..],
        &include_bytes!(
            "../../../../../fuzz/artifacts/trace_parse/crash-d04fa3c184da4ebe95297f43d42deebd513f3302"
        )[..],
    ] {
        if let Ok(pickle) = decode(p.to_vec()) {
            assert!(pickle.containers() <= p.len());
        }
    }
}

#[test]
fn cycles_are_harmless() {
    // L = []; memo 0; append L to itself.
    let p = b"\x80\x04]\x94h\x00a.";
    let pickle = decode(p.to_vec()).unwrap();
    let Obj::List(l) = pickle.root() else { panic!() };
    assert_eq!(l.get(0), Some(pickle.root()));
    assert!(render(pickle.root(), 0).contains('…'));
    // A dict holding itself under every key of 10^5.
    let mut p = b"\x80\x04}\x94(".to_vec();
    for i in 0..100_000u32 {
        p.push(b'J');
        p.extend(i.to_le_bytes());
        p.extend(b"h\x00");
    }
    p.extend(b"u.");
    assert_eq!(decode(p).unwrap().containers(), 1);
}

/// Values left on the stack or in the memo cost at most one slot per input byte.
#[test]
fn values_left_on_the_stack_or_in_the_memo_are_bounded_by_the_input() {
    for op in [b']', 0x94, b'2'] {
        let mut p = b"\x80\x04N".to_vec();
        p.extend(std::iter::repeat_n(op, 1_000_000));
        p.extend(b"N.");
        assert_eq!(decoded(&p), Ok("None".into()), "{op:#x}");
    }
    // A memo id far past the others is kept aside, not as a gap of 4 billion slots.
    let p = b"\x80\x04Nr\xff\xff\xff\xff0j\xff\xff\xff\xff.";
    assert_eq!(decoded(p), Ok("None".into()));
    // Ids filled in out of order.
    let p = b"\x80\x04K\x02q\x020K\x01q\x010K\x00q\x000(h\x00h\x01h\x02\x94h\x03l.";
    assert_eq!(decoded(p), Ok("[0, 1, 2, 2]".into()));
}

#[test]
fn long_decimal_integers_are_refused() {
    let mut p = b"(L".to_vec();
    p.extend(std::iter::repeat_n(b'7', 2_000_000));
    p.extend(b"L\nl.");
    assert_eq!(decoded(&p), Err("pickle has a decimal integer longer than 1024 digits".into()));
    let mut p = b"I".to_vec();
    p.extend(std::iter::repeat_n(b'7', 1000));
    p.extend(b"\n.");
    assert_eq!(decoded(&p), Ok("bigint".into()));
    assert_eq!(decoded(b"I-170141183460469231731687303715884105728\n."), Ok(i128::MIN.to_string()));
    assert_eq!(decoded(b"I170141183460469231731687303715884105728\n."), Ok("bigint".into()));
    for bad in [&b"I\n."[..], b"I-\n.", b"I1x\n.", b"I 1\n.", b"LL\n."] {
        assert!(decoded(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn binary_longs_of_any_length() {
    // LONG4 of 10^6 bytes: 1, then zeros (Python reads 1), and -1 sign-extended.
    let mut p = b"\x80\x04\x8b\x40\x42\x0f\x00\x01".to_vec();
    p.extend(std::iter::repeat_n(0, 999_999));
    p.push(b'.');
    assert_eq!(decoded(&p), Ok("1".into()));
    let mut p = b"\x80\x04\x8b\x40\x42\x0f\x00".to_vec();
    p.extend(std::iter::repeat_n(0xff, 1_000_000));
    p.push(b'.');
    assert_eq!(decoded(&p), Ok("-1".into()));
    // 2^127 needs 17 bytes; 2^64 - 1 (an address) 9.
    assert_eq!(
        decoded(b"\x80\x04\x8a\x11\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\x80\0."),
        Ok("bigint".into())
    );
    assert_eq!(
        decoded(b"\x80\x04\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\0."),
        Ok(u64::MAX.to_string())
    );
    assert_eq!(decoded(b"\x80\x04\x8a\x00."), Ok("0".into()));
    assert!(decoded(b"\x80\x04\x8b\xff\xff\xff\xff.").is_err(), "negative length");
}

/// NaN as a set element or dict key is just a value (nothing is sorted or hashed).
#[test]
fn floats_nan_as_keys_and_set_items() {
    // Python: pickle.dumps([frozenset({nan, nan, nan, 1.5, 2**53 + 1, 2.0**53, 0.5, -1.0, 7}),
    //                       {2**53 + 1: 1, 2.0**53: 3, nan: 4, 0.5: 5}], protocol=4)
    let p = b"\x80\x04\x95\x82\x00\x00\x00\x00\x00\x00\x00]\x94((GC@\x00\x00\x00\x00\x00\x00G?\xf8\x00\x00\x00\x00\x00\x00\x8a\x07\x01\x00\x00\x00\x00\x00 G\x7f\xf8\x00\x00\x00\x00\x00\x00G?\xe0\x00\x00\x00\x00\x00\x00K\x07G\x7f\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf8\x00\x00\x00\x00\x00\x00G\xbf\xf0\x00\x00\x00\x00\x00\x00\x91\x94}\x94(\x8a\x07\x01\x00\x00\x00\x00\x00 K\x01GC@\x00\x00\x00\x00\x00\x00K\x03G\x7f\xf8\x00\x00\x00\x00\x00\x00K\x04G?\xe0\x00\x00\x00\x00\x00\x00K\x05ue.";
    let pickle = decode(p.to_vec()).unwrap();
    let Obj::List(l) = pickle.root() else { panic!() };
    let Some(Obj::Dict(d)) = l.get(1) else { panic!() };
    let keys: Vec<_> = d.iter().map(|(k, _)| k).collect();
    assert!(matches!(keys[2], Obj::Float(f) if f.is_nan()), "{keys:?}");
    assert_eq!(keys[0], Obj::Int(9_007_199_254_740_993));
    let Some(Obj::FrozenSet(s)) = l.get(0) else { panic!() };
    assert_eq!(s.len(), 9);
    // Text floats.
    assert_eq!(decoded(b"Fnan\r\n."), Ok(format!("f:{}", hex(&f64::NAN.to_be_bytes()))));
    assert!(decoded(b"Fjunk\n.").is_err());
}

#[test]
fn truncated_input_is_an_error_at_every_cut() {
    let p: &[u8] = b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01x\x94]\x94(K\x01\x8a\x01\x02M\x00\x01J\x00\x00\x00\x01G\x00\x00\x00\x00\x00\x00\x00\x00X\x01\x00\x00\x00y\x8d\x01\x00\x00\x00\x00\x00\x00\x00zC\x01\x00h\x01I12\ne\x8c\x01kNu.";
    assert!(decoded(p).is_ok(), "{:?}", decoded(p));
    for cut in 0..p.len() {
        assert!(decoded(&p[..cut]).is_err(), "cut at {cut}");
    }
    // Lengths past the end allocate nothing.
    for p in [
        &b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff."[..],
        b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\x7f.",
        b"\x80\x04X\xff\xff\xff\xff.",
        b"\x80\x04\x8b\xff\xff\xff\x7f.",
        b"\x80\x04T\xff\xff\xff\x7f.",
    ] {
        assert_eq!(decoded(p), Err("truncated pickle".into()));
    }
}

#[test]
fn malformed_programs_are_errors() {
    let cases: &[(&[u8], &str)] = &[
        (b"\x80\x04.", "pickle stack underflow"),
        (b"\x80\x04N(.", "pickle stack underflow"),
        (b"\x80\x04(N1.", "pickle stack underflow"),
        (b"\x80\x04Ne.", "pickle mark underflow (no MARK open)"),
        (b"\x80\x04Na.", "pickle stack underflow"),
        (b"\x80\x04NNa.", "pickle adds items to a value that is not a list"),
        (b"\x80\x04](NNNu.", "pickle adds items to a value that is not a dict"),
        (b"\x80\x04}(NNNu.", "pickle sets a dict item without a value"),
        (b"\x80\x04(Nd.", "pickle sets a dict item without a value"),
        (b"\x80\x04h\x00.", "pickle memo reference to nothing"),
        (b"\x80\x04\x94.", "pickle stack underflow"),
        (b"\x80\x04N.N", "pickle has data after its STOP opcode"),
        (b"\x80\x04]\x00.", "unsupported pickle opcode 0x00"),
        (b"\x80\x04N\x97.", "unsupported pickle opcode NEXT_BUFFER (0x97): not plain data"),
        (b"\x80\x04}Nb.", "unsupported pickle opcode BUILD (0x62): not plain data"),
        (b"\x80\x04X\x02\x00\x00\x00\xff\xfe.", "pickle string is not UTF-8"),
        (b"Vx\\ud800\n.", "bad escape in a pickle UNICODE string"),
        (b"S'\\q'\n.", "bad escape in a pickle STRING"),
        (b"Sabc\n.", "bad STRING in pickle (not quoted)"),
        (b"\x80\x02N)R.", "pickle calls a value that is not a global (REDUCE)"),
        (
            b"\x80\x02cbuiltins\nset\nNR.",
            "pickle calls a global without an argument tuple (REDUCE)",
        ),
        (
            b"\x80\x02cbuiltins\nset\nK\x01\x85R.",
            "pickle calls builtins.set with arguments it does not take",
        ),
    ];
    for (p, want) in cases {
        assert_eq!(decoded(p), Err(want.to_string()), "{p:?}");
    }
    let e = decoded(b"\x80\x04cos\nsystem\n.").unwrap_err();
    assert!(e.starts_with("pickle refers to `os.system`, which is not plain data"), "{e}");
    let e = decoded(b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.").unwrap_err();
    assert!(e.starts_with("pickle refers to `builtins.eval`"), "{e}");
    // POP of an empty frame closes the mark, as in CPython.
    assert_eq!(decoded(b"\x80\x04N(0."), Ok("None".into()));
}

/// Repeated latin-1 conversions of one string cost its length each: bounded by the input.
#[test]
fn copies_are_bounded_by_the_input() {
    let mut p = b"\x80\x02c_codecs\nencode\nq\x00X\x00\x10\x00\x00".to_vec();
    p.extend(std::iter::repeat_n(b'x', 4096));
    p.extend(b"q\x01X\x06\x00\x00\x00latin1q\x02\x86q\x03");
    // encode(s, "latin1") again and again, each 5 bytes of input and 4 KB of copy.
    p.extend(b"0h\x00h\x03R".repeat(10_000));
    p.push(b'.');
    let e = decoded(&p).unwrap_err();
    assert_eq!(e, "pickle decodes more than 3 bytes of strings per byte of input");
    let mut p =
        b"\x80\x02c_codecs\nencode\nX\x04\x00\x00\x00ab\xc3\xbfX\x06\x00\x00\x00latin1\x86R."
            .to_vec();
    assert_eq!(decoded(&p), Ok("b:6162ff".into()));
    // Not latin-1.
    p = b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00\xe4\xb8\xadX\x06\x00\x00\x00latin1\x86R."
        .to_vec();
    assert_eq!(decoded(&p), Err("pickle encodes text that is not latin-1 as bytes".into()));
}

/// The drop of a large decoded pickle is flat: a list of 10^6 empty lists.
#[test]
fn wide_and_long_pickles_drop_flat() {
    let mut p = b"\x80\x04](".to_vec();
    p.extend(std::iter::repeat_n(b']', 1_000_000));
    p.extend(b"e.");
    let pickle = decode(p).unwrap();
    assert_eq!(pickle.containers(), 1_000_001);
    drop(pickle);
}

/// A string is checked as UTF-8 once, when decoded, however often it is viewed: viewed as a
/// span of the input, it was checked at every view, and one 500 KB `action` string shared by
/// 500 000 snapshot entries (a 1 MB pickle) took 6 s to read (found by review for hostile
/// input). Escaped protocol 0 strings are checked where they are built.
#[test]
fn a_shared_string_is_checked_once_however_often_it_is_viewed() {
    let long = "é".repeat(500);
    let mut p = b"\x80\x04](X".to_vec();
    p.extend(u32::try_from(long.len()).unwrap().to_le_bytes());
    p.extend(long.as_bytes());
    p.extend(std::iter::repeat_n(b'2', 999));
    p.extend(b"e.");
    let pickle = decode(p).unwrap();
    let Obj::List(items) = pickle.root() else { panic!("{:?}", pickle.root()) };
    assert_eq!(items.len(), 1000);
    for _ in 0..2 {
        for item in items.iter() {
            assert_eq!(item, Obj::Str(&long));
        }
    }
    let checked = |p: &Pickle| p.utf8_checked.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(checked(&pickle), 1000);
    // Keys are compared, not viewed: a lookup checks nothing either.
    let mut p = b"\x80\x04}(X".to_vec();
    p.extend(u32::try_from(long.len()).unwrap().to_le_bytes());
    p.extend(long.as_bytes());
    p.extend(b"\x8c\x01v\x8c\x01kNu.");
    let pickle = decode(p).unwrap();
    let Obj::Dict(d) = pickle.root() else { panic!() };
    for _ in 0..100 {
        assert_eq!(d.get("k"), Some(Obj::None));
        assert_eq!(d.get(&long), Some(Obj::Str("v")));
    }
    assert_eq!(checked(&pickle), 1000 + 1 + 1);
    // Protocol 0: `V` (raw-unicode-escape) and a `GLOBAL`'s names through `STACK_GLOBAL`.
    assert_eq!(
        decoded(b"V\\u00e9t\\u00e9\np0\n.").unwrap(),
        format!("s:{}", hex("été".as_bytes()))
    );
}
