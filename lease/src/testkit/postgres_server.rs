//! A real PostgreSQL (`initdb` + `postgres`) on a free loopback port, in a throwaway directory.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use super::server_process::{ServerProcess, system_user};
use super::{free_port, require_binary};

pub struct PostgresServer {
    process: ServerProcess,
    port: u16,
    bin: PathBuf,
    run_as: Option<(u32, u32)>,
}

/// Debian keeps the server binaries under /usr/lib/postgresql/VERSION/bin.
fn bin_dir() -> PathBuf {
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("postgres").is_file())
        .max();
    newest.unwrap_or_else(|| {
        require_binary("postgres", "postgresql")
            .parent()
            .expect("bin dir")
            .to_owned()
    })
}

impl PostgresServer {
    pub fn start() -> Self {
        let bin = bin_dir();
        let process = ServerProcess::new("postgres");
        let run_as = system_user("postgres");
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(process.dir(), Some(uid), Some(gid)).expect("chown");
        }
        let mut server = Self {
            process,
            port: free_port(),
            bin,
            run_as,
        };
        let mut initdb = server.command("initdb");
        initdb.arg("-D").arg(server.data()).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        server.process.prepare(initdb);
        server.spawn();
        server
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.run_as {
            command.uid(uid).gid(gid);
        }
        command
    }

    fn data(&self) -> PathBuf {
        self.process.dir().join("data")
    }

    fn spawn(&mut self) {
        let mut postgres = self.command("postgres");
        postgres
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            // Dynamic shared memory in the data directory, not /dev/shm: a server stopped by
            // SIGQUIT or SIGKILL leaves its segments behind, and they go with the throwaway
            // directory only when they live in it.
            .args(["-c", "dynamic_shared_memory_type=mmap"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.process.dir().display()
            ));
        let (isready, port) = (self.bin.join("pg_isready"), self.port);
        self.process.spawn(postgres, move || {
            Command::new(&isready)
                .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// An immediate shutdown (SIGQUIT): no checkpoint, crash recovery on the next start.
    pub fn kill(&mut self) {
        self.process.stop(Some(nix::sys::signal::Signal::SIGQUIT));
    }

    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}
