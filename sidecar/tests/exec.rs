//! `leasehold-sidecar exec`: the command runs only while the lock is held; its processes (its
//! group and what left it) are gone before the claim ends when the lock is lost, and when
//! `exec` is killed outright; with the signals it is sent and the status it exits with.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::{FaultProxy, RedisServer};

fn exec(lock: &str, backend: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar"));
    command
        .args(["exec", "--lock", lock, "--backend", backend])
        .stdin(Stdio::null());
    command
}

fn sqlite(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("locks.db").display())
}

/// `sh -c SCRIPT` after the exec flags.
fn shell<'a>(command: &'a mut Command, script: &str) -> &'a mut Command {
    command.args(["--", "sh", "-c", script])
}

fn wait_for(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < deadline, "{what} within {deadline:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_exit(child: &mut Child, deadline: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!("exec did not exit within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `DEL key` on the Redis server at `port`, spoken in RESP; the reply's first line.
fn redis_del(port: u16, key: &str) -> String {
    use std::io::{BufRead, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("redis");
    write!(conn, "*2\r\n$3\r\nDEL\r\n${}\r\n{key}\r\n", key.len()).unwrap();
    let mut reply = String::new();
    std::io::BufReader::new(conn).read_line(&mut reply).unwrap();
    reply.trim_end().to_owned()
}

/// Dead: gone, or a zombie waiting for whoever inherited it to reap it.
fn dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

#[test]
fn the_command_gets_the_token_and_its_status_is_returned() {
    let dir = tempfile::tempdir().unwrap();
    let out: PathBuf = dir.path().join("seen");
    let script = format!(
        "echo $LEASEHOLD_EXEC_LOCK $LEASEHOLD_FENCING_TOKEN >> {}; exit 7",
        out.display()
    );
    for _ in 0..2 {
        let status = shell(&mut exec("jobs", &sqlite(dir.path())), &script)
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(7));
    }
    let seen = read(&out);
    let tokens: Vec<u64> = seen
        .lines()
        .map(|line| {
            let (lock, token) = line.split_once(' ').expect("lock and token");
            assert_eq!(lock, "jobs");
            token.parse().expect("a token")
        })
        .collect();
    assert_eq!(tokens.len(), 2, "{seen}");
    assert!(tokens[0] >= 1 && tokens[1] > tokens[0], "{tokens:?}");
}

#[test]
fn two_execs_of_one_lock_take_turns() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = format!(
        "echo start >> {0}; sleep 0.5; echo end >> {0}",
        log.display()
    );
    let backend = sqlite(dir.path());
    let mut children: Vec<Child> = (0..3)
        .map(|_| shell(&mut exec("jobs", &backend), &script).spawn().unwrap())
        .collect();
    took_turns(&mut children, &log);
}

#[test]
fn execs_of_a_lock_of_two_permits_run_two_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = format!(
        "echo start $LEASEHOLD_PERMIT $LEASEHOLD_FENCING_TOKEN >> {0}; sleep 2; echo end $LEASEHOLD_PERMIT >> {0}",
        log.display()
    );
    let backend = sqlite(dir.path());
    let mut children: Vec<Child> = (0..4)
        .map(|_| {
            let mut command = exec("workers", &backend);
            command.args(["--permits", "2"]);
            shell(&mut command, &script).spawn().unwrap()
        })
        .collect();
    for child in &mut children {
        assert!(wait_exit(child, Duration::from_secs(60)).success());
    }
    let lines: Vec<String> = read(&log).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 8, "{lines:?}");
    // Replayed in order: never more than two running, each on a permit nobody else runs on.
    let mut running: Vec<String> = Vec::new();
    let mut most = 0;
    for line in &lines {
        let words: Vec<&str> = line.split(' ').collect();
        match words[..] {
            ["start", permit, _token] => {
                assert!(["0", "1"].contains(&permit), "{lines:?}");
                assert!(
                    !running.iter().any(|p| p == permit),
                    "permit {permit} twice: {lines:?}"
                );
                running.push(permit.to_owned());
            }
            ["end", permit] => running.retain(|p| p != permit),
            _ => panic!("{line:?} in {lines:?}"),
        }
        most = most.max(running.len());
    }
    assert_eq!(most, 2, "two commands ran at once, no more: {lines:?}");
}

/// `exec` on `backend` with a 3 s lease and a 300 ms grace, running a stubborn group
/// ([`stubborn_group_of`]).
fn stubborn_group(backend: &str) -> (Child, StubbornPids, tempfile::TempDir) {
    let mut command = exec("jobs", backend);
    command.args(["--lease-duration", "3s", "--kill-grace", "300ms"]);
    stubborn_group_of(command)
}

/// `command` (an `exec` without its command yet) running a command with a background
/// grandchild in its group, which a signal to the command alone would leave running, and one
/// that left the group (`setsid`), which a signal to the group would leave running; all ignore
/// SIGTERM, so only a SIGKILL stops them. The exec (its stderr piped), the two background
/// processes' pids, and the directory they were written in.
fn stubborn_group_of(mut command: Command) -> (Child, StubbornPids, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let script = format!(
        "trap '' TERM; sleep 300 & echo $! >> {0}; setsid sh -c 'echo $$ >> {0}; exec sleep 300' & wait",
        pids.display()
    );
    let child = shell(&mut command, &script)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the command to start", Duration::from_secs(10), || {
        read(&pids).lines().count() == 2
    });
    let pids = StubbornPids(
        read(&pids)
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect(),
    );
    assert!(!pids.dead());
    assert_ne!(
        group_of(pids.0[0]),
        group_of(pids.0[1]),
        "one left the group"
    );
    (child, pids, dir)
}

/// How long before the claim's end exec says the command's processes were gone, on its own
/// clock (0 when they were not).
fn spare_ms(stderr: &str) -> u64 {
    stderr
        .split_once("were stopped ")
        .and_then(|(_, rest)| rest.split_once(" ms before the claim ends"))
        .and_then(|(ms, _)| ms.parse().ok())
        .unwrap_or_else(|| panic!("no spare time reported: {stderr}"))
}

/// A stubborn group's background processes: one in its group, one out of it.
struct StubbornPids(Vec<i32>);

impl StubbornPids {
    fn dead(&self) -> bool {
        self.0.iter().all(|&pid| dead(pid))
    }
}

#[test]
fn a_lost_lock_stops_the_whole_group_before_the_claim_ends() {
    let redis = RedisServer::start_with(true);
    let proxy = FaultProxy::start(redis.port());
    let lease = Duration::from_secs(3);
    let (child, pids, _dir) = stubborn_group(&format!("redis://127.0.0.1:{}", proxy.port));

    // The last renewal was sent before the cut, so the claim ends within a lease of it. This
    // test's own clock only catches a hang: when the group died against the claim's end is
    // exec's to say (below), as this thread may see it late on a loaded machine.
    let cut = Instant::now();
    proxy.cut();
    wait_for("the background processes to be stopped", 3 * lease, || {
        pids.dead()
    });
    let stopped_after = cut.elapsed();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(75),
        "the lock-lost status: {stderr}"
    );
    // What exec says it had to spare, on its own clock: the SIGKILL goes out the kill margin
    // before the claim ends, and the group is gone before it ends (0 when it was not).
    let spare_ms = spare_ms(&stderr);
    eprintln!(
        "the group was stopped {spare_ms} ms before the claim ends, {stopped_after:?} after the cut"
    );
    assert!(
        spare_ms > 0,
        "the group was not gone before the claim ended: {stderr}"
    );
}

#[test]
fn a_lease_the_backend_no_longer_has_stops_the_group_at_once() {
    let redis = RedisServer::start_with(true);
    let (child, pids, _dir) = stubborn_group(&redis.url());
    // The lease deleted behind the holder's back: its next renewal (within a renew interval,
    // 1 s) finds it gone, and the group, which ignores SIGTERM, is killed without its grace.
    assert_eq!(redis_del(redis.port(), "leasehold:{jobs}:lease"), ":1");
    wait_for(
        "the background processes to be killed",
        Duration::from_secs(3),
        || pids.dead(),
    );
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains("was lost; the command's processes were stopped"),
        "{stderr}"
    );
}

/// The grace after SIGTERM is the claim's to give: a lease the backend turns out no longer to
/// have, learned while the group is being stopped (the backend reached again), ends the grace
/// at once, since another may hold the lock already.
#[test]
fn a_lease_found_gone_during_the_grace_ends_the_grace() {
    let redis = RedisServer::start_with(true);
    let proxy = FaultProxy::start(redis.port());
    let mut command = exec("jobs", &format!("redis://127.0.0.1:{}", proxy.port));
    // A renewal a second: the claim ends 18.6 to 19.6 s after the cut, and the grace of 17 s
    // begins 1.35 to 2.35 s after it, to end long after the backend answers again (at 4 s).
    command.args([
        "--lease-duration",
        "20s",
        "--renew-interval",
        "1s",
        "--kill-grace",
        "17s",
    ]);
    let (child, pids, _dir) = stubborn_group_of(command);
    let cut = Instant::now();
    proxy.cut();
    // Gone from the backend (as after a force-release, or a server that lost its data), so
    // another may take the lock at once.
    assert_eq!(redis_del(redis.port(), "leasehold:{jobs}:lease"), ":1");
    std::thread::sleep(Duration::from_secs(4).saturating_sub(cut.elapsed()));
    assert!(!pids.dead(), "the group ignores SIGTERM");
    proxy.restore();
    let restored = Instant::now();
    // The next renewal finds the lease gone; waiting out the grace would take 14.35 s more.
    wait_for(
        "the background processes to be killed once the lease is found gone",
        Duration::from_secs(15),
        || pids.dead(),
    );
    let killed_after = restored.elapsed();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(75), "{stderr}");
    assert!(
        killed_after < Duration::from_secs(7),
        "the group was killed {killed_after:?} after the backend answered again, at the end of its grace: {stderr}"
    );
}

#[test]
fn what_the_command_leaves_running_is_stopped_before_the_lock_is_released() {
    let dir = tempfile::tempdir().unwrap();
    let background = dir.path().join("background");
    // One in the command's group, and one that left it (`setsid`).
    let script = format!(
        "sleep 300 & echo $! >> {0}; setsid sh -c 'echo $$ >> {0}; exec sleep 300' & \
         for i in $(seq 500); do [ $(wc -l < {0}) -ge 2 ] && break; sleep 0.02; done; exit 0",
        background.display()
    );
    let status = shell(&mut exec("jobs", &sqlite(dir.path())), &script)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let pids: Vec<i32> = read(&background)
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "both started");
    for pid in pids {
        assert!(dead(pid), "a background process outlived its lock");
    }
}

/// The children of `pid`, from `/proc`.
fn children_of(pid: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let child: i32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = read(&entry.path().join("stat"));
            let (_, fields) = stat.rsplit_once(") ")?;
            let parent: u32 = fields.split(' ').nth(1)?.parse().ok()?;
            (parent == pid).then_some(child)
        })
        .collect()
}

/// A command that is not a shell (a shell clears the signal mask it starts with) starts with no
/// signal blocked, and the signals `exec` passes on stop it.
#[test]
fn a_command_starts_with_no_signal_blocked_and_is_stopped_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = exec("jobs", &sqlite(dir.path()))
        .args(["--", "sleep", "100"])
        .spawn()
        .unwrap();
    // exec, its keeper, the command, once it runs `sleep` (while it is being started, every
    // signal is blocked).
    let mut command = None;
    wait_for("the command to start", Duration::from_secs(10), || {
        command = children_of(child.id())
            .into_iter()
            .flat_map(|keeper| children_of(keeper as u32))
            .find(|&pid| read(Path::new(&format!("/proc/{pid}/comm"))).trim() == "sleep");
        command.is_some()
    });
    let status = read(Path::new(&format!("/proc/{}/status", command.unwrap())));
    let blocked = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .expect("SigBlk")
        .trim();
    assert!(
        blocked.chars().all(|c| c == '0'),
        "the command starts with signals blocked: SigBlk {blocked}"
    );
    let exec = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(exec, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(5));
    assert_eq!(status.code(), Some(143), "killed by SIGTERM: 128 + 15");
}

/// A process `exec` had as a child before it became `exec` (started by the shell that ran it)
/// is not the command's: it is not stopped when the command ends.
#[test]
fn what_exec_had_before_the_command_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let before = dir.path().join("before");
    let exec = env!("CARGO_BIN_EXE_leasehold-sidecar");
    let script = format!(
        "sleep 300 & echo $! > {0}; exec {exec} exec --lock jobs --backend {1} -- sh -c 'sleep 0.2'",
        before.display(),
        sqlite(dir.path())
    );
    let status = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let pid: i32 = read(&before).trim().parse().unwrap();
    let alive = !dead(pid);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    assert!(
        alive,
        "a process exec had before the command was stopped with it"
    );
}

#[test]
fn signals_reach_the_command_and_its_group() {
    let dir = tempfile::tempdir().unwrap();
    let got = dir.path().join("got");
    let ready = dir.path().join("ready");
    // A background subshell of the group says when it gets SIGHUP too.
    let script = format!(
        "(trap 'echo GROUP-HUP >> {0}' HUP; while true; do sleep 0.05; done) & \
         trap 'echo HUP >> {0}' HUP; trap 'echo INT >> {0}' INT; trap 'echo TERM >> {0}; exit 3' TERM; \
         touch {1}; while true; do sleep 0.05; done",
        got.display(),
        ready.display()
    );
    let mut child = shell(&mut exec("jobs", &sqlite(dir.path())), &script)
        .spawn()
        .unwrap();
    wait_for("the command to start", Duration::from_secs(10), || {
        ready.exists()
    });
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let lines = || read(&got).lines().map(str::to_owned).collect::<Vec<_>>();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    wait_for(
        "HUP at the command and its group",
        Duration::from_secs(5),
        || {
            let lines = lines();
            lines.iter().any(|l| l == "HUP") && lines.iter().any(|l| l == "GROUP-HUP")
        },
    );
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    wait_for("INT", Duration::from_secs(5), || {
        lines().iter().any(|l| l == "INT")
    });
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(3), "the command's own status");
    let own: Vec<String> = lines().into_iter().filter(|l| l != "GROUP-HUP").collect();
    assert_eq!(own, ["HUP", "INT", "TERM"]);
}

#[test]
fn a_lock_not_taken_within_the_wait_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let backend = sqlite(dir.path());
    let (ready, done) = (dir.path().join("ready"), dir.path().join("done"));
    // The holder runs until told (or 30 s): however slowly the second exec starts, the lock
    // stays taken.
    let mut holder = shell(
        &mut exec("jobs", &backend),
        &format!(
            "touch {}; for _ in $(seq 600); do [ -e {} ] && break; sleep 0.05; done",
            ready.display(),
            done.display()
        ),
    )
    .spawn()
    .unwrap();
    wait_for(
        "the first command to start",
        Duration::from_secs(10),
        || ready.exists(),
    );
    let ran = dir.path().join("ran");
    // An exec that ignored --wait would wait on until the holder ends, which it does not.
    let started = Instant::now();
    let mut waiting = shell(
        exec("jobs", &backend).args(["--wait", "300ms"]),
        &format!("touch {}", ran.display()),
    )
    .spawn()
    .unwrap();
    let status = wait_exit(&mut waiting, Duration::from_secs(20));
    assert_eq!(status.code(), Some(69));
    // Far above 300 ms and a process's start on a loaded machine, far below a wait misread.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "gave up after {:?}",
        started.elapsed()
    );
    assert!(!ran.exists(), "the command ran without the lock");
    std::fs::write(&done, "").unwrap();
    assert!(wait_exit(&mut holder, Duration::from_secs(10)).success());
}

#[test]
fn bad_input_is_refused_and_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let backend = sqlite(dir.path());
    let ran = dir.path().join("ran");
    let touch = format!("touch {}", ran.display());
    let refused = |command: &mut Command, says: &str| {
        let output = command.stderr(Stdio::piped()).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(says), "{says:?} not in {stderr}");
    };
    refused(&mut exec("jobs", &backend), "COMMAND");
    refused(
        shell(
            exec("jobs", &backend).args(["--lease-duration", "3s", "--kill-grace", "2s"]),
            &touch,
        ),
        "kill-grace",
    );
    refused(shell(&mut exec("bad name!", &backend), &touch), "--lock");
    refused(shell(&mut exec("jobs", "nosuch://x"), &touch), "--backend");
    assert!(!ran.exists());
}

/// Each of `children` exits 0, and the `start ...`/`end` lines their commands wrote to `log`
/// show them one at a time; the lines.
fn took_turns(children: &mut [Child], log: &Path) -> Vec<String> {
    for child in children.iter_mut() {
        assert!(wait_exit(child, Duration::from_secs(30)).success());
    }
    let lines: Vec<String> = read(log).lines().map(str::to_owned).collect();
    let shape: Vec<&str> = lines.iter().map(|l| l.split(' ').next().unwrap()).collect();
    let expected: Vec<&str> = children.iter().flat_map(|_| ["start", "end"]).collect();
    assert_eq!(shape, expected, "the commands overlapped: {lines:?}");
    lines
}

/// A sidecar serving the lock API on a free loopback port (on-demand, with a keyed family
/// `jobs-keys`), stopped when dropped.
struct RunningSidecar {
    child: Child,
    port: u16,
}

impl RunningSidecar {
    /// On a 20 s lease: a release (within moments of a command's end) is then told apart from
    /// a lease running out by a bound a loaded machine does not reach.
    fn start(identity: &str, lock: &str, backend: &str) -> Self {
        Self::start_with(identity, lock, backend, &[])
    }

    /// With `family_args` for the family `jobs-keys` (`--permits 2 --read-write`).
    fn start_with(identity: &str, lock: &str, backend: &str, family_args: &[&str]) -> Self {
        Self::start_on_lease(identity, lock, backend, family_args, ["20s", "5s"])
    }

    /// On a lease and renew interval of its own (`["3s", "1s"]` for a claim that ends soon).
    fn start_on_lease(
        identity: &str,
        lock: &str,
        backend: &str,
        family_args: &[&str],
        [lease, renew]: [&str; 2],
    ) -> Self {
        let port = leasehold_testkit::free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar"))
            .args(["--lock", lock, "--backend", backend, "--identity", identity])
            .args(["--mode", "on-demand", "--keyed", "jobs-keys"])
            .args(family_args)
            .args(["--lease-duration", lease, "--renew-interval", renew])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the sidecar");
        let sidecar = Self { child, port };
        wait_for("the sidecar to serve", Duration::from_secs(10), || {
            sidecar
                .get("/healthz")
                .is_some_and(|(status, _)| status == 200)
        });
        sidecar
    }

    fn via(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `GET path`: the status and the body, or `None` when nobody answers.
    fn get(&self, path: &str) -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        write!(
            conn,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut raw = String::new();
        conn.read_to_string(&mut raw).ok()?;
        let status = raw.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, raw.split_once("\r\n\r\n")?.1.to_owned()))
    }

    fn status(&self, path: &str) -> u16 {
        self.get(path).expect("the sidecar answers").0
    }
}

impl Drop for RunningSidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An on-demand sidecar of the lock `jobs` on a Redis reached through a fault proxy, on
/// `lease` renewed every second.
fn sidecar_behind_a_proxy(lease: &str) -> (RedisServer, FaultProxy, RunningSidecar) {
    let redis = RedisServer::start_with(true);
    let proxy = FaultProxy::start(redis.port());
    let sidecar = RunningSidecar::start_on_lease(
        "pod-a",
        "jobs",
        &format!("redis://127.0.0.1:{}", proxy.port),
        &[],
        [lease, "1s"],
    );
    (redis, proxy, sidecar)
}

/// `exec --via` a running sidecar, holding `what` (`--lock NAME` or `--keyed FAMILY/KEY`).
fn exec_via(sidecar: &RunningSidecar, what: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar"));
    command
        .arg("exec")
        .args(what)
        .args(["--via", &sidecar.via(), "--kill-grace", "300ms"])
        .stdin(Stdio::null());
    command
}

/// `exec --via` running `script` on the lock `jobs`, once the script has written `started` and
/// the sidecar says the lock is held.
fn holding_jobs(sidecar: &RunningSidecar, script: &str, started: &Path) -> Child {
    let child = shell(&mut exec_via(sidecar, &["--lock", "jobs"]), script)
        .spawn()
        .unwrap();
    wait_for("the command to start", Duration::from_secs(10), || {
        !read(started).is_empty()
    });
    assert_eq!(sidecar.status("/lock"), 200, "held while the command runs");
    child
}

#[test]
fn through_a_sidecar_the_lock_is_held_while_the_command_runs_and_free_when_it_exits() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = RunningSidecar::start("pod-a", "jobs", &sqlite(dir.path()));
    let out = dir.path().join("seen");
    let script = format!(
        "echo $LEASEHOLD_EXEC_LOCK $LEASEHOLD_FENCING_TOKEN > {}; sleep 1; exit 7",
        out.display()
    );
    let mut child = holding_jobs(&sidecar, &script, &out);
    let (lock, token) = read(&out)
        .trim()
        .split_once(' ')
        .map(|(l, t)| (l.to_owned(), t.to_owned()))
        .unwrap();
    assert_eq!(lock, "jobs");
    let (_, body) = sidecar.get("/lock").unwrap();
    assert!(
        body.contains(&format!("\"fencingToken\":{token}")),
        "{body}"
    );
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(10)).code(),
        Some(7)
    );
    // Released as the connection closed (the sidecar sees the close a moment after exec
    // exits), not when the hold (two leases) or the lease (20 s) ran out.
    let exited = Instant::now();
    wait_for("the lock to be released", Duration::from_secs(10), || {
        sidecar.status("/lock") == 409
    });
    eprintln!("released {:?} after exec exited", exited.elapsed());
}

/// The group of a living process, from `/proc`.
fn group_of(pid: i32) -> i32 {
    let stat = read(Path::new(&format!("/proc/{pid}/stat")));
    let (_, fields) = stat.rsplit_once(") ").expect("a process's stat");
    fields.split(' ').nth(2).unwrap().parse().unwrap()
}

/// An exec killed outright (`SIGKILL`, as the out-of-memory killer does), on a backend of its
/// own and through a sidecar: its keeper stops the command at once, with what the command left
/// in the background, in its group or out of it (`setsid`); through a sidecar, the lock is then
/// released.
#[test]
fn a_killed_execs_command_and_all_it_started_are_stopped_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = RunningSidecar::start("pod-a", "jobs", &sqlite(dir.path()));
    for via in [false, true] {
        let pids = dir.path().join(format!("pids-{via}"));
        let script = format!(
            "sleep 30 & echo $! >> {0}; setsid sh -c 'echo $$ >> {0}; exec sleep 30' & echo $$ >> {0}; wait",
            pids.display()
        );
        let mut command = if via {
            exec_via(&sidecar, &["--lock", "jobs"])
        } else {
            exec("own", &sqlite(dir.path()))
        };
        let mut child = shell(&mut command, &script).spawn().unwrap();
        wait_for("the command and its two", Duration::from_secs(10), || {
            read(&pids).lines().count() == 3
        });
        let pids: Vec<i32> = read(&pids)
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect();
        let shell_group = group_of(*pids.last().unwrap());
        assert!(
            pids.iter().any(|&pid| group_of(pid) != shell_group),
            "one process left the command's group"
        );
        if via {
            assert_eq!(sidecar.status("/lock"), 200);
        }
        let _ = child.kill();
        let _ = child.wait();
        let killed = Instant::now();
        // A hang bound: the command's processes sleep 30 s.
        wait_for(
            "every process of the command to be stopped",
            Duration::from_secs(10),
            || pids.iter().all(|&pid| dead(pid)),
        );
        eprintln!("stopped {:?} after exec was killed", killed.elapsed());
        if via {
            wait_for("the lock to be released", Duration::from_secs(10), || {
                sidecar.status("/lock") == 409
            });
        }
    }
}

#[test]
fn a_stopped_execs_command_is_stopped_before_another_can_take_the_lock() {
    // Ctrl-Z stops exec, the terminal's foreground job, but not the command, whose group is its
    // own; SIGSTOP does the same here, where no terminal is. The stopped exec renews nothing,
    // and another exec takes the lock once the lease has run out.
    let redis = RedisServer::start_with(true);
    let (first, pids, dir) = stubborn_group(&redis.url());
    let first_pid = nix::unistd::Pid::from_raw(first.id() as i32);
    let first = Stopped(Some(first));
    // Past the first renewals (every second of the 3 s lease), which exec tells its keeper.
    std::thread::sleep(Duration::from_millis(2500));
    nix::sys::signal::kill(first_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();

    next_holder_finds_none_of(&pids, dir.path(), &redis.url());
    eprintln!(
        "the next holder ran {:?} after exec was stopped",
        stopped.elapsed()
    );
    keeper_stopped_the_group_in_time(first, &pids);
}

/// Once an exec on `backend`, stopped, has lost the lock `jobs`, the next holder's command
/// looks, as it starts, for `pids`: none may run.
fn next_holder_finds_none_of(pids: &StubbornPids, dir: &Path, backend: &str) {
    let checked = dir.join("checked");
    let script = format!(
        "for p in {} {}; do s=$(awk '{{print $3}}' /proc/$p/stat 2>/dev/null); case \"$s\" in ''|Z|X) ;; *) echo \"$p runs ($s)\";; esac; done > {2}; echo checked >> {2}",
        pids.0[0],
        pids.0[1],
        checked.display()
    );
    let mut second = shell(&mut exec("jobs", backend), &script).spawn().unwrap();
    // A hang bound: the leases here are seconds.
    let status = wait_exit(&mut second, Duration::from_secs(30));
    assert!(status.success(), "the next holder's command: {status:?}");
    assert_eq!(
        read(&checked).trim(),
        "checked",
        "the stopped exec's command ran beside the next holder's"
    );
}

/// Resumed, a stopped exec finds its command stopped for the lock; the keeper says, on its own
/// clock, how long before the claim's end the command's processes (`pids`) were gone.
fn keeper_stopped_the_group_in_time(first: Stopped, pids: &StubbornPids) {
    let output = first.resume().wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(75),
        "the lock-lost status: {stderr}"
    );
    assert!(stderr.contains("by its keeper"), "{stderr}");
    eprintln!(
        "the keeper stopped the group {} ms before the claim ends",
        spare_ms(&stderr)
    );
    assert!(
        spare_ms(&stderr) > 0,
        "the group was not gone before the claim ended: {stderr}"
    );
    assert!(pids.dead());
}

/// An exec stopped while its sidecar renews reads, once resumed, the renewals' events that
/// waited in the connection's buffers. Dated from that reading, its claim would end past the
/// sidecar's by the time they waited; the keeper, told that end, would let the command run
/// beside the next holder's once the sidecar has lost the lock.
#[test]
fn an_exec_that_reads_its_sidecars_renewals_late_keeps_to_the_sidecars_claim() {
    let (redis, proxy, sidecar) = sidecar_behind_a_proxy("6s");
    let (first, pids, dir) = stubborn_group_of(exec_via(&sidecar, &["--lock", "jobs"]));
    let first_pid = nix::unistd::Pid::from_raw(first.id() as i32);
    let first = Stopped(Some(first));
    let signal = |signal| nix::sys::signal::kill(first_pid, signal).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    signal(nix::sys::signal::Signal::SIGSTOP);
    // A renewal (every second) while exec is stopped, its event left unread; then the sidecar
    // is cut off, its claim ending at most 6 s after that renewal, and no sooner than 5.8 s
    // after the stop.
    std::thread::sleep(Duration::from_millis(1200));
    proxy.cut();
    // Resumed well before that end (and before the end of the claim it last read, so that it
    // goes on), exec reads the waiting events, and is stopped again: only the keeper, and the
    // end exec told it, stop the command now.
    std::thread::sleep(Duration::from_millis(2300));
    signal(nix::sys::signal::Signal::SIGCONT);
    std::thread::sleep(Duration::from_millis(200));
    signal(nix::sys::signal::Signal::SIGSTOP);
    next_holder_finds_none_of(&pids, dir.path(), &redis.url());
    keeper_stopped_the_group_in_time(first, &pids);
}

/// An exec the test stopped, continued (and killed) however the test ends.
struct Stopped(Option<Child>);

impl Stopped {
    fn resume(mut self) -> Child {
        let child = self.0.take().expect("not resumed yet");
        cont(&child);
        child
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            cont(&child);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn cont(child: &Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGCONT,
    );
}

/// `command` (an `exec` without its command yet) running a command that exits with `status`,
/// leaving behind a process that ignores SIGTERM. The exec (its stderr piped), once the command
/// has ended, the pid of what it left, and the directory it wrote that in.
fn ended_leaving_one(mut command: Command, status: u8) -> (Child, i32, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let left = dir.path().join("left");
    let ended = dir.path().join("ended");
    let script = format!(
        "trap '' TERM; sleep 300 & echo $! > {0}; echo done > {1}; exit {status}",
        left.display(),
        ended.display()
    );
    let child = shell(&mut command, &script)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the command to end", Duration::from_secs(10), || {
        !read(&ended).is_empty()
    });
    let pid = read(&left).trim().parse().unwrap();
    (child, pid, dir)
}

/// An exec killed while it gives what the command left running its grace: the keeper, which
/// stops them before it passes the command's status on, stops them at once.
#[test]
fn an_exec_killed_after_its_command_ended_leaves_nothing_running() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = exec("jobs", &sqlite(dir.path()));
    command.args(["--lease-duration", "60s", "--renew-interval", "10s"]);
    command.args(["--kill-grace", "30s"]);
    let (mut child, pid, _left) = ended_leaving_one(command, 0);
    // Within the grace: the process left behind ignores SIGTERM.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!dead(pid), "stopped before the grace ran out");
    let _ = child.kill();
    let _ = child.wait();
    // Well within the 30 s grace.
    wait_for(
        "the process left behind to be stopped",
        Duration::from_secs(10),
        || dead(pid),
    );
}

/// A lock lost while what the command left is given its grace: the command ended under the
/// lock, so its status stands, and what it left is stopped at once.
#[test]
fn a_lock_lost_after_the_command_ended_keeps_the_commands_status() {
    let redis = RedisServer::start_with(true);
    let mut command = exec("jobs", &redis.url());
    command.args(["--lease-duration", "6s", "--kill-grace", "3s"]);
    let (child, pid, _left) = ended_leaving_one(command, 7);
    // Once the keeper has told exec that the command ended (by its name).
    wait_for("the keeper to say so", Duration::from_secs(5), || {
        children_of(child.id())
            .into_iter()
            .any(|keeper| read(Path::new(&format!("/proc/{keeper}/comm"))).starts_with("ended:"))
    });
    // The lease gone behind the holder's back: its next renewal (within 2 s) finds out, within
    // the grace.
    assert_eq!(redis_del(redis.port(), "leasehold:{jobs}:lease"), ":1");
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(dead(pid), "what the command left was stopped");
    assert_eq!(
        output.status.code(),
        Some(7),
        "the command's status: {stderr}"
    );
    assert!(!stderr.contains("is being lost"), "{stderr}");
}

/// An exec and its keeper both killed outright, through a sidecar: nothing is left to stop the
/// command, which runs on; it holds the connection open, so the sidecar keeps the lock until
/// the command is gone.
#[test]
fn through_a_sidecar_a_command_that_outlives_exec_and_its_keeper_keeps_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = RunningSidecar::start("pod-a", "jobs", &sqlite(dir.path()));
    let out = dir.path().join("started");
    let ended = dir.path().join("ended");
    // The keeper is the shell's parent.
    let script = format!(
        "echo $PPID > {}; sleep 3; echo done > {}",
        out.display(),
        ended.display()
    );
    let mut child = holding_jobs(&sidecar, &script, &out);
    let keeper: i32 = read(&out).trim().parse().unwrap();
    // Stopped first, so that exec does not see its keeper die and stop the command itself.
    let exec = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(exec, nix::sys::signal::Signal::SIGSTOP).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(keeper),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let mut held = 0;
    while read(&ended).is_empty() {
        assert_eq!(
            sidecar.status("/lock"),
            200,
            "released while a process of the command still ran"
        );
        held += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(held >= 5, "the command outlived exec by too little to tell");
    wait_for("the lock to be released", Duration::from_secs(10), || {
        sidecar.status("/lock") == 409
    });
}

#[test]
fn execs_through_two_sidecars_take_turns_on_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let backend = sqlite(dir.path());
    let sidecars = [
        RunningSidecar::start("pod-a", "jobs", &backend),
        RunningSidecar::start("pod-b", "jobs", &backend),
    ];
    let log = dir.path().join("log");
    let script = format!(
        "echo start $LEASEHOLD_FENCING_TOKEN >> {0}; sleep 0.5; echo end >> {0}",
        log.display()
    );
    let mut children: Vec<Child> = (0..4)
        .map(|i| {
            let mut command = exec_via(&sidecars[i % 2], &["--keyed", "jobs-keys/report/2026"]);
            command.args(["--identity", &format!("run-{i}")]);
            shell(&mut command, &script).spawn().unwrap()
        })
        .collect();
    let lines = took_turns(&mut children, &log);
    let tokens: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("start ")?.parse().ok())
        .collect();
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "{tokens:?}");
}

/// A sidecar whose family `jobs-keys` is read-write, of two permits, on SQLite in `dir`.
fn read_write_sidecar(dir: &Path) -> RunningSidecar {
    RunningSidecar::start_with(
        "pod-a",
        "jobs",
        &sqlite(dir),
        &["--permits", "2", "--read-write"],
    )
}

/// On a read-write family, `exec --mode read` commands run side by side and an `exec --mode
/// write` command runs alone: after the readers that came first, before a reader that came
/// while it ran, with a token above the readers'.
#[test]
fn readers_exec_side_by_side_and_a_writer_execs_alone() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = read_write_sidecar(dir.path());
    let log = dir.path().join("log");
    let run = |mode: &str, owner: &str| {
        let script = format!(
            "echo {mode}-start $LEASEHOLD_FENCING_TOKEN >> {0}; sleep 1; echo {mode}-end >> {0}",
            log.display()
        );
        let mut command = exec_via(&sidecar, &["--keyed", "jobs-keys/report"]);
        command.args(["--mode", mode, "--identity", owner]);
        shell(&mut command, &script).spawn().unwrap()
    };
    let started = |what: &str| read(&log).lines().filter(|l| l.starts_with(what)).count();
    let mut children = vec![run("read", "r1"), run("read", "r2")];
    wait_for("both readers to run", Duration::from_secs(10), || {
        started("read-start") == 2
    });
    children.push(run("write", "w1"));
    wait_for("the writer to run", Duration::from_secs(10), || {
        started("write-start") == 1
    });
    children.push(run("read", "r3"));
    for child in &mut children {
        assert!(wait_exit(child, Duration::from_secs(30)).success());
    }
    let lines: Vec<String> = read(&log).lines().map(str::to_owned).collect();
    let shape: Vec<&str> = lines.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(
        shape,
        [
            "read-start",
            "read-start",
            "read-end",
            "read-end",
            "write-start",
            "write-end",
            "read-start",
            "read-end"
        ],
        "{lines:?}"
    );
    let tokens: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.split(' ').nth(1)?.parse().ok())
        .collect();
    // A reader's token rises with its permit's holders only (on SQLite each permit counts on
    // its own), so the writer's is compared with the readers' before it.
    assert!(tokens[2] > tokens[0].max(tokens[1]), "{lines:?}");
}

/// `exec --keyed F/a --keyed F/b`: both keys held while the command runs, each key's token in
/// `LEASEHOLD_FENCING_TOKENS` (and no `LEASEHOLD_FENCING_TOKEN`: no one token fences both
/// keys); an `exec` on one of the keys runs only once the first command has ended.
#[test]
fn an_exec_on_several_keys_holds_them_all_while_its_command_runs() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = RunningSidecar::start("pod-a", "jobs", &sqlite(dir.path()));
    let log = dir.path().join("log");
    let both = format!(
        "echo start $LEASEHOLD_FENCING_TOKENS ${{LEASEHOLD_FENCING_TOKEN-unset}} >> {0}; sleep 1.5; echo end >> {0}",
        log.display()
    );
    let mut first = shell(
        &mut exec_via(
            &sidecar,
            &["--keyed", "jobs-keys/a", "--keyed", "jobs-keys/b"],
        ),
        &both,
    )
    .spawn()
    .unwrap();
    wait_for("the command to start", Duration::from_secs(10), || {
        !read(&log).is_empty()
    });
    for key in ["a", "b"] {
        assert_eq!(
            sidecar.status(&format!("/locks/jobs-keys/keys/{key}")),
            200,
            "{key} held while the command runs"
        );
    }
    let one = format!("echo start-b >> {0}", log.display());
    let mut second = shell(&mut exec_via(&sidecar, &["--keyed", "jobs-keys/b"]), &one)
        .spawn()
        .unwrap();
    for child in [&mut first, &mut second] {
        assert!(wait_exit(child, Duration::from_secs(30)).success());
    }
    let lines: Vec<String> = read(&log).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    let fields: Vec<&str> = lines[0].split(' ').collect();
    let tokens: Vec<(&str, u64)> = fields[1]
        .split(',')
        .map(|pair| {
            let (key, token) = pair.split_once('=').expect("KEY=TOKEN");
            (key, token.parse().expect("token"))
        })
        .collect();
    assert_eq!(
        tokens.iter().map(|(key, _)| *key).collect::<Vec<_>>(),
        ["a", "b"],
        "{lines:?}"
    );
    assert!(tokens.iter().all(|(_, token)| *token > 0), "{lines:?}");
    assert_eq!(fields[2], "unset", "{lines:?}");
    assert_eq!(&lines[1..], ["end", "start-b"], "{lines:?}");
}

/// `exec --keyed F/a --keyed F/b --mode write` on a read-write family: the command runs once
/// the readers of either key have left, alone on both keys (a reader of either that comes
/// meanwhile waits), and each key's token is above its readers'.
#[test]
fn an_exec_writing_several_keys_runs_alone_on_each() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = read_write_sidecar(dir.path());
    let log = dir.path().join("log");
    let run = |keys: &[&str], mode: &str, owner: &str, tag: &str| {
        let script = format!(
            "echo {tag}-start ${{LEASEHOLD_FENCING_TOKENS-$LEASEHOLD_FENCING_TOKEN}} >> {0}; sleep 1; echo {tag}-end >> {0}",
            log.display()
        );
        let keyed: Vec<String> = keys.iter().map(|key| format!("jobs-keys/{key}")).collect();
        let mut args = Vec::new();
        for keyed in &keyed {
            args.extend(["--keyed", keyed.as_str()]);
        }
        let mut command = exec_via(&sidecar, &args);
        command.args(["--mode", mode, "--identity", owner]);
        shell(&mut command, &script).spawn().unwrap()
    };
    let started = |what: &str| read(&log).lines().filter(|l| l.starts_with(what)).count();
    let mut children = vec![
        run(&["a"], "read", "r1", "ra"),
        run(&["b"], "read", "r2", "rb"),
    ];
    wait_for("both readers to run", Duration::from_secs(10), || {
        started("ra-start") + started("rb-start") == 2
    });
    children.push(run(&["a", "b"], "write", "w1", "w"));
    wait_for("the writer to run", Duration::from_secs(10), || {
        started("w-start") == 1
    });
    children.push(run(&["b"], "read", "r3", "rc"));
    for child in &mut children {
        assert!(wait_exit(child, Duration::from_secs(30)).success());
    }
    let lines: Vec<String> = read(&log).lines().map(str::to_owned).collect();
    let at = |what: &str| {
        lines
            .iter()
            .position(|l| l.starts_with(what))
            .unwrap_or_else(|| panic!("{what} missing: {lines:?}"))
    };
    assert!(at("w-start") > at("ra-end").max(at("rb-end")), "{lines:?}");
    assert!(at("rc-start") > at("w-end"), "{lines:?}");
    let token = |what: &str| -> String { lines[at(what)].split(' ').nth(1).unwrap().to_owned() };
    let written: Vec<(String, u64)> = token("w-start")
        .split(',')
        .map(|pair| {
            let (key, token) = pair.split_once('=').expect("KEY=TOKEN");
            (key.to_owned(), token.parse().expect("token"))
        })
        .collect();
    assert_eq!(written.len(), 2, "{lines:?}");
    assert_eq!(written[0].0, "a", "{lines:?}");
    assert_eq!(written[1].0, "b", "{lines:?}");
    let read_a: u64 = token("ra-start").parse().unwrap();
    let read_b: u64 = token("rb-start").parse().unwrap();
    assert!(written[0].1 > read_a && written[1].1 > read_b, "{lines:?}");
}

#[test]
fn a_lock_lost_by_the_sidecar_stops_the_group_before_the_claim_ends() {
    let (_redis, proxy, sidecar) = sidecar_behind_a_proxy("3s");
    let (child, pids, _dir) = stubborn_group_of(exec_via(&sidecar, &["--lock", "jobs"]));
    let lease = Duration::from_secs(3);
    let cut = Instant::now();
    proxy.cut();
    // A hang bound: when the group died against the claim's end is exec's to say.
    wait_for("the background processes to be stopped", 3 * lease, || {
        pids.dead()
    });
    let stopped_after = cut.elapsed();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(75), "{stderr}");
    let spare_ms = spare_ms(&stderr);
    assert!(
        spare_ms > 0,
        "the group was not gone before the claim ended: {stderr}"
    );
    eprintln!("stopped {stopped_after:?} after the cut: {stderr}");
}

#[test]
fn bad_input_through_a_sidecar_is_refused_and_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = RunningSidecar::start("pod-a", "jobs", &sqlite(dir.path()));
    let ran = dir.path().join("ran");
    let touch = format!("touch {}", ran.display());
    let refused = |command: &mut Command, says: &str| {
        let output = shell(command, &touch)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(says), "{says:?} not in {stderr}");
    };
    refused(&mut exec_via(&sidecar, &["--lock", "no-such-lock"]), "404");
    refused(
        &mut exec_via(&sidecar, &["--keyed", "nofamily"]),
        "FAMILY/KEY",
    );
    refused(&mut exec_via(&sidecar, &["--keyed", "no-such/k"]), "404");
    refused(
        exec_via(&sidecar, &["--lock", "jobs"]).args(["--lease-duration", "5s"]),
        "--lease-duration",
    );
    refused(
        Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar")).args([
            "exec",
            "--keyed",
            "jobs-keys/k",
        ]),
        "--via",
    );
    refused(
        exec_via(&sidecar, &["--lock", "jobs"]).args(["--mode", "write"]),
        "--keyed",
    );
    refused(
        exec_via(&sidecar, &["--keyed", "jobs-keys/k"]).args(["--mode", "upgrade"]),
        "upgrade",
    );
    refused(
        &mut exec_via(&sidecar, &["--keyed", "jobs-keys/a", "--keyed", "other/b"]),
        "one family",
    );
    refused(
        &mut exec_via(
            &sidecar,
            &["--keyed", "jobs-keys/a", "--keyed", "jobs-keys/a"],
        ),
        "named twice",
    );
    refused(
        &mut exec_via(
            &sidecar,
            &["--keyed", "jobs-keys/a,b", "--keyed", "jobs-keys/c"],
        ),
        "no commas",
    );
    refused(
        Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar")).args([
            "exec",
            "--lock",
            "jobs",
            "--via",
            "127.0.0.1:1",
        ]),
        "http://",
    );
    // The sidecar's 20 s lease leaves under 15 s before a renewal: a 15 s grace cannot fit.
    let mut long_grace = Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar"));
    long_grace.args([
        "exec",
        "--lock",
        "jobs",
        "--via",
        &sidecar.via(),
        "--kill-grace",
        "15s",
    ]);
    refused(&mut long_grace, "the sidecar's lease");
    assert!(!ran.exists());
    // The refused grace was learnt once held: the hold is given up as exec exits.
    wait_for("nothing to be left held", Duration::from_secs(10), || {
        sidecar.status("/lock") == 409
    });
}

/// Several `exec`s through one sidecar take turns: on a lock (whose acquisitions are the pod's,
/// so each waits for the others' exclusive holds), on a key (each `exec` its own owner when no
/// `--identity` is given, though host name and process id may repeat across containers), and
/// on a key with one `--identity` for all (one owner, whose exclusive holds take turns rather
/// than re-enter one holding).
#[test]
fn execs_through_one_sidecar_take_turns() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = RunningSidecar::start("pod-a", "jobs", &sqlite(dir.path()));
    for what in [
        &["--lock", "jobs"][..],
        &["--keyed", "jobs-keys/k"][..],
        &["--keyed", "jobs-keys/k", "--identity", "nightly"][..],
    ] {
        let log = dir.path().join(format!(
            "log-{}-{}",
            what[0].trim_start_matches('-'),
            what.len()
        ));
        let script = format!(
            "echo start $LEASEHOLD_EXEC_IDENTITY >> {0}; sleep 0.4; echo end >> {0}",
            log.display()
        );
        let mut children: Vec<Child> = (0..3)
            .map(|_| {
                shell(&mut exec_via(&sidecar, what), &script)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let lines = took_turns(&mut children, &log);
        // The identity the lock is held under in the backend: the sidecar's, or its owner's.
        let identities: Vec<&str> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("start "))
            .collect();
        if what[0] == "--lock" {
            assert!(identities.iter().all(|i| *i == "pod-a"), "{identities:?}");
        } else if what.len() == 4 {
            assert!(
                identities.iter().all(|i| *i == "pod-a/nightly"),
                "{identities:?}"
            );
        } else {
            assert!(
                identities.iter().all(|i| i.starts_with("pod-a/")),
                "{identities:?}"
            );
        }
    }
}

/// A stand-in for a sidecar's hold route on a free loopback port, answering each connection
/// with the next of `streams` (events after a 200 head; the connection then stays open until
/// the client closes it, unless the stream's last event ends the hold). Returns the address.
fn scripted_hold_routes(streams: Vec<Vec<(&'static str, serde_json::Value)>>) -> String {
    use std::io::{BufRead, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for events in streams {
            let Ok((conn, _)) = listener.accept() else {
                return;
            };
            let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line.trim_end() != "" {
                line.clear();
            }
            let mut conn = conn;
            write!(
                conn,
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
            )
            .unwrap();
            let ends = events
                .last()
                .is_some_and(|(kind, _)| *kind == "lost" || *kind == "released");
            for (kind, data) in events {
                write!(conn, "event: {kind}\ndata: {data}\n\n").unwrap();
            }
            if !ends {
                // Held until exec closes the connection.
                let mut rest = Vec::new();
                let _ = std::io::Read::read_to_end(&mut reader, &mut rest);
            }
        }
    });
    address
}

/// Through a sidecar, a hold whose stream ends before the command started (told too short a
/// claim to start on, then lost) ran nothing: `exec` asks again and runs the command once held,
/// rather than exit with the lock-lost status for a command that never ran.
#[test]
fn through_a_sidecar_a_hold_ended_before_the_command_started_is_asked_for_again() {
    let held = |valid_for_ms: u64| {
        serde_json::json!({"lock": "jobs", "holder": true, "fencingToken": 7,
                           "validForMs": valid_for_ms, "leaseDurationMs": 15000,
                           "renewIntervalMs": 5000, "identity": "pod-a"})
    };
    let via = scripted_hold_routes(vec![
        vec![
            ("acquired", held(100)),
            (
                "lost",
                serde_json::json!({"lock": "jobs", "reason": "resigned"}),
            ),
        ],
        vec![("acquired", held(15000))],
    ]);
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let mut child = Command::new(env!("CARGO_BIN_EXE_leasehold-sidecar"))
        .args([
            "exec",
            "--lock",
            "jobs",
            "--via",
            &via,
            "--kill-grace",
            "300ms",
        ])
        .args(["--", "touch", ran.to_str().unwrap()])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(20));
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(ran.exists(), "the command never ran: {stderr}");
}

/// The command is told its own holding's fencing and nothing else: a key of a family of
/// several permits (a read-write family's reader here) comes with its permit, and what an exec
/// the command runs under (nested) set is not passed on, so several keys come without a
/// `LEASEHOLD_FENCING_TOKEN` that fences none of them.
#[test]
fn the_command_is_told_its_own_holdings_permit_and_no_inherited_fencing() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = read_write_sidecar(dir.path());
    let told = |what: &[&str]| {
        let mut command = exec_via(&sidecar, what);
        command
            .env("LEASEHOLD_FENCING_TOKEN", "999")
            .env("LEASEHOLD_FENCING_TOKENS", "outer=998")
            .env("LEASEHOLD_PERMIT", "7")
            .stderr(Stdio::piped())
            .stdout(Stdio::piped());
        let output = shell(
            &mut command,
            "echo ${LEASEHOLD_PERMIT-unset} ${LEASEHOLD_FENCING_TOKEN-unset} ${LEASEHOLD_FENCING_TOKENS-unset}",
        )
        .output()
        .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    };
    let one = told(&["--keyed", "jobs-keys/k", "--mode", "read"]);
    let fields: Vec<&str> = one.split(' ').collect();
    assert_eq!(fields[0], "0", "the reader's permit: {one}");
    assert!(fields[1].parse::<u64>().is_ok_and(|t| t != 999), "{one}");
    assert_eq!(fields[2], "unset", "{one}");
    let several = told(&["--keyed", "jobs-keys/a", "--keyed", "jobs-keys/b"]);
    let fields: Vec<&str> = several.split(' ').collect();
    assert_eq!(&fields[..2], ["unset", "unset"], "{several}");
    assert!(
        fields[2].starts_with("a=") && fields[2].contains(",b="),
        "{several}"
    );
}
