//! Turning a row of logits into the next token: penalties, temperature, top-k, top-p, min-p,
//! a seeded generator for reproducible sampling, and log-probabilities for the API.

use std::collections::HashMap;

use orchid_model::LogitAdjust;

/// Sampling parameters of one request (OpenAI / vLLM semantics).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off; keeps tokens with p ≥ min_p · p_max.
    pub min_p: f32,
    /// 1 = off; HF style over prompt and output tokens.
    pub repetition_penalty: f32,
    /// OpenAI style, over output tokens.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// SplitMix64-seeded xoshiro256**: small, fast, reproducible across platforms.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    /// A seed from the clock, for requests without one.
    pub fn from_entropy() -> Rng {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Rng::new(t ^ COUNTER.fetch_add(0x1234_5678_9ABC_DEF1, Ordering::Relaxed))
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The chosen token's log-probability and the most likely alternatives (shared with the fast
/// decoders, which compute it on the device).
pub use orchid_model::TokenLogprob;

/// Per-sequence sampling state.
pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    /// Tokens seen (prompt + output) for the repetition penalty.
    seen: HashMap<u32, ()>,
    /// Output token counts for presence/frequency penalties.
    counts: HashMap<u32, u32>,
    /// Added to these tokens' logits before anything else (`logit_bias`).
    bias: HashMap<u32, f32>,
    /// Tokens that cannot be chosen right now (e.g. end tokens before `min_tokens`).
    pub banned: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Sampler {
        let rng = params.seed.map_or_else(Rng::from_entropy, Rng::new);
        let seen = if params.repetition_penalty != 1.0 { prompt.iter().map(|&t| (t, ())).collect() } else { HashMap::new() };
        Sampler { params, rng, seen, counts: HashMap::new(), bias: HashMap::new(), banned: Vec::new() }
    }

    /// Adds `bias` to the logits of its token ids at every step.
    pub fn with_bias(mut self, bias: HashMap<u32, f32>) -> Sampler {
        self.bias = bias;
        self
    }

    /// Records an emitted token (for penalties).
    pub fn observe(&mut self, token: u32) {
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token, ());
        }
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// The logits `sample` draws from: the first `valid` of `logits` with the bias, the bans and
    /// the penalties applied, in that order.
    pub fn adjusted_logits(&self, logits: &[f32], valid: usize) -> Vec<f32> {
        let p = &self.params;
        let valid = valid.min(logits.len());
        let mut l: Vec<f32> = logits[..valid].to_vec();
        for (&t, &b) in &self.bias {
            if let Some(x) = l.get_mut(t as usize) {
                *x += b;
            }
        }
        for &t in &self.banned {
            if let Some(x) = l.get_mut(t as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x > 0.0 { *x / p.repetition_penalty } else { *x * p.repetition_penalty };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        l
    }

    /// Whether the penalties and the bias can change a logit at all (bans aside).
    fn penalised(&self) -> (bool, bool) {
        let p = &self.params;
        (p.repetition_penalty != 1.0, p.presence_penalty != 0.0 || p.frequency_penalty != 0.0)
    }

    /// At least the length of [`device_adjust`](Self::device_adjust)'s list (0: it is empty),
    /// without building it.
    pub fn device_adjust_bound(&self) -> usize {
        let (rep, counted) = self.penalised();
        // Every counted token is a seen one when the repetition penalty is on.
        let tokens = if rep {
            self.seen.len()
        } else if counted {
            self.counts.len()
        } else {
            0
        };
        tokens + self.bias.len()
    }

    /// This step's bias and penalties as a device sampler's per-token list (see
    /// [`LogitAdjust`]): one entry per token below `valid` that they touch, in increasing id
    /// order. Applied to a row of logits ([`orchid_model::apply_logit_adjust`]) it gives what
    /// [`adjusted_logits`](Self::adjusted_logits) gives without bans, bit for bit.
    pub fn device_adjust(&self, valid: usize) -> Vec<LogitAdjust> {
        let p = &self.params;
        let (rep, counted) = self.penalised();
        let mut ids: Vec<u32> = self.bias.keys().copied().collect();
        if rep {
            ids.extend(self.seen.keys());
        }
        if counted {
            ids.extend(self.counts.keys());
        }
        ids.retain(|&t| (t as usize) < valid);
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter()
            .map(|t| {
                let mut a = LogitAdjust::neutral(t);
                if let Some(&b) = self.bias.get(&t) {
                    a.bias = b;
                }
                if rep && self.seen.contains_key(&t) {
                    a.repetition = p.repetition_penalty;
                }
                if let (true, Some(&c)) = (counted, self.counts.get(&t)) {
                    a.subtract = p.presence_penalty + p.frequency_penalty * c as f32;
                }
                a
            })
            .collect()
    }

    /// Picks the next token from `logits` (ids ≥ `valid` are never chosen).
    pub fn sample(&mut self, logits: &[f32], valid: usize) -> u32 {
        let l = self.adjusted_logits(logits, valid);
        let p = &self.params;
        if p.is_greedy() {
            return argmax(&l) as u32;
        }
        // Candidates sorted by logit, highest first, cut by top-k.
        let mut idx: Vec<u32> = (0..l.len() as u32).filter(|&i| l[i as usize].is_finite()).collect();
        if idx.is_empty() {
            return argmax(logits) as u32;
        }
        let k = if p.top_k > 0 { p.top_k.min(idx.len()) } else { idx.len() };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| l[b as usize].total_cmp(&l[a as usize]));
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        let inv_t = 1.0 / p.temperature as f64;
        let m = l[idx[0] as usize] as f64;
        let mut probs: Vec<f64> = idx.iter().map(|&i| ((l[i as usize] as f64 - m) * inv_t).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        // top-p: the smallest prefix whose mass reaches top_p.
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        // min-p: relative to the most likely token.
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.next_f64() * mass;
        for (i, q) in probs[..keep].iter().enumerate() {
            r -= q;
            if r < 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }
}

pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// log-softmax of the raw logits at `chosen`, plus the `top` most likely tokens (by logit
/// descending, ties to the lower id).
pub fn logprobs(logits: &[f32], valid: usize, chosen: u32, top: usize) -> TokenLogprob {
    let l = &logits[..valid.min(logits.len())];
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    let lp = |i: u32| (l[i as usize] as f64 - lse) as f32;
    let mut best: Vec<u32> = (0..l.len() as u32).collect();
    let n = top.min(best.len());
    if n > 0 && n < best.len() {
        best.select_nth_unstable_by(n - 1, |&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
    }
    best.truncate(n);
    best.sort_unstable_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
    TokenLogprob { id: chosen, logprob: lp(chosen), top: best.into_iter().map(|i| (i, lp(i))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = vec![0.1, 2.0, 1.9, -1.0, 0.5];
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&logits, 5), 1);
        let p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), &[]);
            (0..50).map(|_| s.sample(&logits, 5)).collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert!(draw(&p).iter().any(|&t| t != 1));
        // top_k = 2 only ever yields the two best.
        let p2 = SamplingParams { temperature: 5.0, top_k: 2, seed: Some(1), ..Default::default() };
        assert!(draw(&p2).iter().all(|&t| t == 1 || t == 2));
        // masking: id 1 is beyond `valid`.
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&logits, 1), 0);
    }

    #[test]
    fn bias_and_bans() {
        let logits = vec![1.0, 2.0, 0.5];
        let mut s = Sampler::new(SamplingParams::default(), &[]).with_bias([(2, 10.0)].into_iter().collect());
        assert_eq!(s.sample(&logits, 3), 2);
        s.banned = vec![2];
        assert_eq!(s.sample(&logits, 3), 1);
        let p = SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() };
        let mut s = Sampler::new(p, &[]).with_bias([(0, -100.0)].into_iter().collect());
        s.banned = vec![1];
        assert!((0..50).all(|_| s.sample(&logits, 3) == 2));
    }

    #[test]
    fn penalties_and_logprobs() {
        let logits = vec![1.0, 1.05, 0.0];
        let mut s = Sampler::new(SamplingParams { presence_penalty: 1.0, ..Default::default() }, &[]);
        s.observe(1);
        assert_eq!(s.sample(&logits, 3), 0);
        let lp = logprobs(&logits, 3, 0, 2);
        let total: f32 = [1.0f32, 1.05, 0.0].iter().map(|x| x.exp()).sum();
        assert!((lp.logprob - (1.0f32.exp() / total).ln()).abs() < 1e-5);
        assert_eq!(lp.top[0].0, 1);
        // Equal logits: the lower ids first, at the cut too.
        let tied = [1.0f32, 2.0, 0.5, 2.0, 2.0, 2.0];
        for n in 1..=4 {
            let ids: Vec<u32> = logprobs(&tied, 6, 0, n).top.iter().map(|t| t.0).collect();
            assert_eq!(ids, [1, 3, 4, 5][..n]);
        }
    }

    /// The host packing of the penalties and bias (counts -> a row's list): applied to random
    /// logits it gives the host sampler's adjusted logits bit for bit, over random prompts,
    /// outputs, biases and penalties (signed zeros, positive and negative logits, ids past the
    /// vocabulary); the bound holds; a request without any gets an empty list.
    #[test]
    fn device_adjust_packs_the_host_rules() {
        let mut rng = Rng::new(5);
        let (v, valid) = (300usize, 280usize);
        let plain = Sampler::new(SamplingParams { temperature: 1.0, ..Default::default() }, &[1, 2, 3]);
        assert!(plain.device_adjust(valid).is_empty() && plain.device_adjust_bound() == 0);
        for case in 0..400 {
            let pick = |rng: &mut Rng, n: usize| (rng.next_u64() % n as u64) as usize;
            let f = |rng: &mut Rng, lo: f32, hi: f32| lo + (hi - lo) * rng.next_f64() as f32;
            let on = |rng: &mut Rng| !rng.next_u64().is_multiple_of(3);
            let params = SamplingParams {
                repetition_penalty: if on(&mut rng) { f(&mut rng, 0.5, 2.0) } else { 1.0 },
                presence_penalty: if on(&mut rng) { f(&mut rng, -2.0, 2.0) } else { 0.0 },
                frequency_penalty: if on(&mut rng) { f(&mut rng, -2.0, 2.0) } else { 0.0 },
                ..Default::default()
            };
            let prompt: Vec<u32> = (0..pick(&mut rng, 60)).map(|_| pick(&mut rng, v + 20) as u32).collect();
            let bias: HashMap<u32, f32> = (0..pick(&mut rng, 8))
                .map(|_| (pick(&mut rng, v + 20) as u32, if rng.next_u64().is_multiple_of(4) { 0.0 } else { f(&mut rng, -100.0, 100.0) }))
                .collect();
            let mut s = Sampler::new(params, &prompt).with_bias(bias);
            for _ in 0..pick(&mut rng, 40) {
                s.observe(pick(&mut rng, v + 20) as u32);
            }
            let logits: Vec<f32> = (0..v)
                .map(|i| match i % 7 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => f(&mut rng, -20.0, 20.0),
                })
                .collect();
            let list = s.device_adjust(valid);
            assert!(list.len() <= s.device_adjust_bound(), "case {case}");
            assert!(list.windows(2).all(|w| w[0].token < w[1].token) && list.iter().all(|a| (a.token as usize) < valid));
            let mut dev = logits.clone();
            orchid_model::apply_logit_adjust(&mut dev, valid, &list);
            let host = s.adjusted_logits(&logits, valid);
            let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&dev[..valid]), bits(&host), "case {case}");
            // Greedy picks the same token from either.
            assert_eq!(argmax(&dev[..valid]), argmax(&host), "case {case}");
        }
    }
}
