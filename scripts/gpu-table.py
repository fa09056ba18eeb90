#!/usr/bin/env python3
"""The table of scripts/gpu-check.sh, from what it left in OUT_DIR: parity-*.log, bench-*.log, long-*.log, xl-*.log
and tiled-*.log (each holding one
JSON line from `nightshift bench ... --json`), peer.json and roofline.json (scripts/gpu-peer.py), model-config.json
and env.txt. Prints Markdown; a figure whose step failed or was skipped shows as "n/a".

  gpu-table.py OUT_DIR
"""

import glob
import json
import os
import re
import sys


def last_json(path):
    """The last line of a log that parses as a JSON object, or None."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None


def fmt(x, spec, unit=""):
    return "n/a" if x is None else format(x, spec) + unit


def main(out):
    env = open(os.path.join(out, "env.txt")).read() if os.path.exists(os.path.join(out, "env.txt")) else ""
    config = load(os.path.join(out, "model-config.json")) or {}
    roof = load(os.path.join(out, "roofline.json"))
    peer = load(os.path.join(out, "peer.json"))
    peer_runs = {r["batch"]: r for r in (peer or {}).get("runs", [])}
    prompt = int(re.search(r"prompt (\d+)", env).group(1)) if re.search(r"prompt (\d+)", env) else None
    new = int(re.search(r"new (\d+)", env).group(1)) if re.search(r"new (\d+)", env) else None

    print("## GPU check\n")
    for line in env.splitlines():
        if line.startswith(("date:", "commit:", "device:")) or "," in line and "NVIDIA" in line:
            print(f"- {line}")
    if roof:
        print(f"- measured ceilings: copy bandwidth {roof['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {roof['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s ({roof['device']})")
    if peer:
        print(f"- peer: transformers {peer.get('transformers')} generate, torch {peer.get('torch')}, bf16, "
              f"{peer.get('parameters', 0) / 1e9:.3f} B parameters")
    print()

    print("### (a) Parity: the GPU's paged path against the CPU path in f32, and batched against alone\n")
    print("| model | dtype | comparison | max \\|diff\\| / max \\|logit\\| | allowed | argmax agrees | verdict |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(out, "parity-*.log"))):
        r = last_json(path)
        name = os.path.basename(path)[len("parity-"):-len(".log")]
        if not r:
            print(f"| {name} | | (no report: see {os.path.basename(path)}) | | | | failed |")
            continue
        model = os.path.basename(r["model"].rstrip("/"))
        for c in r["comparisons"]:
            print(f"| {model} | {r['dtype']} | {c['name']} | {c['max_rel_diff']:.2e} | {c['max_rel_diff_allowed']:.0e} | "
                  f"{c['argmax_agree']}/{c['positions']} | {'ok' if c['pass'] else 'OUT OF TOLERANCE'} |")
    print()

    layers = config.get("num_hidden_layers")
    kv_heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
    head_dim = config.get("head_dim") or (config["hidden_size"] // config["num_attention_heads"] if config else None)
    kv_per_token = 2 * layers * kv_heads * head_dim * 2 if layers and kv_heads and head_dim else None
    bw = roof["memory_bandwidth_bytes_per_s"] if roof else None
    flops = roof["bf16_matmul_flops_per_s"] if roof else None

    print(f"### (b-d) Fixed-length generation ({prompt} prompt + {new} new tokens per row, batch = rows), "
          "against transformers and the roofline\n")
    print("| batch | nightshift output tok/s | transformers output tok/s | ratio | nightshift decode step | "
          "bandwidth floor | x floor | FLOP floor | nightshift TTFT p50 | host ms/step | attention | GPU memory in use |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for path in sorted(glob.glob(os.path.join(out, "bench-*.log")), key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0])):
        batch = int(re.findall(r"\d+", os.path.basename(path))[0])
        r = last_json(path)
        p = peer_runs.get(batch)
        ours = r["output_tokens_per_s"] if r else None
        theirs = p["output_tokens_per_s"] if p else None
        ratio = ours / theirs if ours and theirs else None
        step_ms = batch / r["decode_tokens_per_s"] * 1e3 if r and r.get("decode_tokens_per_s") else None
        floor_ms = flop_ms = None
        if r and bw:
            mean_context = (prompt or 0) + (new or 0) / 2
            kv = batch * mean_context * kv_per_token if kv_per_token else 0
            floor_ms = (r["weights_bytes"] + kv) / bw * 1e3
        if r and flops:
            # bf16 weights: parameters = bytes / 2; a decode step is 2 FLOPs per parameter per sequence.
            flop_ms = 2 * (r["weights_bytes"] / 2) * batch / flops * 1e3
        x_floor = step_ms / floor_ms if step_ms and floor_ms else None
        mem = r.get("device_memory_in_use_bytes") if r else None
        print(f"| {batch} | {fmt(ours, '.0f')} | {fmt(theirs, '.0f')} | {fmt(ratio, '.2f', 'x')} | {fmt(step_ms, '.2f', ' ms')} | "
              f"{fmt(floor_ms, '.3f', ' ms')} | {fmt(x_floor, '.1f', 'x')} | {fmt(flop_ms, '.3f', ' ms')} | "
              f"{fmt(r['ttft_p50_s'] * 1e3 if r else None, '.0f', ' ms')} | {fmt(r.get('host_ms_per_step') if r else None, '.2f')} | "
              f"{r.get('attention', 'n/a') if r else 'n/a'} | {fmt(mem / 2**30 if mem else None, '.1f', ' GiB')} |")
        if batch == 1:
            verdicts.append(f"batch 1 decode within 2x of the bandwidth roofline: "
                            f"{'n/a' if x_floor is None else ('met' if x_floor <= 2 else 'missed')} ({fmt(x_floor, '.1f', 'x')})")
        if batch == 256:
            verdicts.append(f"batch 256 output tokens/s at least 5x transformers: "
                            f"{'n/a' if ratio is None else ('met' if ratio >= 5 else 'missed')} ({fmt(ratio, '.2f', 'x')})")
    print()
    runs = [p for pattern in ("long-*.log", "xl-*.log", "tiled-*.log") for p in sorted(glob.glob(os.path.join(out, pattern)))]
    if runs:
        print("Long prompts, and the tiled attention beside the kernels (nightshift's decode kernel, flash-attention):\n")
        print("| run | attention | rows | prompt + new tokens per row | output tok/s | total tok/s | prefill tok/s | "
              "decode step | TTFT p50 | host ms/step | GPU memory in use |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for path in runs:
            name = os.path.basename(path)[:-len(".log")]
            r = last_json(path)
            if not r:
                print(f"| {name} | | | (no report: see {os.path.basename(path)}) | | | | | | | |")
                continue
            mem = r.get("device_memory_in_use_bytes")
            step_ms = r["rows"] / r["decode_tokens_per_s"] * 1e3 if r.get("decode_tokens_per_s") else None
            print(f"| {name} | {r.get('attention', 'n/a')} | {r['rows']} | {r['prompt_tokens'] // max(r['rows'], 1)} + "
                  f"{r['output_tokens'] // max(r['rows'], 1)} | {r['output_tokens_per_s']:.0f} | {r['total_tokens_per_s']:.0f} | "
                  f"{r['prefill_tokens_per_s']:.0f} | {fmt(step_ms, '.2f', ' ms')} | {r['ttft_p50_s'] * 1e3:.0f} ms | {fmt(r.get('host_ms_per_step'), '.2f')} | "
                  f"{fmt(mem / 2**30 if mem else None, '.1f', ' GiB')} |")
        print()
    gguf = sorted(glob.glob(os.path.join(out, "gguf-bench-*.log")), key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]))
    if gguf:
        print("GGUF path (candle's quantized kernels), same shape and workload:\n")
        print("| batch | output tok/s | decode step | weight bytes | bandwidth floor | x floor |")
        print("|---|---|---|---|---|---|")
        for path in gguf:
            batch = int(re.findall(r"\d+", os.path.basename(path))[0])
            r = last_json(path)
            step_ms = batch / r["decode_tokens_per_s"] * 1e3 if r and r.get("decode_tokens_per_s") else None
            floor_ms = r["weights_bytes"] / bw * 1e3 if r and bw else None
            x_floor = step_ms / floor_ms if step_ms and floor_ms else None
            print(f"| {batch} | {fmt(r['output_tokens_per_s'] if r else None, '.0f')} | {fmt(step_ms, '.2f', ' ms')} | "
                  f"{fmt(r['weights_bytes'] / 1e9 if r else None, '.2f', ' GB')} | {fmt(floor_ms, '.3f', ' ms')} | {fmt(x_floor, '.1f', 'x')} |")
        print()
    for v in verdicts:
        print(f"- target: {v}")
    steps = open(os.path.join(out, "steps.txt")).read().split("\n") if os.path.exists(os.path.join(out, "steps.txt")) else []
    failed = [s for s in steps if "rc=" in s and "rc=0" not in s]
    if failed:
        print(f"- steps that failed or were skipped: {'; '.join(failed)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
