//! A seeded, deterministic simulation of the control plane under virtual time.
//!
//! [`run`] drives the real [`ControlPlane`] with a trainer and a pool of simulated
//! actors, jumping from one scheduled wakeup to the next (nothing sleeps, nothing reads
//! a clock). Actors differ up to 3x in speed and drift batch to batch; a [`Scenario`]
//! adds joins, graceful leaves, preemptions (the actor finishes what it holds within
//! the warning window, then goes), silent deaths, rejoins, slowdowns,
//! partitions, actors that submit results with the wrong hash, on the wrong version or
//! for forged leases, and hub restarts: the hub's whole state is serialized with
//! serde_json, dropped, and restored (checked) after a downtime.
//!
//! While it runs, a checker holds the core to its promises:
//!
//! * **No prompt lost.** After every event, the hub's accepted, leased and pooled
//!   prompts are exactly the prompts the trainer posted, each listed once; the
//!   accepted ones are exactly those the actors were told were accepted; each leased
//!   one is held by the actor the driver last saw it granted to; reservations never
//!   exceed the pool; and the core passes [`ControlPlane::check_invariants`]. At
//!   completion the trainer takes the step's outcome once, and its accepted and
//!   unfinished prompts are exactly the prompts posted.
//! * **None accepted twice**, per step and prompt.
//! * **None accepted wrongly**: every accepted result was generated on its job's
//!   version, with h(version), by the lease's holder, strictly before the lease
//!   expired, and not by an incarnation of the actor that the hub had since forgotten.
//! * **Progress.** Every step completes within a bound of virtual time (the scenario
//!   keeps one actor alive throughout), and the run completes all its steps.
//! * **Consistent membership**: a dead or departed actor is forgotten within the
//!   heartbeat timeout, every relay is a relay-capable member of its region, every
//!   region with such a member has a relay, the actor limit holds.
//! * **Honest counters**: the core's accepted and rejected totals match what the
//!   actors were told, across restarts.
//! * **Bounded estimates**: no settlement raises an actor's throughput estimate by
//!   more than [`MAX_SAMPLE_GROWTH`] allows, whatever token counts it reports.
//!
//! A violation carries its seed; [`run`] on [`Scenario::random`] of that seed replays it
//! exactly (the test reads `AURORA_SIM_SEEDS` to rerun chosen seeds).
//!
//! [`compare_split_policies`] and [`preemption_timeline`] run fixed scenarios and
//! return plain data for a benchmark to print. [`paper`] reproduces the AuroraRL
//! paper's evaluation at its scale on top of the same driver, and goes past it.
//!
//! [`ControlPlane`]: aurora_control::ControlPlane
//! [`ControlPlane::check_invariants`]: aurora_control::ControlPlane::check_invariants
//! [`MAX_SAMPLE_GROWTH`]: aurora_control::MAX_SAMPLE_GROWTH

mod bench;
mod driver;
pub mod paper;
mod report;
mod scenario;
mod world;

pub use bench::{PolicyOutcome, SplitComparison, compare_split_policies, preemption_timeline};
pub use driver::run;
pub use report::{ActorReport, ControlCalls, RunReport, StepRecord, TrainerCrashes, Violation};
pub use scenario::{
    ActorSpec, BatchedDecode, Fault, Liveness, Misbehavior, Scenario, ScheduledFault,
};
