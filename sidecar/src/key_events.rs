//! `GET /locks/{family}/keys/{key}/events`: an observer follows one key's holders, in any pod,
//! as server-sent events. Each `holder` event names the holder as the backend reports it
//! (`POD/OWNER`, or `null` when the key is free) and its fencing token; the first comes at once,
//! the next whenever the holder changes, within a renew interval. The backend is asked once
//! per renew interval, and no more: an observer takes no part in the backend's wake-ups (a
//! waiter's place in line, a session kept blocked), which are its waiters'. `unknown` says the
//! backend could not be asked, once per outage.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use leasehold_lease::keyed::{KeyError, KeyedFamily};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The stream for `key` of `family`, after checking the key.
pub fn respond(family: KeyedFamily, key: String) -> Result<Response, KeyError> {
    family.backend_name(&key)?;
    let (events, receiver) = mpsc::channel(4);
    tokio::spawn(follow(family, key, events));
    let stream = ReceiverStream::new(receiver);
    Ok(
        Sse::new(futures_util::StreamExt::map(stream, Ok::<_, Infallible>))
            .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
            .into_response(),
    )
}

/// What the stream last told.
#[derive(PartialEq)]
enum Told {
    Nothing,
    Holder(Option<(String, u64)>),
    Unknown,
}

async fn follow(family: KeyedFamily, key: String, events: mpsc::Sender<SseEvent>) {
    let mut told = Told::Nothing;
    loop {
        let pace = family.config().renew_interval;
        // A backend that does not answer within the pace is as good as unreachable.
        let observed = tokio::select! {
            _ = events.closed() => return,
            observed = tokio::time::timeout(pace, family.observe(&key)) => observed,
        };
        let now = match observed
            .unwrap_or(Err(KeyError::Lock(leasehold_lease::Error::Timeout(pace))))
        {
            Ok(holding) => Told::Holder(holding.map(|h| (h.identity, h.token))),
            Err(e) => {
                if told != Told::Unknown {
                    let body = json!({"family": family.name(), "key": key, "error": e.to_string()});
                    let event = SseEvent::default().event("unknown").data(body.to_string());
                    if events.send(event).await.is_err() {
                        return;
                    }
                }
                Told::Unknown
            }
        };
        if now != told {
            if let Told::Holder(holder) = &now {
                let (identity, token) = holder.clone().unzip();
                let body = json!({
                    "family": family.name(),
                    "key": key,
                    "currentHolder": identity,
                    "fencingToken": token,
                });
                let event = SseEvent::default().event("holder").data(body.to_string());
                if events.send(event).await.is_err() {
                    return;
                }
            }
            told = now;
        }
        tokio::select! {
            _ = events.closed() => return,
            _ = tokio::time::sleep(pace) => {}
        }
    }
}
