//! The compute layer: one spec, run on the user's own compute.
//!
//! The core is plain data with no I/O:
//!
//! - [`spec`]: a task YAML with SkyPilot's key names (`resources`, `num_nodes`, `envs`,
//!   `setup`, `run`, `file_mounts`, ...) and job groups as multi-document YAML, read
//!   into [`JobGroup`] with errors that say where and how to fix;
//! - [`discovery`]: the environment through which components find each other
//!   (`AGENTSTACK_<COMPONENT>_ADDRS`, `SKYPILOT_NODE_RANK`, ...);
//! - [`entrypoint`]: the shell script every node runs (setup, then `exec` run);
//! - [`slurm`], [`ray`], [`kubernetes`]: a component as an `sbatch` script, a Ray Jobs
//!   submission body, or a Service and an Indexed Job.
//!
//! On top of it, the parts that run things:
//!
//! - [`launch`]: a launch's choices: the infra ([`launch::InfraKind`]), the backend
//!   for it, the supervisor's pace, and the dry-run plan (text, no I/O);
//! - [`backend`]: one small trait and its engines — local process groups, the Slurm
//!   CLI, the Ray Jobs API (and Kubernetes' API);
//! - [`supervisor`]: a launch's life on any backend — gang start, discovery files,
//!   recovery by `job_recovery`, termination delays, preemption, cancel;
//! - [`state`]: launches and units in SQLite, so a restarted `agentstack` picks up
//!   what an earlier one started;
//! - [`balancer`]: the load balancer in front of a service's ready replicas, which
//!   sends a request again to another replica when one dies.
//!
//! ```
//! use agentstack_compute::discovery::{self, Addresses};
//! use agentstack_compute::{JobGroup, slurm};
//!
//! let group = JobGroup::parse(
//!     "name: demo\nexecution: parallel\nprimary_tasks: [client]\n\
//!      ---\nname: server\nresources: {ports: 8000}\nrun: python -m http.server $AGENTSTACK_PORT\n\
//!      ---\nname: client\nrun: curl http://$AGENTSTACK_SERVER_ADDRS/\n",
//! )?;
//! let mut addresses = Addresses::new();
//! addresses.insert("server".into(), vec!["10.0.0.5:8000".parse()?]);
//! addresses.insert("client".into(), vec!["10.0.0.6".parse()?]);
//! let env = discovery::environment(&group, &addresses, "client", 0)?;
//! assert_eq!(env["AGENTSTACK_SERVER_ADDRS"], "10.0.0.5:8000");
//!
//! let script = slurm::batch_script(&group, "client", 0, &env, &Default::default())?;
//! assert!(script.contains("#SBATCH --job-name=demo-client"));
//!
//! let err = JobGroup::parse("name: t\nrun: x\nresources: {cpu: 4}\n").unwrap_err();
//! assert!(err.to_string().contains("unknown key `cpu`"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod backend;
pub mod balancer;
pub mod discovery;
pub mod entrypoint;
pub mod kubernetes;
pub mod launch;
pub mod ray;
pub mod request;
pub mod slurm;
pub mod spec;
pub mod state;
pub mod supervisor;

pub use request::BuildError;
pub use spec::{JobGroup, SpecError, Task};
