//! The lifecycle core (`fedfleet-agent-core`, sans-IO) joined to this device's store: every
//! write the core returns is made durable before the next action leaves it.

use std::ops::Deref;

pub use fedfleet_agent_core::lifecycle::*;

use crate::store::{AgentStore, StoreError};

/// Why an agent stopped: the core refused its saved state, or the store failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The lifecycle core with its store. Reads go to the core (`Deref`); inputs go through
/// [`handle`](Self::handle) and [`handle_timeout`](Self::handle_timeout), which persist what
/// the core asks before returning, so [`poll_action`](Self::poll_action) never runs ahead of
/// the store.
pub struct DurableLifecycle {
    core: Lifecycle,
    store: AgentStore,
}

impl DurableLifecycle {
    /// Opens the core on what `store` holds (see [`Lifecycle::open`]).
    pub fn open(
        cfg: CoreConfig,
        store: AgentStore,
        pinned_root: Option<fedfleet_protocol::tuf::SignedMetadata<fedfleet_protocol::tuf::Root>>,
        initial: Option<SlotModel>,
        now: Millis,
    ) -> Result<Self, AgentError> {
        let core = Lifecycle::open(cfg, store.saved()?, pinned_root, initial, now)?;
        let mut me = DurableLifecycle { core, store };
        me.persist()?;
        Ok(me)
    }

    fn persist(&mut self) -> Result<(), StoreError> {
        while let Some(write) = self.core.poll_persist() {
            self.store.apply(&write)?;
        }
        Ok(())
    }

    pub fn handle(&mut self, now: Millis, input: Input) -> Result<(), AgentError> {
        let handled = self.core.handle(now, input);
        // What the core committed before an error is still written.
        self.persist()?;
        Ok(handled?)
    }

    pub fn handle_timeout(&mut self, now: Millis) -> Result<(), AgentError> {
        self.core.handle_timeout(now);
        Ok(self.persist()?)
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.core.poll_action()
    }

    pub fn store(&self) -> &AgentStore {
        &self.store
    }

    pub fn core(&self) -> &Lifecycle {
        &self.core
    }
}

impl Deref for DurableLifecycle {
    type Target = Lifecycle;
    fn deref(&self) -> &Lifecycle {
        &self.core
    }
}
