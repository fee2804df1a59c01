//! The trainer and actor nodes (`aurora_node`) for Python: each owns a tokio runtime, and
//! every call that waits releases the GIL. Control-plane answers cross as the JSON of the
//! control API's wire types (docs/control-api.md), which the Python side parses: one
//! schema, written down once.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use aurora_api::{StatusResponse, WireResult};
use aurora_delta::{ChangedElements, Encoding};
use aurora_node::{
    Activation, ActorNode, ActorSettings, Handoff, NodeError, Published, RecoverError, Retraining,
    RetrainingError, StepResults, TrainerNode, TrainerSettings,
};
use aurora_proto::Weights;
use aurora_store::TrainerData;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::dlpack::export_bytes;
use crate::errors::{self, NodeClosedError, delta_error, node_timeout_error, usage_error};
use crate::trust::TrustArgs;
use crate::{SpecArg, TensorArg, Tensors, tensor_specs};

/// An error's message and every cause after it.
pub(crate) fn message_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // Some messages already end with their cause's.
        let cause_text = cause.to_string();
        if !message.ends_with(&cause_text) {
            message.push_str(&format!(": {cause_text}"));
        }
        source = cause.source();
    }
    message
}

/// The Python exception for a node's error, with its message and every cause after it.
fn node_error(error: NodeError) -> PyErr {
    let message = message_chain(&error);
    match error {
        NodeError::Delta(error) => delta_error(error),
        NodeError::Timeout { .. } => node_timeout_error(message),
        error if error.is_usage() => usage_error(message),
        _ => errors::NodeError::new_err(message),
    }
}

/// A node's tokio runtime, until the node is closed. Closing ends the calls in flight
/// (they fail with `NodeClosedError`), waits for them to return, then stops every task
/// within a bounded time (so the node's files and ports are free for the next node, and
/// no thread of it logs through Python afterwards). Not forever: a node is often dropped
/// as the interpreter exits, when a worker thread that logs through Python (which then no
/// longer lets threads in) never finishes.
struct Runtime {
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    handle: tokio::runtime::Handle,
    /// Set once by `close`; calls in flight watch it.
    closed: tokio::sync::watch::Sender<bool>,
    /// Held shared by every call while it runs, and exclusively by `close` while it stops
    /// the runtime, whose timers would fail the calls still polling them.
    calls: RwLock<()>,
}

/// How long closing a node waits for its tasks.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

impl Runtime {
    fn start() -> PyResult<Runtime> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("aurora-node")
            .enable_all()
            .build()
            .map_err(|e| errors::NodeError::new_err(format!("starting the node's runtime: {e}")))?;
        Ok(Runtime {
            handle: runtime.handle().clone(),
            runtime: Mutex::new(Some(runtime)),
            closed: tokio::sync::watch::channel(false).0,
            calls: RwLock::new(()),
        })
    }

    /// Runs `future` to completion on the node's runtime, unless the node is closed
    /// before or meanwhile.
    fn block_on<F: std::future::Future>(&self, future: F) -> PyResult<F::Output> {
        let _call = self.calls.read().unwrap_or_else(PoisonError::into_inner);
        let mut closed = self.closed.subscribe();
        if *closed.borrow() {
            return Err(node_closed());
        }
        self.handle.block_on(async {
            tokio::select! {
                output = future => Ok(output),
                _ = closed.wait_for(|closed| *closed) => Err(node_closed()),
            }
        })
    }

    /// Ends the calls in flight and stops every task; later calls fail. Idempotent.
    fn close(&self) {
        self.closed.send_replace(true);
        let _calls = self.calls.write().unwrap_or_else(PoisonError::into_inner);
        let runtime = self
            .runtime
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(runtime) = runtime {
            runtime.shutdown_timeout(SHUTDOWN_TIMEOUT);
        }
    }

    fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.close();
    }
}

/// The node in `slot` while it and `runtime` are open.
fn open_node<T>(slot: &Mutex<Option<Arc<T>>>, runtime: &Runtime) -> PyResult<Arc<T>> {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
        .filter(|_| !runtime.is_closed())
        .ok_or_else(node_closed)
}

fn node_closed() -> PyErr {
    NodeClosedError::new_err("the node is closed")
}

/// The store's kind of trainer data a Python name means.
fn trainer_data(kind: &str) -> PyResult<TrainerData> {
    match kind {
        "rollouts" => Ok(TrainerData::Rollouts),
        "state" => Ok(TrainerData::State),
        other => Err(usage_error(format!(
            "trainer data is 'rollouts' or 'state', not '{other}'"
        ))),
    }
}

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|e| usage_error(format!("{what}: {e}")))
}

fn address(text: &str) -> PyResult<SocketAddr> {
    text.parse()
        .map_err(|e| usage_error(format!("{text:?} is not an address (HOST:PORT): {e}")))
}

/// The control plane's settings: the defaults with `overrides` (JSON, any subset of the
/// settings' fields, nested as in `aurora_control::Config`) laid over them.
fn control_config(overrides: &str) -> PyResult<aurora_control::Config> {
    fn merge(into: &mut serde_json::Value, from: serde_json::Value, path: &str) -> PyResult<()> {
        match (into, from) {
            (serde_json::Value::Object(into), serde_json::Value::Object(from)) => {
                for (key, value) in from {
                    let path = format!("{path}{key}");
                    let slot = into
                        .get_mut(&key)
                        .ok_or_else(|| usage_error(format!("unknown control setting {path:?}")))?;
                    merge(slot, value, &format!("{path}."))?;
                }
                Ok(())
            }
            (into, from) => {
                *into = from;
                Ok(())
            }
        }
    }
    let invalid = |e: serde_json::Error| usage_error(format!("control settings: {e}"));
    let mut config = serde_json::to_value(aurora_control::Config::default()).map_err(invalid)?;
    merge(
        &mut config,
        serde_json::from_str(overrides).map_err(invalid)?,
        "",
    )?;
    let config: aurora_control::Config = serde_json::from_value(config).map_err(invalid)?;
    config
        .validate()
        .map_err(|e| usage_error(format!("control settings: {e}")))?;
    Ok(config)
}

fn published(published: Published) -> (u64, String, u64) {
    (
        published.version,
        published.weights_hash.to_hex(),
        published.artifact_bytes,
    )
}

/// The control plane, transport hub and checkpoint store in this process.
#[pyclass(module = "aurora_rl._core", frozen)]
pub struct TrainerNodeCore {
    /// Taken by `close`, which lets the store go.
    node: Mutex<Option<Arc<TrainerNode>>>,
    control_address: SocketAddr,
    transport_address: SocketAddr,
    run_id: aurora_delta::RunId,
    runtime: Runtime,
}

#[pymethods]
impl TrainerNodeCore {
    // The keyword arguments of the Python class (aurora_rl.Trainer).
    #[allow(clippy::too_many_arguments)]
    #[new]
    #[pyo3(signature = (*, directory, token, control_listen, transport_listen, streams, snapshot_every, encoding, control, signing_key, ca, cert, key, insecure_plaintext, insecure_closed_network, insecure_unsigned))]
    fn new(
        py: Python<'_>,
        directory: std::path::PathBuf,
        token: String,
        control_listen: &str,
        transport_listen: &str,
        streams: u8,
        snapshot_every: u64,
        encoding: &str,
        control: &str,
        signing_key: Option<std::path::PathBuf>,
        ca: Option<std::path::PathBuf>,
        cert: Option<std::path::PathBuf>,
        key: Option<std::path::PathBuf>,
        insecure_plaintext: bool,
        insecure_closed_network: bool,
        insecure_unsigned: bool,
    ) -> PyResult<TrainerNodeCore> {
        if streams == 0 {
            return Err(usage_error("streams must be at least 1"));
        }
        let trust = TrustArgs {
            ca,
            cert,
            key,
            insecure_plaintext,
            insecure_closed_network,
            fleet_token: token,
        }
        .load()?;
        let mut settings = TrainerSettings::new(directory, trust);
        settings.insecure_unsigned = insecure_unsigned;
        settings.control_listen = address(control_listen)?;
        settings.transport_listen = address(transport_listen)?;
        settings.streams = streams;
        settings.snapshot_every = snapshot_every;
        settings.encoding = match encoding {
            "aurora" => Encoding::Aurora,
            "dense" => Encoding::Dense,
            other => {
                return Err(usage_error(format!(
                    "unknown encoding {other:?}: aurora or dense"
                )));
            }
        };
        settings.control = control_config(control)?;
        settings.signing_key = signing_key
            .map(|path| aurora_trust::signing::load_signing_key(&path).map(Arc::new))
            .transpose()
            .map_err(key_error)?;
        let runtime = Runtime::start()?;
        let node = py
            .detach(|| runtime.block_on(TrainerNode::start(settings)))?
            .map_err(node_error)?;
        Ok(TrainerNodeCore {
            control_address: node.control_address(),
            transport_address: node.transport_address(),
            run_id: node.run_id(),
            node: Mutex::new(Some(Arc::new(node))),
            runtime,
        })
    }

    #[getter]
    fn control_address(&self) -> String {
        self.control_address.to_string()
    }

    #[getter]
    fn transport_address(&self) -> String {
        self.transport_address.to_string()
    }

    /// The run this node's store was made for, in hex: every statement it signs names it.
    #[getter]
    fn run_id(&self) -> String {
        self.run_id.to_hex()
    }

    /// The newest published version and its weights hash.
    fn latest(&self) -> PyResult<Option<(u64, String)>> {
        Ok(self
            .node()?
            .latest()
            .map(|latest| (latest.version, latest.hash.to_hex())))
    }

    fn publish_first(
        &self,
        py: Python<'_>,
        version: u64,
        state: Vec<TensorArg<'_>>,
    ) -> PyResult<(u64, String, u64)> {
        let state = Tensors::borrow(state)?;
        let checkpoint = state.checkpoint()?;
        let node = self.node()?;
        py.detach(|| node.publish_first(version, &checkpoint))
            .map(published)
            .map_err(node_error)
    }

    /// With `base_untouched`, the caller vouches that `base` is the latest version's
    /// weights as published (`TrainerNode::publish_over_latest`).
    #[pyo3(signature = (base, target, base_untouched = false))]
    fn publish(
        &self,
        py: Python<'_>,
        base: Vec<TensorArg<'_>>,
        target: Vec<TensorArg<'_>>,
        base_untouched: bool,
    ) -> PyResult<(u64, String, u64)> {
        let (base, target) = (Tensors::borrow(base)?, Tensors::borrow(target)?);
        let (base, target) = (base.checkpoint()?, target.checkpoint()?);
        let node = self.node()?;
        py.detach(|| {
            if base_untouched {
                node.publish_over_latest(&base, &target)
            } else {
                node.publish(&base, &target)
            }
        })
        .map(published)
        .map_err(node_error)
    }

    /// Publishes the next version from the parts of a sharded trainer's ranks
    /// (`extract_shard` over each rank's element ranges of `tensors`).
    fn publish_shards(
        &self,
        py: Python<'_>,
        tensors: Vec<SpecArg>,
        parts: Vec<Bound<'_, PyBytes>>,
    ) -> PyResult<(u64, String, u64)> {
        let tensors = tensor_specs(tensors)?;
        let node = self.node()?;
        let parts: Vec<&[u8]> = parts.iter().map(|part| part.as_bytes()).collect();
        py.detach(|| node.publish_shards(tensors, &parts))
            .map(published)
            .map_err(node_error)
    }

    fn commit(&self, py: Python<'_>) -> PyResult<(u64, String)> {
        let (node, runtime) = (self.node()?, &self.runtime);
        let latest = py
            .detach(|| runtime.block_on(node.commit()))?
            .map_err(node_error)?;
        Ok((latest.version, latest.hash.to_hex()))
    }

    fn open_step(&self, py: Python<'_>, prompts: Vec<u64>) -> PyResult<u64> {
        let node = self.node()?;
        py.detach(|| node.open_step(&prompts)).map_err(node_error)
    }

    /// Stores `data` as `version`'s trainer data of `kind` (`rollouts` or `state`).
    fn save_trainer_data(
        &self,
        py: Python<'_>,
        kind: &str,
        version: u64,
        data: &[u8],
    ) -> PyResult<()> {
        let (kind, node) = (trainer_data(kind)?, self.node()?);
        let store = node.store();
        py.detach(|| store.put_trainer_data(kind, version, data))
            .map(drop)
            .map_err(|e| node_error(e.into()))
    }

    /// The versions that have trainer data of `kind`, oldest first.
    fn trainer_data_versions(&self, kind: &str) -> PyResult<Vec<u64>> {
        let records = self
            .node()?
            .store()
            .trainer_data_records(trainer_data(kind)?);
        Ok(records
            .map_err(|e| node_error(e.into()))?
            .into_keys()
            .collect())
    }

    /// Brings a restarted trainer back to the latest published version
    /// (`aurora_node::TrainerNode::recover`) with the caller's callables:
    /// `restore(version, state)` gives a trainer, `retrain(trainer, version, rollouts)`
    /// trains it once more, `export(trainer, version)` gives its host tensors. Returns
    /// the trainer, the latest version and the version it was restored from.
    fn recover(
        &self,
        restore: Bound<'_, PyAny>,
        retrain: Bound<'_, PyAny>,
        export: Bound<'_, PyAny>,
    ) -> PyResult<(Py<PyAny>, u64, u64)> {
        let py = restore.py();
        let mut callables = Callables {
            restore,
            retrain,
            export,
        };
        let recovered = self
            .node()?
            .recover(&mut callables)
            .map_err(|error| recover_error(py, error))?;
        Ok((
            recovered.trainer,
            recovered.version,
            recovered.restored_from,
        ))
    }

    /// `version`'s trainer data of `kind`, verified against its hash.
    fn trainer_data<'py>(
        &self,
        py: Python<'py>,
        kind: &str,
        version: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (kind, node) = (trainer_data(kind)?, self.node()?);
        let store = node.store();
        let data = py
            .detach(|| store.trainer_data(kind, version))
            .map_err(|e| node_error(e.into()))?;
        Ok(PyBytes::new(py, &data))
    }

    /// The control plane's monitoring view as JSON: `StatusResponse` of
    /// docs/control-api.md (`GET /v1/status`), the latest version, every actor, the step.
    fn status(&self) -> PyResult<String> {
        let status = self.node()?.hub().inspect(StatusResponse::from_core);
        serde_json::to_string(&status).map_err(|e| errors::NodeError::new_err(e.to_string()))
    }

    /// The open step's results as JSON, once it is complete, waiting up to `timeout_s`.
    fn wait_step(&self, py: Python<'_>, timeout_s: f64) -> PyResult<String> {
        let (node, runtime) = (self.node()?, &self.runtime);
        let timeout = seconds(timeout_s, "timeout")?;
        let results = py
            .detach(|| runtime.block_on(node.wait_step(timeout)))?
            .map_err(node_error)?;
        Ok(results_json(&results))
    }

    /// Stops the control plane and the transport hub; the store stays as written (every
    /// write is crash-safe). Idempotent.
    fn close(&self, py: Python<'_>) {
        let runtime = &self.runtime;
        py.detach(|| runtime.close());
        let node = self
            .node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        py.detach(|| drop(node));
    }

    #[getter]
    fn closed(&self) -> bool {
        self.runtime.is_closed()
    }

    /// `step`'s results as JSON if they were handed over before and the next step has
    /// not opened (a trainer that stopped before keeping them reads them again).
    fn taken_step(&self, step: u64) -> PyResult<Option<String>> {
        let results = self.node()?.taken_step_results(step).map_err(node_error)?;
        Ok(results.as_ref().map(results_json))
    }
}

impl TrainerNodeCore {
    fn node(&self) -> PyResult<Arc<TrainerNode>> {
        open_node(&self.node, &self.runtime)
    }
}

/// A step's results as the JSON the Python side parses into `StepResults`.
fn results_json(results: &StepResults) -> String {
    let rollouts: Vec<serde_json::Value> = results
        .rollouts
        .iter()
        .map(|rollout| {
            serde_json::json!({
                "prompt": rollout.prompt.0,
                "actor": rollout.actor.0,
                "payload": rollout.payload,
            })
        })
        .collect();
    serde_json::json!({
        "step": results.outcome.step.0,
        "version": results.outcome.version.0,
        "rollouts": rollouts,
        "unfinished": results.outcome.unfinished.iter().map(|p| p.0).collect::<Vec<_>>(),
    })
    .to_string()
}

/// A transport actor and the actor's side of the control API, in an inference process.
#[pyclass(module = "aurora_rl._core", frozen)]
pub struct ActorNodeCore {
    /// Taken by `close`.
    node: Mutex<Option<Arc<ActorNode>>>,
    /// `leave` was called: closing does not leave again.
    left: AtomicBool,
    handoff: Arc<Handoff>,
    runtime: Runtime,
}

/// How long closing an actor waits for the control plane to hear it leave: a call
/// retries an outage for minutes, which a process shutting down should not.
const LEAVE_ON_CLOSE: Duration = Duration::from_secs(10);

#[pymethods]
impl ActorNodeCore {
    /// Starts from `weights` (their version and tensors) when given, else joins over the
    /// wire: takes the newest snapshot an upstream offers (within `join_timeout_s`).
    /// Then registers.
    // The keyword arguments of the Python class (aurora_rl.Actor).
    #[allow(clippy::too_many_arguments)]
    #[new]
    #[pyo3(signature = (*, id, region, control, upstreams, token, streams, join_timeout_s, weights, trainer_key, ca, cert, key, insecure_plaintext, insecure_closed_network, insecure_unsigned, return_after_s, behind_timeout_s, changed_elements, changes_first))]
    fn new(
        py: Python<'_>,
        id: u64,
        region: String,
        control: &str,
        upstreams: Vec<String>,
        token: String,
        streams: u8,
        join_timeout_s: f64,
        weights: Option<(u64, Vec<TensorArg<'_>>)>,
        trainer_key: Option<std::path::PathBuf>,
        ca: Option<std::path::PathBuf>,
        cert: Option<std::path::PathBuf>,
        key: Option<std::path::PathBuf>,
        insecure_plaintext: bool,
        insecure_closed_network: bool,
        insecure_unsigned: bool,
        return_after_s: Option<f64>,
        behind_timeout_s: f64,
        changed_elements: bool,
        changes_first: bool,
    ) -> PyResult<ActorNodeCore> {
        if streams == 0 {
            return Err(usage_error("streams must be at least 1"));
        }
        let return_after = return_after_s
            .map(|value| seconds(value, "return after"))
            .transpose()?;
        let behind_timeout = seconds(behind_timeout_s, "behind timeout")?;
        let trust = TrustArgs {
            ca,
            cert,
            key,
            insecure_plaintext,
            insecure_closed_network,
            fleet_token: token,
        }
        .load()?;
        let settings = ActorSettings {
            insecure_unsigned,
            id,
            region,
            control: address(control)?,
            upstreams: upstreams
                .iter()
                .map(|u| address(u))
                .collect::<PyResult<_>>()?,
            trust,
            streams,
            transport_limits: aurora_node::TransportLimits::default(),
            trainer_key: trainer_key
                .map(|path| aurora_trust::signing::load_public_key(&path))
                .transpose()
                .map_err(key_error)?,
            // Host memory stays flat beside the engine's own copy: the image is an
            // unnamed file in the temporary directory ($TMPDIR), mapped.
            images: Arc::new(aurora_checkpoint::FileImages::new(std::env::temp_dir())),
            return_after,
            behind_timeout,
        };
        let timeout = seconds(join_timeout_s, "join timeout")?;
        let local = match weights {
            Some((version, tensors)) => {
                let tensors = Tensors::borrow(tensors)?;
                let checkpoint = tensors.checkpoint()?;
                let images = settings.images.clone();
                let weights = py.detach(|| Weights::from_checkpoint(&checkpoint, version, images));
                Some(weights.map_err(delta_error)?)
            }
            None => None,
        };
        let runtime = Runtime::start()?;
        let handoff = if changed_elements {
            Handoff::writing_elements(changes_first)
        } else {
            Handoff::new()
        };
        let node = py
            .detach(|| {
                runtime.block_on(async {
                    match local {
                        Some(weights) => ActorNode::start(settings, weights, handoff.clone()).await,
                        None => ActorNode::join(settings, handoff.clone(), timeout).await,
                    }
                })
            })?
            .map_err(node_error)?;
        Ok(ActorNodeCore {
            node: Mutex::new(Some(Arc::new(node))),
            left: AtomicBool::new(false),
            handoff,
            runtime,
        })
    }

    /// The active version and its weights hash.
    fn active(&self) -> PyResult<Option<(u64, String)>> {
        Ok(self
            .node()?
            .active()
            .map(|active| (active.version, active.hash.to_hex())))
    }

    /// Why the node may not be at the version asked of it: the last activation, if it
    /// failed, and why the last upstream session ended, while no session is up; each
    /// None if not.
    fn last_failures(&self) -> PyResult<(Option<String>, Option<String>)> {
        let status = self.node()?.transport().status();
        let upstream = status.last_upstream_failure.filter(|_| !status.connected);
        Ok((status.last_failed_activation, upstream))
    }

    /// Weights to load before the next batch, if an activation is ready or starts within
    /// `wait_s` (see `aurora_node::Handoff::at_safe_point`).
    fn at_safe_point(&self, py: Python<'_>, wait_s: f64) -> PyResult<Option<ActivationCore>> {
        let wait = seconds(wait_s, "wait")?;
        let handoff = &self.handoff;
        let activation = py
            .detach(|| handoff.at_safe_point(wait))
            .map_err(node_error)?;
        Ok(activation.map(|activation| ActivationCore {
            activation: std::sync::Mutex::new(Some(activation)),
        }))
    }

    /// The control plane's answer to a claim, as JSON.
    fn claim(&self, py: Python<'_>) -> PyResult<String> {
        let (node, runtime) = (self.node()?, &self.runtime);
        let claim = py
            .detach(|| runtime.block_on(node.claim()))?
            .map_err(node_error)?;
        serde_json::to_string(&claim).map_err(|e| errors::NodeError::new_err(e.to_string()))
    }

    /// Submits results (a JSON list of the control API's results) and returns the
    /// outcomes as JSON.
    fn submit(&self, py: Python<'_>, results: &str) -> PyResult<String> {
        let results: Vec<WireResult> =
            serde_json::from_str(results).map_err(|e| usage_error(format!("results: {e}")))?;
        let (node, runtime) = (self.node()?, &self.runtime);
        let answer = py
            .detach(|| runtime.block_on(node.submit(results)))?
            .map_err(node_error)?;
        serde_json::to_string(&answer.outcomes)
            .map_err(|e| errors::NodeError::new_err(e.to_string()))
    }

    /// Leaves the fleet (held leases return to the pool) and stops the node's transport;
    /// the node is closed afterwards, whatever the control plane answered.
    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        let (node, runtime) = (self.node()?, &self.runtime);
        self.left.store(true, Ordering::SeqCst);
        let left = py.detach(|| runtime.block_on(node.leave()));
        self.close(py);
        left?.map_err(node_error)
    }

    /// Stops the node: leaves the fleet first unless it left, best effort (a control
    /// plane that does not answer within [`LEAVE_ON_CLOSE`] is not waited for: its leases
    /// come back as the node's heartbeats stop), then stops its tasks. Idempotent.
    fn close(&self, py: Python<'_>) {
        let Some(node) = self
            .node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return;
        };
        let runtime = &self.runtime;
        if !self.left.swap(true, Ordering::SeqCst) {
            let left = py.detach(|| {
                runtime.block_on(async { tokio::time::timeout(LEAVE_ON_CLOSE, node.leave()).await })
            });
            match left {
                Ok(Ok(Err(error))) => {
                    tracing::warn!(error = %message_chain(&error), "leaving the fleet on close")
                }
                Ok(Err(_)) => tracing::warn!(
                    timeout = ?LEAVE_ON_CLOSE,
                    "leaving the fleet on close: the control plane did not answer"
                ),
                _ => {}
            }
        }
        py.detach(|| {
            node.stop();
            runtime.close();
            drop(node);
        });
    }

    #[getter]
    fn closed(&self) -> bool {
        self.runtime.is_closed()
    }
}

impl ActorNodeCore {
    fn node(&self) -> PyResult<Arc<ActorNode>> {
        open_node(&self.node, &self.runtime)
    }
}

/// A Python trainer's side of `TrainerNode::recover`: its own callables, called with the
/// GIL held (the recovery runs on the caller's thread).
struct Callables<'py> {
    restore: Bound<'py, PyAny>,
    retrain: Bound<'py, PyAny>,
    export: Bound<'py, PyAny>,
}

impl Retraining for Callables<'_> {
    type Trainer = Py<PyAny>;

    fn restore(&mut self, version: u64, state: Vec<u8>) -> Result<Py<PyAny>, RetrainingError> {
        let state = PyBytes::new(self.restore.py(), &state);
        Ok(self.restore.call1((version, state))?.unbind())
    }

    fn retrain(
        &mut self,
        trainer: &mut Py<PyAny>,
        version: u64,
        rollouts: Vec<u8>,
    ) -> Result<(), RetrainingError> {
        let py = self.retrain.py();
        let rollouts = PyBytes::new(py, &rollouts);
        self.retrain.call1((trainer.bind(py), version, rollouts))?;
        Ok(())
    }

    fn weights_hash(
        &mut self,
        trainer: &mut Py<PyAny>,
        version: u64,
    ) -> Result<aurora_delta::Hash, RetrainingError> {
        let py = self.export.py();
        let tensors: Vec<TensorArg<'_>> =
            self.export.call1((trainer.bind(py), version))?.extract()?;
        let tensors = Tensors::borrow(tensors)?;
        let checkpoint = tensors.checkpoint()?;
        Ok(py.detach(|| checkpoint.weights_hash()))
    }
}

/// A recovery's failure: the caller's own exception as the cause of the step it failed
/// in; a trainer that did not reproduce a version as `WrongBaseError`.
fn recover_error(py: Python<'_>, error: RecoverError) -> PyErr {
    let (head, message) = (error.to_string(), message_chain(&error));
    match error {
        RecoverError::NothingPublished => usage_error(message),
        RecoverError::NotReproduced { .. } => errors::WrongBaseError::new_err(message),
        RecoverError::Retraining { source, .. } => {
            let raised = errors::NodeError::new_err(head);
            if let Ok(cause) = source.downcast::<PyErr>() {
                raised.set_cause(py, Some(*cause));
            }
            raised
        }
        _ => errors::NodeError::new_err(message),
    }
}

/// Weights the transport activated, held until released.
#[pyclass(module = "aurora_rl._core", frozen)]
pub struct ActivationCore {
    activation: std::sync::Mutex<Option<Activation>>,
}

impl ActivationCore {
    fn with<T>(&self, read: impl FnOnce(&Activation) -> T) -> PyResult<T> {
        let held = self.activation.lock().unwrap_or_else(|p| p.into_inner());
        held.as_ref()
            .map(read)
            .ok_or_else(|| usage_error("the activation was released"))
    }
}

#[pymethods]
impl ActivationCore {
    #[getter]
    fn version(&self) -> PyResult<u64> {
        self.with(|a| a.active.version)
    }

    #[getter]
    fn weights_hash(&self) -> PyResult<String> {
        self.with(|a| a.active.hash.to_hex())
    }

    /// Whether the changed elements come before the node's copy has them: the image
    /// (`tensor_bytes`) is then the version the engine runs now, and the new one is the
    /// changed elements laid over it (`aurora_node::Activation::changes_first`).
    #[getter]
    fn changes_first(&self) -> PyResult<bool> {
        self.with(|a| a.changes_first)
    }

    #[getter]
    fn changed(&self) -> PyResult<Vec<String>> {
        self.with(|a| a.changed.names())
    }

    /// Each changed tensor's name and, unless it changed whole, its changed elements: the
    /// flat indices, ascending (int64s), and the new values in their order (the tensor's
    /// dtype), each a DLPack capsule of flat uint8 host memory (no copy). They move out: a
    /// second call gives None for each.
    #[allow(clippy::type_complexity)]
    fn changed_elements<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(String, Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>)>> {
        let mut held = self.activation.lock().unwrap_or_else(|p| p.into_inner());
        let activation = held
            .as_mut()
            .ok_or_else(|| usage_error("the activation was released"))?;
        activation
            .changed
            .tensors
            .iter_mut()
            .map(|tensor| {
                let Some(elements) = tensor.elements.take() else {
                    return Ok((tensor.name.clone(), None));
                };
                let ChangedElements { indices, values } = elements;
                let (index_data, index_len) = (indices.as_ptr().cast::<u8>(), indices.len() * 8);
                let (value_data, value_len) = (values.as_ptr(), values.len());
                // SAFETY: each capsule owns its vector, and moving a vector into it does
                // not move its buffer.
                let indices =
                    unsafe { export_bytes(py, Box::new(indices), index_data, index_len)? };
                let values = unsafe { export_bytes(py, Box::new(values), value_data, value_len)? };
                Ok((tensor.name.clone(), Some((indices, values))))
            })
            .collect()
    }

    /// Every tensor's name, dtype and shape.
    fn tensor_specs(&self) -> PyResult<Vec<(String, String, Vec<u64>)>> {
        self.with(|a| {
            a.weights
                .layout()
                .iter()
                .map(|t| (t.name.clone(), t.dtype.name().to_string(), t.shape.clone()))
                .collect()
        })
    }

    /// Read-only views of the named tensors' bytes in the activated image (where the
    /// changes come first, the image they are laid over), as DLPack capsules of flat
    /// uint8 host memory: no copy. Each keeps the weights alive; the next activation, and
    /// the node's copy taking changes that came first, wait until every view is gone.
    fn tensor_bytes<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
    ) -> PyResult<Vec<TensorArg<'py>>> {
        let (weights, guard, places) = self.with(|a| {
            let places: Vec<_> = names
                .iter()
                .map(|name| {
                    a.weights
                        .layout()
                        .iter()
                        .find(|t| &t.name == name)
                        .map(|t| {
                            (
                                t.name.clone(),
                                t.dtype.name().to_string(),
                                t.shape.clone(),
                                t.bytes.clone(),
                            )
                        })
                        .ok_or_else(|| usage_error(format!("no tensor {name:?} in the weights")))
                })
                .collect();
            (a.weights.clone(), a.guard(), places)
        })?;
        places
            .into_iter()
            .map(|place| {
                let (name, dtype, shape, bytes): (String, String, Vec<u64>, Range<usize>) = place?;
                let data = weights.image()[bytes.clone()].as_ptr();
                // SAFETY: the image is neither moved nor written while a guard of its
                // activation lives (the next activation waits for every one to go).
                let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(guard.clone());
                let capsule = unsafe { export_bytes(py, owner, data, bytes.len())? };
                Ok((name, dtype, shape, capsule))
            })
            .collect()
    }

    /// Lets go of the weights: views made earlier still hold them until they are gone.
    fn release(&self) {
        self.activation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}

/// A key file that cannot be used: its error names the file and what is wrong.
fn key_error(error: aurora_trust::signing::KeyFileError) -> PyErr {
    crate::errors::AuroraError::new_err(error.to_string())
}
