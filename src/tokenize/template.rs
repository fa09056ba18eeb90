//! Chat templates: the Jinja template shipped in the model's metadata, rendered with minijinja.
//!
//! Templates are written for Python's Jinja2, so Python string and dict methods (`.strip()`, `.items()`, ...)
//! are provided through minijinja-contrib's pycompat layer, and `raise_exception` as Hugging Face defines it.
//!
//! A template is a program from the model file, so its work is bounded: [`FUEL`] instructions per render, an
//! output of at most [`output_limit`] bytes, and [`memory_limit`] bytes held while it renders (on a metered
//! thread, [`crate::alloc`]). A template that goes past the memory limit once is not run again: every later row
//! is an error. A model's template is rendered on a probe conversation when the job is checked, so one that cannot
//! render a single user message stops the job there (exit 4), before any row.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use minijinja::{context, Environment, Error, ErrorKind, Value};

use super::TokenizerError;
use crate::row::{ErrorCode, Message, RowError};

pub struct ChatTemplate {
    inner: Arc<Inner>,
}

struct Inner {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Set once a render went past the memory limit.
    over_memory: AtomicBool,
}

const NAME: &str = "chat";

/// Template instructions per render. A chat template spends tens per message; this is a long conversation's
/// worth many times over, and a fraction of a second of work.
pub const FUEL: u64 = 5_000_000;

/// The most bytes a render may write: a template writes its messages once or twice plus its own markup.
pub fn output_limit(input_bytes: usize) -> usize {
    (1 << 20) + 8 * input_bytes
}

/// The most bytes a render may hold.
pub fn memory_limit(input_bytes: usize) -> usize {
    (256 << 20) + 16 * input_bytes
}

/// A writer that refuses to grow past its limit.
struct Bounded {
    out: Vec<u8>,
    limit: usize,
    over: bool,
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        // As Hugging Face's `apply_chat_template` sets up Jinja2.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let template = ChatTemplate { inner: Arc::new(Inner { env, bos_token, eos_token, over_memory: AtomicBool::new(false) }) };
        // The probe: a template that cannot render one user message (or runs out of its limits doing it) is no
        // chat template for this job.
        let probe = [Message { role: "user".into(), content: "Hello".into() }];
        template.render(&probe).map_err(|e| TokenizerError::Template(format!("it cannot render a single user message: {}", e.message)))?;
        Ok(template)
    }

    /// Renders a conversation, ending with the assistant's turn opened (`add_generation_prompt`).
    pub fn render(&self, messages: &[Message]) -> Result<String, RowError> {
        let failed = |message: String| RowError::new(ErrorCode::TemplateError, message);
        if self.inner.over_memory.load(Ordering::Relaxed) {
            return Err(failed("the chat template went past its memory limit on an earlier row; it is not run again".to_string()));
        }
        let input_bytes: usize = messages.iter().map(|m| m.role.len() + m.content.len()).sum();
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let inner = Arc::clone(&self.inner);
        let rendered = crate::alloc::run_metered(memory_limit(input_bytes), move || inner.render(messages, output_limit(input_bytes)));
        match rendered {
            Ok(result) => result.map_err(failed),
            Err(crate::alloc::OverLimit) => {
                self.inner.over_memory.store(true, Ordering::Relaxed);
                Err(failed(format!(
                    "the chat template went past its memory limit ({} MiB) rendering this row; it is not run again",
                    memory_limit(input_bytes) >> 20
                )))
            }
        }
    }
}

impl Inner {
    fn render(&self, messages: Vec<Value>, limit: usize) -> Result<String, String> {
        let template = self.env.get_template(NAME).expect("the template was added in `new`");
        let ctx = context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        let mut out = Bounded { out: Vec::new(), limit, over: false };
        match template.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.out).map_err(|_| "the chat template wrote invalid UTF-8".to_string()),
            Err(_) if out.over => Err(format!("the chat template wrote more than its output limit of {limit} bytes")),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                Err(format!("the chat template ran past its limit of {FUEL} instructions (it loops too long)"))
            }
            Err(e) => Err(format!("the chat template failed: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(content: &str) -> Message {
        Message { role: "user".into(), content: content.into() }
    }

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let source = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::new(source, "<s>".into(), "</s>".into()).unwrap();
        assert_eq!(t.render(&[user("hi")]).unwrap(), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'].strip() }}";
        let t = ChatTemplate::new(source, String::new(), String::new()).unwrap();
        assert_eq!(t.render(&[user("  x  ")]).unwrap(), "x");
        let err = t.render(&[Message { role: "system".into(), content: "s".into() }]).unwrap_err();
        assert_eq!(err.code, ErrorCode::TemplateError);
        assert!(err.message.contains("first must be user"), "{}", err.message);
    }

    /// Gemma 2's chat template as Google ships it (llama.cpp's copy, fetched with the models): `<start_of_turn>` turns,
    /// the assistant as `model`, content trimmed, and a system message refused (a row error, as Hugging Face raises).
    #[test]
    fn gemmas_template_renders_its_turns_and_refuses_a_system_message() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/llama.cpp/models/templates/google-gemma-2-2b-it.jinja");
        let Ok(source) = std::fs::read_to_string(&path) else {
            eprintln!("skipped: {} is not there (scripts/fetch-models.sh fetches it)", path.display());
            return;
        };
        let t = ChatTemplate::new(&source, "<bos>".into(), "<eos>".into()).unwrap();
        let conversation = [user(" What is RoPE? "), Message { role: "assistant".into(), content: "Rotary embeddings.".into() }, user("And GQA?")];
        assert_eq!(
            t.render(&conversation).unwrap(),
            "<bos><start_of_turn>user\nWhat is RoPE?<end_of_turn>\n<start_of_turn>model\nRotary embeddings.<end_of_turn>\n<start_of_turn>user\nAnd GQA?<end_of_turn>\n<start_of_turn>model\n"
        );
        let err = t.render(&[Message { role: "system".into(), content: "Be brief.".into() }, user("hi")]).unwrap_err();
        assert_eq!(err.code, ErrorCode::TemplateError);
        assert!(err.message.contains("System role not supported"), "{}", err.message);
    }

    #[test]
    fn invalid_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", String::new(), String::new()).is_err());
    }
}
