//! The user-facing settings that library messages refer to ("raise the context", "replace with
//! force"). The library never spells a front end's flags: a message shows a [`Setting`] through
//! `Display`, which prints the library's own name (`option \`context\``) unless the front end
//! installed its spelling once at start-up with [`spell_with`] (the CLI installs its flags, so the
//! same message reads "raise --context" there).

use std::fmt;
use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Setting {
    /// KV-cache / exported context length.
    Context,
    /// The GPTQ group size.
    GroupSize,
    /// Number of calibration windows.
    Samples,
    /// Tokens per calibration window.
    SeqLen,
    /// Multiplier on calibrated activation ranges.
    RangeMargin,
    /// Number of graph parts of a phone export.
    Parts,
    /// Replace a previous artifact of ours.
    Force,
    /// Run although the memory plan exceeds the available memory.
    ForceMemory,
    /// Continue an interrupted quantize.
    Resume,
    /// The numerics a GPTQ checkpoint is executed with.
    W4Numerics,
    /// The weight format of quantize.
    Format,
    /// What the weight path favours.
    Priority,
    /// The output folder of an artifact.
    Out,
    /// The file `run` writes its logits to.
    LogitsOut,
    /// The file `parity` writes its report to.
    Json,
    /// Token ids given instead of a prompt.
    Tokens,
    /// The prompt text.
    Prompt,
    /// Tokens `run`/`parity` generate at most.
    MaxNewTokens,
    /// Prompt tokens of a benchmark.
    PromptLen,
    /// Generated tokens of a benchmark.
    Gen,
    /// Activation rows of the kernel benchmark.
    Rows,
    /// The file quantize writes dequantized weights to.
    DumpDequantized,
    /// The numerics of a phone export.
    Precision,
    /// The file a report is written to as HTML.
    Html,
    /// The file a report is written to as Markdown.
    Markdown,
}

impl Setting {
    /// The library's name: the field of the options struct that carries it.
    pub fn name(self) -> &'static str {
        match self {
            Setting::Context => "context",
            Setting::GroupSize => "group_size",
            Setting::Samples => "samples",
            Setting::SeqLen => "seq_len",
            Setting::RangeMargin => "range_margin",
            Setting::Parts => "parts",
            Setting::Force => "force",
            Setting::ForceMemory => "force_memory",
            Setting::Resume => "resume",
            Setting::W4Numerics => "w4_numerics",
            Setting::Format => "format",
            Setting::Precision => "precision",
            Setting::Priority => "priority",
            Setting::Out => "out",
            Setting::LogitsOut => "logits_out",
            Setting::Json => "json",
            Setting::Tokens => "tokens",
            Setting::Prompt => "prompt",
            Setting::MaxNewTokens => "max_new_tokens",
            Setting::PromptLen => "prompt_len",
            Setting::Gen => "gen",
            Setting::Rows => "rows",
            Setting::DumpDequantized => "dump_dequantized",
            Setting::Html => "html",
            Setting::Markdown => "markdown",
        }
    }
}

static SPELLING: OnceLock<fn(Setting) -> &'static str> = OnceLock::new();

/// Install how this program spells settings in messages (first call wins).
pub fn spell_with(spelling: fn(Setting) -> &'static str) {
    let _ = SPELLING.set(spelling);
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match SPELLING.get() {
            Some(spell) => f.write_str(spell(*self)),
            None => write!(f, "option `{}`", self.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_names_are_the_options_fields() {
        // Tests run without a front end's spelling installed.
        assert_eq!(Setting::Context.to_string(), "option `context`");
        assert_eq!(
            format!("raise {}", Setting::Context),
            "raise option `context`"
        );
    }
}
