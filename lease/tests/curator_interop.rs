//! Apache Curator's `InterProcessMutex` and the ZooKeeper driver on one lock path exclude each
//! other, both ways, and hand over through the queue: the driver names its nodes as Curator does
//! (`_c_<uuid>-lock-<sequence>`). Curator is Debian's (`libcurator-recipes-java`), run by Java's
//! single-file launcher (`default-jdk-headless`) from `tests/curator/CuratorMutexProbe.java`.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use leasehold_lease::zookeeper::{ZooKeeperConfig, ZooKeeperDriver};
use leasehold_lease::{Acquire, Driver};
use leasehold_testkit::ZooKeeperServer;

/// Debian's jars that Curator's mutex needs.
const JARS: &[&str] = &[
    "curator-recipes",
    "curator-framework",
    "curator-client",
    "zookeeper",
    "zookeeper-jute",
    "guava",
    "slf4j-api",
    "netty-handler",
    "netty-common",
    "netty-transport",
];

struct Curator {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Curator {
    fn start(servers: &str, path: &str) -> Self {
        let mut classpath = Vec::new();
        for jar in JARS {
            let file = format!("/usr/share/java/{jar}.jar");
            assert!(
                Path::new(&file).exists(),
                "{file} is missing: apt-get install libcurator-recipes-java (scripts/install-test-deps does)"
            );
            classpath.push(file);
        }
        let probe = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/curator/CuratorMutexProbe.java"
        );
        let mut child = Command::new("java")
            .arg("-cp")
            .arg(classpath.join(":"))
            .arg(probe)
            .arg(servers)
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run java: {e}; apt-get install default-jdk-headless (scripts/install-test-deps does)")
            });
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut curator = Self {
            child,
            stdin,
            lines,
        };
        assert_eq!(curator.answer(Duration::from_secs(60)), "ready");
        curator
    }

    fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn answer(&mut self, within: Duration) -> String {
        self.lines
            .recv_timeout(within)
            .unwrap_or_else(|_| panic!("Curator gave no answer within {within:?}"))
    }
}

impl Drop for Curator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn answer_async(curator: &mut Curator, within: Duration) -> String {
    tokio::task::block_in_place(|| curator.answer(within))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_leasehold_exclude_each_other_on_one_path() {
    let server = ZooKeeperServer::start();
    let servers = format!("127.0.0.1:{}", server.port());
    let driver = || {
        ZooKeeperDriver::connect(ZooKeeperConfig {
            servers: servers.clone(),
            root: "/leasehold".into(),
            digest: None,
            tick_time: ZooKeeperServer::TICK_TIME,
            tls: None,
        })
        .expect("driver")
    };
    let (a, b) = (driver(), driver());
    let ttl = Duration::from_secs(5);
    let lock = "interop";
    let mut curator = Curator::start(&servers, &format!("/leasehold/{lock}"));

    // Leasehold holds: Curator cannot.
    let Acquire::Acquired(first) = a.try_acquire(lock, "pod-a", ttl).await.unwrap() else {
        panic!("the free lock was not acquired");
    };
    curator.send("acquire 500");
    assert_eq!(
        answer_async(&mut curator, Duration::from_secs(10)).await,
        "busy"
    );

    // Curator queues; Leasehold's release wakes it through its watch.
    curator.send("acquire 20000");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    assert!(a.release(&first).await.unwrap());
    assert_eq!(
        answer_async(&mut curator, Duration::from_secs(20)).await,
        "acquired"
    );
    println!("hand-over Leasehold -> Curator: {:?}", released.elapsed());

    // Curator holds: Leasehold cannot, and waits in the queue behind it.
    match b.try_acquire(lock, "pod-b", ttl).await.unwrap() {
        Acquire::Busy(_) | Acquire::Withheld(_) => {}
        Acquire::Acquired(lease) => panic!("Leasehold acquired under Curator's lock: {lease:?}"),
    }
    curator.send("release");
    assert_eq!(
        answer_async(&mut curator, Duration::from_secs(10)).await,
        "released"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let second = loop {
        if let Acquire::Acquired(lease) = b.try_acquire(lock, "pod-b", ttl).await.unwrap() {
            break lease;
        }
        assert!(
            Instant::now() < deadline,
            "Leasehold never got the lock back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        second.token > first.token,
        "tokens still rise across a Curator holder: {} then {}",
        first.token,
        second.token
    );
    curator.send("acquire 500");
    assert_eq!(
        answer_async(&mut curator, Duration::from_secs(10)).await,
        "busy"
    );
    assert!(b.release(&second).await.unwrap());
    curator.send("acquire 5000");
    assert_eq!(
        answer_async(&mut curator, Duration::from_secs(10)).await,
        "acquired"
    );
    curator.send("quit");
}
