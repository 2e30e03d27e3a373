//! AdamW over the adapters, with global gradient-norm clipping and a learning-rate
//! schedule (linear warm-up, then linear or cosine decay).

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};

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

/// AdamW with clipping and a schedule. Its moments are plain tensors, saved and
/// restored with [`Optim::save`] / [`Optim::load`], so a resumed run continues with
/// exactly the state it stopped with.
pub struct Optim {
    config: OptimConfig,
    vars: Vec<Var>,
    /// First and second moments, one pair per variable.
    moments: Vec<(Tensor, Tensor)>,
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
        let moments = vars
            .iter()
            .map(|v| Ok((v.zeros_like()?, v.zeros_like()?)))
            .collect::<Result<_>>()?;
        Ok(Self {
            config,
            vars,
            moments,
            step: 0,
        })
    }

    /// Steps taken.
    pub fn steps(&self) -> usize {
        self.step
    }

    /// The settings.
    pub fn config(&self) -> &OptimConfig {
        &self.config
    }

    /// Applies `grads` (clipped to the maximum norm first). The gradient of a
    /// variable missing from `grads` counts as zero.
    pub fn step(&mut self, grads: &mut GradStore) -> Result<StepReport> {
        let gradients: Vec<Option<Tensor>> = self
            .vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).cloned())
            .collect();
        let report = self.apply(&gradients)?;
        // Callers read the clipped gradients back.
        if let Some(factor) = self.clip_factor(report.grad_norm) {
            for var in &self.vars {
                if let Some(g) = grads.remove(var.as_tensor()) {
                    grads.insert(var.as_tensor(), (g * factor)?);
                }
            }
        }
        Ok(report)
    }

    fn clip_factor(&self, grad_norm: f64) -> Option<f64> {
        match self.config.max_grad_norm {
            Some(max) if grad_norm > max => Some(max / (grad_norm + 1e-6)),
            _ => None,
        }
    }

    /// Applies gradients given per variable, in the order of the variables (`None`:
    /// zero), e.g. summed over micro-batches (gradient accumulation).
    pub fn apply(&mut self, gradients: &[Option<Tensor>]) -> Result<StepReport> {
        assert_eq!(
            gradients.len(),
            self.vars.len(),
            "one gradient per variable"
        );
        let mut squares = 0.0f64;
        for g in gradients.iter().flatten() {
            squares += g
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
        let grad_norm = squares.sqrt();
        let factor = self.clip_factor(grad_norm).unwrap_or(1.0);
        let lr = self.config.lr_at(self.step);
        let (b1, b2) = self.config.betas;
        let t = (self.step + 1) as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for ((var, g), (m, v)) in self.vars.iter().zip(gradients).zip(&mut self.moments) {
            let g = match g {
                Some(g) => (g * factor)?,
                None => var.zeros_like()?,
            };
            *m = ((&*m * b1)? + (&g * (1.0 - b1))?)?;
            *v = ((&*v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&*m / c1)?;
            let v_hat = (&*v / c2)?;
            let decayed = (var.as_tensor() * (1.0 - lr * self.config.weight_decay))?;
            let update = (m_hat / (v_hat.sqrt()? + self.config.eps)?)?;
            var.set(&(decayed - (update * lr)?)?)?;
        }
        self.step += 1;
        Ok(StepReport { grad_norm, lr })
    }

    /// Saves the moments and the step count (safetensors, atomically).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for (i, (m, v)) in self.moments.iter().enumerate() {
            tensors.insert(format!("{i}.m"), m.clone());
            tensors.insert(format!("{i}.v"), v.clone());
        }
        tensors.insert(
            "step".into(),
            Tensor::new(&[self.step as u32], &Device::Cpu)?,
        );
        let tmp = path.with_extension("safetensors.partial");
        candle_core::safetensors::save(&tensors, &tmp)?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }

    /// Restores what [`Optim::save`] wrote, for the same variables.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)?;
        let get = |name: &str| {
            tensors.get(name).cloned().ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: no tensor `{name}`", path.display()))
            })
        };
        let mut moments = Vec::with_capacity(self.vars.len());
        for (i, var) in self.vars.iter().enumerate() {
            let (m, v) = (get(&format!("{i}.m"))?, get(&format!("{i}.v"))?);
            if m.dims() != var.dims() || v.dims() != var.dims() {
                return Err(candle_core::Error::Msg(format!(
                    "{}: moments {i} have shape {:?}, the adapter {:?}",
                    path.display(),
                    m.dims(),
                    var.dims()
                )));
            }
            moments.push((m, v));
        }
        if tensors.len() != 2 * self.vars.len() + 1 {
            return Err(candle_core::Error::Msg(format!(
                "{}: holds {} tensors, {} expected for these adapters",
                path.display(),
                tensors.len(),
                2 * self.vars.len() + 1
            )));
        }
        self.step = get("step")?.to_vec1::<u32>()?[0] as usize;
        self.moments = moments;
        Ok(())
    }
}

/// Adds `grads`' gradients of `vars` into `sum` (one entry per variable).
pub fn accumulate(sum: &mut [Option<Tensor>], vars: &[Var], grads: &GradStore) -> Result<()> {
    for (slot, var) in sum.iter_mut().zip(vars) {
        if let Some(g) = grads.get(var.as_tensor()) {
            *slot = Some(match slot.take() {
                Some(s) => (s + g)?,
                None => g.clone(),
            });
        }
    }
    Ok(())
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
        let var = Var::new(&[0.0f32, 0.0], &Device::Cpu).unwrap();
        let loss = (var.as_tensor() * &Tensor::new(&[30.0f32, 40.0], &Device::Cpu).unwrap())
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
        // AdamW's first step moves every coordinate by lr against its gradient's sign.
        let moved: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        assert!(moved.iter().all(|x| (x + 0.1).abs() < 1e-4), "{moved:?}");
        let g: Vec<f32> = grads.get(var.as_tensor()).unwrap().to_vec1().unwrap();
        assert!(
            ((g[0] * g[0] + g[1] * g[1]).sqrt() - 1.0).abs() < 1e-4,
            "{g:?}"
        );
    }
}

#[cfg(test)]
mod state_tests {
    use super::*;

    fn quadratic_steps(optim: &mut Optim, var: &Var, n: usize) {
        for _ in 0..n {
            let loss = var.as_tensor().sqr().unwrap().sum_all().unwrap();
            let mut grads = loss.backward().unwrap();
            optim.step(&mut grads).unwrap();
        }
    }

    #[test]
    fn saved_state_resumes_exactly() {
        let config = OptimConfig {
            lr: 0.05,
            weight_decay: 0.01,
            ..OptimConfig::default()
        };
        let start = [1.0f32, -2.0, 3.0];
        let a = Var::new(&start, &Device::Cpu).unwrap();
        let mut straight = Optim::new(vec![a.clone()], config.clone()).unwrap();
        quadratic_steps(&mut straight, &a, 6);

        let b = Var::new(&start, &Device::Cpu).unwrap();
        let mut first = Optim::new(vec![b.clone()], config.clone()).unwrap();
        quadratic_steps(&mut first, &b, 3);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optim.safetensors");
        first.save(&path).unwrap();
        let c = Var::from_tensor(b.as_tensor()).unwrap();
        let mut resumed = Optim::new(vec![c.clone()], config).unwrap();
        resumed.load(&path).unwrap();
        assert_eq!(resumed.steps(), 3);
        quadratic_steps(&mut resumed, &c, 3);
        let x: Vec<f32> = a.as_tensor().to_vec1().unwrap();
        let y: Vec<f32> = c.as_tensor().to_vec1().unwrap();
        assert_eq!(x, y);
        // A fresh optimizer would have gone elsewhere (its moments start at zero).
        let d = Var::from_tensor(b.as_tensor()).unwrap();
        let mut fresh = Optim::new(
            vec![d.clone()],
            OptimConfig {
                lr: 0.05,
                weight_decay: 0.01,
                ..OptimConfig::default()
            },
        )
        .unwrap();
        quadratic_steps(&mut fresh, &d, 3);
        assert_ne!(d.as_tensor().to_vec1::<f32>().unwrap(), y);
    }
}
