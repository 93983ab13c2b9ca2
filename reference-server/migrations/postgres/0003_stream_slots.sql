-- Open SSE streams per principal across every server process (limits.max_streams_per_principal).
-- A row lives while its stream is open; rows of a process that died are removed by the next
-- claim for the same principal. Not part of the state digest: streams are not durable state.
CREATE TABLE stream_slots (
    id         TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    principal  TEXT COLLATE "C" NOT NULL,
    instance   TEXT COLLATE "C" NOT NULL
);

CREATE INDEX stream_slots_by_principal ON stream_slots (principal);
