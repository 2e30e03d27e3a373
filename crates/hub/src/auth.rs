//! API tokens: random, shown once, stored only as their sha256 (a token has 160 bits
//! of entropy, so a fast hash is enough: there is nothing to guess). A token may
//! expire ([`parse_lifetime`] reads `--expires-in`) and may be revoked; the
//! registry refuses both with 401, saying which.

use rand::RngCore;

/// Every token starts with this, so secret scanners can find leaked ones.
pub const TOKEN_PREFIX: &str = "ash_";

/// A secret token. Its `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// A new random token.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 20];
        rand::rng().fill_bytes(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(format!("{TOKEN_PREFIX}{hex}"))
    }

    /// Wraps a token read from a file, a flag or the environment.
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into().trim().to_owned())
    }

    /// The secret itself, to send or to show once.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// What the registry stores.
    pub fn hash(&self) -> String {
        hash_token(&self.0)
    }
}

/// sha256 of a token, hex.
pub fn hash_token(secret: &str) -> String {
    crate::blobs::sha256_hex(secret.as_bytes())
}

/// The longest lifetime a token may be given (ten years): beyond it, make one that
/// never expires.
pub const MAX_TOKEN_LIFETIME: std::time::Duration =
    std::time::Duration::from_secs(10 * 365 * 86_400);

/// Reads a token lifetime: a whole number and a unit, `s`, `m`, `h`, `d` or `w`
/// (`90m`, `12h`, `30d`, `2w`).
pub fn parse_lifetime(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let unit_at = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(unit_at);
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => 0,
    };
    let lifetime = number
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0 && seconds > 0)
        .and_then(|n| n.checked_mul(seconds))
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| {
            format!("'{text}' is not a lifetime: write a number and a unit, e.g. 90m, 12h, 30d, 2w")
        })?;
    if lifetime > MAX_TOKEN_LIFETIME {
        return Err(format!(
            "'{text}' is longer than ten years; leave --expires-in out for a token that never expires"
        ));
    }
    Ok(lifetime)
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_never_printed() {
        let (a, b) = (Token::generate(), Token::generate());
        assert_ne!(a, b);
        assert!(a.expose().starts_with(TOKEN_PREFIX) && a.expose().len() == 44);
        assert!(!format!("{a:?} {a}").contains(a.expose()));
        assert_eq!(a.hash().len(), 64);
        assert_ne!(a.hash(), a.expose());
    }

    #[test]
    fn token_lifetimes_parse() {
        assert_eq!(parse_lifetime("30d").unwrap().as_secs(), 30 * 86_400);
        assert_eq!(parse_lifetime("90m").unwrap().as_secs(), 5400);
        assert_eq!(parse_lifetime("2w").unwrap().as_secs(), 14 * 86_400);
        for bad in [
            "",
            "30",
            "d",
            "0d",
            "-1d",
            "1.5h",
            "3y",
            "99999999999999999w",
            "5000w",
        ] {
            assert!(parse_lifetime(bad).is_err(), "{bad}");
        }
    }
}
