//! `kill_server`, `restart_server`, `stop_database`, `start_database`: faults the runner
//! injects into a deployment it started for the scenario (`target::Control`). Each is
//! recorded with its time, and the steps that ran after it are what was checked after it.

use std::time::{Duration, Instant};

use super::StepKind;
use crate::engine::context::{Ctx, FaultRecord, StepError, ms};
use crate::scenario::{Fault, Via};

/// Which fault a step injects.
#[derive(Debug, Clone, Copy)]
pub(in crate::engine) enum FaultKind {
    KillServer,
    RestartServer,
    StopDatabase,
    StartDatabase,
}

/// A fault step: its kind and what the scenario wrote.
pub(in crate::engine) struct Inject<'a>(pub FaultKind, pub &'a Fault);

impl FaultKind {
    fn name(self) -> &'static str {
        match self {
            FaultKind::KillServer => "kill_server",
            FaultKind::RestartServer => "restart_server",
            FaultKind::StopDatabase => "stop_database",
            FaultKind::StartDatabase => "start_database",
        }
    }
}

impl StepKind for Inject<'_> {
    fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
        // A server process prints its address within 30 s or is an error; `pg_ctl` waits
        // for the database to accept connections.
        match self.0 {
            FaultKind::RestartServer | FaultKind::StartDatabase => Duration::from_secs(30),
            FaultKind::KillServer | FaultKind::StopDatabase => Duration::from_secs(5),
        }
    }

    async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        // The scenario requires the control, so it runs only on a deployment that has it: one
        // the runner started for it, or a service it launched (`--launch`), which has one
        // server process and no database the runner holds.
        let peer = self.1.via == Via::Peer;
        let at_ms = ctx.at();
        let began = Instant::now();
        let done = if let Some(control) = ctx.target.control.as_ref() {
            match self.0 {
                FaultKind::KillServer => control.kill_server(peer).await.map(|()| true),
                FaultKind::RestartServer => control.restart_server(peer).await,
                FaultKind::StopDatabase => control.stop_database().await.map(|()| true),
                FaultKind::StartDatabase => control.start_database().await.map(|()| true),
            }
        } else if ctx.target.can_restart() && !peer {
            match self.0 {
                FaultKind::KillServer => ctx.target.kill_service().await.map(|()| true),
                FaultKind::RestartServer => ctx.target.start_service().await,
                FaultKind::StopDatabase | FaultKind::StartDatabase => {
                    Err("the runner holds no database of a launched service".into())
                }
            }
        } else {
            Err("the runner controls no server process of this target".into())
        };
        let took_ms = ms(began.elapsed());
        let acted = done.map_err(|e| StepError::Error(format!("{}: {e}", self.0.name())))?;
        let on = match (self.0, peer) {
            (FaultKind::StopDatabase | FaultKind::StartDatabase, _) => "database",
            (_, true) => "peer",
            (_, false) => "primary",
        };
        if !acted {
            // A cleanup step that brings a killed server back finds it running when the
            // steps did so already: nothing was injected.
            ctx.note(format!(
                "{label}: the {on} server is running, nothing to restart"
            ));
            return Ok(());
        }
        ctx.note(format!(
            "{label}: {} on the {on} done in {took_ms} ms",
            self.0.name()
        ));
        ctx.faults.push(FaultRecord {
            step: label.to_owned(),
            kind: self.0.name().to_owned(),
            on: on.to_owned(),
            at_ms,
            took_ms,
            checked_after: Vec::new(),
        });
        Ok(())
    }
}
