-- The whole durable state of the reference server (PostgreSQL). Timestamps are microseconds
-- since the Unix epoch so that they round-trip exactly; bodies are JSON text. Text keys use the
-- "C" collation so that ordering is by bytes, as in SQLite, whatever the database's locale.

CREATE TABLE records (
    kind        TEXT COLLATE "C" NOT NULL,
    id          TEXT COLLATE "C" NOT NULL,
    owner       TEXT COLLATE "C" NOT NULL,
    parent      TEXT COLLATE "C",
    state       TEXT COLLATE "C" NOT NULL,
    body        TEXT   NOT NULL,
    version     BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    due_at      BIGINT,
    PRIMARY KEY (kind, id)
);

-- Owner-scoped lists, ordered by (created_at, id).
CREATE INDEX records_by_owner ON records (kind, owner, created_at, id);
-- Children of one object (a sandbox's processes, a session's submissions).
CREATE INDEX records_by_parent ON records (kind, parent, created_at, id);
-- The reapers' work queue.
CREATE INDEX records_by_due ON records (kind, due_at) WHERE due_at IS NOT NULL;

-- One row per stream: the sequence counter that makes appends gap-free (its row lock
-- serializes concurrent appends from every server process), and how far retention has purged.
CREATE TABLE streams (
    stream          TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    last_seq        BIGINT NOT NULL,
    purged_through  BIGINT NOT NULL
);

CREATE TABLE events (
    stream  TEXT COLLATE "C" NOT NULL,
    seq     BIGINT NOT NULL,
    kind    TEXT   NOT NULL,
    data    TEXT   NOT NULL,
    at      BIGINT NOT NULL,
    PRIMARY KEY (stream, seq)
);

-- Idempotency keys: in flight while `status` is NULL, done afterwards.
CREATE TABLE idempotency (
    principal     TEXT COLLATE "C" NOT NULL,
    key           TEXT COLLATE "C" NOT NULL,
    request_hash  TEXT    NOT NULL,
    status        INTEGER,
    resource_id   TEXT,
    created_at    BIGINT  NOT NULL,
    PRIMARY KEY (principal, key)
);

CREATE INDEX idempotency_by_age ON idempotency (created_at);
