//! The registry's JSON API, version 1: request and response bodies, names and
//! references. Plain data, shared by the server and the client; no I/O.
//!
//! Routes (all under `/api/v1`):
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/health` | liveness |
//! | GET | `/whoami` | the token's user |
//! | GET | `/envs?q=&sort=&limit=&offset=` | search ([`SearchResponse`]) |
//! | GET | `/envs/{owner}/{name}` | a package ([`PackageInfo`]) |
//! | PUT | `/envs/{owner}/{name}/versions/{version}?private=` | push a packed package (body: `.tar.gz`) |
//! | GET | `/envs/{owner}/{name}/versions/{ref}` | one version ([`VersionInfo`]) |
//! | GET | `/envs/{owner}/{name}/versions/{ref}/package` | its bytes (header `x-agentstack-sha256`) |
//! | PUT | `/envs/{owner}/{name}/tags/{tag}` | move a tag ([`TagRequest`]) |
//! | POST | `/envs/{owner}/{name}/fork` | fork ([`ForkRequest`]) |
//! | GET/POST | `/envs/{owner}/{name}/versions/{ref}/leaderboard` | results ([`LeaderboardPost`]) |
//! | GET | `/tokens` | the caller's tokens ([`TokenList`]) |
//! | DELETE | `/tokens/current` | revoke the token of this request ([`RevokedToken`]) |
//! | DELETE | `/tokens/{id}` | revoke one of the caller's tokens ([`RevokedToken`]) |
//!
//! A push is authorized from its headers before its body is read; `private=true`
//! creates a private package, and a push never changes an existing package's
//! visibility (`private=true` on a public package, or `private=false` on a private
//! one, is 409; without `private` the package's visibility is kept).
//!
//! Errors are `{"error": {"code": "...", "message": "..."}}` with the HTTP status;
//! 429 and 503 carry `Retry-After` (seconds).

use serde::{Deserialize, Serialize};

/// The header that carries a package's sha256 on download.
pub const SHA256_HEADER: &str = "x-agentstack-sha256";
/// The header that carries the resolved version on download.
pub const VERSION_HEADER: &str = "x-agentstack-version";
/// The tag that follows the highest released version.
pub const LATEST: &str = "latest";

/// The longest owner or package name.
pub const MAX_NAME_LEN: usize = 64;

/// Checks an owner or package name: lowercase ASCII letters, digits, `_`, `-`, `.`;
/// starts with a letter or digit; at most [`MAX_NAME_LEN`] characters.
pub fn check_name(kind: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "'{name}' is not a valid {kind} name: use lowercase letters, digits, '_', '-', '.', starting with a letter or digit, at most {MAX_NAME_LEN} characters"
        ))
    }
}

/// Turns a free-form name (an `openenv.yaml` name such as `My Env`) into a valid
/// package name (`my_env`), or `None` when nothing usable is left.
pub fn normalize_name(name: &str) -> Option<String> {
    let mut out = String::new();
    for c in name.trim().chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() || "_-.".contains(c) {
            out.push(c);
        } else if !out.ends_with('_') {
            out.push('_');
        }
    }
    let out = out.trim_matches(|c| "_-.".contains(c)).to_owned();
    let out: String = out.chars().take(MAX_NAME_LEN).collect();
    check_name("package", &out).ok().map(|()| out)
}

/// `owner/name[@ref]`: what users type to name a package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageRef {
    /// The namespace (a user).
    pub owner: String,
    /// The package.
    pub name: String,
    /// A version or a tag; `None` means `latest`.
    pub reference: Option<String>,
}

impl PackageRef {
    /// Parses `owner/name[@version|@tag]` (a leading `hub:` is accepted).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.strip_prefix("hub:").unwrap_or(text);
        let (path, reference) = match text.split_once('@') {
            Some((path, r)) if !r.is_empty() => (path, Some(r.to_owned())),
            Some(_) => {
                return Err(format!(
                    "'{text}': nothing after '@' (write owner/name@1.0.0 or owner/name@latest)"
                ));
            }
            None => (text, None),
        };
        let Some((owner, name)) = path.split_once('/') else {
            return Err(format!("'{text}' is not owner/name[@version]"));
        };
        check_name("owner", owner)?;
        check_name("package", name)?;
        if let Some(r) = &reference {
            check_reference(r)?;
        }
        Ok(Self {
            owner: owner.to_owned(),
            name: name.to_owned(),
            reference,
        })
    }

    /// The reference to resolve: the given one or `latest`.
    pub fn reference(&self) -> &str {
        self.reference.as_deref().unwrap_or(LATEST)
    }
}

impl std::fmt::Display for PackageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.owner, self.name)?;
        if let Some(r) = &self.reference {
            write!(f, "@{r}")?;
        }
        Ok(())
    }
}

/// Checks a version or tag as it appears in a path.
pub fn check_reference(reference: &str) -> Result<(), String> {
    if reference.is_empty()
        || reference.len() > 128
        || !reference
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
    {
        return Err(format!(
            "'{reference}' is not a version or tag: use a semantic version (1.2.0) or a tag of letters, digits, '.', '_', '-', '+'"
        ));
    }
    Ok(())
}

/// Parses a version: semantic versioning, so versions order and `latest` can follow.
pub fn parse_version(version: &str) -> Result<semver::Version, String> {
    semver::Version::parse(version).map_err(|e| {
        format!("'{version}' is not a semantic version ({e}); write MAJOR.MINOR.PATCH, e.g. 1.0.0")
    })
}

/// An error body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A stable code: `bad_request`, `unauthorized`, `forbidden`, `not_found`,
    /// `conflict`, `too_large`, `timed_out`, `invalid_package`, `rate_limited`,
    /// `busy`, `internal`.
    pub code: String,
    /// What was wrong and how to fix it.
    pub message: String,
}

/// `GET /whoami`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WhoAmI {
    /// The user the token belongs to.
    pub user: String,
}

/// A pushed version, as returned by a push.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PushResponse {
    /// `owner/name`.
    pub package: String,
    /// The version.
    pub version: String,
    /// sha256 of the packed bytes.
    pub sha256: String,
    /// Packed size in bytes.
    pub size: u64,
    /// Whether the package is private (a push keeps an existing package's
    /// visibility).
    #[serde(default)]
    pub private: bool,
    /// The validation status right after the push (`pending` while it runs).
    pub validation: String,
}

/// How a version's validation went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Validation {
    /// `pending`, `passed`, `failed` or `skipped`.
    pub status: String,
    /// Each check.
    pub checks: Vec<ValidationCheck>,
}

/// One validation check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationCheck {
    /// Its name (`manifest`, `unpack`, `conformance`, `lift`, ...).
    pub name: String,
    /// `passed`, `failed` or `skipped`.
    pub status: String,
    /// Details.
    pub message: String,
}

/// One version of a package.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VersionInfo {
    /// The version.
    pub version: String,
    /// sha256 of the packed bytes.
    pub sha256: String,
    /// Packed size in bytes.
    pub size: u64,
    /// Number of files.
    pub files: u64,
    /// Who pushed it.
    pub pushed_by: String,
    /// When, Unix seconds.
    pub created_at: i64,
    /// Tags pointing at it.
    pub tags: Vec<String>,
    /// Validation on push.
    pub validation: Validation,
}

/// Where a fork came from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Parent {
    /// `owner/name`.
    pub package: String,
    /// The version forked.
    pub version: String,
}

/// `GET /envs/{owner}/{name}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PackageInfo {
    /// Namespace.
    pub owner: String,
    /// Name.
    pub name: String,
    /// From `openenv.yaml`.
    pub description: String,
    /// From `openenv.yaml` `tags`.
    pub tags: Vec<String>,
    /// README.md of the latest version.
    pub readme: String,
    /// Only the owner sees it.
    pub private: bool,
    /// Downloads of every version.
    pub downloads: u64,
    /// What it was forked from.
    pub parent: Option<Parent>,
    /// Forks of it (`owner/name`).
    pub forks: Vec<String>,
    /// Newest first.
    pub versions: Vec<VersionInfo>,
    /// Tag → version.
    pub dist_tags: std::collections::BTreeMap<String, String>,
}

/// One search hit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SearchHit {
    /// Namespace.
    pub owner: String,
    /// Name.
    pub name: String,
    /// Description.
    pub description: String,
    /// Tags.
    pub tags: Vec<String>,
    /// The `latest` version, if any.
    pub latest: Option<String>,
    /// Downloads.
    pub downloads: u64,
    /// The best leaderboard score on any version, if any.
    pub best_score: Option<f64>,
}

/// How to order search results.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SearchSort {
    /// Best text match first (newest first without a query).
    #[default]
    Relevance,
    /// Most downloaded first.
    Downloads,
    /// Best leaderboard score first.
    Score,
}

/// `GET /envs` query.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SearchQuery {
    /// Words to look for (every word must match, as a prefix).
    #[serde(default)]
    pub q: String,
    /// Order.
    #[serde(default)]
    pub sort: SearchSort,
    /// At most this many (default 20, at most 100).
    #[serde(default)]
    pub limit: Option<u32>,
    /// Skip this many.
    #[serde(default)]
    pub offset: Option<u32>,
}

/// `GET /envs` response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SearchResponse {
    /// The hits.
    pub results: Vec<SearchHit>,
}

/// `PUT /envs/{owner}/{name}/tags/{tag}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagRequest {
    /// The version the tag should point at.
    pub version: String,
}

/// `POST /envs/{owner}/{name}/fork`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The new package's name in the caller's namespace (default: the same name).
    #[serde(default)]
    pub name: Option<String>,
    /// The version to fork (default: `latest`).
    #[serde(default)]
    pub version: Option<String>,
}

/// `POST .../leaderboard`: one evaluation's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaderboardPost {
    /// The model evaluated (a name, file or URL).
    pub model: String,
    /// The mean score.
    pub score: f64,
    /// The 95% confidence interval of the score, `[low, high]`.
    pub ci95: [f64; 2],
    /// Episodes run.
    pub episodes: u64,
    /// A hash of the harness configuration (prompt profile, context policy, sampling),
    /// so results made the same way can be told apart from the rest.
    pub harness: String,
    /// Anything else worth keeping (the run's summary).
    #[serde(default)]
    pub details: serde_json::Value,
}

/// Whether `c` may not appear in text a leaderboard shows: C0 and C1 control
/// characters (tab and newline included), DEL, and the bidirectional overrides and
/// isolates that reorder what a terminal or a page displays.
pub fn is_forbidden_char(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every [`is_forbidden_char`] written as `\u{..}`, so stored text cannot
/// drive a terminal when it is printed.
pub fn escape_forbidden(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(is_forbidden_char) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if is_forbidden_char(c) {
                format!("\\u{{{:x}}}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// Refuses a text field holding an [`is_forbidden_char`], naming the field and the
/// character.
fn check_text(field: &str, text: &str) -> Result<(), String> {
    match text.chars().find(|c| is_forbidden_char(*c)) {
        Some(c) => Err(format!(
            "{field} holds the control character U+{:04X}; control characters and bidirectional overrides are not allowed in leaderboard posts",
            u32::from(c)
        )),
        None => Ok(()),
    }
}

/// Checks every string (keys included) of a `details` value.
fn check_details(path: &mut String, value: &serde_json::Value) -> Result<(), String> {
    match value {
        serde_json::Value::String(text) => check_text(path, text),
        serde_json::Value::Array(items) => items.iter().enumerate().try_for_each(|(i, item)| {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            let result = check_details(path, item);
            path.truncate(len);
            result
        }),
        serde_json::Value::Object(map) => map.iter().try_for_each(|(key, item)| {
            check_text(&format!("a key of {path}"), key)?;
            let len = path.len();
            path.push('.');
            path.push_str(&escape_forbidden(key));
            let result = check_details(path, item);
            path.truncate(len);
            result
        }),
        _ => Ok(()),
    }
}

impl LeaderboardPost {
    /// Checks the numbers, sizes and text (no control characters).
    pub fn check(&self) -> Result<(), String> {
        let [low, high] = self.ci95;
        if !(self.score.is_finite() && low.is_finite() && high.is_finite()) {
            return Err("score and ci95 must be finite numbers".into());
        }
        if !(low <= self.score && self.score <= high) {
            return Err(format!(
                "ci95 [{low}, {high}] must contain the score {}",
                self.score
            ));
        }
        if self.episodes == 0 {
            return Err("episodes must be at least 1".into());
        }
        if self.model.trim().is_empty() || self.model.len() > 512 {
            return Err("model must be 1 to 512 characters".into());
        }
        if self.harness.len() > 256 {
            return Err("harness must be at most 256 characters".into());
        }
        check_text("model", &self.model)?;
        check_text("harness", &self.harness)?;
        check_details(&mut "details".to_owned(), &self.details)
    }

    /// Checks that the score and its interval lie within the package's declared
    /// reward range, `[low, high]`.
    pub fn check_range(&self, range: [f64; 2]) -> Result<(), String> {
        let [low, high] = range;
        let inside = |x: f64| low <= x && x <= high;
        if !(inside(self.score) && inside(self.ci95[0]) && inside(self.ci95[1])) {
            return Err(format!(
                "score {} and ci95 [{}, {}] must lie within the package's reward_range [{low}, {high}] (openenv.yaml, agentstack.reward_range)",
                self.score, self.ci95[0], self.ci95[1]
            ));
        }
        Ok(())
    }
}

/// One API token (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenInfo {
    /// Its id (what revoking takes).
    pub id: i64,
    /// What it is for.
    pub label: String,
    /// When it was made, Unix seconds.
    pub created_at: i64,
    /// When it stops working, Unix seconds; `None`: never.
    pub expires_at: Option<i64>,
    /// When it was revoked, Unix seconds.
    pub revoked_at: Option<i64>,
    /// Whether it is the token of the request that listed it.
    #[serde(default)]
    pub current: bool,
}

/// `GET /tokens`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenList {
    /// Their user.
    pub user: String,
    /// Oldest first.
    pub tokens: Vec<TokenInfo>,
}

/// `DELETE /tokens/...`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevokedToken {
    /// The revoked token's id.
    pub id: i64,
}

/// One leaderboard row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaderboardEntry {
    /// Rank, from 1.
    pub rank: u32,
    /// Who posted it.
    pub user: String,
    /// The version it was posted to.
    pub version: String,
    /// What was posted.
    #[serde(flatten)]
    pub post: LeaderboardPost,
    /// When, Unix seconds.
    pub created_at: i64,
}

/// `GET .../leaderboard`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Leaderboard {
    /// `owner/name`.
    pub package: String,
    /// The version.
    pub version: String,
    /// Best score first.
    pub entries: Vec<LeaderboardEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_references_parse_with_clear_errors() {
        let r = PackageRef::parse("hub:alice/echo@1.2.0").unwrap();
        assert_eq!((r.owner.as_str(), r.name.as_str()), ("alice", "echo"));
        assert_eq!(r.reference(), "1.2.0");
        assert_eq!(PackageRef::parse("alice/echo").unwrap().reference(), LATEST);
        for bad in [
            "echo",
            "Alice/echo",
            "alice/../x",
            "alice/echo@",
            "a/b@x y",
            "/echo",
        ] {
            assert!(PackageRef::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(normalize_name("My Env!").as_deref(), Some("my_env"));
        assert_eq!(normalize_name("???"), None);
        assert!(
            parse_version("1.0")
                .unwrap_err()
                .contains("MAJOR.MINOR.PATCH")
        );
    }

    #[test]
    fn leaderboard_posts_are_checked() {
        let mut post = LeaderboardPost {
            model: "m".into(),
            score: 0.5,
            ci95: [0.4, 0.6],
            episodes: 20,
            harness: "h".into(),
            details: serde_json::Value::Null,
        };
        assert!(post.check().is_ok());
        post.ci95 = [0.6, 0.7];
        assert!(post.check().unwrap_err().contains("contain"));
        post.ci95 = [0.4, f64::NAN];
        assert!(post.check().is_err());
    }

    #[test]
    fn leaderboard_posts_with_control_characters_or_out_of_range_are_refused() {
        let post = LeaderboardPost {
            model: "m".into(),
            score: 0.5,
            ci95: [0.4, 0.6],
            episodes: 20,
            harness: "h".into(),
            details: serde_json::json!({"seed": 1, "notes": ["fine"]}),
        };
        assert!(post.check().is_ok());
        for (field, bad) in [
            ("model", "gpt\u{1b}[2J"),
            ("model", "a\u{202E}gnp.exe"),
            ("harness", "x\u{9b}31m"),
            ("harness", "tab\there"),
            ("details", "\u{2066}isolated"),
        ] {
            let mut p = post.clone();
            match field {
                "model" => p.model = bad.into(),
                "harness" => p.harness = bad.into(),
                _ => p.details = serde_json::json!({"notes": [bad]}),
            }
            let err = p.check().unwrap_err();
            assert!(
                err.contains(field) && err.contains("control character"),
                "{err}"
            );
        }
        let mut p = post.clone();
        p.details = serde_json::json!({"k\u{7}": 1});
        assert!(p.check().unwrap_err().contains("a key of details"));
        assert!(post.check_range([0.0, 1.0]).is_ok());
        let err = post.check_range([0.0, 0.55]).unwrap_err();
        assert!(err.contains("reward_range [0, 0.55]"), "{err}");
        assert_eq!(escape_forbidden("ok"), "ok");
        assert_eq!(
            escape_forbidden("a\u{1b}[2J\u{202e}"),
            "a\\u{1b}[2J\\u{202e}"
        );
    }
}
