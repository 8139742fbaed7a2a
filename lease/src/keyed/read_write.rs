//! Read-write locks on a family's keys (docs/read-write.md): on a family declared read-write,
//! readers share a key and a writer holds it alone.
//!
//! Every acquisition of a read-write family is a reader: it takes one permit of the key, as a
//! semaphore's owner does. A writer takes every permit, so a key of N permits has up to N
//! readers at once, or one writer. Each permit is an ordinary lock of the backend, so
//! exclusion rests on the permits' own guarantees: a writer believes it writes only while it
//! holds every permit it took, self-fenced, and a reader only while it holds its permit.
//!
//! Before the permits a writer takes the key's *write gate*, a lock of its own (`KEY#w`, a name
//! no key can have), and holds it to the end. Writers therefore take the permits one at a time,
//! in permit order, and two writers never hold some permits each. Readers wait while a writer
//! holds the gate, so a writer waiting for readers to leave is not overtaken by new ones.
//!
//! Pods may disagree on the count of permits for a while (a change rolling out), so a writer
//! cannot take "every permit" by its own count alone. Once it holds the gate it probes every
//! permit above its count up to [`MAX_READ_WRITE_PERMITS`] and waits until each is free, then
//! takes the permits of its count; a
//! reader that took a permit above 0 then probes the gate, and gives the permit back and waits
//! should it not be free. Either the reader's permit was held when the writer probed it (the
//! writer waits), or the gate was held when the reader probed it (the reader steps back). A
//! probe is an acquisition given back at once, not a read: it is as current as an acquisition,
//! and meets the backend's guards (a restarted server withholding grants for a lease), which a
//! plain read of a record would not see.
//!
//! A writer's token is the highest of the tokens of the permits it took. Each permit's tokens
//! rise with its holders, so it is above the token of every earlier holder of those permits.
//! A probe granted is granted a token too: should one be above those of the permits it then
//! took (each permit counting on its own, an earlier writer of more permits raised that one's),
//! the writer takes that permit as well, so its token is above every earlier holder's of every
//! permit.
//!
//! There is no upgrade from read to write: two readers upgrading at once would each wait for
//! the other's permit. An owner that reads and asks to write is refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::several::{Ahead, Taken, Taking};
use super::{KeyAnswer, KeyError, KeyRelease, KeyedFamily, StateInUse, Waiting, changed};
use crate::driver::Acquire;
use crate::error::Error;
use crate::holder::Answer;

/// The part of a key a writer takes first: its write gate (the key's local state `KEY#w`).
pub(super) const GATE: u32 = u32::MAX;
/// The most permits a key of a read-write family may have: a writer reads every permit up to
/// this one that it does not take.
pub const MAX_READ_WRITE_PERMITS: u32 = 16;
/// How many permits a writer probes at once among those it does not take.
const PROBES_AT_ONCE: usize = 16;
/// What ends a probe's identity (`POD/OWNER probe`): a holder so named is a probe of a reader's
/// or a writer's, given back at once, not a writer. Owners have no spaces, so no owner's
/// identity ends so.
pub(super) const PROBE: &str = " probe";
/// How many times a probe that meets another probe tries, and how long it waits between.
const PROBE_ATTEMPTS: u32 = 8;
const PROBE_RETRY: Duration = Duration::from_millis(2);

/// A writer of this pod holding a key's write lock: the gate and every permit it took, each
/// with the token it was taken with. `ended` once it no longer holds the key as a whole: its
/// owner's calls answer "not held" until what remains is given back and it is forgotten.
/// `releasing` counts the releases under way, which give its parts back one at a time: a part
/// found gone meanwhile is theirs to settle, not a loss that ends the write lock.
#[derive(Debug)]
pub(super) struct Writer {
    pub(super) owner: String,
    pub(super) parts: Vec<Taking>,
    ended: AtomicBool,
    releasing: AtomicUsize,
}

/// One write lock of a key, as a hold bound to a connection follows it: the engines of its
/// parts, and an extension or a release of this write lock alone. Once it has ended, its calls
/// find nothing held, even should its owner write the key again since.
#[derive(Clone)]
pub struct WriteHolding {
    family: KeyedFamily,
    key: String,
    writer: Arc<Writer>,
}

impl WriteHolding {
    pub(super) fn new(family: &KeyedFamily, key: &str, writer: Arc<Writer>) -> WriteHolding {
        WriteHolding {
            family: family.clone(),
            key: key.to_owned(),
            writer,
        }
    }

    /// The key it writes.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Each part's engine with the token the part was taken with (the write gate first), or
    /// `None` once a part is no longer this write lock's.
    pub fn parts(&self) -> Option<Vec<(crate::Lock, u64)>> {
        if self.writer.ended.load(Ordering::SeqCst) {
            return None;
        }
        self.writer
            .parts
            .iter()
            .map(|part| {
                let holding = self
                    .family
                    .holding_on(&self.key, part.permit, &self.writer.owner)?;
                Some((holding.lock.clone(), part.token))
            })
            .collect()
    }

    /// The write lock's answer ([`KeyedFamily::status`] for its writer). A write lock found
    /// ended is given back whole.
    pub fn answer(&self) -> KeyAnswer {
        self.family.write_answer(&self.key, &self.writer)
    }

    /// Keep this write lock at least `hold` from now.
    pub async fn extend(&self, hold: Duration) -> Result<KeyAnswer, KeyError> {
        self.family
            .extend_write(&self.key, &self.writer, hold)
            .await
    }

    /// Give up one acquisition of this write lock.
    pub async fn release(&self) -> Result<KeyRelease, KeyError> {
        self.family.release_write(&self.key, &self.writer).await
    }

    /// [`WriteHolding::release`] by the connection that holds it, whose parts it bound
    /// ([`crate::Lock::bind`]).
    pub async fn release_bound(&self) -> Result<KeyRelease, KeyError> {
        self.family
            .release_write_as(&self.key, &self.writer, true)
            .await
    }
}

/// What [`KeyedFamily::take_writes`] came to.
pub(super) enum Writes {
    /// Every part of every key, kept `hold` from now.
    Taken(Taken),
    /// `key` was refused, with this answer; nothing is taken.
    Refused { key: String, answer: KeyAnswer },
}

/// A reader's answer on its way to its caller, once its permit above 0 was checked against the
/// write gate. Dropped unread (its caller gone as it was sent, or after and before reading it:
/// a client that hung up in that moment), the permit it names is given back rather than kept
/// for nobody until its hold ends.
struct CheckedRead {
    answer: Option<Result<KeyAnswer, KeyAnswer>>,
    /// The holding to give back unless the answer is read: set while the answer says held.
    unread: Option<(KeyedFamily, String, String, (u32, u64))>,
}

impl CheckedRead {
    fn read(mut self) -> Result<KeyAnswer, KeyAnswer> {
        self.unread = None;
        self.answer.take().unwrap_or(Err(KeyAnswer::Unknown))
    }
}

impl Drop for CheckedRead {
    fn drop(&mut self) {
        let Some((family, key, owner, taken)) = self.unread.take() else {
            return;
        };
        // Without a runtime (the process shutting down) the permit ends with its hold.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = family.release_held(&key, &owner, Some(taken)).await;
            });
        }
    }
}

/// The refusal of a write to an owner that reads the key: there is no upgrade from read to
/// write.
pub(super) fn reads_so_cannot_write(owner: &str, key: &str) -> KeyError {
    KeyError::BadMode(format!(
        "{owner} reads {key:?} and cannot also write it: release the read first (two readers upgrading at once would each wait for the other)"
    ))
}

/// The refusal of a read to an owner that writes the key, or is taking it to write.
pub(super) fn writes_so_cannot_read(owner: &str, key: &str) -> KeyError {
    KeyError::BadMode(format!(
        "{owner} is taking {key:?} to write and cannot read it meanwhile"
    ))
}

impl KeyedFamily {
    /// Take `key` to write for `owner` (a family declared read-write): once no other owner,
    /// reader or writer, holds any of its permits, waiting up to `wait`, and keep it at most
    /// `hold` unless extended or released. Re-entrant for the same writer; refused to an owner
    /// that reads the key (no upgrade).
    pub async fn acquire_write(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        let (answer, _) = self.acquire_write_holding(key, owner, wait, hold).await?;
        Ok(answer)
    }

    /// [`KeyedFamily::acquire_write`], with the write lock the answer is of while it is held:
    /// what a hold bound to a connection follows, and gives back when the connection closes.
    pub async fn acquire_write_holding(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<(KeyAnswer, Option<WriteHolding>), KeyError> {
        self.check_new_key(key)?;
        self.check_owner(owner)?;
        self.check_running()?;
        self.check_read_write()?;
        let holding = |answer: KeyAnswer, writer: Arc<Writer>| {
            let holding = matches!(answer, KeyAnswer::Held { .. })
                .then(|| WriteHolding::new(self, key, writer));
            (answer, holding)
        };
        if let Some((answer, writer)) = self.reenter_write(key, owner, hold, true).await? {
            return Ok(holding(answer, writer));
        }
        self.refuse_upgrade(key, owner)?;
        self.check_writes_fit(1)?;
        let deadline = Instant::now() + wait;
        let _waiting = Waiting::new(&self.inner.waiting);
        let taken = match self
            .take_writes(&[key], deadline, hold, Taken::new(self, owner))
            .await?
        {
            Writes::Taken(taken) => taken,
            Writes::Refused { answer, .. } => return Ok((answer, None)),
        };
        // The whole is read back, each part held as taken.
        let writer = Self::writer_from(&taken, key, owner);
        let answer = self.parts_answer(key, &writer);
        if !matches!(answer, KeyAnswer::Held { .. }) {
            taken.give_back().await;
            return Ok((answer, None));
        }
        self.register_writer(key, &writer);
        taken.keep();
        Ok(holding(answer, writer))
    }

    /// A 400 when `owner` reads `key`: there is no upgrade from read to write. A part of the
    /// owner's own write lock not answered yet (its write waiting for readers, or being given
    /// back) is no read: the write then meets its own gate, a 409 naming the owner.
    pub(super) fn refuse_upgrade(&self, key: &str, owner: &str) -> Result<(), KeyError> {
        match self.find_holding(key, |holding| holding.owner == owner && !holding.of_write) {
            Some(_) => Err(reads_so_cannot_write(owner, key)),
            None => Ok(()),
        }
    }

    /// Take the write lock of each of `keys`, in the order given (the canonical one), for
    /// `taken`'s owner by `deadline`, then keep every part at least `hold` from now. Should a key
    /// be refused, or a call fail, every part taken is given back first.
    pub(super) async fn take_writes(
        &self,
        keys: &[&str],
        deadline: Instant,
        hold: Duration,
        mut taken: Taken,
    ) -> Result<Writes, KeyError> {
        let kept = std::sync::Mutex::new(Instant::now());
        let looked = AtomicBool::new(!self.driver().expiry_is_observed());
        for (i, key) in keys.iter().copied().enumerate() {
            let ahead = Ahead {
                later: &keys[i..],
                looked: &looked,
            };
            let refused = match self
                .take_write_parts(key, deadline, hold, &mut taken, &kept, ahead)
                .await
            {
                Ok(None) => continue,
                Ok(Some(answer)) => Ok(Writes::Refused {
                    key: key.to_owned(),
                    answer,
                }),
                Err(e) => Err(e),
            };
            taken.give_back().await;
            return refused;
        }
        // Every hold runs from now.
        if let Err(e) = taken.extend(hold).await {
            taken.give_back().await;
            return Err(e);
        }
        Ok(Writes::Taken(taken))
    }

    /// Take `key`'s write gate and every permit of it for `taken`'s owner, one after another, and wait
    /// until the permits it does not take are free, by `deadline`; each part taken is added to
    /// `taken`, whose earlier parts (of other keys too) are kept alive meanwhile. Should a part
    /// not be granted at once, the parts of the keys `ahead` (this one among them) are read
    /// once ([`KeyedFamily::take_keeping`]), so that on a backend whose expiry is observed a
    /// dead writer's parts are all counted from then, not each from its turn. `None` once every
    /// part is taken, else the refusal to answer; the caller gives `taken` back then.
    pub(super) async fn take_write_parts(
        &self,
        key: &str,
        deadline: Instant,
        hold: Duration,
        taken: &mut Taken,
        kept: &std::sync::Mutex<Instant>,
        ahead: Ahead<'_>,
    ) -> Result<Option<KeyAnswer>, KeyError> {
        let owner = &taken.owner().to_owned();
        let permits = self.permits_written();
        let look = || Ahead {
            later: ahead.later,
            looked: ahead.looked,
        };
        let take = async |permit: u32, taken: &mut Taken| {
            let left = deadline.saturating_duration_since(Instant::now());
            let take = self.take_write_part(key, permit, owner, left, hold);
            let answer = self
                .take_keeping(take, taken, kept, look(), owner, hold)
                .await?;
            let KeyAnswer::Held { token, .. } = answer else {
                return Ok(Err(answer));
            };
            taken.keys.push((key.to_owned(), Taking { permit, token }));
            Ok::<_, KeyError>(Ok(token))
        };
        if let Err(refusal) = take(GATE, taken).await? {
            return Ok(Some(refusal));
        }
        // The permits this writer does not count first, then its own: on a backend whose
        // tokens count across a key's permits, its own are then above every probe's.
        let free = self.await_free_permits(key, owner, permits, deadline);
        let probed = match self
            .take_keeping(free, taken, kept, look(), owner, hold)
            .await?
        {
            Ok(probed) => probed,
            Err(refusal) => return Ok(Some(refusal)),
        };
        let mut highest = 0;
        for permit in 0..permits {
            match take(permit, taken).await? {
                Ok(token) => highest = highest.max(token),
                Err(refusal) => return Ok(Some(refusal)),
            }
        }
        // A permit this writer only probed was granted with a token above its own (each
        // permit counts on its own, and an earlier writer of more permits took that one
        // above): it takes that permit too, so that its token is above every earlier
        // holder's of it, that writer's among them.
        if let Some(probed) = probed.filter(|p| p.token > highest)
            && let Err(refusal) = take(probed.permit, taken).await?
        {
            return Ok(Some(refusal));
        }
        Ok(None)
    }

    /// The write lock of `key` that `taken` holds for `owner`: its parts of that key.
    pub(super) fn writer_from(taken: &Taken, key: &str, owner: &str) -> Arc<Writer> {
        Arc::new(Writer {
            owner: owner.to_owned(),
            parts: taken
                .keys
                .iter()
                .filter(|(k, _)| k == key)
                .map(|(_, taking)| *taking)
                .collect(),
            ended: AtomicBool::new(false),
            releasing: AtomicUsize::new(0),
        })
    }

    /// Make `writer` the key's writer in this pod: its owner's calls on the key act on it.
    pub(super) fn register_writer(&self, key: &str, writer: &Arc<Writer>) {
        self.inner
            .writers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_owned(), writer.clone());
    }

    /// Wait until each permit of `key` from `from` up to [`MAX_READ_WRITE_PERMITS`] (permits
    /// this writer does not take, which readers of pods with more permits may hold) is free when
    /// probed, or `deadline`: once all were, the permit whose probe was granted the highest
    /// token, if any; else the refusal to answer. Those not free are probed again every half
    /// renew interval.
    async fn await_free_permits(
        &self,
        key: &str,
        owner: &str,
        from: u32,
        deadline: Instant,
    ) -> Result<Result<Option<Taking>, KeyAnswer>, KeyError> {
        let driver = self.driver();
        let renew_interval = self.read_config(|c| c.renew_interval);
        let mut pending: Vec<u32> = (from..MAX_READ_WRITE_PERMITS).collect();
        let mut highest: Option<Taking> = None;
        loop {
            let mut held = Vec::new();
            for chunk in pending.chunks(PROBES_AT_ONCE) {
                let probes = chunk.iter().map(|&permit| {
                    let name = self.permit_name(key, permit);
                    async move { (permit, self.probe(&name, owner).await) }
                });
                for (permit, probe) in futures_util::future::join_all(probes).await {
                    match probe {
                        Ok(Ok(token)) => {
                            if highest.is_none_or(|h| token > h.token) {
                                highest = Some(Taking { permit, token });
                            }
                        }
                        Ok(Err(refusal)) => held.push((permit, refusal)),
                        Err(e) => {
                            tracing::debug!(family = self.name(), key, error = %e, "could not probe a permit");
                            return Ok(Err(KeyAnswer::Unknown));
                        }
                    }
                }
            }
            let Some((_, refusal)) = held.first() else {
                return Ok(Ok(highest));
            };
            if Instant::now() >= deadline {
                return Ok(Err(refusal.clone()));
            }
            pending = held.iter().map(|(permit, _)| *permit).collect();
            let nap = (renew_interval / 2).min(driver.poll_interval(renew_interval));
            tokio::time::sleep_until(deadline.min(Instant::now() + nap)).await;
        }
    }

    /// An acquisition of a read-write family's `key` by `owner`, which does not write it: a
    /// reader's. It waits while a writer holds the key's gate, takes a permit, and should the
    /// permit be above 0 (one a writer of fewer permits probes rather than takes), probes the
    /// gate: not free, the permit is given back and the reader waits again.
    pub(super) async fn take_reading(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
        reentrant: bool,
    ) -> Result<KeyAnswer, KeyError> {
        // The owner's holding is acquired again where it is, once it has passed the gate (an
        // acquisition of the owner's may be probing it still), before any wait for a writer.
        if let Some(answer) = self.reenter_owned(key, owner, hold, reentrant).await? {
            return Ok(answer);
        }
        if self.holding_on(key, GATE, owner).is_some() {
            return Err(writes_so_cannot_read(owner, key));
        }
        let deadline = Instant::now() + wait;
        loop {
            if let Some(refused) = self.wait_for_no_writer(key, owner, deadline).await {
                return Ok(refused);
            }
            // The owner may have begun writing the key meanwhile (its gate is no other's).
            if self.holding_on(key, GATE, owner).is_some() {
                return Err(writes_so_cannot_read(owner, key));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let answer = self.take_checked(key, owner, left, hold, reentrant).await?;
            let KeyAnswer::Held { permit, token, .. } = answer else {
                return Ok(answer);
            };
            if permit == 0 {
                return Ok(answer);
            }
            // On a task of its own, so that a client hanging up cannot leave the permit held
            // when the probe finds a writer; nor when it finds the gate free, since the answer
            // then goes to nobody.
            let (family, key_owned, owner_owned) = (self.clone(), key.to_owned(), owner.to_owned());
            let (answered, answer) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let gate = family.permit_name(&key_owned, GATE);
                let refusal = match family.probe(&gate, &owner_owned).await {
                    Ok(Ok(_)) => None,
                    Ok(Err(refusal)) => Some(refusal),
                    Err(e) => {
                        tracing::debug!(family = family.name(), key = key_owned, error = %e, "could not probe the write gate");
                        Some(KeyAnswer::Unknown)
                    }
                };
                // A caller gone meanwhile (its client hung up) is told nothing: the holding is
                // not marked checked, so that no other call of the owner's is told it holds,
                // and is given back rather than kept for nobody until its hold ends.
                let gone = answered.is_closed();
                let holding = family.holding_taken(&key_owned, permit, &owner_owned, token);
                let taken = Some((permit, token));
                let checked = match (refusal, holding) {
                    // Free: the holding may be told of, with its validity as of now; one the
                    // holder cannot vouch for now (a renewal failed during the check, or the
                    // claim ran out) is given back, since its owner is told it was not taken.
                    (None, Some(holding)) if !gone => {
                        let answer = family.answer_for(&holding, holding.lock.answer());
                        if matches!(answer, KeyAnswer::Held { .. }) {
                            holding.checked.store(true, Ordering::SeqCst);
                        } else {
                            let _ = family.release_held(&key_owned, &owner_owned, taken).await;
                        }
                        Ok(answer)
                    }
                    (None, _) if gone => {
                        let _ = family.release_held(&key_owned, &owner_owned, taken).await;
                        Ok(KeyAnswer::NotHeld)
                    }
                    (None, _) => Ok(KeyAnswer::NotHeld),
                    (Some(refusal), _) => {
                        let _ = family.release_held(&key_owned, &owner_owned, taken).await;
                        Err(refusal)
                    }
                };
                // The caller gone as the answer is sent, or before it reads it: the permit is
                // given back all the same.
                let unread = taken.filter(|_| matches!(checked, Ok(KeyAnswer::Held { .. })));
                let _ = answered.send(CheckedRead {
                    answer: Some(checked),
                    unread: unread.map(|taken| (family, key_owned, owner_owned, taken)),
                });
            });
            let checked = answer
                .await
                .map_or(Err(KeyAnswer::Unknown), CheckedRead::read);
            let refusal = match checked {
                Ok(answer) => return Ok(answer),
                Err(refusal) => refusal,
            };
            if matches!(refusal, KeyAnswer::Unknown) || Instant::now() >= deadline {
                return Ok(refusal);
            }
            // The gate read free and probed busy (a guard, a place in a queue): not at once
            // again.
            let renew_interval = self.read_config(|c| c.renew_interval);
            let nap = (renew_interval / 2).min(self.driver().poll_interval(renew_interval));
            tokio::time::sleep_until(deadline.min(Instant::now() + nap)).await;
        }
    }

    /// Whether `lock` is free now, as an acquisition finds it: one attempt for `owner`, given
    /// back at once when granted (`Ok` with the token it was granted); else the refusal (who
    /// holds it, or why a guard of the backend's withholds it). A refused attempt leaves the
    /// backend's queue at once, and so does one that failed (a place may have been put before
    /// the failure). Probes carry an identity of their own ([`PROBE`]), so that readers probing
    /// one gate at once, who find each other's probes rather than a writer, try again shortly.
    ///
    /// On a task of its own: a caller dropped midway (a client that hung up) must not leave a
    /// probe's place in a queue, first in line for nobody, nor its acquisition held.
    async fn probe(&self, lock: &str, owner: &str) -> Result<Result<u64, KeyAnswer>, Error> {
        let (family, lock, owner) = (self.clone(), lock.to_owned(), owner.to_owned());
        tokio::spawn(async move { family.probe_to_the_end(&lock, &owner).await })
            .await
            .map_err(|e| Error::Backend(format!("a probe of {} failed: {e}", self.name())))?
    }

    async fn probe_to_the_end(
        &self,
        lock: &str,
        owner: &str,
    ) -> Result<Result<u64, KeyAnswer>, Error> {
        let driver = self.driver();
        let identity = format!("{}{PROBE}", self.qualified(owner));
        let lease_duration = self.read_config(|c| c.lease_duration);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let attempt = driver.try_acquire(lock, &identity, lease_duration).await;
            let refusal = match attempt {
                Ok(Acquire::Acquired(lease)) => {
                    // Not given back (the backend out of reach): the record ends with its
                    // lease, and keeps the lock meanwhile, which is the safe side.
                    if let Err(e) = driver.release(&lease).await {
                        tracing::debug!(family = self.name(), lock, error = %e, "a probe's acquisition was not given back");
                    }
                    return Ok(Ok(lease.token));
                }
                Ok(Acquire::Busy(holder)) => KeyAnswer::HeldByAnother {
                    holder: holder.map(|h| h.identity),
                },
                Ok(Acquire::Withheld(withheld)) => KeyAnswer::Withheld {
                    reason: withheld.reason,
                    resume_in: withheld.resume_in,
                },
                Err(e) => {
                    driver.abandon(lock, &identity).await;
                    return Err(e);
                }
            };
            driver.abandon(lock, &identity).await;
            let another_probe = matches!(&refusal, KeyAnswer::HeldByAnother { holder: Some(h) } if h.ends_with(PROBE));
            if !another_probe || attempts >= PROBE_ATTEMPTS {
                return Ok(Err(refusal));
            }
            tokio::time::sleep(PROBE_RETRY).await;
        }
    }

    /// Who holds `key`'s write gate, other than `owner`: this pod's holder, else the backend's
    /// record as read (a hint for waiting, not a proof: see [`KeyedFamily::probe`]).
    async fn gate_holder(&self, key: &str, owner: &str) -> Result<Option<String>, Error> {
        let local = self
            .existing(&super::permit_key(key, GATE))
            .and_then(|s| super::current_of(&s));
        if let Some(holding) = local {
            return Ok((holding.owner != owner).then(|| self.qualified(&holding.owner)));
        }
        let me = self.qualified(owner);
        Ok(self
            .driver()
            .observe(&self.permit_name(key, GATE))
            .await?
            .map(|holder| holder.identity)
            .filter(|holder| *holder != me && !holder.ends_with(PROBE)))
    }

    /// Wait until no writer holds `key`'s write gate, or `deadline`: `None` once none does,
    /// else the refusal to answer. The gate is read at each round; a round follows a release
    /// notice of the gate (the backend's, or this pod's), or half a renew interval, since a
    /// writer that dies sends no notice.
    async fn wait_for_no_writer(
        &self,
        key: &str,
        owner: &str,
        deadline: Instant,
    ) -> Option<KeyAnswer> {
        let gate = self.permit_name(key, GATE);
        let renew_interval = self.read_config(|c| c.renew_interval);
        let own_key = StateInUse::new(&self.inner, key);
        let mut given_up = own_key.given_up_notices();
        loop {
            let driver = self.driver();
            let mut notice = driver.changes(&gate);
            let writer = match self.gate_holder(key, owner).await {
                Ok(writer) => writer?,
                Err(e) => {
                    tracing::debug!(family = self.name(), key, error = %e, "could not read the write gate");
                    return Some(KeyAnswer::Unknown);
                }
            };
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
        // Only a read-write family has writers, and it stays one.
        if !self.is_read_write() {
            return None;
        }
        let writers = self.inner.writers.lock().unwrap_or_else(|e| e.into_inner());
        writers
            .get(key)
            .filter(|writer| owner.is_none_or(|owner| writer.owner == owner))
            .cloned()
    }

    /// `owner`'s write lock on `key`, while it holds it: what a hold bound to a connection
    /// follows.
    pub fn write_holding(&self, key: &str, owner: &str) -> Option<WriteHolding> {
        let writer = self.writer_of(key, Some(owner))?;
        matches!(self.parts_answer(key, &writer), KeyAnswer::Held { .. })
            .then(|| WriteHolding::new(self, key, writer))
    }

    /// Whether `owner` holds `key`'s write lock now.
    pub fn writes(&self, key: &str, owner: &str) -> bool {
        self.writer_of(key, Some(owner))
            .is_some_and(|writer| matches!(self.parts_answer(key, &writer), KeyAnswer::Held { .. }))
    }

    /// Whether the family is declared read-write.
    pub fn is_read_write(&self) -> bool {
        self.inner.read_write.load(Ordering::SeqCst)
    }

    /// A 400 when writing `keys` keys at once (those the owner does not write already) can
    /// never fit the pod's limit of held keys: each key written holds its gate and every permit,
    /// each counted as a held key. Checked before anything is taken, so that the call neither
    /// waits nor holds keys for a refusal it was bound to end in.
    pub(super) fn check_writes_fit(&self, keys: usize) -> Result<(), KeyError> {
        if keys == 0 {
            return Ok(());
        }
        let permits = self.permits_written() as usize;
        let max_keys = self.read_config(|c| c.max_keys);
        let parts = keys.saturating_mul(permits + 1);
        if parts <= max_keys {
            return Ok(());
        }
        Err(KeyError::BadKeys(format!(
            "writing {keys} key(s) of {permits} permit(s) holds {parts} keys (a gate and every permit each), over this sidecar's limit of {max_keys} held keys (spec.keys.maxHeldPerPod, --max-keys)"
        )))
    }

    /// How many permits a writer takes: every permit the family has had in this pod, readers
    /// kept on permits above a lowered count included (the higher ones up to
    /// [`MAX_READ_WRITE_PERMITS`] are probed, not taken). Never a permit above those: a pod
    /// that had more as a semaphore would take one that writers of pods without that past
    /// neither take nor probe, and its token, counted on that permit alone, could stand above
    /// theirs.
    fn permits_written(&self) -> u32 {
        self.read_config(|c| c.permits)
            .max(self.inner.permits_ever.load(Ordering::SeqCst))
            .min(MAX_READ_WRITE_PERMITS)
    }

    pub(super) fn check_read_write(&self) -> Result<(), KeyError> {
        if self.is_read_write() {
            return Ok(());
        }
        Err(KeyError::BadMode(format!(
            "the family {:?} is not declared read-write (spec.keys.readWrite, --read-write): its keys have no readers and writers",
            self.name()
        )))
    }

    /// An acquisition by `owner` of a key it writes: the write lock again (every part
    /// re-entered), or refused when it may not be (`reentrant` false: Dapr's try-lock), with
    /// the write lock it is of. `None`: the owner does not write the key, or its write lock
    /// ended and what remained of it is given back, so the owner takes the key afresh.
    ///
    /// Every part is acquired once more, or none: a part that cannot be (its engine cannot
    /// tell, a moment) gives back the parts acquired, and the answer is `Unknown`. Uneven
    /// counts would let one release free the gate while the permits are still held for
    /// another acquisition of the owner. A write lock acquired again whose answer then cannot
    /// tell is given back once too: its owner, answered `Unknown`, will not release it.
    pub(super) async fn reenter_write(
        &self,
        key: &str,
        owner: &str,
        hold: Duration,
        reentrant: bool,
    ) -> Result<Option<(KeyAnswer, Arc<Writer>)>, KeyError> {
        let Some(writer) = self.writer_of(key, Some(owner)) else {
            return Ok(None);
        };
        match self.parts_answer(key, &writer) {
            KeyAnswer::Held { .. } => {}
            KeyAnswer::NotHeld if writer.releasing.load(Ordering::SeqCst) == 0 => {
                self.end_write(key, &writer).await;
                return Ok(None);
            }
            // Cannot tell now: the backend cannot say, or a release is giving the parts back.
            _ => return Ok(Some((KeyAnswer::Unknown, writer))),
        }
        if !reentrant {
            let refused = KeyAnswer::HeldByAnother {
                holder: Some(self.qualified(owner)),
            };
            return Ok(Some((refused, writer)));
        }
        // On a task of its own, so that a client hanging up cannot leave some parts acquired
        // once more than others; a write lock acquired again comes back in a `Taken`, which
        // gives it back should the client have hung up by then.
        let (family, key_owned, held) = (self.clone(), key.to_owned(), writer.clone());
        let reentered = tokio::spawn(async move {
            let mut counted = Vec::with_capacity(held.parts.len());
            for part in &held.parts {
                let Some(holding) = family.holding_on(&key_owned, part.permit, &held.owner) else {
                    break;
                };
                match holding.lock.acquire(Duration::ZERO, hold).await {
                    Ok(Answer::Holder { token, .. }) if token == part.token => {
                        counted.push((holding, part.token));
                    }
                    _ => break,
                }
            }
            if counted.len() == held.parts.len() {
                let answer = family.write_answer(&key_owned, &held);
                // Acquired again but not to be answered held (a part cannot tell, or was lost):
                // given back, since its owner, not told it holds, will not release it.
                if matches!(answer, KeyAnswer::Unknown)
                    && let Err(e) = family.release_write(&key_owned, &held).await
                {
                    tracing::debug!(family = family.name(), key = key_owned, error = %e, "a write lock acquired again was not given back; it ends whole");
                    family.end_write(&key_owned, &held).await;
                }
                let given = matches!(answer, KeyAnswer::Held { .. })
                    .then(|| Taken::rewritten(&family, &key_owned, held.clone()));
                return (answer, given);
            }
            for (holding, token) in counted {
                if let Err(e) = holding.lock.release_if(super::own_permit(token)).await {
                    tracing::debug!(family = family.name(), key = key_owned, error = %e, "a part acquired again was not given back; the write lock ends whole");
                    family.end_write(&key_owned, &held).await;
                    break;
                }
            }
            // Not acquired again: not held, or held as before this call, which cannot say so.
            match family.write_answer(&key_owned, &held) {
                KeyAnswer::NotHeld => (KeyAnswer::NotHeld, None),
                _ => (KeyAnswer::Unknown, None),
            }
        })
        .await;
        let answer = match reentered {
            Ok((answer, given)) => {
                if let Some(given) = given {
                    given.keep();
                }
                answer
            }
            Err(_) => KeyAnswer::Unknown,
        };
        Ok(Some((answer, writer)))
    }

    /// The write lock's answer: held while every part is held with the token it was taken
    /// with, until the earliest part's claim ends, with the highest permit's token (and that
    /// permit). A write lock found ended is given back whole, on a task of its own.
    pub(super) fn write_answer(&self, key: &str, writer: &Arc<Writer>) -> KeyAnswer {
        let answer = self.parts_answer(key, writer);
        if matches!(answer, KeyAnswer::NotHeld)
            && writer.releasing.load(Ordering::SeqCst) == 0
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
            // Ended from now on, for every call, and once.
            && !writer.ended.swap(true, Ordering::SeqCst)
        {
            let (family, key, writer) = (self.clone(), key.to_owned(), writer.clone());
            runtime.spawn(async move { family.end_write(&key, &writer).await });
        }
        answer
    }

    pub(super) fn parts_answer(&self, key: &str, writer: &Writer) -> KeyAnswer {
        if writer.ended.load(Ordering::SeqCst) {
            return KeyAnswer::NotHeld;
        }
        let (mut token, mut permit) = (0, 0);
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
                    ..
                } if held == part.token => {
                    valid_for = valid_for.min(left);
                    if part.permit == GATE {
                        holds = holding.lock.read_snapshot(|s| s.holds);
                    } else if held >= token {
                        (token, permit) = (held, part.permit);
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
            permit,
            writer: true,
        }
    }

    /// The write lock no longer holds the key as a whole: its owner's calls answer "not held"
    /// from now, every part still held steps down whatever its count of acquisitions, and then
    /// the writer is forgotten. A part steps down as on a force-release: released once the
    /// last answer it gave has run out, since the writer's last answer may still be relied on.
    async fn end_write(&self, key: &str, writer: &Arc<Writer>) {
        writer.ended.store(true, Ordering::SeqCst);
        let holdings: Vec<_> = writer
            .parts
            .iter()
            .rev()
            .filter_map(|part| {
                let holding = self.holding_on(key, part.permit, &writer.owner)?;
                Some((holding, part.token))
            })
            .collect();
        // On a task of its own, so that a client hanging up cannot cut it short, nor leave the
        // ended writer registered.
        let (family, key, writer) = (self.clone(), key.to_owned(), writer.clone());
        let _ = tokio::spawn(async move {
            for (holding, token) in holdings {
                // Not held with the token: a later holding, or one that ended already.
                let _ = holding.lock.force_release(None, token).await;
            }
            family.forget_writer(&key, &writer);
        })
        .await;
    }

    /// A part of `key` (a permit, or its gate) whose engine the family let go of: this pod's
    /// writer of the key, if that part was its owner's, is asked how it stands, which ends it
    /// once a part is gone (its hold ran out, with nobody asking).
    pub(super) fn part_let_go(&self, key: &str, owner: &str) {
        if let Some(writer) = self.writer_of(key, Some(owner)) {
            self.write_answer(key, &writer);
        }
    }

    /// Forget `writer`, if it is still `key`'s.
    fn forget_writer(&self, key: &str, writer: &Arc<Writer>) {
        let mut writers = self.inner.writers.lock().unwrap_or_else(|e| e.into_inner());
        if writers.get(key).is_some_and(|w| Arc::ptr_eq(w, writer)) {
            writers.remove(key);
        }
    }

    /// Keep the write lock at least `hold` from now: every part extended.
    pub(super) async fn extend_write(
        &self,
        key: &str,
        writer: &Arc<Writer>,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        if !writer.ended.load(Ordering::SeqCst) {
            // All at once: an engine busy renewing holds its call for a while, and the parts'
            // waits should not add up.
            let extensions = writer.parts.iter().map(|part| {
                let held = Some((part.permit, part.token));
                self.extend_held(key, &writer.owner, hold, held)
            });
            futures_util::future::try_join_all(extensions).await?;
        }
        Ok(self.write_answer(key, writer))
    }

    /// Give up one acquisition of the write lock: one release of each part, the permits from
    /// the last, the gate after them, on a task of its own (a client hanging up cannot leave
    /// some parts acquired more often than others, or the write lock unsettled). The holds left
    /// are the gate's. A part found ended, or a release that failed, ends the write lock whole.
    pub(super) async fn release_write(
        &self,
        key: &str,
        writer: &Arc<Writer>,
    ) -> Result<KeyRelease, KeyError> {
        self.release_write_as(key, writer, false).await
    }

    /// [`KeyedFamily::release_write`], `by_connection` when the connection holding it gives
    /// it back ([`crate::Lock::bind`]).
    async fn release_write_as(
        &self,
        key: &str,
        writer: &Arc<Writer>,
        by_connection: bool,
    ) -> Result<KeyRelease, KeyError> {
        if writer.ended.load(Ordering::SeqCst) {
            return Ok(KeyRelease::NotHeld);
        }
        let (family, key, writer) = (self.clone(), key.to_owned(), writer.clone());
        tokio::spawn(async move {
            family
                .release_write_parts(&key, &writer, by_connection)
                .await
        })
        .await
        .map_err(|e| KeyError::Lock(Error::Backend(format!("a release stopped: {e}"))))?
    }

    async fn release_write_parts(
        &self,
        key: &str,
        writer: &Arc<Writer>,
        by_connection: bool,
    ) -> Result<KeyRelease, KeyError> {
        let releasing = Releasing::new(writer);
        let mut released = Vec::with_capacity(writer.parts.len());
        for part in writer.parts.iter().rev() {
            let taken = Some((part.permit, part.token));
            released.push((
                part.permit,
                self.release_held_as(key, &writer.owner, taken, by_connection)
                    .await,
            ));
        }
        let gate = released
            .iter()
            .find(|(permit, _)| *permit == GATE)
            .and_then(|(_, answer)| answer.as_ref().ok().cloned())
            .unwrap_or(KeyRelease::NotHeld);
        // Every part released once, each left with the gate's count: the write lock stands
        // (or, at 0, is gone). Anything else ends it whole.
        let even = released
            .iter()
            .all(|(_, answer)| matches!(answer, Ok(released) if *released == gate));
        let answer = match gate {
            KeyRelease::Released { holds: 0 } if even => {
                self.forget_writer(key, writer);
                gate
            }
            KeyRelease::Released { .. } if even => {
                drop(releasing);
                // A part lost once this release had passed it: the write lock ends now, not
                // when an answer is next asked for.
                self.write_answer(key, writer);
                gate
            }
            _ => {
                self.end_write(key, writer).await;
                match gate {
                    // Ended whole: nothing of it is held any more.
                    KeyRelease::Released { .. } => KeyRelease::Released { holds: 0 },
                    other => other,
                }
            }
        };
        let failed = released.into_iter().find_map(|(_, answer)| answer.err());
        match failed {
            Some(e) => Err(e),
            None => Ok(answer),
        }
    }
}

/// A release under way of a writer's parts ([`Writer::releasing`]), counted for as long as it
/// lives, however it ends.
struct Releasing<'a>(&'a Writer);

impl<'a> Releasing<'a> {
    fn new(writer: &'a Writer) -> Self {
        writer.releasing.fetch_add(1, Ordering::SeqCst);
        Releasing(writer)
    }
}

impl Drop for Releasing<'_> {
    fn drop(&mut self) {
        self.0.releasing.fetch_sub(1, Ordering::SeqCst);
    }
}
