//! AdamW over the adapters, with global gradient-norm clipping and a learning-rate
//! schedule (linear warm-up, then linear or cosine decay).

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

/// How the learning rate moves over training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// The same rate throughout.
    Constant,
    /// Linear from the peak to 0 at `total` steps (after the warm-up).
    Linear {
        /// Steps in all.
        total: usize,
    },
    /// Cosine from the peak to 0 at `total` steps (after the warm-up).
    Cosine {
        /// Steps in all.
        total: usize,
    },
}

/// Optimiser settings.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// `(β1, β2)`.
    pub betas: (f64, f64),
    /// Adam's ε.
    pub eps: f64,
    /// Clip the global gradient norm to this (none when `None`).
    pub max_grad_norm: Option<f64>,
    /// Linear warm-up steps.
    pub warmup: usize,
    /// After the warm-up.
    pub schedule: Schedule,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-5,
            weight_decay: 0.0,
            betas: (0.9, 0.999),
            eps: 1e-8,
            max_grad_norm: Some(1.0),
            warmup: 0,
            schedule: Schedule::Constant,
        }
    }
}

impl OptimConfig {
    /// The learning rate for step `step` (from 0).
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let done = step - self.warmup;
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Linear { total } => {
                let span = total.saturating_sub(self.warmup).max(1);
                self.lr * (1.0 - done as f64 / span as f64).max(0.0)
            }
            Schedule::Cosine { total } => {
                let span = total.saturating_sub(self.warmup).max(1);
                let progress = (done as f64 / span as f64).min(1.0);
                self.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// AdamW with clipping and a schedule.
pub struct Optim {
    config: OptimConfig,
    vars: Vec<Var>,
    adam: AdamW,
    step: usize,
}

/// What one optimiser step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The learning rate used.
    pub lr: f64,
}

impl Optim {
    /// An optimiser for `vars`.
    pub fn new(vars: Vec<Var>, config: OptimConfig) -> Result<Self> {
        let adam = AdamW::new(
            vars.clone(),
            ParamsAdamW {
                lr: config.lr_at(0),
                beta1: config.betas.0,
                beta2: config.betas.1,
                eps: config.eps,
                weight_decay: config.weight_decay,
            },
        )?;
        Ok(Self {
            config,
            vars,
            adam,
            step: 0,
        })
    }

    /// Steps taken.
    pub fn steps(&self) -> usize {
        self.step
    }

    /// Applies `grads` (clipped to the maximum norm first).
    pub fn step(&mut self, grads: &mut GradStore) -> Result<StepReport> {
        let mut squares = 0.0f64;
        for var in &self.vars {
            if let Some(g) = grads.get(var.as_tensor()) {
                squares += g
                    .sqr()?
                    .sum_all()?
                    .to_dtype(candle_core::DType::F64)?
                    .to_scalar::<f64>()?;
            }
        }
        let grad_norm = squares.sqrt();
        if let Some(max) = self.config.max_grad_norm
            && grad_norm > max
        {
            let factor = max / (grad_norm + 1e-6);
            for var in &self.vars {
                if let Some(g) = grads.remove(var.as_tensor()) {
                    let scaled: Tensor = (g * factor)?;
                    grads.insert(var.as_tensor(), scaled);
                }
            }
        }
        let lr = self.config.lr_at(self.step);
        self.adam.set_learning_rate(lr);
        self.adam.step(grads)?;
        self.step += 1;
        Ok(StepReport { grad_norm, lr })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_warm_up_then_decay() {
        let c = OptimConfig {
            lr: 1.0,
            warmup: 2,
            schedule: Schedule::Linear { total: 6 },
            ..OptimConfig::default()
        };
        let lrs: Vec<f64> = (0..7).map(|s| c.lr_at(s)).collect();
        assert_eq!(lrs, vec![0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]);
        let cos = OptimConfig {
            lr: 1.0,
            schedule: Schedule::Cosine { total: 4 },
            ..OptimConfig::default()
        };
        assert!((cos.lr_at(2) - 0.5).abs() < 1e-12 && cos.lr_at(4).abs() < 1e-12);
    }

    #[test]
    fn gradients_are_clipped_to_the_maximum_norm() {
        let var = Var::new(&[0.0f32, 0.0], &candle_core::Device::Cpu).unwrap();
        let loss = (var.as_tensor()
            * &Tensor::new(&[30.0f32, 40.0], &candle_core::Device::Cpu).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let mut grads = loss.backward().unwrap();
        let mut optim = Optim::new(
            vec![var.clone()],
            OptimConfig {
                lr: 0.1,
                max_grad_norm: Some(1.0),
                ..OptimConfig::default()
            },
        )
        .unwrap();
        let report = optim.step(&mut grads).unwrap();
        assert!((report.grad_norm - 50.0).abs() < 1e-4);
        let g: Vec<f32> = grads.get(var.as_tensor()).unwrap().to_vec1().unwrap();
        assert!(
            ((g[0] * g[0] + g[1] * g[1]).sqrt() - 1.0).abs() < 1e-4,
            "{g:?}"
        );
    }
}
