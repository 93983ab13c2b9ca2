//! The `sandspec` command: the runner, and `sandspec serve` (the reference server).
fn main() {}
