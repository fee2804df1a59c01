//! Runs: a node pinned to its run refuses upstreams of another, learns its run only from
//! the trainer's hub, and takes no snapshot older than the control plane told it.

use super::tests::{drain, refused_signature};
use super::*;
use crate::frame::Role;
use crate::testutil::{
    RUN, commit, pinned_receiver, relaying_receiver, snapshot_artifact, trainer_key,
};

/// A Welcome of `role` `peer_id` naming `run`, offering `snapshot`, with `commit`.
fn welcome_of(
    role: Role,
    peer_id: &str,
    run: aurora_delta::RunId,
    snapshot: Option<u64>,
    commit: Option<crate::Commit>,
) -> Frame {
    Frame::Welcome(Welcome {
        protocol_version: PROTOCOL_VERSION,
        role,
        peer_id: peer_id.into(),
        region: "eu".into(),
        latest: None,
        commit,
        snapshot,
        run,
    })
}

/// `r` on a new session 5, stream 0 connected as conn 1 to an upstream whose
/// certificate says `certified`, answered `welcome`; what it did.
fn welcome_on(
    r: &mut Receiver,
    certified: Option<crate::Identity>,
    welcome: Frame,
) -> (Vec<ReceiverEvent>, Vec<(ConnId, Frame)>) {
    let now = Instant::now();
    r.start_session(now, 5);
    r.connected(now, 5, 0, 1, certified);
    drain(r);
    r.handle_frame(now, 1, welcome);
    drain(r)
}

fn ended_by(events: &[ReceiverEvent], needle: &str) -> bool {
    events.iter().any(|e| {
        matches!(e, ReceiverEvent::UpstreamLost { reason } if reason.to_string().contains(needle))
    })
}

const OTHER_RUN: aurora_delta::RunId = aurora_delta::RunId([0x99; 16]);

#[test]
fn a_node_pinned_to_its_run_refuses_an_upstream_of_another_or_of_none() {
    let pinned = || pinned_receiver(1, 1, Some(trainer_key().verifying_key()));
    assert_eq!(pinned().run(), Some(RUN));
    for (run, needle) in [
        (OTHER_RUN, "serves run 99999999"),
        (aurora_delta::RunId::UNKNOWN, "serves run 00000000"),
    ] {
        let mut r = pinned();
        let (events, _) = welcome_on(&mut r, None, welcome_of(Role::Hub, "hub", run, None, None));
        assert!(ended_by(&events, needle), "{events:?}");
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, ReceiverEvent::Connected { .. })),
            "{events:?}"
        );
    }
    let mut r = pinned();
    let (events, _) = welcome_on(
        &mut r,
        None,
        welcome_of(Role::Relay, "relay", RUN, None, None),
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::Connected { .. })),
        "its own run, from a relay: {events:?}"
    );
}

#[test]
fn a_node_with_a_key_learns_its_run_only_from_the_trainer_s_hub() {
    let unpinned_run = || {
        let mut config = ReceiverConfig::new(
            crate::Identity {
                role: Role::Relay,
                peer_id: "relay-eu".into(),
                region: "eu".into(),
            },
            Vec::new(),
        );
        config.trainer_key = Some(trainer_key().verifying_key());
        Receiver::relaying(config)
    };
    // A relay's word for the run is not taken: it could name another run of the key.
    let mut r = unpinned_run();
    let (events, _) = welcome_on(
        &mut r,
        None,
        welcome_of(Role::Relay, "relay-us", RUN, None, None),
    );
    assert!(
        ended_by(&events, "learns its run only from the trainer"),
        "{events:?}"
    );
    assert_eq!(r.run(), None);
    // Nor a hub's Welcome over a link whose certificate is a relay's.
    let relay_certificate = crate::Identity {
        role: Role::Relay,
        peer_id: "relay-us".into(),
        region: "us".into(),
    };
    let mut r = unpinned_run();
    let (events, _) = welcome_on(
        &mut r,
        Some(relay_certificate),
        welcome_of(Role::Hub, "hub", RUN, None, None),
    );
    assert!(
        ended_by(&events, "certificate is relay relay-us's"),
        "{events:?}"
    );
    assert_eq!(r.stats().violations, 1);
    assert_eq!(r.run(), None);
    // The trainer's hub, certified as such: learned, and held from then on.
    let hub_certificate = crate::Identity {
        role: Role::Hub,
        peer_id: "hub".into(),
        region: "hub".into(),
    };
    let mut r = unpinned_run();
    let (events, _) = welcome_on(
        &mut r,
        Some(hub_certificate),
        welcome_of(Role::Hub, "hub", RUN, None, None),
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::Connected { .. })),
        "{events:?}"
    );
    assert_eq!(r.run(), Some(RUN));
    let (events, _) = welcome_on(
        &mut r,
        None,
        welcome_of(Role::Hub, "hub", OTHER_RUN, None, None),
    );
    assert!(ended_by(&events, "serves run 99999999"), "{events:?}");
    // Without a key nothing is signed: the first Welcome's run is taken, as a check
    // against a misconfigured upstream only.
    let mut keyless = relaying_receiver(None);
    assert_eq!(keyless.run(), Some(RUN));
    let (events, _) = welcome_on(
        &mut keyless,
        None,
        welcome_of(Role::Hub, "hub", OTHER_RUN, None, None),
    );
    assert!(ended_by(&events, "serves run"), "{events:?}");
}

#[test]
fn another_run_s_authentic_snapshot_is_refused_though_its_upstream_names_this_run() {
    // What a compromised relay does: it names the joiner's run in its Welcome, and
    // serves version 0 of another run, signed by the same trainer key.
    let key = trainer_key();
    let mut config = ReceiverConfig::new(
        crate::Identity {
            role: Role::Actor,
            peer_id: "7".into(),
            region: "eu".into(),
        },
        Vec::new(),
    );
    config.trainer_key = Some(key.verifying_key());
    config.run = Some(RUN);
    let mut r = Receiver::joining(config);
    welcome_on(
        &mut r,
        None,
        welcome_of(Role::Relay, "relay", RUN, Some(0), None),
    );
    let (bytes, _) = snapshot_artifact(0, 2);
    let file = aurora_delta::DeltaFile::parse(&bytes).unwrap();
    let kind = ArtifactKind::Snapshot;
    let offer = Frame::Offer {
        version: 0,
        kind,
        descriptor: Bytes::from(file.header().encode_pending()),
        signature: Some(crate::offer_signature(&key, &OTHER_RUN, kind, &bytes).unwrap()),
    };
    r.handle_frame(Instant::now(), 1, offer);
    let (events, _) = drain(&mut r);
    assert!(refused_signature(&events), "{events:?}");
    assert!(ended_by(&events, &format!("for run {RUN}")), "{events:?}");
    assert!(r.assemblies.is_empty());
}

#[test]
fn a_joiner_takes_no_snapshot_or_upstream_older_than_the_control_plane_told_it() {
    let key = trainer_key();
    let joiner = || {
        let mut config = ReceiverConfig::new(
            crate::Identity {
                role: Role::Actor,
                peer_id: "7".into(),
                region: "eu".into(),
            },
            Vec::new(),
        );
        config.trainer_key = Some(key.verifying_key());
        config.run = Some(RUN);
        config.join_floor = JoinFloor {
            snapshot: 6,
            commit: 8,
        };
        Receiver::joining(config)
    };
    // Its Hellos say which snapshot it takes at the oldest.
    let mut r = joiner();
    let (_, out) = welcome_on(
        &mut r,
        None,
        welcome_of(Role::Relay, "relay", RUN, Some(6), None),
    );
    let _ = out;
    let now = Instant::now();
    r.start_session(now, 9);
    r.connected(now, 9, 0, 3, None);
    let (_, out) = drain(&mut r);
    assert!(
        out.iter().any(|(_, f)| matches!(
            f,
            Frame::Hello(hello) if hello.snapshot_floor == 6 && hello.active == VersionRef::default()
        )),
        "{out:?}"
    );
    // A relay replaying an old authentic snapshot and commit: refused at its Welcome.
    let old_commit = Some(commit(3, Some(&key)));
    let mut r = joiner();
    let (events, _) = welcome_on(
        &mut r,
        None,
        welcome_of(Role::Relay, "relay", RUN, Some(3), old_commit),
    );
    assert!(ended_by(&events, "has committed version 3"), "{events:?}");
    // A current commit but an old snapshot: refused too.
    let mut r = joiner();
    let (events, _) = welcome_on(
        &mut r,
        None,
        welcome_of(
            Role::Relay,
            "relay",
            RUN,
            Some(3),
            Some(commit(8, Some(&key))),
        ),
    );
    assert!(ended_by(&events, "not one from 6 on"), "{events:?}");
    // The trainer's own offer: the snapshot it names, at the commit it names.
    let mut r = joiner();
    let (events, _) = welcome_on(
        &mut r,
        None,
        welcome_of(Role::Hub, "hub", RUN, Some(6), Some(commit(8, Some(&key)))),
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ReceiverEvent::Connected { .. })),
        "{events:?}"
    );
    assert_eq!(r.taking_snapshot(), Some(6));
}
