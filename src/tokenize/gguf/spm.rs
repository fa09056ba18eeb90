//! SentencePiece's BPE as llama.cpp runs it on `tokenizer.ggml.model = "llama"` vocabularies: the text's
//! characters are symbols; the adjacent pair whose concatenation is the highest-scoring token (leftmost among
//! equals) merges until none is a token; a symbol that is not a token is split back along the merges that made it,
//! or into byte tokens (`<0xXX>`).

use std::collections::{BinaryHeap, HashMap};

use super::unicode;

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: i32,
    next: i32,
}

/// A candidate merge: ordered by score (highest first), then by position (leftmost first).
struct Bigram {
    left: i32,
    right: i32,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

/// What [`encode`] needs of the vocabulary.
pub struct Lookup<'a> {
    pub token_id: &'a dyn Fn(&[u8]) -> Option<u32>,
    pub score: &'a dyn Fn(u32) -> f32,
}

/// A byte no token covers: neither `<0xXX>` nor the byte itself is in the vocabulary.
#[derive(Debug)]
pub struct MissingByte(pub u8);

/// Appends the tokens of `text` (spaces already written as `▁`).
pub fn encode(text: &[u8], lookup: &Lookup, out: &mut Vec<u32>) -> Result<(), MissingByte> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    let mut offset = 0;
    while offset < text.len() {
        let len = unicode::len_utf8(text[offset]).min(text.len() - offset);
        let index = symbols.len() as i32;
        offset += len;
        symbols.push(Symbol { start: offset - len, len, prev: index - 1, next: if offset == text.len() { -1 } else { index + 1 } });
    }
    let mut queue = BinaryHeap::new();
    // The pair each merged text came from, the last one recorded for that text (llama.cpp's `rev_merge`).
    let mut made_of: HashMap<&[u8], (i32, i32)> = HashMap::new();
    fn try_pair<'t>(text: &'t [u8], symbols: &[Symbol], left: i32, right: i32, lookup: &Lookup, queue: &mut BinaryHeap<Bigram>, made_of: &mut HashMap<&'t [u8], (i32, i32)>) {
        if left < 0 || right < 0 {
            return;
        }
        let (l, r) = (symbols[left as usize], symbols[right as usize]);
        let merged = &text[l.start..l.start + l.len + r.len];
        let Some(id) = (lookup.token_id)(merged) else { return };
        queue.push(Bigram { left, right, score: (lookup.score)(id), size: merged.len() });
        made_of.insert(merged, (left, right));
    }
    for i in 1..symbols.len() as i32 {
        try_pair(text, &symbols, i - 1, i, lookup, &mut queue, &mut made_of);
    }
    while let Some(bigram) = queue.pop() {
        let (l, r) = (symbols[bigram.left as usize], symbols[bigram.right as usize]);
        if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
            continue;
        }
        symbols[bigram.left as usize].len += r.len;
        symbols[bigram.right as usize].len = 0;
        symbols[bigram.left as usize].next = r.next;
        if r.next >= 0 {
            symbols[r.next as usize].prev = bigram.left;
        }
        let prev = symbols[bigram.left as usize].prev;
        let next = symbols[bigram.left as usize].next;
        try_pair(text, &symbols, prev, bigram.left, lookup, &mut queue, &mut made_of);
        try_pair(text, &symbols, bigram.left, next, lookup, &mut queue, &mut made_of);
    }
    let mut i = if symbols.is_empty() { -1 } else { 0 };
    while i != -1 {
        resegment(text, &symbols, i, lookup, &made_of, out)?;
        i = symbols[i as usize].next;
    }
    Ok(())
}

fn resegment(text: &[u8], symbols: &[Symbol], index: i32, lookup: &Lookup, made_of: &HashMap<&[u8], (i32, i32)>, out: &mut Vec<u32>) -> Result<(), MissingByte> {
    let s = symbols[index as usize];
    let piece = &text[s.start..s.start + s.len];
    if let Some(id) = (lookup.token_id)(piece) {
        out.push(id);
        return Ok(());
    }
    match made_of.get(piece) {
        Some(&(left, right)) => {
            resegment(text, symbols, left, lookup, made_of, out)?;
            resegment(text, symbols, right, lookup, made_of, out)
        }
        None => {
            for &byte in piece {
                let hex = format!("<0x{byte:02X}>");
                let id = (lookup.token_id)(hex.as_bytes()).or_else(|| (lookup.token_id)(&[byte])).ok_or(MissingByte(byte))?;
                out.push(id);
            }
            Ok(())
        }
    }
}
