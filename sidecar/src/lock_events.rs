//! `GET /lock/events`: a lock's changes in this pod as server-sent events, `state` first, then
//! `acquired`, `renewed`, `lost` and `released`. A campaign's followers learn from it that the
//! pod leads, so each word that says it holds also says for how long (`validForMs`): the
//! `state` of a holder, `acquired`, and a `renewed` each time the claim moves on. A sidecar
//! paused or starved past its claim says nothing until it runs again; a follower that counts
//! `validForMs` from each event it reads stops acting as the leader before anyone else can. One
//! that may read an event late also takes `validUntilBootTimeMs`, the same end on the machine's
//! boot clock ([`validity`](crate::hold_stream::validity)).

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use leasehold_lease::boot_clock::BootInstant;
use leasehold_lease::{Event, EventKind, Lock, Snapshot};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// The stream of `lock`'s changes.
pub fn respond(lock: Lock) -> Response {
    // Subscribed before the state is read, so that no change falls between the two.
    let changes = lock.events();
    let (events, receiver) = mpsc::channel(16);
    tokio::spawn(follow(lock, changes, events));
    let stream = ReceiverStream::new(receiver);
    Sse::new(futures_util::StreamExt::map(stream, Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The holding the stream last told of as held, and until when its answer was valid.
type Told = Option<((u32, u64), BootInstant)>;

/// The holding `snapshot` shows held, and until when an answer about it is valid.
fn held_in(snapshot: &Snapshot) -> Told {
    snapshot
        .held
        .as_ref()
        .map(|held| ((held.permit, held.token), held.answered_until()))
}

/// `body` with how long a holding valid until `until` is valid.
fn add_validity(body: &mut Value, until: BootInstant) {
    if let Value::Object(fields) = body {
        fields.extend(crate::hold_stream::validity(until));
    }
}

async fn follow(
    lock: Lock,
    mut changes: broadcast::Receiver<Event>,
    events: mpsc::Sender<SseEvent>,
) {
    let mut states = lock.watch();
    let permits = lock.has_had_permits();
    let (state, mut told) = state_event(&lock, &states.borrow_and_update(), permits);
    if events.send(state).await.is_err() {
        return;
    }
    let mut engine_running = true;
    loop {
        tokio::select! {
            _ = events.closed() => return,
            change = changes.recv() => {
                let event = match change {
                    Ok(event) => event,
                    // A reader that fell behind missed events: told the state anew.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let (state, now_told) = state_event(&lock, &lock.snapshot(), permits);
                        told = now_told;
                        if events.send(state).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let mut body = event_body(&event, permits);
                told = None;
                if event.kind == EventKind::Acquired
                    && let Some((holding, until)) = held_in(&lock.snapshot())
                    && holding == (event.permit, event.token)
                {
                    add_validity(&mut body, until);
                    told = Some((holding, until));
                }
                if events.send(sse(event.kind.as_str(), body)).await.is_err() {
                    return;
                }
            }
            changed = states.changed(), if engine_running => {
                if changed.is_err() {
                    engine_running = false;
                    continue;
                }
                let snapshot = states.borrow_and_update().clone();
                // Only a holding known to the stream (told of, or held when it began) is told
                // of as renewed: one not yet known is, with its validity, by its `acquired`.
                let Some(((holding, until), (told_holding, told_until))) =
                    held_in(&snapshot).zip(told)
                else {
                    continue;
                };
                if holding != told_holding || until == told_until || !snapshot.answer().is_holder() {
                    continue;
                }
                let mut body = holding_body(lock.name(), "renewed", holding, permits);
                add_validity(&mut body, until);
                told = Some((holding, until));
                // Never waited for: a client that reads slowly must not hold up the next,
                // fresher word; one it misses only shortens the validity it counts on.
                if let Err(mpsc::error::TrySendError::Closed(_)) =
                    events.try_send(sse("renewed", body))
                {
                    return;
                }
            }
        }
    }
}

/// The `state` event for `snapshot`, and the holding the stream then knows of. A holding that
/// stands is known even while the backend cannot be read (the answer then unknown, told without
/// a validity): its next renewal is told, with its validity.
fn state_event(lock: &Lock, snapshot: &Snapshot, permits: bool) -> (SseEvent, Told) {
    let answer = snapshot.answer();
    let mut state = json!({
        "lock": lock.name(),
        "holder": answer.is_holder(),
        "fencingToken": answer.token(),
        "since": crate::api::rfc3339(snapshot.since),
    });
    let known = held_in(snapshot).filter(|(_, until)| *until > BootInstant::now());
    if let (Some(holding), Some((shown, until))) = (answer.holding(), known)
        && holding == shown
    {
        add_validity(&mut state, until);
        if permits {
            state["permit"] = holding.0.into();
        }
    }
    (sse("state", state), known)
}

/// What every event of a holding says: the lock, the kind, the token, and on a lock of several
/// permits (`permits`) the permit the token is of.
fn holding_body(lock: &str, kind: &str, (permit, token): (u32, u64), permits: bool) -> Value {
    let mut body = json!({"lock": lock, "kind": kind, "fencingToken": token});
    if permits {
        body["permit"] = permit.into();
    }
    body
}

/// What an event of the engine's says.
fn event_body(event: &Event, permits: bool) -> Value {
    let holding = (event.permit, event.token);
    let mut body = holding_body(&event.lock, event.kind.as_str(), holding, permits);
    body["at"] = crate::api::rfc3339(event.at).into();
    body["reason"] = event.reason.into();
    body
}

fn sse(kind: &str, body: Value) -> SseEvent {
    SseEvent::default().event(kind).data(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{next_event, sqlite_backend};
    use leasehold_lease::{LockConfig, Mode};
    use std::sync::Arc;
    use std::time::Duration;

    /// A follower that begins while the leader's renewals fail (the answer unknown, its state
    /// without a validity) learns that the pod leads at the next renewal that succeeds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_that_began_during_a_failed_renewal_is_told_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = leasehold_testkit::faulty::FaultyDriver::wrap(sqlite_backend(&dir).await);
        let mut config = LockConfig::new("leader", "pod-a", Duration::from_secs(3));
        config.mode = Mode::Campaign;
        config.renew_interval = Duration::from_millis(300);
        let lock = Lock::start(faulty.clone(), config, Arc::new(())).unwrap();
        let mut state = lock.watch();
        tokio::time::timeout(
            Duration::from_secs(10),
            state.wait_for(|s| s.answer().is_holder()),
        )
        .await
        .expect("the pod leads")
        .unwrap();
        faulty.stall_renewals(true);
        tokio::time::timeout(
            Duration::from_secs(10),
            state.wait_for(|s| s.backend_error.is_some() && s.held.is_some()),
        )
        .await
        .expect("a renewal fails while the claim stands")
        .unwrap();
        let mut body = respond(lock.clone()).into_body().into_data_stream();
        let first = next_event(&mut body).await;
        assert!(
            first.starts_with("event: state") && !first.contains("validForMs"),
            "{first}"
        );
        faulty.stall_renewals(false);
        let next = next_event(&mut body).await;
        assert!(
            next.starts_with("event: renewed") && next.contains("validUntilBootTimeMs"),
            "the follower was not told that the pod leads: {next}"
        );
    }
}
