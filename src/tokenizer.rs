//! Text ↔ token ids with the checkpoint's own `tokenizer.json`, and the
//! Spark chat frame (docs/MODEL.md §13).

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizing failed")]
    Encode(#[source] tokenizers::Error),
    #[error("decoding failed")]
    Decode(#[source] tokenizers::Error),
}

pub const BOS: &str = "<｜start▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
/// Hard-coded in the shipped template; emitted even without a caller's system message.
pub const BUILTIN_SYSTEM: &str = "you are a helpful assistant.";

pub struct SparkTokenizer {
    inner: tokenizers::Tokenizer,
}

impl SparkTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(SparkTokenizer { inner })
    }

    /// Encode without adding BOS/EOS: the chat frame already starts every turn with BOS.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(TokenizerError::Encode)
    }

    /// Decode keeping role/tool markers (they are ordinary added tokens in Spark).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(TokenizerError::Decode)
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Render one user turn in the chat frame, ending with the generation prompt.
pub fn render_chat(user: &str, system: Option<&str>, thinking: bool) -> String {
    let mut s = format!("{BOS}<|System|>\n{BUILTIN_SYSTEM}");
    if let Some(sys) = system {
        s.push_str("\n\n");
        s.push_str(sys);
    }
    s.push_str(EOS);
    s.push_str(&format!("{BOS}<|User|>{user}{EOS}{BOS}<|Bot|>"));
    s.push_str(if thinking { "<think>" } else { "</think>" });
    s
}

/// Streams text for a growing list of generated ids without splitting
/// multi-byte characters: text is printed only once it decodes cleanly.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    printed: usize,
}

impl StreamDecoder {
    pub fn push(&mut self, tok: &SparkTokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = text.get(self.printed..).unwrap_or_default().to_string();
        self.printed = text.len();
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_frame_matches_the_spec() {
        assert_eq!(
            render_chat("Hi", None, true),
            "<｜start▁of▁sentence｜><|System|>\nyou are a helpful assistant.<｜end▁of▁sentence｜>\
             <｜start▁of▁sentence｜><|User|>Hi<｜end▁of▁sentence｜><｜start▁of▁sentence｜><|Bot|><think>"
        );
        let s = render_chat("Hi", Some("Be brief."), false);
        assert!(s.contains("assistant.\n\nBe brief.<｜end▁of▁sentence｜>"));
        assert!(s.ends_with("<|Bot|></think>"));
    }
}
