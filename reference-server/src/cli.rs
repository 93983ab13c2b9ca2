//! The `sandspec serve` command line.
