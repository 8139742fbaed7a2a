/// Everything a reconciliation can fail with. The variant names double as the `error` label of
/// `leasehold_operator_reconcile_errors_total`, so keep them few and stable.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API refused or failed a request (status patch, finalizer, event).
    #[error("Kubernetes API: {0}")]
    Kube(#[source] kube::Error),

    /// The lock's backend could not be provisioned or read; the status says why.
    #[error("backend: {0}")]
    Backend(#[source] leasehold_lease::Error),

    /// The finalizer machinery failed (adding or removing it, or the clean-up behind it).
    #[error("finalizer: {0}")]
    Finalizer(String),

    /// A lock being deleted with `cleanupPolicy: Delete` still has a live holder, so its records
    /// stay (and the finalizer with them) until it releases or its lease runs out.
    #[error("clean-up waits: {0}")]
    HolderAlive(String),
}

impl Error {
    pub fn label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Backend(_) => "backend",
            Error::Finalizer(_) => "finalizer",
            Error::HolderAlive(_) => "holder_alive",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
