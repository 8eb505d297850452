//! The integration tests, in one binary: each module was a test crate of its own, and every one
//! of them linked the whole library again (docs/TESTING.md).

mod common;

mod artifacts;
mod cli;
mod faults;
mod gguf;
mod gguf_blocks;
mod golden;
mod gptq_reference;
mod hub;
#[cfg(feature = "lab")]
mod lab;
mod loader;
mod malformed;
mod parity;
mod phone;
mod phone_w4a16;
mod prefill_decode;
mod quantize;
mod reports;
