#!/usr/bin/env python3
"""Incremental nightly runs (issue #20), measured on the sample model: night 1 computes every row; night 2 (10 % of
prompts changed, 5 % removed, 5 % new) reuses night 1 with `--reuse`; the same night 2 computed from scratch; a
run where 30 % of rows repeat another row's prompt. Then the reuse lookup's cost at scale: `nightshift plan
--reuse` against forged sources of 1, 3 and 10 million request keys (time to read the keys, peak memory).

    python3 scripts/bench-reuse.py [--rows 2000] [--max-new 32] [--scale 1000000,3000000,10000000]

Writes under target/bench-reuse/ and prints a Markdown table for BENCHMARKS.md. Needs pyarrow and a release
build (`cargo build --release`).
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

TICKETS = [
    "The printer on the third floor jams every time someone prints more than ten pages.",
    "I was charged twice for my March subscription. Please refund the duplicate payment.",
    "After the latest update the mobile app crashes as soon as I open the settings screen.",
    "Our team cannot access the shared drive since this morning: the network path was not found.",
    "I would like to change the delivery address for my order to my office. It has not shipped yet.",
    "The password reset email never arrives. I checked the spam folder and tried three times.",
    "The conference room projector shows no signal when we connect a laptop over HDMI.",
    "Can you extend my free trial by one week? I was travelling and could not test the reports.",
    "The invoice PDF for February is blank when I download it from the billing page.",
    "Two of our new hires have not received their laptops. They start on Monday.",
    "The website checkout page is very slow today. Payments take more than a minute.",
    "Please cancel my subscription at the end of the current billing period and confirm by email.",
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Emil", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kemal", "Lena", "Mo"]
CITIES = ["Leeds", "Lyon", "Porto", "Graz", "Turku", "Gdansk", "Cork", "Bilbao", "Brno"]


def prompt(i, variant=0):
    ticket = TICKETS[i % len(TICKETS)]
    who = f"{NAMES[(i // 12) % len(NAMES)]} from {CITIES[(i // 7) % len(CITIES)]}"
    note = "" if variant == 0 else f" Update {variant}: still not solved, please hurry."
    return f"Support ticket {i} from {who}:\n{ticket}{note}\n\nSummarise the ticket above in one short sentence."


def write_input(path, ids, prompts):
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path)


def job_file(path, input_path, output, max_new):
    model = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_text(
        f'[input]\nurl = "{input_path}"\nid_column = "id"\nprompt_column = "prompt"\n\n[model]\npath = "{model}"\n\n'
        f'[generation]\nmax_new_tokens = {max_new}\n\n[output]\nurl = "{output}"\n'
    )
    return path


def run(binary, args, timed=True):
    started = time.monotonic()
    proc = subprocess.run(["/usr/bin/time", "-v", str(binary), *args], capture_output=True, text=True, env={**os.environ, "RUST_LOG": "warn"})
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"nightshift {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    return proc.stdout, seconds, rss


def metrics(output):
    manifest = json.loads((output / "_manifest.json").read_text())
    table = pa.concat_tables([pq.read_table(output / f) for f in manifest["metrics"]])
    return {c: sum(table[c].to_pylist()) for c in ("rows", "computed_rows", "reused_rows", "deduplicated_rows", "completion_tokens")}


def results(output):
    manifest = json.loads((output / "_manifest.json").read_text())
    table = pa.concat_tables([pq.read_table(output / f) for f in manifest["results"]])
    return {row["id"]: row for row in table.to_pylist()}


OWN = {"id", "queue_s", "ttft_s", "e2e_s", "tpot_s", "request_key", "duplicate_of", "reused_from"}


def computed_part(row):
    return {k: v for k, v in row.items() if k not in OWN}


def forge_source(dest, template, keys, numerics, unit_rows=2048):
    """An output that looks complete to a reuse lookup: night 1's plan, `keys` succeeded rows with random request
    keys in result files of `unit_rows` rows (the default `output.unit_rows`), a manifest and `_SUCCESS`."""
    files = -(-keys // unit_rows)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "data").mkdir(parents=True)
    shutil.copy(template / "_plan.json", dest / "_plan.json")
    per = -(-keys // files)
    names, units = [], []
    for f in range(files):
        n = min(per, keys - f * per)
        if n <= 0:
            break
        hexes = pa.array([h.hex() for h in (blob[i:i + 32] for blob in [os.urandom(32 * n)] for i in range(0, 32 * n, 32))])
        table = pa.table({"id": pa.array([f"f{f}-{i}" for i in range(n)]), "status": pa.array(["succeeded"] * n), "request_key": hexes})
        table = table.replace_schema_metadata({"nightshift.numerics": numerics})
        name = f"data/u{f:06d}.parquet"
        pq.write_table(table, dest / name, compression="zstd")
        names.append(name)
        units.append({"unit": f, "shard": 0, "attempt": "forged", "results": name, "metrics": "", "rows": n, "succeeded_rows": n,
                      "errored_rows": 0, "prompt_tokens": 0, "completion_tokens": 0})
    manifest = json.loads((template / "_manifest.json").read_text())
    manifest.update(results=names, metrics=[], units=units, rows=keys, succeeded_rows=keys, errored_rows=0)
    (dest / "_manifest.json").write_text(json.dumps(manifest))
    (dest / "_SUCCESS").write_text("")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--binary", default=str(REPO / "target" / "release" / "nightshift"))
    ap.add_argument("--scale", default="1000000,3000000,10000000", help="source keys for the lookup's cost; empty to skip")
    ap.add_argument("--skip-full", action="store_true", help="skip night 2 computed from scratch")
    ap.add_argument("--only-scale", action="store_true", help="only the lookup's cost, against the outputs of an earlier run of this script")
    a = ap.parse_args()
    work = REPO / "target" / "bench-reuse"
    if a.only_scale:
        scale(a, work)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    n = a.rows
    ids = [f"t{i:06d}" for i in range(n)]
    write_input(work / "night1.parquet", ids, [prompt(i) for i in range(n)])
    ids2, prompts2, changed = [], [], set()
    for i in range(n):
        if i % 20 == 0:
            continue
        if i % 10 == 1:
            prompts2.append(prompt(i, variant=1))
            changed.add(ids[i])
        else:
            prompts2.append(prompt(i))
        ids2.append(ids[i])
    for i in range(n, n + n // 20):
        ids2.append(f"t{i:06d}")
        prompts2.append(prompt(i))
        changed.add(ids2[-1])
    write_input(work / "night2.parquet", ids2, prompts2)
    dup_prompts = [prompt(i - 1 if i % 10 in (3, 6, 9) else i) for i in range(n)]
    write_input(work / "dups.parquet", ids, dup_prompts)

    out = {}
    for name, inp in [("night1", "night1"), ("night2", "night2"), ("night2-full", "night2"), ("dups", "dups")]:
        out[name] = (job_file(work / f"{name}.toml", work / f"{inp}.parquet", work / name, a.max_new), work / name)
    table = []
    _, s1, r1 = run(a.binary, ["run", str(out["night1"][0])])
    m1 = metrics(out["night1"][1])
    table.append(("night 1", n, m1, s1, r1))
    plan, _, _ = run(a.binary, ["plan", str(out["night2"][0]), "--reuse", str(out["night1"][1]), "--calibration-rows", "0", "--json"])
    planned = json.loads(plan)["reuse"]["reused_rows"]
    _, s2, r2 = run(a.binary, ["run", str(out["night2"][0]), "--reuse", str(out["night1"][1])])
    m2 = metrics(out["night2"][1])
    table.append(("night 2, `--reuse` night 1", len(ids2), m2, s2, r2))
    if not a.skip_full:
        _, s3, r3 = run(a.binary, ["run", str(out["night2-full"][0])])
        table.append(("night 2 from scratch", len(ids2), metrics(out["night2-full"][1]), s3, r3))
    _, s4, r4 = run(a.binary, ["run", str(out["dups"][0])])
    m4 = metrics(out["dups"][1])
    table.append(("30 % duplicates", n, m4, s4, r4))

    night1, night2 = results(out["night1"][1]), results(out["night2"][1])
    unchanged = [i for i in ids2 if i not in changed]
    identical = sum(computed_part(night2[i]) == computed_part(night1[i]) for i in unchanged)
    same_as_full = None
    if not a.skip_full:
        full = results(out["night2-full"][1])
        same_as_full = sum(computed_part(night2[i]) == computed_part(full[i]) for i in ids2)
    distinct = len(set(dup_prompts))

    print(f"| run | rows | computed | reused | deduplicated | output tokens computed | wall s | peak RSS MiB |")
    print(f"|---|---|---|---|---|---|---|---|")
    for label, rows, m, s, r in table:
        print(f"| {label} | {rows} | {m['computed_rows']} | {m['reused_rows']} | {m['deduplicated_rows']} | {m['completion_tokens']} | {s:.1f} | {r >> 20} |")
    print()
    print(f"night 2: {len(changed)} rows changed or new, {len(unchanged)} unchanged; `plan` said {planned} would be reused")
    print(f"night 2 wall / night 1 wall: {s2 / s1:.3f}")
    print(f"unchanged rows byte-identical to night 1 (every column but id, timings, reuse columns): {identical} of {len(unchanged)}")
    if same_as_full is not None:
        print(f"night 2 with reuse equal to night 2 from scratch: {same_as_full} of {len(ids2)} rows")
    print(f"30 % duplicates: {distinct} distinct prompts of {n}; computed {m4['computed_rows']}")

    scale(a, work)


def scale(a, work):
    """`nightshift plan --reuse` against forged sources of each size in `--scale`: seconds to read the keys and
    peak memory over the same plan without a source."""
    scales = [int(x) for x in a.scale.split(",") if x]
    if not scales:
        return
    night1, job2 = work / "night1", work / "night2.toml"
    numerics = pq.read_schema(night1 / json.loads((night1 / "_manifest.json").read_text())["results"][0]).metadata[b"nightshift.numerics"].decode()
    _, base_s, base_rss = run(a.binary, ["plan", str(job2), "--calibration-rows", "0", "--json"])
    print()
    print(f"plan without a source: {base_s:.2f} s, peak RSS {base_rss >> 20} MiB")
    print("| source keys | source files MiB | plan wall s | read keys s | plan peak RSS MiB | over plan without reuse MiB | bytes per key |")
    print("|---|---|---|---|---|---|---|")
    for keys in scales:
        src = work / f"forged-{keys}"
        forge_source(src, night1, keys, numerics)
        size = sum(p.stat().st_size for p in (src / "data").iterdir())
        plan, secs, rss = run(a.binary, ["plan", str(job2), "--reuse", str(src), "--calibration-rows", "0", "--json"])
        r = json.loads(plan)["reuse"]
        assert r["source_keys"] == keys, r
        extra = rss - base_rss
        print(f"| {keys:,} | {size >> 20} | {secs:.2f} | {r['index_seconds']:.2f} | {rss >> 20} | {extra >> 20} | {extra / keys:.0f} |", flush=True)
        shutil.rmtree(src)


if __name__ == "__main__":
    main()
