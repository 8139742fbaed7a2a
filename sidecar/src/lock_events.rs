//! `GET /lock/events`: a lock's changes in this pod as server-sent events, `state` first, then
//! `acquired`, `renewed`, `lost` and `released`. A campaign's followers learn from it that the
//! pod leads, so each word that says it holds also says for how long (`validForMs`): the
//! `state` of a holder, `acquired`, and a `renewed` each time the claim moves on. A sidecar
//! paused or starved past its claim says nothing until it runs again; a follower that counts
//! `validForMs` from each event it reads stops acting as the leader before anyone else can.

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

fn valid_for_ms(until: BootInstant) -> u64 {
    until
        .saturating_duration_since(BootInstant::now())
        .as_millis() as u64
}

async fn follow(
    lock: Lock,
    mut changes: broadcast::Receiver<Event>,
    events: mpsc::Sender<SseEvent>,
) {
    let mut states = lock.watch();
    let snapshot = states.borrow_and_update().clone();
    let permits = lock.has_had_permits();
    let answer = snapshot.answer();
    let mut state = json!({
        "lock": lock.name(),
        "holder": answer.is_holder(),
        "fencingToken": answer.token(),
        "since": crate::api::rfc3339(snapshot.since),
    });
    let mut told: Told = None;
    if let (Some(holding), Some((shown, until))) = (answer.holding(), held_in(&snapshot))
        && holding == shown
    {
        state["validForMs"] = valid_for_ms(until).into();
        if permits {
            state["permit"] = holding.0.into();
        }
        told = Some((holding, until));
    }
    if events.send(sse("state", state)).await.is_err() {
        return;
    }
    let mut engine_running = true;
    loop {
        tokio::select! {
            _ = events.closed() => return,
            change = changes.recv() => {
                let event = match change {
                    Ok(event) => event,
                    // A reader that falls behind skips what it missed; the next event, or the
                    // next renewal, carries the state.
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let mut body = event_body(&event, permits);
                told = None;
                if event.kind == EventKind::Acquired
                    && let Some((holding, until)) = held_in(&lock.snapshot())
                    && holding == (event.permit, event.token)
                {
                    body["validForMs"] = valid_for_ms(until).into();
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
                let now_held = held_in(&states.borrow_and_update());
                // Only a holding told of as acquired is told of as renewed: one not yet told
                // of is, with its validity, by its `acquired`.
                let Some(((holding, until), (told_holding, told_until))) = now_held.zip(told)
                else {
                    continue;
                };
                if holding != told_holding || until == told_until {
                    continue;
                }
                let mut body = json!({
                    "lock": lock.name(),
                    "kind": "renewed",
                    "fencingToken": holding.1,
                    "validForMs": valid_for_ms(until),
                });
                if permits {
                    body["permit"] = holding.0.into();
                }
                told = Some((holding, until));
                if events.send(sse("renewed", body)).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// What an event of the engine's says.
fn event_body(event: &Event, permits: bool) -> Value {
    let mut body = json!({
        "lock": event.lock,
        "kind": event.kind.as_str(),
        "fencingToken": event.token,
        "at": crate::api::rfc3339(event.at),
        "reason": event.reason,
    });
    if permits {
        body["permit"] = event.permit.into();
    }
    body
}

fn sse(kind: &str, body: Value) -> SseEvent {
    SseEvent::default().event(kind).data(body.to_string())
}
