//! Credentials out of text: every URL's user-info replaced before an error, a log line or a message is shown
//! ([`redact_urls`]), error chains formatted through it ([`report`]), and standard error for the log through it
//! ([`RedactedStderr`]). A leaf: every stage may use it, it uses none.

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
