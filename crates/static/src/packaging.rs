//! What packaging never copies from an environment's directory.
//!
//! One list for every walk that packs, pushes or copies an environment (the hub's
//! `pack`, `env import`'s copy of a project's source), so they cannot drift apart.

/// Names of files and directories never packed or copied, at any depth: version
/// control, Python and tool caches, virtual environments, build output and editor
/// litter. A name matches whether it is a file or a directory (a `.git` file is a
/// worktree's pointer to its repository).
pub const SKIPPED_NAMES: &[&str] = &[
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".venv",
    "venv",
    "node_modules",
    "target",
    "build",
    "dist",
    ".DS_Store",
];

/// Endings of file names never packed or copied: Python bytecode, which `__pycache__`
/// holds but older Pythons write beside the source.
pub const SKIPPED_SUFFIXES: &[&str] = &[".pyc"];

/// Whether an entry called `name` (a single path component) is left out.
///
/// ```
/// use agentstack_static::packaging::is_skipped;
/// assert!(is_skipped(".git") && is_skipped("app.cpython-311.pyc"));
/// assert!(!is_skipped("server") && !is_skipped("openenv.yaml"));
/// ```
pub fn is_skipped(name: &str) -> bool {
    SKIPPED_NAMES.contains(&name) || SKIPPED_SUFFIXES.iter().any(|s| name.ends_with(s))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_listed_name_and_suffix_is_skipped() {
        for name in SKIPPED_NAMES {
            assert!(is_skipped(name), "{name}");
        }
        assert!(is_skipped("proj.pyc"));
        assert!(is_skipped("app.cpython-311.pyc"));
    }

    #[test]
    fn near_misses_are_kept() {
        for name in [
            "server",
            "openenv.yaml",
            "pyproject.toml",
            "builder.py",
            "distance.py",
            "targets",
            "git",
            "venv.py",
            "notes.pyc.txt",
            "app.py",
        ] {
            assert!(!is_skipped(name), "{name}");
        }
    }

    #[test]
    fn no_name_is_listed_twice() {
        let unique: BTreeSet<_> = SKIPPED_NAMES.iter().collect();
        assert_eq!(unique.len(), SKIPPED_NAMES.len());
    }
}
