//! Unit tests of the GGUF tokenizers on small hand-made vocabularies; the real vocabularies are checked against
//! llama.cpp in tests/tokenizer.rs.

use super::*;
