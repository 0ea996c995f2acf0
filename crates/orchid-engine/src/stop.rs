//! Stop strings: text is released only once it can no longer be the start of a stop string,
//! and a matched stop string (and everything after it) is never emitted.
//!
//! Matching runs an Aho-Corasick automaton over the bytes of the generated text, one byte at a
//! time, so a token costs time proportional to its own length (amortized), whatever the length
//! or number of the stop strings. The automaton's state is the longest suffix of the text that
//! is a prefix of some stop string: exactly the text that has to be held back.

pub struct StopMatcher {
    /// The trie: per node, its children (byte, node), sorted by byte.
    next: Vec<Vec<(u8, u32)>>,
    /// Per node: the node of its longest proper suffix that is also in the trie.
    fail: Vec<u32>,
    /// Per node: its depth (bytes from the root).
    depth: Vec<u32>,
    /// Per node: length of the longest stop string that ends here (itself or through its
    /// suffix links); 0 when none does.
    out: Vec<u32>,
    /// Current node.
    at: u32,
    /// Text generated but not yet released (the last `depth[at]` bytes).
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
        let mut m = StopMatcher {
            next: vec![Vec::new()],
            fail: vec![0],
            depth: vec![0],
            out: vec![0],
            at: 0,
            pending: String::new(),
            matched: None,
        };
        for s in stops.iter().filter(|s| !s.is_empty()) {
            let mut node = 0u32;
            for &b in s.as_bytes() {
                node = match m.child(node, b) {
                    Some(c) => c,
                    None => {
                        let c = m.next.len() as u32;
                        m.next.push(Vec::new());
                        m.fail.push(0);
                        m.depth.push(m.depth[node as usize] + 1);
                        m.out.push(0);
                        let kids = &mut m.next[node as usize];
                        let at = kids.partition_point(|&(x, _)| x < b);
                        kids.insert(at, (b, c));
                        c
                    }
                };
            }
            m.out[node as usize] = s.len() as u32;
        }
        // Suffix links, breadth first (a node's link is shallower than the node).
        let mut queue: std::collections::VecDeque<u32> = m.next[0].iter().map(|&(_, c)| c).collect();
        while let Some(node) = queue.pop_front() {
            for (b, c) in m.next[node as usize].clone() {
                let mut f = m.fail[node as usize];
                let link = loop {
                    if let Some(x) = m.child(f, b) {
                        break x;
                    }
                    if f == 0 {
                        break 0;
                    }
                    f = m.fail[f as usize];
                };
                m.fail[c as usize] = link;
                m.out[c as usize] = m.out[c as usize].max(m.out[link as usize]);
                queue.push_back(c);
            }
        }
        m
    }

    fn child(&self, node: u32, b: u8) -> Option<u32> {
        let kids = &self.next[node as usize];
        kids.binary_search_by_key(&b, |&(x, _)| x).ok().map(|i| kids[i].1)
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.next[0].is_empty() {
            self.pending.push_str(text);
            return StopOutcome::Continue(std::mem::take(&mut self.pending));
        }
        let base = self.pending.len();
        self.pending.push_str(text);
        for (i, &b) in text.as_bytes().iter().enumerate() {
            let mut node = self.at;
            self.at = loop {
                if let Some(c) = self.child(node, b) {
                    break c;
                }
                if node == 0 {
                    break 0;
                }
                node = self.fail[node as usize];
            };
            let len = self.out[self.at as usize] as usize;
            if len > 0 {
                // The first stop string to complete (the longest of those ending here).
                let end = base + i + 1;
                let out = self.pending[..end - len].to_string();
                self.matched = Some(self.pending[end - len..end].to_string());
                self.pending.clear();
                self.at = 0;
                return StopOutcome::Stopped(out);
            }
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let cut = self.pending.len() - self.depth[self.at as usize] as usize;
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
        self.at = 0;
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
        assert_eq!(m.matched(), Some("\n\n"));
        let mut m = StopMatcher::new(vec!["éé".into()]);
        assert_eq!(m.push("aé"), StopOutcome::Continue("a".into()));
        assert_eq!(m.push("é!"), StopOutcome::Stopped("".into()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn overlapping_stops_and_suffix_links() {
        // "abab" fails partway and falls back to "ab" without losing text.
        let mut m = StopMatcher::new(vec!["ababc".into(), "bx".into()]);
        assert_eq!(m.push("xabab"), StopOutcome::Continue("x".into()));
        assert_eq!(m.push("ab"), StopOutcome::Continue("ab".into()));
        assert_eq!(m.push("c tail"), StopOutcome::Stopped("".into()));
        // A stop string inside another one's prefix is found through the suffix link.
        let mut m = StopMatcher::new(vec!["abcd".into(), "bc".into()]);
        assert_eq!(m.push("zab"), StopOutcome::Continue("z".into()));
        assert_eq!(m.push("c"), StopOutcome::Stopped("a".into()));
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("anything"), StopOutcome::Continue("anything".into()));
    }

    /// The same result as a plain reference matcher (earliest-ending match; hold back the
    /// longest suffix that is a proper prefix of a stop string) on random splits of random
    /// text over a small alphabet.
    #[test]
    fn agrees_with_a_naive_matcher() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let alphabet = ['a', 'b', 'é', 'c'];
        for _ in 0..2000 {
            let stops: Vec<String> = (0..1 + rnd(3)).map(|_| (0..1 + rnd(4)).map(|_| alphabet[rnd(4) as usize]).collect()).collect();
            let text: String = (0..rnd(20)).map(|_| alphabet[rnd(4) as usize]).collect();
            let chars: Vec<char> = text.chars().collect();
            // Reference: scan end positions; the first end where some stop string ends wins.
            let mut want = None;
            'outer: for end in 1..=chars.len() {
                let prefix: String = chars[..end].iter().collect();
                let mut best: Option<usize> = None;
                for s in &stops {
                    if prefix.ends_with(s.as_str()) {
                        best = Some(best.map_or(s.len(), |b: usize| b.max(s.len())));
                    }
                }
                if let Some(l) = best {
                    want = Some(prefix[..prefix.len() - l].to_string());
                    break 'outer;
                }
            }
            let mut m = StopMatcher::new(stops.clone());
            let (mut got, mut stopped, mut i) = (String::new(), false, 0);
            while i < chars.len() && !stopped {
                let n = 1 + rnd(3) as usize;
                let piece: String = chars[i..(i + n).min(chars.len())].iter().collect();
                i += n;
                match m.push(&piece) {
                    StopOutcome::Continue(t) => got.push_str(&t),
                    StopOutcome::Stopped(t) => {
                        got.push_str(&t);
                        stopped = true;
                    }
                }
            }
            if !stopped {
                got.push_str(&m.flush());
            }
            match &want {
                Some(w) => assert!(stopped && &got == w, "{stops:?} {text:?}: got {got:?} want {w:?}"),
                None => assert!(!stopped && got == text, "{stops:?} {text:?}: got {got:?}"),
            }
        }
    }

    /// A long stop string does not make pushing slower: the work per byte is bounded by the
    /// number of states visited, which the automaton keeps amortized constant.
    #[test]
    fn long_stop_strings_hold_back_only_what_can_still_match() {
        let long = "x".repeat(100_000);
        let mut m = StopMatcher::new(vec![long.clone(), "yz".into()]);
        for _ in 0..1000 {
            assert_eq!(m.push("ab"), StopOutcome::Continue("ab".into()));
        }
        assert_eq!(m.push("xxx"), StopOutcome::Continue("".into()));
        assert_eq!(m.push("y"), StopOutcome::Continue("xxx".into()));
        assert_eq!(m.push("z!"), StopOutcome::Stopped("".into()));
    }
}
