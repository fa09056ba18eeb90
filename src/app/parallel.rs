//! `nightshift run --data-parallel N`: every GPU of one machine (or its cores split N ways) on one job.
//!
//! The process starts N workers, copies of itself running `run` with `--shard i/N --shards N`: the plan's shards
//! are the unit of parallelism, as on a cluster, so what makes a Kubernetes array safe (create-once units, the
//! last shard finalizing, resume after a kill) makes this safe too. Each worker sees only its own GPU
//! (`CUDA_VISIBLE_DEVICES`) and gets an equal share of the cores for its CPU threads (`RAYON_NUM_THREADS`).
//! The parent forwards SIGTERM and SIGINT to every worker still running (each drains as a lone run would; a
//! second signal is forwarded too), finalizes the output when every worker completed its shard, and exits with
//! the worst worker's code ([`worst`]). A worker that the forwarded signal kills before its handlers are installed
//! counts as interrupted (75), and a worker whose parent dies (`kill -9`) gets SIGTERM and drains.

use std::ffi::OsString;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::error::{Error, Exit};

/// What `--data-parallel` asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataParallel {
    /// One worker per visible GPU.
    Auto,
    Workers(u32),
}

impl FromStr for DataParallel {
    type Err = String;

    fn from_str(s: &str) -> Result<DataParallel, String> {
        match s {
            "auto" => Ok(DataParallel::Auto),
            _ => match s.parse::<u32>() {
                Ok(n) if n >= 1 => Ok(DataParallel::Workers(n)),
                _ => Err(format!("expected `auto` or a number of workers (1 or more), got {s:?}")),
            },
        }
    }
}

/// One worker: its shard, its GPU (an id of the parent's visible devices) and its CPU threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Worker {
    pub shard: u32,
    pub gpu: Option<String>,
    pub threads: usize,
}

/// How a worker ended: its exit code, or 128 + the signal that killed it (as a shell reports it), except that a
/// worker the forwarded signal killed before it could drain (it had not installed its handlers yet) counts as
/// interrupted: 75, with `signal` saying so. Its units are committed or absent, never half-written, so a rerun
/// resumes it like any drained shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerExit {
    pub worker: Worker,
    pub code: i32,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
}

/// The data-parallel run: every worker's end, the code the parent exits with, and whether it finalized the output.
#[derive(Clone, Debug)]
pub struct ParallelReport {
    pub workers: Vec<WorkerExit>,
    pub code: i32,
    pub finalized: bool,
}

/// The GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set (its ids, as the driver takes them), else the
/// ones `nvidia-smi -L` lists; none on a machine without either.
pub fn visible_gpus(env: impl Fn(&str) -> Option<String>) -> Vec<String> {
    if let Some(list) = env("CUDA_VISIBLE_DEVICES") {
        // An empty list hides every GPU, as it does for CUDA itself.
        return list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
    }
    match Command::new("nvidia-smi").arg("-L").stderr(Stdio::null()).output() {
        Ok(out) if out.status.success() => {
            let count = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("GPU ")).count();
            (0..count).map(|i| i.to_string()).collect()
        }
        _ => Vec::new(),
    }
}

/// The workers for `asked` on a machine with `gpus` visible and `cores` CPU cores: one GPU each while there are
/// GPUs (`auto`: as many workers as GPUs), the cores split evenly.
pub fn plan_workers(asked: &DataParallel, gpus: &[String], cores: usize) -> Result<Vec<Worker>, Error> {
    let n = match asked {
        DataParallel::Auto if gpus.is_empty() => {
            return Err(Error::Usage("--data-parallel auto found no GPU (no CUDA_VISIBLE_DEVICES, and nvidia-smi lists none); give a number of workers to split the CPU cores".into()))
        }
        DataParallel::Auto => gpus.len(),
        DataParallel::Workers(n) => *n as usize,
    };
    if !gpus.is_empty() && n > gpus.len() {
        return Err(Error::Usage(format!("--data-parallel {n}: only {} GPUs are visible (one worker per GPU)", gpus.len())));
    }
    let threads = (cores / n).max(1);
    Ok((0..n).map(|i| Worker { shard: i as u32, gpu: gpus.get(i).cloned(), threads }).collect())
}

/// The worst of the workers' exit codes: any failure (a code other than 0 and 75, the highest of them) over an
/// interrupted, resumable shard (75) over success (0).
pub fn worst(codes: &[i32]) -> i32 {
    let failures = codes.iter().copied().filter(|&c| c != 0 && c != Exit::Partial as i32);
    failures.max().unwrap_or_else(|| if codes.contains(&(Exit::Partial as i32)) { Exit::Partial as i32 } else { 0 })
}

/// A worker's command line: the parent's arguments without `--data-parallel`, `--shards` (and their values) and
/// `--no-progress`, then its shard of `count` and `--no-progress` (workers share the terminal).
pub fn worker_args(parent: &[OsString], shard: u32, count: u32) -> Result<Vec<OsString>, Error> {
    let mut out = Vec::with_capacity(parent.len() + 5);
    let mut skip_value = false;
    for arg in parent {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = arg.to_string_lossy();
        let flag = text.split_once('=').map_or(&*text, |(f, _)| f);
        match flag {
            "--data-parallel" | "--shards" => skip_value = !text.contains('='),
            // Given to every worker below; clap refuses a flag given twice.
            "--no-progress" => {}
            "--shard" => return Err(Error::Usage("--data-parallel runs every shard: it cannot be given --shard".into())),
            _ => out.push(arg.clone()),
        }
    }
    out.extend([format!("--shard={shard}/{count}"), format!("--shards={count}"), "--no-progress".into()].map(OsString::from));
    Ok(out)
}

/// Starts the workers and waits for them, forwarding SIGTERM and SIGINT; finalizes the output (`output_url`) when
/// all completed. `args`: the parent's command line after the program name.
pub fn run(asked: &DataParallel, args: &[OsString], output_url: &str, shards_asked: Option<u32>) -> Result<ParallelReport, Error> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = plan_workers(asked, &visible_gpus(|k| std::env::var(k).ok()), cores)?;
    let count = workers.len() as u32;
    if let Some(shards) = shards_asked.filter(|&s| s != count) {
        return Err(Error::Usage(format!("--shards {shards} disagrees with --data-parallel's {count} workers (a worker runs one shard)")));
    }
    let exe = std::env::current_exe().map_err(|e| Error::Internal(format!("cannot find this program to start the workers: {e}")))?;
    // The signal to forward, set by the I/O runtime's handlers: 0 for none.
    let pending = Arc::new(AtomicI32::new(0));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).thread_name("nightshift-signals").enable_all().build().map_err(|e| Error::Internal(format!("cannot start the signal handlers: {e}")))?;
    watch(&rt, pending.clone())?;
    let mut children: Vec<Running> = Vec::with_capacity(workers.len());
    for w in workers {
        let mut cmd = Command::new(&exe);
        cmd.args(worker_args(args, w.shard, count)?).env("RAYON_NUM_THREADS", w.threads.to_string());
        if let Some(gpu) = &w.gpu {
            cmd.env("CUDA_VISIBLE_DEVICES", gpu);
        }
        stop_with_parent(&mut cmd);
        info!(shard = w.shard, gpu = w.gpu.as_deref().unwrap_or("none"), threads = w.threads, "starting worker {} of {count}", w.shard);
        match cmd.spawn() {
            Ok(child) => children.push(Running { worker: w, child: Some(child), ended: None, forwarded: Vec::new() }),
            Err(e) => {
                // The ones started are stopped as a signal would stop them; their units stay for a rerun.
                warn!("cannot start worker {}: {e}; stopping the others", w.shard);
                pending.store(libc::SIGTERM, Ordering::SeqCst);
                children.push(Running { worker: w, child: None, ended: Some((Exit::Failed as i32, None)), forwarded: Vec::new() });
                break;
            }
        }
    }
    loop {
        let signal = pending.swap(0, Ordering::SeqCst);
        for r in children.iter_mut() {
            let Some(c) = r.child.as_mut() else { continue };
            if signal != 0 {
                forward(c, signal, r.worker.shard);
                r.forwarded.push(signal);
            }
            match c.try_wait() {
                Ok(Some(status)) => {
                    r.ended = Some(ended(status, &r.forwarded));
                    r.child = None;
                }
                Ok(None) => {}
                Err(e) => return Err(Error::Internal(format!("cannot wait for worker {}: {e}", r.worker.shard))),
            }
        }
        if children.iter().all(|r| r.child.is_none()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(rt);
    let workers: Vec<WorkerExit> = children
        .into_iter()
        .map(|r| {
            let (code, signal) = r.ended.unwrap_or((Exit::Failed as i32, None));
            WorkerExit { worker: r.worker, code, signal }
        })
        .collect();
    let mut code = worst(&workers.iter().map(|w| w.code).collect::<Vec<_>>());
    let mut finalized = false;
    if code == 0 && workers.len() == count as usize {
        // The last worker to finish finalized already; this makes sure (it is idempotent).
        match super::finalize(output_url) {
            Ok(_) => finalized = true,
            Err(e) => {
                warn!("every worker completed its shard; finalizing failed: {e}");
                code = e.exit() as i32;
            }
        }
    }
    Ok(ParallelReport { workers, code, finalized })
}

/// A worker while the parent waits: its process until reaped, how it ended, the signals passed on to it.
struct Running {
    worker: Worker,
    child: Option<Child>,
    ended: Option<(i32, Option<i32>)>,
    forwarded: Vec<i32>,
}

/// Makes the worker get SIGTERM (and drain, as for a forwarded one) when the parent dies, whatever killed the
/// parent: a `kill -9`, the OOM killer, or a scheduler that signals the main process only. Without it the
/// workers would run on, orphaned, beside the rerun that resumes the job.
fn stop_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe calls are allowed: it
    // makes two system calls (prctl, getppid) and, when needed, `_exit`, all async-signal-safe, and touches no
    // memory but its copied `parent` integer (no allocation, no lock). PR_SET_PDEATHSIG takes the signal number as
    // an unsigned long and ignores the other arguments. The death signal follows the thread that spawned the child;
    // that is the parent's main thread, which waits for the workers until they have all ended.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died between the fork and the prctl: the signal will never come, so stop now.
            if libc::getppid() != parent {
                libc::_exit(Exit::Partial as i32);
            }
            Ok(())
        });
    }
}

/// A reaped worker's code and the signal that ended it: a worker killed by a signal the parent passed on to it
/// counts as interrupted (75), since it stopped as asked, only before it could drain.
fn ended(status: std::process::ExitStatus, forwarded: &[i32]) -> (i32, Option<i32>) {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(sig) if forwarded.contains(&sig) => (Exit::Partial as i32, Some(sig)),
        Some(sig) => (128 + sig, Some(sig)),
        None => (status.code().unwrap_or(Exit::Failed as i32), None),
    }
}

/// The first and every later SIGTERM or SIGINT, recorded for the wait loop to forward.
fn watch(rt: &tokio::runtime::Runtime, pending: Arc<AtomicI32>) -> Result<(), Error> {
    use tokio::signal::unix::{signal, SignalKind};
    let _guard = rt.enter();
    let cannot = |e: std::io::Error| Error::Internal(format!("cannot install signal handlers: {e}"));
    let mut term = signal(SignalKind::terminate()).map_err(cannot)?;
    let mut int = signal(SignalKind::interrupt()).map_err(cannot)?;
    rt.spawn(async move {
        loop {
            let sig = tokio::select! { _ = term.recv() => libc::SIGTERM, _ = int.recv() => libc::SIGINT };
            warn!(signal = sig, "signal received: passing it on to the workers");
            pending.store(sig, Ordering::SeqCst);
        }
    });
    Ok(())
}

/// Sends `signal` to a worker that has not been waited for.
fn forward(child: &Child, signal: i32, shard: u32) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else { return };
    // SAFETY: kill(2) takes two integers and touches no memory of this process. The pid is a child this process
    // has not reaped (a reaped child's `Child` is dropped above, and only this thread waits for children): until it
    // is reaped the pid stays the child's, even after it exits, so the signal cannot reach another process.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc != 0 {
        warn!(shard, "cannot pass the signal on to worker {shard}: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_parallel_parses_auto_and_counts() {
        assert_eq!("auto".parse(), Ok(DataParallel::Auto));
        assert_eq!("3".parse(), Ok(DataParallel::Workers(3)));
        assert!("0".parse::<DataParallel>().is_err());
        assert!("two".parse::<DataParallel>().is_err());
    }

    #[test]
    fn visible_gpus_follow_cuda_visible_devices() {
        let env = |v: &'static str| move |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| v.to_string());
        assert_eq!(visible_gpus(env("2,3")), ["2", "3"]);
        assert_eq!(visible_gpus(env("GPU-8a1c, GPU-77f0")), ["GPU-8a1c", "GPU-77f0"]);
        assert!(visible_gpus(env("")).is_empty(), "an empty list hides every GPU");
    }

    #[test]
    fn workers_take_a_gpu_each_and_share_the_cores() {
        let gpus: Vec<String> = ["4", "5", "6", "7"].map(String::from).to_vec();
        let auto = plan_workers(&DataParallel::Auto, &gpus, 64).unwrap();
        assert_eq!(auto.len(), 4);
        assert_eq!(auto[2], Worker { shard: 2, gpu: Some("6".into()), threads: 16 });
        let two = plan_workers(&DataParallel::Workers(2), &gpus, 64).unwrap();
        assert_eq!(two.iter().map(|w| w.gpu.clone().unwrap()).collect::<Vec<_>>(), ["4", "5"]);
        assert!(plan_workers(&DataParallel::Workers(5), &gpus, 64).is_err(), "more workers than GPUs");
        assert!(plan_workers(&DataParallel::Auto, &[], 8).is_err(), "auto without a GPU");
        let cpu = plan_workers(&DataParallel::Workers(3), &[], 2).unwrap();
        assert_eq!(cpu.iter().map(|w| (w.gpu.is_none(), w.threads)).collect::<Vec<_>>(), [(true, 1); 3], "at least a thread each");
    }

    /// Real processes: a worker the forwarded SIGTERM kills is interrupted (75); one another signal kills is not.
    #[test]
    fn a_worker_killed_by_the_forwarded_signal_is_interrupted() {
        use std::os::unix::process::ExitStatusExt;
        let killed = |sig: i32| std::process::ExitStatus::from_raw(sig);
        assert_eq!(ended(killed(libc::SIGTERM), &[libc::SIGTERM]), (75, Some(libc::SIGTERM)));
        assert_eq!(ended(killed(libc::SIGKILL), &[libc::SIGTERM]), (137, Some(libc::SIGKILL)));
        assert_eq!(ended(killed(libc::SIGTERM), &[]), (143, Some(libc::SIGTERM)), "nobody forwarded it");
        let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
        forward(&sleeper, libc::SIGTERM, 0);
        assert_eq!(ended(sleeper.wait().unwrap(), &[libc::SIGTERM]), (75, Some(libc::SIGTERM)));
        let exited = Command::new("sh").args(["-c", "exit 4"]).status().unwrap();
        assert_eq!(ended(exited, &[libc::SIGTERM]), (4, None));
    }

    /// A child started with [`stop_with_parent`] gets SIGTERM when its parent goes. The kernel sends the death
    /// signal when the thread that spawned the child exits (for `run`, the main thread: the process), so a thread
    /// that spawns a `sleep` and returns stands in for a parent killed with `kill -9`.
    #[test]
    fn a_worker_stops_when_its_parent_dies() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut cmd = Command::new("sleep");
            cmd.arg("30");
            stop_with_parent(&mut cmd);
            tx.send(cmd.spawn().unwrap()).unwrap();
        })
        .join()
        .unwrap();
        let mut child = rx.recv().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(std::time::Instant::now() < deadline, "the child outlived the thread that started it");
            std::thread::sleep(Duration::from_millis(10));
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM));
    }

    #[test]
    fn the_worst_code_wins() {
        assert_eq!(worst(&[0, 0]), 0);
        assert_eq!(worst(&[0, 75]), 75);
        assert_eq!(worst(&[75, 4, 0]), 4);
        assert_eq!(worst(&[1, 137, 75]), 137);
    }

    #[test]
    fn worker_args_replace_the_parallel_flags_with_a_shard() {
        let os = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let args = worker_args(&os(&["run", "job.toml", "--data-parallel", "2", "--shards=2", "--show", "3"]), 1, 2).unwrap();
        assert_eq!(args, os(&["run", "job.toml", "--show", "3", "--shard=1/2", "--shards=2", "--no-progress"]));
        let args = worker_args(&os(&["--log-format", "json", "run", "--data-parallel=auto", "job.toml"]), 0, 4).unwrap();
        assert_eq!(args, os(&["--log-format", "json", "run", "job.toml", "--shard=0/4", "--shards=4", "--no-progress"]));
        assert!(worker_args(&os(&["run", "job.toml", "--data-parallel", "2", "--shard", "0/2"]), 0, 2).is_err());
        let args = worker_args(&os(&["run", "job.toml", "--no-progress", "--data-parallel", "2"]), 0, 2).unwrap();
        assert_eq!(args, os(&["run", "job.toml", "--shard=0/2", "--shards=2", "--no-progress"]), "given once");
    }
}
