//! Validation on push. The static checks (manifest schema, safe unpacking, hashes) run
//! before a push is accepted; the rest run afterwards, in the background, and their
//! results are stored with the version and shown on its page:
//!
//! - `conformance` ([`Conformance`]): the package is started **inside the sandbox**
//!   (it is untrusted code) and `agentstack env validate` checks it speaks the OpenEnv
//!   protocol, all within the sandbox's own loopback network.
//! - `lift` ([`Lift`], when the hub is given a model): a short GRPO run on the package,
//!   also inside the sandbox: `agentstack train grpo` evaluates the model on held-out
//!   tasks, trains it briefly with LoRA, evaluates again, and the check reports the
//!   change in mean reward with both 95% intervals.
//!
//! Anything that implements [`Validator`] can be added to [`Validators`].

use std::sync::Arc;
use std::time::Duration;

use agentstack_sandbox::{End, Job, JobFile, LimitKind, Limits, Sandbox};
use futures_util::future::BoxFuture;

use crate::api::ValidationCheck;
use crate::package::{self, Files, PackageSpec};
use crate::registry::Registry;

/// What a validator gets: the package's checked files and its `openenv.yaml`.
pub struct ValidationInput {
    /// `owner/name`.
    pub package: String,
    /// The version.
    pub version: String,
    /// Path → (contents, executable).
    pub files: Files,
    /// `openenv.yaml`.
    pub spec: PackageSpec,
}

/// One check run on every pushed version.
pub trait Validator: Send + Sync {
    /// The check's name, shown with its result (`conformance`, `lift`, ...).
    fn name(&self) -> &str;
    /// Runs the check.
    fn validate<'a>(&'a self, input: &'a ValidationInput) -> BoxFuture<'a, ValidationCheck>;
}

/// The validators a registry runs, in order.
#[derive(Clone, Default)]
pub struct Validators {
    list: Vec<Arc<dyn Validator>>,
    /// At most this many versions validated at once.
    limit: Option<Arc<tokio::sync::Semaphore>>,
}

impl Validators {
    /// Adds a validator.
    pub fn push(&mut self, validator: Arc<dyn Validator>) {
        self.list.push(validator);
    }

    /// Validates at most `n` versions at once.
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.limit = Some(Arc::new(tokio::sync::Semaphore::new(n.max(1))));
        self
    }

    /// The names of the validators.
    pub fn names(&self) -> Vec<String> {
        self.list.iter().map(|v| v.name().to_owned()).collect()
    }
}

fn check(name: &str, status: &str, message: impl Into<String>) -> ValidationCheck {
    ValidationCheck {
        name: name.to_owned(),
        status: status.to_owned(),
        message: message.into(),
    }
}

/// The overall status of a set of checks: `failed` if any failed, `incomplete` if any
/// was skipped, else `passed`.
pub fn overall(checks: &[ValidationCheck]) -> &'static str {
    if checks.iter().any(|c| c.status == "failed") {
        "failed"
    } else if checks.iter().any(|c| c.status != "passed") {
        "incomplete"
    } else {
        "passed"
    }
}

/// Validates one stored version and records the result. Never fails: what goes wrong
/// becomes a failed check.
pub async fn validate_version(registry: Arc<Registry>, version_id: i64) {
    let _permit = match &registry.validators.limit {
        Some(s) => Some(s.clone().acquire_owned().await),
        None => None,
    };
    let checks = run_checks(&registry, version_id).await;
    let status = overall(&checks);
    tracing::info!(version_id, status, "validated");
    if let Err(e) = registry
        .db
        .set_validation(version_id, status, &checks)
        .await
    {
        tracing::error!(version_id, error = %e, "could not store a validation");
    }
}

async fn run_checks(registry: &Registry, version_id: i64) -> Vec<ValidationCheck> {
    let mut checks = Vec::new();
    let version = match registry.db.version_by_id(version_id).await {
        Ok(Some(v)) => v,
        Ok(None) => return vec![check("unpack", "failed", "the version is gone")],
        Err(e) => return vec![check("unpack", "failed", format!("database: {e}"))],
    };
    let bytes = match registry.blobs.get(&version.sha256).await {
        Ok(b) => b,
        Err(e) => return vec![check("unpack", "failed", e.to_string())],
    };
    let limits = registry.limits.unpack;
    let read =
        tokio::task::spawn_blocking(move || package::read_packed_within(&bytes, &limits)).await;
    let (manifest, files) = match read {
        Ok(Ok(ok)) => ok,
        Ok(Err(e)) => return vec![check("unpack", "failed", e.to_string())],
        Err(e) => return vec![check("unpack", "failed", e.to_string())],
    };
    let spec = match files
        .get("openenv.yaml")
        .map(|(c, _)| PackageSpec::parse(&String::from_utf8_lossy(c), "openenv.yaml".as_ref()))
    {
        Some(Ok(spec)) => spec,
        Some(Err(e)) => return vec![check("manifest", "failed", e.to_string())],
        None => return vec![check("manifest", "failed", "no openenv.yaml")],
    };
    checks.push(check(
        "manifest",
        "passed",
        format!("openenv.yaml names '{}'", spec.name),
    ));
    checks.push(check(
        "unpack",
        "passed",
        format!(
            "{} files, every hash matches the manifest",
            manifest.files.len()
        ),
    ));
    let package = registry
        .db
        .package_name(version.package_id)
        .await
        .unwrap_or_default();
    let input = ValidationInput {
        package,
        version: version.version.clone(),
        files,
        spec,
    };
    for validator in &registry.validators.list {
        checks.push(validator.validate(&input).await);
    }
    checks
}

/// Starts the package inside the sandbox and runs `agentstack env validate` on it
/// there (the sandbox's network is its own loopback, so the check never leaves it).
pub struct Conformance {
    sandbox: Option<Arc<Sandbox>>,
    /// Why there is no sandbox (shown as the check's message).
    unavailable: String,
    /// Limits of one validation run.
    pub limits: Limits,
    /// Extra environment for the run (e.g. `AGENTSTACK_PYTHON`).
    pub env: Vec<(String, String)>,
}

impl Conformance {
    /// Validates in `sandbox`, which must expose its program
    /// ([`agentstack_sandbox::SandboxConfig::expose_program`]).
    pub fn new(sandbox: Arc<Sandbox>) -> Self {
        Self {
            sandbox: Some(sandbox),
            unavailable: String::new(),
            limits: Limits {
                wall: Duration::from_secs(120),
                cpu: Duration::from_secs(120),
                memory_bytes: 4 << 30,
                processes: 256,
                file_bytes: 256 << 20,
                output_bytes: 1 << 20,
                scratch_bytes: 1 << 30,
            },
            env: Vec::new(),
        }
    }

    /// Reports the check as skipped, saying why: this machine cannot isolate, and
    /// package code never runs unisolated.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            sandbox: None,
            unavailable: reason.into(),
            limits: Limits::default(),
            env: Vec::new(),
        }
    }
}

impl Validator for Conformance {
    fn name(&self) -> &str {
        "conformance"
    }

    fn validate<'a>(&'a self, input: &'a ValidationInput) -> BoxFuture<'a, ValidationCheck> {
        Box::pin(async move {
            let sandbox = match sandbox_for("conformance", &self.sandbox, &self.unavailable, input)
            {
                Ok(sandbox) => sandbox,
                Err(skipped) => return skipped,
            };
            let job = package_job(
                &["env", "validate", "--json", "pkg"],
                input,
                Vec::new(),
                self.limits,
                &self.env,
            );
            let outcome = match sandbox.run(&job).await {
                Ok(o) => o,
                Err(e) => {
                    return check("conformance", "failed", format!("the sandbox failed: {e}"));
                }
            };
            let stdout = outcome.stdout_text();
            let report: Option<serde_json::Value> = serde_json::from_str(&stdout).ok();
            match (outcome.end, report) {
                (End::Exited { code: 0 }, Some(report)) => {
                    check("conformance", "passed", summary(&report))
                }
                (End::Exited { code: 1 }, Some(report)) => {
                    check("conformance", "failed", summary(&report))
                }
                (end, _) => check(
                    "conformance",
                    "failed",
                    format!(
                        "the package did not start or answer ({end:?}): {}",
                        tail(&outcome.stderr_text())
                    ),
                ),
            }
        })
    }
}

/// The sandbox a check runs in, or the check's result when it cannot run there:
/// skipped when this hub cannot isolate, or when the package has more files than one
/// sandbox run takes.
fn sandbox_for<'a>(
    name: &str,
    sandbox: &'a Option<Arc<Sandbox>>,
    unavailable: &str,
    input: &ValidationInput,
) -> Result<&'a Sandbox, ValidationCheck> {
    let Some(sandbox) = sandbox else {
        return Err(check(name, "skipped", format!("not run: {unavailable}")));
    };
    if input.files.len() > agentstack_sandbox::job::MAX_JOB_FILES - 8 {
        return Err(check(
            name,
            "skipped",
            "the package has more files than a sandbox run takes",
        ));
    }
    Ok(sandbox)
}

/// A sandbox job running the exposed `agentstack --quiet ARGS...` on the package, whose
/// files are under `pkg/` in the scratch directory (with `extra` files beside it).
fn package_job(
    args: &[&str],
    input: &ValidationInput,
    extra: Vec<JobFile>,
    limits: Limits,
    env: &[(String, String)],
) -> Job {
    let mut job = Job::new(
        [agentstack_sandbox::PROGRAM_IN_SANDBOX, "--quiet"]
            .iter()
            .chain(args)
            .copied(),
    );
    job.files = input
        .files
        .iter()
        .map(|(path, (contents, executable))| JobFile {
            path: format!("pkg/{path}"),
            contents: contents.clone(),
            executable: *executable,
        })
        .chain(extra)
        .collect();
    job.limits = limits;
    job.env = env.to_vec();
    job.env.push(("PATH".into(), SANDBOX_PATH.into()));
    job
}

/// The last 2,000 characters of a run's standard error, trimmed.
fn tail(stderr: &str) -> String {
    let start = stderr.char_indices().rev().nth(1999).map_or(0, |(i, _)| i);
    stderr[start..].trim().to_owned()
}

/// `PATH` inside the sandbox, with the exposed `agentstack` first.
const SANDBOX_PATH: &str = "/opt/agentstack/bin:/usr/local/bin:/usr/bin:/bin";

/// A short GRPO run on the pushed environment, inside the sandbox: `agentstack train
/// grpo` with the hub's configuration, on the hub's model (bound read-only into the
/// sandbox at its own path), evaluating held-out tasks before the first step and after
/// the last. The check passes when the run completes; its message is the change in
/// held-out mean reward. A run the hub's time limit cuts short is `skipped`, since
/// the limit, not the package, ended it; a run that fails is `failed`, with its error.
pub struct Lift {
    sandbox: Option<Arc<Sandbox>>,
    /// Why there is no sandbox (shown as the check's message).
    unavailable: String,
    /// The run's `train.toml` (its `model` and `env` are replaced).
    config: String,
    /// The model file, readable inside the sandbox at this path.
    model: std::path::PathBuf,
    /// Compute threads of the run.
    pub threads: usize,
    /// Limits of one run.
    pub limits: Limits,
    /// Extra environment for the run (e.g. `AGENTSTACK_PYTHON`).
    pub env: Vec<(String, String)>,
}

impl Lift {
    /// Lift runs of `config` (a `train.toml`) on `model` in `sandbox`, which must
    /// expose its program and bind `model` read-only.
    pub fn new(sandbox: Arc<Sandbox>, config: String, model: std::path::PathBuf) -> Self {
        Self {
            sandbox: Some(sandbox),
            unavailable: String::new(),
            config,
            model,
            threads: 1,
            limits: Limits {
                wall: Duration::from_secs(30 * 60),
                cpu: Duration::from_secs(30 * 60),
                // Address space, not resident memory: the f32 learner, the rollout
                // weights and every thread's reservations.
                memory_bytes: 32 << 30,
                processes: 256,
                file_bytes: 1 << 30,
                output_bytes: 1 << 20,
                scratch_bytes: 2 << 30,
            },
            env: Vec::new(),
        }
    }

    /// Reports the check as skipped, saying why.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            sandbox: None,
            unavailable: reason.into(),
            config: String::new(),
            model: std::path::PathBuf::new(),
            threads: 1,
            limits: Limits::default(),
            env: Vec::new(),
        }
    }

    fn job(&self, input: &ValidationInput) -> Job {
        let threads = self.threads.max(1).to_string();
        let model = self.model.to_string_lossy().into_owned();
        let config = JobFile {
            path: "lift.toml".into(),
            contents: self.config.clone().into_bytes(),
            executable: false,
        };
        package_job(
            &[
                "train",
                "grpo",
                "--config",
                "lift.toml",
                "--model",
                &model,
                "--env",
                "pkg",
                "--runs-dir",
                "runs",
                "--run-id",
                "lift",
                "--fresh",
                "--json",
                "--threads",
                &threads,
            ],
            input,
            vec![config],
            self.limits,
            &self.env,
        )
    }
}

/// `0.230 (95% CI 0.150–0.310)` from a run report's `[mean, [lo, hi]]`.
fn held_out(value: &serde_json::Value) -> Option<(f64, String)> {
    let mean = value.get(0)?.as_f64()?;
    let lo = value.get(1)?.get(0)?.as_f64()?;
    let hi = value.get(1)?.get(1)?.as_f64()?;
    Some((mean, format!("{mean:.3} (95% CI {lo:.3}–{hi:.3})")))
}

/// The check from a finished run's JSON report (`train --json`).
fn lift_result(report: &serde_json::Value, model: &str) -> ValidationCheck {
    let steps = report["steps"].as_u64().unwrap_or(0);
    match (
        held_out(&report["eval_before"]),
        held_out(&report["eval_after"]),
    ) {
        (Some((before, b)), Some((after, a))) => check(
            "lift",
            "passed",
            format!(
                "held-out mean reward {b} before, {a} after {steps} GRPO steps of {model}: {:+.3}",
                after - before
            ),
        ),
        _ => check(
            "lift",
            "failed",
            "the training run finished without held-out evaluations before and after it",
        ),
    }
}

impl Validator for Lift {
    fn name(&self) -> &str {
        "lift"
    }

    fn validate<'a>(&'a self, input: &'a ValidationInput) -> BoxFuture<'a, ValidationCheck> {
        Box::pin(async move {
            let sandbox = match sandbox_for("lift", &self.sandbox, &self.unavailable, input) {
                Ok(sandbox) => sandbox,
                Err(skipped) => return skipped,
            };
            let outcome = match sandbox.run(&self.job(input)).await {
                Ok(o) => o,
                Err(e) => return check("lift", "failed", format!("the sandbox failed: {e}")),
            };
            let model = self
                .model
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            match outcome.end {
                End::Exited { code: 0 } => {
                    match serde_json::from_str::<serde_json::Value>(outcome.stdout_text().trim()) {
                        Ok(report) => lift_result(&report, &model),
                        Err(e) => check(
                            "lift",
                            "failed",
                            format!("the training run's report is not JSON ({e})"),
                        ),
                    }
                }
                End::Limit {
                    limit: limit @ (LimitKind::WallTime | LimitKind::CpuTime),
                } => check(
                    "lift",
                    "skipped",
                    format!(
                        "the training run did not finish within this hub's {} ({} s)",
                        limit.describe(),
                        match limit {
                            LimitKind::CpuTime => self.limits.cpu,
                            _ => self.limits.wall,
                        }
                        .as_secs()
                    ),
                ),
                end => check(
                    "lift",
                    "failed",
                    format!(
                        "the training run failed ({end:?}): {}",
                        tail(&outcome.stderr_text())
                    ),
                ),
            }
        })
    }
}

/// "9/10 checks passed; failed: step_reward (reward 7 outside [0, 1])".
fn summary(report: &serde_json::Value) -> String {
    let checks = report["checks"].as_array().cloned().unwrap_or_default();
    let passed = checks.iter().filter(|c| c["status"] == "pass").count();
    let failed: Vec<String> = checks
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| {
            format!(
                "{} ({})",
                c["id"].as_str().unwrap_or("?"),
                c["detail"].as_str().unwrap_or("")
            )
        })
        .collect();
    let mut text = format!("{passed}/{} protocol checks passed", checks.len());
    if !failed.is_empty() {
        text.push_str("; failed: ");
        text.push_str(&failed.join("; "));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overall_status_is_the_worst_check() {
        let c = |s: &str| check("x", s, "");
        assert_eq!(overall(&[c("passed"), c("passed")]), "passed");
        assert_eq!(overall(&[c("passed"), c("skipped")]), "incomplete");
        assert_eq!(overall(&[c("skipped"), c("failed")]), "failed");
    }

    #[test]
    fn a_lift_reports_the_change_in_held_out_reward() {
        let report = serde_json::json!({
            "steps": 10,
            "eval_before": [0.25, [0.125, 0.375]],
            "eval_after": [0.5, [0.375, 0.625]],
        });
        let c = lift_result(&report, "m.gguf");
        assert_eq!(c.status, "passed");
        assert_eq!(
            c.message,
            "held-out mean reward 0.250 (95% CI 0.125–0.375) before, 0.500 (95% CI 0.375–0.625) after 10 GRPO steps of m.gguf: +0.250"
        );
        // A run without both evaluations measured nothing.
        let c = lift_result(&serde_json::json!({"steps": 10, "eval_before": null}), "m");
        assert_eq!(c.status, "failed");
    }

    #[test]
    fn tails_keep_the_last_characters() {
        let long = format!("{}é{}", "a".repeat(3000), "b".repeat(1998));
        let t = tail(&long);
        assert_eq!(t.chars().count(), 2000);
        assert!(t.starts_with("aé") && t.ends_with('b'));
        assert_eq!(tail("  short \n"), "short");
    }
}
