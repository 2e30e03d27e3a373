//! An error's chain of causes, written out.

use std::error::Error;
use std::fmt::Write as _;

/// `error` and each of its sources, `: `-separated: `reading x: permission denied`.
///
/// For errors that leave the process as text (an HTTP body, a results file, a log
/// line), where no reporter walks [`Error::source`]. Error messages here do not repeat
/// their source (the workspace's rule), so nothing prints twice.
pub fn with_causes(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        // Writing to a String cannot fail.
        let _ = write!(text, ": {c}");
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reading x")
        }
    }

    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn every_cause_once_in_order() {
        let inner = std::io::Error::other("permission denied");
        assert_eq!(with_causes(&inner), "permission denied");
        assert_eq!(with_causes(&Outer(inner)), "reading x: permission denied");
    }
}
