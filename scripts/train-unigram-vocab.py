#!/usr/bin/env python3
"""Trains a SentencePiece Unigram vocabulary (T5's kind: `tokenizer.ggml.model = "t5"`) and writes it as a
vocabulary-only GGUF the way llama.cpp's converter writes a T5 model's (conversion/t5.py): pieces, scores, token
types, `add_space_prefix`, `remove_extra_whitespaces` and the precompiled normalisation map (NFKC, as T5's). No
published vocabulary-only file of llama.cpp's is Unigram, so this one stands in for a T5 GGUF in
scripts/compare-tokenizers.py.

    python3 -m pip install sentencepiece protobuf
    PYTHONPATH=models/llama.cpp/gguf-py python3 scripts/train-unigram-vocab.py OUT.gguf [--vocab-size 4000]

The training text is this repository's Markdown and a seeded mix of scripts, digits and punctuation, so the
vocabulary has multi-character pieces in several scripts and leaves rare characters to the unknown token.
"""
import argparse
import glob
import os
import random
import tempfile

import gguf

# sentencepiece_model_pb2 needs protobuf's pure-Python implementation (as llama.cpp's converter sets it).
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2


def training_text(root, seed):
    lines = []
    for path in sorted(glob.glob(os.path.join(root, "*.md")) + glob.glob(os.path.join(root, "tests/data/*.md"))):
        with open(path, encoding="utf-8") as f:
            lines.extend(line.strip() for line in f if line.strip())
    rng = random.Random(seed)
    words = ["Grüße", "naïve", "café", "Ελλάδα", "Москва", "東京都", "北京市", "서울", "नमस्ते", "مرحبا", "שלום", "ありがとう"]
    for _ in range(3000):
        lines.append(" ".join(rng.choice(words) if rng.random() < 0.5 else str(rng.randint(0, 10**rng.randint(1, 6))) for _ in range(rng.randint(3, 12))))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "train.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write("\n".join(training_text(root, args.seed)))
        prefix = os.path.join(tmp, "spiece")
        # T5's layout: <pad> 0, </s> 1, <unk> 2, no BOS, NFKC.
        spm.SentencePieceTrainer.train(
            input=text, model_prefix=prefix, model_type="unigram", vocab_size=args.vocab_size,
            normalization_rule_name="nmt_nfkc", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
            character_coverage=0.9995, num_threads=1, minloglevel=2,
        )
        proto = model_pb2.ModelProto()
        with open(prefix + ".model", "rb") as f:
            proto.ParseFromString(f.read())
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")

    types = gguf.TokenType
    tokens, scores, toktypes = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i).encode("utf-8"))
        scores.append(sp.GetScore(i))
        toktypes.append(types.UNKNOWN if sp.IsUnknown(i) else types.CONTROL if sp.IsControl(i)
                        else types.UNUSED if sp.IsUnused(i) else types.BYTE if sp.IsByte(i) else types.NORMAL)

    w = gguf.GGUFWriter(args.out, "t5")
    w.add_name("nightshift unigram test vocabulary")
    # The hyperparameters llama.cpp reads before it reads a vocabulary (a tiny T5's).
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_relative_attn_buckets_count(32)
    w.add_decoder_start_token_id(0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    w.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
    w.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
    w.add_eos_token_id(1)
    w.add_unk_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: {len(tokens)} pieces, charsmap {len(proto.normalizer_spec.precompiled_charsmap)} bytes")


if __name__ == "__main__":
    main()
