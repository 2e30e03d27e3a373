//! `arithmetic`: solve a generated arithmetic problem and answer with an integer.
//!
//! Problems come from the reset seed at five difficulty levels (reset option
//! `difficulty`, default 1):
//!
//! 1. one addition or subtraction of small numbers;
//! 2. one multiplication or division, always coming out even;
//! 3. two operations where precedence or parentheses matter;
//! 4. three or four operations with negative numbers;
//! 5. short word problems of two or three steps.
//!
//! The agent answers in free text; [`parse_answer`] finds the final integer in it the
//! way graders of math benchmarks do (`\boxed{..}`, "the answer is ..", `####`, else
//! the last number). A correct answer earns 1.0 and ends the episode; one attempt is
//! allowed unless the reset option `max_attempts` says otherwise.
//!
//! The task list ([`ArithmeticTasks`]) has a `train` and a `test` split whose tasks
//! are reset arguments (`{"seed": .., "difficulty": ..}`) with disjoint seeds.

use std::fmt::Write as _;
use std::sync::Arc;

use agentstack_env::{
    EnvError, EnvInfo, EnvSpec, Environment, ResetArgs, Step, TaskError, TaskSource,
};
use agentstack_protocol::tasks::{Split, SplitType};
use rand::Rng;
use rand::seq::{IndexedRandom, SliceRandom};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::episode::{EPISODE_OVER, NO_EPISODE, episode_rng, int_option};

/// The name the environment is served under.
pub const NAME: &str = "arithmetic";

/// The easiest difficulty level.
pub const MIN_DIFFICULTY: u8 = 1;

/// The hardest difficulty level.
pub const MAX_DIFFICULTY: u8 = 5;

/// The most attempts `max_attempts` may allow.
pub const MAX_ATTEMPTS_LIMIT: u32 = 100;

/// Tasks in the `train` split.
pub const TRAIN_TASKS: usize = 1000;

/// Tasks in the `test` split.
pub const TEST_TASKS: usize = 200;

/// Seeds of `test` tasks start here, far above any `train` seed.
const TEST_SEED_BASE: u64 = 1 << 32;

/// Level 4 redraws expressions whose value is larger than this, to keep answers
/// checkable by hand.
const LEVEL4_MAX_MAGNITUDE: i64 = 2000;

const README: &str = r#"# arithmetic

Solve one arithmetic problem, generated from the reset seed, and answer with an integer.

## Reset options

- `difficulty` (integer 1–5, default 1):
  1. one addition or subtraction of small numbers (`What is 14 + 7?`);
  2. one multiplication or division that comes out even (`What is 72 / 8?`);
  3. two operations where precedence or parentheses matter (`What is 3 + 4 * 5?`);
  4. three or four operations with negative numbers (`What is (-6) * 3 - 12 / (-4)?`);
  5. a short word problem of two or three steps.
- `max_attempts` (integer 1–100, default 1): answers allowed per episode.

The same seed and difficulty always give the same problem.

## Action

```json
{"answer": "7 * 6 is 42, so the answer is 42."}
```

The final integer is read from free text: a `\boxed{..}` wins, then the number after the
last "answer is" / "answer:", then after `####`, else the last number in the text.
Commas between thousands and a `.0` ending are accepted (`1,234`, `42.0`); a number
with a fractional part (`42.5`) counts as no answer.

## Observation

```json
{"problem": "What is 6 * 7?", "difficulty": 2, "feedback": null, "attempts_left": 1}
```

`feedback` says whether the last answer was right, which number was read from it, and,
once the episode is over, the correct answer. `metadata.parsed_answer` holds the number
read (or `null`); `metadata.expected_answer` is present once the episode is over.

## Reward

1.0 for the correct integer, otherwise 0.0. The episode ends on a correct answer or when
no attempts are left.

## Tasks

Splits `train` (1000 tasks) and `test` (200 tasks). Each task is a reset body,
`{"seed": .., "difficulty": ..}`, cycling through difficulties 1–5; the seeds of the two
splits are disjoint.
"#;

/// Arithmetic's action.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ArithmeticAction {
    /// The answer, free text ending in an integer, e.g. "The answer is 42." or
    /// "\\boxed{42}".
    pub answer: String,
}

/// Arithmetic's observation.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct ArithmeticObservation {
    /// The problem to solve.
    pub problem: String,
    /// Its difficulty, from 1 (easiest) to 5.
    pub difficulty: u8,
    /// What was wrong or right with the last answer; `null` after a reset.
    pub feedback: Option<String>,
    /// Answers the agent may still give in this episode.
    pub attempts_left: u32,
}

/// Arithmetic's own state fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
pub struct ArithmeticState {
    /// The episode's seed (drawn at random when reset gave none); `null` before the
    /// first reset.
    pub seed: Option<u64>,
    /// The episode's difficulty; `null` before the first reset.
    pub difficulty: Option<u8>,
    /// Answers given so far.
    pub attempts_used: u32,
    /// Answers allowed in the episode.
    pub max_attempts: u32,
    /// Whether the problem was solved.
    pub solved: bool,
    /// Whether the episode is over.
    pub done: bool,
}

/// A generated problem and its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The text shown to the agent.
    pub text: String,
    /// The correct answer.
    pub answer: i64,
}

/// The problem for `seed` at `difficulty`, the same one `reset` poses; `None` when
/// the difficulty is outside 1–5.
pub fn generate(seed: u64, difficulty: u8) -> Option<Problem> {
    if !(MIN_DIFFICULTY..=MAX_DIFFICULTY).contains(&difficulty) {
        return None;
    }
    let (_, mut rng) = episode_rng(Some(seed));
    Some(generate_with(&mut rng, difficulty))
}

fn generate_with(rng: &mut impl Rng, difficulty: u8) -> Problem {
    match difficulty {
        1 => expression_problem(level1(rng)),
        2 => expression_problem(level2(rng)),
        3 => expression_problem(level3(rng)),
        4 => expression_problem(level4(rng)),
        _ => word_problem(rng),
    }
}

fn expression_problem(expr: Expr) -> Problem {
    let answer = expr.value().expect("generators build exact expressions");
    Problem {
        text: format!("What is {}?", expr.render()),
        answer,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
}

impl Op {
    fn symbol(self) -> &'static str {
        match self {
            Op::Add => "+",
            Op::Sub => "-",
            Op::Mul => "*",
            Op::Div => "/",
        }
    }

    fn precedence(self) -> u8 {
        match self {
            Op::Add | Op::Sub => 1,
            Op::Mul | Op::Div => 2,
        }
    }

    /// The exact result, `None` on overflow or a division that does not come out even.
    fn apply(self, a: i64, b: i64) -> Option<i64> {
        match self {
            Op::Add => a.checked_add(b),
            Op::Sub => a.checked_sub(b),
            Op::Mul => a.checked_mul(b),
            Op::Div => (b != 0 && a.checked_rem(b)? == 0).then(|| a / b),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Expr {
    Num(i64),
    Bin(Op, Box<Expr>, Box<Expr>),
}

impl Expr {
    fn bin(op: Op, left: Expr, right: Expr) -> Expr {
        Expr::Bin(op, Box::new(left), Box::new(right))
    }

    fn value(&self) -> Option<i64> {
        match self {
            Expr::Num(n) => Some(*n),
            Expr::Bin(op, left, right) => op.apply(left.value()?, right.value()?),
        }
    }

    fn precedence(&self) -> u8 {
        match self {
            Expr::Num(_) => u8::MAX,
            Expr::Bin(op, ..) => op.precedence(),
        }
    }

    fn render(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            // Parenthesized so `3 - (-4)` never reads as `3 - -4`.
            Expr::Num(n) if *n < 0 => {
                let _ = write!(out, "({n})");
            }
            Expr::Num(n) => {
                let _ = write!(out, "{n}");
            }
            Expr::Bin(op, left, right) => {
                write_operand(out, left, left.precedence() < op.precedence());
                let _ = write!(out, " {} ", op.symbol());
                // A right operand of equal precedence needs parentheses unless the
                // operator is the same associative one (`a + (b + c)` is `a + b + c`);
                // keeping `a * (b / c)` parenthesized also keeps integer division
                // unambiguous.
                let right_parens = match **right {
                    Expr::Num(_) => false,
                    Expr::Bin(right_op, ..) => {
                        right_op.precedence() < op.precedence()
                            || (right_op.precedence() == op.precedence()
                                && !(right_op == *op && matches!(op, Op::Add | Op::Mul)))
                    }
                };
                write_operand(out, right, right_parens);
            }
        }
    }
}

fn write_operand(out: &mut String, expr: &Expr, parens: bool) {
    if parens {
        out.push('(');
        expr.write(out);
        out.push(')');
    } else {
        expr.write(out);
    }
}

/// `left op right`, adjusted so a division comes out even: the divisor leaf becomes a
/// divisor of the dividend, or the dividend leaf a multiple of the divisor, keeping
/// each leaf's sign; when neither works the division becomes a multiplication.
fn combine(rng: &mut impl Rng, op: Op, left: Expr, right: Expr) -> Expr {
    if op != Op::Div {
        return Expr::bin(op, left, right);
    }
    let (Some(lv), Some(rv)) = (left.value(), right.value()) else {
        return Expr::bin(Op::Mul, left, right);
    };
    if let Expr::Num(old) = right {
        let divisors: Vec<i64> = (2..=12).filter(|d| lv != 0 && lv % d == 0).collect();
        if let Some(&d) = divisors.choose(rng) {
            return Expr::bin(Op::Div, left, Expr::Num(if old < 0 { -d } else { d }));
        }
    }
    if let Expr::Num(old) = left
        && rv != 0
        && rv.abs() <= 50
    {
        let q = rng.random_range(2..=9_i64);
        let magnitude = (rv * q).abs();
        return Expr::bin(
            Op::Div,
            Expr::Num(if old < 0 { -magnitude } else { magnitude }),
            right,
        );
    }
    Expr::bin(Op::Mul, left, right)
}

/// A random tree over `leaves` (in order), taking one operator per inner node.
fn build(rng: &mut impl Rng, leaves: &[i64], ops: &mut impl Iterator<Item = Op>) -> Expr {
    if let [only] = leaves {
        return Expr::Num(*only);
    }
    let split = rng.random_range(1..leaves.len());
    let op = ops.next().unwrap_or(Op::Add);
    let left = build(rng, &leaves[..split], ops);
    let right = build(rng, &leaves[split..], ops);
    combine(rng, op, left, right)
}

fn level1(rng: &mut impl Rng) -> Expr {
    let a = rng.random_range(1..=20);
    let b = rng.random_range(1..=20);
    if rng.random_bool(0.5) {
        Expr::bin(Op::Add, Expr::Num(a), Expr::Num(b))
    } else {
        // Level 1 stays non-negative.
        Expr::bin(Op::Sub, Expr::Num(a.max(b)), Expr::Num(a.min(b)))
    }
}

fn level2(rng: &mut impl Rng) -> Expr {
    let a = rng.random_range(2..=12);
    let b = rng.random_range(2..=12);
    if rng.random_bool(0.5) {
        Expr::bin(Op::Mul, Expr::Num(a), Expr::Num(b))
    } else {
        Expr::bin(Op::Div, Expr::Num(a * b), Expr::Num(b))
    }
}

fn level3(rng: &mut impl Rng) -> Expr {
    let mut draw = || {
        let additive = *[Op::Add, Op::Sub].choose(rng).expect("non-empty");
        let multiplicative = *[Op::Mul, Op::Div].choose(rng).expect("non-empty");
        let mut ops = [additive, multiplicative];
        ops.shuffle(rng);
        let leaves: Vec<i64> = (0..3).map(|_| rng.random_range(1..=12)).collect();
        build(rng, &leaves, &mut ops.into_iter())
    };
    let mut expr = draw();
    // Redraw `(7 - 7) * 3` and the like, where one operation makes the other moot.
    for _ in 0..100 {
        if nonzero_throughout(&expr) {
            break;
        }
        expr = draw();
    }
    expr
}

/// Whether no operation in `expr` comes to zero.
fn nonzero_throughout(expr: &Expr) -> bool {
    match expr {
        Expr::Num(_) => true,
        Expr::Bin(_, left, right) => {
            expr.value().is_some_and(|v| v != 0)
                && nonzero_throughout(left)
                && nonzero_throughout(right)
        }
    }
}

fn level4(rng: &mut impl Rng) -> Expr {
    const ALL: [Op; 4] = [Op::Add, Op::Sub, Op::Mul, Op::Div];
    for _ in 0..100 {
        let count = rng.random_range(4..=5);
        let mut leaves: Vec<i64> = (0..count)
            .map(|_| {
                let n = rng.random_range(1..=15);
                if rng.random_bool(0.4) { -n } else { n }
            })
            .collect();
        if leaves.iter().all(|&n| n > 0) {
            let i = rng.random_range(0..leaves.len());
            leaves[i] = -leaves[i];
        }
        let mut ops = std::iter::repeat_with(|| *ALL.choose(rng).expect("non-empty"))
            .take(count - 1)
            .collect::<Vec<_>>()
            .into_iter();
        let expr = build(rng, &leaves, &mut ops);
        let small = expr
            .value()
            .is_some_and(|v| v.abs() <= LEVEL4_MAX_MAGNITUDE);
        if small && has_negative_leaf(&expr) && nonzero_throughout(&expr) {
            return expr;
        }
    }
    // Practically unreachable; a level-3 expression is always valid.
    level3(rng)
}

fn has_negative_leaf(expr: &Expr) -> bool {
    match expr {
        Expr::Num(n) => *n < 0,
        Expr::Bin(_, left, right) => has_negative_leaf(left) || has_negative_leaf(right),
    }
}

const NAMES: &[&str] = &[
    "Alice", "Ben", "Carmen", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira",
    "Liam", "Maya", "Noah", "Olga", "Priya",
];

const ITEMS: &[&str] = &[
    "apples", "marbles", "stickers", "pencils", "cookies", "cards", "shells", "stamps",
];

/// A templated word problem of two or three steps.
fn word_problem(rng: &mut impl Rng) -> Problem {
    let mut two = NAMES.choose_multiple(rng, 2);
    let (a, b) = (
        *two.next().expect("two names"),
        *two.next().expect("two names"),
    );
    let items = *ITEMS.choose(rng).expect("non-empty");
    match rng.random_range(0..6) {
        0 => {
            let have = rng.random_range(5..=30);
            let packs = rng.random_range(2..=6);
            let per_pack = rng.random_range(3..=12);
            let given = rng.random_range(1..=have);
            Problem {
                text: format!(
                    "{a} has {have} {items}. {a} buys {packs} packs with {per_pack} {items} \
                     in each, then gives {given} {items} to {b}. How many {items} does {a} \
                     have now?"
                ),
                answer: have + packs * per_pack - given,
            }
        }
        1 => {
            let count = rng.random_range(2..=9);
            let price = rng.random_range(2..=9);
            let cost = count * price;
            let bill = [20, 50, 100]
                .into_iter()
                .find(|&bill| bill > cost)
                .expect("cost is at most 81");
            Problem {
                text: format!(
                    "{a} buys {count} {items} at {price} dollars each and pays with a \
                     {bill}-dollar bill. How many dollars of change does {a} get?"
                ),
                answer: bill - cost,
            }
        }
        2 => {
            let per_bag = rng.random_range(3..=9);
            let bags = rng.random_range(4..=12);
            let given = rng.random_range(1..bags);
            Problem {
                text: format!(
                    "{a} packs {total} {items} into bags of {per_bag}, then gives {given} of \
                     the bags to {b}. How many bags does {a} have left?",
                    total = per_bag * bags
                ),
                answer: bags - given,
            }
        }
        3 => {
            let wage = rng.random_range(8..=25);
            let monday = rng.random_range(2..=8);
            let tuesday = rng.random_range(2..=8);
            Problem {
                text: format!(
                    "{a} earns {wage} dollars an hour, works {monday} hours on Monday and \
                     {tuesday} hours on Tuesday. How many dollars does {a} earn over the two \
                     days?"
                ),
                answer: wage * (monday + tuesday),
            }
        }
        4 => {
            let per_day = rng.random_range(5..=30);
            let days = rng.random_range(2..=7);
            let extra = rng.random_range(1..=20);
            let left = rng.random_range(1..=100);
            Problem {
                text: format!(
                    "{a} reads {per_day} pages a day for {days} days, then {extra} more pages. \
                     The book has {total} pages. How many pages are left to read?",
                    total = per_day * days + extra + left
                ),
                answer: left,
            }
        }
        _ => {
            let friends = rng.random_range(2..=5);
            let share = rng.random_range(1..=6);
            let times = rng.random_range(2..=4);
            let have = friends * share;
            Problem {
                text: format!(
                    "{a} has {have} {items} and {b} has {times} times as many. They put all \
                     their {items} together and share them equally among {friends} friends. \
                     How many {items} does each friend get?"
                ),
                answer: share * (1 + times),
            }
        }
    }
}

/// A number found in free text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NumberToken {
    /// Byte offset just past the number.
    end: usize,
    /// Its value; `None` when it is not an integer (`42.5`, `1/2`) or does not fit.
    value: Option<i64>,
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Whether a `-` after `before` is a binary minus: it follows a word or `)` directly,
/// or a digit or `)` across spaces (`x-3`, `10 - 3`; but `is -7`, `= -7`).
fn follows_operand(before: &[(usize, char)]) -> bool {
    let mut rest = before.iter().rev().map(|&(_, c)| c);
    match rest.next() {
        None => false,
        Some(c) if is_word_char(c) || c == ')' => true,
        Some(c) if c.is_whitespace() => rest
            .find(|c| !c.is_whitespace())
            .is_some_and(|c| c.is_ascii_digit() || c == ')'),
        Some(_) => false,
    }
}

/// Every number in `text`, in order. A minus sign belongs to the number only where it
/// cannot be a binary minus (see [`follows_operand`]); digits glued to a word (`x2`,
/// `H2O`) are not numbers.
fn scan_numbers(text: &str) -> Vec<NumberToken> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let char_at = |i: usize| chars.get(i).map(|&(_, c)| c);
    let digit_at = |i: usize| char_at(i).is_some_and(|c| c.is_ascii_digit());
    let offset_at = |i: usize| chars.get(i).map_or(text.len(), |&(offset, _)| offset);
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i].1;
        let prev = i.checked_sub(1).and_then(char_at);
        let sign = matches!(c, '-' | '−') && digit_at(i + 1) && !follows_operand(&chars[..i]);
        let bare_fraction = c == '.' && digit_at(i + 1) && !prev.is_some_and(is_word_char);
        let digit = c.is_ascii_digit() && !prev.is_some_and(is_word_char);
        if !(sign || digit || bare_fraction) {
            i += 1;
            continue;
        }
        let mut literal = String::new();
        if sign {
            literal.push('-');
            i += 1;
        }
        let mut integer = !bare_fraction;
        while digit_at(i) {
            literal.push(chars[i].1);
            i += 1;
        }
        // Thousands separators: a comma followed by exactly three digits.
        while char_at(i) == Some(',') && (1..=3).all(|k| digit_at(i + k)) && !digit_at(i + 4) {
            literal.extend(chars[i + 1..i + 4].iter().map(|&(_, c)| c));
            i += 4;
        }
        if char_at(i) == Some('.') && digit_at(i + 1) {
            i += 1;
            while digit_at(i) {
                integer &= chars[i].1 == '0';
                i += 1;
            }
        }
        // `1/2` is a fraction, not the integer 1.
        if char_at(i) == Some('/') && digit_at(i + 1) {
            integer = false;
            while digit_at(i) || char_at(i) == Some('/') {
                i += 1;
            }
        }
        tokens.push(NumberToken {
            end: offset_at(i),
            value: if integer { literal.parse().ok() } else { None },
        });
    }
    tokens
}

/// The text inside the last `\boxed{..}`, up to its matching brace (or the end).
fn last_boxed(text: &str) -> Option<&str> {
    const OPEN: &str = "\\boxed{";
    let start = text.rfind(OPEN)? + OPEN.len();
    let mut depth = 1_usize;
    for (offset, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + offset]);
                }
            }
            _ => {}
        }
    }
    Some(&text[start..])
}

/// Reads the final integer answer from a model's free-text reply.
///
/// In order of preference: the content of the last `\boxed{..}` (which must hold
/// exactly one number), the first number after the last "answer is" / "answer:" /
/// "answer =" (any case), the first number after the last `####`, else the last
/// number in the text. A marker followed by no number passes to the next rule.
/// Thousands separators and a zero fractional part are accepted; a number with a
/// non-zero fractional part, a fraction or one that does not fit in `i64` gives
/// `None`, as does text without numbers.
///
/// ```
/// use agentstack_envs::arithmetic::parse_answer;
///
/// assert_eq!(parse_answer("6 * 7 = 42, so the answer is 42."), Some(42));
/// assert_eq!(parse_answer("\\boxed{-7}"), Some(-7));
/// assert_eq!(parse_answer("about 42.5"), None);
/// ```
pub fn parse_answer(text: &str) -> Option<i64> {
    if let Some(content) = last_boxed(text) {
        match scan_numbers(content).as_slice() {
            [] => {}
            [only] => return only.value,
            _ => return None,
        }
    }
    let tokens = scan_numbers(text);
    let first_after = |position: usize| tokens.iter().find(|t| t.end > position);
    // ASCII lowercasing keeps byte offsets valid for `text`.
    let lower = text.to_ascii_lowercase();
    let phrase_end = ["answer is", "answer:", "answer ="]
        .iter()
        .filter_map(|phrase| lower.rfind(phrase).map(|at| at + phrase.len()))
        .max();
    for marker_end in [phrase_end, text.rfind("####").map(|at| at + 4)]
        .into_iter()
        .flatten()
    {
        if let Some(token) = first_after(marker_end) {
            return token.value;
        }
    }
    tokens.last()?.value
}

/// The `train` and `test` task lists. Task `i` is the reset body
/// `{"seed": s, "difficulty": i % 5 + 1}`, with `s = i` in `train` and `s = 2^32 + i`
/// in `test`, so the splits never share a seed.
#[derive(Debug, Clone, Copy, Default)]
pub struct ArithmeticTasks;

impl ArithmeticTasks {
    fn split(&self, split: &str) -> Result<(usize, u64), TaskError> {
        match split {
            "train" => Ok((TRAIN_TASKS, 0)),
            "test" => Ok((TEST_TASKS, TEST_SEED_BASE)),
            other => Err(self.unknown_split(other)),
        }
    }
}

impl TaskSource for ArithmeticTasks {
    fn splits(&self) -> Vec<Split> {
        vec![
            Split {
                name: "train".to_owned(),
                kind: SplitType::Train,
            },
            Split {
                name: "test".to_owned(),
                kind: SplitType::Test,
            },
        ]
    }

    fn num_tasks(&self, split: &str) -> Result<usize, TaskError> {
        self.split(split).map(|(len, _)| len)
    }

    fn task(&self, split: &str, index: usize) -> Result<Value, TaskError> {
        let (len, seed_base) = self.split(split)?;
        if index >= len {
            return Err(TaskError::InvalidIndex);
        }
        let levels = usize::from(MAX_DIFFICULTY - MIN_DIFFICULTY + 1);
        let difficulty = usize::from(MIN_DIFFICULTY) + index % levels;
        Ok(json!({"seed": seed_base + index as u64, "difficulty": difficulty}))
    }
}

#[derive(Debug, Clone)]
struct Episode {
    seed: u64,
    difficulty: u8,
    problem: Problem,
    max_attempts: u32,
    attempts_used: u32,
    solved: bool,
}

impl Episode {
    fn done(&self) -> bool {
        self.solved || self.attempts_used >= self.max_attempts
    }

    fn observation(&self, feedback: Option<String>) -> ArithmeticObservation {
        ArithmeticObservation {
            problem: self.problem.text.clone(),
            difficulty: self.difficulty,
            feedback,
            attempts_left: self.max_attempts - self.attempts_used,
        }
    }
}

/// The arithmetic environment.
#[derive(Debug, Clone, Default)]
pub struct ArithmeticEnv {
    episode: Option<Episode>,
}

impl ArithmeticEnv {
    /// A fresh environment; `reset` starts the first episode.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The spec that serves [`ArithmeticEnv`].
pub fn spec() -> EnvSpec {
    EnvSpec::new(ArithmeticEnv::new)
}

fn plural(n: u32, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

impl Environment for ArithmeticEnv {
    type Action = ArithmeticAction;
    type Observation = ArithmeticObservation;
    type State = ArithmeticState;

    fn info(&self) -> EnvInfo {
        EnvInfo {
            readme: Some(README.to_owned()),
            ..EnvInfo::new(
                NAME,
                "Solve generated arithmetic and word problems (difficulty 1-5); answer with an integer",
            )
        }
    }

    async fn reset(&mut self, args: ResetArgs) -> Result<Step<ArithmeticObservation>, EnvError> {
        let difficulty = int_option(
            &args.options,
            "difficulty",
            u64::from(MIN_DIFFICULTY),
            u64::from(MIN_DIFFICULTY)..=u64::from(MAX_DIFFICULTY),
        )?;
        let max_attempts = int_option(
            &args.options,
            "max_attempts",
            1,
            1..=u64::from(MAX_ATTEMPTS_LIMIT),
        )?;
        let difficulty = u8::try_from(difficulty).expect("checked to be at most 5");
        let max_attempts = u32::try_from(max_attempts).expect("checked to be at most 100");
        let (seed, mut rng) = episode_rng(args.seed);
        let episode = Episode {
            seed,
            difficulty,
            problem: generate_with(&mut rng, difficulty),
            max_attempts,
            attempts_used: 0,
            solved: false,
        };
        let observation = episode.observation(None);
        self.episode = Some(episode);
        Ok(Step::new(observation).with_reward(0.0))
    }

    async fn step(
        &mut self,
        action: ArithmeticAction,
    ) -> Result<Step<ArithmeticObservation>, EnvError> {
        let episode = self
            .episode
            .as_mut()
            .ok_or_else(|| EnvError::new(NO_EPISODE))?;
        if episode.done() {
            return Err(EnvError::new(EPISODE_OVER));
        }
        episode.attempts_used += 1;
        let expected = episode.problem.answer;
        let parsed = parse_answer(&action.answer);
        episode.solved = parsed == Some(expected);
        let done = episode.done();
        let mut feedback = match parsed {
            _ if episode.solved => format!("Correct: the answer is {expected}."),
            Some(n) => format!("Incorrect: {n} is not the answer."),
            None => "No integer answer found; end your reply with it, e.g. \"The answer is 42.\""
                .to_owned(),
        };
        if done && !episode.solved {
            let _ = write!(feedback, " The answer was {expected}.");
        } else if !done {
            let left = episode.max_attempts - episode.attempts_used;
            let _ = write!(feedback, " {} left.", plural(left, "attempt"));
        }
        let mut step = Step::new(episode.observation(Some(feedback)))
            .with_reward(if episode.solved { 1.0 } else { 0.0 })
            .with_done(done)
            .with_metadata("parsed_answer", parsed);
        if done {
            step = step.with_metadata("expected_answer", expected);
        }
        Ok(step)
    }

    fn state(&self) -> ArithmeticState {
        match &self.episode {
            None => ArithmeticState::default(),
            Some(episode) => ArithmeticState {
                seed: Some(episode.seed),
                difficulty: Some(episode.difficulty),
                attempts_used: episode.attempts_used,
                max_attempts: episode.max_attempts,
                solved: episode.solved,
                done: episode.done(),
            },
        }
    }

    fn task_source(&self) -> Option<Arc<dyn TaskSource>> {
        Some(Arc::new(ArithmeticTasks))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use agentstack_protocol::http::ResetRequest;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use serde_json::Map;
    use serde_json::value::RawValue;

    use super::*;

    use crate::episode::test_reset_args as reset_args;

    fn answer(text: &str) -> ArithmeticAction {
        ArithmeticAction {
            answer: text.into(),
        }
    }

    #[test]
    fn parses_common_answer_formats() {
        let cases = [
            ("42", Some(42)),
            (" 42.", Some(42)),
            ("The answer is 42.", Some(42)),
            ("\\boxed{42}", Some(42)),
            ("**42**", Some(42)),
            ("#### 42", Some(42)),
            ("x = -7", Some(-7)),
            ("1,234", Some(1234)),
            ("42.0", Some(42)),
            ("$1,234,567.00", Some(1_234_567)),
            ("−5", Some(-5)),
            ("Answer: 17", Some(17)),
            ("FINAL ANSWER IS 8", Some(8)),
            ("answer = 9", Some(9)),
            ("I computed 3 + 4 = 7", Some(7)),
            ("10-3", Some(3)),
            ("10 - 3", Some(3)),
            ("(2) - 3", Some(3)),
            ("The answer is -12", Some(-12)),
            ("so (-12)", Some(-12)),
            ("It is 3 apples, 1, 2", Some(2)),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_answer(text), expected, "{text:?}");
        }
    }

    #[test]
    fn prefers_boxed_then_answer_phrase_then_hashes() {
        assert_eq!(parse_answer("so \\boxed{12} and later 99"), Some(12));
        assert_eq!(
            parse_answer("\\boxed{1} then \\boxed{\\text{x} = 5}"),
            Some(5)
        );
        assert_eq!(
            parse_answer("The answer is 30, I checked 3 times"),
            Some(30)
        );
        assert_eq!(parse_answer("#### 30\nstep 2 gives 4"), Some(30));
        assert_eq!(parse_answer("answer is 5 #### 6"), Some(5));
        assert_eq!(parse_answer("\\boxed{5} answer is 6"), Some(5));
        // A marker with no number after it defers to the next rule.
        assert_eq!(parse_answer("I got 7 for the answer: see above"), Some(7));
        assert_eq!(parse_answer("\\boxed{} 8"), Some(8));
    }

    #[test]
    fn rejects_non_integers_and_empty_text() {
        for text in [
            "42.5",
            "The answer is 42.5",
            "\\boxed{\\frac{1}{2}}",
            "\\boxed{3.5}",
            "about .5",
            "1/2",
            "",
            "no idea",
            "99999999999999999999",
            "x2",
        ] {
            assert_eq!(parse_answer(text), None, "{text:?}");
        }
    }

    proptest! {
        #[test]
        fn parses_any_integer_in_common_wrappers(n in any::<i64>()) {
            prop_assert_eq!(parse_answer(&n.to_string()), Some(n));
            prop_assert_eq!(parse_answer(&format!("The answer is {n}.")), Some(n));
            prop_assert_eq!(parse_answer(&format!("\\boxed{{{n}}}")), Some(n));
            prop_assert_eq!(parse_answer(&format!("work 1 2 3\n#### {n}")), Some(n));
        }

        #[test]
        fn never_panics(text in ".{0,40}") {
            let _ = parse_answer(&text);
        }
    }

    #[test]
    fn every_level_generates_exact_problems_deterministically() {
        for difficulty in MIN_DIFFICULTY..=MAX_DIFFICULTY {
            let mut texts = HashSet::new();
            for seed in 0..200 {
                let problem = generate(seed, difficulty).unwrap();
                assert_eq!(generate(seed, difficulty), Some(problem.clone()));
                assert!(problem.text.ends_with('?'), "{}", problem.text);
                texts.insert(problem.text);
            }
            assert!(
                texts.len() > 50,
                "level {difficulty}: only {} problems",
                texts.len()
            );
        }
        assert_eq!(generate(0, 0), None);
        assert_eq!(generate(0, 6), None);
    }

    #[test]
    fn rendered_expressions_respect_precedence() {
        // 2 + 3 * 4 needs no parentheses; (2 + 3) * 4 does; 10 - (4 - 3) keeps them.
        let times = Expr::bin(Op::Mul, Expr::Num(3), Expr::Num(4));
        assert_eq!(
            Expr::bin(Op::Add, Expr::Num(2), times).render(),
            "2 + 3 * 4"
        );
        let sum = Expr::bin(Op::Add, Expr::Num(2), Expr::Num(3));
        assert_eq!(
            Expr::bin(Op::Mul, sum, Expr::Num(4)).render(),
            "(2 + 3) * 4"
        );
        let diff = Expr::bin(Op::Sub, Expr::Num(4), Expr::Num(3));
        let outer = Expr::bin(Op::Sub, Expr::Num(10), diff);
        assert_eq!(outer.render(), "10 - (4 - 3)");
        assert_eq!(outer.value(), Some(9));
        assert_eq!(
            Expr::bin(Op::Sub, Expr::Num(3), Expr::Num(-4)).render(),
            "3 - (-4)"
        );
        assert_eq!(Op::Div.apply(7, 2), None);
        assert_eq!(Op::Div.apply(-8, 2), Some(-4));
    }

    #[test]
    fn rendered_expressions_evaluate_to_the_answer() {
        // Re-evaluates the rendered text with an independent precedence parser.
        fn eval(tokens: &[&str]) -> i64 {
            fn expr(t: &[&str], i: &mut usize) -> i64 {
                let mut v = term(t, i);
                while *i < t.len() && (t[*i] == "+" || t[*i] == "-") {
                    let op = t[*i];
                    *i += 1;
                    let r = term(t, i);
                    v = if op == "+" { v + r } else { v - r };
                }
                v
            }
            fn term(t: &[&str], i: &mut usize) -> i64 {
                let mut v = atom(t, i);
                while *i < t.len() && (t[*i] == "*" || t[*i] == "/") {
                    let op = t[*i];
                    *i += 1;
                    let r = atom(t, i);
                    v = if op == "*" { v * r } else { v / r };
                }
                v
            }
            fn atom(t: &[&str], i: &mut usize) -> i64 {
                if t[*i] == "(" {
                    *i += 1;
                    let v = expr(t, i);
                    *i += 1;
                    v
                } else {
                    *i += 1;
                    t[*i - 1].parse().unwrap()
                }
            }
            expr(tokens, &mut 0)
        }
        for difficulty in 1..=4 {
            for seed in 0..100 {
                let problem = generate(seed, difficulty).unwrap();
                let body = problem
                    .text
                    .trim_start_matches("What is ")
                    .trim_end_matches('?');
                let spaced = body.replace('(', " ( ").replace(')', " ) ");
                let mut tokens: Vec<&str> = spaced.split_whitespace().collect();
                // `( -4 )` is a negative literal, not a group.
                let mut merged = Vec::new();
                let mut i = 0;
                while i < tokens.len() {
                    if tokens[i] == "("
                        && tokens
                            .get(i + 1)
                            .is_some_and(|t| t.starts_with('-') && t.len() > 1)
                    {
                        merged.push(tokens[i + 1]);
                        i += 3;
                    } else {
                        merged.push(tokens[i]);
                        i += 1;
                    }
                }
                tokens = merged;
                assert_eq!(eval(&tokens), problem.answer, "{}", problem.text);
            }
        }
    }

    #[test]
    fn level_four_has_negatives_and_level_three_two_operations() {
        for seed in 0..100 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            assert!(nonzero_throughout(&level3(&mut rng)));
            assert!(nonzero_throughout(&level4(&mut rng)));
            let text = generate(seed, 4).unwrap().text;
            assert!(text.contains("(-"), "{text}");
            let text = generate(seed, 3).unwrap().text;
            let ops = text.chars().filter(|c| "+-*/".contains(*c)).count();
            assert_eq!(ops, 2, "two operators in {text}");
        }
    }

    #[tokio::test]
    async fn correct_answer_scores_and_ends() {
        let mut env = ArithmeticEnv::new();
        let reset = env
            .reset(reset_args(3, json!({"difficulty": 2})))
            .await
            .unwrap();
        assert_eq!(reset.observation.difficulty, 2);
        assert_eq!(reset.observation.attempts_left, 1);
        assert_eq!(reset.observation.feedback, None);
        let expected = generate(3, 2).unwrap();
        assert_eq!(reset.observation.problem, expected.text);

        let step = env
            .step(answer(&format!("so the answer is {}.", expected.answer)))
            .await
            .unwrap();
        assert_eq!(step.reward, Some(1.0));
        assert!(step.done);
        assert_eq!(step.metadata["parsed_answer"], expected.answer);
        assert!(env.state().solved);
        let err = env.step(answer("1")).await.unwrap_err();
        assert_eq!(err.message, EPISODE_OVER);
    }

    #[tokio::test]
    async fn wrong_answer_reveals_after_last_attempt() {
        let mut env = ArithmeticEnv::new();
        env.reset(reset_args(5, json!({"max_attempts": 2})))
            .await
            .unwrap();
        let expected = generate(5, 1).unwrap().answer;

        let first = env.step(answer("no idea")).await.unwrap();
        assert_eq!(first.reward, Some(0.0));
        assert!(!first.done);
        assert_eq!(first.observation.attempts_left, 1);
        let feedback = first.observation.feedback.unwrap();
        assert!(feedback.contains("No integer answer"), "{feedback}");
        assert!(feedback.contains("1 attempt left"), "{feedback}");
        assert_eq!(first.metadata["parsed_answer"], Value::Null);

        let second = env.step(answer(&(expected + 1).to_string())).await.unwrap();
        assert_eq!(second.reward, Some(0.0));
        assert!(second.done);
        let feedback = second.observation.feedback.unwrap();
        assert!(
            feedback.contains(&format!("The answer was {expected}.")),
            "{feedback}"
        );
        assert_eq!(second.metadata["expected_answer"], expected);
    }

    #[tokio::test]
    async fn bad_options_and_missing_reset_are_errors() {
        let mut env = ArithmeticEnv::new();
        assert_eq!(env.step(answer("1")).await.unwrap_err().message, NO_EPISODE);
        for options in [
            json!({"difficulty": 0}),
            json!({"difficulty": 6}),
            json!({"difficulty": "hard"}),
        ] {
            let err = env.reset(reset_args(1, options)).await.unwrap_err();
            assert!(err.message.contains("`difficulty`"), "{err}");
            assert!(err.message.contains("from 1 to 5"), "{err}");
        }
        let err = env
            .reset(reset_args(1, json!({"max_attempts": 0})))
            .await
            .unwrap_err();
        assert!(err.message.contains("`max_attempts`"), "{err}");
    }

    #[tokio::test]
    async fn unseeded_episodes_report_their_seed() {
        let mut env = ArithmeticEnv::new();
        let args = ResetArgs {
            seed: None,
            episode_id: "x".into(),
            options: Map::new(),
        };
        let first = env.reset(args).await.unwrap();
        let seed = env.state().seed.unwrap();
        let replay = env.reset(reset_args(seed, json!({}))).await.unwrap();
        assert_eq!(first.observation.problem, replay.observation.problem);
    }

    #[test]
    fn task_splits_are_deterministic_and_disjoint() {
        let tasks = ArithmeticTasks;
        assert_eq!(tasks.num_tasks("train"), Ok(TRAIN_TASKS));
        assert_eq!(tasks.num_tasks("test"), Ok(TEST_TASKS));
        assert_eq!(
            tasks.task("train", 7),
            Ok(json!({"seed": 7, "difficulty": 3}))
        );
        assert_eq!(tasks.task("test", TEST_TASKS), Err(TaskError::InvalidIndex));
        assert!(matches!(
            tasks.task("dev", 0),
            Err(TaskError::UnknownSplit { .. })
        ));
        let seeds = |split: &str, len: usize| -> HashSet<u64> {
            (0..len)
                .map(|i| tasks.task(split, i).unwrap()["seed"].as_u64().unwrap())
                .collect()
        };
        let train = seeds("train", TRAIN_TASKS);
        let test = seeds("test", TEST_TASKS);
        assert_eq!(train.len(), TRAIN_TASKS);
        assert_eq!(test.len(), TEST_TASKS);
        assert!(train.is_disjoint(&test));
    }

    #[tokio::test]
    async fn wire_form_through_spec() {
        let spec = spec();
        assert_eq!(spec.name(), NAME);
        assert!(spec.tasks().is_some());
        let mut env = spec.instantiate().unwrap();
        let mut request = ResetRequest {
            seed: Some(11),
            ..ResetRequest::default()
        };
        request.options.insert("difficulty".into(), json!(5));
        let reset = env.reset(request).await.unwrap();
        let obs: Value = serde_json::from_str(reset.observation.get()).unwrap();
        let expected = generate(11, 5).unwrap();
        assert_eq!(obs["problem"], expected.text);
        assert_eq!(obs["difficulty"], 5);
        assert_eq!(obs["feedback"], Value::Null);

        let body = json!({"answer": format!("\\boxed{{{}}}", expected.answer)}).to_string();
        let step = env
            .step(&RawValue::from_string(body).unwrap())
            .await
            .unwrap();
        assert_eq!(step.reward, Some(1.0));
        assert!(step.done);
        let state = env.state().unwrap();
        assert_eq!(state["seed"], 11);
        assert_eq!(state["solved"], true);
    }
}
