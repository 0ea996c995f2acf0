//! The OpenAI wire format: request parsing and validation ([`validate`]) and the JSON the
//! server answers with ([`types`]).

pub mod types;
pub mod validate;

use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh response or tool-call id: `prefix` + 24 random hex digits.
pub fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed).rotate_left(17);
    let mut out = String::with_capacity(prefix.len() + 24);
    out.push_str(prefix);
    for _ in 0..2 {
        // SplitMix64 finaliser: a cheap, well-mixed 64-bit value per call.
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.push_str(&format!("{:012x}", z >> 16));
    }
    out
}

/// Seconds since the Unix epoch (the `created` field).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_unique_and_shaped() {
        let a = super::new_id("call_");
        let b = super::new_id("call_");
        assert_ne!(a, b);
        assert_eq!(a.len(), 5 + 24);
        assert!(a[5..].chars().all(|c| c.is_ascii_hexdigit()));
    }
}
