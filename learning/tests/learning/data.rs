use fedfleet_learning::data::{DIGITS_SPLIT_SEED, DIGITS_TEST_FRACTION};
use fedfleet_learning::{CsvOptions, DataError, Dataset, LabelColumn, Normalization};
use std::io::Write;
use std::path::PathBuf;

fn csv(text: &str, opts: &CsvOptions) -> Result<Dataset, DataError> {
    Dataset::from_csv_bytes(text.as_bytes(), "test.csv", opts)
}

fn line_of(e: DataError) -> usize {
    match e {
        DataError::Csv { line, .. } => line,
        other => panic!("expected a CSV row error, got {other}"),
    }
}

#[test]
fn digits_loads_through_the_csv_loader() {
    let d = Dataset::digits().unwrap();
    assert_eq!(d.len(), 1797);
    assert_eq!(d.shape, vec![64]);
    assert_eq!(d.num_classes, 10);
    assert!(d.features.iter().all(|&x| (0.0..=1.0).contains(&x)));
    assert_eq!(d.label_histogram().iter().sum::<usize>(), 1797);
    assert!(d.label_histogram().iter().all(|&c| c > 170));
    let (train, test) = Dataset::digits_split().unwrap();
    assert_eq!(train.len() + test.len(), 1797);
    assert_eq!(test.len(), 359);
    // stratified and reproducible
    let (t2, s2) = d.split(DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED);
    assert_eq!((t2, s2.clone()), (train, test.clone()));
    assert!(test.label_histogram().iter().all(|&c| (34..=38).contains(&c)), "{:?}", test.label_histogram());
    // a user-facing file load gives the same rows
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("digits.csv.gz");
    std::fs::write(&p, fedfleet_learning::data::DIGITS_CSV_GZ).unwrap();
    assert_eq!(Dataset::load_csv(&p, &CsvOptions::digits()).unwrap(), d);
}

#[test]
fn csv_options_header_label_first_and_scaling() {
    let opts =
        CsvOptions { label: LabelColumn::First, has_header: true, normalization: Normalization::Scale(0.5), ..CsvOptions::default() };
    let d = csv("label,a,b\n1, 2,4\r\n\n0,6,8\n", &opts).unwrap();
    assert_eq!(d.labels, vec![1, 0]);
    assert_eq!(d.features, vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(d.num_classes, 2);
    let semi = CsvOptions { delimiter: ';', label: LabelColumn::Index(1), ..CsvOptions::default() };
    let d = csv("1;2;3\n4;0;6\n", &semi).unwrap();
    assert_eq!((d.labels, d.features), (vec![2, 0], vec![1.0, 3.0, 4.0, 6.0]));
    let std = CsvOptions { normalization: Normalization::Standardize { mean: 1.0, std: 2.0 }, ..CsvOptions::default() };
    assert_eq!(csv("5,0\n", &std).unwrap().features, vec![2.0]);
}

#[test]
fn csv_rejects_malformed_rows_with_their_line_number() {
    let o = CsvOptions { num_classes: Some(3), ..CsvOptions::default() };
    let cases = [
        ("1,2,0\n3,4,1\n5,6\n", 3, "expected 3 columns"),
        ("1,2,0\n3,x,1\n", 2, "not a number"),
        ("1,2,0\n\n3,4,7\n", 3, "not below 3 classes"),
        ("1,2,-1\n", 1, "non-negative integer"),
        ("1,2,0.5\n", 1, "non-negative integer"),
        ("1,2,0\n1,inf,0\n", 2, "not finite"),
        ("1,2,0\n1,NaN,0\n", 2, "not finite"),
        ("1,2,0\n1,2,0,4\n", 2, "expected 3 columns"),
    ];
    for (text, line, reason) in cases {
        let e = csv(text, &o).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(reason), "{text:?}: {msg}");
        assert!(msg.contains(&format!("line {line}")), "{text:?}: {msg}");
        assert_eq!(line_of(e), line, "{text:?}");
    }
    let mut bad_utf8 = b"1,2,0\n".to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe, b'\n']);
    assert_eq!(line_of(Dataset::from_csv_bytes(&bad_utf8, "x", &o).unwrap_err()), 2);
    assert!(matches!(csv("\n\n", &o), Err(DataError::Empty(_))));
    let shaped = CsvOptions { shape: Some(vec![1, 3, 3]), ..CsvOptions::default() };
    assert!(matches!(csv("1,2,0\n", &shaped), Err(DataError::Mismatch(_))));
    // a malformed row inside a gzip file is reported with its line too
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(b"1,2,0\n1,2,0\n1,2\n").unwrap();
    let bytes = gz.finish().unwrap();
    assert_eq!(line_of(Dataset::from_csv_bytes(&bytes, "x.gz", &o).unwrap_err()), 3);
    // a truncated gzip stream is refused
    assert!(matches!(Dataset::from_csv_bytes(&bytes[..bytes.len() / 2], "x.gz", &o), Err(DataError::Gzip { .. })));
    // missing file
    assert!(matches!(Dataset::load_csv("/nonexistent/file.csv", &o), Err(DataError::Io { .. })));
}

fn idx_images(n: u32, rows: u32, cols: u32, data: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 8, 3];
    for d in [n, rows, cols] {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(data);
    v
}

fn idx_labels(labels: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 8, 1];
    v.extend_from_slice(&(labels.len() as u32).to_be_bytes());
    v.extend_from_slice(labels);
    v
}

fn idx_err(images: &[u8], labels: &[u8]) -> String {
    Dataset::from_idx_bytes(images, "img", labels, "lab").unwrap_err().to_string()
}

#[test]
fn idx_loader_reads_and_rejects() {
    let px: Vec<u8> = (0..2 * 2 * 3).map(|i| (i * 20) as u8).collect();
    let d = Dataset::from_idx_bytes(&idx_images(2, 2, 3, &px), "img", &idx_labels(&[7, 1]), "lab").unwrap();
    assert_eq!(d.shape, vec![1, 2, 3]);
    assert_eq!(d.labels, vec![7, 1]);
    assert_eq!(d.features[1], 20.0 / 255.0);
    // files on disk, gzip and plain
    let dir = tempfile::tempdir().unwrap();
    let (ip, lp) = (dir.path().join("i.idx"), dir.path().join("l.idx.gz"));
    std::fs::write(&ip, idx_images(2, 2, 3, &px)).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&idx_labels(&[7, 1])).unwrap();
    std::fs::write(&lp, gz.finish().unwrap()).unwrap();
    assert_eq!(Dataset::load_idx(&ip, &lp).unwrap(), d);

    let good_l = idx_labels(&[7, 1]);
    let e = idx_err(&[0, 0, 8], &good_l);
    assert!(e.contains("offset 0") && e.contains("shorter than the 4-byte magic"), "{e}");
    let e = idx_err(&[1, 2, 8, 3, 0, 0, 0, 0], &good_l);
    assert!(e.contains("bad magic"), "{e}");
    let e = idx_err(&[0, 0, 0x0d, 3, 0, 0, 0, 0], &good_l);
    assert!(e.contains("offset 2") && e.contains("0x0d"), "{e}");
    let e = idx_err(&idx_images(2, 2, 3, &px)[..10], &good_l);
    assert!(e.contains("header truncated"), "{e}");
    let e = idx_err(&idx_images(2, 2, 3, &px[..11]), &good_l);
    assert!(e.contains("need 12 data bytes, file has 11"), "{e}");
    let e = idx_err(&idx_images(2, 2, 3, &[px.clone(), vec![0]].concat()), &good_l);
    assert!(e.contains("file has 13"), "{e}");
    let e = idx_err(&idx_images(2, 2, 3, &px), &idx_labels(&[7]));
    assert!(e.contains("2 images") && e.contains("1 labels"), "{e}");
    let e = idx_err(&idx_images(2, 2, 3, &px), &idx_labels(&[7, 12]));
    assert!(e.contains("offset 9") && e.contains("not a digit"), "{e}");
    let e = idx_err(&good_l, &good_l);
    assert!(e.contains("3 dimensions"), "{e}");
    let e = idx_err(&idx_images(2, 2, 3, &px), &idx_images(2, 2, 3, &px));
    assert!(e.contains("1 dimension"), "{e}");
    let huge = idx_images(u32::MAX, u32::MAX, u32::MAX, &[]);
    assert!(idx_err(&huge, &good_l).contains("overflow"));
}

fn mnist_dir() -> Option<PathBuf> {
    [PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/mnist-t10k"), PathBuf::from("/work/shared/data/mnist-t10k")]
        .into_iter()
        .find(|p| p.join("t10k-images-idx3-ubyte.gz").exists())
}

#[test]
fn idx_loader_reads_the_real_mnist_t10k() {
    let Some(dir) = mnist_dir() else {
        eprintln!("MNIST t10k not present; skipping");
        return;
    };
    let d = Dataset::load_mnist_dir(&dir, "t10k").unwrap();
    assert_eq!(d.len(), 10_000);
    assert_eq!(d.shape, vec![1, 28, 28]);
    assert_eq!(&d.labels[..5], &[7, 2, 1, 0, 4]);
    assert_eq!(d.label_histogram(), vec![980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]);
    let (tr, te) = d.split(0.2, 1);
    assert_eq!((tr.len(), te.len()), (8000, 2000));
}

#[test]
fn csv_columns_can_be_regression_targets_or_all_features() {
    let text = b"1,2,3,0.5\n4,5,6,1.5\n";
    let r = Dataset::from_csv_bytes(text, "r", &CsvOptions { label: LabelColumn::Targets(1), ..CsvOptions::default() }).unwrap();
    assert_eq!((r.features.len(), r.targets.clone(), r.shape.clone(), r.targets_per_example()), (6, vec![0.5, 1.5], vec![3], 1));
    let two = Dataset::from_csv_bytes(text, "r", &CsvOptions { label: LabelColumn::Targets(2), ..CsvOptions::default() }).unwrap();
    assert_eq!((two.shape.clone(), two.targets), (vec![2], vec![3.0, 0.5, 6.0, 1.5]));
    let all =
        Dataset::from_csv_bytes(b"1 2 3\n4 5 6\n", "a", &CsvOptions { label: LabelColumn::None, delimiter: ' ', ..CsvOptions::default() })
            .unwrap();
    assert_eq!((all.len(), all.shape, all.targets.len()), (2, vec![3], 0));
    let err = Dataset::from_csv_bytes(b"1,x\n", "r", &CsvOptions { label: LabelColumn::Targets(1), ..CsvOptions::default() }).unwrap_err();
    assert!(err.to_string().contains("target \"x\" is not a number"), "{err}");
    let err = Dataset::from_csv_bytes(b"1,2\n", "r", &CsvOptions { label: LabelColumn::Targets(2), ..CsvOptions::default() }).unwrap_err();
    assert!(err.to_string().contains("no feature column"), "{err}");
}
