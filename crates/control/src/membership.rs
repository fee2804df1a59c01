//! Who the actors are: registration, liveness, reported versions, throughput
//! estimates and one relay per region.
//!
//! Membership changes only ever touch the actor that changed (and, when it was a
//! relay, its region's relay choice). No other actor's leases, reservations or
//! estimates move, which is what lets surviving actors carry on without pausing.
//!
//! **Liveness.** Every message from an actor counts as a heartbeat. An actor silent
//! for `heartbeat_timeout_ms` is removed; its leases return to the pool then rather
//! than at their own expiry, since a dead actor will not answer them.
//!
//! **Relays.** A region's relay is kept as long as it stays a relay-capable member of
//! the region, so a join never moves traffic. When it goes, the relay-capable member
//! with the smallest id takes over: deterministic, so every replica of the core (and
//! every replay of a simulation) picks the same one.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::Config;
use crate::events::{Event, EventQueue};
use crate::ledger::check_time;
use crate::restore::RestoreError;
use crate::scheduler::{Eligibility, MilliTokensPerS, NewActorEstimate, SchedulerConfig};
use crate::values::{ActorId, Capabilities, Millis, Permille, Region, Version};

/// What an actor says about itself when it (re)joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Its network region.
    pub region: Region,
    /// What it can do besides generating.
    pub capabilities: Capabilities,
    /// The version it generates with.
    pub active: Version,
    /// The next version, fully received and verified, waiting for Commit.
    pub staged: Option<Version>,
}

/// A registered actor as the core sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its network region.
    pub region: Region,
    /// What it can do besides generating.
    pub capabilities: Capabilities,
    /// The version it generates with, as last reported.
    pub active: Version,
    /// Its staged version, as last reported.
    pub staged: Option<Version>,
    /// MilliTokensPerS estimate `tau`.
    pub estimate: MilliTokensPerS,
    /// When it was last heard from.
    pub last_seen: Millis,
    /// Set by a preemption notice: when its warning window ends and it is removed.
    /// Until then it keeps its leases but gets no new work and relays for nobody.
    pub leaving_at: Option<Millis>,
    /// End of its last settlement; throughput is measured from there so that two
    /// submissions out of one batch do not both count the whole batch's time.
    last_settled_at: Option<Millis>,
}

/// An operation named an actor that is not registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("{0} is not registered")]
pub struct UnknownActor(pub ActorId);

/// Why a registration or version report was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum MembershipError {
    /// The actor is not registered.
    #[error(transparent)]
    UnknownActor(#[from] UnknownActor),
    /// `limits.max_actors` are registered already.
    #[error("the membership is full ({max} actors)")]
    ActorLimit {
        /// The limit.
        max: u32,
    },
    /// No version has been published, so no reported version can be checked.
    #[error("no version has been published yet")]
    NothingPublished,
    /// A reported version is newer than anything published.
    #[error("{version} has not been published (latest is {latest})")]
    VersionNotPublished {
        /// The version reported.
        version: Version,
        /// The latest published version.
        latest: Version,
    },
    /// A staged delta always applies on top of the active version, so it must be the
    /// next one.
    #[error("staged {staged} is not the version after active {active}")]
    StagedNotNext {
        /// The active version reported.
        active: Version,
        /// The staged version reported.
        staged: Version,
    },
}

/// Checks reported versions against the latest published one, which it returns.
pub(crate) fn check_versions(
    active: Version,
    staged: Option<Version>,
    latest: Option<Version>,
) -> Result<Version, MembershipError> {
    let latest = latest.ok_or(MembershipError::NothingPublished)?;
    if let Some(staged) = staged
        && active.next() != Some(staged)
    {
        return Err(MembershipError::StagedNotNext { active, staged });
    }
    let newest = staged.unwrap_or(active);
    if newest > latest {
        return Err(MembershipError::VersionNotPublished {
            version: newest,
            latest,
        });
    }
    Ok(latest)
}

/// Whether a registration added an actor or replaced a live registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Joined {
    New,
    Replaced,
}

/// The membership's whole state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Membership {
    members: BTreeMap<ActorId, Member>,
    relays: BTreeMap<Region, ActorId>,
    /// Derived from `members`: not stored, rebuilt on restore.
    #[serde(skip)]
    deadlines: Deadlines,
}

/// The members by when they fall silent and by when their preemption window ends,
/// kept beside them because every call asks whose window has ended and the driver
/// asks for the next deadline after every call: at 1,000 actors a pass over the
/// members for each was most of the core's time (`cargo bench -p aurora-control
/// --bench calls`, a profile of `aurora sim paper`). Changed only where `last_seen`
/// or `leaving_at` change; [`Membership::check`] compares it with a rebuild.
#[derive(Clone, Debug, Default)]
struct Deadlines {
    last_seen: BTreeSet<(Millis, ActorId)>,
    leaving_at: BTreeSet<(Millis, ActorId)>,
}

impl Deadlines {
    fn of(members: &BTreeMap<ActorId, Member>) -> Deadlines {
        let mut deadlines = Deadlines::default();
        for (&actor, member) in members {
            deadlines.add(actor, member);
        }
        deadlines
    }

    fn add(&mut self, actor: ActorId, member: &Member) {
        self.last_seen.insert((member.last_seen, actor));
        if let Some(at) = member.leaving_at {
            self.leaving_at.insert((at, actor));
        }
    }

    fn remove(&mut self, actor: ActorId, member: &Member) {
        self.last_seen.remove(&(member.last_seen, actor));
        if let Some(at) = member.leaving_at {
            self.leaving_at.remove(&(at, actor));
        }
    }

    fn agrees_with(&self, other: &Deadlines) -> bool {
        self.last_seen == other.last_seen && self.leaving_at == other.leaving_at
    }
}

/// Derived from the members, which `Membership` compares already (see `JobIndex`).
impl PartialEq for Deadlines {
    fn eq(&self, _: &Deadlines) -> bool {
        true
    }
}

impl Eq for Deadlines {}

impl Membership {
    /// Adds an actor, or replaces the registration of one that is already a member (a
    /// restarted process that the heartbeat timeout has not caught yet). A replaced
    /// member keeps its estimate: it is the same machine.
    pub(crate) fn register(
        &mut self,
        actor: ActorId,
        registration: Registration,
        now: Millis,
        max_actors: u32,
        new_actor_estimate: NewActorEstimate,
        events: &mut EventQueue,
    ) -> Result<Joined, MembershipError> {
        let (joined, estimate, last_settled_at, old_region) = match self.members.get(&actor) {
            Some(member) => (
                Joined::Replaced,
                member.estimate,
                member.last_settled_at,
                Some(member.region.clone()),
            ),
            None => {
                if self.members.len() >= usize::try_from(max_actors).unwrap_or(usize::MAX) {
                    return Err(MembershipError::ActorLimit { max: max_actors });
                }
                let known = self.members.values().map(|member| member.estimate);
                (
                    Joined::New,
                    new_actor_estimate.for_newcomer(known),
                    None,
                    None,
                )
            }
        };
        let region = registration.region.clone();
        if let Some(old) = self.members.get(&actor) {
            self.deadlines.remove(actor, old);
        }
        let member = Member {
            region: registration.region,
            capabilities: registration.capabilities,
            active: registration.active,
            staged: registration.staged,
            estimate,
            last_seen: now,
            leaving_at: None,
            last_settled_at,
        };
        self.deadlines.add(actor, &member);
        self.members.insert(actor, member);
        if let Some(old_region) = old_region.filter(|old| *old != region) {
            self.refresh_relay(&old_region, events);
        }
        self.refresh_relay(&region, events);
        Ok(joined)
    }

    /// Records that `actor` was heard from.
    pub(crate) fn touch(
        &mut self,
        actor: ActorId,
        now: Millis,
    ) -> Result<&mut Member, UnknownActor> {
        let member = self.members.get_mut(&actor).ok_or(UnknownActor(actor))?;
        if now > member.last_seen {
            self.deadlines.last_seen.remove(&(member.last_seen, actor));
            self.deadlines.last_seen.insert((now, actor));
            member.last_seen = now;
        }
        Ok(member)
    }

    /// Removes `actor`, handing its region's relay role on if it held it.
    pub(crate) fn remove(&mut self, actor: ActorId, events: &mut EventQueue) -> Option<Member> {
        let member = self.members.remove(&actor)?;
        self.deadlines.remove(actor, &member);
        self.refresh_relay(&member.region, events);
        Some(member)
    }

    /// Actors not heard from for `timeout_ms` at `now`.
    pub(crate) fn silent(&self, now: Millis, timeout_ms: u64) -> Vec<ActorId> {
        self.deadlines
            .last_seen
            .iter()
            .take_while(|&&(last_seen, _)| now >= last_seen.saturating_add(timeout_ms))
            .map(|&(_, actor)| actor)
            .collect()
    }

    /// When the next actor falls silent, if nobody is heard from before then.
    pub(crate) fn next_silence(&self, timeout_ms: u64) -> Option<Millis> {
        self.deadlines
            .last_seen
            .first()
            .map(|&(last_seen, _)| last_seen.saturating_add(timeout_ms))
    }

    /// Restarts every actor's silence clock at `now`.
    pub(crate) fn forgive_silence_until(&mut self, now: Millis) {
        for member in self.members.values_mut() {
            member.last_seen = member.last_seen.max(now);
        }
        self.deadlines = Deadlines::of(&self.members);
    }

    /// Every member by id, with its eligibility for a step on `version` and its
    /// estimate: the input of [`crate::split_among_eligible`].
    pub(crate) fn standings(
        &self,
        version: Version,
    ) -> (Vec<ActorId>, Vec<(Eligibility, MilliTokensPerS)>) {
        self.members
            .iter()
            .map(|(&actor, member)| {
                // An actor in its preemption window takes no new work.
                let eligibility = if member.leaving_at.is_some() {
                    Eligibility::Behind
                } else {
                    Eligibility::of(version, member.active, member.staged)
                };
                (actor, (eligibility, member.estimate))
            })
            .unzip()
    }

    /// Decays the estimate of every member too far behind `version` to work on it.
    pub(crate) fn decay_behind(&mut self, version: Version, alpha: Permille) {
        for member in self.members.values_mut() {
            if Eligibility::of(version, member.active, member.staged) == Eligibility::Behind {
                member.estimate = member.estimate.decayed(alpha);
            }
        }
    }

    /// Folds one settlement into `actor`'s estimate: `tokens` accepted at `now` for
    /// leases the earliest of which was issued at `earliest_issue`. Elapsed time runs
    /// from the later of that issue and the previous settlement, so time spent idle
    /// without work, or already counted, does not dilute the measurement; the sample is
    /// bounded by [`SchedulerConfig::plausible_sample`].
    pub(crate) fn record_throughput(
        &mut self,
        actor: ActorId,
        tokens: u64,
        earliest_issue: Millis,
        now: Millis,
        config: &SchedulerConfig,
    ) {
        let Some(member) = self.members.get_mut(&actor) else {
            return;
        };
        let start = member
            .last_settled_at
            .map_or(earliest_issue, |last| last.max(earliest_issue));
        let sample = config.plausible_sample(tokens, now.saturating_since(start), member.estimate);
        member.estimate = member
            .estimate
            .averaged_with(sample, config.estimate_weight);
        member.last_settled_at = Some(now);
    }

    /// Multiplies `actor`'s estimate by `factor` (after its leases expired).
    pub(crate) fn decay_estimate(&mut self, actor: ActorId, factor: Permille) {
        if let Some(member) = self.members.get_mut(&actor) {
            member.estimate = member.estimate.decayed(factor);
        }
    }

    /// Starts `actor`'s preemption window, ending at `leaving_at`, and hands its
    /// region's relay role on. Returns false if it is not a member.
    pub(crate) fn mark_leaving(
        &mut self,
        actor: ActorId,
        leaving_at: Millis,
        events: &mut EventQueue,
    ) -> bool {
        let Some(member) = self.members.get_mut(&actor) else {
            return false;
        };
        // A second notice never extends the window.
        let leaving_at = member
            .leaving_at
            .map_or(leaving_at, |at| at.min(leaving_at));
        self.deadlines.remove(actor, member);
        member.leaving_at = Some(leaving_at);
        self.deadlines.add(actor, member);
        let region = member.region.clone();
        self.refresh_relay(&region, events);
        true
    }

    /// Members whose preemption window has ended at `now`.
    pub(crate) fn leaving_due(&self, now: Millis) -> Vec<ActorId> {
        self.deadlines
            .leaving_at
            .iter()
            .take_while(|&&(at, _)| now >= at)
            .map(|&(_, actor)| actor)
            .collect()
    }

    /// When the next preemption window ends.
    pub(crate) fn next_leaving(&self) -> Option<Millis> {
        self.deadlines.leaving_at.first().map(|&(at, _)| at)
    }

    /// Rebuilds the deadlines from the members: a deserialized membership has none.
    pub(crate) fn rebuild_deadlines(&mut self) {
        self.deadlines = Deadlines::of(&self.members);
    }

    /// Checks the membership's invariants: what [`crate::ControlPlane::restore`]
    /// demands of a snapshot.
    pub(crate) fn check(
        &self,
        config: &Config,
        latest: Option<Version>,
        clock: Millis,
    ) -> Result<(), RestoreError> {
        let max = config.limits.max_actors;
        if self.members.len() > usize::try_from(max).unwrap_or(usize::MAX) {
            return Err(RestoreError::TooManyMembers {
                count: self.members.len(),
                max,
            });
        }
        let starting = config.scheduler.new_actor_estimate.floor();
        // Estimates are averages of capped samples, starting estimates, or decays of
        // either; a newcomer may start at the slowest known, which is below both.
        let highest = starting.max(config.scheduler.max_sample_rate);
        for (&actor, member) in &self.members {
            check_versions(member.active, member.staged, latest)
                .map_err(|source| RestoreError::MemberVersions { actor, source })?;
            if member.estimate > highest {
                return Err(RestoreError::ImplausibleEstimate(actor));
            }
            check_time("last heartbeat", member.last_seen, clock)?;
            if let Some(at) = member.last_settled_at {
                check_time("last settlement", at, clock)?;
            }
            if let Some(leaving_at) = member.leaving_at
                && leaving_at > clock.saturating_add(config.preemption_grace_ms)
            {
                return Err(RestoreError::LeavingTooLate { actor, leaving_at });
            }
        }
        if !self.deadlines.agrees_with(&Deadlines::of(&self.members)) {
            return Err(RestoreError::MemberDeadlines);
        }
        for (region, &relay) in &self.relays {
            if !self.qualifies(relay, region) {
                return Err(RestoreError::InvalidRelay {
                    region: region.clone(),
                    relay,
                });
            }
        }
        if let Some(member) = self.members.iter().find_map(|(&actor, member)| {
            (self.qualifies(actor, &member.region) && !self.relays.contains_key(&member.region))
                .then_some(member)
        }) {
            return Err(RestoreError::MissingRelay(member.region.clone()));
        }
        Ok(())
    }

    /// Whether `actor` may relay for `region`: a relay-capable member of it that has
    /// not been told it is about to be preempted.
    fn qualifies(&self, actor: ActorId, region: &Region) -> bool {
        self.members.get(&actor).is_some_and(|member| {
            member.region == *region && member.capabilities.can_relay && member.leaving_at.is_none()
        })
    }

    /// A registered actor.
    pub(crate) fn get(&self, actor: ActorId) -> Option<&Member> {
        self.members.get(&actor)
    }

    /// All registered actors, by id.
    pub(crate) fn members(&self) -> &BTreeMap<ActorId, Member> {
        &self.members
    }

    /// The relay of each region that has one.
    pub(crate) fn relays(&self) -> &BTreeMap<Region, ActorId> {
        &self.relays
    }

    /// Keeps `region`'s relay if it still qualifies, else picks a new one, and reports
    /// a change.
    fn refresh_relay(&mut self, region: &Region, events: &mut EventQueue) {
        let qualifies = |actor: &ActorId| self.qualifies(*actor, region);
        let current = self.relays.get(region).copied();
        let chosen = current
            .filter(qualifies)
            .or_else(|| self.members.keys().copied().find(qualifies));
        if chosen == current {
            return;
        }
        match chosen {
            Some(relay) => self.relays.insert(region.clone(), relay),
            None => self.relays.remove(region),
        };
        events.push(Event::RelayChanged {
            region: region.clone(),
            relay: chosen,
        });
    }
}
