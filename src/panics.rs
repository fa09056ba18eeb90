//! Panics of libraries turned into errors: a model file or an input is untrusted, and a library that panics on a
//! malformed one (the `tokenizers` crate on a bad `tokenizer.json`, the Parquet reader on a bad footer) gives an
//! error, never a crash. A leaf: every stage may use it, it uses none.

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
