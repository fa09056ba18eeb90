//! Unit tests of the GGUF tokenizers on small hand-made vocabularies, one rule of llama.cpp's each. The real
//! vocabularies are checked against llama.cpp itself in tests/tokenizer.rs.

use super::*;

fn meta(model: &str, tokens: &[&str], types: &[i32]) -> Metadata {
    Metadata {
        model: model.into(),
        tokens: tokens.iter().map(|t| t.to_string()).collect(),
        token_types: Some(types.to_vec()),
        ..Metadata::default()
    }
}

/// A SentencePiece vocabulary: `<unk> <s> </s>`, the byte tokens of a few bytes, and scored pieces.
fn spm() -> Vocab {
    let mut tokens = vec!["<unk>", "<s>", "</s>", "<0x0A>", "<0xC3>", "<0xA9>"];
    let mut types = vec![2, 3, 3, 6, 6, 6];
    let pieces = ["▁", "h", "e", "l", "o", "▁h", "he", "ll", "▁he", "llo", "▁hello", "w", "▁w"];
    tokens.extend(pieces);
    types.extend(pieces.iter().map(|_| 1));
    let mut m = meta("llama", &tokens, &types);
    // Longer pieces score higher, so "▁hello" wins over its parts.
    m.scores = Some(tokens.iter().map(|t| t.chars().count() as f32).collect());
    Vocab::new(&m).unwrap()
}

#[test]
fn sentencepiece_prefixes_a_space_falls_back_to_bytes_and_strips_the_space_when_decoding() {
    let v = spm();
    let id = |t: &str| v.token_id(t.as_bytes()).unwrap();
    assert_eq!(v.tokenize(b"hello", false, false).unwrap(), [id("▁hello")]);
    assert_eq!(v.tokenize(b"hello", true, false).unwrap(), [1, id("▁hello")], "BOS by default");
    // "é" has no piece: its two bytes' tokens; "\n" likewise.
    assert_eq!(v.tokenize("hello é\n".as_bytes(), false, false).unwrap(), [id("▁hello"), id("▁"), 4, 5, 3]);
    assert_eq!(v.detokenize(&[id("▁hello"), id("▁w")], false, false), b"hello w");
    assert_eq!(v.detokenize(&[id("▁hello")], true, false), b"hello", "the first piece's space");
    assert_eq!(v.detokenize(&[1, id("▁hello")], true, false), b" hello", "BOS removed, and with it the space removal (llama.cpp's rule)");
    assert_eq!(v.detokenize(&[1, id("▁hello")], false, true), b"<s> hello");
    // A byte no token covers is an error for that text, never a panic.
    let e = v.tokenize(b"z", false, false).unwrap_err().to_string();
    assert!(e.contains("0x7A"), "{e}");
    assert!(v.tokenize(b"", true, true).unwrap() == [1], "an empty text is BOS alone");
}

/// A byte-level BPE vocabulary with GPT-2's byte characters for a few bytes, merges and special tokens.
fn bpe(pre: &str, name: Option<&str>) -> Vocab {
    let tokens = ["a", "b", "c", "Ġ", "Ċ", "ab", "Ġa", "Ġab", "abc", "<|im_start|>", "<|im_end|>", "<tool>", "<s>", "</s>", "<|endoftext|>", "<unused0>", "<unk>"];
    let types = [1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 1, 4, 3, 3, 3, 3, 2];
    let mut m = meta("gpt2", &tokens, &types);
    m.pre = Some(pre.into());
    m.merges = Some(["a b", "Ġ a", "Ġa b", "ab c"].map(String::from).to_vec());
    m.name = name.map(String::from);
    Vocab::new(&m).unwrap()
}

#[test]
fn special_tokens_split_the_text_as_llama_cpp_partitions_it() {
    let v = bpe("gpt-2", None);
    // Control tokens only when asked; user-defined ones always.
    assert_eq!(v.tokenize(b"ab<|im_start|>ab", false, true).unwrap(), [5, 9, 5]);
    assert_eq!(v.tokenize(b"ab<tool>ab", false, false).unwrap(), [5, 11, 5]);
    let unparsed = v.tokenize(b"<|im_start|>", false, false).unwrap();
    assert!(!unparsed.contains(&9), "{unparsed:?}");
    // `<|im_end|>` is a normal token in the file; its name makes it a control token and an end of generation.
    assert_eq!(v.attr(10) & attr::CONTROL, attr::CONTROL);
    assert!(v.end_of_generation.contains(&10) && v.end_of_generation.contains(&14));
    assert_eq!(v.specials.eot, Some(10), "the first of llama.cpp's EOT names the vocabulary has");
    assert_eq!(v.attr(15) & attr::UNUSED, attr::UNUSED, "a control token named unused");
    // Phi-3's special tokens take the whitespace after them.
    let phi = bpe("gpt-2", Some("Phi-3 mini"));
    assert_eq!(phi.tokenize(b"<|im_start|>  ab", false, true).unwrap(), [9, 5]);
    assert_eq!(v.tokenize(b"<|im_start|> ab", false, true).unwrap(), [9, 3, 5]);
}

#[test]
fn byte_level_bpe_merges_by_rank_and_detokenizes_gpt2_characters() {
    let v = bpe("gpt-2", None);
    // " ab" is Ġ a b: "a b" (rank 0) merges before "Ġ a" (rank 1), and nothing merges Ġ with ab.
    assert_eq!(v.tokenize(b"abc ab", false, false).unwrap(), [8, 3, 5]);
    assert_eq!(v.tokenize(b" a", false, false).unwrap(), [6]);
    assert_eq!(v.detokenize(&[8, 3, 5], false, false), b"abc ab");
    // A character with no token and no byte token of its own disappears, as in llama.cpp.
    assert_eq!(v.tokenize(b"abz", false, false).unwrap(), [5]);
    // `llama-bpe` takes a word that is a token whole, whatever the merges say.
    let llama3 = bpe("llama-bpe", None);
    assert_eq!(llama3.tokenize(b"abc", false, false).unwrap(), [8]);
    assert!(llama3.add_bos, "Llama 3's pre-tokenizer adds BOS by default");
}

#[test]
fn clean_spaces_tidies_as_llama_cpp() {
    let clean = |s: &str| {
        let mut t = s.as_bytes().to_vec();
        clean_up(&mut t);
        String::from_utf8(t).unwrap()
    };
    assert_eq!(clean("Hello , world ! ok ."), "Hello, world! ok.");
    assert_eq!(clean("rock ' n"), "rock'n");
    // After a removed " ' ", the next apostrophe's space check sees the removed space as gone.
    assert_eq!(clean("a ' ' b"), "a'' b");
    assert_eq!(clean("it 's we 're I 'll he 'd"), "it's we're I 'll he 'd");
    assert_eq!(clean(""), "");
}

#[test]
fn wordpiece_lowercases_splits_punctuation_and_marks_unknown_words() {
    let tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "▁hello", "▁world", "▁,", "wor", "▁cafe"];
    let mut m = meta("bert", &tokens, &[3, 2, 3, 3, 1, 1, 1, 1, 1]);
    (m.ids.bos, m.ids.unknown, m.ids.separator) = (Some(2), Some(1), Some(3));
    let v = Vocab::new(&m).unwrap();
    assert_eq!(v.tokenize("Hello, WORLD xyz Café".as_bytes(), true, false).unwrap(), [2, 4, 6, 5, 1, 8, 3]);
    assert_eq!(v.detokenize(&[4, 6, 5], false, false), b" hello, world", "spaces before punctuation tidied");
}

#[test]
fn unigram_takes_the_best_scoring_segmentation_and_one_unknown_per_run() {
    let tokens = ["<pad>", "</s>", "<unk>", "▁", "▁ab", "a", "b", "c", "▁abc"];
    let mut m = meta("t5", &tokens, &[3, 3, 2, 1, 1, 1, 1, 1, 1]);
    m.scores = Some(vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -3.0, -3.0, -10.0]);
    m.add_space_prefix = Some(true);
    let v = Vocab::new(&m).unwrap();
    // "▁abc": -10 whole, or "▁ab" + "c" = -5: the latter.
    assert_eq!(v.tokenize(b"abc", false, false).unwrap(), [4, 7]);
    assert_eq!(v.tokenize(b"abc", true, false).unwrap(), [4, 7, 1], "EOS by default");
    // Unknown code points in a row are one unknown token.
    assert_eq!(v.tokenize("ab\u{4E00}\u{4E01}".as_bytes(), false, false).unwrap(), [4, 2]);
    // A malformed character map is refused at load.
    m.precompiled_charsmap = Some(vec![8, 0, 0, 0, 1]);
    assert!(Vocab::new(&m).is_err());
}

#[test]
fn unsupported_or_malformed_vocabularies_are_refused_by_name() {
    let e = Vocab::new(&meta("rwkv", &["a"], &[1])).unwrap_err().to_string();
    assert!(e.contains("`rwkv`") && e.contains("gpt2, llama"), "{e}");
    let mut m = meta("gpt2", &["a"], &[1]);
    m.pre = Some("no-such-pre".into());
    m.merges = Some(Vec::new());
    let e = Vocab::new(&m).unwrap_err().to_string();
    assert!(e.contains("`no-such-pre`") && e.contains("llama-bpe") && e.contains("qwen2") && e.contains("tekken"), "{e}");
    m.pre = Some("qwen2".into());
    m.merges = None;
    assert!(Vocab::new(&m).unwrap_err().to_string().contains("merges"));
    let dup = meta("llama", &["a", "a"], &[1, 1]);
    assert!(Vocab::new(&dup).unwrap_err().to_string().contains("twice"));
    let mut short = meta("llama", &["a", "b"], &[1, 1]);
    short.scores = Some(vec![0.0]);
    assert!(Vocab::new(&short).unwrap_err().to_string().contains("scores"));
    assert!(Vocab::new(&meta("llama", &[], &[])).unwrap_err().to_string().contains("empty"));
}

#[test]
fn every_pre_tokenizer_compiles() {
    for p in PRE_TOKENIZERS {
        split::Splitter::new(p.expressions, p.byte_encode).unwrap_or_else(|e| panic!("{}: {e}", p.names[0]));
        assert!(pre_tokenizer(Some(p.names[0])).is_some_and(|found| std::ptr::eq(found, p)), "{} is found by its name", p.names[0]);
    }
    assert!(std::ptr::eq(pre_tokenizer(None).unwrap(), pre_tokenizer(Some("default")).unwrap()));
    let names: Vec<&str> = PRE_TOKENIZERS.iter().flat_map(|p| p.names.iter().copied()).collect();
    let unique: HashSet<&str> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "a name selects one pre-tokenizer");
}
