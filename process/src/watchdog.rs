//! A process whose async runtime has stopped running tasks (every worker thread blocked)
//! answers nothing and renews nothing, yet a kill from outside would run its shutdown. The
//! watchdog, on a thread of its own, ends such a process at once instead, releasing nothing:
//! what it held runs out on the backend as after a crash, and the container's restart policy
//! starts it again. The sidecar has it instead of a liveness probe: the kubelet's kill of a
//! container whose probe fails runs its preStop hook while the app may still act on an answer.

use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the runtime is asked to run a task, and for how many on-time steps it may not.
#[derive(Debug, Clone, Copy)]
pub struct Watchdog {
    /// Between two checks, and the wait counted as one missed step.
    pub step: Duration,
    /// Missed steps in a row that count as the runtime stuck.
    pub steps: u32,
}

impl Watchdog {
    /// The sidecar's: a runtime that runs no task for 30 s while its process is scheduled,
    /// as the liveness probe it replaces (three failures 10 s apart).
    pub const SIDECAR: Watchdog = Watchdog {
        step: Duration::from_secs(1),
        steps: 30,
    };

    /// Whether a step whose wait took `waited` counts as missed. A wait the watchdog itself
    /// overslept (the whole process stopped, frozen or throttled) says nothing of the runtime,
    /// whose task may run as soon as the process does.
    fn missed(&self, waited: Duration) -> bool {
        waited < self.step * 2
    }

    /// Watches `runtime` from a thread of its own; `on_stuck` is called once, with how long the
    /// runtime ran nothing, when it missed [`Watchdog::steps`] steps in a row. The thread ends
    /// with the runtime.
    pub fn watch(
        self,
        runtime: tokio::runtime::Handle,
        on_stuck: impl FnOnce(Duration) + Send + 'static,
    ) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name("watchdog".to_owned())
            .spawn(move || {
                loop {
                    std::thread::sleep(self.step);
                    let (answer, answered) = sync_channel(1);
                    runtime.spawn(async move {
                        let _ = answer.send(());
                    });
                    let mut missed = 0;
                    let asked = Instant::now();
                    loop {
                        let waiting = Instant::now();
                        match answered.recv_timeout(self.step) {
                            Ok(()) => break,
                            // The runtime shut down and dropped the task.
                            Err(RecvTimeoutError::Disconnected) => return,
                            Err(RecvTimeoutError::Timeout) => {
                                if self.missed(waiting.elapsed()) {
                                    missed += 1;
                                }
                                if missed >= self.steps {
                                    on_stuck(asked.elapsed());
                                    return;
                                }
                            }
                        }
                    }
                }
            })
    }
}

/// What the sidecar does with a stuck runtime: says so on stderr and exits with status 70,
/// releasing nothing. The message goes from a thread of its own and is given 100 ms: a blocked
/// worker may hold stderr's lock (a log pipe nobody reads), and the exit must not wait for it.
pub fn exit_stuck(stuck_for: Duration) {
    let _ = std::thread::Builder::new().spawn(move || {
        eprintln!(
            "error: the runtime ran no task for {stuck_for:.1?}: exiting without releasing anything (each lease runs out on its backend)"
        );
    });
    std::thread::sleep(Duration::from_millis(100));
    std::process::exit(EXIT_STUCK);
}

/// The exit status of a process the watchdog ended (`EX_SOFTWARE`).
pub const EXIT_STUCK: i32 = 70;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_runtime_whose_workers_are_all_blocked_is_found_stuck() {
        let runtime = runtime();
        let (stuck, found) = channel();
        let dog = Watchdog {
            step: Duration::from_millis(20),
            steps: 5,
        };
        dog.watch(runtime.handle().clone(), move |stuck_for| {
            stuck.send(stuck_for).unwrap();
        })
        .unwrap();
        // The one worker blocks its thread (a synchronous call that never returns in time).
        runtime.spawn(async { std::thread::sleep(Duration::from_secs(30)) });
        let stuck_for = found
            .recv_timeout(Duration::from_secs(20))
            .expect("the watchdog found the blocked runtime");
        assert!(stuck_for >= dog.step * dog.steps, "stuck for {stuck_for:?}");
        runtime.shutdown_background();
    }

    #[test]
    fn a_runtime_that_runs_its_tasks_is_left_alone_and_the_watchdog_ends_with_it() {
        let runtime = runtime();
        let (stuck, found) = channel();
        let watching = Watchdog {
            step: Duration::from_millis(10),
            steps: 100,
        }
        .watch(runtime.handle().clone(), move |stuck_for| {
            stuck.send(stuck_for).unwrap();
        })
        .unwrap();
        // Busy with short tasks for a while: each yields, so the watchdog's task runs.
        runtime.block_on(async {
            for _ in 0..50 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        drop(runtime);
        watching.join().unwrap();
        assert!(
            found.try_recv().is_err(),
            "a running runtime was found stuck"
        );
    }

    #[test]
    fn a_wait_the_watchdog_overslept_is_not_counted() {
        let dog = Watchdog::SIDECAR;
        assert!(dog.missed(Duration::from_millis(1000)));
        assert!(dog.missed(Duration::from_millis(1900)));
        // The process was stopped (SIGSTOP, a frozen cgroup) for a while: not the runtime's fault.
        assert!(!dog.missed(Duration::from_secs(2)));
        assert!(!dog.missed(Duration::from_secs(40)));
    }
}
