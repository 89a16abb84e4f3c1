//! NumPy and image-folder loaders.

use fedfleet_learning::files::{read_npy, read_npz};
use fedfleet_learning::{DataError, Dataset, ImageFolderOptions, ModelSpec, Normalization, TrainConfig, train_local};
use std::path::PathBuf;

fn arrays() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arrays")
}

#[test]
fn npy_features_with_integer_labels_or_float_targets() {
    let d = Dataset::load_npy(arrays().join("x.npy"), Some(&arrays().join("y.npy")), Normalization::None).unwrap();
    assert_eq!(d.shape, vec![2, 3]);
    assert_eq!(d.len(), 6);
    assert_eq!(d.features, (0..36).map(|i| i as f32 / 4.0).collect::<Vec<_>>());
    assert_eq!(d.labels, vec![0, 2, 1, 2, 0, 1]);
    assert_eq!(d.num_classes, 3);
    assert!(d.targets.is_empty());
    let r = Dataset::load_npy(arrays().join("x.npy"), Some(&arrays().join("t.npy")), Normalization::Scale(2.0)).unwrap();
    assert_eq!(r.targets_per_example(), 2);
    assert_eq!(&r.targets[..4], &[0.0, -0.0, 0.5, -1.0]);
    assert_eq!(r.features[1], 0.5);
    // Trains as a regression.
    let spec = ModelSpec::from_json(
        r#"{"arch":"graph","input":[2,3],"task":"regression","layers":[{"type":"flatten"},{"type":"linear","out_features":2}]}"#,
    )
    .unwrap();
    let g = fedfleet_learning::model::init_bundle(&spec, 1).unwrap();
    assert!(train_local(&spec, &g, &r, &TrainConfig::default(), 1).is_ok());
}

#[test]
fn npz_big_endian_and_byte_arrays() {
    let d = Dataset::load_npz(arrays().join("data.npz"), "x", Some("y"), Normalization::None).unwrap();
    let e = Dataset::load_npy(arrays().join("x.npy"), Some(&arrays().join("y.npy")), Normalization::None).unwrap();
    assert_eq!(d, e);
    let be = read_npy(&std::fs::read(arrays().join("big_endian.npy")).unwrap(), "be").unwrap();
    assert_eq!(be.values, e.features);
    let u8s = read_npy(&std::fs::read(arrays().join("x_u8.npy")).unwrap(), "u8").unwrap();
    assert!(u8s.integer);
    assert_eq!(u8s.shape, vec![4, 3]);
    assert_eq!(u8s.values[11], 11.0);
    let npz = std::fs::read(arrays().join("data.npz")).unwrap();
    let err = read_npz(&npz, "data.npz", &["z"]).unwrap_err().to_string();
    assert!(err.contains(r#"no array "z""#) && err.contains('x'), "{err}");
}

#[test]
fn bad_arrays_are_named_errors() {
    let fortran = std::fs::read(arrays().join("x_fortran.npy")).unwrap();
    assert!(read_npy(&fortran, "f").unwrap_err().to_string().contains("Fortran"));
    let good = std::fs::read(arrays().join("x.npy")).unwrap();
    for cut in [0, 5, 20, good.len() - 1] {
        assert!(matches!(read_npy(&good[..cut], "cut"), Err(DataError::Npy { .. })), "cut at {cut}");
    }
    // A header claiming a huge shape is refused before allocating.
    let text = String::from_utf8_lossy(&good).replace("(6, 2, 3)", "(9999999999, 2, 3)");
    let forged = text.as_bytes();
    assert!(matches!(read_npy(forged, "forged"), Err(DataError::Npy { .. })));
    assert!(matches!(read_npz(&good, "not-zip", &["x"]), Err(DataError::Npy { .. })));
    // Labels that do not match the examples.
    let x = read_npy(&good, "x").unwrap();
    let short = fedfleet_learning::files::NpyArray { shape: vec![5], values: vec![0.0; 5], integer: true };
    assert!(matches!(Dataset::from_arrays(x.clone(), Some(short), "x", Normalization::None), Err(DataError::Mismatch(_))));
    let negative = fedfleet_learning::files::NpyArray { shape: vec![6], values: vec![-1.0; 6], integer: true };
    assert!(Dataset::from_arrays(x, Some(negative), "x", Normalization::None).is_err());
}

#[test]
fn image_folders_become_resized_chw_examples() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for class in ["cats", "dogs"] {
        std::fs::create_dir(root.join(class)).unwrap();
    }
    // A red 4x4 PNG, a 6x2 blue JPEG and a stray text file.
    let red = image::RgbImage::from_pixel(4, 4, image::Rgb([255, 0, 0]));
    red.save(root.join("cats/a.png")).unwrap();
    let blue = image::RgbImage::from_pixel(6, 2, image::Rgb([0, 0, 255]));
    blue.save(root.join("dogs/b.JPG"))
        .unwrap_or_else(|_| blue.save_with_format(root.join("dogs/b.JPG"), image::ImageFormat::Jpeg).unwrap());
    std::fs::write(root.join("dogs/notes.txt"), "not an image").unwrap();
    let opts = ImageFolderOptions::for_input(&[3, 2, 2]).unwrap();
    let (data, classes) = Dataset::load_image_folder(root, &opts).unwrap();
    assert_eq!(classes, ["cats", "dogs"]);
    assert_eq!(data.labels, vec![0, 1]);
    assert_eq!(data.shape, vec![3, 2, 2]);
    let cat = data.example(0);
    assert_eq!(&cat[..4], &[1.0; 4], "red plane");
    assert_eq!(&cat[4..], &[0.0; 8]);
    let dog = data.example(1);
    assert!(dog[8..].iter().all(|&v| v > 0.9), "blue plane {dog:?}");
    assert!(dog[..8].iter().all(|&v| v < 0.1));
    // Grayscale for a 1-channel model.
    let (gray, _) = Dataset::load_image_folder(root, &ImageFolderOptions::for_input(&[1, 3, 3]).unwrap()).unwrap();
    assert_eq!(gray.shape, vec![1, 3, 3]);
    // A corrupt image names the file.
    std::fs::write(root.join("cats/broken.png"), b"\x89PNG nope").unwrap();
    let err = Dataset::load_image_folder(root, &opts).unwrap_err();
    assert!(matches!(&err, DataError::Image { path, .. } if path.ends_with("cats/broken.png")), "{err}");
    assert!(ImageFolderOptions::for_input(&[2, 8, 8]).is_err());
}

#[test]
fn written_npy_arrays_read_back_as_features_and_targets() {
    let dir = tempfile::tempdir().unwrap();
    let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
    fedfleet_learning::files::write_npy(dir.path().join("x.npy"), &[3, 4], &x).unwrap();
    fedfleet_learning::files::write_npy(dir.path().join("t.npy"), &[3], &[0.5, 1.5, -2.0]).unwrap();
    let d = Dataset::load_npy(dir.path().join("x.npy"), Some(&dir.path().join("t.npy")), Normalization::None).unwrap();
    assert_eq!((d.features, d.targets, d.shape), (x, vec![0.5, 1.5, -2.0], vec![4]));
    let bad = fedfleet_learning::files::write_npy(dir.path().join("y.npy"), &[2, 2], &[1.0]).unwrap_err();
    assert!(bad.to_string().contains("1 values for shape [2, 2]"), "{bad}");
}
