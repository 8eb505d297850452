//! One decode step of Spark2_5 as an ONNX graph (docs/PHONE_IO.md §4–§6):
//! static shapes, the KV cache as explicit per-layer tensors sized by layer
//! type, per-type additive masks and rotary cos/sin fed by the host.
//!
//! Per layer (norm weights and the 1/√d attention scale are folded into the
//! following MatMul weights, which is exact algebra and keeps constant
//! multiplies out of the quantized graph):
//! ```text
//! n = x / sqrt(mean(x²) + eps)   (as √H · LpNormalization([x, √(H·eps)])[..H])
//! q,k,v,g = n·W{q,k,v,g}'          q,k rotated with the layer type's cos/sin
//! K = concat(past_key_in, k)       V = concat(past_value_in, v)
//! a = softmax(q·K + mask)·V        a_head *= sigmoid(g_head)
//! x += a·Wo;  n2 = norm(x);  x += (gelu(n2·Wgate') ⊙ n2·Wup')·Wdown
//! ```

use std::ops::Range;

use super::onnx::{Attr, DType, Graph};
use crate::checkpoint::layout::layer_prefix;
use crate::checkpoint::{LayerType, Proj, QkvLayout, SparkConfig};
pub use crate::phone::manifest::{
    cos_input, key_in, key_out, mask_input, sin_input, type_name, value_in, value_out, EMBEDS,
    HIDDEN_IN, HIDDEN_OUT, LOGITS,
};

/// How a MatMul weight is materialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repr {
    /// f32 `[K, N]`.
    F32,
    /// int8 symmetric per output channel `[K, N]` (range −127…127).
    Q8,
    /// The f32 per-channel scales `[N]` of [`Repr::Q8`].
    Q8Scale,
    /// IEEE half `[K, N]` (rounded to nearest even).
    F16,
    /// LPBQ codes `q − 8` as INT4 `[K, N]` (a GPTQ linear, `super::lpbq`).
    Int4,
    /// LPBQ block multipliers k ∈ 1…16, uint8 `[K/B, N]`.
    LpbqK,
    /// LPBQ per-channel γ, f32 `[N]`.
    LpbqGamma,
}

/// A MatMul weight `[K, N]` = (rows `rows` of checkpoint tensor `[N_all, K]`)ᵀ,
/// each input column scaled by the folded norm weight and by `mul`. For a GPTQ linear
/// (`gptq_group`: its group size) `tensor` is the linear's prefix and `rows` its output columns.
#[derive(Debug, Clone)]
pub struct WeightSpec {
    pub tensor: String,
    pub rows: Range<usize>,
    pub k: usize,
    pub fold: Option<String>,
    pub mul: f32,
    pub repr: Repr,
    pub gptq_group: Option<usize>,
}

/// Which layers (and whether the head) one exported part holds.
#[derive(Debug, Clone)]
pub struct PartPlan {
    pub index: usize,
    pub of: usize,
    pub layers: Range<usize>,
    pub head: bool,
}

/// Weights of one decoder layer's matrices (q, k, v, gate heads, out, MLP).
fn layer_params(cfg: &SparkConfig) -> usize {
    let h = cfg.hidden_size;
    (cfg.q_dim() + 2 * cfg.kv_dim() + cfg.num_attention_heads) * h
        + cfg.q_dim() * h
        + 3 * h * cfg.intermediate_size
}

impl PartPlan {
    /// Matrix weights this part holds (its layers, and the head when it has it).
    pub fn params(&self, cfg: &SparkConfig) -> usize {
        self.layers.len() * layer_params(cfg)
            + if self.head {
                cfg.vocab_size * cfg.hidden_size
            } else {
                0
            }
    }

    pub fn file(&self) -> String {
        if self.of == 1 {
            "model.onnx".into()
        } else {
            format!("part{}_of_{}.onnx", self.index + 1, self.of)
        }
    }
    /// Qualcomm's Genie naming for token-generator graphs.
    pub fn graph_name(&self, context: usize) -> String {
        format!("token_ar1_cl{context}_{}_of_{}", self.index + 1, self.of)
    }
}

/// Split `layers` decoder layers plus the head into `parts` contiguous
/// parts with the largest part (by parameters) as small as possible.
pub fn plan_parts(cfg: &SparkConfig, parts: usize) -> Vec<PartPlan> {
    let mut units = vec![layer_params(cfg); cfg.num_hidden_layers];
    units.push(cfg.vocab_size * cfg.hidden_size);
    let n = units.len();
    let parts = parts.clamp(1, n);
    // best[i][p]: minimal max-part cost splitting units[..i] into p parts.
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(units.iter().scan(0, |s, u| {
            *s += u;
            Some(*s)
        }))
        .collect();
    let mut best = vec![vec![usize::MAX; parts + 1]; n + 1];
    let mut cut = vec![vec![0usize; parts + 1]; n + 1];
    best[0][0] = 0;
    for i in 1..=n {
        for p in 1..=parts.min(i) {
            for j in (p - 1)..i {
                if best[j][p - 1] == usize::MAX {
                    continue;
                }
                let c = best[j][p - 1].max(prefix[i] - prefix[j]);
                if c < best[i][p] {
                    best[i][p] = c;
                    cut[i][p] = j;
                }
            }
        }
    }
    let mut bounds = vec![n];
    let (mut i, mut p) = (n, parts);
    while p > 0 {
        i = cut[i][p];
        bounds.push(i);
        p -= 1;
    }
    bounds.reverse();
    let layers = cfg.num_hidden_layers;
    bounds
        .windows(2)
        .enumerate()
        .map(|(index, w)| PartPlan {
            index,
            of: parts,
            layers: w[0]..w[1].min(layers),
            head: w[1] == n,
        })
        .collect()
}

/// Past entries a layer type keeps: W−1 for sliding, C−1 for full.
pub fn past_len(cfg: &SparkConfig, t: LayerType, context: usize) -> usize {
    match t {
        LayerType::Sliding => cfg.sliding_window.min(context) - 1,
        LayerType::Full => context - 1,
    }
}

/// Residual stream entering a part (`input_embeds` for the first) and
/// leaving a part without the head; the host passes one part's output to the next.
pub fn hidden_in(p: &PartPlan) -> String {
    if p.index == 0 {
        EMBEDS.into()
    } else {
        HIDDEN_IN.into()
    }
}

pub struct StepBuilder<'a> {
    pub cfg: &'a SparkConfig,
    pub qkv: &'a [QkvLayout],
    pub tied: bool,
    pub context: usize,
    /// The checkpoint's GPTQ linears (prefixes) and their group size: their codes are written
    /// as they are, so no norm can be folded into them.
    pub gptq: &'a std::collections::BTreeSet<String>,
    pub gptq_group: usize,
    /// The norm weights, when norms are applied as their own `Mul` instead of folded into the
    /// following weights (exports of GPTQ checkpoints).
    pub norms: Option<&'a std::collections::HashMap<String, Vec<f32>>>,
}

impl StepBuilder<'_> {
    /// The `[k, rows.len()]` initializer `name` from rows `rows` of the stored `tensor`, with norm
    /// `fold` folded in (unless norms are applied on their own) and scaled by `mul`.
    fn weight(
        &self,
        g: &mut Graph<WeightSpec>,
        name: &str,
        (tensor, rows): (String, Range<usize>),
        k: usize,
        fold: Option<String>,
        mul: f32,
    ) -> String {
        let n = rows.len();
        // A GPTQ linear is addressed by its prefix; a folded norm is never asked of it.
        let gptq_group = tensor
            .strip_suffix(".weight")
            .filter(|p| self.gptq.contains(*p))
            .map(|_| self.gptq_group);
        let tensor = match gptq_group {
            Some(_) => tensor.trim_end_matches(".weight").to_string(),
            None => tensor,
        };
        let fold = if self.norms.is_some() { None } else { fold };
        // A folded norm also carries the √H that `unit_norm` leaves out.
        let mul = match fold {
            Some(_) => mul * (self.cfg.hidden_size as f32).sqrt(),
            None => mul,
        };
        g.init(
            name,
            DType::F32,
            &[k, n],
            super::onnx::Source::Deferred(WeightSpec {
                tensor,
                rows,
                k,
                fold,
                mul,
                repr: Repr::F32,
                gptq_group,
            }),
        )
    }

    /// The `[K, N]` initializer of projection `proj` of layer `l`, read from wherever the
    /// checkpoint stores it (its rows of a fused `q_k_v_proj`, or its own tensor).
    fn proj_weight(
        &self,
        g: &mut Graph<WeightSpec>,
        name: &str,
        l: usize,
        proj: Proj,
        fold: Option<String>,
        mul: f32,
    ) -> String {
        let (prefix, rows) = proj.stored_at(l, self.qkv[l], self.cfg);
        let [n, k] = proj.shape(self.cfg);
        let rows = rows.unwrap_or(0..n);
        self.weight(g, name, (format!("{prefix}.weight"), rows), k, fold, mul)
    }

    /// `x / sqrt(mean(x²) + eps)` over the last axis of `[1, 1, H]`, times the norm weight
    /// `weight` unless it is folded into the following MatMuls. [`Self::unit_norm`] leaves a
    /// factor 1/√H, which is applied with the norm weight (in its `Mul` or in the fold).
    fn norm(&self, g: &mut Graph<WeightSpec>, p: &str, x: &str, weight: &str) -> String {
        let n = self.unit_norm(g, p, x);
        match self.norms {
            None => n,
            Some(norms) => {
                let sqrt_h = (self.cfg.hidden_size as f32).sqrt();
                let w = &norms[weight];
                let bytes = w.iter().flat_map(|v| (v * sqrt_h).to_le_bytes()).collect();
                let c = g.init(
                    &format!("{p}_w"),
                    DType::F32,
                    &[w.len()],
                    super::onnx::Source::Bytes(bytes),
                );
                g.f("Mul", &format!("{p}_scaled"), &[&n, &c], &[1, 1, w.len()])
            }
        }
    }

    /// `x / sqrt(Σx² + H·eps)` = RMSNorm(x)/√H, exactly, as one `LpNormalization` of `x` with
    /// the constant `√(H·eps)` appended: the HTP computes it in one op, where the decomposed
    /// form (x², mean, +eps, sqrt, divide) rounds five 16-bit intermediates, the worst of them
    /// x², whose range is the square of the residual stream's outliers (docs/PHONE_EXPORT.md,
    /// "the norm as one op").
    fn unit_norm(&self, g: &mut Graph<WeightSpec>, p: &str, x: &str) -> String {
        let h = self.cfg.hidden_size;
        let c = (h as f64 * self.cfg.rms_norm_eps as f64).sqrt() as f32;
        let eps = g.const_f32(&format!("{p}_eps_col"), &[c], &[1, 1, 1]);
        let last = vec![("axis", Attr::Int(-1))];
        let aug = g.node(
            "Concat",
            &format!("{p}_aug"),
            &[x, &eps],
            DType::F32,
            &[1, 1, h + 1],
            last.clone(),
        );
        let mut attrs = last;
        attrs.push(("p", Attr::Int(2)));
        let unit = g.node(
            "LpNormalization",
            &format!("{p}_lp"),
            &[&aug],
            DType::F32,
            &[1, 1, h + 1],
            attrs,
        );
        let start = g.const_i64("i64_0", &[0]);
        let end = g.const_i64(&format!("i64_{h}"), &[h as i64]);
        let axis = g.const_i64("axes_last", &[-1]);
        g.f(
            "Slice",
            &format!("{p}_out"),
            &[&unit, &start, &end, &axis],
            &[1, 1, h],
        )
    }

    /// NeoX rotate-half over the first R dims of `[.., heads, hd]`.
    fn rope(&self, g: &mut Graph<WeightSpec>, p: &str, x: &str, t: LayerType) -> String {
        let hd = self.cfg.head_dim;
        let r = self.cfg.rope_for(t).rotary_dims;
        let shape = g.shape(x).to_vec();
        let heads = shape[2];
        let half = [1, 1, heads, r / 2];
        let (cos, sin) = (cos_input(t), sin_input(t));
        let ax = g.const_i64("axis3", &[3]);
        let slice = |g: &mut Graph<WeightSpec>, name: &str, a: usize, b: usize| {
            let s = g.const_i64(&format!("i64_{a}"), &[a as i64]);
            let e = g.const_i64(&format!("i64_{b}"), &[b as i64]);
            g.f(
                "Slice",
                &format!("{p}_{name}"),
                &[x, &s, &e, &ax],
                &[1, 1, heads, b - a],
            )
        };
        let x1 = slice(g, "x1", 0, r / 2);
        let x2 = slice(g, "x2", r / 2, r);
        let pass = (r < hd).then(|| slice(g, "pass", r, hd));
        let a = g.f("Mul", &format!("{p}_x1c"), &[&x1, &cos], &half);
        let b = g.f("Mul", &format!("{p}_x2s"), &[&x2, &sin], &half);
        let c = g.f("Mul", &format!("{p}_x2c"), &[&x2, &cos], &half);
        let d = g.f("Mul", &format!("{p}_x1s"), &[&x1, &sin], &half);
        let r1 = g.f("Sub", &format!("{p}_r1"), &[&a, &b], &half);
        let r2 = g.f("Add", &format!("{p}_r2"), &[&c, &d], &half);
        let mut parts = vec![r1.as_str(), r2.as_str()];
        if let Some(pass) = &pass {
            parts.push(pass);
        }
        g.node(
            "Concat",
            &format!("{p}_rot"),
            &parts,
            DType::F32,
            &[1, 1, heads, hd],
            vec![("axis", Attr::Int(3))],
        )
    }

    fn reshape(&self, g: &mut Graph<WeightSpec>, out: &str, x: &str, shape: &[usize]) -> String {
        let s: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let key = format!(
            "shape_{}",
            s.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("x")
        );
        let sh = g.const_i64(&key, &s);
        g.f("Reshape", out, &[x, &sh], shape)
    }

    fn layer(&self, g: &mut Graph<WeightSpec>, l: usize, x: &str) -> String {
        let cfg = self.cfg;
        let t = cfg.layer_types[l];
        let (h, hd, nh, kvh) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let (qd, kvd, inter, grp) = (
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
            cfg.gqa_group(),
        );
        let past = past_len(cfg, t, self.context);
        let p = format!("l{l}");
        let pre = layer_prefix(l);
        let ln1 = Some(format!("{pre}input_layernorm.weight"));
        let ln2 = Some(format!("{pre}post_attention_layernorm.weight"));

        let n = self.norm(
            g,
            &format!("{p}_ln1"),
            x,
            ln1.as_deref().expect("set above"),
        );
        let scale = 1.0 / (hd as f32).sqrt();
        let wq = self.proj_weight(g, &format!("{p}_wq"), l, Proj::Q, ln1.clone(), scale);
        let wk = self.proj_weight(g, &format!("{p}_wk"), l, Proj::K, ln1.clone(), 1.0);
        let wv = self.proj_weight(g, &format!("{p}_wv"), l, Proj::V, ln1.clone(), 1.0);
        let wg = self.proj_weight(g, &format!("{p}_wg"), l, Proj::G, ln1, 1.0);
        let q = g.f("MatMul", &format!("{p}_q"), &[&n, &wq], &[1, 1, qd]);
        let k = g.f("MatMul", &format!("{p}_k"), &[&n, &wk], &[1, 1, kvd]);
        let v = g.f("MatMul", &format!("{p}_v"), &[&n, &wv], &[1, 1, kvd]);
        let gate = g.f("MatMul", &format!("{p}_g"), &[&n, &wg], &[1, 1, nh]);

        let q4 = self.reshape(g, &format!("{p}_q4"), &q, &[1, 1, nh, hd]);
        let k4 = self.reshape(g, &format!("{p}_k4"), &k, &[1, 1, kvh, hd]);
        let qr = self.rope(g, &format!("{p}_qrope"), &q4, t);
        let kr = self.rope(g, &format!("{p}_krope"), &k4, t);
        let qa = self.reshape(g, &format!("{p}_qa"), &qr, &[kvh, grp, 1, hd]);
        let k_new = self.reshape(g, &key_out(l), &kr, &[kvh, 1, hd, 1]);
        let v_new = self.reshape(g, &value_out(l), &v, &[kvh, 1, 1, hd]);
        let kin = g.input(&key_in(l), DType::F32, &[kvh, 1, hd, past]);
        let vin = g.input(&value_in(l), DType::F32, &[kvh, 1, past, hd]);
        let kall = g.node(
            "Concat",
            &format!("{p}_kall"),
            &[&kin, &k_new],
            DType::F32,
            &[kvh, 1, hd, past + 1],
            vec![("axis", Attr::Int(3))],
        );
        let vall = g.node(
            "Concat",
            &format!("{p}_vall"),
            &[&vin, &v_new],
            DType::F32,
            &[kvh, 1, past + 1, hd],
            vec![("axis", Attr::Int(2))],
        );
        let s = g.f(
            "MatMul",
            &format!("{p}_scores"),
            &[&qa, &kall],
            &[kvh, grp, 1, past + 1],
        );
        let sm = g.f(
            "Add",
            &format!("{p}_masked"),
            &[&s, &mask_input(t)],
            &[kvh, grp, 1, past + 1],
        );
        let pr = g.node(
            "Softmax",
            &format!("{p}_probs"),
            &[&sm],
            DType::F32,
            &[kvh, grp, 1, past + 1],
            vec![("axis", Attr::Int(-1))],
        );
        let o = g.f(
            "MatMul",
            &format!("{p}_attn"),
            &[&pr, &vall],
            &[kvh, grp, 1, hd],
        );
        let o4 = self.reshape(g, &format!("{p}_attn4"), &o, &[1, 1, nh, hd]);
        let gs = g.f("Sigmoid", &format!("{p}_gate"), &[&gate], &[1, 1, nh]);
        let gs4 = self.reshape(g, &format!("{p}_gate4"), &gs, &[1, 1, nh, 1]);
        let og = g.f("Mul", &format!("{p}_gated"), &[&o4, &gs4], &[1, 1, nh, hd]);
        let o2 = self.reshape(g, &format!("{p}_gated2"), &og, &[1, 1, qd]);
        let wo = self.proj_weight(g, &format!("{p}_wo"), l, Proj::Out, None, 1.0);
        let a = g.f("MatMul", &format!("{p}_o"), &[&o2, &wo], &[1, 1, h]);
        let x1 = g.f("Add", &format!("{p}_resid1"), &[x, &a], &[1, 1, h]);

        let n2 = self.norm(
            g,
            &format!("{p}_ln2"),
            &x1,
            ln2.as_deref().expect("set above"),
        );
        let wgate = self.proj_weight(g, &format!("{p}_wgate"), l, Proj::Gate, ln2.clone(), 1.0);
        let wup = self.proj_weight(g, &format!("{p}_wup"), l, Proj::Up, ln2, 1.0);
        let wdown = self.proj_weight(g, &format!("{p}_wdown"), l, Proj::Down, None, 1.0);
        let gt = g.f(
            "MatMul",
            &format!("{p}_mlp_gate"),
            &[&n2, &wgate],
            &[1, 1, inter],
        );
        let up = g.f(
            "MatMul",
            &format!("{p}_mlp_up"),
            &[&n2, &wup],
            &[1, 1, inter],
        );
        let ge = g.node(
            "Gelu",
            &format!("{p}_mlp_gelu"),
            &[&gt],
            DType::F32,
            &[1, 1, inter],
            vec![("approximate", Attr::Str("none".into()))],
        );
        let m = g.f("Mul", &format!("{p}_mlp_act"), &[&ge, &up], &[1, 1, inter]);
        let d = g.f(
            "MatMul",
            &format!("{p}_mlp_down"),
            &[&m, &wdown],
            &[1, 1, h],
        );
        g.f("Add", &format!("{p}_resid2"), &[&x1, &d], &[1, 1, h])
    }

    /// The float graph of one part.
    pub fn build(&self, plan: &PartPlan) -> Graph<WeightSpec> {
        let cfg = self.cfg;
        let h = cfg.hidden_size;
        let mut g = Graph::new(&plan.graph_name(self.context));
        let mut x = g.input(&hidden_in(plan), DType::F32, &[1, 1, h]);
        let mut types: Vec<LayerType> = cfg.layer_types[plan.layers.clone()].to_vec();
        types.sort();
        types.dedup();
        for &t in &types {
            let past = past_len(cfg, t, self.context);
            let r = cfg.rope_for(t).rotary_dims;
            g.input(&mask_input(t), DType::F32, &[1, 1, 1, past + 1]);
            g.input(&cos_input(t), DType::F32, &[1, 1, 1, r / 2]);
            g.input(&sin_input(t), DType::F32, &[1, 1, 1, r / 2]);
        }
        for l in plan.layers.clone() {
            x = self.layer(&mut g, l, &x);
        }
        if plan.head {
            let n = self.norm(&mut g, "final_norm", &x, "model.norm.weight");
            let (tensor, fold) = if self.tied {
                ("model.embedding.weight", "model.norm.weight")
            } else {
                ("lm_head.weight", "model.norm.weight")
            };
            let w = self.weight(
                &mut g,
                "lm_head_w",
                (tensor.into(), 0..cfg.vocab_size),
                h,
                Some(fold.into()),
                1.0,
            );
            g.f("MatMul", LOGITS, &[&n, &w], &[1, 1, cfg.vocab_size]);
            g.output(LOGITS);
        } else {
            g.rename(&x, HIDDEN_OUT);
            g.output(HIDDEN_OUT);
        }
        for l in plan.layers.clone() {
            g.output(&key_out(l));
            g.output(&value_out(l));
        }
        g
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The bundled fixture's config (the graph tests' model).
    pub(crate) fn tiny() -> SparkConfig {
        SparkConfig::from_json_str(
            include_str!("../../fixtures/spark-tiny/config.json"),
            "spark-tiny",
        )
        .unwrap()
    }

    #[test]
    fn parts_are_contiguous_cover_everything_and_end_with_the_head() {
        let cfg = tiny();
        for n in 1..=cfg.num_hidden_layers + 1 {
            let p = plan_parts(&cfg, n);
            assert_eq!(p.len(), n);
            assert_eq!(p[0].layers.start, 0);
            for w in p.windows(2) {
                assert_eq!(w[0].layers.end, w[1].layers.start);
                assert!(!w[0].head);
            }
            assert!(p[n - 1].head);
            assert_eq!(p[n - 1].layers.end, cfg.num_hidden_layers);
            assert!(p.iter().all(|x| !x.layers.is_empty() || x.head));
        }
    }

    #[test]
    fn cache_sizes_follow_the_layer_type() {
        let cfg = tiny();
        assert_eq!(
            past_len(&cfg, LayerType::Sliding, 4096),
            cfg.sliding_window - 1
        );
        assert_eq!(past_len(&cfg, LayerType::Full, 4096), 4095);
        // A context shorter than the window caps the sliding cache too.
        assert_eq!(past_len(&cfg, LayerType::Sliding, 16), 15);
    }

    #[test]
    fn graph_has_per_type_inputs_and_only_new_kv_outputs() {
        let cfg = tiny();
        let qkv = vec![QkvLayout::Fused; cfg.num_hidden_layers];
        let b = StepBuilder {
            cfg: &cfg,
            qkv: &qkv,
            tied: true,
            context: 256,
            gptq: &std::collections::BTreeSet::new(),
            gptq_group: 0,
            norms: None,
        };
        let g = b.build(&plan_parts(&cfg, 1)[0]);
        let names: Vec<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
        for n in [
            "input_embeds",
            "attention_mask_sliding",
            "attention_mask_full",
            "position_ids_cos_sliding",
            "position_ids_sin_full",
        ] {
            assert!(names.contains(&n), "{n} missing");
        }
        let r_full = cfg.rope_for(LayerType::Full).rotary_dims;
        assert_eq!(g.shape("position_ids_cos_full"), &[1, 1, 1, r_full / 2]);
        assert_eq!(
            g.shape("past_key_0_out"),
            &[cfg.num_key_value_heads, 1, cfg.head_dim, 1]
        );
        assert_eq!(g.outputs.len(), 1 + 2 * cfg.num_hidden_layers);
        assert!(
            g.nodes.iter().all(|n| n.op != "Erf"),
            "GELU must be the Gelu op"
        );
        assert_eq!(
            g.nodes.iter().filter(|n| n.op == "Gelu").count(),
            cfg.num_hidden_layers
        );
    }
}
