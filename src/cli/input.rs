//! Inputs read from standard input, one per line, as untrusted text, and
//! how messages quote them.

use std::io::BufRead;

/// Longest line read from standard input, in bytes: a longer one is
/// reported (by its length) without being held, whatever its size.
pub const MAX_LINE_BYTES: usize = 4096;

/// The start of `text`, for messages about a long input.
pub fn preview(text: &str) -> String {
    const MAX: usize = 48;
    if text.chars().count() <= MAX {
        text.to_string()
    } else {
        text.chars().take(MAX).chain(['…']).collect()
    }
}

/// Standard input's lines, each as `(text, None)` or, for a line that
/// cannot be an input, `(preview, Some(why))`: a line over
/// [`MAX_LINE_BYTES`] (skipped without being held) or not UTF-8. One bad
/// line does not stop the others.
pub fn read_lines(mut r: impl BufRead) -> std::io::Result<Vec<(String, Option<String>)>> {
    let mut out = Vec::new();
    loop {
        // One line, keeping at most MAX_LINE_BYTES + 1 of its bytes.
        let (mut line, mut len, mut ended) = (Vec::new(), 0usize, false);
        loop {
            let buf = r.fill_buf()?;
            if buf.is_empty() {
                break;
            }
            let (part, used) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (&buf[..i], i + 1),
                None => (buf, buf.len()),
            };
            len += part.len();
            let room = (MAX_LINE_BYTES + 1).saturating_sub(line.len());
            line.extend_from_slice(&part[..part.len().min(room)]);
            ended = used > part.len();
            r.consume(used);
            if ended {
                break;
            }
        }
        if !ended && len == 0 {
            return Ok(out);
        }
        if line.last() == Some(&b'\r') && len <= MAX_LINE_BYTES {
            line.pop();
            len -= 1;
        }
        let preview = String::from_utf8_lossy(&line[..line.len().min(64)]).into_owned();
        out.push(if len > MAX_LINE_BYTES {
            (
                preview,
                Some(format!(
                    "the line is {len} bytes long, over the limit of {MAX_LINE_BYTES}"
                )),
            )
        } else {
            match String::from_utf8(line) {
                Ok(text) => (text, None),
                Err(e) => (
                    preview,
                    Some(format!(
                        "not UTF-8 text (invalid byte at offset {})",
                        e.utf8_error().valid_up_to()
                    )),
                ),
            }
        });
        if !ended {
            return Ok(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_bounded_and_checked_one_by_one() -> std::io::Result<()> {
        let mut input = b"March 3, 2021\r\n\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 10));
        input.extend_from_slice(b"\n\xc3(\nlast, no newline");
        // A one-byte buffer: every line crosses buffer boundaries.
        let lines = read_lines(std::io::BufReader::with_capacity(1, input.as_slice()))?;
        let why: Vec<Option<&str>> = lines.iter().map(|(_, w)| w.as_deref()).collect();
        assert_eq!(lines[0], ("March 3, 2021".to_string(), None));
        assert_eq!(lines[1], (String::new(), None));
        assert_eq!(
            why[2],
            Some(
                format!(
                    "the line is {} bytes long, over the limit of {MAX_LINE_BYTES}",
                    MAX_LINE_BYTES + 10
                )
                .as_str()
            )
        );
        assert_eq!(lines[2].0.len(), 64);
        assert_eq!(why[3], Some("not UTF-8 text (invalid byte at offset 0)"));
        assert_eq!(lines[4], ("last, no newline".to_string(), None));
        assert_eq!(lines.len(), 5);
        assert!(read_lines(&b""[..])?.is_empty());
        Ok(())
    }
}
