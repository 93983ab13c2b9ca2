//! `operations`: one request to every operation of the profile's operation table in the
//! named groups, each judged by the same `expect` block. A scenario that checks something of
//! every operation (no token is refused, a token without the right is refused) is written
//! once, against the table; an operation added to the table is checked the next run.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::kind::{StepKind, expects_2xx};
use crate::engine::context::{
    CANARY_HEADER, Ctx, Prepared, StepError, is_credential_header, with_problem, with_query,
};
use crate::engine::expect::{check_response, status_ok};
use crate::profile::Operation;
use crate::scenario::{
    CheckCtx, Checker, Expect, Located, Method, Pos, Principal, Scope, Template, Via, present,
};

/// The same request to each operation of some groups of the profile's operation table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Operations {
    /// What messages, the transcript and `fails_at` call the step (required: the step stands
    /// for many requests).
    pub name: Located<String>,
    /// The groups of the table whose operations get a request, in the table's order.
    pub groups: Located<Vec<String>>,
    /// Operations of those groups that get none, each `METHOD path` as the table writes it,
    /// with why (recorded in the transcript). An entry that names no operation of the groups
    /// is an error: the table changed under the scenario.
    #[serde(default)]
    pub except: BTreeMap<String, String>,
    #[serde(rename = "as", default)]
    pub principal: Principal,
    /// Raw headers of every request. An `Authorization` header replaces the principal's token.
    #[serde(default)]
    pub headers: BTreeMap<String, Template>,
    /// The value of each path parameter, by its name in the table (`{id}` is `id`).
    #[serde(default)]
    pub params: BTreeMap<String, Template>,
    /// Query parameters of every request.
    #[serde(default)]
    pub query: BTreeMap<String, Template>,
    /// The JSON body of every request whose method takes one (POST, PUT, PATCH, DELETE).
    #[serde(default, deserialize_with = "present")]
    pub json: Option<Located<serde_json::Value>>,
    pub expect: Expect,
}

impl StepKind for Operations {
    fn label(&self) -> String {
        self.name.value.clone()
    }

    fn check(&self, c: &mut Checker<'_>, scope: &mut Scope, ctx: &CheckCtx<'_>) {
        let pos = Pos::of(&self.name);
        c.principal(self.principal, pos, ctx);
        if self.groups.value.is_empty() {
            c.err(Pos::of(&self.groups), "`groups` names no group");
        }
        for t in self
            .headers
            .values()
            .chain(self.params.values())
            .chain(self.query.values())
        {
            c.template(t, scope, ctx);
        }
        if let Some(json) = &self.json {
            c.json_value(json, scope, ctx);
        }
        for (op, why) in &self.except {
            if op.split_once(' ').is_none() || why.trim().is_empty() {
                c.err(
                    pos,
                    format!("`except` entry `{op}`: write `METHOD /path: why it gets no request`"),
                );
            }
        }
        c.expect(&self.expect, scope, ctx);
    }

    fn expects_success(&self) -> bool {
        expects_2xx(&self.expect)
    }

    fn uses_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        let table = ctx.target.profile().operations();
        let groups = &self.groups.value;
        let chosen: Vec<&Operation> = table
            .iter()
            .filter(|op| groups.contains(&op.group))
            .collect();
        if chosen.is_empty() {
            return Err(StepError::Error(format!(
                "the profile's operation table has no operation in {groups:?}"
            )));
        }
        let names: Vec<String> = chosen
            .iter()
            .map(|op| format!("{} {}", op.method, op.path))
            .collect();
        if let Some(stale) = self.except.keys().find(|e| !names.contains(e)) {
            return Err(StepError::Error(format!(
                "`except` names `{stale}`, which is no operation of {groups:?} in the profile's table"
            )));
        }
        let mut failures = Vec::new();
        let mut sent = 0;
        for (op, name) in chosen.into_iter().zip(names) {
            if let Some(why) = self.except.get(&name) {
                ctx.note(format!("{label}: no request to {name}: {why}"));
                continue;
            }
            let Some(method) = method_of(&op.method) else {
                ctx.note(format!(
                    "{label}: no request to {name}: it is served by another transport"
                ));
                continue;
            };
            let p = self.prepare(ctx, op, method)?;
            let client = ctx.target.client.clone();
            let obs = ctx.send(&client, &p, &format!("{label}: {name}")).await?;
            sent += 1;
            let verdict = match status_ok(&self.expect, obs.status, None) {
                Err(msg) => vec![with_problem(msg, &obs)],
                Ok(()) => check_response(&self.expect, &obs, &ctx.vars),
            };
            if !verdict.is_empty() {
                failures.push(format!("{name}: {}", verdict.join("; ")));
            }
        }
        if sent == 0 {
            return Err(StepError::Error(format!(
                "every operation of {groups:?} was left out: the step checked nothing"
            )));
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(StepError::Fail(format!(
                "{} of {sent} operations: {}",
                failures.len(),
                failures.join(" | ")
            )))
        }
    }
}

impl Operations {
    /// The request to `op`: its path with the parameters filled in, the step's query,
    /// headers and (for a method that takes one) body.
    fn prepare(
        &self,
        ctx: &Ctx<'_>,
        op: &Operation,
        method: Method,
    ) -> Result<Prepared, StepError> {
        let mut path = String::new();
        for segment in op.path.split('/').skip(1) {
            path.push('/');
            match segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(param) => {
                    let value = self.params.get(param).ok_or_else(|| {
                        StepError::Error(format!(
                            "{} {} needs a value for `{param}` (params)",
                            op.method, op.path
                        ))
                    })?;
                    path.push_str(&ctx.vars.render(value)?);
                }
                None => path.push_str(segment),
            }
        }
        let mut query = Vec::new();
        for (k, v) in &self.query {
            query.push((k.clone(), ctx.vars.render(v)?));
        }
        let mut headers = vec![(CANARY_HEADER.to_owned(), ctx.target.canary.clone())];
        let mut literal_auth = false;
        for (k, v) in &self.headers {
            literal_auth |= is_credential_header(k);
            headers.push((k.clone(), ctx.vars.render(v)?));
        }
        let takes_body = matches!(
            method,
            Method::Post | Method::Put | Method::Patch | Method::Delete
        );
        let body = match &self.json {
            Some(json) if takes_body => Some((
                serde_json::to_vec(&ctx.vars.render_json(&json.value)?)
                    .expect("JSON values serialize"),
                "application/json".to_owned(),
            )),
            _ => None,
        };
        Ok(Prepared {
            via: Via::Primary,
            method,
            target: with_query(&path, &query),
            principal: self.principal,
            headers,
            literal_auth,
            body,
            envd_host: None,
        })
    }
}

/// The scenario method a table's method names; `None` for one no HTTP request makes (`WS`).
fn method_of(name: &str) -> Option<Method> {
    Some(match name {
        "GET" => Method::Get,
        "POST" => Method::Post,
        "PUT" => Method::Put,
        "PATCH" => Method::Patch,
        "DELETE" => Method::Delete,
        "HEAD" => Method::Head,
        "OPTIONS" => Method::Options,
        _ => return None,
    })
}
