//! First come, first served among a semaphore's waiters, on a backend that keeps a queue (etcd,
//! ZooKeeper; docs/semaphores.md).
//!
//! Each permit is a fair-queue lock of its own. A waiter kept in one permit's line would miss
//! the others, and every waiter kept in every line would hold places on all of them. Instead,
//! waiters line up for the key's *line*, a lock of its own (`KEY#q`, a name no key can have): in
//! the backend's order across pods, and in the order they asked within a pod. Only the first in
//! line waits for a permit. It keeps a place in the line of every permit it tries
//! ([`InLine::Keep`]), so a permit given up goes to it next, and a newcomer's attempt, placed
//! behind it, is refused. Once it holds a permit, it leaves the other permits' lines and gives
//! the line up to the next waiter.
//!
//! An owner first tries each permit once, as without a line, unless owners of this pod are in
//! line for the key already: a newcomer takes a permit that nobody waits for.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::several::{Taken, Taking};
use super::{InLine, KeyAnswer, KeyError, KeyedFamily, StateInUse, permit_key};
use crate::driver::Backend;

/// The part of a key a semaphore's waiters line up for (the key's local state `KEY#q`).
pub(super) const LINE: u32 = u32::MAX - 1;

impl KeyedFamily {
    /// Take a permit of `key` for `owner` by `deadline`, waiting in the key's line.
    pub(super) async fn take_in_line(
        &self,
        key: &str,
        owner: &str,
        deadline: Instant,
        hold: Duration,
        reentrant: bool,
        first: u32,
    ) -> Result<KeyAnswer, KeyError> {
        let mut refused = None;
        if self.existing(&permit_key(key, LINE)).is_none() {
            match self
                .permit_round(key, owner, first, hold, reentrant, InLine::Leave)
                .await?
            {
                Ok(held) => return Ok(held),
                Err(answer) => refused = Some(answer),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let not_taken = |refused: Option<KeyAnswer>| {
            refused.unwrap_or(KeyAnswer::HeldByAnother { holder: None })
        };
        if left.is_zero() {
            return Ok(not_taken(refused));
        }
        // Held until the wait ends at the latest: the line is given up before the answer.
        let line = self.take_part(key, LINE, owner, left, left, true).await?;
        let token = match line {
            KeyAnswer::Held { token, .. } => token,
            // Its holder is a waiter, not a permit's holder: the permits' refusal tells more.
            KeyAnswer::HeldByAnother { .. } | KeyAnswer::NotHeld => return Ok(not_taken(refused)),
            other => return Ok(other),
        };
        let mut line_held = Taken::new(self, owner);
        line_held.keys.push((
            key.to_owned(),
            Taking {
                permit: LINE,
                token,
            },
        ));
        let renew_interval = self.read_config(|c| c.renew_interval);
        let mut places = Places::new(self.driver(), self.qualified(owner), renew_interval);
        // This pod's releases of any permit of the key; the state is kept while watched.
        let own_key = StateInUse::new(&self.inner, key);
        let mut given_up = own_key.given_up.subscribe();
        let answer = loop {
            let round = Instant::now();
            let driver = self.driver();
            let mut notices = self.permit_notices(key, &*driver);
            let permits = self.read_config(|c| c.permits);
            places.add((0..permits).map(|permit| self.permit_name(key, permit)));
            match self
                .permit_round(key, owner, first, hold, reentrant, InLine::Keep)
                .await?
            {
                Ok(held) => break held,
                Err(answer) => refused = Some(answer),
            }
            if Instant::now() >= deadline {
                break not_taken(refused);
            }
            self.nap_for_permits(&mut notices, &mut given_up, round, deadline)
                .await;
        };
        // The places first, so that the next in line does not stand behind them.
        places.leave().await;
        line_held.give_back().await;
        Ok(answer)
    }
}

/// The places the first in line keeps in permits' lines, left when it is done: on a task of
/// its own, so that a client hanging up meanwhile cannot leave a place standing first in line
/// for nobody. A place where the owner holds the permit is not touched ([`crate::Driver::abandon`]).
struct Places {
    driver: Arc<dyn Backend>,
    identity: String,
    locks: Vec<String>,
    /// How long leaving one place may take: one left standing goes by itself once nobody
    /// comes back to it (the driver's own abandonment).
    budget: Duration,
}

impl Places {
    fn new(driver: Arc<dyn Backend>, identity: String, budget: Duration) -> Self {
        Self {
            driver,
            identity,
            locks: Vec::new(),
            budget,
        }
    }

    /// Permits' backend names where a place may be kept from now on.
    fn add(&mut self, locks: impl Iterator<Item = String>) {
        for lock in locks {
            if !self.locks.contains(&lock) {
                self.locks.push(lock);
            }
        }
    }

    fn leaving(&mut self) -> impl Future<Output = ()> + Send + 'static {
        let (driver, identity, locks, budget) = (
            self.driver.clone(),
            std::mem::take(&mut self.identity),
            std::mem::take(&mut self.locks),
            self.budget,
        );
        async move {
            let leaving = locks
                .iter()
                .map(|lock| tokio::time::timeout(budget, driver.abandon(lock, &identity)));
            futures_util::future::join_all(leaving).await;
        }
    }

    async fn leave(mut self) {
        let _ = tokio::spawn(self.leaving()).await;
    }
}

impl Drop for Places {
    fn drop(&mut self) {
        if self.locks.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(self.leaving());
        }
    }
}
