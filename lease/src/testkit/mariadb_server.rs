//! A real MariaDB (`mariadb-install-db` + `mariadbd`) on a free loopback port, in a throwaway
//! directory, with a `leasehold` database.

use std::path::PathBuf;
use std::process::Command;

use super::server_process::ServerProcess;
use super::{free_port, require_binary};

pub const DATABASE: &str = "leasehold";

pub struct MariaDbServer {
    process: ServerProcess,
    port: u16,
    server: PathBuf,
    client: PathBuf,
}

impl MariaDbServer {
    pub fn start() -> Self {
        let server = require_binary("mariadbd", "mariadb-server");
        let install = require_binary("mariadb-install-db", "mariadb-server");
        let client = require_binary("mariadb", "mariadb-client");
        let process = ServerProcess::new("mariadb");
        let mut me = Self {
            process,
            port: free_port(),
            server,
            client,
        };
        std::fs::create_dir_all(me.tmp()).expect("tmp dir");
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
        let (client, port) = (self.client.clone(), self.port);
        // Ready when it answers a query; creating the database is that query.
        self.process.spawn(mariadbd, move || {
            Command::new(&client)
                .args(["--no-defaults", "-h", "127.0.0.1", "-u", "root"])
                .args(["-P", &port.to_string()])
                .args(["-e", &format!("CREATE DATABASE IF NOT EXISTS {DATABASE}")])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/{DATABASE}", self.port)
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
