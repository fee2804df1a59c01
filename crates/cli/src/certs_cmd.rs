//! `aurora certs`: the fleet's certificate authority and its node certificates
//! (docs/security.md §2).

use std::path::PathBuf;

use anyhow::{Context, Result};
use aurora_trust::{FleetCa, Identity, NodeFiles, Replace, Role, TrustError};
use clap::{Args, Subcommand};

/// The trainer's version-signing key in a fleet directory, and its public half.
const SIGNING_KEY: &str = "signing.key";
const SIGNING_PUBLIC_KEY: &str = "signing.pub";

#[derive(Subcommand, Debug)]
pub enum CertsCommand {
    /// Create a fleet CA: `ca.pem` (for every node) and `ca.key` (mode 0600, for whoever
    /// issues certificates) in DIR; and the trainer's version-signing key: `signing.key`
    /// (mode 0600, for the trainer: `--signing-key`) and `signing.pub` (for every relay and
    /// actor: `--trainer-key`).
    Init {
        /// The fleet's directory.
        #[arg(long)]
        dir: PathBuf,
        /// A name for the CA's certificate.
        #[arg(long, default_value = "aurora")]
        name: String,
    },
    /// Issue a node certificate carrying the node's role, id and region:
    /// `nodes/<role>-<id>.pem` and `nodes/<role>-<id>.key` (mode 0600). Existing files are
    /// never replaced unless `--overwrite` says so.
    Issue(IssueArgs),
    /// Print the identity and validity of a certificate.
    Show {
        /// A PEM certificate.
        cert: PathBuf,
    },
}

#[derive(Args, Debug)]
pub struct IssueArgs {
    /// The fleet's directory, holding `ca.pem` and `ca.key`.
    #[arg(long)]
    dir: PathBuf,
    /// trainer, relay, actor or observer.
    #[arg(long)]
    role: Role,
    /// The node's id: the id it has in the fleet (an actor's is its number in the control
    /// plane, in decimal without leading zeros). `ca` and `signing` are reserved.
    #[arg(long)]
    id: String,
    #[arg(long)]
    region: String,
    /// Days the certificate is valid.
    #[arg(long, default_value_t = 365)]
    days: i64,
    /// The fleet directory to write `nodes/<role>-<id>.pem` and `.key` into (default: the
    /// CA's directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace the node's certificate and key if they exist (a re-issue: the old key
    /// stops working once its certificate expires).
    #[arg(long)]
    overwrite: bool,
}

pub fn run(command: CertsCommand) -> Result<()> {
    match command {
        CertsCommand::Init { dir, name } => {
            // Every file is checked before any is written: an init that finds one
            // leaves the directory as it was.
            let files = [
                aurora_trust::certs::CA_CERT,
                aurora_trust::certs::CA_KEY,
                SIGNING_KEY,
                SIGNING_PUBLIC_KEY,
            ];
            if let Some(taken) = files.iter().map(|name| dir.join(name)).find(|p| p.exists()) {
                return Err(TrustError::Exists(taken).into());
            }
            FleetCa::create(&name)?.save(&dir)?;
            let public = aurora_trust::signing::create_key_pair(
                &dir.join(SIGNING_KEY),
                &dir.join(SIGNING_PUBLIC_KEY),
            )?;
            println!(
                "fleet CA and the trainer's signing key (fingerprint {}) written to {}",
                aurora_trust::signing::fingerprint(&public),
                dir.display()
            );
            Ok(())
        }
        CertsCommand::Issue(args) => {
            let identity = Identity::new(args.role, &args.id, &args.region)?;
            let ca = FleetCa::load(&args.dir)?;
            let files = NodeFiles::of(args.out.as_deref().unwrap_or(&args.dir), &identity);
            let replace = if args.overwrite {
                Replace::Allowed
            } else {
                Replace::Never
            };
            ca.issue(&identity, time::Duration::days(args.days))?
                .save(&files, replace)
                .map_err(|error| match error {
                    TrustError::Exists(path) => anyhow::anyhow!(
                        "{} exists already: {identity} has a certificate; pass --overwrite \
                         to issue it a new one",
                        path.display()
                    ),
                    other => other.into(),
                })?;
            println!(
                "issued {identity}: {} and {}",
                files.cert.display(),
                files.key.display()
            );
            Ok(())
        }
        CertsCommand::Show { cert } => {
            let der = aurora_trust::tls::read_certificates(&cert)?;
            let identity = Identity::from_certificate(&der[0])
                .map_err(TrustError::from)
                .with_context(|| format!("{}", cert.display()))?;
            println!("{identity}");
            Ok(())
        }
    }
}
