//! Steps 1–7 of the demo, one function each: PKI, registry, aggregator (and its MQTT broker),
//! campaign start, the campaign's rounds, the centralized baseline.

use super::*;

// ----- 1. PKI -----

/// A throwaway fleet PKI: CA, `registry`, `aggregator` and `operator` service identities, and one
/// device identity per agent, valid for `days`.
pub fn make_pki(dir: &Path, fleet: &FleetId, devices: &[DeviceId], days: u32) -> anyhow::Result<Pki> {
    services::fleet_pki(dir, fleet, &["registry", "aggregator", "operator"], devices, days)
}

// ----- 2. registry -----

/// Keys, root, store and the QUIC service. Operators: `operator` and `aggregator` (which
/// publishes global models).
pub fn start_registry(dir: &Path, pki: &Pki) -> anyhow::Result<RunningRegistry> {
    RunningRegistry::start(pki, dir, RegistrySetup { console: Some(console_on_loopback(None)), ..RegistrySetup::default() })
}

/// The operator console on a free loopback port (operators on the machine itself, no
/// credentials), linking to `peer`'s.
pub fn console_on_loopback(peer: Option<SocketAddr>) -> fedfleet_http::console::ConsoleConfig {
    fedfleet_http::console::ConsoleConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        tls: false,
        tokens: None,
        loopback: fedfleet_http::console::LoopbackAccess::Operator,
        peer: peer.map(|a| format!("http://{a}/")),
    }
}

// ----- 3. aggregator -----

/// The aggregator's campaign settings from the demo options.
pub fn campaign_defaults(o: &DemoOptions, target: u32) -> anyhow::Result<CampaignDefaults> {
    let name = match o.strategy.as_str() {
        "clipped" => "clipped_fedavg",
        s => s,
    };
    let Ok(mut strategy) = CampaignStrategy::named(name) else {
        bail!("unknown strategy {name:?}: fedavg, fedprox, fedadam, fedyogi, fedadagrad, clipped, median, trimmed_mean, krum, dp_fedavg")
    };
    match &mut strategy {
        CampaignStrategy::ClippedFedAvg { clip_norm } | CampaignStrategy::DpFedAvg { clip_norm, .. } => {
            *clip_norm = o.clip_norm.unwrap_or(*clip_norm)
        }
        CampaignStrategy::FedAdam(k) | CampaignStrategy::FedYogi(k) | CampaignStrategy::FedAdagrad(k) => k.server_lr = o.server_lr,
        CampaignStrategy::Median { max_updates } => *max_updates = 4096,
        CampaignStrategy::TrimmedMean { trim_fraction, max_updates } => {
            *trim_fraction = o.trim_fraction.unwrap_or(*trim_fraction);
            *max_updates = 4096;
        }
        CampaignStrategy::Krum { byzantine, max_updates, .. } => {
            *byzantine = o.byzantine.unwrap_or(*byzantine);
            *max_updates = 4096;
        }
        CampaignStrategy::FedAvg {} | CampaignStrategy::FedProx {} => {}
    }
    let quantization = match o.quantization.as_str() {
        "f32" | "f16" | "bf16" => o.quantization.clone(),
        "int8" | "i8" => "i8".into(),
        q => bail!("unknown quantization {q:?}: f32, f16, bf16, int8"),
    };
    Ok(CampaignDefaults {
        rounds: o.rounds,
        target,
        quorum: target.div_ceil(2).max(1),
        deadline_secs: 120,
        extension_secs: 60,
        sampling_rate: 1.0,
        local_epochs: o.local_epochs,
        batch_size: o.batch_size,
        learning_rate: o.learning_rate,
        optimizer: o.optimizer.clone(),
        proximal_mu: if matches!(strategy, CampaignStrategy::FedProx {}) { o.proximal_mu } else { 0.0 },
        quantization,
        strategy,
        ..CampaignDefaults::default()
    })
}

/// Writes the initial model (version 1), opens the service (sled state under `dir`) and serves it.
pub async fn start_aggregator(
    dir: &Path,
    pki: &Pki,
    spec: &ModelSpec,
    bundle: &TensorBundle,
    campaign: CampaignDefaults,
    publisher: Box<dyn Publisher>,
    registry_console: Option<SocketAddr>,
) -> anyhow::Result<RunningAggregator> {
    std::fs::create_dir_all(dir)?;
    let initial = dir.join("initial.safetensors");
    std::fs::write(&initial, bundle.encode())?;
    let model = ModelConfig {
        name: MODEL_NAME.into(),
        spec: spec.clone(),
        initial,
        validation: Some(fedfleet_aggregator::config::Validation::Builtin("digits".into())),
    };
    let cfg = AggConfig {
        campaign,
        console: Some(console_on_loopback(registry_console)),
        ..AggConfig::new(([127, 0, 0, 1], 0).into(), pki.dir().to_owned(), dir.join("data"), model)
    };
    RunningAggregator::start(cfg, publisher).await
}

/// The aggregator's embedded MQTT broker (loopback, a free port, the fleet CA and the
/// aggregator's certificate) and its control client: every round it opens is announced, signed,
/// on the fleet's rounds topic; device status updates its presence table.
pub async fn start_mqtt(agg: &Aggregator, heartbeat: Duration) -> anyhow::Result<Mqtt> {
    let mut cfg = MqttConfig::embedded(([127, 0, 0, 1], 0).into());
    // A device is online while its last heartbeat is this recent.
    cfg.presence_ttl_secs = (heartbeat.as_secs() * 5).max(10);
    fedfleet_aggregator::mqtt::start(agg, &cfg)
        .await
        .map_err(|e| anyhow::anyhow!("MQTT control plane: {e}"))?
        .context("the MQTT control plane did not start")
}

pub(super) fn operator_tls(pki: &Pki) -> anyhow::Result<rustls::ClientConfig> {
    services::service_tls(pki, "operator")
}

// ----- 4. campaign start -----

/// Starts the campaign as the operator (QUIC); the aggregator publishes its initial model (v1)
/// first. Returns the status.
pub async fn start_campaign(pki: &Pki, agg_addr: SocketAddr, rounds: u32, seed: u64) -> anyhow::Result<CampaignStatus> {
    let client = AggregatorClient::connect(agg_addr, SERVER_NAME, operator_tls(pki)?)
        .await
        .map_err(|e| anyhow::anyhow!("operator connection to the aggregator: {e}"))?;
    let o = CampaignOverrides { rounds: Some(rounds), seed: Some(seed), ..Default::default() };
    client.campaign(AggRequest::CampaignStart(o)).await.map_err(|e| anyhow::anyhow!("campaign start: {e}"))
}

/// An operator connection to the registry.
pub async fn registry_operator(pki: &Pki, addr: SocketAddr) -> anyhow::Result<RegistryClient> {
    RegistryClient::connect(addr, SERVER_NAME, operator_tls(pki)?)
        .await
        .map_err(|e| anyhow::anyhow!("operator connection to the registry: {e}"))
}

// ----- 6. campaign -----

pub(super) fn version_of(st: &CampaignStatus) -> Option<ModelVersion> {
    st.global.map(|(v, _)| v)
}

/// Drives the fleet round by round (agents in lockstep with the observer, so every counter read
/// between two steps belongs to one round) until the campaign ends.
#[allow(clippy::too_many_arguments)]
pub async fn run_campaign(
    ui: &Ui,
    agg: &Aggregator,
    fleet: &mut Fleet,
    spec: &ModelSpec,
    test: &Dataset,
    rounds: u32,
    report: &mut DemoReport,
) -> anyhow::Result<()> {
    let metrics = agg.metrics();
    let bar = ui.bar(rounds as u64, "rounds");
    let agents_bar = ui.bar(fleet.len() as u64, "agents");
    let mqtt = fleet.has_mqtt();
    let heard_header = if mqtt { " | heard via MQTT" } else { "" };
    ui.line(format!(
        "{:>5} | {:>12} | {:>8} | {:>10} | {:>10}{heard_header}",
        "round", "participants", "accuracy", "bytes up", "round time"
    ));
    ui.line(format!("{:-<5}-+-{:-<12}-+-{:-<8}-+-{:-<10}-+-{:-<10}{}", "", "", "", "", "", if mqtt { "-+----------------" } else { "" }));
    let round_timeout = Duration::from_secs(300);
    for r in 1..=rounds {
        let st = agg.status();
        if st.campaign.is_none() {
            report.failures.push(format!("the campaign ended after {} of {rounds} rounds ({:?})", r - 1, st.last_outcome));
            break;
        }
        let open = st.open_round;
        let v_before = version_of(&st);
        let (acc0, bytes0) = (metrics.accepted.get(), metrics.update_bytes.get());
        let t0 = Instant::now();
        if let Some(round) = open {
            // Announced over MQTT as the round opened: give the push a moment to arrive.
            fleet.wait_announced(round, Duration::from_secs(2)).await;
        }
        let mut outcome: Option<Option<ModelVersion>> = None; // Some(Some(v)) published; Some(None) failed
        while outcome.is_none() {
            if t0.elapsed() > round_timeout {
                bail!("round {r} did not finish in {} s", round_timeout.as_secs());
            }
            agents_bar.set_position(0);
            agents_bar.set_message(format!("round {r}"));
            match open {
                Some(round) => fleet.step_round(round, |_| agents_bar.inc(1)).await?,
                None => fleet.step(|_| agents_bar.inc(1)).await?,
            }
            // Wait for the round to close and its model to be published, or for it to stay open.
            let wait = Instant::now();
            loop {
                let st = agg.status();
                if version_of(&st) != v_before {
                    outcome = Some(version_of(&st));
                    break;
                }
                if st.open_round.is_some() && st.open_round != open {
                    outcome = Some(None); // a new round opened without a new model: this one failed
                    break;
                }
                if st.campaign.is_none() {
                    outcome = Some(None);
                    break;
                }
                if st.open_round == open && wait.elapsed() > Duration::from_millis(300) {
                    break; // still open: step again (stragglers, retries)
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let version = outcome.flatten();
        let accuracy = match version {
            Some(_) => {
                let (_, bytes) = agg.global_model().context("the new global model is not readable")?;
                let bundle = TensorBundle::decode(&bytes, &BundleLimits::default())?;
                Some(evaluate(spec, &bundle, test)?.accuracy)
            }
            None => None,
        };
        let row = RoundRow {
            round: r,
            participants: metrics.accepted.get() - acc0,
            accuracy,
            bytes_up: metrics.update_bytes.get() - bytes0,
            round_time: t0.elapsed(),
            version,
            heard_over_mqtt: open.map(|r| fleet.heard_over_mqtt(r)).unwrap_or(0),
        };
        ui.line(format!(
            "{:>5} | {:>12} | {:>8} | {:>10} | {:>9.2}s{}",
            row.round,
            format!("{}/{}", row.participants, fleet.len()),
            row.accuracy.map(|a| format!("{:.2} %", a * 100.0)).unwrap_or_else(|| "failed".into()),
            human_bytes(row.bytes_up),
            row.round_time.as_secs_f64(),
            if mqtt { format!(" | {:>15}", format!("{}/{}", row.heard_over_mqtt, fleet.len())) } else { String::new() }
        ));
        if version.is_none() {
            report.failures.push(format!("round {r} failed"));
        }
        report.rounds.push(row);
        bar.inc(1);
        if let Some(a) = accuracy {
            bar.set_message(format!("accuracy {:.2} %", a * 100.0));
        }
    }
    agents_bar.finish_and_clear();
    bar.finish_and_clear();
    // The campaign finishes once its last round's model is in.
    let t = Instant::now();
    while agg.status().campaign.is_some() && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = agg.status();
    report.campaign_outcome = status.last_outcome;
    report.privacy = status.privacy;
    Ok(())
}

// ----- 7. baseline -----

/// The same model from the same initial weights, trained centrally on the whole training split
/// (SGD, momentum 0.9), evaluated on the same held-out split.
pub fn centralized_baseline(spec: &ModelSpec, train: &Dataset, test: &Dataset, epochs: usize, seed: u64) -> anyhow::Result<f64> {
    let init = init_bundle(spec, seed)?;
    let cfg = TrainConfig {
        local_epochs: epochs,
        batch_size: 16,
        learning_rate: 0.05,
        optimizer: OptimizerConfig::Sgd { momentum: 0.9 },
        ..Default::default()
    };
    let out = fedfleet_learning::train_local(spec, &init, train, &cfg, seed)?;
    let model = lsim::apply_delta(&init, &out.delta, 1.0)?;
    Ok(evaluate(spec, &model, test)?.accuracy)
}
