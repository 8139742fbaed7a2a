//! All-or-nothing acquisitions of several keys of a family (docs/multi-key.md): an owner takes
//! every key it names or none of them, within one wait.
//!
//! The keys are taken one by one in one canonical order (byte order of the keys), whoever asks:
//! two acquisitions whose keys overlap meet first on the lowest key they share, so neither can
//! hold a key the other waits for while waiting for one the other holds, and nobody deadlocks.
//! While later keys are awaited, the keys already taken are extended, so that a short `hold`
//! does not lapse on the first keys before the last is taken; once every key is taken, each is
//! extended to `hold` from then and read back self-fenced, still on the permit and with the
//! token it was taken with, so the answer reports only keys held at that moment. An acquisition
//! refused, failed or dropped (its client hung up) gives back what it took, on a task of its own
//! that a hang-up cannot cut short: one release per key, of the holding taken, which leaves a
//! key the owner already held (a re-entrant acquisition) with its earlier acquisitions.
//!
//! A key the owner holds before the call is outside the order: an owner holding `y` that asks
//! for `x,y` can wait on `x` for another owner that waits on `y`, until one of the waits ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::read_write::{WriteHolding, Writer, Writes};
use super::{KeyAnswer, KeyError, KeyRelease, KeyedFamily};

/// The most keys one acquisition of several keys may name.
pub const MAX_KEYS_AT_ONCE: usize = 64;
/// The least time between two extensions of the keys taken while a later key is awaited.
const MIN_EXTEND_GAP: Duration = Duration::from_millis(10);
/// How long a key's acquisition runs before the keys after it are looked at
/// ([`KeyedFamily::take_keeping`]): longer than an uncontended acquisition takes.
const LOOK_AHEAD_AFTER: Duration = Duration::from_millis(20);
/// The most backend reads one look ahead makes.
const MAX_LOOKS: usize = 64;

/// What an acquisition of several keys did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeysAnswer {
    /// The owner holds every key: each key, in the order asked, with its answer (`Held`).
    Held(Vec<(String, KeyAnswer)>),
    /// The owner holds none of the keys through this acquisition: `key` could not be taken (or
    /// was lost before the others were taken), for the reason `answer` gives.
    NotTaken { key: String, answer: KeyAnswer },
}

/// The keys after the one awaited, and whether the call has looked ahead already.
pub(super) struct Ahead<'a> {
    pub(super) later: &'a [&'a str],
    pub(super) looked: &'a AtomicBool,
}

/// The keys taken so far by one acquisition of several, each with the permit and token it was
/// taken with, and the owner's write locks it acquired again, given back unless the
/// acquisition succeeds: by [`Taken::give_back`], or, when the acquisition is dropped midway
/// (its client hung up), by a task of its own.
pub(super) struct Taken {
    family: KeyedFamily,
    owner: String,
    pub(super) keys: Vec<(String, Taking)>,
    /// Write locks the owner held before the call, each acquired once more by it: given back
    /// by one release of the write lock, which leaves the earlier acquisitions.
    rewritten: Vec<(String, Arc<Writer>)>,
}

/// Which holding of a key an acquisition took: its permit and token. Tokens of two permits of
/// one key may be equal (each permit counts on its own on some backends), so both are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Taking {
    pub(super) permit: u32,
    pub(super) token: u64,
}

impl Taken {
    pub(super) fn new(family: &KeyedFamily, owner: &str) -> Self {
        Self {
            family: family.clone(),
            owner: owner.to_owned(),
            keys: Vec::new(),
            rewritten: Vec::new(),
        }
    }

    /// `writer`'s write lock of `key`, acquired once more for its owner: given back by one
    /// release unless kept.
    pub(super) fn rewritten(family: &KeyedFamily, key: &str, writer: Arc<Writer>) -> Self {
        let mut taken = Self::new(family, &writer.owner);
        taken.rewritten.push((key.to_owned(), writer));
        taken
    }

    /// Every holding the acquisition keeps alive while it waits: the keys it took, and each
    /// part of the write locks it acquired again.
    pub(super) fn kept_alive(&self) -> impl Iterator<Item = (&str, Taking)> {
        let taken = self
            .keys
            .iter()
            .map(|(key, taking)| (key.as_str(), *taking));
        let rewritten = self
            .rewritten
            .iter()
            .flat_map(|(key, writer)| writer.parts.iter().map(move |part| (key.as_str(), *part)));
        taken.chain(rewritten)
    }

    /// The owner the keys are taken for.
    pub(super) fn owner(&self) -> &str {
        &self.owner
    }

    /// Keep every key taken at least `hold` from now, each only on the holding taken.
    pub(super) async fn extend(&self, hold: Duration) -> Result<(), KeyError> {
        for (key, taking) in self.kept_alive() {
            let held = Some((taking.permit, taking.token));
            self.family
                .extend_held(key, &self.owner, hold, held)
                .await?;
        }
        Ok(())
    }

    /// Keep the keys: the acquisition succeeded.
    pub(super) fn keep(mut self) {
        self.keys.clear();
        self.rewritten.clear();
    }

    /// Give the keys back before answering. The releases run on a task of their own, so that
    /// a client hanging up meanwhile cannot cut them short.
    pub(super) async fn give_back(mut self) {
        let (family, owner) = (self.family.clone(), std::mem::take(&mut self.owner));
        let (keys, rewritten) = (
            std::mem::take(&mut self.keys),
            std::mem::take(&mut self.rewritten),
        );
        let _ =
            tokio::spawn(async move { give_back(&family, &owner, keys, rewritten).await }).await;
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if self.keys.is_empty() && self.rewritten.is_empty() {
            return;
        }
        let (family, owner) = (self.family.clone(), std::mem::take(&mut self.owner));
        let (keys, rewritten) = (
            std::mem::take(&mut self.keys),
            std::mem::take(&mut self.rewritten),
        );
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { give_back(&family, &owner, keys, rewritten).await });
        }
    }
}

/// One release per key, last taken first, each only of the holding taken (one taken again
/// since, its lease lost meanwhile, is another acquisition's); then one release of each write
/// lock acquired again.
async fn give_back(
    family: &KeyedFamily,
    owner: &str,
    keys: Vec<(String, Taking)>,
    rewritten: Vec<(String, Arc<Writer>)>,
) {
    for (key, taking) in keys.iter().rev() {
        if let Err(e) = family
            .release_held(key, owner, Some((taking.permit, taking.token)))
            .await
        {
            tracing::warn!(family = family.name(), key, error = %e, "a key taken in vain was not given back; its hold or lease ends it");
        }
    }
    for (key, writer) in rewritten.iter().rev() {
        if let Err(e) = family.release_write(key, writer).await {
            tracing::warn!(family = family.name(), key, error = %e, "a write lock acquired again in vain was not given back; its hold or lease ends it");
        }
    }
}

impl KeyedFamily {
    /// Take every key of `keys` for `owner`, or none, waiting up to `wait` in all, and keep each
    /// at most `hold` from the answer unless extended or released (the rules of
    /// [`KeyedFamily::acquire`] for each). A key the owner holds already is acquired again.
    pub async fn acquire_all(
        &self,
        keys: &[String],
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeysAnswer, KeyError> {
        let order = self.check_new_keys(keys)?;
        self.check_owner(owner)?;
        self.check_running()?;
        self.refuse_written(keys, owner)?;
        let deadline = Instant::now() + wait;
        let mut taken = Taken::new(self, owner);
        // When the keys taken were last kept alive, and whether the keys after the one awaited
        // have been looked at (once a call).
        let kept = std::sync::Mutex::new(Instant::now());
        let looked = AtomicBool::new(!self.driver().expiry_is_observed());
        for (i, key) in order.iter().copied().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            let ahead = Ahead {
                later: &order[i + 1..],
                looked: &looked,
            };
            let take = self.take(key, owner, left, hold, true);
            let answer = match self
                .take_keeping(take, &taken, &kept, ahead, owner, hold)
                .await
            {
                Ok(answer) => answer,
                Err(e) => {
                    taken.give_back().await;
                    return Err(e);
                }
            };
            if let KeyAnswer::Held { writer: true, .. } = answer {
                // The owner came to write the key while this call waited (the check above came
                // first), and the take acquired that write lock again, which a read of several
                // keys neither counts nor gives back as one: it is given back whole, at once.
                if let Some(writer) = self.writer_of(key, Some(owner)) {
                    taken.rewritten.push((key.to_owned(), writer));
                }
                taken.give_back().await;
                return Err(written(key, owner));
            }
            let KeyAnswer::Held { token, permit, .. } = answer else {
                taken.give_back().await;
                return Ok(KeysAnswer::NotTaken {
                    key: key.to_owned(),
                    answer,
                });
            };
            taken.keys.push((key.to_owned(), Taking { permit, token }));
        }
        // Every hold runs from now; then every key is read back, still held as it was taken
        // (not lost, nor taken again since), its validity as of this moment.
        if let Err(e) = taken.extend(hold).await {
            taken.give_back().await;
            return Err(e);
        }
        let mut answers = Vec::with_capacity(keys.len());
        for key in keys {
            let taken_as = taken.keys.iter().find(|(k, _)| k == key).map(|(_, t)| *t);
            let answer = match self.status(key, Some(owner)) {
                Ok(answer) => answer,
                Err(e) => {
                    taken.give_back().await;
                    return Err(e);
                }
            };
            match answer {
                KeyAnswer::Held { token, permit, .. }
                    if taken_as == Some(Taking { permit, token }) =>
                {
                    answers.push((key.clone(), answer));
                }
                // Lost since it was taken (its lease, or a hold shorter than the extensions
                // could keep): the acquisition fails as a whole.
                KeyAnswer::Held { .. } => {
                    taken.give_back().await;
                    return Ok(KeysAnswer::NotTaken {
                        key: key.clone(),
                        answer: KeyAnswer::NotHeld,
                    });
                }
                answer => {
                    taken.give_back().await;
                    return Ok(KeysAnswer::NotTaken {
                        key: key.clone(),
                        answer,
                    });
                }
            }
        }
        taken.keep();
        Ok(KeysAnswer::Held(answers))
    }

    /// [`KeyedFamily::acquire_all`] on a family declared read-write, where it reads each key.
    pub async fn acquire_all_read(
        &self,
        keys: &[String],
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeysAnswer, KeyError> {
        self.check_read_write()?;
        self.acquire_all(keys, owner, wait, hold).await
    }

    /// Take every key of `keys` to write for `owner` (a family declared read-write), or none,
    /// waiting up to `wait` in all: each key's write lock as [`KeyedFamily::acquire_write`]
    /// takes it, the keys in their canonical order and each key's parts in theirs, so that two
    /// such acquisitions, or one and a writer of one key, cannot deadlock. A key the owner
    /// writes already is acquired again (every part of its write lock once more, before any
    /// other key is taken, and given back by one release of the write lock should the call
    /// fail); a key the owner reads is refused (no upgrade).
    pub async fn acquire_all_write(
        &self,
        keys: &[String],
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeysAnswer, KeyError> {
        let (answer, _) = self
            .acquire_all_write_holdings(keys, owner, wait, hold)
            .await?;
        Ok(answer)
    }

    /// [`KeyedFamily::acquire_all_write`], with each key's write lock while the keys are held
    /// (in the keys' canonical order): what a hold bound to a connection follows, and gives
    /// back when the connection closes.
    pub async fn acquire_all_write_holdings(
        &self,
        keys: &[String],
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<(KeysAnswer, Vec<WriteHolding>), KeyError> {
        let order = self.check_new_keys(keys)?;
        self.check_owner(owner)?;
        self.check_running()?;
        self.check_read_write()?;
        // Bad input first, so that a 400 changes nothing.
        let mut fresh = 0;
        for key in &order {
            if self.writer_of(key, Some(owner)).is_none() {
                self.check_fresh_write(key, owner)?;
                fresh += 1;
            }
        }
        self.check_writes_fit(fresh)?;
        let deadline = Instant::now() + wait;
        // The owner's write locks are acquired again first: that never waits, and should a
        // later key be refused, one release of each gives back what this call added.
        let (taken, fresh) = match self.reenter_writes(&order, owner, hold).await? {
            Ok(reentered) => reentered,
            Err(not_taken) => return Ok((not_taken, Vec::new())),
        };
        let _waiting = super::Waiting::new(&self.inner.waiting);
        let taken = match self.take_writes(&fresh, deadline, hold, taken).await? {
            Writes::Taken(taken) => taken,
            Writes::Refused { key, answer } => {
                return Ok((KeysAnswer::NotTaken { key, answer }, Vec::new()));
            }
        };
        // Each key's write lock is read back, every part held as it was taken.
        let mut writers = Vec::with_capacity(order.len());
        for key in order.iter().copied() {
            let rewritten = taken.rewritten.iter().find(|(k, _)| k == key);
            let writer = match rewritten {
                Some((_, writer)) => writer.clone(),
                None => Self::writer_from(&taken, key, owner),
            };
            let answer = self.parts_answer(key, &writer);
            if !matches!(answer, KeyAnswer::Held { .. }) {
                taken.give_back().await;
                let not_taken = KeysAnswer::NotTaken {
                    key: key.to_owned(),
                    answer,
                };
                return Ok((not_taken, Vec::new()));
            }
            writers.push((key, writer, answer, rewritten.is_some()));
        }
        for (key, writer, _, rewritten) in &writers {
            if !rewritten {
                self.register_writer(key, writer);
            }
        }
        taken.keep();
        let mut holdings = Vec::with_capacity(writers.len());
        let mut answers = Vec::with_capacity(writers.len());
        for (key, writer, answer, _) in writers {
            holdings.push(WriteHolding::new(self, key, writer));
            answers.push((key.to_owned(), answer));
        }
        Ok((KeysAnswer::Held(in_asked_order(keys, answers)), holdings))
    }

    /// Acquire again each write lock `owner` holds among `keys` (in their canonical order),
    /// every part once more, for an acquisition of several keys to write: the acquisition's
    /// `Taken` with them, and the keys to take afresh. A write lock of the owner's that has
    /// ended whole is given back by [`KeyedFamily::reenter_write`], and its key taken afresh, as
    /// a write of one key does; one that cannot tell now, or that a release is giving back,
    /// refuses the acquisition (what was acquired again is given back first). A client hanging
    /// up meanwhile drops the `Taken`, which gives back what it holds; a re-entry still under
    /// way comes back from its task in a `Taken` of its own, given back unclaimed.
    async fn reenter_writes<'k>(
        &self,
        order: &[&'k str],
        owner: &str,
        hold: Duration,
    ) -> Result<Result<(Taken, Vec<&'k str>), KeysAnswer>, KeyError> {
        let mut taken = Taken::new(self, owner);
        let mut fresh = Vec::with_capacity(order.len());
        for &key in order {
            // Checked again: the write lock may have ended since the call's checks. Refused, the
            // call gives back what it acquired again before it answers.
            let reentered = match self.reenter_write(key, owner, hold, true).await {
                Ok(None) => self.check_fresh_write(key, owner).map(|()| None),
                other => other,
            };
            let reentered = match reentered {
                Ok(reentered) => reentered,
                Err(e) => {
                    taken.give_back().await;
                    return Err(e);
                }
            };
            match reentered {
                None => fresh.push(key),
                Some((KeyAnswer::Held { .. }, writer)) => {
                    taken.rewritten.push((key.to_owned(), writer));
                }
                Some((answer, _)) => {
                    taken.give_back().await;
                    return Ok(Err(KeysAnswer::NotTaken {
                        key: key.to_owned(),
                        answer,
                    }));
                }
            }
        }
        Ok(Ok((taken, fresh)))
    }

    /// A 400 when `owner` may not take `key`'s write lock afresh: it reads the key (no
    /// upgrade), or the key's gate is still its own (another acquisition of the owner's is
    /// writing the key, or an ended write lock's gate is not given back yet).
    fn check_fresh_write(&self, key: &str, owner: &str) -> Result<(), KeyError> {
        self.refuse_upgrade(key, owner)?;
        if self
            .holding_on(key, super::read_write::GATE, owner)
            .is_some()
        {
            return Err(KeyError::BadMode(format!(
                "{owner} is taking {key:?} to write already"
            )));
        }
        Ok(())
    }

    /// A 400 when `owner` writes one of `keys` it asks to read: a read among several keys
    /// does not stand for a write lock taken again (`mode=write` acquires it again).
    fn refuse_written(&self, keys: &[String], owner: &str) -> Result<(), KeyError> {
        match keys.iter().find(|key| self.writes(key, owner)) {
            Some(key) => Err(written(key, owner)),
            None => Ok(()),
        }
    }

    /// Run `take` (of a key, or of a permit), and meanwhile keep the keys already `taken` from
    /// lapsing: each is extended
    /// once a third of `hold` has passed since the last time (`kept`, across the call's keys).
    /// On a backend whose expiry is observed ([`crate::Driver::expiry_is_observed`]), should
    /// `key` not be granted at once, the keys after it are read once: a dead holder's records
    /// are then counted from now, not from their turn, so that a dead pod's keys are all free
    /// within about one lease rather than one lease per key.
    pub(super) async fn take_keeping<T>(
        &self,
        take: impl std::future::Future<Output = Result<T, KeyError>>,
        taken: &Taken,
        kept: &std::sync::Mutex<Instant>,
        ahead: Ahead<'_>,
        owner: &str,
        hold: Duration,
    ) -> Result<T, KeyError> {
        // Beside the take, never in its stead: the take runs the key's engine.
        let keep_alive = async {
            if taken.kept_alive().next().is_none() {
                return std::future::pending::<()>().await;
            }
            let gap = (hold / 3).max(MIN_EXTEND_GAP);
            loop {
                let last = *kept.lock().unwrap_or_else(|e| e.into_inner());
                tokio::time::sleep_until(last + gap).await;
                for (key, taking) in taken.kept_alive() {
                    // A key lost meanwhile is found when every key is read back.
                    let held = Some((taking.permit, taking.token));
                    let _ = self.extend_held(key, owner, hold, held).await;
                }
                *kept.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            }
        };
        let look_ahead = async {
            if !ahead.later.is_empty() && !ahead.looked.load(Ordering::Relaxed) {
                tokio::time::sleep(LOOK_AHEAD_AFTER).await;
                ahead.looked.store(true, Ordering::Relaxed);
                self.look_at(ahead.later).await;
            }
        };
        tokio::select! {
            answer = take => answer,
            _ = async { tokio::join!(keep_alive, look_ahead) } => {
                unreachable!("the keys taken are kept alive until the take ends")
            }
        }
    }

    /// Read the holders of `keys` (of each permit and write gate, up to [`MAX_LOOKS`] reads), for
    /// the driver to see their records; what is read is not used here.
    async fn look_at(&self, keys: &[&str]) {
        let permits = self.read_config(|c| c.permits);
        // A read-write family's keys have a write gate too.
        let gate = self.is_read_write().then_some(super::read_write::GATE);
        let driver = self.driver();
        let reads = keys
            .iter()
            .flat_map(|key| {
                gate.into_iter()
                    .chain(0..permits)
                    .map(move |permit| self.permit_name(key, permit))
            })
            .take(MAX_LOOKS)
            .map(|name| {
                let driver = driver.clone();
                async move { driver.observe(&name).await }
            });
        futures_util::future::join_all(reads).await;
    }

    /// Give up one acquisition of each of `keys` by `owner`: what [`KeyedFamily::release`]
    /// answers for each, in the order asked. Every key is tried, whatever the others answer.
    pub async fn release_all(
        &self,
        keys: &[String],
        owner: &str,
    ) -> Result<Vec<(String, KeyRelease)>, KeyError> {
        let order = self.check_keys(keys)?;
        self.check_owner(owner)?;
        let mut released = Vec::with_capacity(order.len());
        let mut failed = None;
        for key in order.iter().rev() {
            match self.release(key, owner).await {
                Ok(answer) => released.push((key.to_string(), answer)),
                Err(e) => failed = Some(e),
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(in_asked_order(keys, released))
    }

    /// Keep `owner`'s hold on each of `keys` at least `hold` from now: what
    /// [`KeyedFamily::extend`] answers for each, in the order asked.
    pub async fn extend_all(
        &self,
        keys: &[String],
        owner: &str,
        hold: Duration,
    ) -> Result<Vec<(String, KeyAnswer)>, KeyError> {
        self.check_keys(keys)?;
        self.check_owner(owner)?;
        let mut answers = Vec::with_capacity(keys.len());
        for key in keys {
            answers.push((key.clone(), self.extend(key, owner, hold).await?));
        }
        // Each key extended is read back once all are: an answer's validity counts from its
        // own extension, and the later keys' extensions took their time.
        for (key, answer) in &mut answers {
            if matches!(answer, KeyAnswer::Held { .. }) {
                *answer = self.status(key, Some(owner))?;
            }
        }
        Ok(answers)
    }

    /// What an acquisition of `keys` by `owner` would refuse as bad input, checked without
    /// taking anything: for a caller that waits for something else first (a turn among its own
    /// holds), so that a bad request is refused at once. `read_write`: a mode was asked for.
    pub fn check_acquisition(
        &self,
        keys: &[String],
        owner: &str,
        read_write: bool,
    ) -> Result<(), KeyError> {
        self.check_new_keys(keys)?;
        self.check_owner(owner)?;
        if read_write {
            self.check_read_write()?;
        }
        Ok(())
    }

    /// `keys` to be taken, checked (each valid now, none twice, at least one, at most
    /// [`MAX_KEYS_AT_ONCE`] and the family's limit of keys held), in the canonical order they
    /// are taken in.
    fn check_new_keys<'k>(&self, keys: &'k [String]) -> Result<Vec<&'k str>, KeyError> {
        let limit = MAX_KEYS_AT_ONCE.min(self.read_config(|c| c.max_keys));
        ordered(keys, limit, |key| self.check_new_key(key))
    }

    /// `keys` that may be held, checked as [`Self::check_new_keys`] does but against the
    /// bounds of what may have been taken: a limit lowered since leaves them to be extended
    /// and released together.
    fn check_keys<'k>(&self, keys: &'k [String]) -> Result<Vec<&'k str>, KeyError> {
        ordered(keys, MAX_KEYS_AT_ONCE, |key| self.check_key(key))
    }
}

/// `keys` (at least one, at most `limit`, each passing `check`, none twice) in the canonical
/// order.
fn ordered(
    keys: &[String],
    limit: usize,
    check: impl Fn(&str) -> Result<(), KeyError>,
) -> Result<Vec<&str>, KeyError> {
    if keys.is_empty() || keys.len() > limit {
        return Err(KeyError::BadKeys(format!(
            "name 1 to {limit} keys at once (there were {})",
            keys.len()
        )));
    }
    for key in keys {
        check(key)?;
    }
    let mut order: Vec<&str> = keys.iter().map(String::as_str).collect();
    order.sort_unstable();
    if let Some(twice) = order.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(KeyError::BadKeys(format!(
            "the key {:?} is named twice",
            twice[0]
        )));
    }
    Ok(order)
}

fn in_asked_order<T>(keys: &[String], mut answers: Vec<(String, T)>) -> Vec<(String, T)> {
    answers.sort_by_key(|(key, _)| keys.iter().position(|k| k == key));
    answers
}

/// A read of several keys asked by an owner that writes `key` (no downgrade within one call).
fn written(key: &str, owner: &str) -> KeyError {
    KeyError::BadMode(format!(
        "{owner} writes {key:?}: acquire it again among several keys with mode=write"
    ))
}
