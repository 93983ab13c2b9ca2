//! The scenario file model: what one YAML scenario file may say, and nothing more.
//!
//! Every struct denies unknown fields, and step kinds are an externally tagged enum (each
//! kind's model lives with its run, in `crate::engine::steps`), so a misspelt key is an error
//! at its line rather than a silently ignored assertion. Values that later checks need to
//! point at (templates, JSON bodies, IDs) keep their source position.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use super::pos::Located;
use crate::engine::steps::Step;
use crate::profile::Level;

/// One scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Stable literal ID, e.g. `SBX-LIFE-001`; never a position number.
    pub id: Located<String>,
    pub title: String,
    /// Protocol clause IDs from `docs/protocol.md`, e.g. `SBX-3.4`.
    pub clauses: Vec<Located<String>>,
    pub level: Level,
    /// Capabilities the target must advertise, else the scenario is skipped.
    #[serde(default)]
    pub requires: Vec<Located<String>>,
    #[serde(default)]
    pub tags: Vec<String>,
    /// Reference-server defects this scenario must catch (negative controls), each with the
    /// step at which it must fail.
    #[serde(default)]
    pub defects: Vec<DefectRef>,
    /// Run alone, with no other scenario in flight (digest scenarios compare global state).
    #[serde(default)]
    pub exclusive: bool,
    pub steps: Vec<Step>,
    /// Always run, whatever happened in `steps`.
    #[serde(default)]
    pub cleanup: Vec<Step>,
    /// The built-in variables the scenario's steps use (`base_dir`, `limits.<key>`), found
    /// by the parser: what the scenario needs of the run beyond its `requires`.
    #[serde(skip)]
    pub builtins: std::collections::BTreeSet<String>,
}

/// One negative control: a deliberate defect of the reference server and the step of
/// `steps` that must be the first to fail against a server with it switched on.
#[derive(Debug, Clone)]
pub struct DefectRef {
    /// The defect's stable name (`reference-server/src/defects.rs`).
    pub defect: Located<String>,
    /// The failing step, by its label ([`Step::label`]): its `name`, or for a step without
    /// one what the engine calls it (`GET /v1/sandboxes/{{sbx}}`, `expect_digest_unchanged`).
    pub fails_at: Located<String>,
}

/// By hand, so that a bare defect name (the form before controls named their step) is refused
/// with the form to write instead of a generic "expected mapping".
impl<'de> Deserialize<'de> for DefectRef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = DefectRef;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`{defect: <name>, fails_at: <label of the step that must fail>}`")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<DefectRef, E> {
                Err(E::custom(format!(
                    "write `{{defect: {name}, fails_at: <step>}}`: a negative control names the step that must fail"
                )))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<DefectRef, A::Error> {
                const FIELDS: &[&str] = &["defect", "fails_at"];
                let mut defect = None;
                let mut fails_at = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "defect" if defect.is_none() => defect = Some(map.next_value()?),
                        "fails_at" if fails_at.is_none() => fails_at = Some(map.next_value()?),
                        "defect" | "fails_at" => return Err(de::Error::duplicate_field(FIELDS[0])),
                        other => return Err(de::Error::unknown_field(other, FIELDS)),
                    }
                }
                Ok(DefectRef {
                    defect: defect.ok_or_else(|| de::Error::missing_field("defect"))?,
                    fails_at: fails_at.ok_or_else(|| de::Error::missing_field("fails_at"))?,
                })
            }
        }
        deserializer.deserialize_any(V)
    }
}

impl Scenario {
    /// The indexes of the steps (not cleanup) whose label is `label`.
    pub fn steps_labelled(&self, label: &str) -> Vec<usize> {
        self.steps
            .iter()
            .enumerate()
            .filter(|(_, step)| step.label() == label)
            .map(|(i, _)| i)
            .collect()
    }

    /// The step a negative control must fail at, as an outcome names it
    /// (`steps[3] get as the other principal`); `None` when `fails_at` names no single step
    /// (the parser refuses such a file).
    pub fn fails_at(&self, control: &DefectRef) -> Option<String> {
        match self.steps_labelled(&control.fails_at.value).as_slice() {
            [i] => Some(step_label("steps", *i, &self.steps[*i])),
            _ => None,
        }
    }
}

/// How outcomes and transcripts name a step: `steps[2] create` or `cleanup[0] DELETE /v1/...`.
pub fn step_label(section: &str, index: usize, step: &Step) -> String {
    format!("{section}[{index}] {}", step.label())
}
