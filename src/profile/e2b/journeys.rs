//! The E2B profile's SDK journeys (`--sdk`): the programs in `fixtures/sdk/` (embedded, so an
//! installed runner has them), the clauses each exercises, and how a program is pointed at the
//! target: directly (`E2B_API_URL`, `E2B_SANDBOX_URL`), by E2B's host names for a target with
//! an envd domain, and through the router for an SDK that reads neither.

use std::path::Path;

use futures_util::future::BoxFuture;

use super::router::{DOMAIN, Router};
use crate::sdk::{Journey, Journeys, SdkMatrix, SdkSpec, SdkTarget};

/// The SDK journeys.
pub static JOURNEYS: Journeys = Journeys {
    default: &[
        "python:e2b==2.63.0",
        "node:e2b@2.51.0",
        "python:e2b==1.11.1",
    ],
    journeys: &[
        Journey {
            name: "create",
            title: "create a sandbox, read its info, kill it",
            clauses: &["E2B-SBX-1", "E2B-SBX-2", "E2B-SBX-3"],
        },
        Journey {
            name: "run_and_stream",
            title: "run commands, stream their output, exit codes, a background command",
            clauses: &["E2B-PRC-1", "E2B-ENVD-3"],
        },
        Journey {
            name: "files",
            title: "write and read text and binary files, list, remove",
            clauses: &["E2B-FILE-1"],
        },
        Journey {
            name: "list_pages",
            title: "list sandboxes by metadata, page by page",
            clauses: &["E2B-SBX-7"],
        },
        Journey {
            name: "pause_connect",
            title: "pause a sandbox, connect to resume it with its files",
            clauses: &["E2B-SBX-5", "E2B-SBX-6"],
        },
        Journey {
            name: "timeouts",
            title: "move a sandbox's end, a command over its timeout",
            clauses: &["E2B-SBX-4", "E2B-PRC-7"],
        },
        Journey {
            name: "kill",
            title: "kill a sandbox, kill it again, use it after",
            clauses: &["E2B-SBX-3"],
        },
        Journey {
            name: "secure_access",
            title: "a secure sandbox through the SDK, and a wrong API key",
            clauses: &["E2B-ENVD-2", "E2B-AUTH-2"],
        },
    ],
    python: include_str!("../../../fixtures/sdk/python/journeys.py"),
    node: include_str!("../../../fixtures/sdk/node/journeys.mjs"),
    id_prefix: "E2B-SDK",
};

/// Runs the matrix against `target`: an SDK reaches a target with an envd domain by E2B's
/// host names; otherwise by `E2B_API_URL` and `E2B_SANDBOX_URL`, or through a router started
/// for the run when it reads neither.
pub fn run<'a>(
    target: SdkTarget<'a>,
    client: reqwest::Client,
    specs: &'a [SdkSpec],
    cache: &'a Path,
) -> BoxFuture<'a, SdkMatrix> {
    Box::pin(async move {
        let router = match target.envd_domain {
            Some(_) => None,
            None => match Router::start(target.base_url, client).await {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("sdk: no router for SDKs that read no E2B_SANDBOX_URL: {e}");
                    None
                }
            },
        };
        let env = |_: &SdkSpec| {
            let mut env = vec![
                ("E2B_API_KEY".to_owned(), target.api_key.to_owned()),
                ("SANDSPEC_RUN_ID".to_owned(), target.run_id.to_owned()),
            ];
            match (target.envd_domain, &router) {
                (Some(domain), _) => env.push(("E2B_DOMAIN".into(), domain.to_owned())),
                (None, router) => {
                    env.push(("E2B_API_URL".into(), target.base_url.to_owned()));
                    env.push(("E2B_SANDBOX_URL".into(), target.base_url.to_owned()));
                    if let Some(router) = router {
                        env.push(("E2B_DOMAIN".into(), DOMAIN.to_owned()));
                        env.push(("SANDSPEC_SDK_PROXY".into(), router.proxy_url.clone()));
                        env.push((
                            "SSL_CERT_FILE".into(),
                            router.ca_file().display().to_string(),
                        ));
                    }
                }
            }
            env
        };
        crate::sdk::run(&JOURNEYS, specs, cache, &env).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every journey cites clauses of the E2B document, and the default set holds one judged
    /// release per language and one older major.
    #[test]
    fn journeys_cite_the_profiles_clauses() {
        for j in JOURNEYS.journeys {
            for c in j.clauses {
                assert!(
                    super::super::binding::CLAUSES.level(c).is_some(),
                    "{}: {c}",
                    j.name
                );
            }
        }
        let specs = JOURNEYS.specs(&["default".to_owned()]).unwrap();
        assert_eq!(crate::sdk::judged(&specs), [true, true, false]);
        for program in [JOURNEYS.python, JOURNEYS.node] {
            for j in JOURNEYS.journeys {
                assert!(program.contains(j.name), "{} is in every program", j.name);
            }
        }
    }
}
