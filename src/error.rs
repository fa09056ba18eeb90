//! The top-level error and the process exit codes it maps to.
//!
//! Every stage has its own error enum; this one wraps them so that `main` can print one clear message and
//! exit with a code a scheduler can act on. The codes are documented in the README.

use std::process::ExitCode;

/// Process exit codes. Stable: cron jobs, Kubernetes pod failure policies and Slurm scripts key on them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// Every input row has a result row (some may be error rows); the output is complete.
    Complete = 0,
    /// An unexpected failure (a bug, or an I/O error outside the categories below).
    Failed = 1,
    /// The command line or the job file is invalid.
    InvalidJob = 2,
    /// The input cannot be read or does not have the expected columns.
    InvalidInput = 3,
    /// The model file is missing, unreadable or unsupported.
    InvalidModel = 4,
    /// The output location cannot be written, or holds a different job's output.
    OutputFailed = 5,
    /// Partial and resumable: the job was interrupted (SIGTERM, SIGINT) after committing what it finished, or
    /// `finalize` found units not yet committed. Running the same job again finishes it. (75 is `EX_TEMPFAIL`.)
    Partial = 75,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(e as u8)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Job(#[from] crate::job::JobError),
    #[error(transparent)]
    Source(#[from] crate::source::SourceError),
    #[error(transparent)]
    Model(#[from] crate::engine::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenize::TokenizerError),
    #[error(transparent)]
    Sink(#[from] crate::sink::SinkError),
    #[error(transparent)]
    Shard(#[from] crate::plan::shard::ShardError),
    #[error(transparent)]
    Reuse(#[from] crate::reuse::sources::ReuseError),
    #[error("the engine failed")]
    Engine(#[source] crate::engine::EngineError),
    #[error(
        "interrupted: {committed} of {total} units of {what} are committed ({unfinished} unfinished unit(s) \
         discarded); run the same job again to resume"
    )]
    Interrupted { committed: usize, total: usize, what: String, unfinished: usize },
    #[error(
        "the output store failed mid-run, after retries; {committed} of {total} units are committed and kept: run \
         the same job again to resume"
    )]
    StoreFailed { committed: usize, total: usize, #[source] source: Box<crate::sink::SinkError> },
    /// A command line the program cannot act on (values that contradict each other or the model), found after
    /// parsing: exit 2, as clap's own usage errors.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn exit(&self) -> Exit {
        match self {
            // A model store that did not answer is not the model's fault: a rerun may fetch it.
            Error::Model(crate::engine::ModelError::Unreachable { .. }) => Exit::Partial,
            Error::Job(_) | Error::Shard(_) | Error::Usage(_) => Exit::InvalidJob,
            Error::Source(_) | Error::Reuse(_) => Exit::InvalidInput,
            Error::Model(_) | Error::Tokenizer(_) => Exit::InvalidModel,
            Error::Sink(crate::sink::SinkError::Incomplete { .. } | crate::sink::SinkError::MissingFile { .. } | crate::sink::SinkError::NotComplete { .. })
            | Error::Interrupted { .. }
            | Error::StoreFailed { .. } => {
                Exit::Partial
            }
            Error::Sink(crate::sink::SinkError::Encode { .. }) => Exit::Failed,
            // Asking to export what has nothing to export is a command that cannot be carried out.
            Error::Sink(crate::sink::SinkError::NotExportable { .. }) => Exit::InvalidJob,
            Error::Sink(_) => Exit::OutputFailed,
            Error::Engine(_) | Error::Internal(_) => Exit::Failed,
        }
    }
}

/// Formats an error with its chain of causes, one per line, for the terminal, every URL's credentials redacted
/// ([`redact_urls`]): the object stores' errors name the endpoint they called, user-info included.
pub fn report(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = format!("error: {err}");
    let mut source = err.source();
    while let Some(cause) = source {
        out.push_str(&format!("\n  caused by: {cause}"));
        source = cause.source();
    }
    redact_urls(&out).into_owned()
}

/// `text` with the user-info of every URL in it (`scheme://user:password@host/...`) replaced by `***`, so that
/// credentials someone put in an endpoint or a store URL never reach a log, a message or a terminal. The program
/// prints every error chain, log line and URL through it.
pub fn redact_urls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("://") {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // The authority ends at the path, query or fragment, or wherever the URL's text does.
        let end = tail.find(|c: char| matches!(c, '/' | '?' | '#' | '"' | '\'' | '`' | '<' | '>' | ')' | ']' | ',' | ';') || c.is_whitespace()).unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(user_end) => {
                out.push_str("***");
                out.push_str(&authority[user_end..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// Standard error through [`redact_urls`], for the log: each event is formatted whole and written at once.
pub struct RedactedStderr;

impl std::io::Write for RedactedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        std::io::stderr().write_all(redact_urls(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::redact_urls;

    #[test]
    fn credentials_in_urls_are_redacted_and_everything_else_kept() {
        let text = "HEAD http://user:secret@127.0.0.1:9000/bucket/in.parquet failed; s3://bucket/key and \
                    `https://token@host.example/p?q=a@b` (and https://plain.example/x@y) end";
        let redacted = redact_urls(text);
        assert!(!redacted.contains("secret") && !redacted.contains("token@"), "{redacted}");
        assert_eq!(
            redacted,
            "HEAD http://***@127.0.0.1:9000/bucket/in.parquet failed; s3://bucket/key and \
             `https://***@host.example/p?q=a@b` (and https://plain.example/x@y) end"
        );
        assert_eq!(redact_urls("no urls here, user@example.com"), "no urls here, user@example.com");
        assert_eq!(redact_urls("ends with ://"), "ends with ://");
    }

    #[test]
    fn error_reports_redact_every_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot read `s3://b/k`")]
        struct Outer(#[source] std::io::Error);
        let inner = std::io::Error::other("Error performing HEAD http://user:secret@127.0.0.1:1/b/k after 15 retries");
        let text = super::report(&Outer(inner));
        assert!(text.contains("http://***@127.0.0.1:1/b/k") && !text.contains("secret"), "{text}");
    }
}

thread_local! {
    /// Set while [`catch_panic`] runs: the panic hook stays silent for panics it turns into errors.
    static CAUGHT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic inside it into an error with the panic's message. For libraries that panic on some
/// malformed input instead of returning an error (the `tokenizers` crate on a malformed `tokenizer.json`): a model
/// file is untrusted, and its problems are errors, never a crash.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let was = CAUGHT.with(|c| c.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CAUGHT.with(|c| c.set(was));
    result.map_err(|payload| {
        let text = payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned());
        text.map_or_else(|| "a library failed on it".to_string(), |t| t.lines().next().unwrap_or_default().to_string())
    })
}

/// Installs a panic hook that keeps the default report for real panics (bugs) and is silent for the panics
/// [`catch_panic`] turns into errors.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !CAUGHT.with(|c| c.get()) {
            default(info);
        }
    }));
}

/// [`catch_panic`] for a future: each poll runs under it, and a panic ends the future with its message.
pub async fn catch_panic_async<F: std::future::Future>(f: F) -> Result<F::Output, String> {
    use std::task::Poll;
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(move |cx| match catch_panic(|| f.as_mut().poll(cx)) {
        Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(message) => Poll::Ready(Err(message)),
    })
    .await
}
