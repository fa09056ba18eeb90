//! WordPiece (`tokenizer.ggml.model = "bert"`) as llama.cpp runs it: BERT's normaliser (lowercase, accents
//! stripped, controls dropped), words split at whitespace and around punctuation and CJK ideographs, then the
//! longest token matching at each point of `▁word` (GGUF writes word-initial pieces with `▁`, continuations bare);
//! a word with a point no token matches is the unknown token.

use super::unicode;

pub struct Options {
    pub lowercase: bool,
    pub strip_accents: bool,
}

/// CJK ideographs as BERT's normaliser counts them (with its off-by-0x100 start of Extension E).
fn is_chinese(cp: u32) -> bool {
    matches!(cp, 0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F | 0x2B740..=0x2B81F
        | 0x2B920..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

/// The words of a text after BERT's normaliser.
fn words(text: &[u8], options: &Options) -> Vec<Vec<u8>> {
    let mut cpts = unicode::codepoints(text);
    if options.strip_accents {
        for cp in &mut cpts {
            *cp = unicode::nfd_first(*cp);
        }
    }
    let mut words: Vec<Vec<u8>> = vec![Vec::new()];
    for cp in cpts {
        let flags = unicode::flags(cp);
        if flags.is_whitespace() {
            if !words.last().expect("one word").is_empty() {
                words.push(Vec::new());
            }
            continue;
        }
        if cp == 0 || cp == unicode::REPLACEMENT || flags.is_control() {
            continue;
        }
        if options.strip_accents && flags.is_mark() {
            continue;
        }
        let mut s = Vec::with_capacity(4);
        unicode::push_utf8(&mut s, if options.lowercase { unicode::to_lower(cp) } else { cp });
        if flags.is_punctuation() || (cp < 0x7F && flags.is_symbol()) || is_chinese(cp) {
            if !words.last().expect("one word").is_empty() {
                words.push(Vec::new());
            }
            *words.last_mut().expect("one word") = s;
            words.push(Vec::new());
        } else {
            words.last_mut().expect("one word").extend_from_slice(&s);
        }
    }
    if words.last().is_some_and(|w| w.is_empty()) {
        words.pop();
    }
    words
}

/// Appends the tokens of `text`. `unknown` is the token of a word no tokens make.
pub fn encode(text: &[u8], options: &Options, max_token_len: usize, token_id: &dyn Fn(&[u8]) -> Option<u32>, unknown: u32, out: &mut Vec<u32>) {
    for word in words(text, options) {
        if word.is_empty() {
            continue;
        }
        let word: Vec<u8> = ["\u{2581}".as_bytes(), &word].concat();
        let n = word.len();
        let before = out.len();
        let mut i = 0;
        while i < n {
            let mut matched = false;
            let mut j = n.min(i + max_token_len + 1);
            while j > i {
                if let Some(id) = token_id(&word[i..j]) {
                    out.push(id);
                    matched = true;
                    i = j - 1;
                    break;
                }
                j -= 1;
            }
            if !matched {
                out.truncate(before);
                break;
            }
            i += 1;
        }
        if out.len() == before {
            out.push(unknown);
        }
    }
}
