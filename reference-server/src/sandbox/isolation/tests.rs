//! Tests of sandbox namespaces on the real kernel: holders made both ways (as root, and the
//! unprivileged way, which root can also take), processes entered into them, and what those
//! processes see.

use std::io::BufRead as _;
use std::os::unix::process::ExitStatusExt as _;

use super::*;

/// A namespacer that makes namespaces `privilege`'s way, or `None` (the test is skipped)
/// where the machine cannot and isolation is not required.
fn namespacer(privilege: Privilege) -> Option<Namespacer> {
    // SAFETY: geteuid(2) has no preconditions.
    if privilege == Privilege::Root && unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making namespaces as root needs root");
        return None;
    }
    let namespacer = Namespacer {
        privilege,
        exposed: Vec::new(),
        weakened: Weakened::default(),
    };
    match namespacer.probe() {
        Ok(()) => Some(namespacer),
        Err(reason) if std::env::var(REQUIRE_ENV).as_deref() != Ok("1") => {
            eprintln!("skipped: no {privilege:?} sandbox isolation here: {reason}");
            None
        }
        Err(reason) => panic!("isolation is required: {privilege:?}: {reason}"),
    }
}

/// Both ways this machine can take.
fn namespacers() -> Vec<Namespacer> {
    [Privilege::Root, Privilege::Unprivileged]
        .into_iter()
        .filter_map(namespacer)
        .collect()
}

/// A holder on a fresh directory (kept alive by the returned guard).
fn holder(namespacer: &Namespacer) -> (Holder, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (namespacer.start(dir.path()).unwrap(), dir)
}

/// `argv` to run inside `view`'s sandbox as `user`, in its own process group, as the
/// provider starts processes.
fn entered_as<const N: usize>(view: &SandboxView, user: SandboxUser, argv: [&str; N]) -> Command {
    let entry = view.entry(HOME, user).unwrap();
    let mut cmd = Command::new(argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .process_group(0);
    // SAFETY: `Entry::enter` is made for a pre_exec closure.
    unsafe {
        cmd.pre_exec(move || entry.enter());
    }
    cmd
}

fn entered<const N: usize>(view: &SandboxView, argv: [&str; N]) -> Command {
    entered_as(view, SandboxUser::User, argv)
}

/// The lines a shell script prints inside the sandbox as `user`; panics unless it succeeds.
fn lines_of(view: &SandboxView, user: SandboxUser, script: &str) -> Vec<String> {
    let out = entered_as(view, user, ["sh", "-c", script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The host PID of the sandbox's PID 1, from its pidfd.
fn init_pid(holder: &Holder) -> i32 {
    let fd = holder.init.as_ref().unwrap().as_raw_fd();
    std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Host PIDs of the processes in the sandbox's PID namespace other than its PID 1.
fn sandbox_processes(view: &SandboxView, holder: &Holder) -> Vec<i32> {
    let ns = view.pid_namespace();
    let init = init_pid(holder);
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            pid != init
                && runs(pid)
                && std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|n| n == ns)
        })
        .collect()
}

/// Whether host PID `pid` runs (a zombie runs nothing).
fn runs(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

/// What `/proc/self/fd/<fd>` names (`net:[4026532...]`).
fn link_of(fd: &OwnedFd) -> String {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn an_entered_process_is_in_every_namespace_of_the_sandbox_as_its_user() {
    for namespacer in namespacers() {
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let inner = &view.inner;
        let kinds = [
            ("ipc", libc::CLONE_NEWIPC),
            ("uts", libc::CLONE_NEWUTS),
            ("net", libc::CLONE_NEWNET),
            ("pid", libc::CLONE_NEWPID),
            ("mnt", libc::CLONE_NEWNS),
        ];
        let of_kind = |kind| {
            let (fd, _) = inner.joins.iter().find(|(_, k)| *k == kind).unwrap();
            link_of(fd)
        };
        let script = "id -u; id -g; whoami; pwd; for n in user ipc uts net pid mnt; do \
                      readlink /proc/self/ns/$n; done; hostname";
        for (user, ns) in [
            (SandboxUser::User, &inner.as_user),
            (SandboxUser::Root, &inner.as_root),
        ] {
            let id = user.id().to_string();
            let name = if user == SandboxUser::Root {
                "root"
            } else {
                "user"
            };
            let mut want = vec![
                id.clone(),
                id,
                name.to_owned(),
                HOME.to_owned(),
                link_of(ns),
            ];
            want.extend(kinds.iter().map(|(_, kind)| of_kind(*kind)));
            want.push("sandbox".to_owned());
            assert_eq!(
                lines_of(&view, user, script),
                want,
                "{:?}",
                namespacer.privilege
            );
        }
        // None of them is the server's.
        for (name, _) in kinds {
            let own = std::fs::read_link(format!("/proc/self/ns/{name}")).unwrap();
            assert_ne!(
                own.to_string_lossy(),
                of_kind(kinds.iter().find(|k| k.0 == name).unwrap().1)
            );
        }
    }
}

#[test]
fn the_sandbox_sees_its_own_root_filesystem() {
    for namespacer in namespacers() {
        let (holder, dir) = holder(&namespacer);
        let view = holder.view();
        std::fs::write(dir.path().join("mine.txt"), "x").unwrap();
        let seen = lines_of(
            &view,
            SandboxUser::User,
            "ls -A /; stat -c %d:%i /home/user /workspace; cat /home/user/mine.txt; echo; \
             getent passwd user root | cut -d: -f1,3,6; \
             touch /usr/x /etc/x /x /home/x 2>/dev/null || echo system read-only; \
             echo y > /tmp/t && echo tmp writable; echo z > /home/user/made && echo files writable; \
             test -c /dev/null && echo hi > /dev/null && echo dev null; ls /dev/pts/ptmx",
        );
        let want_root = [
            "bin",
            "dev",
            "etc",
            "home",
            "lib",
            "proc",
            "root",
            "tmp",
            "usr",
            "workspace",
        ];
        let root: Vec<&str> = seen
            .iter()
            .take_while(|l| !l.contains(':'))
            .map(String::as_str)
            .collect();
        for dir in want_root {
            // `/bin` and `/lib` are links or directories, as on the host.
            if std::path::Path::new("/").join(dir).exists() {
                assert!(root.contains(&dir), "/{dir} in {root:?}");
            }
        }
        for absent in ["oldroot", "newroot", "host", "data"] {
            assert!(!root.contains(&absent), "/{absent} in {root:?}");
        }
        let rest = &seen[root.len()..];
        assert_eq!(
            rest[0], rest[1],
            "/home/user and /workspace are one directory"
        );
        assert_eq!(
            rest[2..].to_vec(),
            [
                "x",
                "user:1000:/home/user",
                "root:0:/root",
                "system read-only",
                "tmp writable",
                "files writable",
                "dev null",
                "/dev/pts/ptmx",
            ]
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("made")).unwrap(),
            "z\n"
        );
        // `root` has a home of its own and may write its files, but not the system.
        let seen = lines_of(
            &view,
            SandboxUser::Root,
            "echo r > /root/r && cat /root/r; echo w > /home/user/by-root && echo files writable; \
             touch /usr/x 2>/dev/null || echo system read-only; \
             mount -t tmpfs t /tmp 2>/dev/null || echo no mounts",
        );
        assert_eq!(
            seen,
            ["r", "files writable", "system read-only", "no mounts"]
        );
    }
}

#[test]
fn pid_1_shows_no_host_path_and_cannot_be_looked_into() {
    for namespacer in namespacers() {
        let (holder, dir) = holder(&namespacer);
        let view = holder.view();
        for user in [SandboxUser::User, SandboxUser::Root] {
            let seen = lines_of(
                &view,
                user,
                "tr '\\0' ' ' < /proc/1/cmdline; echo; \
                 cat /proc/1/environ >/dev/null 2>&1 || echo environ refused; \
                 readlink /proc/1/exe >/dev/null 2>&1 || echo exe refused; \
                 readlink /proc/1/fd/0 >/dev/null 2>&1 || echo fds refused; \
                 ps -e -o pid= | wc -l",
            );
            assert_eq!(
                seen[0].trim(),
                holder::ARG0,
                "{:?} {user:?}",
                namespacer.privilege
            );
            assert!(!seen[0].contains('/'));
            assert!(!seen.join("\n").contains(&*dir.path().to_string_lossy()));
            assert_eq!(
                seen[1..4],
                ["environ refused", "exe refused", "fds refused"]
            );
            // PID 1, the shell and `ps` (and the pipe's `wc`).
            let count: usize = seen[4].trim().parse().unwrap();
            assert!(count <= 4, "{count} processes in view");
        }
    }
}

#[test]
fn a_missing_program_fails_the_spawn_and_leaves_nothing() {
    for namespacer in namespacers() {
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        // `sh` is on the host, `/home/user/nothing-here` is not inside: the lookup and the
        // exec happen inside the sandbox, and std's error pipe carries the failure back.
        for program in ["/home/user/nothing-here", "no-such-program-anywhere"] {
            let err = entered(&view, [program]).spawn().unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::NotFound, "{program}: {err}");
        }
        let host_only = std::env::current_exe().unwrap();
        let err = entered(&view, [host_only.to_str().unwrap()])
            .spawn()
            .unwrap_err();
        assert_eq!(
            err.kind(),
            io::ErrorKind::NotFound,
            "the host's files are out of view"
        );
        assert_eq!(sandbox_processes(&view, &holder), Vec::<i32>::new());
    }
}

#[test]
fn the_waited_for_process_ends_as_the_sandboxed_one_ended() {
    for namespacer in namespacers() {
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let status = entered(&view, ["sh", "-c", "exit 7"]).status().unwrap();
        assert_eq!(status.code(), Some(7));
        let status = entered(&view, ["sh", "-c", "kill -TERM $$"])
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        let status = entered(&view, ["sh", "-c", "kill -SEGV $$"])
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGSEGV));
    }
}

#[test]
fn a_signal_to_the_group_reaches_the_sandboxed_process_alone() {
    for namespacer in namespacers() {
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        // The process says when its trap is set; TERM then only writes a line.
        let mut child = entered(
            &view,
            [
                "sh",
                "-c",
                "trap 'echo got TERM' TERM; echo ready; while :; do sleep 0.1; done",
            ],
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
        let pgid = child.id() as i32;
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        // SAFETY: kill(2) to the group this test started.
        assert_eq!(unsafe { libc::kill(-pgid, libc::SIGTERM) }, 0);
        line.clear();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "got TERM\n", "the trap ran");
        assert_eq!(
            child.try_wait().unwrap(),
            None,
            "TERM ended the waited-for process"
        );
        assert!(!sandbox_processes(&view, &holder).is_empty());
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(-pgid, libc::SIGKILL) }, 0);
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        // Bounded, not timed: the kernel reaps the sandboxed process asynchronously.
        for _ in 0..500 {
            if sandbox_processes(&view, &holder).is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(sandbox_processes(&view, &holder), Vec::<i32>::new());
    }
}

#[test]
fn orphans_are_reaped_by_pid_1() {
    for namespacer in namespacers() {
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        // Twenty background children outlive the shell that started them, then end.
        let status = entered(
            &view,
            ["sh", "-c", "for i in $(seq 20); do (sleep 0.2 &) ; done"],
        )
        .status()
        .unwrap();
        assert!(status.success());
        let zombies = || {
            let init = init_pid(&holder).to_string();
            std::fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("stat")).is_ok_and(|stat| {
                        stat.rsplit_once(") ").is_some_and(|(_, rest)| {
                            let mut f = rest.split_whitespace();
                            f.next() == Some("Z") && f.next() == Some(init.as_str())
                        })
                    })
                })
                .count()
        };
        std::thread::sleep(Duration::from_millis(600));
        for _ in 0..200 {
            if sandbox_processes(&view, &holder).is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(sandbox_processes(&view, &holder), Vec::<i32>::new());
        assert_eq!(zombies(), 0, "zombies left under PID 1");
    }
}

#[test]
fn kill_ends_every_process_of_the_sandbox_while_the_holder_lives() {
    for namespacer in namespacers() {
        let (mut holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let init = init_pid(&holder);
        let mut sleeper = entered(&view, ["sh", "-c", "setsid sleep 1000 & echo $!; wait"]);
        let mut sleeper = sleeper.stdout(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(sleeper.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(!line.trim().is_empty());
        let inside = sandbox_processes(&view, &holder);
        assert!(inside.len() >= 2, "{inside:?}");
        assert!(runs(init));
        holder.kill();
        // Bounded, not timed: the kernel tears the namespace down asynchronously.
        for _ in 0..500 {
            if !runs(init) && inside.iter().all(|p| !runs(*p)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!runs(init), "PID 1 outlived kill");
        for pid in inside {
            assert!(!runs(pid), "the sandbox's process {pid} outlived kill");
        }
        // The process the server would wait for ends with the sandbox's.
        let _ = sleeper.wait();
        drop(holder);
    }
}

#[test]
fn the_server_closing_its_socket_ends_the_sandbox() {
    for namespacer in namespacers() {
        let (mut holder, _dir) = holder(&namespacer);
        let view = holder.view();
        let init = init_pid(&holder);
        let mut sleeper = entered(&view, ["sleep", "1000"]).spawn().unwrap();
        // The holder's first process going does not end the sandbox.
        let pidfd = holder.init.take();
        holder.child.kill().unwrap();
        holder.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(runs(init), "PID 1 ended with its parent");
        assert_eq!(sleeper.try_wait().unwrap(), None);
        // What the server's death does: its descriptors close. The pidfd is not used.
        drop(view);
        drop(holder);
        for _ in 0..500 {
            if !runs(init) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!runs(init), "PID 1 outlived the server's socket");
        assert_eq!(sleeper.wait().unwrap().signal(), Some(libc::SIGKILL));
        drop(pidfd);
    }
}

#[test]
fn sockets_from_the_view_are_in_the_sandbox_network_namespace() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for namespacer in namespacers() {
        let (holder, _dir) = holder(&namespacer);
        let view = holder.view();
        runtime.block_on(async {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            // A port the host listens on is not the sandbox's.
            let host = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = host.local_addr().unwrap().port();
            let refused = view.connect(port).await.unwrap_err();
            assert_eq!(refused.kind(), io::ErrorKind::ConnectionRefused);
            // The same port inside, and a process of the sandbox reaching it.
            let inside = view.listen(port).await.unwrap();
            let talk = format!("exec 3<>/dev/tcp/127.0.0.1/{port}; echo hi >&3");
            let mut client = entered(&view, ["bash", "-c", &talk]).spawn().unwrap();
            let (mut conn, _) = inside.accept().await.unwrap();
            let mut got = String::new();
            conn.read_to_string(&mut got).await.unwrap();
            assert_eq!(got, "hi\n");
            assert!(client.wait().unwrap().success());
            // And the server's connection to it.
            let mut out = view.connect(port).await.unwrap();
            let (mut accepted, _) = inside.accept().await.unwrap();
            out.write_all(b"ok").await.unwrap();
            drop(out);
            let mut got = String::new();
            accepted.read_to_string(&mut got).await.unwrap();
            assert_eq!(got, "ok");
        });
    }
}

#[test]
fn metadata_resolves_inside_the_sandbox_root() {
    for namespacer in namespacers() {
        let (holder, dir) = holder(&namespacer);
        let view = holder.view();
        std::os::unix::fs::symlink("/etc/hostname-nowhere", dir.path().join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../usr", dir.path().join("up")).unwrap();
        assert!(view.metadata("/usr/bin/env").unwrap().is_file());
        // An absolute link is followed in the sandbox's root, not the host's.
        std::fs::write("/tmp/.sandspec-probe-outside", "x").ok();
        std::os::unix::fs::symlink("/tmp/.sandspec-probe-outside", dir.path().join("out")).unwrap();
        assert!(view.metadata("/home/user/out").is_err(), "the host's /tmp");
        assert!(view.metadata("/home/user/abs").is_err());
        // `..` stops at the sandbox's root.
        assert!(view.metadata("/home/user/up/bin").unwrap().is_dir());
        let _ = std::fs::remove_file("/tmp/.sandspec-probe-outside");
    }
}

#[test]
fn sandbox_uids_come_in_pairs_in_their_range() {
    for _ in 0..1000 {
        let uid = allocate_uid();
        assert_eq!(uid % 2, 0);
        assert!(is_sandbox_uid(uid) && is_sandbox_uid(uid + 1), "{uid}");
    }
}
