"""The kernel of one code interpreter context: a long-lived Python process inside the sandbox
that runs the code of its context's executions, one at a time, in one namespace that lasts
as long as the process.

The server starts it as a sandbox process (`python3 -c ...`, the bootstrap in
`interpreter.rs`) and writes to its stdin one JSON line of configuration (`token`) followed
by this program. The kernel listens on an ephemeral loopback port inside the sandbox and
says which on its stdout, as the one line `{"sandspec_kernel": 1, "port": N}`; after that its
own stdout and stderr are pipes it reads itself, so that whatever the code (or a process it
starts) writes is reported to the execution that is running.

Each execution is one TCP connection from the server: a JSON line `{"token", "code", "env"}`,
answered by JSON lines in the code interpreter's own shapes (`number_of_executions`,
`stdout`, `stderr`, `result`, `error`) and last `{"type": "sandspec_done"}`. Connections are
taken one after another, so executions of a context never overlap; a connection whose
client has already gone is dropped unrun. SIGINT interrupts the execution that is running
(KeyboardInterrupt) and is ignored between executions.
"""

import ast
import asyncio
import base64
import builtins
import codecs
import datetime
import hmac
import inspect
import json
import linecache
import os
import select
import signal
import socket
import sys
import threading
import traceback
import types

KERNEL_FILE = "<sandspec-kernel>"
MAX_REQUEST = 64 * 1024 * 1024

# MIME types as the code interpreter's `Result` names them; the rest go to `extra`.
FIELDS = [
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
]
# IPython's display protocol: the `_repr_*_` methods an object may have.
REPRS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/pdf", "_repr_pdf_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
]
BINARY = {"image/png", "image/jpeg", "application/pdf"}


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


class Channel:
    """The connection of the execution that is running; writes after its client has gone
    are dropped."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sock = None

    def attach(self, sock):
        with self.lock:
            self.sock = sock

    def detach(self):
        with self.lock:
            self.sock = None

    def send(self, message):
        line = (json.dumps(message, ensure_ascii=True) + "\n").encode()
        with self.lock:
            if self.sock is None:
                return
            try:
                self.sock.sendall(line)
            except OSError:
                self.sock = None


CHANNEL = Channel()


class Capture:
    """A file descriptor (1 or 2) turned into a pipe whose bytes are reported as `stdout` or
    `stderr` of the running execution. `sync` returns once everything written to the
    descriptor before it has been reported."""

    def __init__(self, fd, kind):
        self.kind = kind
        self.fd = fd
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self.read = read
        self.serial = 0
        self.seen = threading.Condition()
        self.last_seen = 0
        threading.Thread(target=self.pump, daemon=True).start()

    def mark(self, n):
        return b"\x1esandspec-sync-%d\x1f" % n

    def sync(self, wait=2.0):
        self.serial += 1
        n = self.serial
        try:
            os.write(self.fd, self.mark(n))
        except OSError:
            return
        with self.seen:
            self.seen.wait_for(lambda: self.last_seen >= n, timeout=wait)

    def pump(self):
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = b""
        while True:
            try:
                data = os.read(self.read, 65536)
            except OSError:
                return
            if not data:
                return
            pending += data
            # What else is already there joins this chunk, as an output stream's flush would.
            while len(pending) < 65536:
                ready, _, _ = select.select([self.read], [], [], 0.005)
                if not ready:
                    break
                more = os.read(self.read, 65536)
                if not more:
                    break
                pending += more
            while True:
                start = pending.find(b"\x1esandspec-sync-")
                if start < 0:
                    # Keep what could be the start of a mark for the next read.
                    keep = 0
                    for i in range(1, min(len(pending), 32) + 1):
                        if b"\x1esandspec-sync-".startswith(pending[-i:]):
                            keep = i
                    text = decoder.decode(pending[: len(pending) - keep])
                    pending = pending[len(pending) - keep :]
                    self.emit(text)
                    break
                end = pending.find(b"\x1f", start)
                if end < 0:
                    self.emit(decoder.decode(pending[:start]))
                    pending = pending[start:]
                    break
                self.emit(decoder.decode(pending[:start]))
                try:
                    n = int(pending[start + len(b"\x1esandspec-sync-") : end])
                except ValueError:
                    n = 0
                pending = pending[end + 1 :]
                with self.seen:
                    self.last_seen = max(self.last_seen, n)
                    self.seen.notify_all()

    def emit(self, text):
        if text:
            CHANNEL.send({"type": self.kind, "text": text, "timestamp": now()})


def mime_bundle(obj):
    data = {}
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method) and not isinstance(obj, type):
        try:
            bundle = method()
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            if isinstance(bundle, dict):
                data.update(bundle)
        except Exception:
            pass
    for mime, name in REPRS:
        if mime in data:
            continue
        method = getattr(obj, name, None)
        if not callable(method) or isinstance(obj, type):
            continue
        try:
            value = method()
        except Exception:
            continue
        if isinstance(value, tuple):
            value = value[0]
        if value is not None:
            data[mime] = value
    for mime in BINARY:
        if isinstance(data.get(mime), (bytes, bytearray)):
            data[mime] = base64.b64encode(bytes(data[mime])).decode("ascii")
    if "text/plain" not in data:
        try:
            data["text/plain"] = repr(obj)
        except Exception as e:
            data["text/plain"] = "<repr failed: %s>" % type(e).__name__
    return data


def publish(obj, main):
    data = mime_bundle(obj)
    out = {"type": "result"}
    text = data.pop("text/plain", None)
    # As the code interpreter's `Result`: a string's quotes are not part of its text.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if text is not None:
        out["text"] = text
    for mime, field in FIELDS[1:]:
        value = data.pop(mime, None)
        if value is not None:
            out[field] = value
    out["extra"] = {k: v for k, v in data.items() if isinstance(k, str)}
    out["is_main_result"] = main
    CHANNEL.send(out)


def settle():
    """Reports what the code wrote so far before what comes next, as a kernel flushes its
    output streams before it publishes a result or an error."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    for capture in CAPTURES:
        capture.sync()


def display(*objs, **_):
    for obj in objs:
        settle()
        publish(obj, False)


CAPTURES = []


class Kernel:
    def __init__(self, token):
        self.token = token
        self.count = 0
        self.executing = False
        self.loop = None
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        builtins.display = display

    def on_sigint(self, signum, frame):
        if self.executing:
            raise KeyboardInterrupt

    def run(self, code_object):
        value = eval(code_object, self.namespace)
        if inspect.iscoroutine(value):
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            value = self.loop.run_until_complete(value)
        return value

    def report(self, exc):
        settle()
        if isinstance(exc, SyntaxError):
            text = "".join(traceback.format_exception_only(type(exc), exc))
        else:
            # The code's frames only: not the kernel's around it, nor its SIGINT handler.
            te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
            te.stack = traceback.StackSummary.from_list(
                [f for f in te.stack if f.filename != KERNEL_FILE]
            )
            text = "".join(te.format())
        CHANNEL.send(
            {
                "type": "error",
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": text,
            }
        )

    def execute(self, code):
        self.count += 1
        filename = "<cell-%d>" % self.count
        flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
        # An interrupt counts from the moment the client is told the execution began: the
        # server interrupts as soon as that client leaves, which may be before the code runs.
        self.executing = True
        try:
            CHANNEL.send({"type": "number_of_executions", "execution_count": self.count})
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST | flags)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            if tree.body:
                self.run(compile(tree, filename, "exec", flags))
            if last is not None:
                value = self.run(compile(last, filename, "eval", flags))
                self.executing = False
                if value is not None:
                    builtins._ = value
                    settle()
                    publish(value, True)
        except BaseException as e:
            self.executing = False
            self.report(e)
        finally:
            self.executing = False

    def serve(self, listener):
        while True:
            conn, _ = listener.accept()
            try:
                self.handle(conn)
            except Exception:
                pass
            finally:
                CHANNEL.detach()
                try:
                    conn.close()
                except OSError:
                    pass

    def handle(self, conn):
        conn.settimeout(30)
        reader = conn.makefile("rb")
        line = reader.readline(MAX_REQUEST)
        request = json.loads(line)
        if not hmac.compare_digest(str(request.get("token", "")), self.token):
            return
        conn.settimeout(None)
        # A client that went away while this execution waited for the one before it: the
        # server closed the connection, so the code is not run.
        ready, _, _ = select.select([conn], [], [], 0)
        if ready and conn.recv(1, socket.MSG_PEEK) == b"":
            return
        CHANNEL.attach(conn)
        env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.execute(str(request.get("code", "")))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            settle()
            CHANNEL.send({"type": "sandspec_done"})


def main(config):
    kernel = Kernel(str(config["token"]))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    signal.signal(signal.SIGINT, kernel.on_sigint)
    # A process starts with the signal mask of the thread that started it: SIGINT must reach
    # this one whatever that thread blocked.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # Code reads no input: stdin is at its end, as a kernel's is without an input channel.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    announce = os.fdopen(os.dup(1), "w")
    CAPTURES.extend([Capture(1, "stdout"), Capture(2, "stderr")])
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stdin = open(0, "r", closefd=False)
    announce.write(json.dumps({"sandspec_kernel": 1, "port": port}) + "\n")
    announce.close()
    kernel.serve(listener)


main(CONFIG)  # noqa: F821 (given by the bootstrap)
