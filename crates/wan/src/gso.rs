//! TCP segmentation offload through the emulator: frames carry a `virtio_net_hdr`, and
//! a TCP "super-packet" of up to 64 KiB stands for many wire packets of one MSS each.
//!
//! Passing super-packets through whole is what lets one core emulate gigabits (one
//! read and one send per 64 KiB instead of per 1.5 KiB). Loss still applies to each
//! wire packet: when some segments of a super-packet are lost, [`segment`] cuts it into
//! its wire packets exactly as the kernel's GSO would (same sequence numbers, IP ids,
//! flags and checksums) and only the survivors go on.
//!
//! Pure; every offset is checked, so a malformed frame is an error, never a panic.

use crate::packet::Malformed;

/// Size of `struct virtio_net_hdr` (without `num_buffers`), the header the TUN device
/// and the packet socket put before each packet.
pub const VNET_HEADER_BYTES: usize = 10;

/// `VIRTIO_NET_HDR_F_NEEDS_CSUM`: `csum_start` and `csum_offset` are meaningful.
const NEEDS_CSUM: u8 = 1;
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;
/// Set on top of a GSO type when the super-packet carries ECN marks.
const GSO_ECN: u8 = 0x80;

const IPPROTO_TCP: u8 = 6;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;

/// The fields of a `virtio_net_hdr` (native byte order: the legacy layout the TUN
/// device and packet sockets use unless told otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VnetHeader {
    pub flags: u8,
    pub gso_type: u8,
    pub header_bytes: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHeader {
    pub fn parse(frame: &[u8]) -> Result<(VnetHeader, &[u8]), Malformed> {
        let (header, packet) = frame
            .split_first_chunk::<VNET_HEADER_BYTES>()
            .ok_or(Malformed::ShortVnetHeader { got: frame.len() })?;
        let u16_at = |offset: usize| u16::from_ne_bytes([header[offset], header[offset + 1]]);
        Ok((
            VnetHeader {
                flags: header[0],
                gso_type: header[1],
                header_bytes: u16_at(2),
                gso_size: u16_at(4),
                csum_start: u16_at(6),
                csum_offset: u16_at(8),
            },
            packet,
        ))
    }

    pub fn to_bytes(self) -> [u8; VNET_HEADER_BYTES] {
        let mut bytes = [0u8; VNET_HEADER_BYTES];
        bytes[0] = self.flags;
        bytes[1] = self.gso_type;
        for (offset, value) in [
            (2, self.header_bytes),
            (4, self.gso_size),
            (6, self.csum_start),
            (8, self.csum_offset),
        ] {
            bytes[offset..offset + 2].copy_from_slice(&value.to_ne_bytes());
        }
        bytes
    }

    /// The same header for the frame with an Ethernet header of `link_header_bytes`
    /// in front: offsets count from the frame's first byte, which a TUN device puts at
    /// the IP header and a raw packet socket at the Ethernet header.
    pub fn behind_link_header(self, link_header_bytes: u16) -> VnetHeader {
        let shift = |offset: u16| match offset {
            0 => 0,
            offset => offset.saturating_add(link_header_bytes),
        };
        VnetHeader {
            header_bytes: shift(self.header_bytes),
            csum_start: if self.flags & NEEDS_CSUM != 0 {
                self.csum_start.saturating_add(link_header_bytes)
            } else {
                self.csum_start
            },
            ..self
        }
    }

    fn is_gso(&self) -> bool {
        self.gso_type & !GSO_ECN != GSO_NONE
    }
}

/// A TCP/IPv4 super-packet taken apart.
struct TcpSuperPacket<'a> {
    ip_header: &'a [u8],
    tcp_header: &'a [u8],
    payload: &'a [u8],
    mss: usize,
}

fn tcp_super_packet<'a>(header: &VnetHeader, packet: &'a [u8]) -> Option<TcpSuperPacket<'a>> {
    if header.gso_type & !GSO_ECN != GSO_TCPV4 || header.gso_size == 0 {
        return None;
    }
    let first = *packet.first()?;
    if first >> 4 != 4 || *packet.get(9)? != IPPROTO_TCP {
        return None;
    }
    let ip_bytes = usize::from(first & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([*packet.get(2)?, *packet.get(3)?]));
    let tcp_bytes = usize::from(*packet.get(ip_bytes + 12)? >> 4) * 4;
    let headers = ip_bytes.checked_add(tcp_bytes)?;
    if ip_bytes < 20 || tcp_bytes < 20 || total < headers || total > packet.len() {
        return None;
    }
    Some(TcpSuperPacket {
        ip_header: &packet[..ip_bytes],
        tcp_header: &packet[ip_bytes..headers],
        payload: &packet[headers..total],
        mss: usize::from(header.gso_size),
    })
}

/// How many wire packets the frame stands for: one, or one per MSS of a TCP
/// super-packet.
pub fn wire_packets(header: &VnetHeader, packet: &[u8]) -> usize {
    if !header.is_gso() {
        return 1;
    }
    match tcp_super_packet(header, packet) {
        Some(tcp) => tcp.payload.len().div_ceil(tcp.mss).max(1),
        None => 1,
    }
}

/// The wire packets of a TCP super-packet whose index `keep` accepts, with complete
/// checksums (so each goes with a plain [`VnetHeader::default`]); `None` if the frame
/// is not a TCP/IPv4 super-packet this function can cut.
pub fn segment(
    header: &VnetHeader,
    packet: &[u8],
    keep: impl Fn(usize) -> bool,
) -> Option<Vec<Vec<u8>>> {
    let tcp = tcp_super_packet(header, packet)?;
    let count = tcp.payload.len().div_ceil(tcp.mss).max(1);
    let ip_id = u16::from_be_bytes([tcp.ip_header[4], tcp.ip_header[5]]);
    let sequence = u32::from_be_bytes(tcp.tcp_header[4..8].try_into().ok()?);
    let mut packets = Vec::new();
    for (index, payload) in tcp.payload.chunks(tcp.mss).enumerate() {
        if !keep(index) {
            continue;
        }
        let length = tcp.ip_header.len() + tcp.tcp_header.len() + payload.len();
        let mut packet = Vec::with_capacity(length);
        packet.extend_from_slice(tcp.ip_header);
        let tcp_start = packet.len();
        packet.extend_from_slice(tcp.tcp_header);
        packet.extend_from_slice(payload);

        let ip = &mut packet[..tcp_start];
        ip[2..4].copy_from_slice(&(length as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&ip_id.wrapping_add(index as u16).to_be_bytes());
        ip[10..12].copy_from_slice(&[0, 0]);
        let ip_checksum = !fold(sum(ip));
        ip[10..12].copy_from_slice(&ip_checksum.to_be_bytes());
        let addresses: [u8; 8] = ip[12..20].try_into().ok()?;

        let segment_tcp = &mut packet[tcp_start..];
        let offset = (index * tcp.mss) as u32;
        segment_tcp[4..8].copy_from_slice(&sequence.wrapping_add(offset).to_be_bytes());
        // The kernel's rule: CWR only on the first segment, FIN and PSH only on the last.
        if index != 0 {
            segment_tcp[13] &= !TCP_CWR;
        }
        if index != count - 1 {
            segment_tcp[13] &= !(TCP_FIN | TCP_PSH);
        }
        segment_tcp[16..18].copy_from_slice(&[0, 0]);
        let tcp_length = segment_tcp.len() as u16;
        let pseudo = sum(&addresses) + u32::from(IPPROTO_TCP) + u32::from(tcp_length);
        let tcp_checksum = !fold(pseudo + sum(segment_tcp));
        segment_tcp[16..18].copy_from_slice(&tcp_checksum.to_be_bytes());
        packets.push(packet);
    }
    Some(packets)
}

/// The 32-bit one's-complement accumulation of big-endian 16-bit words (RFC 1071).
fn sum(bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    let mut total: u64 = chunks
        .by_ref()
        .map(|pair| u64::from(u16::from_be_bytes([pair[0], pair[1]])))
        .sum();
    if let [last] = chunks.remainder() {
        total += u64::from(*last) << 8;
    }
    // Fold the carries into 32 bits so callers can keep adding.
    while total > u64::from(u32::MAX) {
        total = (total & 0xffff_ffff) + (total >> 32);
    }
    total as u32
}

fn fold(mut total: u32) -> u16 {
    while total > 0xffff {
        total = (total & 0xffff) + (total >> 16);
    }
    total as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A TCP/IPv4 super-packet as the kernel hands it over.
    fn super_packet(payload: &[u8], flags: u8) -> Vec<u8> {
        let mut packet = vec![
            0x45,
            0,
            0,
            0,
            0x12,
            0x34,
            0x40,
            0,
            64,
            IPPROTO_TCP,
            0,
            0,
            198,
            18,
            0,
            1,
            198,
            18,
            0,
            2,
        ];
        let tcp = [
            0x1f, 0x90, 0xc3, 0x50, 0xff, 0xff, 0xff, 0x00, 0, 0, 0, 1, 0x50, flags, 0xff, 0xff,
            0xab, 0xcd, 0, 0,
        ];
        packet.extend_from_slice(&tcp);
        packet.extend_from_slice(payload);
        let total = packet.len() as u16;
        packet[2..4].copy_from_slice(&total.to_be_bytes());
        packet
    }

    fn gso(mss: u16) -> VnetHeader {
        VnetHeader {
            flags: NEEDS_CSUM,
            gso_type: GSO_TCPV4,
            header_bytes: 40,
            gso_size: mss,
            csum_start: 20,
            csum_offset: 16,
        }
    }

    fn checksum_is_valid(bytes: &[u8], pseudo: u32) -> bool {
        fold(pseudo + sum(bytes)) == 0xffff
    }

    #[test]
    fn header_round_trips_and_short_frames_are_malformed() {
        let header = gso(1448);
        let mut frame = header.to_bytes().to_vec();
        frame.extend_from_slice(&[1, 2, 3]);
        assert_eq!(VnetHeader::parse(&frame), Ok((header, &[1u8, 2, 3][..])));
        assert_eq!(
            VnetHeader::parse(&frame[..9]),
            Err(Malformed::ShortVnetHeader { got: 9 })
        );
    }

    #[test]
    fn offsets_move_behind_an_ethernet_header() {
        assert_eq!(
            gso(1448).behind_link_header(14),
            VnetHeader {
                header_bytes: 54,
                csum_start: 34,
                ..gso(1448)
            }
        );
        // Without NEEDS_CSUM, csum_start means nothing; an unknown length stays unknown.
        assert_eq!(
            VnetHeader::default().behind_link_header(14),
            VnetHeader::default()
        );
    }

    #[test]
    fn counts_wire_packets() {
        let packet = super_packet(&[0; 3000], TCP_PSH);
        assert_eq!(wire_packets(&gso(1448), &packet), 3);
        assert_eq!(wire_packets(&gso(1500), &packet), 2);
        assert_eq!(wire_packets(&VnetHeader::default(), &packet), 1);
        // An ECN-marked super-packet is still one.
        let mut ecn = gso(1000);
        ecn.gso_type |= GSO_ECN;
        assert_eq!(wire_packets(&ecn, &packet), 3);
        // Not cuttable: counted as one.
        assert_eq!(wire_packets(&gso(0), &packet), 1);
        assert_eq!(wire_packets(&gso(1448), &packet[..30]), 1);
    }

    #[test]
    fn refuses_what_it_cannot_cut() {
        let packet = super_packet(&[0; 3000], 0);
        assert!(segment(&VnetHeader::default(), &packet, |_| true).is_none());
        assert!(segment(&gso(0), &packet, |_| true).is_none());
        let mut udp = packet.clone();
        udp[9] = 17;
        assert!(segment(&gso(1448), &udp, |_| true).is_none());
        let mut long = packet.clone();
        long[2..4].copy_from_slice(&4000u16.to_be_bytes());
        assert!(segment(&gso(1448), &long, |_| true).is_none());
        let mut bad_offset = packet.clone();
        bad_offset[32] = 0x10;
        assert!(segment(&gso(1448), &bad_offset, |_| true).is_none());
        let mut tcpv6 = gso(1448);
        tcpv6.gso_type = 4;
        assert!(segment(&tcpv6, &packet, |_| true).is_none());
    }

    #[test]
    fn keeps_only_the_segments_asked_for_with_kernel_flags() {
        let payload: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let packet = super_packet(&payload, TCP_PSH | TCP_FIN | TCP_CWR | 0x10);
        let segments = segment(&gso(1448), &packet, |index| index != 1).unwrap();
        assert_eq!(segments.len(), 2);
        let first = &segments[0];
        assert_eq!(first[40..], payload[..1448]);
        assert_eq!(first[33], TCP_CWR | 0x10, "first: CWR, no FIN or PSH");
        let last = &segments[1];
        assert_eq!(last[40..], payload[2896..]);
        assert_eq!(
            last[33],
            TCP_PSH | TCP_FIN | 0x10,
            "last: FIN and PSH, no CWR"
        );
        assert_eq!(last[4..6], [0x12, 0x36], "IP id advances per segment");
        assert_eq!(
            u32::from_be_bytes(last[24..28].try_into().unwrap()),
            0xffff_ff00u32.wrapping_add(2896),
            "sequence numbers wrap"
        );
    }

    proptest! {
        /// Every segment is a valid packet (IP and TCP checksums, lengths), no segment
        /// exceeds the MSS, and together they carry the payload in order.
        #[test]
        fn segments_are_valid_packets_that_rebuild_the_payload(
            payload in proptest::collection::vec(any::<u8>(), 1..20_000),
            mss in 1u16..3000,
        ) {
            let packet = super_packet(&payload, TCP_PSH);
            let segments = segment(&gso(mss), &packet, |_| true).unwrap();
            prop_assert_eq!(segments.len(), wire_packets(&gso(mss), &packet));
            let mut rebuilt = Vec::new();
            let mut expected_sequence = 0xffff_ff00u32;
            for packet in &segments {
                prop_assert_eq!(crate::packet::ethertype(packet), Ok(crate::packet::ETHERTYPE_IPV4));
                prop_assert_eq!(usize::from(u16::from_be_bytes([packet[2], packet[3]])), packet.len());
                prop_assert!(checksum_is_valid(&packet[..20], 0));
                let pseudo = sum(&packet[12..20]) + 6 + (packet.len() as u32 - 20);
                prop_assert!(checksum_is_valid(&packet[20..], pseudo));
                prop_assert_eq!(u32::from_be_bytes(packet[24..28].try_into().unwrap()), expected_sequence);
                let segment_payload = &packet[40..];
                prop_assert!(segment_payload.len() <= usize::from(mss));
                expected_sequence = expected_sequence.wrapping_add(segment_payload.len() as u32);
                rebuilt.extend_from_slice(segment_payload);
            }
            prop_assert_eq!(rebuilt, payload);
        }

        #[test]
        fn never_panics_on_arbitrary_frames(
            frame in proptest::collection::vec(any::<u8>(), 0..300),
            mss in any::<u16>(),
            gso_type in any::<u8>(),
        ) {
            let mut header = gso(mss);
            header.gso_type = gso_type;
            let _ = VnetHeader::parse(&frame);
            let _ = wire_packets(&header, &frame);
            let _ = segment(&header, &frame, |index| index % 2 == 0);
        }
    }
}
