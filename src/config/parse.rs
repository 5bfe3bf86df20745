//! The `key:value,...` string (`TIDEPOOL_ALLOC_CONF`, PyTorch's `PYTORCH_CUDA_ALLOC_CONF`
//! syntax) into a [`Config`]: entries, the environment, and each key's value.

use super::{
    Config, ConfigError, CrossStream, ENV_VAR, ExpandableReserve, MIN_ALIGN, NO_CACHING_ENV_VAR,
    NO_EFFECT_KEYS,
};
use crate::pool::{DEFAULT_MAX_NON_SPLIT_ROUNDING, MIB, RoundupDivisions};

impl Config {
    /// The `(key, value)` entries of a `key:value,...` string, trimmed, empty ones skipped: split
    /// at commas outside brackets, so a PyTorch list value such as `[64:8,>:1]` stays whole.
    ///
    /// ```
    /// use tidepool::Config;
    /// let e = Config::entries("expandable_segments:True, roundup_power2_divisions:[64:8,>:1]");
    /// assert_eq!(
    ///     e.unwrap(),
    ///     [("expandable_segments", "True"), ("roundup_power2_divisions", "[64:8,>:1]")]
    /// );
    /// assert!(Config::entries("roundup_power2_divisions:[64:8").is_err());
    /// ```
    pub fn entries(s: &str) -> Result<Vec<(&str, &str)>, ConfigError> {
        let mut parts = Vec::new();
        let (mut depth, mut start) = (0usize, 0usize);
        let unbalanced = |what: &str, from: usize| {
            ConfigError::Malformed(format!("{what} in `{}`", s[from..].trim()))
        };
        for (i, c) in s.char_indices() {
            match c {
                '[' => depth += 1,
                ']' => {
                    depth =
                        depth.checked_sub(1).ok_or_else(|| unbalanced("`]` without `[`", start))?
                }
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        if depth != 0 {
            return Err(unbalanced("`[` without `]`", start));
        }
        parts.push(&s[start..]);
        parts
            .into_iter()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (k, v) =
                    e.split_once(':').ok_or_else(|| ConfigError::Malformed(e.to_string()))?;
                Ok((k.trim(), v.trim()))
            })
            .collect()
    }

    /// Parses a `key:value,key:value` string over the defaults. Empty entries are ignored.
    pub fn parse(s: &str) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        c.apply(s)?;
        Ok(c)
    }

    /// Reads [`ENV_VAR`] (the defaults when it is unset), then [`NO_CACHING_ENV_VAR`]: `1`
    /// turns caching off, `0` or unset leaves it.
    pub fn from_env() -> Result<Config, ConfigError> {
        let var = |name: &str| match std::env::var(name) {
            Ok(s) => Ok(Some(s)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(ConfigError::BadValue {
                key: name.into(),
                value: v.to_string_lossy().into_owned(),
                expected: "valid UTF-8".into(),
            }),
        };
        Config::from_vars(var(ENV_VAR)?.as_deref(), var(NO_CACHING_ENV_VAR)?.as_deref())
    }

    /// [`Config::from_env`] over given values of its two variables.
    pub(super) fn from_vars(
        conf: Option<&str>,
        no_caching: Option<&str>,
    ) -> Result<Config, ConfigError> {
        let in_var = |error| match cfg!(tidepool_broken = "config_errors_blame_env") {
            true => error,
            false => ConfigError::Env { var: ENV_VAR, error: Box::new(error) },
        };
        let mut c = Config::parse(conf.unwrap_or("")).map_err(in_var)?;
        match no_caching.map(str::trim) {
            None | Some("" | "0") => {}
            Some("1") => {
                c.caching = false;
                c.validate().map_err(|e| match e {
                    ConfigError::Inconsistent(why) => ConfigError::Inconsistent(format!(
                        "{why} ({ENV_VAR} with {NO_CACHING_ENV_VAR}=1)"
                    )),
                    e => e,
                })?;
            }
            Some(v) => {
                return Err(ConfigError::BadValue {
                    key: NO_CACHING_ENV_VAR.into(),
                    value: v.into(),
                    expected: "1 or 0".into(),
                });
            }
        }
        Ok(c)
    }

    /// Applies a `key:value,...` string on top of this configuration. On error `self` is
    /// unchanged.
    pub fn apply(&mut self, s: &str) -> Result<(), ConfigError> {
        let mut next = self.clone();
        let entries = Config::entries(s)?;
        // PyTorch reads `large_segment_size_mb` first (two passes), sets
        // `max_non_split_rounding` to it, and then wants an explicit `max_non_split_rounding_mb`
        // at least as large, wherever the keys stand in the string.
        let large = |k: &&str| *k == "large_segment_size_mb";
        let large_given = entries.iter().any(|(k, _)| large(k));
        for (key, value) in entries.iter().filter(|(k, _)| large(k)) {
            next.set(key, value)?;
        }
        for (key, value) in entries.iter().filter(|(k, _)| !large(k)) {
            next.set_with(key, value, large_given)?;
        }
        next.validate()?;
        *self = next;
        Ok(())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        self.set_with(key, value, false)
    }

    /// `large_given`: the string sets `large_segment_size_mb`, the floor of
    /// `max_non_split_rounding_mb` (PyTorch's `parseMaxNonSplitRoundingSize`).
    fn set_with(&mut self, key: &str, value: &str, large_given: bool) -> Result<(), ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        let mib = |max: u64| -> Result<u64, ConfigError> {
            let what = format!("a whole number of MiB in 1..={max}");
            let v: u64 = value.parse().map_err(|_| bad(&what))?;
            if v == 0 || v > max { Err(bad(&what)) } else { Ok(v * MIB) }
        };
        // PyTorch spells them `True` and `False`.
        let flag = || match value {
            "true" | "True" => Ok(true),
            "false" | "False" => Ok(false),
            _ => Err(bad("true or false")),
        };
        const MAX_MIB: u64 = 1 << 28; // 256 TiB
        let clamped = || -> Result<u64, ConfigError> {
            let what = "a whole number of MiB, at least 1";
            match value.parse::<u64>() {
                Ok(0) | Err(_) => Err(bad(what)),
                Ok(v) => Ok(v.min(MAX_MIB) * MIB),
            }
        };
        let z = &mut self.sizing;
        match key {
            // PyTorch clamps a larger value (`std::min(val_env, SIZE_MAX / kMB)`): never split.
            "max_split_size_mb" => z.max_split_size = clamped()?,
            "roundup_power2_divisions" => {
                z.roundup_power2_divisions = RoundupDivisions::parse(value).map_err(|e| bad(&e))?
            }
            "max_non_split_rounding_mb" => {
                let v = clamped()?;
                let floor =
                    if large_given { z.large_segment } else { DEFAULT_MAX_NON_SPLIT_ROUNDING };
                if v < floor {
                    return Err(bad(&format!(
                        "a whole number of MiB, at least {} (large_segment_size_mb, as PyTorch)",
                        floor / MIB
                    )));
                }
                z.max_non_split_rounding = v;
            }
            "backend" if value == "native" => {}
            "backend" => {
                return Err(bad(
                    "native: tidepool is a caching allocator of its own, it does not hand \
                     requests to cudaMallocAsync",
                ));
            }
            k if NO_EFFECT_KEYS.iter().any(|(n, _)| *n == k) => {
                if k == "pinned_num_register_threads" {
                    if !value.parse::<u64>().is_ok_and(|n| n.is_power_of_two() && n <= 128) {
                        return Err(bad("a power of two ≤ 128"));
                    }
                } else if k == "pinned_reserve_segment_size_mb" {
                    mib(MAX_MIB)?; // PyTorch: greater than 0
                } else {
                    flag()?;
                }
                self.no_effect.retain(|e| e.split_once(':').is_none_or(|(old, _)| old != k));
                self.no_effect.push(format!("{k}:{value}"));
            }
            "min_block_size" => {
                let what = "a power of two in 256..=1048576 bytes (pointers stay 256-byte \
                            aligned, as CUDA's and RMM's are)";
                let v: u64 = value.parse().map_err(|_| bad(what))?;
                if !v.is_power_of_two() || !(MIN_ALIGN..=MIB).contains(&v) {
                    return Err(bad(what));
                }
                z.min_block_size = v;
            }
            "small_size_mb" => z.small_size = mib(1024)?,
            "small_segment_mb" => z.small_segment = mib(1024)?,
            "large_segment_mb" => z.large_segment = mib(1 << 16)?,
            "large_segment_size_mb" => {
                let v = mib(1 << 16)?;
                if v <= 10 * MIB {
                    return Err(bad("a whole number of MiB above 10 (as PyTorch)"));
                }
                // PyTorch: `max_non_split_rounding_size_ = large_segment_size_` before the
                // other keys are read (an explicit max_non_split_rounding_mb then overrides it).
                z.large_segment = v;
                z.max_non_split_rounding = v;
            }
            "min_large_alloc_mb" => z.min_large_alloc = mib(1 << 16)?,
            "round_large_mb" => z.round_large = mib(1024)?,
            "memory_limit_mb" => self.memory_limit = Some(mib(MAX_MIB)?),
            "per_process_memory_fraction" => {
                let what = "a number in [0, 1]";
                let v: f64 = value.parse().map_err(|_| bad(what))?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(bad(what));
                }
                self.memory_fraction = Some(v);
            }
            "cross_stream" => {
                self.cross_stream = match value {
                    "strict" => CrossStream::Strict,
                    "wait_event" => CrossStream::WaitEvent,
                    "never" => CrossStream::Never,
                    _ => return Err(bad("strict, wait_event or never")),
                }
            }
            "fast_cache" => self.fast_cache = flag()?,
            "fast_cache_entries" => {
                let what = "a whole number in 1..=65536";
                let v: usize = value.parse().map_err(|_| bad(what))?;
                if v == 0 || v > 65536 {
                    return Err(bad(what));
                }
                self.fast_cache_entries = v;
            }
            "fast_cache_bytes_mb" => self.fast_cache_bytes = mib(1 << 20)?,
            "global_lock" => self.global_lock = flag()?,
            "biased_lanes" => self.biased_lanes = flag()?,
            "expandable_segments" => self.expandable_segments = flag()?,
            "expandable_stitching" => self.stitching = flag()?,
            "graph_capture_record_stream_reuse" => self.graph_capture_record_stream_reuse = flag()?,
            "expandable_segments_reserve" => {
                let what = "a positive share of the device's memory (0.25), or GiB with a G \
                            suffix (16G)";
                let (number, gib) = match value.strip_suffix(['G', 'g']) {
                    Some(n) => (n, true),
                    None => (value, false),
                };
                let v: f64 = number.parse().map_err(|_| bad(what))?;
                if !(v.is_finite() && v > 0.0) {
                    return Err(bad(what));
                }
                self.expandable_reserve = Some(match gib {
                    true => ExpandableReserve::Bytes((v * (1u64 << 30) as f64) as u64),
                    false => ExpandableReserve::Fraction(v),
                });
            }
            "release_threshold_mb" => {
                let what = "a whole number of MiB in 0..=268435456, or none";
                self.release_threshold = match value {
                    "none" => u64::MAX,
                    v => match v.parse::<u64>() {
                        Ok(v) if v <= MAX_MIB => v * MIB,
                        _ => return Err(bad(what)),
                    },
                };
            }
            "garbage_collection_threshold" => {
                let what = "a number in (0, 1)";
                let v: f64 = value.parse().map_err(|_| bad(what))?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(bad(what));
                }
                self.garbage_collection_threshold = Some(v);
            }
            "initial_pool_size_mb" => {
                let what = "a whole number of MiB in 0..=268435456";
                match value.parse::<u64>() {
                    Ok(v) if v <= MAX_MIB => self.initial_pool_size = v * MIB,
                    _ => return Err(bad(what)),
                }
            }
            "max_pool_size_mb" => self.max_pool_size = Some(mib(MAX_MIB)?),
            "caching" => self.caching = flag()?,
            "throw_on_cudamalloc_oom" => self.throw_on_oom = flag()?,
            "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => {
                // PyTorch takes any size, 0 included (nothing rounded, nothing cached).
                let what = "a whole number of MiB in 0..=268435456";
                let v = match value.parse::<u64>() {
                    Ok(v) if v <= MAX_MIB => v * MIB,
                    _ => return Err(bad(what)),
                };
                match key {
                    "pinned_max_round_threshold_mb" => self.pinned.max_round_threshold = v,
                    _ => self.pinned.max_cached_size = v,
                }
            }
            _ => return Err(ConfigError::UnknownKey(key.to_string())),
        }
        Ok(())
    }
}
