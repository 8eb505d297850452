//! Quantization algorithms (no file formats here): the zero-point-8 grid and
//! its scale search, Hessians, GPTQ.

// The lab's post-solve steps (docs/QUANTIZE.md "The lab").
#[cfg(feature = "lab")]
pub mod descent;
pub mod gptaq;
pub mod gptq;
pub mod grid;
pub mod hessian;
#[cfg(feature = "lab")]
pub mod refit;
pub mod timing;

#[cfg(feature = "lab")]
pub use descent::descend;
pub use gptq::{
    delta_form, gptq, output_error_parts, quadratic_form, relative_output_error,
    relative_output_error_with, rtn, GptqConfig, GptqError, GptqResult, GptqSolver, Order,
    QuantizedWeight, Solution,
};
pub use grid::{Grid, Lattice, ScaleRule};
pub use hessian::Hessian;
#[cfg(feature = "lab")]
pub use refit::refit_scales;
