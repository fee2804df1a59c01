//! A minimal JSON client of the control plane's HTTP API over hyper's pooled client:
//! the run's nodes make a few small requests per batch to one address.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Longest wait for one answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Answers larger than this are refused (the hub's largest is the status view).
const MAX_ANSWER_BYTES: usize = 4 << 20;

pub struct Client {
    pool: Pool<HttpConnector, Full<Bytes>>,
    base: String,
    authorization: String,
}

impl Client {
    pub fn new(address: SocketAddr, token: String) -> Client {
        Client {
            pool: Pool::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{address}"),
            authorization: format!("Bearer {token}"),
        }
    }

    /// POSTs `body` as JSON to `path` and parses the JSON answer; a non-2xx status is
    /// an error carrying the hub's message.
    pub async fn post<B: Serialize, R: DeserializeOwned>(&self, path: &str, body: &B) -> Result<R> {
        let request = hyper::Request::post(format!("{}{path}", self.base))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::AUTHORIZATION, &self.authorization)
            .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.pool.request(request))
            .await
            .with_context(|| format!("POST {path}: no answer within {REQUEST_TIMEOUT:?}"))?
            .with_context(|| format!("POST {path}"))?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|error| anyhow::anyhow!("POST {path}: reading the answer: {error}"))?
            .to_bytes();
        if !status.is_success() {
            bail!("POST {path}: {status}: {}", String::from_utf8_lossy(&body));
        }
        serde_json::from_slice(&body).with_context(|| format!("POST {path}: parsing the answer"))
    }
}
