//! The date normaliser's reading of its outputs: the ISO 8601 calendar-date
//! pattern its decoding is constrained to, the final validity check across
//! the beam, and the day-first/month-first source prefix.

use candle::{bail, Result};

use crate::generation::Generated;
use crate::transformer::CharVocab;

/// `YYYY-MM-DD` for exactly the dates of the proleptic Gregorian calendar:
/// months 01–12, 31/30-day months told apart, February 28 days, and 29 in
/// leap years (divisible by 4; of the centuries, only those divisible by
/// 400). The leap years written out: `yy` in the last two digits is
/// `0[48]|[2468][048]|[13579][26]` (4, 8, 12, …, 96), or the year is a
/// century `CC00` with `CC` divisible by 4.
pub const ISO_DATE_PATTERN: &str = concat!(
    r"\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])",
    r"|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)",
    r"|02-(?:0[1-9]|1\d|2[0-8]))",
    r"|(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29",
);

/// Whether `year` has a February 29th (Gregorian rule).
pub fn is_leap_year(year: u32) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

/// Whether `text` is `YYYY-MM-DD` naming a day that exists: the check
/// applied to every hypothesis, independent of the automaton.
pub fn is_calendar_date(text: &str) -> bool {
    let b = text.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        b[r].iter().try_fold(0u32, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + u32::from(c - b'0'))
        })
    };
    let (Some(y), Some(m), Some(d)) = (num(0..4), num(5..7), num(8..10)) else {
        return false;
    };
    let days = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap_year(y) => 29,
        2 => 28,
        _ => return false,
    };
    (1..=days).contains(&d)
}

/// How to read an all-numeric date whose first two parts are both 12 or
/// less ("03/04/2021"): month first (dateutil's default, `dayfirst=False`)
/// or day first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DateOrder {
    /// "03/04/2021" is March 4th.
    #[default]
    MonthFirst,
    /// "03/04/2021" is April 3rd.
    DayFirst,
}

impl DateOrder {
    /// The source token that tells the model this reading.
    pub fn prefix_token(self) -> &'static str {
        match self {
            Self::MonthFirst => "<mdy>",
            Self::DayFirst => "<dmy>",
        }
    }
}

/// Source ids of `text` for the date model: the reading's prefix token
/// first when the vocabulary has one. A model trained without the prefixes
/// knows one fixed reading, so asking it for day-first is an error.
pub fn encode_source(vocab: &CharVocab, text: &str, order: DateOrder) -> Result<Vec<u32>> {
    let ids = vocab.encode(text)?;
    match vocab.src_special(order.prefix_token()) {
        Some(p) => Ok(std::iter::once(p).chain(ids).collect()),
        None if order == DateOrder::DayFirst => bail!(
            "this model has no {} source token: it was trained without a day-first reading",
            order.prefix_token()
        ),
        None => Ok(ids),
    }
}

/// The years the shipped date model was trained on (`scripts/train_dates.py`):
/// a two-digit year `yy` is `20yy` below 50, else `19yy`.
pub const YEARS: std::ops::RangeInclusive<u32> = 1950..=2049;

/// The year an input states, as its digits show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatedYear {
    /// Four digits (`2021`, or the first four of `20210303`).
    Full(u32),
    /// The last of three numbers of at most two digits (`3/4/21`).
    TwoDigit(u32),
    /// No year: one or two numbers (`March 3`, `3/4`).
    None,
}

impl StatedYear {
    /// Reads the year `text` states: a run of four digits, or the first
    /// four of a run of eight (`yyyymmdd`), is the year; else, with three
    /// or more runs of at most two digits, the last one is (numeric dates
    /// with a two-digit year are written day/month/year or month/day/year);
    /// else there is none.
    pub fn of(text: &str) -> Self {
        let runs: Vec<&str> = text
            .split(|c: char| !c.is_ascii_digit())
            .filter(|r| !r.is_empty())
            .collect();
        let number = |r: &str| r.parse::<u32>().unwrap_or(u32::MAX);
        if let Some(r) = runs.iter().find(|r| r.len() == 4 || r.len() == 8) {
            return Self::Full(number(&r[..4]));
        }
        match runs.as_slice() {
            [.., last] if runs.len() >= 3 && runs.iter().all(|r| r.len() <= 2) => {
                Self::TwoDigit(number(last))
            }
            _ => Self::None,
        }
    }

    /// Whether the `YYYY-MM-DD` `date` keeps this year (any year when none
    /// is stated).
    pub fn kept_by(self, date: &str) -> bool {
        let year = date.get(..4).and_then(|y| y.parse::<u32>().ok());
        match (self, year) {
            (Self::None, _) => true,
            (Self::Full(y), Some(out)) => out == y,
            (Self::TwoDigit(yy), Some(out)) => out % 100 == yy,
            (_, None) => false,
        }
    }
}

impl std::fmt::Display for StatedYear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Full(y) => write!(f, "{y}"),
            Self::TwoDigit(yy) => write!(f, "'{yy:02}"),
            Self::None => f.write_str("none"),
        }
    }
}

/// What the date model's hypotheses say.
#[derive(Debug, Clone, PartialEq)]
pub enum DateReading {
    /// The best hypothesis that is a real date, and its probability.
    Date {
        /// `YYYY-MM-DD`.
        text: String,
        /// `exp(score)`: the model's probability of this output.
        probability: f32,
    },
    /// No real date with probability at least the threshold.
    Unreadable {
        /// The best real date found, if any, and its probability.
        best: Option<(String, f32)>,
    },
}

/// Picks the best finished hypothesis (they come best first) that is a
/// real calendar date; unreadable when there is none or its probability is
/// below `min_probability`.
pub fn read_date(hypotheses: &[Generated], vocab: &CharVocab, min_probability: f32) -> DateReading {
    let best = hypotheses
        .iter()
        .filter(|h| h.finished)
        .map(|h| (vocab.decode(&h.tokens), h.score.exp()))
        .find(|(text, _)| is_calendar_date(text));
    match best {
        Some((text, probability)) if probability >= min_probability => {
            DateReading::Date { text, probability }
        }
        best => DateReading::Unreadable { best },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_dates() {
        for ok in [
            "2021-03-03",
            "2000-02-29",
            "2024-02-29",
            "1950-12-31",
            "2049-04-30",
            "0000-02-29",
        ] {
            assert!(is_calendar_date(ok), "{ok}");
        }
        // 1900 and 2100 are centuries not divisible by 400; month 19; day 31
        // of a 30-day month; day 0; wrong shape.
        for bad in [
            "1900-02-29",
            "2100-02-29",
            "2021-02-29",
            "2021-19-03",
            "2021-04-31",
            "2021-01-00",
            "2021-00-10",
            "21-03-03",
            "2021-3-03",
            "2021-03-3x",
            "2021/03/03",
            "",
        ] {
            assert!(!is_calendar_date(bad), "{bad}");
        }
    }

    #[test]
    fn stated_years() {
        use StatedYear::*;
        for (text, year) in [
            ("March 3, 2021", Full(2021)),
            ("July 4th, 1776", Full(1776)),
            ("le 14 juillet 1789", Full(1789)),
            ("20210303", Full(2021)),
            ("2021年3月3日", Full(2021)),
            ("Tue, 3/4/2021", Full(2021)),
            ("03/04/21", TwoDigit(21)),
            ("5.21.99", TwoDigit(99)),
            ("March 3", None),
            ("March 13", None),
            ("3/4", None),
            ("the third of May", None),
        ] {
            assert_eq!(StatedYear::of(text), year, "{text}");
        }
        assert!(Full(2021).kept_by("2021-03-03") && !Full(1776).kept_by("1976-07-04"));
        assert!(TwoDigit(21).kept_by("2021-03-04") && !TwoDigit(21).kept_by("2012-03-04"));
        assert!(None.kept_by("2033-03-03"));
    }

    #[test]
    fn leap_years() {
        // 1996, 2000, 2004 leap; 1900, 1999, 2100 not.
        assert!(is_leap_year(1996) && is_leap_year(2000) && is_leap_year(2004));
        assert!(!is_leap_year(1900) && !is_leap_year(1999) && !is_leap_year(2100));
    }
}
