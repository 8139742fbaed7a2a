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
    /// Clients only over TLS, each with a certificate from [`PostgresServer::tls_files`].
    tls: bool,
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
        Self::start_with(false)
    }

    /// Clients only over TLS (`hostssl`, plain text rejected), each asked for a certificate
    /// signed by the server's own test CA.
    pub fn start_tls() -> Self {
        Self::start_with(true)
    }

    /// The CA and the client pair, for a TLS server.
    pub fn tls_files(&self) -> super::TlsFiles {
        super::TlsFiles::in_dir(self.process.dir())
    }

    fn start_with(tls: bool) -> Self {
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
            tls,
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
        if tls {
            let dir = server.process.dir();
            super::write_test_certificates(dir);
            for file in ["ca.crt", "server.crt", "server.key"] {
                let path = dir.join(file);
                if let Some((uid, gid)) = run_as {
                    std::os::unix::fs::chown(&path, Some(uid), Some(gid)).expect("chown");
                }
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                    .expect("chmod");
            }
            std::fs::write(
                server.data().join("pg_hba.conf"),
                "local all all trust\n\
                 hostssl all all 127.0.0.1/32 trust clientcert=verify-ca\n\
                 hostnossl all all 127.0.0.1/32 reject\n",
            )
            .expect("pg_hba.conf");
        }
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
            // Statements counted as the server ran them, for tests that count round trips
            // (`CREATE EXTENSION pg_stat_statements` to read them).
            .args(["-c", "shared_preload_libraries=pg_stat_statements"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.process.dir().display()
            ));
        if self.tls {
            let dir = self.process.dir();
            postgres.args(["-c", "ssl=on"]);
            for (option, file) in [
                ("ssl_cert_file", "server.crt"),
                ("ssl_key_file", "server.key"),
                ("ssl_ca_file", "ca.crt"),
            ] {
                postgres
                    .arg("-c")
                    .arg(format!("{option}={}", dir.join(file).display()));
            }
        }
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

    /// The backend URL; for a TLS server, with `verify-full`, the CA and the client pair.
    pub fn url(&self) -> String {
        let plain = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
        if !self.tls {
            return plain;
        }
        let files = self.tls_files();
        format!(
            "{plain}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
            files.ca.display(),
            files.client_cert.display(),
            files.client_key.display()
        )
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
