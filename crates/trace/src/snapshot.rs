//! What a PyTorch memory snapshot says about one device beyond its allocations: PyTorch's own
//! reserved memory over the recorded window ([`RecordedReserved`], the `pytorch (recorded)`
//! row of a report), its `allocator_settings` ([`AllocatorSettings`], with their mapping onto
//! tidepool's [`Config`]) and how the window was read ([`SnapshotInfo`]).
//!
//! Reserved memory is reconstructed backwards from the end, as PyTorch's viewer does: at the
//! snapshot it is the sum of the device's `segments[].total_size`; before a `segment_alloc` or
//! `segment_map` of `size` bytes it was `size` less, before a `segment_free` or
//! `segment_unmap` `size` more.
//!
//! ```text
//!  reserved ▲          segment_alloc           segment_free
//!           │      ┌──────────────────┐
//!           │──────┘  (at start)      └────────── at snapshot = Σ segments.total_size
//!           └────────────────────────────────────► trace entries
//! ```

use std::sync::Arc;

use tidepool::Config;

/// PyTorch's reserved bytes over the recorded window of one device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordedReserved {
    /// Reserved at the start of the window (before its first entry).
    pub at_start: u64,
    /// Reserved at the snapshot: the sum of the device's segments.
    pub at_snapshot: u64,
    /// The highest reserved at any point of the window (at the start, after any entry).
    pub peak: u64,
    /// `segment_alloc`, `segment_free`, `segment_map` and `segment_unmap` entries seen.
    pub segment_events: u64,
    /// Reserved after each event of the trace (one value per event).
    pub timeline: Vec<u64>,
    /// False when the segment entries account for more memory than the snapshot's segments
    /// hold (reserved would have been negative at some point): the figures are then raised so
    /// that the lowest point is 0, and a note says so.
    pub consistent: bool,
}

/// How one device of a PyTorch snapshot was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The device index (position in `device_traces`, `segments[].device`).
    pub device: u32,
    /// Whether the snapshot holds a history for this device. Without one (taken without
    /// `torch.cuda.memory._record_memory_history()`), the trace is the static picture at the
    /// snapshot: one persistent allocation per `active_allocated` or `active_pending_free`
    /// block, nothing freed.
    pub history: bool,
    /// Entries of `device_traces[device]`.
    pub entries: u64,
    /// PyTorch's reserved memory over the window.
    pub reserved: RecordedReserved,
    /// The snapshot's `allocator_settings`, when it has them (PyTorch 2.1 and later): one
    /// value shared by the traces of every device (a copy per device made a 220 KB pickle of
    /// a 200 KB `PYTORCH_CUDA_ALLOC_CONF` and 20 000 devices take 3.9 GB).
    pub settings: Option<Arc<AllocatorSettings>>,
    /// Entries found out of `time_us` order and put back in order (0 when every entry has a
    /// `time_us` and they were in order, or when some entry has none: then the order of the
    /// list is kept).
    pub reordered: u64,
    /// Scopes made from `external_annotations` START/END pairs of this device.
    pub annotation_scopes: u64,
    /// Anything else the reader wants the reader of the report to know.
    pub notes: Vec<String>,
}

/// A snapshot's `allocator_settings`: every key as text, and the ones that map onto tidepool.
///
/// Float settings are not shown (the reader once zeroed floats before decoding; the text stays
/// as it was), so `garbage_collection_threshold` is taken from the `PYTORCH_CUDA_ALLOC_CONF`
/// string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocatorSettings {
    /// Every key with its value as text, in the pickle's (sorted) key order.
    pub entries: Vec<(String, String)>,
    /// `PYTORCH_CUDA_ALLOC_CONF` as PyTorch last applied it.
    pub conf: String,
    /// `max_split_size` in bytes (`-1` or `2^64 - 1`: unlimited).
    pub max_split_size: Option<i128>,
    /// `expandable_segments`.
    pub expandable_segments: Option<bool>,
    /// `roundup_power2_divisions`: one value per size interval (`(interval, divisions)`), or a
    /// single value with an empty interval name (older PyTorch).
    pub roundup_power2_divisions: Vec<(String, u64)>,
}

/// Keys of `allocator_settings` that have no effect on a replay of device memory: those
/// tidepool's `Config` accepts without effect.
const NO_EFFECT: &[(&str, &str)] = tidepool::CONFIG_NO_EFFECT_KEYS;

/// `allocator_settings` mapped onto tidepool's configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigMapping {
    /// A `key:value,...` string for tidepool's [`Config`] (empty: the defaults).
    pub config: String,
    /// What could not be mapped, and why, one note per key or group of keys.
    pub notes: Vec<String>,
}

impl AllocatorSettings {
    /// The value of `key` in the `PYTORCH_CUDA_ALLOC_CONF` string, if set there.
    pub fn conf_value(&self, key: &str) -> Option<&str> {
        // PyTorch accepted the string, so it is well formed; one that is not has no value.
        let entries = Config::entries(&self.conf).unwrap_or_default();
        entries.into_iter().rev().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// One line for reports: `key value, key value, ...`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self.entries.iter().map(|(k, v)| format!("{k} {v}")).collect();
        parts.join(", ")
    }

    /// `roundup_power2_divisions` as text: one number when every interval holds the same,
    /// else `[interval:divisions ...]`; `-` when absent.
    pub fn roundup_summary(&self) -> String {
        let r = &self.roundup_power2_divisions;
        match r.first() {
            None => "-".into(),
            Some((_, v)) if r.iter().all(|(_, x)| x == v) => v.to_string(),
            Some(_) => {
                let each: Vec<String> = r.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                format!("[{}]", each.join(" "))
            }
        }
    }

    /// Maps the settings onto tidepool's [`Config`]: `max_split_size` and a uniform
    /// `roundup_power2_divisions` carry over; every other key that is set to something
    /// tidepool cannot do gets a note saying why, and keys with no effect on device memory are
    /// named once.
    pub fn to_config(&self) -> ConfigMapping {
        let mut config: Vec<String> = Vec::new();
        let mut notes = Vec::new();
        if let Some(s) = self.max_split_size
            && s > 0
            && s < i128::from(u64::MAX)
        {
            let mb = (s as u128).div_ceil(1 << 20);
            config.push(format!("max_split_size_mb:{mb}"));
        }
        let r = &self.roundup_power2_divisions;
        if let Some(&(_, v)) = r.first() {
            if r.iter().all(|&(_, x)| x == v) {
                if v != 0 {
                    config.push(format!("roundup_power2_divisions:{v}"));
                }
            } else {
                // One entry per interval, keyed by its start in MiB: PyTorch's list form.
                let each: Vec<String> = r.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                config.push(format!("roundup_power2_divisions:[{}]", each.join(",")));
            }
        }
        if self.expandable_segments == Some(true) {
            config.push("expandable_segments:true".into());
        }
        if let Some(gc) = self.conf_value("garbage_collection_threshold")
            && gc.parse::<f64>().is_ok_and(|x| x > 0.0)
        {
            config.push(format!("garbage_collection_threshold:{gc}"));
            notes.push(format!(
                "garbage_collection_threshold {gc}: the snapshot records no per-process memory \
                 fraction, so it applies against the replay device's whole memory"
            ));
        }
        if let Some(backend) = self.conf_value("backend")
            && backend != "native"
        {
            notes.push(format!(
                "backend {}: PyTorch did not use its caching allocator; the recorded row is \
                 that backend's",
                crate::error::echo(backend)
            ));
        }
        let known = [
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size",
            "roundup_power2_divisions",
            "expandable_segments",
            "garbage_collection_threshold",
        ];
        let no_effect: Vec<String> = self
            .entries
            .iter()
            .filter_map(|(k, _)| NO_EFFECT.iter().find(|(n, _)| n == k))
            .map(|(k, why)| format!("{k} ({why})"))
            .collect();
        if !no_effect.is_empty() {
            notes.push(format!(
                "ignored, no effect on a replay of device memory: {}",
                no_effect.join(", ")
            ));
        }
        let unknown: Vec<&str> = self
            .entries
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !known.contains(k) && !NO_EFFECT.iter().any(|(n, _)| n == k))
            .collect();
        if !unknown.is_empty() {
            notes.push(format!("not known to tidepool, ignored: {}", unknown.join(", ")));
        }
        let mut text = config.join(",");
        if let Err(e) = Config::parse(&text) {
            notes.push(format!("`{text}` is not a valid tidepool configuration ({e}); not mapped"));
            text.clear();
        }
        ConfigMapping { config: text, notes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        max_split: i128,
        roundup: &[u64],
        expandable: bool,
        conf: &str,
    ) -> AllocatorSettings {
        AllocatorSettings {
            entries: vec![
                ("PYTORCH_CUDA_ALLOC_CONF".into(), format!("{conf:?}")),
                ("expandable_segments".into(), expandable.to_string()),
                ("garbage_collection_threshold".into(), conf_gc(conf)),
                ("max_split_size".into(), max_split.to_string()),
                ("pinned_num_register_threads".into(), "1".into()),
                ("roundup_power2_divisions".into(), roundup_text(roundup)),
            ],
            conf: conf.into(),
            max_split_size: Some(max_split),
            expandable_segments: Some(expandable),
            roundup_power2_divisions: roundup
                .iter()
                .enumerate()
                .map(|(i, &v)| ((1u64 << i).to_string(), v))
                .collect(),
        }
    }

    fn conf_gc(conf: &str) -> String {
        let s = AllocatorSettings { conf: conf.into(), ..AllocatorSettings::default() };
        s.conf_value("garbage_collection_threshold").unwrap_or("0").to_string()
    }

    fn roundup_text(r: &[u64]) -> String {
        let s = AllocatorSettings {
            roundup_power2_divisions: r.iter().map(|&v| (String::new(), v)).collect(),
            ..AllocatorSettings::default()
        };
        s.roundup_summary()
    }

    #[test]
    fn defaults_map_to_defaults() {
        let m = settings(-1, &[0, 0, 0], false, "").to_config();
        assert_eq!(m.config, "");
        assert_eq!(
            m.notes,
            vec![
                "ignored, no effect on a replay of device memory: pinned_num_register_threads (pinned host memory)"
            ]
        );
    }

    #[test]
    fn supported_keys_carry_over_and_the_rest_is_explained() {
        let s = settings(
            256 << 20,
            &[4, 4, 4],
            true,
            "expandable_segments:True,garbage_collection_threshold:0.6,max_split_size_mb:256",
        );
        let m = s.to_config();
        assert_eq!(
            m.config,
            "max_split_size_mb:256,roundup_power2_divisions:4,expandable_segments:true,\
             garbage_collection_threshold:0.6"
        );
        assert!(m.notes[0].starts_with("garbage_collection_threshold 0.6"), "{:?}", m.notes);
        assert!(s.summary().contains("garbage_collection_threshold 0.6"), "{}", s.summary());
        assert!(s.summary().contains("roundup_power2_divisions 4"), "{}", s.summary());
        let c = Config::parse(&m.config).unwrap();
        assert!(c.expandable_segments && c.garbage_collection_threshold == Some(0.6));
        // Per-interval divisions map to PyTorch's list form, interval by interval.
        let m = settings(-1, &[1, 2, 4], false, "").to_config();
        assert_eq!(m.config, "roundup_power2_divisions:[1:1,2:2,4:4]");
        let d = Config::parse(&m.config).unwrap().sizing.roundup_power2_divisions;
        assert_eq!([d.for_size(1 << 20), d.for_size(3 << 20), d.for_size(5 << 20)], [1, 2, 4]);
        assert!(m.notes.iter().all(|n| !n.contains("roundup")), "{:?}", m.notes);
        // A max_split_size tidepool rejects (not above its large segment size) is explained.
        let m = settings(1 << 20, &[], false, "").to_config();
        assert_eq!(m.config, "");
        assert!(m.notes.iter().any(|n| n.contains("not a valid tidepool configuration")));
    }

    #[test]
    fn conf_string_values_keep_brackets() {
        let s = AllocatorSettings {
            conf: "roundup_power2_divisions:[256:1,>:4], backend:native".into(),
            ..AllocatorSettings::default()
        };
        assert_eq!(s.conf_value("roundup_power2_divisions"), Some("[256:1,>:4]"));
        assert_eq!(s.conf_value("backend"), Some("native"));
        assert_eq!(s.conf_value("max_split_size_mb"), None);
    }
}
