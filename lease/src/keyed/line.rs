//! First come, first served among a semaphore's waiters, on a backend that keeps a queue (etcd,
//! ZooKeeper; docs/semaphores.md).
//!
//! Each permit is a fair-queue lock of its own. A waiter kept in one permit's line would miss
//! the others, and every waiter kept in every line would hold places on all of them. Instead,
//! waiters line up for the key's *line*, a lock of its own (`KEY#q`, a name no key can have): in
//! the order they asked within a pod (the line's local slot), each pod's first in the backend's
//! order (a pod keeps one place per line). Only the first in line waits for a permit. It keeps a
//! place in the line of every permit it tries ([`InLine::Keep`]), so a permit given up goes to
//! it next, and a newcomer's attempt, placed behind it, is refused. Once it holds a permit, it leaves the other permits' lines and gives
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
        let not_taken = |refused: Option<KeyAnswer>| {
            refused.unwrap_or(KeyAnswer::HeldByAnother { holder: None })
        };
        // This pod's releases of any permit of the key; the state is kept while watched.
        let own_key = StateInUse::new(&self.inner, key);
        let mut given_up = own_key.given_up_notices();
        let renew_interval = self.read_config(|c| c.renew_interval);
        // Lining up, and again should the line be lost while this owner stands first in it.
        loop {
            // The owner's earlier turn in line (of a call of its that hung up, or of one running
            // beside this one) is given back first: its release wakes this pod's waiters.
            while self.holding_on(key, LINE, owner).is_some() && Instant::now() < deadline {
                let nap_until = deadline.min(Instant::now() + renew_interval / 2);
                let _ = tokio::time::timeout_at(nap_until, super::changed(&mut given_up)).await;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(not_taken(refused));
            }
            // Held until the wait ends at the latest. Not re-entrant: two calls of one owner at
            // once would both stand first.
            let line = self.take_part(key, LINE, owner, left, left, false).await?;
            let token = match line {
                KeyAnswer::Held { token, .. } => token,
                // Its holder is a waiter, not a permit's holder: the permits' refusal tells more.
                KeyAnswer::HeldByAnother { .. } | KeyAnswer::NotHeld => {
                    return Ok(not_taken(refused));
                }
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
            let mut places = Places::new(self.qualified(owner), renew_interval);
            let taken = loop {
                if !self.holds_line(key, owner, token) {
                    break None;
                }
                let round = Instant::now();
                let driver = self.driver();
                let mut notices = self.permit_notices(key, &*driver);
                let permits = self.read_config(|c| c.permits);
                places
                    .keep_only(&driver, (0..permits).map(|p| self.permit_name(key, p)))
                    .await;
                // Each attempt is waited for up to a lease, so as not to leave the place it
                // made (holder/engine.rs), but the round not past the wait (a round begun as the
                // wait ends gets a renew interval): the places are left then anyway, and an
                // answer still awaited is followed up in the background.
                let round_taken = tokio::time::timeout_at(
                    deadline.max(round + renew_interval),
                    self.permit_round(key, owner, first, hold, reentrant, InLine::Keep),
                )
                .await;
                // The driver or the count may have changed during the round.
                let permits = self.read_config(|c| c.permits);
                places.add(
                    &self.driver(),
                    (0..permits).map(|p| self.permit_name(key, p)),
                );
                let Ok(round_taken) = round_taken else {
                    break Some(not_taken(refused.take()));
                };
                match round_taken? {
                    Ok(held) => break Some(held),
                    Err(answer) => refused = Some(answer),
                }
                if Instant::now() >= deadline {
                    break Some(not_taken(refused.take()));
                }
                self.nap_for_permits(&mut notices, &mut given_up, round, deadline, InLine::Keep)
                    .await;
            };
            // The places first, so that the next in line does not stand behind them; on a task
            // of its own, so that a client hanging up cannot cut the leaving short. The answer
            // waits for it: the owner's next acquisition must not find this line still held.
            let leaving = async move {
                places.leave().await;
                line_held.give_back().await;
            };
            // A permit taken for a client that hangs up meanwhile is given back.
            let mut permit_held = Taken::new(self, owner);
            if let Some(KeyAnswer::Held { permit, token, .. }) = &taken {
                permit_held.keys.push((
                    key.to_owned(),
                    Taking {
                        permit: *permit,
                        token: *token,
                    },
                ));
            }
            let _ = tokio::spawn(leaving).await;
            if let Some(answer) = taken {
                let answer = self.answered_now(key, owner, answer);
                // Not told as held (the backend could not confirm it meanwhile): given back,
                // rather than kept for an owner who does not know it holds.
                if matches!(answer, KeyAnswer::Held { .. }) {
                    permit_held.keep();
                } else {
                    permit_held.give_back().await;
                }
                return Ok(answer);
            }
        }
    }

    /// `answer`, a permit taken a while ago, as it stands now: its validity is measured as the
    /// answer goes out, not as the permit was taken.
    fn answered_now(&self, key: &str, owner: &str, answer: KeyAnswer) -> KeyAnswer {
        let KeyAnswer::Held { permit, token, .. } = answer else {
            return answer;
        };
        match self.holding_taken(key, permit, owner, token) {
            Some(holding) => self.answer_for(&holding, holding.lock.answer()),
            None => KeyAnswer::NotHeld,
        }
    }

    /// Whether `owner` still holds `key`'s line with `token`: a line whose lease was lost has
    /// another first waiter by now.
    fn holds_line(&self, key: &str, owner: &str, token: u64) -> bool {
        self.holding_taken(key, LINE, owner, token).is_some()
    }
}

/// The places the first in line keeps in permits' lines, left when it is done: on a task of
/// its own, so that a client hanging up meanwhile cannot leave a place standing first in line
/// for nobody. A place where the owner holds the permit is not touched ([`crate::Driver::abandon`]).
struct Places {
    identity: String,
    /// Each place, with the driver it was taken through: one replaced meanwhile (new
    /// credentials) has places of its own.
    entries: Vec<(Arc<dyn Backend>, String)>,
    /// How long leaving one place may take: one left standing goes by itself once nobody
    /// comes back to it (the driver's own abandonment).
    budget: Duration,
}

impl Places {
    fn new(identity: String, budget: Duration) -> Self {
        Self {
            identity,
            entries: Vec::new(),
            budget,
        }
    }

    /// Places may be taken through `driver` on `locks` (each permit's backend name).
    fn add(&mut self, driver: &Arc<dyn Backend>, locks: impl Iterator<Item = String>) {
        for lock in locks {
            if !self
                .entries
                .iter()
                .any(|(d, l)| Arc::ptr_eq(d, driver) && *l == lock)
            {
                self.entries.push((driver.clone(), lock));
            }
        }
    }

    /// Places may be kept from now on through `driver` on `locks`, and on nothing else: those
    /// taken through a driver replaced since, or on a permit above a lowered count, are left
    /// now, since nobody comes back to them. They stay listed until left, so that a caller
    /// dropped meanwhile leaves them all.
    async fn keep_only(&mut self, driver: &Arc<dyn Backend>, locks: impl Iterator<Item = String>) {
        let locks: Vec<String> = locks.collect();
        let kept =
            |(d, l): &(Arc<dyn Backend>, String)| Arc::ptr_eq(d, driver) && locks.contains(l);
        let stale: Vec<(Arc<dyn Backend>, String)> =
            self.entries.iter().filter(|e| !kept(e)).cloned().collect();
        if !stale.is_empty() {
            let _ = tokio::spawn(leave(stale, self.identity.clone(), self.budget)).await;
        }
        self.entries.retain(kept);
        self.add(driver, locks.into_iter());
    }

    fn leaving(&mut self) -> impl Future<Output = ()> + Send + 'static {
        leave(
            std::mem::take(&mut self.entries),
            self.identity.clone(),
            self.budget,
        )
    }

    async fn leave(mut self) {
        self.leaving().await;
    }
}

impl Drop for Places {
    fn drop(&mut self) {
        if self.entries.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(self.leaving());
        }
    }
}

/// Leave `identity`'s places, each within `budget`.
async fn leave(entries: Vec<(Arc<dyn Backend>, String)>, identity: String, budget: Duration) {
    let leaving = entries
        .iter()
        .map(|(driver, lock)| tokio::time::timeout(budget, driver.abandon(lock, &identity)));
    futures_util::future::join_all(leaving).await;
}
