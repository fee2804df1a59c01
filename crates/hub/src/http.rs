//! The axum router: authentication, body limits, JSON errors and one handler per
//! endpoint, each a conversion from the wire, a [`Hub`] call on the blocking pool, and
//! a conversion back.

use std::fmt::Write as _;
use std::io;
use std::sync::Arc;

use aurora_control::{ControlPlane, MembershipError};
use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;

use crate::hub::{CallError, Hub};
use crate::wire::{
    Ack, ActorRequest, ClaimResponse, ErrorBody, REJECTIONS, RegisterRequest, RegisterResponse,
    StatusResponse, SubmitRequest, SubmitResponse, WireError, rejection_reason,
};

/// Largest request body accepted, in bytes. The largest honest request is a
/// submission of `max_leases_per_actor` results (2048 by default) of about 200 bytes
/// each, well under this.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// The API over `hub`: every route, behind the bearer token and the body limit.
pub fn router(hub: Arc<Hub>) -> Router {
    Router::new()
        .route("/v1/register", post(register))
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/claim", post(claim))
        .route("/v1/submit", post(submit))
        .route("/v1/leave", post(leave))
        .route("/v1/preempt", post(preempt))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        // Outermost: an unauthenticated request is refused before its body is read.
        .layer(middleware::from_fn_with_state(Arc::clone(&hub), authorize))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(hub)
}

/// Serves the API on `listener` and runs the tick task, until the server fails. The
/// tick task stops when this future ends or is dropped.
pub async fn run(hub: Arc<Hub>, listener: TcpListener) -> io::Result<()> {
    let ticker = AbortOnDrop(tokio::spawn(tick_forever(Arc::clone(&hub))));
    let served = axum::serve(listener, router(hub)).await;
    drop(ticker);
    served
}

/// Ticks the core whenever a deadline is due, so that leases expire and silent actors
/// are removed even when no request comes in.
async fn tick_forever(hub: Arc<Hub>) {
    loop {
        let ticking = Arc::clone(&hub);
        // Both calls take the core's lock, which a save may hold through an fsync, so
        // they run on the blocking pool rather than stall a runtime worker.
        let wait = tokio::task::spawn_blocking(move || {
            if let Err(error) = ticking.tick() {
                tracing::error!(%error, "tick not saved");
            }
            ticking.until_next_tick()
        })
        .await
        .unwrap_or_else(|error| {
            tracing::error!(%error, "tick task failed");
            TICK_WAIT_MIN
        });
        // The floor keeps a failing save (the deadline stays due) from spinning.
        tokio::time::sleep(wait.max(TICK_WAIT_MIN)).await;
    }
}

/// Shortest pause between two ticks.
const TICK_WAIT_MIN: std::time::Duration = std::time::Duration::from_millis(10);

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn authorize(State(hub): State<Arc<Hub>>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(token) if hub.token_matches(token) => next.run(request).await,
        _ => {
            let mut response =
                ApiError::new(StatusCode::UNAUTHORIZED, "missing or wrong bearer token")
                    .into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            response
        }
    }
}

async fn register(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<RegisterRequest>,
) -> Result<axum::Json<RegisterResponse>, ApiError> {
    let (actor, registration) = request.into_core()?;
    let readiness = blocking(hub, move |hub| hub.register(actor, registration)).await??;
    Ok(axum::Json(readiness.into()))
}

async fn heartbeat(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    blocking(hub, move |hub| hub.heartbeat(request.actor())).await??;
    Ok(axum::Json(Ack {}))
}

async fn claim(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<ClaimResponse>, ApiError> {
    let (assignment, now) = blocking(hub, move |hub| hub.claim(request.actor())).await??;
    Ok(axum::Json(ClaimResponse::from_core(&assignment, now)))
}

async fn submit(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<SubmitRequest>,
) -> Result<axum::Json<SubmitResponse>, ApiError> {
    let (actor, reports) = request.into_core()?;
    let outcomes = blocking(hub, move |hub| hub.submit(actor, &reports)).await??;
    Ok(axum::Json(SubmitResponse::from_core(&outcomes)))
}

async fn leave(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    blocking(hub, move |hub| hub.leave(request.actor())).await??;
    Ok(axum::Json(Ack {}))
}

async fn preempt(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    blocking(hub, move |hub| hub.preempt(request.actor())).await??;
    Ok(axum::Json(Ack {}))
}

async fn status(State(hub): State<Arc<Hub>>) -> Result<axum::Json<StatusResponse>, ApiError> {
    let status = blocking(hub, |hub| hub.inspect(StatusResponse::from_core)).await?;
    Ok(axum::Json(status))
}

async fn metrics(State(hub): State<Arc<Hub>>) -> Result<impl IntoResponse, ApiError> {
    let text = blocking(hub, |hub| {
        hub.inspect(|core| render_metrics(core, hub.leases_issued()))
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text))
}

/// Renders the Prometheus text exposition of the core's counters and gauges.
fn render_metrics(core: &ControlPlane, leases_issued: u64) -> String {
    let stats = core.stats();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
        // Writing to a String cannot fail.
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    metric(
        "aurora_results_accepted_total",
        "counter",
        "Results accepted.",
        &[("", stats.accepted)],
    );
    let rejected: Vec<(String, u64)> = REJECTIONS
        .iter()
        .map(|rejection| {
            let count = stats.rejected.get(rejection).copied().unwrap_or(0);
            let labels = format!("{{reason=\"{}\"}}", rejection_reason(*rejection));
            (labels, count)
        })
        .collect();
    let rejected: Vec<(&str, u64)> = rejected
        .iter()
        .map(|(labels, count)| (labels.as_str(), *count))
        .collect();
    metric(
        "aurora_results_rejected_total",
        "counter",
        "Results rejected, by reason.",
        &rejected,
    );
    metric(
        "aurora_leases_issued_total",
        "counter",
        "Leases handed out by this hub process.",
        &[("", leases_issued)],
    );
    metric(
        "aurora_leases_expired_total",
        "counter",
        "Leases that ran out before their result arrived.",
        &[("", stats.expired)],
    );
    metric(
        "aurora_events_dropped_total",
        "counter",
        "Core events dropped before the hub drained them.",
        &[("", core.events_dropped())],
    );
    let members = core.members();
    let leaving = members
        .values()
        .filter(|member| member.leaving_at.is_some())
        .count();
    let live = members.len() - leaving;
    metric(
        "aurora_actors",
        "gauge",
        "Registered actors, by state.",
        &[
            ("{state=\"live\"}", count(live)),
            ("{state=\"leaving\"}", count(leaving)),
        ],
    );
    metric(
        "aurora_lease_lifetime_ms",
        "gauge",
        "Lifetime of a lease issued now.",
        &[("", core.lease_ms())],
    );
    if let Some((version, _)) = core.latest_version() {
        metric(
            "aurora_latest_version",
            "gauge",
            "Latest published version.",
            &[("", version.0)],
        );
    }
    if let Some(progress) = core.step_progress() {
        metric(
            "aurora_step",
            "gauge",
            "Current or last step.",
            &[("", progress.step.0)],
        );
        metric(
            "aurora_step_jobs",
            "gauge",
            "Jobs of the current or last step, by state.",
            &[
                ("{state=\"batch\"}", u64::from(progress.batch_size)),
                ("{state=\"accepted\"}", u64::from(progress.accepted)),
                ("{state=\"leased\"}", u64::from(progress.leased)),
                ("{state=\"pooled\"}", u64::from(progress.pooled)),
                ("{state=\"reserved\"}", u64::from(progress.reserved)),
            ],
        );
        metric(
            "aurora_step_complete",
            "gauge",
            "Whether the current or last step has completed.",
            &[("", u64::from(progress.completion.is_some()))],
        );
    }
    out
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Runs a hub call on the blocking pool: calls take the core's lock, which a save
/// may hold through an fsync.
async fn blocking<T: Send + 'static>(
    hub: Arc<Hub>,
    call: impl FnOnce(&Hub) -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(move || call(&hub))
        .await
        .map_err(|error| {
            tracing::error!(%error, "hub call failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        })
}

/// A JSON body extractor whose errors are [`ApiError`]s (`{ "error": ... }`) rather than
/// axum's plain-text rejections.
struct Body<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Body(value)),
            Err(rejection) => Err(ApiError::from(rejection)),
        }
    }
}

/// An error response: a status and `{ "error": message }`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.message,
        };
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        // Keep 413 (body over the limit) and 415 (not JSON); every other problem with
        // the body (syntax, missing or mistyped field) is a plain 400.
        let status = match rejection.status() {
            status @ (StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE) => status,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, rejection.body_text())
    }
}

impl From<WireError> for ApiError {
    fn from(error: WireError) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, error.to_string())
    }
}

impl From<CallError> for ApiError {
    fn from(error: CallError) -> ApiError {
        let status = match &error {
            CallError::UnknownActor(_)
            | CallError::Membership(MembershipError::UnknownActor(_)) => StatusCode::NOT_FOUND,
            CallError::Membership(
                MembershipError::VersionNotPublished { .. } | MembershipError::StagedNotNext { .. },
            )
            | CallError::Submit(_) => StatusCode::BAD_REQUEST,
            // The request is fine but the hub's state does not allow it now.
            CallError::Membership(
                MembershipError::ActorLimit { .. } | MembershipError::NothingPublished,
            )
            | CallError::Publish(_)
            | CallError::OpenStep(_) => StatusCode::CONFLICT,
            CallError::Persist(persist) => {
                tracing::error!(error = %persist, "state not saved; request refused");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        ApiError::new(status, error.to_string())
    }
}
