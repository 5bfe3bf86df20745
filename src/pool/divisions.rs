//! `roundup_power2_divisions`: how many equal steps each power-of-two interval of request sizes
//! is rounded to, per interval as PyTorch's allocator keeps it.
//!
//! ```text
//!  interval  0      1      2      3     ...    14        15
//!  sizes     <2MiB  2MiB.. 4MiB.. 8MiB.. ...   16GiB..   ≥32GiB
//!  value     divisions (0: off), stored as log2 + 1 in one byte
//!
//!  "4"                         every interval 4
//!  "[64:8,256:4,>:1]"          64 → interval 6 (64 MiB..128 MiB) = 8, and every interval
//!                              below the first key too; 256 → interval 8 = 4; intervals not
//!                              named stay 0 (7: 128 MiB..256 MiB); ">" sets every interval
//!                              after the key before it (9..=15) = 1; a key after ">" sets
//!                              its own interval again, as in PyTorch
//! ```
//!
//! The text forms are PyTorch's `PYTORCH_CUDA_ALLOC_CONF` ones (keys in MiB, powers of two;
//! divisions 0 or a power of two), read with the same rules, so a configuration copied from a
//! PyTorch job rounds every size as PyTorch does.

use crate::types::MIB;

/// Size intervals: `[2^i MiB, 2^(i+1) MiB)` for `i` in `0..16`, the first taking every smaller
/// size and the last every larger one (PyTorch's `kRoundUpPowerOfTwoIntervals`).
pub const INTERVALS: usize = 16;

/// The largest number of divisions accepted: more would make steps smaller than any block.
pub const MAX_DIVISIONS: u64 = 1 << 32;

/// Divisions per power-of-two size interval (16 of them; see the module docs).
///
/// ```
/// use tidepool::RoundupDivisions;
/// let d = RoundupDivisions::parse("[64:8,256:4,>:1]").unwrap();
/// assert_eq!(d.for_size(3 << 20), 8); // below the first key: its value
/// assert_eq!(d.for_size(100 << 20), 8);
/// assert_eq!(d.for_size(200 << 20), 0); // 128 MiB..256 MiB: not named
/// assert_eq!(d.for_size(300 << 20), 4);
/// assert_eq!(d.for_size(1 << 40), 1);
/// assert_eq!(RoundupDivisions::uniform(4).unwrap().for_size(1 << 30), 4);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RoundupDivisions {
    /// `log2(divisions) + 1` per interval; 0 means 0 (off).
    log: [u8; INTERVALS],
}

/// Encodes a count of divisions (0 or a power of two ≤ 2^32).
fn encode(divisions: u64) -> Option<u8> {
    match divisions {
        0 => Some(0),
        d if d.is_power_of_two() && d <= MAX_DIVISIONS => Some(d.trailing_zeros() as u8 + 1),
        _ => None,
    }
}

/// The interval of a MiB key or a byte size: `log2` of its MiB count, clamped to the table.
#[inline]
fn interval_of_mib(mib: u64) -> usize {
    (63 - mib.max(1).leading_zeros() as usize).min(INTERVALS - 1)
}

impl RoundupDivisions {
    /// Off in every interval (the default).
    pub const OFF: RoundupDivisions = RoundupDivisions { log: [0; INTERVALS] };

    /// The same count in every interval; `None` unless it is 0 or a power of two ≤
    /// 2^32.
    pub fn uniform(divisions: u64) -> Option<RoundupDivisions> {
        Some(RoundupDivisions { log: [encode(divisions)?; INTERVALS] })
    }

    /// Reads PyTorch's forms: one number (every interval), or `[KEY:N,...,>:N]` with KEY a power
    /// of two in MiB. The message of an error says what was expected.
    pub fn parse(text: &str) -> Result<RoundupDivisions, String> {
        let text = text.trim();
        let count =
            |v: &str| -> Result<u8, String> {
                v.trim().parse::<u64>().ok().and_then(encode).ok_or_else(|| {
                    format!("divisions `{}`: 0 or a power of two up to 2^32", v.trim())
                })
            };
        let Some(list) = text.strip_prefix('[') else {
            return Ok(RoundupDivisions { log: [count(text)?; INTERVALS] });
        };
        let list = list
            .strip_suffix(']')
            .ok_or_else(|| "a list `[KEY:N,...]` must end with `]`".to_string())?;
        let mut log = [0u8; INTERVALS];
        let mut last: Option<usize> = None;
        #[cfg(tidepool_broken = "divisions_gt_last")]
        let mut rest_seen = false;
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (key, value) =
                entry.split_once(':').ok_or_else(|| format!("entry `{entry}`: expected KEY:N"))?;
            let v = count(value)?;
            #[cfg(tidepool_broken = "divisions_gt_last")]
            if rest_seen {
                // BROKEN: a key after `>` refused, where PyTorch reads it
                return Err(format!("entry `{entry}` after `>`: `>` must come last"));
            }
            if key.trim() == ">" {
                // PyTorch's `last_index` starts at 0, so a `>` with no key before it fills
                // from interval 1: sizes below 2 MiB keep 0 (`[>:4]`). Keys may follow it,
                // as in PyTorch's loop: each sets its own interval (`[64:8,>:1,256:4]`), and
                // the first of them still fills the intervals below it (`[>:2,64:8]`).
                let from = last.map_or(1, |i| i + 1);
                log[from..].fill(v);
                #[cfg(tidepool_broken = "divisions_gt_last")]
                {
                    rest_seen = true;
                }
                continue;
            }
            let mib = key.trim().parse::<u64>().ok().filter(|m| m.is_power_of_two()).ok_or_else(
                || format!("interval `{}`: a power of two in MiB, or `>`", key.trim()),
            )?;
            let i = interval_of_mib(mib);
            if last.is_none() {
                log[..i].fill(v);
            }
            log[i] = v;
            last = Some(i);
        }
        Ok(RoundupDivisions { log })
    }

    /// The divisions that apply to a request of `bytes` (0: off).
    #[inline]
    pub fn for_size(&self, bytes: u64) -> u64 {
        let code = self.log[interval_of_mib(bytes / MIB)];
        if code == 0 { 0 } else { 1 << (code - 1) }
    }

    /// Whether some request of at most `bytes` bytes is rounded to a division, with rounding
    /// granularity `min_block` (`Sizing::round`: `d` > 1 divisions of an interval apply to its
    /// sizes above `min_block × d`). Every interval up to `bytes`' is asked.
    pub fn divides_up_to(&self, min_block: u64, bytes: u64) -> bool {
        let last = interval_of_mib(bytes / MIB);
        (0..=last).any(|i| {
            let div = self.interval(i);
            // The largest size of interval `i` that is at most `bytes`.
            let top = if i == last { bytes } else { (MIB << (i + 1)) - 1 };
            div > 1 && min_block.saturating_mul(div) < top
        })
    }

    /// The divisions of interval `i` (`[2^i MiB, 2^(i+1) MiB)`), for reports and snapshots.
    pub fn interval(&self, i: usize) -> u64 {
        match self.log.get(i) {
            Some(&c) if c > 0 => 1 << (c - 1),
            _ => 0,
        }
    }

    /// The largest count of any interval (0 when off everywhere).
    pub fn max(&self) -> u64 {
        (0..INTERVALS).map(|i| self.interval(i)).max().unwrap_or(0)
    }

    /// Whether no interval rounds (every count 0 or 1).
    #[inline]
    pub fn is_off(&self) -> bool {
        self.log.iter().all(|&c| c <= 1)
    }
}

impl std::fmt::Display for RoundupDivisions {
    /// One number when every interval holds the same count, else `[1:N,2:N,...]` naming each.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.log.iter().all(|&c| c == self.log[0]) {
            return write!(f, "{}", self.interval(0));
        }
        let each: Vec<String> =
            (0..INTERVALS).map(|i| format!("{}:{}", 1u64 << i, self.interval(i))).collect();
        write!(f, "[{}]", each.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's own expectations for its parser (c10's `allocator_config_test`).
    #[test]
    fn pytorch_list_forms() {
        let d = RoundupDivisions::parse("[64:8,128:2,256:4,512:2,1024:4,>:1]").unwrap();
        let at = |mib: u64| d.for_size(mib * MIB);
        assert_eq!(
            [at(32), at(64), at(128), at(256), at(512), at(1024), at(2048), at(4096), at(8192)],
            [8, 8, 2, 4, 2, 4, 1, 1, 1]
        );
        let d = RoundupDivisions::parse("[128:8,256:16,512:1,2048:8,>:2]").unwrap();
        let at = |mib: u64| d.for_size(mib * MIB);
        assert_eq!(
            [at(64), at(128), at(256), at(512), at(1024), at(2048), at(4096)],
            [8, 8, 16, 1, 0, 8, 2]
        );
        let d = RoundupDivisions::parse("4").unwrap();
        assert_eq!([d.for_size(64 * MIB), d.for_size(2048 * MIB), d.for_size(1)], [4, 4, 4]);
        // Unsloth's default, with divisions above 64.
        let d = RoundupDivisions::parse("[32:256,64:128,256:64,>:32]").unwrap();
        assert_eq!(
            [d.for_size(MIB), d.for_size(40 * MIB), d.for_size(100 * MIB), d.for_size(200 * MIB)],
            [256, 256, 128, 0]
        );
        assert_eq!(
            [d.for_size(300 * MIB), d.for_size(600 * MIB), d.for_size(u64::MAX)],
            [64, 32, 32]
        );
    }

    #[test]
    fn sizes_map_to_their_interval() {
        let d = RoundupDivisions::parse("[1:1,2:2,4:4,8:8,16:16,>:32]").unwrap();
        assert_eq!(d.for_size(0), 1);
        assert_eq!(d.for_size(2 * MIB - 1), 1);
        assert_eq!(d.for_size(2 * MIB), 2);
        assert_eq!(d.for_size(4 * MIB - 1), 2);
        assert_eq!(d.for_size(4 * MIB), 4);
        assert_eq!(d.for_size(31 * MIB), 16);
        assert_eq!(d.for_size(32 * MIB), 32);
        assert_eq!(d.max(), 32);
        // A `>` with no key before it leaves interval 0 (PyTorch's `last_index + 1`).
        let d = RoundupDivisions::parse("[>:4]").unwrap();
        assert_eq!([d.for_size(MIB), d.for_size(2 * MIB), d.for_size(u64::MAX)], [0, 4, 4]);
        // Keys above 32 GiB land in the last interval.
        let d = RoundupDivisions::parse("[65536:4]").unwrap();
        assert_eq!(d.for_size(u64::MAX), 4);
        assert_eq!(d.for_size(MIB), 4);
    }

    #[test]
    fn bad_forms_are_errors() {
        for (text, says) in [
            ("3", "power of two"),
            ("-1", "power of two"),
            ("[64:8", "end with `]`"),
            ("[63:8]", "interval `63`"),
            ("[0:8]", "interval `0`"),
            ("[64:3]", "divisions `3`"),
            ("[64]", "expected KEY:N"),
            ("8589934592", "divisions"),
            ("", "divisions"),
        ] {
            let err = RoundupDivisions::parse(text).unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
        assert_eq!(RoundupDivisions::uniform(3), None);
        assert_eq!(RoundupDivisions::uniform(MAX_DIVISIONS * 2), None);
    }

    #[test]
    fn divisions_up_to_a_size() {
        let four = RoundupDivisions::uniform(4).unwrap();
        // 4 divisions apply above 2 KiB.
        assert!(!four.divides_up_to(512, 2048) && four.divides_up_to(512, 2049));
        assert!(!RoundupDivisions::OFF.divides_up_to(512, u64::MAX));
        assert!(!RoundupDivisions::uniform(1).unwrap().divides_up_to(512, u64::MAX));
        // Below the last interval asked: [1:4,2:1] divides sizes under 2 MiB only.
        let low = RoundupDivisions::parse("[1:4,2:1]").unwrap();
        assert!(low.divides_up_to(512, 2 * MIB) && low.divides_up_to(512, MIB));
        assert!(!RoundupDivisions::parse("[>:4]").unwrap().divides_up_to(512, 2 * MIB - 1));
        assert!(RoundupDivisions::parse("[>:4]").unwrap().divides_up_to(512, 2 * MIB + 1));
        // 4096 divisions × 512 B reach 2 MiB: nothing below it is divided.
        let many = RoundupDivisions::parse("[1:4096,2:1]").unwrap();
        assert!(!many.divides_up_to(512, 2 * MIB));
    }

    #[test]
    fn display_round_trips() {
        for text in ["0", "4", "[64:8,128:2,>:1]", "[32:256,64:128,256:64,>:32]"] {
            let d = RoundupDivisions::parse(text).unwrap();
            assert_eq!(RoundupDivisions::parse(&d.to_string()).unwrap(), d, "{text}");
        }
        assert_eq!(RoundupDivisions::OFF.to_string(), "0");
        assert!(RoundupDivisions::OFF.is_off() && RoundupDivisions::uniform(1).unwrap().is_off());
        assert!(!RoundupDivisions::parse("[1024:2]").unwrap().is_off());
    }
}
