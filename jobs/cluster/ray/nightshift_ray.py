#!/usr/bin/env python3
"""Run a nightshift job on a Ray cluster: one Ray task per shard, retried where a retry can help, then finalize.

    python jobs/cluster/ray/nightshift_ray.py JOB_FILE --shards 8 [--gpus-per-shard 1 | --cpus-per-shard 8]
        [--address auto] [--nightshift nightshift] [--max-retries 5] [-- nightshift run arguments ...]

Each shard is `nightshift run JOB_FILE --shard i/N --no-progress ARGS` in a Ray task on some node (one GPU each with
--gpus-per-shard, so Ray places them one per GPU; --cpus-per-shard cores otherwise), its output streamed to this
driver a line at a time, prefixed with the shard. A shard whose nightshift exits 75 (interrupted, resumable) or 1
is retried, and so is one whose node or worker is lost (Ray's `max_retries`): the rerun resumes from its committed
units. Exits 2 to 5 (a bad job file, input, model or output) are not retried: they would fail again. When every
shard is done, `nightshift finalize OUTPUT` completes the output (the last shard usually has already); the driver
exits with nightshift's codes: 0 complete; where a shard gave up, its exit code (75 for a lost node or worker), a
failure outranking 75 as `run --data-parallel` ranks its workers.

The nightshift binary and the job file must be at the same paths on every node (a shared file system, or an
image), as with Slurm; the input, output and model are URLs every node can reach (or a shared directory).
"""

import os

# Each shard's lines as they come: Ray otherwise folds lines that look alike across tasks ("repeated 4x across
# cluster"), which would hide which shards have finished. Set before Ray starts its log streaming.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import argparse
import ctypes
import signal
import subprocess
import sys
import tomllib

import ray

RETRIED = {75, 1}


class ShardExit(Exception):
    """A shard's nightshift exited with a failing code."""

    def __init__(self, shard, code):
        super().__init__(shard, code)  # both in `args`, so that Ray can pickle it back to the driver
        self.shard, self.code = shard, code

    def __str__(self):
        return f"shard {self.shard} exited {self.code}"


class Resumable(ShardExit):
    """Exit 75 or 1: worth running again (it resumes from its committed units)."""


class Permanent(ShardExit):
    """A code a retry cannot change (2 to 5)."""


def _die_with_parent():
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@ray.remote
def run_shard(nightshift, job, shard, shards, args):
    command = [nightshift, "run", job, "--shard", f"{shard}/{shards}", "--no-progress", *args]
    # If the Ray worker dies (its node lost, the process killed), nightshift gets SIGTERM and drains (Linux's
    # parent-death signal), so it does not run on beside the retry.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
    for line in process.stdout:
        print(f"[shard {shard}/{shards}] {line}", end="", flush=True)
    code = process.wait()
    if code in RETRIED:
        raise Resumable(f"{shard}/{shards}", code)
    if code != 0:
        raise Permanent(f"{shard}/{shards}", code)
    return shard


def output_url(job, args):
    """The output the job writes: `--output` among the run arguments, else the job file's `output.url`."""
    for i, arg in enumerate(args):
        if arg == "--output" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--output="):
            return arg.split("=", 1)[1]
    with open(job, "rb") as f:
        return tomllib.load(f)["output"]["url"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", help="the job file (at this path on every node)")
    parser.add_argument("--shards", type=int, required=True, help="how many shards (Ray tasks)")
    parser.add_argument("--gpus-per-shard", type=float, default=0, help="GPUs per shard (1 on GPU nodes)")
    parser.add_argument("--cpus-per-shard", type=float, default=1, help="cores per shard when it has no GPU")
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: the one this node belongs to)")
    parser.add_argument("--nightshift", default="nightshift", help="the nightshift binary (on every node)")
    parser.add_argument("--max-retries", type=int, default=5, help="retries per shard (lost nodes and exits 75, 1)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    options, args = parser.parse_args(argv[:split]), argv[split + 1 :]

    ray.init(address=options.address, log_to_driver=True)
    resources = {"num_gpus": options.gpus_per_shard} if options.gpus_per_shard else {"num_cpus": options.cpus_per_shard}
    task = run_shard.options(max_retries=options.max_retries, retry_exceptions=[Resumable], **resources)
    pending = {task.remote(options.nightshift, options.job, i, options.shards, args): i for i in range(options.shards)}
    codes = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        shard = pending.pop(done[0])
        try:
            ray.get(done[0])
            print(f"nightshift-ray: shard {shard}/{options.shards} done", flush=True)
        except (ShardExit, ray.exceptions.RayError) as e:
            # Ray raises a task's exception wrapped, with the original as `cause`; a lost worker or node has no code.
            cause = getattr(e, "cause", None) or e
            code = getattr(cause, "code", 75)
            retried = "not retried" if isinstance(cause, Permanent) else "after its retries"
            print(f"nightshift-ray: shard {shard}/{options.shards} gave up ({retried}): exit {code}: {cause}", file=sys.stderr, flush=True)
            codes.append(code)
    # A failure outranks a resumable stop (75), as `run --data-parallel` ranks its workers.
    if codes:
        sys.exit(max((c for c in codes if c != 75), default=75))
    code = subprocess.call([options.nightshift, "finalize", output_url(options.job, args)])
    sys.exit(code)


if __name__ == "__main__":
    main()
