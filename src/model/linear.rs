//! Every projection in the model is a [`Linear`]; the model never asks
//! which kind. Dense weights (f32, or bf16 kept as bf16) live here;
//! quantized kinds plug in behind the same trait.

use std::sync::Arc;

use safetensors::Dtype;

use crate::checkpoint::store::U16View;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::kernels::w4a8::PackedW4A8;
use crate::kernels::{self, bf16};

pub trait Linear: Send + Sync {
    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;
    /// `y[m, out] = x[m, in] · Wᵀ`.
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]);
    /// Short description for reports, e.g. `dense f32`.
    fn kind(&self) -> String;
    /// Bytes of weight data (values, scales, zero points, as the kernel holds them) that one
    /// forward reads: what a decode step streams from memory for this linear.
    fn weight_bytes(&self) -> usize;
    /// The effective weight `[out, in]` in f32 (what `forward` multiplies by).
    fn dequantize(&self) -> Vec<f32>;
    /// `forward` of `x` rounded to bf16, its output rounded to bf16 (a bf16 model's activations,
    /// `Bf16Act`). A linear whose kernel rounds on the way in or out overrides this to skip the
    /// copy and the passes; the bits are those of this default.
    fn forward_bf16(&self, x: &[f32], m: usize, y: &mut [f32]) {
        forward_rounded(self, x, m, y);
    }
    /// The W4A8 weight when `forward` (`bf16` false) or `forward_bf16` (`bf16` true) is exactly
    /// [`PackedW4A8::matmul_rounding`] of it: a caller may then fuse two such linears (the MLP's
    /// GELU(gate) ⊙ up, [`PackedW4A8::gelu_mul_rounding`]).
    fn w4a8_rounding(&self, bf16: bool) -> Option<&PackedW4A8> {
        let _ = bf16;
        None
    }
    /// `forward` into a new `[m, out]` buffer.
    fn project(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * self.out_features()];
        self.forward(x, m, &mut y);
        y
    }
}

/// `l.forward` of `x` rounded to bf16 (a copy), its output rounded in place: what
/// [`Linear::forward_bf16`] does unless a kernel rounds on its own.
pub fn forward_rounded<L: Linear + ?Sized>(l: &L, x: &[f32], m: usize, y: &mut [f32]) {
    let mut xr = x.to_vec();
    kernels::convert::round_bf16_in_place(&mut xr);
    l.forward(&xr, m, y);
    kernels::convert::round_bf16_in_place(y);
}

/// A dense row-major weight. bf16 checkpoints stay bf16 (half the bytes a
/// token streams; widening to f32 is exact); f16 and f32 become f32.
#[derive(Clone)]
pub enum DenseWeight {
    F32(Arc<[f32]>),
    /// bf16 bit patterns.
    Bf16(Bf16Data),
}

/// bf16 bits owned, or read in place from the checkpoint's map.
#[derive(Clone)]
pub enum Bf16Data {
    Owned(Arc<[u16]>),
    Mapped(U16View),
}

impl std::ops::Deref for Bf16Data {
    type Target = [u16];
    fn deref(&self) -> &[u16] {
        match self {
            Bf16Data::Owned(w) => w,
            Bf16Data::Mapped(w) => w,
        }
    }
}

impl DenseWeight {
    /// Rows `rows` (all when `None`) of the 2-D tensor `name`.
    pub fn load(
        ck: &Checkpoint,
        name: &str,
        rows: Option<std::ops::Range<usize>>,
    ) -> Result<Self, CheckpointError> {
        let e = ck.entry(name)?;
        if e.dtype == Dtype::BF16 {
            let cols: usize = e.shape[1..].iter().product();
            let range = match rows {
                Some(r) => r.start * cols * 2..r.end * cols * 2,
                None => 0..e.end - e.start,
            };
            let data = match ck.store.u16_view(e, range.clone()) {
                Some(v) => Bf16Data::Mapped(v),
                None => Bf16Data::Owned(bf16::bits_from_le_bytes(&ck.store.bytes(e)[range]).into()),
            };
            return Ok(DenseWeight::Bf16(data));
        }
        let w = match rows {
            Some(r) => ck.store.rows_to_f32(e, r.start, r.end)?,
            None => ck.store.to_f32(e)?,
        };
        Ok(DenseWeight::F32(w.into()))
    }

    pub fn len(&self) -> usize {
        match self {
            DenseWeight::F32(w) => w.len(),
            DenseWeight::Bf16(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy elements `range` into `out` as f32 (e.g. one embedding row).
    pub fn read_f32(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            DenseWeight::F32(w) => out.copy_from_slice(&w[range]),
            DenseWeight::Bf16(w) => {
                for (o, b) in out.iter_mut().zip(&w[range]) {
                    *o = bf16::widen(*b);
                }
            }
        }
    }

    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.len()];
        self.read_f32(0..self.len(), &mut v);
        v
    }
}

/// A dense weight `[out, in]`.
pub struct DenseLinear {
    weight: DenseWeight,
    out_features: usize,
    in_features: usize,
}

impl DenseLinear {
    pub fn new(weight: Arc<[f32]>, out_features: usize, in_features: usize) -> Self {
        Self::from_weight(DenseWeight::F32(weight), out_features, in_features)
    }

    pub fn from_weight(weight: DenseWeight, out_features: usize, in_features: usize) -> Self {
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

    pub fn weight(&self) -> &DenseWeight {
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
        let (k, n) = (self.in_features, self.out_features);
        match &self.weight {
            DenseWeight::F32(w) => kernels::matmul().matmul_nt(x, m, k, w, n, y),
            DenseWeight::Bf16(w) => bf16::matmul_nt(x, m, k, w, n, y),
        }
    }
    fn kind(&self) -> String {
        match self.weight {
            DenseWeight::F32(_) => "dense f32".into(),
            DenseWeight::Bf16(_) => "dense bf16".into(),
        }
    }
    fn weight_bytes(&self) -> usize {
        match &self.weight {
            DenseWeight::F32(w) => std::mem::size_of_val(&w[..]),
            DenseWeight::Bf16(w) => std::mem::size_of_val(&w[..]),
        }
    }
    fn dequantize(&self) -> Vec<f32> {
        self.weight.to_f32()
    }
}

/// A linear fed as llama.cpp's CPU backend feeds it: the activations converted to the weight
/// type's `vec_dot_type` first (GGUF files; `formats::gguf::activations`).
pub struct GgmlActivations {
    pub inner: Box<dyn Linear>,
    pub act: crate::formats::gguf::activations::ActQuant,
}

impl GgmlActivations {
    /// `inner` fed with activations `act` (f32 needs no wrapper).
    pub fn wrap(
        inner: Box<dyn Linear>,
        act: crate::formats::gguf::activations::ActQuant,
    ) -> Box<dyn Linear> {
        match act {
            crate::formats::gguf::activations::ActQuant::F32 => inner,
            act => Box::new(GgmlActivations { inner, act }),
        }
    }
}

impl Linear for GgmlActivations {
    fn in_features(&self) -> usize {
        self.inner.in_features()
    }
    fn out_features(&self) -> usize {
        self.inner.out_features()
    }
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let mut xr = x.to_vec();
        self.act.round(&mut xr);
        self.inner.forward(&xr, m, y);
    }
    fn kind(&self) -> String {
        format!("{} ({} activations)", self.inner.kind(), self.act.name())
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn dequantize(&self) -> Vec<f32> {
        self.inner.dequantize()
    }
}
