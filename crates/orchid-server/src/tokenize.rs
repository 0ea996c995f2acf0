//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes.
//!
//! - `/tokenize` with `prompt` (a string; `add_special_tokens`, default true) or `messages` (a
//!   chat, rendered by the chat template as `/v1/chat/completions` would: `tools`,
//!   `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`) answers
//!   `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with
//!   `return_token_strs: true`, else null).
//! - `/detokenize` with `tokens` (ids) answers `{"prompt": text}`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::body::JsonBody;
use crate::errors::ApiError;
use crate::openai::validate;
use crate::state::AppState;

/// Longest list `/detokenize` takes.
const MAX_DETOKENIZE: usize = 1 << 20;

pub async fn tokenize(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string")),
    };
    st.check_model(model.as_deref())?;
    let info = st.ready()?;
    let flag = |k: &str| match body.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(k, format!("`{k}` must be a boolean"))),
    };
    let want_strs = flag("return_token_strs")?.unwrap_or(false);
    let tok = st.tokenizer.clone();
    let tokens = match (body.get("prompt"), body.get("messages")) {
        (Some(Value::String(p)), None) => {
            let add = flag("add_special_tokens")?.unwrap_or(true);
            let p = p.clone();
            st.blocking(move || tok.encode(&p, add).map_err(|e| ApiError::internal(format!("tokenizing failed: {e:#}")))).await?
        }
        (None, Some(_)) => {
            // The chat fields only: sampling fields would not mean anything here.
            let mut chat = serde_json::Map::new();
            for k in [
                "messages",
                "tools",
                "tool_choice",
                "chat_template_kwargs",
                "reasoning_effort",
                "add_generation_prompt",
                "continue_final_message",
            ] {
                if let Some(v) = body.get(k) {
                    chat.insert(k.into(), v.clone());
                }
            }
            let req = validate::chat_request(&chat, &st.config.sampling_defaults)?;
            let template = st
                .template
                .clone()
                .ok_or_else(|| ApiError::bad_request("This model has no chat template; tokenize a `prompt` instead."))?;
            // Counting is the point here: no context limit (the body limit bounds the work).
            let st2 = st.clone();
            st.blocking(move || crate::chat::plan(&st2, &template, &tok, &req, usize::MAX).map(|p| p.prompt)).await?
        }
        (Some(_), Some(_)) => return Err(ApiError::invalid("prompt", "give either `prompt` or `messages`, not both")),
        (Some(_), None) => return Err(ApiError::invalid("prompt", "`prompt` must be a string")),
        (None, None) => return Err(ApiError::invalid("prompt", "`prompt` (a string) or `messages` is required")),
    };
    let strs = want_strs.then(|| tokens.iter().map(|&id| st.tokenizer.decode(&[id], false)).collect::<Vec<_>>());
    Ok(axum::Json(json!({"count": tokens.len(), "max_model_len": info.max_context, "tokens": tokens, "token_strs": strs})).into_response())
}

pub async fn detokenize(State(st): State<AppState>, JsonBody(body): JsonBody) -> Result<Response, ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) => st.check_model(Some(m))?,
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string")),
    }
    let info = st.ready()?;
    let ids = match body.get("tokens") {
        Some(Value::Array(ids)) if ids.len() <= MAX_DETOKENIZE => ids
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_u64().and_then(|x| u32::try_from(x).ok()) {
                Some(id) if (id as usize) < info.vocab_size => Ok(id),
                _ => Err(ApiError::invalid(
                    format!("tokens[{i}]"),
                    format!("`tokens[{i}]` must be a token id below {}, got {v}", info.vocab_size),
                )),
            })
            .collect::<Result<Vec<u32>, ApiError>>()?,
        Some(Value::Array(_)) => return Err(ApiError::invalid("tokens", format!("`tokens` may hold at most {MAX_DETOKENIZE} ids"))),
        Some(_) => return Err(ApiError::invalid("tokens", "`tokens` must be an array of token ids")),
        None => return Err(ApiError::invalid("tokens", "`tokens` is required")),
    };
    let tok = st.tokenizer.clone();
    let text = st.blocking(move || Ok(tok.decode(&ids, false))).await?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}
