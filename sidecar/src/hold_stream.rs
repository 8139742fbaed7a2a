//! Holds bound to a connection: `POST /lock/hold`, `/locks/{name}/hold` and
//! `/locks/{family}/keys/{key}/hold` take the lock as `acquire` does, then answer an event
//! stream (server-sent events) for as long as the app keeps the connection open. The lock is held
//! while the connection lives, with no `hold` to guess, and released the moment it closes.
//!
//! The stream says `acquired` (token, validity), `renewed` each time the claim moves on (its new
//! validity), and ends with `lost` (the claim ran out or the backend said the lease is gone, sent
//! the moment the sidecar knows) or `released` (the sidecar stopped, or the acquisition was
//! released by another call). An app holds until `validForMs` after the last event it read,
//! or until `lost`, whichever comes first: a sidecar paused past its claim says nothing until it
//! runs again, and then says `lost` at once.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use leasehold_lease::boot_clock::BootInstant;
use leasehold_lease::keyed::{KeyedFamily, WriteHolding};
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

/// What a connection holds: one acquisition of a lock, of a key for one owner, or of a key's
/// write lock (several parts, each a lock of the backend, followed together).
pub enum Bound {
    Lock(Lock),
    Key {
        family: KeyedFamily,
        key: String,
        owner: String,
    },
    Write {
        family: KeyedFamily,
        holding: WriteHolding,
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
            Bound::Lock(lock) => {
                return (lock.config().lease_duration, lock.config().renew_interval);
            }
            Bound::Key { family, .. } | Bound::Write { family, .. } => family.config(),
        };
        (config.lease_duration, config.renew_interval)
    }

    /// The engines that hold it now, each with the token it holds with (`token`, the
    /// acquisition's, for a lock or a key; each part's own for a write lock), or `None` once
    /// it is no longer held.
    fn parts(&self, token: u64) -> Option<Vec<(Lock, u64)>> {
        match self {
            Bound::Write { holding, .. } => holding.parts(),
            _ => self.engine().map(|engine| vec![(engine, token)]),
        }
    }

    /// Keep the acquisition at least `hold` from now, while the holding is `token`'s.
    async fn extend(&self, token: u64, hold: Duration) {
        let extended = match (self, self.engine()) {
            (Bound::Write { holding, .. }, _) => holding.extend(hold).await.map(drop),
            (_, Some(engine)) => engine
                .extend_if(token, hold)
                .await
                .map(drop)
                .map_err(Into::into),
            (_, None) => return,
        };
        if let Err(e) = extended {
            tracing::debug!(error = %e, token, "a connection's hold was not extended");
        }
    }

    /// Give up the connection's acquisition, if the engine still holds it with `token`: a
    /// later holding (the lease lost, then taken again by another call) is not the
    /// connection's to release. A write lock's parts are released together, or the write lock
    /// ends whole.
    async fn release(&self, token: u64) {
        let released = match (self, self.engine()) {
            (Bound::Write { holding, .. }, _) => holding.release().await.map(drop),
            (_, Some(engine)) => engine.release_if(token).await.map(drop).map_err(Into::into),
            (_, None) => return,
        };
        if let Err(e) = released {
            tracing::warn!(error = %e, token, "releasing a closed connection's hold failed; it lapses with its hold");
        }
    }

    /// The engine that holds a lock or a key now (not a write lock's: it has several).
    fn engine(&self) -> Option<Lock> {
        match self {
            Bound::Lock(lock) => Some(lock.clone()),
            Bound::Key { family, key, owner } => family.holding(key, owner),
            Bound::Write { .. } => None,
        }
    }

    /// After a part was found lost: a write lock steps down whole (its other parts given back
    /// once their last answer has run out).
    fn ended(&self) {
        if let Bound::Write { holding, .. } = self {
            holding.answer();
        }
    }
}

/// The stream for an acquisition `bound` holds with `token`; `about` names it in every event
/// (lock, or family, key and owner). `turn`, an exclusive hold's place, is kept until the
/// acquisition is given up.
pub fn respond(
    bound: Bound,
    token: u64,
    about: Map<String, Value>,
    turn: Option<tokio::sync::OwnedMutexGuard<()>>,
) -> Response {
    let (events, receiver) = mpsc::channel(4);
    tokio::spawn(async move {
        follow(bound, token, about, events).await;
        drop(turn);
    });
    let stream = ReceiverStream::new(receiver);
    Sse::new(futures_util::StreamExt::map(stream, Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
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
}

/// Read the engine's state and its events since the last look.
fn standing(
    engine: &Lock,
    token: u64,
    events: &mut broadcast::Receiver<leasehold_lease::Event>,
) -> Standing {
    let held = engine.snapshot().held;
    match held {
        Some(h) if h.token == token && BootInstant::now() < h.valid_until => Standing::Held {
            claim: h.valid_until,
            answer: h
                .hold_until
                .map_or(h.valid_until, |hold| hold.min(h.valid_until)),
        },
        Some(h) if h.token == token => Standing::Ended {
            released: false,
            reason: "the claim ran out before it was renewed".into(),
        },
        _ => {
            // The engine tells its events in the step that publishes its state.
            let mut ending = None;
            loop {
                match events.try_recv() {
                    Ok(e) if e.token == token && e.kind != EventKind::Acquired => ending = Some(e),
                    Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                    Err(_) => break,
                }
            }
            match ending {
                Some(e) => Standing::Ended {
                    released: e.kind == EventKind::Released,
                    reason: e.reason.to_owned(),
                },
                None => Standing::Ended {
                    released: false,
                    reason: "the lease is no longer held".into(),
                },
            }
        }
    }
}

/// How an acquisition of several parts stands: held while every part is, until the earliest
/// part's claim and answer; ended once any part has, lost where any part was lost.
fn standing_of(
    parts: &[(Lock, u64)],
    events: &mut [broadcast::Receiver<leasehold_lease::Event>],
) -> Standing {
    let mut held: Option<(BootInstant, BootInstant)> = None;
    let mut ended: Option<(bool, String)> = None;
    for ((engine, token), events) in parts.iter().zip(events) {
        match standing(engine, *token, events) {
            Standing::Held { claim, answer } => {
                held = Some(held.map_or((claim, answer), |(c, a)| (c.min(claim), a.min(answer))));
            }
            Standing::Ended { released, reason } => {
                if ended
                    .as_ref()
                    .is_none_or(|(was_released, _)| *was_released && !released)
                {
                    ended = Some((released, reason));
                }
            }
        }
    }
    match (ended, held) {
        (None, Some((claim, answer))) => Standing::Held { claim, answer },
        (Some((released, reason)), _) => Standing::Ended { released, reason },
        (None, None) => Standing::Ended {
            released: false,
            reason: "the lease is no longer held".into(),
        },
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
async fn follow(
    bound: Bound,
    token: u64,
    about: Map<String, Value>,
    events: mpsc::Sender<SseEvent>,
) {
    let Some(parts) = bound.parts(token) else {
        let _ = events
            .send(event(
                "lost",
                &about,
                json!({"fencingToken": token, "reason": "the lease is no longer held"}),
            ))
            .await;
        return;
    };
    // The first part says what the holding is: its holder's identity and its count of
    // acquisitions (a write lock's gate).
    let engine = parts[0].0.clone();
    let mut engine_events: Vec<_> = parts.iter().map(|(engine, _)| engine.events()).collect();
    let mut states: Vec<_> = parts.iter().map(|(engine, _)| engine.watch()).collect();
    let (lease, renew_interval) = bound.timing();
    let hold = bound_hold(lease);
    let mut extend = tokio::time::interval(renew_interval);
    extend.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    extend.tick().await;
    let mut told: Option<BootInstant> = None;
    let mut engine_ended = false;
    loop {
        for state in &mut states {
            state.borrow_and_update();
        }
        let standing = match standing_of(&parts, &mut engine_events) {
            // An engine that ended says so before it ends; this is a backstop.
            Standing::Held { .. } if engine_ended => Standing::Ended {
                released: true,
                reason: "the lock stopped".into(),
            },
            standing => standing,
        };
        let (claim, answer) = match standing {
            Standing::Held { claim, answer } => (claim, answer),
            Standing::Ended { released, reason } => {
                bound.ended();
                let kind = if released { "released" } else { "lost" };
                // Within a renew interval: a client that no longer reads (its `exec` gone, a
                // command holding the connection) must not keep this task, and its turn.
                let _ = tokio::time::timeout(
                    renew_interval,
                    events.send(event(
                        kind,
                        &about,
                        json!({"fencingToken": token, "reason": reason}),
                    )),
                )
                .await;
                return;
            }
        };
        // Told when the claim moves on (a renewal); the hold moves on with every extension.
        if told != Some(claim) {
            let valid_for = answer.saturating_duration_since(BootInstant::now());
            let mut fields = json!({
                "fencingToken": token,
                "validForMs": valid_for.as_millis() as u64,
                "holds": engine.snapshot().holds,
            });
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
                bound.release(token).await;
                return;
            }
            told = Some(claim);
        }
        let wake = if answer > BootInstant::now() {
            answer
        } else {
            claim
        };
        tokio::select! {
            _ = events.closed() => {
                bound.release(token).await;
                return;
            }
            _ = extend.tick() => bound.extend(token, hold).await,
            changed = any_changed(&mut states), if !engine_ended => engine_ended = changed.is_err(),
            // The hold's end (the engine steps down then, and says so), or, once that has
            // passed with the engine busy in a call, the claim's.
            _ = tokio::time::sleep_until(wake.to_tokio()) => {}
        }
    }
}
