//! Helpers shared by the hub's integration tests: a hub on a temporary database with
//! a manual clock, and requests through its router in memory.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::sync::Arc;
use std::time::Duration;

use aurora_api::{
    ClaimResponse, ErrorBody, Outcome, RegisterResponse, SubmitResponse, WireLease, format_hash,
};
use aurora_control::{Config, Millis, PromptId, Version, WeightsHash};
use aurora_hub::{Hub, HubConfig, Limits, ManualClock, Security, ServeConfig, router};
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use tower::ServiceExt;

/// The fleet token of every test hub.
pub const FLEET: &str = "s3cret-fleet-token";
/// h(v1) in the tests.
pub const HASH: WeightsHash = WeightsHash([7; 32]);
/// Where the manual clock starts: an arbitrary time well after zero, as a wall clock
/// would be.
pub const START: Millis = Millis(1_700_000_000_000);

/// A hub on a temporary database, with a manual clock that survives restarts.
pub struct TestHub {
    pub hub: Arc<Hub>,
    pub clock: Arc<ManualClock>,
    control: Config,
    // Dropped last: the database lives in it.
    dir: tempfile::TempDir,
}

impl TestHub {
    /// A hub with the default core settings, v1 published and a step of `prompts`
    /// open.
    pub fn with_step(prompts: &[u64]) -> TestHub {
        TestHub::with_config_and_step(Config::default(), prompts)
    }

    /// A hub with `control` settings, v1 published and a step of `prompts` open.
    pub fn with_config_and_step(control: Config, prompts: &[u64]) -> TestHub {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(START));
        let hub = Hub::open(hub_config(&dir, &clock, &control)).unwrap();
        hub.publish_version(Version(1), HASH).unwrap();
        let prompts: Vec<PromptId> = prompts.iter().copied().map(PromptId).collect();
        hub.open_step(&prompts).unwrap();
        TestHub {
            hub: Arc::new(hub),
            clock,
            control,
            dir,
        }
    }

    /// Stops the hub (dropping it closes the database, as a crash would leave it:
    /// every acknowledged change is committed) and opens it again on the same clock.
    pub fn restart(self) -> TestHub {
        self.stop().reopen().unwrap()
    }

    /// The database as a process killed now would leave it, in a hub stopped
    /// beside this one (on the same clock): the file's bytes as the operating system
    /// holds them, which is what outlives the process, copied while the hub runs.
    pub fn crash_image(&self) -> StoppedHub {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            self.dir.path().join("hub.redb"),
            dir.path().join("hub.redb"),
        )
        .unwrap();
        StoppedHub {
            clock: self.clock.clone(),
            control: self.control.clone(),
            dir,
        }
    }

    /// Stops the hub, leaving its database and clock.
    pub fn stop(self) -> StoppedHub {
        let TestHub {
            hub,
            clock,
            control,
            dir,
        } = self;
        assert_eq!(Arc::strong_count(&hub), 1, "the hub is still in use");
        drop(hub);
        StoppedHub {
            clock,
            control,
            dir,
        }
    }

    /// One request through the router in memory.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: impl Into<Body>,
    ) -> (StatusCode, String) {
        call(&self.hub, method, path, token, body).await
    }

    pub async fn post(&self, path: &str, token: &str, body: &str) -> (StatusCode, String) {
        self.call(Method::POST, path, Some(token), body.to_owned())
            .await
    }

    /// Registers `actor` on v1 in eu-west and returns its token.
    pub async fn register(&self, actor: u64) -> String {
        let body = format!(r#"{{"actor":{actor},"region":"eu-west","active":1}}"#);
        let (status, body) = self.post("/v1/register", FLEET, &body).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_str::<RegisterResponse>(&body)
            .unwrap()
            .token
    }

    /// Claims work for `actor` and returns its leases.
    pub async fn claim(&self, actor: u64, token: &str) -> Vec<WireLease> {
        let (status, body) = self
            .post("/v1/claim", token, &format!(r#"{{"actor":{actor}}}"#))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        match serde_json::from_str(&body).unwrap() {
            ClaimResponse::Work { leases, .. } => leases,
            other => panic!("expected work, got {other:?}"),
        }
    }

    /// Submits one result per `(lease, payload)` with h(v1) and 100 tokens.
    pub async fn submit(
        &self,
        actor: u64,
        token: &str,
        results: &[(&WireLease, serde_json::Value)],
    ) -> Vec<Outcome> {
        let (status, body) = self
            .post("/v1/submit", token, &submit_body(actor, results))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_str::<SubmitResponse>(&body)
            .unwrap()
            .outcomes
    }
}

/// A stopped [`TestHub`], whose database a test may edit before reopening it.
pub struct StoppedHub {
    clock: Arc<ManualClock>,
    control: Config,
    dir: tempfile::TempDir,
}

impl StoppedHub {
    /// Writes to the stopped hub's database in one transaction.
    pub fn edit_db(&self, edit: impl FnOnce(&redb::WriteTransaction)) {
        let db = redb::Database::create(self.dir.path().join("hub.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        edit(&txn);
        txn.commit().unwrap();
    }

    /// The clock the hub ran on, which keeps going while it is stopped.
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }

    /// Reads the stopped hub's database in one transaction.
    pub fn read_db<T>(&self, read: impl FnOnce(&redb::ReadTransaction) -> T) -> T {
        use redb::ReadableDatabase;
        let db = redb::Database::create(self.dir.path().join("hub.redb")).unwrap();
        read(&db.begin_read().unwrap())
    }

    /// Opens a hub on the stopped hub's database and clock, leaving the database to
    /// the stopped hub once the returned one is dropped.
    pub fn open(&self) -> Result<Hub, aurora_hub::OpenError> {
        Hub::open(hub_config(&self.dir, &self.clock, &self.control))
    }

    /// Opens the hub again on the same database and clock.
    pub fn reopen(self) -> Result<TestHub, aurora_hub::OpenError> {
        let hub = self.open()?;
        Ok(TestHub {
            hub: Arc::new(hub),
            clock: self.clock,
            control: self.control,
            dir: self.dir,
        })
    }
}

fn hub_config(dir: &tempfile::TempDir, clock: &Arc<ManualClock>, control: &Config) -> HubConfig {
    HubConfig {
        db_path: dir.path().join("hub.redb"),
        control: control.clone(),
        tick_interval_max: Duration::from_millis(200),
        clock: Arc::clone(clock) as Arc<dyn aurora_hub::Clock>,
    }
}

/// Serving over plain HTTP with [`FLEET`] as the fleet token, default limits.
pub fn plaintext() -> ServeConfig {
    ServeConfig {
        security: Security::insecure_plaintext(FLEET).unwrap(),
        limits: Limits::default(),
    }
}

/// The body of a submission of one result per `(lease, payload)`, with h(v1) and 100
/// tokens each.
pub fn submit_body(actor: u64, results: &[(&WireLease, serde_json::Value)]) -> String {
    let results: Vec<serde_json::Value> = results
        .iter()
        .map(|(lease, payload)| result_json(lease, payload, &HASH))
        .collect();
    serde_json::json!({ "actor": actor, "results": results }).to_string()
}

/// One result for `lease` claiming `weights_hash`, with 100 tokens.
pub fn result_json(
    lease: &WireLease,
    payload: &serde_json::Value,
    weights_hash: &WeightsHash,
) -> serde_json::Value {
    serde_json::json!({
        "lease": lease.lease,
        "version": lease.version,
        "weights_hash": format_hash(weights_hash),
        "tokens": 100,
        "payload": payload,
    })
}

/// One request through `hub`'s router in memory.
pub async fn call(
    hub: &Arc<Hub>,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: impl Into<Body>,
) -> (StatusCode, String) {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = router(Arc::clone(hub), &plaintext())
        .oneshot(request.body(body.into()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// The message of an error body.
pub fn error_message(body: &str) -> String {
    serde_json::from_str::<ErrorBody>(body)
        .unwrap_or_else(|error| panic!("not an error body ({error}): {body}"))
        .error
}

/// The reason of a rejected outcome.
pub fn rejection(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Rejected { reason, .. } => reason,
        Outcome::Accepted { prompt } => panic!("prompt {prompt} was accepted"),
    }
}
