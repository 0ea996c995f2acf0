//! Stop strings: text is released only once it can no longer be the start of a stop string,
//! and a matched stop string (and everything after it) is never emitted.

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text generated but not yet released.
    pending: String,
    /// The stop string that matched, once one did.
    matched: Option<String>,
}

/// What one push released.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to emit (may be empty).
    Continue(String),
    /// A stop string matched; the text before it.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new(), matched: None }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return StopOutcome::Continue(std::mem::take(&mut self.pending));
        }
        // Earliest complete match.
        if let Some((pos, k)) = self.stops.iter().enumerate().filter_map(|(k, s)| Some((self.pending.find(s.as_str())?, k))).min() {
            let out = self.pending[..pos].to_string();
            self.matched = Some(self.stops[k].clone());
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > hold && self.pending.ends_with(&s[..i]) {
                    hold = i;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome::Continue(out)
    }

    /// The stop string that ended the text (after `Stopped`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Releases whatever is held back (the sequence ended without a match).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_and_cuts() {
        let mut m = StopMatcher::new(vec!["STOP".into(), "\n\n".into()]);
        assert_eq!(m.push("hello S"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("T"), StopOutcome::Continue("".into()));
        assert_eq!(m.push("x"), StopOutcome::Continue("STx".into()));
        assert_eq!(m.push(" a\n"), StopOutcome::Continue(" a".into()));
        assert_eq!(m.push("\nmore"), StopOutcome::Stopped("".into()));
        let mut m = StopMatcher::new(vec!["éé".into()]);
        assert_eq!(m.push("aé"), StopOutcome::Continue("a".into()));
        assert_eq!(m.push("é!"), StopOutcome::Stopped("".into()));
        assert_eq!(m.flush(), "");
    }
}
