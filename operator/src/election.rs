//! Leader election among operator replicas, on Leasehold's own Kubernetes Lease driver: one
//! replica reconciles, the others wait. A leader that loses its lease stops reconciling at once,
//! because two reconcilers would fight over status, and campaigns again as a standby; every
//! replica serves the webhook throughout.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::boot_clock::BootInstant;
use leasehold_lease::kubernetes::KubernetesLeaseDriver;
use leasehold_lease::{Lock, LockConfig, Mode};

/// The Lease the replicas compete for, in the operator's namespace.
pub const ELECTION_LEASE: &str = "leasehold-operator";
pub const ELECTION_LEASE_DURATION: Duration = Duration::from_secs(15);
pub const ELECTION_RENEW_INTERVAL: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(100);
/// How long a stopping leader's reconciles may take to finish: with the webhook's drain after
/// it, well within the pod's grace period (the chart's `terminationGracePeriodSeconds`, 30 s).
pub const DRAIN_PATIENCE: Duration = Duration::from_secs(15);

/// Start campaigning. The returned lock keeps campaigning until shut down.
pub fn campaign(
    client: kube::Client,
    namespace: &str,
    identity: &str,
) -> leasehold_lease::Result<Lock> {
    let driver = Arc::new(KubernetesLeaseDriver::new(client, namespace));
    let config = LockConfig {
        renew_interval: ELECTION_RENEW_INTERVAL,
        mode: Mode::Campaign,
        ..LockConfig::new(ELECTION_LEASE, identity, ELECTION_LEASE_DURATION)
    };
    Lock::start(driver, config, Arc::new(()))
}

/// Resolves once `lock` is held.
pub async fn elected(lock: &Lock) {
    while !leads(lock) {
        tokio::time::sleep(POLL).await;
    }
}

/// Resolves once `lock` is no longer held (lost, or never renewed in time).
pub async fn deposed(lock: &Lock) {
    while leads(lock) {
        tokio::time::sleep(POLL).await;
    }
}

/// Whether this replica leads: its claim on the Lease stands. A renewal that failed (the API
/// server down a moment, overloaded, restarting) ends nothing while the claim runs: no other
/// replica can take the Lease before the claim ends (each times it from its own sighting), and
/// the next renewal may succeed. Stepping down at the first failure would cut the reconciles
/// short and, elected again a moment later, resync every lock while the API server struggles.
fn leads(lock: &Lock) -> bool {
    let now = BootInstant::now();
    lock.snapshot()
        .held
        .is_some_and(|held| now < held.valid_until)
}

/// How a term of leading ended.
#[derive(Debug, PartialEq, Eq)]
pub enum TermEnd<S> {
    /// The process was told to stop (its signal's name), while still leading.
    Signalled(S),
    /// The replica lost the leadership.
    Deposed,
    /// The controller ended on its own while the replica led (a panic, say): the replica
    /// would keep renewing the Lease and reconcile nothing, so it must hand the leadership over.
    ControllerEnded,
}

/// Reconcile while leading: `reconcile` starts the controller, which runs until its stop is
/// sent. On `signal` it stops gracefully, its reconciles finishing (the replica still leads);
/// on `deposed` at once, its reconciles cut where they are, since the new leader's run by then
/// and two reconcilers would write status and events over each other.
///
/// Stopping, the reconciles finish only while the replica still leads and within `patience`
/// ([`DRAIN_PATIENCE`]): deposed meanwhile, a standby reconciles by then; past the patience, the
/// pod's grace period would run out before the leadership is handed over, and the standby would
/// wait out the whole lease.
pub async fn reconcile_while_leading<S>(
    reconcile: impl FnOnce(tokio::sync::oneshot::Receiver<()>) -> tokio::task::JoinHandle<()>,
    deposed: impl Future<Output = ()>,
    signal: impl Future<Output = S>,
    patience: Duration,
) -> TermEnd<S> {
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let mut controller = reconcile(stopped);
    let mut deposed = std::pin::pin!(deposed);
    let end = tokio::select! {
        signal = signal => TermEnd::Signalled(signal),
        () = &mut deposed => TermEnd::Deposed,
        ended = &mut controller => {
            if let Err(e) = ended {
                tracing::error!(error = %e, "the reconciler failed");
            }
            return TermEnd::ControllerEnded;
        }
    };
    match end {
        TermEnd::Signalled(_) => {
            let _ = stop.send(());
            tokio::select! {
                _ = &mut controller => return end,
                () = &mut deposed => {
                    tracing::warn!("deposed while stopping: the reconciles still running are cut short");
                }
                () = tokio::time::sleep(patience) => {
                    tracing::warn!(?patience, "the reconciles still running when stopping are cut short");
                }
            }
            controller.abort();
        }
        TermEnd::Deposed => controller.abort(),
        // Returned as it ended, above: nothing is left to stop.
        TermEnd::ControllerEnded => return end,
    }
    let _ = controller.await;
    end
}
