-- The whole durable state of the reference server (SQLite). Timestamps are microseconds since
-- the Unix epoch so that they round-trip exactly; bodies are JSON text.

CREATE TABLE records (
    kind        TEXT    NOT NULL,
    id          TEXT    NOT NULL,
    owner       TEXT    NOT NULL,
    parent      TEXT,
    state       TEXT    NOT NULL,
    body        TEXT    NOT NULL,
    version     INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    due_at      INTEGER,
    PRIMARY KEY (kind, id)
);

-- Owner-scoped lists, ordered by (created_at, id).
CREATE INDEX records_by_owner ON records (kind, owner, created_at, id);
-- Children of one object (a sandbox's processes, a session's submissions).
CREATE INDEX records_by_parent ON records (kind, parent, created_at, id);
-- The reapers' work queue.
CREATE INDEX records_by_due ON records (kind, due_at) WHERE due_at IS NOT NULL;

-- One row per stream: the sequence counter that makes appends gap-free, and how far
-- retention has purged.
CREATE TABLE streams (
    stream          TEXT    NOT NULL PRIMARY KEY,
    last_seq        INTEGER NOT NULL,
    purged_through  INTEGER NOT NULL
);

CREATE TABLE events (
    stream  TEXT    NOT NULL,
    seq     INTEGER NOT NULL,
    kind    TEXT    NOT NULL,
    data    TEXT    NOT NULL,
    at      INTEGER NOT NULL,
    PRIMARY KEY (stream, seq)
);

-- Idempotency keys: in flight while `status` is NULL, done afterwards.
CREATE TABLE idempotency (
    principal     TEXT    NOT NULL,
    key           TEXT    NOT NULL,
    request_hash  TEXT    NOT NULL,
    status        INTEGER,
    resource_id   TEXT,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (principal, key)
);

CREATE INDEX idempotency_by_age ON idempotency (created_at);
