//! The hub's HTTP API end to end: over a real socket with a raw HTTP/1.1 client, and
//! through the router in memory for the error paths and restarts.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aurora_control::{Config, PromptId, Version, WeightsHash};
use aurora_hub::wire::{ClaimResponse, ErrorBody, Outcome, SubmitResponse, WireLease, format_hash};
use aurora_hub::{Hub, HubConfig, LoadError, MAX_BODY_BYTES, OpenError, router, run};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

const TOKEN: &str = "s3cret-token";
const HASH: WeightsHash = WeightsHash([7; 32]);

fn config(db_path: &Path) -> HubConfig {
    HubConfig {
        token: TOKEN.into(),
        db_path: db_path.to_path_buf(),
        control: Config::default(),
        tick_interval_max: Duration::from_millis(200),
    }
}

/// A hub with version 1 published and a step of `prompts` open.
fn hub_with_step(db_path: &Path, prompts: &[u64]) -> Arc<Hub> {
    let hub = Hub::open(config(db_path)).unwrap();
    hub.publish_version(Version(1), HASH).unwrap();
    let prompts: Vec<PromptId> = prompts.iter().copied().map(PromptId).collect();
    hub.open_step(&prompts).unwrap();
    Arc::new(hub)
}

const REGISTER: &str = r#"{"actor":1,"region":"eu-west","active":1}"#;
const CLAIM: &str = r#"{"actor":1}"#;

fn submit_body(lease: &WireLease) -> String {
    serde_json::json!({
        "actor": 1,
        "results": [{
            "lease": lease.lease,
            "version": lease.version,
            "weights_hash": format_hash(&HASH),
            "tokens": 100,
        }],
    })
    .to_string()
}

fn leases(claim: &str) -> Vec<WireLease> {
    match serde_json::from_str(claim).unwrap() {
        ClaimResponse::Work { leases, .. } => leases,
        other => panic!("expected work, got {other:?}"),
    }
}

fn outcomes(submit: &str) -> Vec<Outcome> {
    serde_json::from_str::<SubmitResponse>(submit)
        .unwrap()
        .outcomes
}

/// One request over a fresh connection: the smallest HTTP/1.1 client that works
/// against hyper (`Connection: close`, so the body ends with the stream).
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\
         Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

/// One request through the router in memory.
async fn call(
    hub: &Arc<Hub>,
    path: &str,
    token: Option<&str>,
    body: impl Into<Body>,
) -> (StatusCode, String) {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = router(Arc::clone(hub))
        .oneshot(request.body(body.into()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

fn error_message(body: &str) -> String {
    serde_json::from_str::<ErrorBody>(body).unwrap().error
}

#[tokio::test]
async fn a_result_is_accepted_end_to_end_over_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with_step(&dir.path().join("hub.redb"), &[10]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(run(Arc::clone(&hub), listener));

    let (status, body) = http(addr, "POST", "/v1/register", REGISTER).await;
    assert_eq!((status, body.as_str()), (200, r#"{"kind":"ready"}"#));
    let (status, body) = http(addr, "POST", "/v1/claim", CLAIM).await;
    assert_eq!(status, 200, "{body}");
    let leases = leases(&body);
    assert_eq!(leases.len(), 1);
    assert_eq!((leases[0].prompt, leases[0].version), (10, 1));

    let (status, body) = http(addr, "POST", "/v1/submit", &submit_body(&leases[0])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(outcomes(&body), vec![Outcome::Accepted { prompt: 10 }]);

    let (status, body) = http(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("\naurora_results_accepted_total 1\n"),
        "{body}"
    );
    assert!(body.contains("aurora_leases_issued_total 1\n"), "{body}");
    assert!(body.contains("aurora_actors{state=\"live\"} 1\n"), "{body}");

    let (status, body) = http(addr, "GET", "/v1/status", "").await;
    assert_eq!(status, 200);
    let status: aurora_hub::wire::StatusResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(status.accepted, 1);
    assert!(status.step.unwrap().complete);

    let outcome = hub.take_step_outcome().unwrap().unwrap();
    assert_eq!(
        outcome.accepted,
        vec![(PromptId(10), aurora_control::ActorId(1))]
    );
}

#[tokio::test]
async fn requests_without_the_right_token_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with_step(&dir.path().join("hub.redb"), &[10]);
    for token in [None, Some("wrong-token!"), Some("s3cret-toke")] {
        let (status, body) = call(&hub, "/v1/register", token, REGISTER).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(error_message(&body), "missing or wrong bearer token");
    }
    // Nothing got through.
    assert!(hub.inspect(|core| core.members().is_empty()));
}

#[tokio::test]
async fn bad_bodies_get_a_json_error_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with_step(&dir.path().join("hub.redb"), &[10]);

    let oversized = vec![b' '; MAX_BODY_BYTES + 1];
    let (status, body) = call(&hub, "/v1/register", Some(TOKEN), oversized).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(!error_message(&body).is_empty());

    let (status, body) = call(&hub, "/v1/register", Some(TOKEN), "{\"actor\": ").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&body).contains("EOF"), "{body}");

    let (status, body) = call(&hub, "/v1/register", Some(TOKEN), r#"{"actor":1}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).contains("missing field `region`"),
        "{body}"
    );

    let bad_region = r#"{"actor":1,"region":"eu west","active":1}"#;
    let (status, body) = call(&hub, "/v1/register", Some(TOKEN), bad_region).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&body).starts_with("region: "), "{body}");

    let (status, body) = call(&hub, "/v1/claim", Some(TOKEN), r#"{"actor":99}"#).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_message(&body), "actor 99 is not registered");

    let (status, _) = call(&hub, "/v1/register", Some(TOKEN), REGISTER).await;
    assert_eq!(status, StatusCode::OK);
    let bad_hash = r#"{"actor":1,"results":[{"lease":{"step":0,"job":0,"attempt":0},
        "version":1,"weights_hash":"abc","tokens":5}]}"#;
    let (status, body) = call(&hub, "/v1/submit", Some(TOKEN), bad_hash).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_message(&body),
        "results[0].weights_hash: expected 64 hex digits"
    );

    let future = r#"{"actor":2,"region":"eu-west","active":5}"#;
    let (status, body) = call(&hub, "/v1/register", Some(TOKEN), future).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).contains("has not been published"),
        "{body}"
    );
}

#[tokio::test]
async fn an_acknowledged_acceptance_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let db_path = dir.path().join("hub.redb");
    let hub = hub_with_step(&db_path, &[10, 11]);
    call(&hub, "/v1/register", Some(TOKEN), REGISTER).await;
    let (_, claim) = call(&hub, "/v1/claim", Some(TOKEN), CLAIM).await;
    let leases = leases(&claim);
    assert_eq!(leases.len(), 2);
    let submit = submit_body(&leases[0]);
    let (status, body) = call(&hub, "/v1/submit", Some(TOKEN), submit.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(matches!(outcomes(&body)[..], [Outcome::Accepted { .. }]));
    drop(hub);

    let hub = Arc::new(Hub::open(config(&db_path)).unwrap());
    assert_eq!(hub.inspect(|core| core.stats().accepted), 1);
    let (status, body) = call(&hub, "/v1/submit", Some(TOKEN), submit).await;
    assert_eq!(status, StatusCode::OK);
    match &outcomes(&body)[..] {
        [Outcome::Rejected { reason, .. }] => assert_eq!(reason, "duplicate"),
        other => panic!("expected a duplicate, got {other:?}"),
    }
    // The other lease is still live after the restart.
    let (_, body) = call(&hub, "/v1/submit", Some(TOKEN), submit_body(&leases[1])).await;
    assert!(matches!(outcomes(&body)[..], [Outcome::Accepted { .. }]));
}

#[tokio::test]
async fn a_tick_with_nothing_due_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let hub = hub_with_step(&dir.path().join("hub.redb"), &[10]);
    // The step's reservations and the partial-batch deadline are minutes away.
    assert!(!hub.tick().unwrap());
    assert!(hub.until_next_tick() <= Duration::from_millis(200));
}

#[test]
fn a_corrupt_state_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let db_path = dir.path().join("hub.redb");
    {
        let db = redb::Database::create(&db_path).unwrap();
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
    match Hub::open(config(&db_path)) {
        Err(OpenError::Load(LoadError::Corrupt(_))) => {}
        Err(other) => panic!("expected a corrupt-state error, got {other}"),
        Ok(_) => panic!("a corrupt state was restored"),
    }
}

#[test]
fn an_empty_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&dir.path().join("hub.redb"));
    config.token.clear();
    assert!(matches!(Hub::open(config), Err(OpenError::EmptyToken)));
}
