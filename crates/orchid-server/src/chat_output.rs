//! From the engine's text deltas to chat deltas: reasoning split off first (so calls written
//! inside `<think>` are never parsed), then tool calls parsed out of the answer. Streaming and
//! non-streaming responses are both built from the same [`ChatDelta`]s, so they always agree.

use orchid_engine::sampling::TokenLogprob;

use crate::reasoning_parser::{Piece, ReasoningParser};
use crate::tool_parser::{ToolCallParser, ToolEvent};
use crate::tool_schema::ToolSchemas;

/// One tool-call update: a new call (id + name), or the next piece of its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolDelta {
    Start { index: usize, id: String, name: String },
    Args { index: usize, delta: String },
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolDelta>,
    pub logprobs: Vec<TokenLogprob>,
}

impl ChatDelta {
    /// Whether there is any text or tool-call update (logprobs alone do not count).
    pub fn has_output(&self) -> bool {
        !self.reasoning.is_empty() || !self.content.is_empty() || !self.tool_calls.is_empty()
    }
}

/// How a chat response's text is interpreted.
pub struct ChatOutput {
    reasoning: ReasoningParser,
    tools: Option<ToolCallParser>,
    /// Events produced by priming the tool parser with the forced prompt suffix.
    primed: Vec<ToolEvent>,
    reasoning_tokens: usize,
}

impl ChatOutput {
    /// `reasoning`: the parser for this prompt (opened or not); `tools`: the request's tool
    /// schemas when calls are to be parsed, with the text the prompt was forced to end with
    /// (`<tool_call>\n<function=NAME>\n` for a named `tool_choice`, empty otherwise).
    pub fn new(reasoning: ReasoningParser, tools: Option<(ToolSchemas, String)>) -> ChatOutput {
        let mut primed = Vec::new();
        let tools = tools.map(|(schemas, prefix)| {
            let mut p = ToolCallParser::new(schemas);
            primed = p.push(&prefix);
            p
        });
        ChatOutput { reasoning, tools, primed, reasoning_tokens: 0 }
    }

    /// A generated token's text.
    pub fn token(&mut self, text: &str, logprob: Option<TokenLogprob>) -> ChatDelta {
        if self.reasoning.in_reasoning() {
            self.reasoning_tokens += 1;
        }
        let pieces = self.reasoning.push(text);
        let mut d = self.route(pieces, false);
        d.logprobs.extend(logprob);
        d
    }

    /// The end of the output (`text`: what the engine released at the end).
    pub fn finish(&mut self, text: &str) -> ChatDelta {
        let mut pieces = self.reasoning.push(text);
        pieces.extend(self.reasoning.finish());
        self.route(pieces, true)
    }

    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// Tool calls started so far.
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, ToolCallParser::calls)
    }

    fn route(&mut self, pieces: Vec<Piece>, last: bool) -> ChatDelta {
        let mut d = ChatDelta::default();
        let mut events = std::mem::take(&mut self.primed);
        for p in pieces {
            match p {
                Piece::Reasoning(s) => d.reasoning.push_str(&s),
                Piece::Content(s) => match &mut self.tools {
                    Some(t) => events.extend(t.push(&s)),
                    None => d.content.push_str(&s),
                },
            }
        }
        if last && let Some(t) = &mut self.tools {
            events.extend(t.finish());
        }
        for e in events {
            match e {
                ToolEvent::Content(s) => d.content.push_str(&s),
                ToolEvent::Start { index, id, name } => d.tool_calls.push(ToolDelta::Start { index, id, name }),
                ToolEvent::Args { index, delta } => d.tool_calls.push(ToolDelta::Args { index, delta }),
            }
        }
        d
    }
}

/// Whether a rendered chat prompt leaves the model inside `<think>` (opened in the last turn
/// and not closed), as Qwen3.5 templates do when thinking is on.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    let turn = prompt.rfind("<|im_start|>").map_or(prompt, |i| &prompt[i..]);
    match turn.rfind("<think>") {
        Some(i) => !turn[i..].contains("</think>"),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> ToolSchemas {
        ToolSchemas::from_tools(&[
            json!({"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}}}),
        ])
    }

    /// (reasoning, content, [(name, args)], reasoning tokens)
    fn run(mut out: ChatOutput, tokens: &[&str]) -> (String, String, Vec<(String, String)>, usize) {
        let mut all = ChatDelta::default();
        let mut calls: Vec<(String, String)> = Vec::new();
        let mut deltas: Vec<ChatDelta> = tokens.iter().map(|t| out.token(t, None)).collect();
        deltas.push(out.finish(""));
        for d in deltas {
            all.reasoning.push_str(&d.reasoning);
            all.content.push_str(&d.content);
            for t in d.tool_calls {
                match t {
                    ToolDelta::Start { name, .. } => calls.push((name, String::new())),
                    ToolDelta::Args { index, delta } => calls[index].1.push_str(&delta),
                }
            }
        }
        (all.reasoning, all.content, calls, out.reasoning_tokens())
    }

    #[test]
    fn thinking_then_tool_call() {
        let out = ChatOutput::new(ReasoningParser::new(true), Some((schemas(), String::new())));
        let toks = [
            "Need ",
            "<tool_call>",
            " in thought",
            "\n",
            "</think>",
            "\n\n",
            "Sure.",
            "\n\n",
            "<tool_call>",
            "\n<function=add>\n<parameter=a>\n4",
            "2\n</parameter>\n</function>\n",
            "</tool_call>",
        ];
        let (r, c, calls, rt) = run(out, &toks);
        assert_eq!(r, "Need <tool_call> in thought");
        assert_eq!(c, "Sure.");
        assert_eq!(calls, vec![("add".to_string(), "{\"a\": 42}".to_string())]);
        assert_eq!(rt, 5);
    }

    #[test]
    fn forced_named_call() {
        let out = ChatOutput::new(ReasoningParser::disabled(), Some((schemas(), "<tool_call>\n<function=add>\n".into())));
        let (r, c, calls, _) = run(out, &["<parameter=a>\n1\n</parameter>\n", "</function>\n</tool_call>"]);
        assert_eq!((r.as_str(), c.as_str()), ("", ""));
        assert_eq!(calls, vec![("add".to_string(), "{\"a\": 1}".to_string())]);
    }

    #[test]
    fn no_tools_means_plain_content() {
        let out = ChatOutput::new(ReasoningParser::new(false), None);
        let (r, c, calls, rt) = run(out, &["<tool_call>\n<function=add>\n</function>\n</tool_call>"]);
        assert_eq!((r.as_str(), calls.len(), rt), ("", 0, 0));
        assert_eq!(c, "<tool_call>\n<function=add>\n</function>\n</tool_call>");
    }

    #[test]
    fn detects_opened_reasoning() {
        assert!(prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>\n<|im_start|>assistant\n"));
        assert!(!prompt_opens_reasoning("plain"));
    }
}
