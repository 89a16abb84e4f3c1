//! Datasets: an in-memory labelled set, a CSV loader, an IDX (MNIST format) loader, the
//! vendored digits set, and seeded splits.

use crate::error::DataError;
use crate::rng::{self, streams};
use flate2::read::GzDecoder;
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;

/// The vendored digits set (UCI "Optical Recognition of Handwritten Digits", as shipped in
/// scikit-learn; BSD-3-Clause, see `learning/data/README.md`). 1,797 rows of 64 values 0..16
/// plus a label.
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");

/// Seed of the canonical digits train/test split: every component that talks about "the
/// held-out digits test set" means this one.
pub const DIGITS_SPLIT_SEED: u64 = 20_240_917;

/// Fraction of the digits set held out for testing.
pub const DIGITS_TEST_FRACTION: f64 = 0.2;

/// Labelled examples in memory: `features` is row-major `[len, example_len]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// All feature values, example after example.
    pub features: Vec<f32>,
    /// One label per example, `< num_classes` (classification; 0 for other tasks).
    pub labels: Vec<u32>,
    /// Regression targets, row-major `[len, targets per example]`; empty for other tasks.
    pub targets: Vec<f32>,
    /// Shape of one example, e.g. `[64]` or `[1, 28, 28]`.
    pub shape: Vec<usize>,
    /// Number of classes.
    pub num_classes: usize,
}

/// Which CSV column holds the label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LabelColumn {
    /// The last column (digits, most exports).
    Last,
    /// The first column (MNIST-as-CSV exports).
    First,
    /// A 0-based column index.
    Index(usize),
    /// No label: the last `k` columns are regression targets.
    Targets(usize),
    /// No label: every column is a feature (reconstruction, or targets kept elsewhere).
    None,
}

/// How feature values are scaled after parsing.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Normalization {
    /// Keep values as parsed.
    None,
    /// `x * factor` (e.g. 1/16 for digits, 1/255 for 8-bit images).
    Scale(f32),
    /// `(x - mean) / std`, with statistics a caller computed on its training data.
    Standardize {
        /// Subtracted first.
        mean: f32,
        /// Then divided by.
        std: f32,
    },
}

impl Normalization {
    /// Applies the normalization to feature values in place (training data and inference
    /// inputs alike).
    pub fn apply(&self, v: &mut [f32]) {
        match *self {
            Normalization::None => {}
            Normalization::Scale(f) => v.iter_mut().for_each(|x| *x *= f),
            Normalization::Standardize { mean, std } => v.iter_mut().for_each(|x| *x = (*x - mean) / std),
        }
    }
}

/// Options of [`Dataset::from_csv_bytes`] / [`Dataset::load_csv`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CsvOptions {
    /// Label column.
    pub label: LabelColumn,
    /// Skip the first line.
    pub has_header: bool,
    /// Field separator.
    pub delimiter: char,
    /// Scaling applied to features.
    pub normalization: Normalization,
    /// Number of classes; labels must be below it. `None`: max label + 1.
    pub num_classes: Option<usize>,
    /// Shape of one example (its product must equal the number of feature columns).
    /// `None`: `[feature columns]`.
    pub shape: Option<Vec<usize>>,
}

impl Default for CsvOptions {
    fn default() -> Self {
        CsvOptions {
            label: LabelColumn::Last,
            has_header: false,
            delimiter: ',',
            normalization: Normalization::None,
            num_classes: None,
            shape: None,
        }
    }
}

impl CsvOptions {
    /// The options for the digits file: label last, no header, x/16, 10 classes, `[64]`.
    pub fn digits() -> Self {
        CsvOptions {
            normalization: Normalization::Scale(1.0 / 16.0),
            num_classes: Some(10),
            shape: Some(vec![64]),
            ..CsvOptions::default()
        }
    }
}

/// Decompresses if the bytes start with the gzip magic, else returns them as they are.
fn maybe_gunzip(bytes: &[u8], what: &str) -> Result<Vec<u8>, DataError> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        GzDecoder::new(bytes).read_to_end(&mut out).map_err(|cause| DataError::Gzip { what: what.to_string(), cause })?;
        Ok(out)
    } else {
        Ok(bytes.to_vec())
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|cause| DataError::Io { path: path.to_path_buf(), cause })
}

impl Dataset {
    /// No examples, of no shape (an agent without a data source of its own).
    pub fn empty() -> Dataset {
        Dataset { features: Vec::new(), labels: Vec::new(), targets: Vec::new(), shape: vec![0], num_classes: 0 }
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no examples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values per example.
    pub fn example_len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Regression targets per example (0 without targets).
    pub fn targets_per_example(&self) -> usize {
        if self.labels.is_empty() { 0 } else { self.targets.len() / self.labels.len() }
    }

    /// Features of example `i`.
    pub fn example(&self, i: usize) -> &[f32] {
        let n = self.example_len();
        &self.features[i * n..(i + 1) * n]
    }

    /// Examples at `indices` (in that order), as a new data set.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let n = self.example_len();
        let mut features = Vec::with_capacity(indices.len() * n);
        let mut labels = Vec::with_capacity(indices.len());
        let k = self.targets_per_example();
        let mut targets = Vec::with_capacity(indices.len() * k);
        for &i in indices {
            features.extend_from_slice(self.example(i));
            labels.push(self.labels[i]);
            targets.extend_from_slice(&self.targets[i * k..(i + 1) * k]);
        }
        Dataset { features, labels, targets, shape: self.shape.clone(), num_classes: self.num_classes }
    }

    /// Same data, another example shape of the same size (e.g. `[64]` → `[1, 8, 8]`).
    pub fn reshaped(mut self, shape: Vec<usize>) -> Result<Dataset, DataError> {
        if shape.iter().product::<usize>() != self.example_len() {
            return Err(DataError::Mismatch(format!("cannot reshape examples of {:?} to {:?}", self.shape, shape)));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Count of examples per class.
    pub fn label_histogram(&self) -> Vec<usize> {
        let mut h = vec![0usize; self.num_classes];
        for &l in &self.labels {
            h[l as usize] += 1;
        }
        h
    }

    /// Seeded, stratified split: from each class, `round(test_fraction * count)` examples go
    /// to the test set. Returns `(train, test)`; order within each is by original index.
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let mut r = rng::rng(seed, streams::SPLIT);
        let mut test_idx = Vec::new();
        let mut train_idx = Vec::new();
        for class in 0..self.num_classes as u32 {
            let mut idx: Vec<usize> = (0..self.len()).filter(|&i| self.labels[i] == class).collect();
            rng::shuffle(&mut r, &mut idx);
            let k = ((idx.len() as f64) * test_fraction).round() as usize;
            test_idx.extend_from_slice(&idx[..k]);
            train_idx.extend_from_slice(&idx[k..]);
        }
        train_idx.sort_unstable();
        test_idx.sort_unstable();
        (self.subset(&train_idx), self.subset(&test_idx))
    }

    /// The vendored digits set (1,797 × 64, values scaled to [0, 1]), parsed by the same CSV
    /// loader users get.
    pub fn digits() -> Result<Dataset, DataError> {
        Dataset::from_csv_bytes(DIGITS_CSV_GZ, "digits.csv.gz", &CsvOptions::digits())
    }

    /// The canonical digits split: `(train, test)`, 20 % stratified held out with
    /// [`DIGITS_SPLIT_SEED`] (1,438 / 359). No agent trains on the test part.
    pub fn digits_split() -> Result<(Dataset, Dataset), DataError> {
        Ok(Dataset::digits()?.split(DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED))
    }

    /// Loads a CSV file (optionally gzip-compressed; detected by magic bytes).
    pub fn load_csv(path: impl AsRef<Path>, options: &CsvOptions) -> Result<Dataset, DataError> {
        let path = path.as_ref();
        Dataset::from_csv_bytes(&read_file(path)?, &path.display().to_string(), options)
    }

    /// Parses CSV bytes (optionally gzip-compressed). `what` names the input in errors.
    ///
    /// Each row: numeric feature columns and, per `options.label`, one integer label column,
    /// trailing regression target columns, or neither. Blank lines are skipped.
    /// Rejected with the 1-based line number: wrong column count, non-numeric or non-finite
    /// values, negative/non-integer/out-of-range labels, invalid UTF-8.
    pub fn from_csv_bytes(bytes: &[u8], what: &str, options: &CsvOptions) -> Result<Dataset, DataError> {
        let raw = maybe_gunzip(bytes, what)?;
        let mut features = Vec::new();
        let mut labels = Vec::new();
        let mut targets = Vec::new();
        let mut columns: Option<usize> = None;
        let err = |line: usize, reason: String| DataError::Csv { what: what.to_string(), line, reason };
        for (i, line_bytes) in raw.split(|&b| b == b'\n').enumerate() {
            let line_no = i + 1;
            if i == 0 && options.has_header {
                continue;
            }
            let line = std::str::from_utf8(line_bytes).map_err(|_| err(line_no, "invalid UTF-8".into()))?;
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split(options.delimiter).map(str::trim).collect();
            let ncols = *columns.get_or_insert(fields.len());
            if fields.len() != ncols {
                return Err(err(line_no, format!("expected {ncols} columns, found {}", fields.len())));
            }
            let label_col = match options.label {
                LabelColumn::Last => Some(ncols - 1),
                LabelColumn::First => Some(0),
                LabelColumn::Index(k) if k < ncols => Some(k),
                LabelColumn::Index(k) => {
                    return Err(err(line_no, format!("label column {k} but the row has {ncols} columns")));
                }
                LabelColumn::Targets(_) | LabelColumn::None => None,
            };
            let target_cols = match options.label {
                LabelColumn::Targets(k) => k,
                _ => 0,
            };
            let non_features = usize::from(label_col.is_some()) + target_cols;
            if ncols <= non_features {
                return Err(err(
                    line_no,
                    format!("{ncols} columns leave no feature column beside the {non_features} label/target columns"),
                ));
            }
            if label_col.is_none() {
                labels.push(0);
            }
            for (c, f) in fields.iter().enumerate() {
                if c >= ncols - target_cols {
                    let v: f32 = f.parse().map_err(|_| err(line_no, format!("column {}: target {f:?} is not a number", c + 1)))?;
                    if !v.is_finite() {
                        return Err(err(line_no, format!("column {}: target {f:?} is not finite", c + 1)));
                    }
                    targets.push(v);
                } else if Some(c) == label_col {
                    let v: f64 = f.parse().map_err(|_| err(line_no, format!("column {}: label {f:?} is not a number", c + 1)))?;
                    if !(v >= 0.0 && v.fract() == 0.0 && v < u32::MAX as f64) {
                        return Err(err(line_no, format!("column {}: label {f:?} is not a non-negative integer", c + 1)));
                    }
                    if let Some(k) = options.num_classes
                        && v as usize >= k
                    {
                        return Err(err(line_no, format!("column {}: label {v} is not below {k} classes", c + 1)));
                    }
                    labels.push(v as u32);
                } else {
                    let v: f32 = f.parse().map_err(|_| err(line_no, format!("column {}: {f:?} is not a number", c + 1)))?;
                    if !v.is_finite() {
                        return Err(err(line_no, format!("column {}: {f:?} is not finite", c + 1)));
                    }
                    features.push(v);
                }
            }
        }
        let Some(ncols) = columns else {
            return Err(DataError::Empty(what.to_string()));
        };
        let nfeat = ncols
            - match options.label {
                LabelColumn::Targets(k) => k,
                LabelColumn::None => 0,
                _ => 1,
            };
        let shape = options.shape.clone().unwrap_or_else(|| vec![nfeat]);
        if shape.iter().product::<usize>() != nfeat {
            return Err(DataError::Mismatch(format!("{what}: rows have {nfeat} feature columns but the example shape is {shape:?}")));
        }
        let num_classes = options.num_classes.unwrap_or_else(|| labels.iter().max().map_or(0, |&m| m as usize + 1)).max(2);
        options.normalization.apply(&mut features);
        Ok(Dataset { features, labels, targets, shape, num_classes })
    }

    /// Loads an MNIST-style pair of IDX files (optionally gzip-compressed): images
    /// (`0x00000803`, `[n, rows, cols]` unsigned bytes) and labels (`0x00000801`, `[n]`).
    /// Examples get shape `[1, rows, cols]`, values scaled to [0, 1], 10 classes.
    pub fn load_idx(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> Result<Dataset, DataError> {
        let (ip, lp) = (images.as_ref(), labels.as_ref());
        Dataset::from_idx_bytes(&read_file(ip)?, &ip.display().to_string(), &read_file(lp)?, &lp.display().to_string())
    }

    /// [`Dataset::load_idx`] over bytes already in memory.
    pub fn from_idx_bytes(images: &[u8], images_what: &str, labels: &[u8], labels_what: &str) -> Result<Dataset, DataError> {
        let img = parse_idx(&maybe_gunzip(images, images_what)?, images_what)?;
        let lab = parse_idx(&maybe_gunzip(labels, labels_what)?, labels_what)?;
        if img.dims.len() != 3 {
            return Err(DataError::Idx {
                what: images_what.into(),
                offset: 3,
                reason: format!("images must have 3 dimensions, found {}", img.dims.len()),
            });
        }
        if lab.dims.len() != 1 {
            return Err(DataError::Idx {
                what: labels_what.into(),
                offset: 3,
                reason: format!("labels must have 1 dimension, found {}", lab.dims.len()),
            });
        }
        if img.dims[0] != lab.dims[0] {
            return Err(DataError::Mismatch(format!(
                "{images_what} has {} images but {labels_what} has {} labels",
                img.dims[0], lab.dims[0]
            )));
        }
        if let Some(pos) = lab.data.iter().position(|&l| l > 9) {
            return Err(DataError::Idx {
                what: labels_what.into(),
                offset: lab.header_len + pos,
                reason: format!("label {} of example {pos} is not a digit 0..9", lab.data[pos]),
            });
        }
        if img.dims[0] == 0 {
            return Err(DataError::Empty(images_what.into()));
        }
        let features = img.data.iter().map(|&b| b as f32 / 255.0).collect();
        Ok(Dataset {
            features,
            labels: lab.data.iter().map(|&l| l as u32).collect(),
            targets: Vec::new(),
            shape: vec![1, img.dims[1], img.dims[2]],
            num_classes: 10,
        })
    }

    /// The MNIST t10k files in `dir` (`t10k-images-idx3-ubyte[.gz]`, `t10k-labels-idx1-ubyte[.gz]`).
    pub fn load_mnist_dir(dir: impl AsRef<Path>, prefix: &str) -> Result<Dataset, DataError> {
        let dir = dir.as_ref();
        let pick = |base: String| {
            let gz = dir.join(format!("{base}.gz"));
            if gz.exists() { gz } else { dir.join(base) }
        };
        Dataset::load_idx(pick(format!("{prefix}-images-idx3-ubyte")), pick(format!("{prefix}-labels-idx1-ubyte")))
    }
}

/// A parsed IDX file with unsigned-byte data.
struct Idx {
    dims: Vec<usize>,
    data: Vec<u8>,
    header_len: usize,
}

fn parse_idx(bytes: &[u8], what: &str) -> Result<Idx, DataError> {
    let err = |offset: usize, reason: String| DataError::Idx { what: what.to_string(), offset, reason };
    if bytes.len() < 4 {
        return Err(err(0, format!("file is {} bytes, shorter than the 4-byte magic", bytes.len())));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(err(
            0,
            format!("bad magic {:02x}{:02x}{:02x}{:02x}: must start with two zero bytes", bytes[0], bytes[1], bytes[2], bytes[3]),
        ));
    }
    if bytes[2] != 0x08 {
        return Err(err(2, format!("data type 0x{:02x} is not supported (only 0x08, unsigned byte)", bytes[2])));
    }
    let ndim = bytes[3] as usize;
    if ndim == 0 {
        return Err(err(3, "zero dimensions".into()));
    }
    let header_len = 4 + 4 * ndim;
    if bytes.len() < header_len {
        return Err(err(bytes.len(), format!("header truncated: {ndim} dimensions need {header_len} bytes")));
    }
    let mut dims = Vec::with_capacity(ndim);
    let mut total: usize = 1;
    for d in 0..ndim {
        let o = 4 + 4 * d;
        let v = u32::from_be_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) as usize;
        total = total.checked_mul(v).filter(|&t| t <= 1 << 32).ok_or_else(|| err(o, "dimensions overflow".into()))?;
        dims.push(v);
    }
    let have = bytes.len() - header_len;
    if have != total {
        return Err(err(bytes.len().min(header_len + total), format!("dimensions {dims:?} need {total} data bytes, file has {have}")));
    }
    Ok(Idx { dims, data: bytes[header_len..].to_vec(), header_len })
}
