//! The HTTP server: the accept loop, the axum router with authentication and limits,
//! JSON errors, and one handler per endpoint, each a conversion from the wire, a
//! [`Hub`] call on the blocking pool, and a conversion back.
//!
//! # Limits
//!
//! Everything a client controls is bounded: the body ([`MAX_BODY_BYTES`], refused
//! before it is parsed), one result's payload ([`MAX_PAYLOAD_BYTES`]), the
//! time to send the request head ([`HEADER_READ_TIMEOUT`], which also closes idle
//! keep-alive connections), the time to handle a request, body upload and queueing
//! included ([`REQUEST_TIMEOUT`]), and the requests handled at once
//! ([`MAX_CONCURRENT_REQUESTS`]; more wait for a slot, within their timeout). Open
//! connections are bounded by the process's file descriptor limit and the header
//! timeout.

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use aurora_api::{
    Ack, ActorRequest, ClaimResponse, ErrorBody, MAX_PAYLOAD_BYTES, RegisterRequest,
    RegisterResponse, StatusResponse, SubmitRequest, SubmitResponse, VersionsRequest, WireError,
    WireReadiness,
};
use aurora_control::{ActorId, MembershipError};
use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{BoxError, Extension};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::auth::AuthError;
use crate::hub::{CallError, Hub};

/// Largest request body accepted, in bytes: a submission of 32 results with payloads
/// of the largest size ([`MAX_PAYLOAD_BYTES`]) and 64 KiB for everything else, or
/// thousands of small results. An actor with more to send splits it over several
/// submissions.
pub const MAX_BODY_BYTES: usize = 32 * MAX_PAYLOAD_BYTES + (64 << 10);

/// Longest time to handle one request, from its head to the response: reading the
/// body (8 MiB at 10 Mbit/s takes under 7 s), waiting for a slot, and the call, whose
/// commit includes an fsync. A request that ran out of time gets a 408; its call may
/// still have taken effect, so clients retry (a retried result is then `duplicate`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest time a connection may take to send a request head, and longest time an
/// idle keep-alive connection stays open.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Most requests handled at once; it bounds the memory held by request bodies
/// (`MAX_CONCURRENT_REQUESTS * MAX_BODY_BYTES`, about 516 MiB) and the blocking threads
/// waiting on the core. Further requests wait for a slot.
pub const MAX_CONCURRENT_REQUESTS: usize = 64;

/// Pause after a failed accept (out of file descriptors, say), so that the loop does
/// not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Shortest pause between two ticks.
const TICK_WAIT_MIN: Duration = Duration::from_millis(10);

/// The API over `hub`: fleet routes behind the fleet token, actor routes behind the
/// actor's own token, every route behind the body limit, the request timeout and the
/// concurrency limit.
pub fn router(hub: Arc<Hub>) -> Router {
    let fleet = Router::new()
        .route("/v1/register", post(register))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        // Authentication runs before the body is read.
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&hub),
            authorize_fleet,
        ));
    let actors = Router::new()
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/versions", post(versions))
        .route("/v1/claim", post(claim))
        .route("/v1/submit", post(submit))
        .route("/v1/leave", post(leave))
        .route("/v1/preempt", post(preempt))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&hub),
            authorize_actor,
        ));
    fleet
        .merge(actors)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(overloaded))
                .timeout(REQUEST_TIMEOUT)
                // Global: `Router::layer` clones the stack for every route, and each
                // clone must draw on the same slots.
                .layer(GlobalConcurrencyLimitLayer::new(MAX_CONCURRENT_REQUESTS)),
        )
        .with_state(hub)
}

/// Serves the API on `listener` and runs the tick task, forever: a failed accept (out
/// of file descriptors, say) is logged and retried. Dropping the future stops the tick
/// task and closes every connection.
pub async fn run(hub: Arc<Hub>, listener: TcpListener) -> Infallible {
    let _ticker = AbortOnDrop(tokio::spawn(tick_forever(Arc::clone(&hub))));
    let router = router(hub);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                if !is_connection_error(&error) {
                    tracing::warn!(%error, "accepting connections failed; retrying");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
                continue;
            }
        };
        // Forget finished connections, so the set holds only live ones.
        while connections.try_join_next().is_some() {}
        let service = TowerToHyperService::new(router.clone());
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            if let Err(error) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
}

/// Whether an accept error concerns only the connection being accepted (the peer
/// gave up), rather than the listener or the process.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
    )
}

/// Ticks the core whenever a deadline is due, so that leases expire and silent actors
/// are removed even when no request comes in; ends when the hub has stopped.
async fn tick_forever(hub: Arc<Hub>) {
    loop {
        let ticking = Arc::clone(&hub);
        // Both calls take the core's lock, which a commit may hold through an fsync,
        // so they run on the blocking pool rather than stall a runtime worker.
        let wait = tokio::task::spawn_blocking(move || match ticking.tick() {
            Err(CallError::Stopped) => None,
            Err(error) => {
                tracing::error!(%error, "tick not saved");
                Some(ticking.until_next_tick())
            }
            Ok(_) => Some(ticking.until_next_tick()),
        })
        .await
        .unwrap_or_else(|error| {
            tracing::error!(%error, "tick task failed");
            Some(TICK_WAIT_MIN)
        });
        let Some(wait) = wait else {
            tracing::error!("the hub has stopped: no more ticks until it is restarted");
            return;
        };
        // The floor keeps a tick that keeps failing (the deadline stays due) from spinning.
        tokio::time::sleep(wait.max(TICK_WAIT_MIN)).await;
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The bearer token of a request, if it has one.
fn bearer(request: &Request) -> Option<&[u8]> {
    request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
}

async fn authorize_fleet(State(hub): State<Arc<Hub>>, request: Request, next: Next) -> Response {
    match hub.authenticate_fleet(bearer(&request)) {
        Ok(()) => next.run(request).await,
        Err(error) => unauthorized(error),
    }
}

/// The actor an actor token authenticated, for the handler to check against the
/// actor the request names.
#[derive(Clone, Copy, Debug)]
struct Authenticated(ActorId);

async fn authorize_actor(
    State(hub): State<Arc<Hub>>,
    mut request: Request,
    next: Next,
) -> Response {
    match hub.authenticate_actor(bearer(&request)) {
        Ok(actor) => {
            request.extensions_mut().insert(Authenticated(actor));
            next.run(request).await
        }
        Err(error) => unauthorized(error),
    }
}

impl Authenticated {
    /// Refuses a request naming an actor other than the token's.
    fn check(self, requested: u64) -> Result<ActorId, ApiError> {
        let requested = ActorId(requested);
        if requested == self.0 {
            Ok(requested)
        } else {
            Err(ApiError::from(AuthError::OtherActor {
                token_actor: self.0,
                requested,
            }))
        }
    }
}

fn unauthorized(error: AuthError) -> Response {
    let mut response = ApiError::from(error).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

/// Answers a request the timeout layer stopped.
async fn overloaded(error: BoxError) -> ApiError {
    if error.is::<tower::timeout::error::Elapsed>() {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "request not handled within {} s; retry",
                REQUEST_TIMEOUT.as_secs()
            ),
        )
    } else {
        tracing::error!(%error, "request failed in a middleware");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
    }
}

async fn register(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<RegisterRequest>,
) -> Result<axum::Json<RegisterResponse>, ApiError> {
    let (actor, registration) = request.into_core()?;
    let (readiness, token) = blocking(hub, move |hub| hub.register(actor, registration)).await??;
    Ok(axum::Json(RegisterResponse::from_core(
        readiness,
        token.as_str(),
    )))
}

async fn heartbeat(
    State(hub): State<Arc<Hub>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    blocking(hub, move |hub| hub.heartbeat(actor)).await??;
    Ok(axum::Json(Ack {}))
}

async fn versions(
    State(hub): State<Arc<Hub>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<VersionsRequest>,
) -> Result<axum::Json<WireReadiness>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    let (active, staged) = request.versions();
    let readiness = blocking(hub, move |hub| hub.report_versions(actor, active, staged)).await??;
    Ok(axum::Json(readiness.into()))
}

async fn claim(
    State(hub): State<Arc<Hub>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<ClaimResponse>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    let (assignment, now) = blocking(hub, move |hub| hub.claim(actor)).await??;
    Ok(axum::Json(ClaimResponse::from_core(&assignment, now)))
}

async fn submit(
    State(hub): State<Arc<Hub>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<SubmitRequest>,
) -> Result<axum::Json<SubmitResponse>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    let (_, results) = request.into_core()?;
    let outcomes = blocking(hub, move |hub| hub.submit(actor, &results)).await??;
    Ok(axum::Json(SubmitResponse::from_core(&outcomes)))
}

async fn leave(
    State(hub): State<Arc<Hub>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    blocking(hub, move |hub| hub.leave(actor)).await??;
    Ok(axum::Json(Ack {}))
}

async fn preempt(
    State(hub): State<Arc<Hub>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    blocking(hub, move |hub| hub.preempt(actor)).await??;
    Ok(axum::Json(Ack {}))
}

async fn status(State(hub): State<Arc<Hub>>) -> Result<axum::Json<StatusResponse>, ApiError> {
    let status = blocking(hub, |hub| hub.read(StatusResponse::from_core)).await??;
    Ok(axum::Json(status))
}

async fn metrics(State(hub): State<Arc<Hub>>) -> Result<impl IntoResponse, ApiError> {
    let text = blocking(hub, |hub| {
        hub.read(|core| crate::metrics::render(core, hub.leases_issued()))
    })
    .await??;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text))
}

/// Runs a hub call on the blocking pool: calls take the core's lock, which a commit
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

impl From<AuthError> for ApiError {
    fn from(error: AuthError) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, error.to_string())
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
            CallError::Persist(_) | CallError::Load(_) | CallError::Entropy(_) => {
                tracing::error!(%error, "request refused: the hub could not do its part");
                StatusCode::INTERNAL_SERVER_ERROR
            }
            // Until an operator restarts it; the database has everything acknowledged.
            CallError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, error.to_string())
    }
}
