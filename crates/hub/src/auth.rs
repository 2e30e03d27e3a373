//! API tokens: random, shown once, stored only as their sha256 (a token has 160 bits
//! of entropy, so a fast hash is enough: there is nothing to guess).

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
}
