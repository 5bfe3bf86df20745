//! The `config_parse` harness: arbitrary text into [`Config::parse`].
//!
//! ```text
//!   bytes ─lossy UTF-8─▶ Config::parse ─┬─ Ok(c)  ─▶ c.validate() is Ok; parsing again gives c;
//!                                       │             the size rules are sane for every size
//!                                       └─ Err(e) ─▶ a non-empty message; `apply` of the same
//!                                                    text leaves a configuration unchanged
//! ```
//!
//! "Sane size rules" means: every request up to `MAX_REQUEST` rounds up to a multiple of
//! `min_block_size` at least as large, larger ones are refused, a new segment holds its request,
//! split decisions and the byte limit never overflow.

use tidepool::Config;
use tidepool::{MAX_REQUEST, MIB};

/// Request sizes the size rules are checked on.
const PROBES: [u64; 12] = [
    0,
    1,
    511,
    512,
    513,
    MIB - 1,
    MIB + 1,
    10 * MIB + 3,
    1 << 40,
    MAX_REQUEST,
    MAX_REQUEST + 1,
    u64::MAX,
];

/// Parses `data` as a configuration string; panics if a check fails.
pub fn config_parse(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Err(e) = check(&text) {
        panic!("config_parse: {e}\ninput: {text:?}");
    }
}

/// Checks one configuration string.
pub fn check(text: &str) -> Result<(), String> {
    match Config::parse(text) {
        Ok(c) => {
            c.validate().map_err(|e| format!("parse accepted an invalid config: {e}"))?;
            if Config::parse(text).as_ref() != Ok(&c) {
                return Err("parsing twice gave different results".into());
            }
            check_sizing(&c)
        }
        Err(e) => {
            if e.to_string().trim().is_empty() {
                return Err(format!("empty error message for {e:?}"));
            }
            let mut c = Config::parse("cross_stream:wait_event").expect("a valid config");
            let before = c.clone();
            if c.apply(text).is_ok() || c != before {
                return Err("a failing apply changed the configuration".into());
            }
            Ok(())
        }
    }
}

fn check_sizing(c: &Config) -> Result<(), String> {
    let z = &c.sizing;
    if z.min_block_size < 256 {
        return Err(format!(
            "min_block_size {} accepted: pointers lose 256-byte alignment",
            z.min_block_size
        ));
    }
    for bytes in PROBES {
        match z.round(bytes) {
            None if bytes > MAX_REQUEST => {}
            None => return Err(format!("round({bytes}) refused a valid request")),
            Some(r) if bytes > MAX_REQUEST => return Err(format!("round({bytes}) = {r}")),
            Some(r) => {
                if r < bytes.max(1) || !r.is_multiple_of(z.min_block_size) {
                    return Err(format!("round({bytes}) = {r} with {z:?}"));
                }
                let seg = z.segment_size(r);
                if seg < r {
                    return Err(format!("segment_size({r}) = {seg} cannot hold it"));
                }
                let _ = z.should_split(z.kind(r), seg, r);
                let _ = z.may_serve(seg, r);
            }
        }
    }
    for total in [0, 1 << 30, u64::MAX] {
        if let Some(limit) = c.limit(total)
            && c.memory_fraction.is_some()
            && limit > total
        {
            return Err(format!("limit {limit} above the device's {total} bytes"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_and_bad_strings_pass_the_checks() {
        for s in [
            "",
            "max_split_size_mb:256,roundup_power2_divisions:4",
            "min_block_size:1,roundup_power2_divisions:64",
            "expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]",
            "roundup_power2_divisions:[1:4294967296,>:1],garbage_collection_threshold:0.5",
            "roundup_power2_divisions:[64:8,,>:2]",
            "roundup_power2_divisions:[[64:8]]",
            "pinned_num_register_threads:8,pinned_num_register_threads:4,backend:native",
            "per_process_memory_fraction:1e-300",
            "bogus:1",
            "max_split_size_mb",
            "max_split_size_mb:20",
            "\u{feff}cross_stream:strict",
        ] {
            check(s).unwrap();
            config_parse(s.as_bytes());
        }
        config_parse(&[0xff, 0xfe, b':', 0x80]);
    }

    /// The fuzzer's dictionary names every key the parser knows (it had fallen behind by
    /// thirty keys).
    #[test]
    fn the_dictionary_lists_every_key() {
        let dict = include_str!("../../../fuzz/dicts/config_parse.dict");
        let known = tidepool::CONFIG_KEYS.iter().chain(tidepool::CONFIG_NO_EFFECT_KEYS);
        for (key, _) in known {
            assert!(dict.contains(&format!("=\"{key}\"")), "{key} is not in the dictionary");
        }
    }

    #[test]
    fn a_bad_size_rule_is_caught() {
        let mut c = Config::default();
        c.sizing.min_large_alloc = 10 * MIB;
        c.sizing.round_large = 512;
        check_sizing(&c).unwrap();
        c.sizing.small_segment = 512; // a small segment that cannot hold a small request
        let err = check_sizing(&c).unwrap_err();
        assert!(err.contains("cannot hold it"), "{err}");
    }
}
