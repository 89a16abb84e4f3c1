//! The CI smoke run shared by every fuzz crate's replay test (`protocol`, `control`, the config
//! files): each committed corpus input goes through its target's harness on stable Rust,
//! without libFuzzer. `#[path]`-included by those tests.

use std::path::{Path, PathBuf};

/// The files of `<corpus>/<target>/`, sorted by name, with their bytes.
pub fn inputs(corpus: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(corpus).join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// Runs every input of every target through its harness; panics naming each input that
/// panicked (shown by `show`), or any target whose corpus is empty.
pub fn replay(corpus: &str, targets: &[(&str, fn(&[u8]))], show: fn(&[u8]) -> String) {
    let mut failed = Vec::new();
    let mut total = 0;
    for (target, harness) in targets {
        let files = inputs(corpus, target);
        assert!(!files.is_empty(), "{corpus}/{target} is empty");
        for (path, bytes) in files {
            total += 1;
            if std::panic::catch_unwind(|| harness(&bytes)).is_err() {
                failed.push(format!("{target}: {} ({})", path.display(), show(&bytes)));
            }
        }
    }
    assert!(failed.is_empty(), "{} of {total} corpus inputs panicked:\n{}", failed.len(), failed.join("\n"));
}
