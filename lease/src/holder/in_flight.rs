//! An acquisition the engine stopped waiting for, followed to its end.

use super::LockConfig;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, timeout};
use tokio_util::sync::DropGuard;

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, Driver};
use crate::error::Result;

/// An acquisition sent to the backend, whose answer the engine has not had yet.
pub(super) type Attempt = Pin<Box<dyn Future<Output = Result<Acquire>> + Send>>;

/// An acquisition the engine stopped waiting for (its budget ran out, or the engine stopped).
/// The backend may still carry it out: a statement already handed to SQLite's worker, a
/// command already on the wire. The engine's next campaign step waits for it rather than
/// sending another; if the engine ends first, it is followed to its end in the background and
/// a lease it took is released, so that nobody is left holding the lock for nobody (until its
/// lease runs out) and a retry by the same identity does not meet its own earlier attempt.
pub(super) struct InFlight {
    pub(super) attempt: Option<Attempt>,
    pub(super) sent: Instant,
    pub(super) sent_boot: BootInstant,
    /// The permit the attempt is for, and its backend lock name ([`LockConfig::permit_name`]).
    pub(super) permit: u32,
    pub(super) lock: String,
    pub(super) driver: Arc<dyn Driver>,
    /// The identity the attempt is for, to leave the queue if it took a place.
    pub(super) config: Arc<LockConfig>,
    /// How long the follow-up waits for the attempt before giving up on it.
    pub(super) patience: Duration,
    pub(super) settled: Arc<DropGuard>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(attempt) = self.attempt.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (driver, config, lock, patience, settled) = (
            self.driver.clone(),
            self.config.clone(),
            std::mem::take(&mut self.lock),
            self.patience,
            self.settled.clone(),
        );
        runtime.spawn(async move {
            let _settled = settled;
            match timeout(patience, attempt).await {
                Ok(Ok(Acquire::Acquired(lease))) => {
                    tracing::debug!(lock = %lease.lock, token = lease.token,
                        "an acquisition answered too late took the lock; releasing it");
                    let _ = timeout(patience, driver.release(&lease)).await;
                }
                // Nobody waits for it: a place it took in a fair queue (etcd, ZooKeeper) after
                // the wait ended, and so after the engine left the queue, is left too, rather
                // than standing first in line for four leases.
                _ => {
                    let _ = timeout(patience, driver.abandon(&lock, &config.identity)).await;
                }
            }
        });
    }
}
