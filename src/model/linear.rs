//! Every projection in the model is a [`Linear`]; the model never asks
//! which kind. Dense f32 lives here; quantized kinds plug in behind the
//! same trait.

use std::sync::Arc;

use crate::kernels;

pub trait Linear: Send + Sync {
    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;
    /// `y[m, out] = x[m, in] · Wᵀ`.
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]);
    /// Short description for reports, e.g. `dense f32`.
    fn kind(&self) -> String;
    /// The effective weight `[out, in]` in f32 (what `forward` multiplies by).
    fn dequantize(&self) -> Vec<f32>;
}

/// A dense weight `[out, in]` held as f32 (converted from bf16/f16/f32 at load).
pub struct DenseLinear {
    weight: Arc<[f32]>,
    out_features: usize,
    in_features: usize,
}

impl DenseLinear {
    pub fn new(weight: Arc<[f32]>, out_features: usize, in_features: usize) -> Self {
        assert_eq!(
            weight.len(),
            out_features * in_features,
            "dense weight size does not match its shape"
        );
        DenseLinear {
            weight,
            out_features,
            in_features,
        }
    }

    pub fn weight(&self) -> &[f32] {
        &self.weight
    }
}

impl Linear for DenseLinear {
    fn in_features(&self) -> usize {
        self.in_features
    }
    fn out_features(&self) -> usize {
        self.out_features
    }
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        kernels::matmul().matmul_nt(x, m, self.in_features, &self.weight, self.out_features, y);
    }
    fn kind(&self) -> String {
        "dense f32".into()
    }
    fn dequantize(&self) -> Vec<f32> {
        self.weight.to_vec()
    }
}
