//! Deleting a lock's records from its backend (`cleanupPolicy: Delete`) without a window for two
//! holders.
//!
//! Reading "nobody holds" and then deleting is two steps: a contender that has not yet seen the
//! lock's deletion may take it in between, and the deletion then frees a lock it holds; the next
//! contender takes it at once, while the first still claims until its next renewal. (The safety
//! soak caught exactly that: two holders for 220 ms after a `DistributedLock` was deleted.) So
//! the deletion takes the lock first, through the backend's own exclusion, and deletes only
//! while holding it: whoever takes the lock afterwards takes it alone. Each backend's deletion
//! matches that holding, as a release does ([`crate::driver::Upkeep::deprovision_held`]), so
//! one that lands late frees nobody else's; and it is not sent once the claim that acquisition
//! gave has run out, as a holder writes only within its claim.

use std::time::Duration;

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, Backend, Holding};
use crate::error::{Error, Result};
use crate::holder::safety_margin;

/// Who takes a lock to delete its records, as holders and events name it.
pub const RECORDS_DELETER: &str = "leasehold-operator (deleting the lock's records)";

/// Take `lock` for `lease` and delete its records while holding it: `Ok(None)` when deleted,
/// `Ok(Some(holder))` when another holds it (nothing is deleted; `holder` is `None` where the
/// backend cannot name it yet, e.g. while it waits out a lease a restart may have lost).
pub async fn delete_records(
    driver: &dyn Backend,
    lock: &str,
    lease: Duration,
) -> Result<Option<Option<Holding>>> {
    let sent = BootInstant::now();
    match driver.try_acquire(lock, RECORDS_DELETER, lease).await {
        Ok(Acquire::Acquired(held)) => {
            // Only within the claim the acquisition gave, less the margin every holder keeps
            // (a stalled deleter is a paused holder): past it another may hold the lock, and
            // the deletion would free that holding while it still claims.
            let claim_ends = driver.counted_from(&held, sent) + lease - safety_margin(lease);
            let over = || Error::Timeout(claim_ends.saturating_duration_since(sent));
            let deleted = match claim_ends.remaining() {
                Duration::ZERO => Err(over()),
                left => tokio::time::timeout(left, driver.deprovision_held(&held))
                    .await
                    .unwrap_or_else(|_| Err(over())),
            };
            if let Err(e) = deleted {
                // Not deleted: let go, so that the lock is not blocked for its lease.
                let _ = driver.release(&held).await;
                return Err(e);
            }
            Ok(None)
        }
        Ok(Acquire::Busy(holder)) => {
            // A queue place taken by the attempt (etcd, ZooKeeper) must not stand in line.
            driver.abandon(lock, RECORDS_DELETER).await;
            Ok(Some(holder))
        }
        // Free, but a restart guard withholds it: a holder it may have lost could still claim.
        Ok(Acquire::Withheld(_)) => {
            driver.abandon(lock, RECORDS_DELETER).await;
            Ok(Some(None))
        }
        Err(e) => {
            driver.abandon(lock, RECORDS_DELETER).await;
            Err(e)
        }
    }
}
