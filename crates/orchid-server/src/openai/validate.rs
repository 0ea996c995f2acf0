//! Request bodies -> validated requests. Every invalid value is a 400 naming the field in
//! `param`; unknown fields are ignored (and logged once per name, see `extras`); features this
//! server does not have (image parts, beam search ...) are rejected rather than silently
//! ignored. Output constraints (`response_format`, `structured_outputs`, `guided_*`) are read by
//! [`crate::structured`].

use orchid_engine::sampling::SamplingParams;
use orchid_engine::sampling_limits::{self as limits, Limit};
use serde_json::{Map, Value};

use crate::errors::ApiError;
use crate::structured::{self, Structured};

type Result<T> = std::result::Result<T, ApiError>;

/// What chat and completion requests share.
#[derive(Clone, Debug)]
pub struct Common {
    pub model: Option<String>,
    pub sampling: SamplingParams,
    /// `max_completion_tokens` or `max_tokens`; clipped to the context left later.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub user: Option<String>,
    /// vLLM's request extras (n, min_tokens, ignore_eos, logit_bias ...).
    pub extras: Extras,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub common: Common,
    /// Messages normalised for the chat template (text parts joined, `developer` -> `system`).
    pub messages: Vec<Value>,
    /// The request's tools, as given (the template renders them verbatim).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: ToolChoice,
    /// Extra template variables: `chat_template_kwargs`, plus `enable_thinking: false` for
    /// `reasoning_effort: "none"`.
    pub template_kwargs: Map<String, Value>,
    /// `Some(top_n)` when `logprobs` is true.
    pub logprobs: Option<usize>,
    /// Assistant prefill: `add_generation_prompt` (default true) and `continue_final_message`.
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// The grammar the answer must follow (`response_format`, `structured_outputs`, `guided_*`).
    pub structured: Option<Structured>,
    /// `parallel_tool_calls` (default true): false allows at most one call.
    pub parallel_tool_calls: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
    pub echo: bool,
    pub logprobs: Option<usize>,
    pub structured: Option<Structured>,
}

// ---- vLLM request extras (see extras.rs) ----
#[path = "extras.rs"]
pub mod extras;
pub use extras::{Extras, log_unknown_fields};
// ---- end of vLLM request extras ----

/// Most alternatives a response may list per token.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most stop strings per request.
pub const MAX_STOP: usize = 16;
/// Longest stop string, in bytes (stop strings are short markers; vLLM and OpenAI bound them too).
pub const MAX_STOP_BYTES: usize = 1024;
/// Names a request may not set through `chat_template_kwargs`: the variables the server passes
/// itself and the template language's built-in functions (replacing them breaks rendering).
pub const RESERVED_TEMPLATE_KWARGS: [&str; 19] = [
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "namespace",
    "range",
    "dict",
    "debug",
    "cycler",
    "joiner",
    "lipsum",
    "raise_exception",
    "strftime_now",
    "loop",
    "self",
    "true",
    "false",
    "none",
    "super",
];

/// Typed access to a JSON object, with errors that name the field.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The value of `k`; JSON null counts as absent.
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn number(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(v) => Err(ApiError::invalid(k, format!("`{k}` must be a number, got {}", kind(v)))),
        }
    }

    /// A number within the parameter's accepted range (`orchid_engine::sampling_limits`).
    fn limited(&self, l: &Limit) -> Result<Option<f32>> {
        let Some(x) = self.number(l.name)? else { return Ok(None) };
        l.check(x).map(Some).map_err(|msg| ApiError::invalid(l.name, msg))
    }

    fn int(&self, k: &str) -> Result<Option<i64>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(i) => Ok(Some(i)),
                None if n.as_u64().is_some() => Ok(Some(i64::MAX)),
                None => Err(ApiError::invalid(k, format!("`{k}` must be an integer, got {n}"))),
            },
            Some(v) => Err(ApiError::invalid(k, format!("`{k}` must be an integer, got {}", kind(v)))),
        }
    }

    fn bool(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(k, format!("`{k}` must be a boolean, got {}", kind(v)))),
        }
    }

    fn str(&self, k: &str) -> Result<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(k, format!("`{k}` must be a string, got {}", kind(v)))),
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn common(f: &Fields, defaults: &SamplingParams, default_max_tokens: Option<usize>) -> Result<Common> {
    let model = f.str("model")?.map(str::to_string);
    let mut s = defaults.clone();
    if let Some(t) = f.limited(&limits::TEMPERATURE)? {
        s.temperature = t;
    }
    if let Some(p) = f.limited(&limits::TOP_P)? {
        s.top_p = p;
    }
    if let Some(k) = f.int("top_k")? {
        if k < -1 {
            return Err(ApiError::invalid("top_k", format!("`top_k` must be -1 or 0 (off) or a positive integer, got {k}")));
        }
        s.top_k = k.max(0) as usize;
    }
    if let Some(p) = f.limited(&limits::MIN_P)? {
        s.min_p = p;
    }
    if let Some(p) = f.limited(&limits::PRESENCE_PENALTY)? {
        s.presence_penalty = p;
    }
    if let Some(p) = f.limited(&limits::FREQUENCY_PENALTY)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = f.limited(&limits::REPETITION_PENALTY)? {
        s.repetition_penalty = p;
    }
    s.seed = match f.get("seed") {
        None => None,
        Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64().map(|i| i as u64),
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
        Some(v) => return Err(ApiError::invalid("seed", format!("`seed` must be an integer, got {}", kind(v)))),
    };
    let max_tokens = match f.get("max_completion_tokens") {
        Some(_) => max_tokens_field(f, "max_completion_tokens")?,
        None => max_tokens_field(f, "max_tokens")?,
    }
    .or(default_max_tokens);
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![stop_string("stop", s)?],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(ApiError::invalid("stop", format!("`stop` may hold at most {MAX_STOP} strings, got {}", items.len())));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => stop_string(&format!("stop[{i}]"), s),
                    v => Err(ApiError::invalid(format!("stop[{i}]"), format!("`stop[{i}]` must be a string, got {}", kind(v)))),
                })
                .collect::<Result<Vec<_>>>()?
        }
        Some(v) => {
            return Err(ApiError::invalid("stop", format!("`stop` must be a string or a list of strings, got {}", kind(v))));
        }
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed when `stream` is true"));
            }
            Fields(o).bool("include_usage").map_err(|e| rename(e, "stream_options.include_usage"))?.unwrap_or(false)
        }
        Some(v) => {
            return Err(ApiError::invalid("stream_options", format!("`stream_options` must be an object, got {}", kind(v))));
        }
    };
    let user = f.str("user")?.map(str::to_string);
    // vLLM request extras, and the known fields this server refuses.
    extras::refuse_unimplemented(f)?;
    let extras = extras::extras(f, max_tokens)?;
    Ok(Common { model, sampling: s, max_tokens, stop, stream, include_usage, user, extras })
}

fn max_tokens_field(f: &Fields, k: &str) -> Result<Option<usize>> {
    match f.int(k)? {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid(k, format!("`{k}` must be at least 1, got {n}"))),
        Some(n) => Ok(Some(n as usize)),
    }
}

fn stop_string(param: &str, s: &str) -> Result<String> {
    if s.len() > MAX_STOP_BYTES {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` is {} bytes long; a stop string may have at most {MAX_STOP_BYTES} bytes", s.len()),
        ));
    }
    Ok(s.to_string())
}

/// A function name as OpenAI allows it: 1 to 64 of `a-z A-Z 0-9 _ - .` (no spaces, no markup,
/// so it cannot break out of the template's tool-call syntax).
pub fn valid_function_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

fn rename(mut e: ApiError, param: &str) -> ApiError {
    e.param = Some(param.to_string());
    e
}

/// Parses and validates a `/v1/chat/completions` body; unset sampling fields keep `defaults`.
pub fn chat_request(body: &Map<String, Value>, defaults: &SamplingParams) -> Result<ChatRequest> {
    let f = Fields(body);
    let common = common(&f, defaults, None)?;
    let messages = match f.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m.iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>>>()?,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(v) => {
            return Err(ApiError::invalid("messages", format!("`messages` must be an array, got {}", kind(v))));
        }
    };
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(t)) if t.is_empty() => None,
        Some(Value::Array(t)) => Some(t.iter().enumerate().map(|(i, t)| tool(i, t)).collect::<Result<Vec<_>>>()?),
        Some(v) => return Err(ApiError::invalid("tools", format!("`tools` must be an array, got {}", kind(v)))),
    };
    let tool_choice = tool_choice(f.get("tool_choice"), tools.as_deref())?;
    let mut template_kwargs = Map::new();
    match f.str("reasoning_effort")? {
        None | Some("minimal" | "low" | "medium" | "high") => {}
        Some("none") => {
            template_kwargs.insert("enable_thinking".into(), Value::Bool(false));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!("`reasoning_effort` must be one of none, minimal, low, medium, high; got `{other}`"),
            ));
        }
    }
    match f.get("chat_template_kwargs") {
        None => {}
        Some(Value::Object(kw)) => {
            if let Some(k) = kw.keys().find(|k| RESERVED_TEMPLATE_KWARGS.contains(&k.as_str())) {
                return Err(ApiError::invalid(
                    format!("chat_template_kwargs.{k}"),
                    format!("`chat_template_kwargs.{k}` is reserved (set by the server or built into the template language)"),
                ));
            }
            template_kwargs.extend(kw.iter().map(|(k, v)| (k.clone(), v.clone())))
        }
        Some(v) => {
            return Err(ApiError::invalid("chat_template_kwargs", format!("`chat_template_kwargs` must be an object, got {}", kind(v))));
        }
    }
    let structured = structured::request_constraint(body)?;
    if structured.is_some() && matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_)) {
        let field = structured.as_ref().map_or("", |s| s.field.as_str()).to_string();
        return Err(ApiError::invalid(field.clone(), format!("`{field}` cannot be combined with a `tool_choice` that forces a tool call")));
    }
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let logprobs = match (f.bool("logprobs")?.unwrap_or(false), f.int("top_logprobs")?) {
        (_, Some(n)) if n < 0 || n as usize > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid("top_logprobs", format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")));
        }
        (false, Some(n)) if n > 0 => return Err(ApiError::invalid("top_logprobs", "`top_logprobs` requires `logprobs: true`")),
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, _) => None,
    };
    // Assistant prefill (vLLM extras).
    let (add_generation_prompt, continue_final_message) = extras::prefill(&f, &messages)?;
    Ok(ChatRequest {
        common,
        messages,
        tools,
        tool_choice,
        template_kwargs,
        logprobs,
        add_generation_prompt,
        continue_final_message,
        structured,
        parallel_tool_calls,
    })
}

/// One message, normalised for the template.
fn message(i: usize, m: &Value) -> Result<Value> {
    let p = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(obj) = m else {
        return Err(ApiError::invalid(format!("messages[{i}]"), format!("`messages[{i}]` must be an object, got {}", kind(m))));
    };
    let f = Fields(obj);
    let role = match f.str("role").map_err(|e| rename(e, &p("role")))? {
        Some("developer") => "system",
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        Some(r) => {
            return Err(ApiError::invalid(
                p("role"),
                format!("`messages[{i}].role` must be system, developer, user, assistant or tool; got `{r}`"),
            ));
        }
        None => return Err(ApiError::invalid(p("role"), format!("`messages[{i}].role` is required"))),
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::from(role));
    let content = match f.get("content") {
        None if role == "assistant" => None,
        None => {
            return Err(ApiError::invalid(p("content"), format!("`messages[{i}].content` is required for a {role} message")));
        }
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => Some(text_parts(i, parts)?),
        Some(v) => {
            return Err(ApiError::invalid(
                p("content"),
                format!("`messages[{i}].content` must be a string or a list of text parts, got {}", kind(v)),
            ));
        }
    };
    if let Some(c) = content {
        out.insert("content".into(), Value::from(c));
    }
    for key in ["name", "tool_call_id"] {
        if let Some(s) = f.str(key).map_err(|e| rename(e, &p(key)))? {
            out.insert(key.into(), Value::from(s));
        }
    }
    if role == "assistant" {
        let reasoning = match f.str("reasoning_content").map_err(|e| rename(e, &p("reasoning_content")))? {
            Some(r) => Some(r),
            None => f.str("reasoning").map_err(|e| rename(e, &p("reasoning")))?,
        };
        if let Some(r) = reasoning {
            out.insert("reasoning_content".into(), Value::from(r));
        }
        match f.get("tool_calls") {
            None => {}
            Some(Value::Array(calls)) => {
                let calls = calls.iter().enumerate().map(|(j, c)| tool_call(i, j, c)).collect::<Result<Vec<_>>>()?;
                if !calls.is_empty() {
                    out.insert("tool_calls".into(), Value::Array(calls));
                }
            }
            Some(v) => {
                return Err(ApiError::invalid(p("tool_calls"), format!("`messages[{i}].tool_calls` must be an array, got {}", kind(v))));
            }
        }
    }
    Ok(Value::Object(out))
}

/// `[{"type": "text", "text": ..}, ..]` -> the texts joined (what the template would render).
fn text_parts(i: usize, parts: &[Value]) -> Result<String> {
    let mut s = String::new();
    for (j, part) in parts.iter().enumerate() {
        let param = format!("messages[{i}].content[{j}]");
        let text = match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text") | None, Some(Value::String(t))) => t,
            (Some(t), _) if t != "text" => {
                return Err(ApiError::invalid(
                    format!("{param}.type"),
                    format!("content part type `{t}` is not supported: this model takes text only"),
                ));
            }
            _ => {
                return Err(ApiError::invalid(param.clone(), format!("`{param}` must be {{\"type\": \"text\", \"text\": string}}")));
            }
        };
        s.push_str(text);
    }
    Ok(s)
}

fn tool_call(i: usize, j: usize, c: &Value) -> Result<Value> {
    let param = format!("messages[{i}].tool_calls[{j}]");
    let func = c
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| ApiError::invalid(format!("{param}.function"), format!("`{param}.function` must be an object")))?;
    let name = func.get("name").and_then(Value::as_str).filter(|n| valid_function_name(n));
    let Some(name) = name else {
        return Err(ApiError::invalid(
            format!("{param}.function.name"),
            format!("`{param}.function.name` must be a function name: 1 to 64 letters, digits, `_`, `-` or `.`"),
        ));
    };
    let args = match func.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return Err(ApiError::invalid(
                    format!("{param}.function.arguments"),
                    format!("`{param}.function.arguments` must be a JSON object encoded as a string"),
                ));
            }
        },
        Some(v @ Value::Object(_)) => v.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                format!("{param}.function.arguments"),
                format!("`{param}.function.arguments` must be a JSON string, got {}", kind(v)),
            ));
        }
    };
    let mut out = Map::new();
    if let Some(id) = c.get("id").and_then(Value::as_str) {
        out.insert("id".into(), Value::from(id));
    }
    out.insert("type".into(), Value::from("function"));
    let mut f = Map::new();
    f.insert("name".into(), Value::from(name));
    f.insert("arguments".into(), args);
    out.insert("function".into(), Value::Object(f));
    Ok(Value::Object(out))
}

fn tool(i: usize, t: &Value) -> Result<Value> {
    let param = format!("tools[{i}]");
    match t.get("type").and_then(Value::as_str) {
        Some("function") | None => {}
        Some(other) => {
            return Err(ApiError::invalid(format!("{param}.type"), format!("tool type `{other}` is not supported (only `function`)")));
        }
    }
    let Some(func) = t.get("function").and_then(Value::as_object) else {
        return Err(ApiError::invalid(format!("{param}.function"), format!("`{param}.function` must be an object")));
    };
    let name = func.get("name").and_then(Value::as_str).unwrap_or("");
    if name.is_empty() || name.len() > 256 || name.contains(|c: char| c.is_whitespace() || c == '<' || c == '>') {
        return Err(ApiError::invalid(
            format!("{param}.function.name"),
            format!("`{param}.function.name` must be a non-empty name without spaces or angle brackets"),
        ));
    }
    if let Some(p) = func.get("parameters").filter(|p| !p.is_null() && !p.is_object()) {
        return Err(ApiError::invalid(
            format!("{param}.function.parameters"),
            format!("`{param}.function.parameters` must be a JSON schema object, got {}", kind(p)),
        ));
    }
    Ok(t.clone())
}

fn tool_choice(v: Option<&Value>, tools: Option<&[Value]>) -> Result<ToolChoice> {
    let names: Vec<&str> = tools.unwrap_or_default().iter().filter_map(|t| t.get("function")?.get("name")?.as_str()).collect();
    let choice = match v {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ..}}}}; got `{other}`"
                    ),
                ));
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => {
                if !names.contains(&name) {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("`tool_choice` names the function `{name}`, which is not among `tools`"),
                    ));
                }
                ToolChoice::Function(name.to_string())
            }
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` object must be {\"type\": \"function\", \"function\": {\"name\": string}}",
                ));
            }
        },
        Some(v) => {
            return Err(ApiError::invalid("tool_choice", format!("`tool_choice` must be a string or an object, got {}", kind(v))));
        }
    };
    if choice == ToolChoice::Required && names.is_empty() {
        return Err(ApiError::invalid("tool_choice", "`tool_choice: required` needs at least one tool in `tools`"));
    }
    Ok(choice)
}

/// Parses and validates a `/v1/completions` body; unset sampling fields keep `defaults`.
pub fn completion_request(body: &Map<String, Value>, defaults: &SamplingParams) -> Result<CompletionRequest> {
    let f = Fields(body);
    let common = common(&f, defaults, Some(16))?;
    let bad_prompt =
        || ApiError::invalid("prompt", "`prompt` must be a string, a list of one string, or a list of token ids (one prompt per request)");
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(ids)] => Prompt::Tokens(token_ids(ids)?),
            ids if !ids.is_empty() && ids.iter().all(Value::is_number) => Prompt::Tokens(token_ids(ids)?),
            _ => return Err(bad_prompt()),
        },
        Some(_) => return Err(bad_prompt()),
    };
    if matches!(&prompt, Prompt::Text(s) if s.is_empty()) {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    let logprobs = match f.int("logprobs")? {
        None => None,
        Some(n) if n < 0 || n as usize > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid("logprobs", format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")));
        }
        Some(n) => Some(n as usize),
    };
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported by this server"));
    }
    if f.int("best_of")?.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("best_of", "`best_of` other than 1 is not supported"));
    }
    if common.extras.thinking_token_budget.is_some() {
        return Err(ApiError::invalid(
            "thinking_token_budget",
            "`thinking_token_budget` applies to chat requests only (completions have no reasoning block)",
        ));
    }
    let structured = structured::request_constraint(body)?;
    Ok(CompletionRequest { common, prompt, echo, logprobs, structured })
}

fn token_ids(ids: &[Value]) -> Result<Vec<u32>> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    ids.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| ApiError::invalid("prompt", format!("token id {v} is not a non-negative integer")))
        })
        .collect()
}

#[cfg(test)]
#[path = "validate_tests.rs"]
mod tests;
