"""The real `e2b-code-interpreter` Python SDK against the sandspec reference server.

Run by `tests/code_interpreter.rs` with E2B_API_URL and E2B_SANDBOX_URL set to the server's
base URL and E2B_API_KEY to a principal's token. `Sandbox.create()` makes a sandbox from the
SDK's default template; `run_code` runs stateful Python in it, with results, logs and errors
as the SDK's own types; contexts are created, isolated, listed, restarted and removed; a
`timeout` surfaces as the SDK's TimeoutException and the context is usable afterwards. Every
public method the SDK adds to E2B's `Sandbox` must have a row (`code_interpreter.Sandbox`) in
the SDK method table of SANDSPEC_E2B_DOC when it is given. Any failed check raises.
"""

import inspect
import os
import re
import time

import e2b
from e2b import InvalidArgumentException, NotFoundException, TimeoutException
from e2b_code_interpreter import (
    Context,
    Execution,
    ExecutionError,
    Logs,
    OutputMessage,
    Result,
    Sandbox,
)
from e2b_code_interpreter.constants import DEFAULT_TEMPLATE


def check(condition, what):
    if not condition:
        raise AssertionError(what)
    print(f"ok: {what}")


def public_methods(cls):
    return {
        name
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name, None))
    }


added = sorted(public_methods(Sandbox) - public_methods(e2b.Sandbox))
check(
    added == [
        "create_code_context",
        "list_code_contexts",
        "remove_code_context",
        "restart_code_context",
        "run_code",
    ],
    f"the SDK adds the code interpreter's methods to Sandbox: {added}",
)
doc = os.environ.get("SANDSPEC_E2B_DOC")
if doc:
    text = open(doc, encoding="utf-8").read()
    section = text.split("\n## SDK methods\n", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].strip("`") == "code_interpreter.Sandbox":
            rows.update(re.findall(r"`([a-z_]+)`", cells[1]))
    missing = sorted(set(added) - rows)
    check(not missing, f"every method the SDK adds has a row in the SDK method table (missing: {missing})")

sbx = Sandbox.create(timeout=180, metadata={"purpose": "code-interpreter-sdk"})
try:
    info = sbx.get_info()
    check(info.template_id == DEFAULT_TEMPLATE, f"Sandbox.create() uses the default template {info.template_id}")

    first = sbx.run_code("x = 41")
    check(isinstance(first, Execution), "run_code returns an Execution")
    check(first.results == [] and first.error is None, "an assignment has no result and no error")
    check(first.execution_count == 1, f"its execution count is 1 ({first.execution_count})")
    second = sbx.run_code("x + 1")
    check(second.text == "42", f"the state is kept: x + 1 is {second.text!r}")
    check(second.execution_count == 2, "the execution count goes on")
    main = second.results[0]
    check(isinstance(main, Result) and main.is_main_result, "the last expression is the main Result")
    check(list(main.formats()) == ["text"], f"its formats: {list(main.formats())}")

    seen = {"out": [], "err": [], "results": [], "errors": []}
    logs = sbx.run_code(
        "import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n'done'",
        on_stdout=lambda m: seen["out"].append(m),
        on_stderr=lambda m: seen["err"].append(m),
        on_result=lambda r: seen["results"].append(r),
    )
    check(isinstance(logs.logs, Logs), "logs are Logs")
    check("".join(logs.logs.stdout) == "hello\n", f"stdout: {logs.logs.stdout}")
    check("".join(logs.logs.stderr) == "oops\n", f"stderr: {logs.logs.stderr}")
    check(
        seen["out"] and all(isinstance(m, OutputMessage) and not m.error for m in seen["out"]),
        "on_stdout gets OutputMessages",
    )
    check(seen["err"] and all(m.error for m in seen["err"]), "on_stderr gets error OutputMessages")
    check([r.text for r in seen["results"]] == ["done"], "on_result gets the result")
    check(logs.text == "done", "a string's text has no quotes")

    failed = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=lambda e: seen["errors"].append(e))
    error = failed.error
    check(isinstance(error, ExecutionError), "an exception is an ExecutionError")
    check(error.name == "ZeroDivisionError" and error.value == "division by zero", f"{error.name}: {error.value}")
    check("return 1 / 0" in error.traceback, "the traceback shows the line")
    check(seen["errors"] and seen["errors"][0].name == "ZeroDivisionError", "on_error gets it")
    check(sbx.run_code("x").text == "41", "an error loses nothing")

    env = sbx.run_code("import os\nos.environ.get('SANDSPEC_RUN')", envs={"SANDSPEC_RUN": "yes"})
    check(env.text == "yes", "envs reach the code")
    check(sbx.run_code("os.environ.get('SANDSPEC_RUN')").text is None, "and only that execution")

    html = sbx.run_code(
        "class Page:\n    def _repr_html_(self):\n        return '<p>page</p>'\nPage()"
    )
    check(html.results[0].html == "<p>page</p>", "a text/html representation is the result's html")
    check("html" in html.results[0].formats(), "and one of its formats")

    sbx.files.write("data/input.txt", "from the files API")
    read = sbx.run_code("open('data/input.txt').read()")
    check(read.text == "from the files API", "the kernel sees the sandbox's files from its home")
    sbx.run_code("open('from_kernel.txt', 'w').write('written by code')")
    check(sbx.files.read("from_kernel.txt") == "written by code", "the files API sees what code wrote")

    ctx = sbx.create_code_context()
    check(isinstance(ctx, Context), "create_code_context returns a Context")
    check(ctx.language == "python" and ctx.cwd == "/home/user", f"{ctx.language} in {ctx.cwd}")
    sbx.run_code("y = 'in the context'", context=ctx)
    check(sbx.run_code("y", context=ctx).text == "in the context", "a context keeps its state")
    other = sbx.run_code("y")
    check(other.error is not None and other.error.name == "NameError", "the default context does not see it")
    check(sbx.run_code("x", context=ctx).error.name == "NameError", "nor does the context see the default's")
    sub = sbx.create_code_context(cwd="/home/user/data", language="python")
    check(sbx.run_code("open('input.txt').read()", context=sub).text == "from the files API", "a context's cwd")
    ids = [c.id for c in sbx.list_code_contexts()]
    check(ctx.id in ids and sub.id in ids and len(ids) == 3, f"list_code_contexts: {len(ids)} contexts")
    sbx.restart_code_context(ctx)
    check(sbx.run_code("y", context=ctx).error.name == "NameError", "a restarted context starts afresh")
    sbx.remove_code_context(sub.id)
    check(sub.id not in [c.id for c in sbx.list_code_contexts()], "a removed context is not listed")
    try:
        sbx.run_code("1", context=sub)
        check(False, "code in a removed context must fail")
    except NotFoundException:
        check(True, "code in a removed context is NotFoundException")
    try:
        sbx.run_code("1", context=ctx, language="python")
        check(False, "a context and a language at once must fail")
    except InvalidArgumentException:
        check(True, "a context and a language at once is InvalidArgumentException")
    check(sbx.run_code("1 + 1", language="python").text == "2", "language='python' runs in the default context")

    started = time.monotonic()
    try:
        sbx.run_code("import time\ntime.sleep(60)", timeout=2)
        check(False, "a run past its timeout must fail")
    except TimeoutException:
        check(time.monotonic() - started < 10, "a run past its timeout is TimeoutException")
    started = time.monotonic()
    after = sbx.run_code("x")
    check(after.text == "41", "after the timeout the context runs code again, state kept")
    print(f"the next run answered {time.monotonic() - started:.1f}s after the timeout")
finally:
    sbx.kill()

try:
    sbx.run_code("1")
    check(False, "code in a killed sandbox must fail")
except TimeoutException:
    check(True, "code in a killed sandbox fails as the SDK reports a gone sandbox")

print("e2b-code-interpreter sdk: all checks passed")
