//! A client-side limit on the operator's requests to the Kubernetes API, as client-go's QPS
//! and burst: a new leader reconciling thousands of locks, or thousands of locks created at
//! once, would otherwise send every request at once and meet the API server's priority and
//! fairness limits (429s) for itself and for every other client in its priority level.
//!
//! A token bucket that waits rather than refuses: up to `burst` requests go at once, then one
//! every `1 / qps`. The kube client queues requests in front of its service (a buffer with one
//! worker), so the wait in `poll_ready` holds back the queue, never one request among others.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// The API requests the operator may send per second, sustained, and at once after a quiet
/// spell: a new leader of 10,000 locks reconciles them in minutes, not all in a second.
pub const DEFAULT_QPS: u32 = 50;
pub const DEFAULT_BURST: u32 = 100;

/// When each request may go: the generic cell rate algorithm, waiting instead of refusing.
#[derive(Debug, Clone)]
struct Bucket {
    interval: Duration,
    burst: u32,
    /// When the bucket would be full again if nothing more were sent.
    full_at: Instant,
}

impl Bucket {
    fn new(qps: u32, burst: u32) -> Self {
        Self {
            interval: Duration::from_secs(1) / qps.max(1),
            burst: burst.max(1),
            full_at: Instant::now(),
        }
    }

    /// Take a token for a request asked at `now`: the instant it may be sent.
    fn reserve(&mut self, now: Instant) -> Instant {
        self.full_at = self.full_at.max(now) + self.interval;
        (self.full_at - self.interval * self.burst).max(now)
    }
}

/// The [`tower::Layer`] that puts [`ApiRateLimit`] in front of a client's service.
#[derive(Debug, Clone, Copy)]
pub struct ApiRateLimitLayer {
    qps: u32,
    burst: u32,
}

impl ApiRateLimitLayer {
    /// At most `qps` requests a second once `burst` have gone at once (each at least one).
    pub fn new(qps: u32, burst: u32) -> Self {
        Self { qps, burst }
    }
}

impl<S> tower::Layer<S> for ApiRateLimitLayer {
    type Service = ApiRateLimit<S>;

    fn layer(&self, inner: S) -> ApiRateLimit<S> {
        ApiRateLimit {
            inner,
            bucket: Bucket::new(self.qps, self.burst),
            state: Reservation::None,
        }
    }
}

/// Whether the next request has its token yet.
enum Reservation {
    None,
    /// Taken; the request may go at the sleep's end.
    Waiting(Pin<Box<Sleep>>),
    /// Taken, and its time has come.
    Due,
}

pub struct ApiRateLimit<S> {
    inner: S,
    bucket: Bucket,
    state: Reservation,
}

impl<S, R> tower::Service<R> for ApiRateLimit<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let Reservation::None = self.state {
            let now = Instant::now();
            let at = self.bucket.reserve(now);
            self.state = if at > now {
                Reservation::Waiting(Box::pin(tokio::time::sleep_until(at)))
            } else {
                Reservation::Due
            };
        }
        if let Reservation::Waiting(sleep) = &mut self.state {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.state = Reservation::Due;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        // A token is taken in poll_ready, which the Service contract makes come first.
        debug_assert!(
            matches!(self.state, Reservation::Due),
            "called before ready"
        );
        self.state = Reservation::None;
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tower::{Layer, Service, ServiceExt};

    use super::*;

    /// When each of `count` requests, all asked at once, reaches the service behind the limit
    /// (in milliseconds from the start, on a paused clock).
    async fn arrivals(qps: u32, burst: u32, count: usize) -> Vec<u128> {
        let start = Instant::now();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let service = tower::service_fn(move |_: ()| {
            recorded.lock().unwrap().push(start.elapsed().as_millis());
            async { Ok::<_, std::convert::Infallible>(()) }
        });
        let mut limited = ApiRateLimitLayer::new(qps, burst).layer(service);
        for _ in 0..count {
            limited.ready().await.unwrap().call(()).await.unwrap();
        }
        seen.lock().unwrap().clone()
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_goes_at_once_and_the_rest_at_the_rate() {
        let times = arrivals(10, 5, 8).await;
        assert_eq!(times, [0, 0, 0, 0, 0, 100, 200, 300]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_spell_refills_the_burst_and_no_more() {
        let mut bucket = Bucket::new(10, 3);
        let start = Instant::now();
        for _ in 0..3 {
            assert_eq!(bucket.reserve(start), start);
        }
        assert_eq!(bucket.reserve(start), start + Duration::from_millis(100));
        // A second later the bucket is full again (three tokens), not ten.
        let later = start + Duration::from_secs(1);
        let sent: Vec<Instant> = (0..4).map(|_| bucket.reserve(later)).collect();
        assert_eq!(
            sent,
            [later, later, later, later + Duration::from_millis(100)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_steady_rate_below_the_limit_never_waits() {
        let mut bucket = Bucket::new(10, 1);
        let mut now = Instant::now();
        for _ in 0..20 {
            assert_eq!(bucket.reserve(now), now);
            now += Duration::from_millis(100);
        }
    }
}
