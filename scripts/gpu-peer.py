#!/usr/bin/env python3
"""The GPU peer and the roofline, for scripts/gpu-check.sh on the GPU host (PyTorch and transformers installed).

  gpu-peer.py roofline --out roofline.json
      Measures the device's memory bandwidth (a large device-to-device copy) and its bf16 matmul rate
      (square matmuls), the two ceilings of decode and prefill.

  gpu-peer.py generate --model DIR --batches 1,16,64,256 --prompt-tokens 128 --new-tokens 128 --out peer.json
      Hugging Face transformers `generate` on a model directory (e.g. one written by `nightshift synth-model`),
      greedy, every row exactly --new-tokens long (min_new_tokens = max_new_tokens), on prompts of random byte
      tokens: the same fixed-length workload as `nightshift bench generate --workload fixed`. Reports requests/s,
      total and output tokens/s per batch size.

Both write one JSON object and print it. Times are wall clock around CUDA-synchronised work, after a warm-up.
"""

import argparse
import json
import time

import torch


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def roofline(args):
    dev = torch.device("cuda")
    n_bytes = 4 << 30
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 20)
    # A copy reads and writes every byte.
    bandwidth = 2 * n_bytes / copy_s
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    mm_s = timed(lambda: a @ b, 20)
    flops = 2 * n**3 / mm_s
    result = {
        "device": torch.cuda.get_device_name(0),
        "memory_bandwidth_bytes_per_s": bandwidth,
        "bf16_matmul_flops_per_s": flops,
        "copy_bytes": n_bytes,
        "matmul_n": n,
    }
    write(result, args.out)


def generate(args):
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    # transformers 5 names the argument `dtype`; 4.x, `torch_dtype`.
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model = model.to(device=dev, dtype=torch.bfloat16).eval()
    parameters = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        # Byte tokens 33..126 (printable ASCII in the synthetic tokenizer): every prompt exactly --prompt-tokens long.
        ids = torch.randint(33, 127, (batch, args.prompt_tokens), generator=gen).to(dev)
        mask = torch.ones_like(ids)

        def run():
            with torch.no_grad():
                return model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    pad_token_id=0,
                )

        out = run()  # warm-up, and the check that every row has its length
        assert out.shape == (batch, args.prompt_tokens + args.new_tokens), out.shape
        seconds = timed(run, args.repeats)
        rows.append(
            {
                "batch": batch,
                "seconds": seconds,
                "requests_per_s": batch / seconds,
                "output_tokens_per_s": batch * args.new_tokens / seconds,
                "total_tokens_per_s": batch * (args.prompt_tokens + args.new_tokens) / seconds,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "peer": "transformers generate",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "model": args.model,
        "parameters": parameters,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "runs": rows,
    }
    write(result, args.out)


def write(result, path):
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("roofline")
    r.add_argument("--out")
    g = sub.add_parser("generate")
    g.add_argument("--model", required=True)
    g.add_argument("--batches", default="1,16,64,256")
    g.add_argument("--prompt-tokens", type=int, default=128)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--repeats", type=int, default=1)
    g.add_argument("--out")
    args = parser.parse_args()
    {"roofline": roofline, "generate": generate}[args.command](args)


if __name__ == "__main__":
    main()
