//! Times as Kubernetes writes them: RFC 3339 in UTC, and Go's RFC3339Nano
//! (what kube-proxy's health JSON carries). Pure code.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
}

/// The civil date of a day since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// `2006-01-02T15:04:05.999999999Z`: Go's RFC3339Nano in UTC, as kube-proxy
/// marshals times (trailing zeros of the fraction dropped).
pub fn rfc3339_nano(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    let mut text = format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    let nanos = since.subsec_nanos();
    if nanos > 0 {
        text.push_str(format!(".{nanos:09}").trim_end_matches('0'));
    }
    text.push('Z');
    text
}

/// Parses RFC 3339 (`2025-06-01T10:00:00Z`, with an optional fraction and
/// offset), as the EndpointSlice controller writes times; `None` for
/// anything else, or a time before 1970 or after 9999.
pub fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let (date, time) = text.split_once(['T', 't'])?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (clock, offset_secs) = if let Some(clock) = time.strip_suffix(['Z', 'z']) {
        (clock, 0)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (clock, offset) = time.split_at(at);
        let sign = if offset.starts_with('-') { -1 } else { 1 };
        let (h, m) = offset[1..].split_once(':')?;
        let (h, m) = (h.parse::<i64>().ok()?, m.parse::<i64>().ok()?);
        if h > 23 || m > 59 {
            return None;
        }
        (clock, sign * (h * 3600 + m * 60))
    };
    let (hms, fraction) = clock.split_once('.').unwrap_or((clock, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (t.next()??, t.next()??, t.next()??);
    let in_range = (1970..=9999).contains(&year)
        && (1..=12).contains(&month)
        && (1..=31).contains(&day)
        && (0..24).contains(&hour)
        && (0..60).contains(&minute)
        && (0..=60).contains(&second);
    if !in_range || fraction.len() > 9 || !fraction.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let nanos: u32 =
        if fraction.is_empty() { 0 } else { format!("{fraction:0<9}").parse().ok()? };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second
        - offset_secs;
    Some(UNIX_EPOCH + Duration::new(u64::try_from(secs).ok()?, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn times_format_as_go_rfc3339_nano() {
        assert_eq!(rfc3339_nano(at(0, 0)), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_nano(at(1_748_772_000, 123_456_789)), "2025-06-01T10:00:00.123456789Z");
        assert_eq!(rfc3339_nano(at(951_782_400, 500_000_000)), "2000-02-29T00:00:00.5Z");
    }

    #[test]
    fn times_parse_and_round_trip() {
        for t in [at(0, 0), at(1_748_772_000, 123_456_789), at(951_782_400, 500_000_000)] {
            assert_eq!(parse_rfc3339(&rfc3339_nano(t)), Some(t));
        }
        assert_eq!(
            parse_rfc3339("2025-06-01T12:00:01.5+02:00"),
            Some(at(1_748_772_001, 500_000_000))
        );
        for bad in [
            "2025-13-45T99:99:99Z",
            "99999999999-01-01T00:00:00Z",
            "1969-12-31T23:59:59Z",
            "2025-06-01",
            "2025-06-01T10:00:00.1234567891Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }
}
