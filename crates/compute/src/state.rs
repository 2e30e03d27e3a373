//! Launches and their units, kept in SQLite (`jobs.db` in the data directory's `jobs/`),
//! so any `agentstack` process can show, follow, cancel or pick up a launch that an
//! earlier one started, and supervisors of different launches on one machine share
//! its CPUs (local admission and preemption are one transaction here).

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Row, SqliteConnection};

use crate::spec::InfraKind;

/// Why the state database failed.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// SQLite failed.
    #[error("the job state database")]
    Db(#[from] sqlx::Error),
    /// A row held a value this version does not know.
    #[error("the job state database holds `{0}`, which this version does not know")]
    Unknown(String),
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as i64
}

macro_rules! states {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($(#[$vmeta])* $variant,)* }
        impl $name {
            /// The name stored and shown.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text,)* }
            }
        }
        impl FromStr for $name {
            type Err = StateError;
            fn from_str(s: &str) -> Result<Self, StateError> {
                match s { $($text => Ok(Self::$variant),)* _ => Err(StateError::Unknown(s.to_owned())) }
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                // `pad`, so that tables can give it a width.
                f.pad(self.as_str())
            }
        }
    };
}

states! {
    /// Where a launch is.
    JobState {
        /// Waiting for every unit to run (gang start).
        Starting = "starting",
        /// Every unit has run.
        Running = "running",
        /// Stopping its units (cancel, a failure, or the primaries done).
        Stopping = "stopping",
        /// The primaries finished with exit code 0.
        Succeeded = "succeeded",
        /// A unit failed past its recovery policy, or the gang could not start.
        Failed = "failed",
        /// Cancelled.
        Cancelled = "cancelled",
    }
}

impl JobState {
    /// Whether nothing runs any more.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

states! {
    /// Where one unit is.
    UnitState {
        /// Not started yet (waiting for the gang, or for CPUs).
        Pending = "pending",
        /// Submitted; the engine has not run it yet.
        Starting = "starting",
        /// Running.
        Running = "running",
        /// Failed, and its policy starts it again.
        Restarting = "restarting",
        /// Asked to stop so a higher-priority unit can run.
        Preempting = "preempting",
        /// Stopped for a higher-priority unit; starts again when there is room.
        Preempted = "preempted",
        /// Asked to stop.
        Stopping = "stopping",
        /// Exited with 0.
        Succeeded = "succeeded",
        /// Failed past its policy.
        Failed = "failed",
        /// Stopped by agentstack.
        Stopped = "stopped",
    }
}

impl UnitState {
    /// Whether it will not run again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Stopped)
    }

    /// Whether the engine may have it running (it holds resources).
    pub fn is_active(self) -> bool {
        matches!(
            self,
            Self::Starting | Self::Running | Self::Preempting | Self::Stopping
        )
    }
}

/// One launch.
#[derive(Debug, Clone)]
pub struct JobRecord {
    /// Unique id.
    pub id: String,
    /// The group's name.
    pub name: String,
    /// Where it runs.
    pub infra: InfraKind,
    /// The group as YAML (paths resolved).
    pub spec: String,
    /// Its state.
    pub state: JobState,
    /// Whether someone asked to cancel it.
    pub cancel_requested: bool,
    /// Why it is in its state.
    pub message: Option<String>,
    /// The supervisor's process id.
    pub supervisor_pid: Option<i64>,
    /// When the supervisor last wrote, ms.
    pub heartbeat_ms: Option<i64>,
    /// Its directory (logs, discovery files).
    pub dir: String,
    /// When it was launched, ms.
    pub created_ms: i64,
    /// When every unit first ran, ms.
    pub running_ms: Option<i64>,
    /// When it ended, ms.
    pub ended_ms: Option<i64>,
    /// Launch options for the backend (JSON).
    pub options: String,
    /// The engines to place it on, in order (`infra` is the current one).
    pub infra_order: Vec<InfraKind>,
    /// Where it was placed, and why it moved: one line per engine it left.
    pub placement: Option<String>,
    /// When the current gang start began (after a failover or a group recovery), ms;
    /// `None`: at `created_ms`.
    pub gang_ms: Option<i64>,
    /// When the group recovery under way began, ms: every unit is being stopped, to
    /// start again together.
    pub recovering_ms: Option<i64>,
    /// Group recoveries so far.
    pub recoveries: u32,
}

impl JobRecord {
    /// When the current gang start began, ms.
    pub fn gang_started_ms(&self) -> i64 {
        self.gang_ms.unwrap_or(self.created_ms)
    }

    /// The engine after the current one in `infra_order`, if any.
    pub fn next_infra(&self) -> Option<InfraKind> {
        let at = self.infra_order.iter().position(|k| *k == self.infra)?;
        self.infra_order.get(at + 1).copied()
    }
}

/// One unit of a launch.
#[derive(Debug, Clone)]
pub struct UnitRecord {
    /// The launch.
    pub job_id: String,
    /// The component.
    pub component: String,
    /// The replica.
    pub replica: u32,
    /// Starts so far, minus one (0 on the first start).
    pub attempt: u32,
    /// Restarts counted against `max_restarts_on_errors`.
    pub restarts_on_errors: u32,
    /// Its state.
    pub state: UnitState,
    /// The engine's handle for the current attempt.
    pub handle: Option<String>,
    /// Where it runs, comma-separated.
    pub hosts: Option<String>,
    /// The last exit code.
    pub exit_code: Option<i32>,
    /// Why it is in its state.
    pub message: Option<String>,
    /// Its component's priority.
    pub priority: i32,
    /// CPUs it holds on local.
    pub cpus: f64,
    /// Where it runs (for admission across launches).
    pub infra: InfraKind,
    /// When the current attempt was submitted, ms.
    pub started_ms: Option<i64>,
    /// When the current attempt was first seen running, ms.
    pub running_ms: Option<i64>,
    /// When the last attempt ended, ms.
    pub ended_ms: Option<i64>,
    /// When a graceful stop turns into a kill, or an auxiliary is stopped, ms.
    pub deadline_ms: Option<i64>,
    /// Whether the running attempt's discovery file is written.
    pub discovered: bool,
    /// When the current attempt first passed its readiness probe, ms.
    pub ready_ms: Option<i64>,
}

/// A new launch's units: component, replica, priority, CPUs.
pub type NewUnit = (String, u32, i32, f64);

/// The answer to a request for CPUs on local.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// The CPUs are reserved (the units are `starting`).
    Admitted,
    /// Not enough CPUs now; these units were marked `preempting` and must be stopped.
    Preempt(Vec<UnitRecord>),
    /// Not enough CPUs, and nothing of lower priority to stop.
    Wait {
        /// CPUs asked for.
        need: f64,
        /// CPUs free.
        free: f64,
    },
}

impl PartialEq for UnitRecord {
    fn eq(&self, other: &Self) -> bool {
        (&self.job_id, &self.component, self.replica)
            == (&other.job_id, &other.component, other.replica)
    }
}

/// The database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: SqlitePool,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    infra TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    message TEXT,
    supervisor_pid INTEGER,
    heartbeat_ms INTEGER,
    dir TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    running_ms INTEGER,
    ended_ms INTEGER,
    options TEXT NOT NULL DEFAULT '{}',
    infra_order TEXT NOT NULL DEFAULT '',
    placement TEXT,
    gang_ms INTEGER,
    recovering_ms INTEGER,
    recoveries INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_name ON jobs (name, created_ms);
CREATE TABLE IF NOT EXISTS units (
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    component TEXT NOT NULL,
    replica INTEGER NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    restarts_on_errors INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL,
    handle TEXT,
    hosts TEXT,
    exit_code INTEGER,
    message TEXT,
    priority INTEGER NOT NULL,
    cpus REAL NOT NULL,
    infra TEXT NOT NULL,
    started_ms INTEGER,
    running_ms INTEGER,
    ended_ms INTEGER,
    deadline_ms INTEGER,
    discovered INTEGER NOT NULL DEFAULT 0,
    ready_ms INTEGER,
    PRIMARY KEY (job_id, component, replica)
);
";

/// Columns added to `jobs` after its first version, with their definitions: a database
/// made by an earlier version gets them when opened.
const ADDED_JOB_COLUMNS: &[(&str, &str)] = &[
    ("infra_order", "TEXT NOT NULL DEFAULT ''"),
    ("placement", "TEXT"),
    ("gang_ms", "INTEGER"),
    ("recovering_ms", "INTEGER"),
    ("recoveries", "INTEGER NOT NULL DEFAULT 0"),
];

/// A row's `infra`: a name this version does not know is [`StateError::Unknown`].
fn infra(row: &sqlx::sqlite::SqliteRow) -> Result<InfraKind, StateError> {
    let text: String = row.try_get("infra")?;
    text.parse().map_err(|_| StateError::Unknown(text))
}

fn job(row: &sqlx::sqlite::SqliteRow) -> Result<JobRecord, StateError> {
    Ok(JobRecord {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        infra: infra(row)?,
        spec: row.try_get("spec")?,
        state: row.try_get::<String, _>("state")?.parse()?,
        cancel_requested: row.try_get::<i64, _>("cancel_requested")? != 0,
        message: row.try_get("message")?,
        supervisor_pid: row.try_get("supervisor_pid")?,
        heartbeat_ms: row.try_get("heartbeat_ms")?,
        dir: row.try_get("dir")?,
        created_ms: row.try_get("created_ms")?,
        running_ms: row.try_get("running_ms")?,
        ended_ms: row.try_get("ended_ms")?,
        options: row.try_get("options")?,
        infra_order: row
            .try_get::<String, _>("infra_order")?
            .split(',')
            .filter(|k| !k.is_empty())
            .map(|k| k.parse().map_err(|_| StateError::Unknown(k.to_owned())))
            .collect::<Result<_, _>>()?,
        placement: row.try_get("placement")?,
        gang_ms: row.try_get("gang_ms")?,
        recovering_ms: row.try_get("recovering_ms")?,
        recoveries: row.try_get::<i64, _>("recoveries")? as u32,
    })
}

fn unit(row: &sqlx::sqlite::SqliteRow) -> Result<UnitRecord, StateError> {
    Ok(UnitRecord {
        job_id: row.try_get("job_id")?,
        component: row.try_get("component")?,
        replica: row.try_get::<i64, _>("replica")? as u32,
        attempt: row.try_get::<i64, _>("attempt")? as u32,
        restarts_on_errors: row.try_get::<i64, _>("restarts_on_errors")? as u32,
        state: row.try_get::<String, _>("state")?.parse()?,
        handle: row.try_get("handle")?,
        hosts: row.try_get("hosts")?,
        exit_code: row
            .try_get::<Option<i64>, _>("exit_code")?
            .map(|c| c as i32),
        message: row.try_get("message")?,
        priority: row.try_get::<i64, _>("priority")? as i32,
        cpus: row.try_get("cpus")?,
        infra: infra(row)?,
        started_ms: row.try_get("started_ms")?,
        running_ms: row.try_get("running_ms")?,
        ended_ms: row.try_get("ended_ms")?,
        deadline_ms: row.try_get("deadline_ms")?,
        discovered: row.try_get::<i64, _>("discovered")? != 0,
        ready_ms: row.try_get("ready_ms")?,
    })
}

/// A change to one unit's row; `None` leaves a column as it is.
#[derive(Debug, Clone, Default)]
pub struct UnitUpdate {
    /// New state.
    pub state: Option<UnitState>,
    /// New attempt.
    pub attempt: Option<u32>,
    /// New count of restarts on errors.
    pub restarts_on_errors: Option<u32>,
    /// New handle (`Some(None)` clears it).
    pub handle: Option<Option<String>>,
    /// New hosts.
    pub hosts: Option<Option<String>>,
    /// New exit code.
    pub exit_code: Option<Option<i32>>,
    /// New message.
    pub message: Option<Option<String>>,
    /// New submit time.
    pub started_ms: Option<Option<i64>>,
    /// New running time.
    pub running_ms: Option<Option<i64>>,
    /// New end time.
    pub ended_ms: Option<Option<i64>>,
    /// New deadline.
    pub deadline_ms: Option<Option<i64>>,
    /// Whether the discovery file is written.
    pub discovered: Option<bool>,
    /// New ready time.
    pub ready_ms: Option<Option<i64>>,
}

impl Store {
    /// Opens (creating) the database at `path`.
    pub async fn open(path: &Path) -> Result<Self, StateError> {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL with NORMAL survives a killed process (not a power cut) without an
            // fsync per write: supervisors write every state change.
            .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        // The schema is made (or brought up to date) on one connection of its own,
        // before the pool opens any: a pooled connection that read the table before
        // an `ALTER TABLE` would keep reading rows of its old width.
        {
            use sqlx::{ConnectOptions, Connection};
            let mut conn = options.connect().await?;
            sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut conn).await?;
            let migrated = migrate(&mut conn).await;
            let end = if migrated.is_ok() {
                "COMMIT"
            } else {
                "ROLLBACK"
            };
            sqlx::raw_sql(end).execute(&mut conn).await?;
            migrated?;
            conn.close().await?;
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        Ok(Self { pool })
    }

    /// Records a new launch and its units (all `pending`).
    pub async fn insert_job(&self, job: &JobRecord, units: &[NewUnit]) -> Result<(), StateError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO jobs (id, name, infra, spec, state, dir, created_ms, options, infra_order, placement) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
            .bind(&job.id)
            .bind(&job.name)
            .bind(job.infra.as_str())
            .bind(&job.spec)
            .bind(job.state.as_str())
            .bind(&job.dir)
            .bind(job.created_ms)
            .bind(&job.options)
            .bind(order_text(&job.infra_order))
            .bind(&job.placement)
            .execute(&mut *tx)
            .await?;
        for (component, replica, priority, cpus) in units {
            sqlx::query("INSERT INTO units (job_id, component, replica, state, priority, cpus, infra) VALUES (?, ?, ?, 'pending', ?, ?, ?)")
                .bind(&job.id)
                .bind(component)
                .bind(i64::from(*replica))
                .bind(i64::from(*priority))
                .bind(*cpus)
                .bind(job.infra.as_str())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// A launch by id.
    pub async fn job(&self, id: &str) -> Result<Option<JobRecord>, StateError> {
        sqlx::query("SELECT * FROM jobs WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job)
            .transpose()
    }

    /// The latest launch named `name` (or whose id is `name`).
    pub async fn job_by_name(&self, name: &str) -> Result<Option<JobRecord>, StateError> {
        sqlx::query("SELECT * FROM jobs WHERE name = ? OR id = ? ORDER BY created_ms DESC LIMIT 1")
            .bind(name)
            .bind(name)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(job)
            .transpose()
    }

    /// Every launch, newest last.
    pub async fn jobs(&self) -> Result<Vec<JobRecord>, StateError> {
        sqlx::query("SELECT * FROM jobs ORDER BY created_ms")
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(job)
            .collect()
    }

    /// A launch's units, in component and replica order of insertion.
    pub async fn units(&self, job_id: &str) -> Result<Vec<UnitRecord>, StateError> {
        sqlx::query("SELECT * FROM units WHERE job_id = ? ORDER BY rowid")
            .bind(job_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(unit)
            .collect()
    }

    /// Sets a launch's state (and its end time when terminal).
    pub async fn set_job_state(
        &self,
        id: &str,
        state: JobState,
        message: Option<&str>,
    ) -> Result<(), StateError> {
        let now = now_ms();
        sqlx::query(
            "UPDATE jobs SET state = ?, message = COALESCE(?, message),
             running_ms = CASE WHEN ? = 'running' AND running_ms IS NULL THEN ? ELSE running_ms END,
             ended_ms = CASE WHEN ? THEN ? ELSE ended_ms END WHERE id = ?",
        )
        .bind(state.as_str())
        .bind(message)
        .bind(state.as_str())
        .bind(now)
        .bind(state.is_terminal())
        .bind(now)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Starts a group recovery: from now every unit is stopped, to start again
    /// together.
    pub async fn begin_group_recovery(
        &self,
        id: &str,
        now: i64,
        message: &str,
    ) -> Result<(), StateError> {
        sqlx::query("UPDATE jobs SET recovering_ms = ?, message = ? WHERE id = ?")
            .bind(now)
            .bind(message)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Ends a group recovery's teardown: the launch is `starting` again, its gang
    /// start counted from `now`.
    pub async fn end_group_recovery(
        &self,
        id: &str,
        now: i64,
        message: &str,
    ) -> Result<(), StateError> {
        sqlx::query(
            "UPDATE jobs SET recovering_ms = NULL, gang_ms = ?, state = 'starting', recoveries = recoveries + 1, message = ? WHERE id = ?",
        )
        .bind(now)
        .bind(message)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Moves a launch whose engine refused or could not place it to `next`: its
    /// units are pending there with nothing started, `placement` gets `note` as a
    /// line, and the gang start is counted from `now`. One transaction.
    pub async fn fail_over(
        &self,
        id: &str,
        next: InfraKind,
        note: &str,
        now: i64,
    ) -> Result<(), StateError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE jobs SET infra = ?, state = 'starting', gang_ms = ?, message = ?,
             placement = CASE WHEN placement IS NULL THEN ? ELSE placement || char(10) || ? END
             WHERE id = ?",
        )
        .bind(next.as_str())
        .bind(now)
        .bind(format!("placing on {next}"))
        .bind(note)
        .bind(note)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE units SET infra = ?, state = 'pending', handle = NULL, hosts = NULL, exit_code = NULL,
             message = ?, started_ms = NULL, running_ms = NULL, ended_ms = NULL, deadline_ms = NULL,
             discovered = 0, ready_ms = NULL, attempt = 0 WHERE job_id = ?",
        )
        .bind(next.as_str())
        .bind(format!("waiting to be placed on {next}"))
        .bind(id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Asks the launch's supervisor to cancel it.
    pub async fn request_cancel(&self, id: &str) -> Result<(), StateError> {
        sqlx::query("UPDATE jobs SET cancel_requested = 1 WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Claims the launch for the supervisor `pid` (and beats its heart).
    pub async fn heartbeat(&self, id: &str, pid: u32) -> Result<(), StateError> {
        sqlx::query("UPDATE jobs SET supervisor_pid = ?, heartbeat_ms = ? WHERE id = ?")
            .bind(i64::from(pid))
            .bind(now_ms())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Forgets a launch.
    pub async fn delete_job(&self, id: &str) -> Result<(), StateError> {
        sqlx::query("DELETE FROM jobs WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Applies `update` to one unit.
    pub async fn update_unit(
        &self,
        job_id: &str,
        component: &str,
        replica: u32,
        update: &UnitUpdate,
    ) -> Result<(), StateError> {
        update_unit(
            &mut *self.pool.acquire().await?,
            job_id,
            component,
            replica,
            update,
        )
        .await
    }

    /// Reserves `cpus` on local for `units` of launch `job_id` (all or none), at
    /// `priority`, out of `capacity`: admitted when they fit beside every active local
    /// unit; else, when stopping lower-priority units (lowest first) frees enough, those
    /// are marked `preempting` and returned; else wait. A unit asking while a
    /// higher-priority one waits also waits, so the higher one is not starved.
    pub async fn admit_local(
        &self,
        job_id: &str,
        units: &[(String, u32)],
        need: f64,
        priority: i32,
        capacity: f64,
    ) -> Result<Admission, StateError> {
        let mut conn = self.pool.acquire().await?;
        // BEGIN IMMEDIATE: the read and the reservation are one step for every
        // supervisor on this machine.
        sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await?;
        let result = admit(&mut conn, job_id, units, need, priority, capacity).await;
        let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
        sqlx::query(end).execute(&mut *conn).await?;
        result
    }
}

/// Creates the tables, and adds the columns later versions added to a database an
/// earlier one made. In the caller's transaction, so processes opening the database at
/// once do it one after the other.
async fn migrate(conn: &mut SqliteConnection) -> Result<(), StateError> {
    sqlx::raw_sql(SCHEMA).execute(&mut *conn).await?;
    let columns: Vec<String> = sqlx::raw_sql("SELECT name FROM pragma_table_info('jobs')")
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| r.try_get("name"))
        .collect::<Result<_, _>>()?;
    for (name, definition) in ADDED_JOB_COLUMNS {
        if !columns.iter().any(|c| c == name) {
            sqlx::raw_sql(&format!("ALTER TABLE jobs ADD COLUMN {name} {definition}"))
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}

/// `infra_order` as stored: kinds, comma-separated.
fn order_text(order: &[InfraKind]) -> String {
    order
        .iter()
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

async fn update_unit(
    conn: &mut SqliteConnection,
    job_id: &str,
    component: &str,
    replica: u32,
    u: &UnitUpdate,
) -> Result<(), StateError> {
    let mut sets = Vec::new();
    macro_rules! set {
        ($field:ident) => {
            if u.$field.is_some() {
                sets.push(concat!(stringify!($field), " = ?"));
            }
        };
    }
    set!(state);
    set!(attempt);
    set!(restarts_on_errors);
    set!(handle);
    set!(hosts);
    set!(exit_code);
    set!(message);
    set!(started_ms);
    set!(running_ms);
    set!(ended_ms);
    set!(deadline_ms);
    set!(discovered);
    set!(ready_ms);
    if sets.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "UPDATE units SET {} WHERE job_id = ? AND component = ? AND replica = ?",
        sets.join(", ")
    );
    let mut q = sqlx::query(&sql);
    if let Some(v) = u.state {
        q = q.bind(v.as_str());
    }
    if let Some(v) = u.attempt {
        q = q.bind(i64::from(v));
    }
    if let Some(v) = u.restarts_on_errors {
        q = q.bind(i64::from(v));
    }
    if let Some(v) = &u.handle {
        q = q.bind(v.clone());
    }
    if let Some(v) = &u.hosts {
        q = q.bind(v.clone());
    }
    if let Some(v) = u.exit_code {
        q = q.bind(v.map(i64::from));
    }
    if let Some(v) = &u.message {
        q = q.bind(v.clone());
    }
    for v in [u.started_ms, u.running_ms, u.ended_ms, u.deadline_ms]
        .into_iter()
        .flatten()
    {
        q = q.bind(v);
    }
    if let Some(v) = u.discovered {
        q = q.bind(v);
    }
    if let Some(v) = u.ready_ms {
        q = q.bind(v);
    }
    q.bind(job_id)
        .bind(component)
        .bind(i64::from(replica))
        .execute(conn)
        .await?;
    Ok(())
}

async fn admit(
    conn: &mut SqliteConnection,
    job_id: &str,
    units: &[(String, u32)],
    need: f64,
    priority: i32,
    capacity: f64,
) -> Result<Admission, StateError> {
    let active: Vec<UnitRecord> = sqlx::query(
        "SELECT * FROM units WHERE infra = 'local' AND state IN ('starting', 'running', 'preempting', 'stopping') AND cpus > 0",
    )
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(unit)
    .collect::<Result<_, _>>()?;
    let used: f64 = active.iter().map(|u| u.cpus).sum();
    let free = capacity - used;
    let waiting_higher: i64 = sqlx::query(
        "SELECT COUNT(*) FROM units u JOIN jobs j ON j.id = u.job_id
         WHERE u.infra = 'local' AND u.state IN ('pending', 'preempted') AND u.cpus > 0
           AND u.priority > ? AND u.job_id != ? AND j.cancel_requested = 0
           AND j.state NOT IN ('succeeded', 'failed', 'cancelled', 'stopping')",
    )
    .bind(i64::from(priority))
    .bind(job_id)
    .fetch_one(&mut *conn)
    .await?
    .try_get(0)?;
    if need <= free + 1e-9 && waiting_higher == 0 {
        let now = now_ms();
        for (component, replica) in units {
            update_unit(
                conn,
                job_id,
                component,
                *replica,
                &UnitUpdate {
                    state: Some(UnitState::Starting),
                    started_ms: Some(Some(now)),
                    ..Default::default()
                },
            )
            .await?;
        }
        return Ok(Admission::Admitted);
    }
    // Room is already being made (a victim still stopping): wait for it.
    let freeing: f64 = active
        .iter()
        .filter(|u| u.state == UnitState::Preempting)
        .map(|u| u.cpus)
        .sum();
    if need <= free + freeing + 1e-9 {
        return Ok(Admission::Wait { need, free });
    }
    let mut victims: Vec<UnitRecord> = active
        .into_iter()
        .filter(|u| u.state == UnitState::Running && u.priority < priority)
        .collect();
    victims.sort_by_key(|u| u.priority);
    let mut freed = free + freeing;
    let mut chosen = Vec::new();
    for v in victims {
        if need <= freed + 1e-9 {
            break;
        }
        freed += v.cpus;
        chosen.push(v);
    }
    if need > freed + 1e-9 {
        return Ok(Admission::Wait { need, free });
    }
    for v in &chosen {
        update_unit(
            conn,
            &v.job_id,
            &v.component,
            v.replica,
            &UnitUpdate {
                state: Some(UnitState::Preempting),
                message: Some(Some(format!(
                    "preempted for a unit of priority {priority} of launch {job_id}"
                ))),
                ..Default::default()
            },
        )
        .await?;
    }
    Ok(Admission::Preempt(chosen))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database an earlier version made (no failover or group-recovery columns) opens,
    /// gains them, and its launches read back.
    #[tokio::test]
    async fn an_earlier_versions_database_gains_the_new_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jobs.db");
        {
            let options = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true);
            let pool = SqlitePool::connect_with(options).await.unwrap();
            sqlx::raw_sql(
                "CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, infra TEXT NOT NULL,
                 spec TEXT NOT NULL, state TEXT NOT NULL, cancel_requested INTEGER NOT NULL DEFAULT 0,
                 message TEXT, supervisor_pid INTEGER, heartbeat_ms INTEGER, dir TEXT NOT NULL,
                 created_ms INTEGER NOT NULL, running_ms INTEGER, ended_ms INTEGER,
                 options TEXT NOT NULL DEFAULT '{}');
                 INSERT INTO jobs (id, name, infra, spec, state, dir, created_ms)
                 VALUES ('old-1', 'old', 'slurm', 'name: old\nrun: x\n', 'running', '/tmp/old', 5);",
            )
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
        for _ in 0..2 {
            // Twice: the second open finds the columns there.
            let store = Store::open(&path).await.unwrap();
            let job = store.job("old-1").await.unwrap().unwrap();
            assert_eq!(job.infra, InfraKind::Slurm);
            assert!(job.infra_order.is_empty());
            assert_eq!(job.next_infra(), None);
            assert_eq!((job.recoveries, job.gang_started_ms()), (0, 5));
            assert_eq!(job.placement, None);
        }
    }
}
