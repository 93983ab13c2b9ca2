//! What the SQLite and PostgreSQL stores share: row shapes, the encoding of times and JSON,
//! list queries and the digest, so that both stores agree to the byte.

use serde_json::Value;
use sha2::{Digest as _, Sha256};
use sqlx::{ColumnIndex, Database, Decode, Encode, QueryBuilder, Row, Type};
use time::OffsetDateTime;

use super::{Event, IdemClaim, Kind, ListQuery, Record, Result, Scope, StoreError};

/// The columns every record query selects, in the order [`RawRecord::from_row`] reads them.
const RECORD_COLUMNS: &str = "kind, id, owner, parent, state, body, version, created_at, due_at";

/// Microseconds since the Unix epoch: exact for every time `clock::now()` produces, and the
/// same integer in both databases.
pub(super) fn micros(t: OffsetDateTime) -> i64 {
    i64::try_from(t.unix_timestamp_nanos().div_euclid(1000)).unwrap_or(i64::MAX)
}

pub(super) fn from_micros(us: i64) -> Result<OffsetDateTime> {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(us) * 1000)
        .map_err(|e| StoreError::Corrupt(format!("timestamp {us}: {e}")))
}

fn parse_json(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("stored JSON: {e}")))
}

/// JSON text as stored. Serializing a `Value` cannot fail (its keys are strings).
pub(super) fn json_text(v: &Value) -> String {
    v.to_string()
}

/// A record as its columns hold it.
pub(super) struct RawRecord {
    kind: String,
    id: String,
    owner: String,
    parent: Option<String>,
    state: String,
    body: String,
    version: i64,
    created_at: i64,
    due_at: Option<i64>,
}

/// The bounds that let one generic function read rows of either database.
pub(super) trait Columns<DB: Database>: for<'r> Decode<'r, DB> + Type<DB> + Send {}
impl<DB: Database, T: for<'r> Decode<'r, DB> + Type<DB> + Send> Columns<DB> for T {}

impl RawRecord {
    /// Reads the columns of [`RECORD_COLUMNS`] by position.
    pub(super) fn from_row<R: Row>(row: &R) -> Result<Self>
    where
        usize: ColumnIndex<R>,
        String: Columns<R::Database>,
        Option<String>: Columns<R::Database>,
        i64: Columns<R::Database>,
        Option<i64>: Columns<R::Database>,
    {
        Ok(Self {
            kind: row.try_get(0)?,
            id: row.try_get(1)?,
            owner: row.try_get(2)?,
            parent: row.try_get(3)?,
            state: row.try_get(4)?,
            body: row.try_get(5)?,
            version: row.try_get(6)?,
            created_at: row.try_get(7)?,
            due_at: row.try_get(8)?,
        })
    }

    pub(super) fn into_record(self) -> Result<Record> {
        Ok(Record {
            kind: Kind::parse(&self.kind)
                .ok_or_else(|| StoreError::Corrupt(format!("unknown kind {:?}", self.kind)))?,
            id: self.id,
            owner: self.owner,
            parent: self.parent,
            state: self.state,
            body: parse_json(&self.body)?,
            version: self.version,
            created_at: from_micros(self.created_at)?,
            due_at: self.due_at.map(from_micros).transpose()?,
        })
    }
}

/// An event as its columns hold it.
pub(super) struct RawEvent {
    pub(super) stream: String,
    pub(super) seq: i64,
    pub(super) kind: String,
    pub(super) data: String,
    pub(super) at: i64,
}

impl RawEvent {
    /// Reads `stream, seq, kind, data, at` by position.
    pub(super) fn from_row<R: Row>(row: &R) -> Result<Self>
    where
        usize: ColumnIndex<R>,
        String: Columns<R::Database>,
        i64: Columns<R::Database>,
    {
        Ok(Self {
            stream: row.try_get(0)?,
            seq: row.try_get(1)?,
            kind: row.try_get(2)?,
            data: row.try_get(3)?,
            at: row.try_get(4)?,
        })
    }

    pub(super) fn into_event(self) -> Result<Event> {
        Ok(Event {
            stream: self.stream,
            seq: self.seq,
            kind: self.kind,
            data: parse_json(&self.data)?,
            at: from_micros(self.at)?,
        })
    }
}

/// A row of the `streams` table.
pub(super) struct RawStream {
    pub(super) stream: String,
    pub(super) last_seq: i64,
    pub(super) purged_through: i64,
}

impl RawStream {
    /// Reads `stream, last_seq, purged_through` by position.
    pub(super) fn from_row<R: Row>(row: &R) -> Result<Self>
    where
        usize: ColumnIndex<R>,
        String: Columns<R::Database>,
        i64: Columns<R::Database>,
    {
        Ok(Self {
            stream: row.try_get(0)?,
            last_seq: row.try_get(1)?,
            purged_through: row.try_get(2)?,
        })
    }
}

/// A row of the `idempotency` table.
pub(super) struct RawIdem {
    pub(super) principal: String,
    pub(super) key: String,
    pub(super) request_hash: String,
    pub(super) status: Option<i32>,
    pub(super) resource_id: Option<String>,
    pub(super) created_at: i64,
}

impl RawIdem {
    /// Reads `principal, key, request_hash, status, resource_id, created_at` by position.
    pub(super) fn from_row<R: Row>(row: &R) -> Result<Self>
    where
        usize: ColumnIndex<R>,
        String: Columns<R::Database>,
        Option<String>: Columns<R::Database>,
        Option<i32>: Columns<R::Database>,
        i64: Columns<R::Database>,
    {
        Ok(Self {
            principal: row.try_get(0)?,
            key: row.try_get(1)?,
            request_hash: row.try_get(2)?,
            status: row.try_get(3)?,
            resource_id: row.try_get(4)?,
            created_at: row.try_get(5)?,
        })
    }

    /// What a claim that found this row reports.
    pub(super) fn into_claim(self) -> Result<IdemClaim> {
        Ok(match self.status {
            None => IdemClaim::InFlight {
                request_hash: self.request_hash,
            },
            Some(status) => IdemClaim::Done {
                request_hash: self.request_hash,
                status: u16::try_from(status)
                    .map_err(|_| StoreError::Corrupt(format!("idempotency status {status}")))?,
                resource_id: self.resource_id.unwrap_or_default(),
            },
        })
    }
}

/// Builds `SELECT <record columns> FROM records WHERE ...` for a list query. Placeholders are
/// the database's own, so the same function serves both stores.
pub(super) fn list_query<DB: Database>(q: &ListQuery<'_>) -> QueryBuilder<DB>
where
    String: for<'t> Encode<'t, DB> + Type<DB>,
    i64: for<'t> Encode<'t, DB> + Type<DB>,
{
    let mut qb = QueryBuilder::new(format!(
        "SELECT {RECORD_COLUMNS} FROM records WHERE kind = "
    ));
    qb.push_bind(q.kind.as_str().to_owned());
    if let Scope::Owner(owner) = q.scope {
        qb.push(" AND owner = ").push_bind(owner.to_owned());
    }
    if let Some(parent) = q.parent {
        qb.push(" AND parent = ").push_bind(parent.to_owned());
    }
    if let Some(state) = q.state {
        qb.push(" AND state = ").push_bind(state.to_owned());
    }
    if !q.states.is_empty() {
        qb.push(" AND state IN (");
        let mut states = qb.separated(", ");
        for state in q.states {
            states.push_bind((*state).to_owned());
        }
        qb.push(")");
    }
    if let Some((created_at, id)) = &q.after {
        let at = micros(*created_at);
        qb.push(" AND (created_at > ").push_bind(at);
        qb.push(" OR (created_at = ").push_bind(at);
        qb.push(" AND id > ").push_bind(id.clone()).push("))");
    }
    qb.push(" ORDER BY created_at, id");
    if let Some(limit) = q.limit {
        qb.push(" LIMIT ").push_bind(i64::from(limit));
    }
    qb
}

/// Everything durable, as read by one store inside one transaction.
#[derive(Default)]
pub(super) struct Snapshot {
    pub(super) records: Vec<RawRecord>,
    pub(super) events: Vec<RawEvent>,
    pub(super) streams: Vec<RawStream>,
    pub(super) idempotency: Vec<RawIdem>,
}

impl Snapshot {
    /// SHA-256 over one canonical JSON line per row. Rows are sorted here, by bytes, rather
    /// than by the database, whose collation may differ; bodies are re-serialized from their
    /// parsed value with sorted keys, so the text a database happens to keep does not matter.
    pub(super) fn digest(mut self) -> Result<String> {
        self.records
            .sort_by(|a, b| (&a.kind, &a.id).cmp(&(&b.kind, &b.id)));
        self.events
            .sort_by(|a, b| (&a.stream, a.seq).cmp(&(&b.stream, b.seq)));
        self.streams.sort_by(|a, b| a.stream.cmp(&b.stream));
        self.idempotency
            .sort_by(|a, b| (&a.principal, &a.key).cmp(&(&b.principal, &b.key)));

        let mut hasher = Sha256::new();
        let mut line = String::new();
        let mut emit = |row: Value| {
            line.clear();
            canonical_json(&row, &mut line);
            line.push('\n');
            hasher.update(line.as_bytes());
        };
        for r in self.records {
            emit(serde_json::json!([
                "record",
                r.kind,
                r.id,
                r.owner,
                r.parent,
                r.state,
                parse_json(&r.body)?,
                r.version,
                r.created_at,
                r.due_at
            ]));
        }
        for e in self.events {
            emit(serde_json::json!([
                "event",
                e.stream,
                e.seq,
                e.kind,
                parse_json(&e.data)?,
                e.at
            ]));
        }
        for s in self.streams {
            emit(serde_json::json!([
                "stream",
                s.stream,
                s.last_seq,
                s.purged_through
            ]));
        }
        for i in self.idempotency {
            emit(serde_json::json!([
                "idempotency",
                i.principal,
                i.key,
                i.request_hash,
                i.status,
                i.resource_id,
                i.created_at
            ]));
        }
        Ok(hex::encode(hasher.finalize()))
    }
}

/// Writes `v` as JSON with object keys sorted by bytes and no whitespace, whatever order the
/// map keeps its keys in.
pub(super) fn canonical_json(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                canonical_json(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// A stored shared key (hex) back to bytes.
pub(super) fn decode_key(hex_value: &str) -> Result<[u8; 32]> {
    hex::decode(hex_value)
        .ok()
        .and_then(|v| <[u8; 32]>::try_from(v).ok())
        .ok_or_else(|| StoreError::Corrupt("a shared key is not 32 bytes of hex".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let v = serde_json::json!({"b": [{"z": 1, "a": null}], "a": "x\"y"});
        let mut out = String::new();
        canonical_json(&v, &mut out);
        assert_eq!(out, r#"{"a":"x\"y","b":[{"a":null,"z":1}]}"#);
    }

    #[test]
    fn micros_round_trip_and_truncate() {
        let t = time::macros::datetime!(2024-05-06 07:08:09.123456 UTC);
        assert_eq!(from_micros(micros(t)).unwrap(), t);
        let finer = time::macros::datetime!(2024-05-06 07:08:09.123456789 UTC);
        assert_eq!(from_micros(micros(finer)).unwrap(), t);
        let before_epoch = time::macros::datetime!(1969-12-31 23:59:59.999999 UTC);
        assert_eq!(from_micros(micros(before_epoch)).unwrap(), before_epoch);
    }
}
