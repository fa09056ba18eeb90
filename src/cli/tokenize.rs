//! `nightshift tokenize`: a model's tokenizer on texts, as a job runs it (the check of the GGUF tokenizers against
//! llama.cpp's, `scripts/compare-tokenizers.py`, drives it with `--format peer`).

use std::io::{BufRead, Write};

use super::{TokenizeArgs, TokenizeFormat};
use crate::error::Error;
use crate::tokenize::gguf::Vocab;
use crate::tokenize::Tokenizer;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(line: &str) -> Result<Vec<u8>, Error> {
    let line = line.trim();
    if !line.len().is_multiple_of(2) || !line.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Error::Internal(format!("`--hex`: the line `{line}` is not hex")));
    }
    Ok((0..line.len()).step_by(2).map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("hex digits")).collect())
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

/// The first line of `scripts/llama-peer.cpp`'s output: the vocabulary's size, BOS, EOS and EOT ids (-1 for
/// none), and its end-of-generation ids.
pub fn peer_header(vocab: &Vocab) -> String {
    let id = |id: Option<u32>| id.map_or(-1, i64::from);
    let eog: Vec<u32> = vocab.end_of_generation.iter().copied().collect();
    format!("{}\t{}\t{}\t{}\t{}", vocab.len(), id(vocab.specials.bos), id(vocab.specials.eos), id(vocab.specials.eot), join(&eog))
}

/// The five fields of `scripts/llama-peer.cpp` for one input line (see there): a text in hex, or `#` and token
/// ids to detokenize.
pub fn peer_line(vocab: &Vocab, line: &str) -> Result<String, Error> {
    if let Some(ids) = line.strip_prefix('#') {
        let ids: Vec<u32> = ids.split_whitespace().map(|i| i.parse().map_err(|_| Error::Internal(format!("`{i}` is not a token id")))).collect::<Result<_, _>>()?;
        let pieces: Vec<u8> = ids.iter().flat_map(|&id| vocab.piece(id, true).to_vec()).collect();
        return Ok(format!("\t\t{}\t{}\t{}", hex(&vocab.detokenize(&ids, false, false)), hex(&vocab.detokenize(&ids, false, true)), hex(&pieces)));
    }
    let text = unhex(line)?;
    let text = &text[..];
    let fail = |e: crate::tokenize::gguf::TokenizeError| Error::Internal(format!("tokenization failed: {e}"));
    let plain = vocab.tokenize(text, false, false).map_err(fail)?;
    let special = vocab.tokenize(text, true, true).map_err(fail)?;
    let pieces: Vec<u8> = special.iter().flat_map(|&id| vocab.piece(id, true).to_vec()).collect();
    Ok(format!(
        "{}\t{}\t{}\t{}\t{}",
        join(&plain),
        join(&special),
        hex(&vocab.detokenize(&plain, false, false)),
        hex(&vocab.detokenize(&special, false, true)),
        hex(&pieces)
    ))
}

pub fn tokenize(args: &TokenizeArgs) -> Result<(), Error> {
    let vocab = if args.model.is_dir() {
        crate::engine::models::llama::inspect(&args.model)?.vocab
    } else {
        crate::engine::models::llama::gguf::vocabulary(&args.model)?
    };
    let tokenizer = crate::tokenize::vocab::build(&vocab)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    // Whether to go on: a reader that stopped reading (`| head -1`) ends the command, as it ends `cat`.
    let written = |r: std::io::Result<()>| match r {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(Error::Internal(format!("cannot write the tokens: {e}"))),
    };
    let peer = match args.format {
        TokenizeFormat::Peer => Some(tokenizer.gguf().ok_or_else(|| Error::Internal("`--format peer` compares GGUF vocabularies; this model has a tokenizer.json".into()))?),
        TokenizeFormat::Json => None,
    };
    if let Some(vocab) = peer {
        if !written(writeln!(out, "{}", peer_header(vocab)))? {
            return Ok(());
        }
    }
    let mut handle = |line: String| -> Result<bool, Error> {
        match peer {
            Some(vocab) => written(writeln!(out, "{}", peer_line(vocab, &line)?)),
            None => {
                let text = if args.hex { unhex(&line)? } else { line.into_bytes() };
                let ids = match &tokenizer {
                    Tokenizer::Gguf(v) => v.tokenize(&text, args.add_special, !args.no_parse_special).map_err(|e| Error::Internal(format!("tokenization failed: {e}")))?,
                    Tokenizer::Hf(_) => tokenizer.encode(&String::from_utf8_lossy(&text), !args.no_parse_special).map_err(|e| Error::Internal(format!("tokenization failed: {e}")))?,
                };
                let line = serde_json::json!({"ids": ids, "text": tokenizer.decode(&ids, false)});
                written(writeln!(out, "{line}"))
            }
        }
    };
    match &args.text {
        Some(text) => {
            if !handle(text.clone())? {
                return Ok(());
            }
        }
        None => {
            for line in std::io::stdin().lock().lines() {
                if !handle(line.map_err(|e| Error::Internal(format!("cannot read standard input: {e}")))?)? {
                    return Ok(());
                }
            }
        }
    }
    written(out.flush()).map(drop)
}
