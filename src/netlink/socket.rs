//! Datagrams on a netlink socket: one `send` per request or batch, one `recv` per reply
//! datagram, a call interrupted by a signal repeated (it transferred nothing).

use std::io;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::libc::{MSG_DONTWAIT, MSG_TRUNC, c_int};

use super::{NLM_F_DUMP_INTR, NLMSG_DONE, NLMSG_ERROR, messages, parse_error};

/// A `NETLINK_NETFILTER` socket, bound to a port id of the kernel's choosing and connected to
/// the kernel, in the network namespace of the calling thread (nftables, ctnetlink, nfacct).
pub fn netfilter_socket() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// One conversation with the kernel over a `NETLINK_NETFILTER` socket: the socket, the
/// sequence numbers of its requests, and the buffer replies are read into (ctnetlink, nfacct).
pub struct Channel {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl Channel {
    /// A [`netfilter_socket`] reading replies of up to `buffer` bytes.
    pub fn netfilter(buffer: usize) -> io::Result<Channel> {
        Ok(Channel {
            socket: netfilter_socket()?,
            seq: 0,
            buf: vec![0; buffer],
        })
    }

    /// The sequence number of the next request.
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends one request or batch (see [`send`]).
    pub fn send(&self, bytes: &[u8]) -> io::Result<()> {
        send(&self.socket, bytes)
    }

    /// Receives one datagram: its bytes as far as the buffer holds them, and its length
    /// (longer than the bytes when it did not fit).
    pub fn recv(&mut self) -> io::Result<(&[u8], usize)> {
        let n = recv(&self.socket, &mut self.buf, 0)?;
        Ok((&self.buf[..n.min(self.buf.len())], n))
    }

    /// The capacity of the receive buffer.
    pub fn buffer_len(&self) -> usize {
        self.buf.len()
    }
}

/// Sends `bytes` as one datagram; a short send (the kernel took part of it) is an error.
pub fn send(socket: &Socket, bytes: &[u8]) -> io::Result<()> {
    loop {
        match socket.send(bytes, 0) {
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(n) => return Err(io::Error::other(format!("short send: {n} of {} bytes", bytes.len()))),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Receives one datagram into `buf` with `recv(2)` `flags`; returns its length as the kernel
/// reports it (with `MSG_TRUNC`, the whole datagram's even when `buf` was too small).
pub fn recv(socket: &Socket, buf: &mut [u8], flags: c_int) -> io::Result<usize> {
    loop {
        match socket.recv(&mut &mut buf[..], flags) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Reads every datagram already queued, without waiting, handing each to `each`.
pub fn drain(socket: &Socket, buf: &mut [u8], mut each: impl FnMut(&[u8])) -> io::Result<()> {
    loop {
        match recv(socket, buf, MSG_DONTWAIT) {
            Ok(n) => each(&buf[..n.min(buf.len())]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// The data messages of a dump, each as `(type, whole message)`, and whether the kernel said
/// the table changed while it walked it.
#[derive(Debug, Default)]
pub struct Dumped {
    pub messages: Vec<(u16, Vec<u8>)>,
    pub interrupted: bool,
}

/// Sends the dump request `request` (sequence number `seq`) and reads its parts until
/// `NLMSG_DONE`; an `NLMSG_ERROR` with an errno, or a datagram that does not frame, is an
/// error. Replies to other sequence numbers (left over from an earlier exchange) are skipped.
pub fn dump(socket: &Socket, buf: &mut [u8], request: &[u8], seq: u32) -> io::Result<Dumped> {
    drain(socket, buf, |_| {})?;
    send(socket, request)?;
    let mut out = Dumped::default();
    loop {
        let n = recv(socket, buf, MSG_TRUNC)?;
        let data = buf
            .get(..n)
            .ok_or_else(|| io::Error::other(format!("netlink datagram of {n} bytes truncated to {}", buf.len())))?;
        for m in messages(data) {
            let m = m.map_err(|e| io::Error::other(e.to_string()))?;
            if m.seq != seq {
                continue;
            }
            out.interrupted |= m.flags & NLM_F_DUMP_INTR != 0;
            match m.msg_type {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let e = parse_error(&m).map_err(|e| io::Error::other(e.to_string()))?;
                    if e.errno != 0 {
                        let os = io::Error::from_raw_os_error(e.errno.saturating_neg());
                        return Err(match e.message {
                            Some(text) => io::Error::new(os.kind(), format!("{os}: {text}")),
                            None => os,
                        });
                    }
                }
                t => out.messages.push((t, m.bytes.to_vec())),
            }
        }
    }
}

/// Sends the request `request` (sequence number `seq`, not a dump) and returns the one data
/// message the kernel answers with; `None` when it answers ENOENT (no such object).
pub fn get(socket: &Socket, buf: &mut [u8], request: &[u8], seq: u32) -> io::Result<Option<Vec<u8>>> {
    drain(socket, buf, |_| {})?;
    send(socket, request)?;
    loop {
        let n = recv(socket, buf, MSG_TRUNC)?;
        let data = buf
            .get(..n)
            .ok_or_else(|| io::Error::other(format!("netlink datagram of {n} bytes truncated to {}", buf.len())))?;
        for m in messages(data) {
            let m = m.map_err(|e| io::Error::other(e.to_string()))?;
            if m.seq != seq {
                continue;
            }
            if m.msg_type != NLMSG_ERROR {
                return Ok(Some(m.bytes.to_vec()));
            }
            let e = parse_error(&m).map_err(|e| io::Error::other(e.to_string()))?;
            match e.errno.saturating_neg() {
                0 => return Ok(None),
                errno if errno == nix::libc::ENOENT => return Ok(None),
                errno => return Err(io::Error::from_raw_os_error(errno)),
            }
        }
    }
}
