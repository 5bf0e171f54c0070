//! Datagrams on a netlink socket: one `send` per request or batch, one `recv` per reply
//! datagram, a call interrupted by a signal repeated (it transferred nothing).

use std::io;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::libc::{MSG_DONTWAIT, c_int};

/// A `NETLINK_NETFILTER` socket, bound to a port id of the kernel's choosing and connected to
/// the kernel, in the network namespace of the calling thread (nftables, ctnetlink, nfacct).
pub fn netfilter_socket() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
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
