use std::process::ExitCode;

use clap::Parser;
use nightshift::app::{self, RunOptions};
use nightshift::cli::{self, Cli, Command, LogFormat};
use nightshift::error::Exit;
use nightshift::redact::{report, RedactedStderr};
use tracing_subscriber::EnvFilter;

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: a log that cron, Slurm or a container runtime writes to a file stays plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(|| RedactedStderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// `run --data-parallel`: the workers' run; the code to exit with.
fn data_parallel(args: &cli::RunArgs) -> Result<i32, nightshift::error::Error> {
    let asked = args.data_parallel.as_ref().expect("checked by the caller");
    let targets = nightshift::metrics::prometheus::Targets { textfile: None, pushgateway: args.pushgateway.clone() };
    targets.check().map_err(nightshift::error::Error::Usage)?;
    let job = nightshift::job::Job::load(&args.job.job, &args.job.overrides())?;
    let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let report = app::parallel::run(asked, &argv, &job.output.url, args.job.shards)?;
    cli::print_data_parallel(&report);
    Ok(report.code)
}

fn main() -> ExitCode {
    nightshift::panics::install_panic_hook();
    let kept = nightshift::alloc::keep_large_buffers();
    app::tune_cpu_threads();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    tracing::debug!(kept, "the allocator keeps buffers of up to 256 MiB on its heap between steps");
    // Variables earlier versions read, now `NIGHTSHIFT_ATTENTION` (`runtime.attention`): said, not silently ignored.
    for old in ["NIGHTSHIFT_PAGED", "NIGHTSHIFT_PAGED_ATTENTION"] {
        if std::env::var_os(old).is_some() {
            tracing::warn!("{old} is no longer read: set NIGHTSHIFT_ATTENTION=paged-tiled (or runtime.attention, --attention) instead");
        }
    }
    // Before any thread: on a CPU with AMX, Linux's permission for the tiles.
    nightshift::engine::kernels::prepare();
    let result = match &cli.command {
        Command::Run(args) if args.data_parallel.is_some() => match data_parallel(args) {
            Ok(code) => return ExitCode::from(code.clamp(0, 255) as u8),
            Err(e) => Err(e),
        },
        Command::Run(args) => app::run(RunOptions {
            job: args.job.job.clone(),
            overrides: args.job.overrides(),
            progress: !args.no_progress,
            show: args.show,
            shard: args.shard.clone(),
            prometheus: nightshift::metrics::prometheus::Targets { textfile: args.metrics_textfile.clone(), pushgateway: args.pushgateway.clone() },
        })
        .map(|r| cli::print_run(&r)),
        Command::Validate(args) => app::validate(&args.job, &args.overrides()).map(|r| cli::print_validate(&r)),
        Command::Plan(args) => app::plan_job(&args.job.job, &args.job.overrides(), args.calibration_rows).map(|r| cli::print_plan(&r, args.json)),
        Command::Status(args) => app::status(&args.output).map(|s| cli::print_status(&s, args.json)),
        Command::Report(args) => app::report(&args.output, args.to.as_deref()).and_then(|html| cli::print_report(&html, args.to.as_deref())),
        Command::Finalize(args) => app::finalize(&args.output).map(|(f, url)| cli::print_finalize(&f, &url)),
        Command::Export(args) => match args.format {
            cli::ExportFormat::OpenaiBatch => app::export_openai_batch(&args.output, &args.to, args.model.as_deref()).map(|e| cli::print_export(&e)),
        },
        Command::Bench(cli::BenchCommand::Generate(args)) => {
            if let Some(threads) = args.threads {
                app::limit_threads(threads);
            }
            nightshift::bench::generate(&args.options()).map(|r| cli::print_generate_bench(&r, args.json))
        }
        Command::Bench(cli::BenchCommand::Parity(args)) => {
            nightshift::bench::parity(&args.options()).and_then(|r| cli::print_parity(&r, args.json))
        }
        Command::Bench(cli::BenchCommand::Kernels(args)) => {
            if let Some(threads) = args.threads {
                app::limit_threads(threads);
            }
            let options = args.options();
            nightshift::bench::kernels(&options).and_then(|r| nightshift::bench::attention(&options).map(|a| cli::print_kernel_bench(&r, &a, args.json)))
        }
        Command::Tokenize(args) => cli::tokenize(args),
        Command::SynthModel(args) => args.gguf_type().and_then(|quant| {
            if let Some(report) = args.run_t5(quant)? {
                println!("wrote {} ({}): {} parameters, {:.1} MiB of f32 weights", args.dir.display(), report.shape.name, report.parameters, report.bytes as f64 / (1 << 20) as f64);
                return Ok(());
            }
            let report = args.run()?;
            cli::print_synth(&report, &args.dir);
            if let Some(quant) = quant {
                let (path, bytes) = nightshift::synth::synth_gguf(&args.dir, quant, args.tokenizer()?.as_ref())?;
                cli::print_written(&path, bytes);
            }
            Ok(())
        }),
        Command::Bench(cli::BenchCommand::Embed(args)) => {
            if let Some(threads) = args.threads {
                app::limit_threads(threads);
            }
            nightshift::bench::embed(&args.options()).map(|r| cli::print_embed_bench(&r, args.json))
        }
    };
    match result {
        Ok(()) => Exit::Complete.into(),
        Err(e) => {
            eprintln!("{}", report(&e));
            e.exit().into()
        }
    }
}
