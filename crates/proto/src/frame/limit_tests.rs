//! Limits: each frame type's length, segment indices and table sizes, names, tokens,
//! reasons, stream numbers and wants are bounded, and hostile values are named.

// Have-sets are vectors of ranges; a set with one range is not a mistake.
#![allow(clippy::single_range_in_vec_init)]

use super::tests::{decode, hello};
use super::*;

fn with_len(kind: FrameType, len: usize) -> Vec<u8> {
    let mut bytes = (len as u32).to_le_bytes().to_vec();
    bytes.push(kind as u8);
    bytes
}

#[test]
fn every_frame_type_has_its_length_limit() {
    for code in 1..=0x0D {
        let kind = FrameType::from_code(code).unwrap();
        let limit = kind.max_len();
        assert_eq!(
            peek_prefix(&with_len(kind, limit)).unwrap(),
            (kind, 4 + limit)
        );
        assert_eq!(
            peek_prefix(&with_len(kind, limit + 1)).unwrap_err(),
            FrameError::TooLarge {
                frame: kind.name(),
                len: limit + 1,
                limit
            },
            "{kind:?}"
        );
    }
    assert_eq!(FrameType::Segment.max_len(), MAX_FRAME_BYTES);
    assert_eq!(FrameType::Want.max_len(), MAX_WANT_FRAME_BYTES);
    assert_eq!(FrameType::Hello.max_len(), MAX_CONTROL_FRAME_BYTES);
}

#[test]
fn the_largest_segment_fits_its_frame_and_a_larger_one_is_refused() {
    let at_limit = Frame::Segment {
        version: 1,
        index: 0,
        hash: Hash::default(),
        bytes: Bytes::from(vec![0u8; MAX_SEGMENT_BYTES as usize]),
    };
    let bytes = at_limit.to_bytes();
    assert!(bytes.len() - 4 <= MAX_FRAME_BYTES);
    assert_eq!(decode(&bytes).unwrap().1, bytes.len());

    // A declared segment length over the limit, in a frame that is itself in bounds.
    let mut over = Frame::Segment {
        version: 1,
        index: 0,
        hash: Hash::default(),
        bytes: Bytes::new(),
    }
    .to_bytes();
    let len_at = PREFIX_BYTES + 8 + 4 + 32;
    over[len_at..len_at + 4].copy_from_slice(&(MAX_SEGMENT_BYTES + 1).to_le_bytes());
    assert!(matches!(
        decode(&over).unwrap_err(),
        FrameError::LimitExceeded {
            field: "segment length",
            ..
        }
    ));
}

#[test]
fn segment_index_and_table_size_limits() {
    let mut frame = Frame::Segment {
        version: 1,
        index: MAX_TRANSFER_SEGMENTS - 1,
        hash: Hash::default(),
        bytes: Bytes::new(),
    };
    assert!(frame.validate().is_ok());
    if let Frame::Segment { index, .. } = &mut frame {
        *index = MAX_TRANSFER_SEGMENTS;
    }
    assert!(matches!(
        frame.validate().unwrap_err(),
        FrameError::LimitExceeded {
            field: "segment index",
            ..
        }
    ));

    // A Seal claiming more segments than allowed is refused before allocating.
    let mut seal = Frame::Seal {
        version: 1,
        id: Hash::default(),
        target_hash: Hash::default(),
        segments: Vec::new(),
        signature: None,
    }
    .to_bytes();
    let count_at = PREFIX_BYTES + 8 + 32 + 32;
    seal[count_at..count_at + 4].copy_from_slice(&(MAX_TRANSFER_SEGMENTS + 1).to_le_bytes());
    assert!(matches!(
        decode(&seal).unwrap_err(),
        FrameError::LimitExceeded {
            field: "segment count",
            ..
        }
    ));
    // A count within the limit but without the bytes behind it.
    seal[count_at..count_at + 4].copy_from_slice(&1000u32.to_le_bytes());
    assert!(
        decode(&seal)
            .unwrap_err()
            .to_string()
            .contains("segment table needs 36000 bytes")
    );
}

#[test]
fn name_token_reason_and_stream_limits() {
    let check = |mutate: &dyn Fn(&mut Hello), field: &str| {
        let mut h = hello();
        mutate(&mut h);
        let error = Frame::Hello(h).validate().unwrap_err();
        assert!(error.to_string().contains(field), "{field}: {error}");
    };
    check(&|h| h.peer_id = "p".repeat(MAX_NAME_BYTES + 1), "peer id");
    check(&|h| h.region = "r".repeat(MAX_NAME_BYTES + 1), "region");
    check(&|h| h.token = vec![7; MAX_TOKEN_BYTES + 1], "token length");
    check(
        &|h| {
            h.streams = MAX_STREAMS + 1;
            h.stream = 0;
        },
        "streams",
    );
    check(&|h| h.stream = h.streams, "not below the stream count");
    let mut ok = hello();
    ok.peer_id = "p".repeat(MAX_NAME_BYTES);
    ok.token = vec![7; MAX_TOKEN_BYTES];
    ok.streams = MAX_STREAMS;
    assert!(Frame::Hello(ok).validate().is_ok());

    let long = Frame::Goodbye {
        reason: "x".repeat(MAX_REASON_BYTES + 1),
    };
    assert!(long.validate().unwrap_err().to_string().contains("reason"));
    let fits = Frame::Goodbye {
        reason: "x".repeat(MAX_REASON_BYTES),
    };
    assert!(fits.validate().is_ok());
}

#[test]
fn want_limits_and_range_rules() {
    let want = |progress: Vec<Progress>| Frame::Want {
        seq: 1,
        next_version: 1,
        snapshot: false,
        composed: false,
        live_streams: 1,
        epochs: vec![1],
        progress,
    };
    let version = |v: u64, have: Vec<Range<u32>>| Progress {
        version: v,
        has_offer: false,
        has_seal: false,
        composed: false,
        have,
    };
    let many: Vec<Progress> = (1..=MAX_WANT_VERSIONS as u64 + 1)
        .map(|v| version(v, vec![]))
        .collect();
    assert!(want(many[..MAX_WANT_VERSIONS].to_vec()).validate().is_ok());
    assert!(matches!(
        want(many).validate().unwrap_err(),
        FrameError::LimitExceeded {
            field: "version count",
            ..
        }
    ));
    let ranges: Vec<Range<u32>> = (0..MAX_HAVE_RANGES as u32 + 1)
        .map(|i| 2 * i..2 * i + 1)
        .collect();
    let at_limit = want(vec![version(1, ranges[..MAX_HAVE_RANGES].to_vec())]);
    assert!(at_limit.encoded_len() <= MAX_WANT_FRAME_BYTES);
    assert!(at_limit.validate().is_ok());
    assert!(matches!(
        want(vec![version(1, ranges)]).validate().unwrap_err(),
        FrameError::LimitExceeded {
            field: "range count",
            ..
        }
    ));
    for bad in [
        vec![2..2],
        vec![3..4, 1..2],
        vec![0..2, 2..3],
        vec![0..MAX_TRANSFER_SEGMENTS + 1],
    ] {
        let error = want(vec![version(1, bad.clone())]).validate().unwrap_err();
        assert!(error.to_string().contains("have-range"), "{bad:?}: {error}");
    }
    let behind = want(vec![version(0, vec![])]).validate().unwrap_err();
    assert!(behind.to_string().contains("below the next version"));
    let too_many = Frame::Want {
        seq: 1,
        next_version: 1,
        snapshot: false,
        composed: false,
        live_streams: 1,
        epochs: vec![1; MAX_STREAMS as usize + 1],
        progress: vec![],
    };
    assert!(matches!(
        too_many.validate().unwrap_err(),
        FrameError::LimitExceeded {
            field: "epoch count",
            ..
        }
    ));
}

#[test]
fn hostile_values_are_named() {
    let mut bad_magic = Frame::Hello(hello()).to_bytes();
    bad_magic[6] = b'X';
    assert!(
        decode(&bad_magic)
            .unwrap_err()
            .to_string()
            .contains("not an aurora transport")
    );
    let mut bad_role = Frame::Hello(hello()).to_bytes();
    bad_role[PREFIX_BYTES + 12] = 9;
    assert!(
        decode(&bad_role)
            .unwrap_err()
            .to_string()
            .contains("unknown role 9")
    );
    let mut bad_code = Frame::Reject {
        code: RejectCode::Busy,
        reason: String::new(),
    }
    .to_bytes();
    bad_code[PREFIX_BYTES] = 77;
    assert!(
        decode(&bad_code)
            .unwrap_err()
            .to_string()
            .contains("unknown reject code 77")
    );
    let mut bad_utf8 = Frame::Goodbye {
        reason: "ab".into(),
    }
    .to_bytes();
    bad_utf8[PREFIX_BYTES + 2] = 0xFF;
    assert!(
        decode(&bad_utf8)
            .unwrap_err()
            .to_string()
            .contains("not UTF-8")
    );
    let mut bad_flag = Frame::Status {
        active: VersionRef::default(),
        staged: None,
        note: String::new(),
    }
    .to_bytes();
    bad_flag[PREFIX_BYTES + 40] = 2;
    assert!(
        decode(&bad_flag)
            .unwrap_err()
            .to_string()
            .contains("flag 2")
    );
    let mut bad_kind = Frame::Offer {
        version: 1,
        kind: ArtifactKind::Delta,
        descriptor: Bytes::new(),
        signature: None,
    }
    .to_bytes();
    bad_kind[PREFIX_BYTES + 8] = 5;
    assert!(
        decode(&bad_kind)
            .unwrap_err()
            .to_string()
            .contains("unknown artifact kind 5")
    );
}

#[test]
fn the_join_fields_are_bounded() {
    // Want: the flags byte follows the next version; only bits 0 and 1 have a meaning,
    // and not together.
    let want = Frame::Want {
        seq: 1,
        next_version: 4,
        snapshot: true,
        composed: false,
        live_streams: 1,
        epochs: vec![1],
        progress: vec![],
    };
    let flags_at = PREFIX_BYTES + 8 + 8;
    for flags in [0b100, 0x80, 0xFF] {
        let mut bytes = want.to_bytes();
        bytes[flags_at] = flags;
        assert_eq!(
            decode(&bytes).unwrap_err().to_string(),
            format!("Want frame is malformed: unknown want flags {flags:#x}")
        );
    }
    let mut both = want.to_bytes();
    both[flags_at] = 0b11;
    assert!(
        decode(&both)
            .unwrap_err()
            .to_string()
            .contains("a snapshot and composed catch-up at once")
    );
    let mut cleared = want.to_bytes();
    cleared[flags_at] = 0;
    let Frame::Want { snapshot, .. } = decode(&cleared).unwrap().0 else {
        unreachable!()
    };
    assert!(!snapshot);
    // A Want that stops inside its flags is malformed, not incomplete.
    let mut short = want.to_bytes()[..flags_at].to_vec();
    short[..4].copy_from_slice(&((flags_at - 4) as u32).to_le_bytes());
    assert!(
        decode(&short)
            .unwrap_err()
            .to_string()
            .contains("want flags needs 1 bytes but 0 remain")
    );

    // Welcome: the snapshot is an opt64 like `latest`, last in the frame.
    let welcome = Frame::Welcome(Welcome {
        protocol_version: 1,
        role: Role::Hub,
        peer_id: "h".into(),
        region: "".into(),
        latest: None,
        commit: None,
        snapshot: Some(3),
        run: RunId::UNKNOWN,
    });
    let bytes = welcome.to_bytes();
    let flag_at = bytes.len() - 9;
    let mut bad = bytes.clone();
    bad[flag_at] = 2;
    assert!(
        decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("snapshot version flag 2 is not 0 or 1")
    );
    let mut cut = bytes[..flag_at + 1].to_vec();
    cut[..4].copy_from_slice(&((flag_at + 1 - 4) as u32).to_le_bytes());
    assert!(matches!(
        decode(&cut).unwrap_err(),
        FrameError::Malformed {
            frame: "Welcome",
            ..
        }
    ));
    let mut longer = bytes.clone();
    longer.push(0);
    longer[..4].copy_from_slice(&((bytes.len() + 1 - 4) as u32).to_le_bytes());
    assert!(
        decode(&longer)
            .unwrap_err()
            .to_string()
            .contains("1 bytes left after the last field")
    );

    // Offer: kinds 1, 2 and 3 exist, no other.
    for code in [0u8, 4, 0xFF] {
        let mut bytes = Frame::Offer {
            version: 1,
            kind: ArtifactKind::Snapshot,
            descriptor: Bytes::new(),
            signature: None,
        }
        .to_bytes();
        bytes[PREFIX_BYTES + 8] = code;
        assert!(
            decode(&bytes)
                .unwrap_err()
                .to_string()
                .contains(&format!("unknown artifact kind {code}"))
        );
    }
}
