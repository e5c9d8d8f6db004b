//! Every kernel source must have committed PTX built from exactly that source.

use sha2::{Digest, Sha256};

#[test]
fn committed_ptx_matches_its_source() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).expect("kernels/") {
        let source_path = entry.expect("entry").path();
        if source_path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let source = std::fs::read(&source_path).expect("kernel source");
        let ptx_path = source_path.with_extension("ptx");
        let ptx = std::fs::read_to_string(&ptx_path)
            .unwrap_or_else(|_| panic!("{} has no committed PTX", source_path.display()));
        let digest: String = Sha256::digest(&source)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            ptx.lines().next().unwrap_or_default(),
            format!("// source-sha256: {digest}"),
            "{} is stale: run `python3 kernels/build_ptx.py` (see its docstring)",
            ptx_path.display()
        );
        assert!(
            ptx.contains(".entry "),
            "{} defines a kernel",
            ptx_path.display()
        );
        checked += 1;
    }
    assert!(checked >= 1, "kernels/ holds the concatenation kernel");
}
