//! Chat templates: render a checkpoint's HF chat template with minijinja byte-identically to
//! `transformers` `apply_chat_template(messages, tools=.., add_generation_prompt=..,
//! tokenize=False, **kwargs)` (checked against transformers 5.24 by `tests/python`).
//!
//! Template source: `chat_template.jinja` in the model directory, else `chat_template` in
//! `tokenizer_config.json` (a string, or a list of `{name, template}`: "tool_use" when tools are
//! given and it exists, else "default", as transformers picks).
//!
//! What the template sees, in transformers' order:
//! 1. `bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
//!    `mask_token` from `tokenizer_config.json` (those that are set),
//! 2. the caller's extra kwargs (`enable_thinking`, `preserve_thinking` ...), which override 1,
//! 3. `messages`, `tools` (none when not given), `documents` (none), `add_generation_prompt`.
//!
//! Messages are prepared as transformers does before rendering: keys whose value is null are
//! dropped, and reasoning given as `reasoning_content`, `thinking` or `reasoning` is copied to
//! both `reasoning_content` and `thinking`. Then, as vLLM does for OpenAI requests, assistant
//! `tool_calls[].function.arguments` given as a JSON string are parsed into the value they
//! encode (the Qwen3.5 template iterates `arguments|items`), and missing or empty arguments
//! become `{}`.
//!
//! The jinja2 behaviours that differ from minijinja's defaults live in `pycompat` (and
//! `strftime`, for `strftime_now`).

mod pycompat;
mod strftime;

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::{AutoEscape, Environment, Value};
use serde_json::{Map, Value as Json};

use crate::tokenizer::{read_json_opt, token_string};

pub use pycompat::Raised;

/// Why a template could not be loaded or a conversation could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// No template, or a config file that is missing pieces or malformed (names the file).
    #[error("{0}")]
    Load(String),
    /// The template does not parse.
    #[error("chat template syntax error: {0}")]
    Syntax(String),
    /// The request itself is malformed (not a list of message objects, bad tool arguments ...).
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
    /// The template called `raise_exception(msg)`: it does not accept this conversation.
    #[error("{0}")]
    Raised(String),
    /// Any other failure while rendering.
    #[error("chat template render error: {0}")]
    Render(String),
}

type Result<T> = std::result::Result<T, ChatTemplateError>;

/// Names transformers passes itself; an extra kwarg with one of these names is an error there.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];
/// The special-token attributes transformers exposes to templates (`special_tokens_map`).
const SPECIAL_TOKEN_VARS: [&str; 7] = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A compiled chat template (one or several named ones) plus the special-token variables.
pub struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("names", &self.names).finish()
    }
}

impl ChatTemplate {
    /// Loads the template and the special-token variables of the model in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let load = |e: anyhow::Error| ChatTemplateError::Load(format!("{e:#}"));
        let tc_path = dir.join("tokenizer_config.json");
        let tc = read_json_opt(&tc_path).map_err(load)?;
        let mut special_tokens = Vec::new();
        if let Some(tc) = &tc {
            for name in SPECIAL_TOKEN_VARS {
                if let Some(tok) = token_string(&tc_path, name, tc.get(name)).map_err(load)? {
                    special_tokens.push((name.to_string(), tok));
                }
            }
        }
        let jinja_path = dir.join("chat_template.jinja");
        let templates: Vec<(String, String)> = if jinja_path.is_file() {
            let src = std::fs::read_to_string(&jinja_path)
                .map_err(|e| ChatTemplateError::Load(format!("{}: cannot read: {e}", jinja_path.display())))?;
            vec![("default".into(), src)]
        } else {
            match tc.as_ref().and_then(|tc| tc.get("chat_template")) {
                Some(Json::String(s)) => vec![("default".into(), s.clone())],
                Some(Json::Array(items)) => named_templates(&tc_path, items)?,
                None | Some(Json::Null) => {
                    return Err(ChatTemplateError::Load(format!(
                        "{}: no chat template (neither chat_template.jinja nor `chat_template` in tokenizer_config.json)",
                        dir.display()
                    )));
                }
                Some(_) => {
                    return Err(ChatTemplateError::Load(format!(
                        "{}: `chat_template` must be a string or a list of {{name, template}}",
                        tc_path.display()
                    )));
                }
            }
        };
        Self::new(templates, special_tokens)
    }

    /// A template from source, with the given special-token variables (`("eos_token",
    /// "<|im_end|>")` ...).
    pub fn from_source(source: &str, special_tokens: &[(&str, &str)]) -> Result<Self> {
        let special = special_tokens.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::new(vec![("default".into(), source.to_string())], special)
    }

    fn new(templates: Vec<(String, String)>, special_tokens: Vec<(String, String)>) -> Result<Self> {
        let mut env = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True),
        // keep_trailing_newline False, no autoescaping, lenient undefined (jinja2 `Undefined`).
        let syntax =
            SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(|e| ChatTemplateError::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        pycompat::install(&mut env);
        let mut names = Vec::new();
        for (name, src) in templates {
            env.add_template_owned(name.clone(), src).map_err(|e| ChatTemplateError::Syntax(format!("template {name:?}: {e}")))?;
            names.push(name);
        }
        Ok(ChatTemplate { env, names, special_tokens })
    }

    /// Renders `messages` (OpenAI-style message objects) with optional `tools` (OpenAI tool
    /// objects), `add_generation_prompt` and extra template variables `kwargs`.
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String> {
        if messages.is_empty() {
            // transformers refuses an empty conversation before rendering.
            return Err(ChatTemplateError::InvalidRequest("no messages".into()));
        }
        if let Some(k) = kwargs.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(ChatTemplateError::InvalidRequest(format!("`{k}` cannot be passed as a template variable")));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| prepare_message(i, m).map(|m| to_value(&Json::Object(m))))
            .collect::<Result<Vec<Value>>>()?;

        let mut ctx: Vec<(String, Value)> = Vec::new();
        for (k, v) in &self.special_tokens {
            ctx.push((k.clone(), Value::from(v.as_str())));
        }
        for (k, v) in kwargs {
            ctx.push((k.clone(), to_value(v)));
        }
        ctx.push(("messages".into(), Value::from(messages)));
        let tools_value = match tools {
            Some(t) => Value::from(t.iter().map(to_value).collect::<Vec<_>>()),
            None => Value::from(()),
        };
        ctx.push(("tools".into(), tools_value));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));

        let name = self.pick(tools.is_some())?;
        let template = self.env.get_template(name).map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        template.render(Value::from_pairs(ctx)).map_err(render_error)
    }

    /// Renders a request object `{"messages": [..], "tools": [..]?, "add_generation_prompt":
    /// bool?, ...extra template variables}`. `add_generation_prompt` defaults to true (the
    /// OpenAI-server convention); `tools: null` means no tools.
    pub fn render_request(&self, request: &Json) -> Result<String> {
        let bad = |m: &str| ChatTemplateError::InvalidRequest(m.to_string());
        let obj = request.as_object().ok_or_else(|| bad("the request must be a JSON object"))?;
        let messages = match obj.get("messages") {
            Some(Json::Array(m)) => m.as_slice(),
            _ => return Err(bad("`messages` must be a list")),
        };
        let tools = match obj.get("tools") {
            None | Some(Json::Null) => None,
            Some(Json::Array(t)) => Some(t.as_slice()),
            Some(_) => return Err(bad("`tools` must be a list")),
        };
        let add_generation_prompt = match obj.get("add_generation_prompt") {
            None | Some(Json::Null) => true,
            Some(Json::Bool(b)) => *b,
            Some(_) => return Err(bad("`add_generation_prompt` must be a boolean")),
        };
        let kwargs: Map<String, Json> = obj
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "messages" | "tools" | "add_generation_prompt"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        self.render(messages, tools, add_generation_prompt, &kwargs)
    }

    fn pick(&self, has_tools: bool) -> Result<&str> {
        let find = |n: &str| self.names.iter().find(|x| x.as_str() == n).map(String::as_str);
        let picked = if has_tools { find("tool_use").or_else(|| find("default")) } else { find("default") };
        picked.ok_or_else(|| ChatTemplateError::Load(format!("no \"default\" chat template among the named templates {:?}", self.names)))
    }
}

fn named_templates(path: &Path, items: &[Json]) -> Result<Vec<(String, String)>> {
    items
        .iter()
        .map(|item| match (item.get("name"), item.get("template")) {
            (Some(Json::String(n)), Some(Json::String(t))) => Ok((n.clone(), t.clone())),
            _ => Err(ChatTemplateError::Load(format!(
                "{}: each `chat_template` entry must be {{\"name\": str, \"template\": str}}",
                path.display()
            ))),
        })
        .collect()
}

/// Maps a minijinja error to ours, surfacing `raise_exception` messages as [`ChatTemplateError::Raised`].
fn render_error(e: minijinja::Error) -> ChatTemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if let Some(r) = err.downcast_ref::<Raised>() {
            return ChatTemplateError::Raised(r.0.clone());
        }
        source = err.source();
    }
    ChatTemplateError::Render(e.to_string())
}

/// One message as transformers + vLLM hand it to the template (see the module docs).
fn prepare_message(index: usize, message: &Json) -> Result<Map<String, Json>> {
    let Some(obj) = message.as_object() else {
        return Err(ChatTemplateError::InvalidRequest(format!("messages[{index}] must be an object")));
    };
    let mut msg: Map<String, Json> = obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();

    let reasoning = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| msg.get(*k).cloned());
    if let Some(r) = reasoning {
        // Python: {"thinking": r, **message, "reasoning_content": r}
        let mut aliased = Map::new();
        aliased.insert("thinking".into(), r.clone());
        for (k, v) in msg {
            aliased.insert(k, v);
        }
        aliased.insert("reasoning_content".into(), r);
        msg = aliased;
    }

    if msg.get("role").and_then(Json::as_str) == Some("assistant")
        && let Some(Json::Array(calls)) = msg.get_mut("tool_calls")
    {
        for (j, call) in calls.iter_mut().enumerate() {
            let Some(Json::Object(function)) = call.get_mut("function") else {
                continue;
            };
            let args = function.get("arguments").cloned().unwrap_or(Json::Null);
            let parsed = match args {
                Json::String(s) if !s.is_empty() => serde_json::from_str(&s).map_err(|e| {
                    ChatTemplateError::InvalidRequest(format!(
                        "messages[{index}].tool_calls[{j}].function.arguments is not valid JSON: {e}"
                    ))
                })?,
                Json::Object(_) | Json::Array(_) if is_truthy(&args) => args,
                a if !is_truthy(&a) => Json::Object(Map::new()),
                other => {
                    return Err(ChatTemplateError::InvalidRequest(format!(
                        "messages[{index}].tool_calls[{j}].function.arguments must be an object or a JSON string, got {other}"
                    )));
                }
            };
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(msg)
}

/// Python truthiness of a JSON value.
fn is_truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// serde_json -> minijinja, keeping key order and the int/float distinction.
fn to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(to_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), to_value(v)))),
    }
}

#[cfg(test)]
mod tests;
