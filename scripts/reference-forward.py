#!/usr/bin/env python3
"""A float64 forward pass of a GGUF decoder (llama and Mixtral, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma2, gemma3, phi3), written from the architectures' definitions in
numpy: the arbiter when nightshift and llama.cpp disagree, and the tight check of nightshift's arithmetic (llama.cpp,
with an f16 KV cache and other rounding, is 5e-5 to 2e-4 of the largest logit from it on one F32 layer).

    PYTHONPATH=models/llama.cpp/gguf-py python3 scripts/reference-forward.py MODEL.gguf < ids

Each input line is `!` and token ids separated by spaces (as scripts/llama-peer.cpp --logits reads them); each output
line the logits at the sequence's last position. Weights are dequantized by gguf-py and computed in float64, so a
quantized file gives the exact function of its stored weights (without the activation rounding of a Q8_0 kernel).
Slow and unbatched: for tiny models and short sequences.
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    reader = GGUFReader(sys.argv[1])
    fields = reader.fields
    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    if arch not in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "gemma2", "gemma3", "phi3"):
        sys.exit(f"error: architecture {arch} is not computed here")

    def meta(key, default=None):
        field = fields.get(f"{arch}.{key}")
        if field is None:
            return default
        return field.parts[field.data[0]][0].item()

    # Weights are dequantized when a layer first needs them and dropped after it: one layer's float64 weights in
    # memory at a time (a 2.6 B-parameter model would take 21 GB whole), every sequence run through that layer.
    stored = {t.name: t for t in reader.tensors}

    def load(name):
        t = stored.get(name)
        if t is None:
            return None
        shape = [int(d) for d in reversed(t.shape)]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)

    tensors = {name: load(name) for name in ("rope_freqs.weight", "token_embd.weight", "output.weight", "output_norm.weight") if name in stored}
    heads, kv_heads = meta("attention.head_count"), meta("attention.head_count_kv")
    eps, layers = meta("attention.layer_norm_rms_epsilon", 1e-5), meta("block_count")
    base = meta("rope.freq_base", 10000.0)
    scale = 1.0 / meta("rope.scaling.factor", 1.0) if fields.get(f"{arch}.rope.scaling.type") else 1.0
    factors = tensors.get("rope_freqs.weight")
    embedding = tensors["token_embd.weight"]
    output = tensors.get("output.weight", embedding)
    # Gemma (Google's gemma_pytorch and Hugging Face's modeling_gemma2/3): embeddings times sqrt(hidden), norms after
    # attention and the feed-forward network (GGUF stores Gemma's 1 + w), GeGLU with tanh GELU, queries scaled by
    # 1 / sqrt(head_dim), soft-capped scores (Gemma 2) and logits, and sliding-window layers: Gemma 2 every other one
    # (window 4096 unless given), Gemma 3 five of six (none without a window), the latter with a local RoPE base.
    gemma = arch.startswith("gemma")
    window = meta("attention.sliding_window", 4096 if arch == "gemma2" else None) if gemma else None
    period = meta("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    local_base = meta("rope.freq_base_swa", base if arch in ("gemma2", "phi3") else 10000.0)
    attn_cap = meta("attn_logit_softcapping", 50.0) if arch == "gemma2" else None
    final_cap = meta("final_logit_softcapping", 30.0 if arch == "gemma2" else None) if gemma else None
    # Phi-3 (Hugging Face's modeling_phi3): q, k and v in one matrix, gate and up in one (gate's rows first), and its
    # window over every layer (as Hugging Face computes it; llama.cpp attends over the whole context instead).
    if arch == "phi3":
        window, period = meta("attention.sliding_window"), 1
        if window is not None and window >= meta("context_length"):
            window = None

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x, local=False):
        # x: [positions, heads, head_dim]. llama's GGUF rows are stored for rotating adjacent pairs (llama.cpp's
        # "normal" mode); qwen2, qwen3 and Gemma rotate the two halves (NEOX). Only the first
        # `rope.dimension_count` values of each head rotate (partial rotary, Phi-4-mini); the rest pass through.
        positions, _, head_dim = x.shape
        dim = meta("rope.dimension_count", head_dim)
        x, rest = x[..., :dim], x[..., dim:]
        inv = (local_base if local else base) ** (-np.arange(0, dim, 2) / dim)
        if factors is not None and not local:
            inv = inv / factors[: dim // 2]
        angle = (np.arange(positions) * (1.0 if local else scale))[:, None, None] * inv[None, None, :]
        cos, sin = np.cos(angle), np.sin(angle)
        if arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return np.concatenate([out, rest], axis=-1)
        a, b = x[..., : dim // 2], x[..., dim // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)

    # A mixture of experts (Hugging Face's MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock and Qwen2MoeSparseMoeBlock):
    # the softmax of the router's logits, the `expert_used_count` most probable experts, their probabilities
    # renormalized (Mixtral and Qwen3-MoE; not Qwen2-MoE; `expert_weights_norm` decides where a file has it), each
    # expert's SwiGLU weighted by its probability; Qwen2-MoE adds a shared expert's SwiGLU on every token, weighted by
    # the sigmoid of its gate's logit.
    used = meta("expert_used_count")
    normalize = meta("expert_weights_norm", arch not in ("qwen2moe", "olmoe"))

    def experts(h, w):
        logits = h @ w("ffn_gate_inp.weight").T
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        gates, ups, downs = w("ffn_gate_exps.weight"), w("ffn_up_exps.weight"), w("ffn_down_exps.weight")
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            chosen = np.argsort(-probs[t], kind="stable")[:used]
            weights = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
            for e, p in zip(chosen, weights):
                gate, up = gates[e] @ h[t], ups[e] @ h[t]
                out[t] += p * (downs[e] @ (gate / (1 + np.exp(-gate)) * up))
        if w("ffn_gate_inp_shexp.weight") is not None:
            weight = 1 / (1 + np.exp(-(h @ w("ffn_gate_inp_shexp.weight"))))
            gate, up = h @ w("ffn_gate_shexp.weight").T, h @ w("ffn_up_shexp.weight").T
            out += weight[:, None] * ((gate / (1 + np.exp(-gate)) * up) @ w("ffn_down_shexp.weight").T)
        return out

    def block(x, layer, w):
        n = x.shape[0]
        mask = np.triu(np.full((n, n), -np.inf), 1)
        local = window is not None and (arch == "phi3" or layer % period < period - 1)
        # A sliding layer's query at position i sees positions i - window + 1 to i.
        layer_mask = mask + np.tril(np.full((n, n), -np.inf), -window) if local else mask
        h = rms(x, w("attn_norm.weight"))
        if w("attn_qkv.weight") is not None:
            qkv = h @ w("attn_qkv.weight").T
            q_rows = heads * (qkv.shape[1] // (heads + 2 * kv_heads))
            kv_rows = (qkv.shape[1] - q_rows) // 2
            q, k, v = qkv[:, :q_rows], qkv[:, q_rows : q_rows + kv_rows], qkv[:, q_rows + kv_rows :]
        else:
            q, k, v = (h @ w(f"attn_{p}.weight").T + (0 if w(f"attn_{p}.bias") is None else w(f"attn_{p}.bias")) for p in "qkv")
        dim = k.shape[1] // kv_heads
        # OLMoE's q/k norms take the whole q and k rows (weights as wide as they are), before the heads are split.
        rows_norm = w("attn_q_norm.weight") is not None and w("attn_q_norm.weight").shape[-1] == q.shape[1] != dim
        if rows_norm:
            q, k = rms(q, w("attn_q_norm.weight")), rms(k, w("attn_k_norm.weight"))
        q, k, v = q.reshape(n, heads, dim), k.reshape(n, kv_heads, dim), v.reshape(n, kv_heads, dim)
        if w("attn_q_norm.weight") is not None and not rows_norm:
            q, k = rms(q, w("attn_q_norm.weight")), rms(k, w("attn_k_norm.weight"))
        q, k = rope(q, local), rope(k, local)
        attended = np.empty((n, heads, dim))
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(dim)
            if attn_cap is not None:
                scores = attn_cap * np.tanh(scores / attn_cap)
            scores = scores + layer_mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            attended[:, head] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[:, kv]
        out = attended.reshape(n, heads * dim) @ w("attn_output.weight").T
        x = x + (rms(out, w("post_attention_norm.weight")) if gemma else out)
        h = rms(x, w("ffn_norm.weight"))
        if w("ffn_gate_inp.weight") is not None:
            x = x + experts(h, w)
            return x
        if w("ffn_gate.weight") is None:
            gate, up = np.split(h @ w("ffn_up.weight").T, 2, axis=-1)
        else:
            gate, up = h @ w("ffn_gate.weight").T, h @ w("ffn_up.weight").T
        if gemma:
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
            x = x + rms((act * up) @ w("ffn_down.weight").T, w("post_ffw_norm.weight"))
        else:
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w("ffn_down.weight").T
        return x

    sequences = []
    for line in sys.stdin:
        ids = [int(i) for i in line.strip().lstrip("!").split()]
        if not ids or max(ids) >= embedding.shape[0] or min(ids) < 0:
            sys.exit(f"error: token ids {line.strip()!r} out of range")
        sequences.append(ids)
    xs = [embedding[ids] * (np.sqrt(embedding.shape[1]) if gemma else 1.0) for ids in sequences]
    for layer in range(layers):
        weights = {}

        def w(name):
            if name not in weights:
                weights[name] = load(f"blk.{layer}.{name}")
            return weights[name]

        xs = [block(x, layer, w) for x in xs]
    for x in xs:
        logits = output @ rms(x[-1], tensors["output_norm.weight"])
        if final_cap is not None:
            logits = final_cap * np.tanh(logits / final_cap)
        print(" ".join(f"{v:.12g}" for v in logits), flush=True)


if __name__ == "__main__":
    main()
