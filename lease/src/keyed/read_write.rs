//! Read-write locks on a family's keys (docs/read-write.md): readers share a key, a writer holds
//! it alone.
//!
//! A reader takes one permit of the key, as a semaphore's owner does; a writer takes every
//! permit, so a key of N permits has up to N readers at once, or one writer. Each permit is an
//! ordinary lock of the backend, so exclusion rests on the permits' own guarantees: a writer
//! believes it writes only while it holds every permit, self-fenced, and a reader only while it
//! holds its permit.
//!
//! Before the permits a writer takes the key's *write gate*, a lock of its own (`KEY#w`, a name
//! no key can have). Writers therefore take the permits one at a time, in permit order, and
//! two writers never hold some permits each. A reader asking with `mode=read` waits while any
//! writer holds the gate, so a writer waiting for readers to leave is not overtaken by new
//! ones. A reader past the gate when a writer arrives still takes its permit first.
//!
//! A writer's token is the highest of its permits' tokens. Each permit's tokens rise with its
//! holders, so it is above the token of every earlier holder of any permit: every earlier
//! reader's and writer's.
//!
//! There is no upgrade from read to write: two readers upgrading at once would each wait for
//! the other's permit. An owner that reads and asks to write is refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::several::{Ahead, Taken, Taking, give_back};
use super::{
    KeyAnswer, KeyError, KeyRelease, KeyedFamily, StateInUse, Waiting, changed, check_owner,
};
use crate::holder::Answer;

/// The part of a key a writer takes first: its write gate (the key's local state `KEY#w`).
pub(super) const GATE: u32 = u32::MAX;

/// A writer of this pod holding a key's write lock: the gate and every permit, each with the
/// token it was taken with.
#[derive(Debug)]
pub(super) struct Writer {
    owner: String,
    parts: Vec<Taking>,
}

impl Writer {
    /// The parts as an acquisition of several keys keeps them, to give back.
    fn parts_of(&self, key: &str) -> Vec<(String, Taking)> {
        self.parts
            .iter()
            .map(|taking| (key.to_owned(), *taking))
            .collect()
    }
}

impl KeyedFamily {
    /// Take `key` to write for `owner`: once no other owner, reader or writer, holds any of its
    /// permits, waiting up to `wait`, and keep it at most `hold` unless extended or released.
    /// Re-entrant for the same writer; refused to an owner that reads the key (no upgrade).
    pub async fn acquire_write(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        self.check_key(key)?;
        check_owner(owner)?;
        self.check_running()?;
        if let Some(answer) = self.reenter_write(key, owner, hold, true).await? {
            return Ok(answer);
        }
        if self.owned_permit(key, owner).is_some() {
            return Err(KeyError::BadMode(format!(
                "{owner} reads {key:?} and cannot also write it: release the read first (two readers upgrading at once would each wait for the other)"
            )));
        }
        let deadline = Instant::now() + wait;
        let _waiting = Waiting::new(&self.inner.waiting);
        // Every permit the family has had in this pod: readers kept on permits above a
        // lowered count are waited for too.
        let permits = self
            .read_config(|c| c.permits)
            .max(self.inner.permits_ever.load(Ordering::SeqCst));
        let mut taken = Taken::new(self, owner);
        let kept = std::sync::Mutex::new(Instant::now());
        let looked = AtomicBool::new(true);
        for permit in std::iter::once(GATE).chain(0..permits) {
            let left = deadline.saturating_duration_since(Instant::now());
            let take = self.take_part(key, permit, owner, left, hold, true);
            let ahead = Ahead {
                later: &[],
                looked: &looked,
            };
            let answer = match self
                .take_keeping(take, &taken.keys, &kept, ahead, owner, hold)
                .await
            {
                Ok(answer) => answer,
                Err(e) => {
                    taken.give_back().await;
                    return Err(e);
                }
            };
            let KeyAnswer::Held { token, .. } = answer else {
                taken.give_back().await;
                return Ok(answer);
            };
            taken.keys.push((key.to_owned(), Taking { permit, token }));
        }
        // Every hold runs from now; then the whole is read back, each part held as taken.
        for (key, taking) in &taken.keys {
            let held = Some((taking.permit, taking.token));
            if let Err(e) = self.extend_held(key, owner, hold, held).await {
                taken.give_back().await;
                return Err(e);
            }
        }
        let writer = Arc::new(Writer {
            owner: owner.to_owned(),
            parts: taken.keys.iter().map(|(_, taking)| *taking).collect(),
        });
        let answer = self.parts_answer(key, &writer);
        if !matches!(answer, KeyAnswer::Held { .. }) {
            taken.give_back().await;
            return Ok(answer);
        }
        self.inner
            .writers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_owned(), writer);
        taken.keep();
        Ok(answer)
    }

    /// Take `key` to read for `owner` (one permit), waiting up to `wait`: first until no writer
    /// holds the key's write gate (a writer waiting for readers holds it), then for a permit.
    /// An owner holding the key already (reading, or writing) acquires it again.
    pub async fn acquire_read(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        self.check_key(key)?;
        check_owner(owner)?;
        self.check_running()?;
        if self.writer_of(key, Some(owner)).is_some() || self.owned_permit(key, owner).is_some() {
            return self.take(key, owner, wait, hold, true).await;
        }
        let deadline = Instant::now() + wait;
        if let Some(refused) = self.wait_for_no_writer(key, deadline).await {
            return Ok(refused);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        self.take(key, owner, left, hold, true).await
    }

    /// Wait until no writer holds `key`'s write gate, or `deadline`: `None` once none does,
    /// else the refusal to answer. The gate is read from the backend at each round; a round
    /// follows a release notice of the gate (the backend's, or this pod's), or half a renew
    /// interval, since a writer that dies sends no notice.
    async fn wait_for_no_writer(&self, key: &str, deadline: Instant) -> Option<KeyAnswer> {
        let gate = self.permit_name(key, GATE);
        let renew_interval = self.read_config(|c| c.renew_interval);
        let own_key = StateInUse::new(&self.inner, key);
        let mut given_up = own_key.given_up.subscribe();
        let _waiting = Waiting::new(&self.inner.waiting);
        loop {
            let driver = self.driver();
            let mut notice = driver.changes(&gate);
            let local = self
                .existing(&super::permit_key(key, GATE))
                .and_then(|s| super::current_of(&s))
                .map(|holding| self.qualified(&holding.owner));
            let writer = match local {
                Some(writer) => Some(writer),
                None => match driver.observe(&gate).await {
                    Ok(holder) => holder.map(|h| h.identity),
                    Err(e) => {
                        tracing::debug!(family = self.name(), key, error = %e, "could not read the write gate");
                        return Some(KeyAnswer::Unknown);
                    }
                },
            };
            let writer = writer?;
            if Instant::now() >= deadline {
                return Some(KeyAnswer::HeldByAnother {
                    holder: Some(writer),
                });
            }
            let nap_until = deadline.min(
                Instant::now() + (renew_interval / 2).min(driver.poll_interval(renew_interval)),
            );
            let released = async {
                let backend = async {
                    match notice.as_mut() {
                        Some(notice) => changed(notice).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = backend => {}
                    _ = changed(&mut given_up) => {}
                }
            };
            let _ = tokio::time::timeout_at(nap_until, released).await;
        }
    }

    /// This pod's writer of `key`, if it is `owner` (any writer, without one).
    pub(super) fn writer_of(&self, key: &str, owner: Option<&str>) -> Option<Arc<Writer>> {
        let writers = self.inner.writers.lock().unwrap_or_else(|e| e.into_inner());
        writers
            .get(key)
            .filter(|writer| owner.is_none_or(|owner| writer.owner == owner))
            .cloned()
    }

    /// Whether `owner` holds `key`'s write lock.
    pub fn writes(&self, key: &str, owner: &str) -> bool {
        self.writer_of(key, Some(owner)).is_some()
    }

    /// An acquisition by `owner` of a key it writes: the write lock again (every part
    /// re-entered), or refused when it may not be (`reentrant` false: Dapr's try-lock). `None`:
    /// the owner does not write the key, or its write lock was lost and is given back, so the
    /// owner takes the key afresh.
    pub(super) async fn reenter_write(
        &self,
        key: &str,
        owner: &str,
        hold: Duration,
        reentrant: bool,
    ) -> Result<Option<KeyAnswer>, KeyError> {
        let Some(writer) = self.writer_of(key, Some(owner)) else {
            return Ok(None);
        };
        if !matches!(self.parts_answer(key, &writer), KeyAnswer::Held { .. }) {
            // Lost: what remains is given back before the owner takes the key afresh.
            if self.forget_writer(key, &writer) {
                give_back(self, owner, writer.parts_of(key)).await;
            }
            return Ok(None);
        }
        if !reentrant {
            return Ok(Some(KeyAnswer::HeldByAnother {
                holder: Some(self.qualified(owner)),
            }));
        }
        for part in &writer.parts {
            let Some(holding) = self.holding_on(key, part.permit, owner) else {
                break;
            };
            // A part that ended meanwhile is found by the answer below.
            let _ = holding.lock.acquire(Duration::ZERO, hold).await;
        }
        Ok(Some(self.write_answer(key, &writer)))
    }

    /// The write lock's answer: held while every part is held with the token it was taken
    /// with, until the earliest part's claim ends, with the highest permit's token. A write
    /// lock found lost is given back whole (what remains of it), so that readers are not kept
    /// out by a writer that no longer writes.
    pub(super) fn write_answer(&self, key: &str, writer: &Arc<Writer>) -> KeyAnswer {
        let answer = self.parts_answer(key, writer);
        if matches!(answer, KeyAnswer::NotHeld) {
            self.end_write(key, writer);
        }
        answer
    }

    fn parts_answer(&self, key: &str, writer: &Writer) -> KeyAnswer {
        let mut token = 0;
        let mut valid_for = Duration::MAX;
        let mut holds = 0;
        for part in &writer.parts {
            let Some(holding) = self.holding_on(key, part.permit, &writer.owner) else {
                return KeyAnswer::NotHeld;
            };
            match holding.lock.answer() {
                Answer::Holder {
                    token: held,
                    valid_for: left,
                } if held == part.token => {
                    valid_for = valid_for.min(left);
                    if part.permit == GATE {
                        holds = holding.lock.snapshot().holds;
                    } else {
                        token = token.max(held);
                    }
                }
                Answer::Unknown => return KeyAnswer::Unknown,
                _ => return KeyAnswer::NotHeld,
            }
        }
        KeyAnswer::Held {
            token,
            valid_for,
            holds,
            permit: 0,
            writer: true,
        }
    }

    /// Forget `writer` and give back what it still holds, on a task of its own.
    fn end_write(&self, key: &str, writer: &Arc<Writer>) {
        if !self.forget_writer(key, writer) {
            return;
        }
        let parts = writer.parts_of(key);
        let (family, owner) = (self.clone(), writer.owner.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { give_back(&family, &owner, parts).await });
        }
    }

    /// Forget `writer`, if it is still `key`'s: whether it was.
    fn forget_writer(&self, key: &str, writer: &Arc<Writer>) -> bool {
        let mut writers = self.inner.writers.lock().unwrap_or_else(|e| e.into_inner());
        if writers.get(key).is_some_and(|w| Arc::ptr_eq(w, writer)) {
            writers.remove(key);
            return true;
        }
        false
    }

    /// Keep the write lock at least `hold` from now: every part extended.
    pub(super) async fn extend_write(
        &self,
        key: &str,
        writer: &Arc<Writer>,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        for part in &writer.parts {
            let held = Some((part.permit, part.token));
            self.extend_held(key, &writer.owner, hold, held).await?;
        }
        Ok(self.write_answer(key, writer))
    }

    /// Give up one acquisition of the write lock: one release of each part, the permits from
    /// the last, the gate after them. The holds left are the gate's.
    pub(super) async fn release_write(
        &self,
        key: &str,
        writer: &Arc<Writer>,
    ) -> Result<KeyRelease, KeyError> {
        let mut gate = KeyRelease::NotHeld;
        let mut failed = None;
        for part in writer.parts.iter().rev() {
            let held = Some((part.permit, part.token));
            match self.release_held(key, &writer.owner, held).await {
                Ok(released) if part.permit == GATE => gate = released,
                Ok(_) => {}
                Err(e) => failed = Some(e),
            }
        }
        match (&gate, &failed) {
            (KeyRelease::Released { holds }, None) if *holds > 0 => {}
            (_, None) => {
                self.forget_writer(key, writer);
            }
            // What a failed release left is given back whole.
            (_, Some(_)) => self.end_write(key, writer),
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(gate),
        }
    }
}
