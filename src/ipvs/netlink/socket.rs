//! The edge: a `NETLINK_GENERIC` socket speaking to the kernel's IPVS family, one request at a
//! time, each answered by an acknowledgement, an error, or a dump ending in `NLMSG_DONE`.

use std::io;
use std::os::fd::AsFd;
use std::time::Duration;

use netlink_sys::{Socket, SocketAddr as NlSocketAddr, protocols::NETLINK_GENERIC};
use nix::errno::Errno;
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;

use super::Ipvs;
use super::error::{DecodeError, IpvsError, Op};
use super::message::{self, Family, Reply, Request};
use super::types::{Info, RealServer, Timeouts, VirtualServer};
use super::wire::GENL_ID_CTRL;
use crate::netlink;

/// A dump datagram is at most 32 KiB (the kernel sizes dump buffers by the reader's buffer,
/// capped there); anything larger would come back truncated, which is detected.
const RECV_BUFFER: usize = 64 << 10;
/// The kernel answers IPVS requests synchronously; a reply that takes this long is not coming.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);
/// A dump interrupted by concurrent changes is retried this many times.
const DUMP_ATTEMPTS: usize = 5;

/// A handle on the kernel's IPVS table of the network namespace the handle was created in (the
/// socket stays in that namespace for its whole life). Changing the table needs CAP_NET_ADMIN.
#[derive(Debug)]
pub struct IpvsHandle {
    socket: Socket,
    family: Family,
    seq: u32,
    buf: Vec<u8>,
}

fn io_err(op: &Op, context: &'static str) -> impl FnOnce(io::Error) -> IpvsError {
    let op = op.clone();
    move |source| IpvsError::Io { op, context, source }
}

impl IpvsHandle {
    /// Opens the socket and resolves the IPVS family. Without IPVS in the kernel this is
    /// [`IpvsError::NotAvailable`]. (Resolving asks the kernel to load `ip_vs` on demand when
    /// the module exists but is not loaded.)
    pub fn new() -> Result<IpvsHandle, IpvsError> {
        let op = Op::ResolveFamily;
        let mut socket = Socket::new(NETLINK_GENERIC).map_err(io_err(&op, "opening a NETLINK_GENERIC socket"))?;
        socket.bind_auto().map_err(io_err(&op, "binding"))?;
        socket
            .connect(&NlSocketAddr::new(0, 0))
            .map_err(io_err(&op, "connecting to the kernel"))?;
        // Best effort: error texts are a courtesy, and capped acks only save copying our
        // request back. Old kernels lack both options.
        let _ = socket.set_ext_ack(true);
        let _ = socket.set_cap_ack(true);
        setsockopt(
            &socket.as_fd(),
            sockopt::ReceiveTimeout,
            &TimeVal::new(RECV_TIMEOUT.as_secs() as _, 0),
        )
        .map_err(|e| io_err(&op, "setting SO_RCVTIMEO")(io::Error::from(e)))?;
        let mut handle = IpvsHandle {
            socket,
            family: Family {
                id: 0,
                version: 0,
                max_attr: 0,
            },
            // Start from the clock, so that a reply meant for an earlier process that had
            // our port id is not taken for ours.
            seq: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| (d.as_secs() & 0xffff_ffff) as u32)
                .unwrap_or(1),
            buf: vec![0; RECV_BUFFER],
        };
        handle.family = handle.resolve_family()?;
        Ok(handle)
    }

    /// The family id the kernel gave IPVS (dynamic; 0x20-something).
    pub fn family_id(&self) -> u16 {
        self.family.id
    }

    fn resolve_family(&mut self) -> Result<Family, IpvsError> {
        let op = Op::ResolveFamily;
        let seq = self.next_seq();
        let bytes = message::encode_get_family(seq);
        let replies = match self.exchange(&op, &bytes, seq, false) {
            Ok(r) => r,
            // The controller's answer for a family it does not know (after trying to load
            // its module).
            Err(IpvsError::Kernel {
                errno: Errno::ENOENT, ..
            }) => return Err(IpvsError::NotAvailable),
            Err(e) => return Err(e),
        };
        let (msg_type, payload) = replies.first().ok_or_else(|| IpvsError::Decode {
            op: op.clone(),
            source: DecodeError::Missing("CTRL_CMD_NEWFAMILY reply"),
        })?;
        if *msg_type != GENL_ID_CTRL {
            return Err(IpvsError::Decode {
                op,
                source: DecodeError::Unexpected {
                    msg_type: *msg_type,
                    cmd: payload.first().copied().unwrap_or(0),
                },
            });
        }
        message::decode_family(payload).map_err(|source| IpvsError::Decode { op, source })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends `req` and collects the payloads of the reply's data messages.
    fn request(
        &mut self,
        op: &Op,
        req: &Request<'_>,
        scheduler: Option<&str>,
    ) -> Result<Vec<(u16, Vec<u8>)>, IpvsError> {
        let mut attempts = 0;
        loop {
            let seq = self.next_seq();
            let bytes = message::encode(req, self.family.id, seq);
            match self.exchange(op, &bytes, seq, req.is_dump()) {
                Err(IpvsError::Kernel {
                    errno: Errno::EINTR, ..
                }) if req.is_dump() && attempts < DUMP_ATTEMPTS => {
                    attempts += 1;
                }
                Err(IpvsError::Kernel {
                    op,
                    errno,
                    message,
                    hint: None,
                }) => return Err(IpvsError::kernel(op, errno, message, scheduler)),
                other => return other,
            }
        }
    }

    /// One request/reply exchange. A dump whose parts say it was interrupted comes back as
    /// EINTR (and is retried by [`IpvsHandle::request`]).
    fn exchange(&mut self, op: &Op, bytes: &[u8], seq: u32, dump: bool) -> Result<Vec<(u16, Vec<u8>)>, IpvsError> {
        // Drops whatever is queued from earlier exchanges (none normally; a request abandoned
        // midway, e.g. by a decode error, leaves the rest of its reply).
        netlink::drain(&self.socket, &mut self.buf, |_| {}).map_err(io_err(op, "discarding stale replies"))?;
        netlink::send(&self.socket, bytes).map_err(io_err(op, "sending the request"))?;
        let mut out = Vec::new();
        let mut interrupted = false;
        loop {
            let n = match netlink::recv(&self.socket, &mut self.buf, nix::libc::MSG_TRUNC) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io_err(op, "waiting for the reply")(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no reply within {} s", RECV_TIMEOUT.as_secs()),
                    )));
                }
                Err(e) => return Err(io_err(op, "receiving the reply")(e)),
            };
            if n > self.buf.len() {
                return Err(IpvsError::Decode {
                    op: op.clone(),
                    source: DecodeError::Truncated("reply datagram (larger than the receive buffer)"),
                });
            }
            let replies = message::parse_replies(&self.buf[..n])
                .map_err(|source| IpvsError::Decode { op: op.clone(), source })?;
            for reply in replies {
                match reply {
                    // Replies to earlier requests (e.g. an ack after a dump's DONE).
                    Reply::Error { seq: s, .. } | Reply::Done { seq: s, .. } | Reply::Data { seq: s, .. }
                        if s != seq => {}
                    // The ack ends a plain request. (Dumps end with DONE instead.)
                    Reply::Error { errno: 0, .. } => {
                        if !dump {
                            return Ok(out);
                        }
                    }
                    Reply::Error { errno, message, .. } => return Err(refused(op, errno, message)),
                    Reply::Done { errno, .. } if errno != 0 => return Err(refused(op, errno, None)),
                    Reply::Done { .. } if interrupted => {
                        return Err(IpvsError::Kernel {
                            op: op.clone(),
                            errno: Errno::EINTR,
                            message: Some("dump interrupted by a concurrent change".to_string()),
                            hint: None,
                        });
                    }
                    Reply::Done { .. } => return Ok(out),
                    Reply::Data {
                        msg_type,
                        interrupted: intr,
                        payload,
                        ..
                    } => {
                        interrupted |= intr;
                        out.push((msg_type, payload.to_vec()));
                    }
                }
            }
        }
    }

    fn decode_each<T>(
        op: &Op,
        replies: Vec<(u16, Vec<u8>)>,
        f: impl Fn(&[u8], u16) -> Result<T, DecodeError>,
    ) -> Result<Vec<T>, IpvsError> {
        replies
            .iter()
            .map(|(ty, p)| f(p, *ty))
            .collect::<Result<_, _>>()
            .map_err(|source| IpvsError::Decode { op: op.clone(), source })
    }

    fn one<T>(
        op: Op,
        replies: Vec<(u16, Vec<u8>)>,
        f: impl Fn(&[u8], u16) -> Result<T, DecodeError>,
    ) -> Result<T, IpvsError> {
        let (ty, p) = replies.into_iter().next().ok_or_else(|| IpvsError::Decode {
            op: op.clone(),
            source: DecodeError::Missing("reply message"),
        })?;
        f(&p, ty).map_err(|source| IpvsError::Decode { op, source })
    }

    fn check_scheduler(op: &Op, vs: &VirtualServer) -> Result<(), IpvsError> {
        // A NUL would end the name early on the wire and another scheduler would be asked for.
        if vs.scheduler.contains('\0') {
            return Err(IpvsError::Invalid {
                op: op.clone(),
                reason: format!("scheduler name {:?} contains a NUL byte", vs.scheduler),
            });
        }
        Ok(())
    }
}

/// The kernel's refusal (errno negative on the wire), its extack text kept if not empty.
fn refused(op: &Op, errno: i32, message: Option<String>) -> IpvsError {
    IpvsError::Kernel {
        op: op.clone(),
        errno: Errno::from_raw(errno.saturating_abs()),
        message: message.filter(|m| !m.is_empty()),
        hint: None,
    }
}

impl Ipvs for IpvsHandle {
    fn info(&mut self) -> Result<Info, IpvsError> {
        let replies = self.request(&Op::Info, &Request::GetInfo, None)?;
        Self::one(Op::Info, replies, message::decode_info)
    }

    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        let op = Op::ListServices;
        let replies = self.request(&op, &Request::DumpServices, None)?;
        Self::decode_each(&op, replies, message::decode_service_msg)
    }

    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let op = Op::AddService(vs.key());
        Self::check_scheduler(&op, vs)?;
        self.request(&op, &Request::NewService(vs), Some(&vs.scheduler))
            .map(drop)
    }

    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let op = Op::UpdateService(vs.key());
        Self::check_scheduler(&op, vs)?;
        self.request(&op, &Request::SetService(vs), Some(&vs.scheduler))
            .map(drop)
    }

    fn delete_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let op = Op::DeleteService(vs.key());
        self.request(&op, &Request::DelService(vs), None).map(drop)
    }

    fn dests(&mut self, vs: &VirtualServer) -> Result<Vec<RealServer>, IpvsError> {
        let op = Op::ListDests(vs.key());
        let replies = self.request(&op, &Request::DumpDests(vs), None)?;
        let family = vs.family();
        Self::decode_each(&op, replies, |p, ty| message::decode_dest_msg(p, ty, family))
    }

    fn add_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        let op = Op::AddDest(vs.key(), rs.key());
        self.request(&op, &Request::NewDest(vs, rs), None).map(drop)
    }

    fn update_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        let op = Op::UpdateDest(vs.key(), rs.key());
        self.request(&op, &Request::SetDest(vs, rs), None).map(drop)
    }

    fn delete_dest(&mut self, vs: &VirtualServer, rs: &RealServer) -> Result<(), IpvsError> {
        let op = Op::DeleteDest(vs.key(), rs.key());
        self.request(&op, &Request::DelDest(vs, rs), None).map(drop)
    }

    fn flush(&mut self) -> Result<(), IpvsError> {
        self.request(&Op::Flush, &Request::Flush, None).map(drop)
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        self.request(&Op::SetTimeouts(*t), &Request::SetConfig(t), None)
            .map(drop)
    }

    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let replies = self.request(&Op::GetTimeouts, &Request::GetConfig, None)?;
        Self::one(Op::GetTimeouts, replies, message::decode_timeouts)
    }
}
