//! The report's charts as inline SVG: histograms, horizontal bars, step lines and a timeline. Each chart is a
//! fixed coordinate space (`viewBox`) that the page scales to its width; every drawn datum is an element of class
//! `mark` (the browser test counts them), and every text is escaped.

use std::fmt::Write;

/// Text for HTML (and SVG) content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}


/// Colours for series (attempts), in turn; chosen to stay apart for common colour blindness.
pub const PALETTE: [&str; 8] = ["#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5"];

const WIDTH: f64 = 640.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 42.0;

/// A value axis: linear or logarithmic, from `min` to `max`.
#[derive(Clone, Copy, Debug)]
struct Axis {
    min: f64,
    max: f64,
    log: bool,
}

impl Axis {
    fn new(min: f64, max: f64, log: bool) -> Axis {
        let (mut min, mut max) = if log { (min.max(1e-9), max.max(1e-9)) } else { (min, max) };
        if max.partial_cmp(&min) != Some(std::cmp::Ordering::Greater) {
            // One value: a range around it, so that it is drawn and labelled.
            if log {
                (min, max) = (min / 2.0, max * 2.0);
            } else if max == 0.0 {
                max = 1.0;
            } else if max > 0.0 {
                (min, max) = (0.0, max * 1.5);
            } else {
                (min, max) = (min * 1.5, 0.0);
            }
        }
        Axis { min, max, log }
    }

    /// Where `v` falls, from 0 (min) to 1 (max).
    fn frac(&self, v: f64) -> f64 {
        let f = if self.log {
            (v.max(self.min).log10() - self.min.log10()) / (self.max.log10() - self.min.log10())
        } else {
            (v - self.min) / (self.max - self.min)
        };
        if f.is_finite() { f.clamp(0.0, 1.0) } else { 0.0 }
    }

    /// Round values to label: 1, 2 or 5 times a power of ten, about `n` of them (decades on a log axis that spans
    /// more than one).
    fn ticks(&self, n: usize) -> Vec<f64> {
        if self.log && self.max / self.min >= 10.0 {
            let (lo, hi) = (self.min.log10().ceil() as i32, self.max.log10().floor() as i32);
            let every = ((hi - lo) as usize / n.max(1) + 1) as i32;
            let decades: Vec<f64> = (lo..=hi).filter(|e| (e - lo) % every == 0).map(|e| 10f64.powi(e)).collect();
            if decades.len() >= 3 {
                return decades;
            }
            // One or two decades: 2 and 5 times each power of ten too.
            let inside = |v: &f64| *v >= self.min * (1.0 - 1e-9) && *v <= self.max * (1.0 + 1e-9);
            return (lo - 1..=hi).flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e))).filter(inside).collect();
        }
        let raw = (self.max - self.min) / n.max(1) as f64;
        let power = 10f64.powf(raw.log10().floor());
        // The multiple nearest the raw step (in log terms): about `n` ticks, never far more or fewer.
        let error = raw / power;
        let step = power * if error >= 50f64.sqrt() { 10.0 } else if error >= 10f64.sqrt() { 5.0 } else if error >= 2f64.sqrt() { 2.0 } else { 1.0 };
        let mut ticks = Vec::new();
        let mut t = (self.min / step).ceil() * step;
        while t <= self.max + step * 1e-9 && ticks.len() < 4 * n + 2 {
            ticks.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
            t += step;
        }
        ticks
    }
}

/// The plot area of a chart `height` high.
struct Plot {
    height: f64,
    x: Axis,
    y: Axis,
    /// The y axis counts (rows): only whole numbers are labelled.
    whole_y: bool,
}

impl Plot {
    fn px(&self, x: f64) -> f64 {
        LEFT + self.x.frac(x) * (WIDTH - LEFT - RIGHT)
    }

    fn py(&self, y: f64) -> f64 {
        self.height - BOTTOM - self.y.frac(y) * (self.height - BOTTOM - TOP)
    }

    /// The frame: grid lines and labels on both axes, and the axes' titles.
    fn axes(&self, out: &mut String, x_fmt: &dyn Fn(f64) -> String, y_fmt: &dyn Fn(f64) -> String, x_title: &str, y_title: &str) {
        let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, self.height - BOTTOM);
        for t in self.y.ticks(4).into_iter().filter(|t| !self.whole_y || t.fract() == 0.0) {
            let y = self.py(t);
            let _ = write!(out, r##"<line class="grid" x1="{x0:.1}" x2="{x1:.1}" y1="{y:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##, x0 - 6.0, y + 4.0, escape(&y_fmt(t)));
        }
        let mut last_label = String::new();
        for t in self.x.ticks(6) {
            // A label equal to the one before (a range narrower than the labels' precision) is left out.
            if x_fmt(t) == last_label {
                continue;
            }
            last_label = x_fmt(t);
            let x = self.px(t);
            let _ = write!(out, r##"<line class="tick-line" x1="{x:.1}" x2="{x:.1}" y1="{y1:.1}" y2="{:.1}"/><text class="tick" x="{x:.1}" y="{:.1}" text-anchor="{}">{}</text>"##, y1 + 4.0, y1 + 16.0, anchor(x), escape(&x_fmt(t)));
        }
        let _ = write!(out, r##"<line class="axis" x1="{x0:.1}" x2="{x1:.1}" y1="{y1:.1}" y2="{y1:.1}"/><line class="axis" x1="{x0:.1}" x2="{x0:.1}" y1="{y0:.1}" y2="{y1:.1}"/>"##);
        let _ = write!(out, r##"<text class="axis-title" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##, (x0 + x1) / 2.0, self.height - 6.0, escape(x_title));
        let _ = write!(out, r##"<text class="axis-title" x="12" y="{:.1}" text-anchor="middle" transform="rotate(-90 12 {:.1})">{}</text>"##, (y0 + y1) / 2.0, (y0 + y1) / 2.0, escape(y_title));
    }
}

/// How an x-axis label at `x` is anchored: centred under its tick, or inward at the chart's edges, where a centred
/// label would be cut off.
fn anchor(x: f64) -> &'static str {
    if x > WIDTH - RIGHT - 24.0 {
        "end"
    } else if x < 24.0 {
        "start"
    } else {
        "middle"
    }
}

fn open(height: f64, label: &str) -> String {
    format!(r##"<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{}" preserveAspectRatio="xMidYMid meet">"##, escape(label))
}

/// A histogram of (low, high, count) bins, with vertical markers (a percentile's label and value).
pub fn histogram(bins: &[(f64, f64, u64)], log_x: bool, x_fmt: &dyn Fn(f64) -> String, x_title: &str, markers: &[(&str, f64)]) -> String {
    let height = 220.0;
    let mut out = open(height, x_title);
    let (lo, hi) = (bins.first().map_or(0.0, |b| b.0), bins.last().map_or(1.0, |b| b.1));
    let most = bins.iter().map(|b| b.2).max().unwrap_or(0) as f64;
    let plot = Plot { height, x: Axis::new(lo, hi, log_x), y: Axis::new(0.0, most.max(1.0), false), whole_y: true };
    plot.axes(&mut out, x_fmt, &|v| count(v), x_title, "rows");
    for &(low, high, n) in bins.iter().filter(|b| b.2 > 0) {
        let (x0, x1) = (plot.px(low), plot.px(high));
        let (y0, y1) = (plot.py(n as f64), plot.py(0.0));
        let _ = write!(
            out,
            r##"<rect class="mark bar" x="{:.1}" y="{y0:.1}" width="{:.1}" height="{:.1}"><title>{} to {}: {n} rows</title></rect>"##,
            x0 + 0.5,
            (x1 - x0 - 1.0).max(1.0),
            (y1 - y0).max(1.0),
            escape(&x_fmt(low)),
            escape(&x_fmt(high)),
        );
    }
    for (i, (label, value)) in markers.iter().enumerate() {
        let x = plot.px(*value);
        // Labels near the right edge go to the line's left, so that they stay inside the chart.
        let (label_x, anchor) = if x > WIDTH - RIGHT - 90.0 { (x - 3.0, "end") } else { (x + 3.0, "start") };
        let _ = write!(
            out,
            r##"<line class="marker" x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}"/><text class="marker-label" x="{label_x:.1}" y="{:.1}" text-anchor="{anchor}">{} {}</text>"##,
            TOP,
            height - BOTTOM,
            TOP + 10.0 + 12.0 * i as f64,
            escape(label),
            escape(&x_fmt(*value)),
        );
    }
    out.push_str("</svg>");
    out
}

/// Horizontal bars, one per (label, value, colour), longest scale first; the value is written beside each bar.
pub fn bars(items: &[(String, u64, &str)]) -> String {
    let row = 26.0;
    let height = TOP + row * items.len().max(1) as f64 + 8.0;
    let label_w = 170.0;
    let most = items.iter().map(|i| i.1).max().unwrap_or(0).max(1) as f64;
    let total: u64 = items.iter().map(|i| i.1).sum();
    let mut out = open(height, "bars");
    for (i, (label, value, colour)) in items.iter().enumerate() {
        let y = TOP + row * i as f64;
        let w = (WIDTH - label_w - 110.0) * (*value as f64 / most);
        let share = if total > 0 { 100.0 * *value as f64 / total as f64 } else { 0.0 };
        let _ = write!(
            out,
            r##"<text class="bar-label" x="{:.1}" y="{:.1}" text-anchor="end">{}</text><rect class="mark" x="{label_w:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{colour}"><title>{}: {value}</title></rect><text class="bar-value" x="{:.1}" y="{:.1}">{} ({share:.1} %)</text>"##,
            label_w - 8.0,
            y + row / 2.0 + 4.0,
            escape(label),
            y + 4.0,
            w.max(1.5),
            row - 8.0,
            escape(label),
            label_w + w.max(1.5) + 6.0,
            y + row / 2.0 + 4.0,
            count(*value as f64),
        );
    }
    out.push_str("</svg>");
    out
}

/// A series of constant values over intervals: (from, to, value).
pub struct Steps {
    pub label: String,
    pub colour: &'static str,
    pub steps: Vec<(f64, f64, f64)>,
}

/// Step lines, one per series, on shared axes, with a legend under the chart.
pub fn step_lines(series: &[Steps], x_fmt: &dyn Fn(f64) -> String, y_fmt: &dyn Fn(f64) -> String, x_title: &str, y_title: &str) -> String {
    let legend_rows = series.len().div_ceil(3) as f64;
    let height = 240.0 + 8.0 + 20.0 * legend_rows;
    let plot_height = 240.0;
    let mut out = open(height, y_title);
    let all = series.iter().flat_map(|s| s.steps.iter());
    let (mut lo, mut hi, mut top) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for &(a, b, v) in all {
        lo = lo.min(a);
        hi = hi.max(b);
        top = top.max(v);
    }
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    let plot = Plot { height: plot_height, x: Axis::new(lo, hi, false), y: Axis::new(0.0, top * 1.1, false), whole_y: false };
    plot.axes(&mut out, x_fmt, y_fmt, x_title, y_title);
    for s in series {
        // One connected line where steps meet (a vertical rise or fall between them), a new one after a gap.
        let mut d = String::new();
        let mut end: Option<f64> = None;
        for &(a, b, v) in &s.steps {
            match end {
                Some(e) if (e - a).abs() < 1e-9 => _ = write!(d, "V{:.1}H{:.1}", plot.py(v), plot.px(b)),
                _ => _ = write!(d, "M{:.1} {:.1}H{:.1}", plot.px(a), plot.py(v), plot.px(b)),
            }
            end = Some(b);
        }
        let _ = write!(out, r##"<path class="mark line" d="{d}" stroke="{}"><title>{}</title></path>"##, s.colour, escape(&s.label));
    }
    for (i, s) in series.iter().enumerate() {
        let (x, y) = (LEFT + 190.0 * (i % 3) as f64, plot_height + 4.0 + 20.0 * (i / 3) as f64);
        let _ = write!(
            out,
            r##"<rect x="{x:.1}" y="{:.1}" width="14" height="4" fill="{}"/><text class="legend" x="{:.1}" y="{:.1}">{}</text>"##,
            y + 4.0,
            s.colour,
            x + 20.0,
            y + 10.0,
            escape(&s.label)
        );
    }
    out.push_str("</svg>");
    out
}

/// One lane of a timeline: spans (from, to, class) and tick marks (commits).
pub struct Lane {
    pub label: String,
    pub colour: &'static str,
    /// (from, to, whether the span is start-up: drawn lighter).
    pub spans: Vec<(f64, f64, bool)>,
    pub ticks: Vec<f64>,
}

/// Lanes over a shared time axis: when each attempt ran, its start-up, and each of its commits.
pub fn timeline(lanes: &[Lane], x_fmt: &dyn Fn(f64) -> String, x_title: &str) -> String {
    let lane_h = 24.0;
    let height = TOP + lane_h * lanes.len().max(1) as f64 + BOTTOM;
    let label_w = 150.0;
    let mut out = open(height, x_title);
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for lane in lanes {
        for &(a, b, _) in &lane.spans {
            lo = lo.min(a);
            hi = hi.max(b);
        }
    }
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    let x = Axis::new(lo, hi, false);
    let px = |v: f64| label_w + x.frac(v) * (WIDTH - label_w - RIGHT);
    let bottom = height - BOTTOM;
    for t in x.ticks(6) {
        let _ = write!(
            out,
            r##"<line class="grid" x1="{0:.1}" x2="{0:.1}" y1="{TOP:.1}" y2="{bottom:.1}"/><text class="tick" x="{0:.1}" y="{1:.1}" text-anchor="{2}">{3}</text>"##,
            px(t),
            bottom + 16.0,
            anchor(px(t)),
            escape(&x_fmt(t))
        );
    }
    let _ = write!(out, r##"<text class="axis-title" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##, (label_w + WIDTH - RIGHT) / 2.0, height - 6.0, escape(x_title));
    for (i, lane) in lanes.iter().enumerate() {
        let y = TOP + lane_h * i as f64;
        let _ = write!(out, r##"<text class="bar-label" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##, label_w - 8.0, y + lane_h / 2.0 + 4.0, escape(&lane.label));
        for &(a, b, startup) in &lane.spans {
            let _ = write!(
                out,
                r##"<rect class="mark{}" x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {} to {}{}</title></rect>"##,
                if startup { " startup" } else { "" },
                px(a),
                y + 4.0,
                (px(b) - px(a)).max(1.5),
                lane_h - 8.0,
                lane.colour,
                escape(&lane.label),
                escape(&x_fmt(a)),
                escape(&x_fmt(b)),
                if startup { " (start-up and model load)" } else { "" },
            );
        }
        for &t in &lane.ticks {
            let _ = write!(out, r##"<line class="commit" x1="{0:.1}" x2="{0:.1}" y1="{1:.1}" y2="{2:.1}"/>"##, px(t), y + 2.0, y + lane_h - 2.0);
        }
    }
    out.push_str("</svg>");
    out
}

/// A count for an axis or a label: 950, 1.2k, 3.4M.
pub fn count(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.1}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a == a.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// A duration to three significant digits: 850 µs, 12.3 ms, 3.42 s, 5.0 min, 2.1 h.
pub fn seconds(v: f64) -> String {
    let three = |x: f64, unit: &str| match x.abs() {
        a if a < 9.995 => format!("{x:.2} {unit}"),
        a if a < 99.95 => format!("{x:.1} {unit}"),
        _ => format!("{x:.0} {unit}"),
    };
    let a = v.abs();
    if a == 0.0 {
        "0 s".into()
    } else if a < 1e-3 {
        three(v * 1e6, "µs")
    } else if a < 1.0 {
        three(v * 1e3, "ms")
    } else if a < 100.0 {
        three(v, "s")
    } else if a < 6000.0 {
        format!("{:.1} min", v / 60.0)
    } else {
        format!("{:.1} h", v / 3600.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_inside_the_axis() {
        let ticks = Axis::new(0.0, 97.0, false).ticks(4);
        assert_eq!(ticks, vec![0.0, 20.0, 40.0, 60.0, 80.0]);
        assert_eq!(Axis::new(0.003, 40.0, true).ticks(6), vec![0.01, 0.1, 1.0, 10.0]);
        assert_eq!(Axis::new(0.1, 1.3, true).ticks(6), vec![0.1, 0.2, 0.5, 1.0]);
        let narrow = Axis::new(0.2, 0.5, true).ticks(4);
        assert!(!narrow.is_empty() && narrow.iter().all(|t| (0.2..=0.5).contains(t)), "{narrow:?}");
        // A single value still gets an axis with a range and labels.
        for axis in [Axis::new(5.0, 5.0, false), Axis::new(0.0, 0.0, false), Axis::new(0.3, 0.3, true)] {
            assert!(axis.max > axis.min && !axis.ticks(4).is_empty(), "{axis:?}");
        }
    }

    #[test]
    fn charts_escape_labels_and_draw_a_mark_per_datum() {
        let svg = bars(&[("<b>&".to_string(), 3, PALETTE[0]), ("ok".to_string(), 0, PALETTE[1])]);
        assert!(svg.contains("&lt;b&gt;&amp;") && !svg.contains("<b>"), "{svg}");
        assert_eq!(svg.matches(r#"class="mark""#).count(), 2);
        let svg = histogram(&[(1.0, 2.0, 4), (2.0, 3.0, 0), (3.0, 4.0, 1)], false, &count, "tokens", &[("p50", 1.5)]);
        assert_eq!(svg.matches("class=\"mark bar\"").count(), 2, "an empty bin draws nothing");
        for svg in [svg, timeline(&[], &seconds, "t"), step_lines(&[], &seconds, &count, "t", "v"), histogram(&[], true, &seconds, "s", &[])] {
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        }
    }

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!([count(950.0), count(1234.0), count(56_789.0), count(3_400_000.0), count(0.5)], ["950", "1.2k", "57k", "3.4M", "0.5"]);
        assert_eq!(
            [seconds(0.0), seconds(0.0004), seconds(0.012), seconds(0.02425), seconds(3.42), seconds(42.0), seconds(300.0), seconds(7560.0)],
            ["0 s", "400 µs", "12.0 ms", "24.2 ms", "3.42 s", "42.0 s", "5.0 min", "2.1 h"]
        );
    }
}
