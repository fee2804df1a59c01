//! The inbound side of a sender: connections arriving and leaving, the handshake, and
//! what a subscriber's Wants and Nacks change in the state it is served from.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use super::artifacts::ArtifactKey;
use super::session::{Conn, SegState, Session};
use super::{MAX_COMPOSED_PER_TARGET, MAX_RETIRED_SESSIONS, Sender, SenderEvent};
use crate::frame::{
    Frame, Hello, MAX_STREAMS, PROTOCOL_VERSION, Progress, RejectCode, Role, VersionRef, Welcome,
};
use crate::{ConnId, Identity, ranges};

impl Sender {
    /// A downstream connected at `now` (for a TLS connection, when the TCP connection
    /// was accepted: the handshake timeout covers the TLS handshake and the Hello); its
    /// first frame must be a Hello. `peer` is the identity its TLS certificate proves,
    /// none over plaintext: with [`crate::Auth::Certificate`] the Hello must name it.
    pub fn accepted(&mut self, now: Instant, conn: ConnId, peer: Option<Identity>) {
        self.conns.insert(
            conn,
            Conn {
                peer,
                session: None,
                stream: 0,
                epoch: 0,
                in_flight: VecDeque::new(),
                direct: VecDeque::new(),
                opened_at: now,
                last_send: now,
                stalled_since: None,
                closing: false,
                late: false,
            },
        );
    }

    /// Whether `conn` is one of this sender's inbound connections.
    pub(crate) fn serves(&self, conn: ConnId) -> bool {
        self.conns.contains_key(&conn)
    }

    /// The driver finished writing one frame on `conn`.
    pub fn on_sent(&mut self, now: Instant, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.in_flight.pop_front();
            c.stalled_since = None;
            c.last_send = now;
        }
    }

    /// `conn` is gone. Its session keeps the segments it carried as sent until the
    /// subscriber's next Want says what actually arrived.
    pub fn closed(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        if let Some(held) = &mut self.held_hellos {
            held.retain(|(held, _)| *held != conn);
        }
        let Some(id) = c.session else { return };
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if session.streams.get(c.stream as usize) == Some(&Some(conn)) {
            session.streams[c.stream as usize] = None;
        }
        if session.streams.iter().all(Option::is_none) {
            self.sessions.remove(&id);
            self.retire(id);
            self.evict();
        }
    }

    pub fn handle_frame(&mut self, now: Instant, conn: ConnId, frame: Frame) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if c.closing {
            return;
        }
        let Some(session_id) = c.session else {
            match frame {
                Frame::Hello(hello) => self.on_hello(now, conn, hello),
                other => self.refuse(
                    conn,
                    RejectCode::Refused,
                    format!(
                        "the first frame must be Hello, not {}",
                        other.frame_type().name()
                    ),
                ),
            }
            return;
        };
        match frame {
            Frame::Want {
                seq,
                next_version,
                snapshot,
                composed,
                live_streams,
                epochs,
                progress,
            } => {
                let session = self.sessions.get_mut(&session_id).expect("conn has it");
                if session.last_want.is_some_and(|last| seq <= last) {
                    // Overtaken by a later Want on another stream, which says more.
                    return;
                }
                session.last_want = Some(seq);
                // A deferred load is tried again for whoever wants it next: the Want of
                // a receiver back from its backoff, or of another session moving on.
                self.deferred.clear();
                let snapshot = snapshot.then_some(next_version);
                let composed = self.composed_choice(session_id, next_version, composed, &progress);
                self.measure_delivery(now, session_id, next_version);
                self.on_want(
                    session_id,
                    next_version,
                    (snapshot, composed),
                    live_streams,
                    &epochs,
                    progress,
                );
            }
            Frame::Nack { version, index } => self.on_nack(session_id, version, index),
            Frame::Status {
                active,
                staged,
                note,
            } => {
                let peer_id = self.sessions[&session_id].peer_id.clone();
                self.events.push_back(SenderEvent::Status {
                    peer_id,
                    active,
                    staged,
                    note,
                });
            }
            Frame::Keepalive => {}
            Frame::Goodbye { reason } => {
                tracing::debug!(conn, reason, "downstream said goodbye");
                // The driver drops the connection on this Close without reporting it
                // closed: the session forgets it now, and ends with its last stream,
                // instead of lingering until its stall timeout.
                self.closed(conn);
                self.events.push_back(SenderEvent::Close { conn, reason });
            }
            other => self.drop_session(
                session_id,
                format!(
                    "protocol violation: a downstream sent {}",
                    other.frame_type().name()
                ),
            ),
        }
    }

    fn refuse(&mut self, conn: ConnId, code: RejectCode, reason: String) {
        tracing::info!(conn, ?code, reason, "refusing a connection");
        if let Some(c) = self.conns.get_mut(&conn) {
            c.direct.push_back((Frame::Reject { code, reason }, true));
            c.closing = true;
        }
    }

    pub(super) fn on_hello(&mut self, now: Instant, conn: ConnId, hello: Hello) {
        if let Some(held) = &mut self.held_hellos {
            // A connection that says Hello twice is answered once, for its last.
            held.retain(|(c, _)| *c != conn);
            held.push((conn, hello));
            return;
        }
        if hello.protocol_version != PROTOCOL_VERSION {
            return self.refuse(
                conn,
                RejectCode::Version,
                format!(
                    "protocol version {} is not supported: this {} speaks version {PROTOCOL_VERSION} (target hashes in seals); upgrade the {} to the same aurora release",
                    hello.protocol_version, self.config.identity.role, hello.role
                ),
            );
        }
        if hello.flags != 0 {
            return self.refuse(
                conn,
                RejectCode::Refused,
                format!("unknown Hello flags {:#x}", hello.flags),
            );
        }
        let certified = self.conns.get(&conn).and_then(|c| c.peer.as_ref());
        if let Err(refusal) = self.config.auth.check(certified, &hello) {
            self.stats.refused_auth += 1;
            return self.refuse(conn, RejectCode::Auth, refusal.to_string());
        }
        if hello.role == Role::Hub {
            return self.refuse(
                conn,
                RejectCode::Refused,
                "a hub does not subscribe to anyone".into(),
            );
        }
        if let Some(reason) = &self.suspended {
            return self.refuse(conn, RejectCode::Busy, reason.clone());
        }
        match self.sessions.get(&hello.session) {
            Some(existing) if existing.peer_id != hello.peer_id => {
                return self.refuse(
                    conn,
                    RejectCode::Refused,
                    format!("session {} belongs to another peer", hello.session),
                );
            }
            Some(existing) if existing.streams.len() != hello.streams as usize => {
                return self.refuse(
                    conn,
                    RejectCode::Refused,
                    format!(
                        "session {} was opened with {} streams, not {}",
                        hello.session,
                        existing.streams.len(),
                        hello.streams
                    ),
                );
            }
            None if self.sessions.len() >= self.config.max_sessions => {
                return self.refuse(
                    conn,
                    RejectCode::Busy,
                    format!("at the limit of {} sessions", self.config.max_sessions),
                );
            }
            _ => {}
        }
        if let Some(reason) = self.stale(&hello) {
            self.stats.refused_stale += 1;
            return self.refuse(conn, RejectCode::Refused, reason);
        }
        debug_assert!(hello.streams <= MAX_STREAMS, "checked by the decoder");
        let session = self.sessions.entry(hello.session).or_insert_with(|| {
            self.events.push_back(SenderEvent::Subscribed {
                peer_id: hello.peer_id.clone(),
                role: hello.role,
                region: hello.region.clone(),
                session: hello.session,
            });
            Session {
                peer_id: hello.peer_id.clone(),
                streams: vec![None; hello.streams as usize],
                epochs: vec![0; hello.streams as usize],
                next_version: None,
                snapshot: None,
                composed: None,
                last_want: None,
                versions: BTreeMap::new(),
                control: VecDeque::new(),
                blocked: false,
                nacks: 0,
                delivery: None,
            }
        });
        session.epochs[hello.stream as usize] = hello.epoch;
        // A reconnecting stream replaces the connection it had.
        if let Some(old) = session.streams[hello.stream as usize].replace(conn) {
            self.events.push_back(SenderEvent::Close {
                conn: old,
                reason: "replaced by a new connection of the same stream".into(),
            });
            self.conns.remove(&old);
        }
        let joiner = hello.role == Role::Actor && hello.active == VersionRef::default();
        // A snapshot older than the joiner was told the trainer offers is no use to it
        // (it would refuse it): none is offered, and it goes on to its next upstream.
        let snapshot = self
            .snapshot_offer()
            .filter(|&offered| offered >= hello.snapshot_floor);
        if joiner && snapshot.is_none() {
            // An actor with no weights, which wants a snapshot: a relay whose own was
            // withdrawn, or is older than the joiner takes, takes a newer one for the
            // next ([`crate::RelayOptions::keep_snapshots`]).
            if self.kept_snapshot.is_none() {
                self.kept_wanted = true;
            } else if self.kept_snapshot < Some(hello.snapshot_floor) {
                self.kept_wanted = true;
                self.kept_outdated = true;
            }
        }
        let welcome = Frame::Welcome(Welcome {
            protocol_version: PROTOCOL_VERSION,
            role: self.config.identity.role,
            peer_id: self.config.identity.peer_id.clone(),
            region: self.config.identity.region.clone(),
            latest: self.latest(),
            commit: self.commit,
            snapshot,
            run: self.run.unwrap_or_default(),
        });
        let c = self.conns.get_mut(&conn).expect("handle_frame checked");
        c.session = Some(hello.session);
        c.stream = hello.stream;
        c.epoch = hello.epoch;
        c.last_send = now;
        c.direct.push_back((welcome, false));
    }

    /// Why `hello` is a replay, if it is: it names a session that has ended here, or a
    /// stream of a live session at an epoch not above the one already welcomed (a
    /// downstream counts up the epoch of every connection it makes on a stream). Either
    /// would take over or revive what the peer has moved on from.
    fn stale(&self, hello: &Hello) -> Option<String> {
        if self.retired.contains(&hello.session) {
            return Some(format!(
                "session {} of peer '{}' has ended: a new session takes a new id",
                hello.session, hello.peer_id
            ));
        }
        let session = self.sessions.get(&hello.session)?;
        let welcomed = *session.epochs.get(hello.stream as usize)?;
        (hello.epoch <= welcomed).then(|| {
            format!(
                "stream {} of session {} is at epoch {welcomed}: a Hello of epoch {} from \
                 peer '{}' is stale",
                hello.stream, hello.session, hello.epoch, hello.peer_id
            )
        })
    }

    /// Remembers that session `id` ended, so that no Hello revives it; the oldest of
    /// [`MAX_RETIRED_SESSIONS`] are forgotten.
    pub(super) fn retire(&mut self, id: u64) {
        if self.retired.len() == MAX_RETIRED_SESSIONS
            && let Some(oldest) = self.retired_order.pop_front()
        {
            self.retired.remove(&oldest);
        }
        if self.retired.insert(id) {
            self.retired_order.push_back(id);
        }
    }

    /// The composed delta a Want of session `id` at `next_version` is served, if any: a
    /// store-backed sender, a Want that accepts one, and at least two versions to go
    /// (one behind, it would be the stored delta itself). Its target is the store's
    /// latest, or the one the session is being served already (a transfer resumes): a
    /// subscriber does not choose it. A target the driver declined from this base or an
    /// earlier one is replayed instead. A composed delta is a build (a model rebuilt
    /// twice, then a delta extracted), so what one peer can ask for is bounded
    /// (docs/security.md §4): one at a time per peer, however many sessions or bases it
    /// tries, and [`MAX_COMPOSED_PER_TARGET`] bases per target for every peer together;
    /// beyond either, the session replays the deltas.
    fn composed_choice(
        &mut self,
        id: u64,
        next_version: u64,
        accepted: bool,
        progress: &[Progress],
    ) -> Option<(u64, u64)> {
        let latest = self
            .loadable_max
            .filter(|_| accepted && self.config.store_backed)?;
        let session = &self.sessions[&id];
        let peer = session.peer_id.clone();
        // Targets this peer was served: its session's now, or an earlier session's.
        let served = [
            session.composed.map(|(_, target)| target),
            self.composed_for_peer.get(&peer).map(|key| key.version()),
        ];
        let resumed = progress
            .iter()
            .find(|p| p.composed)
            .map(|p| p.version)
            .filter(|&t| t <= latest && served.contains(&Some(t)));
        let target = resumed.unwrap_or(latest);
        if progress.iter().any(|p| p.version == target && !p.composed) {
            // It holds parts of D(target): it is replaying already, and parts of two
            // artifacts for one version would only be dropped.
            return None;
        }
        let (base, target) = (next_version.checked_sub(1)?, target);
        // Declined from an earlier base: replaying to the same target from a later one
        // is cheaper still, so the plan is not asked again at every delivered version.
        let declined = self.unavailable.keys().any(|declined| {
            matches!(*declined, ArtifactKey::Composed { base: b, target: t } if t == target && b <= base)
        });
        if target <= next_version || declined {
            return None;
        }
        let key = ArtifactKey::Composed { base, target };
        // What is being built or held; a peer's key neither, and of no session of the
        // peer, is forgotten.
        let live = |sender: &Sender, key: &ArtifactKey| {
            sender.loading.contains(key) || sender.artifacts.contains_key(key)
        };
        let peers = std::mem::take(&mut self.composed_for_peer);
        self.composed_for_peer = peers
            .into_iter()
            .filter(|(peer, key)| {
                live(self, key) || self.sessions.values().any(|s| s.peer_id == *peer)
            })
            .collect();
        if self
            .composed_for_peer
            .get(&peer)
            .is_some_and(|held| *held != key && live(self, held))
        {
            self.stats.composed_refused += 1;
            return None;
        }
        let bases = self
            .loading
            .iter()
            .chain(self.artifacts.keys())
            .filter(|other| {
                matches!(**other, ArtifactKey::Composed { base: b, target: t } if t == target && b != base)
            })
            .count();
        if !live(self, &key) && bases >= MAX_COMPOSED_PER_TARGET {
            self.stats.composed_refused += 1;
            return None;
        }
        self.composed_for_peer.insert(peer, key);
        Some((base, target))
    }

    /// A version a Want moves past was delivered: how long that took since its last
    /// frame went out says when a later one is overdue (§5.13). A version sent again
    /// says nothing: it took the time of a stall.
    /// A version delivered in time also clears its streams' lateness.
    fn measure_delivery(&mut self, now: Instant, id: u64, next_version: u64) {
        let session = self.sessions.get_mut(&id).expect("caller checked");
        let mut in_time = Vec::new();
        for (&version, state) in session.versions.range(..next_version) {
            if let Some(written_at) = state.written_at.filter(|_| state.hedge.is_none()) {
                let took = now.saturating_duration_since(written_at);
                session.delivery = Some(session.delivery.map_or(took, |least| least.min(took)));
                in_time.push(version);
            }
        }
        for version in in_time {
            self.mark_carriers(id, version, false);
        }
    }

    fn on_want(
        &mut self,
        id: u64,
        next_version: u64,
        (snapshot, composed): (Option<u64>, Option<(u64, u64)>),
        live_streams: u64,
        epochs: &[u32],
        progress: Vec<Progress>,
    ) {
        let session = self.sessions.get_mut(&id).expect("caller checked");
        // A session this sender is already sending deltas past its next version keeps
        // replaying: switching mid-stream would waste what is in flight (a Want may lag
        // behind the deltas sent since it was written).
        let serving = session.composed.map(|(_, target)| target);
        let replaying = session.versions.iter().any(|(v, state)| {
            *v >= next_version && Some(*v) != serving && !state.ever_sent.is_empty()
        });
        let composed = composed.filter(|_| !replaying);
        if snapshot.is_some() && snapshot == self.kept_snapshot {
            self.kept_wanted = true;
        }
        let session = self.sessions.get_mut(&id).expect("caller checked");
        if session.snapshot != snapshot {
            // What was sent of these versions belongs to the other kind of artifact: the
            // Want's progress alone says what the subscriber holds now.
            for version in [session.snapshot, snapshot].into_iter().flatten() {
                session.versions.remove(&version);
            }
            session.snapshot = snapshot;
        }
        if session.composed != composed {
            // The same: D(target) and a composed delta to target are different artifacts.
            for (_, target) in [session.composed, composed].into_iter().flatten() {
                session.versions.remove(&target);
            }
            session.composed = composed;
        }
        let composed_target = composed.map(|(_, target)| target);
        // A segment written on a connection is lost if the Want knows that connection
        // and says it is gone (replaced by a later epoch, or not live). A Want written
        // before the connection existed says nothing about it (it crossed the Hello).
        let still_live = |state: SegState| match state {
            SegState::Sent { stream, epoch } => {
                let known = epochs.get(stream as usize).copied().unwrap_or(0);
                epoch > known || (epoch == known && live_streams & (1 << stream) != 0)
            }
            _ => false,
        };
        session.next_version = Some(next_version);
        session.blocked = false;
        // A Commit written on a stream that died since is lost with it; a Want follows
        // every change of streams, so the latest commit goes out again (receivers ignore
        // one they have).
        if let Some(commit) = self.commit {
            session.control.retain(|f| !matches!(f, Frame::Commit(_)));
            session.control.push_back(Frame::Commit(commit));
        }
        session.versions.retain(|v, _| *v >= next_version);
        let mut reported: BTreeMap<u64, Progress> =
            progress.into_iter().map(|p| (p.version, p)).collect();
        let versions: BTreeSet<u64> = session
            .versions
            .keys()
            .chain(reported.keys())
            .copied()
            .collect();
        for version in versions {
            let state = session.versions.entry(version).or_default();
            let mut report = reported.remove(&version).unwrap_or_default();
            if report.composed != (composed_target == Some(version)) {
                // Progress of the kind of artifact not served: none of it is held.
                report = Progress::default();
            }
            state.offer_sent = report.has_offer;
            state.seal_sent = report.has_seal;
            for index in 0..state.segs.len() {
                let new = if ranges::contains(&report.have, index as u32) {
                    SegState::Have
                } else if still_live(state.segs[index]) {
                    state.segs[index]
                } else {
                    SegState::Unsent
                };
                state.segs[index] = new;
            }
            state.reported = report.have;
            state.cursor = 0;
        }
        self.evict();
    }

    fn on_nack(&mut self, id: u64, version: u64, index: u32) {
        self.stats.nacks += 1;
        let session = self.sessions.get_mut(&id).expect("caller checked");
        session.nacks += 1;
        if session.nacks > self.config.max_nacks {
            let limit = self.config.max_nacks;
            return self.drop_session(id, format!("more than {limit} nacks"));
        }
        let held = self
            .artifacts
            .get(&session.artifact_for(version))
            .is_some_and(|a| a.present(index as usize));
        // A nack for a segment this sender never had is ignored, whatever its index.
        if held && let Some(state) = session.versions.get_mut(&version) {
            state.set(index as usize, SegState::Unsent);
        }
    }

    pub(super) fn queue_control(&mut self, id: u64, frame: Frame) {
        let limit = self.config.max_control_queue;
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        session.control.push_back(frame);
        if session.control.len() > limit {
            self.drop_session(id, format!("more than {limit} control frames queued"));
        }
    }

    pub(super) fn drop_session(&mut self, id: u64, reason: String) {
        let Some(session) = self.sessions.remove(&id) else {
            return;
        };
        tracing::info!(peer = session.peer_id, reason, "dropping a session");
        self.stats.sessions_dropped += 1;
        self.retire(id);
        for conn in session.streams.into_iter().flatten() {
            self.conns.remove(&conn);
            self.events.push_back(SenderEvent::Close {
                conn,
                reason: reason.clone(),
            });
        }
        self.events.push_back(SenderEvent::Dropped {
            peer_id: session.peer_id,
            reason,
        });
        self.evict();
    }

    // ---------------------------------------------------------------------------------
    // Output
    // ---------------------------------------------------------------------------------
}
