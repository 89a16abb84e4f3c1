//! [`Loopback`]: steps 1–5 as one harness (services + N agents on loopback), reused by the
//! scenario examples.

use super::*;

/// A fleet running on loopback: PKI, registry, aggregator (with its embedded MQTT broker), the
/// campaign started with the initial model published as v1 and `stable`, and the agents.
pub struct Loopback {
    pub pki: Pki,
    pub registry: Arc<Registry>,
    pub aggregator: Aggregator,
    pub aggregator_addr: SocketAddr,
    pub registry_addr: SocketAddr,
    /// The registry as the operator (QUIC).
    pub op: RegistryClient,
    pub mqtt: Option<Mqtt>,
    pub spec: ModelSpec,
    pub train: Dataset,
    pub test: Dataset,
    pub initial: ModelRef,
    pub fleet: Fleet,
    reg_run: RunningRegistry,
    agg_run: RunningAggregator,
}

impl Loopback {
    /// Steps 1 to 5 of the demo (one line each on `ui`); fills the report's setup figures.
    pub async fn start(o: &DemoOptions, ui: &Ui, work: &Path, report: &mut DemoReport) -> anyhow::Result<Loopback> {
        if o.agents == 0 {
            bail!("--agents must be at least 1");
        }
        // Alphanumeric: the embedded broker (rumqttd) refuses other fleet ids in certificates.
        let fleet_id = FleetId::new("demo").expect("valid fleet id");
        let devices: Vec<DeviceId> = (0..o.agents).map(|i| DeviceId::new(format!("agent-{i:03}")).expect("valid id")).collect();

        // 1. PKI
        let t = Instant::now();
        let pki = make_pki(&work.join("pki"), &fleet_id, &devices, 30)?;
        ui.line(format!(
            "[1/8] PKI: fleet CA (ed25519), identities for registry, aggregator, operator and {} devices ({:.1} s)",
            devices.len(),
            t.elapsed().as_secs_f64()
        ));

        // 2. registry
        let reg_run = start_registry(&work.join("registry"), &pki)?;
        let (registry, root) = (reg_run.reg.clone(), reg_run.pinned_root.clone());
        ui.line(format!("[2/8] registry: QUIC (mTLS) on {}, TUF root pinned by every device", reg_run.addr));

        // Data and round target (agents with training data; a share can be empty under label skew).
        let spec = o.model.as_ref().map_or_else(ModelSpec::digits_mlp, |m| m.spec.clone());
        let (train, test) = Dataset::digits_split()?;
        let partition = Partition::Dirichlet { alpha: o.alpha };
        let sizes = crate::fleet::shares(&partition, o.agents, o.seed)?;
        let trainers = sizes.iter().filter(|n| **n > 0).count() as u32;

        // 3. aggregator, publishing into the registry, with its MQTT control plane
        let campaign = campaign_defaults(o, trainers.max(1))?;
        let publisher: Box<dyn Publisher> = Box::new(
            RegistryPublisher::connect_lazy(pki.dir(), "aggregator", reg_run.addr, SERVER_NAME).map_err(|e| anyhow::anyhow!("{e}"))?,
        );
        let initial = match &o.model {
            Some(m) => m.initial.clone(),
            None => init_bundle(&spec, o.seed)?,
        };
        let started = start_aggregator(&work.join("aggregator"), &pki, &spec, &initial, campaign, publisher, reg_run.console_addr).await;
        let agg_run = match started {
            Ok(x) => x,
            Err(e) => {
                reg_run.stop().await;
                return Err(e);
            }
        };
        let aggregator = agg_run.agg.clone();
        ui.line(format!(
            "[3/8] aggregator: QUIC (mTLS) on {}, sled state; publishes every global model to the registry over QUIC with its service certificate",
            agg_run.addr
        ));
        if let (Some(agg), Some(reg)) = (agg_run.console_addr, reg_run.console_addr) {
            ui.line(format!("      dashboard: campaign http://{agg}/ · fleet, versions, rollouts http://{reg}/ (API under /api/v1)"));
            report.consoles = Some((agg, reg));
        }
        let mut lb = LoopbackParts { pki, registry, aggregator, reg_run, agg_run, mqtt: None };
        let rest = async {
            if o.mqtt {
                let m = start_mqtt(&lb.aggregator, o.heartbeat).await?;
                let addr = m.broker_addr().context("the embedded broker has no address")?;
                report.mqtt_broker = Some(addr);
                ui.line(format!(
                    "      MQTT control plane: embedded broker (TLS, client certificates of the fleet CA) on {addr}; rounds announced there, signed by the aggregator; devices publish signed status"
                ));
                lb.mqtt = Some(m);
            }

            // 4. campaign start (publishes v1) and the stable alias
            let st = start_campaign(&lb.pki, lb.agg_run.addr, o.rounds, o.seed).await?;
            let (v1, d1) = st.global.context("the aggregator has no initial model")?;
            let initial = ModelRef { name: MODEL_NAME.into(), version: v1, digest: d1 };
            let op = registry_operator(&lb.pki, lb.reg_run.addr).await?;
            op.admin(AdminRequest::AliasSet { name: MODEL_NAME.into(), alias: "stable".into(), version: v1 })
                .await
                .map_err(|e| anyhow::anyhow!("alias set: {e}"))?;
            let initial_bytes = std::fs::read(work.join("aggregator").join("initial.safetensors"))?;
            report.initial_accuracy = evaluate(&spec, &TensorBundle::decode(&initial_bytes, &BundleLimits::default())?, &test)?.accuracy;
            ui.line(format!(
                "[4/8] campaign {} started ({}, target {} updates per round); initial model published as {} v{}, alias stable -> v{}, accuracy {:.2} %",
                st.campaign.unwrap_or(0),
                st.strategy.clone().unwrap_or_default(),
                st.target,
                MODEL_NAME,
                v1.0,
                v1.0,
                report.initial_accuracy * 100.0
            ));
            report.initial = Some(initial.clone());

            // 5. the fleet: agents install stable (v1) through the registry, then join rounds.
            let mut fo = FleetOptions::new(
                lb.pki.dir(),
                fleet_id.clone(),
                devices.clone(),
                lb.agg_run.addr,
                lb.reg_run.addr,
                lb.aggregator.receipt_key(),
                root.clone(),
                MODEL_NAME,
                work.join("agents"),
            );
            fo.partition = partition.clone();
            fo.partition_seed = o.seed;
            let mqtt = report.mqtt_broker.map(|broker| MqttLink { broker, aggregator_key: lb.aggregator.receipt_key(), heartbeat: o.heartbeat });
            let fleet = Fleet::start_with(fo, FleetExtras { mqtt, attacks: o.attacks.clone() })?;
            let hostile = o.attacks.iter().filter(|a| a.is_some()).count();
            ui.line(format!(
                "[5/8] {} agents started (own certificate and key, sled store, QUIC clients{}, Dirichlet({}) share of the digits training split, 20 % kept as local holdout); training examples min {} / median {} / max {}{}",
                fleet.len(),
                if report.mqtt_broker.is_some() { ", MQTT client with signed heartbeats" } else { "" },
                o.alpha,
                sizes.iter().min().unwrap_or(&0),
                median(&sizes),
                sizes.iter().max().unwrap_or(&0),
                if hostile > 0 { format!("; {hostile} of them hostile") } else { String::new() }
            ));
            anyhow::Ok((op, initial, fleet))
        }
        .await;
        match rest {
            Ok((op, initial, fleet)) => Ok(Loopback {
                aggregator_addr: lb.agg_run.addr,
                registry_addr: lb.reg_run.addr,
                pki: lb.pki,
                registry: lb.registry,
                aggregator: lb.aggregator,
                op,
                mqtt: lb.mqtt,
                spec,
                train,
                test,
                initial,
                fleet,
                reg_run: lb.reg_run,
                agg_run: lb.agg_run,
            }),
            Err(e) => {
                lb.stop().await;
                Err(e)
            }
        }
    }

    /// Runs the campaign's rounds (step 6), a table row each.
    pub async fn train(&mut self, ui: &Ui, rounds: u32, report: &mut DemoReport) -> anyhow::Result<ModelRef> {
        run_campaign(ui, &self.aggregator, &mut self.fleet, &self.spec, &self.test, rounds, report).await?;
        let st = self.aggregator.status();
        let (vf, df) = st.global.context("no global model after the campaign")?;
        report.final_accuracy = report.rounds.iter().rev().find_map(|r| r.accuracy).unwrap_or(report.initial_accuracy);
        let final_model = ModelRef { name: MODEL_NAME.into(), version: vf, digest: df };
        report.final_model = Some(final_model.clone());
        Ok(final_model)
    }

    /// The current global model's weights.
    pub fn global_model(&self) -> anyhow::Result<TensorBundle> {
        let (_, bytes) = self.aggregator.global_model().context("the global model is not readable")?;
        Ok(TensorBundle::decode(&bytes, &BundleLimits::default())?)
    }

    /// What the aggregator saw over MQTT: devices online and known through their verified status.
    pub fn mqtt_devices(&self) -> (usize, usize) {
        self.aggregator.metrics().devices(self.aggregator.now_ms())
    }

    /// Stops the agents' MQTT clients, the broker, the aggregator and the registry.
    pub async fn stop(self) {
        self.op.close().await;
        self.fleet.shutdown().await;
        LoopbackParts {
            pki: self.pki,
            registry: self.registry,
            aggregator: self.aggregator,
            reg_run: self.reg_run,
            agg_run: self.agg_run,
            mqtt: self.mqtt,
        }
        .stop()
        .await;
    }
}

/// The services of a [`Loopback`] while it starts.
pub(super) struct LoopbackParts {
    pki: Pki,
    registry: Arc<Registry>,
    aggregator: Aggregator,
    reg_run: RunningRegistry,
    agg_run: RunningAggregator,
    mqtt: Option<Mqtt>,
}

impl LoopbackParts {
    pub(super) async fn stop(self) {
        if let Some(m) = self.mqtt {
            m.shutdown().await;
        }
        self.agg_run.stop().await;
        self.reg_run.stop().await;
    }
}
