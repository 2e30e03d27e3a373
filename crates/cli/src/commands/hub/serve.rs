//! `agentstack hub serve`: the registry, on SQLite (default) or PostgreSQL, with blobs
//! on local disk; pushed packages are validated in the sandbox (conformance, and with
//! `--lift-model` a short training run).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentstack_hub::blobs::Blobs;
use agentstack_hub::db::Db;
use agentstack_hub::package::UnpackLimits;
use agentstack_hub::registry::{Limits, Registry};
use agentstack_hub::validate::{Conformance, Lift, Validators};
use agentstack_rl::config::TrainConfig;
use agentstack_sandbox::{Sandbox, SandboxConfig};
use agentstack_static::env_vars;
use anyhow::{Context, anyhow};

use crate::args::HubServeArgs;
use crate::settings;
use crate::{Exit, IntoUserError};

/// The default lift run (`--lift-config` replaces it).
const DEFAULT_LIFT_CONFIG: &str = include_str!("lift.toml");

/// What `--lift-model` and `--lift-config` name, checked before the hub starts.
struct LiftSetup {
    /// The model, as an absolute path without links (it is bound into the sandbox).
    model: PathBuf,
    config: String,
}

fn lift_setup(args: &HubServeArgs) -> Result<Option<LiftSetup>, Exit> {
    let Some(model) = &args.lift_model else {
        return Ok(None);
    };
    let model = std::fs::canonicalize(model)
        .with_context(|| format!("--lift-model {}", model.display()))
        .map_err(Exit::user)?;
    require_readable_by_all(&model).map_err(Exit::user)?;
    let config = match &args.lift_config {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("--lift-config {}", path.display()))
            .map_err(Exit::user)?,
        None => DEFAULT_LIFT_CONFIG.to_owned(),
    };
    // The run in the sandbox would fail on every push with the same error: say it now.
    let mut parsed = TrainConfig::parse(&config).map_err(|e| {
        Exit::user(anyhow!(
            "--lift-config {}: {e}",
            args.lift_config
                .as_deref()
                .unwrap_or(Path::new(""))
                .display()
        ))
    })?;
    parsed.model = model.clone();
    parsed.env = "pkg".into();
    parsed
        .check()
        .map_err(|e| Exit::user(anyhow!("the lift configuration: {e}")))?;
    if args.lift_threads == 0 || args.lift_timeout == 0 {
        return Err(Exit::user(anyhow!(
            "--lift-threads and --lift-timeout must be at least 1"
        )));
    }
    Ok(Some(LiftSetup { model, config }))
}

/// Sandboxed runs are a user with no rights on the host's files: the model and every
/// folder above it must be open to all users, or the run cannot read it.
fn require_readable_by_all(model: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.permissions().mode())
            .with_context(|| format!("--lift-model: reading {}", p.display()))
    };
    let hint = "the lift run in the sandbox runs as a user with no rights on this machine's files; put the model where every user can read it (e.g. /srv/agentstack/models, mode 0644, folders 0755)";
    if mode(model)? & 0o004 == 0 {
        anyhow::bail!(
            "--lift-model {} is not readable by other users\nhint: {hint}",
            model.display()
        );
    }
    for dir in model.ancestors().skip(1) {
        if mode(dir)? & 0o001 == 0 {
            anyhow::bail!(
                "--lift-model {}: the folder {} is closed to other users\nhint: {hint}",
                model.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// The validators that start package code, in the sandbox, or say why they cannot.
async fn sandboxed(
    args: &HubServeArgs,
    lift: Option<LiftSetup>,
) -> Result<(Conformance, Option<Lift>), Exit> {
    let mut read_only = args.validate_read_only.clone();
    read_only.extend(lift.as_ref().map(|l| l.model.clone()));
    let config = SandboxConfig {
        warm: 0,
        max_concurrent: 1,
        max_queued: 64,
        read_only,
        expose_program: true,
        ..SandboxConfig::default()
    };
    let python = (
        env_vars::AGENTSTACK_PYTHON.to_owned(),
        args.validate_python.clone(),
    );
    match Sandbox::start(config).await {
        Ok(sandbox) => {
            let sandbox = Arc::new(sandbox);
            let mut c = Conformance::new(sandbox.clone());
            c.env.push(python.clone());
            let lift = lift.map(|setup| {
                let mut l = Lift::new(sandbox, setup.config, setup.model);
                l.threads = args.lift_threads;
                l.limits.wall = Duration::from_secs(args.lift_timeout);
                l.limits.cpu = Duration::from_secs(args.lift_timeout)
                    * u32::try_from(args.lift_threads).unwrap_or(u32::MAX);
                l.env.push(python);
                l
            });
            Ok((c, lift))
        }
        // The paths this hub was given, not the machine: say so instead of serving
        // without validation.
        Err(e @ agentstack_sandbox::Error::InvalidConfig(_)) => Err(Exit::user(anyhow!(
            "{e}\nhint: --validate-read-only and --lift-model paths are bound into the sandbox at the same path"
        ))),
        Err(e) => {
            tracing::warn!(error = %e, "this machine cannot isolate: pushed packages will not be started");
            let why = format!("this hub cannot isolate package code ({e})");
            Ok((
                Conformance::unavailable(why.clone()),
                lift.map(|_| Lift::unavailable(why)),
            ))
        }
    }
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn run(args: HubServeArgs) -> Result<(), Exit> {
    let database = settings::hub_database(args.database.as_deref());
    let blobs_dir = args
        .blobs
        .clone()
        .unwrap_or_else(|| settings::data_dir().join("blobs"));
    std::fs::create_dir_all(settings::data_dir())
        .with_context(|| format!("creating {}", settings::data_dir().display()))?;
    let db = Db::connect(&database)
        .await
        .with_context(|| format!("opening the hub database {}", redact_url(&database)))?;
    let blobs = Blobs::local(&blobs_dir).context("opening the blob store")?;
    let lift = lift_setup(&args)?;
    let mut validators = Validators::default().with_concurrency(1);
    if !args.no_conformance || lift.is_some() {
        let (conformance, lift) = sandboxed(&args, lift).await?;
        if !args.no_conformance {
            validators.push(Arc::new(conformance));
        }
        if let Some(lift) = lift {
            validators.push(Arc::new(lift));
        }
    }
    if args.max_concurrent_uploads == 0 || args.max_posts_per_minute == 0 {
        return Err(Exit::user(anyhow!(
            "--max-concurrent-uploads and --max-posts-per-minute must be at least 1"
        )));
    }
    let limits = Limits {
        max_package_bytes: args.max_package_mib << 20,
        unpack: UnpackLimits {
            max_bytes: args.max_unpacked_mib << 20,
            ..UnpackLimits::default()
        },
        max_concurrent_uploads: args.max_concurrent_uploads,
        posts_per_minute: args.max_posts_per_minute,
        ..Limits::default()
    };
    let registry = Registry::with(db, blobs, limits, validators);
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_user_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let address = listener.local_addr().context("local address")?;
    println!("agentstack hub at http://{address}");
    tracing::info!(database = %redact_url(&database), blobs = %blobs_dir.display(), "hub serving");
    agentstack_hub::server::serve(
        listener,
        Arc::new(registry),
        settings::connection_limits(
            &args.connections,
            agentstack_serve::Limits::DEFAULT_MAX_CONNECTIONS,
        ),
        crate::commands::env::serve::shutdown_signal(),
    )
    .await
    .context("serving")?;
    Ok(())
}

/// A database URL without its password, for logs and errors.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_lift_run_is_a_valid_training_configuration() {
        let mut c = agentstack_rl::config::TrainConfig::parse(super::DEFAULT_LIFT_CONFIG).unwrap();
        c.env = "pkg".into();
        c.check().unwrap();
        // Evaluated before the first step and after the last.
        assert_eq!(c.eval.every, c.steps);
        assert_eq!(c.rollout.split.as_deref(), Some(""));
    }

    #[test]
    fn database_passwords_never_reach_logs() {
        assert_eq!(
            super::redact_url("postgres://hub:s3cret@127.0.0.1/hub"),
            "postgres://hub:***@127.0.0.1/hub"
        );
        assert_eq!(
            super::redact_url("sqlite:///x/hub.db"),
            "sqlite:///x/hub.db"
        );
    }
}
