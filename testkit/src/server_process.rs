//! What every test server shares: a throwaway directory, a child process with its log, a
//! readiness check, and crash-style stops and restarts on the same data.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const START_TIMEOUT: Duration = Duration::from_secs(30);

pub struct ServerProcess {
    name: &'static str,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl ServerProcess {
    pub fn new(name: &'static str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("leasehold-{name}-"))
            .tempdir()
            .expect("temp dir");
        Self {
            name,
            dir,
            child: None,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("{}.log", self.name))
    }

    /// Run a set-up command (initdb, install-db) to completion, failing with its output.
    pub fn prepare(&self, mut command: Command) {
        let out = command
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{}: cannot run {command:?}: {e}", self.name));
        assert!(
            out.status.success(),
            "{}: {command:?} failed:\n{}{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Start the server and wait until `ready` says so.
    pub fn spawn(&mut self, command: Command, ready: impl Fn() -> bool) {
        if let Err(why) = self.try_spawn(command, ready) {
            panic!("{why}");
        }
    }

    /// Start the server and wait until `ready` says so; `Err` says why it did not come up (it
    /// exited, or it was not ready in time), with its log.
    pub fn try_spawn(
        &mut self,
        mut command: Command,
        ready: impl Fn() -> bool,
    ) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("server log");
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.name));
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if ready() {
                return Ok(());
            }
            if let Some(status) = self.exited() {
                return Err(format!(
                    "{} exited with {status}; its log:\n{}",
                    self.name,
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Err(format!(
            "{} was not ready within {START_TIMEOUT:?}; its log:\n{}",
            self.name,
            self.log()
        ))
    }

    /// How the server ended, if it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Stop like a crash: `signal` (SIGKILL when `None`), then wait for the exit.
    pub fn stop(&mut self, signal: Option<nix::sys::signal::Signal>) {
        if let Some(mut child) = self.child.take() {
            match signal {
                Some(signal) => {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(child.id() as i32),
                        signal,
                    );
                }
                None => {
                    let _ = child.kill();
                }
            }
            let _ = child.wait();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop(None);
    }
}

/// Servers that refuse to run as root (PostgreSQL) run as this system user when we are root.
pub fn system_user(name: &str) -> Option<(u32, u32)> {
    if nix::unistd::geteuid().is_root() {
        let user = nix::unistd::User::from_name(name).ok().flatten()?;
        Some((user.uid.as_raw(), user.gid.as_raw()))
    } else {
        None
    }
}
