//! The tool map: how one sandbox MCP server's tools carry the actions the MCP profile's
//! scenarios take (create, connect, run a command, start a task, kill), how the server is told
//! its control plane, and where the handle is in each result. Format: `docs/profiles/mcp.md`.
//!
//! Arguments are JSON; a string that is exactly `{{param}}` is replaced by the scenario's
//! value of that parameter, type and all, and the key is left out when the scenario gives no
//! such value. Everything else is sent as written.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};

/// The maps that ship with the suite, by name: the reference MCP server's (the default) and
/// those of the published servers the suite runs (`docs/findings/`).
const BUILT_IN: &[(&str, &str)] = &[
    ("reference", include_str!("../../tool-maps/reference.yaml")),
    (
        "agent-sandbox-client",
        include_str!("../../tool-maps/agent-sandbox-client.yaml"),
    ),
    (
        "code-sandbox-mcp",
        include_str!("../../tool-maps/code-sandbox-mcp.yaml"),
    ),
    (
        "e2b-mcp-server",
        include_str!("../../tool-maps/e2b-mcp-server.yaml"),
    ),
];

/// The parameters a scenario may give an action, and so the only placeholders a map may use.
/// `code` is a `run`'s action in Python, for a server whose tool runs code, not commands.
pub const PARAMS: &[&str] = &[
    "sandbox",
    "timeout_s",
    "cpu",
    "memory_mb",
    "command",
    "code",
];

/// One server's tool map.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolMap {
    /// What reports call the map.
    pub name: String,
    pub env: EnvNames,
    /// A JSON pointer to a string holding the result as JSON text, for servers whose
    /// framework wraps a tool's text answer (FastMCP's `{"result": "<text>"}`): the value
    /// judged is that text, parsed.
    #[serde(default)]
    pub unwrap: Option<String>,
    pub create: Binding,
    /// Absent for a server that cannot reach a sandbox it did not create.
    #[serde(default)]
    pub connect: Option<Binding>,
    #[serde(default)]
    pub run: Option<Binding>,
    #[serde(default)]
    pub start_task: Option<Binding>,
    /// Absent for a server that has no tool to kill a sandbox.
    #[serde(default)]
    pub kill: Option<Binding>,
}

/// How the server is told its control plane.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvNames {
    /// The variable that gets the control plane's base URL; may be left out with `domain`.
    #[serde(default)]
    pub url: String,
    /// The variable that gets the API key.
    pub key: String,
    /// The variable that gets the base URL sandboxes are reached at (E2B's
    /// `E2B_SANDBOX_URL`): the same URL, where envd and the sandbox's other ports are
    /// reached with the routing headers.
    #[serde(default)]
    pub sandbox_url: Option<String>,
    /// For a server that reaches a deployment only by E2B's host names (`api.<domain>`,
    /// `<port>-<sandbox>.<domain>`): the variable that gets the domain. The run then starts
    /// the E2B router for each session and gives the server `HTTPS_PROXY` (the router) and
    /// `SSL_CERT_FILE` (its CA); with `--envd-domain` the server gets that domain instead.
    #[serde(default)]
    pub domain: Option<String>,
    /// Further fixed variables the server needs.
    #[serde(default)]
    pub extra: BTreeMap<String, String>,
}

/// One action carried by one tool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binding {
    pub tool: String,
    #[serde(default)]
    pub args: Map<String, Value>,
    /// JSON pointer to the handle in the tool's result; absent when the result names no
    /// sandbox, and the handle is then the `sandbox` the action was given.
    #[serde(default)]
    pub handle: Option<String>,
}

/// The actions of the MCP step, each a binding of the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Create,
    Connect,
    Run,
    StartTask,
    Kill,
    /// Not a tool: the session ends as a client ends it.
    Shutdown,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Create => "create",
            Action::Connect => "connect",
            Action::Run => "run",
            Action::StartTask => "start_task",
            Action::Kill => "kill",
            Action::Shutdown => "shutdown",
        }
    }
}

/// A tool map that could not be loaded. Messages read after "failed to ...".
#[derive(Debug, thiserror::Error)]
pub enum ToolMapError {
    #[error("read the tool map {0}: {1}")]
    Read(String, String),
    #[error("parse the tool map {0}: {1}")]
    Parse(String, String),
    #[error("use the tool map {0}: {1}")]
    Invalid(String, String),
}

impl ToolMap {
    /// A built-in map by name, else a YAML file at that path.
    pub fn load(name_or_file: &str) -> Result<Self, ToolMapError> {
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name_or_file) {
            return Self::parse(name_or_file, text);
        }
        let path = Path::new(name_or_file);
        let text = std::fs::read_to_string(path).map_err(|e| {
            let names: Vec<&str> = BUILT_IN.iter().map(|(n, _)| *n).collect();
            ToolMapError::Read(
                format!("`{name_or_file}`"),
                format!(
                    "{e} (and it is none of the built-in maps: {})",
                    names.join(", ")
                ),
            )
        })?;
        Self::parse(name_or_file, &text)
    }

    /// The default map: the reference MCP server's.
    pub fn reference() -> Self {
        Self::load("reference").expect("the built-in reference map is valid")
    }

    pub fn parse(origin: &str, text: &str) -> Result<Self, ToolMapError> {
        let map: ToolMap = serde_saphyr::from_str(text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!("{origin}:{}:{}", l.line(), l.column()))
                .unwrap_or_else(|| origin.to_owned());
            ToolMapError::Parse(at, first_line(&e.to_string()))
        })?;
        map.check(origin)?;
        Ok(map)
    }

    fn check(&self, origin: &str) -> Result<(), ToolMapError> {
        let invalid = |m: String| ToolMapError::Invalid(origin.to_owned(), m);
        for (action, b) in self.bindings() {
            if b.tool.is_empty() {
                return Err(invalid(format!("`{}` names no tool", action.name())));
            }
            if let Some(p) = &b.handle
                && !p.starts_with('/')
            {
                return Err(invalid(format!(
                    "`{}.handle` must be a JSON pointer (`/...`), not `{p}`",
                    action.name()
                )));
            }
            for v in b.args.values() {
                if let Some(name) = placeholder(v)
                    && !PARAMS.contains(&name)
                {
                    return Err(invalid(format!(
                        "`{}` uses `{{{{{name}}}}}`; parameters are {}",
                        action.name(),
                        PARAMS.join(", ")
                    )));
                }
            }
        }
        if let Some(p) = &self.unwrap
            && !p.starts_with('/')
        {
            return Err(invalid(format!(
                "`unwrap` must be a JSON pointer (`/...`), not `{p}`"
            )));
        }
        if (self.env.url.is_empty() && self.env.domain.is_none()) || self.env.key.is_empty() {
            return Err(invalid(
                "`env.key` and `env.url` (or `env.domain`) must name variables".into(),
            ));
        }
        for name in [&self.env.sandbox_url, &self.env.domain]
            .into_iter()
            .flatten()
        {
            if name.is_empty() {
                return Err(invalid(
                    "`env.sandbox_url` and `env.domain` name variables".into(),
                ));
            }
        }
        Ok(())
    }

    fn bindings(&self) -> Vec<(Action, &Binding)> {
        let mut out = vec![(Action::Create, &self.create)];
        out.extend(self.connect.as_ref().map(|b| (Action::Connect, b)));
        out.extend(self.kill.as_ref().map(|b| (Action::Kill, b)));
        out.extend(self.run.as_ref().map(|b| (Action::Run, b)));
        out.extend(self.start_task.as_ref().map(|b| (Action::StartTask, b)));
        out
    }

    /// The binding of `action`; `None` for shutdown or an action the map does not carry.
    pub fn binding(&self, action: Action) -> Option<&Binding> {
        match action {
            Action::Create => Some(&self.create),
            Action::Connect => self.connect.as_ref(),
            Action::Run => self.run.as_ref(),
            Action::StartTask => self.start_task.as_ref(),
            Action::Kill => self.kill.as_ref(),
            Action::Shutdown => None,
        }
    }

    /// The value of a tool's result that bindings point into and checks judge: the result
    /// itself, or with `unwrap` the JSON text at that pointer, parsed (kept as the string
    /// when it is not JSON; the result itself when there is no string there).
    pub fn value(&self, result: &Value) -> Value {
        let Some(text) = self
            .unwrap
            .as_deref()
            .and_then(|p| result.pointer(p))
            .and_then(Value::as_str)
        else {
            return result.clone();
        };
        serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
    }

    /// The environment the server is started with: the control plane's `url` (also the
    /// sandbox URL when the map names a variable for it) and `key`. The variables of the
    /// router, for a map with `domain`, are [`ToolMap::routed`]'s.
    pub fn environment(&self, url: &str, key: &str) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if !self.env.url.is_empty() {
            env.push((self.env.url.clone(), url.to_owned()));
        }
        if let Some(name) = &self.env.sandbox_url {
            env.push((name.clone(), url.to_owned()));
        }
        env.push((self.env.key.clone(), key.to_owned()));
        env.extend(self.env.extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        env
    }

    /// For a map with `domain`: the variables that send the server through a router (its
    /// proxy URL and CA file) for E2B's host names under `domain`.
    pub fn routed(&self, domain: &str, proxy: Option<(&str, &Path)>) -> Vec<(String, String)> {
        let Some(name) = &self.env.domain else {
            return Vec::new();
        };
        let mut env = vec![(name.clone(), domain.to_owned())];
        if let Some((proxy_url, ca_file)) = proxy {
            env.push(("HTTPS_PROXY".to_owned(), proxy_url.to_owned()));
            env.push(("SSL_CERT_FILE".to_owned(), ca_file.display().to_string()));
        }
        env
    }
}

impl Binding {
    /// The tool's arguments for the scenario's parameters.
    pub fn arguments(&self, params: &Map<String, Value>) -> Map<String, Value> {
        let mut out = Map::new();
        for (k, v) in &self.args {
            match placeholder(v) {
                Some(name) => {
                    if let Some(given) = params.get(name) {
                        out.insert(k.clone(), given.clone());
                    }
                }
                None => {
                    out.insert(k.clone(), v.clone());
                }
            }
        }
        out
    }

    /// The handle in a result, or the `sandbox` given when the binding points at none.
    pub fn handle(&self, result: &Value, params: &Map<String, Value>) -> Option<String> {
        let v = match &self.handle {
            Some(p) => result.pointer(p)?,
            None => params.get("sandbox")?,
        };
        v.as_str().map(str::to_owned)
    }
}

/// The parameter name of a `{{name}}` placeholder value.
fn placeholder(v: &Value) -> Option<&str> {
    let s = v.as_str()?.strip_prefix("{{")?.strip_suffix("}}")?;
    Some(s.trim())
}

/// The sandbox ID a handle names: the handle without a `provider:` prefix.
pub fn sandbox_of(handle: &str) -> &str {
    match provider_of(handle) {
        Some(p) => &handle[p.len() + 1..],
        None => handle,
    }
}

/// The provider a handle names (`e2b` in `e2b:abc`), if it is qualified.
pub fn provider_of(handle: &str) -> Option<&str> {
    let (p, rest) = handle.split_once(':')?;
    let ok = !p.is_empty()
        && !rest.is_empty()
        && p.starts_with(|c: char| c.is_ascii_lowercase())
        && p.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    ok.then_some(p)
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_built_in_maps_load() {
        let r = ToolMap::reference();
        assert_eq!(r.create.tool, "create_sandbox");
        let a = ToolMap::load("agent-sandbox-client").unwrap();
        assert_eq!(a.env.url, "ABX_SANDBOX_BASE_URL");
        assert!(a.connect.as_ref().unwrap().handle.is_none());
        let c = ToolMap::load("code-sandbox-mcp").unwrap();
        assert_eq!(c.env.sandbox_url.as_deref(), Some("E2B_SANDBOX_URL"));
        let e = ToolMap::load("e2b-mcp-server").unwrap();
        assert!(e.connect.is_none() && e.kill.is_none());
        assert_eq!(e.env.domain.as_deref(), Some("E2B_DOMAIN"));
    }

    #[test]
    fn the_environment_names_what_the_map_asks_for() {
        let c = ToolMap::load("code-sandbox-mcp").unwrap();
        assert_eq!(
            c.environment("http://cp", "k"),
            [
                ("E2B_API_URL".to_owned(), "http://cp".to_owned()),
                ("E2B_SANDBOX_URL".to_owned(), "http://cp".to_owned()),
                ("E2B_API_KEY".to_owned(), "k".to_owned()),
            ]
        );
        assert!(c.routed("d", None).is_empty());
        let e = ToolMap::load("e2b-mcp-server").unwrap();
        assert_eq!(
            e.environment("http://cp", "k"),
            [("E2B_API_KEY".to_owned(), "k".to_owned())]
        );
        let routed = e.routed("d.test", Some(("http://127.0.0.1:9", Path::new("/ca.pem"))));
        assert_eq!(
            routed,
            [
                ("E2B_DOMAIN".to_owned(), "d.test".to_owned()),
                ("HTTPS_PROXY".to_owned(), "http://127.0.0.1:9".to_owned()),
                ("SSL_CERT_FILE".to_owned(), "/ca.pem".to_owned()),
            ]
        );
    }

    #[test]
    fn unwrap_parses_the_text_a_framework_wrapped() {
        let c = ToolMap::load("code-sandbox-mcp").unwrap();
        let wrapped = json!({"result": "{\"sandbox_id\": \"abc\"}"});
        assert_eq!(c.value(&wrapped), json!({"sandbox_id": "abc"}));
        assert_eq!(c.value(&json!({"result": ""})), json!(""));
        assert_eq!(c.value(&json!({"other": 1})), json!({"other": 1}));
        let r = ToolMap::reference();
        assert_eq!(r.value(&wrapped), wrapped);
    }

    #[test]
    fn placeholders_keep_types_and_absent_parameters_drop_keys() {
        let r = ToolMap::reference();
        let params = json!({"memory_mb": 1024}).as_object().unwrap().clone();
        assert_eq!(
            Value::Object(r.create.arguments(&params)),
            json!({"memory_mb": 1024})
        );
        let a = ToolMap::load("agent-sandbox-client").unwrap();
        let params = json!({"sandbox": "abc"}).as_object().unwrap().clone();
        assert_eq!(
            Value::Object(a.connect.as_ref().unwrap().arguments(&params)),
            json!({"sandbox_id": "abc", "command": "true"})
        );
        assert_eq!(
            a.connect
                .as_ref()
                .unwrap()
                .handle(&json!({}), &params)
                .as_deref(),
            Some("abc")
        );
    }

    #[test]
    fn bad_maps_are_refused_with_the_reason() {
        let text = "name: x\nenv: {url: U, key: K}\ncreate: {tool: c, args: {a: \"{{size}}\"}}\n\
                    connect: {tool: c}\nkill: {tool: k}\n";
        let e = ToolMap::parse("m.yaml", text).unwrap_err().to_string();
        assert!(e.contains("`{{size}}`"), "{e}");
        let text = "name: x\nenv: {key: K}\ncreate: {tool: c}\n";
        let e = ToolMap::parse("m.yaml", text).unwrap_err().to_string();
        assert!(e.contains("`env.url` (or `env.domain`)"), "{e}");
        let text = "name: x\nenv: {url: U, key: K}\nunwrap: result\ncreate: {tool: c}\n";
        let e = ToolMap::parse("m.yaml", text).unwrap_err().to_string();
        assert!(e.contains("`unwrap` must be a JSON pointer"), "{e}");
        let e = ToolMap::parse("m.yaml", "name: x\nnope: 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("parse the tool map m.yaml:"), "{e}");
        let e = ToolMap::load("/nonexistent/map.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("built-in maps: reference, agent-sandbox-client, code-sandbox-mcp"),
            "{e}"
        );
    }

    #[test]
    fn handles_split_into_provider_and_sandbox() {
        assert_eq!(provider_of("e2b:abc"), Some("e2b"));
        assert_eq!(sandbox_of("e2b:abc"), "abc");
        assert_eq!(provider_of("abc"), None);
        assert_eq!(sandbox_of("abc"), "abc");
        assert_eq!(provider_of(":abc"), None);
        assert_eq!(provider_of("E2B:abc"), None);
    }
}
