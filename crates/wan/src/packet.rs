//! What the emulator needs to know about a raw IP packet read from a TUN device: its
//! EtherType, and whether its header is consistent enough to hand to a peer.
//!
//! Pure. Anything a process in the namespace can write to the TUN device reaches this
//! code, so every byte is checked and nothing here can panic.

/// EtherType of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETHERTYPE_IPV6: u16 = 0x86dd;

const IPV4_HEADER_MIN_BYTES: usize = 20;
const IPV6_HEADER_BYTES: usize = 40;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("{got}-byte frame is shorter than its virtio_net_hdr")]
    ShortVnetHeader { got: usize },
    #[error("empty packet")]
    Empty,
    #[error("IP version {0} is neither 4 nor 6")]
    Version(u8),
    #[error("{got}-byte packet is shorter than its header ({needed} bytes)")]
    ShortHeader { got: usize, needed: usize },
    #[error("header says {claimed} bytes, packet has {got}")]
    LengthMismatch { claimed: usize, got: usize },
}

/// The EtherType to send `packet` with, if it is a well-formed IPv4 or IPv6 packet
/// whose length fields fit what was read.
pub fn ethertype(packet: &[u8]) -> Result<u16, Malformed> {
    let first = *packet.first().ok_or(Malformed::Empty)?;
    match first >> 4 {
        4 => {
            let header_bytes = usize::from(first & 0x0f) * 4;
            if header_bytes < IPV4_HEADER_MIN_BYTES || packet.len() < header_bytes {
                return Err(Malformed::ShortHeader {
                    got: packet.len(),
                    needed: header_bytes.max(IPV4_HEADER_MIN_BYTES),
                });
            }
            let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
            if total < header_bytes || total > packet.len() {
                return Err(Malformed::LengthMismatch {
                    claimed: total,
                    got: packet.len(),
                });
            }
            Ok(ETHERTYPE_IPV4)
        }
        6 => {
            if packet.len() < IPV6_HEADER_BYTES {
                return Err(Malformed::ShortHeader {
                    got: packet.len(),
                    needed: IPV6_HEADER_BYTES,
                });
            }
            let payload = usize::from(u16::from_be_bytes([packet[4], packet[5]]));
            if IPV6_HEADER_BYTES + payload > packet.len() {
                return Err(Malformed::LengthMismatch {
                    claimed: IPV6_HEADER_BYTES + payload,
                    got: packet.len(),
                });
            }
            Ok(ETHERTYPE_IPV6)
        }
        version => Err(Malformed::Version(version)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ipv4(total: u16, actual: usize) -> Vec<u8> {
        let mut packet = vec![0u8; actual];
        packet[0] = 0x45;
        packet[2..4].copy_from_slice(&total.to_be_bytes());
        packet
    }

    #[test]
    fn accepts_well_formed_ipv4_and_ipv6() {
        assert_eq!(ethertype(&ipv4(60, 60)), Ok(ETHERTYPE_IPV4));
        // Trailing bytes beyond the total length are tolerated (Ethernet padding does
        // the same), the receiving stack trims them.
        assert_eq!(ethertype(&ipv4(46, 60)), Ok(ETHERTYPE_IPV4));
        let mut v6 = vec![0u8; 48];
        v6[0] = 0x60;
        v6[5] = 8;
        assert_eq!(ethertype(&v6), Ok(ETHERTYPE_IPV6));
    }

    #[test]
    fn names_what_is_wrong() {
        assert_eq!(ethertype(&[]), Err(Malformed::Empty));
        assert_eq!(ethertype(&[0x25; 40]), Err(Malformed::Version(2)));
        assert_eq!(
            ethertype(&ipv4(60, 19)),
            Err(Malformed::ShortHeader {
                got: 19,
                needed: 20
            })
        );
        let mut options = ipv4(60, 30);
        options[0] = 0x4f;
        assert_eq!(
            ethertype(&options),
            Err(Malformed::ShortHeader {
                got: 30,
                needed: 60
            })
        );
        let mut tiny_ihl = ipv4(60, 60);
        tiny_ihl[0] = 0x41;
        assert_eq!(
            ethertype(&tiny_ihl),
            Err(Malformed::ShortHeader {
                got: 60,
                needed: 20
            })
        );
        assert_eq!(
            ethertype(&ipv4(61, 60)),
            Err(Malformed::LengthMismatch {
                claimed: 61,
                got: 60
            })
        );
        assert_eq!(
            ethertype(&ipv4(19, 60)),
            Err(Malformed::LengthMismatch {
                claimed: 19,
                got: 60
            })
        );
        let mut v6 = vec![0u8; 48];
        v6[0] = 0x60;
        v6[5] = 9;
        assert_eq!(
            ethertype(&v6),
            Err(Malformed::LengthMismatch {
                claimed: 49,
                got: 48
            })
        );
        assert_eq!(
            ethertype(&v6[..39]),
            Err(Malformed::ShortHeader {
                got: 39,
                needed: 40
            })
        );
    }

    proptest! {
        #[test]
        fn never_panics_and_accepts_only_consistent_lengths(
            bytes in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            if let Ok(kind) = ethertype(&bytes) {
                let claimed = if kind == ETHERTYPE_IPV4 {
                    usize::from(u16::from_be_bytes([bytes[2], bytes[3]]))
                } else {
                    40 + usize::from(u16::from_be_bytes([bytes[4], bytes[5]]))
                };
                prop_assert!(claimed <= bytes.len());
            }
        }
    }
}
