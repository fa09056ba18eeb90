//! Chat templates: the Jinja template shipped in the model's metadata, rendered with minijinja.
//!
//! Templates are written for Python's Jinja2, so Python string and dict methods (`.strip()`, `.items()`, ...)
//! are provided through minijinja-contrib's pycompat layer, and `raise_exception` as Hugging Face defines it.

use minijinja::{context, Environment, Error, ErrorKind, Value};

use super::TokenizerError;
use crate::row::{ErrorCode, Message, RowError};

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

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
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos_token, eos_token })
    }

    /// Renders a conversation, ending with the assistant's turn opened (`add_generation_prompt`).
    pub fn render(&self, messages: &[Message]) -> Result<String, RowError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        let template = self.env.get_template(NAME).expect("the template was added in `new`");
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| RowError::new(ErrorCode::TemplateError, format!("the chat template failed: {e}")))
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

    #[test]
    fn invalid_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", String::new(), String::new()).is_err());
    }
}
