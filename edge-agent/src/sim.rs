//! Simulation mode: many agents in one process, each with its own key, store and data
//! partition, driven through the same [`Agent`] shell and lifecycle as the daemon, against the
//! in-memory services of [`crate::fakes`] and a fake clock. The "aggregator" step here is plain
//! FedAvg from `fedfleet-learning::sim`; the real aggregator replaces it in loopback tests.

use std::path::Path;
use std::sync::Arc;

use ed25519_dalek::SigningKey;
use fedfleet_learning::{Dataset, ModelSpec, Partition, evaluate, model::init_bundle, sim as fsim};
use fedfleet_protocol::{BundleLimits, DeviceId, FleetId, ModelRef, RoundAnnouncement, RoundConfig, RoundId, Selection, TensorBundle};

use crate::agent::{Agent, FakeClock, LocalData, ShellConfig};
use crate::fakes::{FakeAggregator, FakeRegistry};
use crate::lifecycle::{CoreConfig, HealthPolicy, Lifecycle, LifecycleError, SlotModel};
use crate::store::AgentStore;

/// A simulated fleet.
pub struct SimFleet {
    pub agents: Vec<Agent<FakeAggregator, FakeRegistry>>,
    pub agg: Arc<FakeAggregator>,
    pub reg: Arc<FakeRegistry>,
    pub clock: Arc<FakeClock>,
    pub fleet: FleetId,
    pub spec: ModelSpec,
    pub global: TensorBundle,
    pub global_ref: ModelRef,
    pub test: Dataset,
}

/// What one round did.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundSummary {
    pub round: RoundId,
    pub updates: usize,
    pub test_accuracy: f64,
    pub activated: usize,
    pub model: ModelRef,
}

impl SimFleet {
    /// `n` agents on IID partitions of the digits training split, under `dir`.
    pub fn new(dir: &Path, n: usize, seed: u64) -> Result<Self, LifecycleError> {
        let clock = Arc::new(FakeClock::new(1_700_000_000_000));
        let agg = Arc::new(FakeAggregator::new());
        let reg = Arc::new(FakeRegistry::new(seed as u8, u64::MAX / 2));
        let fleet = FleetId::new("sim").expect("valid");
        let spec = ModelSpec::digits_mlp();
        let spec_json = spec.to_json();
        let global = init_bundle(&spec, seed).expect("digits spec is valid");
        let bytes = global.encode();
        let global_ref = reg.publish("digits", &spec_json, bytes.clone());
        let (train, test) = Dataset::digits_split().expect("embedded data");
        let parts = Partition::Iid.split_dataset(&train, n, seed);
        let mut agents = Vec::with_capacity(n);
        for (i, part) in parts.into_iter().enumerate() {
            let device = DeviceId::new(format!("sim-{i:04}")).expect("valid");
            let key = SigningKey::from_bytes(&fedfleet_protocol::Digest::of(format!("{seed}/{i}").as_bytes()).0);
            agg.enroll(device.clone(), key.verifying_key());
            let store = AgentStore::open(dir.join(device.as_str()))?;
            store.put_blob(&bytes)?;
            let (tr, holdout) = part.split(0.2, seed);
            let mut cfg = CoreConfig::new(device, fleet.clone());
            cfg.local_samples = tr.len() as u64;
            cfg.rng_seed = seed ^ i as u64;
            cfg.health = HealthPolicy { max_latency_ms: 1_000.0, accuracy_margin: 0.05 };
            let initial = SlotModel { model: global_ref.clone(), spec: spec_json.clone() };
            let core = Lifecycle::open(cfg, store, Some(reg.pinned_root()), Some(initial), 0)?;
            let shell = ShellConfig { latency_samples: 8, ..Default::default() };
            agents.push(Agent::new(core, agg.clone(), reg.clone(), key, LocalData { train: tr, holdout }, clock.clone(), shell));
        }
        Ok(SimFleet { agents, agg, reg, clock, fleet, spec, global, global_ref, test })
    }

    /// Polls and drives every agent once.
    pub async fn step(&mut self) -> Result<(), LifecycleError> {
        for a in &mut self.agents {
            a.poll_control().await?;
            a.drive().await?;
        }
        Ok(())
    }

    /// One federated round: announce, train everywhere, FedAvg the accepted updates, publish the
    /// result and roll it out to every agent.
    pub async fn run_round(&mut self, round: u64, config: RoundConfig) -> Result<RoundSummary, LifecycleError> {
        let now = fedfleet_protocol::ids::RoundId(round);
        self.agg.set_round(Some(RoundAnnouncement {
            fleet: self.fleet.clone(),
            round: now,
            base_model: self.global_ref.clone(),
            config,
            deadline_unix_ms: u64::MAX,
            selection: Selection::All,
        }));
        self.agg.add_base_model(&self.spec.to_json(), self.global.encode());
        self.step().await?;
        let updates = self.agg.drain_accepted();
        let deltas: Vec<(TensorBundle, f64)> = updates
            .iter()
            .filter_map(|(h, p)| {
                TensorBundle::decode(p, &BundleLimits::default()).ok().map(|b| (b.dequantize(), h.body().sample_count as f64))
            })
            .collect();
        if !deltas.is_empty() {
            let refs: Vec<(&TensorBundle, f64)> = deltas.iter().map(|(b, w)| (b, *w)).collect();
            let avg = fsim::weighted_average(&refs).expect("same layout");
            self.global = fsim::apply_delta(&self.global, &avg, 1.0).expect("same layout");
            self.global_ref = self.reg.publish("digits", &self.spec.to_json(), self.global.encode());
            self.reg.assign_all(Some(FakeRegistry::notice(&self.fleet, round, &self.global_ref)));
            self.step().await?;
        }
        let test_accuracy = evaluate(&self.spec, &self.global, &self.test).map(|r| r.accuracy).unwrap_or(0.0);
        let activated = self.agents.iter().filter(|a| a.core().active().is_some_and(|m| m.model == self.global_ref)).count();
        Ok(RoundSummary { round: now, updates: updates.len(), test_accuracy, activated, model: self.global_ref.clone() })
    }
}
