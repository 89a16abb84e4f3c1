//! The round driver: engine events, deadlines, finalizing a round into a signed, published
//! global model, and starting campaigns.

use super::*;

impl Aggregator {
    // ----- events, rounds, campaigns -----

    /// Processes engine events; commits a round boundary when one happened.
    pub(super) fn drain(&self, core: &mut Core, now: Millis) {
        let sh = &self.shared;
        let mut boundary = false;
        while let Some(ev) = core.coord.poll_event() {
            match ev {
                EngineEvent::RoundOpened(a) => {
                    tracing::info!(round = %a.round, deadline = a.deadline, "round opened");
                    sh.metrics.round("opened");
                    sh.metrics.open_round.set(a.round.0 as i64);
                    sh.metrics.round_accepted.set(0);
                    self.history_round_opened(core, a.round, now);
                    let dtype = core.campaign.payload_dtype();
                    let mut config = a.client.round_config(&sh.cfg.campaign.optimizer, dtype, Some(a.max_sample_count), a.round.0);
                    config.secure_aggregation = sh.cfg.secure_aggregation.is_some();
                    let quorum = core.coord.engine().round_status().map_or(1, |s| s.quorum);
                    config.device_privacy = sh.cfg.device_privacy(quorum);
                    // Under secure aggregation a device must have trained before the keys stage ends.
                    let time_to_start = match sh.cfg.secure_aggregation {
                        Some(s) => (a.deadline.saturating_sub(now) as f64 * s.stage_ends[0]) as u64,
                        None => a.deadline.saturating_sub(now),
                    };
                    // A relay announces the parent's round with the parent's window, or under secure
                    // aggregation a window of its own for its region (`follow_once`): not this one.
                    if sh.cfg.relay.is_none() {
                        config.start_window_ms = core.pacer.open_round(self.expected_participants(&a.selection), time_to_start);
                        sh.metrics.arrivals_per_second.set(i64::from(core.pacer.rate()));
                        tracing::info!(round = %a.round, start_window_ms = config.start_window_ms, arrivals_per_second = core.pacer.rate(), "start window");
                    }
                    let opened = self.open_secagg(core, a.round, &a.selection, a.deadline, now);
                    core.secagg_before = std::mem::replace(&mut core.secagg, opened);
                    let ann = fedfleet_protocol::RoundAnnouncement {
                        fleet: a.fleet,
                        round: a.round,
                        base_model: ModelRef { name: sh.cfg.model.name.clone(), version: a.base_version, digest: a.base_digest },
                        config,
                        deadline_unix_ms: a.deadline,
                        selection: a.selection,
                    };
                    core.campaign.announcement = Some(Signed::sign(ann, &sh.key).encode());
                    sh.announce.send_replace(core.campaign.announcement.clone());
                    // The round driver may be sleeping on an older (or no) timer: it must
                    // re-read the deadline (a campaign started on an idle service opens its
                    // first round outside the driver).
                    sh.wake.notify_one();
                    boundary = true;
                }
                EngineEvent::RoundClosed { round, cause, contributions, .. } => {
                    tracing::info!(round = %round, ?cause, updates = contributions.len(), "round closed");
                    sh.metrics.round("closed");
                    sh.metrics.open_round.set(0);
                    let updates = contributions.iter().map(|c| c.updates.max(1)).sum::<u64>().min(u32::MAX as u64) as u32;
                    self.pace_after(core, u64::from(updates), now);
                    self.history_round_closed(core, round, updates, now);
                    core.campaign.announcement = None;
                    sh.announce.send_replace(None);
                    core.closing = Some(round);
                    sh.wake.notify_one();
                }
                EngineEvent::RoundFailed { round, reason } => {
                    tracing::warn!(round = %round, reason = reason.as_str(), "round failed");
                    sh.metrics.round("failed");
                    sh.metrics.open_round.set(0);
                    self.history_round_ended(core, round, &format!("failed: {}", reason.as_str()), None, now);
                    // Only the failed round's own updates are discarded (after a restart the
                    // strategy may already hold the refolded updates of a later round).
                    if core.coord.folding() == Some(round) || core.coord.folding().is_none() {
                        core.coord.discard_held();
                    }
                    core.campaign.announcement = None;
                    sh.announce.send_replace(None);
                    if core.closing == Some(round) {
                        core.closing = None;
                    }
                    boundary = true;
                }
                EngineEvent::CampaignFinished { campaign, outcome, rounds_completed, privacy } => {
                    let epsilon = privacy.map(|p| p.epsilon_spent);
                    tracing::info!(campaign = %campaign, outcome = outcome.as_str(), rounds_completed, ?epsilon, "campaign finished");
                    core.campaign.last_outcome = Some(outcome.as_str().to_owned());
                    core.campaign.last_privacy = privacy;
                    sh.metrics.round_accepted.set(0);
                    core.campaign.announcement = None;
                    sh.announce.send_replace(None);
                    boundary = true;
                }
                EngineEvent::RoundExtended { round, deadline, accepted } => {
                    tracing::info!(round = %round, deadline, accepted, "quorum not met: deadline extended once");
                    // Devices check the signed deadline: re-issue the announcement with the new
                    // one, or devices arriving after the old deadline skip a round still open.
                    let extended = core
                        .campaign
                        .announcement
                        .as_deref()
                        .and_then(|b| Signed::<fedfleet_protocol::RoundAnnouncement>::decode(b).ok())
                        .map(|signed| signed.body().clone())
                        .filter(|ann| ann.round == round);
                    if let Some(mut ann) = extended {
                        ann.deadline_unix_ms = deadline;
                        core.campaign.announcement = Some(Signed::sign(ann, &sh.key).encode());
                        sh.announce.send_replace(core.campaign.announcement.clone());
                        boundary = true;
                    }
                }
                EngineEvent::DeviceRevoked { device, contributed_to } => match contributed_to {
                    // The engine knows the open round only: what the device gave earlier rounds
                    // is in the models published since, and no log line should suggest otherwise.
                    Some(round) => tracing::warn!(
                        device = %device, %round,
                        "device revoked: its update stays in the open round (abort the round if its key was compromised); updates to earlier rounds stay in the versions published since"
                    ),
                    None => tracing::warn!(
                        device = %device,
                        "device revoked: nothing of it in the open round; updates to earlier rounds stay in the versions published since"
                    ),
                },
            }
        }
        if boundary {
            self.commit_boundary(core, now);
        }
    }

    pub(super) fn commit_boundary(&self, core: &mut Core, _now: Millis) {
        let sh = &self.shared;
        let strategy =
            (core.coord.strategy().folded() == 0).then(|| postcard::to_stdvec(core.coord.strategy()).expect("strategy serializes"));
        let engine = core.coord.engine().to_bytes();
        let r = sh.store.commit_boundary(Boundary {
            engine: &engine,
            strategy: strategy.as_deref(),
            global: core.global,
            campaign: Some(&core.campaign),
            arrival_rate: core.pacer.learned(),
        });
        if let Err(e) = r {
            tracing::error!(error = %e, "cannot commit a round boundary; aborting so a restart resumes from disk");
            std::process::abort();
        }
        let keep = core.coord.engine().round_status().map(|s| s.round).unwrap_or(RoundId(u64::MAX));
        let _ = sh.store.gc_updates(keep, false);
    }

    /// The round driver: deadlines and finalize/publish of closed rounds.
    pub(super) async fn drive(&self) {
        loop {
            let closing = self.lock().closing;
            if let Some(round) = closing {
                // A relay forwards its closed round to its parent instead of publishing it.
                let done = if self.shared.cfg.relay.is_some() { self.forward(round).await } else { self.finalize(round).await };
                if let Err(e) = done {
                    tracing::error!(round = %round, error = %e, "publishing failed; retrying in 5 s");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                continue;
            }
            // Deadlines are judged by the service's clock, which may be a test's: a timer only
            // wakes the driver, and [`Aggregator::clock_moved`] wakes it as well.
            let now = self.now_ms();
            let next = {
                let mut core = self.lock();
                if Self::secagg_timeout(&core).is_some_and(|t| t <= now) {
                    self.secagg_tick(&mut core, now);
                    continue;
                }
                match core.coord.poll_timeout() {
                    Some(t) if t <= now => {
                        core.coord.handle_timeout(now);
                        self.drain(&mut core, now);
                        continue;
                    }
                    next => next.into_iter().chain(Self::secagg_timeout(&core)).min(),
                }
            };
            let sleep = match next {
                Some(t) => Duration::from_millis(t - now),
                None => Duration::from_secs(3600),
            };
            tokio::select! {
                _ = self.shared.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }

    /// How many devices a round's `selection` is expected to draw: the invited list, or the
    /// enrolled devices (times the sampling rate).
    fn expected_participants(&self, selection: &fedfleet_protocol::Selection) -> u64 {
        let enrolled = self.shared.allow.len() as u64;
        match selection {
            fedfleet_protocol::Selection::All => enrolled,
            fedfleet_protocol::Selection::Devices(devices) => devices.len() as u64,
            fedfleet_protocol::Selection::Sample { rate_ppm, .. } => {
                enrolled * u64::from(*rate_ppm) / u64::from(fedfleet_protocol::messages::PPM)
            }
        }
    }

    /// A DP campaign's (ε, δ) with the round being published counted: the model's metadata
    /// (local DP: the ε each device's releases spent, at most).
    fn privacy_metrics(&self) -> Vec<(String, f64)> {
        let core = self.lock();
        let e = core.coord.engine();
        let rounds = u64::from(e.rounds_completed().unwrap_or(0)) + 1;
        if let Some(l) = &self.shared.cfg.campaign.local_dp {
            return vec![("local_dp_epsilon_per_device".to_owned(), l.epsilon_per_device(rounds)), ("dp_delta".to_owned(), l.delta)];
        }
        let Some(p) = e.privacy() else { return Vec::new() };
        vec![("dp_epsilon".to_owned(), p.spend.epsilon_after(rounds)), ("dp_delta".to_owned(), p.spend.delta)]
    }

    /// `[promotion]`: the gate's decision for a candidate with `metrics` against the champion
    /// (the version the gate's alias points at), written into `metrics` so that the published
    /// version carries it. A champion that cannot be read keeps the candidate a candidate.
    async fn promotion_gate(&self, metrics: &mut BTreeMap<String, f64>) -> Option<Result<String, String>> {
        let p = self.shared.cfg.promotion.as_ref()?;
        let decision = match self.shared.publisher.alias_version(&self.shared.cfg.model.name, &p.alias).await {
            Err(e) => Err(format!("the champion ({}) could not be read: {}", p.alias, e.0)),
            Ok(mut champion) => {
                // The current global model passed the last gate but its alias did not move:
                // move it first, and it is the champion.
                if let Some((version, passed)) = self.unfinished_promotion(champion.as_ref().map(|(v, _)| *v))
                    && self.move_alias(&p.alias, version).await
                {
                    champion = Some((version, passed));
                }
                if let Some((v, m)) = &champion {
                    metrics.insert("gate_champion_version".into(), v.0 as f64);
                    if let Some(x) = m.get(&p.metric) {
                        metrics.insert("gate_champion_value".into(), *x);
                    }
                }
                crate::publish::promotion_gate(metrics, champion.as_ref().map(|(v, m)| (*v, m)), &p.metric, p.margin)
            }
        };
        metrics.insert("gate_passed".into(), if decision.is_ok() { 1.0 } else { 0.0 });
        metrics.insert("gate_margin".into(), p.margin);
        Some(decision)
    }

    /// Moves the gate's alias to the current global model if it passed the gate and the alias
    /// did not move then (the registry failed the move, or the service stopped between the
    /// publish and the move), unless the alias moved since ([`promotion_unfinished`]). Runs at
    /// start; the gate does the same with the champion it reads.
    ///
    /// [`promotion_unfinished`]: crate::publish::promotion_unfinished
    pub async fn finish_promotion(&self) {
        let Some(p) = self.shared.cfg.promotion.as_ref() else { return };
        let alias_now = match self.shared.publisher.alias_version(&self.shared.cfg.model.name, &p.alias).await {
            Ok(v) => v.map(|(v, _)| v),
            Err(e) => return tracing::warn!(alias = %p.alias, error = %e.0, "promotion gate: the alias could not be read"),
        };
        if let Some((version, _)) = self.unfinished_promotion(alias_now) {
            self.move_alias(&p.alias, version).await;
        }
    }

    /// The current global model's version and signed metrics, if its promotion is unfinished
    /// while the alias points at `alias_now` ([`crate::publish::promotion_unfinished`]).
    fn unfinished_promotion(&self, alias_now: Option<ModelVersion>) -> Option<(ModelVersion, BTreeMap<String, f64>)> {
        let global = self.lock().global?;
        let metrics = self.shared.store.model_record(&global.digest).ok()??.metrics;
        crate::publish::promotion_unfinished(&metrics, alias_now).then_some((global.version, metrics))
    }

    /// Moves `alias` to `version`, whose promotion did not move it after the publish; true if it
    /// moved now.
    async fn move_alias(&self, alias: &str, version: ModelVersion) -> bool {
        match self.shared.publisher.set_alias(&self.shared.cfg.model.name, alias, version).await {
            Ok(()) => {
                tracing::info!(%version, %alias, "promotion gate: the alias moved now (it had not after the publish)");
                true
            }
            Err(e) => {
                tracing::warn!(%version, %alias, error = %e.0, "promotion gate passed, but the alias still did not move");
                false
            }
        }
    }

    /// Finalizes the closed `round`, evaluates, publishes, records, and opens the next round.
    pub(super) async fn finalize(&self, round: RoundId) -> Result<(), String> {
        let sh = self.shared.clone();
        let me = self.clone();
        // Finalize under the lock (CPU), off the async threads.
        let out = tokio::task::spawn_blocking(move || {
            // Every update folded into this model is durable before the model exists.
            me.shared.store.sync_all().unwrap_or_else(|e| abort_on_commit_failure(e));
            let mut core = me.lock();
            if core.closing != Some(round) {
                return Ok(None);
            }
            let base = core.base.clone().ok_or("no base model")?;
            if let Some((r, model)) = &core.finalized
                && *r == round
            {
                return Ok(Some((model.clone(), base)));
            }
            let result = match (core.coord.mode(), &me.shared.tensor_device) {
                (FoldMode::Deferred, Some(device)) => {
                    // Every accepted payload is on disk: fold them on the device in digest order.
                    let t0 = Instant::now();
                    let dtype = core.campaign.payload_dtype();
                    let mut records = me.shared.store.accepted_in(round).map_err(|e| e.to_string())?;
                    records.sort_by_key(|r| r.payload_digest);
                    let updates = records.iter().map(|rec| Ok((stored_delta(&me.shared.store, rec, &base, dtype)?, rec.weight)));
                    let r = core.coord.finalize_with(me.now_ms(), round, |s| {
                        s.finalize_on(&crate::accel::TensorBackend::new(device), &base.global(), updates)
                    });
                    let elapsed = t0.elapsed();
                    if r.is_ok() {
                        me.shared.metrics.folded(records.len() as u64 * base.dim() as u64 * 4, elapsed);
                        me.shared.metrics.round("tensor_folded");
                    }
                    tracing::info!(round = %round, updates = records.len(), ms = elapsed.as_millis() as u64, "tensor fold");
                    r
                }
                _ => core.coord.finalize(me.now_ms(), round, &base.global()),
            };
            match result {
                Ok(sent) => {
                    let model = base.merged(sent);
                    core.finalized = Some((round, model.clone()));
                    Ok(Some((model, base)))
                }
                Err(e) => {
                    core.closing = None;
                    me.drain(&mut core, me.now_ms());
                    Err(format!("finalize failed, round aborted: {e}"))
                }
            }
        })
        .await
        .map_err(|e| e.to_string())??;
        let Some((model, base)) = out else { return Ok(()) };
        // Evaluate and encode (CPU).
        let spec = sh.spec.clone();
        let sh2 = sh.clone();
        let layout = base.layout.clone();
        let (bytes, metrics, model) = tokio::task::spawn_blocking(move || {
            let bundle = unflatten(&layout, &model);
            let mut metrics = BTreeMap::new();
            if let Some(v) = sh2.validation.as_ref().filter(|_| spec.is_builtin()) {
                match fedfleet_learning::evaluate(&spec, &bundle, v) {
                    Ok(r) => {
                        metrics.extend(eval_metrics(&r));
                        metrics.insert("eval_examples".to_owned(), r.num_examples as f64);
                    }
                    Err(e) => tracing::warn!(error = %e, "server-side evaluation failed"),
                }
            }
            (bundle.encode(), metrics, model)
        })
        .await
        .map_err(|e| e.to_string())?;
        let digest = Digest::of(&bytes);
        let mut metrics = metrics;
        metrics.extend(self.privacy_metrics());
        let gate = self.promotion_gate(&mut metrics).await;
        let req = publish_request(&sh, &bytes, Some(base.version), metrics, true)?;
        let (version, published) = sh.publisher.publish(&req).await.map_err(|e| e.to_string())?;
        if published != Digest::of(&req.bundle) {
            return Err(format!("publisher returned digest {published}, expected {}", Digest::of(&req.bundle)));
        }
        let promotion = match (gate, &sh.cfg.promotion) {
            (Some(Ok(why)), Some(p)) => match sh.publisher.set_alias(&sh.cfg.model.name, &p.alias, version).await {
                Ok(()) => {
                    tracing::info!(%version, alias = %p.alias, reason = %why, "promotion gate: promoted");
                    Some(format!("promoted to {}: {why}", p.alias))
                }
                Err(e) => {
                    tracing::warn!(%version, alias = %p.alias, error = %e.0, "promotion gate passed, but the alias did not move");
                    Some(format!("passed ({why}), but {} did not move: {}", p.alias, e.0))
                }
            },
            (Some(Err(why)), _) => {
                tracing::info!(%version, reason = %why, "promotion gate: stays a candidate");
                Some(format!("candidate: {why}"))
            }
            _ => None,
        };
        let rec = held_model(&sh, req.model, version, &bytes, digest);
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            me.shared.store.put_model(&digest, &bytes, &rec).map_err(|e| e.to_string())?;
            let mut core = me.lock();
            if core.closing != Some(round) {
                return Ok(());
            }
            core.closing = None;
            core.finalized = None;
            core.global = Some(GlobalRef { version, digest });
            core.base = Some(Base::new(digest, version, base.layout.clone(), model, &base.sent.layout));
            me.shared.metrics.round("published");
            me.shared.metrics.published(version.0, &rec.metrics);
            tracing::info!(round = %round, version = %version, %digest, metrics = ?rec.metrics, "global model published");
            let now = me.now_ms();
            me.history_round_ended(&mut core, round, "published", Some((version, &rec.metrics, promotion)), now);
            core.coord.model_ready(now, round, version, digest).map_err(|e| e.to_string())?;
            me.drain(&mut core, now);
            Ok::<(), String>(())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Imports the configured initial model as the first global version (once).
    pub(super) async fn ensure_global(&self) -> Result<(), String> {
        if self.lock().global.is_some() {
            return Ok(());
        }
        let sh = &self.shared;
        let path = &sh.cfg.model.initial;
        let bytes = std::fs::read(path)
            .map_err(|e| format!("initial model {}: {e} (create it with `fedfleet-aggregator init-model`)", path.display()))?;
        let (layout, values) = decode_base(&bytes).map_err(|e| format!("initial model {}: {e}", path.display()))?;
        let expected: Layout = sh.spec.params().into_iter().map(|p| (p.name, p.shape)).collect();
        if layout != expected {
            return Err(format!("initial model {} does not match model.spec", path.display()));
        }
        let mut metrics = BTreeMap::new();
        if let Some(v) = sh.validation.as_ref().filter(|_| sh.spec.is_builtin()) {
            let b = TensorBundle::decode(&bytes, &BundleLimits::default()).map_err(|e| e.to_string())?;
            if let Ok(r) = fedfleet_learning::evaluate(&sh.spec, &b, v) {
                metrics.extend(eval_metrics(&r));
            }
        }
        // Version 1 is the pre-trained base: under LoRA its (zero-effect) adapters are merged
        // away and no lineage is recorded.
        let req = publish_request(sh, &bytes, None, metrics, false)?;
        let (version, _) = sh.publisher.publish(&req).await.map_err(|e| e.to_string())?;
        let digest = Digest::of(&bytes);
        let rec = held_model(sh, req.model, version, &bytes, digest);
        sh.store.put_model(&digest, &bytes, &rec).map_err(|e| e.to_string())?;
        let mut core = self.lock();
        if core.global.is_none() {
            core.global = Some(GlobalRef { version, digest });
            core.base = Some(Base::new(digest, version, layout, values, &sh.spec.update_layout()));
        }
        Ok(())
    }

    /// Starts a campaign from the config defaults and `o`.
    pub async fn start_campaign(&self, o: CampaignOverrides) -> Result<CampaignStatus, String> {
        if let Some(r) = &self.shared.cfg.relay {
            return Err(format!("this aggregator is a relay of {}: start campaigns on the root", r.parent));
        }
        if let Some(c) = self.lock().coord.engine().campaign_id() {
            return Err(format!("campaign {c} is still running"));
        }
        self.ensure_global().await?;
        let sh = &self.shared;
        let d = &sh.cfg.campaign;
        let mut strategy_cfg = sh.cfg.strategy_config();
        let dtype = d.dtype().map_err(|e| e.to_string())?;
        let mut core = self.lock();
        if let Some(c) = core.coord.engine().campaign_id() {
            return Err(format!("campaign {c} is still running"));
        }
        let base = core.base.clone().ok_or("no global model")?;
        let target = o.target_count.unwrap_or(d.target);
        if let fedfleet_rounds::StrategyConfig::DpFedAvg { expected_count, noise_seed, .. } = &mut strategy_cfg {
            // The fixed denominator, and a noise key nobody else holds (kept with the strategy's
            // state, so a restart redraws the same noise). A campaign started with a fixed
            // `--seed` (reproducible runs, tests) derives it from the seed: its noise is then
            // known to whoever knows the seed.
            *expected_count = u64::from(target);
            match o.seed {
                Some(seed) => *noise_seed = Digest::of(&[b"fedfleet dp-fedavg noise key v1\0".as_slice(), &seed.to_le_bytes()].concat()).0,
                None => rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, noise_seed),
            }
        }
        let strategy = ServerStrategy::new(&strategy_cfg, base.dim()).map_err(|e| e.to_string())?;
        let seed = o.seed.unwrap_or_else(|| rand_core::RngCore::next_u64(&mut rand_core::OsRng));
        let mut seed32 = [0u8; 32];
        seed32[..8].copy_from_slice(&seed.to_le_bytes());
        let id = CampaignId(core.campaign.last_campaign + 1);
        let spec = CampaignSpec {
            id,
            rounds: o.rounds.unwrap_or(d.rounds),
            base_version: base.version,
            base_digest: base.digest,
            client: strategy.configure(RoundId(0)),
            selection: Invitation::Rate { rate: d.sampling_rate },
            policy: RoundPolicy {
                target_count: target,
                min_quorum: o.min_quorum.unwrap_or(d.quorum).min(target),
                over_selection: d.over_selection,
                duration_ms: o.deadline_secs.unwrap_or(d.deadline_secs) * 1000,
                extension_ms: d.extension_secs * 1000,
                max_sample_count: d.max_sample_count,
            },
            seed: seed32,
            max_consecutive_failures: d.max_consecutive_failures,
            buffer: d.buffer(),
            privacy: d.privacy(),
        };
        let name = strategy.name().to_owned();
        let mode = fold_mode(self.shared.tensor_device.is_some(), &strategy);
        if self.shared.tensor_device.is_some() && mode == FoldMode::Streaming {
            tracing::warn!(strategy = %name, "[compute] fold = \"tensor\" covers the FedAvg family; this strategy folds exactly on the CPU");
        }
        let old_mode = core.coord.mode();
        core.coord.set_mode(mode);
        let old = std::mem::replace(core.coord.strategy_mut(), strategy);
        // What `campaign status` names the campaign by: its strategy, and how it runs.
        core.campaign.strategy = Some(match &spec.buffer {
            Some(b) => format!("{name}, async: a version every {target} updates, max staleness {}", b.max_staleness),
            None => name.clone(),
        });
        core.campaign.dtype = dtype.code();
        core.campaign.last_campaign = id.0;
        core.campaign.last_outcome = None;
        core.campaign.last_privacy = None;
        let now = self.now_ms();
        if let Err(e) = core.coord.engine_mut().start_campaign(now, spec) {
            *core.coord.strategy_mut() = old;
            core.coord.set_mode(old_mode);
            return Err(e.to_string());
        }
        tracing::info!(campaign = %id, strategy = %name, "campaign started");
        self.drain(&mut core, now);
        drop(core);
        Ok(self.status())
    }
}

/// The registry metrics of a server-side evaluation: the loss and the task's metric
/// (`accuracy`, or `rmse` for regression and reconstruction).
fn eval_metrics(r: &fedfleet_learning::EvalReport) -> [(String, f64); 2] {
    let (name, value, _) = r.metric();
    [(name.to_owned(), value), ("loss".to_owned(), r.loss)]
}

/// What goes to the registry for a model the service holds (safetensors `bytes` of the
/// service's spec): under LoRA the adapters merged into the base weights, with the base spec
/// (devices serve a plain model) and, if `lineage`, the adapters that were merged; otherwise
/// the model as it is.
fn publish_request(
    sh: &Shared,
    bytes: &[u8],
    parent: Option<ModelVersion>,
    metrics: BTreeMap<String, f64>,
    lineage: bool,
) -> Result<PublishRequest, String> {
    use fedfleet_learning::finetune::{base_spec, lora_adapters, merge_lora};
    let (bundle, spec, adapter) = match lora_adapters(&sh.spec) {
        None => (bytes.to_vec(), sh.spec_json.clone(), None),
        Some((rank, alpha, tensors)) => {
            let bundle = TensorBundle::decode(bytes, &BundleLimits::default()).map_err(|e| e.to_string())?;
            let merged = merge_lora(&sh.spec, &bundle).map_err(|e| format!("merging the LoRA adapters: {e}"))?;
            let adapter = lineage.then(|| AdapterLineage { method: "lora".into(), rank: rank as u32, alpha, tensors });
            (merged.encode(), base_spec(&sh.spec).spec_json(), adapter)
        }
    };
    let model = NewVersion {
        name: sh.cfg.model.name.clone(),
        spec,
        parent,
        metrics,
        created_at_unix_ms: sh.clock.now_ms(),
        publisher: String::new(),
        adapter,
    };
    Ok(PublishRequest { model, bundle })
}

/// The record of a model the service holds as it trains it (under LoRA: base weights +
/// adapters, with the LoRA spec), published as `version`.
fn held_model(sh: &Shared, published: NewVersion, version: ModelVersion, bytes: &[u8], digest: Digest) -> ModelInfo {
    let held = NewVersion { spec: sh.spec_json.clone(), adapter: None, ..published };
    ModelInfo::published(held, version, bytes.len() as u64, digest)
}
