//! Code points as llama.cpp's tokenizers see them: UTF-8 decoded its way (each byte of a malformed sequence is one
//! U+FFFD), classes from the tables in [`super::unicode_data`] (Unicode 15.1, the version llama.cpp's are made
//! from), and GPT-2's byte-to-character mapping for byte-level BPE.

use std::sync::OnceLock;

use super::unicode_data::{CATEGORY_RUNS, LOWERCASE, NFD_FIRST, WHITESPACE};

/// The largest code point plus one.
const CODEPOINTS: usize = 0x11_0000;

/// A code point's classes: one general category bit, and White_Space. `Flags::default()` (no bit) is "outside the
/// text", which the splitters read past a fragment's ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flags(u16);

impl Flags {
    pub const UNDEFINED: u16 = 0x01;
    pub const NUMBER: u16 = 0x02;
    pub const LETTER: u16 = 0x04;
    pub const SEPARATOR: u16 = 0x08;
    pub const MARK: u16 = 0x10;
    pub const PUNCTUATION: u16 = 0x20;
    pub const SYMBOL: u16 = 0x40;
    pub const CONTROL: u16 = 0x80;
    pub const CATEGORIES: u16 = 0xFF;
    pub const WHITESPACE: u16 = 0x100;

    pub fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    pub fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    pub fn is_mark(self) -> bool {
        self.0 & Self::MARK != 0
    }
    pub fn is_punctuation(self) -> bool {
        self.0 & Self::PUNCTUATION != 0
    }
    pub fn is_symbol(self) -> bool {
        self.0 & Self::SYMBOL != 0
    }
    pub fn is_control(self) -> bool {
        self.0 & Self::CONTROL != 0
    }
    pub fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
    /// Inside the text (any code point has a category, if only "unassigned").
    pub fn is_some(self) -> bool {
        self.0 != 0
    }
    /// The category bit alone.
    pub fn category(self) -> u16 {
        self.0 & Self::CATEGORIES
    }
}

/// Every code point's flags, in one table (2.2 MB), built on first use: the splitters read a code point's flags
/// once or twice per character.
fn table() -> &'static [u16] {
    static TABLE: OnceLock<Box<[u16]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = vec![0u16; CODEPOINTS].into_boxed_slice();
        for (i, &(start, flag)) in CATEGORY_RUNS.iter().enumerate() {
            let end = CATEGORY_RUNS.get(i + 1).map_or(CODEPOINTS, |r| r.0 as usize);
            table[start as usize..end].fill(u16::from(flag));
        }
        for &cp in &WHITESPACE {
            table[cp as usize] |= Flags::WHITESPACE;
        }
        table
    })
}

/// The flags of a code point; none for values past U+10FFFF.
pub fn flags(cp: u32) -> Flags {
    table().get(cp as usize).map_or(Flags(Flags::UNDEFINED), |&f| Flags(f))
}

/// Unicode's simple lowercase mapping (the code point itself where there is none).
pub fn to_lower(cp: u32) -> u32 {
    LOWERCASE.binary_search_by_key(&cp, |p| p.0).map_or(cp, |i| LOWERCASE[i].1)
}

/// The first code point of the canonical decomposition (the code point itself where it does not decompose): what
/// llama.cpp's BERT normaliser keeps of an accented letter before it drops marks.
pub fn nfd_first(cp: u32) -> u32 {
    NFD_FIRST.binary_search_by_key(&cp, |p| p.0).map_or(cp, |i| NFD_FIRST[i].1)
}

/// Bytes in a UTF-8 sequence by its first byte (1 for continuation bytes), without checking the rest.
pub fn len_utf8(lead: u8) -> usize {
    match lead >> 4 {
        0xC | 0xD => 2,
        0xE => 3,
        0xF => 4,
        _ => 1,
    }
}

pub const REPLACEMENT: u32 = 0xFFFD;

/// Decodes one code point at `bytes[at..]` as llama.cpp does: the lead byte says the length, the continuation
/// bytes must have their tag (overlong forms and surrogates pass). `None` for a malformed sequence.
pub fn decode_at(bytes: &[u8], at: usize) -> Option<(u32, usize)> {
    let b0 = bytes[at];
    let cont = |i: usize| bytes.get(at + i).filter(|&&b| b & 0xC0 == 0x80).map(|&b| u32::from(b & 0x3F));
    match b0 {
        0x00..=0x7F => Some((u32::from(b0), 1)),
        0x80..=0xBF => None,
        0xC0..=0xDF => Some(((u32::from(b0 & 0x1F) << 6) | cont(1)?, 2)),
        0xE0..=0xEF => Some(((u32::from(b0 & 0x0F) << 12) | (cont(1)? << 6) | cont(2)?, 3)),
        0xF0..=0xF7 => Some(((u32::from(b0 & 0x07) << 18) | (cont(1)? << 12) | (cont(2)? << 6) | cont(3)?, 4)),
        0xF8..=0xFF => None,
    }
}

/// The code points of `bytes`, a malformed byte becoming U+FFFD.
pub fn codepoints(bytes: &[u8]) -> Vec<u32> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        match decode_at(bytes, at) {
            Some((cp, n)) => {
                out.push(cp);
                at += n;
            }
            None => {
                out.push(REPLACEMENT);
                at += 1;
            }
        }
    }
    out
}

/// Appends a code point's UTF-8 bytes (surrogates too, as llama.cpp writes them back).
pub fn push_utf8(out: &mut Vec<u8>, cp: u32) {
    match cp {
        0..=0x7F => out.push(cp as u8),
        0x80..=0x7FF => out.extend_from_slice(&[0xC0 | (cp >> 6) as u8, 0x80 | (cp & 0x3F) as u8]),
        0x800..=0xFFFF => out.extend_from_slice(&[0xE0 | (cp >> 12) as u8, 0x80 | ((cp >> 6) & 0x3F) as u8, 0x80 | (cp & 0x3F) as u8]),
        _ => out.extend_from_slice(&[
            0xF0 | ((cp >> 18) & 0x07) as u8,
            0x80 | ((cp >> 12) & 0x3F) as u8,
            0x80 | ((cp >> 6) & 0x3F) as u8,
            0x80 | (cp & 0x3F) as u8,
        ]),
    }
}

/// GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the other 68 for
/// U+0100 onwards, in byte order.
pub fn byte_to_char(byte: u8) -> u32 {
    static MAP: OnceLock<[u32; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut map = [0u32; 256];
        let mut next = 256;
        for (b, c) in map.iter_mut().enumerate() {
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            *c = if printable {
                b as u32
            } else {
                next += 1;
                next - 1
            };
        }
        map
    })[byte as usize]
}

/// The byte a GPT-2 stand-in character stands for.
pub fn char_to_byte(cp: u32) -> Option<u8> {
    static MAP: OnceLock<std::collections::HashMap<u32, u8>> = OnceLock::new();
    MAP.get_or_init(|| (0..=255u8).map(|b| (byte_to_char(b), b)).collect()).get(&cp).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_a_few_code_points() {
        assert!(flags('a' as u32).is_letter() && flags('Ж' as u32).is_letter() && flags('中' as u32).is_letter());
        assert!(flags('7' as u32).is_number() && flags('٣' as u32).is_number() && flags('½' as u32).is_number());
        assert!(flags(' ' as u32).is_whitespace() && flags(0x3000).is_whitespace() && flags('\n' as u32).is_whitespace());
        assert!(!flags(0x200B).is_whitespace(), "ZERO WIDTH SPACE is a format character, not White_Space");
        assert!(flags('!' as u32).is_punctuation() && flags('$' as u32).is_symbol() && flags('🦙' as u32).is_symbol());
        assert!(flags(0x301).is_mark());
        // Unicode 15.1's CJK Extension I is letters; 16.0's additions are not assigned yet.
        assert!(flags(0x2EBF0).is_letter());
        assert_eq!(flags(0x1CC00).category(), Flags::UNDEFINED);
        assert_eq!(to_lower('A' as u32), 'a' as u32);
        assert_eq!(to_lower(0x130), 'i' as u32);
        assert_eq!(to_lower('a' as u32), 'a' as u32);
        assert_eq!(nfd_first('é' as u32), 'e' as u32);
        assert_eq!(nfd_first('e' as u32), 'e' as u32);
    }

    #[test]
    fn malformed_utf8_is_one_replacement_per_byte() {
        assert_eq!(codepoints("aé中🦙".as_bytes()), vec!['a' as u32, 'é' as u32, '中' as u32, '🦙' as u32]);
        // A lone continuation byte, a lead byte cut short, an invalid lead byte.
        assert_eq!(codepoints(b"\x80a\xE4\xB8b\xFF"), vec![REPLACEMENT, 'a' as u32, REPLACEMENT, REPLACEMENT, 'b' as u32, REPLACEMENT]);
        let mut out = Vec::new();
        for cp in codepoints("x🦙é".as_bytes()) {
            push_utf8(&mut out, cp);
        }
        assert_eq!(out, "x🦙é".as_bytes());
    }

    #[test]
    fn gpt2_bytes_map_to_characters_and_back() {
        assert_eq!(byte_to_char(b'a'), 'a' as u32);
        assert_eq!(byte_to_char(b' '), 'Ġ' as u32);
        assert_eq!(byte_to_char(b'\n'), 'Ċ' as u32);
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte('中' as u32), None);
    }
}
