//! Data sets from the files edge teams have: NumPy arrays (`.npy`, `.npz`) and image folders
//! (one sub-folder per class, PNG/JPEG, resized to the model input).

use crate::data::{Dataset, Normalization};
use crate::error::DataError;
use image::imageops::FilterType;
use npyz::{NpyFile, Order, TypeChar};
use std::io::{Cursor, Read};
use std::path::{Path, PathBuf};

/// An array read from a `.npy` stream: its shape and values, integer or floating.
#[derive(Clone, Debug, PartialEq)]
pub struct NpyArray {
    /// Shape as written (C order).
    pub shape: Vec<usize>,
    /// The values converted to f32.
    pub values: Vec<f32>,
    /// The file held integers (labels) rather than floats.
    pub integer: bool,
}

/// Writes `values` as a little-endian f32 `.npy` array of `shape` (C order), as
/// `np.save(path, x.astype(np.float32))` would: exports of device data and test fixtures.
pub fn write_npy(path: impl AsRef<Path>, shape: &[usize], values: &[f32]) -> Result<(), DataError> {
    use npyz::WriterBuilder;
    let path = path.as_ref();
    let io = |cause| DataError::Io { path: path.to_path_buf(), cause };
    if shape.iter().product::<usize>() != values.len() {
        return Err(DataError::Mismatch(format!("{}: {} values for shape {shape:?}", path.display(), values.len())));
    }
    let file = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut w = npyz::WriteOptions::new().default_dtype().shape(&dims).writer(file).begin_nd().map_err(io)?;
    w.extend(values.iter().copied()).map_err(io)?;
    w.finish().map_err(io)
}

fn npy_err(what: &str, reason: impl Into<String>) -> DataError {
    DataError::Npy { what: what.to_string(), reason: reason.into() }
}

/// Parses one `.npy` stream. Accepted dtypes: f2/f4/f8, i1..i8, u1..u8, bool (either
/// endianness); C order only.
pub fn read_npy(bytes: &[u8], what: &str) -> Result<NpyArray, DataError> {
    let npy = NpyFile::new(Cursor::new(bytes)).map_err(|e| npy_err(what, format!("bad header: {e}")))?;
    if npy.order() == Order::Fortran {
        return Err(npy_err(what, "Fortran-ordered arrays are not supported (save with np.ascontiguousarray)"));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let npyz::DType::Plain(ts) = npy.dtype() else {
        return Err(npy_err(what, "structured dtypes are not supported"));
    };
    let size = ts.size_field() as usize;
    // Refuse a header that claims more data than the file has before anything is allocated.
    let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| npy_err(what, "shape overflows"))?;
    if count.checked_mul(size).is_none_or(|n| n > bytes.len()) {
        return Err(npy_err(what, format!("shape {shape:?} of {size}-byte values does not fit in {} bytes", bytes.len())));
    }
    let io = |e: std::io::Error| npy_err(what, e.to_string());
    macro_rules! conv {
        ($t:ty) => {
            npy.into_vec::<$t>().map_err(io)?.into_iter().map(|v| v as f32).collect::<Vec<f32>>()
        };
    }
    let (values, integer) = match (ts.type_char(), size) {
        (TypeChar::Float, 2) => (npy.into_vec::<half::f16>().map_err(io)?.into_iter().map(|v| v.to_f32()).collect(), false),
        (TypeChar::Float, 4) => (conv!(f32), false),
        (TypeChar::Float, 8) => (conv!(f64), false),
        (TypeChar::Int, 1) => (conv!(i8), true),
        (TypeChar::Int, 2) => (conv!(i16), true),
        (TypeChar::Int, 4) => (conv!(i32), true),
        (TypeChar::Int, 8) => (conv!(i64), true),
        (TypeChar::Uint, 1) => (conv!(u8), true),
        (TypeChar::Uint, 2) => (conv!(u16), true),
        (TypeChar::Uint, 4) => (conv!(u32), true),
        (TypeChar::Uint, 8) => (conv!(u64), true),
        (TypeChar::Bool, 1) => (npy.into_vec::<bool>().map_err(io)?.into_iter().map(|b| f32::from(u8::from(b))).collect(), true),
        _ => return Err(npy_err(what, format!("dtype {ts} is not supported (floats, integers or bool)"))),
    };
    Ok(NpyArray { shape, values, integer })
}

/// Reads the arrays `names` (without `.npy`) from `.npz` bytes (stored or deflated, as
/// `np.savez` / `np.savez_compressed` write them).
pub fn read_npz(bytes: &[u8], what: &str, names: &[&str]) -> Result<Vec<NpyArray>, DataError> {
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| npy_err(what, format!("not a zip archive: {e}")))?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let entry_name = format!("{name}.npy");
        let mut entry =
            zip.by_name(&entry_name).map_err(|_| npy_err(what, format!("no array {name:?} (the archive has {:?})", zip_names(bytes))))?;
        if entry.size() > bytes.len() as u64 * 1032 {
            // deflate cannot expand more than ~1032:1; a larger claim is a forged header.
            return Err(npy_err(what, format!("{entry_name} claims {} bytes", entry.size())));
        }
        let mut buf = Vec::with_capacity(entry.size() as usize);
        entry.read_to_end(&mut buf).map_err(|e| npy_err(what, format!("{entry_name}: {e}")))?;
        out.push(read_npy(&buf, &format!("{what}:{entry_name}"))?);
    }
    Ok(out)
}

fn zip_names(bytes: &[u8]) -> Vec<String> {
    zip::ZipArchive::new(Cursor::new(bytes))
        .map(|z| z.file_names().map(|n| n.trim_end_matches(".npy").to_string()).collect())
        .unwrap_or_default()
}

fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|cause| DataError::Io { path: path.to_path_buf(), cause })
}

impl Dataset {
    /// Builds a data set from a features array `[n, ...]` (1 to 3 dimensions per example) and
    /// optional labels: an integer array `[n]` gives classification labels (classes = max + 1,
    /// at least 2), a float array `[n]` or `[n, k]` gives regression targets; without labels
    /// the set serves reconstruction. `normalization` applies to the features.
    pub fn from_arrays(
        features: NpyArray,
        labels: Option<NpyArray>,
        what: &str,
        normalization: Normalization,
    ) -> Result<Dataset, DataError> {
        let n = *features.shape.first().ok_or_else(|| npy_err(what, "features are a scalar, expected [examples, ...]"))?;
        if n == 0 {
            return Err(DataError::Empty(what.to_string()));
        }
        let mut shape = features.shape[1..].to_vec();
        if shape.is_empty() {
            shape.push(1);
        }
        if shape.len() > 3 || shape.contains(&0) {
            return Err(npy_err(what, format!("examples of shape {shape:?}: need 1 to 3 non-empty dimensions")));
        }
        if let Some(i) = features.values.iter().position(|v| !v.is_finite()) {
            return Err(npy_err(
                what,
                format!("feature value {} of example {} is not finite", i % (features.values.len() / n), i / (features.values.len() / n)),
            ));
        }
        let mut features_v = features.values;
        normalization.apply(&mut features_v);
        let mut data = Dataset { features: features_v, labels: vec![0; n], targets: Vec::new(), shape, num_classes: 2 };
        if let Some(l) = labels {
            if l.shape.first() != Some(&n) || l.shape.len() > 2 {
                return Err(DataError::Mismatch(format!("{what}: {n} examples but labels of shape {:?}", l.shape)));
            }
            if l.integer {
                if l.shape.len() != 1 {
                    return Err(DataError::Mismatch(format!("{what}: integer labels must be [n], got {:?}", l.shape)));
                }
                if let Some(pos) = l.values.iter().position(|&v| !(v >= 0.0 && v < u32::MAX as f32)) {
                    return Err(npy_err(what, format!("label {} of example {pos} is negative or too large", l.values[pos])));
                }
                data.labels = l.values.iter().map(|&v| v as u32).collect();
                data.num_classes = data.labels.iter().max().map_or(2, |&m| (m as usize + 1).max(2));
            } else {
                if let Some(pos) = l.values.iter().position(|v| !v.is_finite()) {
                    return Err(npy_err(what, format!("target value {pos} is not finite")));
                }
                data.targets = l.values;
            }
        }
        Ok(data)
    }

    /// Loads `features.npy` and optional `labels.npy` (see [`Dataset::from_arrays`]).
    pub fn load_npy(features: impl AsRef<Path>, labels: Option<&Path>, normalization: Normalization) -> Result<Dataset, DataError> {
        let fp = features.as_ref();
        let what = fp.display().to_string();
        let x = read_npy(&read_file(fp)?, &what)?;
        let y = labels.map(|p| read_file(p).and_then(|b| read_npy(&b, &p.display().to_string()))).transpose()?;
        Dataset::from_arrays(x, y, &what, normalization)
    }

    /// Loads arrays from an `.npz` archive: `features_key` (e.g. `"x"`) and optionally
    /// `labels_key` (e.g. `"y"`), as written by `np.savez(path, x=..., y=...)`.
    pub fn load_npz(
        path: impl AsRef<Path>,
        features_key: &str,
        labels_key: Option<&str>,
        normalization: Normalization,
    ) -> Result<Dataset, DataError> {
        let path = path.as_ref();
        let what = path.display().to_string();
        let bytes = read_file(path)?;
        let mut keys = vec![features_key];
        keys.extend(labels_key);
        let mut arrays = read_npz(&bytes, &what, &keys)?.into_iter();
        let x = arrays.next().expect("one array per key");
        Dataset::from_arrays(x, arrays.next(), &what, normalization)
    }
}

/// How [`Dataset::load_image_folder`] turns images into examples.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageFolderOptions {
    /// 1 (grayscale) or 3 (RGB) channels.
    pub channels: usize,
    /// Height after resizing.
    pub height: usize,
    /// Width after resizing.
    pub width: usize,
    /// Applied to the 0..255 pixel values (default: `Scale(1/255)`).
    pub normalization: Normalization,
}

impl ImageFolderOptions {
    /// Options matching a model input `[C, H, W]` (C 1 or 3), pixels scaled to [0, 1].
    pub fn for_input(shape: &[usize]) -> Result<ImageFolderOptions, DataError> {
        match *shape {
            [c @ (1 | 3), h, w] if h > 0 && w > 0 => {
                Ok(ImageFolderOptions { channels: c, height: h, width: w, normalization: Normalization::Scale(1.0 / 255.0) })
            }
            _ => Err(DataError::Mismatch(format!("image input must be [1 or 3, H, W], the model takes {shape:?}"))),
        }
    }
}

/// Decodes one PNG/JPEG file, resizes it (bilinear) and lays it out `[C, H, W]` like
/// torchvision's `ToTensor`.
pub fn load_image(path: &Path, options: &ImageFolderOptions) -> Result<Vec<f32>, DataError> {
    let bytes = read_file(path)?;
    let img = image::load_from_memory(&bytes).map_err(|e| DataError::Image { path: path.to_path_buf(), reason: e.to_string() })?;
    let (w, h) = (options.width as u32, options.height as u32);
    let plane = options.height * options.width;
    let mut out = vec![0.0f32; options.channels * plane];
    match options.channels {
        1 => {
            let g = image::imageops::resize(&img.to_luma8(), w, h, FilterType::Triangle);
            for (i, p) in g.pixels().enumerate() {
                out[i] = p.0[0] as f32;
            }
        }
        3 => {
            let rgb = image::imageops::resize(&img.to_rgb8(), w, h, FilterType::Triangle);
            for (i, p) in rgb.pixels().enumerate() {
                for c in 0..3 {
                    out[c * plane + i] = p.0[c] as f32;
                }
            }
        }
        c => return Err(DataError::Mismatch(format!("images have 1 or 3 channels, not {c}"))),
    }
    options.normalization.apply(&mut out);
    Ok(out)
}

impl Dataset {
    /// Loads `root/<class>/<image>` (PNG or JPEG by extension, case-insensitive; other files
    /// and hidden entries are skipped). Classes are the sub-folder names in sorted order and
    /// are returned next to the data; label `i` is `classes[i]`. Every image is resized to
    /// the options' size; one that does not decode is an error naming the file.
    pub fn load_image_folder(root: impl AsRef<Path>, options: &ImageFolderOptions) -> Result<(Dataset, Vec<String>), DataError> {
        let root = root.as_ref();
        if options.height == 0 || options.width == 0 || options.height * options.width > 1 << 24 {
            return Err(DataError::Mismatch(format!("image size {}x{} is out of range", options.height, options.width)));
        }
        let list = |dir: &Path| -> Result<Vec<PathBuf>, DataError> {
            let rd = std::fs::read_dir(dir).map_err(|cause| DataError::Io { path: dir.to_path_buf(), cause })?;
            let mut v = Vec::new();
            for entry in rd {
                let entry = entry.map_err(|cause| DataError::Io { path: dir.to_path_buf(), cause })?;
                if !entry.file_name().to_string_lossy().starts_with('.') {
                    v.push(entry.path());
                }
            }
            v.sort();
            Ok(v)
        };
        let classes: Vec<PathBuf> = list(root)?.into_iter().filter(|p| p.is_dir()).collect();
        if classes.len() < 2 {
            return Err(DataError::Mismatch(format!("{}: need at least 2 class folders, found {}", root.display(), classes.len())));
        }
        let mut features = Vec::new();
        let mut labels = Vec::new();
        for (label, dir) in classes.iter().enumerate() {
            for file in list(dir)? {
                let ext = file.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
                if !matches!(ext.as_deref(), Some("png" | "jpg" | "jpeg")) || !file.is_file() {
                    continue;
                }
                features.extend(load_image(&file, options)?);
                labels.push(label as u32);
            }
        }
        if labels.is_empty() {
            return Err(DataError::Empty(root.display().to_string()));
        }
        let names = classes.iter().map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()).collect();
        let data = Dataset {
            features,
            labels,
            targets: Vec::new(),
            shape: vec![options.channels, options.height, options.width],
            num_classes: classes.len(),
        };
        Ok((data, names))
    }
}
