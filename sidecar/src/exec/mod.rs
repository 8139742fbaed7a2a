//! `leasehold-sidecar exec`: run a command only while this process holds a lock.
//!
//! It waits for the lock, then starts the command in a process group of its own, with the
//! fencing token in its environment, and forwards the signals it receives to that group. When
//! the command exits, what it left running in its group is stopped, the lock is released, and
//! the command's status is this process's. When the lock is being lost (renewals fail, so the
//! claim's self-fenced end draws near, or the backend says the lease is gone), the whole group
//! gets SIGTERM, then SIGKILL after `--kill-grace`, or sooner, so that the SIGKILL goes out
//! [`KILL_MARGIN`] before the claim ends (at once when the claim is gone): no other holder's
//! command can start while one of this one's processes still runs.
//!
//! The lock is held by this process itself, on `--backend`, or by a running sidecar through a
//! hold bound to a connection (`--via`, [`via`]), which can also hold a keyed lock's key
//! (`--keyed FAMILY/KEY`).
//!
//! The command runs behind a small trampoline, this binary again (`exec-child`), which asks
//! the kernel to kill it if this process dies (`PR_SET_PDEATHSIG`) and then becomes the
//! command: a `leasehold exec` killed with SIGKILL does not leave its command running without
//! the lock. Processes the command started in the background are not covered by that signal;
//! they are by the group kill, which needs this process alive.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};

use leasehold_lease::{
    BackendUrl, BootInstant, DEFAULT_BACKEND, Lock, LockConfig, Mode, safety_margin,
};

use crate::config::EXIT_BAD_CONFIG;

mod via;

/// The exit status when the lock was lost and the command stopped for it (EX_TEMPFAIL: try
/// again).
pub const EXIT_LOCK_LOST: u8 = 75;
/// The exit status when the lock was not taken within `--wait` (EX_UNAVAILABLE).
pub const EXIT_NOT_ACQUIRED: u8 = 69;
/// The status a shell gives a command it cannot run.
const EXIT_CANNOT_RUN: u8 = 127;
/// How long before the claim ends the command's whole group must be gone: SIGKILL takes
/// effect at once, but the kernel must still be given time to reap every process.
pub const KILL_MARGIN: Duration = Duration::from_millis(250);
/// The lease without --lease-duration, as the sidecar's.
const DEFAULT_LEASE: Duration = Duration::from_secs(15);
/// How often the group is checked for survivors while it is being stopped.
const GROUP_POLL: Duration = Duration::from_millis(10);
/// The longest sleep between checks of the claim, so that a suspended machine (whose boot
/// clock jumps) is noticed soon after it resumes.
const CLAIM_POLL: Duration = Duration::from_millis(200);
/// The trampoline's first argument, and the variable naming the process it must die with.
const CHILD_ARG: &str = "exec-child";
const PARENT_VAR: &str = "LEASEHOLD_EXEC_PARENT";

/// The signals passed on to the command's process group.
const FORWARDED: [Signal; 6] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

#[derive(Debug, Parser)]
#[command(
    name = "leasehold-sidecar exec",
    about = "Runs a command only while a lock is held: leasehold-sidecar exec (--lock NAME | --keyed FAMILY/KEY) [--backend URL | --via http://127.0.0.1:4040] -- COMMAND [ARGS]...",
    after_help = "Exit status: the command's (128+N when killed by signal N); 75 when the lock was lost and the command stopped; 69 when the lock was not taken within --wait; 128+N when exec got signal N while waiting for the lock; 2 for bad arguments; 127 when the command cannot be started; 1 when the backend cannot be opened."
)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["lock", "keyed"])))]
struct ExecArgs {
    /// The lock to hold while the command runs.
    #[arg(long, value_name = "NAME")]
    lock: Option<String>,

    /// A key of a keyed family to hold while the command runs, through the sidecar serving the
    /// family (needs --via); the owner is --identity.
    #[arg(long, value_name = "FAMILY/KEY", requires = "via")]
    keyed: Option<String>,

    /// Hold the lock through the sidecar whose lock API is here, for as long as exec runs,
    /// instead of on a backend of exec's own; the lease settings are the sidecar's.
    #[arg(long, value_name = "http://HOST:PORT",
          conflicts_with_all = ["lease_duration", "renew_interval"])]
    via: Option<String>,

    /// The backend, as the sidecar's --backend (without --via).
    #[arg(long, env = "LEASEHOLD_BACKEND", value_name = "URL", default_value = DEFAULT_BACKEND,
          hide_env_values = true)]
    backend: String,

    /// Who holds the lock, or the key's owner with --keyed [default: the host name and this
    /// process's id].
    #[arg(long, env = "LEASEHOLD_IDENTITY", value_name = "ID")]
    identity: Option<String>,

    /// [default: 15s; with --via, the sidecar's]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease_duration: Option<Duration>,

    /// [default: a third of the lease; with --via, the sidecar's]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    renew_interval: Option<Duration>,

    /// Give up when the lock is not taken within this long [default: wait for ever].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    wait: Option<Duration>,

    /// When the lock is being lost: how long the command has between SIGTERM and SIGKILL.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = humantime::parse_duration)]
    kill_grace: Duration,

    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// `leasehold-sidecar exec ...` (`args` starts with `exec`) and the trampoline
/// (`leasehold-sidecar exec-child -- COMMAND...`).
pub fn main(args: Vec<OsString>) -> ExitCode {
    if args.first().is_some_and(|a| a == CHILD_ARG) {
        return become_command(&args[1..]);
    }
    let args = match ExecArgs::try_parse_from(&args) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    ExitCode::SUCCESS
                }
                _ => ExitCode::from(EXIT_BAD_CONFIG),
            };
        }
    };
    leasehold_process::init_logging(false);
    leasehold_lease::tls::use_ring_provider();
    // One thread: the kernel's parent-death signal follows the thread that started the command,
    // and this one lives as long as the process.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    ExitCode::from(runtime.block_on(run(args)))
}

/// What stopped the wait for the lock, or the command.
enum Outcome {
    Exited(std::process::ExitStatus),
    Lost,
}

async fn run(args: ExecArgs) -> u8 {
    let bad = |flag: &str, reason: &dyn std::fmt::Display| {
        eprintln!("error: invalid value for '--{flag}': {reason}");
        EXIT_BAD_CONFIG
    };
    let identity = args.identity.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            leasehold_process::hostname("leasehold"),
            std::process::id()
        )
    });
    let mut holder = match &args.via {
        Some(via) => {
            let via = match via::Via::parse(via) {
                Ok(via) => via,
                Err(e) => return bad("via", &e),
            };
            let target = match (&args.lock, &args.keyed) {
                (Some(lock), _) => via::Target::Lock(lock.clone()),
                (None, Some(keyed)) => match keyed.split_once('/') {
                    Some((family, key)) if !family.is_empty() && !key.is_empty() => {
                        via::Target::Key {
                            family: family.to_owned(),
                            key: key.to_owned(),
                            owner: args.identity.clone().unwrap_or_else(unique_owner),
                        }
                    }
                    _ => return bad("keyed", &format!("{keyed:?} is not FAMILY/KEY")),
                },
                (None, None) => return bad("lock", &"--lock or --keyed is required"),
            };
            let name = args.lock.clone().or(args.keyed.clone()).unwrap_or_default();
            let (hold, claims) = via::Hold::start(via, target, args.wait);
            Holder::Via {
                name,
                identity,
                hold,
                claims,
            }
        }
        None => match start_direct(&args, &identity).await {
            Ok(lock) => Holder::Direct(lock),
            Err(status) => return status,
        },
    };
    let mut signals = match Signals::new() {
        Ok(signals) => signals,
        Err(e) => {
            eprintln!("error: cannot handle signals: {e}");
            holder.let_go(Group::Gone).await;
            return 1;
        }
    };
    let (status, group) = supervise(&args, &mut holder, &mut signals).await;
    if let Group::Survived { .. } = group {
        // A process of the command's group outlived SIGKILL (an uninterruptible wait): the
        // lock is not released while it lives.
        let kept = match holder {
            Holder::Direct(_) => "left to run out, not released",
            Holder::Via { .. } => "kept until the group is gone (or the claim ends), then released",
        };
        eprintln!(
            "leasehold exec: a process of the command's group outlived SIGKILL; the lock {:?} is {kept}",
            holder.name()
        );
    }
    holder.let_go(group).await;
    status
}

/// A key's owner for this `exec` alone: the host name and process id repeat across
/// containers (each one's first process is 1), so a random part is added.
fn unique_owner() -> String {
    let mut random = [0u8; 4];
    let read = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random));
    if read.is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        random = nanos.to_le_bytes();
    }
    format!(
        "{}-{}-{:08x}",
        leasehold_process::hostname("leasehold"),
        std::process::id(),
        u32::from_le_bytes(random)
    )
}

/// The lock, held on this process's own backend connection.
async fn start_direct(args: &ExecArgs, identity: &str) -> Result<Lock, u8> {
    let bad = |flag: &str, reason: &dyn std::fmt::Display| {
        eprintln!("error: invalid value for '--{flag}': {reason}");
        EXIT_BAD_CONFIG
    };
    let Some(name) = &args.lock else {
        return Err(bad("keyed", &"a key is held through a sidecar: add --via"));
    };
    let url = BackendUrl::parse(&args.backend).map_err(|e| bad("backend", &e))?;
    let lease_duration = args.lease_duration.unwrap_or(DEFAULT_LEASE);
    let mut config = LockConfig::new(name, identity, lease_duration);
    config.mode = Mode::Campaign;
    if let Some(renew) = args.renew_interval {
        config.renew_interval = renew;
    }
    config.validate().map_err(|e| bad("lock", &e))?;
    check_grace(args.kill_grace, lease_duration, config.renew_interval)
        .map_err(|e| bad("kill-grace", &e))?;
    let driver = leasehold_lease::connect(&url).await.map_err(|e| {
        eprintln!("error: {url}: {e}");
        1
    })?;
    Lock::start(driver, config, Arc::new(())).map_err(|e| bad("lock", &e))
}

/// Just before a renewal the claim has a lease, less the margin and a renew interval, left:
/// stopping the command must fit in it, or a healthy holder would stop its own command.
fn check_grace(grace: Duration, lease: Duration, renew_interval: Duration) -> Result<(), String> {
    let slack = lease
        .saturating_sub(safety_margin(lease))
        .saturating_sub(renew_interval);
    if grace + KILL_MARGIN >= slack {
        return Err(format!(
            "{grace:?} plus {KILL_MARGIN:?} must be shorter than the {slack:?} a claim has left just before it is renewed; lengthen the lease or shorten the grace"
        ));
    }
    Ok(())
}

/// Who holds the lock for the command.
enum Holder {
    /// This process, on its own backend connection.
    Direct(Lock),
    /// A running sidecar, for as long as the connection stays open.
    Via {
        name: String,
        identity: String,
        hold: via::Hold,
        claims: tokio::sync::watch::Receiver<via::Claim>,
    },
}

impl Holder {
    fn name(&self) -> &str {
        match self {
            Holder::Direct(lock) => lock.name(),
            Holder::Via { name, .. } => name,
        }
    }

    /// Who holds the lock in the backend: through a sidecar, as its stream says.
    fn identity(&self) -> String {
        match self {
            Holder::Direct(lock) => lock.config().identity.clone(),
            Holder::Via {
                identity, claims, ..
            } => claims
                .borrow()
                .identity
                .clone()
                .unwrap_or_else(|| identity.clone()),
        }
    }

    /// The claims as they change.
    fn claims(&self) -> Claims {
        match self {
            Holder::Direct(lock) => Claims::Direct(lock.watch()),
            Holder::Via { claims, .. } => Claims::Via(claims.clone()),
        }
    }

    /// Done with the lock: released when the group is gone; left to run out when a process
    /// survived (through a sidecar, the connection stays open until the group is gone or the
    /// claim ends, since closing it would release the lock at once).
    async fn let_go(self, group: Group) {
        match (self, group) {
            (Holder::Direct(lock), Group::Gone) => lock.shutdown().await,
            (Holder::Direct(lock), Group::Survived { .. }) => lock.retire().await,
            (Holder::Via { hold, .. }, Group::Gone) => drop(hold),
            (Holder::Via { hold, claims, .. }, Group::Survived { pgid }) => {
                let mut claims = Claims::Via(claims);
                while group_running(pgid) && claims.current().is_some() {
                    tokio::time::sleep(GROUP_POLL).await;
                }
                drop(hold);
            }
        }
    }
}

/// The claim as it moves: the token and the end of the claim while held.
enum Claims {
    Direct(tokio::sync::watch::Receiver<leasehold_lease::Snapshot>),
    Via(tokio::sync::watch::Receiver<via::Claim>),
}

impl Claims {
    /// The claim now (marking it seen), if held and not yet ended.
    fn current(&mut self) -> Option<(u64, BootInstant)> {
        let held = match self {
            Claims::Direct(state) => state
                .borrow_and_update()
                .held
                .as_ref()
                .map(|held| (held.token, held.valid_until)),
            Claims::Via(claims) => claims.borrow_and_update().held,
        };
        held.filter(|(_, end)| BootInstant::now() < *end)
    }

    /// The lease and renew interval a sidecar holds the lock with (`--via`).
    fn timing(&self) -> Option<(Duration, Duration)> {
        match self {
            Claims::Direct(_) => None,
            Claims::Via(claims) => claims.borrow().timing,
        }
    }

    /// Why the lock can no longer be had, when it cannot: the status to exit with.
    fn failed(&self) -> Option<(u8, String)> {
        match self {
            Claims::Direct(_) => None,
            Claims::Via(claims) => claims.borrow().failed.clone(),
        }
    }

    /// Wait for a change; `false` when nothing will change any more.
    async fn changed(&mut self) -> bool {
        match self {
            Claims::Direct(state) => state.changed().await.is_ok(),
            Claims::Via(claims) => claims.changed().await.is_ok(),
        }
    }
}

/// Whether the command's process group is gone once `exec` is done with it.
enum Group {
    Gone,
    Survived { pgid: Pid },
}

async fn supervise(args: &ExecArgs, holder: &mut Holder, signals: &mut Signals) -> (u8, Group) {
    let token = match wait_for_lock(holder, args.wait, args.kill_grace + KILL_MARGIN, signals).await
    {
        Ok(token) => token,
        Err(status) => return (status, Group::Gone),
    };
    let mut child = match spawn(args, holder, token) {
        Ok(child) => child,
        Err(e) => {
            eprintln!("error: cannot start {:?}: {e}", args.command[0]);
            return (EXIT_CANNOT_RUN, Group::Gone);
        }
    };
    let Some(pgid) = child.id().map(|id| Pid::from_raw(id as i32)) else {
        return (EXIT_CANNOT_RUN, Group::Gone);
    };
    tracing::info!(lock = %holder.name(), token, pid = pgid.as_raw(), "holding the lock; the command runs");
    let mut claims = holder.claims();
    let outcome = follow(
        &mut claims,
        token,
        args.kill_grace,
        &mut child,
        pgid,
        signals,
    )
    .await;
    // Whatever ended it, nothing of the group may run once the lock is let go: the command's
    // background processes are stopped too, within what is left of the claim.
    let claim_end = claims
        .current()
        .filter(|(held, _)| *held == token)
        .map(|(_, end)| end);
    let group = stop_group(&mut child, pgid, args.kill_grace, claim_end).await;
    let status = match outcome {
        Outcome::Exited(status) => exit_status(status),
        Outcome::Lost => {
            match claim_end.map(|end| end.saturating_duration_since(BootInstant::now())) {
                Some(spare) => eprintln!(
                    "leasehold exec: the lock {:?} is being lost; the command's processes were stopped {} ms before the claim ends",
                    holder.name(),
                    spare.as_millis()
                ),
                None => eprintln!(
                    "leasehold exec: the lock {:?} was lost; the command's processes were stopped",
                    holder.name()
                ),
            }
            EXIT_LOCK_LOST
        }
    };
    (status, group)
}

/// The token once the lock is held with more than `needed` of its claim left; `Err(status)`
/// when `exec` gives up (the wait ran out, a signal asked it to stop, or the sidecar refused).
async fn wait_for_lock(
    holder: &Holder,
    wait: Option<Duration>,
    needed: Duration,
    signals: &mut Signals,
) -> Result<u64, u8> {
    let mut claims = holder.claims();
    let started = Instant::now();
    loop {
        // The claim must outlast stopping the command, or it would start only to be stopped
        // (a lease a backend dates from before the call may arrive half spent): otherwise the
        // next renewal is awaited.
        if let Some((token, end)) = claims.current() {
            // Through a sidecar the lease is the sidecar's, known once held.
            if let Some((lease, renew)) = claims.timing()
                && let Err(e) = check_grace(needed - KILL_MARGIN, lease, renew)
            {
                eprintln!("error: invalid value for '--kill-grace': {e} (the sidecar's lease)");
                return Err(EXIT_BAD_CONFIG);
            }
            if end.saturating_duration_since(BootInstant::now()) > needed {
                return Ok(token);
            }
        }
        if let Some((status, why)) = claims.failed() {
            eprintln!("error: {why}");
            return Err(status);
        }
        let left = wait.map(|w| w.saturating_sub(started.elapsed()));
        if left == Some(Duration::ZERO) {
            eprintln!(
                "error: the lock was not taken within {:?}",
                wait.unwrap_or_default()
            );
            return Err(EXIT_NOT_ACQUIRED);
        }
        tokio::select! {
            changed = claims.changed() => {
                if !changed && claims.failed().is_none() {
                    return Err(1);
                }
            }
            signal = signals.next() => return Err(128 + signal as u8),
            () = tokio::time::sleep(left.unwrap_or(Duration::MAX).min(CLAIM_POLL)) => {}
        }
    }
}

fn spawn(args: &ExecArgs, holder: &Holder, token: u64) -> std::io::Result<tokio::process::Child> {
    let mut command = tokio::process::Command::new(std::env::current_exe()?);
    command
        .arg(CHILD_ARG)
        .arg("--")
        .args(&args.command)
        .env(PARENT_VAR, std::process::id().to_string())
        // It may carry the backend's password, which the command has no use for.
        .env_remove("LEASEHOLD_BACKEND")
        // Not the sidecar's own LEASEHOLD_LOCK and LEASEHOLD_IDENTITY, which a sidecar the
        // command starts would take for its flags.
        .env("LEASEHOLD_EXEC_LOCK", holder.name())
        .env("LEASEHOLD_EXEC_IDENTITY", holder.identity())
        .env("LEASEHOLD_FENCING_TOKEN", token.to_string())
        .process_group(0)
        .kill_on_drop(false);
    // Through a sidecar, the command inherits a copy of the held connection (the only
    // descriptor left open across exec), which stays open while it or any process it started
    // lives: the sidecar releases only once they are all gone, even if exec is killed outright.
    let inherited = match holder {
        Holder::Via { hold, .. } => hold.inheritable(),
        Holder::Direct(_) => None,
    };
    let child = command.spawn();
    drop(inherited);
    child
}

/// Until the command exits or the lock is being lost: the group is stopped from the moment the
/// claim's end is nearer than the grace and the margin, or at once when the lock is gone or
/// changed hands.
async fn follow(
    claims: &mut Claims,
    token: u64,
    kill_grace: Duration,
    child: &mut tokio::process::Child,
    pgid: Pid,
    signals: &mut Signals,
) -> Outcome {
    loop {
        let stop_at = match claims.current() {
            Some((held, end)) if held == token => end - (kill_grace + KILL_MARGIN),
            _ => return Outcome::Lost,
        };
        let left = stop_at.saturating_duration_since(BootInstant::now());
        if left.is_zero() {
            return Outcome::Lost;
        }
        tokio::select! {
            status = child.wait() => {
                return match status {
                    Ok(status) => Outcome::Exited(status),
                    Err(e) => {
                        eprintln!("error: waiting for the command: {e}");
                        Outcome::Lost
                    }
                };
            }
            signal = signals.next() => {
                let _ = killpg(pgid, signal);
            }
            changed = claims.changed() => {
                if !changed {
                    return Outcome::Lost;
                }
            }
            () = tokio::time::sleep(left.min(CLAIM_POLL)) => {}
        }
    }
}

/// Stops what runs of group `pgid`: SIGTERM, then SIGKILL after `grace`, or sooner so that it
/// goes out [`KILL_MARGIN`] before `claim_end` (at once when the claim is gone: another may
/// hold the lock already). [`Group::Survived`] when a process still runs [`KILL_MARGIN`] after
/// the SIGKILL (an uninterruptible wait, which it dies leaving).
async fn stop_group(
    child: &mut tokio::process::Child,
    pgid: Pid,
    grace: Duration,
    claim_end: Option<BootInstant>,
) -> Group {
    // Reap the command itself; the group's other processes are reaped by whoever inherits
    // them.
    let _ = child.try_wait();
    if !group_running(pgid) {
        return Group::Gone;
    }
    let left = claim_end.map_or(Duration::ZERO, |end| {
        end.saturating_duration_since(BootInstant::now())
            .saturating_sub(KILL_MARGIN)
    });
    let kill_after = grace.min(left);
    let _ = killpg(pgid, Signal::SIGTERM);
    let term_sent = Instant::now();
    let mut killed_at: Option<Instant> = None;
    loop {
        let _ = child.try_wait();
        if !group_running(pgid) {
            return Group::Gone;
        }
        match killed_at {
            None if term_sent.elapsed() >= kill_after => {
                let _ = killpg(pgid, Signal::SIGKILL);
                killed_at = Some(Instant::now());
            }
            Some(at) if at.elapsed() >= KILL_MARGIN => return Group::Survived { pgid },
            _ => {}
        }
        tokio::time::sleep(GROUP_POLL).await;
    }
}

/// Whether a process of group `pgid` still runs. A zombie does not: it is dead, and waits only
/// for whoever inherited it to reap it (a container's first process may never do so).
fn group_running(pgid: Pid) -> bool {
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return killpg(pgid, None).is_ok();
    };
    processes.flatten().any(|process| {
        let Ok(stat) = std::fs::read_to_string(process.path().join("stat")) else {
            return false;
        };
        // `PID (COMMAND) STATE PPID PGRP ...`; the command may itself hold spaces and parentheses.
        let Some((_, fields)) = stat.rsplit_once(") ") else {
            return false;
        };
        let mut fields = fields.split(' ');
        let state = fields.next().unwrap_or("Z");
        let group = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
        group == Some(pgid.as_raw()) && !matches!(state, "Z" | "X" | "x")
    })
}

fn exit_status(status: std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(signal)) => 128u8.saturating_add(u8::try_from(signal).unwrap_or(0)),
        _ => 1,
    }
}

/// The signals this process passes on, as one stream.
struct Signals(Vec<(Signal, tokio::signal::unix::Signal)>);

impl Signals {
    fn new() -> std::io::Result<Self> {
        FORWARDED
            .iter()
            .map(|&s| Ok((s, signal(SignalKind::from_raw(s as i32))?)))
            .collect::<std::io::Result<Vec<_>>>()
            .map(Self)
    }

    async fn next(&mut self) -> Signal {
        let waits = self.0.iter_mut().map(|(kind, stream)| {
            let kind = *kind;
            Box::pin(async move {
                stream.recv().await;
                kind
            })
        });
        futures_util::future::select_all(waits).await.0
    }
}

/// The trampoline: die with the `leasehold exec` that started it, then become the command.
fn become_command(args: &[OsString]) -> ExitCode {
    let command = match args.first() {
        Some(dashes) if dashes == "--" => &args[1..],
        _ => args,
    };
    let Some((program, rest)) = command.split_first() else {
        eprintln!("error: exec-child needs a command");
        return ExitCode::from(EXIT_BAD_CONFIG);
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        eprintln!("error: cannot arrange to die with leasehold exec: {e}");
        return ExitCode::from(EXIT_CANNOT_RUN);
    }
    // Set after the fork: the parent may have died in between, and this process would then be
    // another's child already.
    let parent = std::env::var(PARENT_VAR).ok();
    if parent.as_deref() != Some(&nix::unistd::getppid().as_raw().to_string()) {
        return ExitCode::from(EXIT_LOCK_LOST);
    }
    let error = std::process::Command::new(program)
        .args(rest)
        .env_remove(PARENT_VAR)
        .exec();
    eprintln!("error: cannot run {program:?}: {error}");
    ExitCode::from(EXIT_CANNOT_RUN)
}
