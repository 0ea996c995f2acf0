//! Splits generated text into reasoning (`<think>…</think>`) and answer content, fed one text
//! delta at a time.
//!
//! Qwen3.5 templates open the reasoning in the prompt (`…<|im_start|>assistant\n<think>\n`),
//! so generation starts inside it and the first `</think>` ends it: [`ReasoningParser::new`]
//! with `in_reasoning = true`. When the prompt does not open it (thinking disabled, which the
//! template writes as an empty `<think>\n\n</think>\n\n` block, or templates that let the
//! model open it), a `<think>` at the very start of the output (after whitespace) opens it.
//!
//! Shape: the newline right after `<think>`, the newlines right before `</think>` and the
//! newlines right after it are template framing (`<think>\n{r}\n</think>\n\n{c}`) and belong
//! to neither part. Everything else is emitted exactly once, in order; text that may be the
//! start of a tag is held back until the next delta decides it.

/// One piece of classified text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Start of the output, reasoning not opened by the prompt: a leading `<think>` opens it.
    Start,
    /// Inside the reasoning; `trim_start` while the framing newline may still come.
    Reasoning { trim_start: bool },
    /// After the reasoning (or no reasoning at all); `trim_start` drops the framing newlines.
    Content { trim_start: bool },
}

pub struct ReasoningParser {
    state: State,
    /// Text received but not yet classified.
    buf: String,
}

impl ReasoningParser {
    /// `in_reasoning`: the prompt already opened `<think>` (see the module docs).
    pub fn new(in_reasoning: bool) -> ReasoningParser {
        let state = if in_reasoning { State::Reasoning { trim_start: true } } else { State::Start };
        ReasoningParser { state, buf: String::new() }
    }

    /// A parser that never finds reasoning (everything is content).
    pub fn disabled() -> ReasoningParser {
        ReasoningParser { state: State::Content { trim_start: false }, buf: String::new() }
    }

    /// Whether text fed now would count as reasoning (used to count reasoning tokens).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Reasoning { .. })
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return out;
                    }
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning { trim_start: true };
                    } else if OPEN.starts_with(t) {
                        return out;
                    } else {
                        self.state = State::Content { trim_start: false };
                    }
                }
                State::Reasoning { trim_start } => {
                    if trim_start {
                        if self.buf.is_empty() {
                            return out;
                        }
                        if self.buf.starts_with('\n') {
                            self.buf.remove(0);
                        }
                        self.state = State::Reasoning { trim_start: false };
                        continue;
                    }
                    if let Some(i) = self.buf.find(CLOSE) {
                        let before = self.buf[..i].trim_end_matches('\n');
                        push_piece(&mut out, Piece::Reasoning(before.to_string()));
                        self.buf.drain(..i + CLOSE.len());
                        self.state = State::Content { trim_start: true };
                        continue;
                    }
                    // Hold back a possible partial `</think>` and the newlines before it.
                    let keep = partial_tag_suffix(&self.buf, CLOSE);
                    let cut = self.buf[..self.buf.len() - keep].trim_end_matches('\n').len();
                    let ready: String = self.buf.drain(..cut).collect();
                    push_piece(&mut out, Piece::Reasoning(ready));
                    return out;
                }
                State::Content { trim_start } => {
                    if trim_start {
                        let t = self.buf.trim_start_matches('\n');
                        if t.is_empty() {
                            self.buf.clear();
                            return out;
                        }
                        self.buf = t.to_string();
                        self.state = State::Content { trim_start: false };
                    }
                    push_piece(&mut out, Piece::Content(std::mem::take(&mut self.buf)));
                    return out;
                }
            }
        }
    }

    /// The output ended: releases whatever was held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.state {
            // Never decided: it was content (a lone partial `<think`, or only whitespace).
            State::Start => push_piece(&mut out, Piece::Content(rest)),
            State::Reasoning { .. } => push_piece(&mut out, Piece::Reasoning(rest)),
            State::Content { trim_start } => {
                let rest = if trim_start { rest.trim_start_matches('\n').to_string() } else { rest };
                push_piece(&mut out, Piece::Content(rest))
            }
        }
        out
    }
}

fn push_piece(out: &mut Vec<Piece>, p: Piece) {
    match &p {
        Piece::Reasoning(s) | Piece::Content(s) if s.is_empty() => {}
        _ => out.push(p),
    }
}

/// Length of the longest proper prefix of `tag` that `text` ends with (0 if none).
pub(crate) fn partial_tag_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| tag.is_char_boundary(n) && text.ends_with(&tag[..n])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `deltas`, then merges consecutive pieces of the same kind.
    fn run(mut p: ReasoningParser, deltas: &[&str]) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        let mut all = Vec::new();
        for d in deltas {
            all.extend(p.push(d));
        }
        all.extend(p.finish());
        for piece in all {
            match piece {
                Piece::Reasoning(s) => r.push_str(&s),
                Piece::Content(s) => c.push_str(&s),
            }
        }
        (r, c)
    }

    /// Every way of cutting `text` into two or three deltas gives the same split.
    fn all_splits(in_reasoning: bool, text: &str, want: (&str, &str)) {
        let idx: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &a in &idx {
            for &b in idx.iter().filter(|&&b| b >= a) {
                let got = run(ReasoningParser::new(in_reasoning), &[&text[..a], &text[a..b], &text[b..]]);
                assert_eq!((got.0.as_str(), got.1.as_str()), want, "split at {a},{b} of {text:?}");
            }
        }
    }

    #[test]
    fn prompt_opened_reasoning() {
        all_splits(true, "Let me think.\nTwo lines.\n</think>\n\nThe answer is 4.", ("Let me think.\nTwo lines.", "The answer is 4."));
        // Leading framing newline dropped; a second one is kept as text.
        all_splits(true, "\nabc\n</think>\n\nx", ("abc", "x"));
        // No `</think>` (ran out of tokens): everything is reasoning.
        all_splits(true, "still thinking <b>bold</b> </thi", ("still thinking <b>bold</b> </thi", ""));
        // A `<` that is not the tag, right before it.
        all_splits(true, "a<</think>b", ("a<", "b"));
    }

    #[test]
    fn model_opened_reasoning() {
        all_splits(false, "<think>\nhmm\n</think>\n\nok", ("hmm", "ok"));
        all_splits(false, "  \n<think>r</think>c", ("r", "c"));
        // Not at the start: plain content, tags and all.
        all_splits(false, "x <think>y</think>", ("", "x <think>y</think>"));
        all_splits(false, "<thin", ("", "<thin"));
        all_splits(false, "<thinking>", ("", "<thinking>"));
    }

    #[test]
    fn disabled_is_content() {
        let got = run(ReasoningParser::disabled(), &["<think>", "a</think>b"]);
        assert_eq!(got, (String::new(), "<think>a</think>b".to_string()));
    }

    #[test]
    fn in_reasoning_tracks_state() {
        let mut p = ReasoningParser::new(true);
        assert!(p.in_reasoning());
        p.push("abc</thi");
        assert!(p.in_reasoning());
        p.push("nk>");
        assert!(!p.in_reasoning());
    }

    #[test]
    fn tool_call_inside_reasoning_stays_reasoning() {
        all_splits(
            true,
            "<tool_call>\n<function=f>\n</function>\n</tool_call></think>done",
            ("<tool_call>\n<function=f>\n</function>\n</tool_call>", "done"),
        );
    }
}
