//! The shared store test suite, run against every implementation.
