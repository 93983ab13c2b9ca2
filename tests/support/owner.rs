//! Direct calls on a reference server the test started, as its owner, over plain HTTP: to
//! set up state a run then meets, and to look at what the run left.

use sandspec::target::ReferenceServer;
use serde_json::Value;

/// `POST path` with `body` as the owner; the created object's ID.
pub async fn create(server: &ReferenceServer, path: &str, body: Value) -> String {
    let resp = sandspec::target::build_client(None)
        .unwrap()
        .post(format!("{}{path}", server.url))
        .bearer_auth(&server.tokens.owner)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 201, "POST {path}");
    resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The status of `GET path` as the owner.
pub async fn status(server: &ReferenceServer, path: &str) -> u16 {
    sandspec::target::build_client(None)
        .unwrap()
        .get(format!("{}{path}", server.url))
        .bearer_auth(&server.tokens.owner)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}
