//! Connections: socket options, frame reading and writing, and the two tasks that move
//! frames between a socket (plain TCP, or TLS over it) and the node's event loop.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use aurora_proto::frame::{MAX_CONTROL_FRAME_BYTES, PREFIX_BYTES, peek_prefix};
use aurora_proto::{ConnId, Frame, FrameError, Identity};
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::{TlsConnector, TlsStream};

use crate::decode::DecodeBacklog;
use crate::node::Event;
use crate::security::{self, Refusal};

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("connection closed by the peer")]
    Eof,
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("invalid frame: {0}")]
    Frame(#[from] FrameError),
    #[error(
        "the first frame ({frame}, {len} bytes) exceeds the {limit} bytes a Hello may take: \
         nothing larger is read before authentication"
    )]
    FirstFrameTooLarge {
        frame: &'static str,
        len: usize,
        limit: usize,
    },
    #[error("socket error")]
    Io(#[from] std::io::Error),
}

/// The congestion control a socket gets when [`SocketOptions::congestion`] names none.
/// Random loss caps a CUBIC stream far below a long link's rate (the Mathis bound:
/// about 13 Mbps at 0.1% loss and 50 ms RTT), while BBR keeps such a link nearly full
/// on one stream (BENCHMARKS.md, "WAN emulation").
pub const DEFAULT_CONGESTION: &str = "bbr";

/// Socket options for every connection a node opens or accepts.
#[derive(Debug, Clone, Default)]
pub struct SocketOptions {
    /// TCP congestion control algorithm (`cubic`, `bbr`, ...), which must be available.
    /// When unset, [`DEFAULT_CONGESTION`] where the kernel offers it, else the system
    /// default (logged once). Linux only.
    pub congestion: Option<String>,
}

impl SocketOptions {
    pub(crate) fn apply(&self, stream: &TcpStream) -> std::io::Result<()> {
        // Segments are large and written whole; small control frames must not wait.
        stream.set_nodelay(true)?;
        match &self.congestion {
            Some(algorithm) => set_congestion(stream, algorithm)?,
            None => {
                if let Err(error) = set_congestion(stream, DEFAULT_CONGESTION) {
                    static LOGGED: std::sync::Once = std::sync::Once::new();
                    LOGGED.call_once(|| {
                        tracing::warn!(
                            %error,
                            "{DEFAULT_CONGESTION} congestion control unavailable; \
                             sockets keep the system default"
                        );
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(target_os = "linux")]
fn set_congestion(stream: &TcpStream, algorithm: &str) -> std::io::Result<()> {
    socket2::SockRef::from(stream).set_tcp_congestion(algorithm.as_bytes())
}

#[cfg(not(target_os = "linux"))]
fn set_congestion(_stream: &TcpStream, algorithm: &str) -> std::io::Result<()> {
    Err(std::io::Error::other(format!(
        "choosing the congestion control ({algorithm}) needs Linux"
    )))
}

/// The congestion control algorithm a socket uses (for tests and logs).
#[cfg(target_os = "linux")]
pub fn congestion_of(stream: &TcpStream) -> std::io::Result<String> {
    let name = socket2::SockRef::from(stream).tcp_congestion()?;
    Ok(String::from_utf8_lossy(&name)
        .trim_end_matches('\0')
        .to_string())
}

/// Reads one frame. A clean end of stream between frames is [`ConnError::Eof`], one
/// inside a frame [`ConnError::Truncated`]. The prefix is checked against the frame
/// type's limit before the body is read, so an oversized frame allocates nothing.
pub async fn read_frame(reader: &mut (impl AsyncReadExt + Unpin)) -> Result<Frame, ConnError> {
    read_frame_within(reader, usize::MAX).await
}

/// [`read_frame`], refusing a frame whose body is over `limit` bytes whatever its type:
/// the first frame of an inbound connection, read before the peer is authenticated,
/// may be no larger than a Hello ([`FIRST_FRAME_LIMIT`]).
async fn read_frame_within(
    reader: &mut (impl AsyncReadExt + Unpin),
    limit: usize,
) -> Result<Frame, ConnError> {
    let mut prefix = [0u8; PREFIX_BYTES];
    let mut filled = 0;
    while filled < PREFIX_BYTES {
        let n = reader.read(&mut prefix[filled..]).await?;
        if n == 0 {
            return Err(if filled == 0 {
                ConnError::Eof
            } else {
                ConnError::Truncated
            });
        }
        filled += n;
    }
    let (kind, total) = peek_prefix(&prefix)?;
    let len = total - 4;
    if len > limit {
        return Err(ConnError::FirstFrameTooLarge {
            frame: kind.name(),
            len,
            limit,
        });
    }
    let mut buf = BytesMut::zeroed(total);
    buf[..PREFIX_BYTES].copy_from_slice(&prefix);
    reader
        .read_exact(&mut buf[PREFIX_BYTES..])
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => ConnError::Truncated,
            _ => ConnError::Io(e),
        })?;
    let (frame, _) = Frame::decode(&buf.freeze())?;
    Ok(frame)
}

pub async fn write_frame(
    writer: &mut (impl AsyncWriteExt + Unpin),
    frame: &Frame,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(64);
    // A segment's payload is written from its own buffer rather than copied.
    let payload = frame.encode_split(&mut head);
    writer.write_all(&head).await?;
    if let Some(payload) = payload {
        writer.write_all(payload).await?;
    }
    Ok(())
}

/// The largest first frame of an inbound connection: a Hello, as every control frame,
/// fits in [`MAX_CONTROL_FRAME_BYTES`].
pub(crate) const FIRST_FRAME_LIMIT: usize = MAX_CONTROL_FRAME_BYTES;

/// A connected socket, with TLS over it or not (docs/wire-protocol.md §2.1).
pub(crate) enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// What the writer task is asked to do.
pub(crate) enum WriteCmd {
    Frame { frame: Frame, close_after: bool },
}

/// Which way a connection was made, and what that asks of its reader.
pub(crate) enum Direction {
    /// Accepted: its first frame may be no larger than a Hello.
    Inbound,
    /// Dialed to an upstream: every byte read is added to `read_bytes` as it arrives,
    /// and no frame is read while `backlog` is over its limit.
    Upstream {
        read_bytes: Arc<AtomicU64>,
        backlog: Arc<DecodeBacklog>,
    },
}

/// Starts the reader and writer tasks of a connected socket. Frames read go to
/// `events`; frames to write come through the returned sender, whose capacity is the
/// window the state machine already respects (plus room for a few control frames).
/// The abort handle stops the reader when the node closes the connection.
pub(crate) fn spawn_conn(
    tasks: &mut tokio::task::JoinSet<()>,
    conn: ConnId,
    stream: Stream,
    direction: Direction,
    window: usize,
    events: mpsc::Sender<Event>,
) -> (mpsc::Sender<WriteCmd>, tokio::task::AbortHandle) {
    let (tx, rx) = mpsc::channel(window.max(1) + CONTROL_ROOM);
    let (first_limit, read_bytes, backlog) = match direction {
        Direction::Inbound => (FIRST_FRAME_LIMIT, None, None),
        Direction::Upstream {
            read_bytes,
            backlog,
        } => (usize::MAX, Some(read_bytes), Some(backlog)),
    };
    // A plain socket splits into owned halves; a TLS stream's halves share its session.
    let reader = match stream {
        Stream::Plain(stream) => {
            let (reader, writer) = stream.into_split();
            tasks.spawn(write_loop(conn, writer, rx, events.clone()));
            let reader = Counted {
                inner: reader,
                bytes: read_bytes,
            };
            tasks.spawn(read_loop(conn, reader, first_limit, backlog, events))
        }
        Stream::Tls(stream) => {
            let (reader, writer) = tokio::io::split(*stream);
            tasks.spawn(write_loop(conn, writer, rx, events.clone()));
            let reader = Counted {
                inner: reader,
                bytes: read_bytes,
            };
            tasks.spawn(read_loop(conn, reader, first_limit, backlog, events))
        }
    };
    (tx, reader)
}

/// Write-queue slots beyond the window, for the small control frames a receiver sends
/// on its outbound connections.
const CONTROL_ROOM: usize = 16;

/// A reader that counts what it reads as it arrives: one frame may take seconds to
/// arrive whole, and a benchmark samples progress in between.
struct Counted<R> {
    inner: R,
    bytes: Option<Arc<AtomicU64>>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Counted<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Some(bytes) = &this.bytes {
            bytes.fetch_add((buf.filled().len() - before) as u64, Ordering::Relaxed);
        }
        poll
    }
}

async fn read_loop(
    conn: ConnId,
    mut reader: Counted<impl AsyncRead + Unpin>,
    first_limit: usize,
    backlog: Option<Arc<DecodeBacklog>>,
    events: mpsc::Sender<Event>,
) {
    let mut limit = first_limit;
    loop {
        if let Some(backlog) = &backlog {
            backlog.room().await;
        }
        match read_frame_within(&mut reader, limit).await {
            Ok(frame) => {
                limit = usize::MAX;
                if events.send(Event::Frame { conn, frame }).await.is_err() {
                    return;
                }
            }
            Err(error) => {
                if !matches!(error, ConnError::Eof) {
                    tracing::debug!(conn, %error, "connection ended");
                }
                let _ = events
                    .send(Event::Closed {
                        conn,
                        reason: error.to_string(),
                    })
                    .await;
                return;
            }
        }
    }
}

async fn write_loop(
    conn: ConnId,
    mut writer: impl AsyncWrite + Unpin,
    mut commands: mpsc::Receiver<WriteCmd>,
    events: mpsc::Sender<Event>,
) {
    while let Some(WriteCmd::Frame { frame, close_after }) = commands.recv().await {
        // A TLS stream may keep the end of a frame in its buffer when the socket is full:
        // flushed, the frame is on the socket before it is reported sent, and nothing
        // waits for the next frame (perhaps a keepalive, seconds later) to push it out.
        // A plain socket's flush does nothing.
        let written = match write_frame(&mut writer, &frame).await {
            Ok(()) => writer.flush().await,
            Err(error) => Err(error),
        };
        if let Err(error) = written {
            let _ = events
                .send(Event::Closed {
                    conn,
                    reason: format!("write failed: {error}"),
                })
                .await;
            return;
        }
        if events.send(Event::Sent { conn }).await.is_err() {
            return;
        }
        if close_after {
            let _ = writer.shutdown().await;
            return;
        }
    }
    // The node dropped this connection: close our half so the peer sees it.
    let _ = writer.shutdown().await;
}

/// Connects to `address` and, with a TLS connector, completes a handshake that proves
/// the upstream a trainer or a relay of the fleet, all within `timeout`: the stream, and
/// who the upstream's certificate says it is (none in plaintext). The error says why
/// not, with the refusal a failed handshake counts as.
pub(crate) async fn dial(
    address: SocketAddr,
    timeout: Duration,
    options: &SocketOptions,
    tls: Option<&TlsConnector>,
) -> Result<(Stream, Option<Identity>), (String, Option<Refusal>)> {
    let connect = async {
        let stream = TcpStream::connect(address)
            .await
            .map_err(|e| (format!("connecting to {address}: {e}"), None))?;
        options
            .apply(&stream)
            .map_err(|e| (format!("socket options for {address}: {e}"), None))?;
        match tls {
            None => Ok((Stream::Plain(stream), None)),
            Some(connector) => security::connect(connector, stream)
                .await
                .map(|(stream, certified)| (stream, Some(certified)))
                .map_err(|(why, refusal)| {
                    (
                        format!("TLS handshake with {address} failed: {why}"),
                        Some(refusal),
                    )
                }),
        }
    };
    tokio::time::timeout(timeout, connect).await.map_err(|_| {
        (
            format!("connecting to {address} timed out after {timeout:?}"),
            None,
        )
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use aurora_delta::Hash;
    use bytes::Bytes;

    #[tokio::test]
    async fn frames_round_trip_through_a_socket_and_eof_is_clean() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let frames = vec![
            Frame::Keepalive,
            Frame::Segment {
                version: 3,
                index: 9,
                hash: Hash::of(b"payload"),
                bytes: Bytes::from_static(b"payload"),
            },
            Frame::Nack {
                version: 3,
                index: 9,
            },
        ];
        let sent = frames.clone();
        let client = tokio::spawn(async move {
            let mut stream = TcpStream::connect(address).await.unwrap();
            for frame in &sent {
                write_frame(&mut stream, frame).await.unwrap();
            }
        });
        let (mut stream, _) = listener.accept().await.unwrap();
        for frame in &frames {
            assert_eq!(&read_frame(&mut stream).await.unwrap(), frame);
        }
        client.await.unwrap();
        assert!(matches!(read_frame(&mut stream).await, Err(ConnError::Eof)));
    }

    #[tokio::test]
    async fn a_first_frame_larger_than_a_hello_is_refused_before_its_body_is_read() {
        // A Segment frame announcing 1 MiB: fine later on, never as a first frame.
        let mut announced: &[u8] = &[0x00, 0x00, 0x10, 0x00, 0x06];
        let error = read_frame_within(&mut announced, FIRST_FRAME_LIMIT)
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                ConnError::FirstFrameTooLarge {
                    frame: "Segment",
                    len: 0x10_0000,
                    limit: FIRST_FRAME_LIMIT
                }
            ),
            "{error}"
        );
    }

    #[tokio::test]
    async fn an_oversized_or_cut_frame_is_an_error_not_a_wait() {
        let mut oversized: &[u8] = &[0xFF, 0xFF, 0xFF, 0x7F, 0x0C];
        assert!(matches!(
            read_frame(&mut oversized).await,
            Err(ConnError::Frame(FrameError::TooLarge { .. }))
        ));
        let bytes = Frame::Nack {
            version: 1,
            index: 1,
        }
        .to_bytes();
        let mut cut: &[u8] = &bytes[..bytes.len() - 2];
        assert!(matches!(
            read_frame(&mut cut).await,
            Err(ConnError::Truncated)
        ));
        let mut cut_prefix: &[u8] = &bytes[..3];
        assert!(matches!(
            read_frame(&mut cut_prefix).await,
            Err(ConnError::Truncated)
        ));
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn sockets_use_bbr_unless_told_otherwise_where_the_kernel_has_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (Stream::Plain(stream), None) = dial(
            address,
            Duration::from_secs(5),
            &SocketOptions::default(),
            None,
        )
        .await
        .unwrap() else {
            unreachable!("no TLS asked for")
        };
        // Any process may choose an algorithm of this list (root any available one).
        let allowed = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
            .unwrap_or_default();
        let used = congestion_of(&stream).unwrap();
        if allowed
            .split_whitespace()
            .any(|name| name == DEFAULT_CONGESTION)
        {
            assert_eq!(used, DEFAULT_CONGESTION);
        } else {
            // The fallback: the socket still connects, on the system default.
            assert!(!used.is_empty());
        }
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_congestion_control_can_be_chosen() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let options = SocketOptions {
            congestion: Some("reno".into()),
        };
        let (Stream::Plain(stream), None) = dial(address, Duration::from_secs(5), &options, None)
            .await
            .unwrap()
        else {
            unreachable!("no TLS asked for")
        };
        assert_eq!(congestion_of(&stream).unwrap(), "reno");
        let unknown = SocketOptions {
            congestion: Some("no-such-algorithm".into()),
        };
        let Err((error, None)) = dial(address, Duration::from_secs(5), &unknown, None).await else {
            panic!("an unknown algorithm is refused")
        };
        assert!(error.contains("socket options"), "{error}");
    }
}
