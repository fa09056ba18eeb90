#!/usr/bin/env python3
"""How closely nightshift computes a GGUF model compared with llama.cpp, on llama.cpp's own greedy continuations.

1. llama-server (the chat template from the GGUF, `--jinja`, applied by its `/apply-template`) answers every
   prompt (`/completion`): greedily, or sampled at `--temperature` (seeded) for a random-weight model, whose greedy
   answers repeat one token; it returns the token ids it chose, the log-probability of each and its most likely
   token at each position.
2. A nightshift scoring job (`input.completion_column`, `generation.logprobs = 1`) scores the same token ids
   (a `list<int64>` completion column: the answer as generated, not its text tokenized again, which a random-weight
   model's answers would not survive) under the same prompts, once per `runtime.cpu_weights` layout and
   `runtime.kv_cache_dtype` asked for.
3. With `--llama-baseline`, llama-server scores the same answers too, one request per answer position (the
   prompt and the answer so far in one prompt-processing pass, as a scoring job does, against the one-token
   decode steps that wrote the answer): how closely llama.cpp agrees with itself across its two paths, the floor
   for any other implementation; and nightshift against llama.cpp teacher-forced (both scoring from the whole
   prefix). Slow: a prompt pass per answer token (about 15 minutes for 48 answers on 2 cores).
4. Per layout: top-1 agreement (the share of answer positions where nightshift's most likely token is
   llama.cpp's most likely token: the token it chose, for greedy answers) and the mean absolute difference of the
   chosen tokens' log-probabilities.

The prompts are the sample tickets (jobs/data/tickets.parquet) under four instructions each (48 prompts), or the
`prompt` column of `--prompts FILE`. Needs pyarrow (pip install pyarrow); nightshift itself does not.

  scripts/fidelity-llama.py --server PATH/llama-server --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --nightshift target/release/nightshift --layouts as-stored,fast,q8_0 --kv-cache-dtypes auto,f32
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

from llama_server import post, serve

INSTRUCTIONS = [
    "Summarise the ticket above in one short sentence.",
    "Which team should handle the ticket above? Answer in a few words, then explain why.",
    "Write a short, polite reply to the customer who sent the ticket above.",
    "List the facts stated in the ticket above as bullet points.",
]


def prompts_of(args):
    if args.prompts:
        return pq.read_table(args.prompts, columns=["prompt"]).column("prompt").to_pylist()[: args.rows]
    texts = pq.read_table("jobs/data/tickets.parquet", columns=["text"]).column("text").to_pylist()
    return [f"Support ticket:\n{t}\n\n{i}" for i in INSTRUCTIONS for t in texts][: args.rows]


def llama_answers(args, prompts):
    """llama-server's answer to each prompt: (text, token ids, log-probability of each chosen token, its most likely
    token at each position)."""
    with serve(args.server, args.model, args.threads, args.slots, args.slots * 2048, args.port, ["--jinja", *args.server_arg]) as base:
        def one(prompt):
            chat = post(base + "/apply-template", {"messages": [{"role": "user", "content": prompt}]})["prompt"]
            sampling = {"temperature": 0.0, "top_k": 1} if args.temperature == 0 else {"temperature": args.temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
            body = {"prompt": chat, "n_predict": args.max_new, "seed": args.seed, "n_probs": 2, "return_tokens": True, "cache_prompt": False, **sampling}
            answer = post(base + "/completion", body)
            probs = answer.get("completion_probabilities") or []
            ids = [p["id"] for p in probs]
            logprobs = [p["logprob"] for p in probs]
            tops = [p["top_logprobs"][0]["id"] for p in probs]
            # How far llama.cpp's most likely token leads the next: the logits' peakedness, which makes top-1
            # agreement meaningful (near-ties flip on rounding) or not.
            margins = [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in probs if len(p["top_logprobs"]) > 1]
            # The end-of-generation token, when the answer ended by itself, is scored but not part of the answer.
            if len(ids) > len(answer.get("tokens") or []):
                ids = ids[: len(answer["tokens"])]
            return answer.get("content") or "", ids, logprobs, tops, margins

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.slots) as pool:
            return list(pool.map(one, prompts))


def nightshift_scores(args, work, prompts, answers, layout, kv):
    """Per row id: [(token id, log-probability, most likely token id)] of the answer, as nightshift scores it."""
    rows = [(f"p{i:03}", p, a[1]) for i, (p, a) in enumerate(zip(prompts, answers)) if a[1]]
    data = os.path.join(work, "in.parquet")
    completions = pa.array([r[2] for r in rows], type=pa.list_(pa.int64()))
    pq.write_table(pa.table({"id": [r[0] for r in rows], "prompt": [r[1] for r in rows], "completion": completions}), data)
    out = os.path.join(work, f"out-{layout}-{kv}")
    job = os.path.join(work, f"job-{layout}-{kv}.toml")
    with open(job, "w") as f:
        f.write(f"""[input]
url = {json.dumps(data)}
id_column = "id"
completion_column = "completion"

[model]
path = {json.dumps(os.path.abspath(args.nightshift_model or args.model))}

[generation]
logprobs = 1

[output]
url = {json.dumps(out)}

[runtime]
device = "cpu"
cpu_weights = "{layout}"
kv_cache_dtype = "{kv}"
threads = {args.threads}
""")
    run = subprocess.run([args.nightshift, "run", job], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"nightshift failed ({run.returncode}) on layout {layout}, KV cache {kv}:\n{run.stderr[-3000:]}")
    scores = {}
    manifest = json.load(open(os.path.join(out, "_manifest.json")))
    for name in manifest["results"]:
        for row in pq.read_table(os.path.join(out, name), columns=["id", "status", "logprobs"]).to_pylist():
            if row["status"] != "succeeded":
                sys.exit(f"row {row['id']} failed under layout {layout}")
            scores[row["id"]] = [(t["token_id"], t["logprob"], t["top"][0]["token_id"]) for t in row["logprobs"]]
    return scores


def llama_scores(args, prompts, answers):
    """Per row id: [(token id, log-probability or None, most likely token id)] of llama.cpp's answer, as llama-server
    itself scores it, each position by a request whose prompt is the chat prompt and the answer's tokens before it
    (not cached, so the whole prefix is one prompt-processing pass)."""
    scores = {}
    with serve(args.server, args.model, args.threads, 1, 4096, args.port, ["--jinja", *args.server_arg]) as base:
        for i, (prompt, (text, ids, _, _, _)) in enumerate(zip(prompts, answers)):
            if not ids:
                continue
            chat = post(base + "/apply-template", {"messages": [{"role": "user", "content": prompt}]})["prompt"]
            row = []
            for j, token in enumerate(ids):
                body = {"prompt": [chat, *ids[:j]] if j else chat, "n_predict": 1, "n_probs": 10, "temperature": 0.0,
                        "top_k": 1, "cache_prompt": False, "return_tokens": True}
                # No probabilities come back where the most likely token ends generation: that position is skipped.
                probs = (post(base + "/completion", body).get("completion_probabilities") or [None])[0]
                if probs is None:
                    row.append((token, None, None))
                    continue
                logprob = next((t["logprob"] for t in probs["top_logprobs"] if t["id"] == token), None)
                row.append((token, logprob, probs["id"]))
            scores[f"p{i:03}"] = row
    return scores


def compare(answers, scores):
    positions = agree = same_rows = compared_rows = 0
    diffs = []
    for i, (text, ids, logprobs, tops, _) in enumerate(answers):
        row = scores.get(f"p{i:03}")
        if row is None:
            continue
        compared_rows += 1
        positions += len(row)
        agree += sum(1 for (_, _, top), llama_top in zip(row, tops) if top == llama_top)
        # llama.cpp's log-probabilities end with the end-of-turn token's when the answer ended by itself.
        if [t for t, _, _ in row] == ids and len(logprobs) in (len(ids), len(ids) + 1):
            same_rows += 1
            diffs.extend(abs(lp - ref) for (_, lp, _), ref in zip(row, logprobs) if lp is not None)
    return {
        "rows": compared_rows, "positions": positions, "top1_agreement": agree / max(positions, 1),
        "rows_same_tokens": same_rows, "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
    }


def teacher_forced(scores, teacher):
    """nightshift's scores against llama.cpp's teacher-forced ones (each position's prefix in one prompt pass, as
    nightshift scores it): top-1 agreement and mean absolute log-probability difference, where llama.cpp gave one."""
    positions = agree = 0
    diffs = []
    for key, row in scores.items():
        for (_, lp, top), (_, ref_lp, ref_top) in zip(row, teacher.get(key, [])):
            if ref_top is None:
                continue
            positions += 1
            agree += top == ref_top
            if lp is not None and ref_lp is not None:
                diffs.append(abs(lp - ref_lp))
    return {"positions": positions, "top1_agreement": agree / max(positions, 1), "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="llama-server binary")
    ap.add_argument("--model", required=True, help="the GGUF file both run")
    ap.add_argument("--nightshift", default="target/release/nightshift")
    ap.add_argument("--nightshift-model", help="the GGUF nightshift scores with, if not --model (scripts/break-gguf.py's broken copies)")
    ap.add_argument("--layouts", default="as-stored,fast,q8_0", help="runtime.cpu_weights values, comma-separated")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="runtime.kv_cache_dtype values, comma-separated")
    ap.add_argument("--prompts", help="a Parquet file with a `prompt` column (default: the sample tickets, 48 prompts)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18081)
    ap.add_argument("--temperature", type=float, default=0.0, help="sample llama.cpp's answers (0: greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-baseline", action="store_true", help="also have llama-server score its own answers (slow)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more llama-server argument (repeat it; --server-arg=--cache-type-k --server-arg=f32)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    prompts = prompts_of(args)
    answers = llama_answers(args, prompts)
    margins = sorted(m for a in answers for m in a[4])
    report = {"model": args.model, "prompts": len(prompts), "max_new": args.max_new, "layouts": {},
              "median_top1_margin": margins[len(margins) // 2] if margins else None,
              "share_margin_below_0_1": sum(1 for m in margins if m < 0.1) / max(len(margins), 1)}
    scored = {}
    with tempfile.TemporaryDirectory(prefix="nightshift-fidelity-") as work:
        for layout in args.layouts.split(","):
            for kv in args.kv_cache_dtypes.split(","):
                name = layout if kv == "auto" else f"{layout}, kv_cache_dtype {kv}"
                scored[name] = nightshift_scores(args, work, prompts, answers, layout, kv)
                report["layouts"][name] = compare(answers, scored[name])
    if args.llama_baseline:
        teacher = llama_scores(args, prompts, answers)
        report["layouts"]["llama.cpp itself (baseline)"] = compare(answers, teacher)
        # nightshift against llama.cpp teacher-forced: both computing each position from the whole prefix at once.
        report["teacher_forced"] = {name: teacher_forced(s, teacher) for name, s in scored.items()}
    if args.json:
        print(json.dumps(report))
        return
    how = "greedy" if args.temperature == 0 else f"sampled (temperature {args.temperature}, seed {args.seed})"
    print(f"{args.model}: {len(prompts)} prompts, llama.cpp's {how} answers (at most {args.max_new} tokens) scored by nightshift")
    if report["median_top1_margin"] is not None:
        print(f"llama.cpp's top token leads the next by {report['median_top1_margin']:.2f} nats at the median position; by less than 0.1 at {100 * report['share_margin_below_0_1']:.1f} % of positions")
    print("| runtime.cpu_weights | positions | top-1 agreement | answers tokenized alike | mean abs logprob diff |")
    print("|---|---:|---:|---:|---:|")
    for layout, r in report["layouts"].items():
        diff = "n/a" if r["mean_abs_logprob_diff"] is None else f"{r['mean_abs_logprob_diff']:.4f}"
        print(f"| {layout} | {r['positions']} | {100 * r['top1_agreement']:.1f} % | {r['rows_same_tokens']} of {r['rows']} | {diff} |")
    if "teacher_forced" in report:
        print("\nAgainst llama.cpp teacher-forced (llama-server scoring each answer position from its whole prefix in one pass):")
        print("| runtime.cpu_weights | positions | top-1 agreement | mean abs logprob diff |")
        print("|---|---:|---:|---:|")
        for layout, r in report["teacher_forced"].items():
            diff = "n/a" if r["mean_abs_logprob_diff"] is None else f"{r['mean_abs_logprob_diff']:.4f}"
            print(f"| {layout} | {r['positions']} | {100 * r['top1_agreement']:.1f} % | {diff} |")


if __name__ == "__main__":
    main()
