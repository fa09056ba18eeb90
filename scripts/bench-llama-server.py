#!/usr/bin/env python3
"""Runs a saved `nightshift bench generate --save-workload FILE` workload through llama.cpp's llama-server.

Starts llama-server on the same GGUF with continuous batching and SLOTS parallel slots, sends every request at
once (as an offline batch would), waits for all of them, and prints the figures nightshift's bench prints:
requests/s, total and output tokens/s. Standard library only.

  scripts/bench-llama-server.py --server PATH/llama-server --model models/X.gguf --workload w.jsonl --slots 16 --threads 2
"""
import argparse
import concurrent.futures
import json
import time

from llama_server import post, serve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--cache-prompt", action="store_true",
                    help="let each slot reuse the KV cache of the prompt it ran before (llama-server's prompt cache)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    rows = [json.loads(line) for line in open(args.workload) if line.strip()]
    longest = max(len(r["prompt"]) + r["max_new"] for r in rows)
    # Each slot gets its own context of the longest request.
    ctx = args.slots * (longest + 16)
    extra = ["-b", "2048", "-ub", "512", "--cont-batching"]
    with serve(args.server, args.model, args.threads, args.slots, ctx, args.port, extra) as base:
        def one(row):
            body = {"prompt": row["prompt"], "n_predict": row["max_new"], "ignore_eos": row["ignore_eos"],
                    "temperature": 0.0, "cache_prompt": args.cache_prompt}
            r = post(base + "/completion", body, timeout=7200)
            # timings.prompt_n: the prompt tokens it computed (the rest came from the slot's cache).
            return r["tokens_evaluated"], r["tokens_predicted"], r.get("timings", {}).get("prompt_n", r["tokens_evaluated"])

        started = time.time()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(rows)) as pool:
            results = list(pool.map(one, rows))
        seconds = time.time() - started
    prompt = sum(r[0] for r in results)
    output = sum(r[1] for r in results)
    computed = sum(r[2] for r in results)
    report = {
        "peer": "llama-server", "slots": args.slots, "cache_prompt": args.cache_prompt, "rows": len(rows), "prompt_tokens": prompt, "computed_prompt_tokens": computed, "output_tokens": output,
        "seconds": seconds, "requests_per_s": len(rows) / seconds, "total_tokens_per_s": (prompt + output) / seconds,
        "output_tokens_per_s": output / seconds,
    }
    if args.json:
        print(json.dumps(report))
    else:
        cache = ", prompt cache on" if args.cache_prompt else ""
        print(f"llama-server, {args.slots} slots{cache}: {len(rows)} rows, {prompt} prompt ({computed} computed) and {output} output tokens in {seconds:.1f} s: "
              f"{report['requests_per_s']:.2f} requests/s, {report['total_tokens_per_s']:.1f} total tokens/s, "
              f"{report['output_tokens_per_s']:.1f} output tokens/s")


if __name__ == "__main__":
    main()
