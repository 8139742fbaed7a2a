//! The command's processes as `/proc` shows them: its group, and every process that descends
//! from `exec` (or its keeper), whichever group or session it moved to. One read of `/proc` is
//! a [`Table`]; callers scan again until two reads in a row find nothing, since a process
//! handed from a dying parent to a subreaper can be missed by one read.

use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// Every process, as one read of `/proc` saw it.
pub struct Table(Vec<Process>);

struct Process {
    pid: Pid,
    parent: Pid,
    group: Pid,
    living: bool,
}

/// The longest chain of parents followed up from a process: a read of `/proc` is not atomic,
/// and a chain read across a pid's reuse could loop.
const MAX_DEPTH: usize = 4096;

impl Table {
    /// `None` when `/proc` cannot be read.
    pub fn read() -> Option<Self> {
        let entries = std::fs::read_dir("/proc").ok()?;
        let processes = entries
            .flatten()
            .filter_map(|entry| {
                let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
                let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
                // `PID (COMMAND) STATE PPID PGRP ...`; the command may hold spaces and parentheses.
                let (_, fields) = stat.rsplit_once(") ")?;
                let mut fields = fields.split(' ');
                let state = fields.next()?;
                let parent = fields.next()?.parse::<i32>().ok()?;
                let group = fields.next()?.parse::<i32>().ok()?;
                let pid = Pid::from_raw(pid);
                Some(Process {
                    pid,
                    parent: Pid::from_raw(parent),
                    group: Pid::from_raw(group),
                    living: living(pid, state),
                })
            })
            .collect();
        Some(Self(processes))
    }

    /// The living processes of the command: those of `group`, and those descending from `own`
    /// (this process) but through `excluded` (children `own` had before the command started);
    /// not `own`.
    pub fn command(&self, own: Pid, group: Pid, excluded: &[Pid]) -> Vec<Pid> {
        let parents: std::collections::HashMap<Pid, Pid> =
            self.0.iter().map(|p| (p.pid, p.parent)).collect();
        let descends = |pid: Pid| {
            let mut at = pid;
            for _ in 0..MAX_DEPTH {
                if excluded.contains(&at) {
                    return false;
                }
                match parents.get(&at) {
                    Some(&parent) if parent == own => return true,
                    Some(&parent) if parent.as_raw() > 1 => at = parent,
                    _ => return false,
                }
            }
            false
        };
        self.0
            .iter()
            .filter(|p| p.living && p.pid != own && (p.group == group || descends(p.pid)))
            .map(|p| p.pid)
            .collect()
    }

    /// The children of `own` that have ended and wait to be reaped, but `spawned` (whose
    /// status its [`tokio::process::Child`] takes).
    pub fn ended_children(&self, own: Pid, spawned: Option<Pid>) -> Vec<Pid> {
        self.0
            .iter()
            .filter(|p| p.parent == own && !p.living && Some(p.pid) != spawned)
            .map(|p| p.pid)
            .collect()
    }

    /// The children `own` has now.
    pub fn children(&self, own: Pid) -> Vec<Pid> {
        self.0
            .iter()
            .filter(|p| p.parent == own)
            .map(|p| p.pid)
            .collect()
    }
}

/// Whether a process in `state` lives. A zombie does not (it waits only to be reaped), unless
/// it is a thread group whose first thread ended while others run on.
fn living(pid: Pid, state: &str) -> bool {
    if !matches!(state, "Z" | "X" | "x") {
        return true;
    }
    status_field(pid, "Threads:")
        .and_then(|threads| threads.parse::<u32>().ok())
        .is_some_and(|threads| threads > 1)
}

/// Whether `pid` has a SIGKILL pending: it will never run its own code again, and dies as soon
/// as the kernel lets it (a process in an uninterruptible wait holds it until the wait ends).
pub fn dying(pid: Pid) -> bool {
    let bit = 1u64 << (Signal::SIGKILL as i32 - 1);
    ["ShdPnd:", "SigPnd:"].iter().any(|field| {
        status_field(pid, field)
            .and_then(|mask| u64::from_str_radix(&mask, 16).ok())
            .is_some_and(|mask| mask & bit != 0)
    })
}

fn status_field(pid: Pid, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .map(|value| value.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(pid: i32, parent: i32, group: i32, living: bool) -> Process {
        Process {
            pid: Pid::from_raw(pid),
            parent: Pid::from_raw(parent),
            group: Pid::from_raw(group),
            living,
        }
    }

    #[test]
    fn the_command_is_its_group_and_what_descends_from_exec_but_what_it_had_before() {
        let pid = Pid::from_raw;
        let table = Table(vec![
            process(1, 0, 1, true),
            // exec (10), a child it had before (11) and that one's child (12).
            process(10, 1, 10, true),
            process(11, 10, 10, true),
            process(12, 11, 12, true),
            // The keeper (20), the command (21) in its group, a setsid'd child (22) and its
            // child (23), a zombie (24), and a process of the group handed to init (25).
            process(20, 10, 20, true),
            process(21, 20, 20, true),
            process(22, 21, 22, true),
            process(23, 22, 22, true),
            process(24, 10, 24, false),
            process(25, 1, 20, true),
            // Unrelated.
            process(30, 1, 30, true),
        ]);
        let mut command = table.command(pid(10), pid(20), &[pid(11)]);
        command.sort();
        assert_eq!(
            command,
            [20, 21, 22, 23, 25].map(Pid::from_raw).to_vec(),
            "the group, and the living descendants of exec but through 11"
        );
        assert_eq!(table.ended_children(pid(10), None), vec![pid(24)]);
        assert_eq!(table.ended_children(pid(10), Some(pid(24))), vec![]);
        assert_eq!(
            table.children(pid(10)),
            [11, 20, 24].map(Pid::from_raw).to_vec()
        );
    }

    #[test]
    fn this_process_lives_and_has_no_sigkill_pending() {
        let own = nix::unistd::getpid();
        let table = Table::read().expect("/proc");
        assert!(table.0.iter().any(|p| p.pid == own && p.living));
        assert!(!dying(own));
    }
}
