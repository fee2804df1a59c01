//! A JSON client of the control plane's HTTP API (docs/control-api.md) over hyper's
//! pooled client: an actor makes a few small requests per batch to one address.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

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
/// How long a call is retried while the control plane cannot be reached or answers
/// that it is unavailable: a trainer node restarting after a crash comes back within
/// this, so its actors wait for it rather than give up.
const OUTAGE_PATIENCE: Duration = Duration::from_secs(120);
/// The longest pause between two tries.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
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
    /// an error carrying the hub's message. While the control plane cannot be reached
    /// or answers 503 (a trainer node restarting), the call is tried again, backing off,
    /// for up to [`OUTAGE_PATIENCE`]: every call is safe to repeat (the control plane
    /// judges a repeated submission as a duplicate).
    pub async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, NodeError> {
        let fail = |reason: String| NodeError::Api {
            path: format!("POST {path}"),
            reason,
        };
        let body = Bytes::from(serde_json::to_vec(body).map_err(|e| fail(e.to_string()))?);
        let give_up = Instant::now() + OUTAGE_PATIENCE;
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.try_post(path, body.clone()).await {
                Err(Attempt::Unavailable(reason)) if Instant::now() < give_up => {
                    tracing::warn!(
                        path,
                        reason,
                        ?backoff,
                        "the control plane is unavailable; trying again"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(Attempt::Unavailable(reason) | Attempt::Failed(reason)) => {
                    return Err(fail(reason));
                }
                Ok(answer) => {
                    return serde_json::from_slice(&answer)
                        .map_err(|e| fail(format!("parsing the answer: {e}")));
                }
            }
        }
    }

    async fn try_post(&self, path: &str, body: Bytes) -> Result<Bytes, Attempt> {
        let request = hyper::Request::post(format!("{}{path}", self.base))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::AUTHORIZATION, &self.authorization)
            .body(Full::new(body))
            .map_err(|e| Attempt::Failed(e.to_string()))?;
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.pool.request(request))
            .await
            .map_err(|_| Attempt::Failed(format!("no answer within {REQUEST_TIMEOUT:?}")))?
            // No answer at all: refused, reset, or a pooled connection to a process that
            // is gone. Every call is safe to repeat, so each is worth another try.
            .map_err(|e| {
                use std::error::Error;
                Attempt::Unavailable(
                    e.source()
                        .map_or(e.to_string(), |cause| format!("{e}: {cause}")),
                )
            })?;
        let status = response.status();
        let answer = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| Attempt::Failed(format!("reading the answer: {e}")))?
            .to_bytes();
        let reason = || format!("{status}: {}", String::from_utf8_lossy(&answer));
        match status {
            _ if status.is_success() => Ok(answer),
            hyper::StatusCode::SERVICE_UNAVAILABLE => Err(Attempt::Unavailable(reason())),
            _ => Err(Attempt::Failed(reason())),
        }
    }
}

/// Why one try of a call failed: worth trying again, or not.
enum Attempt {
    Unavailable(String),
    Failed(String),
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Serves each of `answers` on a connection of its own (closed after it) at
    /// `address`, once `down_for` has passed: a control plane that restarts.
    async fn restarting_server(
        address: SocketAddr,
        down_for: Duration,
        answers: Vec<&'static str>,
    ) {
        tokio::time::sleep(down_for).await;
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        for answer in answers {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let mut buffer = [0; 1024];
                let read = socket.read(&mut buffer).await.unwrap();
                request.extend_from_slice(&buffer[..read]);
            }
            socket.write_all(answer.as_bytes()).await.unwrap();
        }
    }

    fn free_address() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    }

    const UNAVAILABLE: &str =
        "HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

    #[tokio::test]
    async fn a_call_waits_out_a_control_plane_that_is_down_or_unavailable() {
        let address = free_address();
        let ok = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}";
        let server = tokio::spawn(restarting_server(
            address,
            Duration::from_millis(300),
            vec![UNAVAILABLE, ok],
        ));
        let client = ControlClient::new(address, "token");
        let answer: serde_json::Value = client.post("/v1/heartbeat", &()).await.unwrap();
        assert_eq!(answer, serde_json::json!({ "ok": true }));
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_refusal_is_not_tried_again() {
        let address = free_address();
        let refused = "HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 11\r\n\r\nbad request";
        let server = tokio::spawn(restarting_server(address, Duration::ZERO, vec![refused]));
        let client = ControlClient::new(address, "token");
        let error = client
            .post::<_, serde_json::Value>("/v1/claim", &())
            .await
            .unwrap_err();
        assert!(
            error.to_string().contains("400 Bad Request: bad request"),
            "{error}"
        );
        server.await.unwrap();
    }
}
