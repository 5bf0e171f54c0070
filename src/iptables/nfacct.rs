//! The kernel's extended accounting objects (nfacct, nfnetlink subsystem `NFNL_SUBSYS_ACCT`):
//! named packet and byte counters that iptables rules feed with `-m nfacct --nfacct-name NAME`.
//! iptables mode uses two of them, as upstream does, for the metrics
//! `kubeproxy_iptables_ct_state_invalid_dropped_packets_total` and
//! `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`: they are created at start
//! where the kernel has nfacct, and only then do the rules count into them.
//!
//! Messages are built and read here (pure, [`new_request`], [`get_request`],
//! [`parse_counter`]); [`Netlink`] runs the exchange on a `NETLINK_NETFILTER` socket, behind the
//! [`Nfacct`] trait, with a recording [`Fake`].

use std::io;

use crate::netlink::{self, Attrs, DecodeError, MsgBuf, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, NLMSG_ERROR};

/// nfacct's nfnetlink subsystem; message types are `subsys << 8 | NFNL_MSG_ACCT_*`.
pub const NFNL_SUBSYS_ACCT: u16 = 7;
const NFNL_MSG_ACCT_NEW: u16 = 0;
const NFNL_MSG_ACCT_GET: u16 = 1;
const NFACCT_NAME: u16 = 1;
const NFACCT_PKTS: u16 = 2;
const NFACCT_BYTES: u16 = 3;
/// `NFACCT_NAME_MAX`: names are at most 31 bytes (32 with the NUL).
pub const NAME_MAX: usize = 31;
/// `nfgenmsg`: AF_UNSPEC, NFNETLINK_V0, resource id 0.
const NFGENMSG: [u8; 4] = [0, 0, 0, 0];
const RECV_BUFFER: usize = 8 * 1024;

/// One accounting object as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    pub name: String,
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not open a NETLINK_NETFILTER socket: {0}")]
    Socket(io::Error),
    #[error("nfacct name {0:?} is longer than {NAME_MAX} bytes")]
    NameTooLong(String),
    #[error("nfacct counter {0:?} does not exist")]
    NotFound(String),
    #[error("nfacct {what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("nfacct {what}: the kernel answered {source}")]
    Kernel { what: String, source: io::Error },
    #[error("nfacct {what}: undecodable reply: {source}")]
    Decode { what: String, source: DecodeError },
}

fn check_name(name: &str) -> Result<(), Error> {
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong(name.to_string()));
    }
    Ok(())
}

fn request(cmd: u16, flags: u16, name: &str, seq: u32) -> Vec<u8> {
    let mut b = MsgBuf::with_capacity(64);
    let m = b.begin_msg(
        NFNL_SUBSYS_ACCT << 8 | cmd,
        NLM_F_REQUEST | NLM_F_ACK | flags,
        seq,
        &NFGENMSG,
    );
    b.put_str(NFACCT_NAME, name);
    b.end_msg(m);
    b.buf
}

/// `NFNL_MSG_ACCT_NEW` creating the counter `name` (acknowledged; an existing one is `EBUSY`).
pub fn new_request(name: &str, seq: u32) -> Vec<u8> {
    request(NFNL_MSG_ACCT_NEW, NLM_F_CREATE, name, seq)
}

/// `NFNL_MSG_ACCT_GET` of the counter `name` (`ENOENT` when there is none).
pub fn get_request(name: &str, seq: u32) -> Vec<u8> {
    request(NFNL_MSG_ACCT_GET, 0, name, seq)
}

/// The attributes of an nfacct message (after its `nfgenmsg`) as a [`Counter`].
pub fn parse_counter(payload: &[u8]) -> Result<Counter, DecodeError> {
    let attrs = Attrs::parse(
        payload
            .get(NFGENMSG.len()..)
            .ok_or(DecodeError::Truncated("nfgenmsg"))?,
    )?;
    let be64 = |ty: u16, name: &'static str| -> Result<u64, DecodeError> {
        let v = attrs.get(ty).ok_or(DecodeError::Missing(name))?;
        let bytes: [u8; 8] = v.try_into().map_err(|_| DecodeError::Length {
            attr: name,
            len: v.len(),
        })?;
        Ok(u64::from_be_bytes(bytes))
    };
    Ok(Counter {
        name: Attrs::need(attrs.str(NFACCT_NAME, "NFACCT_NAME"), "NFACCT_NAME")?.to_string(),
        packets: be64(NFACCT_PKTS, "NFACCT_PKTS")?,
        bytes: be64(NFACCT_BYTES, "NFACCT_BYTES")?,
    })
}

/// The kernel's nfacct objects, as iptables mode and its metrics use them.
pub trait Nfacct: Send {
    /// Creates the counter `name` unless it exists (upstream's `Ensure`).
    fn ensure(&mut self, name: &str) -> Result<(), Error>;
    /// The counter `name` now.
    fn get(&mut self, name: &str) -> Result<Counter, Error>;
}

/// Creates each of `names` that is missing; true when all of them exist afterwards. Failures are
/// logged, as upstream logs them: the rules then count into none of them, so a kernel without
/// nfacct keeps working rules.
pub fn ensure_all(nfacct: &mut dyn Nfacct, names: &[&str]) -> bool {
    let mut all = true;
    for name in names {
        if let Err(e) = nfacct.ensure(name) {
            tracing::error!(error = %e, counter = name, "Failed to create nfacct counter; the corresponding metric will not be updated");
            all = false;
        }
    }
    all
}

/// nfacct over a `NETLINK_NETFILTER` socket, in the network namespace of the thread that
/// created it (needs `CAP_NET_ADMIN`).
#[derive(Debug)]
pub struct Netlink {
    channel: netlink::Channel,
}

/// What one exchange returned: the counter message, if any, and the kernel's errno (0: done).
struct Answer {
    counter: Option<Result<Counter, DecodeError>>,
    errno: i32,
}

impl Netlink {
    pub fn new() -> Result<Netlink, Error> {
        let channel = netlink::Channel::netfilter(RECV_BUFFER).map_err(Error::Socket)?;
        Ok(Netlink { channel })
    }

    /// Sends one request and reads until the kernel acknowledges or refuses it (messages of
    /// other sequence numbers are leftovers of an exchange cut short, and skipped).
    fn exchange(&mut self, what: &str, build: impl Fn(u32) -> Vec<u8>) -> Result<Answer, Error> {
        let seq = self.channel.next_seq();
        let io_err = |source| Error::Io {
            what: what.to_string(),
            source,
        };
        self.channel.send(&build(seq)).map_err(io_err)?;
        let mut counter = None;
        loop {
            // A datagram too long for the buffer is read as far as it goes.
            let (data, _) = self.channel.recv().map_err(io_err)?;
            for m in netlink::messages(data) {
                let m = m.map_err(|source| Error::Decode {
                    what: what.to_string(),
                    source,
                })?;
                if m.seq != seq {
                    continue;
                }
                if m.msg_type == NLMSG_ERROR {
                    let reply = netlink::parse_error(&m).map_err(|source| Error::Decode {
                        what: what.to_string(),
                        source,
                    })?;
                    return Ok(Answer {
                        counter,
                        errno: reply.errno,
                    });
                }
                counter = Some(parse_counter(m.payload));
            }
        }
    }
}

fn kernel(what: &str, errno: i32) -> Error {
    Error::Kernel {
        what: what.to_string(),
        source: io::Error::from_raw_os_error(errno.saturating_neg()),
    }
}

impl Nfacct for Netlink {
    fn ensure(&mut self, name: &str) -> Result<(), Error> {
        match self.get(name) {
            Ok(_) => Ok(()),
            Err(Error::NotFound(_)) => {
                let what = format!("creating {name}");
                let answer = self.exchange(&what, |seq| new_request(name, seq))?;
                // EBUSY: created by someone else since (an earlier run, another proxy): fine.
                match answer.errno {
                    0 => Ok(()),
                    e if e == -(nix::libc::EBUSY) => Ok(()),
                    e => Err(kernel(&what, e)),
                }
            }
            Err(e) => Err(e),
        }
    }

    fn get(&mut self, name: &str) -> Result<Counter, Error> {
        check_name(name)?;
        let what = format!("reading {name}");
        let answer = self.exchange(&what, |seq| get_request(name, seq))?;
        match (answer.errno, answer.counter) {
            (e, _) if e == -(nix::libc::ENOENT) => Err(Error::NotFound(name.to_string())),
            (0, Some(Ok(c))) => Ok(c),
            (0, Some(Err(source))) => Err(Error::Decode { what, source }),
            (0, None) => Err(Error::Decode {
                what,
                source: DecodeError::Missing("counter message"),
            }),
            (e, _) => Err(kernel(&what, e)),
        }
    }
}

/// A recording [`Nfacct`]: counters in memory, and what was asked.
#[derive(Debug, Default)]
pub struct Fake {
    pub counters: std::collections::BTreeMap<String, u64>,
    /// `Some`: every call fails (a kernel without nfacct).
    pub unsupported: Option<i32>,
    pub calls: Vec<String>,
}

impl Nfacct for Fake {
    fn ensure(&mut self, name: &str) -> Result<(), Error> {
        self.calls.push(format!("ensure {name}"));
        if let Some(errno) = self.unsupported {
            return Err(kernel(&format!("creating {name}"), -errno));
        }
        self.counters.entry(name.to_string()).or_insert(0);
        Ok(())
    }

    fn get(&mut self, name: &str) -> Result<Counter, Error> {
        self.calls.push(format!("get {name}"));
        if let Some(errno) = self.unsupported {
            return Err(kernel(&format!("reading {name}"), -errno));
        }
        let packets = *self
            .counters
            .get(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        Ok(Counter {
            name: name.to_string(),
            packets,
            bytes: packets * 60,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_nfnetlink_acct_messages() {
        // nlmsghdr (length 36, ACCT NEW, REQUEST|ACK|CREATE, seq 5, port 0), nfgenmsg
        // (AF_UNSPEC, v0), NFACCT_NAME "ct_state_x" with its NUL and one byte of padding.
        let want = [
            &36u32.to_ne_bytes()[..],
            &(NFNL_SUBSYS_ACCT << 8).to_ne_bytes(),
            &0x0405u16.to_ne_bytes(),
            &5u32.to_ne_bytes(),
            &[0; 4],
            &[0; 4],
            &15u16.to_ne_bytes(),
            &1u16.to_ne_bytes(),
            b"ct_state_x\0\0",
        ]
        .concat();
        assert_eq!(new_request("ct_state_x", 5), want);
        let get = get_request("ct_state_x", 6);
        assert_eq!(u16::from_ne_bytes([get[4], get[5]]), 0x0701);
        assert_eq!(u16::from_ne_bytes([get[6], get[7]]), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(get[16..], want[16..]);
    }

    #[test]
    fn a_counter_reads_back_with_big_endian_values() {
        let mut b = MsgBuf::default();
        let m = b.begin_msg(NFNL_SUBSYS_ACCT << 8, 0, 1, &NFGENMSG);
        b.put_str(NFACCT_NAME, "localhost_nps_accepted_pkts");
        b.put_be64(NFACCT_PKTS, 3);
        b.put_be64(NFACCT_BYTES, 180);
        b.put_be32(4, 1); // NFACCT_USE
        b.end_msg(m);
        let msgs = netlink::split_messages(&b.buf).unwrap();
        assert_eq!(
            parse_counter(msgs[0].payload),
            Ok(Counter {
                name: "localhost_nps_accepted_pkts".into(),
                packets: 3,
                bytes: 180
            })
        );
        // A short value or a missing counter is an error, not a zero.
        let mut b = MsgBuf::default();
        let m = b.begin_msg(NFNL_SUBSYS_ACCT << 8, 0, 1, &NFGENMSG);
        b.put_str(NFACCT_NAME, "x");
        b.put_be32(NFACCT_PKTS, 3);
        b.end_msg(m);
        let msgs = netlink::split_messages(&b.buf).unwrap();
        assert!(matches!(
            parse_counter(msgs[0].payload),
            Err(DecodeError::Length { .. })
        ));
        assert!(parse_counter(&[0, 0]).is_err());
    }

    #[test]
    fn ensure_all_reports_whether_every_counter_exists() {
        let mut ok = Fake::default();
        assert!(ensure_all(&mut ok, &["a", "b"]));
        assert_eq!(ok.get("b").map(|c| c.packets).ok(), Some(0));
        let mut without = Fake {
            unsupported: Some(nix::libc::EINVAL),
            ..Fake::default()
        };
        assert!(!ensure_all(&mut without, &["a", "b"]));
        assert_eq!(without.calls, vec!["ensure a", "ensure b"]);
        assert!(check_name(&"x".repeat(32)).is_err());
    }
}
