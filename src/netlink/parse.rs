//! Netlink replies read back (pure): a datagram split into its messages, the attributes of a
//! message, and the kernel's `NLMSG_ERROR`. Nothing here trusts a length: what does not fit is
//! a [`DecodeError`], never a panic.

use super::{DecodeError, NLA_TYPE_MASK, NLM_F_ACK_TLVS, NLM_F_CAPPED, NLMSG_HDRLEN, NLMSGERR_ATTR_MSG, align};

pub fn read_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

pub fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

pub fn read_i32(b: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

/// One netlink message of a datagram, header decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawMsg<'a> {
    pub msg_type: u16,
    pub flags: u16,
    pub seq: u32,
    /// Everything after `nlmsghdr`.
    pub payload: &'a [u8],
    /// The whole message, `nlmsghdr` included.
    pub bytes: &'a [u8],
}

/// The messages of a datagram, in order. A message whose length runs past the datagram (or is
/// shorter than a header) is an error that ends the run: the rest cannot be framed.
pub fn messages(data: &[u8]) -> impl Iterator<Item = Result<RawMsg<'_>, DecodeError>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= data.len() {
            return None;
        }
        let framed = frame(data, at);
        at = match &framed {
            Ok(m) => at.saturating_add(align(m.bytes.len())),
            Err(_) => data.len(),
        };
        Some(framed)
    })
}

/// [`messages`], all of them or the error.
pub fn split_messages(data: &[u8]) -> Result<Vec<RawMsg<'_>>, DecodeError> {
    messages(data).collect()
}

fn frame(data: &[u8], at: usize) -> Result<RawMsg<'_>, DecodeError> {
    let header = DecodeError::Truncated("netlink message header");
    let len = read_u32(data, at).ok_or(header.clone())? as usize;
    let msg = data
        .get(at..at.saturating_add(len))
        .filter(|_| len >= NLMSG_HDRLEN)
        .ok_or(DecodeError::Truncated("netlink message"))?;
    Ok(RawMsg {
        msg_type: read_u16(msg, 4).ok_or(header.clone())?,
        flags: read_u16(msg, 6).ok_or(header.clone())?,
        seq: read_u32(msg, 8).ok_or(header)?,
        payload: &msg[NLMSG_HDRLEN..],
        bytes: msg,
    })
}

/// A run of attributes, in order, the `NLA_F_NESTED` / byte-order flags masked off their types.
/// One whose length does not fit is an error that ends the run.
fn attributes(mut b: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), DecodeError>> {
    std::iter::from_fn(move || {
        if b.is_empty() {
            return None;
        }
        let header = DecodeError::Truncated("attribute header");
        let attr = match (read_u16(b, 0), read_u16(b, 2)) {
            (Some(len), Some(ty)) if (4..=b.len()).contains(&usize::from(len)) => {
                Ok((ty & NLA_TYPE_MASK, &b[4..usize::from(len)]))
            }
            (Some(_), Some(_)) => Err(DecodeError::Truncated("attribute")),
            _ => Err(header),
        };
        b = match &attr {
            Ok((_, value)) => b.get(align(4 + value.len())..).unwrap_or_default(),
            Err(_) => &[],
        };
        Some(attr)
    })
}

/// The attributes of one level, in the order they came. Lookups take the last of a type, as
/// the kernel's own parser does.
#[derive(Clone, Debug, Default)]
pub struct Attrs<'a> {
    list: Vec<(u16, &'a [u8])>,
}

impl<'a> Attrs<'a> {
    /// Reads a run of attributes; the `NLA_F_NESTED` / byte-order flags are masked off the
    /// types (the kernel sets no flag on the nests it sends, libnl sets `NLA_F_NESTED`).
    pub fn parse(b: &'a [u8]) -> Result<Attrs<'a>, DecodeError> {
        Ok(Attrs {
            list: attributes(b).collect::<Result<_, _>>()?,
        })
    }

    pub fn get(&self, ty: u16) -> Option<&'a [u8]> {
        self.list.iter().rev().find(|(t, _)| *t == ty).map(|(_, v)| *v)
    }

    /// The attribute's value, which must be exactly `N` bytes.
    fn fixed<const N: usize>(&self, ty: u16, name: &'static str) -> Result<Option<[u8; N]>, DecodeError> {
        match self.get(ty) {
            None => Ok(None),
            Some(v) => v.try_into().map(Some).map_err(|_| DecodeError::Length {
                attr: name,
                len: v.len(),
            }),
        }
    }

    pub fn u16(&self, ty: u16, name: &'static str) -> Result<Option<u16>, DecodeError> {
        Ok(self.fixed::<2>(ty, name)?.map(u16::from_ne_bytes))
    }

    pub fn be16(&self, ty: u16, name: &'static str) -> Result<Option<u16>, DecodeError> {
        Ok(self.fixed::<2>(ty, name)?.map(u16::from_be_bytes))
    }

    pub fn u32(&self, ty: u16, name: &'static str) -> Result<Option<u32>, DecodeError> {
        Ok(self.fixed::<4>(ty, name)?.map(u32::from_ne_bytes))
    }

    pub fn raw4(&self, ty: u16, name: &'static str) -> Result<Option<[u8; 4]>, DecodeError> {
        self.fixed::<4>(ty, name)
    }

    pub fn u64(&self, ty: u16, name: &'static str) -> Result<Option<u64>, DecodeError> {
        Ok(self.fixed::<8>(ty, name)?.map(u64::from_ne_bytes))
    }

    /// A NUL-terminated (or unterminated) UTF-8 string.
    pub fn str(&self, ty: u16, name: &'static str) -> Result<Option<&'a str>, DecodeError> {
        let Some(v) = self.get(ty) else {
            return Ok(None);
        };
        std::str::from_utf8(until_nul(v))
            .map(Some)
            .map_err(|_| DecodeError::NotUtf8(name))
    }

    pub fn nested(&self, ty: u16) -> Result<Option<Attrs<'a>>, DecodeError> {
        self.get(ty).map(Attrs::parse).transpose()
    }

    /// Like the typed getters, for an attribute that must be there.
    pub fn need<T>(got: Result<Option<T>, DecodeError>, name: &'static str) -> Result<T, DecodeError> {
        got?.ok_or(DecodeError::Missing(name))
    }
}

/// Every attribute of a run in order, duplicates kept (a nest of list elements), or `None`
/// when one does not fit.
pub fn attributes_of(b: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    attributes(b).collect::<Result<_, _>>().ok()
}

fn until_nul(v: &[u8]) -> &[u8] {
    v.split(|&c| c == 0).next().unwrap_or_default()
}

/// What an `NLMSG_ERROR` says: `errno` (negative) is the kernel's refusal of the request whose
/// sequence number is `seq`; 0 acknowledges it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorReply {
    pub seq: u32,
    pub errno: i32,
    /// The kernel's extended-ack text, if it gave one.
    pub message: Option<String>,
}

/// `struct nlmsgerr` (the errno, the request's header, its payload unless `NLM_F_CAPPED`), then
/// the extack attributes if `NLM_F_ACK_TLVS`. The text is a courtesy: it is read up to an
/// attribute that does not fit, lossily, and never hides the errno.
pub fn parse_error(m: &RawMsg<'_>) -> Result<ErrorReply, DecodeError> {
    let p = m.payload;
    let truncated = DecodeError::Truncated("netlink error");
    let errno = read_i32(p, 0).ok_or(truncated.clone())?;
    let inner_len = read_u32(p, 4).ok_or(truncated.clone())? as usize;
    let seq = read_u32(p, 4 + 8).ok_or(truncated)?;
    let echoed = if m.flags & NLM_F_CAPPED != 0 {
        NLMSG_HDRLEN
    } else {
        align(inner_len)
    };
    let mut message = None;
    if m.flags & NLM_F_ACK_TLVS != 0
        && let Some(tlvs) = p.get(4 + echoed..)
    {
        for (ty, value) in attributes(tlvs).map_while(Result::ok) {
            if ty == NLMSGERR_ATTR_MSG {
                message = Some(String::from_utf8_lossy(until_nul(value)).into_owned());
            }
        }
    }
    Ok(ErrorReply { seq, errno, message })
}

#[cfg(test)]
mod tests {
    use super::super::{MsgBuf, NLMSG_ERROR};
    use super::*;

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        // An attribute claiming more bytes than there are.
        assert!(Attrs::parse(&[8, 0, 1, 0, 1, 0]).is_err());
        // A length below the header size.
        assert!(Attrs::parse(&[2, 0, 1, 0]).is_err());
        // A message claiming more than the datagram holds, and one shorter than its header.
        assert!(split_messages(&[64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(split_messages(&[4, 0, 0, 0]).is_err());
        // A wrong-sized integer.
        let a = Attrs::parse(&[6, 0, 1, 0, 1, 2, 0, 0]).expect("parses");
        assert!(matches!(a.u32(1, "x"), Err(DecodeError::Length { attr: "x", len: 2 })));
    }

    #[test]
    fn messages_then_the_error_that_ends_them() {
        let mut b = MsgBuf::default();
        for seq in [1, 2] {
            let m = b.begin_msg(0x10, 0, seq, &[]);
            b.put_u8(1, 0);
            b.end_msg(m);
        }
        b.buf.extend_from_slice(&[0xff, 0, 0]);
        let got: Vec<_> = messages(&b.buf).collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[1].as_ref().map(|m| (m.seq, m.bytes.len())), Ok((2, 24)));
        assert_eq!(got[2], Err(DecodeError::Truncated("netlink message header")));
        let attrs = Attrs::parse(got[0].as_ref().expect("framed").payload).expect("attrs");
        assert_eq!(attrs.get(1), Some(&[0u8][..]));
    }

    #[test]
    fn error_with_capped_echo_and_extack() {
        let mut b = MsgBuf::default();
        let m = b.begin_msg(NLMSG_ERROR, NLM_F_CAPPED | NLM_F_ACK_TLVS, 42, &(-2i32).to_ne_bytes());
        // The echoed header: length 64 (not echoed further), seq 42.
        let echo = b.begin_msg(0x0a06, 0, 42, &[]);
        b.end_msg(echo);
        b.buf[echo..echo + 4].copy_from_slice(&64u32.to_ne_bytes());
        b.put_str(NLMSGERR_ATTR_MSG, "no chain");
        b.put_u32(2, 36);
        b.end_msg(m);
        let msgs = split_messages(&b.buf).expect("framed");
        assert_eq!(
            parse_error(&msgs[0]),
            Ok(ErrorReply {
                seq: 42,
                errno: -2,
                message: Some("no chain".into())
            })
        );
        assert!(
            parse_error(&RawMsg {
                payload: &b.buf[16..30],
                ..msgs[0]
            })
            .is_err()
        );
    }
}
