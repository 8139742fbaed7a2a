//! `http`: `GET /lock` through the sidecar against a bare axum server answering a constant, and
//! the sidecar's idle memory.

use super::*;

/// The baseline server: axum with the sidecar's runtime shape, answering a constant.
pub(crate) fn bare_axum(port: u16) {
    const BODY: &str = r#"{"lock":"bench","holder":true,"identity":"bench","currentHolder":"bench","fencingToken":1,"validForMs":14000,"backend":"sqlite","mode":"campaign","since":"2026-01-01T00:00:00.000Z"}"#;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let app = axum::Router::new().route(
            "/lock",
            axum::routing::get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    BODY,
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        axum::serve(listener, app).await.expect("serve");
    });
}

pub(crate) async fn http_section() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (sidecar_port, bare_port) = (free_port(), free_port());
    let sidecar = Process(
        Command::new(sibling_binary("leasehold-sidecar"))
            .args(["--lock", "bench", "--identity", "bench"])
            .arg("--backend")
            .arg(format!("sqlite://{}/bench.db", dir.path().display()))
            .args(["--listen", &format!("127.0.0.1:{sidecar_port}")])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sidecar"),
    );
    let _bare = Process(
        Command::new(std::env::current_exe().expect("exe"))
            .args(["--bare-axum", &bare_port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start bare axum"),
    );
    let sidecar_addr = SocketAddr::from(([127, 0, 0, 1], sidecar_port));
    let bare_addr = SocketAddr::from(([127, 0, 0, 1], bare_port));
    wait_until_serving(sidecar_addr, "/lock", 200).await;
    wait_until_serving(bare_addr, "/lock", 200).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = rss_kib(sidecar.0.id());

    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for _ in 0..HTTP_ROUNDS {
        base.push(requests_per_second(bare_addr, "/lock", 200).await);
        ours.push(requests_per_second(sidecar_addr, "/lock", 200).await);
    }
    let loaded_rss = rss_kib(sidecar.0.id());
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let (ours, base) = (best(&ours), best(&base));
    println!(
        "## GET /lock ({HTTP_CONNECTIONS} keep-alive connections, best of {HTTP_ROUNDS} x {HTTP_DURATION:?})"
    );
    println!("  bare axum constant handler : {base:>10.0} req/s");
    println!("  leasehold-sidecar /lock    : {ours:>10.0} req/s");
    println!(
        "  ratio                      : {:>10.1} %",
        100.0 * ours / base
    );
    println!("## sidecar memory");
    println!(
        "  idle RSS                   : {:>10.1} MiB",
        idle_rss as f64 / 1024.0
    );
    println!(
        "  RSS after the load         : {:>10.1} MiB",
        loaded_rss as f64 / 1024.0
    );
}
