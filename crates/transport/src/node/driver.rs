//! The event loop: every event a node's sockets, tasks and timers report, handled in
//! one place, so it is the only one where protocol state changes.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use aurora_delta::{ArtifactKind, DeltaError, Hash, SigningKey, SpilledChunks, Statement};
use aurora_proto::{
    ArtifactKey, Commit, ConnId, EffectError, Identity, KeptSegments, KeptSnapshot, Node, Sender,
    StoredArtifact, Upstreams, Weights,
};
use aurora_store::{Store, StoreError};
use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio_rustls::TlsConnector;

use crate::conn::{Direction, Stream, WriteCmd, spawn_conn};
use crate::decode::{DecodeBacklog, DecodePool};
use crate::engine::Engine;
use crate::security::{BuildBudget, Refusal, RefusalCounters};

use super::accept::Permit;

use super::handle::Command;
use super::{NodeConfig, NodeStatus, TransportError, error_chain};

/// Events queued between the sockets and the loop.
pub(super) const EVENT_QUEUE: usize = 1024;

pub(crate) enum Event {
    /// An inbound connection past its TLS handshake (if any): `peer` is the identity
    /// its certificate proves, none over plaintext.
    Accepted {
        stream: Stream,
        peer: Option<Identity>,
        address: SocketAddr,
        /// When the TCP connection was accepted: the Hello's deadline counts from here.
        accepted_at: Instant,
        permit: Permit,
    },
    /// A connection was refused before it reached the loop (the counts changed).
    Refused,
    Frame {
        conn: ConnId,
        frame: aurora_proto::Frame,
    },
    Closed {
        conn: ConnId,
        /// How it counts, where its reader refused what the peer sent.
        refusal: Option<Refusal>,
        reason: String,
    },
    Sent {
        conn: ConnId,
    },
    Dialed {
        session: u64,
        stream: u8,
        /// The connected stream and who its certificate says the upstream is, or why
        /// not (and the refusal, for a failed TLS handshake).
        result: Result<(Stream, Option<Identity>), (String, Option<Refusal>)>,
    },
    Decoded {
        version: u64,
        index: u32,
        hash: Hash,
        result: Result<SpilledChunks, DeltaError>,
    },
    /// The outcome of [`aurora_proto::Output::Verify`].
    Verified {
        version: u64,
        result: Result<(), DeltaError>,
        /// The elements activating it changes, read from its spill beside the check (for
        /// an engine that writes elements), so that the activation does not.
        changed: Option<aurora_delta::ChangeSet>,
    },
    SafePoint,
    Activated {
        version: u64,
        weights: Arc<Weights>,
        /// The tensors the activation changed (none when it failed); where the engine
        /// took the changes first, every tensor the version changed, whole.
        changed: aurora_delta::ChangeSet,
        result: Result<Hash, EffectError>,
        /// The engine took the changes first ([`Engine::takes_changes_first`]).
        engine_first: bool,
    },
    /// The artifact the sender asked for, or why there is none.
    Loaded {
        key: ArtifactKey,
        result: Result<StoredArtifact, String>,
    },
    /// The store now holds `version`.
    Stored {
        version: u64,
    },
    /// A relay's fetcher took a newer snapshot than the one it keeps
    /// ([`aurora_proto::Output::FetchSnapshot`]), or says why not.
    SnapshotFetched(Result<(KeptSnapshot, Box<dyn KeptSegments>), String>),
}

/// The artifact `key` names with its signatures (blocking: reads, and may build, from
/// the store), or why there is none. A stored delta comes with the signature it was
/// stored with, and its Offer is signed with `signing_key` as it is read where the hub
/// signs and the delta is signed (the catalog keeps one signature per delta, and an
/// unsigned one stays wholly unsigned); a snapshot or composed delta, built here, is
/// signed with `signing_key` where the hub signs. A composed delta is declined when
/// replaying is no dearer.
pub(super) fn read_stored(
    key: ArtifactKey,
    store: &Store,
    snapshot_segment_bytes: usize,
    signing_key: Option<&SigningKey>,
) -> Result<StoredArtifact, String> {
    let chain = |e: StoreError| error_chain(&e);
    // Every statement names the run the store was made for.
    let run = store.run_id();
    let built = |bytes: Bytes| match signing_key {
        Some(signing_key) => {
            StoredArtifact::signed(bytes, key.kind(), signing_key, &run).map_err(|e| e.to_string())
        }
        None => Ok(StoredArtifact::unsigned(bytes)),
    };
    match key {
        ArtifactKey::Delta(version) => {
            let record = store.delta_record(version).map_err(chain)?;
            let file = store.delta(version).map_err(chain)?;
            // Served from the map: the page cache holds it, not the process.
            let bytes = Bytes::from_owner(file);
            let offer_signature = match signing_key.filter(|_| record.signature.is_some()) {
                Some(signing_key) => Some(
                    aurora_proto::offer_signature(signing_key, &run, ArtifactKind::Delta, &bytes)
                        .map_err(|e| e.to_string())?,
                ),
                None => None,
            };
            Ok(StoredArtifact {
                bytes,
                signature: record.signature,
                offer_signature,
            })
        }
        ArtifactKey::Snapshot(version) => store
            .snapshot_artifact(version, snapshot_segment_bytes)
            .map_err(chain)
            .map(Bytes::from_owner)
            .and_then(built),
        ArtifactKey::Composed { base, target } => {
            let (plan, bytes) = store.composed_catch_up(base, target).map_err(chain)?;
            tracing::info!(base, target, ?plan, bytes = plan.bytes(), "catch-up plan");
            bytes
                .ok_or_else(|| format!("the catch-up plan is {plan:?}"))
                .map(Bytes::from)
                .and_then(built)
        }
    }
}

pub(super) struct ConnEntry {
    pub(super) writer: mpsc::Sender<WriteCmd>,
    pub(super) inbound: bool,
    pub(super) reader: AbortHandle,
    /// The authenticated peer of an inbound connection, for its cap.
    pub(super) peer: Option<String>,
    /// An inbound connection's place under the total cap, given back with the entry.
    pub(super) _permit: Option<Permit>,
}

/// An artifact being published live, kept (as shared buffers) to store it when sealed.
pub(super) struct Live {
    pub(super) segments: BTreeMap<u32, Bytes>,
}

pub(super) struct Driver<E: Engine> {
    pub(super) config: NodeConfig,
    pub(super) node: Node,
    /// Shared with the decodes out; the node starts an activation only when none is.
    pub(super) weights: Option<Arc<Weights>>,
    /// The pool this node decodes on and its member key there.
    pub(super) decoder: Option<(Arc<DecodePool>, u64)>,
    /// What waits for the decoder; reading from upstreams pauses while it is over its
    /// limit.
    pub(super) backlog: Arc<DecodeBacklog>,
    pub(super) engine: Option<Arc<E>>,
    /// The change set of the verified patch waiting for its Commit, and its version.
    pub(super) prepared: Option<(u64, aurora_delta::ChangeSet)>,
    pub(super) store: Option<Arc<Store>>,
    pub(super) live: BTreeMap<u64, Live>,
    pub(super) conns: HashMap<ConnId, ConnEntry>,
    /// Inbound connections of each authenticated peer.
    pub(super) peer_conns: HashMap<String, usize>,
    /// Snapshot and composed-delta builds running.
    pub(super) builds: BuildBudget,
    /// The size of a whole checkpoint (the store's newest snapshot): what a build is
    /// charged.
    pub(super) checkpoint_bytes: u64,
    pub(super) refusals: Arc<RefusalCounters>,
    /// Dials upstreams over TLS (none in plaintext).
    pub(super) connector: Option<TlsConnector>,
    pub(super) next_conn: ConnId,
    /// Which upstream the current (or next) session goes to.
    pub(super) upstreams: Upstreams<SocketAddr>,
    pub(super) new_session_at: Option<Instant>,
    pub(super) tasks: JoinSet<()>,
    pub(super) events_tx: mpsc::Sender<Event>,
    pub(super) status_tx: watch::Sender<NodeStatus>,
    pub(super) status: NodeStatus,
    /// Bytes read from upstream connections (see [`NodeHandle::upstream_bytes`]).
    pub(super) upstream_bytes: Arc<AtomicU64>,
}

impl<E: Engine> Driver<E> {
    pub(super) async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        mut commands: mpsc::Receiver<Command>,
    ) {
        loop {
            let wake = [
                self.node.poll_timeout(),
                self.new_session_at,
                self.upstreams.return_at(),
            ]
            .into_iter()
            .flatten()
            .min();
            let sleep = async {
                match wake {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                event = events.recv() => {
                    let Some(event) = event else { return };
                    self.on_event(event);
                    // Take what else is ready before publishing the status.
                    while let Ok(event) = events.try_recv() {
                        self.on_event(event);
                        self.drain();
                    }
                }
                command = commands.recv() => {
                    let Some(command) = command else {
                        // Every handle is gone: keep serving until killed.
                        commands = mpsc::channel(1).1;
                        continue;
                    };
                    self.on_command(command);
                }
                () = sleep => {
                    let now = Instant::now();
                    if self.new_session_at.is_some_and(|at| now >= at) {
                        self.new_session_at = None;
                        self.start_session(now);
                    }
                    self.node.handle_timeout(now);
                    self.poll_return(now, false);
                }
            }
            self.drain();
            self.publish_status();
            while self.tasks.try_join_next().is_some() {}
        }
    }

    pub(super) fn start_session(&mut self, now: Instant) {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(self.next_conn);
        let session = hasher.finish();
        let upstream = self.current_upstream();
        tracing::info!(%upstream, session, "starting an upstream session");
        self.status.upstream = Some(upstream);
        self.node.start_session(now, session);
    }

    pub(super) fn current_upstream(&self) -> SocketAddr {
        self.upstreams
            .current()
            .expect("only a node with upstreams (spawn checks) has sessions")
    }

    /// Leaves a session on a fallback upstream for the first one once it is time and
    /// the receiver is between versions: it holds no part of one, or `delivered` one
    /// just now ([`Upstreams::poll_return`]).
    pub(super) fn poll_return(&mut self, now: Instant, delivered: bool) {
        let Some(receiver) = self.node.receiver_mut() else {
            return;
        };
        self.upstreams.poll_return(now, receiver, delivered);
    }

    pub(super) fn on_event(&mut self, event: Event) {
        let now = Instant::now();
        match event {
            Event::Accepted {
                stream,
                peer,
                address,
                accepted_at,
                permit,
            } => {
                if let Some(peer) = &peer {
                    let open = self.peer_conns.get(&peer.peer_id).copied().unwrap_or(0);
                    let cap = self.config.limits.max_connections_per_peer;
                    if open >= cap {
                        self.refusals.record(
                            Refusal::PeerCap,
                            &format_args!("{} at {address}", peer.peer_id),
                            &format_args!(
                                "{open} connections of this peer are open, the cap is {cap}"
                            ),
                        );
                        return;
                    }
                    *self.peer_conns.entry(peer.peer_id.clone()).or_default() += 1;
                }
                let key = peer.as_ref().map(|p| p.peer_id.clone());
                let conn = self.add_conn(stream, Some((permit, key)));
                self.node.handle_accepted(accepted_at, conn, peer);
            }
            Event::Refused => {}
            Event::Frame { conn, frame } => {
                if self.conns.contains_key(&conn) {
                    self.node.handle_frame(now, conn, frame);
                }
            }
            Event::Closed {
                conn,
                refusal,
                reason,
            } => {
                let Some(entry) = self.remove_conn(conn) else {
                    return;
                };
                match refusal {
                    Some(refusal) => {
                        let peer = entry.peer.as_deref().unwrap_or(if entry.inbound {
                            "a subscriber"
                        } else {
                            "the upstream"
                        });
                        self.refusals.record(refusal, &peer, &reason);
                    }
                    None => {
                        tracing::debug!(conn, reason, inbound = entry.inbound, "connection closed")
                    }
                }
                self.node.handle_closed(conn);
            }
            Event::Sent { conn } => self.node.sent(now, conn),
            Event::Dialed {
                session,
                stream,
                result,
            } => match result {
                Ok((socket, certified)) => {
                    let conn = self.add_conn(socket, None);
                    self.node
                        .handle_connected(now, session, stream, conn, certified);
                }
                Err((reason, refusal)) => {
                    match refusal {
                        Some(refusal) => {
                            // The upstream failed to prove itself (or refused us).
                            self.refusals.record(refusal, &"the upstream", &reason);
                        }
                        None => tracing::debug!(reason, "dial failed"),
                    }
                    self.node.handle_dial_failed(session, stream, &reason);
                }
            },
            Event::Decoded {
                version,
                index,
                hash,
                result,
            } => {
                self.node
                    .decoded(version, index, hash, result.map_err(EffectError::from));
            }
            Event::Verified {
                version,
                result,
                changed,
            } => {
                if let Err(error) = &result {
                    tracing::warn!(version, %error, "the staged delta does not produce its target");
                }
                self.prepared = changed
                    .filter(|_| result.is_ok())
                    .map(|changed| (version, changed));
                self.node
                    .verified(version, result.map_err(EffectError::from));
            }
            Event::SafePoint => self.node.safe_point(),
            Event::Activated {
                version,
                weights,
                changed,
                result,
                engine_first,
            } => {
                // The engine resumes on the new weights, or on the old ones if the patch
                // did not reproduce the target (they were restored). A joining node's
                // engine, whose snapshot failed, was never paused and has nothing to run.
                // One that took the changes first runs them already, and is handed the
                // old weights back only if the node could not write them. Weights lost
                // midway are read by nobody: an engine that took the changes first keeps
                // running them, one that waits resumes on its own (the version before),
                // and the node rejoins from a snapshot into empty weights.
                let lost = result.as_ref().is_err_and(EffectError::lost_weights);
                if let Some(engine) = &self.engine
                    && lost
                    && !engine_first
                {
                    engine.resume(weights.active());
                }
                if let Some(engine) = &self.engine
                    && !weights.is_empty()
                    && !lost
                    && (!engine_first || result.is_err())
                {
                    if let (true, Err(error)) = (engine_first, &result) {
                        tracing::error!(
                            version,
                            %error,
                            "the engine took the version, the node's copy did not: the engine goes back to the copy's"
                        );
                    }
                    engine.activate(weights.clone(), changed);
                }
                match &result {
                    Ok(_) => self.status.last_failed_activation = None,
                    Err(error) => {
                        self.status.failed_activations += 1;
                        self.status.last_failed_activation =
                            Some(format!("version {version}: {error}"));
                    }
                }
                tracing::info!(version, ok = result.is_ok(), "activation");
                self.weights = Some(if lost {
                    Arc::new(weights.emptied())
                } else {
                    weights
                });
                self.node.activated(version, result);
            }
            // Reading the catalog is cheap next to the put that just finished.
            Event::Stored { version } => self.read_store(Some(version)),
            Event::SnapshotFetched(Ok((snapshot, segments))) => {
                self.node.adopt_snapshot(snapshot, segments);
            }
            Event::SnapshotFetched(Err(reason)) => self.node.snapshot_not_fetched(&reason),
            Event::Loaded { key, result } => {
                self.builds.finished(key);
                if let Err(error) = self.node.loaded(key, result) {
                    match key {
                        // Declining a composed delta for replaying is the plan working.
                        ArtifactKey::Composed { .. } => {
                            tracing::debug!(%error, "no composed delta")
                        }
                        _ => tracing::warn!(%error, "cannot serve a stored artifact"),
                    }
                }
            }
        }
    }

    /// Tells the sender what the store holds now: the newest version (at least `stored`,
    /// just put) and the newest snapshot.
    pub(super) fn read_store(&mut self, stored: Option<u64>) {
        let Some(store) = &self.store else {
            return;
        };
        match store
            .latest_version()
            .and_then(|latest| Ok((latest, store.records()?.1)))
        {
            Ok((latest, snapshots)) => {
                self.checkpoint_bytes = snapshots
                    .last_key_value()
                    .map_or(0, |(_, record)| record.size_bytes);
                self.node
                    .store_changed(latest.max(stored), snapshots.into_keys());
            }
            Err(error) => tracing::warn!(%error, "cannot read the store's catalog"),
        }
    }

    /// Starts the tasks of a connection: an inbound one with its place under the total
    /// cap and its authenticated peer, an outbound one with neither.
    pub(super) fn add_conn(
        &mut self,
        stream: Stream,
        inbound: Option<(Permit, Option<String>)>,
    ) -> ConnId {
        let conn = self.next_conn;
        self.next_conn += 1;
        let direction = match inbound {
            Some(_) => Direction::Inbound {
                limits: self.config.limits.clone(),
            },
            None => Direction::Upstream {
                read_bytes: self.upstream_bytes.clone(),
                backlog: self.backlog.clone(),
            },
        };
        let (writer, reader) = spawn_conn(
            &mut self.tasks,
            conn,
            stream,
            direction,
            self.config.window_frames,
            self.events_tx.clone(),
        );
        let (permit, peer) = inbound.map_or((None, None), |(permit, peer)| (Some(permit), peer));
        self.conns.insert(
            conn,
            ConnEntry {
                writer,
                inbound: permit.is_some(),
                reader,
                peer,
                _permit: permit,
            },
        );
        conn
    }

    /// Forgets a connection, giving back its places under the caps.
    pub(super) fn remove_conn(&mut self, conn: ConnId) -> Option<ConnEntry> {
        let entry = self.conns.remove(&conn)?;
        if let Some(peer) = &entry.peer
            && let Some(open) = self.peer_conns.get_mut(peer)
        {
            *open -= 1;
            if *open == 0 {
                self.peer_conns.remove(peer);
            }
        }
        Some(entry)
    }

    pub(super) fn on_command(&mut self, command: Command) {
        match command {
            Command::Begin { descriptor, reply } => {
                // The descriptor goes out before extraction starts, and joiners size what
                // they build from it: it is signed on its own, now.
                let signed = self.config.sign_offer(&descriptor).map_err(Into::into);
                let result = signed.and_then(|signature| {
                    self.hub_sender()?
                        .begin_artifact(ArtifactKind::Delta, descriptor.clone(), signature)
                        .map_err(Into::into)
                });
                if let Ok(version) = result {
                    self.live.insert(
                        version,
                        Live {
                            segments: BTreeMap::new(),
                        },
                    );
                }
                let _ = reply.send(result);
            }
            Command::Segment {
                version,
                segment,
                reply,
            } => {
                let bytes = Bytes::from(segment.bytes);
                let result = self.hub_sender().and_then(|s| {
                    s.add_segment(
                        ArtifactKey::Delta(version),
                        segment.index,
                        segment.hash,
                        bytes.clone(),
                    )
                    .map_err(Into::into)
                });
                if result.is_ok()
                    && let Some(live) = self.live.get_mut(&version)
                {
                    live.segments.insert(segment.index, bytes);
                }
                let _ = reply.send(result);
            }
            Command::Seal {
                version,
                manifest,
                reply,
            } => {
                // The manifest is known only now: the delta is signed as it is sealed.
                let signature = self
                    .config
                    .sign(&Statement::manifest(ArtifactKind::Delta, &manifest));
                let sealed = self.hub_sender().and_then(|s| {
                    s.seal_artifact(
                        ArtifactKey::Delta(version),
                        manifest.header.target_hash,
                        manifest.id(),
                        manifest.segments.clone(),
                        signature,
                    )
                    .map_err(Into::into)
                });
                let live = self.live.remove(&version);
                match (sealed, live) {
                    (Ok(()), Some(live)) => {
                        // Sized exactly: a growing buffer would copy itself as it grows,
                        // and keep up to twice the delta's size once frozen. The header is
                        // the complete one: the descriptor left the target hash pending.
                        let head = manifest.header.encode();
                        let tail = manifest.encode_tail();
                        let len = head.len() + manifest.payload_bytes() as usize + tail.len();
                        let mut artifact = Vec::with_capacity(len);
                        artifact.extend_from_slice(&head);
                        for bytes in live.segments.values() {
                            artifact.extend_from_slice(bytes);
                        }
                        artifact.extend_from_slice(&tail);
                        // The store keeps the artifact's signature; the Offer's is made
                        // again whenever the delta is read back.
                        let artifact = StoredArtifact {
                            bytes: Bytes::from(artifact),
                            signature,
                            offer_signature: None,
                        };
                        // The sender serves the joined artifact from now on and the
                        // segments' own buffers are freed: the delta is held once while
                        // the store writes it, and after.
                        let adopted = self
                            .hub_sender()
                            .and_then(|s| s.insert_artifact(artifact.clone()).map_err(Into::into));
                        if let Err(error) = adopted {
                            let _ = reply.send(Err(error));
                            return;
                        }
                        self.store_then(version, artifact, |r| {
                            let _ = reply.send(r.map(|_| ()));
                        });
                    }
                    (Ok(()), None) => {
                        let _ = reply.send(Ok(()));
                    }
                    (Err(error), _) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            Command::Publish { artifact, reply } => {
                let artifact = match self.signed_delta(artifact) {
                    Ok(artifact) => artifact,
                    Err(error) => {
                        let _ = reply.send(Err(error));
                        return;
                    }
                };
                let inserted = self
                    .hub_sender()
                    .and_then(|s| s.insert_artifact(artifact.clone()).map_err(Into::into));
                match inserted {
                    Ok(version) => self.store_then(version, artifact, |r| {
                        let _ = reply.send(r);
                    }),
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }
            Command::ExpectCommitted(version) => {
                self.node.expect_committed(Instant::now(), version);
            }
            Command::Commit(target) => {
                let commit = Commit {
                    target,
                    signature: None,
                };
                let commit = Commit {
                    signature: self.config.sign(&commit.statement()),
                    ..commit
                };
                if let Err(error) = self.node.commit(commit) {
                    tracing::error!(%error, "cannot announce the commit");
                }
            }
            Command::StoreChanged { reply } => {
                self.read_store(None);
                let _ = reply.send(Ok(()));
            }
            Command::StopServing(reason) => self.node.stop_serving(reason),
            Command::TakeKept { reply } => {
                let _ = reply.send(self.node.take_kept());
            }
        }
    }

    /// A complete delta to publish, with the hub's signatures where it signs.
    fn signed_delta(&self, bytes: Bytes) -> Result<StoredArtifact, TransportError> {
        Ok(match self.config.signer() {
            Some((key, run)) => StoredArtifact::signed(bytes, ArtifactKind::Delta, key, &run)?,
            None => StoredArtifact::unsigned(bytes),
        })
    }

    pub(super) fn hub_sender(&mut self) -> Result<&mut Sender, TransportError> {
        self.node.sender_mut().ok_or(TransportError::Stopped)
    }

    /// Stores a sealed artifact (on a hub with a store) on a blocking thread, then
    /// answers. The version is servable from memory meanwhile.
    pub(super) fn store_then(
        &mut self,
        version: u64,
        artifact: StoredArtifact,
        answer: impl FnOnce(Result<u64, TransportError>) + Send + 'static,
    ) {
        let Some(store) = self.store.clone() else {
            return answer(Ok(version));
        };
        let events = self.events_tx.clone();
        self.tasks.spawn_blocking(move || {
            let stored = store
                .put_delta(&artifact.bytes, artifact.signature)
                .map(|r| r.version);
            if stored.is_ok() {
                let _ = events.blocking_send(Event::Stored { version });
            }
            answer(stored.map_err(Into::into));
        });
    }

    /// Reads (or builds) the artifact `key` names from the store on a blocking thread
    /// and reports it as [`Event::Loaded`].
    pub(super) fn load(&mut self, key: ArtifactKey) {
        let Some(store) = self.store.clone() else {
            let _ = self.node.loaded(key, Err("no store".into()));
            return;
        };
        let admitted = self
            .builds
            .admit(key, self.checkpoint_bytes, &self.config.limits);
        if let Err(reason) = admitted {
            self.refusals.record(
                Refusal::BuildBudget,
                &format_args!("a build of {key}"),
                &reason,
            );
            self.node.load_deferred(key, reason);
            return;
        }
        let segment_bytes = self.config.snapshot_segment_bytes;
        let signing_key = self.config.signing_key.clone();
        let events = self.events_tx.clone();
        self.tasks.spawn_blocking(move || {
            let result = read_stored(key, &store, segment_bytes, signing_key.as_deref());
            let _ = events.blocking_send(Event::Loaded { key, result });
        });
    }

    /// Carries out everything the node wants done.
    pub(super) fn drain(&mut self) {
        let now = Instant::now();
        while let Some(output) = self.node.poll(now) {
            self.output(output);
        }
    }
}
