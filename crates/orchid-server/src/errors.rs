//! Every error the server answers with, in the OpenAI envelope
//! `{"error": {"message", "type", "param", "code"}}`. This is the one place errors become
//! responses: handlers return `Result<_, ApiError>`, extractor rejections, unknown routes,
//! panics and mid-stream failures are all turned into an [`ApiError`] first.

use std::any::Any;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use orchid_engine::ChatTemplateError;
use orchid_engine::request::SubmitError;
use serde_json::{Value, json};

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI `type`: `invalid_request_error`, `not_found_error`, `server_error` ...
    pub kind: &'static str,
    /// The request field at fault (`temperature`, `messages[2].content` ...).
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, sent as `Retry-After` (overload).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code, retry_after: None }
    }

    /// 400: a field has an invalid value (names the field).
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("invalid_value"), message);
        e.param = Some(param.into());
        e
    }

    /// 400: the request as a whole is unacceptable.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }

    /// 400: the body is not JSON (or not an object).
    pub fn malformed_json(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("invalid_json"), message)
    }

    /// 400: the prompt does not fit the context.
    pub fn context_length(param: &str, prompt: usize, max: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            format!(
                "This model's maximum context length is {max} tokens, but the prompt has {prompt} tokens (room must be left for at least one generated token)."
            ),
        );
        e.param = Some(param.into());
        e
    }

    /// 400: the prompt is known to be too long before it was counted exactly.
    pub fn context_length_over(param: &str, at_least: usize, max: usize) -> ApiError {
        let mut e = ApiError::context_length(param, at_least, max);
        e.message = format!(
            "This model's maximum context length is {max} tokens, but the prompt has at least {at_least} tokens (room must be left for at least one generated token)."
        );
        e
    }

    /// 401: `/v1/*` needs the API key.
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "Missing or incorrect API key: send it as `Authorization: Bearer <key>`.",
        )
    }

    /// 408: the client did not send the request body in time.
    pub fn body_timeout(secs: f64) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            Some("request_timeout"),
            format!("The request body did not arrive within {secs} seconds."),
        )
    }

    /// 415: a body that is not declared as JSON.
    pub fn unsupported_media_type(got: Option<&str>) -> ApiError {
        let got = got.map_or("no Content-Type".to_string(), |g| format!("Content-Type `{g}`"));
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            Some("unsupported_media_type"),
            format!("The request body must be JSON sent with `Content-Type: application/json` (got {got})."),
        )
    }

    /// 404: no such model.
    pub fn unknown_model(model: &str, served: &str) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!("The model `{model}` does not exist; this server serves `{served}`."),
        );
        e.param = Some("model".into());
        e
    }

    /// 404: no such route.
    pub fn route_not_found(method: &str, path: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("not_found"), format!("Unknown route: {method} {path}"))
    }

    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            Some("method_not_allowed"),
            format!("{method} is not allowed on {path}"),
        )
    }

    /// 413: the body is larger than the server accepts.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!("The request body exceeds the limit of {limit} bytes."),
        )
    }

    /// 503: the queue is full (try again shortly).
    pub fn overloaded() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("overloaded"),
            "The server is overloaded (the request queue is full); retry shortly.",
        );
        e.retry_after = Some(1);
        e
    }

    /// 503: not serving (model still loading, or shutting down).
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("unavailable"), message);
        e.retry_after = Some(5);
        e
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", Some("internal_error"), message)
    }

    /// 500 from a caught panic.
    pub fn from_panic(payload: &(dyn Any + Send)) -> ApiError {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!("request handler panicked: {what}");
        ApiError::internal(format!("Internal error while handling the request: {what}"))
    }

    /// The envelope, also sent as an SSE event when a stream fails after it started.
    pub fn to_json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), "{}", self.message);
        } else {
            tracing::debug!(status = self.status.as_u16(), "{}", self.message);
        }
        let mut resp = (self.status, axum::Json(self.to_json())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull => ApiError::overloaded(),
            SubmitError::ContextLength { prompt, max } => ApiError::context_length("messages", prompt, max),
            SubmitError::EmptyPrompt => ApiError::invalid("prompt", "The prompt is empty."),
            SubmitError::InvalidToken { id, vocab } => {
                ApiError::invalid("prompt", format!("The prompt holds token id {id}, outside the vocabulary (size {vocab})."))
            }
            SubmitError::NotReady => ApiError::unavailable("The model is still loading."),
            SubmitError::Stopped => ApiError::unavailable("The server is shutting down."),
        }
    }
}

impl From<ChatTemplateError> for ApiError {
    fn from(e: ChatTemplateError) -> ApiError {
        match e {
            // The conversation is not acceptable to this model's template.
            ChatTemplateError::InvalidRequest(m) | ChatTemplateError::Raised(m) => ApiError::invalid("messages", m),
            other => ApiError::internal(format!("Chat template failure: {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_and_headers() {
        let r = ApiError::overloaded().into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let v = ApiError::invalid("temperature", "bad").to_json();
        assert_eq!(
            v,
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}})
        );
        let p: Box<dyn Any + Send> = Box::new("boom");
        assert!(ApiError::from_panic(p.as_ref()).message.contains("boom"));
        let e: ApiError = SubmitError::ContextLength { prompt: 10, max: 8 }.into();
        assert_eq!(e.code, Some("context_length_exceeded"));
    }
}
