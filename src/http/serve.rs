//! The serving layer of every HTTP server of the daemon (healthz, metrics, the health-check
//! node ports): HTTP/1.1 over hyper, bounded so that many idle connections or slow clients can
//! neither exhaust the daemon (file descriptors, memory) nor delay `/healthz`. Upstream's Go
//! servers set no timeout at all; the limits ([`Limits::default`]):
//!
//! - **connections**: at most 1,000 open at once across all the servers of the process (and
//!   at most a quarter of the soft `RLIMIT_NOFILE`, so that the daemon keeps descriptors for
//!   its own work). A connection beyond that closes the oldest open one that has no request
//!   in progress (an idle keep-alive, or a client still sending its headers), so that a new
//!   client, a probe, always gets in, at once (a few dozen closed ones may still be holding
//!   their descriptor while their task has not run; beyond, admissions wait for them, so that
//!   the descriptors stay bounded too).
//!   When every open connection has a request in progress, the new one is closed at once.
//! - **the listen backlog** is `net.core.somaxconn`, as Go listens: a burst of connections
//!   beyond the default 1,024 would overflow the accept queue, and a probe whose SYN is
//!   dropped there waits a second for its retransmission.
//! - **headers**: a request's headers must be complete 10 s after the connection opened or
//!   the previous response ended; otherwise the connection is closed (slowloris clients, and
//!   idle keep-alive connections after 10 s). At most 16 KiB of headers (hyper answers 431
//!   beyond).
//! - **slow readers**: a response the client does not read for 10 s (no progress writing it)
//!   closes the connection.
//!
//! On shutdown the listener is closed first, then every connection finishes its request in
//! progress (bounded by the same timeouts) and closes.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use futures::StreamExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinSet;
use tower::ServiceExt as _;

/// What one connection, and all of them together, may take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once across the servers sharing a [`Connections`].
    pub max_connections: usize,
    /// Time for a request's headers, from the connection's start or the previous response.
    pub header_read_timeout: Duration,
    /// Time a response may make no progress because the client does not read it.
    pub write_timeout: Duration,
    /// Largest request head (hyper's read buffer; at least 8 KiB).
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 1000,
            header_read_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
        }
    }
}

impl Limits {
    /// The defaults, with the connections capped at a quarter of the soft file-descriptor
    /// limit `nofile` (at least 16).
    pub fn for_fd_limit(nofile: u64) -> Limits {
        let quarter = usize::try_from(nofile / 4).unwrap_or(usize::MAX).max(16);
        let mut limits = Limits::default();
        limits.max_connections = limits.max_connections.min(quarter);
        limits
    }

    /// [`Limits::for_fd_limit`] of this process.
    pub fn for_this_process() -> Limits {
        use nix::sys::resource::{Resource, getrlimit};
        match getrlimit(Resource::RLIMIT_NOFILE) {
            Ok((soft, _)) => Limits::for_fd_limit(soft),
            Err(_) => Limits::default(),
        }
    }
}

/// The connections open across the servers that share it (all of the daemon's, through
/// [`Connections::process`]), with the limits they are held to.
#[derive(Clone)]
pub struct Connections(Arc<Shared>);

struct Shared {
    limits: Limits,
    table: Mutex<Table>,
    /// Woken when a connection leaves the table (its descriptor is closed).
    freed: Notify,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    /// By id, so in the order they were opened.
    open: BTreeMap<u64, Open>,
    /// How many of them were asked to close and are not gone yet.
    closing: usize,
}

struct Open {
    /// Requests of the connection being handled or written.
    in_flight: Arc<AtomicUsize>,
    /// Closes the connection (it is dropped at once); taken once it was asked to close.
    close: Option<oneshot::Sender<()>>,
}

/// A connection admitted into the table; dropping it takes it out.
struct Admitted {
    id: u64,
    in_flight: Arc<AtomicUsize>,
    closed: oneshot::Receiver<()>,
    connections: Connections,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut table = self.connections.lock();
        if table.open.remove(&self.id).is_some_and(|c| c.close.is_none()) {
            table.closing -= 1;
        }
        drop(table);
        self.connections.0.freed.notify_waiters();
    }
}

/// How many connections asked to close may still hold their descriptor while new ones are
/// admitted: beyond, an admission waits for them to be gone, so that the descriptors stay
/// bounded even when the accept loop runs ahead of the closing tasks.
const CLOSING_SLACK: usize = 32;

/// How long an admission waits for the connections it closed to be gone.
const ADMIT_WAIT: Duration = Duration::from_secs(1);

impl Connections {
    pub fn new(limits: Limits) -> Connections {
        Connections(Arc::new(Shared {
            limits,
            table: Mutex::new(Table::default()),
            freed: Notify::new(),
        }))
    }

    /// The one table of this process, with [`Limits::for_this_process`].
    pub fn process() -> &'static Connections {
        static PROCESS: OnceLock<Connections> = OnceLock::new();
        PROCESS.get_or_init(|| Connections::new(Limits::for_this_process()))
    }

    pub fn limits(&self) -> &Limits {
        &self.0.limits
    }

    /// How many connections are open now.
    pub fn open(&self) -> usize {
        self.lock().open.len()
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // The table stays consistent under a panic elsewhere: every change is one call.
        self.0.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits one more connection. When the table is full, asks the oldest one without a
    /// request in progress (and not already closing) to close; the new one is admitted at once
    /// while fewer than [`CLOSING_SLACK`] closed ones still hold their descriptor (they go as
    /// soon as their task runs), else it waits, at most [`ADMIT_WAIT`], for one to be gone.
    /// `None` when every open connection has a request in progress.
    async fn admit(&self) -> Option<Admitted> {
        let deadline = tokio::time::Instant::now() + ADMIT_WAIT;
        let max = self.0.limits.max_connections;
        loop {
            // Registered before looking, so that a place freed meanwhile is not missed.
            let mut freed = pin!(self.0.freed.notified());
            freed.as_mut().enable();
            {
                let mut table = self.lock();
                // Also after a wait: the place another admission's eviction freed may have
                // been taken by this one's, so each one closes again as needed.
                if table.open.len() - table.closing >= max {
                    let victim = table
                        .open
                        .values_mut()
                        .find(|c| c.close.is_some() && c.in_flight.load(Ordering::SeqCst) == 0);
                    let close = victim.and_then(|c| c.close.take())?;
                    let _ = close.send(());
                    table.closing += 1;
                }
                if table.open.len() - table.closing < max && table.open.len() < max + CLOSING_SLACK {
                    return Some(self.insert(&mut table));
                }
            }
            tokio::time::timeout_at(deadline, freed).await.ok()?;
        }
    }

    fn insert(&self, table: &mut Table) -> Admitted {
        let id = table.next_id;
        table.next_id += 1;
        let in_flight = Arc::new(AtomicUsize::new(0));
        let (close, closed) = oneshot::channel();
        let open = Open {
            in_flight: in_flight.clone(),
            close: Some(close),
        };
        table.open.insert(id, open);
        Admitted {
            id,
            in_flight,
            closed,
            connections: self.clone(),
        }
    }
}

/// Serves `router` on `listener` within the process' [`Connections`] until `shutdown`
/// completes; then closes the listener and lets the requests in progress finish.
pub async fn serve<L>(
    listener: L,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()>
where
    L: axum::serve::Listener<Io = TcpStream>,
{
    serve_within(listener, router, shutdown, Connections::process().clone()).await
}

/// [`serve`] within the given connection table.
pub async fn serve_within<L>(
    mut listener: L,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    connections: Connections,
) -> io::Result<()>
where
    L: axum::serve::Listener<Io = TcpStream>,
{
    let (drain, draining) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        tokio::select! {
            (stream, _) = listener.accept() => {
                let admitted = tokio::select! {
                    admitted = connections.admit() => admitted,
                    () = &mut shutdown => break,
                };
                // Beyond the limit with every connection busy: closed at once (dropped).
                if let Some(admitted) = admitted {
                    let limits = connections.limits().clone();
                    tasks.spawn(connection(stream, router.clone(), admitted, limits, draining.clone()));
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    let _ = drain.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Serves one connection until it ends, is evicted, or the server drains.
async fn connection(
    stream: TcpStream,
    router: Router,
    admitted: Admitted,
    limits: Limits,
    mut draining: watch::Receiver<bool>,
) {
    let in_flight = admitted.in_flight.clone();
    // The peer's address is handed to the handlers (the `/debug` endpoints check it).
    let peer = stream.peer_addr().ok();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = InFlight::new(in_flight.clone());
        let router = router.clone();
        async move {
            let mut req = req.map(Body::new);
            if let Some(peer) = peer {
                req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
            }
            let rsp = router.oneshot(req).await?;
            // Busy until the response body has been written (or dropped with the connection).
            Ok::<_, std::convert::Infallible>(rsp.map(|body| {
                Body::from_stream(body.into_data_stream().map(move |chunk| {
                    let _busy = &busy;
                    chunk
                }))
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .keep_alive(true);
    let io = TokioIo::new(WriteDeadline::new(stream, limits.write_timeout));
    let mut conn = pin!(builder.serve_connection(io, service));
    let mut admitted = admitted;
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = &mut admitted.closed => return,
        _ = draining.wait_for(|d| *d) => conn.as_mut().graceful_shutdown(),
    }
    tokio::select! {
        _ = conn => {}
        _ = &mut admitted.closed => {}
    }
}

/// Counts one request in progress while it lives.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn new(count: Arc<AtomicUsize>) -> InFlight {
        count.fetch_add(1, Ordering::SeqCst);
        InFlight(count)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A stream whose writes fail with `TimedOut` once one has made no progress for `timeout`
/// (a client that does not read its response).
struct WriteDeadline {
    inner: TcpStream,
    timeout: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn new(inner: TcpStream, timeout: Duration) -> WriteDeadline {
        WriteDeadline {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// After a write returned Pending: an error once it has been stalled for the timeout.
    fn check_stall(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        ready!(stalled.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client did not read the response",
        )))
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.check_stall(cx),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.check_stall(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    fn limits(max_connections: usize) -> Limits {
        Limits {
            max_connections,
            header_read_timeout: Duration::from_millis(300),
            write_timeout: Duration::from_millis(300),
            ..Limits::default()
        }
    }

    #[test]
    fn the_connection_limit_follows_the_fd_limit() {
        assert_eq!(Limits::for_fd_limit(1 << 20).max_connections, 1000);
        assert_eq!(Limits::for_fd_limit(1024).max_connections, 256);
        assert_eq!(Limits::for_fd_limit(0).max_connections, 16);
    }

    #[tokio::test]
    async fn a_full_table_closes_its_oldest_idle_connection_or_refuses() {
        let c = Connections::new(limits(2));
        let mut first = c.admit().await.expect("room");
        let second = c.admit().await.expect("room");
        second.in_flight.fetch_add(1, Ordering::SeqCst);
        let third = c.admit().await.expect("the idle first one makes room");
        assert_eq!(first.closed.try_recv(), Ok(()), "the oldest idle one is asked to close");
        assert_eq!(c.open(), 3, "it holds its descriptor until its task drops it");
        drop(first);
        assert_eq!(c.open(), 2);
        third.in_flight.fetch_add(1, Ordering::SeqCst);
        assert!(c.admit().await.is_none(), "every open one is busy");
        drop(second);
        assert_eq!(c.open(), 1);
        assert!(c.admit().await.is_some());
    }

    #[tokio::test]
    async fn closed_connections_that_linger_hold_admissions_back() {
        let c = Connections::new(limits(1));
        let mut held = vec![c.admit().await.expect("room")];
        // Each new one closes the previous one, which is kept (its task has not run).
        for _ in 0..CLOSING_SLACK {
            held.push(c.admit().await.expect("within the slack"));
        }
        assert_eq!(c.open(), 1 + CLOSING_SLACK);
        let waiting = tokio::spawn({
            let c = c.clone();
            async move { c.admit().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the slack is used up");
        held.remove(0);
        let admitted = waiting.await.expect("no panic").expect("admitted once one is gone");
        assert_eq!(c.open(), 1 + CLOSING_SLACK);
        drop(admitted);
        // Nothing gone within the wait: refused.
        let started = Instant::now();
        let _last = c.admit().await.expect("one place was freed");
        assert!(c.admit().await.is_none(), "the slack is used up again");
        assert!(started.elapsed() >= ADMIT_WAIT, "{:?}", started.elapsed());
    }

    /// Polls `check` every 10 ms until it holds (at most 2 s).
    async fn until(check: impl Fn() -> bool, what: &str) {
        let polled = tokio::time::timeout(Duration::from_secs(2), async {
            while !check() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        polled.await.unwrap_or_else(|_| panic!("{what} within 2 s"));
    }

    async fn start(max: usize) -> (std::net::SocketAddr, Connections, oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Connections::new(limits(max));
        let router = Router::new().route("/healthz", get(|| async { "ok" }));
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(serve_within(
            listener,
            router,
            async move {
                let _ = stopped.await;
            },
            connections.clone(),
        ));
        (addr, connections, stop)
    }

    async fn get_healthz(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        out
    }

    /// EOF (or a reset) on a connection the server closed, within `within`.
    async fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(tokio::time::timeout(within, s.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
    }

    #[tokio::test]
    async fn idle_and_slow_clients_are_closed_and_a_new_client_gets_in() {
        let (addr, connections, _stop) = start(8).await;
        let mut idle = Vec::new();
        for _ in 0..8 {
            idle.push(TcpStream::connect(addr).await.expect("connect"));
        }
        // A slowloris client: part of a request, never the end of its headers.
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let started = Instant::now();
        let answer = get_healthz(addr).await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
        assert!(connections.open() <= 8, "{}", connections.open());
        // The oldest idle ones were closed to make room; the rest go after the header timeout.
        assert!(closed_by_server(&mut idle[0], Duration::from_millis(100)).await);
        assert!(
            closed_by_server(&mut slow, Duration::from_secs(2)).await,
            "slowloris closed"
        );
        for s in &mut idle {
            assert!(closed_by_server(s, Duration::from_secs(2)).await, "idle closed");
        }
        until(|| connections.open() == 0, "every connection gone").await;
    }

    #[tokio::test]
    async fn keep_alive_serves_several_requests_then_idles_out() {
        let (addr, connections, _stop) = start(4).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        for _ in 0..3 {
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .expect("write");
            let mut buf = vec![0u8; 1024];
            let n = s.read(&mut buf).await.expect("read");
            assert!(String::from_utf8_lossy(&buf[..n]).ends_with("ok"));
        }
        assert_eq!(connections.open(), 1);
        assert!(
            closed_by_server(&mut s, Duration::from_secs(2)).await,
            "idle keep-alive closed"
        );
    }

    #[tokio::test]
    async fn headers_beyond_the_limit_are_refused() {
        let (addr, _connections, _stop) = start(4).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let big = format!(
            "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(40_000)
        );
        let _ = s.write_all(big.as_bytes()).await;
        let mut out = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out)).await;
        assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    }

    #[tokio::test]
    async fn a_client_that_does_not_read_its_response_is_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Connections::new(limits(4));
        let router = Router::new().route("/big", get(|| async { "x".repeat(64 << 20) }));
        tokio::spawn(serve_within(
            listener,
            router,
            std::future::pending(),
            connections.clone(),
        ));
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        // Never read: the response stalls in the socket buffers.
        let started = Instant::now();
        until(|| connections.open() == 1, "the connection admitted").await;
        tokio::time::timeout(Duration::from_secs(3), async {
            while connections.open() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("closed after the write timeout");
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
        drop(s);
    }

    #[tokio::test]
    async fn shutdown_closes_the_listener_and_idle_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let connections = Connections::new(Limits::default());
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        let task = tokio::spawn(serve_within(
            listener,
            Router::new(),
            async move {
                let _ = stopped.await;
            },
            connections.clone(),
        ));
        until(|| connections.open() == 1, "the idle connection admitted").await;
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("serve returns")
            .expect("no panic")
            .expect("no error");
        assert!(closed_by_server(&mut idle, Duration::from_millis(500)).await);
        assert!(TcpStream::connect(addr).await.is_err(), "the listener is closed");
    }
}
