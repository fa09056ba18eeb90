//! Byte-pair encoding of one pre-tokenized word, as llama.cpp merges: the word's characters are symbols, and the
//! adjacent pair with the lowest merge rank (leftmost among equals) is merged until no pair has a rank. A symbol
//! that is not a token falls back to its bytes' tokens, dropping those that have none (llama.cpp's behaviour).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::unicode;

/// A string that appears in the merges (a part or a result), by number; token texts get theirs too.
type Sym = u32;
const NONE: Sym = u32::MAX;

/// The merge table: pairs of symbol strings by rank, each with the string it makes.
pub struct Merges {
    /// String -> symbol number: every merge part and result.
    strings: HashMap<Box<[u8]>, Sym>,
    /// (left, right) -> (rank, merged).
    pairs: HashMap<(Sym, Sym), (u32, Sym)>,
    /// The token id of each symbol string, `NONE` where it is not a token.
    token: Vec<u32>,
}

impl Merges {
    /// Reads merges as GGUF stores them ("left right", split at the first space after the first byte); a
    /// repeated pair keeps its first rank.
    pub fn new(merges: &[String], token_id: impl Fn(&[u8]) -> Option<u32>) -> Merges {
        let mut strings: HashMap<Box<[u8]>, Sym> = HashMap::new();
        let mut token = Vec::new();
        let mut intern = |s: &[u8], strings: &mut HashMap<Box<[u8]>, Sym>| -> Sym {
            if let Some(&sym) = strings.get(s) {
                return sym;
            }
            let sym = token.len() as Sym;
            token.push(token_id(s).unwrap_or(NONE));
            strings.insert(s.into(), sym);
            sym
        };
        let mut pairs = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            let bytes = merge.as_bytes();
            let Some(space) = bytes.iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                continue; // llama.cpp records ("", ""), which no pair of symbols ever is
            };
            let (left, right) = (&bytes[..space], &bytes[space + 1..]);
            if left.is_empty() || right.is_empty() {
                continue;
            }
            let l = intern(left, &mut strings);
            let r = intern(right, &mut strings);
            if pairs.contains_key(&(l, r)) {
                continue;
            }
            let merged = intern(&[left, right].concat(), &mut strings);
            pairs.insert((l, r), (rank as u32, merged));
        }
        Merges { strings, pairs, token }
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    sym: Sym,
    prev: i32,
    next: i32,
}

/// Candidate merges: (rank, left symbol, right symbol, and the two symbols' strings when pushed), lowest first.
type Queue = BinaryHeap<Reverse<(u32, i32, i32, Sym, Sym)>>;

/// What [`encode_word`] needs of the vocabulary.
pub struct Lookup<'a> {
    pub merges: &'a Merges,
    pub token_id: &'a dyn Fn(&[u8]) -> Option<u32>,
    /// Whether a word that is itself a token is taken whole (Llama 3's `ignore_merges`).
    pub ignore_merges: bool,
    /// Whether a word of newlines only is taken whole when it is a token (Gemma 4).
    pub whole_newlines: bool,
    /// GPT-2's byte characters (byte-level BPE); else bytes fall back to `<0xXX>` tokens.
    pub byte_encode: bool,
}

/// Appends the tokens of one word.
pub fn encode_word(word: &[u8], lookup: &Lookup, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    let whole = (lookup.ignore_merges || (lookup.whole_newlines && word.iter().all(|&b| b == b'\n')))
        && (lookup.token_id)(word).is_some();
    if whole {
        symbols.push(Symbol { start: 0, len: word.len(), sym: NONE, prev: -1, next: -1 });
    } else {
        let mut offset = 0;
        while offset < word.len() {
            let len = unicode::len_utf8(word[offset]).min(word.len() - offset);
            let index = symbols.len() as i32;
            let sym = lookup.merges.strings.get(&word[offset..offset + len]).copied().unwrap_or(NONE);
            offset += len;
            symbols.push(Symbol { start: offset - len, len, sym, prev: index - 1, next: if offset == word.len() { -1 } else { index + 1 } });
        }
    }
    // Pairs by (rank, left position): the lowest rank first, the leftmost among equals.
    let mut queue: Queue = BinaryHeap::new();
    let pair = |symbols: &[Symbol], left: i32, right: i32, queue: &mut Queue| {
        if left < 0 || right < 0 {
            return;
        }
        let (l, r) = (symbols[left as usize].sym, symbols[right as usize].sym);
        if let Some(&(rank, _)) = lookup.merges.pairs.get(&(l, r)) {
            queue.push(Reverse((rank, left, right, l, r)));
        }
    };
    for i in 1..symbols.len() as i32 {
        pair(&symbols, i - 1, i, &mut queue);
    }
    while let Some(Reverse((_, left, right, l, r))) = queue.pop() {
        let (a, b) = (symbols[left as usize], symbols[right as usize]);
        // A pair is stale once either side has merged into something else.
        if a.len == 0 || b.len == 0 || a.sym != l || b.sym != r {
            continue;
        }
        let merged = lookup.merges.pairs[&(l, r)].1;
        symbols[left as usize].len += b.len;
        symbols[left as usize].sym = merged;
        symbols[left as usize].next = b.next;
        symbols[right as usize].len = 0;
        if b.next >= 0 {
            symbols[b.next as usize].prev = left;
        }
        pair(&symbols, a.prev, left, &mut queue);
        pair(&symbols, left, b.next, &mut queue);
    }
    for s in symbols.iter().filter(|s| s.len > 0) {
        let text = &word[s.start..s.start + s.len];
        let id = match s.sym {
            NONE => (lookup.token_id)(text),
            sym => Some(lookup.merges.token[sym as usize]).filter(|&t| t != NONE),
        };
        match id {
            Some(id) => out.push(id),
            None => {
                for &byte in text {
                    let fallback = if lookup.byte_encode {
                        (lookup.token_id)(&[byte])
                    } else {
                        (lookup.token_id)(format!("<0x{byte:02X}>").as_bytes())
                    };
                    out.extend(fallback);
                }
            }
        }
    }
}
