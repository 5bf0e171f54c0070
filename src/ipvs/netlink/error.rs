//! What can go wrong talking to IPVS, named by operation and by the virtual / real server it
//! was about, with the kernel's errno.

use std::fmt;
use std::io;
use std::net::SocketAddr;

use nix::errno::Errno;

use super::types::{ServiceKey, Timeouts};

pub use crate::netlink::DecodeError;

/// An IPVS operation and what it was about; errors print it first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Resolving the "IPVS" generic-netlink family.
    ResolveFamily,
    Info,
    ListServices,
    AddService(ServiceKey),
    UpdateService(ServiceKey),
    DeleteService(ServiceKey),
    ListDests(ServiceKey),
    AddDest(ServiceKey, SocketAddr),
    UpdateDest(ServiceKey, SocketAddr),
    DeleteDest(ServiceKey, SocketAddr),
    Flush,
    SetTimeouts(Timeouts),
    GetTimeouts,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::ResolveFamily => write!(f, "resolving the generic netlink family IPVS"),
            Op::Info => write!(f, "getting IPVS info"),
            Op::ListServices => write!(f, "listing virtual servers"),
            Op::AddService(s) => write!(f, "adding virtual server {s}"),
            Op::UpdateService(s) => write!(f, "updating virtual server {s}"),
            Op::DeleteService(s) => write!(f, "deleting virtual server {s}"),
            Op::ListDests(s) => write!(f, "listing the real servers of {s}"),
            Op::AddDest(s, d) => write!(f, "adding real server {d} to {s}"),
            Op::UpdateDest(s, d) => write!(f, "updating real server {d} of {s}"),
            Op::DeleteDest(s, d) => write!(f, "deleting real server {d} of {s}"),
            Op::Flush => write!(f, "flushing the IPVS table"),
            Op::SetTimeouts(t) => write!(f, "setting IPVS timeouts ({t})"),
            Op::GetTimeouts => write!(f, "getting IPVS timeouts"),
        }
    }
}

/// Why an IPVS operation failed.
#[derive(Debug, thiserror::Error)]
pub enum IpvsError {
    /// The kernel knows no "IPVS" generic-netlink family: the module is neither loaded nor
    /// loadable. IPVS mode must refuse to start on this, never fall back to another mode.
    #[error("the kernel has no IPVS (ip_vs module not loaded): run `modprobe ip_vs`")]
    NotAvailable,
    /// The kernel refused the request. (A `hint` names the likely cause where the errno alone
    /// is cryptic, e.g. a scheduler module that is missing.)
    #[error("{op}: {errno}{}{}", message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default(), hint.as_deref().map(|h| format!(": {h}")).unwrap_or_default())]
    Kernel {
        op: Op,
        errno: Errno,
        /// The kernel's extended-ack text, if it gave one.
        message: Option<String>,
        hint: Option<String>,
    },
    /// Refused before sending: the kernel would refuse it too, less clearly.
    #[error("{op}: {reason}")]
    Invalid { op: Op, reason: String },
    /// The netlink socket failed.
    #[error("{op}: netlink socket: {context}")]
    Io {
        op: Op,
        context: &'static str,
        #[source]
        source: io::Error,
    },
    /// The kernel's reply could not be read.
    #[error("{op}: unreadable reply from the kernel")]
    Decode {
        op: Op,
        #[source]
        source: DecodeError,
    },
}

impl IpvsError {
    /// The kernel's (or the fake's) errno, when it refused the request.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            IpvsError::Kernel { errno, .. } => Some(*errno),
            IpvsError::Io { source, .. } => source.raw_os_error().map(Errno::from_raw),
            _ => None,
        }
    }

    /// A refusal, with the hint this module gives for that errno and operation.
    pub fn kernel(op: Op, errno: Errno, message: Option<String>, scheduler: Option<&str>) -> IpvsError {
        let hint = match (&op, errno, scheduler) {
            // The kernel asks modprobe for `ip_vs_NAME` itself when it does not know a
            // scheduler, so ENOENT means that module is missing or the name is wrong.
            (Op::AddService(_) | Op::UpdateService(_), Errno::ENOENT, Some(s)) => Some(format!(
                "no IPVS scheduler `{s}` (module ip_vs_{s} not loaded): run `modprobe ip_vs_{s}`"
            )),
            // The kernel's attribute policy refuses longer names, without saying why.
            (Op::AddService(_) | Op::UpdateService(_), Errno::EINVAL, Some(s))
                if s.len() > super::fake::MAX_SCHEDULER_NAME =>
            {
                Some(format!("scheduler name `{s}` is longer than 15 bytes"))
            }
            (Op::AddService(_), Errno::EEXIST, _) => Some("the virtual server exists".to_string()),
            (_, Errno::ESRCH, _) => Some("no such virtual server".to_string()),
            (Op::AddDest(..), Errno::EEXIST, _) => Some("the real server exists".to_string()),
            (Op::UpdateDest(..) | Op::DeleteDest(..), Errno::ENOENT, _) => Some("no such real server".to_string()),
            _ => None,
        };
        IpvsError::Kernel {
            op,
            errno,
            message,
            hint,
        }
    }
}
