//! The operations of a profile's protocol: each a method and a path template
//! (`GET /files/list`, `DELETE /v1/vaults/{vault_id}`) in a group, read from the document that
//! lists them, and which operation a request of a transcript called. The evidence counts, for
//! every operation, the scenarios that called it, so that a run says which operations no
//! scenario reached.

use serde::{Deserialize, Serialize};

/// One operation a profile's protocol has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Operation {
    /// `GET`, `POST`, ... (`WS` for a WebSocket, which no request of a transcript calls).
    pub method: String,
    /// The path, with `{name}` for each parameter segment.
    pub path: String,
    /// The group the document files it under.
    pub group: String,
}

/// HTTP methods (and `WS`) an operation table may name.
const METHODS: &[&str] = &[
    "GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "WS",
];

impl Operation {
    /// Whether a request `method` to `target` (its path, with or without a query string) is a
    /// call of this operation: the same method, and the same segments, where a `{name}`
    /// segment stands for any one non-empty segment. A trailing slash is no segment.
    pub fn matches(&self, method: &str, target: &str) -> bool {
        if !self.method.eq_ignore_ascii_case(method) {
            return false;
        }
        let path = target.split(['?', '#']).next().unwrap_or_default();
        let want: Vec<&str> = segments(&self.path).collect();
        let got: Vec<&str> = segments(path).collect();
        want.len() == got.len()
            && want
                .iter()
                .zip(&got)
                .all(|(w, g)| is_param(w) && !g.is_empty() || w == g)
    }

    /// Literal (not parameter) segments: where two templates match one request, the one with
    /// more literal segments names it (`GET /v1/agents/sessions` over `GET /v1/agents/{id}`),
    /// as a router that tries specific routes first would.
    fn literal_segments(&self) -> usize {
        segments(&self.path).filter(|s| !is_param(s)).count()
    }
}

fn segments(path: &str) -> impl Iterator<Item = &str> {
    path.trim_matches('/').split('/').filter(|s| !s.is_empty())
}

fn is_param(segment: &str) -> bool {
    segment.len() > 2 && segment.starts_with('{') && segment.ends_with('}')
}

/// The index in `operations` of the operation a request `method target` called, if any: the
/// most specific of those that match, the first of equals.
pub fn operation_of(operations: &[Operation], method: &str, target: &str) -> Option<usize> {
    operations
        .iter()
        .enumerate()
        .filter(|(_, op)| op.matches(method, target))
        .max_by(|(ia, a), (ib, b)| {
            a.literal_segments()
                .cmp(&b.literal_segments())
                .then(ib.cmp(ia))
        })
        .map(|(i, _)| i)
}

/// The operations written as the rows of a document's tables: a row whose first cell is one
/// or more `` `METHOD /path` `` (comma-separated) names each of them. Its group is the row's
/// cell in a column headed `Group` when the table has one, else the text of the heading the
/// table is under. A table headed `RPC` under a heading `` `pkg.Service` `` names Connect RPCs
/// (`` `Start` (stream) ``), each the operation `POST /pkg.Service/Start`.
pub fn from_tables(text: &str) -> Vec<Operation> {
    let mut out = Vec::new();
    let mut heading = String::new();
    let mut header: Option<Vec<String>> = None;
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        if let Some(h) = line.strip_prefix('#') {
            heading = h.trim_start_matches('#').trim().to_owned();
            header = None;
            continue;
        }
        if !line.starts_with('|') {
            header = None;
            continue;
        }
        let cells = row_cells(line);
        let Some(columns) = &header else {
            header = Some(cells);
            continue;
        };
        if cells
            .iter()
            .all(|c| c.chars().all(|ch| matches!(ch, '-' | ':' | ' ')))
        {
            continue;
        }
        let group = columns
            .iter()
            .position(|c| c.eq_ignore_ascii_case("group"))
            .and_then(|i| cells.get(i))
            .map(|c| c.trim_matches('`').to_owned())
            .unwrap_or_else(|| heading.trim_matches('`').to_owned());
        let first = cells.first().map(String::as_str).unwrap_or_default();
        if columns.first().is_some_and(|c| c == "RPC") {
            let service = heading.trim_matches('`');
            for rpc in backticked(first) {
                if service.contains('.') && !rpc.contains(' ') {
                    out.push(Operation {
                        method: "POST".to_owned(),
                        path: format!("/{service}/{rpc}"),
                        group: group.clone(),
                    });
                }
            }
            continue;
        }
        for quoted in backticked(first) {
            let Some((method, path)) = quoted.split_once(' ') else {
                continue;
            };
            if METHODS.contains(&method) && path.starts_with('/') && !path.contains(' ') {
                // `GET /files?path=`: the query says what the operation takes, not where it is.
                let path = path.split('?').next().unwrap_or(path);
                out.push(Operation {
                    method: method.to_owned(),
                    path: path.to_owned(),
                    group: group.clone(),
                });
            }
        }
    }
    out
}

/// The cells of a Markdown table row, trimmed (`\|` is a pipe inside a cell).
fn row_cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().expect("a cell").push('|');
                chars.next();
            }
            '|' => cells.push(String::new()),
            c => cells.last_mut().expect("a cell").push(c),
        }
    }
    cells.into_iter().map(|c| c.trim().to_owned()).collect()
}

/// The texts between backticks of a cell, in order.
fn backticked(cell: &str) -> impl Iterator<Item = &str> {
    cell.split('`').skip(1).step_by(2)
}

/// The operations of an OpenAPI document: every method of every path, grouped by the
/// operation's first tag (else `untagged`), in the order of the paths' names.
pub fn from_openapi(yaml: &str) -> Result<Vec<Operation>, String> {
    let doc: serde_json::Value = serde_saphyr::from_str(yaml).map_err(|e| e.to_string())?;
    let paths = doc
        .get("paths")
        .and_then(|p| p.as_object())
        .ok_or("the document has no `paths` mapping")?;
    let mut out = Vec::new();
    for (path, item) in paths {
        let Some(item) = item.as_object() else {
            continue;
        };
        for (method, op) in item {
            let method = method.to_ascii_uppercase();
            if !METHODS.contains(&method.as_str()) {
                continue;
            }
            let group = op
                .get("tags")
                .and_then(|t| t.get(0))
                .and_then(|t| t.as_str())
                .unwrap_or("untagged");
            out.push(Operation {
                method,
                path: path.clone(),
                group: group.to_owned(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(method: &str, path: &str) -> Operation {
        Operation {
            method: method.into(),
            path: path.into(),
            group: "g".into(),
        }
    }

    #[test]
    fn a_template_matches_its_requests_and_no_others() {
        let get = op("GET", "/v1/agents/sessions/{id}/turns/{turn_id}");
        assert!(get.matches("GET", "/v1/agents/sessions/agsess_1/turns/turn_2"));
        assert!(get.matches("get", "/v1/agents/sessions/a/turns/b?order=asc"));
        assert!(get.matches("GET", "/v1/agents/sessions/a/turns/b/"));
        assert!(!get.matches("POST", "/v1/agents/sessions/a/turns/b"));
        assert!(!get.matches("GET", "/v1/agents/sessions/a/turns"));
        assert!(!get.matches("GET", "/v1/agents/sessions/a/turns/b/items"));
        assert!(!get.matches("GET", "/v1/agents/sessions//turns/b"));
        assert!(op("GET", "/health").matches("GET", "/health"));
        assert!(!op("GET", "/health").matches("GET", "/healthz"));
    }

    #[test]
    fn the_most_specific_template_names_a_request() {
        let ops = [
            op("GET", "/v1/agents/{agent_id}"),
            op("GET", "/v1/agents/sessions"),
            op("GET", "/v1/agents/sessions/{id}"),
        ];
        assert_eq!(operation_of(&ops, "GET", "/v1/agents/sessions"), Some(1));
        assert_eq!(operation_of(&ops, "GET", "/v1/agents/agent_7"), Some(0));
        assert_eq!(operation_of(&ops, "GET", "/v1/agents/sessions/x"), Some(2));
        assert_eq!(operation_of(&ops, "DELETE", "/v1/agents/sessions/x"), None);
    }

    #[test]
    fn tables_name_operations_by_their_first_cell() {
        let doc = "\
# Doc

## Control plane

| Endpoint | Behaviour |
| --- | --- |
| `POST /sandboxes` | creates |
| `POST /sandboxes/{id}/connect`, `POST /v2/sandboxes/{id}/connect` | a \\| pipe |
| `NOT a route` | no |

## Operations

| Method and path | Group | Scopes |
| --- | --- | --- |
| `GET /files/list` | `file_ops` | `files:read` |
| `WS /pty` | terminal | |
| `GET /files?path=` | file_ops | |

### `process.Process`

| RPC | Behaviour |
| --- | --- |
| `Start` (stream) | starts |
| `CreateWatcher`, `GetWatcherEvents` | polls |

```
| `GET /fenced` | no |
```
";
        let ops = from_tables(doc);
        let rows: Vec<(&str, &str, &str)> = ops
            .iter()
            .map(|o| (o.method.as_str(), o.path.as_str(), o.group.as_str()))
            .collect();
        assert_eq!(
            rows,
            [
                ("POST", "/sandboxes", "Control plane"),
                ("POST", "/sandboxes/{id}/connect", "Control plane"),
                ("POST", "/v2/sandboxes/{id}/connect", "Control plane"),
                ("GET", "/files/list", "file_ops"),
                ("WS", "/pty", "terminal"),
                ("GET", "/files", "file_ops"),
                ("POST", "/process.Process/Start", "process.Process"),
                ("POST", "/process.Process/CreateWatcher", "process.Process"),
                (
                    "POST",
                    "/process.Process/GetWatcherEvents",
                    "process.Process"
                ),
            ]
        );
    }

    #[test]
    fn an_openapi_document_names_each_method_of_each_path() {
        let yaml = "openapi: 3.1.0\npaths:\n  /v1/things:\n    get:\n      tags: [things]\n    post:\n      tags: [things]\n    parameters: []\n  /v1/health:\n    get: {}\n";
        let ops = from_openapi(yaml).unwrap();
        let rows: Vec<(&str, &str, &str)> = ops
            .iter()
            .map(|o| (o.method.as_str(), o.path.as_str(), o.group.as_str()))
            .collect();
        assert_eq!(
            rows,
            [
                ("GET", "/v1/health", "untagged"),
                ("GET", "/v1/things", "things"),
                ("POST", "/v1/things", "things"),
            ]
        );
    }
}
