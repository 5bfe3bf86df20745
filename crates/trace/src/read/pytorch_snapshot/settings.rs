//! The snapshot's `allocator_settings` and its `external_annotations` (ranges of the history).

use super::values::{as_i128, as_u64, bad, cut, field, key, record, time_us};
use crate::error::{TraceError, echo};
use crate::read::pickle::Obj;
use crate::snapshot::AllocatorSettings;
use std::collections::BTreeMap;

pub(super) fn parse_settings(v: Option<Obj<'_>>) -> Result<Option<AllocatorSettings>, TraceError> {
    let map = match v {
        None | Some(Obj::None) => return Ok(None),
        Some(v @ Obj::Dict(m)) => {
            record(v, &|e| bad(format!("allocator_settings: {e}")))?;
            m
        }
        Some(_) => return Err(bad("`allocator_settings` is not a dict".into())),
    };
    // String keys in order, each once with its last value (as Python's dict holds them).
    let map: BTreeMap<&str, Obj<'_>> = map
        .iter()
        .filter_map(|(k, v)| match k {
            Obj::Str(k) => Some((k, v)),
            _ => None,
        })
        .collect();
    let mut s = AllocatorSettings::default();
    for (k, val) in map {
        let text = match val {
            Obj::Str(t) => format!("{t:?}"),
            Obj::Bool(b) => if b { "True" } else { "False" }.to_string(),
            Obj::Dict(_) => "{…}".to_string(),
            other => as_i128(other).map(|i| i.to_string()).unwrap_or_else(|| "…".into()),
        };
        match (k, val) {
            ("PYTORCH_CUDA_ALLOC_CONF", Obj::Str(t)) => s.conf = t.to_string(),
            ("max_split_size", v) => s.max_split_size = as_i128(v),
            ("expandable_segments", Obj::Bool(b)) => s.expandable_segments = Some(b),
            ("roundup_power2_divisions", v @ Obj::Dict(d)) => {
                record(v, &|e| bad(format!("allocator_settings.roundup_power2_divisions: {e}")))?;
                // Keys `"1024"` or `1024`, each once with its last value.
                let unique: BTreeMap<Result<i64, &str>, Obj<'_>> = d
                    .iter()
                    .filter_map(|(k, v)| match k {
                        Obj::Str(s) => Some((Err(s), v)),
                        Obj::Int(i) => Some((Ok(i64::try_from(i).ok()?), v)),
                        _ => None,
                    })
                    .collect();
                let mut r: Vec<(u64, String, u64)> = unique
                    .into_iter()
                    .filter_map(|(k, v)| {
                        let name = match k {
                            Err(s) => cut(s, 64),
                            Ok(i) => i.to_string(),
                        };
                        Some((name.parse().unwrap_or(u64::MAX), name, as_u64(v)?))
                    })
                    .collect();
                r.sort();
                s.roundup_power2_divisions = r.into_iter().map(|(_, k, v)| (k, v)).collect();
            }
            ("roundup_power2_divisions", v) => {
                if let Some(n) = as_u64(v) {
                    s.roundup_power2_divisions = vec![(String::new(), n)];
                }
            }
            _ => {}
        }
        s.entries.push((cut(k, 64), cut(&text, 256)));
    }
    // Floats are not shown (as before this decoder, which zeroed them: the figures stay the
    // same), and dicts have no short text: write those from what was read.
    let gc = s.conf_value("garbage_collection_threshold").map(|v| cut(v, 64));
    let roundup = s.roundup_summary();
    for (k, v) in &mut s.entries {
        match k.as_str() {
            "garbage_collection_threshold" => *v = gc.clone().unwrap_or_else(|| "0".into()),
            "roundup_power2_divisions" => *v = roundup.clone(),
            _ => {}
        }
    }
    Ok(Some(s))
}

/// One `external_annotations` record.
pub(super) struct Annotation {
    pub(super) device: u64,
    /// START (`true`) or END; `None`: another stage (skipped).
    pub(super) stage: Option<bool>,
    pub(super) name: String,
    pub(super) time: i128,
}

pub(super) fn parse_annotations(v: Option<Obj<'_>>) -> Result<Vec<Annotation>, TraceError> {
    let list = match v {
        None | Some(Obj::None) => return Ok(Vec::new()),
        Some(Obj::List(l)) => l,
        Some(_) => return Err(bad("`external_annotations` is not a list".into())),
    };
    let mut out = Vec::new();
    for (i, a) in list.iter().enumerate() {
        let what = |m: String| bad(format!("external_annotations[{i}]: {m}"));
        record(a, &what)?;
        let start = match key(a, "stage") {
            Some(Obj::Str("START")) => true,
            Some(Obj::Str("END")) => false,
            // A stage PyTorch may add: no scope, skipped and counted on its device.
            // BROKEN (`annotation_stage_refused`): it refused the whole snapshot.
            Some(Obj::Str(_)) if !cfg!(tidepool_broken = "annotation_stage_refused") => {
                out.push(Annotation {
                    device: field(a, "device", &what)?,
                    stage: None,
                    name: String::new(),
                    time: 0,
                });
                continue;
            }
            Some(Obj::Str(_)) => return Err(what("`stage` is not START or END".into())),
            _ => return Err(what("missing or non-string `stage`".into())),
        };
        let name = match key(a, "name") {
            Some(Obj::Str(s)) => echo(s),
            _ => return Err(what("missing or non-string `name`".into())),
        };
        let device = field(a, "device", &what)?;
        let time = match key(a, "time_us") {
            Some(v) => time_us(v).map_err(what)?,
            None => return Err(what("missing key `time_us`".into())),
        };
        out.push(Annotation { device, stage: Some(start), name, time });
    }
    Ok(out)
}
