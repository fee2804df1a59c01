//! Scheduled faults striking the actors and the hub, and the hub's restore from its
//! serialized state after a restart.

use aurora_control::{ControlPlane, Snapshot};

use super::{Presence, Sim, TrainerPhase, Wake};
use crate::report::Violation;
use crate::scenario::Fault;
use crate::world::{PREEMPTION_GRACE_MS, actor_id};

impl Sim<'_> {
    pub(super) fn inject(&mut self, fault: Fault) -> Result<(), Violation> {
        let now = self.now;
        match fault {
            Fault::Leave { actor } => {
                if self.actors[actor].presence != Presence::Online {
                    return Ok(());
                }
                if self.reachable(actor) && self.actors[actor].registered {
                    // An error means the hub had already forgotten it (heartbeat
                    // timeout), which is just as good.
                    self.calls.leave_or_preempt += 1;
                    let _ = self.hub_mut()?.leave(actor_id(actor));
                }
                self.take_offline(actor, Presence::Departed);
            }
            Fault::Preempt { actor } => {
                if self.actors[actor].presence != Presence::Online
                    || self.actors[actor].leaving_at.is_some()
                {
                    return Ok(());
                }
                if self.reachable(actor) && self.actors[actor].registered {
                    // As for a leave, an error means the hub had forgotten it already.
                    self.calls.leave_or_preempt += 1;
                    let _ = self.hub_mut()?.preempt(actor_id(actor), now);
                }
                // The machine goes at the end of the window whether or not the notice
                // reached the hub.
                let leaving_at = now.saturating_add(PREEMPTION_GRACE_MS);
                self.actors[actor].leaving_at = Some(leaving_at);
                self.wake_actor_at(actor, now);
            }
            Fault::Die { actor } => {
                if self.actors[actor].presence == Presence::Online {
                    self.take_offline(actor, Presence::Dead);
                }
            }
            Fault::Rejoin { actor } => {
                let rejoining = &mut self.actors[actor];
                if matches!(rejoining.presence, Presence::Departed | Presence::Dead) {
                    rejoining.presence = Presence::Online;
                    rejoining.offline_since = None;
                    rejoining.leaving_at = None;
                    rejoining.registered = false;
                    rejoining.next_heartbeat = now;
                    self.wake_actor_at(actor, now);
                }
            }
            Fault::Partition { actor, duration_ms } => {
                let until = now.saturating_add(duration_ms);
                let partitioned = &mut self.actors[actor];
                partitioned.partitioned_until = partitioned.partitioned_until.max(until);
            }
            Fault::Slow {
                actor,
                speed,
                duration_ms,
            } => {
                self.actors[actor].slow = Some((now.saturating_add(duration_ms), speed));
            }
            Fault::Misbehave { actor, misbehavior } => {
                self.actors[actor].misbehavior = Some(misbehavior)
            }
            Fault::HubRestart { downtime_ms } | Fault::TrainerCrash { downtime_ms } => {
                if matches!(fault, Fault::TrainerCrash { .. }) && self.hub.is_some() {
                    let crashes = &mut self.trainer_crashes;
                    match self.trainer {
                        TrainerPhase::Opening => crashes.opening += 1,
                        TrainerPhase::StepOpen(_) => crashes.step_open += 1,
                        TrainerPhase::Training => crashes.training += 1,
                        TrainerPhase::Done | TrainerPhase::Down => {}
                    }
                    if self.trainer != TrainerPhase::Done {
                        self.trainer = TrainerPhase::Down;
                    }
                }
                if let Some(hub) = self.hub.take() {
                    let json = serde_json::to_string(&hub)
                        .map_err(|error| self.violation(format!("snapshot: {error}")))?;
                    drop(hub);
                    self.snapshot = Some(json);
                    self.hub_timer = None;
                    self.schedule(now.saturating_add(downtime_ms), Wake::HubUp);
                }
            }
        }
        Ok(())
    }

    pub(super) fn restore_hub(&mut self) -> Result<(), Violation> {
        let Some(json) = self.snapshot.take() else {
            return Ok(());
        };
        let snapshot: Snapshot = serde_json::from_str(&json)
            .map_err(|error| self.violation(format!("restore: {error}")))?;
        let again = serde_json::to_string(&snapshot)
            .map_err(|error| self.violation(format!("snapshot: {error}")))?;
        if again != json {
            return Err(self.violation("the restored state serializes differently".into()));
        }
        let hub = ControlPlane::restore(snapshot, self.now)
            .map_err(|error| self.violation(format!("restore refused: {error}")))?;
        self.last_resume = self.now;
        self.hub = Some(hub);
        self.hub_restarts += 1;
        if self.trainer == TrainerPhase::Down {
            self.resume_trainer()?;
        }
        Ok(())
    }
}
