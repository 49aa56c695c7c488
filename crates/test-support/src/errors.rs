//! Refusals as the library gives them: an error, never a panic, whose
//! message names what is wrong.

/// Asserts `msg` mentions every one of `needles`.
#[track_caller]
pub fn assert_mentions(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

/// Asserts `res` is an error whose message mentions every one of
/// `needles`. Only the first line is read: candle appends a backtrace when
/// `RUST_BACKTRACE` is set.
#[track_caller]
pub fn assert_err<T>(res: candle::Result<T>, needles: &[&str]) {
    let msg = match res {
        Ok(_) => panic!("expected an error mentioning {needles:?}"),
        Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
    };
    assert_mentions(&msg, needles);
}
