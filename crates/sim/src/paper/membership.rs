//! Membership: a preemption and a newcomer (fig:fault), and a pool grown from one actor
//! to four (fig:scale).

use super::*;

impl Bench {
    pub(super) fn fault_and_scale(&self) -> Result<Section, Violation> {
        const ONE_ACTOR_WHY: &str = "one actor holds all 512 sequences and decodes at \
            most 256 at once (vLLM's default, an assumption), four hold 128 each, so the \
            gain follows how many sequences share each read of the weights; the model's \
            single actor makes 17% less than the paper's 5.6K tokens/s, and no single input \
            moves one end without the other: unexplained";
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
        // Section 7.5: "the preempted Actor's rollout aborts": the machine is gone with its
        // work, and the paper's system finds out only as the leases expire.
        let preemption_at_ms = ((step_opened(6) + 1.0) * 1e3) as u64;
        let faults = vec![ScheduledFault {
            at_ms: preemption_at_ms,
            fault: Fault::Die { actor: 1 },
        }];
        let generate = |pool: &[PoolActor], faults: Vec<ScheduledFault>| {
            self.generate(&setup, pool, SplitPolicy::Proportional, faults)
        };
        // The newcomer comes as step 14 opens, on the timeline the preemption slowed: a
        // run without it tells when that is, since nothing changes before it registers.
        let preempted = generate(&base, faults.clone())?;
        let arrives_at_s = preempted.opened_at_s.get(14).copied().unwrap_or(0.0);
        let mut pool = base.clone();
        pool.push(PoolActor {
            joins_at_s: arrives_at_s + snapshot_s,
            ..actor(A100, CANADA)
        });
        let churn = generate(&pool, faults.clone())?;
        let timings = self.timings(&deployment, System::AuroraRl, &churn);
        let steps = self.runs.steps as usize;
        let joined = churn
            .first_step_opened_after(arrives_at_s + snapshot_s)
            .max(15);
        let assumed_mfu_setup = setup.assumed_mfu_trainer();
        // The churn run under each what-if: decode at each end of its range, the trainer
        // at the assumed 40% MFU.
        let what_if_churn = |steps: std::ops::Range<usize>,
                             label: &str,
                             paper: f64|
         -> Result<Vec<Row>, Violation> {
            let mut rows = decode_what_ifs(&pool, "", label, Value(paper), "tokens/s", |pool| {
                let generation = generate(pool, faults.clone())?;
                Ok(throughput(
                    &self.timings(&deployment, System::AuroraRl, &generation),
                    steps.clone(),
                ))
            })?;
            let slow_training = self.deployment(&assumed_mfu_setup, &pool);
            rows.push(assumed_mfu_what_if(
                "",
                label,
                Value(paper),
                throughput(
                    &self.timings(&slow_training, System::AuroraRl, &churn),
                    steps,
                ),
                "tokens/s",
            ));
            Ok(rows)
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
        rows.push(Row::compared(
            "the step of the preemption",
            Value(4_700.0),
            throughput(&timings, 6..7),
            "tokens/s",
        ));
        // aurora's own actor takes the notice and hands its leases back at once.
        let noticed = vec![ScheduledFault {
            at_ms: preemption_at_ms,
            fault: Fault::Preempt { actor: 1 },
        }];
        let generation = self.generate_finding_the_gone(
            &setup,
            &base,
            SplitPolicy::Proportional,
            noticed,
            Liveness::Heartbeats,
        )?;
        rows.push(Row::simulated(
            "the step of the preemption, aurora (notice, leases handed back)",
            throughput(
                &self.timings(&deployment, System::Aurora, &generation),
                6..7,
            ),
            "tokens/s",
        ));
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
                    let label = format!("{actors} actor(s)");
                    let mut rows =
                        decode_what_ifs(&pool, "", &label, Value(paper), "tokens/s", |pool| {
                            self.aurora_rl_tokens_per_s(&setup, pool)
                        })?;
                    rows.push(assumed_mfu_what_if(
                        "",
                        &label,
                        Value(paper),
                        self.aurora_rl_tokens_per_s(&setup.assumed_mfu_trainer(), &pool)?,
                        "tokens/s",
                    ));
                    Ok(rows)
                },
            )?);
            if actors == 4 {
                rows.push(
                    Row::compared("4 actors over 1", Value(2.4), rate / first, "x")
                        .explained(ONE_ACTOR_WHY, 0.6),
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
