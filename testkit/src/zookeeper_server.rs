//! A real standalone ZooKeeper (Debian's `zookeeper` package, run as a plain Java process with its
//! own `zoo.cfg`) on a free loopback port, with a throwaway data directory, so that it can be
//! killed and restarted with its data.
//!
//! `tickTime=100` lets sessions be as short as 200 ms, below the suite's one-second lease.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::server_process::ServerProcess;
use super::{free_port, require_binary};

pub(super) const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

pub struct ZooKeeperServer {
    process: ServerProcess,
    port: u16,
    /// The TLS port (`secureClientPort`), on a server started with [`ZooKeeperServer::start_tls`].
    tls_port: Option<u16>,
}

/// One ZooKeeper (server or ensemble) per test process at a time: two JVMs starting and warming
/// up at once on two cores answer slower than a one-second session tolerates.
static RUNNING: AtomicBool = AtomicBool::new(false);

/// Wait until no other ZooKeeper of this process runs; pair with [`zookeeper_is_done`].
pub(super) fn one_zookeeper_at_a_time() {
    while RUNNING
        .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(super) fn zookeeper_is_done() {
    RUNNING.store(false, Ordering::SeqCst);
}

impl Drop for ZooKeeperServer {
    fn drop(&mut self) {
        self.process.stop(None);
        zookeeper_is_done();
    }
}

impl ZooKeeperServer {
    /// The servers' `tickTime`, which the driver needs to know (`?tick-time=`).
    pub const TICK_TIME: Duration = Duration::from_millis(100);

    pub fn start() -> Self {
        Self::start_with_min_session(None)
    }

    /// A server that grants no session shorter than `min` (`minSessionTimeout`; production
    /// ensembles have 2 x tickTime, 4 s by default).
    pub fn start_with_min_session(min: Option<Duration>) -> Self {
        Self::start_configured(min, false)
    }

    /// A server that also serves TLS on [`ZooKeeperServer::tls_port`], with a certificate for
    /// 127.0.0.1 signed by a CA of the test's own, and that asks every TLS client for a
    /// certificate signed by it ([`ZooKeeperServer::tls_files`]). The plain port stays open for
    /// the test's own checks.
    pub fn start_tls() -> Self {
        Self::start_configured(None, true)
    }

    fn start_configured(min: Option<Duration>, tls: bool) -> Self {
        one_zookeeper_at_a_time();
        let mut server = Self {
            process: ServerProcess::new("zookeeper"),
            port: free_port(),
            tls_port: tls.then(free_port),
        };
        let data = server.process.dir().join("data");
        std::fs::create_dir_all(&data).expect("zookeeper data dir");
        let config = format!(
            "tickTime={}\n\
             dataDir={}\n\
             clientPort={}\n\
             clientPortAddress=127.0.0.1\n\
             maxSessionTimeout=60000\n\
             maxClientCnxns=0\n\
             admin.enableServer=false\n\
             4lw.commands.whitelist=ruok,mntr\n{}",
            Self::TICK_TIME.as_millis(),
            data.display(),
            server.port,
            min.map(|m| format!("minSessionTimeout={}\n", m.as_millis()))
                .unwrap_or_default()
        ) + &server.tls_config();
        std::fs::write(server.process.dir().join("zoo.cfg"), config).expect("zoo.cfg");
        server.spawn();
        warm_up(server.port, None);
        if let Some(tls_port) = server.tls_port {
            // The TLS path (Netty's handshakes and codecs) has its own cold start.
            warm_up(tls_port, Some(server.tls_files()));
        }
        server
    }

    /// ZooKeeper's TLS settings, after writing the certificates they name: Netty serves the
    /// secure port, with PEM key and trust stores (the key store holds the key and the
    /// certificate in one file).
    fn tls_config(&self) -> String {
        let Some(tls_port) = self.tls_port else {
            return String::new();
        };
        let dir = self.process.dir();
        super::write_test_certificates(dir);
        let key = std::fs::read_to_string(dir.join("server.key")).expect("server.key");
        let cert = std::fs::read_to_string(dir.join("server.crt")).expect("server.crt");
        let store = dir.join("server.pem");
        std::fs::write(&store, key + &cert).expect("server.pem");
        format!(
            "secureClientPort={tls_port}\n\
             secureClientPortAddress=127.0.0.1\n\
             serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n\
             ssl.keyStore.location={}\n\
             ssl.keyStore.type=PEM\n\
             ssl.trustStore.location={}\n\
             ssl.trustStore.type=PEM\n\
             ssl.clientAuth=need\n",
            store.display(),
            dir.join("ca.crt").display(),
        )
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// The CA and the client pair of a server started with [`ZooKeeperServer::start_tls`].
    pub fn tls_files(&self) -> super::TlsFiles {
        super::TlsFiles::in_dir(self.process.dir())
    }

    /// `zks://` to the TLS port, with the CA and the client pair.
    fn tls_url(&self) -> String {
        let port = self.tls_port.expect("a server started with start_tls");
        let files = self.tls_files();
        format!(
            "zks://127.0.0.1:{port}/leasehold?tick-time={}ms&ca={}&cert={}&key={}",
            Self::TICK_TIME.as_millis(),
            files.ca.display(),
            files.client_cert.display(),
            files.client_key.display()
        )
    }

    /// The driver's URL: `zks://` to the TLS port on a server started with
    /// [`ZooKeeperServer::start_tls`], else `zk://`.
    pub fn url(&self) -> String {
        if self.tls_port.is_some() {
            return self.tls_url();
        }
        format!(
            "zk://127.0.0.1:{}/leasehold?tick-time={}ms",
            self.port,
            Self::TICK_TIME.as_millis()
        )
    }

    fn spawn(&mut self) {
        let java = require_binary("java", "zookeeper");
        assert!(
            std::path::Path::new(ZOOKEEPER_JAR).is_file(),
            "{ZOOKEEPER_JAR} was not found. Install it with `apt-get install -y zookeeper` \
             (scripts/test does this), then run the tests again."
        );
        let command = server_command(&java, "256m", &self.process.dir().join("zoo.cfg"));
        let port = self.port;
        self.process.spawn(command, move || serving(port));
    }

    /// `kill -9`: the transaction log and snapshots survive.
    pub fn kill(&mut self) {
        self.process.stop(None);
    }

    /// Start again on the same port with the same data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Requests the server has received so far (`mntr`'s `zk_packets_received`).
    pub fn packets_received(&self) -> u64 {
        four_letter(self.port, "mntr")
            .lines()
            .find_map(|l| l.strip_prefix("zk_packets_received"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Whether the server serves requests: `ruok` answers `imok` as soon as the port is open, while
/// the server still loads its database and turns every session away (a restart "ended" by it
/// left the sidecars 2 s more without a server, and the safety soak counted that against them).
/// `mntr` reports the server's state only once it serves.
fn serving(port: u16) -> bool {
    four_letter(port, "mntr").contains("zk_server_state")
}

/// Take a fresh server's JVM through what a lock does (sessions, creates, listings, deletes)
/// until it answers at its usual speed: its very first requests take half a second while the
/// JIT warms up, past the budget of a try-lock's one attempt (`wait=0` answered "cannot tell"),
/// and a test meant to measure the driver would measure the JVM. A server in production has
/// long been warm; a restart in a test keeps its JVM cold on purpose (the outage scenarios).
fn warm_up(port: u16, tls: Option<super::TlsFiles>) {
    use zookeeper_client as zk;
    const USUAL: Duration = Duration::from_millis(50);
    const ROUNDS: usize = 30;
    let warmed = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
            let parent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
            for _ in 0..ROUNDS {
                let began = std::time::Instant::now();
                let connector =
                    zk::Client::connector().with_session_timeout(Duration::from_secs(2));
                let server = format!("127.0.0.1:{port}");
                let client = match &tls {
                    None => connector.connect(&server).await.ok()?,
                    Some(files) => {
                        let read = |path: &std::path::Path| std::fs::read_to_string(path).ok();
                        let options = zk::TlsOptions::new()
                            .with_pem_ca(&read(&files.ca)?)
                            .ok()?
                            .with_pem_identity(
                                &read(&files.client_cert)?,
                                &read(&files.client_key)?,
                            )
                            .ok()?;
                        leasehold_lease::tls::use_ring_provider();
                        connector
                            .with_tls(options)
                            .secure_connect(&server)
                            .await
                            .ok()?
                    }
                };
                let _ = client.mkdir("/warm-up", &parent).await;
                let (_, sequence) = client.create("/warm-up/n-", b"", &options).await.ok()?;
                client.list_children("/warm-up").await.ok()?;
                client.sync("/warm-up").await.ok()?;
                client
                    .delete(&format!("/warm-up/n-{sequence}"), None)
                    .await
                    .ok()?;
                drop(client);
                if began.elapsed() < USUAL {
                    return Some(());
                }
            }
            Some(())
        })
    })
    .join();
    assert!(
        matches!(warmed, Ok(Some(()))),
        "the ZooKeeper on port {port} did not answer its warm-up requests"
    );
}

/// A ZooKeeper server on `config`. Debian's `zookeeper.jar` finds no SLF4J binding and logs
/// nothing, so a server that exits at start-up would leave no reason; `slf4j-simple` (from
/// `libslf4j-java`, which the package pulls in) writes its warnings and errors to the log.
pub(super) fn server_command(java: &Path, heap: &str, config: &Path) -> Command {
    let mut command = Command::new(java);
    command
        .arg(format!("-Xmx{heap}"))
        .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
        // Empty container nodes are deleted within half a second rather than a minute, so a
        // test sees an idle lock's parent go.
        .arg("-Dznode.container.checkIntervalMs=500")
        .args([
            "-cp",
            &format!("{ZOOKEEPER_JAR}:{SLF4J_SIMPLE_JAR}:{NETTY_CODEC_JAR}:/etc/zookeeper/conf"),
        ])
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(config);
    command
}

const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";
/// Netty's codecs, which ZooKeeper's Netty connection factory (the one that serves TLS) needs and
/// Debian's `zookeeper.jar` leaves off its class path (`libnetty-java`, a dependency of the
/// package, has it).
const NETTY_CODEC_JAR: &str = "/usr/share/java/netty-codec.jar";

/// One of ZooKeeper's four-letter commands, answered in plain text.
pub(super) fn four_letter(port: u16, command: &str) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = Vec::new();
    if s.write_all(command.as_bytes()).is_ok() {
        let _ = s.read_to_end(&mut reply);
    }
    // `mntr` is not all UTF-8.
    String::from_utf8_lossy(&reply).into_owned()
}
