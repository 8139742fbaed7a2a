#![forbid(unsafe_code)]
//! The long safety check: `leasehold-soak DURATION [TARGET...]` runs the multi-process check
//! against each target (all of them by default) for DURATION each, prints one line of figures per
//! target, and exits 1 if any run found a violation. `LEASEHOLD_SOAK_SEED` fixes the fault
//! schedule to replay a run.

use leasehold_e2e::safety::{self, Target};

const CONTENDERS: usize = 3;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
        eprintln!("usage: leasehold-soak DURATION [{}]...", names.join("|"));
        std::process::exit(2);
    };
    let Some(duration) = args.first().and_then(|d| humantime::parse_duration(d).ok()) else {
        usage()
    };
    let targets: Vec<Target> = if args.len() > 1 {
        args[1..]
            .iter()
            .map(|name| Target::parse(name).unwrap_or_else(|| usage()))
            .collect()
    } else {
        Target::ALL.to_vec()
    };
    let seed = std::env::var("LEASEHOLD_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!(
        "safety soak: {CONTENDERS} sidecars per target, lease {:?}, renew {:?}, {} each",
        safety::LEASE,
        safety::RENEW,
        humantime::format_duration(duration)
    );
    let mut failed = false;
    for target in targets {
        let report = safety::run(target, duration, CONTENDERS, seed);
        println!("{}", report.summary());
        for violation in &report.violations {
            println!("  VIOLATION {violation}");
        }
        failed |= !report.violations.is_empty();
    }
    if failed {
        std::process::exit(1);
    }
}
