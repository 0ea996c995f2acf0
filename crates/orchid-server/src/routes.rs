//! The router: endpoints, the fallbacks for unknown routes and methods, the body limit, a
//! panic guard per request, the request counter, and request ids with the access log.

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tower_http::catch_panic::CatchPanicLayer;

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
        // Outermost first: count every response, including those made from panics.
        .layer(CatchPanicLayer::custom(|p: Box<dyn std::any::Any + Send>| {
            ApiError::from_panic(p.as_ref()).into_response()
        }))
        .layer(middleware::from_fn_with_state(st.clone(), count_requests))
        // Request ids and the access log see every response, the counted ones included.
        .layer(middleware::from_fn(crate::access_log::middleware))
        .with_state(st)
}

async fn count_requests(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
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

async fn model(State(st): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    st.check_model(Some(&id))?;
    let max = st.engine.info().map(|i| i.max_context);
    Ok(axum::Json(types::model_object(&st.config.model_id, st.started, max)).into_response())
}

/// 200 once the model is loaded and the server is not shutting down, else 503.
async fn health(State(st): State<AppState>) -> Response {
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
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
#[path = "routes_tests.rs"]
mod tests;
