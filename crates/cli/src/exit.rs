//! Exit codes, and whose fault an error is.
//!
//! Every failure is either the user's (exit 1: bad input, flags, files or
//! configuration, a request that was refused, a check that found a problem) or ours
//! (exit 2: an internal or unexpected error, such as a panic, a failed read of our own
//! state, a bug). An error is the user's only when it says so: a command marks it with
//! [`Exit::user`], or marks an `anyhow` error on its way up with [`UserError`] (through
//! [`IntoUserError`] or [`user_error!`](crate::user_error)). Anything unmarked is
//! internal, so an error nobody foresaw is never blamed on the user.
//!
//! The model is uv's `ExitStatus`; the codes are ripgrep's and uv's.

use std::fmt;
use std::process::ExitCode;

/// How the process ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// Everything went as asked (0).
    Success,
    /// The user's error: bad input, flags, files or configuration, a refused request,
    /// a check that failed (1).
    Failure,
    /// An internal error: a panic, a failure of our own state or I/O, a bug (2).
    Error,
}

impl ExitStatus {
    /// The process exit code.
    pub const fn code(self) -> u8 {
        match self {
            Self::Success => 0,
            Self::Failure => 1,
            Self::Error => 2,
        }
    }
}

impl From<ExitStatus> for ExitCode {
    fn from(status: ExitStatus) -> Self {
        ExitCode::from(status.code())
    }
}

/// An error that carries its exit code.
#[derive(Debug)]
pub struct Exit {
    /// The process exit code.
    pub code: u8,
    /// What to print on stderr (nothing when empty).
    pub error: Option<anyhow::Error>,
}

impl Exit {
    /// The user's error (exit 1).
    pub fn user(error: anyhow::Error) -> Self {
        Self {
            code: ExitStatus::Failure.code(),
            error: Some(error),
        }
    }

    /// An internal error (exit 2).
    pub fn internal(error: impl Into<anyhow::Error>) -> Self {
        Self {
            code: ExitStatus::Error.code(),
            error: Some(error.into()),
        }
    }

    /// Exit with `code` having already printed everything.
    pub fn quiet(code: u8) -> Self {
        Self { code, error: None }
    }
}

/// `?` on an `anyhow` error: the user's (exit 1) when it holds a [`UserError`],
/// internal (exit 2) otherwise.
impl From<anyhow::Error> for Exit {
    fn from(error: anyhow::Error) -> Self {
        if is_users(&error) {
            Self::user(error)
        } else {
            Self::internal(error)
        }
    }
}

/// Whether `error` is the user's: marked so anywhere along its chain (contexts added
/// above a [`UserError`] keep it the user's), or caused by a domain error whose kind
/// is the user's (see `blames_the_user`).
pub fn is_users(error: &anyhow::Error) -> bool {
    error.downcast_ref::<UserError>().is_some() || error.chain().any(blames_the_user)
}

/// The one table of the domain errors that are the user's to fix: a model file that
/// is not one, a request the server refused, a key that is missing. Every other kind
/// (a failed connection, a tensor computation, a database) is not.
fn blames_the_user(cause: &(dyn std::error::Error + 'static)) -> bool {
    use agentstack_env::client::ClientError as EnvClientError;
    use agentstack_harness::env::EnvError;
    use agentstack_harness::episode::EpisodeError;
    use agentstack_harness::model::ModelError as ClientModelError;
    use agentstack_harness::run::RunError;
    use agentstack_model::ModelError;
    use agentstack_quant::QuantError;
    if cause.is::<UserError>() {
        return true;
    }
    let model_error_is_users = |e: &ModelError| {
        matches!(
            e,
            ModelError::Io { .. }
                | ModelError::Gguf { .. }
                | ModelError::MissingMetadata { .. }
                | ModelError::BadMetadata { .. }
                | ModelError::UnsupportedArchitecture(_)
                | ModelError::BadTensor { .. }
                | ModelError::Template(_)
                | ModelError::InvalidRequest(_)
                | ModelError::ContextOverflow { .. }
        )
    };
    if let Some(e) = cause.downcast_ref::<ModelError>() {
        return model_error_is_users(e);
    }
    if let Some(agentstack_model::engine::SubmitError::Invalid(e)) = cause.downcast_ref() {
        // Transparent too: a request the in-process engine refused (`model generate`).
        return model_error_is_users(e);
    }
    if let Some(e) = cause.downcast_ref::<ClientModelError>() {
        return match e {
            // Transparent: the chain skips the model's own error.
            ClientModelError::Local(e) => model_error_is_users(e),
            ClientModelError::Status { status, .. } => (400..500).contains(status),
            _ => false,
        };
    }
    if let Some(e) = cause.downcast_ref::<RunError>() {
        return matches!(
            e,
            RunError::ConfigMismatch { .. } | RunError::Locked { .. } | RunError::Config(_)
        );
    }
    if let Some(e) = cause.downcast_ref::<QuantError>() {
        return matches!(
            e,
            QuantError::Io { .. }
                | QuantError::BadGguf { .. }
                | QuantError::BadImatrix { .. }
                | QuantError::Unquantizable { .. }
                | QuantError::Invalid(_)
        );
    }
    let env_client_error_is_users = |e: &EnvClientError| match e {
        EnvClientError::InvalidUrl(_) | EnvClientError::Unauthorized { .. } => true,
        EnvClientError::Status { status, .. } => (400..500).contains(status),
        _ => false,
    };
    if let Some(e) = cause.downcast_ref::<EnvClientError>() {
        return env_client_error_is_users(e);
    }
    if let Some(EnvError::Client(e)) = cause.downcast_ref::<EnvError>() {
        // Transparent, as above.
        return env_client_error_is_users(e);
    }
    if let Some(EpisodeError::Profile(_)) = cause.downcast_ref::<EpisodeError>() {
        // The user's prompt profile does not render.
        return true;
    }
    if let Some(e) = cause.downcast_ref::<agentstack_rl::train::TrainError>() {
        use agentstack_rl::train::TrainError;
        // The configuration, its prompt profile, the environment's task split: the
        // user's; a model that does not load is decided by its own error, below it.
        return matches!(
            e,
            TrainError::Config(_)
                | TrainError::InvalidConfig(_)
                | TrainError::Profile(_)
                | TrainError::Tasks { .. }
        );
    }
    if let Some(e) = cause.downcast_ref::<agentstack_hub::db::DbError>() {
        use agentstack_hub::db::DbError;
        // A database URL we do not speak, or a path we cannot use; a broken database
        // is not the user's.
        return matches!(e, DbError::Url(_) | DbError::Permissions { .. });
    }
    if let Some(e) = cause.downcast_ref::<agentstack_hub::client::ClientError>() {
        return crate::commands::hub::is_users(e);
    }
    false
}

/// Marks an error as the user's to fix (exit 1). It prints exactly as the error it
/// wraps: same message, same causes.
pub struct UserError(anyhow::Error);

impl UserError {
    /// Marks `error` as the user's.
    pub fn new(error: impl Into<anyhow::Error>) -> Self {
        Self(error.into())
    }
}

impl fmt::Display for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `{}` of an anyhow error is its own message, without its causes: those are
        // this error's sources.
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl std::error::Error for UserError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Marks the error of a `Result` as the user's.
pub trait IntoUserError<T> {
    /// The error, as the user's (same message).
    fn user(self) -> anyhow::Result<T>;

    /// The error under `context`, as the user's.
    fn user_context<C>(self, context: C) -> anyhow::Result<T>
    where
        C: fmt::Display + Send + Sync + 'static;

    /// The error under the context `f` makes (only on error), as the user's.
    fn with_user_context<C, F>(self, f: F) -> anyhow::Result<T>
    where
        C: fmt::Display + Send + Sync + 'static,
        F: FnOnce() -> C;
}

impl<T, E: Into<anyhow::Error>> IntoUserError<T> for Result<T, E> {
    fn user(self) -> anyhow::Result<T> {
        self.map_err(|e| UserError::new(e).into())
    }

    fn user_context<C>(self, context: C) -> anyhow::Result<T>
    where
        C: fmt::Display + Send + Sync + 'static,
    {
        self.map_err(|e| UserError::new(e.into().context(context)).into())
    }

    fn with_user_context<C, F>(self, f: F) -> anyhow::Result<T>
    where
        C: fmt::Display + Send + Sync + 'static,
        F: FnOnce() -> C,
    {
        self.map_err(|e| UserError::new(e.into().context(f())).into())
    }
}

/// An `anyhow::Error` that is the user's (exit 1), formatted like `anyhow!`.
#[macro_export]
macro_rules! user_error {
    ($($arg:tt)*) => {
        ::anyhow::Error::from($crate::exit::UserError::new(::anyhow::anyhow!($($arg)*)))
    };
}

/// Writes `error` and its causes on stderr, each cause once: a cause whose text the
/// line above already holds (a message that repeats its source, often from a crate
/// this one cannot change) is not written again.
pub fn print_error(error: &anyhow::Error) {
    eprint!("{}", report(error));
}

/// The text [`print_error`] writes.
pub fn report(error: &anyhow::Error) -> String {
    let mut out = format!("error: {error}\n");
    let mut above = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !above.contains(&text) {
            out.push_str(&format!("  caused by: {text}\n"));
        }
        above = text;
    }
    out
}

#[cfg(test)]
mod tests {
    use anyhow::{Context, anyhow};

    use super::*;

    #[test]
    fn unmarked_errors_are_internal() {
        let exit = Exit::from(anyhow!("a bug"));
        assert_eq!(exit.code, 2);
        let io = std::io::Error::other("disk on fire");
        let exit = Exit::from(anyhow::Error::from(io).context("writing the state"));
        assert_eq!(exit.code, 2);
    }

    #[test]
    fn marked_errors_are_the_users_under_any_context() {
        assert_eq!(Exit::from(crate::user_error!("bad flag")).code, 1);
        let marked: anyhow::Result<()> = Err(std::io::Error::other("no such file")).user();
        let wrapped = marked.context("reading --config").unwrap_err();
        assert_eq!(Exit::from(wrapped).code, 1);
        let marked: anyhow::Result<()> =
            Err(anyhow!("not a number")).user_context("--threads four");
        assert_eq!(Exit::from(marked.unwrap_err()).code, 1);
    }

    #[test]
    fn a_marked_error_prints_as_the_error_it_marks() {
        let io = std::io::Error::other("no such file");
        let plain = anyhow::Error::from(io).context("reading x.yaml");
        let expected = report(&plain);
        let io = std::io::Error::other("no such file");
        let marked: anyhow::Result<()> = Err(io).user_context("reading x.yaml");
        assert_eq!(report(&marked.unwrap_err()), expected);
        assert_eq!(
            expected,
            "error: reading x.yaml\n  caused by: no such file\n"
        );
    }

    /// The table decides by kind, under any context: a model file that is not one and
    /// a bad training configuration are the user's; a failed download is not.
    #[test]
    fn domain_errors_say_whose_they_are() {
        use agentstack_model::ModelError;
        let code = |e: anyhow::Error| Exit::from(e.context("loading")).code;
        assert_eq!(
            code(ModelError::UnsupportedArchitecture("gpt2".into()).into()),
            1
        );
        assert_eq!(
            code(
                ModelError::Download {
                    url: "http://127.0.0.1:9/m.gguf".into(),
                    reason: "connection refused".into(),
                }
                .into()
            ),
            2
        );
        assert_eq!(
            code(agentstack_rl::train::TrainError::Config("steps = 0".into()).into()),
            1
        );
    }

    /// A message that repeats its source (`"model: {0}"` over the same error) prints
    /// its cause once.
    #[test]
    fn a_cause_the_message_repeats_prints_once() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "episode 0 failed: {}", self.0)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let error =
            anyhow::Error::new(Outer(std::io::Error::other("refused"))).context("the run stopped");
        assert_eq!(
            report(&error),
            "error: the run stopped\n  caused by: episode 0 failed: refused\n"
        );
    }
}
