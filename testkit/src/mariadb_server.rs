//! A real MariaDB (`mariadb-install-db` + `mariadbd`) on a free loopback port, in a throwaway
//! directory, with a `leasehold` database.
//!
//! [`MariaDbServer::start_tls`] takes TCP clients over TLS only (`require_secure_transport`),
//! with a certificate from a test CA of its own; it checks a client certificate when one is
//! presented.

use std::path::PathBuf;
use std::process::Command;

use super::server_process::ServerProcess;
use super::{free_port, require_binary};

pub const DATABASE: &str = "leasehold";

/// A counter or gauge of the server's `SHOW GLOBAL STATUS` (`Questions`, `Threads_connected`),
/// read on `admin`. The read is a prepared statement itself, so it counts once in
/// `Com_stmt_execute`.
pub async fn status(admin: &mut sqlx::AnyConnection, name: &str) -> u64 {
    use sqlx::Row;
    assert!(
        name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "not a status variable: {name}"
    );
    sqlx::query(&format!("SHOW GLOBAL STATUS LIKE '{name}'"))
        .fetch_one(admin)
        .await
        .expect("SHOW STATUS")
        .try_get::<String, _>("Value")
        .expect("Value")
        .parse()
        .expect("a count")
}

pub struct MariaDbServer {
    process: ServerProcess,
    port: u16,
    server: PathBuf,
    client: PathBuf,
    tls: bool,
}

impl MariaDbServer {
    pub fn start() -> Self {
        Self::start_with(false)
    }

    /// TCP clients over TLS only.
    pub fn start_tls() -> Self {
        Self::start_with(true)
    }

    /// The CA and the client pair, for a TLS server.
    pub fn tls_files(&self) -> super::TlsFiles {
        super::TlsFiles::in_dir(self.process.dir())
    }

    fn start_with(tls: bool) -> Self {
        let server = require_binary("mariadbd", "mariadb-server");
        let install = require_binary("mariadb-install-db", "mariadb-server");
        let client = require_binary("mariadb", "mariadb-client");
        let process = ServerProcess::new("mariadb");
        let mut me = Self {
            process,
            port: free_port(),
            server,
            client,
            tls,
        };
        std::fs::create_dir_all(me.tmp()).expect("tmp dir");
        if tls {
            super::write_test_certificates(me.process.dir());
        }
        let mut init = Command::new(install);
        init.arg("--no-defaults")
            .arg(format!("--datadir={}", me.data().display()))
            // Parallel servers collide on temporary-table names in a shared /tmp.
            .arg(format!("--tmpdir={}", me.tmp().display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ])
            // Many servers at once exhaust the kernel's AIO contexts; tests need none.
            .arg("--innodb-use-native-aio=0");
        me.process.prepare(init);
        me.spawn();
        me
    }

    fn data(&self) -> PathBuf {
        self.process.dir().join("data")
    }

    fn tmp(&self) -> PathBuf {
        self.process.dir().join("tmp")
    }

    fn spawn(&mut self) {
        let dir = self.process.dir().to_owned();
        let mut mariadbd = Command::new(&self.server);
        mariadbd
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data().display()))
            .arg(format!("--tmpdir={}", self.tmp().display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("mysqld.sock").display()))
            .arg(format!("--pid-file={}", dir.join("mysqld.pid").display()))
            .args([
                "--user=root",
                "--skip-log-bin",
                "--innodb-buffer-pool-size=16M",
            ])
            .arg("--innodb-use-native-aio=0");
        if self.tls {
            mariadbd
                .arg(format!("--ssl-ca={}", dir.join("ca.crt").display()))
                .arg(format!("--ssl-cert={}", dir.join("server.crt").display()))
                .arg(format!("--ssl-key={}", dir.join("server.key").display()))
                .arg("--require-secure-transport=ON");
        }
        let (client, port) = (self.client.clone(), self.port);
        let socket = dir.join("mysqld.sock");
        let tls = self.tls;
        // Ready when it answers a query; creating the database is that query. Over the local
        // socket when TCP takes TLS only (the socket counts as secure).
        self.process.spawn(mariadbd, move || {
            let mut check = Command::new(&client);
            check.args(["--no-defaults", "-u", "root"]);
            if tls {
                check.arg(format!("--socket={}", socket.display()));
            } else {
                check.args(["-h", "127.0.0.1", "-P", &port.to_string()]);
            }
            check
                .args(["-e", &format!("CREATE DATABASE IF NOT EXISTS {DATABASE}")])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The backend URL; for a TLS server, with `VERIFY_IDENTITY`, the CA and the client pair.
    pub fn url(&self) -> String {
        let plain = format!("mysql://root@127.0.0.1:{}/{DATABASE}", self.port);
        if !self.tls {
            return plain;
        }
        let files = self.tls_files();
        format!(
            "{plain}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}&ssl-cert={}&ssl-key={}",
            files.ca.display(),
            files.client_cert.display(),
            files.client_key.display()
        )
    }

    /// `kill -9`: InnoDB recovers on the next start.
    pub fn kill(&mut self) {
        self.process.stop(None);
    }

    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}
