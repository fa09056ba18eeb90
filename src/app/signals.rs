//! SIGTERM / SIGINT: the first signal drains the job, a second exits at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::error::{Error, Exit};

/// SIGTERM / SIGINT handling. The first signal asks the job to drain: no new rows are admitted, running sequences
/// may finish until the grace deadline, complete units are committed, and the process exits "partial, resumable".
/// A second signal exits at once.
#[derive(Default)]
pub struct Drain {
    requested: AtomicBool,
    deadline: std::sync::Mutex<Option<Instant>>,
}

impl Drain {
    pub fn start(&self, grace: Duration) {
        *self.deadline.lock().expect("not poisoned") = Some(Instant::now() + grace);
        self.requested.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    pub fn past_deadline(&self) -> bool {
        self.requested() && self.deadline.lock().expect("not poisoned").is_some_and(|d| Instant::now() >= d)
    }
}

/// Installs the handlers on the I/O runtime: the first signal starts the drain with `grace` to finish, the second
/// exits with [`Exit::Partial`].
pub fn watch_signals(rt: &tokio::runtime::Runtime, drain: Arc<Drain>, grace: Duration) -> Result<(), Error> {
    use tokio::signal::unix::{signal, SignalKind};
    let _guard = rt.enter();
    let cannot = |e: std::io::Error| Error::Internal(format!("cannot install signal handlers: {e}"));
    let mut term = signal(SignalKind::terminate()).map_err(cannot)?;
    let mut int = signal(SignalKind::interrupt()).map_err(cannot)?;
    rt.spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        warn!(grace_s = grace.as_secs_f64(), "signal received: admitting no more rows; finishing running sequences and committing complete units (a second signal exits at once)");
        drain.start(grace);
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        eprintln!("error: second signal: exiting at once; committed units are kept, rerun the job to resume");
        std::process::exit(Exit::Partial as i32);
    });
    Ok(())
}
