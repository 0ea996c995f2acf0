//! A flat batch of tokens from one or more sequences. The model sees token ids and positions;
//! only the mixers (attention, GDN) care which sequence a token belongs to.

/// `len` consecutive tokens of the sequence in state slot `slot`, the first at position `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub slot: usize,
    pub start: usize,
    pub len: usize,
}

/// The spans of one forward call; the batch's tokens are the spans' tokens in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchLayout {
    pub spans: Vec<SeqSpan>,
}

impl BatchLayout {
    pub fn single(slot: usize, start: usize, len: usize) -> BatchLayout {
        BatchLayout { spans: vec![SeqSpan { slot, start, len }] }
    }

    pub fn num_tokens(&self) -> usize {
        self.spans.iter().map(|s| s.len).sum()
    }

    /// Row offset of each span's first token in the flat batch.
    pub fn offsets(&self) -> Vec<usize> {
        let mut off = 0;
        self.spans
            .iter()
            .map(|s| {
                let o = off;
                off += s.len;
                o
            })
            .collect()
    }

    /// The flat row of each span's last token.
    pub fn last_rows(&self) -> Vec<usize> {
        self.offsets().iter().zip(&self.spans).map(|(o, s)| o + s.len - 1).collect()
    }

    /// Position of every token.
    pub fn positions(&self) -> Vec<usize> {
        self.spans.iter().flat_map(|s| s.start..s.start + s.len).collect()
    }
}

/// Which rows of logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// Every token (teacher-forced evaluation).
    All,
    /// The last token of each span (generation).
    LastOfEachSpan,
}
