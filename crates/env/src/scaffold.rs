//! `env init`: writes a new environment, in Rust (on `agentstack-env`) or in Python
//! (an OpenEnv package), that serves and passes `validate` as created.

use std::path::{Path, PathBuf};

/// Why the environment could not be created.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    /// The name cannot be a crate, module and URL name.
    #[error(
        "'{0}' is not a valid environment name; use lowercase letters, digits and '_', starting with a letter"
    )]
    BadName(String),
    /// The target exists.
    #[error("{0} already exists; choose another name or directory")]
    Exists(PathBuf),
    /// Writing failed.
    #[error("could not write {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

const RUST: [(&str, &str); 3] = [
    (
        "Cargo.toml",
        include_str!("../templates/rust/Cargo.toml.tmpl"),
    ),
    (
        "src/main.rs",
        include_str!("../templates/rust/src/main.rs.tmpl"),
    ),
    (
        "README.md",
        include_str!("../templates/rust/README.md.tmpl"),
    ),
];

const PYTHON: [(&str, &str); 8] = [
    (
        "openenv.yaml",
        include_str!("../templates/python/openenv.yaml.tmpl"),
    ),
    (
        "__init__.py",
        include_str!("../templates/python/__init__.py.tmpl"),
    ),
    (
        "models.py",
        include_str!("../templates/python/models.py.tmpl"),
    ),
    (
        "server/__init__.py",
        include_str!("../templates/python/server/__init__.py.tmpl"),
    ),
    (
        "server/environment.py",
        include_str!("../templates/python/server/environment.py.tmpl"),
    ),
    (
        "server/app.py",
        include_str!("../templates/python/server/app.py.tmpl"),
    ),
    (
        "pyproject.toml",
        include_str!("../templates/python/pyproject.toml.tmpl"),
    ),
    (
        "README.md",
        include_str!("../templates/python/README.md.tmpl"),
    ),
];

fn valid(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn type_name(name: &str) -> String {
    name.split('_')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// How the new Rust crate depends on agentstack-env: this checkout's crate when it
/// exists (a development build), else the published version.
fn agentstack_env_dep() -> String {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    if here.join("Cargo.toml").is_file() {
        format!("{{ path = {:?} }}", here.display().to_string())
    } else {
        format!("\"{}\"", env!("CARGO_PKG_VERSION"))
    }
}

/// Creates `<parent>/<name>`; returns its path. Writes into a temporary directory
/// first and renames it into place, so a failure leaves nothing half-made.
pub fn create(name: &str, python: bool, parent: &Path) -> Result<PathBuf, ScaffoldError> {
    if !valid(name) {
        return Err(ScaffoldError::BadName(name.to_owned()));
    }
    let target = parent.join(name);
    if target.exists() {
        return Err(ScaffoldError::Exists(target));
    }
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ScaffoldError::Io { path, source }
    };
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let staging = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let files: &[(&str, &str)] = if python { &PYTHON } else { &RUST };
    let write_all = || -> Result<(), ScaffoldError> {
        for (rel, template) in files {
            let text = template
                .replace("{{name}}", name)
                .replace("{{type_name}}", &type_name(name))
                .replace("{{agentstack_env_dep}}", &agentstack_env_dep());
            let path = staging.join(rel);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io(dir))?;
            }
            std::fs::write(&path, text).map_err(io(&path))?;
        }
        Ok(())
    };
    if let Err(e) = write_all() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    std::fs::rename(&staging, &target).map_err(io(&target))?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_layout() {
        assert_eq!(type_name("my_env2"), "MyEnv2");
        assert!(valid("my_env") && !valid("My-env") && !valid("2env") && !valid(""));
        let tmp = tempfile::tempdir().unwrap();
        let dir = create("demo_env", true, tmp.path()).unwrap();
        let yaml = std::fs::read_to_string(dir.join("openenv.yaml")).unwrap();
        assert!(yaml.contains("name: demo_env"));
        let app = std::fs::read_to_string(dir.join("server/app.py")).unwrap();
        assert!(app.contains("DemoEnvEnvironment") && !app.contains("{{"));
        assert!(matches!(
            create("demo_env", true, tmp.path()),
            Err(ScaffoldError::Exists(_))
        ));
        let rust = create("rusty", false, tmp.path()).unwrap();
        let cargo = std::fs::read_to_string(rust.join("Cargo.toml")).unwrap();
        assert!(cargo.contains("agentstack-env = { path"));
        assert!(matches!(
            create("Bad-Name", false, tmp.path()),
            Err(ScaffoldError::BadName(_))
        ));
    }
}
