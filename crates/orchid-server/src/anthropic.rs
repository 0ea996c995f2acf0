//! placeholder
use axum::extract::State;
use axum::response::Response;
use crate::body::JsonBody;
use crate::errors::ApiError;
use crate::state::AppState;
pub async fn messages(State(_st): State<AppState>, JsonBody(_body): JsonBody) -> Result<Response, ApiError> {
    Err(ApiError::bad_request("todo"))
}
