//! `nightshift validate`: the job file, the input, the model and the output checked without loading weights,
//! generating or writing anything.

use std::path::Path;

use super::load::{check_model, ModelSummary};
use super::{fingerprint, runtime};
use crate::error::Error;
use crate::job::{Job, Overrides};
use crate::sink::Output;
use crate::source::Input;

/// What `validate` found.
#[derive(Debug)]
pub struct ValidateReport {
    pub input_files: Vec<String>,
    pub rows: u64,
    pub model: ModelSummary,
    pub output_url: String,
    /// `new`, resumable (how far), or complete; a different job's output is an error instead.
    pub output_state: String,
}

/// Checks the job file, the input's files and columns, the model's metadata, tokenizer and chat template and the
/// job's parameters against it (as a run does, [`check_model`]), and whether the output holds this job's plan (or a
/// different job's).
pub fn validate(job_path: &Path, overrides: &Overrides) -> Result<ValidateReport, Error> {
    let mut job = Job::load(job_path, overrides)?;
    let rt = runtime()?;
    super::local_model(&mut job, &rt)?;
    let input = rt.block_on(Input::open(&job.input))?;
    // What a run checks over the whole input before it plans: unique ids (and a request file's model names).
    rt.block_on(input.check_whole())?;
    let output = Output::resolve(&job.output.url)?;
    let check = check_model(&job)?;
    // What a run would do with the output: start it, resume it, find it complete, or refuse it.
    let ours = fingerprint(&job, &check.sha256, check.template.as_deref(), &input);
    let output_state = rt.block_on(async {
        let Some(plan) = output.read_plan().await? else { return Ok::<_, Error>("new".to_string()) };
        output.check_same_job(&plan, &ours)?;
        if output.is_complete().await? {
            return Ok("complete: a run does nothing".to_string());
        }
        let committed = output.committed_units().await?.len();
        let shards = if plan.shards > 1 { format!(", in {} shards", plan.shards) } else { String::new() };
        Ok(format!("a run resumes it: {committed} of {} units committed{shards}", plan.units.len()))
    })?;
    Ok(ValidateReport { input_files: input.file_urls(), rows: input.total_rows(), model: check.summary, output_url: job.output.url, output_state })
}
