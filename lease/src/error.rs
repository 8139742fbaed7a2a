use std::time::Duration;

/// Everything the lease engine can fail with. The variant names double as the `reason` label
/// of the `leasehold_backend_errors_total` metric, so keep them few and stable.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The backend could not be reached, or the connection broke mid-request.
    #[error("backend unreachable: {0}")]
    Unreachable(String),

    /// The backend did not answer within the time the lease could afford to wait.
    #[error("backend did not answer within {0:?}")]
    Timeout(Duration),

    /// The backend answered, but with an error (permissions, busy file, script failure, ...).
    #[error("backend error: {0}")]
    Backend(String),

    /// A backend URL that cannot be used. The message never contains the password.
    #[error("invalid backend URL {url}: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// A lock, table or key name that is not a safe identifier.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        what: &'static str,
        value: String,
        reason: &'static str,
    },

    /// A lock configuration that cannot work; `field` names the setting (`identity`,
    /// `lease-duration`, `renew-interval`) so that callers can point at their own flag or field.
    #[error("invalid {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },

    /// The lock engine task has stopped (the process is shutting down).
    #[error("the lock is shut down")]
    Shutdown,
}

impl Error {
    /// A short, bounded label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Unreachable(_) => "unreachable",
            Error::Timeout(_) => "timeout",
            Error::Backend(_) => "backend",
            Error::InvalidUrl { .. } => "invalid_url",
            Error::InvalidName { .. } => "invalid_name",
            Error::InvalidConfig { .. } => "invalid_config",
            Error::Shutdown => "shutdown",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
