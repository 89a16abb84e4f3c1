//! Strategies: determinism under any arrival order, relay equivalence, server optimizers against
//! hand-computed values, clipping, robust aggregation.

use fedfleet_protocol::RoundId;
use fedfleet_rounds::strategy::fixed::{MAX_FOLDS, MAX_WEIGHT};
use fedfleet_rounds::strategy::l2_norm;
use fedfleet_rounds::*;
use rand::seq::SliceRandom;
use rand::{Rng as _, RngCore, SeedableRng};

/// The tests' seeded generator.
type Rng = rand_chacha::ChaCha8Rng;

/// `n` updates of `dim` elements whose magnitudes span 1e-9 .. 1e4 (mixed within each update),
/// with weights from 1 to 2^24.
fn mixed_updates(n: usize, dim: usize, seed: u64) -> Vec<(Vec<f32>, u64)> {
    let mut rng = Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let delta = (0..dim)
                .map(|_| {
                    let mag = 10f64.powf(-9.0 + 13.0 * rng.r#gen::<f64>());
                    let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
                    (sign * mag) as f32
                })
                .collect();
            let weight = match i % 4 {
                0 => 1,
                1 => rng.gen_range(1..=1000),
                2 => MAX_WEIGHT,
                _ => rng.gen_range(1..=100_000),
            };
            (delta, weight)
        })
        .collect()
}

fn client() -> ClientConfig {
    ClientConfig::default()
}

fn all_configs(dim_updates: usize) -> Vec<StrategyConfig> {
    let c = client();
    vec![
        StrategyConfig::FedAvg { client: c.clone() },
        StrategyConfig::FedProx { client: c.clone(), proximal_mu: 0.01 },
        StrategyConfig::ClippedFedAvg { client: c.clone(), clip_norm: 10.0 },
        StrategyConfig::FedAdam { client: c.clone(), params: FedOptParams::adam() },
        StrategyConfig::FedYogi { client: c.clone(), params: FedOptParams::yogi() },
        StrategyConfig::FedAdagrad { client: c.clone(), params: FedOptParams::adagrad() },
        StrategyConfig::Median { client: c.clone(), max_updates: dim_updates },
        StrategyConfig::TrimmedMean { client: c.clone(), trim_fraction: 0.2, max_updates: dim_updates },
        StrategyConfig::Krum { client: c, byzantine: 2, select: 3, max_updates: dim_updates },
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn result_is_bit_identical_for_any_arrival_order() {
    let dim = 1_000;
    let updates = mixed_updates(12, dim, 1);
    let global: Vec<f32> = (0..dim).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut rng = Rng::seed_from_u64(99);
    for config in all_configs(updates.len()) {
        let mut reference: Option<Vec<u32>> = None;
        let mut order: Vec<usize> = (0..updates.len()).collect();
        for _ in 0..40 {
            order.shuffle(&mut rng);
            let mut s = ServerStrategy::new(&config, dim).unwrap();
            for &i in &order {
                s.fold(&updates[i].0, updates[i].1).unwrap();
            }
            let model = s.finalize(&global).unwrap();
            assert!(model.iter().all(|x| x.is_finite()));
            let b = bits(&model);
            match &reference {
                None => reference = Some(b),
                Some(r) => assert!(r == &b, "{config:?}: order {order:?} changed the result"),
            }
        }
    }
}

#[test]
fn fixed_point_mean_is_accurate() {
    // The exact mean, computed in f64 in one order, agrees to f32 precision.
    let dim = 500;
    let updates = mixed_updates(9, dim, 7);
    let mut s = PartialSum::new(dim);
    for (d, w) in &updates {
        s.fold(d, *w).unwrap();
    }
    let mean = s.mean().unwrap();
    let total: f64 = updates.iter().map(|(_, w)| *w as f64).sum();
    for j in 0..dim {
        let exact: f64 = updates.iter().map(|(d, w)| d[j] as f64 * *w as f64).sum::<f64>() / total;
        let tol = exact.abs() * 1e-12 + 1e-14;
        assert!((mean[j] - exact).abs() <= tol, "coord {j}: {} vs {exact}", mean[j]);
    }
}

#[test]
fn relay_partial_sums_equal_fedavg_over_all_devices() {
    let dim = 777;
    let updates = mixed_updates(15, dim, 3);
    let global = vec![0.25f32; dim];

    let fedavg = || ServerStrategy::new(&StrategyConfig::FedAvg { client: client() }, dim).unwrap();
    let mut direct = fedavg();
    for (d, w) in &updates {
        direct.fold(d, *w).unwrap();
    }
    let expected = direct.partial_sum().unwrap().clone();

    // Three relays of uneven size; each forwards its partial sum over the wire (postcard).
    let mut root = fedavg();
    for part in [&updates[..2], &updates[2..9], &updates[9..]] {
        let mut relay = fedavg();
        for (d, w) in part {
            relay.fold(d, *w).unwrap();
        }
        let wire = postcard::to_stdvec(&relay.take_partial_sum().unwrap()).unwrap();
        let partial: PartialSum = postcard::from_bytes(&wire).unwrap();
        root.merge_partial(&partial).unwrap();
    }
    assert_eq!(root.partial_sum(), Some(&expected));
    assert_eq!(root.partial_sum().unwrap().count(), 15);
    assert_eq!(bits(&root.finalize(&global).unwrap()), bits(&direct.finalize(&global).unwrap()));

    // Robust steps have no partial sum to merge.
    let mut s = ServerStrategy::new(&StrategyConfig::Median { client: client(), max_updates: 4 }, dim).unwrap();
    assert!(s.merge_partial(&expected).is_err());
}

fn adaptive(s: &ServerStrategy) -> &AdaptiveOptimizer {
    match s.optimizer() {
        ServerOptimizer::Adaptive(opt) => opt,
        other => panic!("{other:?}"),
    }
}

fn fedopt_two_rounds(kind: FedOptKind, beta_1: f64) -> (Vec<f32>, Vec<f32>, ServerStrategy) {
    let params = FedOptParams { eta: 0.1, eta_l: 0.05, beta_1, beta_2: 0.99, tau: 1e-3, bias_correction: false };
    let config = match kind {
        FedOptKind::Adam => StrategyConfig::FedAdam { client: client(), params },
        FedOptKind::Yogi => StrategyConfig::FedYogi { client: client(), params },
        FedOptKind::Adagrad => StrategyConfig::FedAdagrad { client: client(), params },
    };
    let mut s = ServerStrategy::new(&config, 2).unwrap();
    assert_eq!(s.configure(RoundId(1)).learning_rate, 0.05);
    // Round 1: weighted mean of [1, -2]·1 and [3, 2]·3 is [2.5, 1.0].
    s.fold(&[1.0, -2.0], 1).unwrap();
    s.fold(&[3.0, 2.0], 3).unwrap();
    let r1 = s.finalize(&[0.5, -0.5]).unwrap();
    // Round 2: mean [-1.0, 0.5].
    s.fold(&[-1.0, 0.5], 2).unwrap();
    let r2 = s.finalize(&r1).unwrap();
    (r1, r2, s)
}

fn assert_close(got: &[f32], want: &[f64]) {
    for (g, w) in got.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 2e-7, "got {got:?}, want {want:?}");
    }
}

#[test]
fn fedadam_matches_hand_computed_values() {
    // m1 = 0.1·Δ = [0.25, 0.1]; v1 = 0.01·Δ² = [0.0625, 0.01];
    // x1 = x0 + 0.1·m1/(√v1 + 1e-3) = [0.5 + 0.025/0.251, -0.5 + 0.01/0.101].
    // m2 = 0.9·m1 + 0.1·[-1, 0.5] = [0.125, 0.14]; v2 = 0.99·v1 + 0.01·[1, 0.25] = [0.071875, 0.0124].
    let (r1, r2, s) = fedopt_two_rounds(FedOptKind::Adam, 0.9);
    assert_close(&r1, &[0.599601594, -0.400990099]);
    assert_close(&r2, &[0.646053567, -0.276385371]);
    assert_close(adaptive(&s).m(), &[0.125, 0.14]);
    assert_close(adaptive(&s).v(), &[0.071875, 0.0124]);
    assert_eq!(adaptive(&s).t(), 2);
}

#[test]
fn fedyogi_matches_hand_computed_values() {
    // Round 1 equals Adam's (v0 = 0). Round 2: sign(v1 − Δ²) = −1, so v2 = v1 + 0.01·Δ² =
    // [0.0725, 0.0125].
    let (r1, r2, s) = fedopt_two_rounds(FedOptKind::Yogi, 0.9);
    assert_close(&r1, &[0.599601594, -0.400990099]);
    assert_close(&r2, &[0.645853652, -0.276880363]);
    assert_close(adaptive(&s).v(), &[0.0725, 0.0125]);
}

#[test]
fn fedadagrad_matches_hand_computed_values() {
    // β₁ = 0: m = Δ; v accumulates Δ²: v1 = [6.25, 1], v2 = [7.25, 1.25].
    let (r1, r2, s) = fedopt_two_rounds(FedOptKind::Adagrad, 0.0);
    assert_close(&r1, &[0.599960016, -0.400099900]);
    assert_close(&r2, &[0.562834736, -0.355418505]);
    assert_close(adaptive(&s).m(), &[-1.0, 0.5]);
    assert_close(adaptive(&s).v(), &[7.25, 1.25]);
}

#[test]
fn fedopt_state_survives_serialization() {
    let (_, r2, s) = fedopt_two_rounds(FedOptKind::Adam, 0.9);
    let bytes = postcard::to_stdvec(&s).unwrap();
    let mut back: ServerStrategy = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, s);
    let mut orig = s;
    for x in [&mut orig, &mut back] {
        x.fold(&[0.5, 0.5], 1).unwrap();
    }
    assert_eq!(bits(&orig.finalize(&r2).unwrap()), bits(&back.finalize(&r2).unwrap()));
}

fn clipped(s: &ServerStrategy) -> u64 {
    match s.aggregation() {
        AggregationStep::ClippedMean(c) => c.clipped_this_round(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn clipping_bounds_every_contribution() {
    let dim = 300;
    let clip = 2.5;
    let global = vec![0.0f32; dim];
    let updates = mixed_updates(10, dim, 11); // norms up to ~1e5
    for (d, w) in &updates {
        let mut s = ServerStrategy::new(&StrategyConfig::ClippedFedAvg { client: client(), clip_norm: clip }, dim).unwrap();
        s.fold(d, *w).unwrap();
        let out = s.finalize(&global).unwrap();
        let norm = l2_norm(&out);
        assert!(norm <= clip * (1.0 + 1e-6), "norm {norm} > {clip}");
        if l2_norm(d) > clip {
            assert!(norm > clip * (1.0 - 1e-6), "a clipped delta keeps the bound as its norm: {norm}");
        }
    }
    // The mean of clipped deltas is bounded too; the count of clipped updates is reported.
    let mut s = ServerStrategy::new(&StrategyConfig::ClippedFedAvg { client: client(), clip_norm: clip }, dim).unwrap();
    for (d, w) in &updates {
        s.fold(d, *w).unwrap();
    }
    assert_eq!(clipped(&s), 10);
    assert!(l2_norm(&s.finalize(&global).unwrap()) <= clip * (1.0 + 1e-6));
    // A small delta passes unchanged: same bits as plain FedAvg.
    let small: Vec<f32> = (0..dim).map(|i| (i as f32) * 1e-5).collect();
    let mut c = ServerStrategy::new(&StrategyConfig::ClippedFedAvg { client: client(), clip_norm: clip }, dim).unwrap();
    let mut f = ServerStrategy::new(&StrategyConfig::FedAvg { client: client() }, dim).unwrap();
    c.fold(&small, 3).unwrap();
    f.fold(&small, 3).unwrap();
    assert_eq!(clipped(&c), 0);
    assert_eq!(bits(&c.finalize(&global).unwrap()), bits(&f.finalize(&global).unwrap()));
}

#[test]
fn robust_strategies_resist_an_outlier() {
    let honest = [[1.0f32, 2.0], [1.1, 2.1], [0.9, 1.9], [1.05, 2.05], [0.95, 1.95], [1.0, 2.0]];
    let evil = [1e6f32, -1e6];
    let global = [0.0f32, 0.0];
    let configs = [
        StrategyConfig::Median { client: client(), max_updates: 16 },
        StrategyConfig::TrimmedMean { client: client(), trim_fraction: 0.15, max_updates: 16 },
        StrategyConfig::Krum { client: client(), byzantine: 1, select: 1, max_updates: 16 },
        StrategyConfig::Krum { client: client(), byzantine: 1, select: 3, max_updates: 16 },
    ];
    for config in configs {
        let mut s = ServerStrategy::new(&config, 2).unwrap();
        s.fold(&evil, MAX_WEIGHT).unwrap(); // claiming many samples buys nothing
        for h in &honest {
            s.fold(h, 1).unwrap();
        }
        let out = s.finalize(&global).unwrap();
        assert!((out[0] - 1.0).abs() < 0.11 && (out[1] - 2.0).abs() < 0.11, "{config:?}: {out:?}");
        assert_eq!(s.folded(), 0, "finalize clears the round");
    }
    // Median of an even count averages the middle pair.
    let mut m = Median::new(MemorySpill::new(1, 4));
    for x in [4.0f32, 1.0, 3.0, 2.0] {
        m.fold(&[x], 1).unwrap();
    }
    assert_eq!(m.aggregate().unwrap(), vec![2.5]);
}

#[test]
fn robust_strategies_refuse_what_they_cannot_use() {
    let mut krum = Krum::new(2, 1, MemorySpill::new(1, 100)).unwrap();
    for x in 0..6 {
        krum.fold(&[x as f32], 1).unwrap();
    }
    assert!(matches!(krum.aggregate(), Err(StrategyError::TooFewUpdates { need: 7, got: 6, .. })));
    let mut med = Median::new(MemorySpill::new(2, 1));
    med.fold(&[1.0, 1.0], 1).unwrap();
    let e = med.fold(&[1.0, 1.0], 1).unwrap_err();
    assert_eq!(e.reason(), RejectReason::Overloaded);
    let e = med.fold(&[1.0], 1).unwrap_err();
    assert_eq!(e.reason(), RejectReason::ShapeMismatch);
}

#[test]
fn bad_updates_are_refused_with_named_reasons_and_leave_no_trace() {
    let dim = 5000;
    for config in all_configs(4) {
        let mut s = ServerStrategy::new(&config, dim).unwrap();
        let good = vec![0.5f32; dim];
        s.fold(&good, 2).unwrap();
        let mut nan = good.clone();
        nan[4999] = f32::NAN;
        assert_eq!(s.fold(&nan, 1).unwrap_err().reason(), RejectReason::NonFinite, "{config:?}");
        assert_eq!(s.fold(&good[1..], 1).unwrap_err().reason(), RejectReason::ShapeMismatch);
        assert_eq!(s.fold(&good, 0).unwrap_err().reason(), RejectReason::BadSampleCount);
        assert_eq!(s.folded(), 1);
        if s.partial_sum().is_some() && s.name() != "clipped_fedavg" {
            let mut huge = good.clone();
            huge[7] = 1e30;
            assert_eq!(s.fold(&huge, 1).unwrap_err().reason(), RejectReason::TooLarge, "{config:?}");
            assert_eq!(s.partial_sum().unwrap().count(), 1);
        }
    }
    let _ = MAX_FOLDS;
}

#[test]
fn aborted_round_keeps_server_state() {
    let (_, r2, mut s) = fedopt_two_rounds(FedOptKind::Adam, 0.9);
    let (m, v) = (adaptive(&s).m().to_vec(), adaptive(&s).v().to_vec());
    s.fold(&[9.0, 9.0], 1).unwrap();
    s.abort_round();
    assert_eq!(s.folded(), 0);
    assert_eq!((adaptive(&s).m(), adaptive(&s).v(), adaptive(&s).t()), (&m[..], &v[..], 2));
    assert!(s.finalize(&r2).is_err(), "nothing folded");
}

/// Rough fold throughput (not a benchmark harness; asserts nothing about time). Run with
/// `cargo test -p fedfleet-aggregator --release --test strategies -- --ignored --nocapture`.
#[test]
#[ignore]
fn fold_throughput() {
    let dim = 4 << 20; // 16 MiB of f32
    let delta: Vec<f32> = (0..dim).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let mut sum = PartialSum::new(dim);
    let mut copy = vec![0f32; dim];
    let reps = 20;
    let t = std::time::Instant::now();
    for k in 0..reps {
        sum.fold(&delta, 1 + k).unwrap();
    }
    let fold = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        copy.copy_from_slice(std::hint::black_box(&delta));
        std::hint::black_box(&mut copy);
    }
    let memcpy = t.elapsed().as_secs_f64();
    let gb = (reps as usize * dim * 4) as f64 / 1e9;
    println!("fold: {:.2} GB/s of f32 input; memcpy: {:.2} GB/s", gb / fold, gb / memcpy);
}
