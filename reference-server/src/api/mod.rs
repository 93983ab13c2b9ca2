//! HTTP handlers, wire types, and the one mapping from errors to problem bodies.
//!
//! Architecture invariant: only this module knows status codes and JSON wire shapes.
