//! What the status should say and which events to publish, decided by pure functions from what
//! the backend showed. The Kubernetes-facing code only carries the results.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use leasehold_crds::{CONDITION_BACKEND_READY, CONDITION_CLEANED_UP, DistributedLockStatus};
use leasehold_lease::Holding;

/// What one look at the backend showed.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// Provisioned and reachable; the holder as the backend reports it.
    Ready {
        holder: Option<Holding>,
        /// For a family of keyed locks: how many of its keys are held now, in every pod, where
        /// the backend can count them.
        held_keys: Option<u64>,
        /// For a lock of several permits: how many of them are held now (`holder` is permit
        /// 0's), where the backend can count them.
        held_permits: Option<u64>,
        warnings: Vec<String>,
    },
    /// The backend could not be used; `reason` is a CamelCase condition reason.
    Failed {
        reason: &'static str,
        message: String,
    },
}

/// An event to publish on the lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

pub const REASON_READY: &str = "Provisioned";

/// The status the lock should have after `observation`, keeping what must not move (the
/// condition's transition time while its status holds, the transition count).
pub fn desired(
    current: Option<&DistributedLockStatus>,
    generation: Option<i64>,
    backend: &str,
    observation: &Observation,
    now: Timestamp,
) -> DistributedLockStatus {
    let previous = current.and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == CONDITION_BACKEND_READY)
    });
    let count = |n: &Option<u64>| n.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
    let old_token = current.and_then(|s| s.fencing_token);
    let (ready, reason, message, (holder, new_token), held_keys, held_permits) = match observation {
        Observation::Ready {
            holder,
            held_keys,
            held_permits,
            warnings,
        } => (
            "True",
            REASON_READY,
            if warnings.is_empty() {
                "the backend is reachable and the lock is provisioned".to_owned()
            } else {
                // Sorted: a backend of several servers gives them in no fixed order.
                let mut warnings = warnings.clone();
                warnings.sort();
                warnings.dedup();
                warnings.join("; ")
            },
            (
                holder.as_ref().map(|h| h.identity.clone()),
                holder
                    .as_ref()
                    .map(|h| i64::try_from(h.token).unwrap_or(i64::MAX)),
            ),
            count(held_keys),
            count(held_permits),
        ),
        // Unknown while the backend cannot be read: the last count is not kept as if current.
        // The holder it last reported stays (beside the condition that says so): a look that
        // failed is no change of holder, and the next one that finds the same holding must
        // not count one.
        Observation::Failed { reason, message } => (
            "False",
            *reason,
            message.clone(),
            (current.and_then(|s| s.holder.clone()), old_token),
            None,
            None,
        ),
    };
    let last_transition_time = match previous {
        Some(p) if p.status == ready => p.last_transition_time.clone(),
        _ => Time(now),
    };
    let condition = Condition {
        type_: CONDITION_BACKEND_READY.to_owned(),
        status: ready.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    };
    let mut transitions = current.and_then(|s| s.transitions).unwrap_or(0);
    if new_token.is_some() && new_token != old_token {
        transitions += 1;
    }
    DistributedLockStatus {
        conditions: vec![condition],
        observed_generation: generation,
        backend: Some(backend.to_owned()),
        holder,
        fencing_token: new_token,
        transitions: Some(transitions),
        held_keys,
        held_permits,
    }
}

/// The events that going from `current` to `next` deserves: a holder change, a backend that
/// fails or recovers, a new warning. Nothing when nothing changed, so a resync is silent.
pub fn notices(
    current: Option<&DistributedLockStatus>,
    next: &DistributedLockStatus,
) -> Vec<Notice> {
    let mut notices = Vec::new();
    let condition = |s: Option<&DistributedLockStatus>| {
        s.and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == CONDITION_BACKEND_READY)
                .cloned()
        })
    };
    let (before, after) = (condition(current), condition(Some(next)));
    if let Some(after) = &after {
        let changed = before.as_ref().is_none_or(|b| {
            (b.status.as_str(), b.reason.as_str(), b.message.as_str())
                != (
                    after.status.as_str(),
                    after.reason.as_str(),
                    after.message.as_str(),
                )
        });
        if changed {
            match after.status.as_str() {
                "False" => notices.push(Notice {
                    warning: true,
                    reason: "BackendUnavailable",
                    note: format!("{}: {}", after.reason, after.message),
                }),
                _ if after.message != "the backend is reachable and the lock is provisioned" => {
                    notices.push(Notice {
                        warning: true,
                        reason: "BackendWarning",
                        note: after.message.clone(),
                    })
                }
                _ if before.as_ref().is_some_and(|b| b.status == "False") => notices.push(Notice {
                    warning: false,
                    reason: "BackendRecovered",
                    note: "the backend is reachable again".into(),
                }),
                _ => notices.push(Notice {
                    warning: false,
                    reason: "Provisioned",
                    note: "the backend is provisioned for this lock".into(),
                }),
            }
        }
    }
    let holder_before = current.and_then(|s| s.fencing_token);
    if next.fencing_token.is_some() && next.fencing_token != holder_before {
        notices.push(Notice {
            warning: false,
            reason: "HolderChanged",
            // Without the token (the status has it): Events alike are folded into one with a
            // count, one per holder, rather than one Event object per hand-over.
            note: format!("{} holds the lock", next.holder.as_deref().unwrap_or("?")),
        });
    }
    notices
}

/// The API server's limit on an event's note, in bytes.
pub const EVENT_NOTE_LIMIT: usize = 1024;

/// `note` cut to [`EVENT_NOTE_LIMIT`] bytes on a character boundary (a longer note gets the
/// whole event refused).
pub fn event_note(note: &str) -> String {
    if note.len() <= EVENT_NOTE_LIMIT {
        return note.to_owned();
    }
    const MORE: &str = "...";
    let mut end = EVENT_NOTE_LIMIT - MORE.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MORE}", &note[..end])
}

/// `current` with the clean-up condition set to `False`, `reason` and `message`; `None` when it
/// already says so.
pub fn with_cleanup(
    current: &DistributedLockStatus,
    reason: &str,
    message: &str,
    now: Timestamp,
) -> Option<DistributedLockStatus> {
    let previous = current
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_CLEANED_UP);
    if previous.is_some_and(|c| c.reason == reason && c.message == message) {
        return None;
    }
    let mut next = current.clone();
    next.conditions.retain(|c| c.type_ != CONDITION_CLEANED_UP);
    next.conditions.push(Condition {
        type_: CONDITION_CLEANED_UP.to_owned(),
        status: "False".to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: current.observed_generation,
        last_transition_time: previous
            .map(|p| p.last_transition_time.clone())
            .unwrap_or(Time(now)),
    });
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn holding(identity: &str, token: u64) -> Option<Holding> {
        Some(Holding {
            identity: identity.into(),
            token,
            expires_in: Some(Duration::from_secs(5)),
        })
    }

    fn ready(holder: Option<Holding>) -> Observation {
        Observation::Ready {
            holder,
            held_keys: None,
            held_permits: None,
            warnings: vec![],
        }
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap()
    }

    #[test]
    fn first_look_sets_everything_and_announces_the_holder() {
        let status = desired(None, Some(1), "redis", &ready(holding("pod-a", 3)), at(100));
        assert_eq!(status.holder.as_deref(), Some("pod-a"));
        assert_eq!(
            (status.fencing_token, status.transitions),
            (Some(3), Some(1))
        );
        assert_eq!(status.observed_generation, Some(1));
        let c = &status.conditions[0];
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", REASON_READY)
        );
        let reasons: Vec<_> = notices(None, &status).iter().map(|n| n.reason).collect();
        assert_eq!(reasons, ["Provisioned", "HolderChanged"]);
    }

    #[test]
    fn an_unchanged_backend_keeps_the_status_and_says_nothing() {
        let first = desired(None, Some(1), "redis", &ready(holding("pod-a", 3)), at(100));
        let second = desired(
            Some(&first),
            Some(1),
            "redis",
            &ready(holding("pod-a", 3)),
            at(200),
        );
        assert_eq!(first, second, "the transition time must not move");
        assert!(notices(Some(&first), &second).is_empty());
    }

    #[test]
    fn a_failure_flips_the_condition_keeps_the_last_holder_and_warns() {
        let ok = desired(None, Some(1), "redis", &ready(holding("pod-a", 3)), at(100));
        let failed = Observation::Failed {
            reason: "Unreachable",
            message: "connection refused".into(),
        };
        let bad = desired(Some(&ok), Some(1), "redis", &failed, at(200));
        let c = &bad.conditions[0];
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Unreachable")
        );
        assert_eq!(c.last_transition_time, Time(at(200)));
        assert_eq!(
            (bad.holder.as_deref(), bad.fencing_token),
            (Some("pod-a"), Some(3)),
            "the holder last reported"
        );
        assert_eq!(bad.transitions, Some(1), "the count survives");
        let n = notices(Some(&ok), &bad);
        assert_eq!(n.len(), 1);
        assert!(n[0].warning && n[0].reason == "BackendUnavailable");
        assert!(n[0].note.contains("connection refused"));
        // Back again, the same holding: recovered, and no change of holder counted or told.
        let same = desired(
            Some(&bad),
            Some(1),
            "redis",
            &ready(holding("pod-a", 3)),
            at(250),
        );
        assert_eq!(
            same.transitions,
            Some(1),
            "a failed look counted as a hand-over"
        );
        let reasons: Vec<_> = notices(Some(&bad), &same)
            .iter()
            .map(|n| n.reason)
            .collect();
        assert_eq!(reasons, ["BackendRecovered"]);
        // Back again, with a new holder: recovered, and one more transition.
        let back = desired(
            Some(&bad),
            Some(1),
            "redis",
            &ready(holding("pod-b", 4)),
            at(300),
        );
        assert_eq!(back.transitions, Some(2));
        let reasons: Vec<_> = notices(Some(&bad), &back)
            .iter()
            .map(|n| n.reason)
            .collect();
        assert_eq!(reasons, ["BackendRecovered", "HolderChanged"]);
    }

    #[test]
    fn warnings_are_announced_once() {
        let warned = Observation::Ready {
            holder: None,
            held_keys: None,
            held_permits: None,
            warnings: vec!["maxmemory-policy is allkeys-lru".into()],
        };
        let first = desired(None, Some(1), "redis", &warned, at(100));
        assert_eq!(first.conditions[0].status, "True");
        let n = notices(None, &first);
        assert_eq!(
            (n.len(), n[0].reason, n[0].warning),
            (1, "BackendWarning", true)
        );
        let again = desired(Some(&first), Some(1), "redis", &warned, at(200));
        assert!(notices(Some(&first), &again).is_empty());
    }

    /// A backend of several servers (Redis Cluster's masters) gives its warnings in no fixed
    /// order: the same warnings in another order are the same status, written and announced
    /// once, not a status write (and a reconcile it starts) at every look.
    #[test]
    fn the_same_warnings_in_another_order_change_nothing() {
        let warned = |warnings: &[&str]| Observation::Ready {
            holder: None,
            held_keys: None,
            held_permits: None,
            warnings: warnings.iter().map(|w| w.to_string()).collect(),
        };
        let first = desired(
            None,
            Some(1),
            "redis",
            &warned(&["m1: lru", "m2: lru"]),
            at(100),
        );
        let again = desired(
            Some(&first),
            Some(1),
            "redis",
            &warned(&["m2: lru", "m1: lru", "m2: lru"]),
            at(200),
        );
        assert_eq!(first, again);
        assert!(notices(Some(&first), &again).is_empty());
    }

    #[test]
    fn a_spec_change_moves_observed_generation() {
        let first = desired(None, Some(1), "redis", &ready(None), at(100));
        let second = desired(Some(&first), Some(2), "redis", &ready(None), at(200));
        assert_eq!(second.observed_generation, Some(2));
        assert_eq!(second.conditions[0].observed_generation, Some(2));
        assert_ne!(first, second);
    }

    #[test]
    fn event_notes_are_cut_to_the_byte_limit_on_a_character() {
        assert_eq!(event_note("short"), "short");
        // Three bytes per character: a cut by characters would send 3072 bytes.
        let long = "锁".repeat(1024);
        let note = event_note(&long);
        assert!(note.len() <= EVENT_NOTE_LIMIT, "{}", note.len());
        assert!(note.ends_with("...") && note.starts_with("锁锁"));
    }

    #[test]
    fn the_cleanup_condition_sits_beside_backend_ready_and_moves_only_on_change() {
        let status = desired(None, Some(1), "redis", &ready(None), at(100));
        let waiting = with_cleanup(&status, "HolderAlive", "pod-a holds", at(200)).unwrap();
        assert_eq!(waiting.conditions.len(), 2);
        assert_eq!(waiting.conditions[0], status.conditions[0]);
        assert!(with_cleanup(&waiting, "HolderAlive", "pod-a holds", at(300)).is_none());
        let gave_up = with_cleanup(&waiting, "GaveUp", "kept", at(400)).unwrap();
        let c = &gave_up.conditions[1];
        assert_eq!(
            (c.type_.as_str(), c.reason.as_str()),
            ("CleanedUp", "GaveUp")
        );
        assert_eq!(gave_up.conditions.len(), 2);
    }
}
