//! Exact decimal numbers as SQL writes them (`42`, `-2.50`, `.5`, `1e-3`), so that a literal can
//! be compared with integer, decimal and timestamp columns without rounding.

/// A number `±digits × 10^exp`, with neither leading nor trailing zeros in `digits` (empty for 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Exact {
    negative: bool,
    digits: String,
    exp: i64,
}

/// Beyond any integer column (the widest, u64 and i64, stay below 2^64 ≈ 1.8e19), and far from
/// i128's limits so that `floor + 1` cannot overflow.
const CLAMP: i128 = 10i128.pow(30);

/// Exponents beyond this are refused rather than expanded into digits.
const MAX_EXPONENT: i64 = 100_000;

/// Where a number lies among the integers: `floor` itself when `exact`, strictly between
/// `floor` and `floor + 1` otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bound {
    pub(super) floor: i128,
    pub(super) exact: bool,
}

impl Exact {
    /// Reads `[+-]digits[.digits][e[+-]digits]` (at least one digit in the mantissa).
    pub(super) fn parse(text: &str) -> Option<Self> {
        let (negative, rest) = match text.as_bytes().first()? {
            b'-' => (true, &text[1..]),
            b'+' => (false, &text[1..]),
            _ => (false, text),
        };
        let (mantissa, exponent) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if int.len() + frac.len() == 0 || !all_digits(int) || !all_digits(frac) {
            return None;
        }
        let mut exp = match exponent {
            None => 0,
            Some(e) => {
                let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
                if digits.is_empty() || digits.len() > 12 || !all_digits(digits) {
                    return None;
                }
                let value: i64 = e.parse().ok()?;
                if value.abs() > MAX_EXPONENT {
                    return None;
                }
                value
            }
        };
        let joined = format!("{int}{frac}");
        exp -= i64::try_from(frac.len()).ok()?;
        let trimmed = joined.trim_start_matches('0');
        let digits = trimmed.trim_end_matches('0');
        exp += i64::try_from(trimmed.len() - digits.len()).ok()?;
        if digits.is_empty() {
            return Some(Self {
                negative: false,
                digits: String::new(),
                exp: 0,
            });
        }
        Some(Self {
            negative,
            digits: digits.to_owned(),
            exp,
        })
    }

    /// Where the number lies among the integers; magnitudes beyond `CLAMP` are clamped to it,
    /// which keeps them beyond every integer column.
    pub(super) fn bound(&self) -> Bound {
        if self.digits.is_empty() {
            return Bound {
                floor: 0,
                exact: true,
            };
        }
        let len = i64::try_from(self.digits.len()).unwrap_or(i64::MAX);
        let int_len = len.saturating_add(self.exp);
        if int_len > 30 {
            let floor = if self.negative { -CLAMP - 1 } else { CLAMP };
            return Bound {
                floor,
                exact: false,
            };
        }
        // The integer part has at most 30 digits here, so it fits an i128.
        let magnitude = |s: &str| s.parse::<i128>().unwrap_or(0);
        if self.exp >= 0 {
            let zeros = "0".repeat(usize::try_from(self.exp).unwrap_or(0));
            let m = magnitude(&format!("{}{zeros}", self.digits));
            return Bound {
                floor: if self.negative { -m } else { m },
                exact: true,
            };
        }
        let int = usize::try_from(int_len).map_or("", |n| &self.digits[..n]);
        let m = magnitude(int);
        // The fractional part is not zero: trailing zeros were removed.
        let floor = if self.negative { -m - 1 } else { m };
        Bound {
            floor,
            exact: false,
        }
    }

    /// The number times `10^scale`: a literal as a `Decimal(_, scale)` column's raw integers
    /// see it, to compare exactly as with integer columns.
    pub(super) fn shifted(&self, scale: i8) -> Self {
        let mut shifted = self.clone();
        if !shifted.digits.is_empty() {
            shifted.exp = shifted.exp.saturating_add(i64::from(scale));
        }
        shifted
    }

    /// The number times `10^scale` as integer digits, if that is an integer of at most
    /// `precision` digits: the raw value of a `Decimal(precision, scale)`.
    pub(super) fn scaled(&self, precision: u8, scale: i8) -> Option<String> {
        if self.digits.is_empty() {
            return Some("0".to_owned());
        }
        let exp = self.exp.checked_add(i64::from(scale))?;
        let zeros = usize::try_from(exp).ok()?;
        if self.digits.len().checked_add(zeros)? > usize::from(precision) {
            return None;
        }
        let sign = if self.negative { "-" } else { "" };
        Some(format!("{sign}{}{}", self.digits, "0".repeat(zeros)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(text: &str) -> (i128, bool) {
        let b = Exact::parse(text).expect("a number").bound();
        (b.floor, b.exact)
    }

    #[test]
    fn parses_and_bounds() {
        assert_eq!(bound("42"), (42, true));
        assert_eq!(bound("-42"), (-42, true));
        assert_eq!(bound("2.5"), (2, false));
        assert_eq!(bound("-2.5"), (-3, false));
        assert_eq!(bound("2.000"), (2, true));
        assert_eq!(bound("0.001"), (0, false));
        assert_eq!(bound("-0.001"), (-1, false));
        assert_eq!(bound("1e3"), (1000, true));
        assert_eq!(bound("15e-1"), (1, false));
        assert_eq!(bound(".5"), (0, false));
        assert_eq!(bound("-0"), (0, true));
        assert_eq!(
            bound("18446744073709551615"),
            (18_446_744_073_709_551_615, true)
        );
        assert_eq!(bound("1e40"), (CLAMP, false));
        assert_eq!(bound("-1e40"), (-CLAMP - 1, false));
        assert_eq!(bound("1e-400"), (0, false));
        for bad in [
            "",
            "-",
            ".",
            "e5",
            "1e",
            "1e+",
            "1.2.3",
            "0x10",
            "1e99999999999999",
            "inf",
            "NaN",
            "1_0",
        ] {
            assert_eq!(Exact::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn scales_exactly_or_not_at_all() {
        let scaled = |t: &str, p, s| Exact::parse(t).expect("a number").scaled(p, s);
        assert_eq!(scaled("1.23", 5, 2).as_deref(), Some("123"));
        assert_eq!(scaled("-1.2", 5, 2).as_deref(), Some("-120"));
        assert_eq!(scaled("1.234", 5, 2), None);
        assert_eq!(scaled("1234", 5, 2), None);
        assert_eq!(scaled("999.99", 5, 2).as_deref(), Some("99999"));
        assert_eq!(scaled("1200", 3, -2).as_deref(), Some("12"));
        assert_eq!(scaled("1250", 3, -2), None);
        assert_eq!(scaled("0.000", 1, 0).as_deref(), Some("0"));
    }
}
