//! Membership: a preemption and a newcomer (fig:fault), and a pool grown from one actor
//! to four (fig:scale).

use super::*;

impl Bench {
    pub(super) fn fault_and_scale(&self) -> Result<Section, Violation> {
        const NOTICE_WHY: &str = "aurora's actor takes the preemption notice and hands its \
            leases back at once (the graceful leave), and an actor gone without a notice is \
            found by its missed heartbeats within 4 s (the what-if), so the step loses \
            little; the paper's step loses most of its rollouts: a difference of design, \
            unexplained by an input";
        const TRAINER_BOUND_WHY: &str = "the paper's pool gains 2.4x from one actor to \
            four, so its pipeline is bound by the trainer at four A100s; the modelled \
            trainer (2 H100 at 40% MFU, training overlapped with the next generation) \
            binds later: unexplained by a single input";
        let paper = PAPER_DEPLOYMENTS[0];
        let setup = Setup::paper(&paper, UNNAMED_DATASET);
        let model = setup.model;
        let base = paper_pool(&paper);
        let deployment = self.deployment(&setup, &base);
        let reference = self.generate(&setup, &base, SplitPolicy::Proportional, Vec::new())?;
        // Each region's relay took the snapshot of version 0 as the run began, and keeps
        // the deltas after it: a newcomer takes both from it, over its datacenter's network.
        let snapshot_s = {
            let from = JoinFrom::aurora(&model, setup.workload.density, 14);
            self.network.snapshot_join_s(&self.tcp, &model, from)
        };
        let step_opened = |step: usize| reference.opened_at_s.get(step).copied().unwrap_or(0.0);
        let faults = vec![ScheduledFault {
            at_ms: ((step_opened(6) + 1.0) * 1e3) as u64,
            fault: Fault::Preempt { actor: 1 },
        }];
        // The newcomer comes as step 14 opens, on the timeline the preemption slowed: a
        // run without it tells when that is, since nothing changes before it registers.
        let preempted = self.generate(&setup, &base, SplitPolicy::Proportional, faults.clone())?;
        let arrives_at_s = preempted.opened_at_s.get(14).copied().unwrap_or(0.0);
        let mut pool = base.clone();
        pool.push(PoolActor {
            joins_at_s: arrives_at_s + snapshot_s,
            ..actor(A100, CANADA)
        });
        let churn = self.generate(&setup, &pool, SplitPolicy::Proportional, faults.clone())?;
        let timings = self.timings(&deployment, System::AuroraRl, &churn);
        let steps = self.runs.steps as usize;
        let joined = churn
            .first_step_opened_after(arrives_at_s + snapshot_s)
            .max(15);
        let slow_pool = decoding_at(&pool, SLOW_DECODE_ROOFLINE_SHARE);
        let slow_setup = setup.slow_trainer();
        // The churn run under each what-if: decode at 0.35 of the roofline, the
        // trainer at 25% MFU.
        let what_if_churn = |steps: std::ops::Range<usize>,
                             label: &str,
                             paper: f64|
         -> Result<Vec<Row>, Violation> {
            let slow_decode = self.generate(
                &setup,
                &slow_pool,
                SplitPolicy::Proportional,
                faults.clone(),
            )?;
            let decode_rate = throughput(
                &self.timings(&deployment, System::AuroraRl, &slow_decode),
                steps.clone(),
            );
            let slow_training = self.deployment(&slow_setup, &pool);
            let trainer_rate = throughput(
                &self.timings(&slow_training, System::AuroraRl, &churn),
                steps,
            );
            Ok(vec![
                Row::what_if(
                    format!("decode at 0.35 of the roofline: {label}"),
                    Value(paper),
                    decode_rate,
                    "tokens/s",
                ),
                Row::what_if(
                    format!("trainer at 25% MFU: {label}"),
                    Value(paper),
                    trainer_rate,
                    "tokens/s",
                ),
            ])
        };
        let mut rows = vec![Row::simulated(
            "newcomer's snapshot from its relay",
            snapshot_s,
            "s",
        )];
        rows.extend(checked(
            Row::compared(
                "before the preemption (steps 2-5)",
                Value(13_400.0),
                throughput(&timings, 2..6),
                "tokens/s",
            ),
            DECODE_WHY,
            0.3,
            || what_if_churn(2..6, "before the preemption", 13_400.0),
        )?);
        rows.extend(checked(
            Row::compared(
                "the step of the preemption",
                Value(4_700.0),
                throughput(&timings, 6..7),
                "tokens/s",
            ),
            NOTICE_WHY,
            2.0,
            || {
                let died = vec![ScheduledFault {
                    at_ms: ((step_opened(6) + 1.0) * 1e3) as u64,
                    fault: Fault::Die { actor: 1 },
                }];
                let generation = self.generate(&setup, &base, SplitPolicy::Proportional, died)?;
                let timings = self.timings(&deployment, System::AuroraRl, &generation);
                Ok(vec![Row::what_if(
                    "the step of the preemption, the actor gone without a notice",
                    Value(4_700.0),
                    throughput(&timings, 6..7),
                    "tokens/s",
                )])
            },
        )?);
        rows.push(Row::compared(
            "three actors (steps 7-13)",
            Range(11_000.0, 12_000.0),
            throughput(&timings, 7..14),
            "tokens/s",
        ));
        rows.extend(checked(
            Row::compared(
                format!("after onboarding (steps {joined}-{})", steps - 1),
                Value(13_500.0),
                throughput(&timings, joined..steps),
                "tokens/s",
            ),
            DECODE_WHY,
            0.3,
            || what_if_churn(joined..steps, "after onboarding", 13_500.0),
        )?);
        let mut first = 0.0;
        for (actors, paper) in [(1, 5_600.0), (2, 9_300.0), (3, 11_500.0), (4, 13_500.0)] {
            let pool = a100s(actors, CANADA);
            let rate = self.aurora_rl_tokens_per_s(&setup, &pool)?;
            if actors == 1 {
                first = rate;
            }
            rows.extend(checked(
                Row::compared(format!("{actors} actor(s)"), Value(paper), rate, "tokens/s"),
                DECODE_WHY,
                0.3,
                || {
                    Ok(vec![
                        Row::what_if(
                            format!("decode at 0.35 of the roofline: {actors} actor(s)"),
                            Value(paper),
                            self.aurora_rl_tokens_per_s(
                                &setup,
                                &decoding_at(&pool, SLOW_DECODE_ROOFLINE_SHARE),
                            )?,
                            "tokens/s",
                        ),
                        Row::what_if(
                            format!("trainer at 25% MFU: {actors} actor(s)"),
                            Value(paper),
                            self.aurora_rl_tokens_per_s(&setup.slow_trainer(), &pool)?,
                            "tokens/s",
                        ),
                    ])
                },
            )?);
            if actors == 4 {
                rows.push(
                    Row::compared("4 actors over 1", Value(2.4), rate / first, "x")
                        .explained(TRAINER_BOUND_WHY, 0.6),
                );
            }
        }
        Ok(Section {
            title: "7. A preemption at step 6, a newcomer at step 14; 1 to 4 actors (sections 7.5 \
                    and 7.8, fig:fault, fig:scale)"
                .into(),
            setting: format!(
                "Qwen3-4B on 2 H100, A100 actors in Canada, {}, AuroraRL; preemptions and \
                 joins through the control core's membership",
                UNNAMED_DATASET.name
            ),
            rows,
        })
    }
}
