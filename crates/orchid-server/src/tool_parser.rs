//! Tool calls in the model's answer text, parsed incrementally (fed text deltas, emits events).
//!
//! Qwen3.5/3.6 write calls in an XML form (the template's system prompt asks for it):
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE (raw text, may span lines; objects and arrays as JSON)
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Qwen3 / Qwen3-Next templates write `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`
//! instead; both are accepted.
//!
//! Events: a call starts ([`ToolEvent::Start`], id + name) as soon as `<function=NAME>` is
//! complete; its JSON `arguments` then arrive in pieces, one per finished parameter
//! (`{"a": 1`, `, "b": "x"`, then `}`), each value typed by the tool's schema
//! ([`ToolSchemas`]). Text outside calls is [`ToolEvent::Content`]; whitespace between the
//! text and a call, and between calls, is framing and dropped.
//!
//! Malformed text is never lost: `<tool_call>` followed by anything but `<function=NAME>` or a
//! JSON object, or a JSON call that does not parse, comes back as content verbatim. Once a
//! call has started the parser is lenient: a missing `</parameter>` ends at the next tag, a
//! missing `</function>`/`</tool_call>` ends the call at the next call or at the end of the
//! output, and stray text inside a call comes back as content.

use serde_json::Value;

use crate::openai::new_id;
use crate::reasoning_parser::partial_tag_suffix;
use crate::tool_schema::ToolSchemas;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// A new call (indices count from 0 within the response).
    Start {
        index: usize,
        id: String,
        name: String,
    },
    /// The next piece of the call's JSON `arguments`.
    Args {
        index: usize,
        delta: String,
    },
}

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNC_OPEN: &str = "<function=";
const FUNC_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// What may end a parameter value (the first one that appears).
const VALUE_ENDS: [&str; 4] = [PARAM_CLOSE, PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE];
/// Longest function or parameter name accepted; past it the text is not a tag.
const MAX_NAME: usize = 256;

#[derive(Debug)]
enum State {
    /// Answer text, looking for `<tool_call>`.
    Text,
    /// After `<tool_call>`, before the function name is known. `raw`: the literal text
    /// consumed since (returned as content if this turns out not to be a call).
    Open { raw: String },
    /// A JSON-form call body, collected until `</tool_call>`.
    Json { raw: String },
    /// Inside `<function=..>`, between parameters.
    Function,
    /// Inside `<parameter=NAME>`, collecting the value.
    Param { name: String, value: String },
    /// After `</function>`, expecting `</tool_call>`.
    AfterFunction,
}

pub struct ToolCallParser {
    schemas: ToolSchemas,
    state: State,
    buf: String,
    /// Calls completed or in progress.
    calls: usize,
    /// The function of the call in progress and how many parameters it has emitted.
    func: String,
    params: usize,
    /// Drop whitespace at the start of the next text (framing after a call).
    trim_lead: bool,
}

impl ToolCallParser {
    pub fn new(schemas: ToolSchemas) -> ToolCallParser {
        ToolCallParser { schemas, state: State::Text, buf: String::new(), calls: 0, func: String::new(), params: 0, trim_lead: false }
    }

    /// Number of calls started so far.
    pub fn calls(&self) -> usize {
        self.calls + matches!(self.state, State::Function | State::Param { .. } | State::AfterFunction) as usize
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        merge_content(out)
    }

    /// The output ended: closes a call in progress, returns held-back text.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match std::mem::replace(&mut self.state, State::Text) {
            State::Text => {
                if !(self.trim_lead && rest.trim().is_empty()) {
                    content(&mut out, rest);
                }
            }
            State::Open { raw } | State::Json { raw } => content(&mut out, raw + &rest),
            State::Function => {
                let t = rest.trim();
                if ![PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE].iter().any(|tag| tag.starts_with(t)) {
                    content(&mut out, t.to_string());
                }
                self.end_call(&mut out);
            }
            State::Param { name, value } => {
                self.finish_param(&mut out, &name, &(value + &rest));
                self.end_call(&mut out);
            }
            State::AfterFunction => self.calls += 1,
        }
        merge_content(out)
    }

    /// Makes progress on `buf`; false when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        match &mut self.state {
            State::Text => {
                if self.trim_lead {
                    let n = self.buf.len() - self.buf.trim_start().len();
                    self.buf.drain(..n);
                    if self.buf.is_empty() {
                        return false;
                    }
                    self.trim_lead = false;
                }
                if let Some(i) = self.buf.find(CALL_OPEN) {
                    let text_end = self.buf[..i].trim_end().len();
                    content(out, self.buf[..text_end].to_string());
                    let raw = self.buf[text_end..i + CALL_OPEN.len()].to_string();
                    self.buf.drain(..i + CALL_OPEN.len());
                    self.state = State::Open { raw };
                    return true;
                }
                // Hold back a possible partial `<tool_call>` and the whitespace before it.
                let keep = partial_tag_suffix(&self.buf, CALL_OPEN);
                let cut = self.buf[..self.buf.len() - keep].trim_end().len();
                content(out, self.buf.drain(..cut).collect());
                false
            }
            State::Open { raw } => {
                let ws = self.buf.len() - self.buf.trim_start().len();
                let t = &self.buf[ws..];
                if t.is_empty() {
                    return false;
                }
                if let Some(rest) = t.strip_prefix(FUNC_OPEN) {
                    match rest.find('>') {
                        Some(j) if valid_name(rest[..j].trim()) => {
                            let name = rest[..j].trim().to_string();
                            self.buf.drain(..ws + FUNC_OPEN.len() + j + 1);
                            self.start_call(out, name);
                            self.state = State::Function;
                            return true;
                        }
                        None if !rest.contains(['\n', '<']) && rest.len() <= MAX_NAME => return false,
                        _ => {}
                    }
                } else if t.starts_with('{') {
                    raw.push_str(&self.buf[..ws]);
                    self.buf.drain(..ws);
                    self.state = State::Json { raw: std::mem::take(raw) };
                    return true;
                } else if FUNC_OPEN.starts_with(t) {
                    return false;
                }
                // Not a call: the tag and what follows are text.
                content(out, std::mem::take(raw));
                self.state = State::Text;
                true
            }
            State::Json { raw } => {
                let Some(i) = self.buf.find(CALL_CLOSE) else { return false };
                let body = &self.buf[..i];
                match parse_json_call(body) {
                    Some((name, args)) => {
                        self.start_call(out, name);
                        out.push(ToolEvent::Args { index: self.calls, delta: args });
                        self.calls += 1;
                        self.trim_lead = true;
                    }
                    None => content(out, std::mem::take(raw) + &self.buf[..i + CALL_CLOSE.len()]),
                }
                self.buf.drain(..i + CALL_CLOSE.len());
                self.state = State::Text;
                true
            }
            State::Function => {
                let ws = self.buf.len() - self.buf.trim_start().len();
                self.buf.drain(..ws);
                let t = self.buf.as_str();
                if t.is_empty() {
                    return false;
                }
                if let Some(rest) = t.strip_prefix(PARAM_OPEN) {
                    match rest.find('>') {
                        Some(j) if valid_name(rest[..j].trim()) => {
                            let name = rest[..j].trim().to_string();
                            self.buf.drain(..PARAM_OPEN.len() + j + 1);
                            self.state = State::Param { name, value: String::new() };
                            return true;
                        }
                        None if !rest.contains(['\n', '<']) && rest.len() <= MAX_NAME => return false,
                        _ => {}
                    }
                } else if t.starts_with(FUNC_CLOSE) {
                    self.buf.drain(..FUNC_CLOSE.len());
                    self.close_args(out);
                    self.state = State::AfterFunction;
                    return true;
                } else if t.starts_with(CALL_CLOSE) {
                    self.buf.drain(..CALL_CLOSE.len());
                    self.end_call(out);
                    return true;
                } else if [PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE].iter().any(|tag| tag.starts_with(t)) {
                    return false;
                }
                // Stray text inside the call: once the next tag starts, everything before it
                // (less trailing whitespace, skipped as between tags) is content.
                let Some((end, _)) = t.char_indices().skip(1).find(|&(_, c)| c == '<') else {
                    return false;
                };
                let end = t[..end].trim_end().len();
                content(out, self.buf.drain(..end).collect());
                true
            }
            State::Param { name, value } => {
                let found = VALUE_ENDS.iter().filter_map(|tag| self.buf.find(tag).map(|i| (i, *tag))).min();
                match found {
                    Some((i, tag)) => {
                        value.push_str(&self.buf[..i]);
                        let consumed = if tag == PARAM_CLOSE { i + tag.len() } else { i };
                        self.buf.drain(..consumed);
                        let (name, value) = (std::mem::take(name), std::mem::take(value));
                        self.finish_param(out, &name, &value);
                        self.state = State::Function;
                        true
                    }
                    None => {
                        let keep = VALUE_ENDS.iter().map(|tag| partial_tag_suffix(&self.buf, tag)).max().unwrap_or(0);
                        value.extend(self.buf.drain(..self.buf.len() - keep));
                        false
                    }
                }
            }
            State::AfterFunction => {
                let ws = self.buf.len() - self.buf.trim_start().len();
                self.buf.drain(..ws);
                let t = self.buf.as_str();
                let proper_prefix_of = |tag: &str| tag.len() > t.len() && tag.starts_with(t);
                if t.is_empty() || proper_prefix_of(CALL_CLOSE) || proper_prefix_of(FUNC_OPEN) {
                    return false;
                }
                let (close, another) = (t.starts_with(CALL_CLOSE), t.starts_with(FUNC_OPEN));
                if close {
                    self.buf.drain(..CALL_CLOSE.len());
                }
                self.calls += 1;
                self.trim_lead = true;
                // `<function=` right after `</function>`: a second call missing its wrapper.
                self.state = if another { State::Open { raw: String::new() } } else { State::Text };
                true
            }
        }
    }

    fn start_call(&mut self, out: &mut Vec<ToolEvent>, name: String) {
        self.func = name.clone();
        self.params = 0;
        out.push(ToolEvent::Start { index: self.calls, id: new_id("call_"), name });
    }

    fn finish_param(&mut self, out: &mut Vec<ToolEvent>, name: &str, value: &str) {
        // The template writes `<parameter=n>\nVALUE\n</parameter>`: one newline each side is framing.
        let v = value.strip_prefix('\n').unwrap_or(value);
        let v = v.strip_suffix('\n').unwrap_or(v);
        let json = self.schemas.convert(&self.func, name, v);
        let sep = if self.params == 0 { "{" } else { ", " };
        let delta = format!("{sep}{}: {}", Value::from(name), json);
        self.params += 1;
        out.push(ToolEvent::Args { index: self.calls, delta });
    }

    fn close_args(&mut self, out: &mut Vec<ToolEvent>) {
        let delta = if self.params == 0 { "{}" } else { "}" };
        out.push(ToolEvent::Args { index: self.calls, delta: delta.into() });
    }

    /// Ends the call in progress (closing its arguments first).
    fn end_call(&mut self, out: &mut Vec<ToolEvent>) {
        self.close_args(out);
        self.calls += 1;
        self.trim_lead = true;
        self.state = State::Text;
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME && !name.contains(|c: char| c.is_whitespace() || c == '<' || c == '>')
}

/// `{"name": "f", "arguments": {..} | "json string"}` -> (name, arguments as a JSON string).
fn parse_json_call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str().filter(|n| valid_name(n))?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => {
            let parsed: Value = serde_json::from_str(s).ok()?;
            parsed.to_string()
        }
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some((name, args))
}

fn content(out: &mut Vec<ToolEvent>, s: String) {
    if !s.is_empty() {
        out.push(ToolEvent::Content(s));
    }
}

fn merge_content(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::with_capacity(events.len());
    for e in events {
        if let (Some(ToolEvent::Content(prev)), ToolEvent::Content(s)) = (out.last_mut(), &e) {
            prev.push_str(s);
        } else {
            out.push(e);
        }
    }
    out
}

#[cfg(test)]
#[path = "tool_parser_tests.rs"]
mod tests;
