//! Data directories for tests: a temporary one that removes itself, and the manifest read and
//! rewritten (with a header that matches, as a forger or a faulty tool would write it).

use std::path::{Path, PathBuf};

use serde_json::Value;

/// A fresh directory under the system's temporary one, removed when dropped.
#[derive(Debug)]
pub struct TempDataDir(PathBuf);

impl TempDataDir {
    /// A directory no other test or process uses: `test` names it, the process id tells runs
    /// apart.
    pub fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("gpu-flight-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The manifest's JSON body.
pub fn read_manifest(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("manifest.json")).expect("manifest");
    let (_, body) = text.split_once('\n').expect("a header line");
    serde_json::from_str(body).expect("a manifest")
}

/// Writes `manifest` with a header whose size and checksum match it.
pub fn write_manifest(dir: &Path, manifest: &Value) {
    let body = serde_json::to_vec(manifest).expect("json");
    write_manifest_body(dir, &body);
}

/// Writes `body`, whatever it holds, as the manifest, with a header that matches it.
pub fn write_manifest_body(dir: &Path, body: &[u8]) {
    let header = serde_json::json!({
        "format": 1,
        "bytes": body.len(),
        "crc32": crc32fast::hash(body),
    });
    let mut text = serde_json::to_vec(&header).expect("json");
    text.push(b'\n');
    text.extend_from_slice(body);
    std::fs::write(dir.join("manifest.json"), text).expect("write");
}

/// The path of segment `index` of `dataset`, as the manifest names it.
pub fn segment_path(dir: &Path, dataset: &str, index: usize) -> PathBuf {
    let manifest = read_manifest(dir);
    let file = manifest["datasets"][dataset]["segments"][index]["file"]
        .as_str()
        .expect("a segment file");
    dir.join("segments").join(file)
}
