"""The real E2B Python SDK against the sandspec reference server.

Run by `tests/e2b.rs` with E2B_API_URL and E2B_SANDBOX_URL set to the server's base URL and
E2B_API_KEY to a principal's token. Every call must succeed with the SDK's own types; a killed
sandbox and a wrong key must surface as the SDK's own exceptions. Any failed check raises.
"""

import io
import time
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
    SandboxNotFoundException,
    SandboxQuery,
    WriteInfo,
)
from e2b.sandbox.sandbox_api import SandboxState


def check(condition, what):
    if not condition:
        raise AssertionError(what)
    print(f"ok: {what}")


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
