//! `quant_report.html`, written beside `quant_report.json` in every quantized checkpoint: which
//! layers and projections each method struggled with, the damping each needed, where the time
//! went and why this weight format was chosen.

use std::path::Path;

use maud::html;
use serde::Serialize;

use super::page::{self, Cell};
use super::plots::{self, Axis, Bar, BarChart, Bars};
use super::ReportError;
use crate::quantize::{LinearReport, QuantReport};

/// The page's name inside the checkpoint folder.
pub const FILE_NAME: &str = "quant_report.html";

/// Relative errors below this are drawn on the axis floor (a zero error has no logarithm).
const ERROR_FLOOR: f64 = 1e-8;

/// Layer and projection of a stored linear's name: `model.layers.3.mlp.down_proj` is layer 3,
/// `mlp.down_proj`; a name outside the layers (`lm_head`) has no layer.
pub fn place(name: &str) -> (Option<usize>, &str) {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return (None, name);
    };
    match rest.split_once('.') {
        Some((layer, proj)) => match layer.parse() {
            Ok(l) => (Some(l), proj),
            Err(_) => (None, name),
        },
        None => (None, name),
    }
}

/// Each method's relative output error of one projection, layer by layer: the bars of one chart.
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectionErrors {
    pub proj: String,
    /// The layer of each entry (`None`: outside the layers).
    pub layers: Vec<Option<usize>>,
    pub written: Vec<f64>,
    pub rtn: Vec<Option<f64>>,
    pub gptq: Vec<Option<f64>>,
    pub gptq_search: Vec<Option<f64>>,
}

/// The linears grouped by projection, projections in the order they first appear.
pub fn projection_errors(linears: &[LinearReport]) -> Vec<ProjectionErrors> {
    let mut out: Vec<ProjectionErrors> = Vec::new();
    for l in linears {
        let (layer, proj) = place(&l.name);
        let i = match out.iter().position(|p| p.proj == proj) {
            Some(i) => i,
            None => {
                out.push(ProjectionErrors {
                    proj: proj.to_string(),
                    layers: vec![],
                    written: vec![],
                    rtn: vec![],
                    gptq: vec![],
                    gptq_search: vec![],
                });
                out.len() - 1
            }
        };
        let p = &mut out[i];
        p.layers.push(layer);
        p.written.push(l.error);
        p.rtn.push(l.rtn_error);
        p.gptq.push(l.gptq_error);
        p.gptq_search.push(l.gptq_search_error);
    }
    out
}

fn error_chart(p: &ProjectionErrors) -> Result<plots::Svg, ReportError> {
    let categories: Vec<String> = p
        .layers
        .iter()
        .map(|l| l.map_or("–".into(), |l| l.to_string()))
        .collect();
    let bars = |v: &[Option<f64>]| v.iter().map(|e| e.map(Bar::from)).collect();
    let mut series: Vec<Bars> = [
        ("RTN", &p.rtn),
        ("GPTQ", &p.gptq),
        ("GPTQ + search", &p.gptq_search),
    ]
    .into_iter()
    .filter(|(_, v)| v.iter().any(Option::is_some))
    .map(|(label, v)| Bars {
        label: label.into(),
        values: bars(v),
    })
    .collect();
    // Without the comparison (`--no-compare`) only the written weights' error is known.
    if series.is_empty() {
        series.push(Bars {
            label: "written".into(),
            values: p.written.iter().map(|e| Some(Bar::from(*e))).collect(),
        });
    }
    plots::bar_chart(&BarChart {
        title: &p.proj,
        value_desc: "‖(W−Q)X‖² / ‖WX‖² (log)",
        axis: Axis::Log { floor: ERROR_FLOOR },
        categories: &categories,
        series: &series,
        horizontal: false,
        width: 560,
    })
}

/// The block tuning row: its settings and what it did, summed over the layers.
fn block_tuning(r: &QuantReport) -> String {
    let Some(bt) = &r.recipe.lab.block_tune else {
        return "off".into();
    };
    let l = &r.block_tune_layers;
    let mean = |f: &dyn Fn(&crate::quantize::lab::LayerTuneReport) -> f64| {
        l.iter().map(f).sum::<f64>() / l.len().max(1) as f64
    };
    let moved: u64 = l.iter().map(|x| x.codes_moved).sum();
    let codes: u64 = l.iter().map(|x| x.codes).sum();
    format!(
        "{} steps × {} windows per layer; block output error {} → {} (mean of {} layers, {} tuned), {:.2} % of codes moved",
        bt.steps,
        bt.batch,
        page::sci(mean(&|x| x.error_before)),
        page::sci(mean(&|x| x.error_after)),
        l.len(),
        l.iter().filter(|x| x.tuned).count(),
        100.0 * moved as f64 / codes.max(1) as f64
    )
}

/// The model tuning row: its settings and the calibration KL it reached.
fn model_tuning(r: &QuantReport) -> String {
    let (Some(mt), Some(res)) = (&r.recipe.lab.model_tune, &r.model_tune_result) else {
        return "off".into();
    };
    format!(
        "{} steps × {} windows; calibration KL {} → {}{}",
        mt.steps,
        mt.batch,
        page::sci(res.kl_before),
        page::sci(res.kl_after),
        if res.tuned {
            String::new()
        } else {
            " (not lower: solved state kept)".into()
        }
    )
}

fn phase_chart(r: &QuantReport) -> Result<plots::Svg, ReportError> {
    let categories: Vec<String> = r.phases.iter().map(|p| json_name(&p.phase)).collect();
    plots::bar_chart(&BarChart {
        title: "Wall time per phase",
        value_desc: "seconds",
        axis: Axis::Linear(None),
        categories: &categories,
        series: &[Bars {
            label: "seconds".into(),
            values: r
                .phases
                .iter()
                .map(|p| Some(Bar::from(p.seconds)))
                .collect(),
        }],
        horizontal: true,
        width: 1100,
    })
}

/// How a value reads in the JSON report (`"gptq-search"`, `"w4a16"`).
fn json_name(v: &impl Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

fn opt_sci(v: Option<f64>) -> String {
    v.map_or("–".into(), page::sci)
}

/// The page of one quantize run.
pub fn html(r: &QuantReport) -> Result<String, ReportError> {
    let groups = projection_errors(&r.linears);
    let charts = groups
        .iter()
        .map(error_chart)
        .collect::<Result<Vec<_>, _>>()?;
    let phases = phase_chart(r)?;
    let format = json_name(&r.recipe.format).to_uppercase();
    let headline = headline(r, &format);
    let settings = settings(r, &format);
    let p = &r.path;
    let body = html! {
        p { strong { (headline) } }
        h2 { "Run" }
        (page::table(&["setting", "value"], settings.into_iter().map(|(k, v)| vec![Cell::from(k), Cell::from(v)])))
        h2 { "Device path" }
        (page::table(&["target", "format", "group size", "kernel", "runs in vLLM", "verified", "LPBQ scales"], [vec![
            Cell::from(p.target),
            Cell::from(json_name(&p.format)),
            Cell::Num(p.group_size.to_string()),
            Cell::from(p.kernel.unwrap_or("–")),
            Cell::from(p.runs_in_vllm.to_string()),
            Cell::from(p.verified.to_string()),
            Cell::from(p.lpbq.to_string()),
        ]]))
        ul { @for reason in &p.reasons { li { (reason) } } }
        h2 { "Mean relative output error" }
        (page::table(&["written", "RTN", "GPTQ", "GPTQ + search"], [vec![
            Cell::Num(page::sci(r.mean_error)),
            Cell::Num(opt_sci(r.mean_rtn_error)),
            Cell::Num(opt_sci(r.mean_gptq_error)),
            Cell::Num(opt_sci(r.mean_gptq_search_error)),
        ]]))
        @if let Some(a) = r.mean_act_error {
            p.note {
                "W4A8: the per-token int8 rounding of each linear's input adds " (page::sci(a))
                " on average to the written weights' error (same measure, a sample of the calibration rows; "
                "per linear in quant_report.json as act_error)."
            }
        }
        @if let Some(s) = r.stream_error {
            p.note {
                "The quantized model's residual stream after the last layer is " (page::sci(s))
                " of the float model's (‖s̃ − s‖² / ‖s‖² over the calibration tokens)."
            }
        }
        @if let Some((mean, lo, hi, n)) = r.stream_weights() {
            p.note {
                "float-stream: " (n) " out_proj and down_proj took the float stream's error into their "
                "targets with the split-half weight α, mean " (format!("{mean:.2}")) ", from "
                (format!("{lo:.2}")) " to " (format!("{hi:.2}")) " (per linear in quant_report.json as stream_weight)."
            }
        }
        h2 { "Relative output error per layer and projection" }
        p.note {
            "‖(W − Q)X‖² / ‖WX‖² on each linear's calibration inputs, by layer; lower is better. Log scale, floored at "
            (page::sci(ERROR_FLOOR)) "."
        }
        div.grid { @for c in &charts { (page::figure(c, "")) } }
        h2 { "Time per phase" }
        (page::figure(&phases, "Wall seconds of each phase over the run (docs/SCALE.md); CPU use in the table."))
        (page::table(&["phase", "wall s", "CPU s", "CPU use"], r.phases.iter().map(|ph| vec![
            Cell::from(json_name(&ph.phase)),
            Cell::Num(format!("{:.2}", ph.seconds)),
            Cell::Num(format!("{:.2}", ph.cpu_seconds)),
            Cell::Num(format!("{:.0} %", 100.0 * ph.utilisation)),
        ])))
        h2 { "Per linear" }
        (page::table(
            &["linear", "out × in", "written", "RTN", "GPTQ", "GPTQ + search", "damping", "dead columns", "seconds"],
            r.linears.iter().map(|l| vec![
                Cell::from(l.name.as_str()),
                Cell::Num(format!("{} × {}", l.out_features, l.in_features)),
                Cell::Num(page::sci(l.error)),
                Cell::Num(opt_sci(l.rtn_error)),
                Cell::Num(opt_sci(l.gptq_error)),
                Cell::Num(opt_sci(l.gptq_search_error)),
                Cell::Num(format!("{}", l.damp)),
                Cell::Num(l.dead_columns.to_string()),
                Cell::Num(format!("{:.2}", l.seconds)),
            ]),
        ))
    };
    Ok(page::render(
        "spark-tool quantize",
        &format!("{} → {}", r.model, r.out),
        body,
    ))
}

/// The page's first line: format, method, mean error and size.
fn headline(r: &QuantReport, format: &str) -> String {
    format!(
        "{format} g{} by {}: mean relative output error {}{}, {:.3} bits per weight",
        r.recipe.group_size,
        json_name(&r.recipe.method),
        page::sci(r.mean_error),
        r.mean_rtn_error
            .map_or(String::new(), |e| format!(" (RTN {})", page::sci(e))),
        r.bits_per_weight
    )
}

/// The run's settings and resources, one row each.
fn settings(r: &QuantReport, format: &str) -> Vec<(&'static str, String)> {
    let plan = &r.memory_plan;
    vec![
        ("model", r.model.clone()),
        ("output", r.out.clone()),
        ("format", format.to_string()),
        ("group size", r.recipe.group_size.to_string()),
        ("method", json_name(&r.recipe.method)),
        ("scale rule", json_name(&r.scale_rule)),
        ("column order", json_name(&r.recipe.order)),
        ("refit rounds", r.recipe.lab.refit_rounds.to_string()),
        ("descent passes", r.recipe.lab.descent_passes.to_string()),
        ("objective", json_name(&r.objective)),
        ("block tuning", block_tuning(r)),
        ("model tuning", model_tuning(r)),
        ("calibration forward", json_name(&r.recipe.forward_precision)),
        ("q/k/v layout", json_name(&r.recipe.qkv_layout)),
        ("4-bit head", r.recipe.quantize_head.to_string()),
        (
            "calibration",
            format!(
                "{} × {} tokens from {} (sha256 {})",
                r.samples,
                r.seq_len,
                r.calibration_files.join(", "),
                r.calibration_sha256
            ),
        ),
        ("bits per weight", format!("{:.3}", r.bits_per_weight)),
        ("output size", page::bytes(r.output_bytes)),
        (
            "time",
            format!(
                "wall {:.1} s, CPU {:.1} s, {:.0} % of {} threads",
                r.wall_seconds,
                r.cpu_seconds,
                100.0 * r.cpu_utilisation,
                r.threads
            ),
        ),
        (
            "peak memory",
            format!(
                "RSS {}, private {}; planned {} (activations {}, Hessian {}, weights {}, fixed {}, block tuning {}, model tuning {})",
                r.peak_rss_bytes.map_or("–".into(), page::bytes),
                r.peak_private_bytes.map_or("–".into(), page::bytes),
                page::bytes(plan.total()),
                page::bytes(plan.activations),
                page::bytes(plan.hessian),
                page::bytes(plan.weights),
                page::bytes(plan.fixed),
                page::bytes(plan.block_tune),
                page::bytes(plan.model_tune)
            ),
        ),
        (
            "resumed from layer",
            r.resumed_from_layer.map_or("–".into(), |l| l.to_string()),
        ),
    ]
}

/// Write the page into the checkpoint folder being built (`dir`), atomically.
pub fn write_html(dir: &Path, r: &QuantReport) -> Result<(), ReportError> {
    super::write_text(&dir.join(FILE_NAME), &html(r)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(name: &str, e: f64, rtn: Option<f64>) -> LinearReport {
        LinearReport {
            name: name.into(),
            out_features: 8,
            in_features: 8,
            error: e,
            rtn_error: rtn,
            gptq_error: Some(e * 1.1),
            gptq_search_error: Some(e),
            damp: 0.01,
            dead_columns: 0,
            seconds: 0.1,
            act_error: None,
            stream_weight: None,
        }
    }

    #[test]
    fn names_place_by_layer_and_projection() {
        assert_eq!(
            place("model.layers.12.mlp.down_proj"),
            (Some(12), "mlp.down_proj")
        );
        assert_eq!(place("lm_head"), (None, "lm_head"));
        assert_eq!(place("model.layers.x.mlp"), (None, "model.layers.x.mlp"));
    }

    #[test]
    fn the_bars_are_the_reports_errors_grouped_by_projection() {
        let ls = vec![
            linear("model.layers.0.self_attn.q_proj", 1e-4, Some(3e-3)),
            linear("model.layers.0.mlp.down_proj", 2e-4, Some(4e-3)),
            linear("model.layers.1.self_attn.q_proj", 5e-4, None),
            linear("model.layers.1.mlp.down_proj", 6e-4, Some(7e-3)),
            linear("lm_head", 9e-4, Some(1e-2)),
        ];
        let g = projection_errors(&ls);
        let names: Vec<&str> = g.iter().map(|p| p.proj.as_str()).collect();
        assert_eq!(names, ["self_attn.q_proj", "mlp.down_proj", "lm_head"]);
        assert_eq!(g[0].layers, [Some(0), Some(1)]);
        assert_eq!(g[0].rtn, [Some(3e-3), None]);
        assert_eq!(g[1].written, [2e-4, 6e-4]);
        assert_eq!(g[1].gptq, [ls[1].gptq_error, ls[3].gptq_error]);
        assert_eq!(g[2].layers, [None]);
        // Every linear is in exactly one group.
        assert_eq!(g.iter().map(|p| p.written.len()).sum::<usize>(), ls.len());
    }
}
