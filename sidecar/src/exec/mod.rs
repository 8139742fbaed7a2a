//! `leasehold-sidecar exec`: run a command only while this process holds a lock.
//!
//! It waits for the lock, then starts the command in a process group of its own, with the
//! fencing token in its environment, and forwards the signals it receives to that group. When
//! the command exits, what it left running is stopped, the lock is released, and the command's
//! status is this process's. When the lock is being lost (renewals fail, so the claim's
//! self-fenced end draws near, or the backend says the lease is gone), the command's processes
//! get SIGTERM, then SIGKILL after `--kill-grace`, or sooner, so that the SIGKILL goes out
//! [`KILL_MARGIN`] before the claim ends (at once when the claim is gone): no other holder's
//! command can start while one of this one's processes still runs. The command's processes
//! are its group and every process descending from this one, which is their subreaper, as
//! `/proc` shows them ([`processes`]).
//!
//! The lock is held by this process itself, on `--backend`, or by a running sidecar through a
//! hold bound to a connection (`--via`, [`via`]), which can also hold a keyed lock's key
//! (`--keyed FAMILY/KEY`).
//!
//! The command runs under a small keeper, this binary again (`exec-child`), which the kernel
//! tells when this process dies (`PR_SET_PDEATHSIG`), and which is the subreaper of every
//! process the command starts: a `leasehold exec` killed with SIGKILL does not leave its command,
//! or anything the command left in the background, running without the lock. `exec` tells the
//! keeper each new end of the claim ([`claim_end`]): an `exec` that is stopped (Ctrl-Z, SIGSTOP)
//! renews nothing, and the keeper stops the command before the last end it was told.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getppid};
use tokio::signal::unix::{SignalKind, signal};

use leasehold_lease::{
    BackendUrl, BootInstant, DEFAULT_BACKEND, Lock, LockConfig, Mode, safety_margin,
};

use crate::config::EXIT_BAD_CONFIG;

mod claim_end;
mod processes;
mod via;

use processes::Table;

/// The exit status when the lock was lost and the command stopped for it (EX_TEMPFAIL: try
/// again).
pub const EXIT_LOCK_LOST: u8 = 75;
/// The exit status when the lock was not taken within `--wait` (EX_UNAVAILABLE).
pub const EXIT_NOT_ACQUIRED: u8 = 69;
/// The status a shell gives a command it cannot run.
const EXIT_CANNOT_RUN: u8 = 127;
/// How long before the claim ends the command's processes must be gone: SIGKILL takes effect
/// at once, but the kernel must still be given time to reap every process. Also how long after
/// the SIGKILL a process may take to die before it counts as a survivor.
pub const KILL_MARGIN: Duration = Duration::from_millis(250);
/// The lease without --lease-duration, as the sidecar's.
const DEFAULT_LEASE: Duration = Duration::from_secs(15);
/// How often the command's processes are looked for while they are being stopped.
const GROUP_POLL: Duration = Duration::from_millis(10);
/// How often processes that outlived SIGKILL are looked for, while a sidecar keeps the lock
/// for them.
const SURVIVOR_POLL: Duration = Duration::from_millis(100);
/// How often the keeper looks for its parent, `exec`, besides when the kernel says it died.
const PARENT_POLL: Duration = Duration::from_millis(250);
/// The longest sleep between checks of the claim, so that a suspended machine (whose boot
/// clock jumps) is noticed soon after it resumes.
const CLAIM_POLL: Duration = Duration::from_millis(200);
/// The keeper's first argument, and the variable naming the `exec` it must stop the command with.
const CHILD_ARG: &str = "exec-child";
const PARENT_VAR: &str = "LEASEHOLD_EXEC_PARENT";
/// The keeper's name once the command has ended, before its status (`/proc/PID/comm`).
const ENDED_NAME: &str = "ended:";
/// The variable telling the keeper `--kill-grace`, in milliseconds.
const GRACE_VAR: &str = "LEASEHOLD_EXEC_KILL_GRACE_MS";

/// The stops a terminal sends, which the keeper catches so that only SIGSTOP stops it.
const JOB_CONTROL_STOPS: [Signal; 3] = [Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU];
/// The most the keeper acts ahead of `exec`'s SIGKILL, to find the command's processes first.
const MAX_KEEPER_LEAD: Duration = Duration::from_millis(250);

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
    about = "Runs a command only while a lock is held: leasehold-sidecar exec (--lock NAME | --keyed FAMILY/KEY [--mode read|write] | --keyed FAMILY/KEY --keyed FAMILY/KEY...) [--backend URL | --via http://127.0.0.1:4040] -- COMMAND [ARGS]...",
    after_help = "Exit status: the command's (128+N when killed by signal N); 75 when the lock was lost and the command stopped; 69 when the lock was not taken within --wait; 128+N when exec got signal N while waiting for the lock; 2 for bad arguments; 127 when the command cannot be started; 1 when the backend cannot be opened."
)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["lock", "keyed"])))]
struct ExecArgs {
    /// The lock to hold while the command runs.
    #[arg(long, value_name = "NAME")]
    lock: Option<String>,

    /// A key of a keyed family to hold while the command runs, through the sidecar serving the
    /// family (needs --via); the owner is --identity. Given several times (keys of one
    /// family), every key is held, or none.
    #[arg(long, value_name = "FAMILY/KEY", requires = "via")]
    keyed: Vec<String>,

    /// With --keyed on a read-write family: hold the key to read (shared with other readers)
    /// or to write (alone) [default: the family's plain acquisition, a read on a read-write
    /// family].
    #[arg(long, value_name = "MODE")]
    mode: Option<via::KeyMode>,

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

    /// Run while holding one of the lock's N permits: up to N commands run at once, each with
    /// its permit in LEASEHOLD_PERMIT (as consul lock -n N). Every exec of the lock must give
    /// the same N.
    #[arg(long, value_name = "N", default_value_t = 1, conflicts_with_all = ["via", "keyed"])]
    permits: u32,

    /// Give up when the lock is not taken within this long [default: wait for ever].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    wait: Option<Duration>,

    /// How long between SIGTERM and SIGKILL: for what the command left running when it ended,
    /// and for all its processes when the lock is being lost.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = humantime::parse_duration)]
    kill_grace: Duration,

    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// `leasehold-sidecar exec ...` (`args` starts with `exec`) and the keeper
/// (`leasehold-sidecar exec-child -- COMMAND...`).
pub fn main(args: Vec<OsString>) -> ExitCode {
    if args.first().is_some_and(|a| a == CHILD_ARG) {
        return keep_command(&args[1..]);
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
    // One thread: the kernel's parent-death signal follows the thread that started the keeper,
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
    /// The command ended with this status, and its keeper was stopping what it left.
    Ended(u8),
    Lost,
}

async fn run(args: ExecArgs) -> u8 {
    let bad = |flag: &str, reason: &dyn std::fmt::Display| {
        eprintln!("error: invalid value for '--{flag}': {reason}");
        EXIT_BAD_CONFIG
    };
    if args.mode.is_some() && args.keyed.is_empty() {
        return bad(
            "mode",
            &"a mode is for a key of a read-write family (--keyed)",
        );
    }
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
            let target = match &args.lock {
                Some(lock) => via::Target::Lock(lock.clone()),
                None => match keyed_target(&args) {
                    Ok(target) => target,
                    Err((flag, why)) => return bad(flag, &why),
                },
            };
            let name = match (&args.lock, &target) {
                (Some(lock), _) => lock.clone(),
                (None, via::Target::Keys { family, keys, .. }) => {
                    format!("{family}/{}", keys.join(","))
                }
                (None, _) => args.keyed.concat(),
            };
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
        // A process of the command outlived SIGKILL (an uninterruptible wait) or may not be
        // signalled: the lock is not released while it lives.
        let kept = match holder {
            Holder::Direct(_) => "left to run out, not released",
            Holder::Via { .. } => {
                "kept until the command's processes are gone (or the claim ends), then released"
            }
        };
        eprintln!(
            "leasehold exec: a process of the command outlived SIGKILL or may not be signalled; the lock {:?} is {kept}",
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
    config.permits = args.permits;
    if let Some(renew) = args.renew_interval {
        config.renew_interval = renew;
    }
    config.validate().map_err(|e| match e {
        leasehold_lease::Error::InvalidConfig {
            field: "permits",
            reason,
        } => bad("permits", &reason),
        e => bad("lock", &e),
    })?;
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

/// What `--keyed` names: one key (with its `--mode`), or several keys of one family.
fn keyed_target(args: &ExecArgs) -> Result<via::Target, (&'static str, String)> {
    let mut family = None;
    let mut keys: Vec<String> = Vec::with_capacity(args.keyed.len());
    if args.keyed.len() > leasehold_lease::keyed::MAX_KEYS_AT_ONCE {
        return Err((
            "keyed",
            format!(
                "{} keys: at most {} are held together",
                args.keyed.len(),
                leasehold_lease::keyed::MAX_KEYS_AT_ONCE
            ),
        ));
    }
    for keyed in &args.keyed {
        match keyed.split_once('/') {
            // A comma would split the key in the request's list of keys.
            Some((_, key)) if key.contains(',') => {
                return Err(("keyed", format!("{keyed:?}: a key has no commas")));
            }
            Some((_, key)) if keys.iter().any(|k| k == key) => {
                return Err(("keyed", format!("{keyed:?} is named twice")));
            }
            Some((of, key)) if !of.is_empty() && !key.is_empty() => {
                if family.is_some_and(|family| family != of) {
                    return Err((
                        "keyed",
                        format!("{keyed:?}: keys held together are of one family"),
                    ));
                }
                family = Some(of);
                keys.push(key.to_owned());
            }
            _ => return Err(("keyed", format!("{keyed:?} is not FAMILY/KEY"))),
        }
    }
    let Some(family) = family else {
        return Err(("lock", "--lock or --keyed is required".into()));
    };
    let owner = args.identity.clone().unwrap_or_else(unique_owner);
    if let [key] = keys.as_slice() {
        return Ok(via::Target::Key {
            family: family.to_owned(),
            key: key.clone(),
            owner,
            mode: args.mode,
        });
    }
    Ok(via::Target::Keys {
        family: family.to_owned(),
        keys,
        owner,
        mode: args.mode,
    })
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

    /// The permit of `holding` to tell the command, on a lock or a key of several permits (its
    /// tokens count per permit); through a sidecar, the permit its stream names (a family's
    /// key's stream names it where the family has permits).
    fn permit_told(&self, (permit, _): (u32, u64)) -> Option<u32> {
        match self {
            Holder::Direct(lock) => lock.has_had_permits().then_some(permit),
            Holder::Via { claims, .. } => claims.borrow().permit,
        }
    }

    /// Several keys' tokens, `KEY=TOKEN` each, comma-separated.
    fn tokens(&self) -> Option<String> {
        match self {
            Holder::Direct(_) => None,
            Holder::Via { claims, .. } => claims.borrow().tokens.clone(),
        }
    }

    /// The claims as they change.
    fn claims(&self) -> Claims {
        match self {
            Holder::Direct(lock) => Claims::Direct(lock.watch()),
            Holder::Via { claims, .. } => Claims::Via(claims.clone()),
        }
    }

    /// Done with the lock: released when the command's processes are gone; left to run out
    /// when one survived (through a sidecar, the connection stays open until they are gone or
    /// the claim ends, since closing it would release the lock at once).
    async fn let_go(self, group: Group) {
        match (self, group) {
            (Holder::Direct(lock), Group::Gone) => lock.shutdown().await,
            (Holder::Direct(lock), Group::Survived { .. }) => {
                lock.retire().await;
            }
            (Holder::Via { hold, .. }, Group::Gone) => drop(hold),
            (Holder::Via { hold, claims, .. }, Group::Survived { command }) => {
                let mut claims = Claims::Via(claims);
                while command.running() && claims.current().is_some() {
                    tokio::time::sleep(SURVIVOR_POLL).await;
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
    /// The claim now (marking it seen), if held and not yet ended: the holding (its permit,
    /// 0 but on a lock of several held by exec itself, and its token) and the claim's end.
    fn current(&mut self) -> Option<((u32, u64), BootInstant)> {
        let held = match self {
            Claims::Direct(state) => state
                .borrow_and_update()
                .held
                .as_ref()
                .map(|held| ((held.permit, held.token), held.valid_until)),
            // A stream is one holding, whose token it names at every event.
            Claims::Via(claims) => claims
                .borrow_and_update()
                .held
                .map(|(token, end)| ((0, token), end)),
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

/// Whether the command's processes are gone once `exec` is done with them.
enum Group {
    Gone,
    Survived { command: CommandProcesses },
}

async fn supervise(args: &ExecArgs, holder: &mut Holder, signals: &mut Signals) -> (u8, Group) {
    let (holding, end) =
        match wait_for_lock(holder, args.wait, args.kill_grace + KILL_MARGIN, signals).await {
            Ok(held) => held,
            Err(status) => return (status, Group::Gone),
        };
    let token = holding.1;
    let (mut child, command, mut teller) = match spawn(args, holder, holding, end) {
        Ok(spawned) => spawned,
        Err(e) => {
            eprintln!("error: cannot start {:?}: {e}", args.command[0]);
            return (EXIT_CANNOT_RUN, Group::Gone);
        }
    };
    let pgid = command.pgid;
    tracing::info!(lock = %holder.name(), token, pid = pgid.as_raw(), "holding the lock; the command runs");
    let mut claims = holder.claims();
    let outcome = follow(
        &mut claims,
        holding,
        args.kill_grace,
        &mut child,
        pgid,
        signals,
        &mut teller,
    )
    .await;
    // Whatever ended it, nothing of the group may run once the lock is let go: the command's
    // background processes are stopped too, within what is left of the claim.
    let claim_end = claims
        .current()
        .filter(|(held, _)| *held == holding)
        .map(|(_, end)| end);
    // A command that ended before the lock was being lost ended under it: its status stands.
    let outcome = match outcome {
        Outcome::Lost => ended_status(pgid).map_or(Outcome::Lost, Outcome::Ended),
        outcome => outcome,
    };
    // The keeper gave what the command left its grace before it exited (with `/proc` to find
    // it): what is left now gets SIGKILL at once.
    let grace = match outcome {
        Outcome::Exited(_) if std::fs::metadata("/proc/self/stat").is_ok() => Duration::ZERO,
        _ => args.kill_grace,
    };
    let group = stop_group(&mut child, command, grace, claim_end, &mut claims, holding).await;
    let status = match outcome {
        Outcome::Exited(status) => exit_status(status),
        Outcome::Ended(status) => status,
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

/// The holding (permit, token) and its claim's end, once the lock is held with more than
/// `needed` of its claim left; `Err(status)` when `exec` gives up (the wait ran out, a signal asked it to stop, or the
/// sidecar refused).
async fn wait_for_lock(
    holder: &Holder,
    wait: Option<Duration>,
    needed: Duration,
    signals: &mut Signals,
) -> Result<((u32, u64), BootInstant), u8> {
    let mut claims = holder.claims();
    let started = Instant::now();
    loop {
        // The claim must outlast stopping the command, or it would start only to be stopped
        // (a lease a backend dates from before the call may arrive half spent): otherwise the
        // next renewal is awaited.
        if let Some((holding, end)) = claims.current() {
            // Through a sidecar the lease is the sidecar's, known once held.
            if let Some((lease, renew)) = claims.timing()
                && let Err(e) = check_grace(needed - KILL_MARGIN, lease, renew)
            {
                eprintln!("error: invalid value for '--kill-grace': {e} (the sidecar's lease)");
                return Err(EXIT_BAD_CONFIG);
            }
            if end.saturating_duration_since(BootInstant::now()) > needed {
                return Ok((holding, end));
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

/// The command's keeper, started, what is the command's to stop when it ends, and the pipe
/// that tells the keeper when the claim ends (from `end` on).
fn spawn(
    args: &ExecArgs,
    holder: &Holder,
    (permit, token): (u32, u64),
    end: BootInstant,
) -> std::io::Result<(tokio::process::Child, CommandProcesses, claim_end::Teller)> {
    // What the command leaves running out of its group comes here once its keeper has ended,
    // to be stopped with the group.
    nix::sys::prctl::set_child_subreaper(true)?;
    let own = nix::unistd::getpid();
    // Children this process had before it became `exec` (a shell's, that ran `exec
    // leasehold-sidecar exec ...`) are not the command's.
    let before = Table::read().map_or_else(Vec::new, |table| table.children(own));
    let (teller, for_keeper) = claim_end::Teller::new(end)?;
    let mut command = tokio::process::Command::new(std::env::current_exe()?);
    command
        .envs(for_keeper.vars.clone())
        .arg(CHILD_ARG)
        .arg("--")
        .args(&args.command)
        .env(PARENT_VAR, std::process::id().to_string())
        .env(GRACE_VAR, args.kill_grace.as_millis().to_string())
        // It may carry the backend's password, which the command has no use for.
        .env_remove("LEASEHOLD_BACKEND")
        // Not the sidecar's own LEASEHOLD_LOCK and LEASEHOLD_IDENTITY, which a sidecar the
        // command starts would take for its flags.
        .env("LEASEHOLD_EXEC_LOCK", holder.name())
        .env("LEASEHOLD_EXEC_IDENTITY", holder.identity())
        .process_group(0)
        .kill_on_drop(false);
    // Nothing of an exec the command runs under (nested) is passed on: only this holding's.
    for inherited in [
        "LEASEHOLD_FENCING_TOKEN",
        "LEASEHOLD_FENCING_TOKENS",
        "LEASEHOLD_PERMIT",
    ] {
        command.env_remove(inherited);
    }
    // Several keys have a token each, counted apart: no one of them fences the others' keys.
    match holder.tokens() {
        Some(tokens) => {
            command.env("LEASEHOLD_FENCING_TOKENS", tokens);
        }
        None => {
            command.env("LEASEHOLD_FENCING_TOKEN", token.to_string());
            // A token counts per permit: the command fences with both.
            if let Some(permit) = holder.permit_told((permit, token)) {
                command.env("LEASEHOLD_PERMIT", permit.to_string());
            }
        }
    }
    // Through a sidecar, the command inherits a copy of the held connection (the only
    // descriptor left open across exec), which stays open while it or any process it started
    // lives: the sidecar releases only once they are all gone, even if exec is killed outright.
    let inherited = match holder {
        Holder::Via { hold, .. } => hold.inheritable(),
        Holder::Direct(_) => None,
    };
    let child = command.spawn();
    drop(inherited);
    for_keeper.close();
    let child = child?;
    let Some(pgid) = child.id().map(|id| Pid::from_raw(id as i32)) else {
        return Err(std::io::Error::other("the keeper ended at once"));
    };
    Ok((child, CommandProcesses { own, pgid, before }, teller))
}

/// Until the command exits or the lock is being lost: the command's processes are stopped from
/// the moment the claim's end is nearer than the grace and the margin, or at once when the lock
/// is gone or changed hands. Each new end is told to the keeper.
async fn follow(
    claims: &mut Claims,
    holding: (u32, u64),
    kill_grace: Duration,
    child: &mut tokio::process::Child,
    pgid: Pid,
    signals: &mut Signals,
    teller: &mut claim_end::Teller,
) -> Outcome {
    loop {
        let stop_at = match claims.current() {
            Some((held, end)) if held == holding => {
                teller.tell(end);
                end - (kill_grace + KILL_MARGIN)
            }
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

/// What is the command's: its group (`pgid`, its keeper's), and the processes descending
/// from this one (`own`, their subreaper) but through the children it had before (`before`).
struct CommandProcesses {
    own: Pid,
    pgid: Pid,
    before: Vec<Pid>,
}

impl CommandProcesses {
    /// Reap the processes handed to this one that have ended, and find the command's living
    /// processes, on one read of `/proc`; `None` when it cannot be read. `keeper`: the keeper,
    /// until its [`tokio::process::Child`] has reaped it.
    fn reap_and_find(&self, keeper: Option<Pid>) -> Option<Vec<Pid>> {
        let Some(table) = Table::read() else {
            // Without `/proc`, any child once nothing is left to take the keeper's status.
            if keeper.is_none() {
                reap_any();
            }
            return None;
        };
        reap_ended(&table, self.own, keeper);
        Some(table.command(self.own, self.pgid, &self.before))
    }

    /// Whether a process of the command lives (two reads of `/proc` agree that none does);
    /// without `/proc`, whether its group has a member. Reaps as [`Self::reap_and_find`].
    fn running(&self) -> bool {
        (0..2).any(|_| match self.reap_and_find(None) {
            None => killpg(self.pgid, None).is_ok(),
            Some(living) => !living.is_empty(),
        })
    }
}

/// Reap the ended children of `own` (this process, a subreaper) but `spawned`, the child it
/// started itself, whose status its [`tokio::process::Child`] takes.
fn reap_ended(table: &Table, own: Pid, spawned: Option<Pid>) {
    for pid in table.ended_children(own, spawned) {
        let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
    }
}

/// The command's status, once its keeper (`keeper`) says it has ended.
fn ended_status(keeper: Pid) -> Option<u8> {
    let name = std::fs::read_to_string(format!("/proc/{keeper}/comm")).ok()?;
    name.trim().strip_prefix(ENDED_NAME)?.parse().ok()
}

/// Reap every ended child of this process.
fn reap_any() {
    // A status that cannot be decoded (a realtime signal) is an error after its child was
    // reaped: a bound, not the error, ends the loop.
    for _ in 0..1024 {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(nix::errno::Errno::ECHILD) => return,
            Ok(_) | Err(_) => {}
        }
    }
}

/// Stops what runs of the command: SIGTERM, then SIGKILL after `grace`, or sooner so that it
/// goes out [`KILL_MARGIN`] before `claim_end`, and at once when the claim is gone (another may
/// hold the lock already), also when `claims` learns so during the grace (the backend,
/// reached again, no longer has the lease).
async fn stop_group(
    child: &mut tokio::process::Child,
    command: CommandProcesses,
    grace: Duration,
    claim_end: Option<BootInstant>,
    claims: &mut Claims,
    holding: (u32, u64),
) -> Group {
    let left = claim_end.map_or(Duration::ZERO, |end| {
        end.saturating_duration_since(BootInstant::now())
            .saturating_sub(KILL_MARGIN)
    });
    let find = || {
        // Reap the keeper (the group's leader) through its Child, the rest here.
        let keeper = match child.try_wait() {
            Ok(None) => Some(command.pgid),
            _ => None,
        };
        command.reap_and_find(keeper)
    };
    let claim_gone = || claims.current().is_none_or(|(held, _)| held != holding);
    match stop_processes(find, Some(command.pgid), grace.min(left), claim_gone).await {
        Stopped::Gone => Group::Gone,
        Stopped::Survived => Group::Survived { command },
    }
}

/// How stopping processes ended.
enum Stopped {
    Gone,
    /// [`KILL_MARGIN`] after the SIGKILL, processes remain that will never run their own code
    /// again (in an uninterruptible wait, which they die leaving) or that may not be signalled.
    Survived,
}

/// SIGTERM to every process `find` finds, then, from `kill_after` on or from when `kill_now`
/// says so, SIGKILL to each once, looking again every [`GROUP_POLL`]: a process handed down as
/// its parent dies gets the same. `find` is `None` without `/proc`: then `group`, when given,
/// stands for all of them.
async fn stop_processes(
    mut find: impl FnMut() -> Option<Vec<Pid>>,
    group: Option<Pid>,
    kill_after: Duration,
    mut kill_now: impl FnMut() -> bool,
) -> Stopped {
    let started = Instant::now();
    let mut termed: std::collections::HashSet<Pid> = std::collections::HashSet::new();
    let mut killed: std::collections::HashSet<Pid> = std::collections::HashSet::new();
    let mut killing_since: Option<Instant> = None;
    let (mut empty_reads, mut settled_reads) = (0, 0);
    loop {
        let kill = killing_since.is_some() || started.elapsed() >= kill_after || kill_now();
        if kill && killing_since.is_none() {
            // The command's own group at once: the look through `/proc` for what left it takes
            // longer on a busy host, and the claim's end does not wait for it.
            if let Some(group) = group {
                let _ = killpg(group, Signal::SIGKILL);
            }
            killing_since = Some(Instant::now());
        }
        let Some(living) = find() else {
            let Some(group) = group.filter(|&group| killpg(group, None).is_ok()) else {
                return Stopped::Gone;
            };
            match killing_since {
                None if termed.insert(group) => {
                    let _ = killpg(group, Signal::SIGTERM);
                }
                Some(since) if since.elapsed() >= KILL_MARGIN => return Stopped::Survived,
                Some(_) => {
                    let _ = killpg(group, Signal::SIGKILL);
                }
                None => {}
            }
            tokio::time::sleep(GROUP_POLL).await;
            continue;
        };
        // A read of `/proc` is not atomic: it takes two in a row to agree.
        empty_reads = if living.is_empty() {
            empty_reads + 1
        } else {
            0
        };
        if empty_reads >= 2 {
            return Stopped::Gone;
        }
        if kill {
            // Each process once: the kernel drops a SIGKILL to a process already exiting, so
            // one that got it and still runs is on its way out.
            let mut sent = false;
            for &pid in &living {
                if !killed.contains(&pid) && !processes::dying(pid) {
                    match nix::sys::signal::kill(pid, Signal::SIGKILL) {
                        Ok(()) => {
                            sent = true;
                            killed.insert(pid);
                        }
                        Err(nix::errno::Errno::EPERM) => {
                            killed.insert(pid);
                        }
                        // Gone meanwhile: its pid may come back as another's.
                        Err(_) => {}
                    }
                }
            }
            settled_reads = if sent || living.is_empty() {
                0
            } else {
                settled_reads + 1
            };
            let since = killing_since.unwrap_or_else(Instant::now);
            if settled_reads >= 2 && since.elapsed() >= KILL_MARGIN {
                return Stopped::Survived;
            }
        } else {
            for &pid in &living {
                if termed.insert(pid) {
                    let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
                }
            }
        }
        tokio::time::sleep(GROUP_POLL).await;
    }
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

/// The keeper: runs the command as its child, in the keeper's own process group (which `exec`
/// signals), and outlives it to give what it left its grace, stop that, and pass its status on.
/// When `exec` dies first (killed outright, so that nobody renews the
/// lock any more), the keeper stops every process of the command at once: those of the group,
/// and those that left it (`setsid`, a daemon's double fork), which come to the keeper as
/// their parents die because it is their subreaper.
fn keep_command(args: &[OsString]) -> ExitCode {
    let command = match args.first() {
        Some(dashes) if dashes == "--" => &args[1..],
        _ => args,
    };
    let Some((program, rest)) = command.split_first() else {
        eprintln!("error: exec-child needs a command");
        return ExitCode::from(EXIT_BAD_CONFIG);
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the keeper's runtime: {e}");
            return ExitCode::from(EXIT_CANNOT_RUN);
        }
    };
    ExitCode::from(runtime.block_on(keep(program, rest)))
}

async fn keep(program: &OsString, rest: &[OsString]) -> u8 {
    // The signals `exec` passes on to the group are the command's: the keeper catches them and
    // does nothing. Caught, not blocked: a handler is reset in the command as it starts, where
    // a blocked mask would be inherited.
    // The job-control stops too: the group is in the background of a terminal, and a command
    // reading it would stop the keeper with it (SIGTTIN goes to the whole group).
    let caught: std::io::Result<Vec<_>> = FORWARDED
        .iter()
        .chain(&JOB_CONTROL_STOPS)
        .map(|&s| signal(SignalKind::from_raw(s as i32)))
        .collect();
    // `exec`'s death is told as a SIGCHLD, the signal a child's end is told by.
    let told = caught.and_then(|caught| Ok((caught, signal(SignalKind::child())?)));
    let arranged = told.and_then(|told| {
        nix::sys::prctl::set_child_subreaper(true)?;
        nix::sys::prctl::set_pdeathsig(Signal::SIGCHLD)?;
        Ok(told)
    });
    let (_caught, mut children_or_parent) = match arranged {
        Ok(told) => told,
        Err(e) => {
            eprintln!("error: cannot arrange to stop the command with leasehold exec: {e}");
            return EXIT_CANNOT_RUN;
        }
    };
    // Checked after the death signal is set: `exec` may have died in between, and this process
    // would then be another's child already.
    let parent = getppid();
    if std::env::var(PARENT_VAR).ok().as_deref() != Some(&parent.as_raw().to_string()) {
        return EXIT_LOCK_LOST;
    }
    // Without it, a stopped `exec` would leave the command running past the claim's end.
    let claim = match claim_end::Told::from_env() {
        Ok(claim) => claim,
        Err(e) => {
            eprintln!("error: the keeper cannot follow the claim: {e}");
            return EXIT_CANNOT_RUN;
        }
    };
    // The keeper cannot signal its own group without dying with it, so what it stops is found
    // through `/proc` first: it acts earlier by twice what a look takes here.
    let looked = Instant::now();
    let _ = Table::read();
    let lead = (2 * looked.elapsed()).min(MAX_KEEPER_LEAD);
    let kill_due = || BootInstant::now() >= claim.stop_at() - lead;
    if kill_due() {
        return EXIT_LOCK_LOST;
    }
    let mut spawning = tokio::process::Command::new(program);
    spawning
        .args(rest)
        .env_remove(PARENT_VAR)
        .env_remove(GRACE_VAR)
        .kill_on_drop(false);
    for var in claim_end::Told::vars() {
        spawning.env_remove(var);
    }
    let mut child = match spawning.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("error: cannot run {program:?}: {e}");
            return EXIT_CANNOT_RUN;
        }
    };
    let command = child.id().map(|id| Pid::from_raw(id as i32));
    let own = nix::unistd::getpid();
    loop {
        let child_ended = tokio::select! {
            status = child.wait() => {
                let status = match status {
                    Ok(status) => exit_status(status),
                    Err(_) => EXIT_LOCK_LOST,
                };
                // Told to `exec` by the keeper's name, so that a lock lost from now on does not
                // change the command's status.
                if let Ok(name) = std::ffi::CString::new(format!("{ENDED_NAME}{status}")) {
                    let _ = nix::sys::prctl::set_name(&name);
                }
                // What the command left is stopped before its status is passed on, so that
                // it is stopped even if `exec` dies meanwhile: at once if it has died.
                let grace = std::env::var(GRACE_VAR)
                    .ok()
                    .and_then(|ms| ms.parse().ok())
                    .map_or(Duration::ZERO, Duration::from_millis);
                let find = || {
                    if getppid() != parent {
                        stop_everything(None, Keeper::Too);
                    }
                    reap_any();
                    Table::read().map(|table| table.command(own, own, &[]))
                };
                stop_processes(find, None, grace, kill_due).await;
                return status;
            }
            _ = children_or_parent.recv() => true,
            () = claim.changed() => false,
            // A backstop for a signal that never came, and the claim's end.
            () = tokio::time::sleep(PARENT_POLL.min((claim.stop_at() - lead).remaining())) => false,
        };
        if getppid() != parent {
            stop_everything(command, Keeper::Too);
            return EXIT_LOCK_LOST;
        }
        if kill_due() {
            stop_everything(command, Keeper::Stays);
            eprintln!(
                "leasehold exec: the claim ends and exec (stopped, or starved of CPU) has not stopped the command: its processes were stopped {} ms before the claim ends, by its keeper",
                claim.end().remaining().as_millis()
            );
            return EXIT_LOCK_LOST;
        }
        // Orphans handed to the keeper are reaped as they end (the command by its Child).
        if child_ended && let Some(table) = Table::read() {
            reap_ended(&table, own, command);
        }
    }
}

/// Whether [`stop_everything`] ends with the keeper's whole group, the keeper with it.
#[derive(PartialEq)]
enum Keeper {
    /// `exec` is gone: nobody waits for the keeper's status.
    Too,
    /// `exec` lives, and is told the lock-lost status; where `/proc` cannot be read, the
    /// group is signalled anyway.
    Stays,
}

/// SIGKILL to the command (`command`, while it runs), every process of the keeper's group and
/// every process descending from the keeper (the command's, whichever group they moved to),
/// until two reads of `/proc` in a row find none that lacks a SIGKILL and may be signalled;
/// then to the group, the keeper with it, for whatever `/proc` did not show.
fn stop_everything(command: Option<Pid>, keeper: Keeper) {
    if let Some(command) = command {
        let _ = nix::sys::signal::kill(command, Signal::SIGKILL);
    }
    let own = nix::unistd::getpid();
    let mut quiet_reads = 0;
    let mut read = false;
    while let Some(table) = Table::read() {
        read = true;
        let mut sent = false;
        for pid in table.command(own, own, &[]) {
            // A process that may not be signalled (one that changed its user) is not waited for.
            if !processes::dying(pid) {
                sent |= nix::sys::signal::kill(pid, Signal::SIGKILL).is_ok();
            }
        }
        // The command's status is of no use here: every ended child is reaped.
        reap_any();
        quiet_reads = if sent { 0 } else { quiet_reads + 1 };
        if quiet_reads >= 2 {
            break;
        }
        std::thread::sleep(GROUP_POLL);
    }
    if keeper == Keeper::Too || !read {
        let _ = killpg(own, Signal::SIGKILL);
    }
}
