//! The SQLite store: the embedded default.

use super::*;

pub struct SqliteStore {}

impl SqliteStore {
    pub async fn open(_path: Option<&std::path::Path>) -> Result<Self> {
        todo!()
    }
}
