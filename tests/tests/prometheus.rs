//! A real Prometheus (Debian's `prometheus`) scrapes a running sidecar through its probe
//! listener, where a cluster's Prometheus reaches it, and a query returns the lock's holder.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use leasehold_e2e::{Sidecar, http, unique_lock};
use leasehold_testkit::{free_port, require_binary};

struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn scraping(target: &str) -> Self {
        let binary = require_binary("prometheus", "prometheus");
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: leasehold-sidecars\n    \
                 static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        Self {
            child,
            port,
            _dir: dir,
        }
    }

    /// An instant query's result vector, or None while Prometheus is not answering yet.
    fn query(&self, promql_urlencoded: &str) -> Option<Vec<serde_json::Value>> {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let reply = http(
            addr,
            "GET",
            &format!("/api/v1/query?query={promql_urlencoded}"),
        )
        .ok()?;
        if reply.status != 200 {
            return None;
        }
        reply.json()["data"]["result"].as_array().cloned()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn prometheus_scrapes_the_holder_through_the_probe_listener() {
    let dir = tempfile::tempdir().unwrap();
    let lock = unique_lock("scraped");
    let probe = free_port();
    let sidecar = Sidecar::start(
        "pod-a",
        &format!("sqlite://{}/locks.db", dir.path().display()),
        &lock,
        &["--probe-listen", &format!("0.0.0.0:{probe}")],
    );
    let prometheus = Prometheus::scraping(&format!("127.0.0.1:{probe}"));
    // leasehold_holder{lock="LOCK"} == 1
    let query = format!("leasehold_holder%7Block%3D%22{lock}%22%7D%3D%3D1");
    let start = std::time::Instant::now();
    let seen = loop {
        let seen = prometheus.query(&query).unwrap_or_default();
        if !seen.is_empty() {
            break seen;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "Prometheus never reported the sidecar as the lock's holder (last answer {seen:?}); sidecar log:\n{}",
            sidecar.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let series = &seen[0]["metric"];
    assert_eq!(series["lock"], lock.as_str());
    assert_eq!(series["job"], "leasehold-sidecars");
    assert_eq!(seen[0]["value"][1], "1");
    // The lock's mode and backend come along for the alerts' joins.
    let info = prometheus
        .query(&format!(
            "leasehold_lock_info%7Block%3D%22{lock}%22%2Cmode%3D%22campaign%22%2Cbackend%3D%22sqlite%22%7D"
        ))
        .unwrap_or_default();
    assert_eq!(info.len(), 1, "{info:?}");
}
