//! Human-readable byte counts with binary units: `512 B`, `1.50 KiB`, `3.64 GiB`.

/// Binary unit names, each 1024 × the previous.
const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// Formats `bytes` with the largest binary unit that keeps the number ≥ 1, to 2 decimals.
pub fn format_bytes(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// A unit (name, bytes per unit) suited to axis labels up to `max` bytes: MiB below 1 GiB,
/// else GiB (KiB / B for tiny traces).
pub fn axis_unit(max: u64) -> (&'static str, f64) {
    match max {
        m if m >= 1 << 30 => ("GiB", (1u64 << 30) as f64),
        m if m >= 1 << 20 => ("MiB", (1u64 << 20) as f64),
        m if m >= 1 << 10 => ("KiB", 1024.0),
        _ => ("B", 1.0),
    }
}

/// Parses a byte count: a whole number with an optional unit, binary (`KiB`, `MiB`, `GiB`,
/// `TiB`, or `K`, `M`, `G`, `T`) or `B`; no unit means bytes. `512MiB`, `4 GiB`, `1073741824`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || format!("`{text}` is not a byte count (e.g. 4GiB, 512MiB, 1048576)");
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("`{text}` is more than 2^64 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(3 << 20), "3.00 MiB");
        assert_eq!(format_bytes(3911787528), "3.64 GiB");
        assert_eq!(format_bytes(u64::MAX), "16.00 EiB");
        assert_eq!(axis_unit(5 << 30).0, "GiB");
        assert_eq!(axis_unit(5 << 20).0, "MiB");
    }

    #[test]
    fn parses() {
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2k"), Ok(2048));
        assert_eq!(parse_bytes("7B"), Ok(7));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("1.5GiB").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("99999999999T").unwrap_err().contains("more than 2^64"));
    }
}
