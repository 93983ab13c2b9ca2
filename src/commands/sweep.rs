//! `sandspec sweep`: removes what interrupted runs left behind, as the profile lists it: only
//! objects whose own record carries a `sandspec_run` tag and that are older than asked.

use std::process::ExitCode;

use crate::cli::{EXIT_CONFORMANT, EXIT_HARNESS, EXIT_NOT_CONFORMANT, EXIT_USAGE, SweepArgs};
use crate::target::{Endpoint, Target, TargetSpec, UrlEndpoint};

/// `sandspec sweep` from a synchronous `main`.
pub fn sweep_blocking(args: SweepArgs) -> ExitCode {
    match tokio::runtime::Runtime::new() {
        Ok(runtime) => ExitCode::from(runtime.block_on(sweep(args))),
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::from(EXIT_HARNESS)
        }
    }
}

async fn sweep(args: SweepArgs) -> u8 {
    if let Err(e) = crate::live::guard(&args.target, args.live) {
        eprintln!("error: {e}");
        return EXIT_USAGE;
    }
    let mut envs = vec![args.owner_token_env.clone()];
    envs.extend(args.other_token_env.clone());
    let mut failed = false;
    for env in &envs {
        // The guard has been asked already: once for the whole sweep.
        let mut spec = TargetSpec::new(
            args.api,
            Endpoint::Url(UrlEndpoint {
                ca_file: args.ca_file.clone(),
                live: true,
                ..UrlEndpoint::new(&args.target, env, env)
            }),
        );
        if let Some(body) = args.max_body_bytes {
            spec.limits.body = body;
        }
        let opened = match spec.check() {
            Ok(checked) => Target::open(checked).await,
            Err(e) => Err(e),
        };
        let target = match opened {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {e}");
                return if e.is_usage() {
                    EXIT_USAGE
                } else {
                    EXIT_HARNESS
                };
            }
        };
        let token = target.tokens.owner.clone();
        let found = target
            .profile()
            .sweep_older_than(&target.conn(), &token, args.older_than, args.dry_run)
            .await;
        match found {
            Ok(found) => {
                for s in &found {
                    let what = match (args.dry_run, s.removed) {
                        (true, _) => "would remove",
                        (false, true) => "removed",
                        (false, false) => "could NOT remove",
                    };
                    println!("{what} {} (run {}, principal from ${env})", s.path, s.run);
                    failed |= !args.dry_run && !s.removed;
                }
                if found.is_empty() {
                    println!("nothing to sweep for the principal from ${env}");
                }
            }
            Err(e) => {
                eprintln!("error: {e}");
                return EXIT_HARNESS;
            }
        }
    }
    if failed {
        EXIT_NOT_CONFORMANT
    } else {
        EXIT_CONFORMANT
    }
}
