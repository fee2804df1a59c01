//! The few raw Linux calls the emulator and the measurements need: entering a network
//! namespace, TUN devices, packet sockets, an eventfd to wake a thread, `ppoll` with a
//! nanosecond timeout, and `TCP_INFO`. Every `unsafe` block of the crate is here.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Where `ip netns add` puts its namespaces.
pub const NETNS_DIR: &str = "/run/netns";

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// Opens the namespace `ip netns add NAME` created.
pub fn open_netns(name: &str) -> io::Result<OwnedFd> {
    let file = std::fs::File::open(format!("{NETNS_DIR}/{name}"))?;
    Ok(OwnedFd::from(file))
}

/// Moves the calling thread (only it) into the network namespace `netns`.
pub fn enter_netns(netns: &OwnedFd) -> io::Result<()> {
    // SAFETY: setns reads only its arguments; a bad fd is reported as an error.
    check(unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) })?;
    Ok(())
}

fn interface_name(name: &str) -> io::Result<[libc::c_char; libc::IFNAMSIZ]> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a valid interface name"),
        ));
    }
    let mut raw = [0 as libc::c_char; libc::IFNAMSIZ];
    for (slot, &byte) in raw.iter_mut().zip(bytes) {
        *slot = byte as libc::c_char;
    }
    Ok(raw)
}

/// Creates the TUN device `name` in the calling thread's network namespace, opened
/// non-blocking; it lives until the descriptor is closed. Each packet read comes after a
/// `virtio_net_hdr`, and the device offers checksum and TCP/IPv4 segmentation offload,
/// so the stack hands over TCP super-packets of up to 64 KiB (see `crate::gso`).
pub fn create_tun(name: &str) -> io::Result<OwnedFd> {
    let path = c"/dev/net/tun";
    // SAFETY: a valid C string and flags; the result is checked.
    let raw = check(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: open returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    request.ifr_name = interface_name(name)?;
    request.ifr_ifru.ifru_flags =
        (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes one ifreq, which outlives the call.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut request) })?;
    let offloads = libc::TUN_F_CSUM | libc::TUN_F_TSO4;
    // SAFETY: TUNSETOFFLOAD takes its flags by value.
    check(unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            libc::TUNSETOFFLOAD,
            offloads as libc::c_ulong,
        )
    })?;
    Ok(fd)
}

/// Reads one frame; `Ok(None)` when none is waiting.
pub fn read_packet(fd: &OwnedFd, buffer: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: the buffer is valid for writes of its length.
        let read = unsafe { libc::read(fd.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len()) };
        if read >= 0 {
            return Ok(Some(read as usize));
        }
        let error = io::Error::last_os_error();
        match error.kind() {
            io::ErrorKind::WouldBlock => return Ok(None),
            io::ErrorKind::Interrupted => continue,
            _ => return Err(error),
        }
    }
}

/// `PACKET_VNET_HDR` (linux/if_packet.h): frames sent start with a `virtio_net_hdr`.
const PACKET_VNET_HDR: libc::c_int = 15;
/// Destination and source MAC addresses and the EtherType.
pub const ETHERNET_HEADER_BYTES: usize = 14;

/// Sends IP packets out of one Ethernet interface to one MAC address, below IP (no
/// routing, no ARP) but above the interface's queueing discipline, so a rate limit on
/// the interface applies. Each frame starts with a `virtio_net_hdr`, so TCP
/// super-packets go out whole.
pub struct PacketSender {
    fd: OwnedFd,
    address: libc::sockaddr_ll,
    ethernet: [u8; ETHERNET_HEADER_BYTES],
}

impl PacketSender {
    /// A sender on `interface` (in the calling thread's namespace, whose MAC address
    /// is `local_mac`) to `peer_mac`. The socket's send buffer is forced to
    /// `send_buffer_bytes`: packets waiting in the interface's queue count against it,
    /// and the queue must be able to fill.
    pub fn new(
        interface: &str,
        local_mac: [u8; 6],
        peer_mac: [u8; 6],
        send_buffer_bytes: usize,
    ) -> io::Result<Self> {
        let name = CString::new(interface)?;
        // SAFETY: a valid C string.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            return Err(io::Error::last_os_error());
        }
        // A raw socket, since only those take a virtio header. Protocol 0: it receives
        // nothing, so incoming traffic is not copied to it.
        // SAFETY: plain arguments; the result is checked.
        let raw = check(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        })?;
        // SAFETY: socket returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        set_int_option(&fd, libc::SOL_PACKET, PACKET_VNET_HDR, 1)?;
        let size = libc::c_int::try_from(send_buffer_bytes).unwrap_or(libc::c_int::MAX / 2);
        set_int_option(&fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, size)?;
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        address.sll_family = libc::AF_PACKET as libc::c_ushort;
        address.sll_ifindex = index as libc::c_int;
        let mut ethernet = [0u8; ETHERNET_HEADER_BYTES];
        ethernet[..6].copy_from_slice(&peer_mac);
        ethernet[6..12].copy_from_slice(&local_mac);
        Ok(PacketSender {
            fd,
            address,
            ethernet,
        })
    }

    /// Sends `packet` behind `vnet_header` (whose offsets must already count the
    /// Ethernet header) and an Ethernet header with `ethertype`.
    pub fn send(&mut self, vnet_header: &[u8], ethertype: u16, packet: &[u8]) -> io::Result<()> {
        self.ethernet[12..].copy_from_slice(&ethertype.to_be_bytes());
        let mut parts = [
            libc::iovec {
                iov_base: vnet_header.as_ptr() as *mut libc::c_void,
                iov_len: vnet_header.len(),
            },
            libc::iovec {
                iov_base: self.ethernet.as_ptr() as *mut libc::c_void,
                iov_len: self.ethernet.len(),
            },
            libc::iovec {
                iov_base: packet.as_ptr() as *mut libc::c_void,
                iov_len: packet.len(),
            },
        ];
        // SAFETY: msghdr is plain data; all-zero is a valid value.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        message.msg_name = (&mut self.address as *mut libc::sockaddr_ll).cast();
        message.msg_namelen = size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        message.msg_iov = parts.as_mut_ptr();
        message.msg_iovlen = parts.len();
        loop {
            // SAFETY: every pointer in `message` is valid for its length during the
            // call, and sendmsg only reads through them.
            let sent = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &message, 0) };
            if sent >= 0 {
                return Ok(());
            }
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

fn set_int_option(
    fd: &OwnedFd,
    level: libc::c_int,
    option: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the option value is one c_int that outlives the call.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            option,
            (&value as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// Wakes a thread blocked in [`wait_readable`].
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain arguments; the result is checked.
        let raw = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: eventfd returned a fresh descriptor that nothing else owns.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of `one`.
        let written = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if written == 8 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.0
    }
}

/// Blocks until one of `fds` is readable or `timeout` passes (`None`: no timeout);
/// returns which are readable.
pub fn wait_readable<const N: usize>(
    fds: [&OwnedFd; N],
    timeout: Option<Duration>,
) -> io::Result<[bool; N]> {
    let mut polled = fds.map(|fd| libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    });
    let timespec = timeout.map(|timeout| libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    });
    let timeout_ptr = timespec.as_ref().map_or(std::ptr::null(), |timespec| {
        timespec as *const libc::timespec
    });
    // SAFETY: the pollfd array and the timespec outlive the call.
    let result = unsafe {
        libc::ppoll(
            polled.as_mut_ptr(),
            N as libc::nfds_t,
            timeout_ptr,
            std::ptr::null(),
        )
    };
    if result < 0 {
        let error = io::Error::last_os_error();
        if error.kind() == io::ErrorKind::Interrupted {
            return Ok([false; N]);
        }
        return Err(error);
    }
    Ok(polled.map(|fd| fd.revents != 0))
}

/// Lets the kernel wake the calling thread within `slack` of a timeout, instead of the
/// default 50 µs, so delays are released on time.
pub fn set_timer_slack(slack: Duration) -> io::Result<()> {
    let nanos = slack.as_nanos().clamp(1, libc::c_ulong::MAX as u128) as libc::c_ulong;
    // SAFETY: PR_SET_TIMERSLACK takes one integer.
    check(unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, nanos, 0, 0, 0) })?;
    Ok(())
}

/// Whether the process may configure network namespaces (effective user root).
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The raw `struct tcp_info` of a TCP socket (up to 256 bytes, as much as the kernel
/// fills).
pub fn tcp_info_bytes(socket: &impl AsRawFd) -> io::Result<Vec<u8>> {
    let mut buffer = vec![0u8; 256];
    let mut length = buffer.len() as libc::socklen_t;
    // SAFETY: the buffer is valid for `length` bytes, and the kernel writes back how
    // many it filled.
    check(unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buffer.as_mut_ptr().cast(),
            &mut length,
        )
    })?;
    buffer.truncate(length as usize);
    Ok(buffer)
}

/// Sets a socket's receive buffer past `net.core.rmem_max` (root only), so a burst of
/// datagrams waits for the reader instead of being dropped.
pub fn force_receive_buffer(socket: &impl AsRawFd, bytes: usize) -> io::Result<()> {
    let size = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX / 2);
    // SAFETY: the descriptor is borrowed for the call only and not closed.
    let fd = std::mem::ManuallyDrop::new(unsafe { OwnedFd::from_raw_fd(socket.as_raw_fd()) });
    set_int_option(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, size)
}
