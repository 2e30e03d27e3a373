//! Snapshots of what successful commands print, not only their errors: a change to a
//! table, a summary line or the order of checks shows up as a snapshot diff. Ports,
//! temporary paths and the model's location are filtered out.

use agentstack_test_support::cli::{FILTERS, agentstack, snapshot};

/// `insta` settings with the CLI's run-to-run filters.
fn settings() -> insta::Settings {
    let mut settings = insta::Settings::clone_current();
    for (pattern, replacement) in FILTERS {
        settings.add_filter(pattern, replacement);
    }
    settings
}

#[test]
fn env_validate_prints_each_check_and_a_summary() {
    let out = agentstack(&["env", "validate", "connect_four"]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    settings().bind(|| insta::assert_snapshot!(snapshot(&out)));
}

#[test]
fn env_run_prints_a_table_of_episodes_and_the_mean_reward() {
    let out = agentstack(&["env", "run", "word_guess", "-n", "3", "--seed", "5"]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    settings().bind(|| insta::assert_snapshot!(snapshot(&out)));
}

#[test]
#[ignore = "needs the SmolLM2 model (scripts/fetch-model)"]
fn model_info_describes_the_test_model() {
    let model = super::test_model();
    let out = agentstack(&["model", "info", &model]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    let mut settings = settings();
    settings.add_filter(&regex_escape(&model), "[MODEL]");
    settings.bind(|| insta::assert_snapshot!(snapshot(&out)));
}

/// `text` as a regex that matches only itself.
fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$#&-~".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}
