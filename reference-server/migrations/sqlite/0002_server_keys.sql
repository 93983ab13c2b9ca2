-- Keys every server process on the database shares (the page-token key), created once by the
-- first process that needs one. Not part of the state digest: no request changes them.
CREATE TABLE server_keys (
    name   TEXT NOT NULL PRIMARY KEY,
    value  TEXT NOT NULL
);
