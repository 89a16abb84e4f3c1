//! DP-FedAvg campaigns: the engine accounts every published round's ε at the campaign's
//! sampling rate, refuses a budget that allows no round, and ends the campaign (named outcome)
//! before a round would spend past its budget.

use fedfleet_protocol::{Digest, ModelVersion, RoundId};
use fedfleet_rounds::privacy::DpSpend;
use fedfleet_rounds::*;

use crate::engine::{T0, dev, fleet};

fn dp_spec(rounds: u32, rate: f64, budget: Option<f64>) -> CampaignSpec {
    CampaignSpec {
        id: CampaignId(3),
        rounds,
        base_version: ModelVersion(1),
        base_digest: Digest::of(b"model v1"),
        client: ClientConfig::default(),
        selection: Invitation::Rate { rate },
        policy: RoundPolicy { target_count: 1, min_quorum: 1, over_selection: 1.0, ..RoundPolicy::default() },
        seed: [9; 32],
        max_consecutive_failures: 3,
        buffer: None,
        privacy: Some(PrivacyPolicy { noise_multiplier: 1.1, delta: 1e-5, epsilon_budget: budget }),
    }
}

/// Runs rounds (one invited device's update each) until the campaign ends; returns the
/// outcome, the rounds published and the ε the engine reported after each.
fn run(spec: CampaignSpec) -> (CampaignOutcome, u32, Vec<f64>) {
    let mut e = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    e.start_campaign(T0, spec).unwrap();
    let mut eps = Vec::new();
    let mut now = T0;
    loop {
        let mut published = None;
        while let Some(ev) = e.poll_event() {
            match ev {
                EngineEvent::RoundOpened(a) => {
                    let d = (0..100_000).map(dev).find(|d| a.selection.selects(d)).expect("someone is invited");
                    let meta = UpdateMeta {
                        fleet: fleet(),
                        device: d,
                        round: a.round,
                        base_digest: a.base_digest,
                        nonce: Nonce([a.round.0 as u8; 16]),
                        num_examples: 5,
                        payload_digest: Digest::of(b"update"),
                    };
                    now += 1_000;
                    e.handle_update(now, meta).unwrap();
                }
                EngineEvent::RoundClosed { round, .. } => published = Some(round),
                EngineEvent::CampaignFinished { outcome, rounds_completed, privacy, .. } => {
                    eps.push(privacy.expect("a DP campaign reports its final spend").epsilon_spent);
                    return (outcome, rounds_completed, eps);
                }
                _ => {}
            }
        }
        let round = published.expect("the round closed at its target");
        let n = eps.len() as u64 + 2;
        e.model_ready(now, round, ModelVersion(n), Digest::of(&n.to_le_bytes())).unwrap();
        if let Some(p) = e.privacy() {
            eps.push(p.epsilon_spent);
        }
    }
}

#[test]
fn every_published_round_spends_what_the_accountant_says() {
    let (outcome, rounds, eps) = run(dp_spec(5, 0.01, None));
    assert_eq!((outcome, rounds), (CampaignOutcome::Completed, 5));
    let spend = DpSpend { sampling_rate: 0.01, noise_multiplier: 1.1, delta: 1e-5 };
    assert_eq!(eps, (1..=5).map(|t| spend.epsilon_after(t)).collect::<Vec<_>>(), "ε after each round");
    assert!(eps.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn a_campaign_stops_before_a_round_would_pass_its_budget() {
    let spend = DpSpend { sampling_rate: 0.01, noise_multiplier: 1.1, delta: 1e-5 };
    let budget = spend.epsilon_after(3) + 1e-9;
    let (outcome, rounds, eps) = run(dp_spec(50, 0.01, Some(budget)));
    assert!(eps.iter().all(|&e| e <= budget), "{eps:?}");
    assert_eq!(outcome, CampaignOutcome::PrivacyBudgetSpent);
    assert_eq!(rounds, 3, "three rounds fit the budget, a fourth would not");
    assert_eq!(outcome.as_str(), "privacy_budget_spent");
}

#[test]
fn a_budget_that_allows_no_round_and_dp_in_async_mode_are_refused() {
    let mut e = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    let err = e.start_campaign(T0, dp_spec(5, 0.01, Some(1e-6))).unwrap_err().to_string();
    assert!(err.contains("allows no round"), "{err}");
    let mut spec = dp_spec(5, 0.01, None);
    spec.buffer = Some(BufferPolicy { max_staleness: 2 });
    let err = e.start_campaign(T0, spec).unwrap_err().to_string();
    assert!(err.contains("asynchronous"), "{err}");
    let mut spec = dp_spec(5, 0.01, None);
    spec.privacy.as_mut().unwrap().noise_multiplier = 0.0;
    assert!(e.start_campaign(T0, spec).is_err(), "no noise is no DP");
}

/// The accountant against Google's dp-accounting (`RdpAccountant` on the same orders) over a grid
/// of sampling rates, noise multipliers and round counts, ε at δ = 1e-5: every cell within 1 %
/// relative. The table is `dp_reference.csv`, written by `dp_reference.py` beside it; its last
/// column (dp-accounting's default orders, fractional ones included) is there for reading.
#[test]
fn epsilon_matches_google_dp_accounting_over_a_grid() {
    let mut cells = 0;
    let mut off = Vec::new();
    for line in include_str!("dp_reference.csv").lines().filter(|l| !l.starts_with('#') && !l.starts_with("q,")) {
        let f: Vec<f64> = line.split(',').map(|x| x.parse().unwrap()).collect();
        let (q, z, steps, reference) = (f[0], f[1], f[2] as u64, f[3]);
        let ours = DpSpend { sampling_rate: q, noise_multiplier: z, delta: 1e-5 }.epsilon_after(steps);
        if (ours - reference).abs() > 0.01 * reference {
            off.push(format!("q {q} z {z} steps {steps}: {ours:.6} against {reference:.6}"));
        }
        cells += 1;
    }
    assert_eq!(cells, 180);
    assert!(off.is_empty(), "{} of {cells} cells off by more than 1 %:\n{}", off.len(), off.join("\n"));
}
