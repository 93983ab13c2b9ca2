//! `run(listener, config, shutdown)`: the server, its TLS, and its background reapers.
