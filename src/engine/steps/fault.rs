//! `kill_server`, `restart_server`, `stop_database`, `start_database`: faults the runner
//! injects into a deployment it started for the scenario (`target::Control`). Each is
//! recorded with its time, and the steps that ran after it are what was checked after it.

use std::time::{Duration, Instant};

use serde::Deserialize;

use super::kind::StepKind;
use crate::engine::context::{Ctx, FaultRecord, StepError, ms};
use crate::scenario::{CheckCtx, Checker, Located, Pos, Scope, Via};

/// A fault the runner injects into a deployment it started (`kill_server`, `restart_server`,
/// `stop_database`, `start_database`): written `- kill_server: {}`, or with a name, or
/// `via: peer` for the peer's server process.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub name: Option<String>,
    /// Which server process; the database steps take none.
    #[serde(default)]
    pub via: Via,
}

/// Which fault a step injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultKind {
    KillServer,
    RestartServer,
    StopDatabase,
    StartDatabase,
}

/// The four fault step kinds: what the scenario wrote, as the step of each kind.
macro_rules! fault_steps {
    ($($(#[$doc:meta])* $step:ident => $kind:ident,)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Deserialize)]
            #[serde(transparent)]
            pub struct $step(pub Located<Fault>);

            impl StepKind for $step {
                fn label(&self) -> String {
                    FaultKind::$kind.label(&self.0.value)
                }

                fn check(&self, c: &mut Checker<'_>, _scope: &mut Scope, ctx: &CheckCtx<'_>) {
                    FaultKind::$kind.check(&self.0, c, ctx);
                }

                fn waits(&self, _ctx: &Ctx<'_>) -> Duration {
                    FaultKind::$kind.waits()
                }

                async fn run(&self, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
                    FaultKind::$kind.inject(&self.0.value, ctx, label).await
                }
            }
        )*
    };
}

fault_steps! {
    /// SIGKILL to a server process of a deployment the runner controls.
    KillServer => KillServer,
    /// Starts a server process again on its data directory, database and port.
    RestartServer => RestartServer,
    /// Stops the deployment's database server abruptly.
    StopDatabase => StopDatabase,
    /// Starts the deployment's database server again.
    StartDatabase => StartDatabase,
}

impl FaultKind {
    /// The key that names the step in a scenario file.
    fn name(self) -> &'static str {
        match self {
            FaultKind::KillServer => "kill_server",
            FaultKind::RestartServer => "restart_server",
            FaultKind::StopDatabase => "stop_database",
            FaultKind::StartDatabase => "start_database",
        }
    }

    /// Its `name`, else the kind; a server's fault on the peer says so.
    fn label(self, f: &Fault) -> String {
        let name = f.name.as_deref().unwrap_or(self.name());
        match self {
            FaultKind::KillServer | FaultKind::RestartServer => {
                format!("{name}{}", f.via.label_suffix())
            }
            FaultKind::StopDatabase | FaultKind::StartDatabase => name.to_owned(),
        }
    }

    /// A server fault needs `server_control`; a database fault needs `database_control` and
    /// acts on no server process.
    fn check(self, f: &Located<Fault>, c: &mut Checker<'_>, ctx: &CheckCtx<'_>) {
        match self {
            FaultKind::KillServer | FaultKind::RestartServer => {
                if !ctx.requires.contains("server_control") {
                    c.err(
                        Pos::of(f),
                        format!("`{}` needs `requires: [server_control]`", self.name()),
                    );
                }
                c.via(f.value.via, Pos::of(f), ctx);
            }
            FaultKind::StopDatabase | FaultKind::StartDatabase => {
                if !ctx.requires.contains("database_control") {
                    c.err(
                        Pos::of(f),
                        format!("`{}` needs `requires: [database_control]`", self.name()),
                    );
                }
                if f.value.via == Via::Peer {
                    c.err(
                        Pos::of(f),
                        format!("`{}` acts on the database: it takes no `via`", self.name()),
                    );
                }
            }
        }
    }

    fn waits(self) -> Duration {
        // A server process prints its address within 30 s or is an error; `pg_ctl` waits
        // for the database to accept connections.
        match self {
            FaultKind::RestartServer | FaultKind::StartDatabase => Duration::from_secs(30),
            FaultKind::KillServer | FaultKind::StopDatabase => Duration::from_secs(5),
        }
    }

    async fn inject(self, fault: &Fault, ctx: &mut Ctx<'_>, label: &str) -> Result<(), StepError> {
        // The scenario requires the control, so it runs only on a deployment that has it: one
        // the runner started for it, or a service it launched (`--launch`), which has one
        // server process and no database the runner holds.
        let peer = fault.via == Via::Peer;
        let at_ms = ctx.at();
        let began = Instant::now();
        let done = if let Some(control) = ctx.target.control.as_ref() {
            match self {
                FaultKind::KillServer => control.kill_server(peer).await.map(|()| true),
                FaultKind::RestartServer => control.restart_server(peer).await,
                FaultKind::StopDatabase => control.stop_database().await.map(|()| true),
                FaultKind::StartDatabase => control.start_database().await.map(|()| true),
            }
        } else if ctx.target.can_restart() && !peer {
            match self {
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
        let acted = done.map_err(|e| StepError::Error(format!("{}: {e}", self.name())))?;
        let on = match (self, peer) {
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
            self.name()
        ));
        ctx.faults.push(FaultRecord {
            step: label.to_owned(),
            kind: self.name().to_owned(),
            on: on.to_owned(),
            at_ms,
            took_ms,
            checked_after: Vec::new(),
        });
        Ok(())
    }
}
