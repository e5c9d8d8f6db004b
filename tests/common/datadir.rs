//! Temporary directories for tests (a data directory, or token files and certificates) that
//! remove themselves, and the manifest read and rewritten (with a header that matches, as a
//! forger or a faulty tool would write it).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

/// A fresh directory under the system's temporary one, removed when dropped, so also when the
/// test fails and unwinds. It is not created here: a store creates its data directory itself,
/// with the permissions it is tested for; `write` creates it for files a test provides.
#[derive(Debug)]
pub struct TempDataDir(PathBuf);

impl TempDataDir {
    /// A directory no other test or process uses: `test` names it, the process id tells runs
    /// apart, and a counter the calls of one run (its tests run in parallel threads).
    pub fn new(test: &str) -> Self {
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("gpu-flight-{test}-{}-{call}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `contents` to the file `name` in the directory, which is created if need be.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        std::fs::create_dir_all(&self.0).expect("create the temporary directory");
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write a temporary file");
        path
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
