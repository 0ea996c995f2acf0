//! `strftime_now(format)` for chat templates: C/Python `strftime` of the current time in UTC
//! (transformers uses local time: the same on a machine set to UTC). The common directives and glibc's
//! `%-x` (no padding) are supported; unknown directives are copied as they are.

use std::fmt::Write as _;

/// Seconds since the Unix epoch, now.
pub(super) fn now_unix() -> i64 {
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs() as i64),
    }
}

/// Civil date (year, month 1..12, day 1..31) of a day count since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the 400-year era
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year, from March 1
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

const MONTHS: [&str; 12] =
    ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// C `strftime` of a UTC timestamp: the common directives and glibc's `%-x` (no padding).
/// Unknown directives are copied as they are.
pub(super) fn strftime(fmt: &str, unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let wday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day as i64 + i64::from(leap && month > 2);
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };
    let mname = MONTHS[(month - 1) as usize];
    let wname = WEEKDAYS[wday];

    let mut out = String::new();
    let mut it = fmt.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = it.peek() == Some(&'-');
        if no_pad {
            it.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            let _ = if no_pad { write!(out, "{v}") } else { write!(out, "{v:0width$}") };
        };
        match it.next() {
            Some('Y') => num(&mut out, year, 1),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month.into(), 2),
            Some('d') => num(&mut out, day.into(), 2),
            Some('e') => {
                let _ = write!(out, "{day:>2}");
            }
            Some('H') => num(&mut out, h, 2),
            Some('I') => num(&mut out, h12, 2),
            Some('M') => num(&mut out, m, 2),
            Some('S') => num(&mut out, s, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(mname),
            Some('b') | Some('h') => out.push_str(&mname[..3]),
            Some('A') => out.push_str(wname),
            Some('a') => out.push_str(&wname[..3]),
            Some('u') => num(&mut out, if wday == 0 { 7 } else { wday as i64 }, 1),
            Some('w') => num(&mut out, wday as i64, 1),
            Some('F') => {
                let _ = write!(out, "{year:04}-{month:02}-{day:02}");
            }
            Some('T') => {
                let _ = write!(out, "{h:02}:{m:02}:{s:02}");
            }
            Some('R') => {
                let _ = write!(out, "{h:02}:{m:02}");
            }
            Some('D') => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            Some('c') => {
                let _ = write!(out, "{} {} {day:>2} {h:02}:{m:02}:{s:02} {year}", &wname[..3], &mname[..3]);
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2026-11-29 09:30:47 UTC, a Sunday.
        let t = 1_795_944_647;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2026-11-29 09:30:47");
        assert_eq!(strftime("%d %b %Y, %A %B %-d %j %I%p %%", t), "29 Nov 2026, Sunday November 29 333 09AM %");
        assert_eq!(strftime("%F %T", 0), "1970-01-01 00:00:00");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
    }
}
