//! The memory timeline as an SVG (plotters' SVG backend, which writes text as SVG `<text>`,
//! so no font files are needed): x = event index, y = bytes in MiB or GiB; one line for
//! live requested bytes, one per policy for reserved bytes and, for a PyTorch snapshot, one
//! for what PyTorch's allocator reserved (`pytorch (recorded)`).
//!
//! Long timelines are downsampled to at most [`MAX_POINTS`] points by splitting the x range
//! into equal buckets and keeping each bucket's maximum (at the bucket's first index), so
//! peaks survive downsampling. Each line then ends with its last value at the axis's end.

use std::path::Path;

use plotters::prelude::*;

use super::report::Report;

/// Most points a line's timeline is downsampled to (the line draws one more, its end).
pub const MAX_POINTS: usize = 2000;
/// Image size in pixels.
const SIZE: (u32, u32) = (1200, 700);

/// Downsamples `values` to at most `max_points` `(index, value)` pairs, keeping the maximum
/// of each bucket.
pub fn downsample(values: &[u64], max_points: usize) -> Vec<(usize, u64)> {
    let max_points = max_points.max(1);
    if values.len() <= max_points {
        return values.iter().copied().enumerate().collect();
    }
    let bucket = values.len().div_ceil(max_points);
    values
        .chunks(bucket)
        .enumerate()
        .map(|(b, chunk)| (b * bucket, chunk.iter().copied().max().unwrap_or(0)))
        .collect()
}

/// The points of one line: the value after each event at the event's index (downsampled),
/// then the last value again at the x axis's end (`values.len()`), where it still holds: a
/// single point draws nothing, so a trace of one event had no line at all.
pub fn line_points(values: &[u64]) -> Vec<(usize, u64)> {
    let mut points = downsample(values, MAX_POINTS);
    // BROKEN (`plot_last_point_only`): each line ends at the last event's index.
    if let Some(&last) = values.last()
        && !cfg!(tidepool_broken = "plot_last_point_only")
    {
        points.push((values.len(), last));
    }
    points
}

/// Draws `report`'s timelines into an SVG file at `path`.
///
/// The drawing is made in memory and written to a new file beside `path` (the target of
/// `path` where it is a link), which then replaces it: a write that fails (a full disk, a
/// file-size limit) leaves what `path` held before, and no partial file.
pub fn write_svg(report: &Report, path: &Path) -> Result<(), String> {
    let mut svg = String::new();
    draw(report, path, &mut svg)?;
    let cannot = |e: std::io::Error| format!("cannot write {}: {e}", crate::echo_path(path));
    // BROKEN (`svg_written_in_place`): written over `path` itself; a failed write leaves a
    // partial file.
    if cfg!(tidepool_broken = "svg_written_in_place") {
        return std::fs::write(path, svg).map_err(cannot);
    }
    // A link is written through, as `fs::write` would: its target is replaced, not the link.
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temp = target.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::write(&temp, svg).and_then(|()| std::fs::rename(&temp, &target));
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written.map_err(cannot)
}

/// Draws `report`'s timelines as SVG text into `svg` (`path` names the file in errors).
fn draw(report: &Report, path: &Path, svg: &mut String) -> Result<(), String> {
    let mut lines: Vec<(String, Vec<(usize, u64)>)> =
        vec![("live (requested)".to_string(), line_points(&report.live_timeline))];
    for p in &report.policies {
        if let Some(tl) = &p.reserved_timeline {
            lines.push((format!("reserved: {}", p.name), line_points(tl)));
        }
    }
    if let Some(s) = &report.snapshot {
        lines.push((
            format!("reserved: {}", super::report::RECORDED_ROW),
            line_points(&s.reserved.timeline),
        ));
    }
    let max_y = lines.iter().flat_map(|(_, pts)| pts.iter().map(|&(_, v)| v)).max().unwrap_or(0);
    let (unit, scale) = axis_unit(max_y);
    let x_end = report.events.max(1) as f64;
    let y_end = (max_y as f64 / scale * 1.05).max(1e-9);

    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", crate::echo_path(path));
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            match report.device() {
                Some(d) => format!("memory timeline: {}, device {d}", report.display_name()),
                None => format!("memory timeline: {}", report.display_name()),
            },
            ("sans-serif", 24),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..x_end, 0f64..y_end)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .x_desc("event index")
        .y_desc(format!("bytes ({unit})"))
        .x_label_formatter(&x_label)
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (label, pts)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let style = ShapeStyle { color, filled: false, stroke_width: if i == 0 { 2 } else { 1 } };
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|&(x, y)| (x as f64, y as f64 / scale)),
                style,
            ))
            .map_err(|e| err(&e))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The x axis's label of the tick at `x`: event indices are whole, and plotters ticks a short
/// trace's axis in fractions (every half event for 5 events), which `{x:.0}` labelled `2` at
/// both 1.5 and 2.5: a fractional tick is left unlabelled.
fn x_label(x: &f64) -> String {
    // BROKEN (`plot_fraction_labels`): every tick labelled, rounded.
    // (A tick's value is a sum of steps: 1 may come as 1.0000000000000002.)
    if (x - x.round()).abs() < 1e-6 || cfg!(tidepool_broken = "plot_fraction_labels") {
        format!("{x:.0}")
    } else {
        String::new()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsample_keeps_bucket_maxima() {
        let v: Vec<u64> = (0..10).map(|i| if i == 7 { 100 } else { i }).collect();
        assert_eq!(downsample(&v, 20).len(), 10);
        let d = downsample(&v, 3); // buckets of 4: [0..4) [4..8) [8..10)
        assert_eq!(d, vec![(0, 3), (4, 100), (8, 9)]);
        assert!(downsample(&vec![1; 100_000], MAX_POINTS).len() <= MAX_POINTS);
    }
}
