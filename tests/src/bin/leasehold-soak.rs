#![forbid(unsafe_code)]
//! The long safety check: `leasehold-soak DURATION [SCENARIO...]` runs the multi-process check
//! of each scenario (by default every driver campaigning, and waiters on etcd, ZooKeeper and
//! Redis) for DURATION each, prints one line of figures per scenario, and exits 1 if any run
//! found a violation. A scenario is a target (`etcd`), or a target and a workload
//! (`etcd+waiters`: on-demand sidecars with blocking waiters, try-locks and clients that hang
//! up; `etcd+keyed`: a keyed family's owners, re-entering and hanging up; `etcd+semaphore`: the
//! same on keys of two permits; `etcd+read-write`: readers and writers on keys of two permits;
//! `etcd+several`: owners taking two or three keys at once;
//! `etcd+exec`: `leasehold-sidecar exec` run over and over, its commands never two at once;
//! `etcd+exec-via`: the same through each contender's sidecar; `etcd+exec-via-keyed`: on a key).
//! `LEASEHOLD_SOAK_SEED` fixes the fault schedule to replay a run.

use leasehold_e2e::safety::{self, Scenario, Target, Workload};
use leasehold_e2e::{exec_safety, keyed_safety};

const CONTENDERS: usize = 3;

/// A run's one-line summary and its violations, whichever check ran.
trait Outcome {
    fn outcome(self) -> (String, Vec<String>);
}

impl Outcome for keyed_safety::Report {
    fn outcome(self) -> (String, Vec<String>) {
        (self.summary(), self.violations)
    }
}

impl Outcome for exec_safety::Report {
    fn outcome(self) -> (String, Vec<String>) {
        (self.summary(), self.violations)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        let names: Vec<String> = Target::ALL
            .into_iter()
            .flat_map(|target| {
                Workload::ALL
                    .into_iter()
                    .map(move |workload| Scenario { target, workload }.name())
            })
            .collect();
        eprintln!("usage: leasehold-soak DURATION [{}]...", names.join("|"));
        std::process::exit(2);
    };
    let Some(duration) = args.first().and_then(|d| humantime::parse_duration(d).ok()) else {
        usage()
    };
    let scenarios: Vec<Scenario> = if args.len() > 1 {
        args[1..]
            .iter()
            .map(|name| Scenario::parse(name).unwrap_or_else(|| usage()))
            .collect()
    } else {
        Scenario::soak_default()
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
    for scenario in scenarios {
        let target = scenario.target;
        let (summary, violations) = match scenario.workload {
            Workload::Keyed => keyed_safety::run(target, duration, seed).outcome(),
            Workload::Semaphore => keyed_safety::run_semaphore(target, duration, seed).outcome(),
            Workload::ReadWrite => keyed_safety::run_read_write(target, duration, seed).outcome(),
            Workload::Several => keyed_safety::run_several(target, duration, seed).outcome(),
            Workload::Exec => exec_safety::run(target, duration, seed).outcome(),
            Workload::ExecPermits => exec_safety::run_permits(target, duration, seed).outcome(),
            Workload::ExecVia => exec_safety::run_via(target, duration, seed).outcome(),
            Workload::ExecViaKeyed => exec_safety::run_via_keyed(target, duration, seed).outcome(),
            Workload::ExecViaReadWrite => {
                exec_safety::run_via_read_write(target, duration, seed).outcome()
            }
            Workload::Campaign | Workload::Waiters | Workload::Resource => {
                let report = safety::run(scenario, duration, CONTENDERS, seed);
                (report.summary(), report.violations)
            }
        };
        println!("{summary}");
        for violation in &violations {
            println!("  VIOLATION {violation}");
        }
        failed |= !violations.is_empty();
    }
    if failed {
        std::process::exit(1);
    }
}
