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
