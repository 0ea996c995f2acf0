//! The JSON request body extractor. Unlike axum's `Json`, every failure (too large, not JSON,
//! not an object, unreadable, too slow) is an [`ApiError`], so it gets the OpenAI envelope.
//! The body must be declared `Content-Type: application/json` (415 otherwise): a web page can
//! send `text/plain` to a local server without a CORS preflight, but not JSON.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde_json::{Map, Value};

use crate::errors::ApiError;
use crate::state::AppState;

pub struct JsonBody(pub Map<String, Value>);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &AppState) -> Result<Self, ApiError> {
        let limit = st.config.max_body_bytes;
        let ctype = req.headers().get(header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let is_json = ctype.as_deref().is_some_and(|c| {
            let essence = c.split(';').next().unwrap_or("").trim();
            essence.eq_ignore_ascii_case("application/json")
        });
        if !is_json {
            return Err(ApiError::unsupported_media_type(ctype.as_deref()));
        }
        // Refuse a declared oversize body before reading any of it.
        let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::too_large(limit));
        }
        let timeout = st.config.body_timeout;
        let read =
            tokio::time::timeout(timeout, Bytes::from_request(req, st)).await.map_err(|_| ApiError::body_timeout(timeout.as_secs_f64()))?;
        let bytes = read.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(limit)
            } else {
                ApiError::bad_request(format!("Could not read the request body: {}", r.body_text()))
            }
        })?;
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| ApiError::malformed_json(format!("The request body is not valid JSON: {e}")))?;
        match v {
            Value::Object(m) => Ok(JsonBody(m)),
            _ => Err(ApiError::malformed_json("The request body must be a JSON object.")),
        }
    }
}
