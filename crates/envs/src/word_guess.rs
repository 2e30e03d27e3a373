//! `word_guess`: find a secret five-letter word in a few guesses, Wordle-style.
//!
//! The secret comes from [`crate::words::WORDS`], picked by the reset seed. Each
//! guess gets one mark per letter ([`score_guess`]): `G` for the right letter in the
//! right place, `Y` for a letter the word has elsewhere, `.` for one it lacks (or
//! has fewer times than the guess uses it). A guess that is not five letters a–z (or,
//! with `allow_unknown_words: false`, not in the word list) is not counted: the
//! message says why and the reward is 0. Solving earns 1.0 and ends the episode;
//! running out of guesses ends it with 0 and reveals the word.

use std::fmt::Write as _;

use agentstack_env::{EnvError, EnvInfo, EnvSpec, Environment, ResetArgs, Step};
use rand::seq::IndexedRandom;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::episode::{EPISODE_OVER, NO_EPISODE, bool_option, episode_rng, int_option};
use crate::words;

/// The name the environment is served under.
pub const NAME: &str = "word_guess";

/// Letters in the secret word and in every guess.
pub const WORD_LENGTH: usize = 5;

/// Guesses per episode when the reset options name no number.
pub const DEFAULT_MAX_GUESSES: u32 = 6;

/// The most guesses `max_guesses` may allow.
pub const MAX_GUESSES_LIMIT: u32 = 20;

/// Invalid guesses are quoted back at most this many characters long.
const QUOTE_LIMIT: usize = 40;

const README: &str = r#"# word_guess

Find the secret five-letter English word, Wordle-style. The word is chosen from a
built-in list of common words by the reset seed.

## Reset options

- `max_guesses` (integer 1–20, default 6): guesses per episode.
- `allow_unknown_words` (bool, default true): when false, a guess must be in the word
  list to count.

## Action

```json
{"guess": "crane"}
```

Five letters a–z, any case; surrounding spaces are ignored. A guess of another length,
with other characters, or (with `allow_unknown_words: false`) not in the list is not
counted: the message says why, the reward is 0, and no guess is used up.

## Observation

```json
{
  "feedback": ".Y..G",
  "history": [{"guess": "crane", "feedback": ".Y..G"}],
  "guesses_left": 5,
  "message": "crane: .Y..G. 5 guesses left."
}
```

`feedback` has one mark per letter of the last counted guess: `G` the right letter in
the right place, `Y` a letter the word has elsewhere, `.` a letter it does not have. A
letter guessed more times than the word has it is marked `Y`/`G` only as many times as
the word has it (greens first). `feedback` is `null` after a reset or an uncounted
guess.

## Reward

1.0 when the word is found, 0.0 otherwise. The episode ends when the word is found or
no guesses are left; the message (and `metadata.secret`) then reveals the word.
"#;

/// Word guess's action.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WordGuessAction {
    /// A five-letter word, letters a-z in any case.
    pub guess: String,
}

/// One counted guess and its marks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct GuessFeedback {
    /// The guess, lowercase.
    pub guess: String,
    /// One mark per letter: `G` right place, `Y` elsewhere in the word, `.` not in it.
    pub feedback: String,
}

/// Word guess's observation.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct WordGuessObservation {
    /// Marks for this step's guess, one per letter: `G` right letter in the right
    /// place, `Y` in the word elsewhere, `.` not in the word; `null` after a reset or
    /// a guess that was not counted.
    pub feedback: Option<String>,
    /// Every counted guess of the episode with its marks, oldest first.
    pub history: Vec<GuessFeedback>,
    /// Guesses left in the episode.
    pub guesses_left: u32,
    /// What happened, in words; says why a guess was not counted.
    pub message: String,
}

/// Word guess's own state fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
pub struct WordGuessState {
    /// The episode's seed (drawn at random when reset gave none); `null` before the
    /// first reset.
    pub seed: Option<u64>,
    /// Guesses allowed in the episode.
    pub max_guesses: u32,
    /// Guesses counted so far.
    pub guesses_used: u32,
    /// Whether the word was found.
    pub solved: bool,
    /// Whether the episode is over.
    pub done: bool,
    /// The secret word, shown once the episode is over.
    pub secret: Option<String>,
}

/// The marks for `guess` against `secret`: per letter `G` (same letter, same place),
/// `Y` (the secret has the letter in another place) or `.`. A letter repeated in the
/// guess is marked `G`/`Y` at most as many times as the secret has it, greens first,
/// then yellows from left to right, as Wordle does. Both words should be the same
/// length; extra letters of the longer one are ignored.
///
/// ```
/// use agentstack_envs::word_guess::score_guess;
///
/// assert_eq!(score_guess("apple", "paper"), "YYGY.");
/// assert_eq!(score_guess("abbey", "bobby"), "Y.G.G");
/// ```
pub fn score_guess(secret: &str, guess: &str) -> String {
    let (secret, guess) = (secret.as_bytes(), guess.as_bytes());
    let len = secret.len().min(guess.len());
    let mut marks = vec![b'.'; len];
    // Letters of the secret not matched by a green, still free to make a yellow.
    let mut unmatched = [0_u8; 256];
    for i in 0..len {
        if guess[i] == secret[i] {
            marks[i] = b'G';
        } else {
            unmatched[usize::from(secret[i])] += 1;
        }
    }
    for i in 0..len {
        let free = &mut unmatched[usize::from(guess[i])];
        if marks[i] != b'G' && *free > 0 {
            marks[i] = b'Y';
            *free -= 1;
        }
    }
    marks.into_iter().map(char::from).collect()
}

/// `text` in quotes, cut short if long.
fn quote(text: &str) -> String {
    let mut quoted: String = text.chars().take(QUOTE_LIMIT).collect();
    if text.chars().count() > QUOTE_LIMIT {
        quoted.push('…');
    }
    format!("\"{quoted}\"")
}

/// `n` and the noun in the right number: "1 guess", "2 guesses".
fn counted(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn guesses(n: u32) -> String {
    counted(n as usize, "guess", "guesses")
}

#[derive(Debug, Clone)]
struct Episode {
    seed: u64,
    secret: &'static str,
    max_guesses: u32,
    allow_unknown_words: bool,
    history: Vec<GuessFeedback>,
    solved: bool,
}

impl Episode {
    fn guesses_left(&self) -> u32 {
        self.max_guesses - self.history.len() as u32
    }

    fn done(&self) -> bool {
        self.solved || self.guesses_left() == 0
    }

    /// The guess, lowercased, or why it does not count.
    fn check(&self, raw: &str) -> Result<String, String> {
        let guess = raw.trim().to_ascii_lowercase();
        if !guess.chars().all(|c| c.is_ascii_lowercase()) {
            return Err(format!(
                "{} is not a valid guess: use only the letters a-z",
                quote(raw)
            ));
        }
        if guess.len() != WORD_LENGTH {
            return Err(format!(
                "{} is not a valid guess: it has {}, and guesses must have exactly \
                 {WORD_LENGTH}",
                quote(&guess),
                counted(guess.len(), "letter", "letters")
            ));
        }
        if !self.allow_unknown_words && !words::contains(&guess) {
            return Err(format!(
                "{} is not a valid guess: it is not in the word list",
                quote(&guess)
            ));
        }
        Ok(guess)
    }

    fn observation(&self, feedback: Option<String>, message: String) -> WordGuessObservation {
        WordGuessObservation {
            feedback,
            history: self.history.clone(),
            guesses_left: self.guesses_left(),
            message,
        }
    }
}

/// The word guessing environment.
#[derive(Debug, Clone, Default)]
pub struct WordGuessEnv {
    episode: Option<Episode>,
}

impl WordGuessEnv {
    /// A fresh environment; `reset` starts the first episode.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The spec that serves [`WordGuessEnv`].
pub fn spec() -> EnvSpec {
    EnvSpec::new(WordGuessEnv::new)
}

impl Environment for WordGuessEnv {
    type Action = WordGuessAction;
    type Observation = WordGuessObservation;
    type State = WordGuessState;

    fn info(&self) -> EnvInfo {
        EnvInfo {
            readme: Some(README.to_owned()),
            ..EnvInfo::new(
                NAME,
                "Find a secret five-letter word from per-letter feedback, Wordle-style",
            )
        }
    }

    async fn reset(&mut self, args: ResetArgs) -> Result<Step<WordGuessObservation>, EnvError> {
        let max_guesses = int_option(
            &args.options,
            "max_guesses",
            u64::from(DEFAULT_MAX_GUESSES),
            1..=u64::from(MAX_GUESSES_LIMIT),
        )?;
        let max_guesses = u32::try_from(max_guesses).expect("checked to be at most 20");
        let allow_unknown_words = bool_option(&args.options, "allow_unknown_words", true)?;
        let (seed, mut rng) = episode_rng(args.seed);
        let secret = words::WORDS
            .choose(&mut rng)
            .expect("the word list is not empty");
        let episode = Episode {
            seed,
            secret,
            max_guesses,
            allow_unknown_words,
            history: Vec::new(),
            solved: false,
        };
        let message = format!(
            "Guess the secret {WORD_LENGTH}-letter word in {}. Each guess is marked letter \
             by letter: G = right letter in the right place, Y = in the word but elsewhere, \
             . = not in the word.",
            guesses(max_guesses)
        );
        let observation = episode.observation(None, message);
        self.episode = Some(episode);
        Ok(Step::new(observation).with_reward(0.0))
    }

    async fn step(
        &mut self,
        action: WordGuessAction,
    ) -> Result<Step<WordGuessObservation>, EnvError> {
        let episode = self
            .episode
            .as_mut()
            .ok_or_else(|| EnvError::new(NO_EPISODE))?;
        if episode.done() {
            return Err(EnvError::new(EPISODE_OVER));
        }
        let guess = match episode.check(&action.guess) {
            Ok(guess) => guess,
            Err(why) => {
                let left = guesses(episode.guesses_left());
                let message = format!("{why}. Not counted; {left} left.");
                return Ok(Step::new(episode.observation(None, message))
                    .with_reward(0.0)
                    .with_metadata("invalid_guess", true));
            }
        };
        let feedback = score_guess(episode.secret, &guess);
        episode.solved = guess == episode.secret;
        episode.history.push(GuessFeedback {
            guess: guess.clone(),
            feedback: feedback.clone(),
        });
        let mut message = format!("{guess}: {feedback}.");
        if episode.solved {
            let used = guesses(episode.history.len() as u32);
            let _ = write!(message, " Solved in {used}!");
        } else if episode.done() {
            let _ = write!(
                message,
                " Out of guesses; the word was \"{}\".",
                episode.secret
            );
        } else {
            let _ = write!(message, " {} left.", guesses(episode.guesses_left()));
        }
        let done = episode.done();
        let mut step = Step::new(episode.observation(Some(feedback), message))
            .with_reward(if episode.solved { 1.0 } else { 0.0 })
            .with_done(done);
        if done {
            step = step.with_metadata("secret", episode.secret);
        }
        Ok(step)
    }

    fn state(&self) -> WordGuessState {
        match &self.episode {
            None => WordGuessState::default(),
            Some(episode) => WordGuessState {
                seed: Some(episode.seed),
                max_guesses: episode.max_guesses,
                guesses_used: episode.history.len() as u32,
                solved: episode.solved,
                done: episode.done(),
                secret: episode.done().then(|| episode.secret.to_owned()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use agentstack_protocol::http::ResetRequest;
    use serde_json::value::RawValue;
    use serde_json::{Value, json};

    use super::*;

    use crate::episode::test_reset_args as reset_args;

    fn guess(word: &str) -> WordGuessAction {
        WordGuessAction { guess: word.into() }
    }

    fn secret(env: &WordGuessEnv) -> &'static str {
        env.episode.as_ref().unwrap().secret
    }

    #[test]
    fn marks_letters_like_wordle() {
        let cases = [
            ("crane", "crane", "GGGGG"),
            ("crane", "plumb", "....."),
            ("crane", "nacre", "YYYYG"),
            // One `p` is green, the other yellow; `a` and `e` elsewhere.
            ("apple", "paper", "YYGY."),
            // Three `b`s guessed, the word has two: the green and one yellow count.
            ("abbey", "bobby", "Y.G.G"),
            // The word's only `e` is green, so the other two `e`s get nothing.
            ("crane", "eerie", "..Y.G"),
            // Two greens use up both `o`s.
            ("spoon", "ooooo", "..GG."),
            // A yellow goes to the leftmost extra copy only.
            ("alert", "eerie", "Y.Y.."),
            ("lever", "eerie", "YGY.."),
        ];
        for (secret, guess, expected) in cases {
            assert_eq!(
                score_guess(secret, guess),
                expected,
                "{guess} against {secret}"
            );
        }
    }

    #[tokio::test]
    async fn same_seed_same_secret() {
        let mut a = WordGuessEnv::new();
        let mut b = WordGuessEnv::new();
        a.reset(reset_args(17, json!({}))).await.unwrap();
        b.reset(reset_args(17, json!({}))).await.unwrap();
        assert_eq!(secret(&a), secret(&b));
        let secrets: std::collections::HashSet<_> = (0..20)
            .map(|seed| {
                let (_, mut rng) = episode_rng(Some(seed));
                *words::WORDS.choose(&mut rng).unwrap()
            })
            .collect();
        assert!(secrets.len() > 10, "seeds should spread over the list");
    }

    #[tokio::test]
    async fn solving_scores_one_and_ends() {
        let mut env = WordGuessEnv::new();
        let reset = env.reset(reset_args(3, json!({}))).await.unwrap();
        assert_eq!(reset.observation.guesses_left, DEFAULT_MAX_GUESSES);
        assert_eq!(reset.observation.feedback, None);
        let word = secret(&env);

        let miss = env.step(guess("zzzzz")).await.unwrap();
        assert_eq!(miss.reward, Some(0.0));
        assert!(!miss.done);
        assert_eq!(miss.observation.feedback.as_deref(), Some("....."));
        assert_eq!(miss.observation.guesses_left, DEFAULT_MAX_GUESSES - 1);

        let hit = env
            .step(guess(&format!("  {}  ", word.to_uppercase())))
            .await
            .unwrap();
        assert_eq!(hit.reward, Some(1.0));
        assert!(hit.done);
        assert_eq!(hit.observation.feedback.as_deref(), Some("GGGGG"));
        assert!(hit.observation.message.contains("Solved in 2 guesses"));
        assert_eq!(hit.observation.history.len(), 2);
        assert_eq!(hit.observation.history[1].guess, word);
        assert_eq!(hit.metadata["secret"], word);
        let state = env.state();
        assert!(state.solved && state.done);
        assert_eq!(state.secret.as_deref(), Some(word));
        assert_eq!(
            env.step(guess(word)).await.unwrap_err().message,
            EPISODE_OVER
        );
    }

    #[tokio::test]
    async fn running_out_reveals_the_word() {
        let mut env = WordGuessEnv::new();
        env.reset(reset_args(8, json!({"max_guesses": 2})))
            .await
            .unwrap();
        assert_eq!(env.state().secret, None);
        let word = secret(&env);
        let first = env.step(guess("zzzzz")).await.unwrap();
        assert!(first.observation.message.ends_with("1 guess left."));
        let last = env.step(guess("qqqqq")).await.unwrap();
        assert!(last.done);
        assert_eq!(last.reward, Some(0.0));
        assert_eq!(last.observation.guesses_left, 0);
        assert!(
            last.observation
                .message
                .contains(&format!("the word was \"{word}\"")),
            "{}",
            last.observation.message
        );
    }

    #[tokio::test]
    async fn invalid_guesses_are_not_counted() {
        let mut env = WordGuessEnv::new();
        env.reset(reset_args(1, json!({"allow_unknown_words": false})))
            .await
            .unwrap();
        let cases = [
            ("abc", "it has 3 letters"),
            ("abcdef", "it has 6 letters"),
            ("", "it has 0 letters"),
            ("ab3de", "only the letters a-z"),
            ("héllo", "only the letters a-z"),
            ("zzzzz", "not in the word list"),
        ];
        for (text, why) in cases {
            let step = env.step(guess(text)).await.unwrap();
            let message = &step.observation.message;
            assert!(message.contains(why), "{text:?}: {message}");
            assert!(
                message.contains("Not counted; 6 guesses left."),
                "{message}"
            );
            assert_eq!(step.reward, Some(0.0));
            assert!(!step.done);
            assert_eq!(step.observation.feedback, None);
            assert_eq!(step.metadata["invalid_guess"], true);
        }
        assert_eq!(env.state().guesses_used, 0);
        let long = env.step(guess(&"x".repeat(1000))).await.unwrap();
        assert!(long.observation.message.len() < 200);
        // A listed word counts.
        let listed = env.step(guess("about")).await.unwrap();
        assert_eq!(listed.observation.guesses_left, DEFAULT_MAX_GUESSES - 1);
    }

    #[tokio::test]
    async fn bad_options_are_errors() {
        let mut env = WordGuessEnv::new();
        assert_eq!(
            env.step(guess("about")).await.unwrap_err().message,
            NO_EPISODE
        );
        let err = env
            .reset(reset_args(0, json!({"max_guesses": 0})))
            .await
            .unwrap_err();
        assert!(err.message.contains("from 1 to 20"), "{err}");
        let err = env
            .reset(reset_args(0, json!({"allow_unknown_words": 1})))
            .await
            .unwrap_err();
        assert!(err.message.contains("`allow_unknown_words`"), "{err}");
    }

    #[tokio::test]
    async fn wire_form_through_spec() {
        let spec = spec();
        assert_eq!(spec.name(), NAME);
        let mut env = spec.instantiate().unwrap();
        let request = ResetRequest {
            seed: Some(2),
            ..ResetRequest::default()
        };
        let reset = env.reset(request).await.unwrap();
        let obs: Value = serde_json::from_str(reset.observation.get()).unwrap();
        assert_eq!(obs["guesses_left"], 6);
        assert_eq!(obs["history"], json!([]));
        assert_eq!(obs["feedback"], Value::Null);

        let action = RawValue::from_string(r#"{"guess":"zzzzz"}"#.into()).unwrap();
        let step = env.step(&action).await.unwrap();
        let obs: Value = serde_json::from_str(step.observation.get()).unwrap();
        assert_eq!(
            obs["history"],
            json!([{"guess": "zzzzz", "feedback": "....."}])
        );
        assert_eq!(env.state().unwrap()["guesses_used"], 1);
    }
}
