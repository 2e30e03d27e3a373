//! Validation on push. The static checks (manifest schema, safe unpacking, hashes) run
//! before a push is accepted; the rest run afterwards, in the background, and their
//! results are stored with the version and shown on its page:
//!
//! - `conformance` ([`Conformance`]): the package is started **inside the sandbox**
//!   (it is untrusted code) and `agentstack env validate` checks it speaks the OpenEnv
//!   protocol, all within the sandbox's own loopback network.
//! - `lift`: the hook for a short training run before/after. Anything that implements
//!   [`Validator`] can be added to [`Validators`]; the RL crate adds this one.

use std::sync::Arc;
use std::time::Duration;

use agentstack_sandbox::{End, Job, JobFile, Limits, Sandbox};
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
    let read = tokio::task::spawn_blocking(move || package::read_packed(&bytes)).await;
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
            let Some(sandbox) = &self.sandbox else {
                return check(
                    "conformance",
                    "skipped",
                    format!("not run: {}", self.unavailable),
                );
            };
            if input.files.len() > agentstack_sandbox::job::MAX_JOB_FILES - 8 {
                return check(
                    "conformance",
                    "skipped",
                    "the package has more files than a sandbox run takes",
                );
            }
            let files = input
                .files
                .iter()
                .map(|(path, (contents, executable))| JobFile {
                    path: format!("pkg/{path}"),
                    contents: contents.clone(),
                    executable: *executable,
                })
                .collect();
            let mut job = Job::new([
                agentstack_sandbox::PROGRAM_IN_SANDBOX,
                "--quiet",
                "env",
                "validate",
                "--json",
                "pkg",
            ]);
            job.files = files;
            job.limits = self.limits;
            job.env = self.env.clone();
            job.env.push((
                "PATH".into(),
                "/opt/agentstack/bin:/usr/local/bin:/usr/bin:/bin".into(),
            ));
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
                (end, _) => {
                    let stderr = outcome.stderr_text();
                    let tail: String = stderr
                        .chars()
                        .rev()
                        .take(2000)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect();
                    check(
                        "conformance",
                        "failed",
                        format!(
                            "the package did not start or answer ({end:?}): {}",
                            tail.trim()
                        ),
                    )
                }
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
}
