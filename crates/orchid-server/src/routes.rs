//! The router: endpoints, the fallbacks for unknown routes and methods, the body limit, a
//! panic guard per request, the request counter, the API key check on `/v1/*`, CORS, and request
//! ids with the access log.

use axum::Router;
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use crate::errors::ApiError;
use crate::openai::types;
use crate::state::AppState;

/// All routes, with `st` as their state.
pub fn router(st: AppState) -> Router {
    with_layers(endpoints(), st)
}

fn endpoints() -> Router<AppState> {
    Router::new()
        .route("/v1/chat/completions", post(crate::chat::chat_completions))
        .route("/v1/completions", post(crate::completions::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route("/v1/responses", post(crate::responses::responses))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/messages/count_tokens", post(crate::anthropic::count_tokens))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
}

/// The fallbacks and layers every route gets.
fn with_layers(routes: Router<AppState>, st: AppState) -> Router {
    let limit = st.config.max_body_bytes;
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(st.clone(), check_api_key))
        // Outermost first: count every response, including those made from panics.
        .layer(CatchPanicLayer::custom(|p: Box<dyn std::any::Any + Send>| ApiError::from_panic(p.as_ref()).into_response()))
        .layer(middleware::from_fn_with_state(st.clone(), count_requests))
        // Preflights are answered here, before the key check (browsers send no key with them).
        .layer(cors(&st.config.allowed_origins))
        // Request ids and the access log see every response, the counted ones included.
        .layer(middleware::from_fn(crate::access_log::middleware))
        .with_state(st)
}

/// CORS for `origins` (`*`: any origin; empty: none, so that a preflight is answered without
/// an `Access-Control-Allow-Origin` and the browser refuses the call).
fn cors(origins: &[String]) -> CorsLayer {
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o.trim_end_matches('/')).ok()))
    };
    CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
        .allow_headers(AllowHeaders::mirror_request())
        .max_age(std::time::Duration::from_secs(600))
}

/// `/v1/*` needs the API key when one is configured (`/health` and `/metrics` stay open).
async fn check_api_key(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = st.config.api_key.as_deref() else { return next.run(req).await };
    if !req.uri().path().starts_with("/v1/") && req.uri().path() != "/v1" {
        return next.run(req).await;
    }
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let given = bearer.or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()));
    if given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    let mut resp = ApiError::unauthorized().into_response();
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// Compares without an early exit on the first differing byte.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn count_requests(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    let resp = next.run(req).await;
    st.metrics.record_request(&endpoint, resp.status().as_u16());
    resp
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

async fn models(State(st): State<AppState>) -> Response {
    let max = st.engine.info().map(|i| i.max_context);
    let m = types::model_object(&st.config.model_id, st.started, max);
    axum::Json(json!({"object": "list", "data": [m]})).into_response()
}

async fn model(State(st): State<AppState>, id: Result<Path<String>, PathRejection>) -> Result<Response, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::invalid("model", format!("Invalid model id in the path: {}", e.body_text())))?;
    st.check_model(Some(&id))?;
    let max = st.engine.info().map(|i| i.max_context);
    Ok(axum::Json(types::model_object(&st.config.model_id, st.started, max)).into_response())
}

/// 200 once the model is loaded and the server is not shutting down, else 503.
async fn health(State(st): State<AppState>) -> Response {
    if let Some(why) = st.engine.failure() {
        let body = json!({"status": "failed", "model": st.config.model_id, "error": why});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    let (status, state) = if st.is_shutting_down() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else if st.engine.info().is_some() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    };
    (status, axum::Json(json!({"status": state, "model": st.config.model_id}))).into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    let info = st.engine.info();
    let mut text = st.metrics.render(st.engine.stats(), info.as_ref(), st.engine.options().max_seqs);
    crate::vllm_metrics::render(&st.metrics, st.engine.stats(), st.engine.options().max_seqs, &st.config.model_id, &mut text);
    let mut resp = text.into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    resp
}

#[cfg(test)]
#[path = "routes_tests.rs"]
mod tests;
