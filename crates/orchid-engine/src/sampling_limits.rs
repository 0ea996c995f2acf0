//! The accepted range of each sampling parameter: one definition for the HTTP API's validation
//! and the command line's flags, so both accept the same values and say the same thing.

/// A closed range [lo, hi], or (lo, hi] when `lo_open`.
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    pub name: &'static str,
    pub lo: f64,
    pub hi: f64,
    pub lo_open: bool,
}

pub const TEMPERATURE: Limit = Limit { name: "temperature", lo: 0.0, hi: 2.0, lo_open: false };
pub const TOP_P: Limit = Limit { name: "top_p", lo: 0.0, hi: 1.0, lo_open: true };
pub const MIN_P: Limit = Limit { name: "min_p", lo: 0.0, hi: 1.0, lo_open: false };
pub const PRESENCE_PENALTY: Limit = Limit { name: "presence_penalty", lo: -2.0, hi: 2.0, lo_open: false };
pub const FREQUENCY_PENALTY: Limit = Limit { name: "frequency_penalty", lo: -2.0, hi: 2.0, lo_open: false };
/// The smallest repetition penalty is well above f32's subnormals, so that a value that passes
/// stays the value that was asked for once it is an f32.
pub const REPETITION_PENALTY: Limit = Limit { name: "repetition_penalty", lo: 0.0, hi: 10.0, lo_open: true };

impl Limit {
    /// The value as an f32, or the message that names the parameter and its range. A value
    /// that is inside the range but becomes 0 or non-finite as an f32 is refused too.
    pub fn check(&self, x: f64) -> Result<f32, String> {
        let inside = x <= self.hi && if self.lo_open { x > self.lo } else { x >= self.lo };
        let f = x as f32;
        if inside && f.is_finite() && !(self.lo_open && f <= self.lo as f32) {
            return Ok(f);
        }
        let range = if self.lo_open {
            format!("greater than {} and at most {}", self.lo, self.hi)
        } else {
            format!("between {} and {}", self.lo, self.hi)
        };
        Err(format!("`{}` must be {range}, got {}", self.name, readable(x)))
    }
}

/// `x` as people write it: 1e-46 rather than 0.000…0001.
fn readable(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e16).contains(&x.abs()) { format!("{x:e}") } else { format!("{x}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_messages() {
        assert_eq!(TEMPERATURE.check(0.0), Ok(0.0));
        assert_eq!(TEMPERATURE.check(2.0), Ok(2.0));
        assert_eq!(TEMPERATURE.check(-1.0).unwrap_err(), "`temperature` must be between 0 and 2, got -1");
        assert!(TEMPERATURE.check(f64::NAN).is_err());
        assert!(TOP_P.check(0.0).is_err());
        assert_eq!(TOP_P.check(1.0), Ok(1.0));
        // Inside (0, 10] as an f64, but 0 as an f32.
        assert_eq!(REPETITION_PENALTY.check(1e-46).unwrap_err(), "`repetition_penalty` must be greater than 0 and at most 10, got 1e-46");
        assert!(PRESENCE_PENALTY.check(2.5).is_err());
    }
}
