//! `connect_four`: play Connect Four against a built-in opponent.
//!
//! The board has 7 columns and 6 rows; a disc drops to the lowest empty cell of its
//! column; four in a row horizontally, vertically or diagonally wins; a full board
//! is a draw. The agent is `X` and moves first unless the reset option
//! `agent_first` is `false`. The opponent (`O`) plays at the reset option
//! `strength`: 0 picks a random legal column, 1 wins when it can, else blocks an
//! immediate threat, else plays at random, and 2 to 6 search that many plies ahead
//! with negamax and alpha-beta pruning. Its random choices (including ties between
//! equally good moves) come from the episode's seeded generator, so a seed and the
//! agent's moves fix the whole game.
//!
//! Rewards: win 1.0, loss -1.0, draw and ongoing 0.0; an illegal move (a full
//! column or one outside 0–6) gives -1.0 and, unless the reset option
//! `illegal_move_ends` is `false`, ends the episode.

use std::fmt::Write as _;

use agentstack_env::{EnvError, EnvInfo, EnvSpec, Environment, ResetArgs, Step};
use rand::Rng;
use rand::seq::IndexedRandom;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::episode::{EPISODE_OVER, NO_EPISODE, bool_option, episode_rng, int_option};

/// The name the environment is served under.
pub const NAME: &str = "connect_four";

/// Columns on the board.
pub const COLUMNS: usize = 7;

/// Rows on the board.
pub const ROWS: usize = 6;

/// The strongest opponent: a six-ply search.
pub const MAX_STRENGTH: u8 = 6;

/// The opponent's strength when the reset options name none.
pub const DEFAULT_STRENGTH: u8 = 1;

/// Bits per column in a [`Board`]'s bitboards: the rows plus an always-empty
/// sentinel, so that lines cannot wrap from one column into the next.
const COLUMN_BITS: usize = ROWS + 1;

/// Columns to search first: central ones take part in more lines, so trying them
/// first makes alpha-beta prune more.
const SEARCH_ORDER: [usize; COLUMNS] = [3, 2, 4, 1, 5, 0, 6];

/// The score of a won position, above any heuristic score.
const WIN_SCORE: i32 = 1_000_000;

/// Larger than any score.
const INFINITY: i32 = 10 * WIN_SCORE;

const README: &str = r#"# connect_four

Connect Four against a built-in opponent: 7 columns, 6 rows, discs fall to the lowest
empty cell, four in a row (horizontal, vertical or diagonal) wins, a full board draws.
You are `X`; the opponent is `O`.

## Reset options

- `strength` (integer 0–6, default 1): 0 plays a random legal column; 1 wins when it
  can, else blocks your immediate win, else plays at random; 2–6 search that many
  plies ahead (negamax with alpha-beta).
- `opponent`: instead of `strength`, `"random"` (0), `"greedy"` (1) or an integer.
- `agent_first` (bool, default true): false lets the opponent move first.
- `illegal_move_ends` (bool, default true): whether an illegal move ends the episode.

The seed fixes the opponent's random choices: the same seed and the same moves give the
same game.

## Action

```json
{"column": 3}
```

Columns are numbered 0 (left) to 6 (right).

## Observation

```json
{
  "board_text": ".......\n.......\n.......\n.......\n...O...\n...X...\n0123456",
  "board": [[0,0,0,0,0,0,0], [0,0,0,0,0,0,0], [0,0,0,0,0,0,0],
            [0,0,0,0,0,0,0], [0,0,0,-1,0,0,0], [0,0,0,1,0,0,0]],
  "legal_columns": [0,1,2,3,4,5,6],
  "last_opponent_move": 3,
  "message": "You played column 3; the opponent played column 3. Your move."
}
```

`board` lists the rows top first: 1 is your disc (`X`), -1 the opponent's (`O`), 0 an
empty cell. Once the episode is over `legal_columns` is empty and `metadata.outcome` is
`win`, `loss`, `draw` or `illegal_move`.

## Reward

Win 1.0, loss -1.0, draw 0.0, a move that does not end the game 0.0. An illegal move
(a full column, or one outside 0–6) gives -1.0, leaves the board as it was, and ends the
episode unless `illegal_move_ends` is false; the message says why and lists the legal
columns.
"#;

/// Who owns a disc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Player {
    /// The agent, shown as `X`.
    Agent,
    /// The built-in opponent, shown as `O`.
    Opponent,
}

impl Player {
    /// The other player.
    pub fn other(self) -> Player {
        match self {
            Player::Agent => Player::Opponent,
            Player::Opponent => Player::Agent,
        }
    }
}

/// A Connect Four position: one bitboard per player (bit `column * 7 + row`, row 0 at
/// the bottom) and the height of each column.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Board {
    agent: u64,
    opponent: u64,
    heights: [u8; COLUMNS],
}

fn bit(column: usize, row: usize) -> u64 {
    1 << (column * COLUMN_BITS + row)
}

/// Whether the bitboard `discs` holds four in a line in any direction.
fn has_four(discs: u64) -> bool {
    // Vertical, horizontal, and the two diagonals.
    [1, COLUMN_BITS, COLUMN_BITS - 1, COLUMN_BITS + 1]
        .into_iter()
        .any(|shift| {
            let pairs = discs & (discs >> shift);
            pairs & (pairs >> (2 * shift)) != 0
        })
}

/// The centre column's cells, as a bitboard.
const CENTRE: u64 = ((1 << ROWS) - 1) << (COLUMNS / 2 * COLUMN_BITS);

/// Every line of four cells on the board, as bitboards.
const WINDOWS: [u64; 69] = windows();

const fn windows() -> [u64; 69] {
    const DIRECTIONS: [(i32, i32); 4] = [(0, 1), (1, 0), (1, 1), (1, -1)];
    let mut out = [0; 69];
    let mut n = 0;
    let mut d = 0;
    while d < DIRECTIONS.len() {
        let (dc, dr) = DIRECTIONS[d];
        let mut column = 0;
        while column < COLUMNS as i32 {
            let mut row = 0;
            while row < ROWS as i32 {
                let (end_column, end_row) = (column + 3 * dc, row + 3 * dr);
                if end_column >= 0
                    && end_column < COLUMNS as i32
                    && end_row >= 0
                    && end_row < ROWS as i32
                {
                    let mut mask = 0_u64;
                    let mut k = 0;
                    while k < 4 {
                        let index = (column + k * dc) * COLUMN_BITS as i32 + row + k * dr;
                        mask |= 1 << index;
                        k += 1;
                    }
                    out[n] = mask;
                    n += 1;
                }
                row += 1;
            }
            column += 1;
        }
        d += 1;
    }
    assert!(n == 69, "a 7x6 board has 69 lines of four");
    out
}

impl Board {
    /// The empty board.
    pub fn new() -> Self {
        Self::default()
    }

    fn discs(&self, player: Player) -> u64 {
        match player {
            Player::Agent => self.agent,
            Player::Opponent => self.opponent,
        }
    }

    /// Whether a disc can go into `column`.
    pub fn is_legal(&self, column: usize) -> bool {
        column < COLUMNS && usize::from(self.heights[column]) < ROWS
    }

    /// The columns that are not full, in order.
    pub fn legal_columns(&self) -> Vec<u8> {
        (0..COLUMNS)
            .filter(|&c| self.is_legal(c))
            .map(|c| c as u8)
            .collect()
    }

    /// Drops a disc of `player` into `column`; `false` (and no change) when the
    /// column is full or does not exist.
    pub fn play(&mut self, column: usize, player: Player) -> bool {
        if !self.is_legal(column) {
            return false;
        }
        let disc = bit(column, usize::from(self.heights[column]));
        match player {
            Player::Agent => self.agent |= disc,
            Player::Opponent => self.opponent |= disc,
        }
        self.heights[column] += 1;
        true
    }

    /// Whether `player` has four in a row.
    pub fn has_won(&self, player: Player) -> bool {
        has_four(self.discs(player))
    }

    /// Whether every column is full.
    pub fn is_full(&self) -> bool {
        self.heights.iter().all(|&h| usize::from(h) == ROWS)
    }

    /// Who owns the cell at `row` (0 is the top row, as rendered) and `column`.
    pub fn cell(&self, row: usize, column: usize) -> Option<Player> {
        if row >= ROWS || column >= COLUMNS {
            return None;
        }
        let disc = bit(column, ROWS - 1 - row);
        if self.agent & disc != 0 {
            Some(Player::Agent)
        } else if self.opponent & disc != 0 {
            Some(Player::Opponent)
        } else {
            None
        }
    }

    /// Rows top to bottom of `.` (empty), `X` (agent), `O` (opponent), then a line of
    /// column numbers.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity((COLUMNS + 1) * (ROWS + 1));
        for row in 0..ROWS {
            for column in 0..COLUMNS {
                out.push(match self.cell(row, column) {
                    None => '.',
                    Some(Player::Agent) => 'X',
                    Some(Player::Opponent) => 'O',
                });
            }
            out.push('\n');
        }
        for column in 0..COLUMNS {
            let _ = write!(out, "{column}");
        }
        out
    }

    /// Rows top to bottom: 1 for the agent, -1 for the opponent, 0 for empty.
    pub fn grid(&self) -> Vec<Vec<i8>> {
        (0..ROWS)
            .map(|row| {
                (0..COLUMNS)
                    .map(|column| match self.cell(row, column) {
                        None => 0,
                        Some(Player::Agent) => 1,
                        Some(Player::Opponent) => -1,
                    })
                    .collect()
            })
            .collect()
    }

    /// The board after `player` plays `column`, if legal.
    fn after(&self, column: usize, player: Player) -> Option<Board> {
        let mut next = *self;
        next.play(column, player).then_some(next)
    }

    /// A column where `player` wins at once, if any.
    fn winning_column(&self, player: Player) -> Option<usize> {
        SEARCH_ORDER.into_iter().find(|&c| {
            self.after(c, player)
                .is_some_and(|next| next.has_won(player))
        })
    }
}

/// The column the opponent of strength `strength` plays on `board` (which must have
/// a legal column), drawing any random choice from `rng`.
pub fn choose_move(board: &Board, strength: u8, rng: &mut impl Rng) -> usize {
    let me = Player::Opponent;
    let legal: Vec<usize> = (0..COLUMNS).filter(|&c| board.is_legal(c)).collect();
    let random = |rng: &mut _| *legal.choose(rng).expect("the board has a legal column");
    match strength {
        0 => random(rng),
        1 => board
            .winning_column(me)
            .or_else(|| board.winning_column(me.other()))
            .unwrap_or_else(|| random(rng)),
        depth => search(board, me, depth.min(MAX_STRENGTH), rng),
    }
}

/// The best column for `me` by a `depth`-ply negamax search; ties are broken at
/// random so that equal positions do not always give the same game.
fn search(board: &Board, me: Player, depth: u8, rng: &mut impl Rng) -> usize {
    let mut best = -INFINITY;
    let mut best_columns = Vec::new();
    for column in SEARCH_ORDER {
        let Some(next) = board.after(column, me) else {
            continue;
        };
        let score = if next.has_won(me) {
            WIN_SCORE + i32::from(depth)
        } else {
            // A window just below the best so far: moves as good as it get exact
            // scores (to find ties), worse ones are cut off early.
            -negamax(&next, me.other(), depth - 1, -INFINITY, -(best - 1))
        };
        if score > best {
            best = score;
            best_columns.clear();
        }
        if score == best {
            best_columns.push(column);
        }
    }
    *best_columns
        .choose(rng)
        .expect("the board has a legal column")
}

/// The value of `board` for `side`, who is to move and has not lost yet.
/// Fail-soft alpha-beta: results outside `(alpha, beta)` are bounds.
fn negamax(board: &Board, side: Player, depth: u8, mut alpha: i32, beta: i32) -> i32 {
    if board.is_full() {
        return 0;
    }
    // Winning sooner scores higher: the remaining depth is added.
    if board.winning_column(side).is_some() {
        return WIN_SCORE + i32::from(depth);
    }
    if depth == 0 {
        return evaluate(board, side);
    }
    let mut best = -INFINITY;
    for column in SEARCH_ORDER {
        let Some(next) = board.after(column, side) else {
            continue;
        };
        let score = -negamax(&next, side.other(), depth - 1, -beta, -alpha);
        best = best.max(score);
        alpha = alpha.max(score);
        if alpha >= beta {
            break;
        }
    }
    best
}

/// A heuristic value of a position for `side`: open lines with two or three of its
/// discs, minus the same for the other side, plus a little for the centre column.
fn evaluate(board: &Board, side: Player) -> i32 {
    let mine = board.discs(side);
    let theirs = board.discs(side.other());
    let line_score = |count: u32| match count {
        3 => 5,
        2 => 2,
        _ => 0,
    };
    let mut score = 0;
    for window in WINDOWS {
        let (m, t) = ((mine & window).count_ones(), (theirs & window).count_ones());
        if t == 0 {
            score += line_score(m);
        } else if m == 0 {
            score -= line_score(t);
        }
    }
    let centre_difference =
        i64::from((mine & CENTRE).count_ones()) - i64::from((theirs & CENTRE).count_ones());
    score + 3 * i32::try_from(centre_difference).expect("at most six discs")
}

/// Connect Four's action.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConnectFourAction {
    /// The column to drop a disc into: 0 (left) to 6 (right).
    pub column: i64,
}

/// Connect Four's observation.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct ConnectFourObservation {
    /// The board as text: six rows, top first, of `.` (empty), `X` (your discs) and
    /// `O` (the opponent's), then a line of column numbers.
    pub board_text: String,
    /// The board as numbers: six rows, top first, of seven cells; 1 is your disc, -1
    /// the opponent's, 0 empty.
    pub board: Vec<Vec<i8>>,
    /// The columns you may play now; empty once the game is over.
    pub legal_columns: Vec<u8>,
    /// The column the opponent played last; `null` before its first move.
    pub last_opponent_move: Option<u8>,
    /// What happened, in words.
    pub message: String,
}

/// How an episode ended, from the agent's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The agent connected four.
    Win,
    /// The opponent connected four.
    Loss,
    /// The board filled up.
    Draw,
    /// The agent made an illegal move, which ended the episode.
    IllegalMove,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Win => "win",
            Outcome::Loss => "loss",
            Outcome::Draw => "draw",
            Outcome::IllegalMove => "illegal_move",
        }
    }
}

/// Connect Four's own state fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
pub struct ConnectFourState {
    /// The episode's seed (drawn at random when reset gave none); `null` before the
    /// first reset.
    pub seed: Option<u64>,
    /// The opponent's strength, 0 to 6.
    pub strength: Option<u8>,
    /// Whether the agent moved first.
    pub agent_first: Option<bool>,
    /// Every column played this episode by either player, in order.
    pub moves: Vec<u8>,
    /// How the episode ended; `null` while it runs.
    pub outcome: Option<Outcome>,
    /// Whether the episode is over.
    pub done: bool,
}

#[derive(Debug, Clone)]
struct Game {
    seed: u64,
    rng: ChaCha8Rng,
    board: Board,
    strength: u8,
    agent_first: bool,
    illegal_move_ends: bool,
    moves: Vec<u8>,
    last_opponent_move: Option<u8>,
    outcome: Option<Outcome>,
}

impl Game {
    fn opponent_moves(&mut self) -> u8 {
        let column = choose_move(&self.board, self.strength, &mut self.rng);
        self.board.play(column, Player::Opponent);
        let column = column as u8;
        self.moves.push(column);
        self.last_opponent_move = Some(column);
        column
    }

    fn observation(&self, message: String) -> ConnectFourObservation {
        ConnectFourObservation {
            board_text: self.board.render(),
            board: self.board.grid(),
            legal_columns: if self.outcome.is_some() {
                Vec::new()
            } else {
                self.board.legal_columns()
            },
            last_opponent_move: self.last_opponent_move,
            message,
        }
    }

    fn finish(&mut self, outcome: Outcome, message: String) -> Step<ConnectFourObservation> {
        self.outcome = Some(outcome);
        let reward = match outcome {
            Outcome::Win => 1.0,
            Outcome::Draw => 0.0,
            Outcome::Loss | Outcome::IllegalMove => -1.0,
        };
        Step::new(self.observation(message))
            .with_reward(reward)
            .with_done(true)
            .with_metadata("outcome", outcome.as_str())
    }
}

/// The Connect Four environment.
#[derive(Debug, Clone, Default)]
pub struct ConnectFourEnv {
    game: Option<Game>,
}

impl ConnectFourEnv {
    /// A fresh environment; `reset` starts the first game.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The spec that serves [`ConnectFourEnv`].
pub fn spec() -> EnvSpec {
    EnvSpec::new(ConnectFourEnv::new)
}

/// Reads the opponent's strength from `strength` or its alias `opponent`.
fn strength_option(options: &Map<String, Value>) -> Result<u8, EnvError> {
    let range = 0..=u64::from(MAX_STRENGTH);
    let default = u64::from(DEFAULT_STRENGTH);
    let opponent = options.get("opponent").filter(|v| !v.is_null());
    let strength = match opponent {
        None => int_option(options, "strength", default, range)?,
        Some(_) if options.get("strength").is_some_and(|v| !v.is_null()) => {
            return Err(EnvError::new(
                "give either reset option `opponent` or `strength`, not both",
            ));
        }
        Some(Value::String(name)) => match name.as_str() {
            "random" => 0,
            "greedy" => 1,
            other => {
                return Err(EnvError::new(format!(
                    "invalid reset option `opponent`: expected \"random\", \"greedy\" or an \
                     integer strength from 0 to {MAX_STRENGTH}, got \"{other}\""
                )));
            }
        },
        Some(_) => int_option(options, "opponent", default, range)?,
    };
    Ok(u8::try_from(strength).expect("checked to be at most 6"))
}

impl Environment for ConnectFourEnv {
    type Action = ConnectFourAction;
    type Observation = ConnectFourObservation;
    type State = ConnectFourState;

    fn info(&self) -> EnvInfo {
        EnvInfo {
            readme: Some(README.to_owned()),
            reward_range: (-1.0, 1.0),
            ..EnvInfo::new(
                NAME,
                "Play Connect Four against a built-in opponent of adjustable strength",
            )
        }
    }

    async fn reset(&mut self, args: ResetArgs) -> Result<Step<ConnectFourObservation>, EnvError> {
        let strength = strength_option(&args.options)?;
        let agent_first = bool_option(&args.options, "agent_first", true)?;
        let illegal_move_ends = bool_option(&args.options, "illegal_move_ends", true)?;
        let (seed, rng) = episode_rng(args.seed);
        let mut game = Game {
            seed,
            rng,
            board: Board::new(),
            strength,
            agent_first,
            illegal_move_ends,
            moves: Vec::new(),
            last_opponent_move: None,
            outcome: None,
        };
        let message = if agent_first {
            "You are X and move first; the opponent is O. Choose a column from 0 to 6.".to_owned()
        } else {
            let column = game.opponent_moves();
            format!(
                "You are X; the opponent (O) moved first and played column {column}. \
                 Choose a column from 0 to 6."
            )
        };
        let observation = game.observation(message);
        self.game = Some(game);
        Ok(Step::new(observation).with_reward(0.0))
    }

    async fn step(
        &mut self,
        action: ConnectFourAction,
    ) -> Result<Step<ConnectFourObservation>, EnvError> {
        let game = self
            .game
            .as_mut()
            .ok_or_else(|| EnvError::new(NO_EPISODE))?;
        if game.outcome.is_some() {
            return Err(EnvError::new(EPISODE_OVER));
        }
        let legal = game.board.legal_columns();
        let column = match usize::try_from(action.column) {
            Ok(column) if game.board.is_legal(column) => column,
            _ => {
                let why = if (0..COLUMNS as i64).contains(&action.column) {
                    "is full"
                } else {
                    "is out of range"
                };
                let message = format!("column {} {why}; legal columns: {legal:?}.", action.column);
                if game.illegal_move_ends {
                    return Ok(game
                        .finish(
                            Outcome::IllegalMove,
                            format!("{message} Game over: you lose."),
                        )
                        .with_metadata("illegal_move", true));
                }
                return Ok(Step::new(game.observation(format!("{message} Try again.")))
                    .with_reward(-1.0)
                    .with_metadata("illegal_move", true));
            }
        };
        game.board.play(column, Player::Agent);
        game.moves.push(column as u8);
        if game.board.has_won(Player::Agent) {
            let message = format!("You played column {column} and connected four. You win!");
            return Ok(game.finish(Outcome::Win, message));
        }
        if game.board.is_full() {
            let message = format!("You played column {column}; the board is full. Draw.");
            return Ok(game.finish(Outcome::Draw, message));
        }
        let reply = game.opponent_moves();
        let played = format!("You played column {column}; the opponent played column {reply}");
        if game.board.has_won(Player::Opponent) {
            let message = format!("{played} and connected four. You lose.");
            return Ok(game.finish(Outcome::Loss, message));
        }
        if game.board.is_full() {
            let message = format!("{played}; the board is full. Draw.");
            return Ok(game.finish(Outcome::Draw, message));
        }
        Ok(Step::new(game.observation(format!("{played}. Your move."))).with_reward(0.0))
    }

    fn state(&self) -> ConnectFourState {
        match &self.game {
            None => ConnectFourState::default(),
            Some(game) => ConnectFourState {
                seed: Some(game.seed),
                strength: Some(game.strength),
                agent_first: Some(game.agent_first),
                moves: game.moves.clone(),
                outcome: game.outcome,
                done: game.outcome.is_some(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use agentstack_protocol::http::ResetRequest;
    use rand::SeedableRng;
    use serde_json::json;
    use serde_json::value::RawValue;

    use super::*;

    use crate::episode::test_reset_args as reset_args;

    fn action(column: i64) -> ConnectFourAction {
        ConnectFourAction { column }
    }

    /// A board from `(column, player)` drops, in order.
    fn board(drops: &[(usize, Player)]) -> Board {
        let mut board = Board::new();
        for &(column, player) in drops {
            assert!(board.play(column, player), "column {column} is full");
        }
        board
    }

    use Player::{Agent as A, Opponent as O};

    #[test]
    fn detects_four_in_every_direction() {
        let horizontal = board(&[(1, A), (2, A), (3, A), (4, A)]);
        assert!(horizontal.has_won(A));
        assert!(!horizontal.has_won(O));

        let vertical = board(&[(6, A), (6, A), (6, A), (6, A)]);
        assert!(vertical.has_won(A));

        // Rising to the right: (0,0) (1,1) (2,2) (3,3).
        let rising = board(&[
            (0, A),
            (1, O),
            (1, A),
            (2, O),
            (2, O),
            (2, A),
            (3, O),
            (3, O),
            (3, O),
            (3, A),
        ]);
        assert!(rising.has_won(A));
        assert!(!rising.has_won(O));

        // Falling to the right: (3,3) (4,2) (5,1) (6,0).
        let falling = board(&[
            (6, O),
            (5, A),
            (5, O),
            (4, A),
            (4, A),
            (4, O),
            (3, A),
            (3, A),
            (3, A),
            (3, O),
        ]);
        assert!(falling.has_won(O));
        assert!(!falling.has_won(A));
    }

    #[test]
    fn lines_do_not_wrap_between_columns_or_rows() {
        // Three at the top of column 0 and one at the bottom of column 1 are
        // consecutive bits without the sentinel row.
        let mut drops = vec![(0, O), (0, O), (0, O), (0, A), (0, A), (0, A), (1, A)];
        assert!(!board(&drops).has_won(A));
        // Three at the right edge and one at the left edge of the next row.
        drops = vec![(4, A), (5, A), (6, A), (0, O), (0, A)];
        assert!(!board(&drops).has_won(A));
        let three = board(&[(0, A), (1, A), (2, A)]);
        assert!(!three.has_won(A));
    }

    #[test]
    fn renders_rows_top_first() {
        let b = board(&[(3, A), (3, O), (0, A)]);
        let text = b.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), ROWS + 1);
        assert_eq!(lines[4], "...O...");
        assert_eq!(lines[5], "X..X...");
        assert_eq!(lines[6], "0123456");
        let grid = b.grid();
        assert_eq!(grid[5], vec![1, 0, 0, 1, 0, 0, 0]);
        assert_eq!(grid[4][3], -1);
        assert_eq!(b.cell(0, 3), None);
    }

    #[test]
    fn full_board_without_winner_is_a_draw() {
        // Each column bottom to top; no line of four anywhere.
        const FILL: [&str; COLUMNS] = [
            "XOOXXO", "XOXOOO", "XOOXXX", "OXXXOX", "OXXOOO", "OOXOOX", "XXOOXX",
        ];
        let mut b = Board::new();
        for (column, discs) in FILL.iter().enumerate() {
            for disc in discs.chars() {
                assert!(b.play(column, if disc == 'X' { A } else { O }));
            }
        }
        assert!(b.is_full());
        assert!(!b.has_won(A));
        assert!(!b.has_won(O));
        assert!(b.legal_columns().is_empty());
        assert!(!b.play(0, A));
    }

    #[test]
    fn every_strength_takes_an_immediate_win_over_a_block() {
        // O has three in column 5; X threatens the bottom row at column 3.
        let b = board(&[(0, A), (5, O), (1, A), (5, O), (2, A), (5, O)]);
        for strength in 1..=MAX_STRENGTH {
            let mut rng = ChaCha8Rng::seed_from_u64(u64::from(strength));
            assert_eq!(
                choose_move(&b, strength, &mut rng),
                5,
                "strength {strength}"
            );
        }
    }

    #[test]
    fn every_strength_blocks_an_immediate_threat() {
        // X has three on a diagonal; only column 3 (row 3) stops it, and O has no
        // win of its own.
        let b = board(&[
            (0, A),
            (1, O),
            (1, A),
            (2, O),
            (2, O),
            (2, A),
            (3, A),
            (3, O),
            (3, A),
        ]);
        assert_eq!(b.winning_column(O), None);
        assert_eq!(b.winning_column(A), Some(3));
        for strength in 1..=MAX_STRENGTH {
            let mut rng = ChaCha8Rng::seed_from_u64(u64::from(strength));
            assert_eq!(
                choose_move(&b, strength, &mut rng),
                3,
                "strength {strength}"
            );
        }
    }

    #[test]
    fn search_sees_a_double_threat_coming() {
        // X at 2 and 3 on the bottom row with 1, 4 and 5 open: X playing 4 (or 1) makes
        // two threats at once. Two plies do not see it; four do, and take a spot
        // that defuses it.
        let b = board(&[(2, A), (3, A), (2, O)]);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let reply = choose_move(&b, 4, &mut rng);
        assert!([1, 4].contains(&reply), "played {reply}");
    }

    #[tokio::test]
    async fn games_against_every_strength_terminate() {
        for strength in 0..=MAX_STRENGTH {
            let mut env = ConnectFourEnv::new();
            let options = json!({"strength": strength});
            let reset = env.reset(reset_args(9, options)).await.unwrap();
            let mut legal = reset.observation.legal_columns;
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            let mut steps = 0;
            loop {
                let column = *legal.choose(&mut rng).unwrap();
                let step = env.step(action(i64::from(column))).await.unwrap();
                steps += 1;
                if step.done {
                    let outcome = env.state().outcome.unwrap();
                    let expected = match outcome {
                        Outcome::Win => 1.0,
                        Outcome::Loss => -1.0,
                        Outcome::Draw => 0.0,
                        Outcome::IllegalMove => unreachable!("only legal moves played"),
                    };
                    assert_eq!(step.reward, Some(expected));
                    assert_eq!(step.metadata["outcome"], outcome.as_str());
                    assert!(step.observation.legal_columns.is_empty());
                    break;
                }
                assert_eq!(step.reward, Some(0.0));
                legal = step.observation.legal_columns;
                assert!(steps <= 21, "the agent plays at most 21 discs");
            }
            let err = env.step(action(0)).await.unwrap_err();
            assert_eq!(err.message, EPISODE_OVER);
        }
    }

    #[tokio::test]
    async fn same_seed_same_opponent() {
        async fn replies(seed: u64, strength: u8) -> Vec<Option<u8>> {
            let mut env = ConnectFourEnv::new();
            let options = json!({"strength": strength, "agent_first": false});
            let first = env.reset(reset_args(seed, options)).await.unwrap();
            let mut out = vec![first.observation.last_opponent_move];
            for column in [0, 6, 0, 6] {
                let step = env.step(action(column)).await.unwrap();
                out.push(step.observation.last_opponent_move);
                if step.done {
                    break;
                }
            }
            out
        }
        for strength in [0, 1, 3] {
            assert_eq!(replies(42, strength).await, replies(42, strength).await);
        }
        let differ = any_differs(&[1, 2, 3, 4, 5]).await;
        assert!(differ, "different seeds should give different random games");

        async fn any_differs(seeds: &[u64]) -> bool {
            let first = replies(seeds[0], 0).await;
            for &seed in &seeds[1..] {
                if replies(seed, 0).await != first {
                    return true;
                }
            }
            false
        }
    }

    #[tokio::test]
    async fn opponent_can_move_first() {
        let mut env = ConnectFourEnv::new();
        let reset = env
            .reset(reset_args(
                1,
                json!({"agent_first": false, "opponent": "random"}),
            ))
            .await
            .unwrap();
        let column = reset.observation.last_opponent_move.unwrap();
        assert_eq!(reset.observation.board[ROWS - 1][usize::from(column)], -1);
        assert_eq!(env.state().moves, vec![column]);
        assert_eq!(env.state().strength, Some(0));
    }

    #[tokio::test]
    async fn illegal_moves_end_the_episode_by_default() {
        let mut env = ConnectFourEnv::new();
        env.reset(reset_args(1, json!({}))).await.unwrap();
        let step = env.step(action(7)).await.unwrap();
        assert_eq!(step.reward, Some(-1.0));
        assert!(step.done);
        assert!(
            step.observation
                .message
                .starts_with("column 7 is out of range; legal columns: [0, 1, 2, 3, 4, 5, 6]."),
            "{}",
            step.observation.message
        );
        assert_eq!(env.state().outcome, Some(Outcome::IllegalMove));
        assert_eq!(env.step(action(0)).await.unwrap_err().message, EPISODE_OVER);
    }

    #[tokio::test]
    async fn illegal_moves_can_be_retried() {
        let mut env = ConnectFourEnv::new();
        let options = json!({"illegal_move_ends": false, "strength": 0});
        env.reset(reset_args(3, options)).await.unwrap();
        let step = env.step(action(-1)).await.unwrap();
        assert_eq!(step.reward, Some(-1.0));
        assert!(!step.done);
        assert!(step.observation.message.ends_with("Try again."));
        assert!(
            step.observation
                .board
                .iter()
                .flatten()
                .all(|&cell| cell == 0)
        );
        assert!(env.state().moves.is_empty());

        let step = env.step(action(3)).await.unwrap();
        assert_eq!(step.reward, Some(0.0));
        assert_eq!(env.state().moves.len(), 2);
    }

    #[tokio::test]
    async fn column_full_message_names_legal_columns() {
        // Column 3 is filled by hand.
        let mut env = ConnectFourEnv::new();
        env.reset(reset_args(
            0,
            json!({"strength": 0, "illegal_move_ends": false}),
        ))
        .await
        .unwrap();
        let mut game = env.game.take().unwrap();
        game.board = board(&[(3, A), (3, O), (3, A), (3, O), (3, A), (3, O)]);
        env.game = Some(game);
        let step = env.step(action(3)).await.unwrap();
        assert_eq!(
            step.observation.message,
            "column 3 is full; legal columns: [0, 1, 2, 4, 5, 6]. Try again."
        );
    }

    #[tokio::test]
    async fn bad_options_are_errors() {
        let mut env = ConnectFourEnv::new();
        assert_eq!(env.step(action(0)).await.unwrap_err().message, NO_EPISODE);
        let cases = [
            (json!({"strength": 7}), "from 0 to 6"),
            (json!({"opponent": "perfect"}), "\"random\""),
            (json!({"opponent": 1, "strength": 2}), "not both"),
            (json!({"agent_first": "no"}), "true or false"),
        ];
        for (options, needle) in cases {
            let err = env.reset(reset_args(0, options)).await.unwrap_err();
            assert!(err.message.contains(needle), "{err}");
        }
        env.reset(reset_args(0, json!({"opponent": 5})))
            .await
            .unwrap();
        assert_eq!(env.state().strength, Some(5));
    }

    #[tokio::test]
    async fn wire_form_through_spec() {
        let spec = spec();
        assert_eq!(spec.info().reward_range, (-1.0, 1.0));
        let mut env = spec.instantiate().unwrap();
        let mut request = ResetRequest {
            seed: Some(5),
            ..ResetRequest::default()
        };
        request.options.insert("strength".into(), json!(2));
        env.reset(request).await.unwrap();
        let action = RawValue::from_string(r#"{"column":3}"#.into()).unwrap();
        let step = env.step(&action).await.unwrap();
        let obs: Value = serde_json::from_str(step.observation.get()).unwrap();
        assert_eq!(obs["board"].as_array().unwrap().len(), ROWS);
        assert_eq!(obs["board"][ROWS - 1][3], 1);
        assert!(obs["board_text"].as_str().unwrap().contains('X'));
        assert!(obs["last_opponent_move"].is_u64());
        assert_eq!(step.reward, Some(0.0));
        let state = env.state().unwrap();
        assert_eq!(state["moves"].as_array().unwrap().len(), 2);
        assert_eq!(state["outcome"], Value::Null);
    }
}
