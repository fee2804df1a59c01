//! A JSON client of the control plane's HTTP API (docs/control-api.md) over hyper's
//! pooled client: an actor makes a few small requests per batch to one address.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::NodeError;

/// Longest wait for one answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Answers larger than this are refused (the hub's largest is the status view).
const MAX_ANSWER_BYTES: usize = 4 << 20;

pub struct ControlClient {
    pool: Pool<HttpConnector, Full<Bytes>>,
    base: String,
    authorization: String,
}

impl ControlClient {
    pub fn new(address: SocketAddr, token: &str) -> ControlClient {
        ControlClient {
            pool: Pool::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{address}"),
            authorization: format!("Bearer {token}"),
        }
    }

    /// POSTs `body` as JSON to `path` and parses the JSON answer; a non-2xx status is
    /// an error carrying the hub's message.
    pub async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, NodeError> {
        let fail = |reason: String| NodeError::Api {
            path: format!("POST {path}"),
            reason,
        };
        let body = serde_json::to_vec(body).map_err(|e| fail(e.to_string()))?;
        let request = hyper::Request::post(format!("{}{path}", self.base))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::AUTHORIZATION, &self.authorization)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| fail(e.to_string()))?;
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.pool.request(request))
            .await
            .map_err(|_| fail(format!("no answer within {REQUEST_TIMEOUT:?}")))?
            .map_err(|e| fail(e.to_string()))?;
        let status = response.status();
        let answer = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| fail(format!("reading the answer: {e}")))?
            .to_bytes();
        if !status.is_success() {
            return Err(fail(format!(
                "{status}: {}",
                String::from_utf8_lossy(&answer)
            )));
        }
        serde_json::from_slice(&answer).map_err(|e| fail(format!("parsing the answer: {e}")))
    }
}
