//! The hub's HTTP API end to end: over real sockets with a raw HTTP/1.1 client, and
//! through the router in memory for the error paths, tokens, payloads, lease expiry
//! and restarts.

mod common;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use aurora_api::{
    ClaimResponse, MAX_PAYLOAD_BYTES, Outcome, StatusResponse, SubmitResponse, format_hash,
};
use aurora_control::{ActorId, Config, PromptId, StepId, Version, WeightsHash};
use aurora_hub::{
    CallError, HEADER_READ_TIMEOUT, Hub, LoadError, MAX_BODY_BYTES, MAX_CONCURRENT_REQUESTS,
    MAX_SMALL_BODY_BYTES, OpenError, REQUEST_TIMEOUT, Security, SecurityError, router, run,
};
use axum::body::{Body, Bytes};
use axum::http::{Method, Request, StatusCode};
use common::{FLEET, HASH, TestHub, error_message, plaintext, rejection, result_json, submit_body};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

const REGISTER: &str = r#"{"actor":1,"region":"eu-west","active":1}"#;

/// One request over a fresh connection: the smallest HTTP/1.1 client that works
/// against hyper (`Connection: close`, so the body ends with the stream).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: &str,
    body: &str,
) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\
         Authorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    read_response(&mut stream).await
}

async fn read_response(stream: &mut TcpStream) -> (u16, String) {
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {response:?}"));
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

async fn serve(hub: &TestHub) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(run(Arc::clone(&hub.hub), listener, plaintext()));
    addr
}

fn payload(prompt: u64) -> serde_json::Value {
    json!({ "prompt": prompt, "completion": format!("answer to {prompt}"), "reward": 1.0 })
}

#[tokio::test]
async fn a_result_and_its_payload_are_accepted_end_to_end_over_a_socket() {
    let hub = TestHub::with_step(&[10]);
    let addr = serve(&hub).await;

    let (status, body) = http(addr, "POST", "/v1/register", FLEET, REGISTER).await;
    assert_eq!(status, 200, "{body}");
    let registered: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(registered["kind"], "ready");
    let token = registered["token"].as_str().unwrap().to_owned();
    assert!(token.starts_with("1."), "{token}");

    let (status, body) = http(addr, "POST", "/v1/claim", &token, r#"{"actor":1}"#).await;
    assert_eq!(status, 200, "{body}");
    let ClaimResponse::Work { commit, leases } = serde_json::from_str(&body).unwrap() else {
        panic!("expected work: {body}");
    };
    assert_eq!(commit, None);
    assert_eq!(leases.len(), 1);
    assert_eq!((leases[0].prompt, leases[0].version), (10, 1));

    let submit = submit_body(1, &[(&leases[0], payload(10))]);
    let (status, body) = http(addr, "POST", "/v1/submit", &token, &submit).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, r#"{"outcomes":[{"status":"accepted","prompt":10}]}"#);

    let (status, body) = http(addr, "GET", "/metrics", FLEET, "").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("\naurora_results_accepted_total 1\n"),
        "{body}"
    );
    assert!(body.contains("aurora_leases_issued_total 1\n"), "{body}");
    assert!(body.contains("aurora_actors{state=\"live\"} 1\n"), "{body}");

    let (status, body) = http(addr, "GET", "/v1/status", FLEET, "").await;
    assert_eq!(status, 200);
    let status: StatusResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(status.accepted, 1);
    assert!(status.step.unwrap().complete);

    let results = hub.hub.take_step_outcome().unwrap().unwrap();
    assert_eq!(results.outcome.accepted, vec![(PromptId(10), ActorId(1))]);
    assert_eq!(results.rollouts.len(), 1);
    assert_eq!(results.rollouts[0].prompt, PromptId(10));
    assert_eq!(results.rollouts[0].actor, ActorId(1));
    let stored: serde_json::Value =
        serde_json::from_str(results.rollouts[0].payload.get()).unwrap();
    assert_eq!(stored, payload(10));
}

#[tokio::test]
async fn fleet_routes_refuse_a_missing_or_wrong_fleet_token() {
    let hub = TestHub::with_step(&[10]);
    let actor_token = hub.register(2).await;
    let cases = [
        (
            None,
            "missing bearer token (send `Authorization: Bearer <token>`)",
        ),
        (Some("wrong-token!"), "wrong fleet token"),
        (Some("s3cret-fleet-toke"), "wrong fleet token"),
        // An actor's token is not the fleet's.
        (Some(actor_token.as_str()), "wrong fleet token"),
    ];
    for (token, expected) in cases {
        for (method, path, body) in [
            (Method::POST, "/v1/register", REGISTER),
            (Method::GET, "/v1/status", ""),
            (Method::GET, "/metrics", ""),
        ] {
            let (status, body) = hub.call(method, path, token, body).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} {token:?}");
            assert_eq!(error_message(&body), expected, "{path} {token:?}");
        }
    }
    // Nothing got through.
    assert!(hub.hub.inspect(|core| core.member(ActorId(1)).is_none()));
}

#[tokio::test]
async fn every_actor_call_needs_that_actors_own_current_token() {
    let hub = TestHub::with_step(&[10]);
    let first = hub.register(1).await;
    let other = hub.register(2).await;
    let routes = [
        "/v1/heartbeat",
        "/v1/versions",
        "/v1/claim",
        "/v1/submit",
        "/v1/leave",
        "/v1/preempt",
    ];
    let mut tampered = first.clone().into_bytes();
    let last = tampered.len() - 1;
    tampered[last] = if tampered[last] == b'0' { b'1' } else { b'0' };
    let tampered = String::from_utf8(tampered).unwrap();
    let unissued = format!("9.{}", &first[2..]);
    let refusals = [
        (
            None,
            "missing bearer token (send `Authorization: Bearer <token>`)".to_owned(),
        ),
        (
            Some(FLEET),
            "not an actor token: actor routes take the `<actor>.<secret>` token that \
             /v1/register returned"
                .to_owned(),
        ),
        (
            Some(unissued.as_str()),
            "no token is issued to actor 9: register first".to_owned(),
        ),
        (
            Some(tampered.as_str()),
            "wrong or outdated token for actor 1: register again to get a new one".to_owned(),
        ),
    ];
    for (token, expected) in &refusals {
        for route in routes {
            // A valid body for every route: the refusal must be about the token.
            let body = match route {
                "/v1/versions" => r#"{"actor":1,"active":1}"#,
                "/v1/submit" => r#"{"actor":1,"results":[]}"#,
                _ => r#"{"actor":1}"#,
            };
            let (status, body) = hub.call(Method::POST, route, *token, body).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{route} {token:?}");
            assert_eq!(&error_message(&body), expected, "{route} {token:?}");
        }
    }
    // A valid token of another actor is a 403: authenticated, but not as actor 1.
    for route in routes {
        let body = match route {
            "/v1/versions" => r#"{"actor":1,"active":1}"#,
            "/v1/submit" => r#"{"actor":1,"results":[]}"#,
            _ => r#"{"actor":1}"#,
        };
        let (status, body) = hub.post(route, &other, body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{route}");
        assert_eq!(
            error_message(&body),
            "the token is actor 2's; it cannot act for actor 1",
            "{route}"
        );
    }
    assert_eq!(
        hub.post("/v1/heartbeat", &first, r#"{"actor":1}"#).await.0,
        StatusCode::OK
    );

    // A re-registration rotates the token: the old one stops working.
    let rotated = hub.register(1).await;
    assert_ne!(rotated, first);
    let (status, body) = hub.post("/v1/heartbeat", &first, r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        error_message(&body),
        "wrong or outdated token for actor 1: register again to get a new one"
    );
    assert_eq!(
        hub.post("/v1/heartbeat", &rotated, r#"{"actor":1}"#)
            .await
            .0,
        StatusCode::OK
    );

    // Leaving ends the registration, and the token with it.
    assert_eq!(
        hub.post("/v1/leave", &rotated, r#"{"actor":1}"#).await.0,
        StatusCode::OK
    );
    let (status, body) = hub.post("/v1/heartbeat", &rotated, r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        error_message(&body),
        "no token is issued to actor 1: register first"
    );
}

#[tokio::test]
async fn bad_bodies_get_a_json_error_naming_the_problem() {
    let hub = TestHub::with_step(&[10]);

    // Every route but the submission takes a small body: one of 16 KiB and a byte is
    // refused before it is parsed, on a registration as on an actor's call.
    let oversized = vec![b' '; MAX_SMALL_BODY_BYTES + 1];
    let (status, body) = hub
        .call(Method::POST, "/v1/register", Some(FLEET), oversized.clone())
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(!error_message(&body).is_empty());
    let token = hub.register(7).await;
    for route in ["/v1/heartbeat", "/v1/versions", "/v1/claim", "/v1/leave"] {
        let (status, _) = hub
            .call(Method::POST, route, Some(&token), oversized.clone())
            .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{route}");
    }

    let (status, body) = hub.post("/v1/register", FLEET, "{\"actor\": ").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&body).contains("EOF"), "{body}");

    let (status, body) = hub.post("/v1/register", FLEET, r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).contains("missing field `region`"),
        "{body}"
    );

    let bad_region = r#"{"actor":1,"region":"eu west","active":1}"#;
    let (status, body) = hub.post("/v1/register", FLEET, bad_region).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&body).starts_with("region: "), "{body}");

    let future = r#"{"actor":2,"region":"eu-west","active":5}"#;
    let (status, body) = hub.post("/v1/register", FLEET, future).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).contains("has not been published"),
        "{body}"
    );

    let token = hub.register(1).await;
    let bad_hash = r#"{"actor":1,"results":[{"lease":{"step":0,"job":0,"attempt":0},
        "version":1,"weights_hash":"abc","tokens":5,"payload":null}]}"#;
    let (status, body) = hub.post("/v1/submit", &token, bad_hash).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_message(&body),
        "results[0].weights_hash: expected 64 hex digits"
    );

    let no_payload = format!(
        r#"{{"actor":1,"results":[{{"lease":{{"step":0,"job":0,"attempt":0}},
        "version":1,"weights_hash":"{}","tokens":5}}]}}"#,
        format_hash(&HASH)
    );
    let (status, body) = hub.post("/v1/submit", &token, &no_payload).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).contains("missing field `payload`"),
        "{body}"
    );

    let (status, body) = hub
        .post(
            "/v1/versions",
            &token,
            r#"{"actor":1,"active":1,"staged":3}"#,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_message(&body),
        "staged v3 is not the version after active v1"
    );
}

#[tokio::test]
async fn limit_max_payload_bytes_and_max_body_bytes() {
    // 32 results with payloads of the largest size fit in one submission.
    let prompts: Vec<u64> = (0..33).collect();
    let hub = TestHub::with_step(&prompts);
    let token = hub.register(1).await;
    let leases = hub.claim(1, &token).await;
    assert_eq!(leases.len(), 33);
    // A JSON string of exactly MAX_PAYLOAD_BYTES, quotes included.
    let largest = |prompt: u64| {
        let text = format!("{}{prompt:04}", "x".repeat(MAX_PAYLOAD_BYTES - 2 - 4));
        serde_json::Value::String(text)
    };
    let results: Vec<_> = leases[..32]
        .iter()
        .map(|lease| (lease, largest(lease.prompt)))
        .collect();
    let body = submit_body(1, &results);
    assert!(body.len() <= MAX_BODY_BYTES, "{}", body.len());
    let (status, answer) = hub.post("/v1/submit", &token, &body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert!(answer.matches("\"accepted\"").count() == 32, "{answer}");

    // One byte more in a payload is refused, naming the result.
    let over = json!("x".repeat(MAX_PAYLOAD_BYTES - 1));
    let body = submit_body(1, &[(&leases[32], over)]);
    let (status, answer) = hub.post("/v1/submit", &token, &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_message(&answer),
        format!(
            "results[0].payload: {} bytes, more than the limit of {MAX_PAYLOAD_BYTES}",
            MAX_PAYLOAD_BYTES + 1
        )
    );
    // And a body over the limit is refused before it is parsed.
    let mut body = submit_body(1, &[(&leases[32], json!(null))]).into_bytes();
    body.resize(MAX_BODY_BYTES + 1, b' ');
    let (status, _) = hub
        .call(Method::POST, "/v1/submit", Some(&token), body)
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    let mut results = hub.hub.rollouts(StepId(0)).unwrap();
    assert_eq!(results.len(), 32);
    let last = results.pop().unwrap();
    assert_eq!(last.payload.get(), largest(last.prompt.0).to_string());
}

#[tokio::test]
async fn accepted_payloads_survive_a_restart_and_are_never_duplicated() {
    let hub = TestHub::with_step(&[10, 11]);
    let token = hub.register(1).await;
    let leases = hub.claim(1, &token).await;
    assert_eq!(leases.len(), 2);
    let (ten, eleven) = (&leases[0], &leases[1]);

    // One result accepted, one rejected: only the accepted payload is stored.
    let body = json!({
        "actor": 1,
        "results": [
            result_json(ten, &payload(10), &HASH),
            result_json(eleven, &payload(11), &WeightsHash([8; 32])),
        ],
    })
    .to_string();
    let (status, answer) = hub.post("/v1/submit", &token, &body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let outcomes: SubmitResponse = serde_json::from_str(&answer).unwrap();
    assert_eq!(outcomes.outcomes[0], Outcome::Accepted { prompt: 10 });
    assert_eq!(rejection(&outcomes.outcomes[1]), "wrong_hash");
    let stored = hub.hub.rollouts(StepId(0)).unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].prompt, PromptId(10));

    let hub = hub.restart();
    // The same result again, with another payload: a duplicate, and the stored
    // payload stays the first one.
    let outcomes = hub
        .submit(1, &token, &[(ten, json!("a second attempt"))])
        .await;
    assert_eq!(rejection(&outcomes[0]), "duplicate");
    // The rejected prompt went back to the pool; the token still works.
    let again = hub.claim(1, &token).await;
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].prompt, again[0].lease.attempt), (11, 1));
    let outcomes = hub.submit(1, &token, &[(&again[0], payload(11))]).await;
    assert_eq!(outcomes, vec![Outcome::Accepted { prompt: 11 }]);

    let hub = hub.restart();
    let taken = hub.hub.take_step_outcome().unwrap().unwrap();
    let payloads: Vec<(u64, serde_json::Value)> = taken
        .rollouts
        .iter()
        .map(|rollout| {
            let value = serde_json::from_str(rollout.payload.get()).unwrap();
            (rollout.prompt.0, value)
        })
        .collect();
    assert_eq!(payloads, vec![(10, payload(10)), (11, payload(11))]);
    assert!(hub.hub.take_step_outcome().unwrap().is_none());

    // A trainer that stopped after taking the step reads its results again, the same
    // outcome and payloads, until the next step opens, which drops them.
    let hub = hub.restart();
    assert!(hub.hub.take_step_outcome().unwrap().is_none());
    let again = hub.hub.taken_step_results().unwrap().expect("taken before");
    assert_eq!(again.outcome, taken.outcome);
    let payloads_of = |rollouts: &[aurora_hub::AcceptedRollout]| -> Vec<(u64, String)> {
        rollouts
            .iter()
            .map(|r| (r.prompt.0, r.payload.get().to_string()))
            .collect()
    };
    assert_eq!(payloads_of(&again.rollouts), payloads_of(&taken.rollouts));
    hub.hub
        .publish_version(Version(2), WeightsHash([9; 32]))
        .unwrap();
    assert_eq!(hub.hub.open_step(&[PromptId(20)]).unwrap(), StepId(1));
    assert!(hub.hub.rollouts(StepId(0)).unwrap().is_empty());
    // An open step has no results to read again.
    assert!(hub.hub.taken_step_results().unwrap().is_none());
}

#[tokio::test]
async fn corrupt_payloads_and_tokens_in_the_database_are_typed_errors() {
    let rollouts: redb::TableDefinition<(u64, u64), (u64, &[u8])> =
        redb::TableDefinition::new("rollouts");
    let hub = TestHub::with_step(&[10, 11]);
    let token = hub.register(1).await;
    let leases = hub.claim(1, &token).await;
    let results = [(&leases[0], payload(10)), (&leases[1], payload(11))];
    assert_eq!(hub.submit(1, &token, &results).await.len(), 2);

    // A payload missing: the step is not handed over, and stays to be taken.
    let stopped = hub.stop();
    stopped.edit_db(|txn| {
        txn.open_table(rollouts).unwrap().remove((0, 11)).unwrap();
    });
    let hub = stopped.reopen().unwrap();
    match hub.hub.take_step_outcome() {
        Err(CallError::Load(LoadError::RolloutsMismatch { step, prompt })) => {
            assert_eq!((step, prompt), (StepId(0), PromptId(11)));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    // A payload that is not JSON.
    let stopped = hub.stop();
    stopped.edit_db(|txn| {
        let mut table = txn.open_table(rollouts).unwrap();
        table.insert((0, 11), (1, b"{not json".as_slice())).unwrap();
    });
    let hub = stopped.reopen().unwrap();
    match hub.hub.take_step_outcome() {
        Err(CallError::Load(error @ LoadError::CorruptPayload { .. })) => assert!(
            error
                .to_string()
                .starts_with("stored payload of prompt 11 in step 0 is not JSON"),
            "{error}"
        ),
        other => panic!("expected a corrupt payload, got {other:?}"),
    }
    // Restored, the step is handed over after all.
    let stopped = hub.stop();
    stopped.edit_db(|txn| {
        let mut table = txn.open_table(rollouts).unwrap();
        let text = payload(11).to_string();
        table.insert((0, 11), (1, text.as_bytes())).unwrap();
    });
    let hub = stopped.reopen().unwrap();
    assert_eq!(
        hub.hub.take_step_outcome().unwrap().unwrap().rollouts.len(),
        2
    );

    // A token hash of the wrong length: the hub does not start.
    let stopped = hub.stop();
    stopped.edit_db(|txn| {
        let tokens: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("actor_tokens");
        let mut table = txn.open_table(tokens).unwrap();
        table.insert(1, b"abc".as_slice()).unwrap();
    });
    match stopped.reopen() {
        Err(OpenError::Load(LoadError::CorruptToken(actor, 3))) => assert_eq!(actor, ActorId(1)),
        Err(other) => panic!("expected a corrupt token, got {other}"),
        Ok(_) => panic!("a corrupt token was loaded"),
    }
}

/// Core settings with short leases (10 s) and a heartbeat timeout longer than them.
fn short_leases() -> Config {
    let mut config = Config::default();
    config.lease.initial_ms = 10_000;
    config.lease.min_ms = 10_000;
    config.heartbeat_timeout_ms = 60_000;
    config
}

#[tokio::test]
async fn an_expired_lease_is_refused_late_and_its_prompt_goes_to_the_next_claimant() {
    let hub = TestHub::with_config_and_step(short_leases(), &[10]);
    let (first, second) = (hub.register(1).await, hub.register(2).await);
    let mine = hub.claim(1, &first).await;
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].expires_in_ms, 10_000);
    assert!(hub.claim(2, &second).await.is_empty());

    hub.clock.advance(9_999);
    // Not yet: the second actor still gets nothing.
    assert!(hub.claim(2, &second).await.is_empty());
    hub.clock.advance(1);
    let outcomes = hub.submit(1, &first, &[(&mine[0], payload(10))]).await;
    assert_eq!(rejection(&outcomes[0]), "late");

    let theirs = hub.claim(2, &second).await;
    assert_eq!(theirs.len(), 1);
    assert_eq!((theirs[0].prompt, theirs[0].lease.attempt), (10, 1));
    let outcomes = hub.submit(2, &second, &[(&theirs[0], payload(10))]).await;
    assert_eq!(outcomes, vec![Outcome::Accepted { prompt: 10 }]);
    assert_eq!(hub.hub.inspect(|core| core.stats().expired), 1);
    let taken = hub.hub.take_step_outcome().unwrap().unwrap();
    assert_eq!(taken.outcome.accepted, vec![(PromptId(10), ActorId(2))]);
    assert_eq!(taken.rollouts[0].actor, ActorId(2));
}

#[tokio::test]
async fn leases_outstanding_at_a_restart_are_honoured_or_expire_as_if_it_never_stopped() {
    let hub = TestHub::with_config_and_step(short_leases(), &[10, 11]);
    let token = hub.register(1).await;
    let leases = hub.claim(1, &token).await;
    assert_eq!(leases.len(), 2);

    // 4 s in, the hub goes down for 4 s: 8 s of the 10 s lease have passed.
    hub.clock.advance(4_000);
    let hub = {
        let restarting = hub;
        restarting.clock.advance(4_000);
        restarting.restart()
    };
    let outcomes = hub.submit(1, &token, &[(&leases[0], payload(10))]).await;
    assert_eq!(outcomes, vec![Outcome::Accepted { prompt: 10 }]);

    // Down again for 3 s: the other lease ran out during the outage.
    hub.clock.advance(3_000);
    let hub = hub.restart();
    let outcomes = hub.submit(1, &token, &[(&leases[1], payload(11))]).await;
    assert_eq!(rejection(&outcomes[0]), "late");
    let second = hub.register(2).await;
    let theirs = hub.claim(2, &second).await;
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0].prompt, 11);
    let outcomes = hub.submit(2, &second, &[(&theirs[0], payload(11))]).await;
    assert_eq!(outcomes, vec![Outcome::Accepted { prompt: 11 }]);

    let taken = hub.hub.take_step_outcome().unwrap().unwrap();
    let holders: Vec<(PromptId, ActorId)> = taken
        .rollouts
        .iter()
        .map(|rollout| (rollout.prompt, rollout.actor))
        .collect();
    assert_eq!(
        holders,
        vec![(PromptId(10), ActorId(1)), (PromptId(11), ActorId(2))]
    );
}

#[tokio::test]
async fn an_actor_reports_a_staged_version_and_gets_the_commit_with_its_work() {
    let hub = TestHub::with_step(&[10]);
    let token = hub.register(1).await;
    let leases = hub.claim(1, &token).await;
    hub.submit(1, &token, &[(&leases[0], payload(10))]).await;
    assert!(hub.hub.take_step_outcome().unwrap().is_some());
    let v2_hash = WeightsHash([9; 32]);
    hub.hub.publish_version(Version(2), v2_hash).unwrap();
    hub.hub.open_step(&[PromptId(20)]).unwrap();

    let (status, body) = hub.post("/v1/claim", &token, r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, r#"{"kind":"catch_up","target":2}"#);
    let (status, body) = hub
        .post(
            "/v1/versions",
            &token,
            r#"{"actor":1,"active":1,"staged":2}"#,
        )
        .await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"kind":"ready"}"#)
    );
    let (_, body) = hub.post("/v1/claim", &token, r#"{"actor":1}"#).await;
    let ClaimResponse::Work { commit, leases } = serde_json::from_str(&body).unwrap() else {
        panic!("expected work: {body}");
    };
    assert_eq!(commit, Some(2));
    assert_eq!((leases[0].prompt, leases[0].version), (20, 2));
}

#[tokio::test]
async fn a_tick_with_nothing_due_writes_nothing() {
    let hub = TestHub::with_step(&[10]);
    // The step's reservations and the partial-batch deadline are minutes away.
    assert!(!hub.hub.tick().unwrap());
    assert!(hub.hub.until_next_tick() <= Duration::from_millis(200));
}

#[test]
fn a_corrupt_state_or_an_empty_token_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = |path: std::path::PathBuf| aurora_hub::HubConfig {
        db_path: path,
        control: Config::default(),
        tick_interval_max: Duration::from_millis(200),
        clock: Arc::new(aurora_hub::SystemClock::new()),
    };
    let corrupt = dir.path().join("corrupt.redb");
    {
        let db = redb::Database::create(&corrupt).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let table: redb::TableDefinition<u64, &[u8]> =
                redb::TableDefinition::new("control_state");
            let mut table = txn.open_table(table).unwrap();
            table
                .insert(0, b"{\"not\": \"a snapshot\"}".as_slice())
                .unwrap();
        }
        txn.commit().unwrap();
    }
    match Hub::open(config(corrupt)) {
        Err(OpenError::Load(LoadError::Corrupt(_))) => {}
        Err(other) => panic!("expected a corrupt-state error, got {other}"),
        Ok(_) => panic!("a corrupt state was restored"),
    }
    assert!(matches!(
        Security::insecure_plaintext(""),
        Err(SecurityError::EmptyToken)
    ));
}

/// A request body that never arrives: the handler waits on it until the request's
/// time runs out.
struct StalledBody;

impl http_body::Body for StalledBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Poll::Pending
    }
}

fn stalled_register() -> Request<Body> {
    Request::post("/v1/register")
        .header("authorization", format!("Bearer {FLEET}"))
        .header("content-type", "application/json")
        .body(Body::new(StalledBody))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn limit_request_timeout() {
    let hub = TestHub::with_step(&[10]);
    let started = tokio::time::Instant::now();
    let response = router(Arc::clone(&hub.hub), &plaintext()).oneshot(stalled_register());
    let response = tokio::time::timeout(REQUEST_TIMEOUT * 2, response)
        .await
        .expect("the request was never answered")
        .unwrap();
    assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
    assert!(started.elapsed() >= REQUEST_TIMEOUT);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(
        error_message(std::str::from_utf8(&body).unwrap()),
        format!("request not handled within {REQUEST_TIMEOUT:?}; retry")
    );
}

#[tokio::test(start_paused = true)]
async fn limit_max_concurrent_requests() {
    let hub = TestHub::with_step(&[10]);
    let app = router(Arc::clone(&hub.hub), &plaintext());
    let status = || {
        Request::get("/v1/status")
            .header("authorization", format!("Bearer {FLEET}"))
            .body(Body::empty())
            .unwrap()
    };
    let mut stalled = tokio::task::JoinSet::new();
    for _ in 0..MAX_CONCURRENT_REQUESTS - 1 {
        stalled.spawn(app.clone().oneshot(stalled_register()));
    }
    // Let every stalled request take its slot and block on its body.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // One slot left: a status request is served at once.
    let response = app.clone().oneshot(status()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    stalled.spawn(app.clone().oneshot(stalled_register()));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // No slot left: it waits (half the request timeout here, by the paused clock).
    let waited = tokio::time::timeout(REQUEST_TIMEOUT / 2, app.clone().oneshot(status())).await;
    assert!(waited.is_err(), "a request was served beyond the limit");
    // The stalled ones end at their timeout, which frees the slots.
    while let Some(response) = stalled.join_next().await {
        assert_eq!(
            response.unwrap().unwrap().status(),
            StatusCode::REQUEST_TIMEOUT
        );
    }
    let response = app.oneshot(status()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn limit_header_read_timeout() {
    let hub = TestHub::with_step(&[10]);
    let addr = serve(&hub).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let started = tokio::time::Instant::now();
    // Half a request head, and then nothing.
    stream
        .write_all(b"GET /v1/status HTTP/1.1\r\nHost: hub\r\n")
        .await
        .unwrap();
    let mut received = Vec::new();
    tokio::time::timeout(HEADER_READ_TIMEOUT * 2, stream.read_to_end(&mut received))
        .await
        .expect("the connection was left open")
        .unwrap();
    assert!(started.elapsed() >= HEADER_READ_TIMEOUT);
    // The connection was closed, with no response or an error response at most.
    assert!(
        received.is_empty() || received.starts_with(b"HTTP/1.1 4"),
        "{}",
        String::from_utf8_lossy(&received)
    );
    // A complete request still gets through.
    let (status, _) = http(addr, "GET", "/v1/status", FLEET, "").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_joining_node_reads_the_run_the_commit_and_the_snapshot_to_join_from() {
    let hub = TestHub::with_step(&[10]);
    // Before the trainer node says, there is nothing to pin: come back later.
    let (status, body) = hub
        .call(Method::GET, "/v1/join", Some(FLEET), Vec::new())
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let run = aurora_delta::RunId([0x61; 16]);
    hub.hub.set_join_point(aurora_hub::JoinPoint {
        run,
        committed: Some(12),
        snapshot: Some(10),
    });
    let (status, body) = hub
        .call(Method::GET, "/v1/join", Some(FLEET), Vec::new())
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: aurora_api::JoinResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(
        answer,
        aurora_api::JoinResponse {
            run: run.to_hex(),
            committed: Some(12),
            snapshot: Some(10),
        }
    );
    // The fleet token is asked for, as for a registration.
    let (status, _) = hub
        .call(Method::GET, "/v1/join", Some("wrong"), Vec::new())
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}
