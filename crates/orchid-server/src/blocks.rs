//! Chat deltas as a sequence of typed output blocks (reasoning, text, tool call), each opened,
//! extended and closed in order. The Responses API (output items) and the Anthropic Messages
//! API (content blocks) both stream this shape; only their event names differ.

use crate::chat_output::{ChatDelta, ToolDelta};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Reasoning,
    Text,
    /// A tool call (its arguments are the text).
    Call,
}

#[derive(Clone, Debug)]
pub struct Block {
    pub kind: Kind,
    /// Reasoning, text, or the call's arguments (JSON text).
    pub text: String,
    /// A call's id and function name.
    pub call: Option<(String, String)>,
}

/// What changed, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Open(usize),
    Delta(usize, String),
    Close(usize),
}

#[derive(Default)]
pub struct Blocks {
    pub blocks: Vec<Block>,
    open: Option<usize>,
    /// Block index of each tool call (by the parser's call index).
    calls: Vec<usize>,
}

impl Blocks {
    /// The changes one delta makes (reasoning, then text, then tool calls).
    pub fn push(&mut self, d: ChatDelta) -> Vec<Change> {
        let mut out = Vec::new();
        if !d.reasoning.is_empty() {
            self.append(Kind::Reasoning, d.reasoning, &mut out);
        }
        if !d.content.is_empty() {
            self.append(Kind::Text, d.content, &mut out);
        }
        for t in d.tool_calls {
            match t {
                ToolDelta::Start { id, name, .. } => {
                    self.close_open(&mut out);
                    self.blocks.push(Block { kind: Kind::Call, text: String::new(), call: Some((id, name)) });
                    let i = self.blocks.len() - 1;
                    self.calls.push(i);
                    self.open = Some(i);
                    out.push(Change::Open(i));
                }
                ToolDelta::Args { index, delta } => {
                    if let Some(&i) = self.calls.get(index) {
                        self.blocks[i].text.push_str(&delta);
                        out.push(Change::Delta(i, delta));
                    }
                }
            }
        }
        out
    }

    /// Closes the open block (the end of the output).
    pub fn finish(&mut self) -> Vec<Change> {
        let mut out = Vec::new();
        self.close_open(&mut out);
        out
    }

    pub fn has_calls(&self) -> bool {
        !self.calls.is_empty()
    }

    fn append(&mut self, kind: Kind, text: String, out: &mut Vec<Change>) {
        let i = match self.open {
            Some(i) if self.blocks[i].kind == kind => i,
            _ => {
                // Whitespace between blocks (e.g. after `</think>`) opens nothing.
                if text.trim().is_empty() {
                    return;
                }
                self.close_open(out);
                self.blocks.push(Block { kind, text: String::new(), call: None });
                let i = self.blocks.len() - 1;
                self.open = Some(i);
                out.push(Change::Open(i));
                i
            }
        };
        self.blocks[i].text.push_str(&text);
        out.push(Change::Delta(i, text));
    }

    fn close_open(&mut self, out: &mut Vec<Change>) {
        if let Some(i) = self.open.take() {
            out.push(Change::Close(i));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_open_and_close_in_order() {
        let mut b = Blocks::default();
        let d = |r: &str, c: &str, t: Vec<ToolDelta>| ChatDelta { reasoning: r.into(), content: c.into(), tool_calls: t, logprobs: vec![] };
        let mut ch = b.push(d("hm", "", vec![]));
        ch.extend(b.push(d(" ok", "\n\n", vec![])));
        ch.extend(b.push(d("", "Hi", vec![ToolDelta::Start { index: 0, id: "c".into(), name: "f".into() }])));
        ch.extend(b.push(d("", "", vec![ToolDelta::Args { index: 0, delta: "{}".into() }])));
        ch.extend(b.finish());
        use Change::*;
        assert_eq!(
            ch,
            vec![
                Open(0),
                Delta(0, "hm".into()),
                Delta(0, " ok".into()),
                Close(0),
                Open(1),
                Delta(1, "Hi".into()),
                Close(1),
                Open(2),
                Delta(2, "{}".into()),
                Close(2)
            ]
        );
        assert_eq!(b.blocks[1].kind, Kind::Text);
        assert!(b.has_calls());
    }
}
