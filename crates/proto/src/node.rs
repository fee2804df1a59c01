//! One peer of the dissemination tree (docs/wire-protocol.md §8): a hub (sender only),
//! a relay (receiver, sender and actor: it forwards every verified segment downstream
//! as it arrives and activates versions itself) or an actor (receiver and actor).
//!
//! The node wires its parts together and hands the driver one stream of [`Output`]s.
//! Drivers feed inputs to the parts directly ([`Node::sender_mut`],
//! [`Node::receiver_mut`]) or through the node's methods for the actor's work, then
//! drain [`Node::poll`].

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use aurora_delta::Hash;

use crate::ConnId;
use crate::actor::{ActorAction, ActorCore, ActorStatus};
use crate::frame::{Frame, Role, VersionRef, Welcome};
use crate::receiver::{Artifact, Receiver, ReceiverEvent};
use crate::sender::{Sender, SenderEvent};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Write `frame` on `conn` (closing it afterwards if `close_after`). Frames for
    /// inbound connections count against their window: report [`Node::sent`] once
    /// written.
    Transmit {
        conn: ConnId,
        frame: Frame,
        close_after: bool,
    },
    Close {
        conn: ConnId,
    },
    /// Open stream `stream` of upstream session `session`.
    Dial {
        session: u64,
        stream: u8,
    },
    /// The upstream session is over: start a new one
    /// ([`Receiver::start_session`]), on the next upstream if this one failed.
    UpstreamLost {
        reason: String,
    },
    /// Load the stored delta of `version` ([`crate::Sender::insert_artifact`]).
    Load {
        version: u64,
    },
    /// Decode `artifact` against the active weights, then call [`Node::staged`].
    Stage {
        version: u64,
        artifact: Artifact,
    },
    /// Wait for the engine's safe point, then call [`Node::safe_point`].
    AwaitSafePoint,
    /// Apply the staged patch of `version`, then call [`Node::activated`].
    Activate {
        version: u64,
    },
    /// Something worth logging or observing; nothing to do.
    Notice(Notice),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Connected(Welcome),
    Complete {
        version: u64,
    },
    Committed(VersionRef),
    Subscribed {
        peer_id: String,
        role: Role,
        region: String,
    },
    Dropped {
        peer_id: String,
        reason: String,
    },
    Status {
        peer_id: String,
        active: VersionRef,
        staged: Option<u64>,
        note: String,
    },
    /// A relay could not republish what it received (a bug or a hostile upstream).
    RelayError(String),
}

pub struct Node {
    sender: Option<Sender>,
    receiver: Option<Receiver>,
    actor: Option<ActorCore>,
    /// Complete artifacts waiting to be staged and activated.
    artifacts: BTreeMap<u64, Artifact>,
    outputs: VecDeque<Output>,
}

impl Node {
    pub fn hub(sender: Sender) -> Node {
        Node::new(Some(sender), None, None)
    }

    /// A relay: receives from upstream, republishes to its subscribers, and activates
    /// versions from `active` on.
    pub fn relay(receiver: Receiver, mut sender: Sender, active: VersionRef) -> Node {
        sender.set_floor(active.version + 1);
        Node::new(Some(sender), Some(receiver), Some(ActorCore::new(active)))
    }

    pub fn actor(receiver: Receiver, active: VersionRef) -> Node {
        Node::new(None, Some(receiver), Some(ActorCore::new(active)))
    }

    /// A receiver that only collects artifacts (benchmarks): no staging.
    pub fn collector(receiver: Receiver) -> Node {
        Node::new(None, Some(receiver), None)
    }

    fn new(sender: Option<Sender>, receiver: Option<Receiver>, actor: Option<ActorCore>) -> Node {
        Node {
            sender,
            receiver,
            actor,
            artifacts: BTreeMap::new(),
            outputs: VecDeque::new(),
        }
    }

    pub fn sender(&self) -> Option<&Sender> {
        self.sender.as_ref()
    }

    pub fn sender_mut(&mut self) -> Option<&mut Sender> {
        self.sender.as_mut()
    }

    pub fn receiver(&self) -> Option<&Receiver> {
        self.receiver.as_ref()
    }

    pub fn receiver_mut(&mut self) -> Option<&mut Receiver> {
        self.receiver.as_mut()
    }

    pub fn actor_status(&self) -> Option<ActorStatus> {
        self.actor.as_ref().map(ActorCore::status)
    }

    /// Whether the actor gave up on its upstreams' chain (see [`ActorCore::diverged`]).
    pub fn actor_diverged(&self) -> bool {
        self.actor.as_ref().is_some_and(ActorCore::diverged)
    }

    /// A frame written on an inbound connection: its window has room again.
    pub fn sent(&mut self, now: Instant, conn: ConnId) {
        if let Some(sender) = &mut self.sender {
            sender.on_sent(now, conn);
        }
    }

    pub fn staged(&mut self, version: u64, outcome: Result<(), String>) {
        if let Some(actor) = &mut self.actor {
            actor.staged(version, outcome);
        }
    }

    pub fn safe_point(&mut self) {
        if let Some(actor) = &mut self.actor {
            actor.safe_point();
        }
    }

    pub fn activated(&mut self, version: u64, outcome: Result<Hash, String>) {
        if let Some(actor) = &mut self.actor {
            actor.activated(version, outcome);
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let sender = self.sender.as_ref().and_then(Sender::poll_timeout);
        let receiver = self.receiver.as_ref().and_then(Receiver::poll_timeout);
        sender.into_iter().chain(receiver).min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(sender) = &mut self.sender {
            sender.handle_timeout(now);
        }
        if let Some(receiver) = &mut self.receiver {
            receiver.handle_timeout(now);
        }
    }

    /// The next thing for the driver to do, after routing what the parts said to each
    /// other.
    pub fn poll(&mut self, now: Instant) -> Option<Output> {
        loop {
            if let Some(output) = self.outputs.pop_front() {
                return Some(output);
            }
            if let Some(event) = self.receiver.as_mut().and_then(Receiver::poll_event) {
                self.on_receiver_event(event);
                continue;
            }
            if let Some(action) = self.actor.as_mut().and_then(ActorCore::poll_action) {
                self.on_actor_action(action);
                continue;
            }
            if let Some((conn, frame, close_after)) =
                self.receiver.as_mut().and_then(Receiver::poll_transmit)
            {
                return Some(Output::Transmit {
                    conn,
                    frame,
                    close_after,
                });
            }
            if let Some(event) = self.sender.as_mut().and_then(Sender::poll_event) {
                self.on_sender_event(event);
                continue;
            }
            let transmit = self.sender.as_mut().and_then(|s| s.poll_transmit(now))?;
            return Some(Output::Transmit {
                conn: transmit.conn,
                frame: transmit.frame,
                close_after: transmit.close_after,
            });
        }
    }

    fn on_receiver_event(&mut self, event: ReceiverEvent) {
        let relay_error = |e: crate::SenderError| Output::Notice(Notice::RelayError(e.to_string()));
        match event {
            ReceiverEvent::Dial { session, stream } => {
                self.outputs.push_back(Output::Dial { session, stream })
            }
            ReceiverEvent::Close { conn } => self.outputs.push_back(Output::Close { conn }),
            ReceiverEvent::Connected { upstream } => {
                self.outputs
                    .push_back(Output::Notice(Notice::Connected(upstream)));
            }
            ReceiverEvent::UpstreamLost { reason } => {
                self.outputs.push_back(Output::UpstreamLost { reason })
            }
            ReceiverEvent::Offered {
                version: _,
                descriptor,
            } => {
                if let Some(sender) = &mut self.sender
                    && let Err(e) = sender.begin_artifact(descriptor)
                {
                    self.outputs.push_back(relay_error(e));
                }
            }
            ReceiverEvent::Segment {
                version,
                index,
                hash,
                bytes,
            } => {
                if let Some(sender) = &mut self.sender
                    && let Err(e) = sender.add_segment(version, index, hash, bytes)
                {
                    self.outputs.push_back(relay_error(e));
                }
            }
            ReceiverEvent::Revoked { version, index } => {
                if let Some(sender) = &mut self.sender {
                    sender.revoke_segment(version, index);
                }
            }
            ReceiverEvent::Sealed {
                version,
                id,
                segments,
            } => {
                if let Some(sender) = &mut self.sender
                    && let Err(e) = sender.seal_artifact(version, id, segments)
                {
                    self.outputs.push_back(relay_error(e));
                }
            }
            ReceiverEvent::Complete { version, artifact } => {
                self.outputs
                    .push_back(Output::Notice(Notice::Complete { version }));
                if let Some(actor) = &mut self.actor {
                    actor.artifact(artifact.header());
                    self.artifacts.insert(version, artifact);
                }
            }
            ReceiverEvent::Commit(commit) => {
                self.outputs
                    .push_back(Output::Notice(Notice::Committed(commit)));
                if let Some(actor) = &mut self.actor {
                    actor.commit(commit);
                }
                if let Some(sender) = &mut self.sender {
                    sender.commit(commit);
                }
            }
        }
    }

    fn on_sender_event(&mut self, event: SenderEvent) {
        let output = match event {
            SenderEvent::Load { version } => Output::Load { version },
            SenderEvent::Close { conn, reason } => {
                tracing::debug!(conn, reason, "closing a downstream connection");
                Output::Close { conn }
            }
            SenderEvent::Subscribed {
                peer_id,
                role,
                region,
                session: _,
            } => Output::Notice(Notice::Subscribed {
                peer_id,
                role,
                region,
            }),
            SenderEvent::Dropped { peer_id, reason } => {
                Output::Notice(Notice::Dropped { peer_id, reason })
            }
            SenderEvent::Status {
                peer_id,
                active,
                staged,
                note,
            } => Output::Notice(Notice::Status {
                peer_id,
                active,
                staged,
                note,
            }),
        };
        self.outputs.push_back(output);
    }

    fn on_actor_action(&mut self, action: ActorAction) {
        match action {
            ActorAction::Stage { version } => {
                let artifact = self.artifacts[&version].clone();
                self.outputs.push_back(Output::Stage { version, artifact });
            }
            ActorAction::AwaitSafePoint => self.outputs.push_back(Output::AwaitSafePoint),
            ActorAction::Activate { version } => {
                self.outputs.push_back(Output::Activate { version })
            }
            ActorAction::Discard { version } => {
                self.artifacts.remove(&version);
            }
            ActorAction::Rewind { version } => {
                if let Some(receiver) = &mut self.receiver {
                    receiver.rewind(version);
                    // The upstream served a delta that does not fit this actor: fetch
                    // the chain again elsewhere.
                    receiver.abandon("served a delta that does not fit the active weights");
                }
            }
            ActorAction::Report { note } => {
                let status = self
                    .actor
                    .as_ref()
                    .expect("actions come from the actor")
                    .status();
                if let Some(receiver) = &mut self.receiver {
                    receiver.set_local(status.active, status.staged);
                    receiver.report(note);
                }
            }
        }
    }
}
