//! The Agent Sandbox profile (`--api agent-sandbox`): the runtime service of
//! `agent-sandbox-server`, a service sandspec did not write. Its clauses are
//! `docs/profiles/agent-sandbox.md`'s; its negative controls are the defects of a stand-in
//! loaded into the real service; the runner can launch the service itself (`--launch`).

mod binding;
mod launch;

pub use binding::{AgentSandbox, CATALOG_FOLDER, DEFECTS};
pub use launch::{
    BASE_DIR_ENV, DEFECT_ENV, LaunchedService, OTHER_TOKEN_ENV, OWNER_TOKEN_ENV, POLICY_ENV,
    PORT_ENV, STATE_DIR_ENV, UNSCOPED_SCOPE, UNSCOPED_TOKEN_ENV, policy_json,
};
