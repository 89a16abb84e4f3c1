use fedfleet_learning::partition::{self, SyntheticConfig, label_histograms, synthetic};
use fedfleet_learning::{Dataset, Partition};

fn check_cover(parts: &[Vec<usize>], n: usize) {
    let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..n).collect::<Vec<_>>(), "every example in exactly one client");
}

/// Mean over clients of the share of their most common label.
fn mean_top_share(h: &[Vec<usize>]) -> f64 {
    h.iter().filter(|c| c.iter().sum::<usize>() > 0).map(|c| *c.iter().max().unwrap() as f64 / c.iter().sum::<usize>() as f64).sum::<f64>()
        / h.len() as f64
}

/// Mean over clients of the number of classes holding at least 5 % of their data.
fn mean_classes_present(h: &[Vec<usize>]) -> f64 {
    h.iter()
        .map(|c| {
            let t = c.iter().sum::<usize>().max(1) as f64;
            c.iter().filter(|&&k| k as f64 / t >= 0.05).count() as f64
        })
        .sum::<f64>()
        / h.len() as f64
}

#[test]
fn dirichlet_small_alpha_is_visibly_skewed() {
    let (train, _) = Dataset::digits_split().unwrap();
    let n = train.len();
    let iid = Partition::Iid.split(&train.labels, 10, 20, 7);
    let d05 = Partition::Dirichlet { alpha: 0.5 }.split(&train.labels, 10, 20, 7);
    let d01 = Partition::Dirichlet { alpha: 0.1 }.split(&train.labels, 10, 20, 7);
    for p in [&iid, &d05, &d01] {
        check_cover(p, n);
        assert!(p.iter().all(|c| c.len() >= 10), "{:?}", p.iter().map(Vec::len).collect::<Vec<_>>());
    }
    let (hi, h5, h1) =
        (label_histograms(&train.labels, 10, &iid), label_histograms(&train.labels, 10, &d05), label_histograms(&train.labels, 10, &d01));
    println!("Dirichlet(0.1) label histograms (client: counts for labels 0..9):");
    for (c, h) in h1.iter().enumerate() {
        println!("  {c:2}: {h:?}");
    }
    let (ti, t5, t1) = (mean_top_share(&hi), mean_top_share(&h5), mean_top_share(&h1));
    let (ci, c1) = (mean_classes_present(&hi), mean_classes_present(&h1));
    println!("mean top-label share: iid {ti:.2}, dir(0.5) {t5:.2}, dir(0.1) {t1:.2}; classes >=5%: iid {ci:.1}, dir(0.1) {c1:.1}");
    assert!(ti < 0.25, "iid should be balanced: {ti}");
    assert!(t1 > 0.5, "Dirichlet(0.1): the top label should hold most of a client's data: {t1}");
    assert!(t1 > t5 && t5 > ti, "skew grows as alpha shrinks: {ti} {t5} {t1}");
    assert!(ci > 9.0 && c1 < 4.0, "classes present: iid {ci}, dir(0.1) {c1}");
    // deterministic in the seed
    assert_eq!(d01, Partition::Dirichlet { alpha: 0.1 }.split(&train.labels, 10, 20, 7));
    assert_ne!(d01, Partition::Dirichlet { alpha: 0.1 }.split(&train.labels, 10, 20, 8));
}

#[test]
fn iid_and_shards() {
    let (train, _) = Dataset::digits_split().unwrap();
    let n = train.len();
    let iid = partition::iid(n, 7, 1);
    check_cover(&iid, n);
    let sizes: Vec<usize> = iid.iter().map(Vec::len).collect();
    assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
    let sh = partition::shards(&train.labels, 20, 2, 1);
    check_cover(&sh, n);
    for h in label_histograms(&train.labels, 10, &sh) {
        // two shards of ~36 sorted examples each: at most 4 labels
        assert!(h.iter().filter(|&&c| c > 0).count() <= 4, "{h:?}");
    }
    let ds = Partition::Shards { per_client: 2 }.split_dataset(&train, 20, 1);
    assert_eq!(ds.iter().map(Dataset::len).sum::<usize>(), n);
    let json = serde_json::to_string(&Partition::Dirichlet { alpha: 0.5 }).unwrap();
    assert_eq!(json, r#"{"kind":"dirichlet","alpha":0.5}"#);
}

#[test]
fn synthetic_alpha_beta_generator() {
    let cfg = SyntheticConfig::new(1.0, 1.0);
    let a = synthetic(&cfg, 3);
    assert_eq!(a.len(), 30);
    for d in &a {
        assert!(d.len() >= 50 && d.len() <= 2000);
        assert_eq!(d.shape, vec![60]);
        assert_eq!(d.features.len(), d.len() * 60);
        assert!(d.features.iter().all(|x| x.is_finite()));
    }
    let b = synthetic(&cfg, 3);
    assert_eq!(a, b);
    // Heterogeneous: clients' majority labels differ.
    let tops: std::collections::BTreeSet<usize> = a
        .iter()
        .map(|d| {
            let h = d.label_histogram();
            (0..10).max_by_key(|&k| h[k]).unwrap()
        })
        .collect();
    assert!(tops.len() >= 4, "majority labels {tops:?}");
    // Synthetic(0,0) with fixed sizes: all clients share mean 0 parameters, still a valid task.
    let fixed = SyntheticConfig { per_client: Some(100), clients: 5, ..SyntheticConfig::new(0.0, 0.0) };
    let s = synthetic(&fixed, 1);
    assert!(s.iter().all(|d| d.len() == 100));
}
