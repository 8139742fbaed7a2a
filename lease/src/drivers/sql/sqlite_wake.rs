//! Cross-process wake-ups for SQLite waiters, so that a release hands the lock over at once to a
//! waiter in another process on the same machine, not at its next poll of the file.
//!
//! Beside the database sits a directory of wake files (`PATH-wake/`), one per slot, a lock
//! hashed to one of [`SLOTS`]. The process that holds a lock keeps an advisory lock (`flock`) on
//! its slot's file for as long as it holds. A waiting process tries the same `flock` without
//! blocking every [`WAKE_POLL`] (a system call, no database read); when it gets it, the holder
//! has released or died, and the waiter's engine is woken to try the lease row. Only the process
//! that got the `flock` reads the database, so a release wakes one waiter, not all of them.
//!
//! A wake-up is only a hint: the lease row decides. A waiter woken by a holder's crash finds the
//! row still leased and waits out the lease as before (it keeps the `flock`, as the next in
//! line), and when anything here fails (the directory cannot be written, two locks share a slot
//! and one of them is held) waiters fall back to polling the file.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::boot_clock::BootInstant;
use crate::driver::ChangeFeeds;

/// Wake files per database; locks share them by hash.
pub(crate) const SLOTS: u32 = 256;
/// How often a waiting process tries its slot's `flock`.
pub(crate) const WAKE_POLL: Duration = Duration::from_millis(2);

/// One slot's file, and what this process does with its `flock`.
struct Slot {
    file: File,
    /// The leases of this slot's locks that this process holds (lock, token), each until its
    /// claim ends: a lease given up without a release (its renewals failed) counts no longer.
    held: HashMap<(String, u64), BootInstant>,
    /// The `flock` is this process's (held, or taken as the next in line).
    locked: bool,
}

impl Slot {
    /// Whether this process holds a lock of the slot now; leases whose claim has ended go.
    fn holding(&mut self) -> bool {
        let now = BootInstant::now();
        self.held.retain(|_, until| *until > now);
        !self.held.is_empty()
    }

    fn try_lock(&mut self) -> bool {
        if !self.locked {
            self.locked = self.file.try_lock().is_ok();
        }
        self.locked
    }

    fn unlock(&mut self) {
        if self.locked {
            // Closing would unlock too; the file stays open for the next holding.
            let _ = self.file.unlock();
            self.locked = false;
        }
    }
}

#[derive(Default)]
struct Slots {
    by_index: HashMap<u32, Slot>,
    /// The poller task runs.
    polling: bool,
}

pub(crate) struct WakeFiles {
    dir: PathBuf,
    slots: Mutex<Slots>,
}

/// FNV-1a: stable across processes and versions, which every process on the file must agree on.
fn slot_of(lock: &str) -> u32 {
    let hash = lock.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    });
    hash % SLOTS
}

/// The directory of the wake files of the database at `db` (`PATH-wake/`).
fn wake_dir(db: &Path) -> PathBuf {
    let mut dir = db.as_os_str().to_owned();
    dir.push("-wake");
    PathBuf::from(dir)
}

/// Slot `index`'s file in `dir`.
fn slot_file(dir: &Path, index: u32) -> PathBuf {
    dir.join(format!("{index:03}"))
}

/// The wake file of `lock`'s slot beside the database at `db`, where the process that holds
/// `lock` keeps a `flock`.
pub fn wake_file(db: &Path, lock: &str) -> PathBuf {
    slot_file(&wake_dir(db), slot_of(lock))
}

impl WakeFiles {
    /// The wake files of the database at `db`; `None` (waiters poll) when the directory cannot be
    /// made.
    pub(crate) fn beside(db: &Path) -> Option<Arc<Self>> {
        let dir = wake_dir(db);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e,
                "no wake files for SQLite waiters in other processes: they will poll");
            return None;
        }
        Some(Arc::new(Self {
            dir,
            slots: Mutex::new(Slots::default()),
        }))
    }

    /// Run `f` on the slot of `lock`, opening its file on first use.
    fn with_slot<T>(&self, lock: &str, f: impl FnOnce(&mut Slot) -> T) -> Option<T> {
        let index = slot_of(lock);
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let std::collections::hash_map::Entry::Vacant(entry) = slots.by_index.entry(index) {
            let path = slot_file(&self.dir, index);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| {
                    tracing::debug!(path = %path.display(), error = %e, "cannot open a wake file");
                })
                .ok()?;
            entry.insert(Slot {
                file,
                held: HashMap::new(),
                locked: false,
            });
        }
        slots.by_index.get_mut(&index).map(f)
    }

    /// This process holds `lock` with `token` until `until` (taken or renewed): keep its slot's
    /// `flock` until it lets go, or the claim ends.
    pub(crate) fn held(&self, lock: &str, token: u64, until: BootInstant) {
        self.with_slot(lock, |slot| {
            slot.held.insert((lock.to_owned(), token), until);
            slot.try_lock();
        });
    }

    /// This process no longer holds `lock` with `token`: free the slot for a waiter elsewhere,
    /// unless it holds another lock of the slot.
    pub(crate) fn let_go(&self, lock: &str, token: u64) {
        self.with_slot(lock, |slot| {
            slot.held.remove(&(lock.to_owned(), token));
            if !slot.holding() {
                slot.unlock();
            }
        });
    }

    /// A waiter of this process subscribed to `lock`'s releases: while anyone here waits, one
    /// task tries the waited slots' `flock`s and wakes the waiters of a slot it gets.
    pub(crate) fn watch(self: &Arc<Self>, lock: &str, feeds: &Arc<ChangeFeeds>) {
        if self.with_slot(lock, |_| ()).is_none() {
            return;
        }
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::replace(&mut slots.polling, true) {
            return;
        }
        let (wake, feeds) = (self.clone(), feeds.clone());
        tokio::spawn(async move { wake.poll(feeds).await });
    }

    async fn poll(self: Arc<Self>, feeds: Arc<ChangeFeeds>) {
        let mut interval = tokio::time::interval(WAKE_POLL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let mut waited: HashMap<u32, Vec<String>> = HashMap::new();
            for lock in feeds.subscribed(|_| true) {
                waited.entry(slot_of(&lock)).or_default().push(lock);
            }
            let mut wake = Vec::new();
            {
                let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
                for (index, slot) in &mut slots.by_index {
                    match waited.remove(index) {
                        // Nobody here waits for this slot: a `flock` taken as the next in line
                        // goes back.
                        None if !slot.holding() => slot.unlock(),
                        None => {}
                        // Ours already: the engines here hold, or try at the lease's end.
                        Some(_) if slot.locked => {}
                        Some(locks) if slot.try_lock() => wake.extend(locks),
                        Some(_) => {}
                    }
                }
                // Checked under the slots' lock, which `watch` takes after its waiter has
                // subscribed: a waiter that comes now finds no poller and starts one.
                if feeds.subscribed(|_| true).is_empty() {
                    slots.polling = false;
                    return;
                }
            }
            for lock in wake {
                feeds.bump(&lock);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_spread_locks_and_agree_across_processes() {
        // Fixed values: another process (another build) must pick the same slot.
        assert_eq!(slot_of("jobs"), slot_of("jobs"));
        assert_eq!(slot_of(""), 0x811c_9dc5 % SLOTS);
        let used: std::collections::HashSet<u32> = (0..1000)
            .map(|i| slot_of(&format!("orders.keys.{i}")))
            .collect();
        assert!(used.len() > SLOTS as usize / 2, "{} slots used", used.len());
    }
}
