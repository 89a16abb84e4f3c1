//! Data for the regression and anomaly-detection scenarios: the vendored diabetes set
//! (`examples/data/diabetes`, scikit-learn's copy, BSD-3-Clause) and generated sensor windows
//! with injected anomalies.

use std::path::Path;

use anyhow::Context;
use fedfleet_learning::rng::{self, streams};
use fedfleet_learning::{CsvOptions, Dataset, LabelColumn};

/// The diabetes regression set: 442 patients, 10 baseline variables standardised per column
/// (mean 0, standard deviation 1), the disease-progression target divided by 100 (0.25–3.46).
pub fn diabetes() -> anyhow::Result<Dataset> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/diabetes");
    let columns = |file: &str, delimiter: char| {
        let path = dir.join(file);
        Dataset::load_csv(&path, &CsvOptions { label: LabelColumn::None, delimiter, ..CsvOptions::default() })
            .with_context(|| format!("the vendored diabetes set ({})", path.display()))
    };
    let mut data = columns("diabetes_data_raw.csv.gz", ' ')?;
    let target = columns("diabetes_target.csv.gz", ',')?;
    anyhow::ensure!(data.len() == target.len() && target.example_len() == 1, "diabetes: features and targets disagree");
    let (n, f) = (data.len(), data.example_len());
    for c in 0..f {
        let col = || (0..n).map(|i| data.features[i * f + c] as f64);
        let mean = col().sum::<f64>() / n as f64;
        let std = (col().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64).sqrt().max(1e-12);
        for i in 0..n {
            data.features[i * f + c] = ((data.features[i * f + c] as f64 - mean) / std) as f32;
        }
    }
    data.targets = target.features.iter().map(|t| t / 100.0).collect();
    Ok(data)
}

/// Sensor windows of `len` samples: a sine of random frequency, phase and amplitude plus a
/// little noise. With `anomalies`, every `k`-th window is corrupted in turn by a spike, a
/// flat-lined second half or a burst of noise; the second value says which windows are.
pub fn sensor_windows(n: usize, len: usize, seed: u64, anomalies: Option<usize>) -> (Dataset, Vec<bool>) {
    let mut r = rng::rng(seed, streams::SYNTHETIC);
    let mut features = Vec::with_capacity(n * len);
    let mut anomalous = Vec::with_capacity(n);
    for i in 0..n {
        let freq = rng::uniform(&mut r, 0.05, 0.15);
        let phase = rng::uniform(&mut r, 0.0, std::f64::consts::TAU);
        let amp = rng::uniform(&mut r, 0.6, 1.0);
        let mut w: Vec<f64> =
            (0..len).map(|t| amp * (std::f64::consts::TAU * freq * t as f64 + phase).sin() + 0.03 * rng::normal(&mut r)).collect();
        let corrupt = anomalies.is_some_and(|k| k > 0 && i % k == k - 1);
        if corrupt {
            let at = (rng::uniform(&mut r, 0.0, len as f64) as usize).min(len - 1);
            match (i / anomalies.unwrap_or(1)) % 3 {
                0 => w[at] += if w[at] > 0.0 { -2.5 } else { 2.5 },
                1 => w[len / 2..].iter_mut().for_each(|v| *v = 0.0),
                _ => w.iter_mut().for_each(|v| *v += 0.6 * rng::normal(&mut r)),
            }
        }
        features.extend(w.iter().map(|&v| v as f32));
        anomalous.push(corrupt);
    }
    let data = Dataset { features, labels: vec![0; n], targets: Vec::new(), shape: vec![len], num_classes: 2 };
    (data, anomalous)
}
