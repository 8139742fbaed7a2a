#![forbid(unsafe_code)]
//! The command the exec safety check runs under `leasehold-sidecar exec`:
//! `leasehold-exec-witness STATE HOLD_MS [read|write]`. While it runs it holds an exclusive
//! `flock` on STATE, a file every contender's commands share, so a command that starts while
//! another still runs finds it taken: two commands at once, written to `STATE.violations`
//! (exit 99). Under the flock it also checks that its fencing token is above every earlier
//! command's, appends `token identity` to `STATE.runs`, and leaves its identity in STATE while
//! it runs (`-` once it is done), for the check to aim its faults at the holder. It is one
//! process and forks nothing, so the flock lives exactly as long as the command. A witness
//! with an even token stays on through `SIGTERM`, as a command finishing its work first would,
//! so that what ends it when the lock is being lost is exec's `SIGKILL` after the grace, which
//! must come before the claim ends.
//!
//! On a read-write lock, `read` commands hold a shared flock (readers run side by side; one
//! that finds a writer's flock is the violation) and leave STATE alone; each also holds an
//! exclusive flock on `STATE-rPERMIT` for its permit (two readers on one permit are the
//! violation) and checks its token is above every earlier reader's of that permit (a reader's
//! token rises with its permit's holders only). `write` commands are checked as above: alone,
//! with a token above every earlier reader's and writer's.
//!
//! On a lock of several permits (`LEASEHOLD_PERMIT` set, no mode), each permit is checked as a
//! lock of its own: its commands flock `STATE-PERMIT`, and their tokens rise in
//! `STATE-PERMIT.runs`. A read-write key's commands are told their permit too, and share STATE.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// The exit status of a command that found another running.
const OVERLAP: i32 = 99;

fn append(path: &str, line: &str) {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    // One write per line: appends from several processes never interleave.
    file.write_all(format!("{line}\n").as_bytes())
        .unwrap_or_else(|e| panic!("{path}: {e}"));
}

/// `path` opened and flocked (`how`, without waiting), as long as the process lives. Found
/// taken: `overlap` written to `violations`, and the process exits [`OVERLAP`].
fn flock_or_overlap(
    path: &str,
    how: FlockArg,
    violations: &str,
    overlap: impl FnOnce() -> String,
) -> Flock<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    match Flock::lock(file, how) {
        Ok(locked) => locked,
        Err((_, Errno::EWOULDBLOCK)) => {
            append(violations, &overlap());
            std::process::exit(OVERLAP);
        }
        Err((_, e)) => panic!("flock {path}: {e}"),
    }
}

/// The highest token among the lines of `runs` (`TOKEN IDENTITY [read]`).
fn highest_token(runs: &str) -> Option<u64> {
    std::fs::read_to_string(runs)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
        .max()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (state, hold_ms, read_write, reader) = match args.as_slice() {
        [state, hold_ms] => (state, hold_ms, false, false),
        [state, hold_ms, mode] if mode == "read" || mode == "write" => {
            (state, hold_ms, true, mode == "read")
        }
        _ => {
            eprintln!("usage: leasehold-exec-witness STATE HOLD_MS [read|write]");
            std::process::exit(2);
        }
    };
    let hold = Duration::from_millis(hold_ms.parse().expect("HOLD_MS"));
    let token: u64 = std::env::var("LEASEHOLD_FENCING_TOKEN")
        .ok()
        .and_then(|t| t.parse().ok())
        .expect("LEASEHOLD_FENCING_TOKEN");
    let identity = std::env::var("LEASEHOLD_EXEC_IDENTITY").expect("LEASEHOLD_EXEC_IDENTITY");
    // A handler for SIGTERM, kept until the process ends, replaces its default of ending it.
    let _stays_through_sigterm = token.is_multiple_of(2).then(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime for the SIGTERM handler");
        let handler = runtime
            .block_on(async {
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            })
            .expect("a SIGTERM handler");
        (runtime, handler)
    });
    let violations = format!("{state}.violations");
    // A read-write key's readers and writer share one state whatever permit each holds.
    let state = &match std::env::var("LEASEHOLD_PERMIT") {
        Ok(permit) if !read_write => format!("{state}-{permit}"),
        _ => state.clone(),
    };
    let how = match reader {
        true => FlockArg::LockSharedNonblock,
        false => FlockArg::LockExclusiveNonblock,
    };
    let mut file = flock_or_overlap(state, how, &violations, || {
        format!("two commands at once: {identity} (token {token}) started while another ran")
    });
    let runs = format!("{state}.runs");
    if reader {
        let permit = std::env::var("LEASEHOLD_PERMIT").expect("LEASEHOLD_PERMIT of a reader");
        let permit_state = format!("{state}-r{permit}");
        let _permit_held = flock_or_overlap(
            &permit_state,
            FlockArg::LockExclusiveNonblock,
            &violations,
            || {
                format!(
                    "two readers on permit {permit} at once: {identity} (token {token}) started while another read"
                )
            },
        );
        let permit_runs = format!("{permit_state}.runs");
        if let Some(highest) = highest_token(&permit_runs).filter(|&highest| highest >= token) {
            append(
                &violations,
                &format!(
                    "reader {identity}'s token {token} on permit {permit} is not above an earlier reader's: {highest}"
                ),
            );
        }
        append(&permit_runs, &format!("{token} {identity}"));
        append(&runs, &format!("{token} {identity} read"));
        std::thread::sleep(hold);
        return;
    }
    // Every earlier command has ended (this one holds the flock alone), and wrote its line.
    let highest = highest_token(&runs);
    if highest.is_some_and(|highest| highest >= token) {
        append(
            &violations,
            &format!(
                "token {token} of {identity} is not above every earlier command's: {highest:?}"
            ),
        );
    }
    let mut set = |line: &str| {
        file.set_len(0).expect("truncate STATE");
        file.seek(SeekFrom::Start(0)).expect("seek STATE");
        file.write_all(line.as_bytes()).expect("write STATE");
    };
    // Counted first: a witness killed between the two leaves its token among the runs.
    append(&runs, &format!("{token} {identity}"));
    set(&format!("{token} {identity}"));
    std::thread::sleep(hold);
    set(&format!("{token} -"));
}
