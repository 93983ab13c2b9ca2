//! The state every handler shares.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::sandbox::Providers;
use crate::store::Store;
use crate::stream::EventLog;
use crate::stream::sse::StreamSlots;

/// Shared by every request; cheap to clone.
#[derive(Clone)]
pub struct AppState(pub Arc<Inner>);

impl std::ops::Deref for AppState {
    type Target = Inner;

    fn deref(&self) -> &Inner {
        &self.0
    }
}

pub struct Inner {
    pub config: Config,
    pub store: Arc<dyn Store>,
    /// Appends to durable logs and wakes the SSE streams that follow them.
    pub log: EventLog,
    pub providers: Providers,
    /// Signs page tokens. Kept in the database, so that every server process sharing it
    /// accepts the tokens of the others.
    pub page_key: [u8; 32],
    /// Open SSE streams per principal, for `limits.max_streams_per_principal`.
    pub streams: Arc<StreamSlots>,
    /// Serializes the quota check and insert of sandbox creates, so that concurrent creates
    /// cannot overshoot `limits.max_sandboxes_per_principal`.
    pub create_lock: tokio::sync::Mutex<()>,
    /// Where this server listens, for preview URLs when the request has no Host header.
    pub local_addr: SocketAddr,
    /// Fired at shutdown: open streams end so that connections can close.
    pub shutdown: CancellationToken,
    /// Per process, the last output seq handed to an event stream. Read only by the
    /// `output-lost-on-disconnect` defect.
    pub delivered: Arc<Mutex<HashMap<String, i64>>>,
    /// Test control (TC-9.11): while held, no background expiry changes durable state, so
    /// that a digest comparison sees only what the scenario did.
    pub expiry_hold: ExpiryHold,
}

/// Until when background expiry is held (TC-9.11). A hold ends by itself at that instant,
/// so a client that never releases it cannot stop expiry for good.
#[derive(Default)]
pub struct ExpiryHold {
    until: Mutex<Option<std::time::Instant>>,
    /// Read-held by every expiry pass while it works, so that setting a hold waits for the
    /// passes already under way: once the control answers, nothing expires.
    passes: tokio::sync::RwLock<()>,
}

impl ExpiryHold {
    /// Holds expiry for `duration` from now (zero releases it), once running passes end.
    pub async fn set(&self, duration: std::time::Duration) {
        let _no_pass = self.passes.write().await;
        let until = (!duration.is_zero()).then(|| std::time::Instant::now() + duration);
        *self.until.lock().unwrap_or_else(|e| e.into_inner()) = until;
    }

    /// Leave to run one expiry pass: `None` while expiry is held. Keep the guard until the
    /// pass has written what it expires, and take no other guard meanwhile.
    pub async fn pass(&self) -> Option<tokio::sync::RwLockReadGuard<'_, ()>> {
        let guard = self.passes.read().await;
        let held = self
            .until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|until| std::time::Instant::now() < until);
        (!held).then_some(guard)
    }
}

impl AppState {
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        log: EventLog,
        providers: Providers,
        local_addr: SocketAddr,
        shutdown: CancellationToken,
        page_key: [u8; 32],
    ) -> Self {
        let streams = Arc::new(StreamSlots::new(
            config
                .defects
                .has(crate::defects::Defect::StreamQuotaUnenforced),
        ));
        AppState(Arc::new(Inner {
            config,
            store,
            log,
            providers,
            page_key,
            streams,
            create_lock: tokio::sync::Mutex::new(()),
            local_addr,
            shutdown,
            delivered: Arc::default(),
            expiry_hold: ExpiryHold::default(),
        }))
    }

    /// The scheme this server is reached with.
    pub fn scheme(&self) -> &'static str {
        if self.config.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }
}
