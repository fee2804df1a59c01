//! What a driver tells a node, quinn-proto's way: connection events and the results of
//! the effects it asked for come in through `handle_*` (and the few commands below), and
//! everything the node wants done leaves through [`Node::poll`]. The node routes each to
//! its part: an inbound connection is its sender's, an outbound one its receiver's.

use std::time::Instant;

use super::Node;
use crate::frame::{Commit, Frame};
use crate::sender::{ArtifactKey, SenderError, StoredArtifact};
use crate::{ConnId, Identity};

impl Node {
    /// A downstream connected (see [`crate::Sender::accepted`]); a node that serves no
    /// one ignores it (the driver accepts only where it listens).
    pub fn handle_accepted(&mut self, now: Instant, conn: ConnId, peer: Option<Identity>) {
        if let Some(sender) = &mut self.sender {
            sender.accepted(now, conn, peer);
        }
    }

    /// Stream `stream` of upstream session `session` connected as `conn` (its TLS
    /// certificate proving `certified`).
    pub fn handle_connected(
        &mut self,
        now: Instant,
        session: u64,
        stream: u8,
        conn: ConnId,
        certified: Option<Identity>,
    ) {
        if let Some(receiver) = &mut self.receiver {
            receiver.connected(now, session, stream, conn, certified);
        }
    }

    /// Dialing stream `stream` of upstream session `session` failed.
    pub fn handle_dial_failed(&mut self, session: u64, stream: u8, reason: &str) {
        if let Some(receiver) = &mut self.receiver {
            receiver.dial_failed(session, stream, reason);
        }
    }

    /// A frame arrived on `conn`.
    pub fn handle_frame(&mut self, now: Instant, conn: ConnId, frame: Frame) {
        match (&mut self.sender, &mut self.receiver) {
            (Some(sender), _) if sender.serves(conn) => sender.handle_frame(now, conn, frame),
            (_, Some(receiver)) => receiver.handle_frame(now, conn, frame),
            _ => {}
        }
    }

    /// `conn` is gone.
    pub fn handle_closed(&mut self, conn: ConnId) {
        match (&mut self.sender, &mut self.receiver) {
            (Some(sender), _) if sender.serves(conn) => sender.closed(conn),
            (_, Some(receiver)) => receiver.closed(conn),
            _ => {}
        }
    }

    /// Starts upstream session `session` (after [`crate::Output::UpstreamLost`], or the
    /// first), dropping any current one.
    pub fn start_session(&mut self, now: Instant, session: u64) {
        if let Some(receiver) = &mut self.receiver {
            receiver.start_session(now, session);
        }
    }

    /// The control plane has `version` committed (see
    /// [`crate::Receiver::expect_committed`]).
    pub fn expect_committed(&mut self, now: Instant, version: u64) {
        if let Some(receiver) = &mut self.receiver {
            receiver.expect_committed(now, version);
        }
    }

    /// Ends the upstream session for `reason` if there is one (the driver then moves to
    /// another upstream); whether there was.
    pub fn abandon_session(&mut self, reason: &str) -> bool {
        self.receiver
            .as_mut()
            .is_some_and(|receiver| receiver.abandon(reason))
    }

    /// The artifact [`crate::Output::Load`] asked for, or why there is none.
    pub fn loaded(
        &mut self,
        key: ArtifactKey,
        artifact: Result<StoredArtifact, String>,
    ) -> Result<(), SenderError> {
        match &mut self.sender {
            Some(sender) => sender.loaded(key, artifact),
            None => Ok(()),
        }
    }

    /// The artifact [`crate::Output::Load`] asked for cannot be built now (a budget is
    /// spent); it is asked for again later.
    pub fn load_deferred(&mut self, key: ArtifactKey, reason: String) {
        if let Some(sender) = &mut self.sender {
            sender.load_deferred(key, reason);
        }
    }

    /// What the store holds now: its newest version and its snapshots.
    pub fn store_changed(&mut self, latest: Option<u64>, snapshots: impl IntoIterator<Item = u64>) {
        if let Some(sender) = &mut self.sender {
            sender.set_loadable(latest);
            sender.set_snapshots(snapshots);
        }
    }

    /// Announces `commit` to every subscriber.
    pub fn commit(&mut self, commit: Commit) -> Result<(), SenderError> {
        match &mut self.sender {
            Some(sender) => sender.commit(commit),
            None => Ok(()),
        }
    }
}
