//! Measurements across a [`Network`]: bulk TCP transfers over N parallel streams with a
//! chosen congestion control (an iperf in the same process, so sender and receiver
//! share one clock), TCP round trips, and datagram delivery (loss).
//!
//! Sockets are created on threads inside the regions' namespaces; the work then runs
//! on plain threads, since a socket stays in the namespace it was created in.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::str::FromStr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use socket2::{Domain, Protocol, SockRef, Socket, Type};

use crate::{Network, WanError, sys};

/// Most parallel streams in one transfer.
pub const MAX_STREAMS: usize = 64;
/// Longest transfer.
pub const MAX_TRANSFER_DURATION: Duration = Duration::from_secs(3600);
/// Most round trips or datagrams in one probe.
pub const MAX_PROBES: usize = 100_000;
/// How long connecting, accepting or waiting for a reply may take before the
/// measurement fails: many seconds of retransmitted SYNs on the lossiest link.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a blocked sender or receiver looks at the deadline.
const DEADLINE_CHECK_INTERVAL: Duration = Duration::from_millis(50);
const WRITE_CHUNK_BYTES: usize = 256 * 1024;
/// Receive buffer of the datagram probe: holds every datagram of the largest probe.
const DATAGRAM_RECEIVE_BUFFER_BYTES: usize = 64 << 20;
/// The datagram probe sends this many at once, then pauses for
/// [`DATAGRAM_BURST_INTERVAL`]: about 30,000 small datagrams a second, far below what a
/// link or an emulator carries, so that only the loss model drops them, not the queue
/// in front of the emulator.
const DATAGRAM_BURST: usize = 32;
const DATAGRAM_BURST_INTERVAL: Duration = Duration::from_millis(1);

/// A TCP congestion control algorithm, set per socket (`TCP_CONGESTION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Congestion {
    Cubic,
    Bbr,
    Reno,
}

impl Congestion {
    pub fn name(self) -> &'static str {
        match self {
            Congestion::Cubic => "cubic",
            Congestion::Bbr => "bbr",
            Congestion::Reno => "reno",
        }
    }
}

impl FromStr for Congestion {
    type Err = String;

    fn from_str(name: &str) -> Result<Congestion, String> {
        [Congestion::Cubic, Congestion::Bbr, Congestion::Reno]
            .into_iter()
            .find(|congestion| congestion.name() == name)
            .ok_or_else(|| format!("unknown congestion control {name:?} (cubic, bbr, reno)"))
    }
}

impl std::fmt::Display for Congestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferConfig {
    pub streams: usize,
    pub congestion: Congestion,
    pub duration: Duration,
}

impl TransferConfig {
    pub fn validate(&self) -> Result<(), WanError> {
        if self.streams == 0 || self.streams > MAX_STREAMS {
            return Err(invalid(format!(
                "{} streams is not in 1..=MAX_STREAMS ({MAX_STREAMS})",
                self.streams
            )));
        }
        if self.duration.is_zero() || self.duration > MAX_TRANSFER_DURATION {
            return Err(invalid(format!(
                "a transfer of {:?} is not in (0, MAX_TRANSFER_DURATION = \
                 {MAX_TRANSFER_DURATION:?}]",
                self.duration
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TransferReport {
    pub duration_s: f64,
    pub streams: Vec<StreamReport>,
}

impl TransferReport {
    pub fn bytes(&self) -> u64 {
        self.streams.iter().map(|stream| stream.bytes).sum()
    }

    /// Application bytes delivered per second, all streams together, in Mbit/s.
    pub fn goodput_mbps(&self) -> f64 {
        self.bytes() as f64 * 8.0 / self.duration_s / 1e6
    }

    pub fn retransmitted_segments(&self) -> u64 {
        self.streams
            .iter()
            .map(|stream| u64::from(stream.sender.retransmitted_segments))
            .sum()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct StreamReport {
    /// Bytes the receiver read before the deadline.
    pub bytes: u64,
    pub goodput_mbps: f64,
    /// The sender's view at the deadline.
    pub sender: TcpStats,
}

/// What the kernel knows about a TCP connection (`TCP_INFO`). Fields the running
/// kernel does not report are `None`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TcpStats {
    pub congestion: String,
    pub smoothed_rtt_us: u32,
    pub min_rtt_us: Option<u32>,
    pub cwnd_segments: u32,
    pub mss_bytes: u32,
    pub retransmitted_segments: u32,
    pub bytes_sent: Option<u64>,
    pub bytes_retransmitted: Option<u64>,
    pub delivery_rate_bytes_per_s: Option<u64>,
    /// Segments the receiver reported receiving twice (D-SACK): retransmissions of
    /// segments that were late rather than lost.
    pub duplicates_reported: Option<u32>,
}

/// Offsets in `struct tcp_info` (linux/tcp.h), stable since each field was added.
mod tcp_info {
    pub const SND_MSS: usize = 16;
    pub const RTT: usize = 68;
    pub const SND_CWND: usize = 80;
    pub const TOTAL_RETRANS: usize = 100;
    pub const MIN_RTT: usize = 148;
    pub const DELIVERY_RATE: usize = 160;
    pub const BYTES_SENT: usize = 200;
    pub const BYTES_RETRANS: usize = 208;
    pub const DSACK_DUPS: usize = 216;
}

fn field_u32(bytes: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        bytes.get(offset..offset + 4)?.try_into().ok()?,
    ))
}

fn field_u64(bytes: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(
        bytes.get(offset..offset + 8)?.try_into().ok()?,
    ))
}

impl TcpStats {
    /// Parses raw `TCP_INFO` bytes; `None` if even the oldest fields are missing.
    pub fn parse(info: &[u8], congestion: String) -> Option<TcpStats> {
        Some(TcpStats {
            congestion,
            smoothed_rtt_us: field_u32(info, tcp_info::RTT)?,
            min_rtt_us: field_u32(info, tcp_info::MIN_RTT),
            cwnd_segments: field_u32(info, tcp_info::SND_CWND)?,
            mss_bytes: field_u32(info, tcp_info::SND_MSS)?,
            retransmitted_segments: field_u32(info, tcp_info::TOTAL_RETRANS)?,
            bytes_sent: field_u64(info, tcp_info::BYTES_SENT),
            bytes_retransmitted: field_u64(info, tcp_info::BYTES_RETRANS),
            delivery_rate_bytes_per_s: field_u64(info, tcp_info::DELIVERY_RATE),
            duplicates_reported: field_u32(info, tcp_info::DSACK_DUPS),
        })
    }

    /// Reads the statistics of a connected socket.
    pub fn of(stream: &TcpStream) -> Result<TcpStats, WanError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| WanError::Io { what, source }
        };
        let congestion = SockRef::from(stream)
            .tcp_congestion()
            .map_err(io("reading TCP_CONGESTION"))?;
        let congestion = String::from_utf8_lossy(&congestion)
            .trim_end_matches('\0')
            .to_string();
        let info = sys::tcp_info_bytes(stream).map_err(io("reading TCP_INFO"))?;
        TcpStats::parse(&info, congestion).ok_or_else(|| WanError::Io {
            what: "reading TCP_INFO".into(),
            source: std::io::Error::other(format!("only {} bytes", info.len())),
        })
    }
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> WanError {
    let what = what.into();
    move |source| WanError::Io { what, source }
}

fn invalid(problem: String) -> WanError {
    WanError::InvalidMeasurement(problem)
}

fn check_probe_count(count: usize) -> Result<(), WanError> {
    if count == 0 || count > MAX_PROBES {
        return Err(invalid(format!(
            "{count} probes is not in 1..=MAX_PROBES ({MAX_PROBES})"
        )));
    }
    Ok(())
}

/// A listening TCP socket inside `region`, on its address and an ephemeral port, whose
/// `accept` gives up after [`REPLY_TIMEOUT`].
fn listen_in(network: &Network, region: &str) -> Result<(Socket, SocketAddr), WanError> {
    let address = SocketAddr::from((network.address(region)?, 0));
    let listener = network.run_in(region, move || -> std::io::Result<Socket> {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
        socket.bind(&address.into())?;
        socket.listen(MAX_STREAMS as i32)?;
        socket.set_read_timeout(Some(REPLY_TIMEOUT))?;
        Ok(socket)
    })?;
    let listener = listener.map_err(io_error(format!("listening in {region}")))?;
    let bound = listener
        .local_addr()
        .map_err(io_error("reading a listener's address"))?
        .as_socket()
        .ok_or_else(|| invalid("listener without an IP address".into()))?;
    Ok((listener, bound))
}

fn accept(listener: &Socket) -> Result<TcpStream, WanError> {
    let (socket, _) = listener
        .accept()
        .map_err(io_error("accepting a connection"))?;
    Ok(socket.into())
}

/// Unconnected TCP sockets created inside `region`, each set to `congestion` before it
/// connects, so the handshake already runs under it.
fn sockets_in(
    network: &Network,
    region: &str,
    count: usize,
    congestion: Congestion,
) -> Result<Vec<Socket>, WanError> {
    network
        .run_in(region, move || -> std::io::Result<Vec<Socket>> {
            (0..count)
                .map(|_| {
                    let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
                    socket.set_tcp_congestion(congestion.name().as_bytes())?;
                    Ok(socket)
                })
                .collect()
        })?
        .map_err(io_error(format!(
            "creating {congestion} sockets in {region}"
        )))
}

fn join<T>(handle: JoinHandle<Result<T, WanError>>, what: &str) -> Result<T, WanError> {
    handle
        .join()
        .map_err(|_| WanError::Panicked(what.to_string()))?
}

/// Sends as fast as TCP allows from `from` to `to` over `config.streams` connections
/// for `config.duration`, and reports what the receiver got by the deadline.
pub fn transfer(
    network: &Network,
    from: &str,
    to: &str,
    config: &TransferConfig,
) -> Result<TransferReport, WanError> {
    config.validate()?;
    let (listener, address) = listen_in(network, to)?;
    let sockets = sockets_in(network, from, config.streams, config.congestion)?;
    // Connect all streams at once: one after another would cost a round trip each.
    let connecting: Vec<_> = sockets
        .into_iter()
        .map(|socket| {
            std::thread::spawn(move || -> Result<TcpStream, WanError> {
                socket
                    .connect_timeout(&address.into(), REPLY_TIMEOUT)
                    .map_err(io_error(format!("connecting to {address}")))?;
                Ok(socket.into())
            })
        })
        .collect();
    let accepted: Vec<TcpStream> = (0..config.streams)
        .map(|_| accept(&listener))
        .collect::<Result<_, _>>()?;
    let senders: Vec<TcpStream> = connecting
        .into_iter()
        .map(|handle| join(handle, "connecting"))
        .collect::<Result<_, _>>()?;
    // Pair each sender with the connection the listener accepted for it.
    let mut receivers = Vec::with_capacity(senders.len());
    let mut accepted: Vec<Option<TcpStream>> = accepted.into_iter().map(Some).collect();
    for sender in &senders {
        let local = sender
            .local_addr()
            .map_err(io_error("reading an address"))?;
        let receiver = accepted
            .iter_mut()
            .find(|slot| {
                slot.as_ref()
                    .is_some_and(|stream| stream.peer_addr().ok() == Some(local))
            })
            .and_then(Option::take)
            .ok_or_else(|| invalid(format!("no accepted connection from {local}")))?;
        receivers.push(receiver);
    }

    let start = Instant::now();
    let deadline = start + config.duration;
    let reading: Vec<_> = receivers
        .into_iter()
        .map(|stream| std::thread::spawn(move || receive_until(stream, deadline)))
        .collect();
    let writing: Vec<_> = senders
        .into_iter()
        .map(|stream| std::thread::spawn(move || send_until(stream, deadline)))
        .collect();
    // Senders first: a receiver that closed its end before its sender stopped would
    // reset the connection under the sender's last write.
    let senders: Vec<TcpStats> = writing
        .into_iter()
        .map(|writer| join(writer, "sending"))
        .collect::<Result<_, _>>()?;
    let mut streams = Vec::with_capacity(config.streams);
    for (reader, sender) in reading.into_iter().zip(senders) {
        let (bytes, _still_open) = join(reader, "receiving")?;
        streams.push(StreamReport {
            bytes,
            goodput_mbps: bytes as f64 * 8.0 / config.duration.as_secs_f64() / 1e6,
            sender,
        });
    }
    Ok(TransferReport {
        duration_s: config.duration.as_secs_f64(),
        streams,
    })
}

fn timed_out(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn send_until(mut stream: TcpStream, deadline: Instant) -> Result<TcpStats, WanError> {
    stream
        .set_write_timeout(Some(DEADLINE_CHECK_INTERVAL))
        .map_err(io_error("setting a write timeout"))?;
    let chunk = vec![0x5a; WRITE_CHUNK_BYTES];
    while Instant::now() < deadline {
        match stream.write(&chunk) {
            Ok(_) => {}
            Err(error) if timed_out(&error) || error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(io_error("sending")(error)),
        }
    }
    let stats = TcpStats::of(&stream)?;
    // Unsent data is discarded with the socket; the receiver has stopped counting.
    let _ = stream.shutdown(Shutdown::Both);
    Ok(stats)
}

/// Counts what arrives before `deadline`; returns the count and the stream, still
/// open, so that the caller closes it only once the sender is done.
fn receive_until(mut stream: TcpStream, deadline: Instant) -> Result<(u64, TcpStream), WanError> {
    stream
        .set_read_timeout(Some(DEADLINE_CHECK_INTERVAL))
        .map_err(io_error("setting a read timeout"))?;
    let mut buffer = vec![0u8; WRITE_CHUNK_BYTES];
    let mut bytes = 0u64;
    loop {
        let result = stream.read(&mut buffer);
        if Instant::now() >= deadline {
            return Ok((bytes, stream));
        }
        match result {
            Ok(0) => {
                return Err(invalid(
                    "the sender closed its stream before the deadline".into(),
                ));
            }
            Ok(read) => bytes += read as u64,
            Err(error) if timed_out(&error) || error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(io_error("receiving")(error)),
        }
    }
}

/// `count` one-byte request/response exchanges on one TCP connection (no Nagle) from
/// `from` to `to`; returns each exchange's duration, the round-trip time as an
/// application sees it.
pub fn round_trips(
    network: &Network,
    from: &str,
    to: &str,
    count: usize,
) -> Result<Vec<Duration>, WanError> {
    check_probe_count(count)?;
    let (listener, address) = listen_in(network, to)?;
    let echo = std::thread::spawn(move || -> Result<(), WanError> {
        let mut stream = accept(&listener)?;
        stream
            .set_nodelay(true)
            .map_err(io_error("setting TCP_NODELAY"))?;
        let mut byte = [0u8];
        loop {
            match stream.read(&mut byte) {
                Ok(0) => return Ok(()),
                Ok(_) => stream.write_all(&byte).map_err(io_error("echoing"))?,
                Err(error) => return Err(io_error("reading a probe")(error)),
            }
        }
    });
    let [socket] = <[Socket; 1]>::try_from(sockets_in(network, from, 1, Congestion::Cubic)?)
        .map_err(|_| invalid("expected one socket".into()))?;
    socket
        .connect_timeout(&address.into(), REPLY_TIMEOUT)
        .map_err(io_error(format!("connecting to {address}")))?;
    let mut stream: TcpStream = socket.into();
    stream
        .set_nodelay(true)
        .map_err(io_error("setting TCP_NODELAY"))?;
    stream
        .set_read_timeout(Some(REPLY_TIMEOUT))
        .map_err(io_error("setting a read timeout"))?;
    let mut samples = Vec::with_capacity(count);
    let mut reply = [0u8];
    for _ in 0..count {
        let sent = Instant::now();
        stream
            .write_all(&[1])
            .map_err(io_error("sending a probe"))?;
        stream
            .read_exact(&mut reply)
            .map_err(io_error("waiting for a probe's echo"))?;
        samples.push(sent.elapsed());
    }
    drop(stream);
    join(echo, "echoing")?;
    Ok(samples)
}

/// How many of the datagrams sent arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Delivery {
    pub sent: u64,
    pub received: u64,
}

impl Delivery {
    pub fn loss(&self) -> f64 {
        1.0 - self.received as f64 / self.sent as f64
    }
}

/// Sends `count` UDP datagrams from `from` to `to`, paced, and counts those that
/// arrive. The end is marked by a TCP connection on the same path: the link delivers in order, so
/// once it is accepted every datagram that survived has arrived.
pub fn datagram_delivery(
    network: &Network,
    from: &str,
    to: &str,
    count: usize,
) -> Result<Delivery, WanError> {
    check_probe_count(count)?;
    let target_ip: Ipv4Addr = network.address(to)?;
    let (listener, marker) = listen_in(network, to)?;
    let receiver = network
        .run_in(to, move || -> std::io::Result<UdpSocket> {
            let socket = UdpSocket::bind((target_ip, 0))?;
            sys::force_receive_buffer(&socket, DATAGRAM_RECEIVE_BUFFER_BYTES)?;
            socket.set_nonblocking(true)?;
            Ok(socket)
        })?
        .map_err(io_error(format!("binding a datagram socket in {to}")))?;
    let target = receiver
        .local_addr()
        .map_err(io_error("reading an address"))?;
    let source_ip = network.address(from)?;
    let sender = network
        .run_in(from, move || UdpSocket::bind((source_ip, 0)))?
        .map_err(io_error(format!("binding a datagram socket in {from}")))?;
    for sequence in 0..count as u64 {
        if sequence > 0 && sequence % DATAGRAM_BURST as u64 == 0 {
            std::thread::sleep(DATAGRAM_BURST_INTERVAL);
        }
        sender
            .send_to(&sequence.to_be_bytes(), target)
            .map_err(io_error("sending a datagram"))?;
    }
    let [socket] = <[Socket; 1]>::try_from(sockets_in(network, from, 1, Congestion::Cubic)?)
        .map_err(|_| invalid("expected one socket".into()))?;
    socket
        .connect_timeout(&marker.into(), REPLY_TIMEOUT)
        .map_err(io_error("connecting the end marker"))?;
    let _marker = accept(&listener)?;
    let mut received = 0;
    let mut buffer = [0u8; 64];
    loop {
        match receiver.recv(&mut buffer) {
            Ok(_) => received += 1,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(error) => return Err(io_error("receiving datagrams")(error)),
        }
    }
    Ok(Delivery {
        sent: count as u64,
        received,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn tcp_info_offsets_match_the_c_struct() {
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_snd_mss),
            tcp_info::SND_MSS
        );
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_rtt),
            tcp_info::RTT
        );
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_snd_cwnd),
            tcp_info::SND_CWND
        );
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_total_retrans),
            tcp_info::TOTAL_RETRANS
        );
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_dsack_dups),
            tcp_info::DSACK_DUPS
        );
    }

    #[test]
    fn parses_what_the_kernel_reports_and_no_more() {
        let mut info = vec![0u8; 216];
        info[tcp_info::RTT..tcp_info::RTT + 4].copy_from_slice(&1234u32.to_ne_bytes());
        info[tcp_info::BYTES_RETRANS..tcp_info::BYTES_RETRANS + 8]
            .copy_from_slice(&99u64.to_ne_bytes());
        let stats = TcpStats::parse(&info, "bbr".into()).unwrap();
        assert_eq!(stats.smoothed_rtt_us, 1234);
        assert_eq!(stats.bytes_retransmitted, Some(99));
        let old_kernel = TcpStats::parse(&info[..104], "bbr".into()).unwrap();
        assert_eq!(
            (old_kernel.min_rtt_us, old_kernel.bytes_retransmitted),
            (None, None)
        );
        assert_eq!(TcpStats::parse(&info[..103], "bbr".into()), None);
    }

    #[test]
    fn reads_a_live_connection_on_loopback() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        socket.set_tcp_congestion(b"bbr").unwrap();
        socket
            .connect(&listener.local_addr().unwrap().into())
            .unwrap();
        let mut stream: TcpStream = socket.into();
        let (mut peer, _) = listener.accept().unwrap();
        stream.write_all(&[7; 1000]).unwrap();
        peer.read_exact(&mut [0; 1000]).unwrap();
        let stats = TcpStats::of(&stream).unwrap();
        assert_eq!(stats.congestion, "bbr");
        assert!(stats.mss_bytes > 0 && stats.cwnd_segments > 0, "{stats:?}");
        assert!(
            stats.bytes_sent.is_some_and(|sent| sent >= 1000),
            "{stats:?}"
        );
    }

    #[test]
    fn limits_are_checked_before_anything_starts() {
        let config = |streams, seconds| TransferConfig {
            streams,
            congestion: Congestion::Cubic,
            duration: Duration::from_secs(seconds),
        };
        assert!(config(1, 1).validate().is_ok());
        assert!(config(MAX_STREAMS, 3600).validate().is_ok());
        for (bad, needle) in [
            (config(0, 1), "MAX_STREAMS"),
            (config(MAX_STREAMS + 1, 1), "MAX_STREAMS"),
            (config(1, 0), "MAX_TRANSFER_DURATION"),
            (config(1, 3601), "MAX_TRANSFER_DURATION"),
        ] {
            let error = bad.validate().unwrap_err().to_string();
            assert!(error.contains(needle), "{error}");
        }
        assert!(check_probe_count(MAX_PROBES).is_ok());
        for bad in [0, MAX_PROBES + 1] {
            let error = check_probe_count(bad).unwrap_err().to_string();
            assert!(error.contains("MAX_PROBES"), "{error}");
        }
    }

    #[test]
    fn congestion_names_round_trip() {
        for congestion in [Congestion::Cubic, Congestion::Bbr, Congestion::Reno] {
            assert_eq!(congestion.name().parse(), Ok(congestion));
        }
        assert!("vegas".parse::<Congestion>().unwrap_err().contains("vegas"));
    }
}
