//! The claim's end, told by `exec` to the command's keeper through a pipe. `exec` renews the
//! claim and stops the command before it ends; an `exec` that is itself stopped (Ctrl-Z, which
//! reaches `exec` but not the command's own group, SIGSTOP, a debugger) or starved renews
//! nothing and stops nothing, while the command runs on. The keeper then stops the command
//! [`KILL_MARGIN`] before the last end it was told, as `exec` would have.

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, OwnedFd};

use leasehold_lease::BootInstant;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use tokio::net::unix::pipe::Receiver;

use super::KILL_MARGIN;

/// The variable naming the descriptor the keeper reads ends from.
const FD_VAR: &str = "LEASEHOLD_EXEC_CLAIM_FD";
/// The variable holding the claim's end as the keeper starts, in nanoseconds since boot.
const END_VAR: &str = "LEASEHOLD_EXEC_CLAIM_END_NS";

/// `exec`'s side: the pipe's write end, and the end last told.
pub struct Teller {
    pipe: OwnedFd,
    told: BootInstant,
}

/// What the keeper is spawned with: the pipe's read end, without close-on-exec, to inherit
/// (dropped once the keeper is spawned), and the variables telling the keeper of it and of the
/// claim's end as it starts.
pub struct ForKeeper {
    pipe: OwnedFd,
    pub vars: [(&'static str, String); 2],
}

impl ForKeeper {
    /// Once the keeper is spawned, holding its own copy.
    pub fn close(self) {
        drop(self.pipe);
    }
}

impl Teller {
    pub fn new(end: BootInstant) -> std::io::Result<(Self, ForKeeper)> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        // A keeper that reads nothing (stopped itself) must never block a renewal's news.
        fcntl(&write, FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
        let inherited = nix::unistd::dup(&read)?;
        let vars = [
            (FD_VAR, inherited.as_raw_fd().to_string()),
            (END_VAR, end.as_nanos().to_string()),
        ];
        let teller = Self {
            pipe: write,
            told: end,
        };
        Ok((
            teller,
            ForKeeper {
                pipe: inherited,
                vars,
            },
        ))
    }

    /// Tell the keeper the claim now ends at `end`. Until a write the pipe had no room for is
    /// made, the keeper acts on an earlier end, which stops the command sooner.
    pub fn tell(&mut self, end: BootInstant) {
        if end == self.told {
            return;
        }
        // Eight bytes: within PIPE_BUF, so written whole or not at all; one not written is
        // tried again at the next call.
        if nix::unistd::write(&self.pipe, &end.as_nanos().to_le_bytes()).is_ok() {
            self.told = end;
        }
    }
}

/// The keeper's side: the last end told, read from the pipe before every decision (so that a
/// keeper resumed after a stop acts on the newest end `exec` wrote meanwhile, not on one read
/// before it).
pub struct Told {
    pipe: Receiver,
    end_nanos: Cell<u64>,
    /// Bytes of an end not read whole yet.
    partial: RefCell<Vec<u8>>,
    /// `exec` closed the pipe (it ended): its last end stands.
    closed: Cell<bool>,
}

impl Told {
    /// From the variables `exec` set; the inherited descriptor is closed either way, so the
    /// command does not inherit it. `Err` says why the keeper cannot follow the claim.
    pub fn from_env() -> Result<Self, String> {
        let fd = std::env::var(FD_VAR)
            .ok()
            .and_then(|fd| fd.parse::<i32>().ok())
            .ok_or_else(|| format!("{FD_VAR} is not set"))?;
        // Opened again through `/proc` (close-on-exec, as std opens files), as a descriptor
        // number cannot be taken over without `unsafe`.
        let opened = std::fs::File::open(format!("/proc/self/fd/{fd}"));
        let _ = nix::unistd::close(fd);
        let file = opened.map_err(|e| format!("cannot open the claim's pipe: {e}"))?;
        let pipe =
            Receiver::from_file(file).map_err(|e| format!("cannot read the claim's pipe: {e}"))?;
        let end = std::env::var(END_VAR)
            .ok()
            .and_then(|end| end.parse::<u64>().ok())
            .ok_or_else(|| format!("{END_VAR} is not set"))?;
        Ok(Self {
            pipe,
            end_nanos: Cell::new(end),
            partial: RefCell::new(Vec::new()),
            closed: Cell::new(false),
        })
    }

    /// Take every end written so far; the last stands.
    fn drain(&self) {
        let mut buf = [0; 512];
        while !self.closed.get() {
            match self.pipe.try_read(&mut buf) {
                Ok(0) => self.closed.set(true),
                Ok(n) => {
                    let mut partial = self.partial.borrow_mut();
                    partial.extend_from_slice(&buf[..n]);
                    let whole = partial.len() / 8 * 8;
                    if let Some(last) = partial[..whole].chunks_exact(8).last() {
                        let mut bytes = [0; 8];
                        bytes.copy_from_slice(last);
                        self.end_nanos.set(u64::from_le_bytes(bytes));
                    }
                    partial.drain(..whole);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => self.closed.set(true),
            }
        }
    }

    /// The claim's last told end.
    pub fn end(&self) -> BootInstant {
        self.drain();
        BootInstant::from_nanos(self.end_nanos.get())
    }

    /// When the command must be stopped: [`KILL_MARGIN`] before the claim's last told end.
    pub fn stop_at(&self) -> BootInstant {
        self.end() - KILL_MARGIN
    }

    /// Until `exec` may have told another end (the next [`Self::stop_at`] reads it).
    pub async fn changed(&self) {
        if self.closed.get() || self.pipe.readable().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The variables the command must not inherit.
    pub fn vars() -> [&'static str; 2] {
        [FD_VAR, END_VAR]
    }
}
