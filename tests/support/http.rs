//! JSON calls with a bearer token on a server a test talks to directly.

#![allow(dead_code)]

use serde_json::Value;

/// `GET url` with `token`; the decoded JSON body.
pub async fn get_json(client: &reqwest::Client, url: &str, token: &str) -> Value {
    decode(client.get(url).bearer_auth(token), url).await
}

/// `POST url` with `token` and the JSON `body`; the decoded JSON body.
pub async fn post_json(client: &reqwest::Client, url: &str, token: &str, body: &Value) -> Value {
    decode(client.post(url).bearer_auth(token).json(body), url).await
}

async fn decode(request: reqwest::RequestBuilder, url: &str) -> Value {
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    response
        .json()
        .await
        .unwrap_or_else(|e| panic!("{url}: the body is not JSON: {e}"))
}
