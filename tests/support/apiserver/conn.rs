//! The test API server's connections: a listener whose connections can all be reset at once.

use super::*;

pub(super) struct GatedListener {
    pub(super) inner: TcpListener,
    pub(super) shared: Arc<Shared>,
}

impl axum::serve::Listener for GatedListener {
    type Io = KillableIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (KillableIo, SocketAddr) {
        loop {
            let Ok((stream, addr)) = self.inner.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            // Read the kill generation before the flag: `set_unavailable` sets the flag before
            // bumping the generation, so a connection either sees the flag or gets killed.
            let kill = self.shared.kill.subscribe();
            let generation = *kill.borrow();
            if self.shared.unavailable.load(Ordering::SeqCst) {
                let _ = stream.set_zero_linger();
                drop(stream);
                continue;
            }
            return (KillableIo::new(stream, kill, generation), addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A TCP stream that fails (and is reset) once the kill generation moves on.
pub(super) struct KillableIo {
    stream: TcpStream,
    killed: Pin<Box<dyn Future<Output = ()> + Send>>,
    dead: bool,
}

impl KillableIo {
    pub(super) fn new(stream: TcpStream, mut kill: watch::Receiver<u64>, generation: u64) -> KillableIo {
        let killed = Box::pin(async move {
            let _ = kill.wait_for(|g| *g != generation).await;
        });
        KillableIo {
            stream,
            killed,
            dead: false,
        }
    }

    pub(super) fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.dead && self.killed.as_mut().poll(cx).is_ready() {
            self.dead = true;
            // RST rather than FIN when the connection is dropped.
            let _ = self.stream.set_zero_linger();
        }
        if self.dead {
            Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "reset by the test API server",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for KillableIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(cx)?;
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
