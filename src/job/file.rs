//! The job file as written: TOML sections parsed strictly (unknown keys are errors), and their resolution into a
//! [`Job`], one check at a time, each error naming its key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::generation::{GenerationSection, SEQ2SEQ_UNSUPPORTED};
use super::LineRules;
use super::runtime::RuntimeSection;
use super::{
    ChatTemplateChoice, GenerationParams, InputSpec, Invalid, Job, JobError, JobKind, ModelSpec, OutputSpec, Overrides,
    ParameterColumns, PromptColumn, ReuseSpec, RuntimeSpec, Truncate, ROW_PARAMETERS,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobFile {
    #[serde(default)]
    kind: JobKind,
    input: InputSection,
    model: ModelSection,
    generation: Option<GenerationSection>,
    output: OutputSection,
    #[serde(default)]
    runtime: RuntimeSection,
    #[serde(default)]
    reuse: ReuseSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReuseSection {
    /// Completed outputs of earlier runs whose rows this run copies instead of computing.
    #[serde(default)]
    from: Vec<String>,
    /// Serve from sources without `_SUCCESS` (their committed units).
    #[serde(default)]
    allow_incomplete: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InputSection {
    url: String,
    id_column: Option<String>,
    prompt_column: Option<String>,
    messages_column: Option<String>,
    system_prompt: Option<String>,
    truncate: Option<String>,
    completion_column: Option<String>,
    /// Per-row overrides of generation parameters: generation key = input column.
    #[serde(default)]
    parameters: BTreeMap<String, String>,
    /// `"parquet"` (the default) or `"openai-batch"` (JSONL request lines; the default for a `.jsonl` URL).
    format: Option<String>,
    /// OpenAI Batch input: the model name lines must give in `body.model`; unset, the model file's name without
    /// its extension. `"*"` accepts any.
    model: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    path: String,
    sha256: Option<String>,
    #[serde(default = "default_chat_template")]
    chat_template: String,
}

fn default_chat_template() -> String {
    "auto".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputSection {
    url: String,
    unit_rows: Option<i64>,
    shards: Option<i64>,
    /// A format the run that completes the output also writes it in (`nightshift export`).
    export: Option<String>,
}

impl Job {
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Job, JobError> {
        let text = std::fs::read_to_string(path).map_err(|source| JobError::Read { path: path.into(), source })?;
        Job::parse(&text, path, overrides)
    }

    /// Checks the sections in the order of the file (input, model, generation, output, runtime), so that a file
    /// with several mistakes is told about the first.
    pub fn parse(text: &str, path: &Path, overrides: &Overrides) -> Result<Job, JobError> {
        let file: JobFile = toml::from_str(text)
            .map_err(|e| JobError::Parse { path: path.into(), message: e.to_string().trim_end().to_string() })?;
        let invalid = |key: &'static str, problem: String| JobError::Invalid { path: path.into(), key, problem };
        let JobFile { kind, input, model, generation, output, runtime, reuse } = file;

        let url = overrides.input_url.clone().unwrap_or_else(|| input.url.clone());
        if url.trim().is_empty() {
            return Err(invalid("input.url", "must not be empty".into()));
        }
        let mut prompt = prompt_column(&input, &invalid)?;
        let model = ModelSpec::from_section(model, overrides, &invalid)?;
        let openai_batch = openai_batch(kind, &url, &input, &model, &invalid)?;
        if let Some(rules) = &openai_batch {
            prompt = match rules.url {
                "/v1/chat/completions" => PromptColumn::Messages("messages".into()),
                "/v1/completions" => PromptColumn::Text("prompt".into()),
                _ => PromptColumn::Text("input".into()),
            };
        }
        check_conversation(kind, &model.chat_template, &prompt, &input, &invalid)?;
        let scoring = check_completion_column(kind, &input, &invalid)?;
        let section = generation_section(kind, generation, scoring, &prompt, &input, &invalid)?;
        let generation = GenerationParams::from_section(section, scoring, kind, &invalid)?;
        let output = OutputSpec::from_section(output, overrides, &invalid)?;
        if scoring && output.export.is_some() {
            return Err(invalid(
                "output.export",
                "a scoring job (`input.completion_column`) generates no answers for the OpenAI Batch format to hold: its results are the completions' log-probabilities, in the output's Parquet files".into(),
            ));
        }
        if let Some(root) = output_inside_input(&url, &output.url) {
            return Err(invalid(
                "output.url",
                format!("`{}` lies inside the input's prefix `{root}`: a rerun would read the job's own results as input; write the output elsewhere", output.url),
            ));
        }
        let truncate = match input.truncate.as_deref().unwrap_or("none") {
            "none" => Truncate::None,
            "left" => Truncate::Left,
            "right" => Truncate::Right,
            other => return Err(invalid("input.truncate", format!("must be \"none\", \"left\" or \"right\", got {other:?}"))),
        };
        let parameters = parameter_columns(input.parameters, scoring, kind, &invalid)?;
        let runtime = RuntimeSpec::from_section(runtime, overrides, &invalid)?;
        let mut from = reuse.from;
        from.extend(overrides.reuse.iter().cloned());
        if let Some(empty) = from.iter().position(|u| u.trim().is_empty()) {
            return Err(invalid("reuse.from", format!("entry {empty} is empty")));
        }
        let output_root = output.url.trim_end_matches('/');
        if from.iter().any(|u| u.trim_end_matches('/') == output_root) {
            return Err(invalid("reuse.from", format!("names the job's own output `{}`: a rerun resumes it anyway; name earlier runs' outputs", output.url)));
        }
        let reuse = ReuseSpec { from, allow_incomplete: reuse.allow_incomplete || overrides.reuse_incomplete };

        Ok(Job {
            file: path.into(),
            kind,
            input: InputSpec {
                url,
                id_column: input.id_column,
                prompt,
                system_prompt: input.system_prompt,
                truncate,
                parameters,
                completion_column: input.completion_column,
                openai_batch,
            },
            model,
            generation,
            output,
            runtime,
            reuse,
        })
    }
}

/// OpenAI Batch input (`input.format = "openai-batch"`, or a `.jsonl` URL): which lines the job runs. The
/// columns and per-row parameter settings of Parquet input have no meaning for it.
fn openai_batch(kind: JobKind, url: &str, input: &InputSection, model: &ModelSpec, invalid: Invalid) -> Result<Option<LineRules>, JobError> {
    let batch = match input.format.as_deref() {
        None => url.to_ascii_lowercase().ends_with(".jsonl"),
        Some("parquet") => false,
        Some("openai-batch") => true,
        Some(other) => return Err(invalid("input.format", format!("must be \"parquet\" or \"openai-batch\", got {other:?}"))),
    };
    if !batch {
        if input.model.is_some() {
            return Err(invalid("input.model", "is for OpenAI Batch input (`input.format = \"openai-batch\"`)".into()));
        }
        return Ok(None);
    }
    for (set, key) in [
        (input.id_column.is_some(), "input.id_column"),
        (input.prompt_column.is_some(), "input.prompt_column"),
        (input.messages_column.is_some(), "input.messages_column"),
        (input.completion_column.is_some(), "input.completion_column"),
        (!input.parameters.is_empty(), "input.parameters"),
    ] {
        if set {
            return Err(invalid(key, "has no meaning for OpenAI Batch input: lines give `custom_id` and a request `body`".into()));
        }
    }
    let url = match (kind, &model.chat_template) {
        (JobKind::Embed, _) => "/v1/embeddings",
        (JobKind::Seq2seq, _) | (JobKind::Generate, ChatTemplateChoice::None) => "/v1/completions",
        (JobKind::Generate, ChatTemplateChoice::Auto) => "/v1/chat/completions",
    };
    let name = match input.model.as_deref() {
        Some("*") => None,
        Some(name) => Some(name.to_string()),
        None => Some(model.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()),
    };
    Ok(Some(LineRules { url, model: name }))
}

/// The input's prefix when the output location lies inside it (or is it): an input that is a prefix, or a glob
/// with `**`, lists Parquet files at any depth under it, the job's own results included. (A glob without `**`
/// matches a fixed depth, which the results' `data/` files below the output do not reach from the glob's own
/// level.) Compared as written, local paths made absolute (`file://` dropped, `.` and `..` folded), every location
/// ending in `/`.
fn output_inside_input(input: &str, output: &str) -> Option<String> {
    let root = if crate::source::store::is_glob(input) {
        if !input.contains("**") {
            return None;
        }
        crate::source::store::glob_prefix(input)
    } else if input.ends_with('/') {
        input
    } else {
        return None;
    };
    let normal = |url: &str| -> String {
        let mut text = match url.strip_prefix("file://") {
            Some(path) => lexical_absolute(path),
            None if url.contains("://") => url.to_string(),
            None => lexical_absolute(url),
        };
        if !text.ends_with('/') {
            text.push('/');
        }
        text
    };
    let (root_n, output_n) = (normal(root), normal(output));
    output_n.starts_with(&root_n).then(|| root.to_string())
}

/// A local path made absolute against the working directory, `.` and `..` folded without touching the disk.
fn lexical_absolute(path: &str) -> String {
    let base = if path.starts_with('/') { std::path::PathBuf::from("/") } else { std::env::current_dir().unwrap_or_default() };
    let mut parts: Vec<String> = Vec::new();
    for part in base.join(path).components() {
        match part {
            std::path::Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            std::path::Component::ParentDir => {
                parts.pop();
            }
            _ => {}
        }
    }
    format!("/{}", parts.join("/"))
}

fn prompt_column(input: &InputSection, invalid: Invalid) -> Result<PromptColumn, JobError> {
    let prompt = match (&input.prompt_column, &input.messages_column) {
        (Some(_), Some(_)) => {
            return Err(invalid("input.messages_column", "cannot be set together with `input.prompt_column`".into()))
        }
        (None, Some(name)) => PromptColumn::Messages(name.clone()),
        (Some(name), None) => PromptColumn::Text(name.clone()),
        (None, None) => PromptColumn::Text("prompt".into()),
    };
    if prompt.name().is_empty() {
        return Err(invalid("input.prompt_column", "must not be empty".into()));
    }
    Ok(prompt)
}

impl ModelSpec {
    fn from_section(model: ModelSection, overrides: &Overrides, invalid: Invalid) -> Result<ModelSpec, JobError> {
        let path = overrides.model_path.clone().unwrap_or(model.path);
        if path.trim().is_empty() {
            return Err(invalid("model.path", "must not be empty".into()));
        }
        let sha256 = match model.sha256 {
            Some(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => Some(s.to_ascii_lowercase()),
            Some(s) => return Err(invalid("model.sha256", format!("must be 64 hex digits, got {s:?}"))),
            None => None,
        };
        let chat_template = match model.chat_template.as_str() {
            "auto" => ChatTemplateChoice::Auto,
            "none" => ChatTemplateChoice::None,
            other => return Err(invalid("model.chat_template", format!("must be \"auto\" or \"none\", got {other:?}"))),
        };
        Ok(ModelSpec { path: PathBuf::from(path), sha256, chat_template })
    }
}

/// A system prompt and a messages column need a chat template; seq2seq jobs have none.
fn check_conversation(
    kind: JobKind,
    template: &ChatTemplateChoice,
    prompt: &PromptColumn,
    input: &InputSection,
    invalid: Invalid,
) -> Result<(), JobError> {
    if *template == ChatTemplateChoice::None {
        if input.system_prompt.is_some() {
            return Err(invalid("input.system_prompt", "needs a chat template, but `model.chat_template` is \"none\"".into()));
        }
        if matches!(prompt, PromptColumn::Messages(_)) {
            return Err(invalid("input.messages_column", "needs a chat template, but `model.chat_template` is \"none\"".into()));
        }
    }
    if kind == JobKind::Seq2seq {
        for (set, key) in [
            (matches!(prompt, PromptColumn::Messages(_)), "input.messages_column"),
            (input.system_prompt.is_some(), "input.system_prompt"),
        ] {
            if set {
                return Err(invalid(key, "has no meaning for `kind = \"seq2seq\"` jobs (no chat template)".into()));
            }
        }
    }
    Ok(())
}

/// Whether the job scores completions (`input.completion_column`), which only a decoder does.
fn check_completion_column(kind: JobKind, input: &InputSection, invalid: Invalid) -> Result<bool, JobError> {
    let Some(column) = &input.completion_column else { return Ok(false) };
    if column.is_empty() {
        return Err(invalid("input.completion_column", "must not be empty".into()));
    }
    if kind != JobKind::Generate {
        return Err(invalid("input.completion_column", "needs `kind = \"generate\"` (a decoder scores completions)".into()));
    }
    Ok(true)
}

/// The `[generation]` section a job of this kind needs: required when it generates, absent when it embeds.
fn generation_section(
    kind: JobKind,
    section: Option<GenerationSection>,
    scoring: bool,
    prompt: &PromptColumn,
    input: &InputSection,
    invalid: Invalid,
) -> Result<GenerationSection, JobError> {
    match (kind, section) {
        (JobKind::Generate | JobKind::Seq2seq, Some(g)) => Ok(g),
        (JobKind::Generate, None) if scoring => Ok(GenerationSection::default()),
        (JobKind::Generate | JobKind::Seq2seq, None) => {
            Err(invalid("generation", "is required: a `[generation]` section with `max_new_tokens`".into()))
        }
        (JobKind::Embed, Some(_)) => Err(invalid("generation", "has no meaning for `kind = \"embed\"` jobs".into())),
        (JobKind::Embed, None) => {
            for (set, key) in [
                (matches!(prompt, PromptColumn::Messages(_)), "input.messages_column"),
                (input.system_prompt.is_some(), "input.system_prompt"),
                (!input.parameters.is_empty(), "input.parameters"),
            ] {
                if set {
                    return Err(invalid(key, "has no meaning for `kind = \"embed\"` jobs".into()));
                }
            }
            Ok(GenerationSection { max_new_tokens: Some(1), ..GenerationSection::default() })
        }
    }
}

impl OutputSpec {
    fn from_section(output: OutputSection, overrides: &Overrides, invalid: Invalid) -> Result<OutputSpec, JobError> {
        let url = overrides.output_url.clone().unwrap_or(output.url);
        if url.trim().is_empty() {
            return Err(invalid("output.url", "must not be empty".into()));
        }
        let unit_rows = match output.unit_rows {
            None => OutputSpec::DEFAULT_UNIT_ROWS,
            Some(n) if (1..=1 << 24).contains(&n) => n as u32,
            Some(n) => return Err(invalid("output.unit_rows", format!("must be in 1..={}, got {n}", 1 << 24))),
        };
        let shards = match overrides.shards.map(i64::from).or(output.shards) {
            None => None,
            Some(n) if (1..=100_000).contains(&n) => Some(n as u32),
            Some(n) => return Err(invalid("output.shards", format!("must be in 1..=100000, got {n}"))),
        };
        let export = match output.export.as_deref() {
            None => None,
            Some("openai-batch") => Some(super::ExportFormat::OpenaiBatch),
            Some(other) => return Err(invalid("output.export", format!("must be \"openai-batch\", got {other:?}"))),
        };
        Ok(OutputSpec { url, unit_rows, shards, export })
    }
}

/// `[input.parameters]`: known generation keys, each to a non-empty column, and only those the job can use.
fn parameter_columns(
    mapped: BTreeMap<String, String>,
    scoring: bool,
    kind: JobKind,
    invalid: Invalid,
) -> Result<ParameterColumns, JobError> {
    let mut parameters = ParameterColumns::default();
    for (key, column) in mapped {
        let Some(&(key, _)) = ROW_PARAMETERS.iter().find(|(k, _)| *k == key) else {
            let known = ROW_PARAMETERS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ");
            return Err(invalid("input.parameters", format!("has an unknown parameter `{key}` (known: {known})")));
        };
        if column.is_empty() {
            return Err(invalid("input.parameters", format!("maps `{key}` to an empty column name")));
        }
        parameters.0.insert(key, column);
    }
    if scoring {
        if let Some((key, _)) = parameters.columns().into_iter().find(|(k, _)| !matches!(*k, "logprobs")) {
            return Err(invalid("input.parameters", format!("maps `{key}`, which has no meaning for a scoring job (`input.completion_column`)")));
        }
    }
    if kind == JobKind::Seq2seq {
        if let Some((key, _)) = parameters.columns().into_iter().find(|(k, _)| SEQ2SEQ_UNSUPPORTED.contains(k)) {
            return Err(invalid("input.parameters", format!("maps `{key}`, which `kind = \"seq2seq\"` jobs do not support")));
        }
    }
    Ok(parameters)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{message, parse, MINIMAL};
    use super::*;

    #[test]
    fn an_output_inside_the_inputs_prefix_is_refused() {
        for (input, output) in [
            ("data/", "data/out/"),
            ("data/", "data"),
            ("./data/", "data/results"),
            ("data/**/*.parquet", "data/x/out/"),
            ("s3://b/in/", "s3://b/in/out/"),
            ("s3://b/in/**", "s3://b/in/run-1"),
            ("file:///tmp/in/", "/tmp/in/out/"),
        ] {
            assert!(output_inside_input(input, output).is_some(), "{input} -> {output}");
        }
        for (input, output) in [
            ("data/in.parquet", "data/out/"),
            ("data/in/", "data/out/"),
            ("s3://b/in/", "s3://b/input-out/"),
            ("s3://b/in/", "s3://other/in/out/"),
            ("data/in/*.parquet", "data/out/"),
            ("data/*.parquet", "data/out"),
        ] {
            assert!(output_inside_input(input, output).is_none(), "{input} -> {output}");
        }
        let m = message(&MINIMAL.replace("url = \"out/\"", "url = \"data/results/\"").replace("data/in.parquet", "data/"));
        assert!(m.contains("output.url") && m.contains("inside the input's prefix `data/`"), "{m}");
        assert!(parse(MINIMAL).is_ok());
    }

    #[test]
    fn minimal_job_gets_documented_defaults() {
        let job = parse(MINIMAL).unwrap();
        assert_eq!(job.kind, JobKind::Generate);
        assert_eq!(job.input.prompt, PromptColumn::Text("prompt".into()));
        assert_eq!(job.generation.temperature, 0.0);
        assert_eq!(job.generation.top_p, 1.0);
        assert_eq!(job.generation.top_k, 0);
        assert_eq!(job.model.chat_template, ChatTemplateChoice::Auto);
        assert_eq!(job.runtime.max_seqs, RuntimeSpec::default().max_seqs);
    }

    #[test]
    fn unknown_key_is_rejected_by_name() {
        let m = message(&MINIMAL.replace("max_new_tokens = 16", "max_new_tokens = 16\ntemprature = 0.5"));
        assert!(m.contains("temprature"), "{m}");
    }

    #[test]
    fn missing_max_new_tokens_is_rejected() {
        let m = message(&MINIMAL.replace("max_new_tokens = 16", ""));
        assert!(m.contains("max_new_tokens"), "{m}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (from, to, key) in [
            ("max_new_tokens = 16", "max_new_tokens = 0", "generation.max_new_tokens"),
            ("max_new_tokens = 16", "max_new_tokens = 16\ntemperature = -1.0", "generation.temperature"),
            ("max_new_tokens = 16", "max_new_tokens = 16\ntop_p = 0.0", "generation.top_p"),
            ("max_new_tokens = 16", "max_new_tokens = 16\nstop = [\"\"]", "generation.stop"),
            ("path = \"models/m.gguf\"", "path = \"m\"\nchat_template = \"chatml\"", "model.chat_template"),
            ("path = \"models/m.gguf\"", "path = \"m\"\nsha256 = \"abc\"", "model.sha256"),
        ] {
            let m = message(&MINIMAL.replace(from, to));
            assert!(m.contains(key), "expected {key} in: {m}");
        }
        let m = message(&format!("{MINIMAL}\n[runtime]\ndevice = \"tpu\""));
        assert!(m.contains("runtime.device"), "{m}");
        let m = message(&format!("{MINIMAL}\n[runtime]\nmax_seqs = 0"));
        assert!(m.contains("runtime.max_seqs"), "{m}");
    }

    #[test]
    fn wrong_type_is_rejected_with_its_location() {
        let m = message(&MINIMAL.replace("max_new_tokens = 16", "max_new_tokens = \"many\""));
        assert!(m.contains("max_new_tokens"), "{m}");
    }

    #[test]
    fn system_prompt_and_messages_need_a_chat_template() {
        let none = MINIMAL.replace("path = \"models/m.gguf\"", "path = \"m\"\nchat_template = \"none\"");
        parse(&none).unwrap();
        let m = message(&none.replace("url = \"data/in.parquet\"", "url = \"x\"\nsystem_prompt = \"Be brief.\""));
        assert!(m.contains("input.system_prompt") && m.contains("chat template"), "{m}");
        let m = message(&none.replace("url = \"data/in.parquet\"", "url = \"x\"\nmessages_column = \"m\""));
        assert!(m.contains("input.messages_column") && m.contains("chat template"), "{m}");
    }

    #[test]
    fn prompt_and_messages_columns_are_exclusive() {
        let m = message(&MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\nprompt_column = \"p\"\nmessages_column = \"m\""));
        assert!(m.contains("input.messages_column"), "{m}");
    }

    #[test]
    fn reliability_keys_have_defaults_and_are_checked() {
        let job = parse(MINIMAL).unwrap();
        assert_eq!(job.output.unit_rows, OutputSpec::DEFAULT_UNIT_ROWS);
        assert_eq!(job.runtime.drain_grace, std::time::Duration::from_secs(30));
        assert_eq!(job.input.truncate, Truncate::None);
        assert!(job.input.parameters.columns().is_empty());
        let text = MINIMAL
            .replace("url = \"out/\"", "url = \"out/\"\nunit_rows = 100")
            .replace("url = \"data/in.parquet\"", "url = \"x\"\ntruncate = \"left\"\n[input.parameters]\ntemperature = \"t\"\nmax_new_tokens = \"n\"");
        let job = parse(&format!("{text}\n[runtime]\ndrain_grace_s = 2.5")).unwrap();
        assert_eq!(job.output.unit_rows, 100);
        assert_eq!(job.output.shards, None);
        let sharded = parse(&MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nshards = 8")).unwrap();
        assert_eq!(sharded.output.shards, Some(8));
        assert_eq!(job.input.truncate, Truncate::Left);
        assert_eq!(job.input.parameters.columns(), vec![("max_new_tokens", "n"), ("temperature", "t")]);
        assert_eq!(job.runtime.drain_grace, std::time::Duration::from_millis(2500));
        for (text, key) in [
            (MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nunit_rows = 0"), "output.unit_rows"),
            (MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nshards = 0"), "output.shards"),
            (MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\ntruncate = \"middle\""), "input.truncate"),
            (format!("{MINIMAL}\n[runtime]\ndrain_grace_s = -1.0"), "runtime.drain_grace_s"),
            (MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\n[input.parameters]\nmirostat = \"p\""), "mirostat"),
        ] {
            let m = message(&text);
            assert!(m.contains(key), "expected {key} in: {m}");
        }
    }

    #[test]
    fn embed_and_seq2seq_jobs_are_checked_for_what_they_cannot_use() {
        let embed = format!("kind = \"embed\"\n{}", MINIMAL.replace("[generation]\nmax_new_tokens = 16\n", ""));
        assert_eq!(parse(&embed).unwrap().kind, JobKind::Embed);
        let m = message(&format!("kind = \"embed\"\n{MINIMAL}"));
        assert!(m.contains("`generation`") && m.contains("embed"), "{m}");
        let m = message(&embed.replace("url = \"data/in.parquet\"", "url = \"x\"\nmessages_column = \"m\""));
        assert!(m.contains("input.messages_column"), "{m}");
        let m = message(&embed.replace("url = \"data/in.parquet\"", "url = \"x\"\n[input.parameters]\ntemperature = \"t\""));
        assert!(m.contains("input.parameters"), "{m}");
        // A seq2seq job generates, so it needs `[generation]`, but it has no chat template.
        let seq2seq = format!("kind = \"seq2seq\"\n{MINIMAL}");
        assert_eq!(parse(&seq2seq).unwrap().kind, JobKind::Seq2seq);
        let m = message(&seq2seq.replace("url = \"data/in.parquet\"", "url = \"x\"\nsystem_prompt = \"Be brief.\""));
        assert!(m.contains("input.system_prompt") && m.contains("seq2seq"), "{m}");
        // A generation job without `[generation]` is told what is missing.
        let m = message(&MINIMAL.replace("[generation]\nmax_new_tokens = 16\n", ""));
        assert!(m.contains("generation") && m.contains("max_new_tokens"), "{m}");
    }

    #[test]
    fn scoring_jobs_need_no_generation_section_and_refuse_generation_keys() {
        let scoring = MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\ncompletion_column = \"label\"");
        let m = message(&scoring);
        assert!(m.contains("generation.max_new_tokens") && m.contains("scoring"), "{m}");
        let job = parse(&scoring.replace("max_new_tokens = 16", "logprobs = 2")).unwrap();
        assert_eq!((job.input.completion_column.as_deref(), job.generation.logprobs), (Some("label"), Some(2)));
        parse(&scoring.replace("[generation]\nmax_new_tokens = 16\n", "")).unwrap();
        let m = message(&scoring.replace("max_new_tokens = 16", "n = 2"));
        assert!(m.contains("generation.n"), "{m}");
    }

    #[test]
    fn overrides_take_precedence() {
        let o = Overrides {
            input_url: Some("s3://b/in.parquet".into()),
            output_url: Some("s3://b/out/".into()),
            model_path: Some("other.gguf".into()),
            max_seqs: Some(3),
            shards: Some(6),
            reuse: vec!["s3://b/night-2/".into()],
            reuse_incomplete: true,
            ..Overrides::default()
        };
        let text = MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nshards = 8") + "\n[reuse]\nfrom = [\"s3://b/night-1/\"]\n";
        let job = Job::parse(&text, Path::new("job.toml"), &o).unwrap();
        assert_eq!(job.reuse.from, ["s3://b/night-1/", "s3://b/night-2/"]);
        assert!(job.reuse.allow_incomplete);
        assert_eq!(job.output.shards, Some(6));
        assert_eq!(job.input.url, "s3://b/in.parquet");
        assert_eq!(job.output.url, "s3://b/out/");
        assert_eq!(job.model.path, PathBuf::from("other.gguf"));
        assert_eq!(job.runtime.max_seqs, 3);
    }

    #[test]
    fn reuse_sources_are_checked() {
        let m = message(&(MINIMAL.to_string() + "\n[reuse]\nfrom = [\"\"]\n"));
        assert!(m.contains("reuse.from") && m.contains("entry 0 is empty"), "{m}");
        let m = message(&(MINIMAL.to_string() + "\n[reuse]\nfrom = [\"out\"]\n"));
        assert!(m.contains("reuse.from") && m.contains("own output"), "{m}");
        let m = message(&(MINIMAL.to_string() + "\n[reuse]\nform = []\n"));
        assert!(m.contains("form"), "{m}");
    }
}
