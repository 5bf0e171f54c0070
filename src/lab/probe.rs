//! `kube-proxy lab serve` and `kube-proxy lab probe`: a tiny TCP+UDP server that answers with
//! its name and the source address it sees, and a client that reports who answered (as JSON).
//!
//! Server protocol (port 8080 by default, `[::]` dual-stack and/or `0.0.0.0`):
//! - TCP: on accept, writes `<name> <peer_ip>\n`, then echoes every line it receives until EOF.
//! - UDP: answers each datagram with `<name> <peer_ip>\n`.
//!
//! Once its sockets are bound it prints `ready <name> <port>` on stdout.
//!
//! The client prints one [`ProbeReport`] as JSON on stdout and exits 0 whatever happened to the
//! attempts (failures are data); only bad arguments make it fail.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// The error of an attempt refused by the peer (RST, or ICMP port-unreachable as an iptables
/// `REJECT` sends it).
pub const ERR_REFUSED: &str = "refused";
/// No answer (connect or first line, or datagram answer) within `--timeout`.
pub const ERR_TIMEOUT: &str = "timeout";
/// The connection was reset (or a write hit a broken pipe).
pub const ERR_RESET: &str = "reset";
/// EHOSTUNREACH / ENETUNREACH (ICMP host/net unreachable, or no route).
pub const ERR_UNREACHABLE: &str = "unreachable";
/// Prefix of every other error: `other: <description>`.
pub const ERR_OTHER_PREFIX: &str = "other: ";

/// Arguments of `kube-proxy lab serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The name written in every answer.
    #[arg(long)]
    pub name: String,
    /// TCP and UDP port to listen on.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
}

/// Transport of a probe.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeProtocol {
    Tcp,
    Udp,
}

/// Arguments of `kube-proxy lab probe`. Build them from Rust with [`ProbeArgs::tcp`] /
/// [`ProbeArgs::udp`] and the `with_*` methods; [`ProbeArgs::to_args`] renders the command line.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct ProbeArgs {
    /// Destination IP:PORT ([IPv6]:PORT).
    #[arg(long)]
    pub to: SocketAddr,
    /// tcp or udp.
    #[arg(long, value_enum, ignore_case = true, default_value_t = ProbeProtocol::Tcp)]
    pub protocol: ProbeProtocol,
    /// Source address to bind (port chosen by the kernel).
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// TCP: new connections, one after another (each a new socket, so a new conntrack entry).
    /// UDP: datagrams, all from one socket.
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// Pause between attempts in ms (default: 0 for TCP, 50 for UDP, 100 between stream lines).
    #[arg(long)]
    pub interval: Option<u64>,
    /// Per attempt, in ms: connect + first line (TCP), or the datagram's answer (UDP); also the
    /// wait for each echo in stream mode.
    #[arg(long, default_value_t = 1000)]
    pub timeout: u64,
    /// TCP stream mode: one connection, a line every --interval ms for this many seconds, each
    /// echo checked.
    #[arg(long)]
    pub stream_seconds: Option<f64>,
}

impl ProbeArgs {
    /// One TCP connection to `to` (1 s timeout).
    pub fn tcp(to: SocketAddr) -> ProbeArgs {
        ProbeArgs {
            to,
            protocol: ProbeProtocol::Tcp,
            bind: None,
            count: 1,
            interval: None,
            timeout: 1000,
            stream_seconds: None,
        }
    }

    /// One UDP datagram to `to` (1 s timeout).
    pub fn udp(to: SocketAddr) -> ProbeArgs {
        ProbeArgs {
            protocol: ProbeProtocol::Udp,
            ..ProbeArgs::tcp(to)
        }
    }

    pub fn with_count(mut self, count: u32) -> ProbeArgs {
        self.count = count;
        self
    }

    pub fn with_bind(mut self, src: IpAddr) -> ProbeArgs {
        self.bind = Some(src);
        self
    }

    pub fn with_interval_ms(mut self, ms: u64) -> ProbeArgs {
        self.interval = Some(ms);
        self
    }

    pub fn with_timeout_ms(mut self, ms: u64) -> ProbeArgs {
        self.timeout = ms;
        self
    }

    /// TCP stream mode for `seconds`.
    pub fn with_stream_seconds(mut self, seconds: f64) -> ProbeArgs {
        self.stream_seconds = Some(seconds);
        self
    }

    /// The arguments after `kube-proxy lab probe`.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--to".to_string(),
            self.to.to_string(),
            "--protocol".to_string(),
            match self.protocol {
                ProbeProtocol::Tcp => "tcp",
                ProbeProtocol::Udp => "udp",
            }
            .to_string(),
            "--count".to_string(),
            self.count.to_string(),
            "--timeout".to_string(),
            self.timeout.to_string(),
        ];
        if let Some(b) = self.bind {
            v.extend(["--bind".to_string(), b.to_string()]);
        }
        if let Some(i) = self.interval {
            v.extend(["--interval".to_string(), i.to_string()]);
        }
        if let Some(s) = self.stream_seconds {
            v.extend(["--stream-seconds".to_string(), s.to_string()]);
        }
        v
    }

    /// How long the probe may take at most, with `slack` added (for callers' deadlines).
    pub fn max_duration(&self, slack: Duration) -> Duration {
        let timeout = Duration::from_millis(self.timeout);
        let interval = Duration::from_millis(self.effective_interval());
        let body = match self.stream_seconds {
            Some(s) => Duration::from_secs_f64(s.max(0.0)) + timeout * 2 + interval,
            None => (timeout + interval) * self.count,
        };
        body + slack
    }

    fn effective_interval(&self) -> u64 {
        self.interval.unwrap_or(match (self.protocol, self.stream_seconds) {
            (_, Some(_)) => 100,
            (ProbeProtocol::Tcp, None) => 0,
            (ProbeProtocol::Udp, None) => 50,
        })
    }

    fn validate(&self) -> Result<()> {
        if let Some(s) = self.stream_seconds {
            if self.protocol != ProbeProtocol::Tcp {
                bail!("--stream-seconds needs --protocol tcp");
            }
            if !s.is_finite() || s < 0.0 {
                bail!("--stream-seconds must be a non-negative number of seconds");
            }
        }
        if self.timeout == 0 {
            bail!("--timeout must be at least 1 ms");
        }
        if let Some(b) = self.bind
            && b.is_ipv4() != self.to.is_ipv4()
        {
            bail!("--bind {b} and --to {} are of different IP families", self.to);
        }
        Ok(())
    }
}

/// One connection (TCP) or datagram (UDP).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Attempt {
    /// Start of the attempt, in ms since the probe started.
    pub t_ms: u64,
    pub ok: bool,
    /// Who answered (the server's `--name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The source address the server saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_src: Option<IpAddr>,
    /// `refused`, `timeout`, `reset`, `unreachable` or `other: …` (see the `ERR_*` constants).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Duration of the attempt in µs.
    pub elapsed_us: u64,
}

/// A stream-mode error (a `timeout` waiting for one echo is not fatal; others end the stream).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct StreamError {
    pub t_ms: u64,
    pub error: String,
}

/// Result of stream mode: lines sent, lines whose echo came back, errors.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct StreamReport {
    pub sent: u64,
    pub echoed: u64,
    pub errors: Vec<StreamError>,
}

/// What `kube-proxy lab probe` prints. In stream mode `attempts` holds the stream's connection
/// (who served it).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct ProbeReport {
    pub attempts: Vec<Attempt>,
    pub stream: Option<StreamReport>,
}

impl ProbeReport {
    /// Whether there was at least one attempt and all succeeded (and, in stream mode, every
    /// line was echoed without error).
    pub fn all_ok(&self) -> bool {
        !self.attempts.is_empty()
            && self.attempts.iter().all(|a| a.ok)
            && self
                .stream
                .as_ref()
                .is_none_or(|s| s.errors.is_empty() && s.echoed == s.sent)
    }

    pub fn ok_count(&self) -> usize {
        self.attempts.iter().filter(|a| a.ok).count()
    }

    /// Answers per server name.
    pub fn names(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for n in self.attempts.iter().filter_map(|a| a.name.clone()) {
            *m.entry(n).or_insert(0) += 1;
        }
        m
    }

    /// Failed attempts per error (`refused`, `timeout`, …).
    pub fn errors(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for e in self.attempts.iter().filter_map(|a| a.error.clone()) {
            *m.entry(e).or_insert(0) += 1;
        }
        m
    }

    /// The source addresses the servers saw.
    pub fn seen_sources(&self) -> BTreeSet<IpAddr> {
        self.attempts.iter().filter_map(|a| a.seen_src).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// serve

/// Binds `[::]:port` (dual-stack unless the namespace says bindv6only) and `0.0.0.0:port`; the
/// second may fail with EADDRINUSE when the first is dual-stack. At least one must work.
fn bind_both<T>(port: u16, what: &str, bind: impl Fn(SocketAddr) -> io::Result<T>) -> Result<Vec<T>> {
    let mut out = Vec::new();
    let v6 = bind(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port));
    let v6_ok = v6.is_ok();
    out.extend(v6.ok());
    match bind(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port)) {
        Ok(s) => out.push(s),
        Err(e) if v6_ok && e.kind() == io::ErrorKind::AddrInUse => {}
        Err(e) => return Err(e).with_context(|| format!("cannot bind {what} 0.0.0.0:{port}")),
    }
    Ok(out)
}

fn tcp_conn(mut stream: TcpStream, name: &str) -> io::Result<()> {
    let peer = stream.peer_addr()?.ip().to_canonical();
    let _ = stream.set_nodelay(true);
    stream.write_all(format!("{name} {peer}\n").as_bytes())?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            return Ok(());
        }
        stream.write_all(&buf)?;
    }
}

/// Runs the server until killed.
pub fn serve(args: &ServeArgs) -> Result<()> {
    let listeners = bind_both(args.port, "TCP", TcpListener::bind)?;
    let sockets = bind_both(args.port, "UDP", UdpSocket::bind)?;
    let mut threads = Vec::new();
    for l in listeners {
        let name = args.name.clone();
        threads.push(std::thread::spawn(move || {
            for conn in l.incoming() {
                match conn {
                    Ok(stream) => {
                        let name = name.clone();
                        std::thread::spawn(move || {
                            let _ = tcp_conn(stream, &name);
                        });
                    }
                    Err(e) => eprintln!("serve {name}: accept: {e}"),
                }
            }
        }));
    }
    for s in sockets {
        let name = args.name.clone();
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            loop {
                match s.recv_from(&mut buf) {
                    Ok((_, peer)) => {
                        let answer = format!("{name} {}\n", peer.ip().to_canonical());
                        if let Err(e) = s.send_to(answer.as_bytes(), peer) {
                            eprintln!("serve {name}: send to {peer}: {e}");
                        }
                    }
                    Err(e) => eprintln!("serve {name}: UDP receive: {e}"),
                }
            }
        }));
    }
    {
        let mut out = io::stdout().lock();
        writeln!(out, "ready {} {}", args.name, args.port).context("cannot write to stdout")?;
        out.flush().context("cannot write to stdout")?;
    }
    for t in threads {
        let _ = t.join();
    }
    bail!("server threads ended")
}

// ---------------------------------------------------------------------------------------------
// probe

/// The report's word for an I/O error.
pub fn classify(e: &io::Error) -> String {
    use io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused => ERR_REFUSED.to_string(),
        K::TimedOut | K::WouldBlock => ERR_TIMEOUT.to_string(),
        K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => ERR_RESET.to_string(),
        K::HostUnreachable | K::NetworkUnreachable => ERR_UNREACHABLE.to_string(),
        _ => format!("{ERR_OTHER_PREFIX}{e}"),
    }
}

fn other(msg: impl std::fmt::Display) -> io::Error {
    io::Error::other(msg.to_string())
}

fn ms_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Parses `<name> <ip>`.
fn parse_answer(line: &str) -> io::Result<(String, IpAddr)> {
    let line = line.trim_end_matches(['\n', '\r']);
    let (name, ip) = line
        .split_once(' ')
        .ok_or_else(|| other(format!("bad answer {line:?}")))?;
    let ip = ip.parse().map_err(|_| other(format!("bad answer {line:?}")))?;
    Ok((name.to_string(), ip))
}

fn attempt(t_ms: u64, elapsed: Duration, res: io::Result<(String, IpAddr)>) -> Attempt {
    match res {
        Ok((name, src)) => Attempt {
            t_ms,
            ok: true,
            name: Some(name),
            seen_src: Some(src),
            error: None,
            elapsed_us: us(elapsed),
        },
        Err(e) => Attempt {
            t_ms,
            ok: false,
            name: None,
            seen_src: None,
            error: Some(classify(&e)),
            elapsed_us: us(elapsed),
        },
    }
}

/// Connects with an optional source address (bind before connect needs tokio's TcpSocket, as
/// the crate forbids unsafe code) within `timeout`; returns a blocking std stream.
fn tcp_connect(
    rt: &tokio::runtime::Runtime,
    to: SocketAddr,
    bind: Option<IpAddr>,
    timeout: Duration,
) -> io::Result<TcpStream> {
    rt.block_on(async {
        let sock = if to.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            let sock = tokio::net::TcpSocket::new_v6()?;
            // An ICMPv6 error that arrives while connect() still holds the socket is kept only
            // as a soft error, reported on the SYN retry ~1 s later; with IPV6_RECVERR it
            // wakes the connect at once (IPv4 reports it at once anyway).
            nix::sys::socket::setsockopt(&sock, nix::sys::socket::sockopt::Ipv6RecvErr, &true)
                .map_err(|e| other(format!("IPV6_RECVERR: {e}")))?;
            sock
        };
        if let Some(ip) = bind {
            sock.bind(SocketAddr::new(ip, 0))
                .map_err(|e| other(format!("bind {ip}: {e}")))?;
        }
        let stream = match tokio::time::timeout(timeout, sock.connect(to)).await {
            Ok(r) => r?,
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
        };
        let std = stream.into_std()?;
        std.set_nonblocking(false)?;
        Ok(std)
    })
}

fn set_deadline(stream: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
    }
    stream.set_read_timeout(Some(left))
}

/// Reads one line; EOF is an error.
fn read_line(reader: &mut BufReader<TcpStream>) -> io::Result<String> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(other("connection closed"));
    }
    Ok(line)
}

/// Connects and reads the greeting; returns the reader for further use.
fn tcp_greeting(
    rt: &tokio::runtime::Runtime,
    args: &ProbeArgs,
) -> io::Result<((String, IpAddr), BufReader<TcpStream>)> {
    let timeout = Duration::from_millis(args.timeout);
    let deadline = Instant::now() + timeout;
    let stream = tcp_connect(rt, args.to, args.bind, timeout)?;
    let _ = stream.set_nodelay(true);
    set_deadline(&stream, deadline)?;
    let mut reader = BufReader::new(stream);
    let answer = parse_answer(&read_line(&mut reader)?)?;
    Ok((answer, reader))
}

fn probe_tcp(rt: &tokio::runtime::Runtime, args: &ProbeArgs, start: Instant) -> Vec<Attempt> {
    let interval = Duration::from_millis(args.effective_interval());
    let mut out = Vec::new();
    for i in 0..args.count {
        if i > 0 && !interval.is_zero() {
            std::thread::sleep(interval);
        }
        let t = ms_since(start);
        let began = Instant::now();
        let res = tcp_greeting(rt, args).map(|(answer, _reader)| answer);
        out.push(attempt(t, began.elapsed(), res));
    }
    out
}

/// Consumes answers (and pending ICMP errors) left over from earlier, timed-out datagrams.
fn drain_udp(sock: &UdpSocket) -> io::Result<()> {
    sock.set_nonblocking(true)?;
    let mut buf = [0u8; 2048];
    for _ in 0..10_000 {
        match sock.recv(&mut buf) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(_) => {}
        }
    }
    sock.set_nonblocking(false)
}

fn udp_once(sock: &UdpSocket, timeout: Duration) -> io::Result<(String, IpAddr)> {
    drain_udp(sock)?;
    let deadline = Instant::now() + timeout;
    sock.send(b"probe\n")?;
    let mut buf = [0u8; 2048];
    let n = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        sock.set_read_timeout(Some(left))?;
        match sock.recv(&mut buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    parse_answer(&String::from_utf8_lossy(&buf[..n]))
}

fn probe_udp(args: &ProbeArgs, start: Instant) -> Vec<Attempt> {
    let interval = Duration::from_millis(args.effective_interval());
    let timeout = Duration::from_millis(args.timeout);
    let local = args.bind.unwrap_or(if args.to.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    });
    // A connected socket: ICMP errors are reported, answers from other sources ignored.
    let sock = UdpSocket::bind(SocketAddr::new(local, 0))
        .map_err(|e| other(format!("bind {local}: {e}")))
        .and_then(|s| s.connect(args.to).map(|()| s));
    let mut out = Vec::new();
    for i in 0..args.count {
        if i > 0 && !interval.is_zero() {
            std::thread::sleep(interval);
        }
        let t = ms_since(start);
        let began = Instant::now();
        let res = match &sock {
            Ok(s) => udp_once(s, timeout),
            Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
        };
        out.push(attempt(t, began.elapsed(), res));
    }
    out
}

fn probe_stream(rt: &tokio::runtime::Runtime, args: &ProbeArgs, seconds: f64, start: Instant) -> ProbeReport {
    let timeout = Duration::from_millis(args.timeout);
    let interval = Duration::from_millis(args.effective_interval());
    let mut report = StreamReport::default();
    let t = ms_since(start);
    let began = Instant::now();
    let (answer, mut reader) = match tcp_greeting(rt, args) {
        Ok((a, r)) => (Ok(a), Some(r)),
        Err(e) => (Err(e), None),
    };
    let first = attempt(t, began.elapsed(), answer);
    if let Some(err) = &first.error {
        report.errors.push(StreamError {
            t_ms: t,
            error: err.clone(),
        });
    }
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut seq: u64 = 0;
    while let Some(r) = reader.as_mut() {
        if Instant::now() >= end {
            break;
        }
        seq += 1;
        let t = ms_since(start);
        if let Err(e) = r.get_mut().write_all(format!("line {seq}\n").as_bytes()) {
            report.errors.push(StreamError {
                t_ms: t,
                error: classify(&e),
            });
            break;
        }
        report.sent += 1;
        let deadline = Instant::now() + timeout;
        let fatal = loop {
            let res = set_deadline(r.get_ref(), deadline).and_then(|()| read_line(r));
            match res {
                Ok(line) => {
                    let got = line
                        .trim_end()
                        .strip_prefix("line ")
                        .and_then(|n| n.parse::<u64>().ok());
                    match got {
                        Some(n) if n == seq => {
                            report.echoed += 1;
                            break false;
                        }
                        // A late echo of a line whose wait timed out.
                        Some(n) if n < seq => report.echoed += 1,
                        _ => {
                            let error = format!("{ERR_OTHER_PREFIX}unexpected echo {:?}", line.trim_end());
                            report.errors.push(StreamError {
                                t_ms: ms_since(start),
                                error,
                            });
                            break true;
                        }
                    }
                }
                Err(e) => {
                    let error = classify(&e);
                    let is_timeout = error == ERR_TIMEOUT;
                    report.errors.push(StreamError {
                        t_ms: ms_since(start),
                        error,
                    });
                    break !is_timeout;
                }
            }
        };
        if fatal {
            break;
        }
        let left = end.saturating_duration_since(Instant::now());
        if !interval.is_zero() && !left.is_zero() {
            std::thread::sleep(interval.min(left));
        }
    }
    ProbeReport {
        attempts: vec![first],
        stream: Some(report),
    }
}

/// Runs the probe in this process' network namespace. An error only for invalid arguments or
/// when no runtime can be built; failed attempts are data in the report.
pub fn run_probe(args: &ProbeArgs) -> Result<ProbeReport> {
    args.validate()?;
    let start = Instant::now();
    if args.protocol == ProbeProtocol::Udp {
        return Ok(ProbeReport {
            attempts: probe_udp(args, start),
            stream: None,
        });
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot build a tokio runtime")?;
    Ok(match args.stream_seconds {
        Some(s) => probe_stream(&rt, args, s, start),
        None => ProbeReport {
            attempts: probe_tcp(&rt, args, start),
            stream: None,
        },
    })
}

/// `kube-proxy lab probe`: runs the probe and prints the report as one JSON line.
pub fn probe(args: &ProbeArgs) -> Result<()> {
    let report = run_probe(args)?;
    let json = serde_json::to_string(&report).context("cannot encode the report")?;
    let mut out = io::stdout().lock();
    writeln!(out, "{json}").context("cannot write to stdout")?;
    out.flush().context("cannot write to stdout")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_round_trip_through_clap() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            probe: ProbeArgs,
        }
        use clap::Parser;
        let a = ProbeArgs::udp("10.96.0.10:53".parse().unwrap())
            .with_count(7)
            .with_bind("10.244.9.2".parse().unwrap())
            .with_interval_ms(5)
            .with_timeout_ms(300);
        let mut argv = vec!["probe".to_string()];
        argv.extend(a.to_args());
        assert_eq!(Cli::parse_from(argv).probe, a);
        let s = ProbeArgs::tcp("[fd00::1]:80".parse().unwrap()).with_stream_seconds(1.5);
        let mut argv = vec!["probe".to_string()];
        argv.extend(s.to_args());
        assert_eq!(Cli::parse_from(argv).probe, s);
    }

    #[test]
    fn report_json_shape() {
        let r = ProbeReport {
            attempts: vec![
                attempt(
                    0,
                    Duration::from_micros(12),
                    Ok(("ep1".into(), "10.244.9.2".parse().unwrap())),
                ),
                attempt(
                    3,
                    Duration::from_micros(40),
                    Err(io::Error::from(io::ErrorKind::ConnectionRefused)),
                ),
            ],
            stream: None,
        };
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(
            j,
            r#"{"attempts":[{"t_ms":0,"ok":true,"name":"ep1","seen_src":"10.244.9.2","elapsed_us":12},{"t_ms":3,"ok":false,"error":"refused","elapsed_us":40}],"stream":null}"#
        );
        assert_eq!(serde_json::from_str::<ProbeReport>(&j).unwrap(), r);
        assert_eq!(r.errors().get("refused"), Some(&1));
        assert!(!r.all_ok());
    }

    #[test]
    fn parses_answers() {
        assert_eq!(
            parse_answer("ep2 10.244.9.2\n").unwrap(),
            ("ep2".to_string(), "10.244.9.2".parse().unwrap())
        );
        assert!(parse_answer("garbage").is_err());
    }
}
