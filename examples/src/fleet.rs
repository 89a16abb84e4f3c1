//! The demo's view of a fleet of real edge agents in one process: a thin wrapper over
//! [`fedfleet_agent::sim::RemoteFleet`] (each agent: its own enrolled identity, key, sled store
//! and data share, the daemon's `Agent` shell, QUIC + mTLS clients to the real aggregator and
//! registry) that adds per-agent progress and the numbers the demo prints.

use fedfleet_agent::sim::{FleetOptions, RemoteFleet};
use fedfleet_learning::{Dataset, Partition};
use fedfleet_protocol::{DeviceId, ModelRef};

pub struct Fleet {
    inner: RemoteFleet,
    pub ids: Vec<DeviceId>,
    /// Local training examples per agent (the share minus its 20 % holdout).
    pub train_sizes: Vec<usize>,
}

impl Fleet {
    /// Opens every agent (clients connect on first use).
    pub fn start(o: FleetOptions) -> anyhow::Result<Fleet> {
        let train_sizes = shares(&o.partition, o.devices.len(), o.partition_seed)?;
        let ids = o.devices.clone();
        Ok(Fleet { inner: RemoteFleet::start(o)?, ids, train_sizes })
    }

    /// Polls the services and drives every agent once, in turn; `on_agent` after each.
    pub async fn step(&mut self, mut on_agent: impl FnMut(usize)) -> anyhow::Result<()> {
        for (i, a) in self.inner.agents.iter_mut().enumerate() {
            a.poll_control().await?;
            a.drive().await?;
            on_agent(i);
        }
        Ok(())
    }

    /// How many agents serve `model`.
    pub fn active_on(&self, model: &ModelRef) -> usize {
        self.inner.agents.iter().filter(|a| a.core().active().is_some_and(|m| m.model == *model)).count()
    }

    pub fn len(&self) -> usize {
        self.inner.agents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.agents.is_empty()
    }

    pub fn inner(&self) -> &RemoteFleet {
        &self.inner
    }
}

/// Training-set sizes of the agents' shares, computed as `RemoteFleet::start` deals them.
pub fn shares(partition: &Partition, n: usize, seed: u64) -> anyhow::Result<Vec<usize>> {
    let (train, _) = Dataset::digits_split()?;
    Ok(partition.split_dataset(&train, n, seed).into_iter().map(|p| p.split(0.2, seed).0.len()).collect())
}
