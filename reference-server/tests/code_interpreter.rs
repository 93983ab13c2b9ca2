//! E2B's code interpreter on the reference server: sandboxes made from its template serve
//! `/execute` and the contexts API on port 49999, with a Python kernel per context inside the
//! sandbox; the defects that break it; and the real `e2b-code-interpreter` SDK (installed from
//! PyPI into a venv; required under `CI`) running stateful Python against it.

use crate::e2b::venv;
use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use support::{ALICE, Reply, TestApp, spawn_app};

/// The virtualenv with E2B's code interpreter SDK and the E2B SDK it builds on, pinned.
const CODE_INTERPRETER: (&str, &[&str]) = (
    "code-interpreter-venv",
    &["e2b-code-interpreter==2.11.5", "e2b==2.63.0"],
);

/// Creates a code interpreter sandbox through `/v2/sandboxes`: (sandboxID, envdAccessToken).
async fn create(app: &TestApp, env: Value) -> (String, String) {
    let reply = Reply::read(
        app.client
            .post(app.url("/v2/sandboxes"))
            .header("X-API-Key", ALICE)
            .json(&json!({"templateID": "code-interpreter-v1", "timeout": 300, "envVars": env}))
            .send()
            .await
            .expect("send"),
    )
    .await;
    let created = reply.ok(201);
    assert_eq!(created["templateID"], "code-interpreter-v1");
    (
        created["sandboxID"].as_str().expect("sandboxID").to_owned(),
        created["envdAccessToken"].as_str().unwrap_or("").to_owned(),
    )
}

/// A request to the sandbox's port 49999, routed as the SDK routes it.
fn ci(app: &TestApp, sandbox: &str, method: Method, path: &str) -> reqwest::RequestBuilder {
    app.client
        .request(method, app.url(path))
        .header("E2b-Sandbox-Id", sandbox)
        .header("E2b-Sandbox-Port", "49999")
}

/// One execution: the status and the JSON lines of its body.
async fn execute(app: &TestApp, sandbox: &str, body: Value) -> (u16, Vec<Value>) {
    let reply = Reply::read(
        ci(app, sandbox, Method::POST, "/execute")
            .json(&body)
            .send()
            .await
            .expect("send"),
    )
    .await;
    let lines = String::from_utf8_lossy(&reply.body)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or(Value::String(l.to_owned())))
        .collect();
    (reply.status.as_u16(), lines)
}

/// The lines of a successful execution, checked to end with `end_of_execution` alone.
#[track_caller]
fn ended(reply: (u16, Vec<Value>)) -> Vec<Value> {
    let (status, lines) = reply;
    assert_eq!(status, 200, "{lines:?}");
    assert_eq!(
        lines.last(),
        Some(&json!({"type": "end_of_execution"})),
        "{lines:?}"
    );
    lines
        .into_iter()
        .filter(|l| l["type"] != "keepalive" && l["type"] != "end_of_execution")
        .collect()
}

fn of_type<'a>(lines: &'a [Value], kind: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["type"] == kind).collect()
}

fn text_of(lines: &[Value], kind: &str) -> String {
    of_type(lines, kind)
        .iter()
        .filter_map(|l| l["text"].as_str())
        .collect()
}

fn main_result(lines: &[Value]) -> Option<String> {
    of_type(lines, "result")
        .into_iter()
        .find(|l| l["is_main_result"] == true)
        .and_then(|l| l["text"].as_str().map(str::to_owned))
}

async fn new_context(app: &TestApp, sandbox: &str, body: Value) -> Value {
    Reply::read(
        ci(app, sandbox, Method::POST, "/contexts")
            .json(&body)
            .send()
            .await
            .expect("send"),
    )
    .await
    .ok(200)
}

async fn context_ids(app: &TestApp, sandbox: &str) -> Vec<String> {
    let listed = Reply::read(
        ci(app, sandbox, Method::GET, "/contexts")
            .send()
            .await
            .expect("send"),
    )
    .await
    .ok(200);
    listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|c| c["id"].as_str().expect("id").to_owned())
        .collect()
}

#[tokio::test]
async fn executions_keep_state_and_stream_what_the_code_does() {
    let app = spawn_app(|_| {}).await;
    let (sbx, token) = create(&app, json!({"SANDSPEC_CI": "from envVars"})).await;

    let health = Reply::read(ci(&app, &sbx, Method::GET, "/health").send().await.unwrap()).await;
    assert_eq!(health.ok(200), json!("OK"));

    let first = ended(execute(&app, &sbx, json!({"code": "x = 40"})).await);
    assert_eq!(
        first,
        [json!({"type": "number_of_executions", "execution_count": 1})]
    );
    let second = ended(
        execute(
            &app,
            &sbx,
            json!({"code": "x + 2", "context_id": null, "language": null, "env_vars": null}),
        )
        .await,
    );
    assert_eq!(second[0]["execution_count"], 2);
    assert_eq!(
        of_type(&second, "result"),
        [&json!({"type": "result", "text": "42", "extra": {}, "is_main_result": true})]
    );

    let streams = ended(
        execute(
            &app,
            &sbx,
            json!({"code": "import sys, subprocess\nprint('out')\nprint('err', file=sys.stderr)\nsubprocess.run(['echo', 'child'])\n'text'"}),
        )
        .await,
    );
    assert_eq!(text_of(&streams, "stdout"), "out\nchild\n", "{streams:?}");
    assert_eq!(text_of(&streams, "stderr"), "err\n");
    assert_eq!(main_result(&streams).as_deref(), Some("text"));
    assert!(
        of_type(&streams, "stdout")[0]["timestamp"]
            .as_str()
            .is_some_and(|t| t.contains('T')),
        "{streams:?}"
    );

    let failed = ended(
        execute(
            &app,
            &sbx,
            json!({"code": "print('before')\nraise ValueError('bad value')\nprint('after')"}),
        )
        .await,
    );
    assert_eq!(text_of(&failed, "stdout"), "before\n");
    let errors = of_type(&failed, "error");
    assert_eq!(errors.len(), 1, "{failed:?}");
    assert_eq!(errors[0]["name"], "ValueError");
    assert_eq!(errors[0]["value"], "bad value");
    let traceback = errors[0]["traceback"].as_str().unwrap();
    assert!(
        traceback.contains("ValueError: bad value") && !traceback.contains("sandspec-kernel"),
        "{traceback}"
    );
    let syntax = ended(execute(&app, &sbx, json!({"code": "def f(:"})).await);
    assert_eq!(of_type(&syntax, "error")[0]["name"], "SyntaxError");

    let shown = ended(
        execute(
            &app,
            &sbx,
            json!({"code": "class Page:\n    def _repr_html_(self):\n        return '<b>hi</b>'\n    def __repr__(self):\n        return 'Page'\ndisplay(1)\nPage()"}),
        )
        .await,
    );
    let results = of_type(&shown, "result");
    assert_eq!(results.len(), 2, "{shown:?}");
    assert_eq!(
        (&results[0]["text"], &results[0]["is_main_result"]),
        (&json!("1"), &json!(false))
    );
    assert_eq!(
        (&results[1]["html"], &results[1]["text"]),
        (&json!("<b>hi</b>"), &json!("Page"))
    );

    // The kernel is one of the sandbox's processes: its environment, its files, its home.
    let env = ended(
        execute(
            &app,
            &sbx,
            json!({"code": "import os\nopen('from-kernel.txt', 'w').write(os.environ['SANDSPEC_CI'])\n(os.environ['SANDSPEC_CI'], os.environ.get('PER_RUN'))", "env_vars": {"PER_RUN": "only now"}}),
        )
        .await,
    );
    assert_eq!(
        main_result(&env).as_deref(),
        Some("('from envVars', 'only now')")
    );
    let after = ended(execute(&app, &sbx, json!({"code": "os.environ.get('PER_RUN')"})).await);
    assert_eq!(main_result(&after), None, "{after:?}");
    let file = Reply::read(
        app.client
            .get(app.url("/files?path=/home/user/from-kernel.txt"))
            .header("E2b-Sandbox-Id", &sbx)
            .header("E2b-Sandbox-Port", "49983")
            .header("X-Access-Token", &token)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(file.status.as_u16(), 200);
    assert_eq!(&file.body[..], b"from envVars");

    // The kernels are not envd's processes.
    let listed = Reply::read(
        app.client
            .post(app.url("/process.Process/List"))
            .header("E2b-Sandbox-Id", &sbx)
            .header("E2b-Sandbox-Port", "49983")
            .header("X-Access-Token", &token)
            .header("Content-Type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(listed.ok(200), json!({"processes": []}));
}

#[tokio::test]
async fn contexts_are_isolated_listed_restarted_and_removed() {
    let app = spawn_app(|_| {}).await;
    let (sbx, _) = create(&app, json!({})).await;
    let a = new_context(&app, &sbx, json!({"language": "python"})).await;
    let b = new_context(&app, &sbx, json!({"cwd": "/home/user"})).await;
    assert_eq!(
        (&a["language"], &a["cwd"]),
        (&json!("python"), &json!("/home/user"))
    );
    let (a, b) = (
        a["id"].as_str().unwrap().to_owned(),
        b["id"].as_str().unwrap().to_owned(),
    );
    assert_ne!(a, b);

    ended(execute(&app, &sbx, json!({"code": "x = 'a'", "context_id": a})).await);
    let in_b = ended(execute(&app, &sbx, json!({"code": "x", "context_id": b})).await);
    assert_eq!(of_type(&in_b, "error")[0]["name"], "NameError", "{in_b:?}");
    let in_default = ended(execute(&app, &sbx, json!({"code": "x"})).await);
    assert_eq!(of_type(&in_default, "error")[0]["name"], "NameError");
    let again = ended(execute(&app, &sbx, json!({"code": "x", "context_id": a})).await);
    assert_eq!(main_result(&again).as_deref(), Some("a"));

    // The default context is listed beside the two.
    let listed = context_ids(&app, &sbx).await;
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(listed.contains(&a) && listed.contains(&b));

    let restarted = Reply::read(
        ci(&app, &sbx, Method::POST, &format!("/contexts/{a}/restart"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(restarted.ok(200), Value::Null);
    let fresh = ended(execute(&app, &sbx, json!({"code": "x", "context_id": a})).await);
    assert_eq!(of_type(&fresh, "error")[0]["name"], "NameError");

    let removed = Reply::read(
        ci(&app, &sbx, Method::DELETE, &format!("/contexts/{b}"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(removed.status.as_u16(), 200);
    assert!(!context_ids(&app, &sbx).await.contains(&b));
    let gone = execute(&app, &sbx, json!({"code": "1", "context_id": b})).await;
    assert_eq!(gone.0, 404);
    assert_eq!(gone.1, [json!(format!("Context {b} not found"))]);

    // Bad input: a clear error, nothing started.
    let before = context_ids(&app, &sbx).await.len();
    let both = execute(
        &app,
        &sbx,
        json!({"code": "1", "context_id": a, "language": "python"}),
    )
    .await;
    assert_eq!(both.0, 400);
    let js = execute(&app, &sbx, json!({"code": "1", "language": "js"})).await;
    assert_eq!(js.0, 400, "{:?}", js.1);
    assert!(
        js.1[0].as_str().unwrap().contains("javascript"),
        "{:?}",
        js.1
    );
    for body in [
        json!({}),
        json!({"code": 1}),
        json!({"code": "1", "env_vars": {"A": 1}}),
    ] {
        assert_eq!(execute(&app, &sbx, body.clone()).await.0, 422, "{body}");
    }
    let outside = Reply::read(
        ci(&app, &sbx, Method::POST, "/contexts")
            .json(&json!({"cwd": "/etc"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(outside.status.as_u16(), 400);
    assert_eq!(context_ids(&app, &sbx).await.len(), before);
    let unknown = Reply::read(
        ci(&app, &sbx, Method::GET, "/nothing")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(unknown.status.as_u16(), 404);
}

/// Starts an execution that sleeps and leaves it after its first line: (when it was left).
async fn abandon_a_long_execution(app: &TestApp, sandbox: &str) -> Instant {
    let mut response = ci(app, sandbox, Method::POST, "/execute")
        .json(&json!({"code": "import time\nwhile True:\n    time.sleep(0.1)"}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status().as_u16(), 200);
    let first = response.chunk().await.expect("read").expect("a first line");
    assert!(
        String::from_utf8_lossy(&first).contains("number_of_executions"),
        "{first:?}"
    );
    drop(response);
    Instant::now()
}

/// Whether an execution that waits behind an abandoned one runs within `limit`.
async fn next_runs_within(app: &TestApp, sandbox: &str, limit: Duration) -> bool {
    let left = abandon_a_long_execution(app, sandbox).await;
    let quick = ci(app, sandbox, Method::POST, "/execute")
        .json(&json!({"code": "'next'"}))
        .send();
    match tokio::time::timeout(limit, async {
        Reply::read(quick.await.expect("send")).await
    })
    .await
    {
        Ok(reply) => {
            let text = String::from_utf8_lossy(&reply.body).into_owned();
            assert!(text.contains("\"next\""), "{text}");
            eprintln!("ran {:?} after the client left", left.elapsed());
            true
        }
        Err(_) => false,
    }
}

#[tokio::test]
async fn a_client_that_leaves_interrupts_its_execution() {
    let app = spawn_app(|_| {}).await;
    let (sbx, _) = create(&app, json!({})).await;
    assert!(next_runs_within(&app, &sbx, Duration::from_secs(20)).await);
    // The interrupted code got KeyboardInterrupt; the namespace is kept.
    ended(execute(&app, &sbx, json!({"code": "kept = 1"})).await);
    let kept = ended(execute(&app, &sbx, json!({"code": "kept"})).await);
    assert_eq!(main_result(&kept).as_deref(), Some("1"));
}

#[tokio::test]
async fn a_kernel_that_dies_is_restarted_with_a_fresh_namespace() {
    let app = spawn_app(|_| {}).await;
    let (sbx, _) = create(&app, json!({})).await;
    ended(execute(&app, &sbx, json!({"code": "y = 1"})).await);
    let died = ended(execute(&app, &sbx, json!({"code": "import os\nos._exit(3)"})).await);
    assert_eq!(
        of_type(&died, "error")[0]["name"],
        "ContextRestarting",
        "{died:?}"
    );
    let fresh = ended(execute(&app, &sbx, json!({"code": "y"})).await);
    assert_eq!(of_type(&fresh, "error")[0]["name"], "NameError");
    let works = ended(execute(&app, &sbx, json!({"code": "2 * 21"})).await);
    assert_eq!(main_result(&works).as_deref(), Some("42"));
}

#[tokio::test]
async fn a_base_sandbox_does_not_serve_the_code_interpreter() {
    let app = spawn_app(|_| {}).await;
    let reply = Reply::read(
        app.client
            .post(app.url("/sandboxes"))
            .header("X-API-Key", ALICE)
            .json(&json!({"templateID": "base", "timeout": 60}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let sbx = reply.ok(201)["sandboxID"].as_str().unwrap().to_owned();
    let (status, _) = execute(&app, &sbx, json!({"code": "1"})).await;
    assert_eq!(
        status, 502,
        "port 49999 of a base sandbox is the sandbox's own"
    );
}

#[cfg(feature = "defects")]
async fn with_defect(name: &str) -> TestApp {
    spawn_app(|c| c.defects = reference_server::defects::Defects::parse([name]).unwrap()).await
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_ci_state_lost_forgets_between_executions() {
    let app = with_defect("e2b-ci-state-lost").await;
    let (sbx, _) = create(&app, json!({})).await;
    ended(execute(&app, &sbx, json!({"code": "x = 40"})).await);
    let second = ended(execute(&app, &sbx, json!({"code": "x + 2"})).await);
    assert_eq!(of_type(&second, "error")[0]["name"], "NameError");
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_ci_contexts_share_state_leaks_between_contexts() {
    let app = with_defect("e2b-ci-contexts-share-state").await;
    let (sbx, _) = create(&app, json!({})).await;
    let a = new_context(&app, &sbx, json!({})).await["id"].clone();
    let b = new_context(&app, &sbx, json!({})).await["id"].clone();
    ended(execute(&app, &sbx, json!({"code": "x = 1", "context_id": a})).await);
    let in_b = ended(execute(&app, &sbx, json!({"code": "x", "context_id": b})).await);
    assert_eq!(main_result(&in_b).as_deref(), Some("1"));
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_ci_error_as_stderr_reports_no_error() {
    let app = with_defect("e2b-ci-error-as-stderr").await;
    let (sbx, _) = create(&app, json!({})).await;
    let failed = ended(execute(&app, &sbx, json!({"code": "raise ValueError('bad')"})).await);
    assert!(of_type(&failed, "error").is_empty(), "{failed:?}");
    assert!(text_of(&failed, "stderr").contains("ValueError: bad"));
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_ci_env_vars_dropped_hides_envvars_from_kernels() {
    let app = with_defect("e2b-ci-env-vars-dropped").await;
    let (sbx, _) = create(&app, json!({"SANDSPEC_CI": "v"})).await;
    let lines = ended(
        execute(
            &app,
            &sbx,
            json!({"code": "import os\nos.environ.get('SANDSPEC_CI')"}),
        )
        .await,
    );
    assert_eq!(main_result(&lines), None);
}

#[cfg(feature = "defects")]
#[tokio::test]
async fn defect_ci_disconnect_not_interrupted_holds_the_context() {
    let app = with_defect("e2b-ci-disconnect-not-interrupted").await;
    let (sbx, _) = create(&app, json!({})).await;
    assert!(!next_runs_within(&app, &sbx, Duration::from_secs(12)).await);
}

/// The real `e2b-code-interpreter` SDK (PyPI, pinned with the E2B SDK it builds on) creates a
/// sandbox from its default template through `E2B_API_URL` and `E2B_SANDBOX_URL` and runs
/// stateful Python: `tests/code_interpreter_sdk.py` asserts each call, with the SDK's own
/// types (`Execution`, `Result`, `Logs`, `ExecutionError`, `Context`).
#[test]
fn code_interpreter_sdk_runs_stateful_python() {
    let (name, packages) = CODE_INTERPRETER;
    let Some(python) = venv::executable(name, packages, "python") else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = rt.block_on(spawn_app(|_| {}));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/code_interpreter_sdk.py");
    let started = Instant::now();
    let output = Command::new(&python)
        .arg(&script)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("E2B_API_URL", &app.base)
        .env("E2B_SANDBOX_URL", &app.base)
        .env("E2B_API_KEY", ALICE)
        .env("E2B_DOMAIN", "sandbox.test")
        .env(
            "SANDSPEC_E2B_DOC",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/profiles/e2b.md"),
        )
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "SDK script failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("e2b-code-interpreter sdk: all checks passed"),
        "stdout:\n{stdout}"
    );
    eprintln!("the SDK script ran in {:?}", started.elapsed());
    drop(app);
}
