//! The exec safety check: contenders run `leasehold-sidecar exec` over and over on one lock,
//! each wrapping [`witness`](../bin/leasehold-exec-witness.rs), while the exec holding the lock
//! is killed, paused alone, cut off from the backend, and the backend restarts or fails over.
//! What is checked is the commands, not the lock: two commands never run at once, each
//! command's fencing token is above the last one's, and a command runs within a lease (and a
//! renew interval, and a slack for a loaded machine) after each fault ends; after a kill or a
//! partition of the holder, a command with a newer token.
//!
//! [`run_permits`] runs each `exec` on a lock of two permits (`--permits 2`): each permit is
//! checked as a lock of its own (its commands one at a time, with rising tokens), and a kill
//! or partition of a permit's holder is followed by a newer token on that permit.
//!
//! [`run_via`] holds through each contender's sidecar instead (`exec --via`, a hold bound to a
//! connection), and kills, pauses and cuts off the sidecar as well as the exec;
//! [`run_via_keyed`] does so on a key of a family (`exec --via --keyed`), and
//! [`run_via_read_write`] on a key of a read-write family, each exec a reader or the writer
//! (`--mode read|write`): readers may run side by side, a writer only alone, with a token above
//! every earlier command's.
//!
//! Two commands at once are seen exactly, not sampled: each witness holds an exclusive `flock`
//! on one file for as long as it lives, so a witness that starts while another still lives
//! finds it taken. An exec holding on its own is paused alone (`SIGSTOP` to its process, not
//! to its command's group): its keeper, told each end of the claim, must stop the command
//! before the claim ends, while exec renews nothing. Through a sidecar, the sidecar is paused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::fault_proxy::FaultProxy;
use crate::safety::{
    Backend, CALM_MAX_MS, CALM_MIN_MS, FAULT_LENGTH, Fault, LEASE, RECOVERY_SLACK, RENEW, TIMING,
    Target,
};
use crate::{Sidecar, sidecar_binary, unique_lock, workspace_binary};

/// Contenders, each one `exec` at a time.
const CONTENDERS: usize = 3;
/// Between `SIGTERM` and `SIGKILL` when a lock is being lost: within what a 1 s lease leaves.
const KILL_GRACE: &str = "200ms";
/// How long a command runs, in milliseconds, drawn afresh for each: most are shorter than the
/// lease, one in three lasts a few leases, so that faults meet commands that must be stopped.
const SHORT_MS: std::ops::Range<u64> = 50..600;
const LONG_MS: std::ops::Range<u64> = 1000..3000;
/// On top of the lease: an exec the harness starts again, or one that had to open its backend
/// again, before its command runs.
const EXEC_START: Duration = Duration::from_millis(1000);
/// The witness's exit status when it found another command running.
const OVERLAP: i32 = 99;

/// The witness command, found beside the test binaries as the sidecar is.
pub fn witness_binary() -> PathBuf {
    workspace_binary("leasehold-exec-witness", "LEASEHOLD_EXEC_WITNESS_BIN")
}

/// The figures of one run.
#[derive(Debug, Default)]
pub struct Report {
    pub target: String,
    pub seed: u64,
    pub duration: Duration,
    /// Commands that ran.
    pub runs: usize,
    /// Execs that stopped their command because the lock was being lost (exit 75).
    pub lost: usize,
    /// Execs that could not open the backend (exit 1), as under a partition or a restart.
    pub unopened: usize,
    pub faults: BTreeMap<&'static str, usize>,
    pub slowest_recovery: Duration,
    pub violations: Vec<String>,
}

impl Report {
    pub fn summary(&self) -> String {
        format!(
            "{:<20} {:>4}s  commands {:>5}  lost {:>3}  unopened {:>3}  faults {} ({})  violations {}  slowest recovery {:>5} ms",
            self.target,
            self.duration.as_secs(),
            self.runs,
            self.lost,
            self.unopened,
            self.faults.values().sum::<usize>(),
            crate::safety::fault_counts(&self.faults),
            self.violations.len(),
            self.slowest_recovery.as_millis(),
        )
    }
}

/// What the contenders' loops tell the check.
#[derive(Default)]
struct Outcomes {
    lost: usize,
    unopened: usize,
    violations: Vec<String>,
}

/// How each `exec` holds the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// On the backend itself (`--backend`).
    Own,
    /// On the backend itself, on a lock of [`PERMITS`] permits (`--permits`).
    OwnPermits,
    /// Through its contender's sidecar (`--via`): a hold bound to a connection, on an
    /// on-demand lock.
    Via,
    /// Through its contender's sidecar, on one key of a family the sidecars serve (`--via
    /// --keyed FAMILY/KEY`), each exec owning it as its contender.
    ViaKeyed,
    /// As [`Route::ViaKeyed`], on a read-write family of two permits: each exec reads or
    /// writes the key (`--mode read|write`), at random.
    ViaReadWrite,
}

/// The permits of [`Route::OwnPermits`]' lock: fewer than the contenders, so that one waits.
const PERMITS: u32 = 2;

/// The family of [`Route::ViaKeyed`], and its key.
const FAMILY: &str = "jobs";
const KEY: &str = "nightly";

/// One contender: its links to the backend, its sidecar (through `--via`), and the exec it
/// runs now.
struct Contender {
    proxies: Vec<FaultProxy>,
    sidecar: Option<Sidecar>,
    running: Arc<Mutex<Option<Pid>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Contender {
    /// Kill the exec that runs now; whether one did.
    fn kill(&self) -> bool {
        match *self.running.lock().unwrap() {
            Some(pid) => kill(pid, Signal::SIGKILL).is_ok(),
            None => false,
        }
    }

    /// Stop the running exec's own process (not its command) for `length`, then let it go on.
    fn pause(&self, length: Duration) -> bool {
        let Some(pid) = *self.running.lock().unwrap() else {
            return false;
        };
        if kill(pid, Signal::SIGSTOP).is_err() {
            return false;
        }
        std::thread::sleep(length);
        let _ = kill(pid, Signal::SIGCONT);
        true
    }
}

/// Stops the loop and its exec (whose command the kernel stops with it), also when a check
/// panics.
impl Drop for Contender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            while !thread.is_finished() {
                self.kill();
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = thread.join();
        }
    }
}

/// Run the check against `target` for `duration`, each `exec` on the backend itself.
pub fn run(target: Target, duration: Duration, seed: u64) -> Report {
    run_routed(target, duration, seed, Route::Own)
}

/// Run the check with each `exec` on a lock of two permits, on the backend itself.
pub fn run_permits(target: Target, duration: Duration, seed: u64) -> Report {
    run_routed(target, duration, seed, Route::OwnPermits)
}

/// Run the check with each `exec` holding through its contender's sidecar (`--via`), whose
/// sidecar is killed, paused and cut off from the backend among the faults.
pub fn run_via(target: Target, duration: Duration, seed: u64) -> Report {
    run_routed(target, duration, seed, Route::Via)
}

/// [`run_via`] on a key of a family (`--via --keyed FAMILY/KEY`) rather than a lock.
pub fn run_via_keyed(target: Target, duration: Duration, seed: u64) -> Report {
    run_routed(target, duration, seed, Route::ViaKeyed)
}

/// [`run_via_keyed`] on a read-write family: each exec reads or writes the key.
pub fn run_via_read_write(target: Target, duration: Duration, seed: u64) -> Report {
    run_routed(target, duration, seed, Route::ViaReadWrite)
}

fn run_routed(target: Target, duration: Duration, seed: u64, route: Route) -> Report {
    assert!(
        target != Target::RedisSentinelSplit,
        "exec runs on this machine, not on test hosts"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut backend = Backend::start(target);
    let lock = unique_lock("exec");
    let dir = tempfile::tempdir().expect("temp dir");
    let state = dir.path().join("state");
    // The files the witnesses flock: one per permit on a lock of several.
    let states: Vec<PathBuf> = match route {
        Route::OwnPermits => (0..PERMITS)
            .map(|permit| dir.path().join(format!("state-{permit}")))
            .collect(),
        _ => vec![state.clone()],
    };
    for file in &states {
        std::fs::File::create(file).expect("the witnesses' file");
    }
    let file_ids: Vec<String> = states.iter().map(|file| lock_table_id(file)).collect();
    let any_runs = || file_ids.iter().any(|id| command_runs(id));
    let stop = Arc::new(AtomicBool::new(false));
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let mut contenders: Vec<Contender> = (0..CONTENDERS)
        .map(|index| {
            let proxies: Vec<FaultProxy> =
                backend.ports().into_iter().map(FaultProxy::start).collect();
            let ports: Vec<u16> = proxies.iter().map(|p| p.port).collect();
            let identity = format!("contender-{index}");
            let url = backend.url_via(index, &ports);
            let sidecar = (!matches!(route, Route::Own | Route::OwnPermits))
                .then(|| start_sidecar(route, &identity, &url, &lock));
            let via = sidecar
                .as_ref()
                .map(|s| format!("http://{}", s.addr))
                .unwrap_or_default();
            let exec = Exec {
                identity,
                lock: lock.clone(),
                backend: match route {
                    Route::Own => Holds::Backend(url, None),
                    Route::OwnPermits => Holds::Backend(url, Some(PERMITS)),
                    Route::Via => Holds::Via(via),
                    Route::ViaKeyed => Holds::ViaKeyed(via, None),
                    Route::ViaReadWrite => Holds::ViaKeyed(via, Some(READ_WRITE_MODES)),
                },
                state: state.clone(),
                log: dir.path().join(format!("contender-{index}.log")),
            };
            let running = Arc::new(Mutex::new(None));
            let (outcomes, seed) = (outcomes.clone(), rng.random());
            let thread = {
                let (running, stop) = (running.clone(), stop.clone());
                std::thread::spawn(move || exec.repeat(&running, &stop, &outcomes, seed))
            };
            Contender {
                proxies,
                sidecar,
                running,
                stop: stop.clone(),
                thread: Some(thread),
            }
        })
        .collect();
    // Through a sidecar, the sidecar is paused (exec must stop its command on its own); an exec
    // holding on its own is paused alone (its keeper must stop the command).
    let faults: Vec<Fault> = backend
        .faults()
        .iter()
        .copied()
        .filter(|f| *f != Fault::SplitSentinels)
        .collect();

    let mut report = Report {
        target: format!(
            "{}+{}",
            target.name(),
            match route {
                Route::Own => "exec",
                Route::OwnPermits => "exec-permits",
                Route::Via => "exec-via",
                Route::ViaKeyed => "exec-via-keyed",
                Route::ViaReadWrite => "exec-via-read-write",
            }
        ),
        seed,
        ..Report::default()
    };
    let bound = LEASE + RENEW + RECOVERY_SLACK + EXEC_START;
    let began = Instant::now();
    if !wait_for(bound, any_runs) {
        report
            .violations
            .push("no command ran at the start".to_owned());
    }
    while began.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(
            rng.random_range(CALM_MIN_MS..CALM_MAX_MS),
        ));
        let fault = faults[rng.random_range(0..faults.len())];
        // A kill or a partition for longer than the lease is aimed at the command's exec, and
        // its holding must then end: the next command has a newer token. With no command
        // running there is nothing to aim at, and no fault is counted.
        let replaces = matches!(
            fault,
            Fault::KillHolder | Fault::PartitionHolder | Fault::PauseHolder
        );
        // A holder to aim at: on a lock of several permits, one permit's, at random.
        let held: Vec<(usize, (usize, u64))> = states
            .iter()
            .enumerate()
            .filter_map(|(permit, file)| Some((permit, holder(file)?)))
            .collect();
        let aimed_at = (!held.is_empty()).then(|| held[rng.random_range(0..held.len())]);
        let (permit, (index, aimed)) = match aimed_at {
            Some((permit, (index, token))) => (permit, (index, Some(token))),
            // Readers leave no trace to aim at (only writers write STATE): a contender's,
            // while readers run.
            None if route == Route::ViaReadWrite && any_runs() => {
                (0, (rng.random_range(0..CONTENDERS), None))
            }
            None if replaces => continue,
            None => (0, (rng.random_range(0..CONTENDERS), None)),
        };
        let ran_before = runs(&state).len();
        let contender = &mut contenders[index];
        match (fault, &mut contender.sidecar) {
            // Through a sidecar, its sidecar or the exec, in turn.
            (Fault::KillHolder, Some(sidecar)) if rng.random_bool(0.5) => {
                // Started again on its port, as a restarted container's sidecar is: the execs
                // waiting on it find it there.
                sidecar.kill9();
                let url = sidecar_url(&backend, index, &contender.proxies);
                *sidecar =
                    start_sidecar_at(route, sidecar.addr.port(), &sidecar.identity, &url, &lock);
            }
            (Fault::KillHolder, _) => {
                if !contender.kill() {
                    continue;
                }
            }
            (Fault::PauseHolder, Some(sidecar)) => {
                sidecar.signal(Signal::SIGSTOP);
                std::thread::sleep(FAULT_LENGTH);
                sidecar.signal(Signal::SIGCONT);
            }
            (Fault::PauseHolder, None) => {
                if !contender.pause(FAULT_LENGTH) {
                    continue;
                }
            }
            (other, _) => backend.inject(other, index, &contender.proxies),
        }
        *report.faults.entry(fault.name()).or_default() += 1;
        let healed = Instant::now();
        let recovered = wait_for(bound, || match aimed.filter(|_| replaces) {
            // A reader's token may be below the writer's it follows: any command after it.
            Some(_) if route == Route::ViaReadWrite => runs(&state).len() > ran_before,
            Some(token) => runs(&states[permit])
                .last()
                .is_some_and(|&last| last > token),
            None => any_runs(),
        });
        report.slowest_recovery = report.slowest_recovery.max(healed.elapsed());
        if !recovered {
            report.violations.push(format!(
                "no command ran within {bound:?} after {} ended (at {:.1?})",
                fault.name(),
                healed - began
            ));
        }
    }
    report.duration = began.elapsed();
    drop(contenders);
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    report.lost = outcomes.lost;
    report.unopened = outcomes.unopened;
    report.violations.extend(outcomes.violations);
    report.violations.extend(
        std::fs::read_to_string(state.with_extension("violations"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned),
    );
    // LEASEHOLD_TEST_LOGS=DIR keeps each contender's exec log there, as the sidecars' are kept.
    if let Some(kept) = std::env::var_os("LEASEHOLD_TEST_LOGS") {
        let _ = std::fs::create_dir_all(&kept);
        for index in 0..CONTENDERS {
            let name = format!("contender-{index}.log");
            let _ = std::fs::copy(
                dir.path().join(&name),
                Path::new(&kept).join(format!("{}-{name}", report.target)),
            );
        }
    }
    for (permit, file) in states.iter().enumerate() {
        let tokens = runs(file);
        report.runs += tokens.len();
        // Readers' tokens rise with their permits only: each writer's the witness checked.
        let checked = match route {
            Route::ViaReadWrite => &[][..],
            _ => &tokens[..],
        };
        if let Some(pair) = checked.windows(2).find(|pair| pair[1] <= pair[0]) {
            let whose = match route {
                Route::OwnPermits => format!(" of permit {permit}"),
                _ => String::new(),
            };
            report.violations.push(format!(
                "the commands' tokens{whose} did not rise: {} then {}",
                pair[0], pair[1]
            ));
        }
    }
    report
}

/// Where an `exec` holds the lock.
enum Holds {
    /// `--backend URL`, with the check's lease, and the lock's permits when it has several.
    Backend(String, Option<u32>),
    /// `--via` the lock API at this URL.
    Via(String),
    /// `--via` the lock API at this URL, for the family's key; on a read-write family, in a
    /// mode drawn from these at each exec.
    ViaKeyed(String, Option<[&'static str; 2]>),
}

/// The modes an exec of [`Route::ViaReadWrite`] draws from.
const READ_WRITE_MODES: [&str; 2] = ["read", "write"];

/// How one contender runs `exec`.
struct Exec {
    identity: String,
    lock: String,
    backend: Holds,
    state: PathBuf,
    log: PathBuf,
}

/// The arguments of each contender's sidecar: the lock on demand, and the family of
/// [`Route::ViaKeyed`] (read-write, of two permits, for [`Route::ViaReadWrite`]), for the
/// holds `exec --via` asks of it.
fn sidecar_args(route: Route) -> Vec<&'static str> {
    let family: &[&str] = match route {
        Route::ViaReadWrite => &["--permits", "2", "--read-write"],
        _ => &[],
    };
    [TIMING, &["--mode", "on-demand", "--keyed", FAMILY], family].concat()
}

/// Contender `identity`'s sidecar.
fn start_sidecar(route: Route, identity: &str, url: &str, lock: &str) -> Sidecar {
    Sidecar::start(identity, url, lock, &sidecar_args(route))
}

/// [`start_sidecar`] on `port`, where the one it replaces listened.
fn start_sidecar_at(route: Route, port: u16, identity: &str, url: &str, lock: &str) -> Sidecar {
    Sidecar::start_at(port, identity, url, lock, &sidecar_args(route))
}

fn sidecar_url(backend: &Backend, index: usize, proxies: &[FaultProxy]) -> String {
    let ports: Vec<u16> = proxies.iter().map(|p| p.port).collect();
    backend.url_via(index, &ports)
}

impl Exec {
    /// Run `exec` again each time it ends, until `stop`, noting how each ended.
    fn repeat(
        &self,
        running: &Mutex<Option<Pid>>,
        stop: &AtomicBool,
        outcomes: &Mutex<Outcomes>,
        seed: u64,
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut runs = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let hold = match rng.random_ratio(1, 3) {
                true => rng.random_range(LONG_MS),
                false => rng.random_range(SHORT_MS),
            }
            .to_string();
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .expect("exec log");
            let mut command = Command::new(sidecar_binary());
            command.args(["exec", "--kill-grace", KILL_GRACE]);
            let mut mode = None;
            match &self.backend {
                Holds::Backend(url, permits) => {
                    command
                        .args(["--lock", &self.lock])
                        .args(["--backend", url, "--identity", &self.identity])
                        .args(TIMING);
                    if let Some(permits) = permits {
                        command.args(["--permits", &permits.to_string()]);
                    }
                }
                Holds::Via(via) => {
                    command.args(["--lock", &self.lock, "--via", via]);
                }
                Holds::ViaKeyed(via, modes) => {
                    // An owner of its own, as `exec`'s default is: two execs given one owner
                    // are one owner, and the second re-enters the first's holding.
                    runs += 1;
                    let owner = format!("{}-{runs}", self.identity);
                    command
                        .args(["--keyed", &format!("{FAMILY}/{KEY}"), "--via", via])
                        .args(["--identity", &owner]);
                    mode = modes.map(|modes| modes[rng.random_range(0..modes.len())]);
                    if let Some(mode) = mode {
                        command.args(["--mode", mode]);
                    }
                }
            }
            command
                .arg("--")
                .arg(witness_binary())
                .arg(&self.state)
                .arg(&hold)
                .args(mode)
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log);
            let mut child = {
                // Taken before the spawn, so that a kill aimed at this contender waits for the
                // pid rather than missing it.
                let mut running = running.lock().unwrap();
                let child = command.spawn().expect("start leasehold-sidecar exec");
                *running = Some(Pid::from_raw(child.id() as i32));
                child
            };
            let status = child.wait().expect("wait for exec");
            *running.lock().unwrap() = None;
            let mut outcomes = outcomes.lock().unwrap();
            match status.code() {
                // The command ran and ended, or was killed with its exec by the check.
                Some(0) | None => {}
                Some(75) => outcomes.lost += 1,
                Some(1) => outcomes.unopened += 1,
                // The witness wrote why.
                Some(OVERLAP) => {}
                Some(other) => outcomes.violations.push(format!(
                    "{}'s exec exited {other}; its log:\n{}",
                    self.identity,
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                )),
            }
        }
    }
}

/// The tokens of the commands that ran, in the order they ran.
fn runs(state: &Path) -> Vec<u64> {
    std::fs::read_to_string(state.with_extension("runs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split_whitespace().next()?.parse().ok())
        .collect()
}

/// How the kernel's table of locks (`/proc/locks`) names `file`: `MAJOR:MINOR:INODE`, the
/// device's numbers in hex.
fn lock_table_id(file: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(file).expect("stat");
    let device = meta.dev();
    format!(
        "{:02x}:{:02x}:{}",
        nix::sys::stat::major(device),
        nix::sys::stat::minor(device),
        meta.ino()
    )
}

/// Whether a command runs now: a witness holds its flock on the file `file_id` names. Read from
/// the kernel's table of locks, so that looking never takes the flock itself.
fn command_runs(file_id: &str) -> bool {
    let locks = std::fs::read_to_string("/proc/locks").expect("/proc/locks");
    locks.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`; a waiter's line starts `1: ->`.
        fields.get(1) == Some(&"FLOCK") && fields.get(5) == Some(&file_id)
    })
}

/// The contender whose command runs now and its token, as the witness last wrote them.
fn holder(state: &Path) -> Option<(usize, u64)> {
    let current = std::fs::read_to_string(state).ok()?;
    let mut fields = current.split_whitespace();
    let token = fields.next()?.parse().ok()?;
    // A key's holder is `POD/OWNER`: the contender's sidecar, and the contender's owner for
    // this exec (`contender-I-N`).
    let identity = fields.next()?;
    let owner = identity.rsplit('/').next()?;
    let index = owner
        .strip_prefix("contender-")?
        .split('-')
        .next()?
        .parse()
        .ok()?;
    Some((index, token))
}

fn wait_for(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}
