//! Byte-level BPE's pre-tokenizers: the rules that cut a text into words before merges apply, one set per
//! `tokenizer.ggml.pre` name, as llama.cpp defines them.
//!
//! A pre-tokenizer is a chain of rules. Each rule cuts every piece the rules before it left into its matches and
//! the text between them (both kept), so a later rule only refines earlier cuts. A rule is one of the hand-written
//! splitters llama.cpp uses for its most common expressions (GPT-2's, Llama 3's, Qwen2's, ...), which [`Rule::of`]
//! picks by the expression's exact text as llama.cpp does, or a regular expression run the way llama.cpp runs
//! it through `std::regex` (ECMAScript):
//! - An expression with Unicode classes (`\p{L}`, `\p{N}`, `\p{P}`, `\p{M}`, `\p{S}`, `\p{Lu}`, ...) runs on a
//!   "collapsed" text: ASCII stays, other whitespace becomes U+000B, and every other code point becomes one
//!   stand-in character for its category (U+00D1 numbers, U+00D2 letters, U+00D3 punctuation, U+00D4 marks, U+00D5
//!   symbols, U+00D0 the rest), and each class becomes its stand-in plus its ASCII members. So `\p{Lu}` is any
//!   letter there, as in llama.cpp.
//! - Any other expression runs on the code points, other whitespace again as U+000B.
//!
//! In both, `\s`, `\d` and `\w` are ECMAScript's ASCII classes, which is what `std::regex` gives in the C locale.

use fancy_regex::Regex;

use super::unicode::{self, Flags};

/// Why a text could not be split: a regular expression ran past its backtracking limit.
#[derive(Debug)]
pub struct SplitError(pub String);

/// A pre-tokenizer: its rules and whether words are then written in GPT-2's byte characters.
pub struct Splitter {
    rules: Vec<Rule>,
    /// GPT-2's byte-level encoding of each word (byte-level BPE); off for SentencePiece-style BPE (Gemma 4).
    pub byte_encode: bool,
}

enum Rule {
    Gpt2,
    Llama3,
    Qwen2,
    Qwen35,
    /// Digit runs cut into groups of three from the right (`\d{1,3}(?=(?:\d{3})*\b)`, AFMoE's and Tiny Aya's).
    DigitGroups,
    /// Runs of newlines and runs of anything else.
    Newlines,
    Regex { regex: Regex, collapsed: bool, surrogate: char },
}

/// The category stand-ins of collapsed text, and the ASCII members of each class.
const COLLAPSED: [(&str, char, &str); 10] = [
    ("\\p{N}", '\u{D1}', "0-9"),
    ("\\p{L}", '\u{D2}', "A-Za-z"),
    ("\\p{P}", '\u{D3}', "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}"),
    ("\\p{M}", '\u{D4}', ""),
    ("\\p{S}", '\u{D5}', "\\$\\+<->^`\\|\\~"),
    ("\\p{Lu}", '\u{D2}', "A-Za-z"),
    ("\\p{Ll}", '\u{D2}', "A-Za-z"),
    ("\\p{Lt}", '\u{D2}', "A-Za-z"),
    ("\\p{Lm}", '\u{D2}', "A-Za-z"),
    ("\\p{Lo}", '\u{D2}', "A-Za-z"),
];

/// ECMAScript's `\s` in the C locale (space, \t, \n, \v, \f, \r), as the members of a class.
const SPACE: &str = "\\t\\n\\x0B\\x0C\\r ";

/// The stand-in of a code point in collapsed text.
fn collapse(cp: u32) -> char {
    if cp < 128 {
        return char::from_u32(cp).expect("ASCII");
    }
    let flags = unicode::flags(cp);
    if flags.is_whitespace() {
        return '\u{0B}';
    }
    match flags.category() {
        Flags::NUMBER => '\u{D1}',
        Flags::LETTER => '\u{D2}',
        Flags::PUNCTUATION => '\u{D3}',
        Flags::MARK => '\u{D4}',
        Flags::SYMBOL => '\u{D5}',
        _ => '\u{D0}',
    }
}

/// A code point as an uncollapsed expression sees it: other whitespace is U+000B. A surrogate (decoded from
/// malformed input, ED A0 80 to ED BF BF) cannot be a Rust `char`: it becomes `surrogate`, a code point the
/// expression's classes hold exactly when they hold the surrogates ([`surrogate_stand_in`]).
fn widen(cp: u32, surrogate: char) -> char {
    if cp > 0x7F && unicode::flags(cp).is_whitespace() {
        return '\u{0B}';
    }
    char::from_u32(cp).unwrap_or(surrogate)
}

/// A code point that every range and character of `expr` takes or leaves as it takes or leaves the surrogates
/// (llama.cpp matches them by value: AFMoE's CJK class runs from U+8C48 to U+FAFF, across them).
fn surrogate_stand_in(expr: &str) -> char {
    let chars: Vec<char> = expr.chars().collect();
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for (i, &c) in chars.iter().enumerate() {
        if i + 2 < chars.len() && chars[i + 1] == '-' && !c.is_ascii() {
            ranges.push((c as u32, chars[i + 2] as u32));
        } else if !c.is_ascii() {
            ranges.push((c as u32, c as u32));
        }
    }
    let holds = |cp: u32| ranges.iter().map(|&(a, b)| (a..=b).contains(&cp)).collect::<Vec<bool>>();
    let wanted = holds(0xD800);
    (0xE000..0x11_0000u32)
        .find(|&cp| holds(cp) == wanted && !unicode::flags(cp).is_whitespace())
        .and_then(char::from_u32)
        .unwrap_or('\u{FFFD}')
}

/// Rust's regex syntax for an ECMAScript expression (llama.cpp's subset: classes, groups, lookaround, counted
/// repetition), with the Unicode classes replaced by their collapsed forms when `collapsed`.
fn translate(expr: &str, collapsed: bool) -> Result<String, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = String::with_capacity(expr.len() * 2);
    let mut inside = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '[' && !inside {
            inside = true;
            out.push('[');
            i += 1;
            // A negation or a literal `]` right after the bracket stays as it is.
            if chars.get(i) == Some(&'^') {
                out.push('^');
                i += 1;
            }
            continue;
        }
        if c == ']' && inside {
            inside = false;
            out.push(']');
            i += 1;
            continue;
        }
        if c == '\\' && i + 1 < chars.len() {
            let next = chars[i + 1];
            if collapsed && next == 'p' {
                let rest: String = chars[i..chars.len().min(i + 11)].iter().collect();
                if let Some((name, stand_in, ascii)) = COLLAPSED.iter().find(|(name, ..)| rest.starts_with(name)) {
                    let class = format!("\\x{{{:X}}}{ascii}", *stand_in as u32);
                    if inside {
                        out.push_str(&class);
                    } else {
                        out.push_str(&format!("[{class}]"));
                    }
                    i += name.chars().count();
                    continue;
                }
            }
            let class = |members: &str, negated: bool| match (inside, negated) {
                (true, false) => Ok(members.to_string()),
                (false, false) => Ok(format!("[{members}]")),
                (false, true) => Ok(format!("[^{members}]")),
                (true, true) => Err(format!("the expression `{expr}` has a negated class escape inside a class")),
            };
            match next {
                's' => out.push_str(&class(SPACE, false)?),
                'S' => out.push_str(&class(SPACE, true)?),
                'd' => out.push_str(&class("0-9", false)?),
                'D' => out.push_str(&class("0-9", true)?),
                'w' => out.push_str(&class("0-9A-Za-z_", false)?),
                'W' => out.push_str(&class("0-9A-Za-z_", true)?),
                'b' => out.push_str("(?-u:\\b)"),
                'B' => out.push_str("(?-u:\\B)"),
                'r' | 'n' | 't' | 'f' | 'v' => {
                    out.push('\\');
                    out.push(if next == 'v' { 'x' } else { next });
                    if next == 'v' {
                        out.push_str("0B");
                    }
                }
                other if other.is_ascii_punctuation() => {
                    // Rust's syntax escapes its meta characters only; the rest are themselves.
                    if "\\.+*?()|[]{}^$#&-~".contains(other) {
                        out.push('\\');
                    }
                    out.push(other);
                }
                other => {
                    out.push('\\');
                    out.push(other);
                }
            }
            i += 2;
            continue;
        }
        // Inside a class, `&` and `~` are literal in ECMAScript, but doubled they are set operations in Rust.
        if inside && (c == '&' || c == '~') {
            out.push('\\');
        }
        // An expression's own control characters (a literal CR or LF) are fine as they are.
        out.push(c);
        i += 1;
    }
    Ok(out)
}

impl Rule {
    /// The rule for one of llama.cpp's expressions: its hand-written splitter where it has one, else the
    /// expression.
    fn of(expr: &str) -> Result<Rule, String> {
        const GPT2: &str = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
        const LLAMA3: [&str; 2] = [
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        ];
        const QWEN2: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        const QWEN35: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        Ok(match expr {
            GPT2 => Rule::Gpt2,
            e if LLAMA3.contains(&e) => Rule::Llama3,
            QWEN2 => Rule::Qwen2,
            QWEN35 => Rule::Qwen35,
            "\\p{AFMoE_digits}" | "\\d{1,3}(?=(?:\\d{3})*\\b)" => Rule::DigitGroups,
            "[^\\n]+|[\\n]+" => Rule::Newlines,
            _ => {
                let collapsed = COLLAPSED.iter().any(|(name, ..)| expr.contains(name));
                if collapsed && !expr.is_ascii() {
                    return Err(format!("the expression `{expr}` mixes Unicode classes and non-ASCII characters"));
                }
                let translated = translate(expr, collapsed)?;
                let regex = fancy_regex::RegexBuilder::new(&translated)
                    .backtrack_limit(10_000_000)
                    .build()
                    .map_err(|e| format!("the expression `{expr}` does not compile: {e}"))?;
                Rule::Regex { regex, collapsed, surrogate: surrogate_stand_in(expr) }
            }
        })
    }
}

/// The text being split: its code points, and the flags of each (none past a piece's ends).
struct Text<'a> {
    cpts: &'a [u32],
    flags: Vec<Flags>,
}

/// One piece of the text, `[start, end)` in code points, read as llama.cpp's splitters read it: nothing outside.
struct Piece<'a> {
    text: &'a Text<'a>,
    start: usize,
    end: usize,
}

const OUT: u32 = u32::MAX;

impl Piece<'_> {
    fn cpt(&self, pos: usize) -> u32 {
        if (self.start..self.end).contains(&pos) {
            self.text.cpts[pos]
        } else {
            OUT
        }
    }

    fn flags(&self, pos: usize) -> Flags {
        if (self.start..self.end).contains(&pos) {
            self.text.flags[pos]
        } else {
            Flags::default()
        }
    }

    fn lower(&self, pos: usize) -> u32 {
        match self.cpt(pos) {
            OUT => OUT,
            cp => unicode::to_lower(cp),
        }
    }

    /// The contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) at `pos`, its length, case-insensitively or not.
    fn contraction(&self, pos: usize, any_case: bool) -> Option<usize> {
        if self.cpt(pos) != '\'' as u32 || pos + 1 >= self.end {
            return None;
        }
        let at = |p: usize| if any_case { self.lower(p) } else { self.cpt(p) };
        let next = at(pos + 1);
        if [b's', b't', b'm', b'd'].iter().any(|&c| next == u32::from(c)) {
            return Some(2);
        }
        if pos + 2 < self.end {
            let after = at(pos + 2);
            let pair = |a: u8, b: u8| next == u32::from(a) && after == u32::from(b);
            if pair(b'r', b'e') || pair(b'v', b'e') || pair(b'l', b'l') {
                return Some(3);
            }
        }
        None
    }

    /// The end of a run of whitespace from `pos`, and the end of its last CR or LF (0 if none).
    fn whitespace(&self, pos: usize) -> (usize, usize) {
        let mut end = pos;
        let mut last_newline = 0;
        while self.flags(end).is_whitespace() {
            let cp = self.cpt(end);
            if cp == '\r' as u32 || cp == '\n' as u32 {
                last_newline = end + 1;
            }
            end += 1;
        }
        (end, last_newline)
    }
}

/// Collects the lengths of the words a splitter cuts a piece into.
struct Cuts<'a> {
    out: &'a mut Vec<usize>,
    prev: usize,
}

impl Cuts<'_> {
    /// Ends a word at `end`; returns its length (an empty word is not one).
    fn cut(&mut self, end: usize) -> usize {
        let len = end - self.prev;
        if len > 0 {
            self.out.push(len);
        }
        self.prev = end;
        len
    }
}

/// The rules every GPT-2-family splitter ends with, at `pos`: `\s*[\r\n]+` (whitespace up to its last newline,
/// when `newlines`), `\s+(?!\S)` (up to the last whitespace before a non-space), `\s+` (all of it, at the piece's
/// end), else the one character. Cuts the word and returns its end.
fn whitespace_word(p: &Piece, pos: usize, cuts: &mut Cuts, newlines: bool) -> usize {
    let (run_end, last_newline) = p.whitespace(pos);
    let n = run_end - pos;
    let end = if newlines && last_newline > 0 {
        last_newline
    } else if n > 1 && p.cpt(run_end) != OUT {
        run_end - 1
    } else if n > 0 {
        run_end
    } else {
        pos + 1
    };
    cuts.cut(end);
    end
}

fn gpt2(p: &Piece, cuts: &mut Cuts) {
    let mut pos = p.start;
    while pos < p.end {
        let cpt = p.cpt(pos);
        let flags = p.flags(pos);
        if let Some(n) = p.contraction(pos, false) {
            pos += cuts.cut(pos + n);
            continue;
        }
        let mut f = if cpt == ' ' as u32 { p.flags(pos + 1) } else { flags };
        let space = usize::from(cpt == ' ' as u32);
        let class: Option<fn(Flags) -> bool> = if f.is_letter() {
            Some(Flags::is_letter)
        } else if f.is_number() {
            Some(Flags::is_number)
        } else if !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.is_some() {
            Some(|f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.is_some())
        } else {
            None
        };
        if let Some(class) = class {
            pos += space;
            while class(f) {
                pos += 1;
                f = p.flags(pos);
            }
            cuts.cut(pos);
            continue;
        }
        pos = whitespace_word(p, pos, cuts, false);
    }
}

/// Llama 3's splitter; `digits` is the most digits a number word takes (3; Qwen2's is 1), `marks` whether letter
/// runs take combining marks (Qwen 3.5).
fn llama3(p: &Piece, cuts: &mut Cuts, digits: usize, marks: bool) {
    let letter = |f: Flags| f.is_letter() || (marks && f.is_mark());
    let mut pos = p.start;
    while pos < p.end {
        let cpt = p.cpt(pos);
        let flags = p.flags(pos);
        if let Some(n) = p.contraction(pos, true) {
            pos += cuts.cut(pos + n);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(cpt == '\r' as u32 || cpt == '\n' as u32 || flags.is_number()) && (letter(flags) || letter(p.flags(pos + 1))) {
            pos += 1;
            while letter(p.flags(pos)) {
                pos += 1;
            }
            cuts.cut(pos);
            continue;
        }
        // \p{N}{1,digits}
        if flags.is_number() {
            let mut first = pos;
            while p.flags(pos).is_number() {
                pos += 1;
                if pos - first >= digits {
                    cuts.cut(pos);
                    first = pos;
                }
            }
            cuts.cut(pos);
            continue;
        }
        // ' '?[^\s\p{L}\p{N}]+[\r\n]*
        let mut f = if cpt == ' ' as u32 { p.flags(pos + 1) } else { flags };
        let other = |f: Flags| !(f.is_whitespace() || letter(f) || f.is_number());
        if other(f) && flags.is_some() {
            pos += usize::from(cpt == ' ' as u32);
            while other(f) && f.is_some() {
                pos += 1;
                f = p.flags(pos);
            }
            while p.cpt(pos) == '\r' as u32 || p.cpt(pos) == '\n' as u32 {
                pos += 1;
            }
            cuts.cut(pos);
            continue;
        }
        pos = whitespace_word(p, pos, cuts, true);
    }
}

/// Digit runs in groups of three counted from the right (a shorter group first); everything else left whole.
fn digit_groups(p: &Piece, cuts: &mut Cuts) {
    let mut pos = p.start;
    while pos < p.end {
        if !p.flags(pos).is_number() {
            pos += 1;
            continue;
        }
        let start = pos;
        while pos < p.end && p.flags(pos).is_number() {
            pos += 1;
        }
        let count = pos - start;
        let mut at = start;
        if !count.is_multiple_of(3) {
            at += count % 3;
            cuts.cut(at);
        }
        while at < start + count {
            at += 3;
            cuts.cut(at);
        }
    }
    if cuts.prev < p.end {
        cuts.cut(p.end);
    }
}

fn newlines(p: &Piece, cuts: &mut Cuts) {
    let mut pos = p.start;
    while pos < p.end {
        let newline = p.cpt(pos) == '\n' as u32;
        while pos < p.end && (p.cpt(pos) == '\n' as u32) == newline {
            pos += 1;
        }
        cuts.cut(pos);
    }
}

impl Splitter {
    /// The pre-tokenizer of llama.cpp's pre-tokenizer type `pre` (its expressions, in order).
    pub fn new(expressions: &[&str], byte_encode: bool) -> Result<Splitter, String> {
        let rules = expressions.iter().map(|e| Rule::of(e)).collect::<Result<_, _>>()?;
        Ok(Splitter { rules, byte_encode })
    }

    /// Cuts `bytes` into words (each in GPT-2's byte characters when [`Splitter::byte_encode`]).
    pub fn split(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, SplitError> {
        let cpts = unicode::codepoints(bytes);
        let text = Text { flags: cpts.iter().map(|&c| unicode::flags(c)).collect(), cpts: &cpts };
        let mut pieces = vec![cpts.len()];
        let mut collapsed: Option<Vec<char>> = None;
        for rule in &self.rules {
            let mut out = Vec::with_capacity(pieces.len() * 2);
            let mut start = 0;
            for &len in &pieces {
                let piece = Piece { text: &text, start, end: start + len };
                let mut cuts = Cuts { out: &mut out, prev: start };
                match rule {
                    Rule::Gpt2 => gpt2(&piece, &mut cuts),
                    Rule::Llama3 => llama3(&piece, &mut cuts, 3, false),
                    Rule::Qwen2 => llama3(&piece, &mut cuts, 1, false),
                    Rule::Qwen35 => llama3(&piece, &mut cuts, 1, true),
                    Rule::DigitGroups => digit_groups(&piece, &mut cuts),
                    Rule::Newlines => newlines(&piece, &mut cuts),
                    Rule::Regex { regex, collapsed: is_collapsed, surrogate } => {
                        let chars: &[char] = if *is_collapsed {
                            collapsed.get_or_insert_with(|| cpts.iter().map(|&c| collapse(c)).collect())
                        } else {
                            &[]
                        };
                        let piece_text: String = if *is_collapsed {
                            chars[start..start + len].iter().collect()
                        } else {
                            cpts[start..start + len].iter().map(|&c| widen(c, *surrogate)).collect()
                        };
                        regex_cuts(regex, &piece_text, start, &mut cuts)?;
                    }
                }
                start += len;
            }
            pieces = out;
        }
        let mut words = Vec::with_capacity(pieces.len());
        let mut start = 0;
        for len in pieces {
            let mut word = Vec::with_capacity(len * 2);
            for &cp in &cpts[start..start + len] {
                if self.byte_encode {
                    let mut utf8 = Vec::with_capacity(4);
                    unicode::push_utf8(&mut utf8, cp);
                    for b in utf8 {
                        unicode::push_utf8(&mut word, unicode::byte_to_char(b));
                    }
                } else {
                    unicode::push_utf8(&mut word, cp);
                }
            }
            words.push(word);
            start += len;
        }
        Ok(words)
    }
}

/// A regular expression's cuts of one piece: each match, and the text between matches, as `std::regex_iterator`
/// walks it.
fn regex_cuts(regex: &Regex, text: &str, start: usize, cuts: &mut Cuts) -> Result<(), SplitError> {
    // Code point index of each byte offset that starts a character (and of the end).
    let mut index = vec![0usize; text.len() + 1];
    for (i, (at, _)) in text.char_indices().enumerate() {
        index[at] = i;
    }
    index[text.len()] = text.chars().count();
    let mut last = 0;
    for m in regex.find_iter(text) {
        let m = m.map_err(|e| SplitError(format!("pre-tokenization failed: {e}")))?;
        let (from, to) = (index[m.start()], index[m.end()]);
        if from > last {
            cuts.cut(start + from);
        }
        cuts.cut(start + to);
        last = to;
    }
    let chars = index[text.len()];
    if last < chars {
        cuts.cut(start + chars);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(expressions: &[&str], text: &str) -> Vec<String> {
        let splitter = Splitter::new(expressions, false).unwrap();
        splitter.split(text.as_bytes()).unwrap().into_iter().map(|w| String::from_utf8(w).unwrap()).collect()
    }

    const GPT2: &str = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";

    #[test]
    fn the_gpt2_splitter_and_its_expression_agree() {
        // The hand-written splitter, and the same expression through the regex path (spelled with a group, so
        // that the hand-written one is not picked).
        let regex = "(?:'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S))";
        for text in ["Hello world", "  leading and   trailing  ", "I'm 42 y'all!! ünïcödé 中文 🦙🦙", "tab\tnew\nline\r\n end", "a  b", ""] {
            let custom = words(&[GPT2], text);
            assert_eq!(custom, words(&[regex], text), "{text:?}");
            assert_eq!(custom.concat(), text);
        }
        assert_eq!(words(&[GPT2], "Hello, world!  ok"), ["Hello", ",", " world", "!", " ", " ok"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_qwen2_by_one() {
        let llama3 = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        assert_eq!(words(&[llama3], "1234567 I'LL"), ["123", "456", "7", " I", "'LL"]);
        let qwen2 = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        assert_eq!(words(&[qwen2], "123 x\n\n y"), ["1", "2", "3", " x", "\n\n", " y"]);
    }

    #[test]
    fn collapsed_expressions_see_categories() {
        // SmolLM's rule: every number on its own, before GPT-2's splitting.
        assert_eq!(words(&["\\p{N}", GPT2], "ab12 ٣٤"), ["ab", "1", "2", " ", "٣", "٤"]);
        // Punctuation runs (llama.cpp's `default` pre-tokenizer's first rule) take non-ASCII punctuation too.
        assert_eq!(words(&["[\\p{P}\\$\\+<=>\\^~\\|]+"], "a,「b」$"), ["a", ",「", "b", "」$"]);
        // An ECMAScript word boundary is ASCII's: a letter outside ASCII is not a word character.
        assert_eq!(words(&["\\d{1,3}(?=(?:\\d{3})*\\b)"], "1234567"), ["1", "234", "567"]);
    }

    #[test]
    fn a_surrogate_is_in_the_classes_that_span_the_surrogates() {
        // U+8C48-U+FAFF holds them (AFMoE's CJK class, as llama.cpp's source has it); U+AC00-U+D7FF does not.
        let spanning = surrogate_stand_in("[\u{8C48}-\u{FAFF}]+");
        assert!(('\u{8C48}'..='\u{FAFF}').contains(&spanning));
        let below = surrogate_stand_in("[\u{AC00}-\u{D7FF}\u{E000}]+");
        assert!(!('\u{AC00}'..='\u{D7FF}').contains(&below) && below != '\u{E000}');
        let splitter = Splitter::new(&["[\u{8C48}-\u{FAFF}]+"], false).unwrap();
        assert_eq!(splitter.split(b"a\xED\xA0\x80b").unwrap().len(), 3, "the surrogate is a match of its own");
    }

    #[test]
    fn translation_keeps_ecmascript_meaning() {
        assert_eq!(translate("[^\\s\\p{L}]+", true).unwrap(), "[^\\t\\n\\x0B\\x0C\\r \\x{D2}A-Za-z]+");
        assert_eq!(translate("\\s+(?!\\S)", false).unwrap(), "[\\t\\n\\x0B\\x0C\\r ]+(?![^\\t\\n\\x0B\\x0C\\r ])");
        assert_eq!(translate("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~]", false).unwrap(), "[!\"#$%\\&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}\\~]");
        assert!(translate("[\\S]", false).is_err());
        assert!(Rule::of("\\s?[A-Za-zµÀ-Ö]+").is_ok());
        assert!(Rule::of("[一-龥\\p{L}]").is_err(), "Unicode classes beside non-ASCII characters");
    }
}
