//! What a run records and where it writes it: its command line, the versions of the
//! programs it measured, `bench/RESULTS.md`'s section and the JSON of every figure.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use anyhow::Context as _;
use serde::Serialize;

/// This process's command line, quoted for a POSIX shell where needed.
pub fn command_line() -> String {
    std::env::args_os()
        .map(OsString::into_string)
        .map(|arg| {
            let arg = arg.unwrap_or_else(|raw| raw.to_string_lossy().into_owned());
            let plain = !arg.is_empty()
                && arg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./=:,-+@".contains(c));
            if plain {
                arg
            } else {
                format!("'{}'", arg.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The first line `PROGRAM --version` prints (on stdout, or on stderr where stdout is
/// empty); empty where it cannot run.
pub fn version_of(program: &Path) -> String {
    Command::new(program)
        .arg("--version")
        .output()
        .map(|o| {
            let text = if o.stdout.is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// Prints a run's Markdown `section` on stdout, then writes `figures` as JSON to `json`
/// and appends `section` to `results`, each where given.
pub fn publish<T: Serialize>(
    section: &str,
    json: Option<&Path>,
    figures: impl FnOnce() -> T,
    results: Option<&Path>,
) -> anyhow::Result<()> {
    print!("{section}");
    if let Some(path) = json {
        write_json(path, &figures())?;
    }
    if let Some(path) = results {
        append_section(path, section)?;
    }
    Ok(())
}

/// Appends a Markdown section to `path` (created if missing) and says so on stderr.
pub fn append_section(path: &Path, section: &str) -> anyhow::Result<()> {
    let mut text = std::fs::read_to_string(path).unwrap_or_default();
    text.push_str(section);
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("appended the results to {}", path.display());
    Ok(())
}

/// Writes `figures` as pretty-printed JSON to `path`, creating its folder, and says so
/// on stderr.
pub fn write_json(path: &Path, figures: &impl Serialize) -> anyhow::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let text = serde_json::to_string_pretty(figures)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote every figure to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_append_and_json_ends_with_a_newline() {
        let dir = std::env::temp_dir().join(format!("bench-support-{}", std::process::id()));
        let results = dir.join("RESULTS.md");
        std::fs::create_dir_all(&dir).unwrap();
        append_section(&results, "a\n").unwrap();
        append_section(&results, "b\n").unwrap();
        assert_eq!(std::fs::read_to_string(&results).unwrap(), "a\nb\n");
        let json = dir.join("nested/figures.json");
        write_json(&json, &serde_json::json!({"x": 1})).unwrap();
        assert_eq!(
            std::fs::read_to_string(&json).unwrap(),
            "{\n  \"x\": 1\n}\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
