//! Placeholder until the tracer lands (temporary stub with the agreed API).
use std::net::IpAddr;
use crate::model::Protocol;
use super::Ruleset;
pub struct Packet { pub src: IpAddr, pub dst: IpAddr, pub dport: u16, pub protocol: Protocol, pub in_interface: Option<String> }
pub struct TraceContext { pub local_addresses: Vec<IpAddr> }
#[derive(Debug, serde::Serialize)]
pub struct Trace {}
#[derive(Debug, thiserror::Error)]
#[error("tracer not built yet")]
pub struct TraceError;
pub fn trace(_r: &Ruleset, _c: &TraceContext, _p: &Packet) -> Result<Trace, TraceError> { Err(TraceError) }
pub fn render_text(_t: &Trace, _p: &Packet) -> String { String::new() }
