#![forbid(unsafe_code)]
//! The command the exec safety check runs under `leasehold-sidecar exec`:
//! `leasehold-exec-witness STATE HOLD_MS`. While it runs it holds an exclusive `flock` on
//! STATE, a file every contender's commands share, so a command that starts while another
//! still runs finds it taken: two commands at once, written to `STATE.violations` (exit 99).
//! Under the flock it also checks that its fencing token is above the last command's, appends
//! `token identity` to `STATE.runs`, and leaves its identity in STATE while it runs (`-` once
//! it is done), for the check to aim its faults at the holder. It is one process and forks
//! nothing, so the flock lives exactly as long as the command.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [state, hold_ms] = args.as_slice() else {
        eprintln!("usage: leasehold-exec-witness STATE HOLD_MS");
        std::process::exit(2);
    };
    let hold = Duration::from_millis(hold_ms.parse().expect("HOLD_MS"));
    let token: u64 = std::env::var("LEASEHOLD_FENCING_TOKEN")
        .ok()
        .and_then(|t| t.parse().ok())
        .expect("LEASEHOLD_FENCING_TOKEN");
    let identity = std::env::var("LEASEHOLD_EXEC_IDENTITY").expect("LEASEHOLD_EXEC_IDENTITY");
    let violations = format!("{state}.violations");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(state)
        .unwrap_or_else(|e| panic!("{state}: {e}"));
    let mut file: Flock<File> = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(locked) => locked,
        Err((_, Errno::EWOULDBLOCK)) => {
            append(
                &violations,
                &format!(
                    "two commands at once: {identity} (token {token}) started while another ran"
                ),
            );
            std::process::exit(OVERLAP);
        }
        Err((_, e)) => panic!("flock {state}: {e}"),
    };
    let mut last = String::new();
    file.read_to_string(&mut last).expect("read STATE");
    let last_token: Option<u64> = last.split_whitespace().next().and_then(|t| t.parse().ok());
    if last_token.is_some_and(|last| last >= token) {
        append(
            &violations,
            &format!("token {token} of {identity} is not above the last command's: {last:?}"),
        );
    }
    let mut set = |line: &str| {
        file.set_len(0).expect("truncate STATE");
        file.seek(SeekFrom::Start(0)).expect("seek STATE");
        file.write_all(line.as_bytes()).expect("write STATE");
    };
    set(&format!("{token} {identity}"));
    append(&format!("{state}.runs"), &format!("{token} {identity}"));
    std::thread::sleep(hold);
    set(&format!("{token} -"));
}
