//! Components as Kubernetes objects, through the API server's REST API: per
//! component a headless Service and an Indexed Job (see [`crate::kubernetes`]).
//!
//! | step | call |
//! |---|---|
//! | prepare | `POST /api/v1/namespaces/{ns}/services` per component |
//! | start | `POST /apis/batch/v1/namespaces/{ns}/jobs` (the component's Job) |
//! | poll | `GET /apis/batch/v1/namespaces/{ns}/jobs/{name}`: `Complete`/`Failed` conditions, `status.ready` |
//! | stop | `DELETE .../jobs/{name}` with `propagationPolicy: Background` and the grace period (0 to kill) |
//! | logs | `GET /api/v1/namespaces/{ns}/pods?labelSelector=job-name={name}`, then each Pod's `/log` |
//! | cleanup | `DELETE` every component's Job, then its Service |
//!
//! The Job controller restarts failed Pods by the component's `job_recovery` (its
//! `backoffLimit` and `podFailurePolicy`), so here a unit is a whole component and a
//! failed Job is final. Every address is a DNS name known before anything runs.
//!
//! Why plain REST and not kube-rs (which DESIGN.md names): the objects are already
//! JSON (built and snapshot-tested in [`crate::kubernetes`]), the backend needs six
//! calls, and kube + k8s-openapi add about 160 crates whose build (minutes on the
//! 2-core machines this is built on) buys typed structs this code would not use.
//! Credentials come from a kubeconfig: token or client certificate, with the cluster's
//! CA; `exec` plugins (EKS, GKE) are not run — give a token instead.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentstack_static::env_vars;
use base64::Engine as _;
use serde_json::{Value, json};
use serde_norway::Value as Yaml;

use super::{Backend, BackendError, LogSource, UnitLaunch, UnitStatus};
use crate::discovery::Addresses;
use crate::kubernetes::{KubernetesOptions, addresses, manifests, object_name};
use crate::spec::{InfraKind, JobGroup};

/// Most bytes of an error body kept.
const MAX_ERROR_BODY: usize = 2000;

/// Where the API server is and how to prove who we are.
#[derive(Clone, Default)]
pub struct Credentials {
    /// The API server's URL.
    pub server: String,
    /// A bearer token.
    pub token: Option<String>,
    /// The cluster's CA certificate (PEM).
    pub ca_pem: Option<Vec<u8>>,
    /// A client certificate and key (PEM, concatenated).
    pub identity_pem: Option<Vec<u8>>,
    /// Skip TLS verification (`insecure-skip-tls-verify`).
    pub insecure: bool,
    /// The context's namespace, if it names one.
    pub namespace: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("server", &self.server)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("insecure", &self.insecure)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

fn config_error(path: &Path, what: impl Into<String>) -> BackendError {
    BackendError::Config {
        what: format!("kubeconfig {}: {}", path.display(), what.into()),
        hint: "check it with `kubectl config view`; agentstack reads server, certificate-authority(-data), token and client-certificate/key(-data)".into(),
    }
}

impl Credentials {
    /// The kubeconfig at `$KUBECONFIG` (its first file) or `~/.kube/config`. An empty
    /// variable is unset, as for every variable agentstack reads (and for kubectl).
    pub fn default_path() -> Option<PathBuf> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(paths) = var(env_vars::KUBECONFIG) {
            return std::env::split_paths(&paths).next();
        }
        var(env_vars::HOME).map(|h| PathBuf::from(h).join(".kube/config"))
    }

    /// Reads `context` (the current one when `None`) from the kubeconfig at `path`.
    pub fn from_kubeconfig(path: &Path, context: Option<&str>) -> Result<Self, BackendError> {
        let text = std::fs::read_to_string(path).map_err(|e| BackendError::io(path, e))?;
        let doc: Yaml = serde_norway::from_str(&text)
            .map_err(|e| config_error(path, format!("not YAML: {e}")))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let named = |list: &str, name: &str, inner: &str| -> Result<Yaml, BackendError> {
            doc[list]
                .as_sequence()
                .and_then(|items| items.iter().find(|i| i["name"].as_str() == Some(name)))
                .map(|i| i[inner].clone())
                .ok_or_else(|| config_error(path, format!("no {inner} named `{name}`")))
        };
        let context_name = match context {
            Some(c) => c.to_owned(),
            None => doc["current-context"]
                .as_str()
                .ok_or_else(|| config_error(path, "no current-context"))?
                .to_owned(),
        };
        let ctx = named("contexts", &context_name, "context")?;
        let cluster_name = ctx["cluster"].as_str().unwrap_or_default();
        let user_name = ctx["user"].as_str().unwrap_or_default();
        let cluster = named("clusters", cluster_name, "cluster")?;
        let user = named("users", user_name, "user").unwrap_or(Yaml::Null);
        let data = |node: &Yaml, key: &str| -> Result<Option<Vec<u8>>, BackendError> {
            if let Some(b64) = node[format!("{key}-data").as_str()].as_str() {
                return base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .map(Some)
                    .map_err(|e| config_error(path, format!("{key}-data: {e}")));
            }
            match node[key].as_str() {
                Some(file) => {
                    let file = base.join(file);
                    std::fs::read(&file)
                        .map(Some)
                        .map_err(|e| BackendError::io(&file, e))
                }
                None => Ok(None),
            }
        };
        if !user["exec"].is_null() || !user["auth-provider"].is_null() {
            return Err(BackendError::Config {
                what: format!(
                    "kubeconfig {}: user `{user_name}` authenticates through a plugin, which agentstack does not run",
                    path.display()
                ),
                hint: "use a context whose user has a token (a ServiceAccount token: `kubectl create token NAME`) or a client certificate".into(),
            });
        }
        let identity = match (
            data(&user, "client-certificate")?,
            data(&user, "client-key")?,
        ) {
            (Some(mut cert), Some(key)) => {
                cert.push(b'\n');
                cert.extend(key);
                Some(cert)
            }
            _ => None,
        };
        let token = match user["token"].as_str() {
            Some(t) => Some(t.to_owned()),
            None => match user["tokenFile"].as_str() {
                Some(f) => Some(
                    std::fs::read_to_string(base.join(f))
                        .map_err(|e| BackendError::io(base.join(f), e))?
                        .trim()
                        .to_owned(),
                ),
                None => None,
            },
        };
        Ok(Self {
            server: cluster["server"]
                .as_str()
                .ok_or_else(|| {
                    config_error(path, format!("cluster `{cluster_name}` has no server"))
                })?
                .trim_end_matches('/')
                .to_owned(),
            token,
            ca_pem: data(&cluster, "certificate-authority")?,
            identity_pem: identity,
            insecure: cluster["insecure-skip-tls-verify"].as_bool() == Some(true),
            namespace: ctx["namespace"].as_str().map(str::to_owned),
        })
    }
}

/// Launch settings for Kubernetes.
#[derive(Debug, Clone)]
pub struct KubernetesSettings {
    /// The namespace.
    pub namespace: String,
    /// The container image (it must hold `bash` and what `run` starts).
    pub image: String,
    /// A Kueue LocalQueue, when the cluster admits Jobs through Kueue.
    pub queue: Option<String>,
    /// Seconds from SIGTERM to SIGKILL.
    pub termination_grace_seconds: u32,
}

/// A Kubernetes API server.
#[derive(Debug, Clone)]
pub struct KubernetesBackend {
    client: reqwest::Client,
    credentials: Credentials,
    settings: KubernetesSettings,
}

impl KubernetesBackend {
    /// A backend talking to the server in `credentials`.
    pub fn new(
        credentials: Credentials,
        settings: KubernetesSettings,
    ) -> Result<Self, BackendError> {
        let tls = |what: &str, e: reqwest::Error| BackendError::Config {
            what: format!("the kubeconfig's {what}: {e}"),
            hint: "it must be PEM".into(),
        };
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .danger_accept_invalid_certs(credentials.insecure);
        if let Some(ca) = &credentials.ca_pem {
            for cert in reqwest::Certificate::from_pem_bundle(ca).map_err(|e| tls("CA", e))? {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let Some(identity) = &credentials.identity_pem {
            builder = builder.identity(
                reqwest::Identity::from_pem(identity).map_err(|e| tls("client certificate", e))?,
            );
        }
        let client = builder.build().map_err(|e| tls("TLS settings", e))?;
        Ok(Self {
            client,
            credentials,
            settings,
        })
    }

    fn options(&self) -> KubernetesOptions<'_> {
        KubernetesOptions {
            queue: self.settings.queue.as_deref(),
            termination_grace_seconds: self.settings.termination_grace_seconds,
            ..KubernetesOptions::new(&self.settings.namespace, &self.settings.image)
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.credentials.server)
    }

    fn ns(&self) -> &str {
        &self.settings.namespace
    }

    /// One call; `Ok(None)` for 404 (and for 409 when `exists_ok`).
    async fn call(
        &self,
        what: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Option<Value>, BackendError> {
        let url = self.url(path);
        let mut request = self.client.request(method, &url);
        if let Some(token) = &self.credentials.token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let http = |source| BackendError::Http {
            what: what.to_owned(),
            url: url.clone(),
            source,
        };
        let response = request.send().await.map_err(http)?;
        let status = response.status();
        let text = response.text().await.map_err(http)?;
        if status.as_u16() == 404 {
            return Ok(None);
        }
        if !status.is_success() {
            let mut body = text;
            body.truncate(MAX_ERROR_BODY);
            return Err(BackendError::Engine {
                what: what.to_owned(),
                status: status.as_u16(),
                body,
            });
        }
        Ok(Some(
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }

    fn objects(&self, group: &JobGroup) -> Result<Vec<Value>, BackendError> {
        Ok(manifests(group, &self.options())?)
    }
}

fn condition(job: &Value, kind: &str) -> Option<String> {
    job["status"]["conditions"]
        .as_array()?
        .iter()
        .find_map(|c| {
            (c["type"] == kind && c["status"] == "True").then(|| {
                format!(
                    "{} {}",
                    c["reason"].as_str().unwrap_or(""),
                    c["message"].as_str().unwrap_or("")
                )
                .trim()
                .to_owned()
            })
        })
}

/// A Job's status as a unit's.
fn job_status(job: &Value) -> UnitStatus {
    if condition(job, "Complete").is_some() {
        return UnitStatus::Exited { code: 0 };
    }
    if let Some(reason) = condition(job, "Failed") {
        tracing::info!(%reason, "Job failed");
        return UnitStatus::Exited { code: 1 };
    }
    let want = job["spec"]["parallelism"].as_i64().unwrap_or(1);
    let ready = job["status"]["ready"].as_i64().unwrap_or(0);
    if ready >= want {
        let name = job["metadata"]["name"].as_str().unwrap_or_default();
        UnitStatus::Running {
            hosts: vec![name.to_owned()],
        }
    } else {
        UnitStatus::Pending
    }
}

impl KubernetesBackend {
    /// Deletes the Job `name` if there is one, and waits (at most 30 s) until it is
    /// gone, so the name can be used again.
    async fn delete_ended(&self, name: &str) -> Result<(), BackendError> {
        let path = format!("/apis/batch/v1/namespaces/{}/jobs/{name}", self.ns());
        let body = json!({
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
            "gracePeriodSeconds": 0,
        });
        match self
            .call(
                "deleting a Job",
                reqwest::Method::DELETE,
                &path,
                Some(&body),
            )
            .await
        {
            Ok(_) => {}
            Err(e) => return Err(e),
        }
        for _ in 0..300 {
            if self
                .call("reading a Job", reqwest::Method::GET, &path, None)
                .await?
                .is_none()
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(BackendError::Config {
            what: format!(
                "the Job `{name}` of the earlier attempt is still being deleted after 30 s"
            ),
            hint: format!("`kubectl get job {name}` shows what holds it (a finalizer?)"),
        })
    }
}

impl Backend for KubernetesBackend {
    fn kind(&self) -> InfraKind {
        InfraKind::Kubernetes
    }

    fn engine_recovers(&self) -> bool {
        true
    }

    fn unit_is_component(&self) -> bool {
        true
    }

    fn addresses_up_front(&self, group: &JobGroup) -> Option<Addresses> {
        Some(addresses(group, &self.options()))
    }

    fn check(&self, group: &JobGroup) -> Result<(), BackendError> {
        self.objects(group).map(drop)
    }

    async fn prepare(&self, group: &JobGroup, _job_id: &str) -> Result<(), BackendError> {
        let path = format!("/api/v1/namespaces/{}/services", self.ns());
        for service in self
            .objects(group)?
            .iter()
            .filter(|o| o["kind"] == "Service")
        {
            match self
                .call(
                    "creating a Service",
                    reqwest::Method::POST,
                    &path,
                    Some(service),
                )
                .await
            {
                Ok(_) => {}
                // Left by an earlier launch of the same group: it is the same Service.
                Err(BackendError::Engine { status: 409, .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn start(&self, launch: &UnitLaunch<'_>) -> Result<String, BackendError> {
        let name = object_name(launch.group, launch.task);
        let job = self
            .objects(launch.group)?
            .into_iter()
            .find(|o| o["kind"] == "Job" && o["metadata"]["name"] == name.as_str())
            .expect("manifests hold a Job per component");
        let path = format!("/apis/batch/v1/namespaces/{}/jobs", self.ns());
        if launch.attempt > 0 {
            // A restart (a group recovery's): the ended Job of the earlier attempt holds
            // the name until it is deleted.
            self.delete_ended(&name).await?;
        }
        match self
            .call("creating a Job", reqwest::Method::POST, &path, Some(&job))
            .await
        {
            Ok(_) => Ok(name),
            Err(BackendError::Engine { status: 409, .. }) => Err(BackendError::Config {
                what: format!(
                    "a Job named `{name}` already exists in namespace `{}`",
                    self.ns()
                ),
                hint: format!(
                    "another launch of this group is running: `agentstack cancel {}`, or `kubectl delete job {name}`",
                    launch.group.name
                ),
            }),
            Err(e) => Err(e),
        }
    }

    async fn poll(&self, handles: &[String]) -> Result<Vec<UnitStatus>, BackendError> {
        let mut out = Vec::with_capacity(handles.len());
        for name in handles {
            let path = format!("/apis/batch/v1/namespaces/{}/jobs/{name}", self.ns());
            out.push(
                match self
                    .call("reading a Job", reqwest::Method::GET, &path, None)
                    .await?
                {
                    Some(job) => job_status(&job),
                    None => UnitStatus::Lost {
                        reason: "the Job is gone".into(),
                    },
                },
            );
        }
        Ok(out)
    }

    async fn stop(&self, handle: &str, graceful: bool) -> Result<(), BackendError> {
        let path = format!("/apis/batch/v1/namespaces/{}/jobs/{handle}", self.ns());
        let grace = if graceful {
            self.settings.termination_grace_seconds
        } else {
            0
        };
        let body = json!({
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
            "gracePeriodSeconds": grace,
        });
        self.call(
            "deleting a Job",
            reqwest::Method::DELETE,
            &path,
            Some(&body),
        )
        .await
        .map(drop)
    }

    async fn logs(&self, handle: &str) -> Result<LogSource, BackendError> {
        let path = format!(
            "/api/v1/namespaces/{}/pods?labelSelector=job-name%3D{handle}",
            self.ns()
        );
        let pods = self
            .call("listing a Job's Pods", reqwest::Method::GET, &path, None)
            .await?
            .unwrap_or_default();
        let mut text = String::new();
        for pod in pods["items"].as_array().into_iter().flatten() {
            let Some(name) = pod["metadata"]["name"].as_str() else {
                continue;
            };
            let path = format!("/api/v1/namespaces/{}/pods/{name}/log", self.ns());
            if let Some(Value::String(log)) = self
                .call("reading a Pod's log", reqwest::Method::GET, &path, None)
                .await?
            {
                text.push_str(&format!("== {name}\n{log}"));
            }
        }
        Ok(LogSource::Text(text))
    }

    /// Deletes every component's Job (those that ended on their own are still there,
    /// with their Pods) and Service; what is gone already is fine.
    async fn cleanup(&self, group: &JobGroup, _job_id: &str) -> Result<(), BackendError> {
        for task in &group.components {
            let name = object_name(group, task);
            self.stop(&name, false).await?;
        }
        for task in &group.components {
            let path = format!(
                "/api/v1/namespaces/{}/services/{}",
                self.ns(),
                object_name(group, task)
            );
            self.call("deleting a Service", reqwest::Method::DELETE, &path, None)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_statuses() {
        let job = |status: Value| json!({"metadata": {"name": "g-a"}, "spec": {"parallelism": 2}, "status": status});
        assert_eq!(job_status(&job(json!({}))), UnitStatus::Pending);
        assert_eq!(job_status(&job(json!({"ready": 1}))), UnitStatus::Pending);
        assert!(matches!(
            job_status(&job(json!({"ready": 2}))),
            UnitStatus::Running { .. }
        ));
        assert_eq!(
            job_status(&job(
                json!({"conditions": [{"type": "Complete", "status": "True"}]})
            )),
            UnitStatus::Exited { code: 0 }
        );
        assert_eq!(
            job_status(&job(
                json!({"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]})
            )),
            UnitStatus::Exited { code: 1 }
        );
    }

    #[test]
    fn kubeconfig_with_token_and_ca() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config");
        std::fs::write(dir.path().join("ca.pem"), "PEM").unwrap();
        std::fs::write(
            &path,
            "apiVersion: v1\ncurrent-context: dev\ncontexts:\n- name: dev\n  context: {cluster: c, user: u, namespace: ml}\n- name: other\n  context: {cluster: c, user: plugin}\nclusters:\n- name: c\n  cluster: {server: 'https://10.0.0.1:6443/', certificate-authority: ca.pem}\nusers:\n- name: u\n  user: {token: secret}\n- name: plugin\n  user: {exec: {command: aws}}\n",
        )
        .unwrap();
        let c = Credentials::from_kubeconfig(&path, None).unwrap();
        assert_eq!(c.server, "https://10.0.0.1:6443");
        assert_eq!(c.token.as_deref(), Some("secret"));
        assert_eq!(c.ca_pem.as_deref(), Some(&b"PEM"[..]));
        assert_eq!(c.namespace.as_deref(), Some("ml"));
        assert!(!format!("{c:?}").contains("secret"));
        let err = Credentials::from_kubeconfig(&path, Some("other")).unwrap_err();
        assert!(err.to_string().contains("through a plugin"), "{err}");
        let err = Credentials::from_kubeconfig(&path, Some("nope")).unwrap_err();
        assert!(err.to_string().contains("no context named `nope`"), "{err}");
    }
}
