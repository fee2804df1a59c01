//! What the protocol node asks of its driver (frames to write, dials, loads, decodes,
//! activations, notices), carried out.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use aurora_delta::ChangeSet;
use aurora_proto::{
    ConnId, EffectError, Notice, Output, PatchState, Receiver, Sender, Staged, Transmit,
    VersionRef, Weights,
};

use crate::conn::{WriteCmd, dial};
use crate::engine::Engine;

use super::driver::{Driver, Event};
use super::{COMPLETED_SHOWN, MAX_REPORTS};

impl<E: Engine> Driver<E> {
    pub(super) fn output(&mut self, output: Output) {
        match output {
            Output::Transmit(Transmit {
                conn,
                frame,
                close_after,
            }) => {
                let Some(entry) = self.conns.get(&conn) else {
                    return;
                };
                if entry
                    .writer
                    .try_send(WriteCmd::Frame { frame, close_after })
                    .is_err()
                {
                    // Only an outbound connection can get here (inbound ones have a
                    // window): its peer is not reading our control frames.
                    tracing::warn!(conn, "write queue full; closing the connection");
                    self.close(conn);
                }
            }
            Output::Close { conn } => self.close(conn),
            Output::Dial { session, stream } => {
                let address = self.current_upstream();
                let timeout = self.config.connect_timeout;
                let options = self.config.socket.clone();
                let connector = self.connector.clone();
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    let result = dial(address, timeout, &options, connector.as_ref()).await;
                    let _ = events
                        .send(Event::Dialed {
                            session,
                            stream,
                            result,
                        })
                        .await;
                });
            }
            Output::UpstreamLost { reason } => {
                let from = self.current_upstream();
                self.status.upstream_switches += 1;
                self.status.connected = false;
                let on_purpose = self.upstreams.leaving_for_first();
                let backoff = self.upstreams.lost(Instant::now(), &reason);
                let next = self.current_upstream();
                if on_purpose {
                    tracing::info!(%from, %next, %reason, "switching upstream");
                } else {
                    tracing::warn!(%from, %next, %reason, "upstream lost; falling back");
                    self.status.last_upstream_failure = Some(format!("{from}: {reason}"));
                }
                self.new_session_at = Some(Instant::now() + backoff);
            }
            Output::Load(key) => self.load(key),
            Output::Decode {
                version,
                index,
                hash,
                kind,
                header,
                bytes,
            } => {
                let weights = self.weights.clone().expect("decoding needs the weights");
                let (pool, member) = self
                    .decoder
                    .clone()
                    .expect("a node with weights has a decode pool");
                let events = self.events_tx.clone();
                let backlog = self.backlog.clone();
                backlog.submitted(bytes.len() as u64);
                pool.submit(member, move || {
                    let result = weights.decode_segment(kind, &header, index, &bytes);
                    backlog.decoded(bytes.len() as u64);
                    // Let go of the weights before reporting: once the last decode is
                    // in, the loop takes them for activation, and a share still held
                    // here would fail it as "not ready".
                    drop(weights);
                    let _ = events.blocking_send(Event::Decoded {
                        version,
                        index,
                        hash,
                        result,
                    });
                });
            }
            Output::AwaitSafePoint => {
                let engine = self.engine.clone().expect("actors have an engine");
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    engine.safe_point().await;
                    let _ = events.send(Event::SafePoint).await;
                });
            }
            Output::Activate { version } => {
                let shared = self.weights.take().expect("activation needs the weights");
                let (mut weights, staged) =
                    match (Arc::try_unwrap(shared), self.node.take_staged(version)) {
                        (Ok(weights), Some(staged)) => (weights, staged),
                        (shared, _) => {
                            // The node activates only a staged patch with no decode out.
                            // Should it not be, the activation fails as any other does:
                            // through the driver, so a paused engine resumes on what it
                            // runs and the status says why.
                            let events = self.events_tx.clone();
                            let weights = shared.map_or_else(|arc| arc, Arc::new);
                            self.tasks.spawn(async move {
                                let _ = events
                                    .send(Event::Activated {
                                        version,
                                        weights,
                                        changed: ChangeSet::default(),
                                        result: Err(EffectError::Patch(PatchState::NotReady)),
                                        engine_first: false,
                                    })
                                    .await;
                            });
                            return;
                        }
                    };
                let events = self.events_tx.clone();
                let elements = self.engine.as_ref().is_some_and(|e| e.writes_elements());
                let mut prepared = match self.prepared.take() {
                    Some((prepared, changed)) if prepared == version => Some(changed),
                    _ => None,
                };
                // Changes come first only as elements: a tensor changed whole would be
                // read from the node's copy, which does not have it yet.
                let first = match (&self.engine, &staged, &prepared) {
                    (Some(engine), Staged::Verified(patch), Some(changed))
                        if engine.takes_changes_first()
                            && changed.tensors.iter().all(|t| t.elements.is_some()) =>
                    {
                        Some((engine.clone(), patch.header().target_hash))
                    }
                    _ => None,
                };
                if let Some((engine, hash)) = first
                    && let Some(changed) = prepared.take()
                {
                    let active = VersionRef { version, hash };
                    self.activate_changes_first(engine, weights, staged, active, changed);
                    return;
                }
                // Not on the decode pool: the engine is paused at its safe point until
                // this is done, so it runs at the process's own priority.
                self.tasks.spawn_blocking(move || {
                    // Whole tensors are always right: what the engine loads should the
                    // elements' listing panic, which would end this task unanswered.
                    let changed = prepared.unwrap_or_else(|| {
                        std::panic::catch_unwind(AssertUnwindSafe(|| staged.change_set(elements)))
                            .unwrap_or_else(|_| ChangeSet::whole(staged.changed_tensors()))
                    });
                    let result = weights.activate_catching_panics(staged);
                    let changed = if result.is_ok() {
                        changed
                    } else {
                        ChangeSet::default()
                    };
                    let _ = events.blocking_send(Event::Activated {
                        version,
                        weights: Arc::new(weights),
                        changed,
                        result,
                        engine_first: false,
                    });
                });
            }
            Output::Verify { version } => {
                let weights = self.weights.clone().expect("verifying needs the weights");
                let Some(patch) = self.node.staged_patch(version).cloned() else {
                    self.node
                        .verified(version, Err(EffectError::Patch(PatchState::Gone)));
                    return;
                };
                let events = self.events_tx.clone();
                let elements = self.engine.as_ref().is_some_and(|e| e.writes_elements());
                // Off the decode pool, as an activation is: one pass over the weights.
                self.tasks.spawn_blocking(move || {
                    let result = weights.verify(&patch);
                    drop(weights);
                    // Behind generation too: the elements the engine will be handed, read
                    // while the patch waits for its Commit (a spill that cannot be read
                    // leaves it to the activation).
                    let changed = (result.is_ok() && elements)
                        .then(|| patch.change_set(true).ok())
                        .flatten();
                    let _ = events.blocking_send(Event::Verified {
                        version,
                        result,
                        changed,
                    });
                });
            }
            Output::FetchSnapshot { newer_than } => {
                let mut config = self.config.clone();
                // The fetcher serves nobody: its snapshot goes to this relay's sender.
                config.listen = None;
                let events = self.events_tx.clone();
                let relay = self.status_tx.subscribe();
                tracing::info!(
                    newer_than,
                    "taking a newer snapshot for the region's joiners"
                );
                self.tasks.spawn(async move {
                    let fetched = super::spawn::fetch_snapshot(config, newer_than, relay).await;
                    let _ = events.send(Event::SnapshotFetched(fetched)).await;
                });
            }
            Output::Notice(notice) => self.notice(notice),
        }
    }

    /// Hands the engine a verified version's changed elements over the weights it runs
    /// now, then, once it has let go of those, writes the changes into them: the engine
    /// serves the version without waiting for the node's copy. Should that write fail
    /// (the weights are left as they were), or the engine not let go in time, the engine
    /// is handed them back whole for every tensor the version changed, so that it runs
    /// what the node holds.
    fn activate_changes_first(
        &mut self,
        engine: Arc<E>,
        weights: Weights,
        staged: Staged,
        active: VersionRef,
        changed: ChangeSet,
    ) {
        let version = active.version;
        let names = ChangeSet::whole(staged.changed_tensors());
        let events = self.events_tx.clone();
        let weights = Arc::new(weights);
        engine.activate_changes_first(weights.clone(), active, changed);
        let release_timeout = self.config.release_timeout;
        self.tasks.spawn(async move {
            // An engine that never lets go must not hold the node in this activation for
            // good: past the limit, the version is reported failed and the engine goes
            // back to the copy, which is written only where the node holds it alone.
            let _ = tokio::time::timeout(release_timeout, engine.released()).await;
            let (weights, result) = match Arc::try_unwrap(weights) {
                Ok(weights) => {
                    let written = tokio::task::spawn_blocking(move || {
                        let mut weights = weights;
                        let result = weights.activate_catching_panics(staged);
                        (Arc::new(weights), result)
                    })
                    .await;
                    // Panics are caught inside; the task is cancelled only when the
                    // runtime shuts down, and then nobody waits for the event.
                    let Ok(written) = written else {
                        return;
                    };
                    written
                }
                Err(shared) => (shared, Err(EffectError::EngineHeld(release_timeout))),
            };
            let _ = events
                .send(Event::Activated {
                    version,
                    weights,
                    changed: names,
                    result,
                    engine_first: true,
                })
                .await;
        });
    }

    pub(super) fn notice(&mut self, notice: Notice) {
        match notice {
            Notice::Connected(welcome) => {
                self.upstreams.connected(Instant::now());
                self.status.connected = true;
                tracing::info!(upstream = welcome.peer_id, latest = ?welcome.latest, "subscribed upstream");
            }
            Notice::Complete { version } => {
                tracing::debug!(version, "version received and verified");
                self.upstreams.delivered();
                self.poll_return(Instant::now(), true);
                let completed = &mut self.status.completed;
                completed.push(version);
                // The status is copied to every watcher at every event: it keeps the
                // recent versions, not every one a long run ever completed.
                if completed.len() > COMPLETED_SHOWN {
                    completed.drain(..completed.len() - COMPLETED_SHOWN);
                }
            }
            Notice::Joined { version } => {
                tracing::info!(version, "received the snapshot to join from");
                // A snapshot taken from a fallback (the hub, when the region's relay
                // keeps none or no longer offers its own): the deltas after it come
                // cheaper from the first upstream, the relay, as for every other actor.
                if !self.upstreams.on_first()
                    && self
                        .node
                        .abandon_session("joined; the deltas come from the first upstream")
                {
                    self.upstreams.leave_for_first();
                }
            }
            Notice::Committed(commit) => tracing::debug!(version = commit.version, "commit"),
            Notice::Subscribed {
                peer_id,
                role,
                region,
            } => tracing::info!(peer_id, %role, region, "subscriber joined"),
            Notice::Dropped { peer_id, reason } => {
                tracing::warn!(peer_id, reason, "subscriber dropped")
            }
            Notice::Status {
                peer_id,
                active,
                staged: _,
                note,
            } => {
                tracing::debug!(peer_id, version = active.version, note, "subscriber status");
                if self.status.reports.len() == MAX_REPORTS {
                    self.status.reports.remove(0);
                }
                self.status.reports.push((peer_id, active, note));
            }
            Notice::RelayError(error) => tracing::warn!(error, "relay cannot republish"),
        }
    }

    pub(super) fn close(&mut self, conn: ConnId) {
        if let Some(entry) = self.remove_conn(conn) {
            entry.reader.abort();
        }
        // Dropping the writer's queue makes its task shut the socket down.
    }

    pub(super) fn publish_status(&mut self) {
        let status = &mut self.status;
        if let Some(actor) = self.node.actor_status() {
            status.active = actor.active;
            status.staged = actor.staged;
            status.committed = actor.committed;
        }
        status.diverged = self.node.actor_diverged();
        status.receiver = self.node.receiver().map(|r| r.stats().clone());
        status.streams = self.node.receiver().map_or(0, Receiver::welcomed_streams);
        status.target_streams = self.node.receiver().map_or(0, Receiver::stream_count);
        status.sender = self.node.sender().map(|s| s.stats().clone());
        status.subscribers = self.node.sender().map_or(0, Sender::sessions);
        status.kept_snapshot = self.node.sender().and_then(Sender::kept_snapshot);
        status.run = self
            .node
            .sender()
            .and_then(Sender::run)
            .or_else(|| self.node.receiver().and_then(Receiver::run));
        status.refusals = self.refusals.snapshot();
        let snapshot = status.clone();
        self.status_tx.send_replace(snapshot);
    }
}
