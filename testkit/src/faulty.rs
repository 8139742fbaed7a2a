//! A driver wrapper that injects the faults a real network and scheduler produce: renewals that
//! never come back (a partitioned or paused holder), a client cut off from the backend
//! altogether, calls or answers that arrive late, and leases the backend counts from before
//! their acquisition was sent.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use leasehold_lease::Result;
use leasehold_lease::{Acquire, Backend, Driver, Holding, Lease, Upkeep};

pub struct FaultyDriver {
    inner: Arc<dyn Backend>,
    stall_renewals: AtomicBool,
    fail_renewals: AtomicBool,
    renewal_answer_stall_ms: AtomicU64,
    cut_off: AtomicBool,
    request_delay_ms: AtomicU64,
    response_delay_ms: AtomicU64,
    counted_earlier_ms: AtomicU64,
    /// Every acquisition and renewal counted from this much before its call was sent.
    all_counted_earlier_ms: AtomicU64,
    /// How many renewals the backend was asked for.
    renewals: AtomicU64,
    /// How many times a change feed was asked for (a waiter's subscription).
    subscriptions: AtomicU64,
    /// The leases counted early (lock, token) and not renewed since.
    counted_early: Mutex<HashSet<(String, u64)>>,
    /// How many acquisitions the backend answered, by lock and identity.
    answered: Mutex<HashMap<(String, String), u64>>,
    /// How many releases the backend answered.
    releases: watch::Sender<u64>,
    deprovision_delay_ms: AtomicU64,
    /// How many deletions of a holding's records the backend has carried out.
    deprovisions_made: Arc<watch::Sender<u64>>,
    /// The acquisitions by identities ending so whose answers come late, and how late.
    answers_delayed_to: Mutex<Option<(String, Duration)>>,
    /// How many answers to those acquisitions the backend has given (and holds back).
    delayed_answers: watch::Sender<u64>,
}

impl FaultyDriver {
    pub fn wrap(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            stall_renewals: AtomicBool::new(false),
            fail_renewals: AtomicBool::new(false),
            renewal_answer_stall_ms: AtomicU64::new(0),
            cut_off: AtomicBool::new(false),
            request_delay_ms: AtomicU64::new(0),
            response_delay_ms: AtomicU64::new(0),
            counted_earlier_ms: AtomicU64::new(0),
            all_counted_earlier_ms: AtomicU64::new(0),
            renewals: AtomicU64::new(0),
            subscriptions: AtomicU64::new(0),
            counted_early: Mutex::new(HashSet::new()),
            answered: Mutex::new(HashMap::new()),
            releases: watch::Sender::new(0),
            deprovision_delay_ms: AtomicU64::new(0),
            deprovisions_made: Arc::new(watch::Sender::new(0)),
            answers_delayed_to: Mutex::new(None),
            delayed_answers: watch::Sender::new(0),
        })
    }

    /// How many acquisitions of `lock` by `identity` the backend has answered (taken, refused
    /// or failed): a fair queue's place stands once one has been.
    pub fn answered(&self, lock: &str, identity: &str) -> u64 {
        let answered = self.answered.lock().unwrap_or_else(|e| e.into_inner());
        answered
            .get(&(lock.to_owned(), identity.to_owned()))
            .copied()
            .unwrap_or(0)
    }

    /// How many releases the backend has answered, told as each answer comes back, before the
    /// release's caller reads it: a task waiting here runs before the caller goes on.
    pub fn releases(&self) -> watch::Receiver<u64> {
        self.releases.subscribe()
    }

    /// How many times an engine has subscribed to the lock's release notices.
    pub fn subscriptions(&self) -> u64 {
        self.subscriptions.load(Ordering::SeqCst)
    }

    /// From now on, renewals hang (the request may or may not have reached the backend).
    pub fn stall_renewals(&self, stall: bool) {
        self.stall_renewals.store(stall, Ordering::SeqCst);
    }

    /// From now on, the backend refuses renewals with an error (a statement failing mid
    /// failover), until told otherwise: the holder cannot tell whether it still holds.
    pub fn fail_renewals(&self, fail: bool) {
        self.fail_renewals.store(fail, Ordering::SeqCst);
    }

    /// The next renewal, once the backend has answered it, stops the thread that runs it for
    /// `stall` before its caller reads the answer: a paused process or a throttled container,
    /// whose engine reads an answer that had arrived in time only after its claim ran out.
    pub fn stall_next_renewal_answer(&self, stall: Duration) {
        self.renewal_answer_stall_ms
            .store(stall.as_millis() as u64, Ordering::SeqCst);
    }

    /// From now on, every call hangs before it reaches the backend, as behind a partition: the
    /// holder can neither renew nor take the lock again.
    pub fn cut_off(&self, cut: bool) {
        self.cut_off.store(cut, Ordering::SeqCst);
    }

    /// From now on, every call reaches the backend this much later than it was made: a call
    /// dropped meanwhile is never made.
    pub fn delay_requests(&self, delay: Duration) {
        self.request_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    async fn unless_cut_off(&self) {
        if self.cut_off.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let ms = self.request_delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// From now on, a deletion of a lock's records reaches the backend this much later than it
    /// was made: one of a lock's holding (`deprovision_held`) is on the wire by then, and is
    /// carried out late whether or not its caller still waits (a stalled clean-up, a request
    /// held up in the network); a deletion of locks (`deprovision`) dropped meanwhile is never
    /// made.
    pub fn delay_deprovisions(&self, delay: Duration) {
        self.deprovision_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// How many deletions of a holding's records (`deprovision_held`) the backend has carried
    /// out, late ones included.
    pub fn deprovisions_made(&self) -> watch::Receiver<u64> {
        self.deprovisions_made.subscribe()
    }

    async fn deprovision_delay(&self) {
        let ms = self.deprovision_delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }

    /// From now on, an acquisition by an identity ending with `suffix` (a read-write family's
    /// probes end with " probe") is carried out at once, and its answer reaches the caller
    /// `delay` later: a caller dropped meanwhile never reads it.
    pub fn delay_answers_to(&self, suffix: &str, delay: Duration) {
        *self
            .answers_delayed_to
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((suffix.to_owned(), delay));
    }

    /// How many answers [`FaultyDriver::delay_answers_to`] has held back so far.
    pub fn delayed_answers(&self) -> watch::Receiver<u64> {
        self.delayed_answers.subscribe()
    }

    /// Deliver every answer this much later than the backend gave it.
    pub fn delay_responses(&self, delay: Duration) {
        self.response_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// From now on, the backend counts each lease acquired from this much before its call was
    /// sent, until it is renewed: as PostgreSQL counts a waiter's row, taken in its blocking
    /// statement a while before its engine claims it.
    pub fn count_acquisitions_earlier(&self, by: Duration) {
        self.counted_earlier_ms
            .store(by.as_millis() as u64, Ordering::SeqCst);
    }

    /// From now on, the backend counts every lease, acquired or renewed, from this much before
    /// its call was sent: as a Sentinel majority's answer or a ZooKeeper session's last sign of
    /// life dates it.
    pub fn count_every_call_earlier(&self, by: Duration) {
        self.all_counted_earlier_ms
            .store(by.as_millis() as u64, Ordering::SeqCst);
    }

    /// How many renewals the backend has been asked for.
    pub fn renewals(&self) -> u64 {
        self.renewals.load(Ordering::SeqCst)
    }

    fn counted_early(&self) -> std::sync::MutexGuard<'_, HashSet<(String, u64)>> {
        self.counted_early.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn delay(&self) {
        let ms = self.response_delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

#[async_trait]
impl Driver for FaultyDriver {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        self.unless_cut_off().await;
        let outcome = self.inner.try_acquire(lock, identity, ttl).await;
        *self
            .answered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((lock.to_owned(), identity.to_owned()))
            .or_default() += 1;
        if let Ok(Acquire::Acquired(lease)) = &outcome
            && self.counted_earlier_ms.load(Ordering::SeqCst) > 0
        {
            self.counted_early()
                .insert((lease.lock.clone(), lease.token));
        }
        let delayed = self
            .answers_delayed_to
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|(suffix, _)| identity.ends_with(suffix.as_str()))
            .map(|(_, delay)| *delay);
        if let Some(delay) = delayed {
            self.delayed_answers.send_modify(|n| *n += 1);
            tokio::time::sleep(delay).await;
        }
        self.delay().await;
        outcome
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        if self.stall_renewals.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.unless_cut_off().await;
        self.renewals.fetch_add(1, Ordering::SeqCst);
        if self.fail_renewals.load(Ordering::SeqCst) {
            return Err(leasehold_lease::Error::Backend(
                "renewal refused (a fault of the test's)".into(),
            ));
        }
        let outcome = self.inner.renew(lease, ttl).await;
        let stall = self.renewal_answer_stall_ms.swap(0, Ordering::SeqCst);
        if stall > 0 {
            // Blocking on purpose: the whole task stops, timers and all, as in a paused process.
            std::thread::sleep(Duration::from_millis(stall));
        }
        self.counted_early()
            .remove(&(lease.lock.clone(), lease.token));
        self.delay().await;
        outcome
    }

    fn counted_from(
        &self,
        lease: &Lease,
        sent: leasehold_lease::boot_clock::BootInstant,
    ) -> leasehold_lease::boot_clock::BootInstant {
        let counted_from = self.inner.counted_from(lease, sent)
            - Duration::from_millis(self.all_counted_earlier_ms.load(Ordering::SeqCst));
        let key = (lease.lock.clone(), lease.token);
        if self.counted_early().contains(&key) {
            let earlier = self.counted_earlier_ms.load(Ordering::SeqCst);
            return counted_from - Duration::from_millis(earlier);
        }
        counted_from
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        self.unless_cut_off().await;
        let released = self.inner.release(lease).await;
        self.releases.send_modify(|count| *count += 1);
        released
    }

    fn enforced_lease(&self, lock: &str) -> Option<Duration> {
        self.inner.enforced_lease(lock)
    }

    async fn abandon(&self, lock: &str, identity: &str) {
        self.inner.abandon(lock, identity).await
    }

    fn keeps_queue(&self) -> bool {
        self.inner.keeps_queue()
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        self.unless_cut_off().await;
        self.inner.observe(lock).await
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        self.subscriptions.fetch_add(1, Ordering::SeqCst);
        self.inner.changes(lock)
    }

    fn poll_interval(&self, renew_interval: Duration) -> Duration {
        self.inner.poll_interval(renew_interval)
    }

    fn expiry_is_observed(&self) -> bool {
        self.inner.expiry_is_observed()
    }

    async fn ping(&self) -> Result<()> {
        self.unless_cut_off().await;
        self.inner.ping().await
    }
}

#[async_trait]
impl Upkeep for FaultyDriver {
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        self.deprovision_delay().await;
        self.inner.deprovision(locks).await
    }

    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        let ms = self.deprovision_delay_ms.load(Ordering::SeqCst);
        let (inner, lease, made) = (
            self.inner.clone(),
            lease.clone(),
            self.deprovisions_made.clone(),
        );
        let on_the_wire = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let deleted = inner.deprovision_held(&lease).await;
            made.send_modify(|count| *count += 1);
            deleted
        });
        on_the_wire
            .await
            .unwrap_or_else(|e| Err(leasehold_lease::Error::Backend(e.to_string())))
    }

    async fn forget_idle_keys(&self, family: &str, idle_for: Duration) -> Result<u64> {
        self.unless_cut_off().await;
        self.inner.forget_idle_keys(family, idle_for).await
    }

    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        self.unless_cut_off().await;
        self.inner.count_held_keys(family).await
    }
}
