//! JSON-Schema-constrained decoding: before each sampled token, every token the schema forbids at that point gets
//! a logit of -inf. The grammar work is llguidance's (the engine vLLM, SGLang and llama.cpp use); this module only
//! adapts it to the model's vocabulary and logits.
//!
//! Three levels, each built from the one before:
//! - [`Grammars`], once per model: the token trie (every token id's bytes) and llguidance's parser factory, plus a
//!   cache of compiled schemas keyed by their text, so rows sharing a schema compile it once.
//! - [`Grammar`], once per distinct schema: a fresh matcher, cloned to start each sequence. Clones share the
//!   lazily built lexer automaton (behind llguidance's mutex), so later sequences find it warm.
//! - [`Constraint`], once per sequence: its position in the grammar; [`Constraint::mask`] then
//!   [`Constraint::consume`] every step.
//!
//! Output is compact JSON: no whitespace between tokens, `,` and `:` as separators. llguidance's own default
//! (`whitespace_flexible: true`) lets a model emit any amount of whitespace between tokens, which small models
//! use to loop until they hit the token limit. A schema may still ask for other formatting through llguidance's
//! `x-guidance` key, whose fields win over these defaults.
//!
//! Special tokens (chat markers and the like) are never allowed by a grammar, except the end tokens once the value
//! is complete: then every end token given to [`Grammars::new`] is allowed, so the model may end the way it was
//! trained to.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;
use crate::tokenize::Tokenizer;
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// Compiled schemas kept by [`Grammars::compile`]; beyond this the least recently used is dropped. A job usually
/// has one schema for all rows, but one per row must not grow memory without bound (a grammar's lexer automaton
/// can take megabytes).
const CACHED_GRAMMARS: usize = 64;

/// The token vocabulary for grammars: built once per model.
pub struct Grammars {
    factory: ParserFactory,
    /// The model's vocab size (logits per position), which may exceed the tokenizer's.
    vocab_size: usize,
    cache: HashMap<String, CachedGrammar>,
    /// Advances on every `compile`; orders cache entries by last use.
    clock: u64,
}

struct CachedGrammar {
    grammar: Arc<Grammar>,
    last_used: u64,
}

/// A compiled schema, ready to start sequences.
pub struct Grammar {
    /// A matcher at the start of the grammar; cloned, never advanced.
    start: Matcher,
}

/// One sequence's position in its grammar.
pub struct Constraint {
    matcher: Matcher,
    /// The tokens allowed now, from the last [`Constraint::mask`]; `consume` checks against it.
    allowed: Option<SimpleVob>,
}

/// The tokenizer as llguidance sees it: each token's bytes in a trie, and tokenization through the model's own
/// tokenizer, so that bytes the grammar forces (keys, enum values) are emitted as the tokens the model was trained
/// on. Not `toktrie_hf_tokenizers`: it depends on another major version of `tokenizers`.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        // Bytes that are not UTF-8 (a token ending inside a character) go through the trie, greedily.
        self.trie.tokenize_with_greedy_fallback(bytes, |text| match self.tokenizer.encode(text, false) {
            Ok(ids) => ids,
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        })
    }
}

/// An llguidance error on one line, for row errors and logs, without the parser state dump that llguidance
/// appends (`<state>...`: the tokens so far and parser statistics).
fn one_line(error: &anyhow::Error) -> String {
    clean(&format!("{error:#}"))
}

fn clean(message: &str) -> String {
    let message = message.split("<state>").next().unwrap_or(message);
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl Grammars {
    /// `end_tokens`: the model's end-of-generation token ids (first one = the EOS llguidance should allow when the
    /// JSON is complete; the others are allowed then too).
    ///
    /// Costs a serialisation of the tokenizer and llguidance's token-slice precomputation: tens to hundreds of
    /// milliseconds, once per model.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, end_tokens: &[u32]) -> Result<Grammars, String> {
        let Some(&eos) = end_tokens.first() else {
            return Err("constrained decoding needs the model's end-of-generation token, and it has none".into());
        };
        let mut words = tokenizer.token_bytes().map_err(|e| clean(&e))?;
        // Tokens the model has no logit for can never be sampled, so llguidance must never force them.
        words.truncate(vocab_size);
        if let Some(&bad) = end_tokens.iter().find(|&&t| t as usize >= words.len()) {
            return Err(format!("end token {bad} is outside the vocabulary ({} tokens)", words.len()));
        }
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(end_tokens);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| format!("cannot prepare the grammar engine: {}", one_line(&e)))?;
        // Warnings come back through `Matcher::grammar_warnings` and go to tracing, not stderr.
        factory.quiet();
        Ok(Grammars { factory, vocab_size, cache: HashMap::new(), clock: 0 })
    }

    /// The model's vocab size this vocabulary was built for.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Compiles (or returns the cached) grammar for a JSON Schema given as JSON text. Err: a one-line message
    /// naming the problem (invalid JSON, unsupported schema feature...).
    ///
    /// `$ref` works for references inside the schema (`#/$defs/...`); remote references are refused.
    pub fn compile(&mut self, schema: &str) -> Result<Arc<Grammar>, String> {
        self.clock += 1;
        if let Some(cached) = self.cache.get_mut(schema) {
            cached.last_used = self.clock;
            return Ok(Arc::clone(&cached.grammar));
        }
        let grammar = Arc::new(self.compile_uncached(schema)?);
        if self.cache.len() >= CACHED_GRAMMARS {
            let oldest = self.cache.iter().min_by_key(|(_, c)| c.last_used).map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.cache.remove(&oldest);
            }
        }
        self.cache.insert(schema.to_string(), CachedGrammar { grammar: Arc::clone(&grammar), last_used: self.clock });
        Ok(grammar)
    }

    fn compile_uncached(&self, text: &str) -> Result<Grammar, String> {
        let schema: Value =
            serde_json::from_str(text).map_err(|e| format!("the JSON schema is not valid JSON: {e}"))?;
        let mut schema = match schema {
            Value::Object(object) => object,
            Value::Bool(true) => serde_json::Map::new(),
            Value::Bool(false) => return Err("the JSON schema is `false`, which no value satisfies".into()),
            other => return Err(format!("a JSON schema must be an object or a boolean, not `{other}`")),
        };
        let compact = JsonCompileOptions { whitespace_flexible: false, ..JsonCompileOptions::default() };
        let mut options = serde_json::to_value(&compact).expect("llguidance's JSON options serialise");
        if let Some(own) = schema.get("x-guidance") {
            llguidance::json_merge(&mut options, own);
        }
        schema.insert("x-guidance".into(), options);
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(Value::Object(schema)))
            .map_err(|e| format!("unsupported JSON schema: {}", one_line(&e)))?;
        let mut start = Matcher::new(Ok(parser));
        if let Some(error) = start.get_error() {
            return Err(format!("unsupported JSON schema: {}", clean(&error)));
        }
        // The forced first steps, tried once here: a schema that refers only to itself has no first token, or forces
        // tokens for ever (`[[[[...`). Found now, it is the row's parameter that is wrong (invalid_parameters, once
        // per schema), not an engine error for every row at its first step.
        if let Err(why) = forced_start(start.clone()) {
            return Err(match why.as_str() {
                "NoExtensionBias" => "no value satisfies the JSON schema: it has no first token (a schema that refers only to itself?)".into(),
                _ => format!("no finite value satisfies the JSON schema: what it forces from the start has no end (a schema that requires itself?); the parser gave up: {why}"),
            });
        }
        for warning in start.grammar_warnings() {
            tracing::warn!(%warning, "JSON schema");
        }
        Ok(Grammar { start })
    }
}

/// Steps walked from a grammar's start while it allows one token only, to find a schema that cannot start.
const FORCED_STEPS: usize = 16;

/// Walks `matcher` from its start while exactly one token is allowed (what the schema forces, `{"` then `a":` ...),
/// up to [`FORCED_STEPS`]: the error a schema that requires itself meets on its first tokens, found once per schema.
fn forced_start(mut matcher: Matcher) -> Result<(), String> {
    for _ in 0..FORCED_STEPS {
        let mask = matcher.compute_mask_or_eos().map_err(|e| one_line(&e))?;
        if mask.num_set() != 1 || matcher.is_accepting().unwrap_or(false) {
            return Ok(());
        }
        let only = mask.first_bit_set().expect("one bit is set") as u32;
        matcher.consume_token(only).map_err(|e| one_line(&e))?;
        if matcher.is_stopped() {
            return Ok(());
        }
    }
    Ok(())
}

impl Constraint {
    pub fn new(grammar: &Grammar) -> Result<Constraint, String> {
        let matcher = grammar.start.clone();
        if let Some(error) = matcher.get_error() {
            return Err(clean(&error));
        }
        Ok(Constraint { matcher, allowed: None })
    }

    /// Sets every logit the grammar forbids now to -inf. `logits.len()` is the model's vocab size, which may be
    /// larger than the tokenizer's (padding rows): those extra ids are always forbidden. When the JSON is complete,
    /// the end tokens stay allowed; once nothing else can follow, only they are.
    ///
    /// llguidance computes the allowed set as a bitset (one bit per token); applying it is one pass over the
    /// logits, 32 at a time, skipping whole words that are all allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| one_line(&e))?;
        let words = allowed.as_slice();
        for (index, chunk) in logits.chunks_mut(32).enumerate() {
            // Bits past the trie's vocabulary are zero, and words past the bitset are absent: both forbidden.
            let word = words.get(index).copied().unwrap_or(0);
            match word {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        self.allowed = Some(allowed);
        Ok(())
    }

    /// Advances past a sampled token. Err when the token was not allowed (a bug upstream) or the matcher errored.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        let refused = || format!("token {token} is not allowed by the JSON schema here");
        if let Some(allowed) = self.allowed.take() {
            if (token as usize) >= allowed.len() || !allowed.is_allowed(token) {
                return Err(refused());
            }
        }
        if self.matcher.is_stopped() && !self.matcher.is_error() {
            // The value is complete and `mask` allowed only end tokens: one ends the sequence, and llguidance, which
            // errors on any token after its stop, has nothing to advance.
            let ends = self.matcher.tok_env().map(|env| env.tok_trie().eos_tokens().contains(&token));
            return if ends.unwrap_or(false) { Ok(()) } else { Err(refused()) };
        }
        self.matcher.consume_token(token).map_err(|e| one_line(&e))
    }

    /// True when the text so far is a complete value of the schema (EOS would be accepted).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// True when nothing can follow (the grammar forced the end, an end token was consumed, or the matcher failed),
    /// so generation must stop now.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use serde_json::json;

    use super::*;
    use crate::engine::sampling::Rng;

    struct Fixture {
        tokenizer: Tokenizer,
        /// SmolLM2's end tokens, EOS first.
        ends: Vec<u32>,
    }

    fn fixture() -> Fixture {
        let info = crate::engine::models::llama::inspect(Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
        let tokenizer = crate::tokenize::vocab::build(&info.vocab).unwrap();
        let mut ends: Vec<u32> = info.vocab.eos.into_iter().chain(info.vocab.eot).collect();
        for &end in &info.vocab.more_ends {
            if !ends.contains(&end) {
                ends.push(end);
            }
        }
        ends.dedup();
        Fixture { tokenizer, ends }
    }

    fn grammars(fixture: &Fixture, vocab_size: usize) -> Grammars {
        Grammars::new(&fixture.tokenizer, vocab_size, &fixture.ends).unwrap()
    }

    const PERSON: &str = r#"{
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["name", "age", "color", "tags"],
        "additionalProperties": false
    }"#;

    fn allowed_ids(logits: &[f32]) -> Vec<u32> {
        logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(id, _)| id as u32).collect()
    }

    fn check_person(text: &str) {
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        let object = value.as_object().unwrap_or_else(|| panic!("not an object: {text:?}"));
        let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["age", "color", "name", "tags"], "{text:?}");
        let name = object["name"].as_str().unwrap_or_else(|| panic!("name is not a string: {text:?}"));
        assert!(name.chars().count() <= 12, "name longer than 12: {text:?}");
        // An integer of any size: serde_json reads one past 64 bits as a float, so check the literal.
        let age = text.split(r#""age":"#).nth(1).and_then(|rest| rest.split(',').next()).unwrap_or("");
        assert!(object["age"].is_number(), "age is not a number: {text:?}");
        assert!(!age.is_empty() && age.trim_start_matches('-').bytes().all(|b| b.is_ascii_digit()), "age: {text:?}");
        assert!(["red", "green", "blue"].contains(&object["color"].as_str().unwrap_or("")), "color: {text:?}");
        let tags = object["tags"].as_array().unwrap_or_else(|| panic!("tags is not an array: {text:?}"));
        assert!(tags.len() <= 3, "more than 3 tags: {text:?}");
        for tag in tags {
            let tag = tag.as_str().unwrap_or_else(|| panic!("a tag is not a string: {text:?}"));
            assert!(tag.chars().count() <= 8, "tag longer than 8: {text:?}");
        }
        assert!(!has_whitespace_outside_strings(text), "whitespace between tokens: {text:?}");
    }

    fn has_whitespace_outside_strings(text: &str) -> bool {
        let (mut in_string, mut escaped) = (false, false);
        for c in text.chars() {
            match (in_string, escaped, c) {
                (true, true, _) => escaped = false,
                (true, false, '\\') => escaped = true,
                (_, _, '"') => in_string = !in_string,
                (false, _, c) if c.is_whitespace() => return true,
                _ => {}
            }
        }
        false
    }

    /// One random walk's outcome.
    struct Walk {
        text: String,
        ended_by_eos: bool,
        mask_time: Duration,
        steps: u32,
    }

    /// Picks a uniformly random allowed token until an end token is picked or the grammar stops; on the way, checks
    /// that a random forbidden token is refused by `consume`.
    fn walk(fixture: &Fixture, grammars: &Grammars, grammar: &Grammar, seed: u64) -> Walk {
        let vocab_size = grammars.vocab_size();
        let mut rng = Rng::new(seed);
        let mut constraint = Constraint::new(grammar).unwrap();
        let (mut tokens, mut mask_time, mut steps) = (Vec::new(), Duration::ZERO, 0);
        let ended_by_eos = loop {
            assert!(tokens.len() < 400, "seed {seed}: no end after 400 tokens");
            let mut logits = vec![0.0f32; vocab_size];
            let start = Instant::now();
            constraint.mask(&mut logits).unwrap();
            mask_time += start.elapsed();
            steps += 1;
            let allowed = allowed_ids(&logits);
            assert!(!allowed.is_empty(), "seed {seed}: nothing allowed after {tokens:?}");
            let trie = grammars.factory.tok_env().tok_trie();
            let special = allowed.iter().find(|&&t| trie.is_special_token(t) && !fixture.ends.contains(&t));
            assert!(special.is_none(), "seed {seed}: special token {special:?} allowed");
            if tokens.len() == 2 {
                let forbidden: Vec<u32> =
                    (0..vocab_size as u32).filter(|t| logits[*t as usize].is_infinite()).collect();
                let forbidden = forbidden[(rng.next_u64() % forbidden.len() as u64) as usize];
                let mut probe = Constraint::new(grammar).unwrap();
                for &t in &tokens {
                    probe.consume(t).unwrap();
                }
                probe.mask(&mut vec![0.0f32; vocab_size]).unwrap();
                assert!(probe.consume(forbidden).is_err(), "seed {seed}: forbidden token {forbidden} consumed");
            }
            let token = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
            if fixture.ends.contains(&token) {
                assert!(constraint.is_accepting(), "seed {seed}: end token allowed before the value is complete");
                constraint.consume(token).unwrap();
                assert!(constraint.is_stopped());
                break true;
            }
            constraint.consume(token).unwrap();
            tokens.push(token);
            if constraint.is_stopped() {
                assert!(constraint.is_accepting(), "seed {seed}: stopped on an incomplete value");
                break false;
            }
        };
        let trie = grammars.factory.tok_env().tok_trie();
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| trie.token(t).to_vec()).collect();
        let text = String::from_utf8(bytes).unwrap_or_else(|e| panic!("seed {seed}: not UTF-8: {e}"));
        assert_eq!(fixture.tokenizer.decode(&tokens, false), text, "seed {seed}: trie bytes differ");
        println!(
            "seed {seed}: {} tokens, ended by {}: {text}",
            tokens.len(),
            if ended_by_eos { "EOS" } else { "stop" }
        );
        Walk { text, ended_by_eos, mask_time, steps }
    }

    #[test]
    fn random_walks_over_allowed_tokens_give_values_of_the_schema() {
        let fixture = fixture();
        let start = Instant::now();
        let mut grammars = grammars(&fixture, fixture.tokenizer.vocab_size());
        let built = start.elapsed();
        let start = Instant::now();
        let grammar = grammars.compile(PERSON).unwrap();
        println!(
            "end tokens {:?}; vocabulary built in {built:?}, schema compiled in {:?}",
            fixture.ends,
            start.elapsed()
        );
        let (mut mask_time, mut steps) = (Duration::ZERO, 0u32);
        for seed in 0..20u64 {
            let walk = walk(&fixture, &grammars, &grammar, seed);
            // An object ends at its `}`: the grammar stops there, with no end token sampled.
            assert!(!walk.ended_by_eos, "seed {seed}");
            check_person(&walk.text);
            mask_time += walk.mask_time;
            steps += walk.steps;
        }
        println!("mask: {:.1} us per step over {steps} steps", mask_time.as_secs_f64() * 1e6 / f64::from(steps));
    }

    #[test]
    fn an_open_ended_value_ends_with_an_end_token() {
        let fixture = fixture();
        let mut grammars = grammars(&fixture, fixture.tokenizer.vocab_size());
        // After a non-zero digit another may follow, so only an end token ends the number; a leading zero
        // cannot be followed by anything, so the grammar stops there.
        let grammar = grammars.compile(r#"{"type": "integer"}"#).unwrap();
        let mut by_eos = 0;
        for seed in 0..10u64 {
            let walk = walk(&fixture, &grammars, &grammar, seed);
            let digits = walk.text.strip_prefix('-').unwrap_or(&walk.text);
            assert!(!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()), "seed {seed}: {:?}", walk.text);
            assert_eq!(walk.ended_by_eos, digits != "0", "seed {seed}: {:?}", walk.text);
            by_eos += usize::from(walk.ended_by_eos);
        }
        assert!(by_eos > 0);
    }

    #[test]
    fn a_complete_value_allows_only_the_end_tokens() {
        let fixture = fixture();
        let vocab_size = fixture.tokenizer.vocab_size();
        let mut grammars = grammars(&fixture, vocab_size);
        let grammar = grammars.compile(r#"{"enum": ["yes", "no"]}"#).unwrap();
        let mut constraint = Constraint::new(&grammar).unwrap();
        let text = r#""yes""#;
        for token in &fixture.tokenizer.encode(text, false).unwrap() {
            let mut logits = vec![0.0f32; vocab_size];
            constraint.mask(&mut logits).unwrap();
            constraint.consume(*token).unwrap();
        }
        assert!(constraint.is_accepting());
        assert!(constraint.is_stopped(), "nothing can follow the closing quote");
        let mut logits = vec![0.0f32; vocab_size];
        constraint.mask(&mut logits).unwrap();
        let mut ends = fixture.ends.clone();
        ends.sort_unstable();
        assert_eq!(allowed_ids(&logits), ends);
        // A caller that samples from that mask rather than checking `is_stopped` first may consume the end token.
        constraint.consume(ends[0]).unwrap();
        assert!(constraint.is_stopped());
    }

    #[test]
    fn a_recursive_schema_with_a_way_out_compiles() {
        let fixture = fixture();
        let mut grammars = grammars(&fixture, fixture.tokenizer.vocab_size());
        let tree = r##"{"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["c"]}}, "$ref": "#/$defs/n"}"##;
        grammars.compile(tree).unwrap();
    }

    #[test]
    fn local_refs_compile() {
        let fixture = fixture();
        let mut grammars = grammars(&fixture, fixture.tokenizer.vocab_size());
        let schema = json!({
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            "type": "array", "items": {"$ref": "#/$defs/point"}
        });
        grammars.compile(&schema.to_string()).unwrap();
    }

    #[test]
    fn invalid_schemas_are_refused_with_a_one_line_message() {
        let fixture = fixture();
        let mut grammars = grammars(&fixture, fixture.tokenizer.vocab_size());
        let cases = [
            (r#"{"type": "object""#, "not valid JSON"),
            ("[1, 2]", "must be an object"),
            ("false", "no value satisfies"),
            (r#"{"type": "colour"}"#, "unsupported JSON schema"),
            (r##"{"type": "array", "items": {"$ref": "#/$defs/missing"}}"##, "missing"),
            (r#"{"type": "string", "minLength": 5, "maxLength": 2}"#, "unsupported JSON schema"),
            (r#"{"$ref": "https://example.com/schema.json"}"#, "unsupported JSON schema"),
            // Recursion without a way out: caught before any row runs (issue #41, class 7: each row was an
            // engine_error with llguidance's internal message).
            (r##"{"$ref": "#"}"##, "no value satisfies"),
            (r##"{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}"##, "no finite value satisfies"),
            (r##"{"type": "array", "items": {"$ref": "#"}, "minItems": 1}"##, "no finite value satisfies"),
        ];
        for (schema, expected) in cases {
            let error = grammars.compile(schema).err().unwrap_or_else(|| panic!("{schema} compiled"));
            println!("{schema} -> {error}");
            assert!(error.contains(expected), "{schema}: {error}");
            assert!(!error.contains('\n'), "{schema}: {error}");
        }
    }

    #[test]
    fn compile_returns_the_cached_grammar_for_the_same_text() {
        let fixture = fixture();
        let mut grammars = grammars(&fixture, fixture.tokenizer.vocab_size());
        let first = grammars.compile(PERSON).unwrap();
        let other = grammars.compile(r#"{"type": "integer"}"#).unwrap();
        assert!(Arc::ptr_eq(&first, &grammars.compile(PERSON).unwrap()));
        assert!(!Arc::ptr_eq(&first, &other));
    }

    #[test]
    fn ids_past_the_tokenizer_vocabulary_are_forbidden() {
        let fixture = fixture();
        let tokenizer_size = fixture.tokenizer.vocab_size();
        let vocab_size = tokenizer_size + 77;
        let mut grammars = grammars(&fixture, vocab_size);
        // Any JSON value: the widest first-token set.
        let grammar = grammars.compile("{}").unwrap();
        let mut constraint = Constraint::new(&grammar).unwrap();
        let mut logits = vec![0.0f32; vocab_size];
        constraint.mask(&mut logits).unwrap();
        assert!(logits[tokenizer_size..].iter().all(|l| *l == f32::NEG_INFINITY));
        assert!(logits[..tokenizer_size].iter().any(|l| l.is_finite()));
        assert!(constraint.consume(tokenizer_size as u32 + 3).is_err());
        // Without a mask first, llguidance itself refuses it; its message loses the parser state dump.
        let error = Constraint::new(&grammar).unwrap().consume(tokenizer_size as u32 + 3).unwrap_err();
        println!("{error}");
        assert!(error.contains("out of range") && !error.contains("<state>"), "{error}");
    }

    #[test]
    fn grammars_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Grammar>();
        fn assert_send<T: Send>() {}
        assert_send::<Constraint>();
        assert_send::<Grammars>();
    }
}
