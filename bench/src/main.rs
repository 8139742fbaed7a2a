#![forbid(unsafe_code)]
//! The benchmark command (`scripts/bench [SECTION]...`). Every figure is printed beside a
//! baseline measured in the same run on the same machine. One module per section (`http`,
//! `drivers`, `sql`, `queue` for etcd and ZooKeeper, `keyed`, `safety`, `operator`,
//! `redis_family` for the cluster, Sentinel, Tair and TLS), `measure` with what they share, and
//! `record` for `--record`, which writes each section's output into `docs/benchmarks.md`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_lease::sql::{Dialect, SqlDriver, SqlMode};
use leasehold_lease::{Acquire, Answer, Backend, Lock, LockConfig, Mode};
use leasehold_testkit::redis_server::field;
use leasehold_testkit::{
    MariaDbServer, PostgresServer, REDLOCK_MASTERS, RedisServer, SqliteHarness, free_port,
    mariadb_server,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

mod api;
mod drivers;
mod handover;
mod http;
mod keyed;
mod measure;
mod operator;
mod queue;
mod read_write;
mod record;
mod redis_family;
mod safety;
mod semaphore;
mod several;
mod sql;

use api::*;
use drivers::*;
use handover::*;
use http::*;
use keyed::*;
use measure::*;
use operator::*;
use queue::*;
use read_write::*;
use redis_family::*;
use safety::*;
use semaphore::*;
use several::*;
use sql::*;

/// Concurrent keep-alive connections of the HTTP load generator.
const HTTP_CONNECTIONS: usize = 8;
const HTTP_DURATION: Duration = Duration::from_secs(3);
const HTTP_ROUNDS: usize = 3;
const CYCLES: usize = 2000;
const ROUNDS: usize = 3;
const HANDOVERS: usize = 20;
const LEASE: Duration = Duration::from_secs(15);

/// The sidecar's allocator, so that the sidecar's code run here costs what it costs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, mode, port] = args.as_slice()
        && mode == "--bare-axum"
    {
        bare_axum(port.parse().expect("port"));
        return;
    }
    let words: Vec<&str> = args[1..].iter().map(String::as_str).collect();
    if let Some(recording) = record::parse(&words) {
        let outcome = recording.and_then(|recording| {
            check_sections(&recording.sections)?;
            record::record(&recording, SECTIONS)
        });
        if let Err(e) = outcome {
            eprintln!("{e}");
            std::process::exit(2);
        }
        return;
    }
    if let Err(e) = check_sections(&words) {
        eprintln!("{e}");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads())
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(&words));
}

/// An error naming the first section that is not one of [`SECTIONS`], with the usage.
fn check_sections(sections: &[&str]) -> Result<(), String> {
    match sections.iter().find(|s| !SECTIONS.contains(s)) {
        None => Ok(()),
        Some(unknown) => Err(format!(
            "unknown section {unknown:?}; usage: leasehold-bench [--record [--repeat N]] [{}]...",
            SECTIONS.join("|")
        )),
    }
}

/// The load generator's runtime threads: the sidecar's (2) unless [`WORKER_THREADS_VAR`] says
/// otherwise, to see how a figure and its baseline depend on the threads they share.
const WORKER_THREADS: usize = 2;
const WORKER_THREADS_VAR: &str = "LEASEHOLD_BENCH_WORKER_THREADS";

fn worker_threads() -> usize {
    match std::env::var(WORKER_THREADS_VAR) {
        Err(_) => WORKER_THREADS,
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("{WORKER_THREADS_VAR}={v:?}: expected a number of threads, at least 1");
                std::process::exit(2);
            }
        },
    }
}

/// The benchmark's sections, all of them when none is named on the command line.
const SECTIONS: &[&str] = &[
    "http",
    "api",
    "drivers",
    "sql",
    "etcd",
    "zookeeper",
    "handover",
    "keyed",
    "keyed-many",
    "semaphore",
    "read-write",
    "several",
    "safety",
    "operator",
    "tls",
    "tair",
    "sentinel",
    "cluster",
];

async fn run(sections: &[&str]) {
    let wanted = |section: &str| sections.is_empty() || sections.contains(&section);
    println!(
        "leasehold benchmark on {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if wanted("http") {
        http_section().await;
    }
    if wanted("api") {
        api_section().await;
    }
    if wanted("drivers") {
        driver_section().await;
    }
    if wanted("sql") {
        println!(
            "## PostgreSQL 15 and MariaDB 10.11, lease and row-lock modes ({CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds)"
        );
        sql_section().await;
    }
    if wanted("etcd") {
        etcd_section().await;
    }
    if wanted("zookeeper") {
        zookeeper_section().await;
    }
    if wanted("handover") {
        handover_section().await;
    }
    if wanted("keyed") {
        keyed_section().await;
    }
    if wanted("keyed-many") {
        many_keys_section().await;
    }
    if wanted("semaphore") {
        semaphore_section().await;
    }
    if wanted("read-write") {
        read_write_section().await;
    }
    if wanted("several") {
        several_section().await;
    }
    if wanted("safety") {
        safety_section().await;
    }
    if wanted("operator") {
        operator_section().await;
    }
    if wanted("tls") {
        tls_section().await;
    }
    if wanted("tair") {
        tair_section().await;
    }
    if wanted("sentinel") {
        sentinel_section().await;
    }
    if wanted("cluster") {
        cluster_section().await;
    }
}
