#![forbid(unsafe_code)]

use std::process::ExitCode;

use leasehold_sidecar::config::{Config, EXIT_BAD_CONFIG, Exit};

/// The sidecar needs little parallelism: two workers keep latency low and memory small.
const WORKER_THREADS: usize = 2;

/// mimalloc: with the C library's allocator, `malloc` and `free` took a sixth of the CPU a keyed
/// lock's acquire and release cost (`scripts/bench keyed`, docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .get(1)
        .is_some_and(|a| a == "exec" || a == "exec-child")
    {
        return leasehold_sidecar::exec::main(args[1..].to_vec());
    }
    let config = match Config::from_env_and_args() {
        Ok(config) => config,
        Err(Exit::Info(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(Exit::BadConfig(line)) => {
            eprintln!("{line}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    leasehold_process::init_logging(config.json_logs);
    leasehold_lease::tls::use_ring_provider();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The injected sidecar has no liveness probe (the kubelet's kill would run the preStop
    // hook, handing locks over while the app runs): a stuck runtime ends the process instead.
    if let Err(e) = leasehold_process::watchdog::Watchdog::SIDECAR.watch(
        runtime.handle().clone(),
        leasehold_process::watchdog::exit_stuck,
    ) {
        eprintln!("error: cannot start the watchdog thread: {e}");
        return ExitCode::FAILURE;
    }
    match runtime.block_on(leasehold_sidecar::run::run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
