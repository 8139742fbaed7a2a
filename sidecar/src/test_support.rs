//! What the sidecar's unit tests share: a backend of their own, and a stream's events as its
//! client reads them.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use leasehold_lease::{Backend, BackendUrl};

/// An SQLite backend in `dir`.
pub async fn sqlite_backend(dir: &tempfile::TempDir) -> Arc<dyn Backend> {
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    leasehold_lease::connect(&BackendUrl::parse(&url).unwrap())
        .await
        .unwrap()
}

/// The next event of a server-sent stream's `body`, as its text: within 10 s, or the test fails.
pub async fn next_event(
    body: &mut (impl Stream<Item = Result<axum::body::Bytes, axum::Error>> + Unpin),
) -> String {
    let chunk = tokio::time::timeout(Duration::from_secs(10), body.next())
        .await
        .expect("no event within 10 s")
        .expect("the stream ended")
        .unwrap();
    String::from_utf8_lossy(&chunk).into_owned()
}
