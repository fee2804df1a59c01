//! What the simulation does with each event: frames delivered and lost, timers, crashes
//! and restarts, the hub's publications, and every output a node asks of its driver.

use super::*;

impl Sim {
    pub(crate) fn handle(&mut self, event: Event) {
        match event {
            Event::Deliver {
                conn,
                from,
                mut frame,
                close_after,
            } => {
                let Some(c) = self.conns.get(&conn).filter(|c| c.open) else {
                    return;
                };
                let to = if from == c.client { c.server } else { c.client };
                if let Frame::Segment { bytes, .. } = &mut frame
                    && !bytes.is_empty()
                    && self.rng.chance(self.corrupt_percent)
                {
                    let mut damaged = bytes.to_vec();
                    let at = self.rng.below(damaged.len() as u64) as usize;
                    damaged[at] ^= 1 << self.rng.below(8);
                    *bytes = Bytes::from(damaged);
                    self.faults.corruptions += 1;
                }
                if let Ok(traced) = std::env::var("AURORA_SIM_TRACE")
                    && self.peers[to].name.contains(&traced)
                {
                    let mut text = format!("{frame:?}");
                    text.truncate(100);
                    let name = &self.peers[to].name;
                    eprintln!(
                        "{:>8?} {name:>7} got on {conn}: {text}",
                        self.now - self.start
                    );
                }
                let now = self.now;
                if let Some(node) = self.node(from) {
                    node.sent(now, conn);
                }
                if let Some(node) = self.node(to) {
                    node.handle_frame(now, conn, frame);
                }
                if close_after {
                    self.close(conn);
                }
                self.drain(to);
                self.drain(from);
            }
            Event::Closed { node, conn } => {
                if !self.conns.contains_key(&conn) {
                    return;
                }
                if let Some(n) = self.node(node) {
                    n.handle_closed(conn);
                }
                self.drain(node);
            }
            Event::Accept { conn } => {
                let c = &self.conns[&conn];
                let (server, open) = (c.server, c.open);
                let reachable = !self.isolated(c.client, server);
                let now = self.now;
                match self.node(server) {
                    Some(node) if open && reachable => {
                        node.handle_accepted(now, conn, None);
                        let latency = self.latency();
                        self.at(latency, Event::Connected { conn });
                        self.drain(server);
                    }
                    _ => {
                        let c = &self.conns[&conn];
                        let event = Event::DialFailed {
                            node: c.client,
                            session: c.session,
                            stream: c.stream,
                        };
                        self.conns.remove(&conn);
                        self.at(Duration::from_millis(5), event);
                    }
                }
            }
            Event::Connected { conn } => {
                let Some(c) = self.conns.get(&conn).filter(|c| c.open) else {
                    return;
                };
                let (client, session, stream) = (c.client, c.session, c.stream);
                let now = self.now;
                if let Some(node) = self.node(client) {
                    node.handle_connected(now, session, stream, conn, None);
                }
                self.drain(client);
            }
            Event::DialFailed {
                node,
                session,
                stream,
            } => {
                if let Some(n) = self.node(node) {
                    n.handle_dial_failed(session, stream, "refused");
                }
                self.drain(node);
            }
            Event::Timer { node } => {
                self.peers[node].timer = None;
                let now = self.now;
                if let Some(n) = self.node(node) {
                    n.handle_timeout(now);
                }
                self.poll_return(node, false);
                self.drain(node);
            }
            Event::NewSession { node } => {
                let session = self.next_session;
                self.next_session += 1;
                let now = self.now;
                if let Some(n) = self.node(node) {
                    n.start_session(now, session);
                }
                self.drain(node);
            }
            Event::Decoded {
                node,
                version,
                index,
                hash,
                outcome,
            } => {
                // The segment was decoded when the node asked; this is when it is done.
                if let Some(n) = self.node(node) {
                    n.decoded(version, index, hash, outcome);
                }
                self.drain(node);
            }
            Event::Verified {
                node,
                version,
                outcome,
            } => {
                if let Some(n) = self.node(node) {
                    n.verified(version, outcome);
                }
                self.drain(node);
            }
            Event::SafePoint { node } => {
                if let Some(n) = self.node(node) {
                    n.safe_point();
                }
                self.drain(node);
            }
            Event::Loaded { node, key } if node == ROGUE => {
                let artifact = match key {
                    ArtifactKey::Snapshot(version) => Ok(forged_snapshot(version)),
                    _ => Err("the rogue builds nothing else".to_string()),
                };
                let sender = self.node(ROGUE).unwrap().sender_mut().unwrap();
                let loaded = sender.loaded(key, artifact);
                assert_eq!(
                    loaded.is_ok(),
                    matches!(key, ArtifactKey::Snapshot(_)),
                    "{loaded:?}"
                );
                self.drain(ROGUE);
            }
            Event::Loaded { key, .. } => {
                let bytes = match key {
                    ArtifactKey::Delta(version) => Ok(chain().deltas[version as usize - 1].clone()),
                    // Built from the store and signed by the hub as it loads them.
                    ArtifactKey::Snapshot(version) => Ok(chain().snapshots[&version].clone()),
                    ArtifactKey::Composed { base, target } => {
                        // The store's catch-up plan: one composed delta if it needs fewer
                        // bytes than replaying D(base+1..=target).
                        let bytes = self
                            .composed
                            .entry((base, target))
                            .or_insert_with(|| composed(base, target))
                            .clone();
                        let replay: usize = (base + 1..=target)
                            .map(|v| chain().deltas[v as usize - 1].len())
                            .sum();
                        (bytes.len() < replay)
                            .then_some(bytes)
                            .ok_or_else(|| "replaying is cheaper".to_string())
                    }
                };
                let declined = bytes.is_err();
                let artifact = bytes.map(|bytes| signed(bytes, key.kind()));
                let sender = self.node(HUB).unwrap().sender_mut().unwrap();
                let loaded = sender.loaded(key, artifact);
                assert_eq!(loaded.is_err(), declined, "{loaded:?}");
                self.drain(HUB);
            }
            Event::Join { node } => {
                let peer = &mut self.peers[node];
                if peer.node.is_none() && peer.weights.is_none() {
                    peer.node = Some(joiner(&peer.name.clone(), 2));
                    peer.weights = Some(Weights::empty(Arc::new(aurora_delta::Heap)));
                    self.at(Duration::ZERO, Event::NewSession { node });
                }
            }
            Event::Publish { version, step } => self.publish(version, step),
            Event::CutConnection => {
                let open: Vec<ConnId> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.open)
                    .map(|(id, _)| *id)
                    .collect();
                if !open.is_empty() {
                    let conn = open[self.rng.below(open.len() as u64) as usize];
                    self.faults.cuts += 1;
                    self.close(conn);
                }
            }
            Event::CutPeer { node } => {
                let open: Vec<ConnId> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.open && c.client == node)
                    .map(|(id, _)| *id)
                    .collect();
                self.faults.cuts += open.len() as u64;
                for conn in open {
                    self.close(conn);
                }
            }
            Event::IsolateRelay { node, duration } => {
                self.faults.relay_isolations += 1;
                self.isolated.insert(node, self.now + duration);
                let cut: Vec<ConnId> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.open && self.isolated(c.client, c.server))
                    .map(|(id, _)| *id)
                    .collect();
                for conn in cut {
                    self.close(conn);
                }
            }
            Event::CrashRelay { node } | Event::CrashActor { node } => {
                if node < 3 {
                    self.faults.relay_crashes += 1;
                } else {
                    self.faults.actor_restarts += 1;
                }
                self.crash(node);
                // A fetcher stops with its relay's process.
                let fetchers: Vec<usize> = self
                    .fetchers
                    .iter()
                    .filter(|(_, relay)| **relay == node)
                    .map(|(fetcher, _)| *fetcher)
                    .collect();
                for fetcher in fetchers {
                    self.stop_fetcher(fetcher);
                }
                if node >= 3 {
                    let after = self.rng.millis(100, 2000);
                    self.at(after, Event::RestartActor { node });
                }
            }
            Event::RestartActor { node } => {
                let peer = &mut self.peers[node];
                // Not joined yet: the Join event starts it.
                let Some(weights) = &peer.weights else {
                    return;
                };
                let streams = 1 + (node as u8 % 3);
                peer.node = Some(if weights.is_empty() {
                    // Crashed before its snapshot was active: it holds nothing.
                    joiner(&peer.name.clone(), streams)
                } else {
                    let active = weights.active();
                    verifying(Node::actor(
                        receiver(Role::Actor, &peer.name.clone(), streams, active),
                        active,
                    ))
                });
                // Often the hub first (as if the relay had not answered): its store
                // serves the catch-up, as one composed delta when that is cheaper.
                peer.route = Upstreams::new(
                    peer.upstreams.clone(),
                    Some(RETURN_AFTER),
                    jitter_seed(&peer.name),
                );
                if self.rng.chance(60) {
                    let unanswered = SessionEnd::CannotConnect("not yet listening".into());
                    peer.route.lost(self.now, &unanswered);
                }
                self.at(Duration::ZERO, Event::NewSession { node });
            }
        }
    }

    pub(crate) fn publish(&mut self, version: u64, step: usize) {
        let bytes = chain().deltas[version as usize - 1].clone();
        let file = DeltaFile::parse(&bytes).unwrap();
        let head = file.header().encode_pending();
        let sender = self.peers[HUB].node.as_mut().unwrap().sender_mut().unwrap();
        let count = file.segment_count();
        let signed = signed(bytes.clone(), ArtifactKind::Delta);
        if step == 0 {
            sender
                .begin_artifact(
                    ArtifactKind::Delta,
                    Bytes::from(head),
                    signed.offer_signature,
                )
                .unwrap();
        } else if step <= count {
            let index = step - 1;
            let segment = Bytes::copy_from_slice(file.verify_segment(index).unwrap());
            sender
                .add_segment(
                    ArtifactKey::Delta(version),
                    index as u32,
                    file.manifest.segments[index].hash,
                    segment,
                )
                .unwrap();
        } else {
            sender
                .seal_artifact(
                    ArtifactKey::Delta(version),
                    file.header().target_hash,
                    file.id,
                    file.manifest.segments.clone(),
                    signed.signature,
                )
                .unwrap();
            sender.set_loadable(Some(version));
            sender.set_snapshots(
                (self.first_snapshot..=version).filter(|v| v.is_multiple_of(SNAPSHOT_EVERY)),
            );
            sender.commit(signed_commit(version)).unwrap();
            if let Some(rogue) = self.peers.get_mut(ROGUE).and_then(|p| p.node.as_mut()) {
                // The forgery under the real delta's signatures (a relay forwards the
                // signatures it got), or with them stripped.
                let stripped = !version.is_multiple_of(2);
                let forged = StoredArtifact {
                    bytes: forged(version),
                    signature: signed.signature.filter(|_| !stripped),
                    offer_signature: signed.offer_signature.filter(|_| !stripped),
                };
                let rogue = rogue.sender_mut().unwrap();
                rogue.insert_artifact(forged).unwrap();
                rogue.set_snapshots((0..=version).filter(|v| v.is_multiple_of(SNAPSHOT_EVERY)));
                // Commits are authentic: it can only forward those.
                rogue.commit(signed_commit(version)).unwrap();
                self.drain(ROGUE);
            }
        }
        if step <= count {
            let after = self.rng.millis(1, 30);
            self.at(
                after,
                Event::Publish {
                    version,
                    step: step + 1,
                },
            );
        }
        self.drain(HUB);
    }

    pub(crate) fn close(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn).filter(|c| c.open) else {
            return;
        };
        c.open = false;
        let (client, server) = (c.client, c.server);
        let a = self.latency();
        self.at(a, Event::Closed { node: client, conn });
        let b = self.latency();
        self.at(b, Event::Closed { node: server, conn });
    }

    pub(crate) fn crash(&mut self, node: usize) {
        self.peers[node].node = None;
        self.peers[node].timer = None;
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.open && (c.client == node || c.server == node))
            .map(|(id, _)| *id)
            .collect();
        for conn in conns {
            self.close(conn);
        }
    }

    /// Carries out everything `node` wants done.
    pub(crate) fn drain(&mut self, node: usize) {
        let now = self.now;
        loop {
            let Some(output) = self.peers[node].node.as_mut().and_then(|n| n.poll(now)) else {
                break;
            };
            self.output(node, output);
        }
        let peer = &self.peers[node];
        let wake = [
            peer.node.as_ref().and_then(Node::poll_timeout),
            peer.node.as_ref().and(peer.route.return_at()),
        ]
        .into_iter()
        .flatten()
        .min();
        if let Some(wake) = wake
            && self.peers[node].timer.is_none_or(|t| wake < t)
        {
            self.peers[node].timer = Some(wake);
            let after = wake.saturating_duration_since(self.now);
            self.at(after, Event::Timer { node });
        }
    }

    pub(crate) fn output(&mut self, node: usize, output: Output) {
        if let Ok(traced) = std::env::var("AURORA_SIM_TRACE")
            && self.peers[node].name.contains(&traced)
        {
            let shown = match &output {
                Output::Transmit(Transmit { conn, frame, .. }) => {
                    let mut text = format!("{frame:?}");
                    text.truncate(120);
                    format!("on {conn}: {text}")
                }
                Output::Decode { version, index, .. } => format!("decode {version}/{index}"),
                other => format!("{other:?}"),
            };
            eprintln!(
                "{:>8?} {:>7} {shown}",
                self.now - self.start,
                self.peers[node].name
            );
        }
        match output {
            Output::Transmit(Transmit {
                conn,
                frame,
                close_after,
            }) => {
                let mut latency = self.latency();
                // Now and then a stream stalls, as a TCP connection recovering a loss
                // does, holding back what follows on it: what copies of overdue
                // versions on another stream are for (wire-protocol §5.13).
                if self.rng.chance(1) {
                    latency += self.rng.millis(100, 500);
                }
                let Some(c) = self.conns.get_mut(&conn).filter(|c| c.open) else {
                    return;
                };
                let last = if node == c.client {
                    &mut c.last_to_server
                } else {
                    &mut c.last_to_client
                };
                let at = (self.now + latency).max(*last);
                *last = at;
                let after = at - self.now;
                self.at(
                    after,
                    Event::Deliver {
                        conn,
                        from: node,
                        frame,
                        close_after,
                    },
                );
            }
            Output::Close { conn } => self.close(conn),
            Output::Dial { session, stream } => {
                let peer = &self.peers[node];
                let server = peer.route.current().expect("a receiving peer");
                let conn = self.next_conn;
                self.next_conn += 1;
                let now = self.now;
                self.conns.insert(
                    conn,
                    Conn {
                        client: node,
                        server,
                        session,
                        stream,
                        open: true,
                        last_to_server: now,
                        last_to_client: now,
                    },
                );
                let latency = self.latency();
                self.at(latency, Event::Accept { conn });
            }
            Output::UpstreamLost { reason } if self.fetchers.contains_key(&node) => {
                self.fetch_failed(node, &reason.to_string());
            }
            Output::UpstreamLost { reason } => {
                self.faults.upstream_switches += 1;
                if matches!(reason, SessionEnd::Violation(Violation::Signature(_))) {
                    self.faults.signatures_refused += 1;
                    *self.refused.entry(node).or_default() += 1;
                    assert!(
                        self.peers[ROGUE].node.is_some(),
                        "seed {}: {} refused a signature of the trainer's own hub: {reason}",
                        self.seed,
                        self.peers[node].name
                    );
                }
                if let Some(n) = &self.peers[node].node
                    && n.actor_status().is_some_and(|s| s.active.is_none())
                {
                    self.faults.join_sessions_lost += 1;
                    if n.receiver().is_some_and(|r| r.stats().segments > 0) {
                        self.faults.join_resumes += 1;
                    }
                }
                let backoff = self.peers[node].route.lost(self.now, &reason);
                self.at(backoff, Event::NewSession { node });
            }
            Output::Load(key) => {
                // Building a snapshot or a composed delta takes longer than reading one.
                let after = match key {
                    ArtifactKey::Delta(_) => self.rng.millis(1, 20),
                    _ => self.rng.millis(5, 60),
                };
                self.at(after, Event::Loaded { node, key });
            }
            Output::Decode {
                version,
                index,
                hash,
                kind,
                header,
                bytes,
            } => {
                let peer = &self.peers[node];
                // A snapshot's image is sized from its descriptor as its first segment
                // decodes: only the trainer's may get here.
                // Decoded from the Offer's header (its target hash pending) or, once
                // complete, from the artifact's.
                let offered = || {
                    let file = DeltaFile::parse(&chain().snapshots[&version]).unwrap();
                    *header == *file.header() || file.header().completes(&header)
                };
                assert!(
                    kind != ArtifactKind::Snapshot || offered(),
                    "seed {}: {} decodes a snapshot of version {version} the trainer did not offer",
                    self.seed,
                    peer.name
                );
                let weights = peer.weights.as_ref().unwrap();
                // Segments are decoded as they arrive, checked only against their frame's
                // hash: a rogue may send its forgeries under the trainer's Offer (whose
                // target hash is pending), and their results are dropped when the signed
                // table names other bytes. The trainer's own segments must decode.
                let outcome = weights.decode_segment(kind, &header, index, &bytes);
                if let Err(error) = &outcome {
                    let (base, trainer) = match kind {
                        ArtifactKind::Delta => (version - 1, &chain().deltas[version as usize - 1]),
                        ArtifactKind::Snapshot => (0, &chain().snapshots[&version]),
                        ArtifactKind::Composed => (
                            header.base_version,
                            &self.composed[&(header.base_version, version)],
                        ),
                    };
                    let file = DeltaFile::parse(trainer).unwrap();
                    assert!(
                        file.manifest.segments.get(index as usize).map(|s| s.hash) != Some(hash),
                        "seed {}: {} could not decode segment {index} of the trainer's version {version} (from {base}): {error}",
                        self.seed,
                        peer.name
                    );
                }
                let outcome = outcome.map_err(EffectError::from);
                let after = self.rng.millis(1, 50);
                self.at(
                    after,
                    Event::Decoded {
                        node,
                        version,
                        index,
                        hash,
                        outcome,
                    },
                );
            }
            Output::Verify { version } => {
                let peer = &self.peers[node];
                let patch = peer
                    .node
                    .as_ref()
                    .unwrap()
                    .staged_patch(version)
                    .expect("staged before it is verified");
                let outcome = peer
                    .weights
                    .as_ref()
                    .unwrap()
                    .verify(patch)
                    .map_err(EffectError::from);
                // The trainer's deltas check out over the weights they were staged on.
                assert!(
                    outcome.is_ok(),
                    "seed {}: {} staged version {version}, which does not produce its target: {outcome:?}",
                    self.seed,
                    peer.name
                );
                let after = self.rng.millis(1, 100);
                self.at(
                    after,
                    Event::Verified {
                        node,
                        version,
                        outcome,
                    },
                );
            }
            Output::AwaitSafePoint => {
                let after = self.rng.millis(1, 300);
                self.at(after, Event::SafePoint { node });
            }
            Output::Activate { version } => {
                let peer = &mut self.peers[node];
                let patch = peer
                    .node
                    .as_mut()
                    .unwrap()
                    .take_staged(version)
                    .expect("staged before");
                let joining = peer.weights.as_ref().unwrap().is_empty();
                if !joining
                    && self
                        .lose_weights_at
                        .is_some_and(|(actor, at)| actor == node && version >= at)
                {
                    // As the tokio driver does with weights a panic left no version's:
                    // nobody reads them again, and the actor rejoins.
                    self.lose_weights_at = None;
                    self.faults.lost_weights += 1;
                    let emptied = peer.weights.as_ref().unwrap().emptied();
                    peer.weights = Some(emptied);
                    let lost = EffectError::ActivationPanicked {
                        message: "the simulation's fault".into(),
                        intact: false,
                    };
                    peer.node.as_mut().unwrap().activated(version, Err(lost));
                    return;
                }
                if !joining && version > peer.weights.as_ref().unwrap().active().version + 1 {
                    self.faults.composed_activations += 1;
                }
                let outcome = peer.weights.as_mut().unwrap().activate(patch);
                let expected = chain().hashes[version as usize];
                if joining {
                    self.faults.joins += 1;
                    if peer.route.current() == Some(RELAYS[0]) {
                        self.faults.joins_from_relay += 1;
                    }
                }
                match &outcome {
                    Ok(hash) => assert_eq!(
                        *hash, expected,
                        "seed {}: {} activated wrong weights for version {version}",
                        self.seed, peer.name
                    ),
                    Err(error) => panic!(
                        "seed {}: {} failed to activate version {version}: {error}",
                        self.seed, peer.name
                    ),
                }
                let outcome = outcome.map_err(EffectError::from);
                peer.node.as_mut().unwrap().activated(version, outcome);
            }
            Output::FetchSnapshot { newer_than } => self.fetch(node, newer_than),
            Output::Notice(Notice::Connected(_)) => self.peers[node].route.connected(self.now),
            Output::Notice(Notice::Complete { .. }) if self.fetchers.contains_key(&node) => {
                self.fetched(node);
            }
            Output::Notice(Notice::Complete { .. }) => {
                self.peers[node].route.delivered();
                self.poll_return(node, true);
            }
            Output::Notice(_) => {}
        }
    }

    /// Leaves a session on a fallback for the first upstream once it is time and the
    /// receiver is between versions, as the tokio driver does.
    pub(crate) fn poll_return(&mut self, node: usize, delivered: bool) {
        let now = self.now;
        let peer = &mut self.peers[node];
        let Some(receiver) = peer.node.as_mut().and_then(Node::receiver_mut) else {
            return;
        };
        if peer.route.poll_return(now, receiver, delivered) {
            self.faults.returns += 1;
        }
    }
}
