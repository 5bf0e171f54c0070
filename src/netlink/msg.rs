//! Netlink messages being built: headers, attributes and nests appended to one buffer, lengths
//! filled in when a message or nest is closed.

use super::{NLA_F_NESTED, align};

/// A growing buffer of netlink messages (one request, or a whole batch).
#[derive(Debug, Default)]
pub struct MsgBuf {
    pub buf: Vec<u8>,
}

impl MsgBuf {
    pub fn with_capacity(n: usize) -> MsgBuf {
        MsgBuf {
            buf: Vec::with_capacity(n),
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Starts a message: `nlmsghdr` (length filled in by [`MsgBuf::end_msg`]; port id 0, which
    /// the kernel fills in itself), then the family's fixed header (`genlmsghdr`, `nfgenmsg`,
    /// ...). Returns the message's offset.
    pub fn begin_msg(&mut self, msg_type: u16, flags: u16, seq: u32, family_header: &[u8]) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&msg_type.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(family_header);
        start
    }

    /// Fills in the length of the message started at `start`.
    pub fn end_msg(&mut self, start: usize) {
        // A netlink message longer than 4 GiB cannot be sent anyway; the kernel rejects the
        // truncated length.
        let len = u32::try_from(self.buf.len() - start).unwrap_or(u32::MAX);
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    /// ORs `flags` into the header flags of the message at `start`.
    pub fn add_msg_flags(&mut self, start: usize, flags: u16) {
        let at = start + 6;
        let old = u16::from_ne_bytes([self.buf[at], self.buf[at + 1]]);
        self.buf[at..at + 2].copy_from_slice(&(old | flags).to_ne_bytes());
    }

    /// Appends one attribute (header, data, padding).
    pub fn put(&mut self, ty: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf
            .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(self.buf.len() + align(len) - len, 0);
    }

    pub fn put_u8(&mut self, ty: u16, v: u8) {
        self.put(ty, &[v]);
    }

    /// A host-order u16 (the kernel's `nla_put_u16`).
    pub fn put_u16(&mut self, ty: u16, v: u16) {
        self.put(ty, &v.to_ne_bytes());
    }

    /// A host-order u32 (`nla_put_u32`).
    pub fn put_u32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_ne_bytes());
    }

    /// A network-order u32 (`nla_put_be32`).
    pub fn put_be32(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_be_bytes());
    }

    /// A network-order u64 (`nla_put_be64`).
    pub fn put_be64(&mut self, ty: u16, v: u64) {
        self.put(ty, &v.to_be_bytes());
    }

    /// A NUL-terminated string.
    pub fn put_str(&mut self, ty: u16, s: &str) {
        let len = 4 + s.len() + 1;
        self.buf
            .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.buf.resize(self.buf.len() + align(len) - len, 0);
    }

    /// Starts a nested attribute, flagged `NLA_F_NESTED` as libnl and libmnl flag the nests
    /// they send; returns its offset.
    pub fn nest_start(&mut self, ty: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        start
    }

    /// Closes the nest started at `start`. Callers keep nests under 64 KiB (nftables splits
    /// element lists into several messages for that); an oversized nest gets a length the
    /// kernel rejects rather than a wrapped one.
    pub fn nest_end(&mut self, start: usize) {
        let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_nests_closed() {
        let mut b = MsgBuf::default();
        let m = b.begin_msg(0x20, 0x1, 7, &[1, 2, 3, 4]);
        b.put_str(1, "ab");
        let n = b.nest_start(2);
        b.put_u16(3, 0x0102);
        b.put_be32(4, 0x0102_0304);
        b.nest_end(n);
        b.put_u8(5, 9);
        b.end_msg(m);
        b.add_msg_flags(m, 0x4);
        let expected: Vec<u8> = [
            &[56u8, 0, 0, 0, 0x20, 0, 5, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4][..],
            &[7, 0, 1, 0, b'a', b'b', 0, 0],
            &[20, 0, 2, 0x80, 6, 0, 3, 0],
            &0x0102u16.to_ne_bytes(),
            &[0, 0, 8, 0, 4, 0, 1, 2, 3, 4],
            &[5, 0, 5, 0, 9, 0, 0, 0],
        ]
        .concat();
        assert_eq!(b.buf, expected);
    }
}
