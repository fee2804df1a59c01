//! Connections: socket options, frame reading and writing, and the two tasks that move
//! frames between a socket (plain TCP, or TLS over it) and the node's event loop.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use aurora_proto::frame::{
    MAX_CONTROL_FRAME_BYTES, PREFIX_BYTES, Side, peek_prefix, peek_prefix_from,
};
use aurora_proto::{ConnId, Frame, FrameError, Identity};
use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::{TlsConnector, TlsStream};

use crate::decode::DecodeBacklog;
use crate::node::Event;
use crate::security::{self, Limits, Refusal};

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
    #[error(
        "a {frame} frame of {len} bytes was still arriving after {waited:?} ({received} bytes \
         in): a subscriber's frame that slow holds a buffer for nothing"
    )]
    FrameTimeout {
        frame: &'static str,
        len: usize,
        received: usize,
        waited: Duration,
    },
    #[error("socket error")]
    Io(#[from] std::io::Error),
}

impl ConnError {
    /// How a refused frame counts, where it was refused for what it was (not for a lost
    /// link): its kind or place, its size, or its pace.
    pub(crate) fn refusal(&self) -> Option<Refusal> {
        match self {
            ConnError::Frame(FrameError::WrongSide { .. } | FrameError::OutOfPlace { .. }) => {
                Some(Refusal::FrameKind)
            }
            ConnError::Frame(FrameError::TooLarge { .. })
            | ConnError::FirstFrameTooLarge { .. } => Some(Refusal::FrameSize),
            ConnError::FrameTimeout { .. } => Some(Refusal::FrameTimeout),
            _ => None,
        }
    }
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

/// Reads one frame of any kind. A clean end of stream between frames is
/// [`ConnError::Eof`], one inside a frame [`ConnError::Truncated`]. The prefix is
/// checked against the frame type's limit before the body is read, so an oversized
/// frame allocates nothing.
pub async fn read_frame(reader: &mut (impl AsyncReadExt + Unpin)) -> Result<Frame, ConnError> {
    read_checked(reader, &ReadRules::any(), false).await
}

/// What a connection's reader takes from its peer (docs/security.md §4).
#[derive(Clone, Debug)]
pub(crate) struct ReadRules {
    /// Which end the peer is: its frames must be of the kinds that end sends, in their
    /// place, within that end's sizes. `None`: any frame (tools and tests).
    from: Option<Side>,
    /// The largest first frame: before authentication, no more than a Hello.
    first_limit: usize,
    /// How long a frame may take from its first byte, by its length; `None`: as long
    /// as it takes (an upstream's segments cross slow links; its sessions are judged by
    /// their progress instead, `aurora_proto::ReceiverConfig::behind_timeout`).
    deadline: Option<Limits>,
}

impl ReadRules {
    fn any() -> ReadRules {
        ReadRules {
            from: None,
            first_limit: usize::MAX,
            deadline: None,
        }
    }
}

/// Reads one frame as `rules` say, `first` on its connection or not. The prefix decides
/// before any of the body is read whether the frame is taken (its kind, place and
/// size); the body is read into a buffer that grows with what arrives, not with what
/// the prefix announced, and, where a deadline applies, whole within it.
async fn read_checked(
    reader: &mut (impl AsyncReadExt + Unpin),
    rules: &ReadRules,
    first: bool,
) -> Result<Frame, ConnError> {
    let mut prefix = [0u8; PREFIX_BYTES];
    // Between frames the peer may be silent as long as it likes.
    let n = reader.read(&mut prefix).await?;
    if n == 0 {
        return Err(ConnError::Eof);
    }
    let started = tokio::time::Instant::now();
    let rest = async {
        let mut filled = n;
        while filled < PREFIX_BYTES {
            let n = reader.read(&mut prefix[filled..]).await?;
            if n == 0 {
                return Err(ConnError::Truncated);
            }
            filled += n;
        }
        let (kind, total) = match rules.from {
            Some(from) => peek_prefix_from(&prefix, from, first)?,
            None => peek_prefix(&prefix)?,
        };
        let len = total - 4;
        if first && len > rules.first_limit {
            return Err(ConnError::FirstFrameTooLarge {
                frame: kind.name(),
                len,
                limit: rules.first_limit,
            });
        }
        Ok((kind, total))
    };
    let within = |budget: Duration| started + budget;
    let (kind, total) = match &rules.deadline {
        Some(limits) => tokio::time::timeout_at(within(limits.frame_read_timeout), rest)
            .await
            .map_err(|_| ConnError::FrameTimeout {
                frame: "(prefix)",
                len: PREFIX_BYTES,
                received: n,
                waited: limits.frame_read_timeout,
            })??,
        None => rest.await?,
    };
    let mut buf = BytesMut::with_capacity(total.min(BODY_CHUNK));
    buf.extend_from_slice(&prefix);
    let body = async {
        while buf.len() < total {
            if buf.capacity() == buf.len() {
                buf.reserve((total - buf.len()).min(buf.len().max(BODY_CHUNK)));
            }
            let room = (total - buf.len()).min(buf.capacity() - buf.len());
            let n = reader.read_buf(&mut (&mut buf).limit(room)).await?;
            if n == 0 {
                return Err(ConnError::Truncated);
            }
        }
        Ok(())
    };
    match &rules.deadline {
        Some(limits) => {
            let budget = limits.frame_deadline(total);
            match tokio::time::timeout_at(within(budget), body).await {
                Ok(read) => read?,
                Err(_) => {
                    return Err(ConnError::FrameTimeout {
                        frame: kind.name(),
                        len: total,
                        received: buf.len(),
                        waited: budget,
                    });
                }
            }
        }
        None => body.await?,
    }
    let (frame, _) = Frame::decode(&buf.freeze())?;
    Ok(frame)
}

/// The first allocation of a frame's buffer, and the least it grows by: a frame's
/// memory follows what arrived, so an announced size costs nothing until it is sent.
const BODY_CHUNK: usize = 64 << 10;

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
    /// Accepted from a subscriber: its first frame may be no larger than a Hello, every
    /// frame must be one a downstream sends, in its place, and arrive whole within
    /// `limits`' frame deadline.
    Inbound { limits: Limits },
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
    let (rules, read_bytes, backlog) = match direction {
        Direction::Inbound { limits } => (
            ReadRules {
                from: Some(Side::Downstream),
                first_limit: FIRST_FRAME_LIMIT,
                deadline: Some(limits),
            },
            None,
            None,
        ),
        Direction::Upstream {
            read_bytes,
            backlog,
        } => (
            ReadRules {
                from: Some(Side::Upstream),
                first_limit: usize::MAX,
                deadline: None,
            },
            Some(read_bytes),
            Some(backlog),
        ),
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
            tasks.spawn(read_loop(conn, reader, rules.clone(), backlog, events))
        }
        Stream::Tls(stream) => {
            let (reader, writer) = tokio::io::split(*stream);
            tasks.spawn(write_loop(conn, writer, rx, events.clone()));
            let reader = Counted {
                inner: reader,
                bytes: read_bytes,
            };
            tasks.spawn(read_loop(conn, reader, rules.clone(), backlog, events))
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
    rules: ReadRules,
    backlog: Option<Arc<DecodeBacklog>>,
    events: mpsc::Sender<Event>,
) {
    let mut first = true;
    loop {
        if let Some(backlog) = &backlog {
            backlog.room().await;
        }
        match read_checked(&mut reader, &rules, first).await {
            Ok(frame) => {
                first = false;
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
                        refusal: error.refusal(),
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
                    refusal: None,
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
        let rules = ReadRules {
            first_limit: FIRST_FRAME_LIMIT,
            ..ReadRules::any()
        };
        let error = read_checked(&mut announced, &rules, true)
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

    /// The rules of a hub's or relay's inbound connection, with the default limits.
    fn inbound() -> ReadRules {
        ReadRules {
            from: Some(Side::Downstream),
            first_limit: FIRST_FRAME_LIMIT,
            deadline: Some(Limits::default()),
        }
    }

    #[tokio::test]
    async fn a_subscriber_s_frame_of_a_kind_it_never_sends_is_refused_at_its_prefix() {
        // What an actor did to grow a hub by 240 MiB: Segment frames announcing 60 MiB
        // each, their bodies never sent. Refused at the five bytes of the prefix.
        let mut segment: &[u8] = &[0x00, 0x00, 0xC0, 0x03, 0x06];
        let error = read_checked(&mut segment, &inbound(), false)
            .await
            .unwrap_err();
        assert!(
            matches!(
                &error,
                ConnError::Frame(FrameError::WrongSide {
                    frame: "Segment",
                    ..
                })
            ),
            "{error}"
        );
        assert_eq!(error.refusal(), Some(Refusal::FrameKind));
        // A second Hello is out of its place; a Want over the largest one is too large.
        let mut hello = Vec::new();
        Frame::Keepalive.encode(&mut hello);
        hello[4] = 0x01;
        let error = read_checked(&mut &hello[..], &inbound(), false)
            .await
            .unwrap_err();
        assert_eq!(error.refusal(), Some(Refusal::FrameKind), "{error}");
        let over = (aurora_proto::frame::MAX_DOWNSTREAM_FRAME_BYTES as u32 + 1).to_le_bytes();
        let want = [over[0], over[1], over[2], over[3], 0x04];
        let error = read_checked(&mut &want[..], &inbound(), false)
            .await
            .unwrap_err();
        assert_eq!(error.refusal(), Some(Refusal::FrameSize), "{error}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscriber_s_frame_must_arrive_whole_within_its_deadline_but_silence_between_frames_is_free()
     {
        let limits = Limits::default();
        let (mut peer, mut node) = tokio::io::duplex(1 << 20);
        let reader = tokio::spawn(async move {
            let first = read_checked(&mut node, &inbound(), false).await;
            let second = read_checked(&mut node, &inbound(), false).await;
            (first, second)
        });
        // An hour of silence, then a whole frame: taken.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        write_frame(&mut peer, &Frame::Keepalive).await.unwrap();
        // Then a Nack's prefix and half its body, and nothing more.
        let mut nack = Vec::new();
        Frame::Nack {
            version: 3,
            index: 1,
        }
        .encode(&mut nack);
        peer.write_all(&nack[..9]).await.unwrap();
        let started = tokio::time::Instant::now();
        let (first, second) = reader.await.unwrap();
        assert!(matches!(first, Ok(Frame::Keepalive)), "{first:?}");
        let error = second.unwrap_err();
        assert!(
            matches!(
                error,
                ConnError::FrameTimeout {
                    frame: "Nack",
                    received: 9,
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(error.refusal(), Some(Refusal::FrameTimeout));
        let waited = started.elapsed();
        assert!(waited >= limits.frame_read_timeout, "{waited:?}");
        // Paused time moves by whole milliseconds.
        let deadline = limits.frame_deadline(nack.len()) + Duration::from_millis(1);
        assert!(waited <= deadline, "{waited:?}");
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
