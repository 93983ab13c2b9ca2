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
/// `agent-sandbox-client`'s.
const BUILT_IN: &[(&str, &str)] = &[
    ("reference", include_str!("../../tool-maps/reference.yaml")),
    (
        "agent-sandbox-client",
        include_str!("../../tool-maps/agent-sandbox-client.yaml"),
    ),
];

/// The parameters a scenario may give an action, and so the only placeholders a map may use.
pub const PARAMS: &[&str] = &["sandbox", "timeout_s", "cpu", "memory_mb", "command"];

/// One server's tool map.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolMap {
    /// What reports call the map.
    pub name: String,
    pub env: EnvNames,
    pub create: Binding,
    pub connect: Binding,
    #[serde(default)]
    pub run: Option<Binding>,
    #[serde(default)]
    pub start_task: Option<Binding>,
    pub kill: Binding,
}

/// How the server is told its control plane.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvNames {
    /// The variable that gets the control plane's base URL.
    pub url: String,
    /// The variable that gets the API key.
    pub key: String,
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
        if self.env.url.is_empty() || self.env.key.is_empty() {
            return Err(invalid(
                "`env.url` and `env.key` must name variables".into(),
            ));
        }
        Ok(())
    }

    fn bindings(&self) -> Vec<(Action, &Binding)> {
        let mut out = vec![
            (Action::Create, &self.create),
            (Action::Connect, &self.connect),
            (Action::Kill, &self.kill),
        ];
        out.extend(self.run.as_ref().map(|b| (Action::Run, b)));
        out.extend(self.start_task.as_ref().map(|b| (Action::StartTask, b)));
        out
    }

    /// The binding of `action`; `None` for shutdown or an action the map does not carry.
    pub fn binding(&self, action: Action) -> Option<&Binding> {
        match action {
            Action::Create => Some(&self.create),
            Action::Connect => Some(&self.connect),
            Action::Run => self.run.as_ref(),
            Action::StartTask => self.start_task.as_ref(),
            Action::Kill => Some(&self.kill),
            Action::Shutdown => None,
        }
    }

    /// The environment the server is started with.
    pub fn environment(&self, url: &str, key: &str) -> Vec<(String, String)> {
        let mut env = vec![
            (self.env.url.clone(), url.to_owned()),
            (self.env.key.clone(), key.to_owned()),
        ];
        env.extend(self.env.extra.iter().map(|(k, v)| (k.clone(), v.clone())));
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
        assert!(a.connect.handle.is_none());
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
            Value::Object(a.connect.arguments(&params)),
            json!({"sandbox_id": "abc", "command": "true"})
        );
        assert_eq!(
            a.connect.handle(&json!({}), &params).as_deref(),
            Some("abc")
        );
    }

    #[test]
    fn bad_maps_are_refused_with_the_reason() {
        let text = "name: x\nenv: {url: U, key: K}\ncreate: {tool: c, args: {a: \"{{size}}\"}}\n\
                    connect: {tool: c}\nkill: {tool: k}\n";
        let e = ToolMap::parse("m.yaml", text).unwrap_err().to_string();
        assert!(e.contains("`{{size}}`"), "{e}");
        let e = ToolMap::parse("m.yaml", "name: x\nnope: 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("parse the tool map m.yaml:"), "{e}");
        let e = ToolMap::load("/nonexistent/map.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("built-in maps: reference, agent-sandbox-client"),
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
