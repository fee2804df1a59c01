use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aurora_checkpoint::{FileImages, MappedFile, write_atomically, write_delta, write_safetensors};
use aurora_delta::{
    ArtifactKind, DeltaHeader, DetachedSignature, Encoding, ExtractOptions, Extraction, Manifest,
    RunId, check_base, compose, decode, invert, key_fingerprint, owned_checkpoint,
    stats::delta_stats,
};
use clap::{Args, Subcommand, ValueEnum};

#[derive(Subcommand)]
pub enum DeltaCommand {
    /// Extract the delta that turns BASE into TARGET.
    Diff {
        base: PathBuf,
        target: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
        #[command(flatten)]
        encode: EncodeArgs,
        #[arg(long, default_value_t = 0)]
        base_version: u64,
        /// Defaults to the base version plus one.
        #[arg(long)]
        target_version: Option<u64>,
    },
    /// Apply DELTA to BASE, writing OUT, or updating BASE itself with --in-place.
    Apply {
        base: PathBuf,
        delta: PathBuf,
        #[arg(
            short,
            long,
            required_unless_present = "in_place",
            conflicts_with = "in_place"
        )]
        out: Option<PathBuf>,
        /// Patch BASE in place (memory-mapped); it is restored if the result is wrong, and
        /// an undo journal beside it restores it if the apply is interrupted.
        #[arg(long)]
        in_place: bool,
        /// BASE stores q/k/v and gate/up fused, as inference engines do (so does OUT).
        #[arg(long)]
        fused: bool,
    },
    /// Restore CHECKPOINT to its base after an in-place apply was interrupted (from the
    /// undo journal the apply left beside it).
    Recover { checkpoint: PathBuf },
    /// Show what a delta is made of, per tensor.
    Inspect {
        delta: PathBuf,
        #[arg(long)]
        json: bool,
        /// Tensors to list, largest first (0 lists all).
        #[arg(long, default_value_t = 12)]
        top: usize,
    },
    /// Check a delta's integrity; with --base also that it applies and reaches its
    /// target; with --key also that DELTA.sig is the trainer's signature of it.
    Verify {
        delta: PathBuf,
        #[arg(long)]
        base: Option<PathBuf>,
        /// The trainer's public key (PEM): DELTA.sig must be its signature of DELTA.
        #[arg(long)]
        key: Option<PathBuf>,
        /// With --key: the run DELTA.sig must be for (32 hex digits).
        #[arg(long, requires = "key")]
        run_id: Option<RunId>,
    },
    /// Sign DELTA with the trainer's key, for a run: writes the detached signature
    /// DELTA.sig (docs/delta-format.md §10).
    Sign {
        delta: PathBuf,
        /// The trainer's signing key (PKCS#8 PEM, readable by its owner alone).
        #[arg(long)]
        key: PathBuf,
        /// The run the delta belongs to (32 hex digits; `aurora store list` names a
        /// store's).
        #[arg(long)]
        run_id: RunId,
    },
    /// Compose consecutive deltas starting at BASE into one.
    Compose {
        base: PathBuf,
        #[arg(required = true)]
        deltas: Vec<PathBuf>,
        #[arg(short, long)]
        out: PathBuf,
        #[command(flatten)]
        encode: EncodeArgs,
    },
    /// Build the delta that undoes DELTA (from its target back to BASE).
    Invert {
        base: PathBuf,
        delta: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
        #[command(flatten)]
        encode: EncodeArgs,
    },
    /// Write CHECKPOINT with q/k/v and gate/up fused, as inference engines store them.
    Fuse {
        checkpoint: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
    },
}

#[derive(Args)]
pub struct EncodeArgs {
    #[arg(long, value_enum, default_value = "aurora")]
    encoding: EncodingArg,
    /// Target segment size in KiB.
    #[arg(long, default_value_t = 256)]
    segment_kib: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum EncodingArg {
    Aurora,
    Leb128,
    /// Every tensor whole: the dense-synchronisation baseline in delta form.
    Dense,
}

impl EncodeArgs {
    fn options(&self) -> ExtractOptions {
        ExtractOptions {
            encoding: match self.encoding {
                EncodingArg::Aurora => Encoding::Aurora,
                EncodingArg::Leb128 => Encoding::Leb128,
                EncodingArg::Dense => Encoding::Dense,
            },
            segment_target_bytes: self.segment_kib.max(1) << 10,
            ..ExtractOptions::default()
        }
    }
}

pub fn run(command: DeltaCommand) -> Result<()> {
    match command {
        DeltaCommand::Diff {
            base,
            target,
            out,
            encode,
            base_version,
            target_version,
        } => {
            let base_file = MappedFile::open(&base)?;
            let target_file = MappedFile::open(&target)?;
            let base_view = base_file.checkpoint()?;
            let target_view = target_file.checkpoint()?;
            let options = ExtractOptions {
                base_version,
                target_version: target_version.unwrap_or(base_version + 1),
                ..encode.options()
            };
            let started = std::time::Instant::now();
            let extraction = Extraction::new(&base_view, &target_view, options)?;
            let bar = crate::progress_bar(extraction.input_bytes(), "extracting");
            let manifest = write_delta(&out, &extraction.header().encode(), |sink| {
                extraction.run(|segment| {
                    bar.set_position(extraction.input_done());
                    sink(segment).map_err(anyhow::Error::from)
                })
            })?;
            bar.finish_and_clear();
            report_written(&out, &manifest, started)
        }
        DeltaCommand::Apply {
            base,
            delta,
            out,
            in_place,
            fused,
        } => {
            // Otherwise the delta's read lock would be reported as another process's.
            if same_file(&base, &delta) || out.as_ref().is_some_and(|o| same_file(o, &delta)) {
                bail!("{} is both the checkpoint and the delta", delta.display());
            }
            let delta_file = MappedFile::open(&delta)?;
            let parsed = delta_file.delta()?;
            let version = parsed.header().target_version;
            let spinner = crate::spinner("applying");
            let applied = if in_place {
                aurora_checkpoint::apply_in_place(&base, &parsed, fused)
            } else {
                let out = out
                    .as_ref()
                    .expect("clap requires --out without --in-place");
                aurora_checkpoint::apply_to_file(&base, &parsed, fused, out)
            };
            spinner.finish_and_clear();
            let hash = applied
                .with_context(|| format!("applying {} to {}", delta.display(), base.display()))?;
            match out {
                Some(out) => println!("{}: version {version} ({hash})", out.display()),
                None => println!("{}: now version {version} ({hash})", base.display()),
            }
            Ok(())
        }
        DeltaCommand::Recover { checkpoint } => {
            match aurora_checkpoint::recover(&checkpoint)
                .with_context(|| format!("recovering {}", checkpoint.display()))?
            {
                Some(info) => println!(
                    "{}: restored version {} ({} bytes) from the journal of delta {} (to version {})",
                    checkpoint.display(),
                    info.base_version,
                    info.restored_bytes,
                    info.delta_id,
                    info.target_version
                ),
                None => println!(
                    "{}: no interrupted apply to recover from",
                    checkpoint.display()
                ),
            }
            Ok(())
        }
        DeltaCommand::Inspect { delta, json, top } => {
            let file = MappedFile::open(&delta)?;
            let stats = delta_stats(&file.delta()?, file.bytes().len() as u64)
                .with_context(|| format!("inspecting {}", delta.display()))?;
            let text = if json {
                serde_json::to_string_pretty(&stats)? + "\n"
            } else {
                format_stats(&stats, top)?
            };
            crate::print_stdout(&text)
        }
        DeltaCommand::Sign { delta, key, run_id } => {
            let signing_key = aurora_trust::signing::load_signing_key(&key)?;
            let file = MappedFile::open(&delta)?;
            let parsed = file.delta()?;
            let kind = artifact_kind(parsed.header());
            let signature =
                DetachedSignature::sign(&signing_key, run_id, kind, parsed.id, parsed.header());
            let path = signature_path(&delta);
            write_bytes(&path, &signature.to_bytes())?;
            println!(
                "{}: {kind} signed by key {} for run {run_id} (id {})",
                path.display(),
                key_fingerprint(&signing_key.verifying_key()),
                parsed.id
            );
            Ok(())
        }
        DeltaCommand::Verify {
            delta,
            base,
            key,
            run_id,
        } => {
            let file = MappedFile::open(&delta)?;
            let parsed = file.delta()?;
            let segment_bytes = parsed
                .manifest
                .segments
                .iter()
                .map(|s| u64::from(s.len))
                .sum();
            let bar = crate::progress_bar(segment_bytes, "verifying");
            for index in 0..parsed.segment_count() {
                parsed
                    .verify_segment(index)
                    .with_context(|| format!("verifying {}", delta.display()))?;
                bar.inc(u64::from(parsed.manifest.segments[index].len));
            }
            bar.finish_and_clear();
            println!(
                "{}: intact, id {}, {} segments",
                delta.display(),
                parsed.id,
                parsed.segment_count()
            );
            if let Some(key) = key {
                let pinned = aurora_trust::signing::load_public_key(&key)?;
                let path = signature_path(&delta);
                let bytes = std::fs::read(&path).with_context(|| {
                    format!(
                        "reading the signature {} (aurora delta sign writes it)",
                        path.display()
                    )
                })?;
                let signature = DetachedSignature::parse(&bytes)
                    .with_context(|| format!("reading {}", path.display()))?;
                signature
                    .verify(&pinned, run_id.as_ref(), parsed.id, parsed.header())
                    .with_context(|| format!("checking {}", path.display()))?;
                println!(
                    "{}: signed by the trainer key {} for run {}",
                    path.display(),
                    key_fingerprint(&pinned),
                    signature.run
                );
            }
            if let Some(base) = base {
                let base_file = MappedFile::open(&base)?;
                let view = base_file.checkpoint()?;
                let spinner = crate::spinner("applying");
                let applied = check_base(parsed.header(), &view, None)
                    .with_context(|| format!("checking base {}", base.display()))
                    .and_then(|()| {
                        // Built in a mapped file: a large model is not held in memory.
                        let scratch = FileImages::new(std::env::temp_dir());
                        Ok(decode(&parsed, &view)?.materialize_image(&view, &scratch)?)
                    });
                spinner.finish_and_clear();
                applied?;
                println!(
                    "applies to {} and reproduces version {} ({})",
                    base.display(),
                    parsed.header().target_version,
                    parsed.header().target_hash
                );
            }
            Ok(())
        }
        DeltaCommand::Compose {
            base,
            deltas,
            out,
            encode,
        } => {
            let started = std::time::Instant::now();
            let base_file = MappedFile::open(&base)?;
            let files = deltas
                .iter()
                .map(MappedFile::open)
                .collect::<Result<Vec<_>, _>>()?;
            let chain = files
                .iter()
                .map(MappedFile::delta)
                .collect::<Result<Vec<_>, _>>()?;
            let spinner = crate::spinner("composing");
            let scratch = FileImages::beside(&out);
            let composed = compose(&base_file.checkpoint()?, &chain, encode.options(), &scratch);
            spinner.finish_and_clear();
            let (manifest, bytes) = composed?;
            write_bytes(&out, &bytes)?;
            report_written(&out, &manifest, started)
        }
        DeltaCommand::Invert {
            base,
            delta,
            out,
            encode,
        } => {
            let started = std::time::Instant::now();
            let base_file = MappedFile::open(&base)?;
            let delta_file = MappedFile::open(&delta)?;
            let spinner = crate::spinner("inverting");
            let inverted = invert(
                &delta_file.delta()?,
                &base_file.checkpoint()?,
                encode.options(),
                &FileImages::beside(&out),
            );
            spinner.finish_and_clear();
            let (manifest, bytes) = inverted?;
            write_bytes(&out, &bytes)?;
            report_written(&out, &manifest, started)
        }
        DeltaCommand::Fuse { checkpoint, out } => {
            let file = MappedFile::open(&checkpoint)?;
            let fused = aurora_delta::fused::fuse(&file.checkpoint()?)?;
            owned_checkpoint(&fused)?;
            write_safetensors(&out, &fused)?;
            println!("{}: {} tensors", out.display(), fused.len());
            Ok(())
        }
    }
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Where the detached signature of `artifact` lives: beside it, `.sig` appended.
fn signature_path(artifact: &Path) -> PathBuf {
    let mut name = artifact.as_os_str().to_os_string();
    name.push(".sig");
    PathBuf::from(name)
}

/// The kind an artifact's versions make it: a snapshot goes from a version to itself, a
/// delta to the next version, a composed delta further.
fn artifact_kind(header: &DeltaHeader) -> ArtifactKind {
    if header.base_version == header.target_version {
        ArtifactKind::Snapshot
    } else if header.base_version + 1 == header.target_version {
        ArtifactKind::Delta
    } else {
        ArtifactKind::Composed
    }
}

fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |w| -> Result<()> {
        std::io::Write::write_all(w, bytes).with_context(|| format!("writing {}", path.display()))
    })
}

fn report_written(path: &Path, manifest: &Manifest, started: std::time::Instant) -> Result<()> {
    let bytes = std::fs::metadata(path)
        .with_context(|| format!("reading back {}", path.display()))?
        .len();
    if bytes == 0 {
        bail!("{} is empty", path.display());
    }
    println!(
        "{}: {} bytes in {} segments, id {}, {:.2}s",
        path.display(),
        bytes,
        manifest.segments.len(),
        manifest.id(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) fn format_stats(
    stats: &aurora_delta::stats::DeltaStats,
    top: usize,
) -> Result<String, std::fmt::Error> {
    use std::fmt::Write;
    let mut out = String::new();
    let per = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    writeln!(out, "delta      {}", stats.id)?;
    writeln!(
        out,
        "versions   {} -> {}   encoding {}   {} segments",
        stats.base_version, stats.target_version, stats.encoding, stats.segments
    )?;
    writeln!(out, "base       {}", stats.base_hash)?;
    writeln!(out, "target     {}", stats.target_hash)?;
    writeln!(
        out,
        "size       {} bytes ({:.2}% of the {} bytes of dense weights)",
        stats.file_bytes,
        100.0 * stats.file_bytes as f64 / stats.target_weights_bytes.max(1) as f64,
        stats.target_weights_bytes
    )?;
    writeln!(
        out,
        "changed    {} of {} elements ({:.3}%)",
        stats.bytes.changed,
        stats.elements,
        100.0 * stats.density
    )?;
    writeln!(
        out,
        "bytes      positions {}  values {}  overhead {}  = {:.3} bytes per changed element",
        stats.bytes.positions,
        stats.bytes.values,
        stats.bytes.overhead,
        stats.bytes_per_changed.unwrap_or(0.0)
    )?;
    let mut tensors: Vec<_> = stats.tensors.iter().collect();
    tensors.sort_by_key(|t| std::cmp::Reverse(t.bytes.total()));
    let shown = if top == 0 {
        tensors.len()
    } else {
        top.min(tensors.len())
    };
    writeln!(
        out,
        "\n{:<52} {:>8} {:>6} {:>10} {:>9} {:>10} {:>10} {:>9} {:>8}  encodings",
        "tensor",
        "change",
        "dtype",
        "elements",
        "density%",
        "positions",
        "values",
        "overhead",
        "B/chg"
    )?;
    for t in &tensors[..shown] {
        let encodings: Vec<String> = t
            .encodings
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect();
        writeln!(
            out,
            "{:<52} {:>8} {:>6} {:>10} {:>9.4} {:>10} {:>10} {:>9} {:>8}  {}",
            t.name,
            t.change,
            t.dtype,
            t.elements,
            100.0 * t.density,
            t.bytes.positions,
            t.bytes.values,
            t.bytes.overhead,
            per(t.bytes_per_changed),
            encodings.join(" ")
        )?;
    }
    if shown < tensors.len() {
        writeln!(
            out,
            "... {} more (--top 0 lists all)",
            tensors.len() - shown
        )?;
    }
    Ok(out)
}
