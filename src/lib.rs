//! spark-tool: Spark-X2.5 (`Spark2_5ForCausalLM`) from its Hugging Face
//! checkpoint to CPU execution and beyond. The library is CLI-free; the
//! `spark-tool` binary is a thin layer over it.

pub mod artifact;
pub mod bench;
pub mod bundled;
pub mod calibration;
pub mod checkpoint;
pub mod device;
pub mod engine;
pub mod export;
pub mod formats;
pub mod generate;
pub mod hub;
pub mod inspect;
pub mod kernels;
pub mod load;
pub mod model;
pub mod parity;
pub mod phone;
pub mod quant;
pub mod quantize;
pub mod report;
pub mod resources;
pub mod sampling;
pub mod setting;
pub mod tokenizer;

use std::path::PathBuf;

/// The trained fixture in this source tree, for tests and fuzzing (the binary never defaults to it).
pub fn bundled_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/spark-tiny")
}
