//! Helpers for the byte-fixture tests of the netlink backends.

/// A fixture written as hex lines, as bytes.
pub fn hex(lines: &[&str]) -> Vec<u8> {
    data_encoding::HEXLOWER
        .decode(lines.concat().as_bytes())
        .expect("fixture hex")
}

/// Fails with a hex dump around the first differing byte, for a readable failure: `got` is
/// ours, `want` what `reference` (the tool the fixture was captured from) sent.
pub fn assert_bytes(name: &str, reference: &str, got: &[u8], want: &[u8]) {
    if got != want {
        let at = got
            .iter()
            .zip(want)
            .position(|(a, b)| a != b)
            .unwrap_or(got.len().min(want.len()));
        let around =
            |b: &[u8]| data_encoding::HEXLOWER.encode(&b[at.saturating_sub(16).min(b.len())..(at + 48).min(b.len())]);
        panic!(
            "{name}: differs from {reference}'s at byte {at} (ours {} bytes, {reference} {} bytes)\nours: {}\n{reference}:  {}",
            got.len(),
            want.len(),
            around(got),
            around(want),
        );
    }
}
