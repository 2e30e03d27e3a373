//! What an `--env` or `--model` reference names, decided before anything is opened.
//!
//! An environment reference is, in this order: a hub package (`hub:owner/name[@version]`),
//! an OpenEnv server's URL (`http://…`, `https://…`), a built-in environment's name, an
//! OpenEnv package directory (with an `openenv.yaml` or a `server/app.py`), or a command
//! line that serves one (it holds whitespace). A model reference is an OpenAI-compatible
//! server's base URL, or anything the in-process engine loads (a GGUF file, a model
//! reference it fetches).
//!
//! ```
//! use agentstack_harness::reference::{EnvReference, ModelReference};
//!
//! let builtins = ["arithmetic".to_owned()];
//! let env = EnvReference::parse("arithmetic", &builtins)?;
//! assert_eq!(env, EnvReference::Builtin("arithmetic".into()));
//! assert!(matches!(EnvReference::parse("hub:ana/maze@1.0.0", &builtins)?, EnvReference::Hub(_)));
//! let model = ModelReference::parse("http://127.0.0.1:8080/v1/");
//! assert_eq!(model.to_string(), "http://127.0.0.1:8080/v1/");
//! assert_eq!(model.base_url(), Some("http://127.0.0.1:8080/v1"));
//! # Ok::<(), agentstack_harness::reference::ReferenceError>(())
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use agentstack_hub::api::PackageRef;

/// What an environment reference names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvReference {
    /// A hub package, pulled before it is opened.
    Hub(PackageRef),
    /// An OpenEnv server's URL.
    Url(String),
    /// A built-in environment, by name.
    Builtin(String),
    /// An OpenEnv package directory.
    Package(PathBuf),
    /// A command line that serves an environment.
    Command(String),
}

/// A reference that names no environment.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// `hub:` followed by something that is not `owner/name[@version]`.
    #[error("{0}")]
    Hub(String),
    /// A directory that is not an OpenEnv package.
    #[error(
        "{} is a directory with neither an openenv.yaml nor a server/app.py\nhint: serve an OpenEnv package directory, a built-in name ({builtins}), or a quoted command line",
        dir.display()
    )]
    NotAPackage {
        /// The directory.
        dir: PathBuf,
        /// The built-in environments' names, comma-separated.
        builtins: String,
    },
    /// Nothing an environment reference can be.
    #[error(
        "'{reference}' is not a built-in environment, a directory or a command line\nhint: built-in environments are: {builtins}"
    )]
    Unknown {
        /// The reference.
        reference: String,
        /// The built-in environments' names, comma-separated.
        builtins: String,
    },
}

fn is_url(text: &str) -> bool {
    text.starts_with("http://") || text.starts_with("https://")
}

impl EnvReference {
    /// Reads `text`, with `builtins` the built-in environments' names. A directory is
    /// looked at (for its `openenv.yaml` or `server/app.py`); nothing is opened.
    pub fn parse(text: &str, builtins: &[String]) -> Result<Self, ReferenceError> {
        if text.starts_with("hub:") {
            return PackageRef::parse(text)
                .map(Self::Hub)
                .map_err(ReferenceError::Hub);
        }
        if is_url(text) {
            return Ok(Self::Url(text.to_owned()));
        }
        Self::parse_local(text, builtins)
    }

    /// [`parse`](Self::parse) for what a server process hosts: a built-in name, a
    /// package directory or a command line (a URL or a `hub:` reference is not one).
    pub fn parse_local(text: &str, builtins: &[String]) -> Result<Self, ReferenceError> {
        if builtins.iter().any(|name| name == text) {
            return Ok(Self::Builtin(text.to_owned()));
        }
        let path = Path::new(text);
        if path.is_dir() {
            // A package without openenv.yaml is served when it has server/app.py (several
            // of OpenEnv's own environments ship none).
            if !path.join("openenv.yaml").is_file() && !path.join("server/app.py").is_file() {
                return Err(ReferenceError::NotAPackage {
                    dir: path.to_path_buf(),
                    builtins: builtins.join(", "),
                });
            }
            return Ok(Self::Package(path.to_path_buf()));
        }
        if text.contains(char::is_whitespace) {
            return Ok(Self::Command(text.to_owned()));
        }
        Err(ReferenceError::Unknown {
            reference: text.to_owned(),
            builtins: builtins.join(", "),
        })
    }
}

impl fmt::Display for EnvReference {
    /// The reference as it was written (what a run records).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Hub(package) => write!(f, "hub:{package}"),
            Self::Url(text) | Self::Builtin(text) | Self::Command(text) => f.write_str(text),
            Self::Package(dir) => write!(f, "{}", dir.display()),
        }
    }
}

/// What a model reference names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelReference {
    /// An OpenAI-compatible server's base URL, as written.
    Url(String),
    /// A model the in-process engine loads: a GGUF file or a reference it fetches.
    Local(String),
}

impl ModelReference {
    /// Reads `text`.
    pub fn parse(text: &str) -> Self {
        if is_url(text) {
            Self::Url(text.to_owned())
        } else {
            Self::Local(text.to_owned())
        }
    }

    /// A server's base URL without a trailing `/`; `None` for a local model.
    pub fn base_url(&self) -> Option<&str> {
        match self {
            Self::Url(url) => Some(url.trim_end_matches('/')),
            Self::Local(_) => None,
        }
    }
}

impl fmt::Display for ModelReference {
    /// The reference as it was written (what a run records).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Url(text) | Self::Local(text) => f.write_str(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtins() -> Vec<String> {
        vec!["echo".into(), "arithmetic".into()]
    }

    #[test]
    fn each_kind_of_env_reference() {
        let b = builtins();
        assert_eq!(
            EnvReference::parse("echo", &b).unwrap(),
            EnvReference::Builtin("echo".into())
        );
        assert_eq!(
            EnvReference::parse("https://envs.example/x", &b).unwrap(),
            EnvReference::Url("https://envs.example/x".into())
        );
        let EnvReference::Hub(package) = EnvReference::parse("hub:ana/maze@1.0.0", &b).unwrap()
        else {
            panic!("a hub package");
        };
        assert_eq!(package.to_string(), "ana/maze@1.0.0");
        assert_eq!(
            EnvReference::parse("python -m my_env.server", &b).unwrap(),
            EnvReference::Command("python -m my_env.server".into())
        );
    }

    #[test]
    fn a_directory_is_a_package_only_with_openenv_yaml_or_server_app() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().to_str().unwrap();
        let error = EnvReference::parse(text, &builtins()).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("neither an openenv.yaml nor a server/app.py"),
            "{error}"
        );
        assert!(error.to_string().contains("(echo, arithmetic)"), "{error}");
        std::fs::write(dir.path().join("openenv.yaml"), "name: x\n").unwrap();
        assert_eq!(
            EnvReference::parse(text, &builtins()).unwrap(),
            EnvReference::Package(dir.path().to_path_buf())
        );
    }

    #[test]
    fn what_names_nothing_says_what_exists() {
        let error = EnvReference::parse("nope", &builtins()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "'nope' is not a built-in environment, a directory or a command line\nhint: built-in environments are: echo, arithmetic"
        );
        let error = EnvReference::parse("hub:nobody", &builtins()).unwrap_err();
        assert!(matches!(error, ReferenceError::Hub(_)), "{error}");
    }

    #[test]
    fn a_server_process_hosts_no_url() {
        assert!(matches!(
            EnvReference::parse_local("http://127.0.0.1:9", &builtins()),
            Err(ReferenceError::Unknown { .. })
        ));
    }

    #[test]
    fn a_model_is_a_url_or_local() {
        let url = ModelReference::parse("http://127.0.0.1:8080/v1/");
        assert_eq!(url.base_url(), Some("http://127.0.0.1:8080/v1"));
        let local = ModelReference::parse("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_eq!(
            local,
            ModelReference::Local("SmolLM2-135M-Instruct.Q4_1.gguf".into())
        );
        assert_eq!(local.base_url(), None);
    }

    #[test]
    fn references_print_as_written() {
        for text in ["echo", "hub:ana/maze@1.0.0", "http://h:1/", "a b"] {
            let env = EnvReference::parse(text, &builtins()).unwrap();
            assert_eq!(env.to_string(), text);
            assert_eq!(ModelReference::parse(text).to_string(), text);
        }
    }
}
