//! A run's progress for Prometheus, as batch jobs report it: a node_exporter textfile-collector file
//! (`--metrics-textfile`, replaced atomically) and a Pushgateway group (`--pushgateway`), both updated when a unit
//! commits and when the run ends.
//!
//! Names follow Prometheus' conventions: a `nightshift_` prefix, base units in the name (`_seconds`), `_total` on
//! counters. Every series carries `job` (the job file's name without `.toml`) and `shard` labels; the Pushgateway
//! groups by `job` and `instance` (the shard), so that the shards of one job push side by side.
//! `nightshift_last_success_timestamp_seconds` is written by a run that completes its work, and kept by one that
//! does not (read back from the textfile; the Pushgateway keeps it, as a push replaces only the series it names),
//! so that an alert on the time since the last success works across failed nights.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::warn;

use super::Collector;

/// Where a run's Prometheus metrics go.
#[derive(Clone, Debug, Default)]
pub struct Targets {
    pub textfile: Option<PathBuf>,
    pub pushgateway: Option<String>,
}

impl Targets {
    pub fn any(&self) -> bool {
        self.textfile.is_some() || self.pushgateway.is_some()
    }

    /// The Pushgateway's address is an `http://` or `https://` URL with a host: anything else (no scheme,
    /// `file://`) is a bad command line before the run, not a push that fails at every unit. The message names the
    /// scheme, never the URL (which may carry credentials).
    pub fn check(&self) -> Result<(), String> {
        let Some(text) = &self.pushgateway else { return Ok(()) };
        match url::Url::parse(text) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some_and(|h| !h.is_empty()) => Ok(()),
            Ok(u) if matches!(u.scheme(), "http" | "https") => Err("--pushgateway: the URL has no host (`http://host:9091`)".into()),
            Ok(u) => Err(format!("--pushgateway must be an http:// or https:// URL (`http://host:9091`), not one with the scheme `{}`", u.scheme())),
            Err(e) => Err(format!("--pushgateway must be an http:// or https:// URL (`http://host:9091`): {e}")),
        }
    }
}

#[derive(Clone, Debug, Default)]
struct State {
    succeeded: u64,
    errored: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    units_committed: usize,
    units: usize,
    running: bool,
    exit_code: Option<i32>,
    last_success: Option<f64>,
}

/// Publishes a run's progress to its [`Targets`].
pub struct Exporter {
    targets: Targets,
    job: String,
    shard: String,
    started: Instant,
    state: Mutex<State>,
    client: Option<reqwest::Client>,
}

/// The value of `nightshift_last_success_timestamp_seconds` for this job and shard (its labels exactly: a line of
/// another job or shard in the same file is not ours) in a textfile written before, if any. Only a regular file
/// is read back: a FIFO or device named as the textfile holds nothing of ours (and reading a FIFO would wait).
fn previous_success(path: &Path, job: &str, shard: &str) -> Option<f64> {
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let ours = format!("nightshift_last_success_timestamp_seconds{{{}}} ", labels(job, shard));
    text.lines().find_map(|l| l.strip_prefix(&ours)?.trim().parse().ok())
}

/// The labels of every series of a run: its job and shard.
fn labels(job: &str, shard: &str) -> String {
    format!("job=\"{}\",shard=\"{}\"", quoted(job), quoted(shard))
}

/// The textfile `before` with the series of this run (`ours`, of `job` and `shard`) in place of its own earlier
/// ones. Kept: series of other jobs, of this job's other shards of the same layout (`1-of-4` beside `0-of-4`: the
/// data-parallel workers and shards of one run), and lines not in our label form. Dropped: this job's series of
/// another layout (`all`, or `0-of-2` once it runs as `0-of-4`), stale since it runs another way. Each metric's
/// series stay together under one `HELP` and `TYPE`, as the format requires.
fn merged(before: &str, ours: &str, job: &str, shard: &str) -> String {
    let (job, shard) = (quoted(job), quoted(shard));
    let layout = |s: &str| s.split_once("-of-").map(|(_, n)| n.to_string());
    let keep = |line: &str| match owner(line) {
        Some((j, s)) if j == job => s != shard && layout(&s).is_some() && layout(&s) == layout(&shard),
        _ => true,
    };
    // Metric name -> (HELP and TYPE lines, series), in the order first seen: ours, then the others.
    let mut metrics: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
    let mut add = |text: &str, filter: &dyn Fn(&str) -> bool| {
        for line in text.lines() {
            let (name, meta) = match line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
                Some(rest) => (rest.split(' ').next().unwrap_or_default(), true),
                None if line.starts_with('#') || line.trim().is_empty() => continue,
                None => (line.split(['{', ' ']).next().unwrap_or_default(), false),
            };
            if !meta && !filter(line) {
                continue;
            }
            let at = match metrics.iter().position(|(n, _, _)| n == name) {
                Some(at) => at,
                None => {
                    metrics.push((name.to_string(), Vec::new(), Vec::new()));
                    metrics.len() - 1
                }
            };
            let (_, head, series) = &mut metrics[at];
            if !meta {
                series.push(line.to_string());
            } else if head.iter().all(|h| h[..6] != line[..6]) {
                head.push(line.to_string());
            }
        }
    };
    add(ours, &|_| true);
    add(before, &keep);
    let mut out = String::new();
    for (_, head, series) in metrics.iter().filter(|(_, _, series)| !series.is_empty()) {
        for line in head.iter().chain(series) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The job and shard labels (as quoted in the text) of a series line in our form (`name{job="..",shard="..",...}`).
fn owner(line: &str) -> Option<(String, String)> {
    let rest = line.split_once('{')?.1;
    let (job, rest) = label_value(rest.strip_prefix("job=\"")?)?;
    let (shard, _) = label_value(rest.strip_prefix(",shard=\"")?)?;
    Some((job.to_string(), shard.to_string()))
}

/// A quoted label value's text up to its closing quote (escapes kept), and what follows the quote.
fn label_value(s: &str) -> Option<(&str, &str)> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some((&s[..i], &s[i + 1..])),
            _ => {}
        }
    }
    None
}

/// A label value as the text format quotes it.
fn quoted(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Exporter {
    /// An exporter for the job named `job`, run as `shard` (`all`, or `3-of-8`).
    pub fn new(targets: Targets, job: &str, shard: &str) -> Exporter {
        let last_success = targets.textfile.as_deref().and_then(|path| previous_success(path, job, shard));
        let client = targets.pushgateway.as_ref().and_then(|_| {
            crate::source::store::install_crypto_provider();
            reqwest::Client::builder().timeout(Duration::from_secs(10)).build().map_err(|e| warn!(error = %e, "cannot make a Pushgateway client")).ok()
        });
        Exporter {
            targets,
            job: job.to_string(),
            shard: shard.to_string(),
            started: Instant::now(),
            state: Mutex::new(State { running: true, last_success, ..State::default() }),
            client,
        }
    }

    /// The run's units, once planned: the first report (the run goes on, nothing done yet).
    pub fn planned(&self, rt: &tokio::runtime::Runtime, units: usize, committed_before: usize) {
        {
            let mut s = self.state.lock().expect("not poisoned");
            s.units = units;
            s.units_committed = committed_before;
        }
        let text = self.render();
        self.write_textfile(&text);
        if let Some(push) = self.push(text) {
            rt.spawn(push);
        }
    }

    /// The rows done so far and the units committed (before this run and by it); written out, and pushed in the
    /// background (a monitoring outage never holds up or fails the job).
    pub fn progress(&self, rows: &Collector, units_committed: usize) {
        {
            let mut s = self.state.lock().expect("not poisoned");
            (s.succeeded, s.errored, s.prompt_tokens, s.completion_tokens) = (rows.succeeded, rows.errored, rows.prompt_tokens, rows.completion_tokens);
            s.units_committed = units_committed;
        }
        let text = self.render();
        self.write_textfile(&text);
        if let Some(push) = self.push(text) {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(push);
            }
        }
    }

    /// The run ended with `exit_code` (0: its work is done); written out and pushed, waiting for the push.
    pub fn finish(&self, rt: &tokio::runtime::Runtime, exit_code: i32) {
        {
            let mut s = self.state.lock().expect("not poisoned");
            s.running = false;
            s.exit_code = Some(exit_code);
            if exit_code == 0 {
                s.last_success = Some(crate::host::unix_s());
            }
        }
        let text = self.render();
        self.write_textfile(&text);
        if let Some(push) = self.push(text) {
            rt.block_on(push);
        }
    }

    /// The metrics in Prometheus' text format.
    pub fn render(&self) -> String {
        let s = self.state.lock().expect("not poisoned").clone();
        let elapsed = self.started.elapsed().as_secs_f64();
        let labels = labels(&self.job, &self.shard);
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(Option<&str>, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (extra, value) in samples {
                let extra = extra.map(|e| format!(",{e}")).unwrap_or_default();
                let _ = writeln!(out, "{name}{{{labels}{extra}}} {value}");
            }
        };
        metric("nightshift_rows_total", "counter", "Rows this run finished, by status.", &[
            (Some("status=\"succeeded\""), s.succeeded as f64),
            (Some("status=\"errored\""), s.errored as f64),
        ]);
        metric("nightshift_prompt_tokens_total", "counter", "Prompt tokens of the rows this run finished.", &[(None, s.prompt_tokens as f64)]);
        metric("nightshift_completion_tokens_total", "counter", "Tokens this run generated.", &[(None, s.completion_tokens as f64)]);
        let rate = if elapsed > 0.0 { s.completion_tokens as f64 / elapsed } else { 0.0 };
        metric("nightshift_output_tokens_per_second", "gauge", "Tokens generated per second of this run, model load included.", &[(None, rate)]);
        metric("nightshift_units_committed", "gauge", "Units of this run's shard committed in the output, by this run or before it.", &[(None, s.units_committed as f64)]);
        metric("nightshift_units", "gauge", "Units of this run's shard.", &[(None, s.units as f64)]);
        metric("nightshift_run_duration_seconds", "gauge", "Seconds since this run started.", &[(None, elapsed)]);
        metric("nightshift_running", "gauge", "1 while the run goes on, 0 once it ended.", &[(None, if s.running { 1.0 } else { 0.0 })]);
        if let Some(code) = s.exit_code {
            metric("nightshift_exit_code", "gauge", "How the run ended: 0 done, 75 partial and resumable, others failed (README, Exit codes).", &[(None, code as f64)]);
        }
        if let Some(t) = s.last_success {
            metric("nightshift_last_success_timestamp_seconds", "gauge", "When a run of this job last finished its work (Unix time).", &[(None, t)]);
        }
        out
    }

    /// Replaces this run's series in the textfile, keeping those of other jobs and of this job's other shards
    /// ([`merged`]: data-parallel workers and several jobs may share one file), under a lock beside it: written
    /// beside it under a name the collector ignores, then renamed over it. A device or FIFO the user named gets
    /// this run's series, in place, never replaced ([`crate::files::replace`]).
    fn write_textfile(&self, text: &str) {
        let Some(path) = &self.targets.textfile else { return };
        let pid = std::process::id();
        let written = (|| {
            if crate::files::target(path) == Ok(crate::files::Target::InPlace) {
                return crate::files::replace(path, text.as_bytes(), |_| unreachable!("written in place"), true);
            }
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path.with_file_name(format!(".{name}.lock")))?;
            lock.lock()?;
            let before = match std::fs::read(path) {
                Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(e),
            };
            let text = merged(&before, text, &self.job, &self.shard);
            crate::files::replace(path, text.as_bytes(), |name| format!(".{name}.{pid}.tmp"), true)
        })();
        if let Err(e) = written {
            warn!(path = %path.display(), error = %e, "cannot write the metrics textfile");
        }
    }

    /// The push of `text` to the Pushgateway group of this job and shard (POST: series not named keep their
    /// values), if one is configured.
    fn push(&self, text: String) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let (base, client) = (self.targets.pushgateway.as_ref()?, self.client.clone()?);
        let segment = |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20");
        let url = format!("{}/metrics/job/{}/instance/{}", base.trim_end_matches('/'), segment(&self.job), segment(&self.shard));
        Some(async move {
            let sent = client.post(&url).header("Content-Type", "text/plain; version=0.0.4").body(text).send().await;
            match sent.map(|r| r.error_for_status()) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) | Err(e) => warn!(url = %crate::redact::redact_urls(&url), error = %e, "cannot push metrics to the Pushgateway"),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pushgateway_is_an_http_url_with_a_host_and_the_refusal_never_shows_the_url() {
        let check = |url: &str| Targets { textfile: None, pushgateway: Some(url.into()) }.check();
        for good in ["http://127.0.0.1:9091", "https://push.example.com", "http://user:pw@gw:9091/prefix"] {
            assert_eq!(check(good), Ok(()), "{good}");
        }
        for bad in ["localhost:9091", "gw:9091", "file:///tmp/metrics", "ftp://user:secret@gw", "http://", "9091", ""] {
            let message = check(bad).unwrap_err();
            assert!(message.contains("--pushgateway") && !message.contains("secret"), "{bad}: {message}");
        }
        assert_eq!(Targets::default().check(), Ok(()));
    }

    #[test]
    fn shards_of_one_layout_share_a_textfile_each_metric_grouped_once() {
        let render = |shard: &str, units: u32| {
            let e = Exporter::new(Targets::default(), "j", shard);
            e.state.lock().unwrap().units = units as usize;
            e.render()
        };
        let one = merged("", &render("0-of-2", 3), "j", "0-of-2");
        let both = merged(&one, &render("1-of-2", 5), "j", "1-of-2");
        let again = merged(&both, &render("0-of-2", 4), "j", "0-of-2");
        let samples: Vec<&str> = again.lines().filter(|l| l.starts_with("nightshift_units{")).collect();
        assert_eq!(samples, ["nightshift_units{job=\"j\",shard=\"0-of-2\"} 4", "nightshift_units{job=\"j\",shard=\"1-of-2\"} 5"], "{again}");
        assert_eq!(again.matches("# TYPE nightshift_units gauge").count(), 1, "{again}");
        assert_eq!(again.matches("# HELP nightshift_units ").count(), 1, "{again}");
        // Each metric's HELP, TYPE and series are one block.
        let at = again.find("# HELP nightshift_units ").unwrap();
        assert!(again[at..].lines().skip(2).take(2).all(|l| l.starts_with("nightshift_units{")), "{again}");
        // A later run of the whole job drops both shards' series.
        let whole = merged(&again, &render("all", 7), "j", "all");
        assert!(!whole.contains("-of-2") && whole.contains("nightshift_units{job=\"j\",shard=\"all\"} 7"), "{whole}");
    }

    #[test]
    fn the_text_format_names_every_series_with_its_labels_and_keeps_the_last_success() {
        let dir = std::env::temp_dir().join(format!("nightshift-prom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("job.prom");
        // Another job's and another shard's lines come first: only ours is read back.
        let before = "nightshift_last_success_timestamp_seconds{job=\"a\",shard=\"all\"} 1600000000\n\
                      nightshift_last_success_timestamp_seconds{job=\"nightly \\\"tickets\\\"\",shard=\"0-of-2\"} 1650000000\n\
                      nightshift_last_success_timestamp_seconds{job=\"nightly \\\"tickets\\\"\",shard=\"all\"} 1700000000.5\n";
        std::fs::write(&path, before).unwrap();
        let e = Exporter::new(Targets { textfile: Some(path.clone()), pushgateway: None }, "nightly \"tickets\"", "all");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        e.planned(&rt, 4, 1);
        e.finish(&rt, 75);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("nightshift_units{job=\"nightly \\\"tickets\\\"\",shard=\"all\"} 4"), "{text}");
        assert!(text.contains("nightshift_exit_code{job=\"nightly \\\"tickets\\\"\",shard=\"all\"} 75"), "{text}");
        assert!(text.contains("nightshift_last_success_timestamp_seconds{job=\"nightly \\\"tickets\\\"\",shard=\"all\"} 1700000000.5"), "{text}");
        e.finish(&rt, 0);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("1700000000.5"), "a success replaces the last one: {text}");
        assert!(text.contains("nightshift_last_success_timestamp_seconds{job=\"a\",shard=\"all\"} 1600000000"), "another job's series are kept: {text}");
        assert!(!text.contains("1650000000"), "this job's series of another shard layout are stale: {text}");
        let mut names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, [".job.prom.lock", "job.prom"], "no temporary file is left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
