//! Where a quantize run spends its time, phase by phase, with the CPU time of all threads so
//! the report shows which phases keep the cores busy (`quant_report.json` `phases`, `--stats`).

use serde::Serialize;

use crate::quant::timing::{SolveTimes, Spent};

/// The phases of a run, in pipeline order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Opening and hashing the checkpoint, tokenizing calibration text, the embedding.
    Load,
    /// Calibration forward passes: norms, attention, the MLP activation, residual adds.
    Forward,
    /// Accumulating Σ x xᵀ per linear input.
    Hessian,
    /// Damping, Cholesky and the triangular inverse, once per Hessian.
    Factor,
    /// Choosing each group's scale (GPTQ of the method written).
    ScaleSearch,
    /// GPTQ's column loop with its in-block error feedback.
    Columns,
    /// GPTQ's lazy batch updates after each block.
    Flush,
    /// Coordinate-descent passes over the codes after the solve.
    Descent,
    /// Block tuning after the layer's solve (`--block-tune`), with its forward on the tuned layer.
    BlockTune,
    /// Model tuning after the last layer (`--model-tune`), with its staging of every layer.
    ModelTune,
    /// Every other method of the comparison (with `compare`) and the error of each.
    Compare,
    /// Replacing each solved linear by its dequantized weights for the later stages.
    Install,
    /// Saving each finished layer for `--resume`.
    Save,
    /// Writing the checkpoint (and `--dump-dequantized`).
    Write,
}

impl Phase {
    pub const ALL: [Phase; 14] = [
        Phase::Load,
        Phase::Forward,
        Phase::Hessian,
        Phase::Factor,
        Phase::ScaleSearch,
        Phase::Columns,
        Phase::Flush,
        Phase::Descent,
        Phase::BlockTune,
        Phase::ModelTune,
        Phase::Compare,
        Phase::Install,
        Phase::Save,
        Phase::Write,
    ];
}

/// Time per phase, accumulated over the run.
#[derive(Debug, Clone, Default)]
pub struct Phases([Spent; Phase::ALL.len()]);

impl Phases {
    pub fn add(&mut self, p: Phase, s: Spent) {
        // Discriminants follow the order of `Phase::ALL`.
        self.0[p as usize] += s;
    }

    pub fn get(&self, p: Phase) -> Spent {
        self.0[p as usize]
    }

    /// Run `f`, adding its time to `p`.
    pub fn time<T>(&mut self, p: Phase, f: impl FnOnce() -> T) -> T {
        crate::quant::timing::timed(&mut self.0[p as usize], f)
    }

    pub fn add_solve(&mut self, t: &SolveTimes) {
        self.add(Phase::ScaleSearch, t.search);
        self.add(Phase::Columns, t.columns);
        self.add(Phase::Flush, t.flush);
    }

    pub fn report(&self, threads: usize) -> Vec<PhaseReport> {
        Phase::ALL
            .iter()
            .map(|&p| {
                let s = self.get(p);
                PhaseReport {
                    phase: p,
                    seconds: s.seconds,
                    cpu_seconds: s.cpu_seconds,
                    utilisation: s.utilisation(threads),
                }
            })
            .collect()
    }
}

/// One row of the report's phase table.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseReport {
    pub phase: Phase,
    pub seconds: f64,
    pub cpu_seconds: f64,
    /// CPU seconds ÷ wall seconds ÷ threads: 1.0 keeps every core busy.
    pub utilisation: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_accumulate_separately_and_report_in_pipeline_order() {
        let mut p = Phases::default();
        let s = |seconds, cpu_seconds| Spent {
            seconds,
            cpu_seconds,
        };
        p.add(Phase::Hessian, s(2.0, 3.0));
        p.add(Phase::Hessian, s(1.0, 1.0));
        p.add_solve(&SolveTimes {
            search: s(1.0, 2.0),
            columns: s(0.5, 0.5),
            flush: Spent::default(),
        });
        let r = p.report(2);
        assert_eq!(r.len(), Phase::ALL.len());
        assert!(r.iter().zip(Phase::ALL).all(|(r, p)| r.phase == p));
        let h = &r[Phase::Hessian as usize];
        assert_eq!((h.seconds, h.cpu_seconds), (3.0, 4.0));
        assert!((h.utilisation - 4.0 / 3.0 / 2.0).abs() < 1e-12);
        assert_eq!(r[Phase::ScaleSearch as usize].utilisation, 1.0);
        assert_eq!(r[Phase::Columns as usize].utilisation, 0.5);
        assert_eq!(r[Phase::Flush as usize].utilisation, 0.0);
    }
}
