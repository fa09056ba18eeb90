//! Unigram (`tokenizer.ggml.model = "t5"`) as llama.cpp runs it: SentencePiece's normaliser (the precompiled
//! character map, user-defined tokens kept as they are, spaces as `▁`), then the best-scoring segmentation by
//! Viterbi over the vocabulary, a code point no token covers being the unknown token (runs of them merged into one).

use std::collections::HashSet;

use super::unicode;

/// SentencePiece's precompiled normalisation map: a double array (XOR-compressed, Kanda 2018) over input bytes whose
/// leaves point at NUL-terminated replacement strings.
pub struct Charsmap {
    xcda: Vec<u32>,
    replacements: Vec<u8>,
}

/// A malformed character map: an index outside its arrays, or a replacement without its terminator.
#[derive(Debug)]
pub struct BadCharsmap(pub &'static str);

impl Charsmap {
    pub fn new(bytes: &[u8]) -> Result<Charsmap, String> {
        if bytes.len() < 4 {
            return Err("the precompiled character map is shorter than its header".into());
        }
        let blob = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
        if blob.checked_add(4).is_none_or(|end| end >= bytes.len()) {
            return Err("the precompiled character map's array runs past its end".into());
        }
        let xcda = bytes[4..4 + blob].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        Ok(Charsmap { xcda, replacements: bytes[4 + blob..].to_vec() })
    }

    fn node(&self, index: u32) -> Result<u32, BadCharsmap> {
        self.xcda.get(index as usize).copied().ok_or(BadCharsmap("an index outside the character map's array"))
    }

    /// The longest prefix of `input` the map replaces: (its length, the replacement).
    fn longest(&self, input: &[u8]) -> Result<Option<(usize, &[u8])>, BadCharsmap> {
        if self.xcda.is_empty() {
            return Ok(None);
        }
        let base = |node: u32| (node >> 10) << ((node & (1 << 9)) >> 6);
        let mut index = base(self.node(0)?);
        let mut found = None;
        for (i, &c) in input.iter().enumerate() {
            if c == 0 {
                break;
            }
            index ^= u32::from(c);
            let node = self.node(index)?;
            if node & ((1 << 31) | 0xFF) != u32::from(c) {
                break;
            }
            let leaf = (node >> 8) & 1 == 1;
            index ^= base(node);
            if leaf {
                found = Some((i + 1, self.node(index)? & ((1 << 31) - 1)));
            }
        }
        let Some((len, offset)) = found else { return Ok(None) };
        let rest = self.replacements.get(offset as usize..).ok_or(BadCharsmap("a replacement outside the character map"))?;
        let end = rest.iter().position(|&b| b == 0).ok_or(BadCharsmap("a replacement without its terminator"))?;
        Ok(Some((len, &rest[..end])))
    }
}

pub struct Options {
    pub add_space_prefix: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
    pub treat_whitespace_as_suffix: bool,
}

/// A token's id and score by its text (normal, user-defined or unused tokens only).
pub type TokenScore<'a> = &'a dyn Fn(&[u8]) -> Option<(u32, f64)>;

/// The vocabulary as the Viterbi search reads it.
pub struct Model<'a> {
    pub charsmap: Option<&'a Charsmap>,
    /// Every prefix of every user-defined token: the normaliser leaves the longest such prefix as it is.
    pub user_defined_prefixes: &'a HashSet<Vec<u8>>,
    /// The id and score of a normal, user-defined or unused token's text (user-defined ones score 0).
    pub token: TokenScore<'a>,
    pub max_token_len: usize,
    pub unknown: u32,
    pub unknown_score: f64,
}

fn normalize(input: &[u8], options: &Options, model: &Model) -> Result<Vec<u8>, BadCharsmap> {
    let space: &[u8] = if options.escape_whitespaces { "\u{2581}".as_bytes() } else { b" " };
    let prepend = !options.treat_whitespace_as_suffix && options.add_space_prefix;
    let append = options.treat_whitespace_as_suffix && options.add_space_prefix;
    let merge = options.remove_extra_whitespaces;
    let mut out = Vec::with_capacity(input.len() * 3);
    let (mut prepended, mut in_word) = (false, false);
    let mut offset = 0;
    while offset < input.len() {
        let rest = &input[offset..];
        let mut user = 0;
        while user < rest.len() && model.user_defined_prefixes.contains(&rest[..user + 1]) {
            user += 1;
        }
        let (normalized, consumed): (&[u8], usize) = if user > 0 {
            (&rest[..user], user)
        } else if let Some((len, replacement)) = model.charsmap.map(|m| m.longest(rest)).transpose()?.flatten() {
            (replacement, len)
        } else {
            match unicode::decode_at(input, offset) {
                Some((_, n)) => (&rest[..n], n),
                None => ("\u{FFFD}".as_bytes(), 1),
            }
        };
        for &c in normalized {
            if c != b' ' {
                if !in_word {
                    in_word = true;
                    if (prepend && !prepended) || merge {
                        out.extend_from_slice(space);
                        prepended = true;
                    }
                }
                out.push(c);
            } else {
                in_word = false;
                if !merge {
                    out.extend_from_slice(space);
                }
            }
        }
        offset += consumed;
    }
    if append {
        out.extend_from_slice(space);
    }
    Ok(out)
}

#[derive(Clone, Copy)]
struct Best {
    token: u32,
    from: usize,
    score: f64,
}

/// Appends the tokens of `text`.
pub fn encode(text: &[u8], options: &Options, model: &Model, out: &mut Vec<u32>) -> Result<(), BadCharsmap> {
    let normalized = normalize(text, options, model)?;
    let n = normalized.len();
    if n == 0 {
        return Ok(());
    }
    let mut best = vec![Best { token: model.unknown, from: 0, score: f64::MIN }; n + 1];
    best[0].score = 0.0;
    let mut offset = 0;
    while offset < n {
        let char_len = unicode::len_utf8(normalized[offset]).min(n - offset);
        let current = best[offset];
        let mut whole_char = false;
        for end in offset + 1..=n.min(offset + model.max_token_len) {
            if let Some((token, score)) = (model.token)(&normalized[offset..end]) {
                if end - offset == char_len {
                    whole_char = true;
                }
                let challenger = current.score + score;
                if challenger > best[end].score {
                    best[end] = Best { token, from: offset, score: challenger };
                }
            }
        }
        if !whole_char {
            let end = offset + char_len;
            let challenger = current.score + model.unknown_score;
            if challenger > best[end].score {
                best[end] = Best { token: model.unknown, from: offset, score: challenger };
            }
        }
        offset += char_len;
    }
    let start = out.len();
    let mut at = n;
    let mut previous_unknown = false;
    loop {
        let b = best[at];
        let unknown = b.token == model.unknown;
        if !(previous_unknown && unknown) {
            out.push(b.token);
        }
        if b.from == 0 {
            break;
        }
        previous_unknown = unknown;
        at = b.from;
    }
    out[start..].reverse();
    Ok(())
}
