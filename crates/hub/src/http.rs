//! The HTTP API: the axum router with authorization and limits, JSON errors, and one
//! handler per endpoint, each a conversion from the wire, a [`Hub`] call on the
//! blocking pool, and a conversion back. The connections it runs on are `listen`'s.
//!
//! # Limits
//!
//! Everything a client controls is bounded: the body ([`MAX_BODY_BYTES`] for a
//! submission, [`MAX_SMALL_BODY_BYTES`] for every other route, refused before it is
//! parsed), one result's payload ([`MAX_PAYLOAD_BYTES`]), the time to
//! handle a request, body upload and queueing included ([`Limits::request_timeout`]),
//! the requests of one peer in progress ([`Limits::max_requests_per_peer`]; one more is
//! refused) and of all peers ([`Limits::max_requests`]; more wait for a slot, within
//! their timeout). Connections and their timeouts are `listen`'s.

use std::sync::Arc;
use std::time::Duration;

use aurora_api::{
    Ack, ActorRequest, ClaimResponse, ErrorBody, JoinResponse, MAX_PAYLOAD_BYTES, RegisterRequest,
    RegisterResponse, StatusResponse, SubmitRequest, SubmitResponse, VersionsRequest, WireError,
    WireReadiness,
};
use aurora_control::{ActorId, MembershipError};
use aurora_trust::{Identity, Role};
use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{BoxError, Extension};
use serde::de::DeserializeOwned;
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::auth::{AuthError, Forbidden, authenticate_fleet, certified_actor, hash_token};
use crate::hub::{CallError, Hub};
use crate::limits::{Counts, Limits};
use crate::listen::{Peer, Security, ServeConfig};
use crate::refusals::{Refusal, RequestRule, Timeout};

/// Largest request body accepted, in bytes: a submission of 32 results with payloads
/// of the largest size ([`MAX_PAYLOAD_BYTES`]) and 64 KiB for everything else, or
/// thousands of small results. An actor with more to send splits it over several
/// submissions.
pub const MAX_BODY_BYTES: usize = 32 * MAX_PAYLOAD_BYTES + (64 << 10);
/// Largest body of every other route: a registration, a heartbeat, a version report,
/// a claim, a leave take about a hundred bytes (an id, a region of at most 64 bytes,
/// two versions); none needs the submission's room, which an authenticated peer could
/// otherwise make the hub buffer on each of its requests.
pub const MAX_SMALL_BODY_BYTES: usize = 16 << 10;

/// The API over `hub`, as `config` says: who may call each route (module `auth`: by
/// certificate over mutual TLS, by token over insecure plaintext), the body limit, the
/// request timeout, and the concurrency limits per peer and in total. Every refusal is
/// counted in the hub's [`crate::Refusals`] and logged once.
pub fn router(hub: Arc<Hub>, config: &ServeConfig) -> Router {
    let access = match &config.security {
        Security::MutualTls(_) => Access::Certificates,
        Security::InsecurePlaintext { fleet_token } => {
            Access::FleetToken(hash_token(fleet_token.as_bytes()))
        }
    };
    let api = Arc::new(Api {
        hub,
        access,
        limits: config.limits.clone(),
        requests: Counts::default(),
    });
    // Authorization runs before the body is read.
    let gate = |rule| {
        middleware::from_fn_with_state(
            Gate {
                api: Arc::clone(&api),
                rule,
            },
            authorize,
        )
    };
    let register = Router::new()
        .route("/v1/register", post(register))
        .route_layer(gate(Rule::Register));
    let join = Router::new()
        .route("/v1/join", get(join))
        .route_layer(gate(Rule::Join));
    let read = Router::new()
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route_layer(gate(Rule::Read));
    let actors = Router::new()
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/versions", post(versions))
        .route("/v1/claim", post(claim))
        .route(
            "/v1/submit",
            post(submit).layer(DefaultBodyLimit::max(MAX_BODY_BYTES)),
        )
        .route("/v1/leave", post(leave))
        .route("/v1/preempt", post(preempt))
        .route_layer(gate(Rule::Actor));
    let request_timeout = config.limits.request_timeout;
    register
        .merge(join)
        .merge(read)
        .merge(actors)
        .layer(DefaultBodyLimit::max(MAX_SMALL_BODY_BYTES))
        .layer(
            ServiceBuilder::new()
                .layer(middleware::from_fn_with_state(
                    Arc::clone(&api),
                    count_refusals,
                ))
                .layer(HandleErrorLayer::new(move |error: BoxError| async move {
                    overloaded(error, request_timeout)
                }))
                .timeout(request_timeout)
                // Before the global limit, so that no peer waits for, or holds, more
                // than its share of it.
                .layer(middleware::from_fn_with_state(
                    Arc::clone(&api),
                    limit_per_peer,
                ))
                // Global: `Router::layer` clones the stack for every route, and each
                // clone must draw on the same slots.
                .layer(GlobalConcurrencyLimitLayer::new(config.limits.max_requests)),
        )
        .with_state(api)
}

/// What the handlers share.
struct Api {
    hub: Arc<Hub>,
    access: Access,
    limits: Limits,
    /// Requests in progress per identity.
    requests: Counts<Identity>,
}

/// How peers prove who they are.
enum Access {
    /// By their certificate, which the handshake verified.
    Certificates,
    /// By the fleet token (its hash), or an actor token.
    FleetToken(blake3::Hash),
}

/// The bearer token of a request, if it has one.
fn bearer(request: &Request) -> Option<&[u8]> {
    request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
}

/// A group of routes, by who may call them (docs/control-api.md, "Authorization").
#[derive(Clone, Copy, Debug)]
enum Rule {
    /// `/v1/register`: an actor, for its own id.
    Register,
    /// `/v1/join`: the nodes that take versions over the wire, before they register.
    Join,
    /// Every other actor call: an actor, for its own id, in its current registration.
    Actor,
    /// Status and metrics: read-only roles. Actors are left out: the status names
    /// every member, which no actor needs.
    Read,
}

impl Rule {
    fn action(self) -> &'static str {
        match self {
            Rule::Register => "register",
            Rule::Join => "read what a joining node pins",
            Rule::Actor => "make an actor's calls",
            Rule::Read => "read the status and metrics",
        }
    }

    fn roles(self) -> &'static [Role] {
        match self {
            Rule::Register | Rule::Actor => &[Role::Actor],
            Rule::Join => &[Role::Actor, Role::Relay],
            Rule::Read => &[Role::Observer, Role::Trainer, Role::Relay],
        }
    }
}

#[derive(Clone)]
struct Gate {
    api: Arc<Api>,
    rule: Rule,
}

async fn authorize(State(gate): State<Gate>, mut request: Request, next: Next) -> Response {
    match gate.api.authorize(gate.rule, &request) {
        Ok(authenticated) => {
            if let Some(authenticated) = authenticated {
                request.extensions_mut().insert(authenticated);
            }
            next.run(request).await
        }
        Err(error) => error.into_response(),
    }
}

impl Api {
    /// Whether the request's peer may call routes of `rule`, and as which actor (for
    /// the handler to check against the actor the body names).
    fn authorize(&self, rule: Rule, request: &Request) -> Result<Option<Authenticated>, ApiError> {
        let token = bearer(request);
        let identity = match &self.access {
            Access::FleetToken(fleet) => {
                return match rule {
                    Rule::Register | Rule::Join | Rule::Read => {
                        authenticate_fleet(fleet, token)?;
                        Ok(None)
                    }
                    Rule::Actor => Ok(Some(Authenticated {
                        actor: self.hub.authenticate_actor(token)?,
                        proof: "token",
                        region: None,
                    })),
                };
            }
            Access::Certificates => request
                .extensions()
                .get::<Peer>()
                .and_then(|peer| peer.identity.as_ref())
                .ok_or(AuthError::NoCertificate)?,
        };
        if !rule.roles().contains(&identity.role) {
            return Err(Forbidden::Role {
                identity: identity.clone(),
                action: rule.action(),
                allowed: rule.roles(),
            }
            .into());
        }
        let actor = match rule {
            Rule::Read | Rule::Join => return Ok(None),
            Rule::Register | Rule::Actor => certified_actor(identity)?,
        };
        if let Rule::Actor = rule {
            // The token binds the call to the actor's current registration: a process
            // of an earlier one holds the same certificate, but not the token.
            let registered = self.hub.authenticate_actor(token)?;
            if registered != actor {
                return Err(Forbidden::OtherActor {
                    proof: "certificate",
                    holder: actor,
                    requested: registered,
                }
                .into());
            }
        }
        Ok(Some(Authenticated {
            actor,
            proof: "certificate",
            region: Some(identity.region.clone()),
        }))
    }
}

/// The actor a request's certificate or token authenticated, for the handler to check
/// against the actor the body names.
#[derive(Clone, Debug)]
struct Authenticated {
    actor: ActorId,
    /// `certificate` or `token`, for the refusal's message.
    proof: &'static str,
    /// The region a certificate puts the actor in (a token says nothing of it).
    region: Option<String>,
}

impl Authenticated {
    /// Refuses a registration in another region than the certificate's: the scheduler
    /// and the relays place an actor by its region, which only the CA may say.
    fn check_region(&self, requested: &str) -> Result<(), ApiError> {
        match &self.region {
            Some(certified) if certified != requested => {
                Err(ApiError::from(Forbidden::OtherRegion {
                    actor: self.actor,
                    certified: certified.clone(),
                    requested: requested.to_string(),
                }))
            }
            _ => Ok(()),
        }
    }

    /// Refuses a request naming another actor than the proof's.
    fn check(&self, requested: u64) -> Result<ActorId, ApiError> {
        let requested = ActorId(requested);
        if requested == self.actor {
            Ok(requested)
        } else {
            Err(ApiError::from(Forbidden::OtherActor {
                proof: self.proof,
                holder: self.actor,
                requested,
            }))
        }
    }
}

/// Refuses a request at once (429) when its peer has
/// [`Limits::max_requests_per_peer`] in progress. Only peers with an identity are
/// counted: over plaintext every actor of a machine shares its address.
async fn limit_per_peer(State(api): State<Arc<Api>>, request: Request, next: Next) -> Response {
    let identity = request
        .extensions()
        .get::<Peer>()
        .and_then(|peer| peer.identity.clone());
    let Some(identity) = identity else {
        return next.run(request).await;
    };
    let max = api.limits.max_requests_per_peer;
    let Some(_slot) = api.requests.try_take(identity, max) else {
        return ApiError::refused(
            StatusCode::TOO_MANY_REQUESTS,
            Refusal::Request(RequestRule::PeerConcurrency),
            format!("{max} requests of this peer are in progress already; send fewer at once"),
        )
        .into_response();
    };
    next.run(request).await
}

/// Counts and logs every refusal an inner layer or handler answered with (they mark
/// their responses with [`Refused`]).
async fn count_refusals(State(api): State<Arc<Api>>, request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<Peer>().cloned();
    let route = format!("{} {}", request.method(), request.uri().path());
    let response = next.run(request).await;
    if let Some(Refused(refusal)) = response.extensions().get::<Refused>() {
        let peer: &dyn std::fmt::Display = match &peer {
            Some(peer) => peer,
            None => &"a client in memory",
        };
        let status = response.status();
        let message = response
            .extensions()
            .get::<RefusedMessage>()
            .map_or("", |message| message.0.as_str());
        api.hub.refusals().record(
            *refusal,
            peer,
            &format_args!("{route}: {status}: {message}"),
        );
    }
    response
}

/// Marks a response as a refusal, for [`count_refusals`].
#[derive(Clone, Copy, Debug)]
struct Refused(Refusal);

/// The refusal's message, for its log line.
#[derive(Clone, Debug)]
struct RefusedMessage(String);

/// Answers a request the timeout layer stopped.
fn overloaded(error: BoxError, timeout: Duration) -> ApiError {
    if error.is::<tower::timeout::error::Elapsed>() {
        ApiError::refused(
            StatusCode::REQUEST_TIMEOUT,
            Refusal::Timeout(Timeout::Request),
            format!("request not handled within {timeout:?}; retry"),
        )
    } else {
        tracing::error!(%error, "request failed in a middleware");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
    }
}

async fn register(
    State(api): State<Arc<Api>>,
    authenticated: Option<Extension<Authenticated>>,
    Body(request): Body<RegisterRequest>,
) -> Result<axum::Json<RegisterResponse>, ApiError> {
    if let Some(Extension(authenticated)) = authenticated {
        authenticated.check(request.actor)?;
        authenticated.check_region(&request.region)?;
    }
    let (actor, registration) = request.into_core()?;
    let (readiness, token) = blocking(&api, move |hub| hub.register(actor, registration)).await??;
    Ok(axum::Json(RegisterResponse::from_core(
        readiness,
        token.as_str(),
    )))
}

async fn join(State(api): State<Arc<Api>>) -> Result<axum::Json<JoinResponse>, ApiError> {
    let point = api.hub.join_point().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this control plane serves no run yet: its trainer node has not started",
        )
    })?;
    Ok(axum::Json(JoinResponse {
        run: point.run.to_hex(),
        committed: point.committed,
        snapshot: point.snapshot,
    }))
}

async fn heartbeat(
    State(api): State<Arc<Api>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    blocking(&api, move |hub| hub.heartbeat(actor)).await??;
    Ok(axum::Json(Ack {}))
}

async fn versions(
    State(api): State<Arc<Api>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<VersionsRequest>,
) -> Result<axum::Json<WireReadiness>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    let (active, staged) = request.versions();
    let readiness = blocking(&api, move |hub| hub.report_versions(actor, active, staged)).await??;
    Ok(axum::Json(readiness.into()))
}

async fn claim(
    State(api): State<Arc<Api>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<ClaimResponse>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    let (assignment, now) = blocking(&api, move |hub| hub.claim(actor)).await??;
    Ok(axum::Json(ClaimResponse::from_core(&assignment, now)))
}

async fn submit(
    State(api): State<Arc<Api>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<SubmitRequest>,
) -> Result<axum::Json<SubmitResponse>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    let (_, results) = request.into_core()?;
    let outcomes = blocking(&api, move |hub| hub.submit(actor, &results)).await??;
    Ok(axum::Json(SubmitResponse::from_core(&outcomes)))
}

async fn leave(
    State(api): State<Arc<Api>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    blocking(&api, move |hub| hub.leave(actor)).await??;
    Ok(axum::Json(Ack {}))
}

async fn preempt(
    State(api): State<Arc<Api>>,
    Extension(authenticated): Extension<Authenticated>,
    Body(request): Body<ActorRequest>,
) -> Result<axum::Json<Ack>, ApiError> {
    let actor = authenticated.check(request.actor)?;
    blocking(&api, move |hub| hub.preempt(actor)).await??;
    Ok(axum::Json(Ack {}))
}

async fn status(State(api): State<Arc<Api>>) -> Result<axum::Json<StatusResponse>, ApiError> {
    let status = blocking(&api, |hub| hub.read(StatusResponse::from_core)).await??;
    Ok(axum::Json(status))
}

async fn metrics(State(api): State<Arc<Api>>) -> Result<impl IntoResponse, ApiError> {
    let text = blocking(&api, |hub| {
        let refusals = hub.refusals().snapshot();
        hub.read(|core| crate::metrics::render(core, hub.leases_issued(), &refusals))
    })
    .await??;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text))
}

/// Runs a hub call on the blocking pool: calls take the core's lock, which a commit
/// may hold through an fsync.
async fn blocking<T: Send + 'static>(
    api: &Api,
    call: impl FnOnce(&Hub) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let hub = Arc::clone(&api.hub);
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
    /// Set when a rule refused the request, for [`count_refusals`].
    refusal: Option<Refusal>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            refusal: None,
        }
    }

    fn refused(status: StatusCode, refusal: Refusal, message: impl Into<String>) -> ApiError {
        ApiError {
            refusal: Some(refusal),
            ..ApiError::new(status, message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.message.clone(),
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        if let Some(refusal) = self.refusal {
            let extensions = response.extensions_mut();
            extensions.insert(Refused(refusal));
            extensions.insert(RefusedMessage(self.message));
        }
        response
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
        let refusal = Refusal::Request(error.rule());
        ApiError::refused(StatusCode::UNAUTHORIZED, refusal, error.to_string())
    }
}

impl From<Forbidden> for ApiError {
    fn from(error: Forbidden) -> ApiError {
        let refusal = Refusal::Request(error.rule());
        ApiError::refused(StatusCode::FORBIDDEN, refusal, error.to_string())
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
