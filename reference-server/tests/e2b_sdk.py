"""The real E2B Python SDK against the sandspec reference server.

Run by `tests/e2b.rs` with E2B_API_URL and E2B_SANDBOX_URL set to the server's base URL,
E2B_API_KEY to a principal's token and SANDSPEC_E2B_DOC to `docs/profiles/e2b.md`. Every call
must succeed with the SDK's own types; a killed sandbox and a wrong key must surface as the
SDK's own exceptions. Every public method of `Sandbox`, `sandbox.files`, `sandbox.commands`
and `sandbox.pty` must have a row in the doc's SDK method table. Any failed check raises.
"""

import gzip
import hashlib
import inspect
import io
import os
import re
import time
import urllib.request
import uuid

from e2b import (
    AuthenticationException,
    CommandExitException,
    CommandResult,
    EntryInfo,
    FileType,
    FilesystemEventType,
    Sandbox,
    SandboxInfo,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    TimeoutException,
    WriteInfo,
)
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.sandbox_api import SandboxState
from e2b.sandbox_sync.commands.command import Commands
from e2b.sandbox_sync.commands.pty import Pty
from e2b.sandbox_sync.filesystem.filesystem import Filesystem


def check(condition, what):
    if not condition:
        raise AssertionError(what)
    print(f"ok: {what}")


def public_methods(cls):
    """The public methods of an SDK class (class, static and instance ones; no properties)."""
    names = set()
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property) or isinstance(attr, (str, int, float, bool)):
            continue
        if callable(attr) or isinstance(attr, (classmethod, staticmethod)) or hasattr(attr, "__get__"):
            names.add(name)
    return names


def table_rows(doc_path):
    """(class, Python names) of each row of the doc's SDK method table."""
    rows = {}
    text = open(doc_path, encoding="utf-8").read()
    section = text.split("\n## SDK methods\n", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        cls = cells[0].strip("`")
        rows.setdefault(cls, set()).update(re.findall(r"`([a-z_]+)`", cells[1]))
    return rows


rows = table_rows(os.environ["SANDSPEC_E2B_DOC"])
for cls, label in [(Sandbox, "Sandbox"), (Filesystem, "files"), (Commands, "commands"), (Pty, "pty")]:
    missing = sorted(public_methods(cls) - rows.get(label, set()))
    check(not missing, f"every public method of {label} has a row in the SDK method table (missing: {missing})")

run_id = uuid.uuid4().hex
sbx = Sandbox.create(timeout=120, metadata={"run": run_id}, envs={"GREETING": "hello"})
check(isinstance(sbx, Sandbox) and sbx.sandbox_id, "Sandbox.create returns a Sandbox")

info = sbx.get_info()
check(isinstance(info, SandboxInfo), "get_info returns SandboxInfo")
check(info.sandbox_id == sbx.sandbox_id and info.metadata == {"run": run_id}, "info names the sandbox and its metadata")
check(info.state == SandboxState.RUNNING, "a new sandbox is running")

# Commands: foreground, exit codes, background, connect, stdin, kill.
result = sbx.commands.run('echo "$GREETING"; echo oops >&2')
check(isinstance(result, CommandResult), "commands.run returns CommandResult")
check(result.exit_code == 0 and result.stdout == "hello\n" and result.stderr == "oops\n", "foreground output and the sandbox's envVars")

try:
    sbx.commands.run("exit 3")
    raise AssertionError("exit 3 did not raise")
except CommandExitException as e:
    check(e.exit_code == 3, "a failing command raises CommandExitException with its exit code")

cat = sbx.commands.run("cat", background=True, stdin=True)
check(cat.pid > 0, "a background command has a pid")
listed = sbx.commands.list()
check(any(p.pid == cat.pid and p.cmd == "/bin/bash" for p in listed), "commands.list shows the background command")
attached = sbx.commands.connect(cat.pid)
check(attached.pid == cat.pid, "commands.connect attaches by pid")
sbx.commands.send_stdin(cat.pid, "ping\n")
sbx.commands.close_stdin(cat.pid)
done = cat.wait()
check(done.exit_code == 0 and done.stdout == "ping\n", "stdin reaches the background command")
check(attached.wait().exit_code == 0, "the connected handle sees the same end")

sleeper = sbx.commands.run("sleep 600", background=True)
check(sbx.commands.kill(sleeper.pid) is True, "commands.kill kills a running command")
try:
    sleeper.wait()
    raise AssertionError("a killed command waited without an error")
except CommandExitException as e:
    check(e.exit_code != 0, "a killed command ends with CommandExitException")
check(sbx.commands.kill(sleeper.pid) is False, "killing it again reports not found")

# Files: multipart and octet-stream uploads, binary-exact reads, list, exists, mkdir,
# rename, remove, watch.
written = sbx.files.write("notes/a.txt", "hello file")
check(isinstance(written, WriteInfo) and written.path == "/home/user/notes/a.txt", "files.write (multipart) returns WriteInfo")
blob = bytes(range(256)) * 16
sbx.files.write("/home/user/bin.dat", io.BytesIO(blob))
check(sbx.files.read("/home/user/bin.dat", format="bytes") == blob, "binary bytes round-trip exactly (octet-stream)")
check(sbx.files.read("notes/a.txt") == "hello file", "files.read returns text")
entries = sbx.files.list("/home/user")
check(all(isinstance(e, EntryInfo) for e in entries), "files.list returns EntryInfo")
kinds = {e.name: e.type for e in entries}
check(kinds.get("notes") == FileType.DIR and kinds.get("bin.dat") == FileType.FILE, "files.list tells files from directories")
check(sbx.files.exists("notes/a.txt") and not sbx.files.exists("nope.txt"), "files.exists")
check(sbx.files.make_dir("made/here") is True, "files.make_dir creates")
check(sbx.files.make_dir("made/here") is False, "files.make_dir reports an existing directory")
moved = sbx.files.rename("notes/a.txt", "made/here/b.txt")
check(moved.path == "/home/user/made/here/b.txt", "files.rename returns the new entry")
check(sbx.files.read("made/here/b.txt") == "hello file", "the moved file keeps its content")
sbx.files.remove("made/here/b.txt")
check(not sbx.files.exists("made/here/b.txt"), "files.remove removes")

watch = sbx.files.watch_dir("/home/user/made")
sbx.files.write("made/seen.txt", "x")
events = []
for _ in range(100):
    events += watch.get_new_events()
    if events:
        break
    time.sleep(0.1)
check(any(e.name == "seen.txt" and e.type in (FilesystemEventType.CREATE, FilesystemEventType.WRITE) for e in events), "files.watch_dir reports the new file")
watch.stop()

# Files as envd 0.6 describes them: entries, metadata, gzip, write_files, list depth.
sbx.files.write("meta/tagged.txt", "tagged", metadata={"author": "sandspec"})
info = sbx.files.get_info("meta/tagged.txt")
check(isinstance(info, EntryInfo) and info.metadata == {"author": "sandspec"}, "files.write(metadata=) surfaces in get_info")
check(info.mode == 0o644 and info.permissions == "-rw-r--r--", "entry mode holds permission bits only")
sbx.files.write("meta/tagged.txt", "untagged")
check(sbx.files.get_info("meta/tagged.txt").metadata is None, "overwriting without metadata clears it")
sbx.files.write("zipped.txt", "squeezed " * 100, gzip=True)
check(sbx.files.read("zipped.txt", gzip=True) == "squeezed " * 100, "gzip on upload and download round-trips")
written = sbx.files.write_files([WriteEntry(path="multi/a.txt", data="A"), WriteEntry(path="multi/b/c.txt", data=b"C")])
check(sorted(w.path for w in written) == ["/home/user/multi/a.txt", "/home/user/multi/b/c.txt"], "files.write_files writes every entry")
deep = [e.path for e in sbx.files.list("multi", depth=2)]
check(deep == ["/home/user/multi/a.txt", "/home/user/multi/b", "/home/user/multi/b/c.txt"], "files.list with depth walks depth first")
sbx.files.remove("never/there.txt")
check(True, "files.remove of a missing path succeeds")
sbx.commands.run("ln -s multi/a.txt link.txt")
linked = sbx.files.get_info("link.txt")
check(linked.type == FileType.FILE and linked.symlink_target == "/home/user/multi/a.txt", "a symlink's entry has its target's type and path")

# Commands: per-command envs, cwd, a timeout, stdin closed, kill by handle.
scoped = sbx.commands.run('echo "$ONLY_HERE"; pwd', envs={"ONLY_HERE": "scoped"}, cwd="/home/user/multi")
check(scoped.stdout.splitlines()[0] == "scoped", "commands.run(envs=) reaches that command")
check(sbx.commands.run('echo "${ONLY_HERE:-unset}"').stdout == "unset\n", "a command's envs do not outlive it")
try:
    sbx.commands.run("sleep 30", timeout=1)
    raise AssertionError("a command past its timeout did not raise")
except Exception as e:
    check("timeout" in type(e).__name__.lower() or "timeout" in str(e).lower(), "commands.run(timeout=) ends a long command with a timeout error")
fed = sbx.commands.run("cat", background=True, stdin=True)
sbx.commands.stream_input(fed.pid, ["one ", b"two\n"])
sbx.commands.close_stdin(fed.pid)
check(fed.wait().stdout == "one two\n", "commands.stream_input sends each chunk in order")
tagged = sbx.commands.run("sleep 600", background=True)
check(tagged.kill() is True, "CommandHandle.kill")

# PTY: a real terminal, resized.
size_lines = []
term = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
sbx.pty.send_stdin(term.pid, b"stty size; exit\n")
ended = term.wait(on_pty=lambda data: size_lines.append(data.decode()))
check(ended.exit_code == 0 and "30 100" in "".join(size_lines), "pty.create, resize and send_stdin on a real terminal")
typed = []
term = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.stream_input(term.pid, [b"echo stream", b"ed-in; exit\n"])
check(term.wait(on_pty=lambda d: typed.append(d.decode())).exit_code == 0 and "streamed-in" in "".join(typed), "pty.stream_input types each chunk")
term = sbx.pty.create(PtySize(rows=24, cols=80))
attached_term = sbx.pty.connect(term.pid)
check(attached_term.pid == term.pid, "pty.connect attaches by pid")
term = sbx.pty.create(PtySize(rows=24, cols=80))
check(sbx.pty.kill(term.pid) is True, "pty.kill")

# Signed file URLs (the access token signs them); E2B_SANDBOX_URL routes by headers, so the
# URL's request carries them.
secure = Sandbox.create(timeout=120, metadata={"run": run_id})
secure.files.write("signed.txt", "signed content")
for url in [secure.download_url("signed.txt"), secure.download_url("signed.txt", use_signature_expiration=60)]:
    req = urllib.request.Request(url, headers={"E2b-Sandbox-Id": secure.sandbox_id, "E2b-Sandbox-Port": "49983"})
    with urllib.request.urlopen(req) as resp:
        check(resp.read() == b"signed content", "download_url is signed with the access token")
expired = secure.download_url("signed.txt", use_signature_expiration=-10)
try:
    urllib.request.urlopen(urllib.request.Request(expired, headers={"E2b-Sandbox-Id": secure.sandbox_id, "E2b-Sandbox-Port": "49983"}))
    raise AssertionError("an expired signature was accepted")
except urllib.error.HTTPError as e:
    check(e.code == 401, "an expired signature is 401")
upload = secure.upload_url("uploaded.txt")
body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"uploaded.txt\"\r\n\r\nup\r\n--b--\r\n"
req = urllib.request.Request(upload, data=body, method="POST", headers={"Content-Type": "multipart/form-data; boundary=b", "E2b-Sandbox-Id": secure.sandbox_id, "E2b-Sandbox-Port": "49983"})
with urllib.request.urlopen(req) as resp:
    check(resp.status == 200 and secure.files.read("uploaded.txt") == "up", "upload_url is signed with the access token")

# A port served inside the sandbox, reached at the host get_host names (routed here by the
# same headers E2B_SANDBOX_URL routes envd by).
secure.files.write("site/hello.txt", "hello from a port")
web = secure.commands.run("python3 -m http.server 8123 --bind 127.0.0.1 --directory site", background=True)
host = secure.get_host(8123)
check(host == f"8123-{secure.sandbox_id}.{secure.sandbox_domain}", "get_host names the port's host")
page = None
for _ in range(100):
    try:
        req = urllib.request.Request(os.environ["E2B_SANDBOX_URL"] + "/hello.txt", headers={"Host": host})
        with urllib.request.urlopen(req) as resp:
            page = resp.read()
        break
    except urllib.error.URLError:
        time.sleep(0.1)
check(page == b"hello from a port", "the port get_host names reaches the sandbox's server")
web.kill()

# Snapshots, forks, metrics, the list's order and filters.
snap = secure.create_snapshot()
check(snap.snapshot_id.startswith("snp_"), "create_snapshot returns its ID")
check(any(s.snapshot_id == snap.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=secure.sandbox_id).next_items()), "list_snapshots by sandbox")
restored = Sandbox.create(snap.snapshot_id, timeout=120, metadata={"run": run_id})
check(restored.files.read("signed.txt") == "signed content", "a sandbox created from a snapshot has its files")
check(Sandbox.delete_snapshot(snap.snapshot_id) is True and Sandbox.delete_snapshot(snap.snapshot_id) is False, "delete_snapshot, then not found")
forks = secure.fork(count=2, timeout=120)
check(len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), "fork(count=2) returns two sandboxes")
forks[0].files.write("signed.txt", "changed in a fork")
check(forks[1].files.read("signed.txt") == "signed content" and secure.files.read("signed.txt") == "signed content", "forks are independent")
metrics = secure.get_metrics()
check(len(metrics) == 1 and metrics[0].cpu_count >= 1 and metrics[0].mem_total > 0, "get_metrics returns a sample")
newest = Sandbox.list(query=SandboxQuery(metadata={"run": run_id})).next_items()
oldest = Sandbox.list(query=SandboxQuery(metadata={"run": run_id}), order="asc").next_items()
check([s.sandbox_id for s in newest] == [s.sandbox_id for s in reversed(oldest)], "list orders newest first, or oldest first with order=asc")
check(Sandbox.list(query=SandboxQuery(metadata={"run": run_id}, template="no-such-template")).next_items() == [], "list filters by template")
check(secure.is_running(), "is_running")
# Egress: what denies is taken (where sandboxes have a network namespace of their own), what
# would let traffic out is refused.
try:
    secure.update_network({"deny_out": ["8.8.8.8"]})
    check(True, "update_network takes a denial")
except SandboxException as e:
    check("host's network" in str(e), "update_network: nothing can be denied without a network namespace")
try:
    secure.update_network({"allow_out": ["1.1.1.1"]})
    raise AssertionError("an egress allowance was taken")
except SandboxException as e:
    check("cannot be honoured" in str(e), "update_network refuses an allowance it cannot honour")
check(restored.beta_pause() is True, "beta_pause pauses")
check(Sandbox.get_info(restored.sandbox_id).state == SandboxState.PAUSED, "a beta-paused sandbox reports paused")
for other in [restored, *forks, secure]:
    other.kill()

# Lifecycle: timeout, list, connect, pause, resume by connect, kill.
sbx.set_timeout(300)
page = Sandbox.list(query=SandboxQuery(metadata={"run": run_id})).next_items()
check([s.sandbox_id for s in page] == [sbx.sandbox_id], "Sandbox.list filters by metadata")
again = Sandbox.connect(sbx.sandbox_id)
check(again.commands.run("echo connected").stdout == "connected\n", "Sandbox.connect to a running sandbox")
check(sbx.pause() is True, "pause")
check(Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, "a paused sandbox reports paused")
resumed = Sandbox.connect(sbx.sandbox_id)
check(Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING, "connect resumes a paused sandbox")
check(resumed.files.read("/home/user/bin.dat", format="bytes") == blob, "files survive pause and resume")

doomed = Sandbox.create(timeout=60, metadata={"run": run_id})
running_cmd = doomed.commands.run("sleep 60", background=True)
doomed.kill()
try:
    running_cmd.wait()
    raise AssertionError("a command of a killed sandbox ended normally")
except TimeoutException as e:
    check("sandbox was killed" in str(e), "a command whose sandbox is killed fails as the sandbox's end")
check(sbx.kill() is True, "kill")
check(Sandbox.kill(sbx.sandbox_id) is False, "a second kill reports not found")
try:
    Sandbox.connect(sbx.sandbox_id)
    raise AssertionError("connect to a killed sandbox succeeded")
except SandboxNotFoundException:
    check(True, "connect after kill raises SandboxNotFoundException")
try:
    Sandbox.get_info(sbx.sandbox_id)
    raise AssertionError("get_info of a killed sandbox succeeded")
except SandboxNotFoundException:
    check(True, "get_info after kill raises SandboxNotFoundException")
try:
    Sandbox.create(api_key="not-a-key")
    raise AssertionError("a wrong key created a sandbox")
except AuthenticationException:
    check(True, "a wrong key raises AuthenticationException")

print("e2b sdk: all checks passed")
