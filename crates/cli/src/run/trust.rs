//! The run's trust material, in `<run>/trust/`: a fleet CA of its own and a certificate
//! for each node, issued as the node starts (docs/security.md §2). Every node of a run
//! talks mutual TLS on both planes: the default path is the secure one. A resumed run
//! keeps its CA and the certificates it issued.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use aurora_trust::{FleetCa, Identity, NodeFiles, Replace, Role};

/// How long a run's certificates are valid.
const VALIDITY: time::Duration = time::Duration::days(30);

fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("trust")
}

/// Creates the run's CA unless the run has one.
pub fn ensure_ca(run_dir: &Path) -> Result<()> {
    let dir = dir(run_dir);
    if dir.join(aurora_trust::certs::CA_CERT).exists() {
        return Ok(());
    }
    FleetCa::create("aurora run")?.save(&dir).with_context(|| {
        format!(
            "creating the run's certificate authority in {}",
            dir.display()
        )
    })
}

/// The flags that give a node its certificate (`--ca`, `--cert`, `--key`), issuing it
/// unless the run has it already.
pub fn node_args(run_dir: &Path, role: Role, id: &str, region: &str) -> Result<Vec<String>> {
    let dir = dir(run_dir);
    let identity = Identity::new(role, id, region)?;
    let files = NodeFiles::of(&dir, &identity);
    if !files.cert.exists() {
        FleetCa::load(&dir)?
            .issue(&identity, VALIDITY)?
            .save(&files, Replace::Never)
            .with_context(|| format!("issuing the certificate of {identity}"))?;
    }
    let path = |path: &Path| path.display().to_string();
    Ok(vec![
        "--ca".into(),
        path(&dir.join(aurora_trust::certs::CA_CERT)),
        "--cert".into(),
        path(&files.cert),
        "--key".into(),
        path(&files.key),
    ])
}
