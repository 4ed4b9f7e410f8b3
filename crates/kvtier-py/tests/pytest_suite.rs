//! Runs the Python test suite (`tests/*.py`) through `scripts/python-tests.sh`, so the
//! workspace's test command covers the binding: the script creates the project-local virtual
//! environment when missing (maturin, pytest and numpy from PyPI), builds the extension into it
//! and runs pytest.

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_suite_passes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = root.join("scripts/python-tests.sh");
    let status = Command::new("bash")
        .arg(&script)
        .current_dir(&root)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(status.success(), "{} failed: {status}", script.display());
}
