//! Holds bound to a connection: `POST /lock/hold`, `/locks/{name}/hold`,
//! `/locks/{family}/keys/{key}/hold` and `/locks/{family}/hold?keys=...` take the lock (or the
//! keys) as `acquire` does, then answer an event
//! stream (server-sent events) for as long as the app keeps the connection open. The lock is held
//! while the connection lives, with no `hold` to guess, and released the moment it closes.
//!
//! The stream says `acquired` (token, validity), `renewed` each time the claim moves on (its new
//! validity), and ends with `lost` (the claim ran out or the backend said the lease is gone, sent
//! the moment the sidecar knows) or `released` (the sidecar stopped, or the acquisition was
//! released by another call). An app holds until `validForMs` after the last event it read,
//! or until `lost`, whichever comes first: a sidecar paused past its claim says nothing until it
//! runs again, and then says `lost` at once. An event read late (its reader stopped or starved,
//! the event left in a buffer) says more than is left: a reader on the sidecar's machine also
//! takes `validUntilBootTimeMs`, the claim's end on the machine's boot clock, whichever is
//! earlier.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use leasehold_lease::boot_clock::BootInstant;
use leasehold_lease::keyed::{KeyedFamily, WriteHolding, own_permit};
use leasehold_lease::{EventKind, Lock};
use serde_json::{Map, Value, json};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

/// The hold a connection's acquisition is taken with, in leases, moved on every renew interval
/// while the connection lives: it only matters when the stream's task can no longer move it (an
/// acquisition granted just as its client hung up), and then frees the lock this long after.
pub const BOUND_HOLD_LEASES: u32 = 2;
/// A comment this often keeps proxies from closing an idle stream, and finds a peer that went
/// away without closing its connection.
const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// What a connection holds, with the token each part was taken with: one acquisition of a
/// lock, of a key for one owner, of a key's write lock (several parts, each a lock of the
/// backend, followed together), of several keys for one owner (all or nothing), or of several
/// keys' write locks for one owner (all or nothing).
pub enum Bound {
    Lock {
        lock: Lock,
        /// Of a lock of several permits, the one taken (its tokens count apart).
        permit: u32,
        token: u64,
    },
    Key {
        family: KeyedFamily,
        key: String,
        owner: String,
        permit: u32,
        token: u64,
    },
    Write {
        family: KeyedFamily,
        holding: WriteHolding,
        token: u64,
    },
    Keys {
        family: KeyedFamily,
        owner: String,
        /// Each key with the permit and the token it was taken with.
        keys: Vec<(String, u32, u64)>,
    },
    Writes {
        family: KeyedFamily,
        /// Each key's write lock.
        holdings: Vec<WriteHolding>,
    },
}

/// A connection's hold for a lock of `lease`.
pub fn bound_hold(lease: Duration) -> Duration {
    lease * BOUND_HOLD_LEASES
}

impl Bound {
    /// The lease and the renew interval it was taken with.
    fn timing(&self) -> (Duration, Duration) {
        let config = match self {
            Bound::Lock { lock, .. } => {
                return (lock.config().lease_duration, lock.config().renew_interval);
            }
            Bound::Key { family, .. }
            | Bound::Write { family, .. }
            | Bound::Keys { family, .. }
            | Bound::Writes { family, .. } => family.config(),
        };
        (config.lease_duration, config.renew_interval)
    }

    /// What every event says of the holding's token: the one token of a lock, a key or a write
    /// lock; nothing for several keys, whose tokens the stream names once, each with its key.
    /// A lock of several permits names the permit beside it.
    fn token_field(&self) -> Map<String, Value> {
        let token = match self {
            Bound::Lock { token, .. } | Bound::Key { token, .. } | Bound::Write { token, .. } => {
                *token
            }
            Bound::Keys { .. } | Bound::Writes { .. } => return Map::new(),
        };
        let mut field = Map::new();
        field.insert("fencingToken".into(), token.into());
        if let Bound::Lock { lock, permit, .. } = self
            && lock.has_had_permits()
        {
            field.insert("permit".into(), (*permit).into());
        }
        field
    }

    /// The engines that hold it now, each with the holding (permit, token) its part was taken
    /// as, or `None` once a part is no longer held.
    fn parts(&self) -> Option<Vec<(Lock, (u32, u64))>> {
        let (engines, parts) = match self {
            Bound::Write { holding, .. } => return Some(own_permits(holding.parts()?)),
            Bound::Writes { holdings, .. } => {
                let mut parts = Vec::new();
                for holding in holdings {
                    parts.extend(own_permits(holding.parts()?));
                }
                return Some(parts);
            }
            Bound::Keys { keys, .. } => (self.engines(), keys.len()),
            Bound::Lock { .. } | Bound::Key { .. } => (self.engines(), 1),
        };
        (engines.len() == parts).then_some(engines)
    }

    /// Keep the acquisition at least `hold` from now: each part the engine holding it now
    /// still holds with its token (a later holding is another acquisition's).
    async fn extend(&self, hold: Duration) {
        let extended = match self {
            Bound::Write { holding, .. } => holding.extend(hold).await.map(drop),
            Bound::Writes { holdings, .. } => {
                let extensions = holdings.iter().map(|holding| holding.extend(hold));
                futures_util::future::try_join_all(extensions)
                    .await
                    .map(drop)
            }
            _ => {
                let extensions = self
                    .engines()
                    .into_iter()
                    .map(|(engine, holding)| async move { engine.extend_if(holding, hold).await });
                futures_util::future::try_join_all(extensions)
                    .await
                    .map(drop)
                    .map_err(Into::into)
            }
        };
        if let Err(e) = extended {
            tracing::debug!(error = %e, "a connection's hold was not extended");
        }
    }

    /// Give up the connection's acquisition: of each part, if the engine holding it now still
    /// holds it with its token (the lease lost, then taken again by another call, is not the
    /// connection's to release). A write lock's parts are released together, or the write lock
    /// ends whole. `Binding::Unbound`: the parts were never bound to the connection ([`bind`]),
    /// so they are given back as any call's acquisitions are, leaving the count of other
    /// connections' bindings of the same holding as it is.
    async fn release(&self, binding: Binding) {
        let bound = binding == Binding::Bound;
        let released = match self {
            Bound::Write { holding, .. } if bound => holding.release_bound().await.map(drop),
            Bound::Write { holding, .. } => holding.release().await.map(drop),
            Bound::Writes { holdings, .. } => {
                let releases = holdings.iter().map(|holding| async move {
                    match bound {
                        true => holding.release_bound().await,
                        false => holding.release().await,
                    }
                });
                futures_util::future::join_all(releases)
                    .await
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()
                    .map(drop)
            }
            _ => {
                let releases = self
                    .engines()
                    .into_iter()
                    .map(|(engine, holding)| async move {
                        match bound {
                            true => engine.release_bound(holding).await,
                            false => engine.release_if(holding).await,
                        }
                    });
                futures_util::future::join_all(releases)
                    .await
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()
                    .map(drop)
                    .map_err(Into::into)
            }
        };
        if let Err(e) = released {
            tracing::warn!(error = %e, "releasing a closed connection's hold failed; it lapses with its hold");
        }
    }

    /// The engines holding a lock's or keys' parts now, each with its holding (permit, token);
    /// those no longer held are left out (not a write lock's: its parts are released through
    /// it).
    fn engines(&self) -> Vec<(Lock, (u32, u64))> {
        match self {
            Bound::Lock {
                lock,
                permit,
                token,
            } => vec![(lock.clone(), (*permit, *token))],
            Bound::Key {
                family,
                key,
                owner,
                permit,
                token,
            } => family
                .holding_on_permit(key, *permit, owner)
                .map(|lock| vec![(lock, own_permit(*token))])
                .unwrap_or_default(),
            Bound::Keys {
                family,
                owner,
                keys,
            } => keys
                .iter()
                .filter_map(|(key, permit, token)| {
                    family
                        .holding_on_permit(key, *permit, owner)
                        .map(|lock| (lock, own_permit(*token)))
                })
                .collect(),
            Bound::Write { .. } | Bound::Writes { .. } => Vec::new(),
        }
    }

    /// Give the acquisition up once `told_until` (the end of the validity the client was last
    /// told) and the engine's safety margin have passed.
    async fn release_after(
        &self,
        family: &KeyedFamily,
        told_until: Option<BootInstant>,
        binding: Binding,
    ) {
        if let Some(until) = told_until {
            let margin = leasehold_lease::safety_margin(family.config().lease_duration);
            tokio::time::sleep_until((until + margin).to_tokio()).await;
        }
        self.release(binding).await;
    }

    /// After a part was found ended: a write lock steps down whole (its other parts given back
    /// once their last answer has run out); several keys are all given back once `told_until`,
    /// the end of the validity the client was last told, and the engine's safety margin have
    /// passed: until then the client may still act on every key, its `lost` unread. Of several
    /// write locks, the one found ended steps down whole at once, as one key's does, and the
    /// others are given back as several keys are.
    async fn ended(&self, told_until: Option<BootInstant>, binding: Binding) {
        match self {
            Bound::Write { holding, .. } => {
                holding.answer();
            }
            Bound::Writes { family, holdings } => {
                for holding in holdings {
                    holding.answer();
                }
                self.release_after(family, told_until, binding).await;
            }
            Bound::Keys { family, .. } => self.release_after(family, told_until, binding).await,
            Bound::Lock { .. } | Bound::Key { .. } => {}
        }
    }
}

/// Whether a connection's acquisition was bound to its engines ([`bind`]) when it is given up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Binding {
    Bound,
    /// A part had ended before the stream began: nothing was bound.
    Unbound,
}

/// Tell the engines of every part of a connection's acquisition ([`Bound::parts`]) that the
/// connection holds it, before its client is told anything: a release by another call then
/// lets it lapse rather than free it while the client may still act on its last event
/// ([`Lock::bind`]), and how that went. A part that was not bound is no longer the
/// connection's: another call gave its acquisition back (a retried release, beside holds that
/// are all bound), or the holding ended. The stream then holds nothing: the parts bound are
/// given back here, by the connection, and the others left as they are (giving one back would
/// end another connection's acquisition).
async fn bind(parts: &[(Lock, (u32, u64))]) -> Bind {
    let mut bound = Vec::new();
    for (engine, holding) in parts {
        match engine.bind(*holding).await {
            Ok(true) => bound.push((engine, holding)),
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(error = %e, "a connection's hold was not bound to its engine");
            }
        }
    }
    if bound.len() == parts.len() {
        return Bind::Bound;
    }
    // Read before the parts bound are given back, which may end their holdings.
    let given_up = parts.iter().all(|(engine, holding)| {
        engine
            .snapshot()
            .held
            .is_some_and(|held| (held.permit, held.token) == *holding)
    });
    for (engine, holding) in bound {
        if let Err(e) = engine.release_bound(*holding).await {
            tracing::warn!(error = %e, "giving back a connection's hold failed; it lapses with its hold");
        }
    }
    match given_up {
        true => Bind::GivenUp,
        false => Bind::Lost,
    }
}

/// How binding a connection's acquisition went ([`bind`]).
enum Bind {
    Bound,
    /// Every part still held as taken: another call gave this acquisition up.
    GivenUp,
    /// A part's holding ended.
    Lost,
}

/// The stream for an acquisition `bound` holds; `about` names it in every event (lock, or
/// family, key and owner, or family, owner and each key with its token). `turns`, an
/// exclusive hold's places, are kept until the acquisition is given up.
pub fn respond(
    bound: Bound,
    about: Map<String, Value>,
    turns: Vec<tokio::sync::OwnedMutexGuard<()>>,
) -> Response {
    let (events, receiver) = mpsc::channel(4);
    tokio::spawn(async move {
        follow(bound, about, events).await;
        drop(turns);
    });
    let stream = ReceiverStream::new(receiver);
    Sse::new(futures_util::StreamExt::map(stream, Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

/// How long a holding valid until `until` is valid: from now (`validForMs`, which a client
/// counts from its reading of the event, and so past the claim by as long as the event waited to
/// be read), and as an instant on the machine's `CLOCK_BOOTTIME` in milliseconds
/// (`validUntilBootTimeMs`, with the machine's `bootId`), which every process on the machine
/// reads alike however late it reads the event. Both rounded down: never past the claim.
pub fn validity(until: BootInstant) -> Map<String, Value> {
    let mut fields = Map::new();
    let valid_for = until.saturating_duration_since(BootInstant::now());
    fields.insert("validForMs".into(), (valid_for.as_millis() as u64).into());
    fields.insert("validUntilBootTimeMs".into(), until.as_millis().into());
    // Which boot's clock that is: a reader elsewhere (through a port forward) tells it apart.
    if let Some(boot_id) = leasehold_lease::boot_clock::boot_id() {
        fields.insert("bootId".into(), boot_id.into());
    }
    fields
}

fn event(kind: &str, about: &Map<String, Value>, fields: Value) -> SseEvent {
    let mut body = about.clone();
    if let Value::Object(fields) = fields {
        body.extend(fields);
    }
    SseEvent::default()
        .event(kind)
        .data(Value::Object(body).to_string())
}

/// How the acquisition stands now.
enum Standing {
    /// Held: the claim (renewed as the lease is) valid until `claim`, and the answer until
    /// `answer` (the claim, or the hold if that ends first).
    Held {
        claim: BootInstant,
        answer: BootInstant,
    },
    /// Ended: by a release (`true`) or a loss.
    Ended { released: bool, reason: String },
    /// No longer held, and the event that says why not read yet: the engine publishes its
    /// state a moment before it tells the event.
    Untold,
}

/// Why a hold ended, when no event of the engine says.
const NO_LONGER_HELD: &str = "the lease is no longer held";
const GIVEN_UP_BY_ANOTHER_CALL: &str =
    "another call released the acquisition before its stream began";
/// How long an ending whose event has not come is waited for before it is told as a loss.
const UNTOLD_PATIENCE: Duration = Duration::from_millis(20);

/// Each of a key's engine parts, with its holding: a key's engines hold permit 0 of their own
/// lock.
fn own_permits(parts: Vec<(Lock, u64)>) -> Vec<(Lock, (u32, u64))> {
    parts
        .into_iter()
        .map(|(engine, token)| (engine, own_permit(token)))
        .collect()
}

/// Read the engine's state and its events since the last look, for the holding
/// (`permit`, `token`).
fn standing(
    engine: &Lock,
    (permit, token): (u32, u64),
    events: &mut broadcast::Receiver<leasehold_lease::Event>,
) -> Standing {
    let held = engine
        .snapshot()
        .held
        .filter(|h| (h.permit, h.token) == (permit, token));
    match held {
        Some(h) if BootInstant::now() < h.valid_until => Standing::Held {
            claim: h.valid_until,
            answer: h
                .hold_until
                .map_or(h.valid_until, |hold| hold.min(h.valid_until)),
        },
        Some(_) => Standing::Ended {
            released: false,
            reason: "the claim ran out before it was renewed".into(),
        },
        _ => {
            // The engine tells its events in the step that publishes its state.
            let mut ending = None;
            let closed = loop {
                match events.try_recv() {
                    Ok(e)
                        if (e.permit, e.token) == (permit, token)
                            && e.kind != EventKind::Acquired =>
                    {
                        ending = Some(e)
                    }
                    Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                    Err(broadcast::error::TryRecvError::Empty) => break false,
                    Err(broadcast::error::TryRecvError::Closed) => break true,
                }
            };
            match ending {
                Some(e) => Standing::Ended {
                    released: e.kind == EventKind::Released,
                    reason: e.reason.to_owned(),
                },
                None if !closed => Standing::Untold,
                None => no_longer_held(),
            }
        }
    }
}

/// An ending no event explains.
fn no_longer_held() -> Standing {
    Standing::Ended {
        released: false,
        reason: NO_LONGER_HELD.into(),
    }
}

/// How an acquisition of several parts stands: held while every part is, until the earliest
/// part's claim and answer; ended once any part has, lost where any part was lost (a part's
/// ending still untold is waited for, unless another part was lost). `endings` keeps each
/// part's ending once found, as its event is read only once.
fn standing_of(
    parts: &[(Lock, (u32, u64))],
    events: &mut [broadcast::Receiver<leasehold_lease::Event>],
    endings: &mut [Option<(bool, String)>],
) -> Standing {
    let mut held: Option<(BootInstant, BootInstant)> = None;
    let mut untold = false;
    for (((engine, token), events), ending) in parts.iter().zip(events).zip(endings.iter_mut()) {
        if ending.is_some() {
            continue;
        }
        match standing(engine, *token, events) {
            Standing::Held { claim, answer } => {
                held = Some(held.map_or((claim, answer), |(c, a)| (c.min(claim), a.min(answer))));
            }
            Standing::Ended { released, reason } => *ending = Some((released, reason)),
            Standing::Untold => untold = true,
        }
    }
    let lost = endings.iter().flatten().find(|(released, _)| !released);
    let released = endings.iter().flatten().next();
    match (lost, untold, released, held) {
        (Some((_, reason)), _, _, _) => Standing::Ended {
            released: false,
            reason: reason.clone(),
        },
        (None, true, _, _) => Standing::Untold,
        (None, false, Some((_, reason)), _) => Standing::Ended {
            released: true,
            reason: reason.clone(),
        },
        (None, false, None, Some((claim, answer))) => Standing::Held { claim, answer },
        (None, false, None, None) => no_longer_held(),
    }
}

/// Until any of `states` changes; an error once one of their engines has ended.
async fn any_changed(
    states: &mut [watch::Receiver<leasehold_lease::Snapshot>],
) -> Result<(), watch::error::RecvError> {
    futures_util::future::select_all(states.iter_mut().map(|state| Box::pin(state.changed())))
        .await
        .0
}

/// The stream's task: extend while the connection lives, tell every renewal, and end with
/// `lost` or `released`; release when the connection closes.
async fn follow(bound: Bound, mut about: Map<String, Value>, events: mpsc::Sender<SseEvent>) {
    about.extend(bound.token_field());
    let Some(parts) = bound.parts() else {
        let _ = events
            .send(event("lost", &about, json!({"reason": NO_LONGER_HELD})))
            .await;
        bound.ended(None, Binding::Unbound).await;
        return;
    };
    let unbound = match bind(&parts).await {
        Bind::Bound => None,
        Bind::GivenUp => Some(("released", GIVEN_UP_BY_ANOTHER_CALL)),
        Bind::Lost => Some(("lost", NO_LONGER_HELD)),
    };
    if let Some((kind, reason)) = unbound {
        let _ = events
            .send(event(kind, &about, json!({"reason": reason})))
            .await;
        return;
    }
    // The first part says what the holding is: its holder's identity and its count of
    // acquisitions (a write lock's gate).
    let engine = parts[0].0.clone();
    let mut engine_events: Vec<_> = parts.iter().map(|(engine, _)| engine.events()).collect();
    let mut states: Vec<_> = parts.iter().map(|(engine, _)| engine.watch()).collect();
    let mut endings = vec![None; parts.len()];
    let mut untold_since = None;
    let (lease, renew_interval) = bound.timing();
    let hold = bound_hold(lease);
    let mut extend = tokio::time::interval(renew_interval);
    extend.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    extend.tick().await;
    let mut told: Option<BootInstant> = None;
    // The end of the validity the client was last told: what it may act on until.
    let mut told_until: Option<BootInstant> = None;
    let mut engine_ended = false;
    loop {
        for state in &mut states {
            state.borrow_and_update();
        }
        let standing = match standing_of(&parts, &mut engine_events, &mut endings) {
            // An engine that ended says so before it ends; this is a backstop.
            Standing::Held { .. } if engine_ended => Standing::Ended {
                released: true,
                reason: "the lock stopped".into(),
            },
            Standing::Untold => {
                let since = *untold_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() < UNTOLD_PATIENCE {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                Standing::Untold
            }
            standing => standing,
        };
        let (claim, answer) = match standing {
            Standing::Held { claim, answer } => (claim, answer),
            ended => {
                let (released, reason) = match ended {
                    Standing::Ended { released, reason } => (released, reason),
                    _ => (false, NO_LONGER_HELD.to_owned()),
                };
                let kind = if released { "released" } else { "lost" };
                // Within a renew interval: a client that no longer reads (its `exec` gone, a
                // command holding the connection) must not keep this task, and its turn.
                let _ = tokio::time::timeout(
                    renew_interval,
                    events.send(event(kind, &about, json!({"reason": reason}))),
                )
                .await;
                // The stream ends here; what is left to give back is given back after.
                drop(events);
                bound.ended(told_until, Binding::Bound).await;
                return;
            }
        };
        // Told when the claim moves on (a renewal); the hold moves on with every extension.
        if told != Some(claim) {
            let mut fields = Value::Object(validity(answer));
            // Several keys' acquisitions are counted key by key: no one count to tell.
            if !matches!(bound, Bound::Keys { .. } | Bound::Writes { .. }) {
                fields["holds"] = engine.snapshot().holds.into();
            }
            let delivered = if told.is_none() {
                fields["identity"] = engine.config().identity.clone().into();
                // What a client needs to tell a late renewal from a normal one.
                fields["leaseDurationMs"] = (lease.as_millis() as u64).into();
                fields["renewIntervalMs"] = (renew_interval.as_millis() as u64).into();
                events
                    .send(event("acquired", &about, fields))
                    .await
                    .map_err(|_| ())
            } else {
                // Never waited for: the hold is extended below whether or not the client
                // reads, and one that stopped reading (its `exec` gone, a command it started
                // holding the connection open) keeps the lock held. A renewal it misses only
                // shortens the claim it counts on.
                match events.try_send(event("renewed", &about, fields)) {
                    Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
                    Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => Ok(()),
                }
            };
            if delivered.is_err() {
                bound.release(Binding::Bound).await;
                return;
            }
            told = Some(claim);
            told_until = Some(answer);
        }
        let wake = if answer > BootInstant::now() {
            answer
        } else {
            claim
        };
        tokio::select! {
            _ = events.closed() => {
                bound.release(Binding::Bound).await;
                return;
            }
            _ = extend.tick() => bound.extend(hold).await,
            changed = any_changed(&mut states), if !engine_ended => engine_ended = changed.is_err(),
            // The hold's end (the engine steps down then, and says so), or, once that has
            // passed with the engine busy in a call, the claim's.
            _ = tokio::time::sleep_until(wake.to_tokio()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{next_event, sqlite_backend};
    use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease};
    use leasehold_lease::{LockConfig, Mode};
    use std::sync::Arc;

    /// Both validities end at the claim or before it: `validForMs` counted from when it was
    /// made, and `validUntilBootTimeMs` as an instant every process on the machine reads alike.
    #[test]
    fn a_validity_never_ends_past_the_claim() {
        let before = BootInstant::now();
        let until = before + Duration::from_millis(4321) + Duration::from_nanos(999_999);
        let fields = validity(until);
        let after = BootInstant::now();
        let valid_for = Duration::from_millis(fields["validForMs"].as_u64().unwrap());
        assert!(
            before + valid_for <= until && after + valid_for + Duration::from_millis(1) > until
        );
        let boot_until = fields["validUntilBootTimeMs"].as_u64().unwrap();
        let boot_until = BootInstant::from_millis(boot_until);
        assert!(boot_until <= until, "rounded up past the claim");
        assert!(until.saturating_duration_since(boot_until) < Duration::from_millis(1));
    }

    /// An acquisition that another call gave back before its stream began (a retried release
    /// sent beside two holds) is not the stream's to hold: the stream says `released` rather than
    /// `acquired`, and leaves the other connection's binding alone, so that the backend keeps
    /// the lock while that connection's client may act on what it was told.
    #[tokio::test]
    async fn a_hold_given_back_by_another_call_before_its_stream_began_is_told_released() {
        let dir = tempfile::tempdir().unwrap();
        let backend = sqlite_backend(&dir).await;
        let mut config = LockConfig::new("jobs", "pod-a", Duration::from_secs(10));
        config.mode = Mode::OnDemand;
        let lock = Lock::start(backend.clone(), config, Arc::new(())).unwrap();
        let hold = Duration::from_secs(30);
        // Two holds of the pod's: the first bound to its connection, the second not yet.
        let first = lock.acquire(Duration::ZERO, hold).await.unwrap();
        let holding = first.holding().expect("the lock is free");
        assert!(lock.bind(holding).await.unwrap());
        let second = lock.acquire(Duration::ZERO, hold).await.unwrap();
        assert_eq!(second.holding(), Some(holding));
        // A release by another call takes the unbound acquisition.
        assert!(lock.release().await.unwrap());
        let (permit, token) = holding;
        let stream = respond(
            Bound::Lock {
                lock: lock.clone(),
                permit,
                token,
            },
            Map::new(),
            Vec::new(),
        );
        let told = next_event(&mut stream.into_body().into_data_stream()).await;
        assert!(
            told.starts_with("event: released") && told.contains("another call released"),
            "the second hold's client was told it holds an acquisition already given back: {told}"
        );
        // The first connection's acquisition is left as it was: counted, and bound.
        assert_eq!(lock.snapshot().holds, 1);
        assert!(lock.release().await.unwrap());
        assert!(
            backend.observe("jobs").await.unwrap().is_some(),
            "a release by another call freed the lock in the backend at once, while the first \
             connection's client may act on what it was told"
        );
    }

    /// A connection's several keys of which one had ended before its stream began: the others
    /// are given back as any call's acquisitions are. Another connection of the owner's that
    /// holds one of those keys stays bound: a later release by another call lets that key lapse
    /// after the validity its client was told, not free it in the backend at once.
    #[tokio::test]
    async fn keys_given_back_before_their_stream_began_leave_another_connections_binding() {
        let dir = tempfile::tempdir().unwrap();
        let backend = sqlite_backend(&dir).await;
        let family = KeyedFamily::new(
            backend.clone(),
            FamilyConfig::new("docs", "pod-a", Duration::from_secs(10)),
            Arc::new(()),
        )
        .unwrap();
        let hold = Duration::from_secs(30);
        let KeyAnswer::Held { permit, token, .. } = family
            .acquire("y", "o", Duration::ZERO, hold)
            .await
            .unwrap()
        else {
            panic!("y is free");
        };
        // One connection holds y: its acquisition is bound to y's engine.
        let engine = family.holding_on_permit("y", permit, "o").unwrap();
        assert!(engine.bind(own_permit(token)).await.unwrap());
        // Another connection's acquisition of x and y: y taken again, x ended before its
        // stream began (it was never held).
        family
            .acquire("y", "o", Duration::ZERO, hold)
            .await
            .unwrap();
        let about = Map::new();
        let response = respond(
            Bound::Keys {
                family: family.clone(),
                owner: "o".into(),
                keys: vec![("x".into(), 0, 999), ("y".into(), permit, token)],
            },
            about,
            Vec::new(),
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        assert!(String::from_utf8_lossy(&body).contains("event: lost"));
        // Given back before the stream ended.
        assert_eq!(engine.snapshot().holds, 1);
        // The first connection's acquisition is all that is left; another call releases it.
        assert!(matches!(
            family.release("y", "o").await.unwrap(),
            KeyRelease::Released { .. }
        ));
        let name = family.backend_name("y").unwrap();
        assert!(
            backend.observe(&name).await.unwrap().is_some(),
            "y was freed in the backend at once, while the first connection's client may still \
             act on the validity it was told"
        );
    }
}
