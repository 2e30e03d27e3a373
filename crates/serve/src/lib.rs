//! HTTP serving fit to expose. Every agentstack server (environments, models, the hub)
//! answers through [`serve`] rather than `axum::serve`, which has no header-read
//! timeout and no connection cap: a client that opens connections and never finishes a
//! request head would hold each of them, and a file descriptor, forever.
//!
//! [`serve`] speaks HTTP/1.1 (with upgrades, so WebSockets work) and bounds what a
//! client can hold:
//! - a request head must arrive within [`Limits::header_read_timeout`], counted from
//!   when the connection opens or its previous response ended, so a slow or idle
//!   connection is closed;
//! - at most [`Limits::max_connections`] connections are open at once, a WebSocket for
//!   its whole life; past that, new connections wait in the listen backlog until one
//!   closes.
//!
//! Handlers see the peer's address as axum's `ConnectInfo<SocketAddr>`.
//!
//! [`auth`] is the API-key check the servers that change state or read files put in
//! front of every route but `/health`. [`HOP_BY_HOP_HEADERS`] names the headers a proxy
//! (the load balancer, the foreign-environment bridge) must not pass on.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use agentstack_serve::{Limits, serve};
//! use axum::{Router, routing::get};
//!
//! let app = Router::new().route("/health", get(|| async { "ok" }));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! serve(listener, app, Limits::default(), async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tower::ServiceExt;

pub mod auth;

/// Headers that belong to one connection, not to the request or response it carries
/// (RFC 9110, 7.6.1), in lowercase: a proxy drops them, and those the `Connection`
/// header names, rather than pass them on to the other side.
pub const HOP_BY_HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// What one client may hold of a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest time to receive a whole request head (request line and headers),
    /// counted from when the connection opens or its previous response ended; then the
    /// connection is closed. This also bounds how long an idle keep-alive connection
    /// is kept.
    pub header_read_timeout: Duration,
    /// Most connections open at once, WebSockets included for their whole life. When
    /// reached, the server stops accepting until one closes (new clients wait in the
    /// listen backlog).
    pub max_connections: usize,
}

impl Limits {
    /// The default [`Limits::header_read_timeout`]: 10 s, as a slow client on a real
    /// network needs far less, and one that takes longer is holding the connection.
    pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
    /// The default [`Limits::max_connections`] for a request/response server.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: Self::DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves; then stops
/// accepting, lets every connection finish the request it is answering, and returns
/// once all are closed (an upgraded connection, such as a WebSocket, is its handler's
/// to close).
///
/// # Panics
/// If `limits.max_connections` is 0 or larger than the number of permits a tokio
/// semaphore holds.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    assert!(
        limits.max_connections > 0,
        "max_connections must be at least 1"
    );
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let (stop_tx, stop_rx) = watch::channel(false);
    // Each connection's task holds a sender; when all are dropped, all have closed.
    let (open_tx, mut open_rx) = mpsc::channel::<Infallible>(1);
    let mut full = false;
    tokio::pin!(shutdown);
    loop {
        if slots.available_permits() == 0 && !full {
            tracing::warn!(
                max_connections = limits.max_connections,
                "connection limit reached; new connections wait until one closes"
            );
        }
        full = slots.available_permits() == 0;
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of file descriptors, most likely: wait rather than spin.
                    tracing::error!(error = %e, "accepting a connection failed");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        () = &mut shutdown => break,
                    }
                }
            },
            () = &mut shutdown => break,
        };
        // Replies are often single small frames: send each at once rather than waiting
        // on Nagle's algorithm for an ACK.
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(Held {
            stream,
            _slot: slot,
        });
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            router.clone().oneshot(request)
        });
        let connection = http.serve_connection(io, service).with_upgrades();
        let mut stop = stop_rx.clone();
        let open = open_tx.clone();
        tokio::spawn(async move {
            tokio::pin!(connection);
            let stopped = async move {
                let _ = stop.wait_for(|stop| *stop).await;
            };
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = stopped => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(open);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_tx);
    let _ = open_rx.recv().await;
    Ok(())
}

/// Errors of one connection that leave the listener fine (as axum's `serve` treats them).
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// A connection holding one of the server's slots until it is dropped, wherever it
/// went: the HTTP connection, or the handler an upgrade handed it to.
struct Held {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl AsyncRead for Held {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Held {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The test-side half of a server's connection, for tests of limits across crates.
pub mod probe {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Opens a connection to `addr`, sends `partial` (an unfinished request head, or
    /// nothing) and returns how long the server took to close it, or `None` if it was
    /// still open after `give_up`.
    pub async fn time_to_close(
        addr: SocketAddr,
        partial: &[u8],
        give_up: Duration,
    ) -> std::io::Result<Option<Duration>> {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(partial).await?;
        let start = Instant::now();
        let mut buf = [0u8; 1024];
        let closed = tokio::time::timeout(give_up, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    // A 408 or other answer may come first; the close follows.
                    Ok(_) => {}
                }
            }
        })
        .await;
        Ok(closed.ok().map(|()| start.elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use axum::Router;
    use axum::extract::ConnectInfo;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::oneshot;

    use super::{Limits, probe, serve};

    /// The header-read timeout of the tests that exercise it.
    const SHORT: Duration = Duration::from_millis(300);
    /// How much later than a timeout the close may come on a loaded 2-core machine.
    const SLACK: Duration = Duration::from_secs(3);

    fn app() -> Router {
        Router::new()
            .route("/", get(|| async { "ok" }))
            .route(
                "/peer",
                get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
            )
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(SHORT * 3).await;
                    "slow"
                }),
            )
    }

    /// A server on a free loopback port; dropping the sender stops it.
    async fn start(
        limits: Limits,
    ) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            serve(listener, app(), limits, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        (addr, stop, task)
    }

    /// Sends one request on `stream` and reads its whole answer (`Connection: close`).
    async fn get_on(stream: &mut TcpStream, path: &str) -> String {
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    async fn fetch(addr: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        get_on(&mut stream, path).await
    }

    fn short() -> Limits {
        Limits {
            header_read_timeout: SHORT,
            ..Limits::default()
        }
    }

    #[tokio::test]
    async fn answers_requests_and_tells_handlers_the_peer() {
        let (addr, _stop, _) = start(short()).await;
        let answer = fetch(addr, "/").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok"), "{answer}");
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let local = stream.local_addr().unwrap().to_string();
        let answer = get_on(&mut stream, "/peer").await;
        assert!(answer.ends_with(&local), "{answer} should end with {local}");
    }

    #[tokio::test]
    async fn an_unfinished_request_head_is_closed_after_the_header_timeout() {
        let (addr, _stop, _) = start(short()).await;
        let took = probe::time_to_close(addr, b"GET / HTTP/1.1\r\nHost: te", SHORT + SLACK)
            .await
            .unwrap()
            .expect("a slow request head must not hold the connection");
        assert!(
            took >= SHORT / 2,
            "closed after {took:?}, before the timeout"
        );
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_header_timeout() {
        let (addr, _stop, _) = start(short()).await;
        let took = probe::time_to_close(addr, b"", SHORT + SLACK)
            .await
            .unwrap();
        assert!(
            took.is_some(),
            "a connection that sends nothing must be closed"
        );
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed_after_the_header_timeout() {
        let (addr, _stop, _) = start(short()).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        let start = Instant::now();
        let mut answer = Vec::new();
        let closed = tokio::time::timeout(SHORT + SLACK, stream.read_to_end(&mut answer)).await;
        assert!(
            closed.is_ok(),
            "an idle keep-alive connection must be closed"
        );
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"));
        assert!(start.elapsed() >= SHORT / 2);
    }

    #[tokio::test]
    async fn a_request_that_runs_longer_than_the_header_timeout_still_completes() {
        let (addr, _stop, _) = start(short()).await;
        let answer = fetch(addr, "/slow").await;
        assert!(answer.ends_with("slow"), "{answer}");
    }

    #[tokio::test]
    async fn connections_past_the_cap_wait_until_one_closes() {
        let limits = Limits {
            header_read_timeout: Duration::from_secs(30),
            max_connections: 2,
        };
        let (addr, _stop, _) = start(limits).await;
        let held: Vec<TcpStream> = vec![
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        // Both are accepted (and hold the two slots) before the third arrives.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let third = tokio::spawn(async move { fetch(addr, "/").await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !third.is_finished(),
            "a third connection was served past the cap of 2"
        );
        drop(held);
        let answer = tokio::time::timeout(SLACK, third)
            .await
            .expect("the waiting connection is served once a slot frees")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn shutdown_returns_with_an_idle_connection_open() {
        let limits = Limits {
            header_read_timeout: Duration::from_secs(30),
            ..Limits::default()
        };
        let (addr, stop, task) = start(limits).await;
        let _idle = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(stop);
        tokio::time::timeout(SLACK, task)
            .await
            .expect("serve returns after shutdown")
            .unwrap();
    }
}
