//! Units as Ray jobs, through the Jobs REST API on the head's dashboard port:
//! `POST /api/jobs/` (the [submission](crate::ray::submit_request)),
//! `GET /api/jobs/{id}` (status, exit code, the driver's node),
//! `POST /api/jobs/{id}/stop` (SIGTERM to the entrypoint's process group, SIGKILL
//! after Ray's `RAY_JOB_STOP_WAIT_TIME_S`), `GET /api/jobs/{id}/logs`.
//!
//! A job's address is its driver's node; it reaches the program through the discovery
//! file, so the launch directory must be on a file system the Ray nodes share (a
//! one-host head, as in the tests, or NFS).

use std::time::Duration;

use serde_json::Value;

use super::{Backend, BackendError, LogSource, UnitLaunch, UnitStatus, signal_exit_code};
use crate::discovery::Addresses;
use crate::ray::{RayOptions, submit_request};
use crate::spec::{InfraKind, JobGroup};

/// Most bytes of an engine's error body kept in an error.
const MAX_ERROR_BODY: usize = 2000;

/// A Ray cluster's Jobs API.
#[derive(Debug, Clone)]
pub struct RayBackend {
    client: reqwest::Client,
    address: String,
}

impl RayBackend {
    /// The Jobs API at `address` (`http://127.0.0.1:8265`).
    pub fn new(address: &str) -> Self {
        Self {
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("a client with a timeout builds"),
            address: address.trim_end_matches('/').to_owned(),
        }
    }

    async fn call(
        &self,
        what: &str,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<Value, BackendError> {
        let http = |source| BackendError::Http {
            what: what.to_owned(),
            url: url.to_owned(),
            source,
        };
        let response = request.send().await.map_err(http)?;
        let status = response.status();
        let text = response.text().await.map_err(http)?;
        if !status.is_success() {
            let mut body = text;
            body.truncate(MAX_ERROR_BODY);
            return Err(BackendError::Engine {
                what: what.to_owned(),
                status: status.as_u16(),
                body,
            });
        }
        serde_json::from_str(&text).map_err(|e| BackendError::Parse {
            what: what.to_owned(),
            detail: e.to_string(),
        })
    }

    /// `GET /api/version`: whether the API answers.
    pub async fn version(&self) -> Result<Value, BackendError> {
        let url = format!("{}/api/version", self.address);
        self.call("the Ray Jobs API", self.client.get(&url), &url)
            .await
    }
}

/// A status from `GET /api/jobs/{id}`.
fn status(job: &Value) -> UnitStatus {
    match job["status"].as_str().unwrap_or("") {
        "PENDING" => UnitStatus::Pending,
        // An entrypoint that never connects to Ray has no `driver_info`; the node's
        // agent address (`http://<node ip>:<port>`) names the node all the same.
        "RUNNING" => match job["driver_info"]["node_ip_address"].as_str().or_else(|| {
            job["driver_agent_http_address"]
                .as_str()
                .and_then(|a| a.split_once("://"))
                .and_then(|(_, rest)| rest.rsplit_once(':'))
                .map(|(host, _)| host.trim_start_matches('[').trim_end_matches(']'))
        }) {
            Some(ip) => UnitStatus::Running {
                hosts: vec![ip.to_owned()],
            },
            None => UnitStatus::Pending,
        },
        "SUCCEEDED" => UnitStatus::Exited { code: 0 },
        "STOPPED" => UnitStatus::Exited {
            code: signal_exit_code(15),
        },
        "FAILED" => match job["driver_exit_code"].as_i64() {
            // Python reports a signal as its negative number.
            Some(code) if code < 0 => UnitStatus::Exited {
                code: signal_exit_code(-code as i32),
            },
            Some(0) | None => UnitStatus::Lost {
                reason: format!(
                    "Ray: {} {}",
                    job["error_type"].as_str().unwrap_or("failed"),
                    job["message"].as_str().unwrap_or("")
                ),
            },
            Some(code) => UnitStatus::Exited { code: code as i32 },
        },
        other => UnitStatus::Lost {
            reason: format!("Ray says `{other}`"),
        },
    }
}

impl Backend for RayBackend {
    fn kind(&self) -> InfraKind {
        InfraKind::Ray
    }

    fn addresses_up_front(&self, _group: &JobGroup) -> Option<Addresses> {
        None
    }

    async fn start(&self, launch: &UnitLaunch<'_>) -> Result<String, BackendError> {
        let discovery_file = launch
            .discovery_file
            .as_ref()
            .map(|f| f.to_string_lossy().into_owned());
        let body = submit_request(
            launch.group,
            &launch.task.name,
            launch.replica,
            launch.discovery,
            &RayOptions {
                launch_id: launch.job_id,
                attempt: launch.attempt,
                working_dir_uri: None,
                discovery_file: discovery_file.as_deref(),
                discovery_timeout_seconds: launch.discovery_timeout_seconds,
            },
        )?;
        let url = format!("{}/api/jobs/", self.address);
        let answer = self
            .call(
                "submitting a Ray job",
                self.client.post(&url).json(&body),
                &url,
            )
            .await?;
        answer["submission_id"]
            .as_str()
            .or(answer["job_id"].as_str())
            .map(str::to_owned)
            .ok_or_else(|| BackendError::Parse {
                what: "POST /api/jobs/".into(),
                detail: format!("no submission_id in {answer}"),
            })
    }

    async fn poll(&self, handles: &[String]) -> Result<Vec<UnitStatus>, BackendError> {
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            let url = format!("{}/api/jobs/{h}", self.address);
            match self
                .call("a Ray job's status", self.client.get(&url), &url)
                .await
            {
                Ok(job) => out.push(status(&job)),
                Err(BackendError::Engine { status: 404, .. }) => out.push(UnitStatus::Lost {
                    reason: "Ray no longer knows the job".into(),
                }),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    async fn stop(&self, handle: &str, _graceful: bool) -> Result<(), BackendError> {
        // Ray's stop is graceful first and forceful after its own wait; a second
        // call is harmless.
        let url = format!("{}/api/jobs/{handle}/stop", self.address);
        self.call("stopping a Ray job", self.client.post(&url), &url)
            .await
            .map(drop)
    }

    async fn logs(&self, handle: &str) -> Result<LogSource, BackendError> {
        let url = format!("{}/api/jobs/{handle}/logs", self.address);
        let answer = self
            .call("a Ray job's logs", self.client.get(&url), &url)
            .await?;
        Ok(LogSource::Text(
            answer["logs"].as_str().unwrap_or_default().to_owned(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(status(&json!({"status": "PENDING"})), UnitStatus::Pending);
        assert_eq!(status(&json!({"status": "RUNNING"})), UnitStatus::Pending);
        assert_eq!(
            status(&json!({"status": "RUNNING", "driver_info": {"node_ip_address": "10.0.0.2"}})),
            UnitStatus::Running {
                hosts: vec!["10.0.0.2".into()]
            }
        );
        assert_eq!(
            status(
                &json!({"status": "RUNNING", "driver_agent_http_address": "http://127.0.0.1:52365"})
            ),
            UnitStatus::Running {
                hosts: vec!["127.0.0.1".into()]
            }
        );
        assert_eq!(
            status(&json!({"status": "FAILED", "driver_exit_code": -9})),
            UnitStatus::Exited { code: 137 }
        );
        assert_eq!(
            status(&json!({"status": "FAILED", "driver_exit_code": 3})),
            UnitStatus::Exited { code: 3 }
        );
        assert!(matches!(
            status(&json!({"status": "FAILED", "error_type": "JOB_SUPERVISOR_ACTOR_DIED"})),
            UnitStatus::Lost { .. }
        ));
    }
}
