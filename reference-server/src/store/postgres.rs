//! The PostgreSQL store: several server processes share one database.

use super::*;

pub struct PostgresStore {}

impl PostgresStore {
    pub async fn connect(_url: &str) -> Result<Self> {
        todo!()
    }
}
