//! The session table: capacity, attachment of WebSockets, idle reaping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentstack_protocol::ws::WsError;
use tokio::sync::Mutex as AsyncMutex;

use crate::environment::DynEnvironment;
use crate::spec::EnvSpec;

/// One live environment instance.
pub(crate) struct Session {
    pub id: String,
    pub env: AsyncMutex<Box<dyn DynEnvironment>>,
    /// Milliseconds since the table's epoch at the last message.
    last_active_ms: AtomicU64,
    /// Whether a WebSocket owns or is attached to this session right now.
    pub attached: AtomicBool,
    /// Whether `openenv/session/close` asked to close it once its socket detaches.
    pub close_requested: AtomicBool,
}

/// Every session of a server, bounded by `max`.
pub(crate) struct Sessions {
    map: Mutex<HashMap<String, Arc<Session>>>,
    active: AtomicUsize,
    max: usize,
    epoch: Instant,
}

impl Sessions {
    pub fn new(max: usize) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            active: AtomicUsize::new(0),
            max,
            epoch: Instant::now(),
        }
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Reserves a slot, builds the environment, and registers the session.
    /// `attached` marks it owned by a WebSocket from the start.
    pub fn create(&self, spec: &EnvSpec, attached: bool) -> Result<Arc<Session>, WsError> {
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .map_err(|n| WsError::capacity(n, self.max))?;
        let env = match spec.instantiate() {
            Ok(env) => env,
            Err(message) => {
                self.active.fetch_sub(1, Ordering::AcqRel);
                return Err(WsError::factory(
                    spec.name(),
                    format!("Failed to create environment '{}': {message}", spec.name()),
                ));
            }
        };
        let session = Arc::new(Session {
            id: uuid::Uuid::new_v4().to_string(),
            env: AsyncMutex::new(env),
            last_active_ms: AtomicU64::new(self.now_ms()),
            attached: AtomicBool::new(attached),
            close_requested: AtomicBool::new(false),
        });
        self.lock().insert(session.id.clone(), session.clone());
        Ok(session)
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.lock().get(id).cloned()
    }

    /// Removes a session; its environment is dropped when the last user lets go.
    pub fn remove(&self, id: &str) -> Option<Arc<Session>> {
        let removed = self.lock().remove(id);
        if removed.is_some() {
            self.active.fetch_sub(1, Ordering::AcqRel);
        }
        removed
    }

    pub fn touch(&self, session: &Session) {
        session
            .last_active_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    pub fn idle_for(&self, session: &Session) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(session.last_active_ms.load(Ordering::Relaxed)),
        )
    }

    /// Removes detached sessions idle for longer than `limit`; returns how many.
    /// Sessions with a WebSocket are reaped by their own socket loop.
    pub fn reap_idle(&self, limit: Duration) -> usize {
        let expired: Vec<String> = self
            .lock()
            .values()
            .filter(|s| !s.attached.load(Ordering::Acquire) && self.idle_for(s) > limit)
            .map(|s| s.id.clone())
            .collect();
        expired
            .iter()
            .filter(|id| self.remove(id).is_some())
            .count()
    }

    /// Removes every session (shutdown).
    pub fn clear(&self) {
        let drained: Vec<_> = self.lock().drain().collect();
        self.active.fetch_sub(drained.len(), Ordering::AcqRel);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        // A panic while holding this lock cannot leave the map inconsistent (every
        // operation is a single insert/remove), so a poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}
