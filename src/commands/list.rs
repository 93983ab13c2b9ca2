//! `sandspec list`: the catalog of a profile, one line per scenario, and the MUST clauses of
//! its document that none of the listed scenarios cites.

use std::process::ExitCode;

use super::plan::matches_filters;
use crate::cli::{EXIT_CONFORMANT, EXIT_USAGE, ListArgs};
use crate::scenario::load_dir;

/// `sandspec list`: ID, level, clauses, title; then the MUST clauses no listed scenario cites.
pub fn list(args: &ListArgs) -> ExitCode {
    let scenarios = match load_dir(&args.api.catalog(&args.scenarios)) {
        Ok(s) => s,
        Err(errors) => {
            super::plan::print_parse_errors(&errors);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let mut must = 0;
    let mut should = 0;
    for s in scenarios
        .iter()
        .filter(|s| matches_filters(s, &args.filter))
    {
        let sc = &s.scenario;
        match sc.level {
            crate::scenario::Level::Must => must += 1,
            crate::scenario::Level::Should => should += 1,
        }
        let clauses: Vec<&str> = sc.clauses.iter().map(|c| c.value.as_str()).collect();
        println!(
            "{:<16} {:<6} {:<24} {}",
            sc.id.value,
            sc.level,
            clauses.join(","),
            sc.title
        );
    }
    println!("{} scenarios ({must} MUST, {should} SHOULD)", must + should);
    // Clause coverage of what was listed, where the profile's document counts its MUST
    // clauses: those none of the listed scenarios cites.
    let Some((document, musts)) = args.api.profile().listed_coverage() else {
        return ExitCode::from(EXIT_CONFORMANT);
    };
    let cited: std::collections::BTreeSet<&str> = scenarios
        .iter()
        .filter(|s| matches_filters(s, &args.filter))
        .flat_map(|s| s.scenario.clauses.iter().map(|c| c.value.as_str()))
        .collect();
    let uncited: Vec<&str> = musts
        .iter()
        .copied()
        .filter(|c| !cited.contains(c))
        .collect();
    println!(
        "{} of {} MUST clauses of {document} cited; by none of these scenarios: {}",
        musts.len() - uncited.len(),
        musts.len(),
        if uncited.is_empty() {
            "none".to_owned()
        } else {
            uncited.join(", ")
        }
    );
    ExitCode::from(EXIT_CONFORMANT)
}
