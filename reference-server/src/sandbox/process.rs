//! Process groups inside a sandbox: spawn, output capture into the event log, stdin, signals, timeouts.
