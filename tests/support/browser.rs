//! Debian's Chromium, headless, rendering a page the tests made: what the laid-out page shows (read by a probe
//! script the test adds to a copy of the page, printed with `--dump-dom`) and a screenshot kept for people to look
//! at. `scripts/test.sh` installs the `chromium` package.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Measures the laid-out page at 1280x900 CSS pixels and appends the result as JSON in `<pre id="probe">`.
const PROBE: &str = r#"
(() => {
  const box = (e) => { const r = e.getBoundingClientRect(); return { x: r.x, y: r.y + scrollY, w: r.width, h: r.height }; };
  const visible = (e) => { const b = e.getBoundingClientRect(); const s = getComputedStyle(e); return b.width > 0 && b.height > 0 && s.visibility !== 'hidden' && s.display !== 'none'; };
  const out = { viewport: { w: innerWidth, h: innerHeight }, scrollWidth: document.documentElement.scrollWidth,
    height: document.documentElement.scrollHeight, title: document.title,
    state: (document.querySelector('[data-state]') || {dataset: {}}).dataset.state || null,
    cards: {}, charts: {}, sections: {}, tables: {}, text: document.body.innerText,
    external: document.querySelectorAll('[src], [href], link, script:not(#probe-script)').length };
  for (const c of document.querySelectorAll('[data-card]')) {
    out.cards[c.dataset.card] = { value: c.querySelector('.value').innerText, box: box(c), visible: visible(c) };
  }
  for (const f of document.querySelectorAll('figure[data-chart]')) {
    const svg = f.querySelector('svg'); const s = svg.getBoundingClientRect();
    // A drawn datum: a rect with an area, or a line (a path: a flat one has no height, its stroke is what shows).
    const marks = [...f.querySelectorAll('.mark')].filter((m) => { const b = m.getBoundingClientRect();
      return m.tagName === 'path' ? b.width > 0 || b.height > 0 : visible(m); });
    // Every label drawn inside its chart: none cut off at an edge.
    const clipped = [...svg.querySelectorAll('text')].filter((t) => { const b = t.getBoundingClientRect();
      return b.left < s.left - 1 || b.right > s.right + 1 || b.top < s.top - 1 || b.bottom > s.bottom + 1; }).map((t) => t.textContent);
    out.charts[f.dataset.chart] = { box: box(svg), marks: marks.length, caption: f.querySelector('figcaption').innerText, clipped };
  }
  for (const s of document.querySelectorAll('section[id]')) {
    out.sections[s.id] = { box: box(s), heading: visible(s.querySelector('h2')), text: s.innerText };
  }
  for (const t of document.querySelectorAll('table[id]')) { out.tables[t.id] = t.rows.length; }
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
})();
"#;

fn chromium() -> PathBuf {
    let found = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].into_iter().map(PathBuf::from).find(|p| p.exists());
    found.expect("Debian's chromium is needed to render reports (scripts/test.sh installs it: apt-get install chromium)")
}

fn chromium_command(dir: &Path) -> Command {
    let mut cmd = Command::new(chromium());
    // The flags this machine needs: no sandbox as root, no GPU, and none of Chromium's background network calls.
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ]);
    cmd.arg(format!("--user-data-dir={}", dir.join("chromium-profile").display()));
    cmd
}

/// What Chromium laid out (the screenshot's path is printed).
pub struct Rendered {
    pub probe: serde_json::Value,
}

impl Rendered {
    pub fn chart(&self, name: &str) -> &serde_json::Value {
        let chart = &self.probe["charts"][name];
        assert!(chart.is_object(), "the page has no `{name}` chart: {}", self.probe["charts"]);
        chart
    }

    pub fn marks(&self, name: &str) -> u64 {
        self.chart(name)["marks"].as_u64().unwrap()
    }

    pub fn text(&self) -> &str {
        self.probe["text"].as_str().unwrap()
    }

    pub fn section(&self, id: &str) -> &str {
        self.probe["sections"][id]["text"].as_str().unwrap_or_else(|| panic!("no section `{id}`"))
    }

    pub fn card(&self, name: &str) -> &str {
        self.probe["cards"][name]["value"].as_str().unwrap_or_else(|| panic!("no card `{name}`"))
    }

    /// What every report must be, whatever its output: one column of readable width, every section with its
    /// heading, the summary cards in the first screen, every chart drawn with no label cut off, nothing fetched.
    pub fn assert_well_formed(&self) {
        let p = &self.probe;
        assert_eq!(p["external"], 0, "the report loads nothing and runs nothing");
        assert!(p["scrollWidth"].as_f64().unwrap() <= p["viewport"]["w"].as_f64().unwrap(), "no horizontal scrolling: {}", p["scrollWidth"]);
        for id in ["outcome", "throughput", "lengths", "latency", "memory", "slowest", "job"] {
            assert!(p["sections"][id]["heading"].as_bool().unwrap_or(false), "section {id} is shown with its heading");
        }
        let fold = p["viewport"]["h"].as_f64().unwrap();
        for (name, card) in p["cards"].as_object().unwrap() {
            let b = &card["box"];
            assert!(card["visible"].as_bool().unwrap() && b["y"].as_f64().unwrap() + b["h"].as_f64().unwrap() <= fold, "card {name} is in the first screen: {b}");
        }
        for (name, chart) in p["charts"].as_object().unwrap() {
            let b = &chart["box"];
            assert!(b["w"].as_f64().unwrap() >= 300.0 && b["h"].as_f64().unwrap() >= 30.0, "chart {name} is drawn at a readable size: {b}");
            assert!(chart["clipped"].as_array().unwrap().is_empty(), "chart {name} cuts off labels: {}", chart["clipped"]);
        }
    }
}

fn unescape(text: &str) -> String {
    text.replace("&quot;", "\"").replace("&lt;", "<").replace("&gt;", ">").replace("&#39;", "'").replace("&amp;", "&")
}

/// Renders `html` (a report page) in headless Chromium at 1280 pixels wide: measures it through a copy with the
/// probe added, and screenshots the page itself, whole, into `CARGO_TARGET_TMPDIR/report-screenshots/NAME.png`.
pub fn render(html: &str, name: &str) -> Rendered {
    let dir = super::scratch(&format!("browser-{name}"));
    let page = dir.join("report.html");
    std::fs::write(&page, html).unwrap();
    let probed = html.replacen("</body>", &format!(r#"<script id="probe-script">{PROBE}</script></body>"#), 1);
    assert_ne!(probed, html, "the page has a </body>");
    let probe_page = dir.join("probe.html");
    std::fs::write(&probe_page, probed).unwrap();
    let out = chromium_command(&dir).arg("--window-size=1280,900").arg("--dump-dom").arg(format!("file://{}", probe_page.display())).output().unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    let json = dom
        .split_once(r#"<pre id="probe">"#)
        .and_then(|(_, rest)| rest.split_once("</pre>"))
        .map(|(json, _)| unescape(json))
        .unwrap_or_else(|| panic!("chromium printed no probe (exit {:?}): {}", out.status, String::from_utf8_lossy(&out.stderr)));
    let probe: serde_json::Value = serde_json::from_str(&json).unwrap();
    let height = probe["height"].as_f64().unwrap().ceil() as u64;
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let screenshot = shots.join(format!("{name}.png"));
    let _ = std::fs::remove_file(&screenshot);
    let out = chromium_command(&dir)
        .arg(format!("--window-size=1280,{}", height.clamp(900, 16_000)))
        .arg(format!("--screenshot={}", screenshot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    let png = std::fs::read(&screenshot).unwrap_or_else(|_| panic!("no screenshot: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "a screenshot of a whole page");
    eprintln!("report screenshot: {}", screenshot.display());
    Rendered { probe }
}
