//! On-disk formats of quantized artifacts (no algorithms here).

pub mod gguf;
pub mod gptq;
